"""The adaptive draft-length policy, on synthetic costs and acceptance (no model)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llama_mtp.speculative.policy import (
    Acceptance,
    Candidate,
    CostModel,
    DraftPolicy,
    Drift,
    PiecewiseCost,
    equal_split,
)


def memory_bound() -> DraftPolicy:
    """A decode costs about the same for 1 or 8 rows (a GPU, or a big model on a CPU)."""
    p = DraftPolicy(6)
    for n in (1, 4):
        p.costs.verify.calibrate(n, [(r, 0.020 + 0.0005 * r) for r in (1, 2, 4, 8, 16, 32)])
    p.costs.draft.calibrate([(1, 0.002), (4, 0.0022)])
    return p


def compute_bound() -> DraftPolicy:
    """Every extra row costs a lot (a small CPU): drafting pays only when drafts land."""
    p = DraftPolicy(6)
    for n in (1, 4):
        p.costs.verify.calibrate(n, [(r, 0.010 + 0.008 * r) for r in (1, 2, 4, 8, 16, 32)])
    p.costs.draft.calibrate([(1, 0.004), (4, 0.006)])
    return p


def acc(alpha: float, k: int = 6) -> Acceptance:
    """An estimate pinned at per-position acceptance alpha."""
    return Acceptance(k, prior=alpha, pseudo=1e12)


def test_expected_tokens() -> None:
    a = Acceptance(4, prior=0.5, pseudo=1e9)
    assert a.expected_tokens(0) == 1.0
    assert a.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_estimates_follow_the_shrinkage_recursion() -> None:
    """alpha(i) shrinks position i's evidence towards alpha(i-1) (position 0 towards
    the prior); positions past the tracked ones repeat the last; the optimistic
    estimate adds a bonus that fades with the evidence; expected_table(k)[j] is
    1 + sum_{i<j} prod_{m<=i} alpha(m) -- all checked against a direct evaluation."""
    import math
    import random

    rng = random.Random(7)
    for _ in range(50):
        a = Acceptance(4, prior=rng.random(), pseudo=rng.uniform(0.5, 5.0), bonus=rng.uniform(0.0, 0.5))
        for _ in range(rng.randrange(40)):
            a.tick()
            d = rng.randrange(1, 5)
            a.observe(d, rng.randrange(d + 1))
        ref, est = [], a.prior
        for i in range(7):
            j = min(i, 3)
            if i <= 3:
                est = (a.hits[j] + a.pseudo * est) / (a.tries[j] + a.pseudo)
            ref.append(est)
        for i in range(7):
            assert a.alpha(i) == pytest.approx(ref[i])
            j = min(i, 3)
            assert a.optimistic(i) == pytest.approx(min(1.0, ref[i] + a.bonus / math.sqrt(a.tries[j] + 1.0)))
        for opt in (False, True):
            f = a.optimistic if opt else a.alpha
            table = a.expected_table(6, optimistic=opt)
            assert len(table) == 7
            for k in range(7):
                assert table[k] == pytest.approx(1 + sum(math.prod(f(m) for m in range(i + 1)) for i in range(k)))
                assert a.expected_tokens(k, optimistic=opt) == pytest.approx(table[k])


def test_step_cost_ignores_which_sequence_drafts_what() -> None:
    """One choose() prices a layout once whatever its order (the memo is keyed on the
    sorted lengths): the verify and the MTP decodes see counts, not sequence ids."""
    p = compute_bound()
    for ks in ([3, 0, 1, 0], [0, 1, 0, 3], [1, 3, 0, 0]):
        assert p.costs.step_seconds(ks) == pytest.approx(p.costs.step_seconds([0, 0, 1, 3]))


@pytest.mark.parametrize("rows, tail, want", [
    ([1, 1, 1, 1], 0, [(4, 1)]),
    ([2, 2, 2, 2], 0, [(4, 2)]),
    ([2, 1, 1, 1], 0, [(4, 1), (1, 1)]),           # one drafter: a second pass for its extra row
    ([1, 1, 1, 2], 0, [(4, 1), (1, 1)]),
    ([3, 1, 1, 1], 0, [(4, 1), (1, 2)]),
    ([2, 2, 1, 1], 0, [(4, 1), (2, 1)]),
    ([2, 1, 2, 1], 0, [(4, 1), (1, 1), (1, 1)]),   # only consecutive sequence ids share a pass
    ([1, 1, 1, 1], 7, [(4, 1)]),
    ([2, 1, 1, 1], 7, [(1, 2), (3, 1)]),           # snapshots: a sequence's tail stays whole
    ([1, 1, 1, 2], 7, [(3, 1), (1, 2)]),
    ([2, 2, 1, 1], 7, [(1, 2), (1, 2), (2, 1)]),
    ([20, 20], 0, [(2, 8), (2, 8), (2, 4)]),        # n_ubatch 16
])
def test_equal_split_follows_llama_cpp(rows: list[int], tail: int, want: list[tuple[int, int]]) -> None:
    """The micro-batches of llama.cpp's split_equal (llama-batch.cpp), simulated; the
    timings behind them were measured on the benchmark model (bench/README.md): a
    [2, 1, 1, 1] verify costs what [2, 2, 2, 2] does."""
    n_ubatch = 16 if rows == [20, 20] else 512
    assert equal_split(list(enumerate(rows)), n_ubatch, keep_tail=tail) == want
    assert equal_split([(0, 1), (2, 1), (3, 1)], 512) == [(1, 1), (2, 1)]  # a gap in the ids
    assert equal_split([(0, 1), (2, 1), (3, 1)], 512, sequential=False) == [(3, 1)]


def test_uneven_layouts_are_priced_by_their_passes() -> None:
    """On recurrent memory a lone drafter makes the verify two passes over the weights: the
    policy prices that, and where a pass costs far more than a row (a memory-bound decode)
    keeps every sequence's rows level instead of letting one draft alone."""
    def policy(split: bool) -> DraftPolicy:
        p = memory_bound()
        p.costs.split = (512, True, 0) if split else None
        return p
    p = policy(True)
    c = p.costs
    assert c.step_seconds([1, 0, 0, 0]) == pytest.approx(c.verify(4, 4) + c.verify(1, 1) + c.draft(1))
    assert policy(False).costs.step_seconds([1, 0, 0, 0]) == pytest.approx(c.verify(4, 5) + c.draft(1))
    cands = {0: (6, acc(0.9), None, 0), **{s: (6, acc(0.3), None, 0) for s in (1, 2, 3)}}
    alone = policy(False).choose(cands)
    assert alone[0] > max(alone[s] for s in (1, 2, 3))  # rows are cheap: the good drafter drafts longer
    level = policy(True).choose(cands)
    assert len(set(level.values())) == 1, level  # one pass: everyone drafts the same length


def test_chooses_zero_when_drafting_cannot_pay() -> None:
    p = compute_bound()
    ks = p.choose({0: (6, acc(0.05), None, 0)})
    assert ks == {0: 0}


def test_longest_useful_draft_when_acceptance_is_one() -> None:
    p = memory_bound()
    assert p.choose({0: (6, acc(1.0), None, 0)}) == {0: 6}
    # capped by what the sequence may verify now
    assert memory_bound().choose({0: (2, acc(1.0), None, 0)}) == {0: 2}


def test_more_acceptance_longer_drafts() -> None:
    ks = [compute_bound().choose({0: (6, acc(a), None, 0)})[0] for a in (0.3, 0.6, 0.8, 0.95, 0.999)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] >= 4, ks


def test_switches_when_acceptance_changes() -> None:
    p = compute_bound()
    a = Acceptance(6)
    for _ in range(60):  # predictable text: everything drafted is accepted
        a.tick()
        a.observe(6, 6)
    assert p.choose({0: (6, a, None, 0)})[0] >= 4
    for _ in range(60):  # the text turns unpredictable
        a.tick()
        a.observe(1, 0)
    assert p.choose({0: (6, a, None, 0)})[0] == 0
    for _ in range(200):  # nothing drafted for a while: the faded evidence earns a probe
        a.tick()
    assert a.tries[0] < p.fresh_evidence and p.probe_wait(a) > 200  # due though its backoff is not over
    assert p.choose({0: (6, a, None, 200)})[0] >= 1
    for _ in range(40):  # the probes land: drafting comes back
        a.tick()
        a.observe(max(1, p.choose({0: (6, a, None, 0)})[0]), 6)
    assert p.choose({0: (6, a, None, 0)})[0] >= 4


def test_shared_batch_drafts_less_with_many_sequences() -> None:
    one = compute_bound().choose({0: (6, acc(0.85), None, 0)})[0]
    many = compute_bound().choose({s: (6, acc(0.85), None, 0) for s in range(4)})
    assert one >= 1 and max(many.values()) <= one, (one, many)
    # a memory-bound device: many sequences still draft long
    assert min(memory_bound().choose({s: (6, acc(0.95), None, 0) for s in range(4)}).values()) >= 4


def test_fixed_lengths_are_kept() -> None:
    p = compute_bound()
    ks = p.choose({0: (6, acc(0.05), 3, 0), 1: (2, acc(0.05), 5, 0)})
    assert ks == {0: 3, 1: 2}


def test_acceptance_extrapolates_and_decays() -> None:
    a = Acceptance(6, prior=0.7, pseudo=1.0)
    for _ in range(50):
        a.observe(1, 1)  # only position 0 ever tested
    assert a.alpha(0) > 0.95 and a.alpha(5) == a.alpha(0)
    before = a.optimistic(0)
    for _ in range(200):
        a.tick()
    assert a.tries[0] < 1.0 and a.optimistic(0) >= before


def test_piecewise_cost() -> None:
    c = PiecewiseCost(0.02, 0.004)
    assert c(2) == pytest.approx(0.028)  # nothing measured: the line
    c.calibrate([(1, 0.02), (4, 0.035), (8, 0.05)])
    assert c(4) == pytest.approx(0.035)
    assert c(6) == pytest.approx(0.0425)  # interpolated
    assert c(16) == pytest.approx(0.08)  # extrapolated from the last segment
    c.observe(4, 0.045)
    assert 0.035 < c(4) < 0.045


def test_unchosen_points_follow_the_speed_of_the_chosen_ones() -> None:
    """The machine slows down by a fifth after calibration; only the 4-row layout (the
    plain step of four sequences) is observed. The layouts nobody chooses must follow
    it, or a draft that paid at calibration time looks cheaper -- or, after a slow
    calibration, dearer -- than it is, and is never measured again."""
    c = CostModel()
    c.verify.calibrate(4, [(4, 0.030), (8, 0.039), (12, 0.048)])
    c.draft.calibrate([(4, 0.006)])
    for _ in range(40):
        c.verify.observe(4, 4, 0.036)
    assert c.drift.factor == pytest.approx(1.2, rel=0.05)
    assert c.verify(4, 4) == pytest.approx(0.036, rel=0.01)
    assert c.verify(4, 12) == pytest.approx(0.048 * 1.2, rel=0.05)  # never observed: follows the drift
    assert c.draft(4) == pytest.approx(0.006 * 1.2, rel=0.05)
    assert c.verify.curve(4).now()[8] == pytest.approx(c.verify(4, 8))
    # a point's own shape is learnt too: one that is dearer than calibrated (more context
    # than the calibration's empty one) stays dearer relative to the others
    for _ in range(60):
        c.verify.observe(4, 4, 0.036)
        c.verify.observe(4, 12, 0.070)
    assert c.verify(4, 12) / c.verify(4, 4) == pytest.approx(0.070 / 0.036, rel=0.05)


def test_drift_is_bounded_per_sample() -> None:
    d = Drift(rate=0.2)
    d.observe(100.0)  # one absurd sample (a preempted decode) moves it by at most 2 ** 0.2
    assert d.factor == pytest.approx(2 ** 0.2)
    c = PiecewiseCost(0.02, 0.004, drift=Drift())
    c.calibrate([(1, 0.010)], count=1)  # a guess: not yet established, moves no drift
    c.observe(1, 0.020)
    assert c.drift is not None and c.drift.factor == 1.0 and 0.010 < c(1) < 0.020


def test_a_first_save_does_not_price_every_draft() -> None:
    c = CostModel()
    c.observe_save(1, 0.0005)
    c.observe_save(4, 4 * 0.005)  # first saves of three sequences also fault their buffers in
    assert c.save <= 0.0005 * 1.2 + 1e-12
    for _ in range(30):  # a real change of cost is followed
        c.observe_save(1, 0.004)
    assert c.save > 0.003


def test_a_sequence_shrinks_towards_the_pool_without_its_own_evidence_twice() -> None:
    pool = Acceptance(6)
    child = Acceptance(6, parent=pool)
    other = Acceptance(6, parent=pool)
    for _ in range(20):  # the other sequences' guesses land ~90%
        for acc_ in (pool, other):
            acc_.observe(1, 1, shadow=True)
    for _ in range(2):
        pool.observe(1, 1, shadow=True)
        other.observe(1, 1, shadow=True)
    for _ in range(2):  # the child's two guesses missed
        child.observe(1, 0, shadow=True)
        pool.observe(1, 0, shadow=True)
    # without the pool: 2 misses against a prior of 0.7 -> 0.42; with it, the pool of the
    # *other* sequences (all hits) pulls it up; counting its own misses twice would not
    alone = Acceptance(6)
    alone.observe(1, 0, shadow=True)
    alone.observe(1, 0, shadow=True)
    loo = (0.0 + child.parent_weight * pool.alphas(1, without=child)[0]) / (2.0 + child.parent_weight)  # 22 seen
    assert child.alpha(0) == pytest.approx(loo)
    assert child.alpha(0) > alone.alpha(0) + 0.15
    twice = (0.0 + child.parent_weight * pool.alpha(0)) / (2.0 + child.parent_weight)  # its misses in the pool too
    assert child.alpha(0) > twice + 0.03
    assert pool.alphas(1, without=child)[0] > pool.alpha(0)
    # a pool that holds nothing but the sequence's own evidence is the bare prior
    solo_pool = Acceptance(6)
    solo = Acceptance(6, parent=solo_pool)
    for acc_ in (solo, solo_pool, solo, solo_pool):
        acc_.observe(1, 0, shadow=True)
    assert solo.alpha(0) == pytest.approx(alone.alpha(0))
    # a new sequence starts where the pool is
    assert Acceptance(6, parent=pool).alpha(0) == pytest.approx(pool.alpha(0))


def test_exploring_past_the_positions_drafted_so_far() -> None:
    """Drafting one token at a time never tests position 1, so one early rejection there
    keeps it low for good (the k = 1 trap: a planted ~75% model lands 0.85 at position 0
    and 0.97 at position 1 given position 0). Where a position is barely tested, the
    policy is optimistic about it -- one position past the evidence only, so a sequence
    new to drafting does not open with a long draft."""
    a = Acceptance(6)
    a.observe(2, 1)  # an early draft rejected at position 1
    for i in range(40):
        a.tick()
        a.observe(1, int(i % 8 != 0))  # then one token at a time, ~7 in 8 land
    assert a.tries[1] < 0.5 < 20 < a.tries[0]
    p = compute_bound()
    p.explore = 0.0
    assert p.choose({0: (6, a, None, 0)})[0] == 1
    assert compute_bound().choose({0: (6, a, None, 0)})[0] == 2  # explores the next position
    table = a.expected_table(6, explore=0.3)
    assert table[2] > a.expected_table(6)[2]
    bonus = [x - y for x, y in zip(a.alphas(3, explore=0.3), a.alphas(3), strict=True)]
    assert bonus[0] == 0.0 and bonus[1] > 0.15 and bonus[2] < 0.05  # little evidence at 1: little past it
    fresh = Acceptance(6)  # no evidence anywhere: no bonus anywhere
    assert fresh.expected_table(6, explore=0.3) == fresh.expected_table(6)


def test_exploration_fades_once_drafts_reach_the_positions() -> None:
    """The explore bonus is for positions not yet tested: once drafts reach them every
    step it fades as 1 / evidence (at 1 / sqrt(evidence) it held ~0.05 a position for
    good, and the compounded optimism chose longer drafts than the estimates pay for)."""
    import random
    rng = random.Random(7)
    a = Acceptance(6)
    for _ in range(200):
        a.tick()
        accepted = 0
        while accepted < 4 and rng.random() < 0.75:
            accepted += 1
        a.observe(4, accepted)  # four tokens a step: positions 0..3 tested, 4 never
    assert min(a.tries[:4]) > 15.0 and a.tries[4] == 0.0

    def policy(**knobs: float) -> DraftPolicy:
        p = DraftPolicy(6)
        for name, value in knobs.items():
            setattr(p, name, value)
        p.costs.verify.calibrate(1, [(r, 0.010 + 0.003 * r) for r in (1, 2, 4, 8, 16, 32)])
        p.costs.draft.calibrate([(1, 0.002), (4, 0.003)])
        return p

    p = policy()
    bonus = [x - y for x, y in zip(a.alphas(6, explore=p.explore, explore_power=p.explore_power),
                                   a.alphas(6), strict=True)]
    assert max(bonus[:4]) < 0.02 < 0.2 < bonus[4]  # the first untested position keeps its bonus
    cands = {0: (4, a, None, 0)}
    assert policy().choose(cands)[0] == policy(explore=0.0).choose(cands)[0] == 2
    assert policy(explore_power=0.5).choose(cands)[0] == 3  # what the lasting bonus chose


def test_exploration_fades_with_the_pools_evidence_too() -> None:
    """A new sequence's estimates follow the engine's pool where its own evidence is thin,
    so the explore bonus fades with the pool's tries of a position as well as its own: a
    short request must not re-explore depths the other sequences drafted to all along
    (four ~75% sequences of 48 tokens each sat at k = 4, 0.9x of k = 3, on the bonus of their
    few own tries). A depth nobody has drafted to keeps its bonus."""
    import random
    rng = random.Random(3)
    pool = Acceptance(6)  # every sequence's evidence: four-token drafts, positions 0..3 tested, never 4
    for _ in range(200):
        pool.tick()
        accepted = 0
        while accepted < 4 and rng.random() < 0.75:
            accepted += 1
        pool.observe(4, accepted)
    new = Acceptance(6, parent=pool)
    for i in range(6):  # a new request: a few drafts of its own, at the same rate
        new.tick()
        pool.tick()
        for acc in (pool, new):
            acc.observe(4, 4 if i % 4 else 1)
    assert new.tries[1] < 8.0 < 20.0 < pool.tries[1]

    def bonus(pooled: float) -> list[float]:
        return [x - y for x, y in zip(new.alphas(6, explore=0.3, explore_pool=pooled), new.alphas(6), strict=True)]

    own, pooled = bonus(0.0), bonus(1.0)
    assert min(own[1:4]) > 0.03  # on its own few tries, every tested depth looked worth exploring
    assert pooled[0] == 0.0 and all(pooled[i] < own[i] / 4 for i in (1, 2, 3))  # the pool tested them
    assert pooled[4] == own[4] > 0.05  # depth 4: nobody drafted there, the bonus stays


def test_probes_back_off_while_they_fail() -> None:
    p = compute_bound()
    a = Acceptance(6)
    waits = []
    for _ in range(6):
        waits.append(p.probe_wait(a))
        a.observe(1, 0)
    assert waits == sorted(waits) and waits[0] == p.probe_gap and waits[-1] > p.probe_every
    b = Acceptance(6)
    b.fails = 40
    assert p.probe_wait(b) == p.probe_max  # capped
    for _ in range(200):  # no evidence since: it has faded, so probe_every rules, not the backoff
        a.tick()
    assert a.tries[0] < p.fresh_evidence and p.probe_wait(a) > p.probe_every
    assert p.choose({0: (6, a, None, p.probe_every - 1)})[0] == 0  # not yet
    assert p.choose({0: (6, a, None, p.probe_every)})[0] >= 1      # now a probe
    a.observe(1, 1)  # it lands: the backoff starts over (and the next step may probe at once)
    assert a.fails == 0 and p.probe_wait(a) == p.probe_gap and p._due(a, 0) and not p._due(a, 1)


def test_a_probe_that_paid_is_followed_by_another_at_once() -> None:
    """A new sequence whose first draft was rejected idles on a pessimistic estimate; its
    probe lands whole and pays -- that is evidence the estimate is behind, so the next
    step probes again rather than waiting ``probe_gap`` steps per probe (a fresh engine
    at ~75% on a 2-core CPU spent most of a 128-token run so); a probe that does not pay
    starts the wait over."""
    p = compute_bound()
    a = Acceptance(6)
    a.observe(2, 0)  # the first draft: rejected
    assert p.probe_wait(a) == p.probe_gap
    assert p.choose({0: (6, a, None, 0)})[0] == 0  # not due
    a.observe(2, 2, paid=p.paid([2], 0, 2))  # the probe (once due) lands and pays
    assert a.paid_last and p._due(a, 0)
    # ... due on the step after it only: an idle sequence whose last draft paid long ago is
    # not (the quiet searches that save Python on idle steps stay quiet)
    assert not p._due(a, 1) and not p._due(a, 5)
    assert p.choose({0: (6, a, None, 0)})[0] >= 1  # the step after it: probed again
    assert p.choose({0: (6, a, None, 1)})[0] == 0  # (a probe declined then waits out probe_gap)
    a.observe(2, 1, paid=p.paid([2], 0, 1))  # one token of two: does not pay on these costs
    assert not a.paid_last and p.probe_wait(a) == p.probe_gap
    assert p.choose({0: (6, a, None, 0)})[0] == 0


def test_a_probe_is_the_shortest_draft_that_could_pay() -> None:
    """Where a 2-row verify costs almost two plain decodes (F16 weights on a small CPU),
    only longer drafts pay: a 1-token probe would lose and test nothing past position
    0, so stale evidence at the deeper positions would never clear. A probe is the
    shortest draft that pays on the optimistic estimates."""
    def stalled() -> Acceptance:
        a = Acceptance(6)
        for _ in range(20):  # drafts landed at position 0, then stalled at position 1
            a.tick()
            a.observe(6, 1)
        for _ in range(120):  # idle since: the evidence fades
            a.tick()
        return a

    p = DraftPolicy(6)
    p.costs.verify.calibrate(1, [(1, 0.0135), (2, 0.0260), (3, 0.0270), (4, 0.0304), (5, 0.0337), (6, 0.0345),
                                 (7, 0.0355)])
    p.costs.draft.calibrate([(1, 0.0026)])
    # a 1-token draft cannot pay on these costs, even if always accepted
    assert p.costs.step_seconds([1]) / 2 > p.costs.step_seconds([0])
    a = stalled()
    k = p.choose({0: (6, a, None, p.probe_wait(a))})[0]
    assert k >= 2, k
    opt = a.expected_table(6, optimistic=True)
    rate = [opt[j] / p.costs.step_seconds([j]) for j in range(7)]
    assert rate[k] > rate[0] >= max(rate[1:k])  # the shortest that pays, optimistically


def test_probes_that_do_not_pay_back_off_though_something_lands() -> None:
    """A draft pays when its accepted tokens come at least as cheap as a plain step's:
    on dear verify rows, one token of a five-token draft does not -- such probes count
    as failures and space out, as do drafts with nothing accepted. Shadow guesses (no
    verify paid) move the estimate, never the backoff."""
    p = compute_bound()
    t0, t5 = p.costs.step_seconds([0]), p.costs.step_seconds([5])
    assert not p.paid([5], 0, 1) and p.paid([5], 0, 5)
    need = next(n for n in range(6) if p.paid([5], 0, n))
    assert (1 + need) * t0 >= t5 > need * t0  # the break-even: tokens per second of a plain step
    assert p.paid([0], 0, 0)  # no draft, nothing to pay for
    # in a shared batch a draft bears its share of what drafting adds: on a memory-bound device one
    # accepted token of four sequences' drafts pays for itself
    assert memory_bound().paid([5, 5, 5, 5], 0, 1)
    a = Acceptance(6)
    waits = []
    for _ in range(4):
        a.observe(5, 1, paid=p.paid([5], 0, 1))
        waits.append(p.probe_wait(a))
    assert waits == sorted(waits) and waits[-1] > 2 * p.probe_gap, waits
    a.observe(1, 1, shadow=True)
    assert p.probe_wait(a) == waits[-1]
    a.observe(5, 5, paid=p.paid([5], 0, 5))
    assert a.fails == 0 and p.probe_wait(a) == p.probe_gap


def test_flowing_evidence_stands_in_for_forced_probes() -> None:
    """While shadow guesses keep arriving (two per 32 steps, all wrong), a long-idle
    sequence is not probed; once the guesses turn right, it drafts again; once they
    stop arriving and the evidence fades, the forced probe is back."""
    p = compute_bound()
    a = Acceptance(6)
    for step in range(1, 321):
        a.tick()
        if step % 32 == 0:
            a.observe(1, 0)
            a.observe(1, 0)
    assert a.tries[0] > p.fresh_evidence
    assert p.choose({0: (6, a, None, 320)})[0] == 0  # idle far beyond probe_every: still no probe
    b = Acceptance(6)
    b.hits, b.tries, b.fails = list(a.hits), list(a.tries), a.fails
    for step in range(1, 97):  # the text turns predictable: the shadow guesses land
        b.tick()
        if step % 32 == 0:
            b.observe(1, 1)
            b.observe(1, 1)
    assert p.choose({0: (6, b, None, 416)})[0] >= 1
    for _ in range(120):  # the guesses stop (no catch-up flushes): the evidence fades
        a.tick()
    assert a.tries[0] < p.fresh_evidence
    assert p.choose({0: (6, a, None, 440)})[0] >= 1


def test_catch_up_rows_price_the_first_draft_decode() -> None:
    """A drafting step's first MTP decode also carries every queued catch-up row: what
    such decodes took beyond a pure draft decode is learnt per row, and a step is priced
    by the rows it will carry -- whole for a sequence that drafted on the last step (what
    its verify accepted: every drafting step pays that), spread over ``resume_steps`` for
    one that resumes (paid once, for the run of drafts it starts)."""
    a = acc(0.8)
    p = compute_bound()
    assert p.choose({0: (6, a, None, 0)})[0] >= 1  # priced on the pure draft decodes
    p.costs.observe_first(1, 1, 0.5)  # no catch-up rows: nothing learnt about them
    assert p.costs.catch.per_row == 0.0
    p.costs.observe_first(1, 11, p.costs.draft(1) + 0.010)  # 10 rows, 10 ms beyond the draft decode
    p.costs.observe_first(4, 24, p.costs.draft(4) + 0.010)  # 20 rows, 10 ms
    assert p.costs.catch.per_row == pytest.approx(0.020 / 30, rel=0.05)
    assert p.costs.step_seconds([1], carry=15) == pytest.approx(p.costs.step_seconds([1]) + 15 * p.costs.catch.per_row)
    assert p.costs.step_seconds([0], carry=15) == p.costs.step_seconds([0])  # no draft, no first decode
    costs = p.costs

    def choose(idle: int, pending: int, resume_steps: int = 8) -> tuple[int, float]:
        q = compute_bound()
        q.costs.catch = costs.catch
        q.resume_steps = resume_steps
        k = q.choose({0: Candidate(6, a, None, idle, 0, pending)})[0]
        return k, q.estimated_tok_s

    assert choose(0, 0)[0] >= 1
    assert choose(0, 12)[0] == 0  # drafting under way with 12 rows a step does not pay here
    k, est = choose(3, 12)  # resuming after 3 idle steps: 12 rows once, for the run it starts
    assert k >= 1
    q = compute_bound()
    q.costs.catch = costs.catch
    tab = a.expected_table(6)
    # what the step is measured against: its own rows, all of them
    assert est == pytest.approx(tab[k] / q.costs.step_seconds([k], carry=12))
    assert choose(3, 12, resume_steps=1)[0] == 0  # priced whole


@pytest.mark.parametrize("cpu", ["epyc", "xeon"])
def test_steady_ratio_prices_drafting_under_way(cpu: str) -> None:
    """What drafting would earn once under way, over a plain step: the best k's
    expected tokens per second, its first MTP decode priced as a pure draft decode
    (however dear resuming was measured). The two 2-core CPUs this was tuned on, at
    ~0.66 acceptance: where a 2-row verify costs almost two plain decodes (EPYC) drafting
    does not pay even steadily; where verify rows are cheap (Xeon), k = 2 pays ~9%."""
    p = DraftPolicy(6)
    if cpu == "epyc":
        p.costs.verify.calibrate(1, [(1, 0.0135), (2, 0.0260), (3, 0.0270), (4, 0.0304), (5, 0.0337),
                                     (6, 0.0345), (7, 0.0355)])
        p.costs.draft.calibrate([(1, 0.0026)])
    else:
        p.costs.verify.calibrate(1, [(1, 0.0244), (2, 0.0308), (3, 0.0354), (7, 0.0519)])
        p.costs.draft.calibrate([(1, 0.0058)])
    p.costs.observe_first(1, 1 + 12, p.costs.draft(1) + 0.0084)  # resuming after idle steps: 12 queued catch-up rows
    a, b = Acceptance(6, prior=0.66, pseudo=1e12), Acceptance(6, prior=0.2, pseudo=1e12)
    got = p.steady_ratios([a, b], 6)
    assert got == p.steady_ratios([a, b], 6, others=0)
    plain = p.costs.step_seconds([0])
    tab = a.expected_table(6)
    want = max(tab[k] / p.costs.step_seconds([k]) for k in range(1, 7)) * plain
    assert got[0] == pytest.approx(want)
    assert got[1] < got[0]  # less acceptance, less to earn
    # steady: the catch-up rows are left out, not the draft decodes
    assert p.costs.step_seconds([2]) == pytest.approx(
        plain - p.costs.verify_layout([1]) + p.costs.verify_layout([3]) + 2 * p.costs.draft(1))
    assert p.costs.step_seconds([2], carry=12) > p.costs.step_seconds([2])
    if cpu == "epyc":
        assert got[0] < 0.95
    else:
        assert 1.05 < got[0] < 1.15
        # resuming with a backlog prices k = 1 .. 2 near plain: what kept auto idle there
        assert max(tab[k] / p.costs.step_seconds([k], carry=12) for k in (1, 2)) * plain < 1.03
        # next to three sequences that draft nothing (their verify rows measured on this
        # Xeon), one more row and an MTP decode weigh more against the shared step: the
        # same text no longer pays -- the batch's tokens over its seconds, both ways
        p.costs.verify.calibrate(4, [(4, 0.04115), (8, 0.05536), (12, 0.06746)])
        four = p.steady_ratios([a], 6, others=3)[0]
        idle = p.costs.step_seconds([0, 0, 0, 0])
        assert four == pytest.approx(max((tab[k] + 3) / p.costs.step_seconds([k, 0, 0, 0])
                                         for k in range(1, 7)) * idle / 4)
        assert four < 0.95 < 1.05 < p.steady_ratios([a], 6)[0]


def test_rejection_table() -> None:
    a = acc(0.5, k=4)
    t = a.rejection_table(3)
    assert t[0] == (0.0, 0.0)
    assert t[1] == pytest.approx((0.5, 0.5))              # rejected at 0: id_last replayed
    assert t[2] == pytest.approx((0.75, 0.5 + 0.25 * 2))  # or at 1: one accepted + id_last
    assert t[3] == pytest.approx((0.875, 1.0 + 0.125 * 3))


def test_overflow_table() -> None:
    """A rejection at position j replays backlog + j + 1 rows; it overflows a k-token
    draft of the others (an extra pass next step) by backlog + j + 1 - k rows when that
    is positive -- never without a backlog."""
    a = acc(0.5, k=4)
    assert a.overflow_table(3) == [(0.0, 0.0)] * 4
    t = a.overflow_table(3, backlog=1)
    assert t[0] == (0.0, 0.0)
    assert t[1] == pytest.approx((0.5, 0.5))     # rejected at 0: 2 rows replayed, 1 row over a 1-token draft
    assert t[2] == pytest.approx((0.25, 0.25))   # only a rejection at 1 overflows 2 + 1
    assert a.overflow_table(1, backlog=2)[1] == pytest.approx((0.5, 1.0))


def test_checkpoint_rollback_is_priced() -> None:
    """Without snapshots a draft costs a save, a rejection a restore and its replayed
    rows: the same acceptance buys shorter drafts (none where rejections cost too
    much), while drafts that are always taken whole still pay."""
    base = memory_bound().choose({0: (6, acc(0.6), None, 0)})[0]
    assert base > 0
    p = memory_bound()
    p.replays = True
    p.costs.observe_save(1, 0.001)
    p.costs.observe_restore(0.001)
    cheap = p.choose({0: (6, acc(0.6), None, 0)})[0]
    assert 0 < cheap <= base
    p = memory_bound()
    p.replays = True
    p.costs.observe_save(1, 0.002)
    p.costs.observe_restore(0.03)
    assert p.choose({0: (6, acc(0.6), None, 0)})[0] < cheap
    assert p.choose({0: (6, acc(1.0), None, 0)})[0] == 6  # nothing to restore or replay
    # the same for four sequences sharing the batch
    ks = p.choose({s: (6, acc(0.6), None, 0) for s in range(4)})
    assert all(k < base for k in ks.values())


def test_a_tie_does_not_draft() -> None:
    """Drafting must promise ``margin`` more than not drafting (the costs are estimates
    from noisy timings): a 2% edge drafts nothing, a
    clear one drafts -- and a sequence already drafting stops once its edge is gone,
    whatever the hysteresis."""
    def policy(margin: float) -> DraftPolicy:
        p = DraftPolicy(1, margin=margin)
        p.costs.verify.calibrate(1, [(1, 0.020), (2, 0.030)])
        p.costs.draft.calibrate([(1, 0.005)])
        return p
    tie = acc(0.785, k=1)  # k = 1: 1.785 tokens in 35 ms, 51 tok/s against 50
    assert policy(0.0).choose({0: (1, tie, None, 0)}) == {0: 1}
    assert policy(0.03).choose({0: (1, tie, None, 0)}) == {0: 0}
    assert policy(0.03).choose({0: (1, acc(0.95, k=1), None, 0)}) == {0: 1}  # 55.7 tok/s: drafts
    p = policy(0.03)
    assert p.choose({0: (1, acc(0.95, k=1), None, 0)}) == {0: 1}
    assert p.choose({0: (1, tie, None, 0)}) == {0: 0}  # the hysteresis does not keep a tie drafting


def test_idle_steps_search_again_every_few_steps() -> None:
    """After a search that drafts nothing, the next ``quiet_steps`` steps of the same
    sequences reuse it (the estimates move by a half-life of dozens of steps), twice as
    many (+1) after each such search in a row, up to ``quiet_max``; the one after
    searches again, and so does any step with a due probe, a replay, a new sequence or
    shadow evidence that drafting may pay (``wake``)."""
    p = compute_bound()
    calls = []
    search = p._search
    p._search = lambda *a, **k: (calls.append(1), search(*a, **k))[1]  # type: ignore[method-assign]
    a = Acceptance(6, prior=0.05, pseudo=1e12)
    every = p.quiet_steps + 1
    assert p.quiet_max == 4 * every - 1
    searched = []
    for step in range(10 * every):
        n = len(calls)
        assert p.choose({0: (6, a, None, step % 8)}) == {0: 0}  # never due a probe (the first waits 8)
        if len(calls) > n:
            searched.append(step)
    assert searched == [0, every, 3 * every, 7 * every]  # 7, 15, 31, 31 quiet steps between
    b = Acceptance(6, prior=0.05, pseudo=1e12)
    p.choose({0: (6, b, None, 0)})  # another sequence: a search, and the backoff starts over
    assert p._quiet == p.quiet_steps
    p._quiet = 0
    p.choose({0: (6, b, None, 0)})
    assert p._quiet == 2 * every - 1
    p.choose({0: (6, a, None, 0)})  # quiet ...
    n = len(calls)
    p.wake()  # ... until evidence comes in without a draft (a confirmed shadow guess): a search
    p.choose({0: (6, a, None, 0)})
    assert len(calls) == n + 1
    a.prior = 1.0  # the text turns predictable: seen within quiet_steps + 1 steps
    got = [p.choose({0: (6, a, None, 0)})[0] for _ in range(p.quiet_steps + 1)]
    assert got[-1] > 0 and got[:-1] == [0] * p.quiet_steps
    p.choose({0: (6, Acceptance(6, prior=0.05, pseudo=1e12), None, 0)})  # another sequence: a search
    n = len(calls)
    assert p.choose({0: Candidate(6, a, None, 0, backlog=1)})[0] > 0 and len(calls) > n


def test_a_wrong_shadow_guess_cannot_make_an_idle_search_draft() -> None:
    """Why only confirmed shadow guesses wake a quiet policy: a miss lowers a sequence's
    estimates (and its pool's), and lower estimates never turn a search that drafts
    nothing into one that drafts -- checked over a grid of evidence, alone and pooled."""
    for costs in (compute_bound, memory_bound):
        for prior in (0.05, 0.3, 0.5, 0.7):
            for hits, tries in ((0, 0), (1, 2), (3, 4), (5, 10), (20, 30), (40, 50)):
                for n in (1, 4):
                    pool = Acceptance(6, prior=prior)
                    accs = [Acceptance(6, prior=prior, parent=pool) for _ in range(n)]
                    for a in (*accs, pool):
                        a.hits[0], a.tries[0] = float(hits), float(tries)
                    cands = {s: (6, a, None, 0) for s, a in enumerate(accs)}
                    if any(costs().choose(cands).values()):
                        continue  # drafts already
                    for a in (accs[0], pool):
                        a.observe(1, 0, shadow=True)
                    assert not any(costs().choose(cands).values()), (costs.__name__, prior, hits, tries, n)


def test_a_step_barred_from_drafting_is_not_a_quiet_search() -> None:
    """A step whose replay bars drafting (cap 0) or carries a backlog drafts nothing
    whatever the estimates say; the steps after it must search again, not sit idle for
    quiet_steps (four sequences in lockstep lost four steps after every rejection)."""
    p = memory_bound()
    a = acc(0.95)
    seqs = range(4)
    assert p.choose({s: Candidate(0, a, None, 0, backlog=5) for s in seqs}) == dict.fromkeys(seqs, 0)
    assert min(p.choose({s: Candidate(6, a, None, 1) for s in seqs}).values()) > 0
    assert p.choose({s: Candidate(6, acc(0.01), None, 0) for s in seqs}) == dict.fromkeys(seqs, 0)
    assert p._quiet == p.quiet_steps  # a free search that drafts nothing is reused


def test_drafts_that_measure_below_their_estimate_are_priced_down() -> None:
    """Whatever the cost model misses (replays that unlevel a shared batch, correlated
    rejections) shows in drafting steps measured against their estimates, next to steps
    that do not draft: the main search scales the value of drafting by that ratio."""
    p = compute_bound()
    good, bad = acc(0.85), acc(0.01)
    assert p.choose({0: (6, good, None, 0)})[0] > 0
    assert p.realism == 1.0
    for _ in range(2 * p.REALISM_MIN):
        for a, real in ((good, 0.5), (bad, 1.0)):
            p._quiet = 0
            p.choose({0: (6, a, None, 0)})
            p.observe_step(1, 1.0 / (real * p.estimated_tok_s))  # measured: `real` times the estimate
    assert p.realism < 0.75
    p._last = {}
    assert p.choose({0: (6, good, None, 0)})[0] == 0
    # what drafting measured fades while it does not draft, so it is tried again; drafts that
    # now measure as estimated bring the model's prices back
    chosen = []
    for _ in range(300):
        p._quiet = 0
        chosen.append(p.choose({0: (6, good, None, 0)})[0])
        p.observe_step(1, 1.0 / p.estimated_tok_s)
    assert chosen[0] == 0 and chosen[-1] > 0 and p.realism > 0.9


def test_a_fresh_engine_probes_at_once() -> None:
    """No evidence anywhere (a fresh engine's first sequence, compute-bound, where the
    prior alone says not to draft): probe now, not after probe_gap plain steps; once
    the pool has heard anything, the usual wait."""
    p = compute_bound()
    pool = Acceptance(6)
    a = Acceptance(6, parent=pool)
    assert p.choose({0: (6, Acceptance(6, prior=0.7, pseudo=1e12), None, 0)})[0] == 0  # the prior: no draft
    assert p.choose({0: (6, a, None, 0)})[0] > 0
    pool.observe(1, 0, shadow=True)
    b = Acceptance(6, parent=pool)
    p._quiet = 0
    assert p.choose({0: (6, b, None, 0)})[0] == 0


def test_a_pending_replay_is_priced() -> None:
    """Without snapshots a rejection restores the state from before this verify's
    replayed tokens, so they are replayed again: a sequence carrying a replay drafts
    shorter (and not at all once the replay costs more than the draft can win), and
    one with nothing to replay is unaffected."""
    p = memory_bound()
    p.replays = True
    p.costs.observe_save(1, 0.001)
    p.costs.observe_restore(0.001)
    p.costs.verify.calibrate(1, [(r, 0.010 + 0.004 * r) for r in (1, 2, 4, 8, 16, 32)])
    ks = [p.choose({0: Candidate(6, acc(0.7), None, 0, backlog)})[0] for backlog in (0, 2, 4, 40)]
    assert ks[0] > 0 and ks == sorted(ks, reverse=True) and ks[-1] == 0
    assert p.choose({0: (6, acc(0.7), None, 0)})[0] == ks[0]  # a plain tuple: no backlog
    assert p.choose({0: Candidate(6, acc(1.0), None, 0, 40)})[0] == 6  # never rejected: nothing replayed again
    p.replays = False  # snapshots undo a rejection in place: the replay is paid once, whatever the draft
    assert p.choose({0: Candidate(6, acc(0.7), None, 0, 40)})[0] == p.choose({0: (6, acc(0.7), None, 0)})[0]


def test_per_step_overhead_favours_longer_steps() -> None:
    """A step's fixed cost outside decodes (Python, sampling) is paid once whatever the
    drafts: on a tiny model, where it is as large as a decode, it makes drafting pay
    at an acceptance where decode costs alone say it cannot."""
    def tiny() -> DraftPolicy:
        p = DraftPolicy(6)
        p.costs.verify.calibrate(1, [(r, 0.0005 + 0.00003 * r) for r in range(1, 8)])
        p.costs.draft.calibrate([(1, 0.0005)])
        return p
    assert tiny().choose({0: (6, acc(0.85), None, 0)}) == {0: 0}
    p = tiny()
    for _ in range(20):
        p.costs.observe_overhead(0.0008)
    assert p.costs.overhead == pytest.approx(0.0008)
    assert p.choose({0: (6, acc(0.85), None, 0)})[0] > 0
    assert p.choose({0: (6, acc(0.0), None, 0)}) == {0: 0}  # nothing lands: still no draft


def one_cpu_sequence() -> DraftPolicy:
    """The benchmark model's decodes on a 2-core EPYC: a 2-row verify costs two plain steps."""
    p = DraftPolicy(6)
    p.costs.verify.calibrate(1, [(1, 0.0134), (2, 0.026), (3, 0.028), (4, 0.034), (5, 0.036), (6, 0.038),
                                 (7, 0.042)])
    p.costs.draft.calibrate([(1, 0.0025)])
    return p


def switching(snapshots: bool, tax: float = 0.05, base: Callable[[], DraftPolicy] | None = None) -> DraftPolicy:
    """memory_bound() that can switch rollback modes: snapshots tax every decode by ``tax``;
    checkpoints pay a save per draft and a restore per rejection. ``snapshots``: the mode
    it is in now."""
    p = (base or memory_bound)()
    alt = p.costs.sibling(None)
    for n, curve in p.costs.verify.curves.items():
        alt.verify.calibrate(n, [(r, v / (1.0 + tax)) for r, v in curve.points.items()])  # no snapshots
    alt.save, alt.restore = 0.001, 0.001
    p.alt, p.alt_replays = alt, True
    if not snapshots:
        p._swap()
    return p


def run_modes(p: DraftPolicy, alpha: float, steps: int, n: int = 1) -> list[int]:
    """choose() for ``steps`` steps of ``n`` sequences at acceptance ``alpha``, switching
    whenever the policy asks; the steps at which it switched."""
    a = [acc(alpha) for _ in range(n)]
    for x in a:  # plenty of evidence: the optimistic estimates are close to alpha
        x.tries, x.hits = [40.0] * 6, [40.0 * alpha] * 6
    out = []
    for t in range(steps):
        if p.switch_wanted:
            p.switched(0.05)
            out.append(t)
        p.choose({s: Candidate(6, a[s], None, 0) for s in range(n)})
    return out


@pytest.mark.parametrize("n", [1, 4])
def test_snapshots_are_left_where_nothing_drafts(n: int) -> None:
    """With snapshots on text the drafter never gets right, nothing drafts and every decode
    pays the snapshots: the policy asks for checkpoints within a few comparisons (the
    optimistic estimates would not draft either), and stays there."""
    p = switching(snapshots=True)
    got = run_modes(p, 0.0, 200, n)
    assert len(got) == 1 and got[0] <= 4 * p.switch_every and p.replays


@pytest.mark.parametrize("n", [1, 4])
def test_snapshots_are_taken_where_drafting_pays(n: int) -> None:
    """With checkpoints on text the drafter gets right (a replay after every rejection),
    the policy asks for snapshots -- and with them it drafts, and stays."""
    p = switching(snapshots=False)
    got = run_modes(p, 0.95, 200, n)
    assert len(got) == 1 and got[0] <= 4 * p.switch_every and not p.replays
    assert p.choose({s: Candidate(6, acc(0.95), None, 0) for s in range(n)})[0] > 0
    q = switching(snapshots=True)
    assert run_modes(q, 0.95, 200, n) == []  # never leaves them


def test_a_short_stint_of_snapshots_backs_the_next_off() -> None:
    """Snapshots left soon after they were taken (the acceptance estimates of idle sequences
    drift back towards the prior and would bring them back every few dozen steps) are
    taken again only after a dwell that doubles each time."""
    p = switching(snapshots=True)
    assert run_modes(p, 0.0, 20) != [] and p.replays  # the engine's first stint: short
    assert p._snap_backoff == 2
    since = p._since_switch
    got = run_modes(p, 0.95, 200)
    assert got and 2 * p.switch_dwell <= since + got[0] <= 2 * p.switch_dwell + 2 * p.switch_every
    assert not p.replays


def test_comparing_modes_leaves_the_choice_alone() -> None:
    """The comparison prices the other mode by swapping costs in and out: the lengths chosen
    are what the policy without an alternative chooses, step after step."""
    for alpha in (0.0, 0.6, 0.95):
        for snapshots in (True, False):
            p, q = switching(snapshots), switching(snapshots)
            q.alt = None
            a, b = [acc(alpha) for _ in range(4)], [acc(alpha) for _ in range(4)]
            for _ in range(40):
                got = p.choose({s: Candidate(6, a[s], None, 0, s % 2) for s in range(4)})
                want = q.choose({s: Candidate(6, b[s], None, 0, s % 2) for s in range(4)})
                assert got == want
            assert p.replays == (not snapshots)


def test_switched_swaps_every_priced_thing() -> None:
    p = switching(snapshots=True)
    snap, ckpt = p.costs, p.alt
    p.costs.observe_overhead(0.002)
    p.switched(0.08)
    assert p.costs is ckpt and p.alt is snap and p.replays and not p.alt_replays
    assert p.costs.overhead == pytest.approx(0.002)  # the same Python either way
    assert p.switches == 1 and p.switch_s > 0.0 and not p.switch_wanted
    assert p.costs.drift is p.alt.drift and p.costs.draft is p.alt.draft


def rejected(n: int) -> Acceptance:
    """A sequence (with the engine's pool behind it) whose first ``n`` 2-token drafts were
    rejected at the first position."""
    pool = Acceptance(6)
    a = Acceptance(6, parent=pool)
    for _ in range(n):
        a.observe(2, 0)
        pool.observe(2, 0)
    return a


def test_snapshots_are_not_left_on_thin_evidence() -> None:
    """One sequence on a compute-bound CPU whose first probe was rejected: every estimate
    is thin, and nothing looks worth drafting on them -- but the sequence may well be at
    ~75%. The snapshots stay (for SWITCH_IDLE_N comparisons) until evidence says the
    first position is poor even optimistically; then they go within a few comparisons."""
    def steps_to_switch(rejections: int) -> int | None:
        p = switching(snapshots=True, base=one_cpu_sequence)
        a = rejected(rejections)
        for t in range(200):
            if p.switch_wanted:
                return t
            p.choose({0: Candidate(6, a, None, 1)})
        return None

    thin = steps_to_switch(1)
    assert thin is None or thin >= DraftPolicy.SWITCH_IDLE_N * 4
    firm = steps_to_switch(12)
    assert firm is not None and firm <= 4 * 4


def test_modes_are_compared_less_often_where_neither_would_draft() -> None:
    """With checkpoints on text nothing drafts for, the comparison (a search of its own)
    runs every 4 * switch_every steps once it found snapshots idle; with snapshots, where
    leaving them counts idle comparisons, every switch_every steps."""
    for snapshots, every in ((False, 16), (True, 4)):
        p = switching(snapshots=snapshots)
        calls = []
        compare = p._compare_modes
        # used only within this iteration (run_modes below): the loop variables are the ones meant
        p._compare_modes = lambda c: (calls.append(1), compare(c))[1]  # type: ignore[method-assign]  # noqa: B023
        p.switch_dwell = 10**6  # stay in the mode under test
        run_modes(p, 0.0, 160)
        assert p.replays == (not snapshots)
        assert 160 // every - 3 <= len(calls) <= 160 // every + 3


def test_snapshots_that_stop_drafting_are_compared_every_few_steps() -> None:
    """Snapshots that drafted (checkpoints far behind then) and now draft nothing: the
    running advantage still remembers the drafting, but leaving counts idle comparisons,
    so they come every switch_every steps from the first idle one -- not four times
    less often until the running mean forgets (four sequences paid the snapshots' tax
    for ~500 steps after text stopped paying)."""
    p = switching(snapshots=True)
    p.switch_dwell = 10**6  # stay with snapshots: only the comparisons are counted
    run_modes(p, 0.95, 100)
    assert p._adv < -0.05 and not p.replays  # checkpoints far behind while drafting
    calls = []
    compare = p._compare_modes
    p._compare_modes = lambda c: (calls.append(1), compare(c))[1]  # type: ignore[method-assign]
    run_modes(p, 0.0, 160)
    assert p._snap_idle and not p.replays
    assert len(calls) >= 160 // p.switch_every - 3


def test_idle_snapshots_that_are_not_hopeless_are_probed() -> None:
    """Snapshots kept on thin evidence (the comparisons find them idle, the optimistic bound
    not hopeless) are paid every step: a sequence due a probe gets one, judged on that
    bound -- without an alternative mode (nothing to leave) the same sequence waits."""
    def thin(p: DraftPolicy) -> list[int]:
        a = rejected(1)
        return [p.choose({0: Candidate(6, a, None, t)})[0] for t in range(40)]

    got = thin(switching(snapshots=True, base=one_cpu_sequence))
    assert any(got) and not any(got[:2 * 4])  # after two idle comparisons
    q = switching(snapshots=True, base=one_cpu_sequence)
    q.alt = None
    assert not any(thin(q))


def test_drafts_pay_only_in_a_step_whose_drafts_paid_together() -> None:
    """A sequence whose draft paid is due another probe on the next step. With eight
    sequences at ~55% one of them lands whatever the text, and the others ride along its
    probe: the luckiest one set everyone's pace (eight on a 2-core CPU drafted for 22 steps
    in a row, each at 0.8x the speed of idling). So a draft pays only where the step's
    drafts paid together; one sequence is judged as before."""
    p = DraftPolicy(6)
    p.costs.verify.calibrate(8, [(r, 0.040 + 0.004 * r) for r in (8, 16, 24, 32, 48, 56)])
    p.costs.draft.calibrate([(1, 0.004), (8, 0.008)])
    ks = [1] * 8
    alone = [p.paid(ks, i, 1) for i in range(8)]
    assert all(alone)  # each landed token, alone, pays its share of what drafting added
    landed = [1, 1, 1, 1, 0, 0, 0, 0]  # half of them: the step gained 4 tokens for 40 ms
    assert p.costs.step_seconds(ks) - p.costs.step_seconds([0] * 8) > 4 * p.costs.step_seconds([0] * 8) / 8
    assert p.paid_step(ks, landed) == [False] * 8
    p.whole_step_paid = False  # (the old rule: the four that landed paid)
    assert p.paid_step(ks, landed) == [True] * 4 + [False] * 4
    p.whole_step_paid = True
    most = [1, 1, 1, 1, 1, 1, 1, 0]  # the step paid: each draft is judged on its own
    assert p.paid_step(ks, most) == [p.paid(ks, i, a) for i, a in enumerate(most)] == [True] * 7 + [False]
    # sequences that did not draft pay nothing; one drafting alone is judged as paid() judges it
    assert p.paid_step([0, 1, 0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]) == \
        [True, p.paid([0, 1, 0, 0, 0, 0, 0, 0], 1, 1), True, True, True, True, True, True]
    one = compute_bound()
    for n in range(6):
        assert one.paid_step([5], [n]) == [one.paid([5], 0, n)]


def test_a_rejected_checkpoint_draft_pays_for_its_replay() -> None:
    """With checkpoints a rejection replays the accepted tokens (and the last) in the next
    verify: rows shared with the others where those verifies stay level, a pass of their
    own on recurrent memory where they do not. Whether a draft paid counts that."""
    p = memory_bound()
    p.replays = True
    p.costs.split = (512, True, 0)
    p.costs.save = p.costs.restore = 0.0005
    p.costs.level = 1.0
    assert p.paid([2, 2, 2, 2], 0, 1)
    p.costs.level = 0.0
    assert not p.paid([2, 2, 2, 2], 0, 1)
    assert p.paid([2, 2, 2, 2], 0, 2)  # taken whole: nothing to replay


def test_a_probe_keeps_a_split_verify_level() -> None:
    """Eight sequences on recurrent memory with a KV stream each: one is due a probe, seven
    idle on text the drafter rarely gets right. A lone probe is a pass of its own over the
    weights; all eight drafting one token is one pass -- so the idle ones ride along
    (``level_probes``) where that pays on the optimistic estimates, and the probe of one
    alone is what the policy ran before."""
    def stalled() -> Acceptance:  # drafts that landed long ago: optimistic again
        a = Acceptance(6)
        for _ in range(20):
            a.tick()
            a.observe(6, 6)
        for _ in range(300):
            a.tick()
        return a

    def policy(level: bool) -> DraftPolicy:
        p = DraftPolicy(6)
        for n in (1, 8):
            p.costs.verify.calibrate(n, [(r, 0.020 + 0.0005 * r) for r in (1, 2, 4, 8, 16, 32, 48, 56)])
        p.costs.draft.calibrate([(1, 0.002), (8, 0.0024)])
        p.costs.split = (512, True, 0)
        p.level_probes = level
        return p

    def cands(p: DraftPolicy) -> dict[int, Candidate]:
        a0 = stalled()
        return {0: Candidate(6, a0, None, p.probe_wait(a0)), **{s: Candidate(6, acc(0.2), None, 1) for s in range(1, 8)}}

    p = policy(True)
    level = p.choose(cands(p))
    assert set(level.values()) == {1}, level
    assert len(p.costs.passes([1 + k for k in level.values()])) == 1
    q = policy(False)
    lone = q.choose(cands(q))
    assert lone[0] > 0 and not any(lone[s] for s in range(1, 8)), lone
    assert len(q.costs.passes([1 + k for k in lone.values()])) == 2


@pytest.mark.parametrize("reset", [True, False])
def test_new_sequences_start_the_mode_comparison_afresh(reset: bool) -> None:
    """The running advantage of the other rollback mode is of the sequences it was measured
    on: the idle tail of a batch (checkpoints ahead) must not have the next batch's
    sequences, drafting with snapshots, leave them at their first comparison."""
    p = switching(snapshots=True)
    p.reset_on_join = reset
    old = [acc(0.0) for _ in range(4)]
    p._cmp_accs = {id(a): a for a in old}
    p._adv, p._adv_n, p._compare_in = 0.5, 6, 1  # checkpoints were far ahead for the last ones
    new = [acc(0.9) for _ in range(4)]
    ks = p.choose({s: Candidate(6, new[s], None, 0) for s in range(4)})
    assert all(k > 0 for k in ks.values())  # the new ones draft
    assert p.switch_wanted is (not reset)


def test_a_verify_carrying_replays_is_levelled_by_the_drafts() -> None:
    """Without snapshots, half of eight sequences on recurrent memory replay a token (their
    rejections' accepted ones) in this verify. Drafting nothing leaves their rows uneven --
    two passes over the weights, what a 2-core CPU measured at twice an idle step -- and
    the same draft for everyone keeps them uneven. A draft one token shorter for each
    sequence that replays one keeps every sequence's rows equal: one pass. The search tries
    that common row count, not only a common draft length (single-sequence moves cannot
    find it: one sequence levelled alone leaves the others uneven)."""
    p = DraftPolicy(6)
    for n in (1, 8):
        p.costs.verify.calibrate(n, [(r, 0.040 + 0.0025 * r) for r in (1, 2, 4, 8, 16, 24, 32, 48, 56)])
    p.costs.draft.calibrate([(1, 0.008), (8, 0.010)])
    p.costs.split = (512, True, 0)
    p.replays = True
    p.costs.save = p.costs.restore = 0.0005
    backlog = [0, 1, 0, 1, 1, 0, 1, 0]
    cands = {s: Candidate(6, acc(0.75), None, 0, b) for s, b in enumerate(backlog)}
    ks = p.choose(cands)
    rows = [1 + ks[s] + b for s, b in enumerate(backlog)]
    assert len(p.costs.passes(rows)) == 1, (ks, rows)
    assert any(ks.values())
    p._last, p.level_replays = {}, False  # a common draft length only (the A/B switch): uneven
    ks = p.choose(cands)
    assert len(p.costs.passes([1 + ks[s] + b for s, b in enumerate(backlog)])) > 1, ks
    p._last, p.level_replays = {}, True
    ks = p.choose({s: Candidate(6, acc(0.75), None, 0) for s in range(8)})  # nothing replayed
    assert len(set(ks.values())) == 1 and any(ks.values()), ks
