"""The adaptive draft-length policy, on synthetic costs and acceptance (no model)."""

from __future__ import annotations

import pytest

from llama_mtp.speculative.policy import Acceptance, DraftPolicy, PiecewiseCost


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
    for _ in range(150):  # nothing drafted for a while: the faded evidence earns a 1-token probe
        a.tick()
    assert p.choose({0: (6, a, None, 150)})[0] == 1
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


def test_probes_back_off_while_they_fail() -> None:
    p = compute_bound()
    a = Acceptance(6)
    waits = []
    for _ in range(6):
        waits.append(p.probe_wait(a))
        a.observe(1, 0)
    assert waits == sorted(waits) and waits[0] == p.probe_gap and waits[-1] == p.probe_every
    for _ in range(90):  # no evidence since: it has faded
        a.tick()
    assert p.choose({0: (6, a, None, waits[-1] - 1)})[0] == 0  # not yet
    assert p.choose({0: (6, a, None, waits[-1])})[0] == 1      # now a probe
    a.observe(1, 1)  # it lands: the next probe may come soon again
    assert a.fails == 0 and p.probe_wait(a) == p.probe_gap


def test_a_new_sequence_inherits_recent_acceptance() -> None:
    pool = Acceptance(6)
    for _ in range(100):
        pool.tick()
        pool.observe(3, 0)
    fresh = Acceptance(6)
    assert fresh.alpha(0) == pytest.approx(0.7)  # the prior
    fresh.inherit(pool)
    assert fresh.alpha(0) < 0.25 and fresh.fails == pool.fails
    assert max(fresh.tries) <= 8.0 + 1e-9  # scaled down: it still adapts within a few steps
    for _ in range(12):
        fresh.tick()
        fresh.observe(6, 6)
    assert fresh.alpha(0) > 0.6


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
    assert p.choose({0: (6, a, None, 440)})[0] == 1


def test_first_draft_decode_cost_counts() -> None:
    """A drafting step's first MTP decode also carries the catch-up rows of what was
    accepted; once it is measured dear, drafting that paid on the clean draft cost stops."""
    p = compute_bound()
    a = acc(0.8)
    assert p.choose({0: (6, a, None, 0)})[0] >= 1  # priced on the pure draft decodes
    p = compute_bound()
    p.costs.first.calibrate([(1, 0.020), (4, 0.030)])
    assert p.costs.step_seconds([1]) == pytest.approx(0.026 + 0.020)
    assert p.costs.step_seconds([2]) == pytest.approx(0.034 + 0.020 + 0.004)
    assert p.choose({0: (6, a, None, 0)})[0] == 0


def test_rejection_table() -> None:
    a = acc(0.5, k=4)
    t = a.rejection_table(3)
    assert t[0] == (0.0, 0.0)
    assert t[1] == pytest.approx((0.5, 0.5))              # rejected at 0: id_last replayed
    assert t[2] == pytest.approx((0.75, 0.5 + 0.25 * 2))  # or at 1: one accepted + id_last
    assert t[3] == pytest.approx((0.875, 1.0 + 0.125 * 3))


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
