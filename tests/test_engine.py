"""The speculative engine: lossless greedy output, acceptance, rollback paths,
continuous batching, stats, errors, and the distribution at T > 0."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
from helpers import GPU, assert_greedy_matches, chi2_two_sample, count_decodes, greedy_reference_margins

import llama_mtp as lm
from llama_mtp.speculative import ContextLengthError, SpeculativeEngine
from llama_mtp.speculative.engine import REPLAY_DRAFT_MAX

GREEDY = lm.SamplingParams.greedy_params()
PROMPTS = ["Multi-token prediction", "the model", "every accepted draft saves a whole decoding", "one"]


@functools.cache
def _models(path: str) -> lm.Model:
    return lm.Model(path)


@functools.cache
def reference(path: str, prompt: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
    """Plain greedy tokens and the top-two logit gaps (compare with assert_greedy_matches)."""
    return greedy_reference_margins(_models(path), list(prompt), n)


def run(engine: SpeculativeEngine, prompts: list[list[int]], lengths: list[int], **kw) -> list[list[int]]:
    ids = engine.add_many([dict(prompt=p, max_tokens=n, **kw) for p, n in zip(prompts, lengths, strict=False)])
    while engine.active:
        engine.step()
    return [engine.sequence(i).tokens for i in ids]


def pin_costs(eng: SpeculativeEngine, row: float = 0.004, draft: tuple[float, float] = (0.003, 0.0005)) -> None:
    """Pin the decode costs of a small CPU (each row costs ``row`` seconds) for
    draft_max='auto': a tiny model's decodes cost about the same for 1 or 7 rows, within
    timing noise, so the policy's choice would be a coin toss; pinned, a test is about
    acceptance. ``draft``: an MTP decode's seconds, fixed and per drafting sequence."""
    c = eng.policy.costs
    for n in {1, eng.max_sequences}:
        c.verify.calibrate(n, [(r, 0.010 + row * r) for r in range(1, n * (eng.draft_max + 1) + 1)])
    c.draft.calibrate([(1, draft[0]), (eng.max_sequences, draft[0] + draft[1] * eng.max_sequences)])
    c.verify.observe = c.draft.observe = c.catch.observe = lambda *a: None  # type: ignore[method-assign]


def never_draft(eng: SpeculativeEngine) -> None:
    """Make an MTP draft decode cost a second: drafting never pays, sequences stay idle."""
    eng.policy.costs.draft.calibrate([(1, 1.0)])
    eng.policy.costs.draft.observe = eng.policy.costs.catch.observe = lambda *a: None  # type: ignore[method-assign]


@pytest.mark.parametrize("rollback", ["snapshots", "checkpoint"])
@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("draft_max", [1, 2, 3, 5, 8, "auto"])
@pytest.mark.parametrize("name", ["random", "planted", "noisy", "shift", "trunk"])
def test_lossless_greedy(model_path, name: str, draft_max: int | str, n_seq: int, rollback: str) -> None:
    """Greedy output with MTP is token for token the output without it."""
    path = str(model_path(name))
    model = _models(path)
    prompts = [model.tokenize(t) for t in PROMPTS[:n_seq]]
    lengths = [30 + 9 * i for i in range(n_seq)]  # sequences finish at different times
    with SpeculativeEngine(model, max_sequences=n_seq, n_ctx=256, draft_max=draft_max, sampling=GREEDY,
                           rollback=rollback) as eng:  # type: ignore[arg-type]
        if draft_max == "auto":
            pin_costs(eng)  # so that auto really drafts where drafts land (and output is still checked)
        got = run(eng, prompts, lengths)
        stats = eng.stats.spec
    for p, n, g in zip(prompts, lengths, got, strict=True):
        assert_greedy_matches(g, reference(path, tuple(p), n))
    assert stats.predicted_n == sum(lengths)
    if name == "planted":
        assert stats.acceptance_rate == 1.0
    if draft_max == "auto":
        return  # the policy may stop drafting where it cannot pay: no rollbacks to count
    if name == "random":
        assert stats.acceptance_rate < 0.05 and stats.rollbacks > 0
    if rollback == "checkpoint" and name in ("random", "noisy"):
        assert stats.checkpoint_restores > 0  # the fallback path really ran
    if rollback == "snapshots":
        assert stats.checkpoint_restores == 0  # n_rs_seq snapshots covered every rollback


@pytest.mark.skipif(GPU, reason="a GPU build may offload the recurrent layers")
@pytest.mark.parametrize("n_seq", [1, 2])
def test_a_sequence_near_its_end_drafts_level_with_the_others(model_path, n_seq: int) -> None:
    """On recurrent memory llama.cpp cuts a verify whose sequences carry different row
    counts into micro-batches: a fixed-k sequence a few tokens from max_tokens drafts on
    to k where the others do, so the verify stays one pass. What lies past max_tokens is
    verified but never emitted, nor counted in the stats; alone, it drafts only what it
    can emit."""
    path = str(model_path("planted"))
    model = _models(path)
    prompts = [model.tokenize(t) for t in PROMPTS[:n_seq]]
    lengths = [10, 40][:n_seq]
    with SpeculativeEngine(model, max_sequences=n_seq, n_ctx=256, draft_max=3, sampling=GREEDY) as eng:
        asked: list[tuple[int, int, int]] = []  # (sequence, draft length asked, tokens it may still emit)
        limit: dict[int, int] = {}
        draft = eng.drafter.draft  # type: ignore[union-attr]

        def spy(reqs):  # type: ignore[no-untyped-def]
            for r in reqs:
                asked.append((r.seq, r.n_max, limit[r.seq] - len(eng.sequence(r.seq).tokens)))
            return draft(reqs)
        eng.drafter.draft = spy  # type: ignore[union-attr,method-assign]
        ids = eng.add_many([dict(prompt=p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)])
        limit.update(zip(ids, lengths, strict=True))
        while eng.active:
            eng.step()
        states = [eng.sequence(i) for i in ids]
    for p, n, st in zip(prompts, lengths, states, strict=True):
        assert_greedy_matches(st.tokens, reference(path, tuple(p), n))
    short = [(k, left) for seq, k, left in asked if seq == ids[0]]
    if n_seq == 1:
        assert all(k <= left - 1 for k, left in short)
    else:
        assert any(k == 3 and k > left - 1 for k, left in short)  # drafted past its end, level with the other
    st = states[0]
    assert st.stats.draft_n_accepted == st.stats.draft_n  # planted: every counted draft landed ...
    # ... and each was emitted: a step's drafts and its own token, after the prompt's first token
    assert 1 + st.stats.steps + st.stats.draft_n == len(st.tokens) == lengths[0]


@pytest.mark.parametrize(("draft_max", "rollback"), [(0, "snapshots"), (3, "snapshots"), (3, "checkpoint"),
                                                    ("auto", "auto")])
def test_a_finished_sequence_leaves_no_gap_in_the_slots(model_path, draft_max: int | str, rollback: str) -> None:
    """A sequence that finishes in the middle of the slots: the highest live one moves into
    its slot (with a KV stream per sequence llama.cpp cuts a batch at gaps in the ids).
    Outputs and public ids do not change; a new sequence takes the lowest free id and the
    free slot, whatever number that is."""
    path = str(model_path("noisy"))
    model = _models(path)
    prompts = [model.tokenize(t) for t in PROMPTS]
    lengths = [30, 6, 30, 26]
    with SpeculativeEngine(model, max_sequences=4, n_ctx=256, draft_max=draft_max, mtp=draft_max != 0,
                           sampling=GREEDY, rollback=rollback) as eng:  # type: ignore[arg-type]
        if draft_max == "auto":
            pin_costs(eng)
        ids = eng.add_many([dict(prompt=p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)])
        assert ids == [0, 1, 2, 3]
        events: dict[int, list[int]] = {i: [] for i in ids}
        late, short = None, None
        while eng.active:
            for ev in eng.step():
                events[ev.seq_id] += ev.tokens
            if late is None and eng.stats.slot_moves:
                assert sorted(eng._seqs) == [0, 1, 2] and eng._ids[3] == 1  # the last one moved down
                short = eng.remove(1).tokens  # (finished: its state)
                late = eng.add(prompts[1], max_tokens=12)
                assert late == 1 and eng._ids[late] == 3  # id 1 is free again; slot 3 is the free one
        assert late is not None and short is not None
        for i, p, n in zip(ids, prompts, lengths, strict=True):
            got = short if i == 1 else eng.sequence(i).tokens
            assert_greedy_matches(got, reference(path, tuple(p), n))
        assert events[3] == eng.sequence(3).tokens[1:]  # its events under its own id (the first token: at add)
        assert_greedy_matches(eng.sequence(late).tokens, reference(path, tuple(prompts[1]), 12))
        assert set(eng.results()) == {0, 1, 2, 3}


def test_a_state_that_does_not_move_is_replayed(model_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A move whose state copy fails replays the sequence from its history in its new slot."""
    path = str(model_path("noisy"))
    model = _models(path)
    prompts = [model.tokenize(t) for t in PROMPTS[:3]]
    lengths = [20, 4, 24]
    with SpeculativeEngine(model, max_sequences=3, n_ctx=256, draft_max=3, sampling=GREEDY) as eng:
        ids = eng.add_many([dict(prompt=p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)])

        refused = []

        def refuse(*a: object, **k: object) -> None:
            refused.append(a)
            raise lm.LlamaError("no room")
        monkeypatch.setattr(eng.target, "checkpoint", refuse)
        while eng.active:
            eng.step()
            if eng.stats.slot_moves:
                monkeypatch.undo()
        assert eng.stats.slot_moves >= 1 and len(refused) == 1
        for i, p, n in zip(ids, prompts, lengths, strict=True):
            assert_greedy_matches(eng.sequence(i).tokens, reference(path, tuple(p), n))


@pytest.mark.parametrize("draft_max", [1, 3])
def test_checkpoint_replays_stay_bounded(model_path, draft_max: int) -> None:
    """After a checkpoint restore the accepted tokens are replayed in the next verify. A
    checkpoint taken before it does not hold the replay, so a rejection there replays it
    again, and more: a sequence whose replay is longer than REPLAY_DRAFT_MAX drafts no
    further than its snapshots in that verify (unbounded, replays grew by a token a
    step at 0% acceptance). Output stays exact."""
    path = str(model_path("random"))
    model = _models(path)
    prompts = [model.tokenize(t) for t in PROMPTS[:3]]
    with SpeculativeEngine(model, max_sequences=3, n_ctx=256, draft_max=draft_max, sampling=GREEDY,
                           rollback="checkpoint") as eng:
        ids = eng.add_many([dict(prompt=p, max_tokens=30) for p in prompts])
        longest = 0
        while eng.active:
            eng.step()
            longest = max([longest, *(len(q.backlog) for q in eng._seqs.values())])
        got = [eng.sequence(i).tokens for i in ids]
        stats = eng.stats.spec
    assert stats.checkpoint_restores > 5 and stats.num_drafts > 5
    # a replay drafted over, plus one rejected step's accepted tokens and id_last; never more
    # (at 0% acceptance every draft is rejected: replays grow until one is too long to draft over)
    assert draft_max + 1 < longest <= REPLAY_DRAFT_MAX + draft_max + 1
    for p, g in zip(prompts, got, strict=True):
        assert_greedy_matches(g, reference(path, tuple(p), 30))


def test_rollback_auto_resolves_by_workload(model_path) -> None:
    """rollback="auto": with draft_max="auto" on a CPU-only run the engine starts with
    snapshots and can switch to checkpoints (the policy prices both: the snapshots' tax
    measured at birth, the checkpoints' save and restore too); a fixed draft length keeps
    the snapshots; an explicit mode is kept. The resolved mode is what the target uses."""
    model = _models(str(model_path("noisy")))
    for n_seq in (1, 3):
        with SpeculativeEngine(model, max_sequences=n_seq, n_ctx=128, draft_cap=3, sampling=GREEDY) as eng:
            assert eng.rollback == "snapshots" and eng.target.n_rs_seq == 3 and not eng.policy.replays
            alt = eng.policy.alt
            if GPU:  # the layers offload by default: snapshots only (tests/test_gpu.py)
                assert alt is None
                continue
            assert alt is not None and eng.policy.alt_replays
            assert alt.save > 0 and alt.restore > 0 and alt.split is not None and alt.split[2] == 0
            for n, curve in alt.verify.curves.items():  # priced like the target's, less the tax
                assert curve.points.keys() == eng.policy.costs.verify.curves[n].points.keys()
    with SpeculativeEngine(model, max_sequences=3, n_ctx=128, draft_max=3) as eng:
        assert eng.rollback == "snapshots" and eng.target.n_rs_seq == 3  # a fixed k keeps the snapshots
        assert eng.policy.alt is None
    with SpeculativeEngine(model, max_sequences=3, n_ctx=128, draft_cap=3, rollback="snapshots") as eng:
        assert eng.rollback == "snapshots" and eng.target.n_rs_seq == 3 and not eng.policy.replays
        assert eng.policy.alt is None
    with SpeculativeEngine(model, max_sequences=3, n_ctx=128, draft_cap=3, rollback="checkpoint") as eng:
        assert eng.target.n_rs_seq == 0 and eng.policy.replays and eng.policy.alt is None
        assert eng.policy.costs.save > 0 and eng.policy.costs.restore > 0
    with SpeculativeEngine(model, max_sequences=1, n_ctx=128, draft_max=2, rollback="checkpoint") as eng:
        assert eng.target.n_rs_seq == 0 and eng.policy.replays
    with pytest.raises(ValueError, match="rollback"):
        SpeculativeEngine(model, rollback="replay")  # type: ignore[arg-type]


def pin_both(eng: SpeculativeEngine) -> None:
    """pin_costs() for both rollback modes (the alternative's verify 5% cheaper: no snapshots)."""
    pin_costs(eng)
    alt = eng.policy.alt
    if alt is not None:
        for n, curve in eng.policy.costs.verify.curves.items():
            alt.verify.calibrate(n, [(r, v / 1.05) for r, v in curve.points.items()])
        alt.verify.observe = lambda *a: None  # type: ignore[method-assign]


@pytest.mark.skipif(GPU, reason="offloaded layers keep the snapshots (no switching)")
@pytest.mark.parametrize("n_seq", [1, 3])
@pytest.mark.parametrize("name", ["random", "noisy", "shift", "planted"])
def test_switching_rollback_modes_is_lossless(model_path, name: str, n_seq: int) -> None:
    """The target context is swapped for one with the other rollback mode every few steps
    (every sequence's state copied across, a pending snapshot rollback or a checkpoint
    replay in flight included): greedy output is still token for token plain decoding,
    and both modes really ran drafts and rollbacks."""
    path = str(model_path(name))
    model = _models(path)
    prompts = [model.tokenize(t) for t in PROMPTS[:n_seq]]
    lengths = [40 + 9 * i for i in range(n_seq)]
    # where drafts are rejected, a fixed length drafts anyway (auto would stop): rollbacks in both modes
    spec = lm.SpecParams(draft_max=3) if name in ("random", "noisy") else None
    with SpeculativeEngine(model, max_sequences=n_seq, n_ctx=256, sampling=GREEDY) as eng:
        pin_both(eng)
        ids = eng.add_many([dict(prompt=p, max_tokens=n, spec=spec) for p, n in zip(prompts, lengths, strict=True)])
        replays = []
        real_prefill = eng._prefill
        eng._prefill = lambda seqs, sample_first: (replays.append(seqs), real_prefill(seqs, sample_first))[1]
        modes, t = Counter(), 0
        targets = {id(eng.target): eng.target}
        while eng.active:
            t += 1
            if t % 3 == 0:
                eng.policy.switch_wanted = True  # what the comparison of modes would ask
            eng.step()
            modes[eng.rollback, eng.target.n_rs_seq] += 1
            targets[id(eng.target)] = eng.target
        got = [eng.sequence(i).tokens for i in ids]
        stats = eng.stats
        # two contexts, swapped back and forth (the one left is kept, emptied, for the way back)
        assert len(targets) == 2 and eng._spare is not None and eng._spare is not eng.target
    assert all(c.closed for c in targets.values())  # the engine closed both
    for p, n, g in zip(prompts, lengths, got, strict=True):
        assert_greedy_matches(g, reference(path, tuple(p), n))
    assert set(modes) == {("snapshots", eng.draft_max), ("checkpoint", 0)}
    assert replays == []  # every state arrived whole: none was replayed from its history
    assert stats.rollback_switches >= t // 3 - 1 and stats.switch_s > 0
    if name in ("random", "noisy"):
        assert stats.spec.rollbacks > stats.spec.checkpoint_restores > 0  # both ways of undoing a draft ran


@pytest.mark.skipif(GPU, reason="offloaded layers keep the snapshots (no switching)")
def test_rollback_mode_follows_the_text(model_path) -> None:
    """Left to itself: on text the drafter never gets right the engine leaves the snapshots
    (they only cost), on text it always gets right it keeps them and drafts."""
    for name, want in (("random", "checkpoint"), ("planted", "snapshots")):
        model = _models(str(model_path(name)))
        with SpeculativeEngine(model, max_sequences=2, n_ctx=256, sampling=GREEDY) as eng:
            pin_both(eng)
            run(eng, [model.tokenize(t) for t in PROMPTS[:2]], [60, 60])
            assert eng.rollback == want, name
            assert eng.stats.rollback_switches == (1 if want == "checkpoint" else 0)


@pytest.mark.skipif(GPU, reason="offloaded layers keep the snapshots (no switching)")
@pytest.mark.parametrize("fail", ["context", "copy"])
def test_a_switch_that_fails_leaves_the_engine_as_it_was(model_path, monkeypatch, fail: str) -> None:
    """No room for the new context, or a state that does not copy: the engine stays on
    the context it has, stops switching, and the output is still exact."""
    import llama_mtp.speculative.engine as engine_mod
    from llama_mtp.errors import LlamaError

    path = str(model_path("noisy"))
    model = _models(path)
    prompts = [model.tokenize(t) for t in PROMPTS[:2]]
    if fail == "context":  # room for the target, not for a second context (made at birth, to calibrate)
        real_context = engine_mod.Context

        def no_room(model, params=None):
            if params is not None and params.n_rs_seq == 0:
                raise LlamaError("failed to allocate the KV cache")
            return real_context(model, params)
        monkeypatch.setattr(engine_mod, "Context", no_room)
    with SpeculativeEngine(model, max_sequences=2, n_ctx=256, sampling=GREEDY) as eng:
        pin_both(eng)
        before = eng.target
        if fail == "context":
            assert eng._spare is None and eng.policy.alt is None  # switching is off from the start
        else:
            real = lm.Context.restore

            def broken(self, ckpt, seq=None):
                if self is not before and not ckpt.partial:
                    raise LlamaError("could not restore the checkpoint")
                return real(self, ckpt, seq)
            monkeypatch.setattr(lm.Context, "restore", broken)
        ids = eng.add_many([dict(prompt=p, max_tokens=40) for p in prompts])
        eng.step()
        eng.policy.switch_wanted = fail == "copy"  # (with no second context the policy cannot ask)
        while eng.active:
            eng.step()
        assert eng.target is before and not before.closed and eng.rollback == "snapshots"
        assert eng.policy.alt is None and not eng.policy.switch_wanted and eng.stats.rollback_switches == 0
        for p, i in zip(prompts, ids, strict=True):
            assert_greedy_matches(eng.sequence(i).tokens, reference(path, tuple(p), 40))


def test_prompt_longer_than_n_batch(model_path) -> None:
    path = str(model_path("trunk"))
    model = _models(path)
    prompt = model.tokenize(" ".join(PROMPTS * 6))
    assert len(prompt) > 40
    with SpeculativeEngine(model, n_ctx=512, n_batch=16, draft_max=3, sampling=GREEDY) as eng:
        got = run(eng, [prompt], [24])
    assert_greedy_matches(got[0], reference(path, tuple(prompt), 24))


def test_acceptance_counts_are_consistent(model_path) -> None:
    model = _models(str(model_path("noisy")))
    with SpeculativeEngine(model, max_sequences=2, n_ctx=256, draft_max=4, sampling=GREEDY) as eng:
        run(eng, [model.tokenize(PROMPTS[0]), model.tokenize(PROMPTS[1])], [60, 50])
        s = eng.stats.spec
    assert 0.05 < s.acceptance_rate < 0.95
    assert sum(s.accepted_per_position) == s.draft_n_accepted
    assert sum(s.drafted_per_position) == s.draft_n
    assert s.drafted_per_position[0] == s.num_drafts
    # acceptance at position i+1 implies acceptance at position i
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:], strict=False))
    assert s.mean_accepted_length == pytest.approx(1 + s.draft_n_accepted / s.steps)
    assert s.predicted_n == 110
    d = s.as_dict()
    for key in ("draft_n", "draft_n_accepted", "acceptance_rate", "mean_accepted_length", "accepted_per_position", "steps"):
        assert key in d
    assert d["by_drafter"]["mtp"]["drafted"] == s.draft_n
    t = eng.stats
    assert t.verify_s > 0 and t.draft_s > 0 and t.step_s >= t.verify_s + t.draft_s
    assert 0 <= t.python_share < 1


def test_whether_a_draft_paid_is_judged_for_the_whole_step(model_path) -> None:
    """Each step that drafts asks the policy once, with the step's draft lengths and
    accepted tokens (DraftPolicy.paid_step), and each drafting sequence's acceptance
    estimate takes its verdict: the one that spaces out its probes."""
    model = _models(str(model_path("noisy")))
    with SpeculativeEngine(model, max_sequences=4, n_ctx=256, draft_max="auto", sampling=GREEDY) as eng:
        pin_costs(eng, row=0.001, draft=(0.001, 0.00005))  # rows neither free nor dear: some steps' drafts pay, some do not
        calls: list[tuple[list[int], list[int], list[int], list[bool]]] = []
        judge = eng.policy.paid_step

        def paid_step(ks, accepted, ids=None):
            got = judge(ks, accepted, ids)
            calls.append((list(ks), list(accepted), list(ids), got))
            return got

        eng.policy.paid_step = paid_step  # type: ignore[method-assign]
        ids = eng.add_many([dict(prompt=model.tokenize(p), max_tokens=40) for p in PROMPTS])
        checked = 0
        while eng.active:
            n = len(calls)
            eng.step()
            assert len(calls) <= n + 1
            if len(calls) > n:  # a drafting step: each drafting sequence holds the step's verdict
                ks, _, slots, got = calls[-1]
                for k, slot, verdict in zip(ks, slots, got, strict=True):
                    q = eng._seqs.get(slot)
                    if k > 0 and q is not None:
                        assert q.acc.paid_last == verdict
                        checked += 1
        out = [eng.sequence(i).tokens for i in ids]
    assert checked > 5
    verdicts = [[g for k, g in zip(ks, got, strict=True) if k] for ks, _, _, got in calls]
    assert any(all(v) for v in verdicts if v) and any(not any(v) for v in verdicts if v)  # steps paid, and did not
    # ... and some draft that landed was judged not to have paid: the verdict is not just "something landed"
    assert any(k and a and not g for ks, acc, _, got in calls for k, a, g in zip(ks, acc, got, strict=True))
    for p, toks in zip(PROMPTS, out, strict=True):
        assert_greedy_matches(toks, reference(str(model_path("noisy")), tuple(model.tokenize(p)), 40))


@pytest.mark.skipif(GPU, reason="a GPU build may offload the recurrent layers")
def test_replays_are_levelled_by_the_drafts(model_path) -> None:
    """Without snapshots a rejection's accepted tokens are replayed in the next verify.
    Where several sequences replay, the policy's search tries a common row count (each
    replaying sequence drafts as many fewer tokens as it replays), so the verify is one
    pass over the weights on recurrent memory: the engine verifies such steps as chosen,
    and stays lossless. (tests/test_policy.py has the search that misses them without it.)"""
    path = str(model_path("noisy"))
    model = _models(path)
    with SpeculativeEngine(model, max_sequences=4, n_ctx=256, draft_max="auto", sampling=GREEDY,
                           rollback="checkpoint") as eng:
        pin_costs(eng, row=0.0005)  # a pass dear against a row: uneven verifies cost a pass each
        c = eng.policy.costs
        c.save = c.restore = 0.0002
        c.observe_save = c.observe_restore = c.observe_overhead = lambda *a: None  # type: ignore[method-assign]
        levelled = 0
        choose = eng.policy.choose

        def watch(cands):  # type: ignore[no-untyped-def]
            nonlocal levelled
            ks = choose(cands)
            rows = [1 + ks[s] + cands[s].backlog for s in cands]
            if sum(1 for s in cands if cands[s].backlog) >= 2 and any(ks.values()) and len(c.passes(rows, list(cands))) == 1:
                levelled += 1
            return ks

        eng.policy.choose = watch  # type: ignore[method-assign]
        ids = eng.add_many([dict(prompt=model.tokenize(p), max_tokens=40) for p in PROMPTS])
        while eng.active:
            eng.step()
        out = [eng.sequence(i).tokens for i in ids]
        restores = eng.stats.spec.checkpoint_restores
    assert levelled > 0 and restores > 5, (levelled, restores)
    for p, toks in zip(PROMPTS, out, strict=True):
        assert_greedy_matches(toks, reference(path, tuple(model.tokenize(p)), 40))


@pytest.mark.parametrize("draft_max", [1, 3])
def test_acceptance_follows_the_planted_model(model_path, draft_max: int) -> None:
    """A model whose MTP head is blind on part of its sentence (acceptance ~1, then 0,
    then ~1 again) is drafted as the numpy prediction of the writer says."""
    from llama_mtp.tiny import TinySpec, predicted_acceptance

    predicted = predicted_acceptance(TinySpec(mtp_blind=(8, 20)), draft_max)
    assert 0.2 < predicted < 0.8
    model = _models(str(model_path("shift")))
    with SpeculativeEngine(model, n_ctx=512, draft_max=draft_max, sampling=GREEDY) as eng:
        run(eng, [model.tokenize(PROMPTS[0])], [26 * 8])
        s = eng.stats.spec
    assert s.acceptance_rate == pytest.approx(predicted, abs=0.08)


def test_join_midflight_and_remove(model_path) -> None:
    path = str(model_path("trunk"))
    model = _models(path)
    a_prompt, b_prompt, c_prompt = (model.tokenize(t) for t in PROMPTS[:3])
    with SpeculativeEngine(model, max_sequences=3, n_ctx=256, draft_max=3, sampling=GREEDY) as eng:
        a = eng.add(a_prompt, max_tokens=40)
        b = eng.add(b_prompt, max_tokens=200)
        for _ in range(3):
            eng.step()
        c = eng.add(c_prompt, max_tokens=30)  # joins mid-flight
        for _ in range(2):
            eng.step()
        state = eng.remove(b)  # leaves mid-flight
        assert state.finish_reason == "removed"
        assert eng.target.memory.pos_max(b) == -1
        assert eng.drafter is not None and eng.drafter.ctx.memory.pos_max(b) == -1
        while eng.active:
            eng.step()
        assert_greedy_matches(eng.sequence(a).tokens, reference(path, tuple(a_prompt), 40))
        assert_greedy_matches(eng.sequence(c).tokens, reference(path, tuple(c_prompt), 30))
        assert eng.sequence(a).finish_reason == "length"
        got_b = eng.sequence(b).tokens
        assert_greedy_matches(got_b, reference(path, tuple(b_prompt), len(got_b)))
        # finished sequences free their memory in both contexts
        for s in (a, c):
            assert eng.target.memory.pos_max(s) == -1 and eng.drafter.ctx.memory.pos_max(s) == -1
        assert eng.free_slots == 3
        # and the slots are reusable
        d = eng.add(a_prompt, max_tokens=10)
        while eng.active:
            eng.step()
        assert_greedy_matches(eng.sequence(d).tokens, reference(path, tuple(a_prompt), 10))


def test_context_end_finishes_with_length(model_path) -> None:
    path = str(model_path("planted"))
    model = _models(path)
    with SpeculativeEngine(model, max_sequences=2, n_ctx=8, draft_max=8, sampling=GREEDY) as eng:
        n_ctx = eng.n_ctx_seq  # llama.cpp pads to 256
        long_prompt = [300 + (i % 100) for i in range(n_ctx - 10)]
        a = eng.add(long_prompt, max_tokens=1000)
        b = eng.add(model.tokenize(PROMPTS[0]), max_tokens=30)
        while eng.active:
            eng.step()
        sa, sb = eng.sequence(a), eng.sequence(b)
    assert sa.finish_reason == "length"
    assert len(long_prompt) + len(sa.tokens) == n_ctx + 1  # the last token is emitted, never decoded
    assert_greedy_matches(sa.tokens, reference(path, tuple(long_prompt), len(sa.tokens)))
    assert sb.finish_reason == "length" and len(sb.tokens) == 30
    with SpeculativeEngine(model, n_ctx=8, sampling=GREEDY) as eng:
        with pytest.raises(ContextLengthError):
            eng.add([300] * eng.n_ctx_seq, max_tokens=4)


def test_no_mtp_head(model_path) -> None:
    path = str(model_path("nomtp"))
    model = _models(path)
    with pytest.raises(lm.MTPUnavailableError, match="mtp=False"):
        SpeculativeEngine(model, sampling=GREEDY)
    prompt = model.tokenize(PROMPTS[0])
    with SpeculativeEngine(model, mtp=False, n_ctx=256, sampling=GREEDY) as eng:  # plain decoding still works
        got = run(eng, [prompt], [20])
        assert eng.stats.spec.draft_n == 0
    assert_greedy_matches(got[0], reference(path, tuple(prompt), 20))


def test_ngram_with_mtp(model_path) -> None:
    """Prompt lookup proposes long drafts (beyond n_rs_seq: checkpoint path), MTP fills in."""
    path = str(model_path("trunk"))
    model = _models(path)
    prompt = model.tokenize(" ".join(PROMPTS))
    spec = lm.SpecParams(draft_max=3, ngram=True, ngram_max=8)
    with SpeculativeEngine(model, n_ctx=512, draft_max=3, sampling=GREEDY, spec=spec) as eng:
        got = run(eng, [prompt], [120])
        s = eng.stats.spec
    assert_greedy_matches(got[0], reference(path, tuple(prompt), 120))
    assert s.by_drafter["ngram"][0] > 0 and s.by_drafter["ngram"][1] > 0
    assert s.by_drafter["mtp"][0] > 0
    assert max(s.draft_length_hist) > 3  # ngram drafts longer than draft_max


def test_stop_conditions(model_path) -> None:
    model = _models(str(model_path("planted")))
    prompt = model.tokenize("Multi-token prediction")
    ref = reference(str(model_path("planted")), tuple(prompt), 40)[0]
    with SpeculativeEngine(model, max_sequences=3, n_ctx=256, draft_max=4, sampling=GREEDY) as eng:
        a = eng.add(prompt, max_tokens=40, stop=["the model"])
        b = eng.add(prompt, max_tokens=40, stop_tokens=[ref[5]])
        c = eng.add(prompt, max_tokens=7)
        while eng.active:
            eng.step()
        sa, sb, sc = eng.sequence(a), eng.sequence(b), eng.sequence(c)
    assert sa.finish_reason == "stop" and sa.stop_hit == "the model"
    assert b"the model" not in sa.text and sa.text.strip().endswith(b"ahead;")
    assert sb.finish_reason == "stop" and sb.tokens == ref[:6]
    assert sc.finish_reason == "length" and sc.tokens == ref[:7]


def test_bad_requests(model_path) -> None:
    model = _models(str(model_path("planted")))
    with SpeculativeEngine(model, max_sequences=1, n_ctx=64, sampling=GREEDY) as eng:
        for bad in (dict(prompt=[]), dict(prompt=[-1]), dict(prompt=[model.n_vocab]), dict(prompt="x", max_tokens=0),
                    dict(prompt="x", seq_id=5)):
            with pytest.raises((ValueError, lm.LlamaError)):
                eng.add(**bad)  # type: ignore[arg-type]
        eng.add("Multi-token", max_tokens=50)
        with pytest.raises(lm.LlamaError, match="no free sequence slot"):
            eng.add("one", max_tokens=4)
    with pytest.raises(lm.ClosedError):
        eng.step()
    for bad in (dict(max_sequences=0), dict(draft_max=-1), dict(n_ctx=2), dict(draft_max=8, max_sequences=64, n_batch=64)):
        with pytest.raises(ValueError):
            SpeculativeEngine(model, **bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- sampling at T > 0

def sample_runs(model: lm.Model, seeds: range, mtp: bool, verify: str = "match", n: int = 3) -> list[tuple[int, ...]]:
    sp = lambda s: lm.SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, seed=s)  # noqa: E731
    spec = lm.SpecParams(draft_max=3, verify=verify)  # type: ignore[arg-type]
    prompt = model.tokenize("Multi-token prediction drafts")
    out = []
    with SpeculativeEngine(model, max_sequences=8, n_ctx=64, draft_max=3, mtp=mtp, spec=spec) as eng:
        seeds = list(seeds)
        for i in range(0, len(seeds), 8):
            ids = eng.add_many([dict(prompt=prompt, max_tokens=n, sampling=sp(s)) for s in seeds[i:i + 8]])
            while eng.active:
                eng.step()
            out += [tuple(eng.sequence(j).tokens) for j in ids]
    return out


def test_seeded_sampling_is_deterministic(soft_model: lm.Model) -> None:
    a = sample_runs(soft_model, range(40), mtp=True)
    b = sample_runs(soft_model, range(40), mtp=True)
    assert a == b
    assert len(set(a)) > 5  # and actually random across seeds


def test_sample_and_match_follows_the_target_distribution(soft_model: lm.Model) -> None:
    """Same seeds: one draw per emitted token, so MTP on/off agree run by run (up to
    float rounding between batched and single-row logits); independent seeds: the
    first-token and bigram frequencies pass a chi-square test."""
    on = sample_runs(soft_model, range(200), mtp=True)
    off = sample_runs(soft_model, range(200), mtp=False)
    same = sum(x == y for x, y in zip(on, off, strict=True)) / len(on)
    assert same > 0.95
    on = sample_runs(soft_model, range(1000, 2600), mtp=True)
    off = sample_runs(soft_model, range(5000, 6600), mtp=False)
    for key in (lambda t: t[0], lambda t: t[:2]):
        _, dof, p = chi2_two_sample(Counter(map(key, on)), Counter(map(key, off)))
        assert dof >= 2 and p > 0.01, (dof, p)


def test_auto_adapts_to_the_model(model_path) -> None:
    """draft_max='auto' on real decodes: all but stops drafting (and later sequences start
    that way) where nothing is accepted; drafts long where everything is."""
    from llama_mtp.speculative.engine import AUTO_DRAFT_CAP

    with SpeculativeEngine(_models(str(model_path("random"))), n_ctx=256, sampling=GREEDY) as eng:
        assert eng.draft_max == AUTO_DRAFT_CAP and eng.target.n_rs_seq == AUTO_DRAFT_CAP
        pin_both(eng)  # both rollback modes: the one it switches to must not be priced by real timings
        hists = []
        for _ in range(2):
            i = eng.add(PROMPTS[0], max_tokens=120, ignore_eos=True)
            while eng.active:
                eng.step()
            hists.append(eng.sequence(i).stats.draft_length_hist)
        first, second = hists
        assert first.get(0, 0) >= 0.8 * sum(first.values()), first
        assert sum(v for k, v in second.items() if k > 0) <= 4, second  # a few probes, no relearning
    with SpeculativeEngine(_models(str(model_path("planted"))), n_ctx=256, sampling=GREEDY) as eng:
        pin_both(eng)
        i = eng.add(PROMPTS[0], max_tokens=80, ignore_eos=True)
        while eng.active:
            eng.step()
        st = eng.sequence(i).stats
        assert st.acceptance_rate == 1.0 and st.draft_n / st.num_drafts >= 4, st.draft_length_hist


def test_first_draft_decode_is_priced_apart(model_path) -> None:
    """A drafting step's first MTP decode (which carries the catch-up rows) is timed on
    its own, with its rows: what it took beyond a pure draft decode is the catch-up rows'
    price; the pure draft decodes after it are timed by their outputs. The policy is
    told each sequence's queued rows."""
    with SpeculativeEngine(_models(str(model_path("planted"))), max_sequences=2, n_ctx=256, draft_max=3,
                           sampling=GREEDY) as eng:
        assert eng.drafter is not None
        ids = eng.add_many([dict(prompt=p, max_tokens=24, ignore_eos=True) for p in PROMPTS[:2]])
        seen: list[dict[int, int]] = []
        real_choose = eng.policy.choose
        eng.policy.choose = lambda cands: (seen.append({s: c.pending for s, c in cands.items()}),  # type: ignore[method-assign]
                                           real_choose(cands))[1]
        learnt: list[tuple[int, float]] = []
        real_observe = eng.policy.costs.catch.observe
        eng.policy.costs.catch.observe = lambda rows, s: (learnt.append((rows, s)), real_observe(rows, s))[1]  # type: ignore[method-assign]
        eng.step()
        n, rows, secs = eng.drafter.first_timing  # type: ignore[misc]
        assert n == 2 and secs > 0
        assert [r for r, _ in eng.drafter.last_timings] == [2, 2]  # k=3: two more decodes
        pending = {s: eng.drafter.pending(s) for s in range(2)}
        assert sum(pending.values()) > 0  # the verify's accepted rows, queued for the next first decode
        eng.step()
        assert seen[-1] == pending  # the policy saw the rows the next first decode carries
        n, rows, secs = eng.drafter.first_timing  # type: ignore[misc]
        assert rows >= n + sum(pending.values())  # (levelled rows may come on top)
        assert learnt and learnt[-1][0] == rows - n
        while eng.active:
            eng.step()
        assert eng.policy.costs.catch.rows > 0
        assert all(eng.sequence(i).stats.acceptance_rate == 1.0 for i in ids)


@pytest.mark.parametrize("name", ["planted", "random"])
def test_shadow_evidence_of_idle_sequences(model_path, name: str) -> None:
    """A sequence that is not drafting still gets acceptance evidence: the MTP head's
    guesses on its catch-up rows, checked against what the target emitted."""
    with SpeculativeEngine(_models(str(model_path(name))), n_ctx=256, sampling=GREEDY) as eng:
        never_draft(eng)
        seen: list[bool] = []
        evidence = eng._shadow_evidence

        def spy() -> None:
            assert eng.drafter is not None
            for seq, pos, guess in eng.drafter.shadow_predictions:
                seen.append(guess == eng._seqs[seq].history[pos + 1])
            evidence()

        eng._shadow_evidence = spy  # type: ignore[method-assign]
        i = eng.add(PROMPTS[0], max_tokens=120, ignore_eos=True)
        q = eng._seqs[i]
        while eng.active:
            eng.step()
            if q.state.finished:
                break
            alpha = q.acc.alpha(0) if q.acc is not None else None
        assert len(seen) >= 4
        if name == "planted":
            assert all(seen) and alpha is not None and alpha > 0.75
        else:
            # misses only: pulled well below the prior (0.7), which faded evidence returns to
            assert sum(seen) <= len(seen) // 4 and alpha is not None and alpha < 0.5


def test_idle_sequences_skip_catch_up(model_path) -> None:
    """A sequence that stopped drafting feeds the MTP context only the rows before each
    shadow guess (its MTP memory keeps a gap); output is still plain greedy decoding."""
    from llama_mtp.speculative.engine import CATCH_UP_QUEUE, SKIP_IDLE, SKIP_KEEP

    path = str(model_path("random"))
    model = _models(path)
    assert model.positions_may_jump  # qwen35: IMROPE
    prompt = model.tokenize(PROMPTS[0])
    n = 150
    with SpeculativeEngine(model, n_ctx=256, sampling=GREEDY) as eng:
        never_draft(eng)
        i = eng.add(prompt, max_tokens=n, ignore_eos=True)
        last_pos = -1
        while eng.active:
            eng.step()
            if eng.active:
                assert eng.drafter is not None
                last_pos = eng.drafter.ctx.memory.pos_max(i)
        got = eng.sequence(i).tokens
        assert eng.drafter is not None
        # once idle, of every CATCH_UP_QUEUE rows all but SKIP_KEEP are dropped
        assert eng.drafter.skipped >= (n - SKIP_IDLE - 2 * CATCH_UP_QUEUE) * (CATCH_UP_QUEUE - SKIP_KEEP) // CATCH_UP_QUEUE
        # and the MTP memory still reaches recent positions, past the gaps
        assert last_pos >= len(prompt) + n - 2 * CATCH_UP_QUEUE
    assert_greedy_matches(got, reference(path, tuple(prompt), n))


def test_a_probe_of_long_idle_sequences_carries_few_catch_up_rows(model_path) -> None:
    """Sequences idle for SKIP_IDLE steps queue only their last SKIP_KEEP rows, so the first
    draft decode of a probe -- which carries every queued row, of every sequence -- stays
    small; their shadow guesses still come every CATCH_UP_QUEUE positions. Output is plain
    greedy decoding."""
    from llama_mtp.speculative.engine import CATCH_UP_QUEUE, SKIP_IDLE, SKIP_KEEP

    path = str(model_path("random"))
    model = _models(path)
    prompts = [model.tokenize(p) for p in PROMPTS[:2]]
    probe_at = SKIP_IDLE + 20  # idle long enough to skip, not yet flushed
    n = probe_at + CATCH_UP_QUEUE + 16
    with SpeculativeEngine(model, n_ctx=256, sampling=GREEDY, max_sequences=2) as eng:
        assert eng.drafter is not None and eng.drafter.can_skip
        steps = [0]

        def choose(cands, steps=steps):  # the first sequence probes once; nothing else drafts
            steps[0] += 1
            return {s: (1 if steps[0] == probe_at and s == ids[0] else 0) for s in cands}

        eng.policy.choose = choose  # type: ignore[method-assign]
        rows: list[int] = []
        real_decode = eng.drafter.ctx.decode

        def decode(batch):
            rows.append(batch.n_tokens)
            return real_decode(batch)

        eng.drafter.ctx.decode = decode  # type: ignore[method-assign]
        flushes = _record_flushes(eng)
        ids = [eng.add(p, max_tokens=n, ignore_eos=True) for p in prompts]
        probe = []
        while eng.active:
            before = len(rows)
            spans = [eng.drafter.span(i) for i in ids]
            eng.step()
            if steps[0] == probe_at:
                probe = rows[before:]
                assert max(spans) > CATCH_UP_QUEUE // 2  # far from its last decode ...
        got = [eng.sequence(i).tokens for i in ids]
    # ... yet the probe's first decode carried SKIP_KEEP rows a sequence and the start row
    assert probe and probe[0] <= 2 * SKIP_KEEP + 1
    assert len(flushes) >= 1  # the shadow guesses still came
    for p, g in zip(prompts, got, strict=True):
        assert_greedy_matches(g, reference(path, tuple(p), n))


@pytest.mark.parametrize("eager,ratio", [(True, 1.0), (True, 0.5), (False, 1.0)])
@pytest.mark.parametrize("n_seq", [1, 2])
def test_recently_idle_sequences_catch_up_every_step(model_path, eager: bool, ratio: float, n_seq: int) -> None:
    """A sequence that drafted a few steps ago, and whose drafts would pay once under way,
    feeds the MTP context after every idle step (so resuming carries no backlog), all
    such sequences in one flush; one whose drafts would not pay, or that has idled for
    EAGER_IDLE steps (or with ``eager_idle = 0``), queues its rows. Output is plain
    greedy decoding."""
    from llama_mtp.speculative.engine import CATCH_UP_QUEUE, EAGER_IDLE, EAGER_RATIO, SKIP_IDLE, SKIP_KEEP

    path = str(model_path("planted"))
    model = _models(path)
    prompts = [model.tokenize(p) for p in PROMPTS[:n_seq]]
    n = EAGER_IDLE + 12
    with SpeculativeEngine(model, n_ctx=256, sampling=GREEDY, max_sequences=n_seq) as eng:
        assert eng.eager_idle == EAGER_IDLE
        if not eager:
            eng.eager_idle = 0
        steps = [0]

        def choose(cands, steps=steps):  # draft 2 tokens on the first two steps, then never
            steps[0] += 1
            return {s: (min(2, c[0]) if steps[0] <= 2 else 0) for s, c in cands.items()}

        priced: list[int] = []

        def steady_ratios(accs, cap, others=0):
            priced.append(len(accs))
            assert others == n_seq - 1  # priced next to the step's other sequences
            return [ratio] * len(accs)

        eng.policy.choose = choose  # type: ignore[method-assign]
        eng.policy.steady_ratios = steady_ratios  # type: ignore[method-assign]
        flushes = _record_flushes(eng)
        ids = [eng.add(p, max_tokens=n, ignore_eos=True) for p in prompts]
        pending: list[list[tuple[int, int]]] = []
        while eng.active:
            flushes.clear()
            eng.step()
            if eng.active:
                pending.append([(eng.sequence(i).stats.num_drafts, eng.drafter.pending(i)) for i in ids])
                if eager and ratio >= EAGER_RATIO and 3 <= len(pending) <= EAGER_IDLE:
                    assert flushes == [ids]  # every recent one, in one flush
        got = [eng.sequence(i).tokens for i in ids]
    assert all(p[0] == 2 for p in pending[1])  # they drafted
    assert bool(priced) == eager
    for j in range(n_seq):
        idle = [row[j][1] for row in pending[2:]]
        if eager and ratio >= EAGER_RATIO:
            # caught up after every idle step while it is recent, queueing after EAGER_IDLE of them
            assert idle[: EAGER_IDLE - 1] == [0] * (EAGER_IDLE - 1)
            assert idle[-1] == len(idle) - (EAGER_IDLE - 1) <= CATCH_UP_QUEUE
        else:
            # queued, as before: the last draft's accepted rows, one more each idle step --
            # until SKIP_IDLE idle steps, when it keeps only its last SKIP_KEEP rows
            assert idle[0] >= 1 and len(idle) > SKIP_IDLE
            assert idle == [idle[0] + i if i + 1 < SKIP_IDLE else min(idle[0] + i, SKIP_KEEP)
                            for i in range(len(idle))]
    for p, g in zip(prompts, got, strict=True):
        assert_greedy_matches(g, reference(path, tuple(p), n))


def _record_flushes(eng: SpeculativeEngine) -> list[list[int]]:
    """The sequences of each catch-up-only MTP flush the engine makes from now on."""
    assert eng.drafter is not None
    flushes: list[list[int]] = []
    real_flush = eng.drafter.flush

    def flush(seqs=None, shadow=0):
        flushes.append(list(seqs or []))
        return real_flush(seqs, shadow)

    eng.drafter.flush = flush  # type: ignore[method-assign]
    return flushes


def test_idle_rows_ride_along_while_another_sequence_drafts(model_path) -> None:
    """While one sequence drafts, another that stopped drafting a step ago does not flush
    its catch-up row after every step: the drafting one's first MTP decode carries it,
    so its queue stays one row long without a decode of its own."""
    path = str(model_path("planted"))
    model = _models(path)
    prompts = [model.tokenize(p) for p in PROMPTS[:2]]
    n = 20
    with SpeculativeEngine(model, n_ctx=256, sampling=GREEDY, max_sequences=2) as eng:
        steps = [0]
        ids: list[int] = []

        def choose(cands, steps=steps):  # both draft on the first two steps, then only the first
            steps[0] += 1
            return {s: (min(2, c[0]) if steps[0] <= 2 or s == ids[0] else 0) for s, c in cands.items()}

        eng.policy.choose = choose  # type: ignore[method-assign]
        eng.policy.steady_ratios = lambda accs, cap, others=0: [2.0] * len(accs)  # type: ignore[method-assign]
        flushes = _record_flushes(eng)
        ids += [eng.add(p, max_tokens=n, ignore_eos=True) for p in prompts]
        queued, alone = [], []
        while eng.active:
            flushes.clear()
            eng.step()
            if steps[0] >= 3 and not eng.sequence(ids[0]).finished:
                queued.append((eng.drafter.pending(ids[1]), flushes[:]))
            elif steps[0] >= 3 and not eng.sequence(ids[1]).finished:
                alone.append(flushes[:])  # the first finished: now nobody drafts, it catches up eagerly
        got = [eng.sequence(i).tokens for i in ids]
    assert len(queued) >= 4 and queued == [(1, [])] * len(queued)
    assert alone and alone[0] == [[ids[1]]]
    for p, g in zip(prompts, got, strict=True):
        assert_greedy_matches(g, reference(path, tuple(p), n))


@pytest.mark.parametrize("round_s", [None, 0.0])
def test_calibration_times_each_shape_in_interleaved_rounds(model_path, monkeypatch: pytest.MonkeyPatch,
                                                             round_s: float | None) -> None:
    """draft_max='auto' times decodes of every shape when the engine is made: each shape
    once untimed (on a GPU the first decode of a shape pays for its CUDA graph: an H200
    timed a cold 1-row verify at 8 ms, a warm one at 2 ms), then in interleaved rounds
    (every shape once a round, the best kept), so a CPU's speed drifting for a few
    seconds cannot bend one shape against the others; one timed round where a round is long."""
    from llama_mtp.speculative import engine as engine_mod

    if round_s is not None:
        monkeypatch.setattr(engine_mod, "CALIBRATION_ROUND_S", round_s)
    model = _models(str(model_path("noisy")))
    calls = count_decodes(monkeypatch)
    with SpeculativeEngine(model, max_sequences=2, n_ctx=128, draft_cap=3, rollback="snapshots") as eng:
        costs = eng.policy.costs
        assert sorted(costs.verify.curves) == [1, 2]
        assert sorted(costs.verify.curve(1).points) == [1, 2, 3, 4]
        assert sorted(costs.verify.curve(2).points) == [2, 4, 6, 8]
        assert sorted(costs.draft.points) == [1, 2]
    # a round: verifies of 1 sequence x 1..4 rows and 2 sequences x 1..4 rows, then MTP
    # draft decodes of 1 and 2 outputs
    one_round = [1, 2, 3, 4] + [2 * r for r in (1, 2, 3, 4)] + [1, 2]
    rounds = 2 if round_s == 0.0 else engine_mod.CALIBRATION_ROUNDS + 1
    assert calls == one_round * rounds


def test_several_sequences_draft_from_a_levelled_first_decode(model_path) -> None:
    """Sequences whose drafts are accepted to different depths start their next draft with
    different catch-up rows; the drafter levels that first decode by decoding entries again
    (one pass, not one per row count). Output is plain greedy decoding either way, and the
    drafts -- hence what is accepted -- are the same with and without it."""
    path = str(model_path("noisy"))
    model = _models(path)
    prompts = [model.tokenize(p) for p in PROMPTS[:3]]
    accepted = {}
    for level in (True, False):
        with SpeculativeEngine(model, n_ctx=256, draft_max=3, sampling=GREEDY, max_sequences=3) as eng:
            assert eng.drafter is not None
            eng.drafter.level_first = level
            got = run(eng, prompts, [40, 40, 40], ignore_eos=True)
            assert (eng.drafter.leveled > 0) is level
            accepted[level] = [(s.draft_n, s.draft_n_accepted) for s in (eng.sequence(i).stats for i in range(3))]
        for p, g in zip(prompts, got, strict=True):
            assert_greedy_matches(g, reference(path, tuple(p), 40))
    assert 0 < sum(a for _, a in accepted[True]) < sum(d for d, _ in accepted[True])  # accepted to different depths
    assert accepted[True] == accepted[False]
