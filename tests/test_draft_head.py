"""The reduced draft vocabulary (DraftHead, ``draft_vocab``): the same logits as the
MTP head for the rows it holds, lossless output, acceptance as the vocabulary allows,
rows learned from the text, and bad input refused."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_greedy_matches, chi2_two_sample, greedy_reference_margins

import llama_mtp as lm
from llama_mtp.batch import Batch
from llama_mtp.speculative import SpeculativeEngine
from llama_mtp.speculative import engine as engine_mod
from llama_mtp.tiny import DEMO_TEXT

GREEDY = lm.SamplingParams.greedy_params()
PROMPTS = ["Multi-token prediction", "the model", "every accepted draft saves a whole decoding"]


@functools.cache
def _model(path: str) -> lm.Model:
    return lm.Model(path)


@functools.cache
def reference(path: str, prompt: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
    return greedy_reference_margins(_model(path), list(prompt), n)


def run(eng: SpeculativeEngine, prompts: list[list[int]], n: int, **kw) -> list[list[int]]:
    ids = eng.add_many([dict(prompt=p, max_tokens=n, **kw) for p in prompts])
    while eng.active:
        eng.step()
    return [eng.sequence(i).tokens for i in ids]


def mtp_logits_and_hidden(model: lm.Model, n_rows: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Full-head logits and h_nextn rows of an MTP decode with ``n_rows`` outputs."""
    rng = np.random.default_rng(1)
    with lm.Context(model, lm.ContextParams(n_ctx=64), mtp=True) as ctx:
        b = Batch(16, hidden_dim=ctx.hidden_dim)
        toks = model.tokenize(DEMO_TEXT)[:8]
        b.extend(toks, 0, 0, outputs=np.arange(8) >= 8 - n_rows,
                 hidden=rng.standard_normal((8, ctx.hidden_dim)).astype(np.float32))
        ctx.decode(b)
        return ctx.logits_all().copy(), ctx.hidden_all()[8 - n_rows:].copy()  # a row per entry


def test_rows_give_the_mtp_heads_logits(planted: lm.Model) -> None:
    full, hidden = mtp_logits_and_hidden(planted)
    ids = [300, 5, 299, 511, 0, 269]
    with lm.DraftHead(planted, ids, n_threads=2) as head:
        assert list(head.ids) == ids and len(head) == 6
        got = head.logits(hidden)
        assert got.shape == (3, 6)
        np.testing.assert_allclose(got, full[:, ids], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(head.logits(hidden[1]), full[1, ids], rtol=1e-5, atol=1e-5)
    with lm.DraftHead(planted, range(planted.n_vocab)) as every:
        col = np.argmax(every.logits(hidden), axis=1)
        assert list(every.to_ids(col)) == list(np.argmax(full, axis=1))


def test_rows_are_added_once_until_full(planted: lm.Model) -> None:
    with lm.DraftHead(planted, [1, 2, 2, 3], capacity=6) as head:
        assert list(head.ids) == [1, 2, 3] and head.room == 3
        assert head.add([3, 4, 4, 1]) == 1
        assert 4 in head and 7 not in head and head.column(4) == 3 and head.column(7) == -1
        assert head.add([5, 6, 7, 8]) == 2  # room for two: the rest are refused, not lost silently
        assert list(head.ids) == [1, 2, 3, 4, 5, 6] and head.room == 0
        assert head.add([9]) == 0
        full, hidden = mtp_logits_and_hidden(planted, 1)
        np.testing.assert_allclose(head.logits(hidden), full[:, [1, 2, 3, 4, 5, 6]], rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused(model_path: type[Path]) -> None:
    m = lm.Model(model_path("planted"))
    head = lm.DraftHead(m, [1, 2], capacity=4)
    for bad in ([-1], [m.n_vocab], [1.5]):
        with pytest.raises((ValueError, TypeError)):
            head.add(bad)
    with pytest.raises(ValueError):
        head.logits(np.zeros((2, m.n_embd_out + 1), np.float32))
    with pytest.raises(ValueError):
        head.logits(np.zeros((0, m.n_embd_out), np.float32))
    for kw in (dict(capacity=1), dict(capacity=m.n_vocab + 1), dict(n_threads=0)):
        with pytest.raises(ValueError):
            lm.DraftHead(m, [1, 2], **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        lm.DraftHead(m, [m.n_vocab])
    assert head.add([3]) == 1  # still usable after refusals
    m.close()
    with pytest.raises(lm.ClosedError):
        head.add([4])  # copying rows needs the model
    assert head.logits(np.zeros(m.n_embd_out, np.float32)).shape == (3,)  # the copy outlives it
    head.close()
    head.close()
    with pytest.raises(lm.ClosedError):
        head.logits(np.zeros(4, np.float32))
    assert "closed" in repr(head)


def test_an_empty_head_gives_empty_rows(planted: lm.Model) -> None:
    with lm.DraftHead(planted, [], capacity=4) as head:
        assert len(head) == 0 and head.logits(np.zeros((2, planted.n_embd_out), np.float32)).shape == (2, 0)
        assert head.add([7]) == 1 and head.logits(np.zeros(planted.n_embd_out, np.float32)).shape == (1,)


def test_a_model_without_mtp_layers_has_rows_to_copy(model_path: type[Path]) -> None:
    with lm.Model(model_path("nomtp")) as m:  # has an output matrix: rows can be copied
        with lm.DraftHead(m, [1]) as head:
            assert len(head) == 1


@pytest.mark.parametrize("draft_max", [3, "auto"])
@pytest.mark.parametrize("n_seq", [1, 3])
@pytest.mark.parametrize("name,vocab", [("planted", 400), ("planted", 280), ("noisy", 300), ("random", 1)])
def test_lossless_greedy_with_a_draft_vocabulary(model_path, name: str, vocab: int, n_seq: int,
                                                 draft_max: int | str) -> None:
    path = str(model_path(name))
    model = _model(path)
    prompts = [model.tokenize(t) for t in PROMPTS[:n_seq]]
    with SpeculativeEngine(model, max_sequences=n_seq, n_ctx=256, draft_max=draft_max, sampling=GREEDY,
                           draft_vocab=vocab) as eng:  # type: ignore[arg-type]
        assert eng.drafter is not None and eng.drafter.head is not None
        got = run(eng, prompts, 40)
        stats = eng.stats.spec
    for p, g in zip(prompts, got, strict=True):
        assert_greedy_matches(g, reference(path, tuple(p), 40))
    if name == "planted" and vocab == 400 and draft_max == 3:
        assert stats.acceptance_rate == 1.0  # every planted piece (ids 269..394) is in the head


def test_the_draft_vocabulary_learns_the_text(model_path) -> None:
    """Drafting from token 0 alone, a planted model's pieces join the head as the prompt
    and the accepted tokens bring them: the first pass over the sentence drafts little,
    the next ones as well as the whole vocabulary does."""
    model = _model(str(model_path("planted")))
    prompt = model.tokenize(PROMPTS[0])
    n = len(model.tokenize(DEMO_TEXT))
    with SpeculativeEngine(model, n_ctx=512, draft_max=3, sampling=GREEDY, draft_vocab=1) as eng:
        head = eng.drafter.head  # type: ignore[union-attr]
        assert head is not None and set(head.ids) == {0, *np.flatnonzero(model.eog_mask)}
        run(eng, [prompt], n)
        first = eng.stats.spec.acceptance_rate
        assert set(model.tokenize(DEMO_TEXT)) <= set(head.ids)
        eng.stats = type(eng.stats)()
        run(eng, [prompt], 2 * n)
        again = eng.stats.spec.acceptance_rate
    assert first < 0.7 and again == 1.0


def test_draft_vocab_auto_and_validation(model_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(str(model_path("planted")))
    with SpeculativeEngine(model, n_ctx=64, draft_max=2) as eng:  # 512 tokens < DRAFT_VOCAB_AUTO: whole head
        assert eng.drafter is not None and eng.drafter.head is None and eng.drafter.draft_vocab == model.n_vocab
    monkeypatch.setattr(engine_mod, "DRAFT_VOCAB_AUTO", 300)
    with SpeculativeEngine(model, n_ctx=64, draft_max=2) as eng:
        assert eng.drafter is not None and eng.drafter.head is not None
        assert len(eng.drafter.head) >= 300 and eng.drafter.head.capacity == model.n_vocab
    with SpeculativeEngine(model, n_ctx=64, draft_max=2, draft_vocab=None) as eng:
        assert eng.drafter.head is None  # type: ignore[union-attr]
    for bad in (0, -3, True, 2.5, "all"):
        with pytest.raises(ValueError):
            SpeculativeEngine(model, n_ctx=64, draft_vocab=bad)  # type: ignore[arg-type]


def sample_runs(model: lm.Model, seeds: range, mtp: bool, draft_vocab: int | None) -> list[tuple[int, ...]]:
    sp = lambda s: lm.SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, seed=s)  # noqa: E731
    spec = lm.SpecParams(draft_max=3, verify="rejection")
    prompt = model.tokenize("Multi-token prediction drafts")
    out = []
    with SpeculativeEngine(model, max_sequences=8, n_ctx=64, draft_max=3, mtp=mtp, spec=spec,
                           draft_vocab=draft_vocab) as eng:
        if mtp:
            assert eng.drafter is not None and eng.drafter.head is not None
        seeds = list(seeds)
        for i in range(0, len(seeds), 8):
            ids = eng.add_many([dict(prompt=prompt, max_tokens=3, sampling=sp(s)) for s in seeds[i:i + 8]])
            while eng.active:
                eng.step()
            out += [tuple(eng.sequence(j).tokens) for j in ids]
        if mtp:
            assert eng.stats.spec.draft_n_accepted > 0  # drafts from the head were accepted
    return out


def test_rejection_sampling_with_a_draft_vocabulary_follows_the_target(soft_model: lm.Model) -> None:
    """Drafts drawn from the reduced vocabulary's distribution (zero outside it) and
    verified by rejection sampling leave the target's distribution as it is."""
    on = sample_runs(soft_model, range(1000, 2600), mtp=True, draft_vocab=300)
    off = sample_runs(soft_model, range(5000, 6600), mtp=False, draft_vocab=None)
    for key in (lambda t: t[0], lambda t: t[:2]):
        _, dof, p = chi2_two_sample(Counter(map(key, on)), Counter(map(key, off)))
        assert dof >= 2 and p > 0.01, (dof, p)


@pytest.mark.parametrize("vocab", [None, 300])
def test_a_drafts_chain_reads_its_own_rows(model_path, vocab: int | None) -> None:
    """A draft's next token comes from the hidden row of its own output, also when the
    first draft decode carries catch-up rows ahead of it. (At the pinned llama.cpp an MTP
    context's *masked* hidden rows are the batch's first rows: read that way, the second
    draft token came from a catch-up row's state.)"""
    from llama_mtp.speculative.mtp import DraftRequest, MTPDrafter

    model = _model(str(model_path("random")))  # random weights: every draft token depends on the chain
    rng = np.random.default_rng(7)
    toks = [int(t) for t in rng.integers(260, 500, 12)]
    hid = rng.standard_normal((13, model.n_embd_out)).astype(np.float32)
    drafts = []
    for flush_first in (False, True):
        d = MTPDrafter(model, n_ctx=64, n_seq_max=1, n_batch=64, draft_vocab=vocab)
        try:
            d.catch_up(0, toks, 0, hid[:12])
            if flush_first:
                d.flush()
            got = d.draft([DraftRequest(seq=0, token=toks[-1], pos=12, hidden=hid[12], n_max=4)])
            drafts.append(got[0].tokens)
        finally:
            d.close()
    assert len(drafts[0]) == 4 and drafts[0] == drafts[1]


def _uneven_drafts(model: lm.Model, level: bool, skip: bool = False,
                   refuse: bool = False) -> tuple[list[list[int]], list[Counter[int]], int]:
    """Two sequences draft once, then accept 3 and 0 tokens: their next first draft decode
    carries 3 + 1 and 0 + 1 rows. Returns both drafts of the second round, the rows per
    sequence of each of its MTP decodes, and the entries decoded again."""
    from llama_mtp.speculative.mtp import DraftRequest, MTPDrafter

    rng = np.random.default_rng(11)
    toks = [[int(t) for t in rng.integers(260, 500, 20)] for _ in range(2)]
    hid = rng.standard_normal((2, 20, model.n_embd_out)).astype(np.float32)
    d = MTPDrafter(model, n_ctx=128, n_seq_max=2, n_batch=64)
    d.level_first = level
    try:
        for s in range(2):
            d.catch_up(s, toks[s][:10], 0, hid[s, :10])
        d.draft([DraftRequest(seq=s, token=toks[s][10], pos=10, hidden=hid[s, 10], n_max=3) for s in range(2)])
        d.catch_up(0, toks[0][11:14], 11, hid[0, 11:14])  # sequence 0 accepted 3 drafts, sequence 1 none
        if skip:
            d.skip(1, 0)  # (nothing queued: a no-op) ...
            d._q(1).dropped = 1  # ... as if rows had been dropped since the last decode
        rows: list[Counter[int]] = []
        real = d.ctx.decode

        def decode(batch: Batch) -> None:
            rows.append(Counter(int(batch.seq[j, 0]) for j in range(batch.n_tokens)))
            real(batch)

        d.ctx.decode = decode  # type: ignore[method-assign]
        if refuse:  # the memory refuses to drop the tail the levelling would decode again (once)
            real_rm, calls = d.ctx.memory.seq_rm, []

            def seq_rm(seq: int, p0: int = -1, p1: int = -1) -> bool:
                calls.append(seq)
                return False if len(calls) == 1 else real_rm(seq, p0, p1)

            d.ctx.memory.seq_rm = seq_rm  # type: ignore[method-assign]
        got = d.draft([DraftRequest(seq=0, token=toks[0][14], pos=14, hidden=hid[0, 14], n_max=3),
                       DraftRequest(seq=1, token=toks[1][11], pos=11, hidden=hid[1, 11], n_max=3)])
        assert d.ctx.memory.pos_max(0) == 14 and d.ctx.memory.pos_max(1) == 11
        return [got[0].tokens, got[1].tokens], rows, d.leveled
    finally:
        d.close()


def test_a_first_draft_decode_is_levelled(model_path) -> None:
    """After a verify that accepted 3 drafts of one sequence and none of the other, the
    next first draft decode carries 4 and 1 rows: several llama.cpp micro-batches with a
    KV stream per sequence. The shorter sequence decodes its last 3 entries again (same
    token, same target row), so both carry 4 -- and every draft is what it was unlevelled
    (random weights: any change of the MTP memory would show)."""
    model = _model(str(model_path("random")))
    plain, rows_plain, n_plain = _uneven_drafts(model, level=False)
    level, rows_level, n_level = _uneven_drafts(model, level=True)
    assert n_plain == 0 and rows_plain[0] == Counter({0: 4, 1: 1})
    assert n_level == 3 and rows_level[0] == Counter({0: 4, 1: 4})
    assert len(plain[0]) == 3 and level == plain
    # a sequence whose history has a gap (rows dropped since its last decode) is left as it is
    _, rows_gap, n_gap = _uneven_drafts(model, level=True, skip=True)
    assert n_gap == 0 and rows_gap[0] == Counter({0: 4, 1: 1})
    # a memory that will not drop the entries to decode again: left as it was, same drafts
    refused, rows_refused, n_refused = _uneven_drafts(model, level=True, refuse=True)
    assert n_refused == 0 and rows_refused[0] == Counter({0: 4, 1: 1}) and refused == plain


def test_a_sidecar_mtp_model_drafts_from_its_own_head(model_path, tmp_path: Path) -> None:
    """With an MTP-only sidecar GGUF the rows are copied from the sidecar's head."""
    from llama_mtp.tiny import write_tiny_model

    path = str(model_path("planted"))
    model = _model(path)
    prompt = model.tokenize(PROMPTS[1])
    with lm.Model(write_tiny_model(tmp_path / "side.gguf", mtp_only=True)) as side, \
            SpeculativeEngine(model, mtp_model=side, n_ctx=128, draft_max=3, sampling=GREEDY, draft_vocab=400) as eng:
        assert eng.drafter is not None and eng.drafter.head is not None and eng.drafter.head.model is side
        got = run(eng, [prompt], 30)[0]
        assert eng.stats.spec.draft_n_accepted > 0
    assert_greedy_matches(got, reference(path, tuple(prompt), 30))


def test_auto_falls_back_to_the_full_head_where_rows_cannot_be_copied(model_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the head cannot be copied (a scaled or repacked head), "auto" drafts from the
    whole vocabulary; an explicit draft_vocab says why instead."""
    from llama_mtp.speculative import mtp as mtp_mod

    def refuse(*a: object, **kw: object) -> None:
        raise lm.MTPUnavailableError("the LM head's weights are repacked for this CPU")

    model = _model(str(model_path("planted")))
    monkeypatch.setattr(engine_mod, "DRAFT_VOCAB_AUTO", 300)
    monkeypatch.setattr(mtp_mod, "DraftHead", refuse)
    with SpeculativeEngine(model, n_ctx=64, draft_max=2, sampling=GREEDY) as eng:
        assert eng.drafter is not None and eng.drafter.head is None
        prompt = model.tokenize(PROMPTS[0])
        assert_greedy_matches(run(eng, [prompt], 12)[0], reference(str(model_path("planted")), tuple(prompt), 12))
    with pytest.raises(lm.MTPUnavailableError, match="repacked"):
        SpeculativeEngine(model, n_ctx=64, draft_max=2, draft_vocab=300)
