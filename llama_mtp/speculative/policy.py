"""Adaptive draft length: choose each sequence's draft length per step (0 included)
to maximise expected tokens per second, from measured costs and running acceptance.

Model (all estimates refreshed as the run goes):

* **costs**, shared by every sequence of an engine (they share the hardware):
  seconds of a target decode by its row count, and of an MTP-context draft decode
  by its output rows -- measured once when the engine starts, then refreshed by
  every decode it runs (exponentially weighted, interpolated between row counts);
* **acceptance**, per sequence: ``alpha[i]``, the probability that draft position
  ``i`` is accepted given positions ``0..i-1`` were -- exponentially weighted,
  so a sequence that moves from prose to code adapts within a few dozen tokens.

With drafts ``k_s`` per sequence, one step emits ``sum_s E_s(k_s)`` tokens, where
``E(k) = 1 + sum_{i<k} prod_{j<=i} alpha[j]``, and costs one verify of
``sum_s (1 + k_s)`` rows plus ``max_s k_s`` MTP decodes (decode ``i`` carries the
sequences still drafting). On recurrent memory that verify is as many passes over
the weights as llama.cpp cuts it into micro-batches (:func:`equal_split`: one per
distinct row count, roughly), so level rows are cheap and a lone drafter is not.
The policy tries a common length for everyone (and, where the verify carries
replayed tokens, a common row count: see below), then single-sequence steps up or
down, while that raises tokens per second -- so it picks 0 when drafting cannot
pay (or pays less than ``margin``), and the longest useful draft when acceptance
is near 1. A sequence that stops
drafting is probed now and then (after ``probe_gap`` steps, doubled for each
draft in a row that did not pay for itself, up to ``probe_max``: a failed probe
costs one to three plain steps) with the shortest draft that pays on the
optimistic estimates -- one token where extra rows are cheap, longer where only
long drafts pay, so the deeper positions' evidence is refreshed too -- so it can
come back when its text becomes predictable again. A probe is forced after ``probe_every`` idle steps
only where the evidence has faded: while the engine's shadow guesses (what the MTP
head predicted on catch-up rows) keep coming, the optimistic estimate decides. Each
sequence's estimates shrink towards the engine's pool of every sequence's evidence
(``Acceptance.parent``, less its own), so a new sequence starts from what the engine
has seen lately, and an idle one hears of the others' shadow guesses too. A position
past the deepest one with evidence of its own gets an optimistic bonus (``explore``,
fading as 1 / evidence, its own and the pool's), or a sequence drafting one token at a
time would never learn that a second lands.

Costs share one :class:`Drift` factor: the policy re-measures only the layouts it
chooses, and a small CPU's speed drifts 10..20% within minutes, so the layouts it does
not choose follow the speed of those it does.

On a context without rollback snapshots (``replays``: the engine's
``rollback="checkpoint"``) a draft also costs a checkpoint of the sequence's state,
and a rejection its restore plus the replayed rows (accepted tokens and the last
one) in the next verify: ``E[rows replayed] = sum_j P(first rejection at j) (j + 1)``.
A verify that carries replays is searched at common row counts too (a sequence
replaying ``b`` tokens drafts ``b`` fewer): drafting nothing there leaves it uneven, a
pass over the weights per distinct row count (eight sequences on a 2-core CPU: ~95 ms
against ~48 for an idle step).

Where the engine can switch its target between the two (``alt``: the other mode's
:class:`CostModel`, sharing the drift and the draft curves), every few steps the
policy compares the best layout with snapshots against a step that drafts nothing
without them, and asks for a switch (``switch_wanted``) once the advantage is clear
enough to pay for the switch -- or, with snapshots, once nothing would draft even on
optimistic estimates (:meth:`DraftPolicy._compare_modes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Acceptance", "Candidate", "CostModel", "DraftPolicy", "Drift", "PiecewiseCost", "RowCost",
           "VerifyCost", "equal_split"]


#: how the explore bonus of a draft position fades with its evidence: explore / (evidence +
#: 1) ** EXPLORE_POWER (:attr:`DraftPolicy.explore_power`, the default of every estimate)
EXPLORE_POWER = 1.0
#: catch-up rows a resuming sequence brings are priced spread over this many drafting steps
#: (:attr:`DraftPolicy.resume_steps`)
RESUME_STEPS = 8
#: how much the engine's pooled evidence of a position (other sequences' drafts that reached
#: it) counts towards the evidence the explore bonus fades with (:attr:`DraftPolicy.explore_pool`)
EXPLORE_POOL = 1.0


def _ewma(old: float, x: float, weight: float) -> float:
    """An exponentially weighted mean of positive samples (0.0: nothing seen yet)."""
    if x <= 0.0:
        return old
    return x if old == 0.0 else (1.0 - weight) * old + weight * x


class Drift:
    """How fast this machine runs now against when its decode costs were measured: one
    factor shared by every cost curve of an engine (``> 1``: slower now).

    A small shared CPU drifts 10..20% within minutes (clock, neighbours), and all its
    decodes drift together. The policy only ever re-measures the layouts it chooses, so
    without a shared factor the chosen layout follows the drift and the others keep the
    speed of their last measurement -- a slow calibration followed by a fast minute
    makes every draft look dear against a plain step that was just re-timed, and
    drafting never comes back to be measured again. With it, a curve keeps each point's
    *shape* (its seconds at factor 1) and every observation of an established point
    moves the factor by part of the way, so the points nobody chooses follow the speed
    of the ones that are.
    """

    def __init__(self, rate: float = 0.3, clamp: float = 2.0) -> None:
        self.factor = 1.0
        self.rate = rate
        self.clamp = clamp  # one sample moves the factor by at most this ratio ** rate

    def observe(self, ratio: float) -> None:
        """A decode took ``ratio`` times what its established point predicted."""
        if ratio > 0.0:
            self.factor *= min(self.clamp, max(1.0 / self.clamp, ratio)) ** self.rate


class PiecewiseCost:
    """Seconds of a decode by its row count: measured points, interpolated.

    Decode time is far from linear in the rows on CPUs (a batch gets cheaper per
    row as it grows), so the model keeps an exponentially weighted mean per row
    count that was measured, interpolates linearly between them, and extrapolates
    from the last two points. Until anything is measured it falls back on a line.

    With a :class:`Drift`, ``points`` hold seconds at factor 1 (the shape) and every
    answer is scaled by the current factor; observations of established points (a
    calibrated one, or one observed twice already) move the factor, and each point
    learns what is its own (a point's first observations weigh most).
    """

    #: what a calibrated point weighs, in observations: a careful measurement of the shape
    #: (its first observations must not take the drift of the moment for its own)
    CALIBRATED = 32

    def __init__(self, a: float, b: float, weight: float = 0.25, drift: Drift | None = None) -> None:
        self.line = (a, b)
        self.weight = weight
        self.drift = drift
        self.points: dict[int, float] = {}   # seconds at drift factor 1
        self.counts: dict[int, int] = {}     # observations behind each point
        self._memo: dict[int, float] = {}    # __call__'s answers (at factor 1) since the points last changed

    @property
    def factor(self) -> float:
        return self.drift.factor if self.drift is not None else 1.0

    def calibrate(self, points: list[tuple[int, float]], count: int | None = None) -> None:
        """Set points measured now, each worth ``count`` observations (default
        :attr:`CALIBRATED`; 1 for a guess the first observation moves halfway)."""
        f = self.factor
        for rows, secs in points:
            self.points[int(rows)] = float(secs) / f
            self.counts[int(rows)] = self.CALIBRATED if count is None else count
        self._memo.clear()

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0.0:
            return
        old = self.points.get(rows)
        n = self.counts.get(rows, 0)
        if old is not None and n >= 2 and self.drift is not None:
            self.drift.observe(seconds / (old * self.drift.factor))
        x = seconds / self.factor
        w = max(self.weight, 1.0 / (n + 1))
        self.points[rows] = x if old is None else (1 - w) * old + w * x
        self.counts[rows] = n + 1
        self._memo.clear()

    def now(self) -> dict[int, float]:
        """The points in seconds at the current speed."""
        f = self.factor
        return {r: v * f for r, v in self.points.items()}

    def __call__(self, rows: int) -> float:
        """Seconds for ``rows``, never more than a measured larger row count costs (a
        point not refreshed lately -- a row count the policy stopped choosing -- must
        not make its neighbours look free)."""
        if rows <= 0:
            return 0.0
        got = self._memo.get(rows)
        if got is None:
            est = self._interp(rows)
            above = [v for x, v in self.points.items() if x > rows]
            got = self._memo[rows] = min(est, min(above)) if above else est
        return got * self.factor

    def _interp(self, rows: int) -> float:
        if rows in self.points:
            return self.points[rows]
        xs = sorted(self.points)
        if len(xs) < 2:
            a, b = self.line
            if xs:  # one point: the line's slope through it
                x0 = xs[0]
                return max(1e-6, self.points[x0] + b * (rows - x0))
            return a + b * rows
        lo = max((x for x in xs if x < rows), default=None)
        hi = min((x for x in xs if x > rows), default=None)
        if lo is None:
            lo, hi = xs[0], xs[1]
        elif hi is None:
            lo, hi = xs[-2], xs[-1]
        y0, y1 = self.points[lo], self.points[hi]
        slope = max(0.0, (y1 - y0) / (hi - lo))
        return max(1e-6, y0 + slope * (rows - lo))


class RowCost:
    """Seconds per row of work that grows with its rows, learnt from noisy samples of
    (rows, seconds): the ratio of exponentially decayed sums, so a sample weighs by its
    rows (a big one measures the slope best; a sample of one row is mostly noise).
    Seconds are kept at the drift factor's 1.0 and answered at the current one."""

    def __init__(self, forget: float = 0.95, drift: Drift | None = None) -> None:
        self.forget = forget
        self.drift = drift
        self.seconds = 0.0  # decayed sum of samples' seconds (at factor 1)
        self.rows = 0.0     # ... and of their rows

    @property
    def factor(self) -> float:
        return self.drift.factor if self.drift is not None else 1.0

    @property
    def per_row(self) -> float:
        """Seconds a row at the current speed (0.0 before any sample)."""
        if self.rows <= 0.0:
            return 0.0
        return max(0.0, self.seconds / self.rows) * self.factor

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0:
            return
        # (a sample below zero -- a timing difference lost in noise -- counts: dropping it would bias the slope up)
        self.seconds = self.forget * self.seconds + seconds / self.factor
        self.rows = self.forget * self.rows + rows

    def __call__(self, rows: float) -> float:
        return rows * self.per_row if rows > 0 else 0.0


class VerifyCost:
    """Target decode seconds by (sequences in the batch, rows): one curve per
    sequence count (batches of many sequences and of one long sequence cost
    differently: recurrent layers run sequences in parallel, tokens in order);
    a count never measured borrows the nearest curve."""

    def __init__(self, drift: Drift | None = None, weight: float = 0.25) -> None:
        self.curves: dict[int, PiecewiseCost] = {}
        self.drift = drift
        self.weight = weight

    def curve(self, n_seqs: int) -> PiecewiseCost:
        if n_seqs not in self.curves:
            self.curves[n_seqs] = PiecewiseCost(0.02, 0.004, self.weight, self.drift)
        return self.curves[n_seqs]

    def observe(self, n_seqs: int, rows: int, seconds: float) -> None:
        self.curve(n_seqs).observe(rows, seconds)

    def calibrate(self, n_seqs: int, points: list[tuple[int, float]]) -> None:
        self.curve(n_seqs).calibrate(points)

    def __call__(self, n_seqs: int, rows: int) -> float:
        """Seconds of one decode of ``rows`` rows over ``n_seqs`` sequences; a count never
        measured is interpolated between the measured counts around it, at the same rows
        per sequence (or follows the nearest one)."""
        if not self.curves:
            return self.curve(n_seqs)(rows)
        known = self.curves.get(n_seqs)
        if known is not None and known.points:
            return known(rows)
        counts = sorted(n for n, c in self.curves.items() if c.points)
        if not counts:
            return self.curve(n_seqs)(rows)
        lo = max((n for n in counts if n < n_seqs), default=None)
        hi = min((n for n in counts if n > n_seqs), default=None)
        if lo is None or hi is None:
            near = lo if hi is None else hi
            return self.curves[near](rows)  # type: ignore[index]
        per = rows / n_seqs
        y0, y1 = self.curves[lo](max(1, round(per * lo))), self.curves[hi](max(1, round(per * hi)))
        return y0 + (y1 - y0) * (n_seqs - lo) / (hi - lo)


def equal_split(rows: list[tuple[int, int]], n_ubatch: int, sequential: bool = True,
                keep_tail: int = 0) -> list[tuple[int, int]]:
    """How llama.cpp cuts a batch into micro-batches on recurrent and hybrid memory
    (``llama_batch_allocr::split_equal``): ``rows`` holds (sequence id, tokens) per
    sequence in batch order; returns (sequences, tokens per sequence) per micro-batch.

    Every micro-batch takes the same number of tokens from each sequence in it -- with
    ``sequential`` (a per-sequence KV cache, llama.cpp's default) only from a run of
    consecutive sequence ids -- and, with ``keep_tail`` (rollback snapshots: n_rs_seq + 1),
    never splits a sequence's last ``keep_tail`` tokens. Each micro-batch is a pass over
    the weights: one sequence drafting 1 token while three draft none costs two decodes
    (4 x 1 row, then 1 x 1), about what all four drafting would.
    """
    rem = [r for _, r in rows]
    out: list[tuple[int, int]] = []
    while True:
        cur: list[int] = []
        last = 0
        for i, (sid, _) in enumerate(rows):
            if rem[i] <= 0 or (sequential and cur and sid != last + 1):
                continue
            cur.append(i)
            last = sid
            if len(cur) > n_ubatch:
                break
        if not cur:
            return out
        n = len(cur)
        t = min(min(rem[i] for i in cur), max(1, n_ubatch // n))
        if keep_tail > 0:
            n_keep = 0
            while n_keep < n and not 0 < rem[cur[n_keep]] - t < keep_tail:
                n_keep += 1
            if n_keep == 0:  # the first sequence alone: to its end, or leaving a whole tail
                i = cur[0]
                t = rem[i] if rem[i] <= n_ubatch else rem[i] - keep_tail
                cur = [i]
            else:
                cur = cur[:n_keep]
        for i in cur:
            rem[i] -= t
        out.append((len(cur), t))


@dataclass
class CostModel:
    """Measured costs of one engine's decodes (every decode curve shares one :class:`Drift`)."""

    #: the machine's speed now against when the points were measured, shared by the curves
    drift: Drift = field(default_factory=Drift)
    #: target decodes by (sequences, rows)
    verify: VerifyCost = field(init=False)
    #: an MTP draft decode by its outputs (the drafting sequences)
    draft: PiecewiseCost = field(init=False)
    #: what a catch-up row adds to a drafting step's first MTP decode, which carries every
    #: queued row (of every sequence) ahead of the drafts' start rows: learnt from those
    #: decodes' time beyond a pure draft decode of their outputs. A step is priced by the
    #: rows it will carry (:meth:`step_seconds`' ``carry``), not by how many sequences draft:
    #: drafting under way carries what the last verify accepted, a resumption after idle
    #: steps every row queued meanwhile. (One price per drafting count, before, mixed the
    #: two: four sequences on a 2-core CPU had learnt ~40 ms from resumptions where a first
    #: decode under way took ~6, and idled where one-token drafts paid.)
    catch: RowCost = field(init=False)

    #: checkpoint rollback (a context without snapshots): seconds to save one drafting
    #: sequence's recurrent state before the verify, and to restore it after a rejection
    #: (whose accepted tokens are then replayed in the next verify)
    save: float = 0.0
    restore: float = 0.0
    #: seconds a step spends outside decodes (Python, sampling, bookkeeping): paid once
    #: per step whatever its draft lengths -- next to a small model's decodes, not small
    overhead: float = 0.0
    #: how the target cuts a verify into micro-batches: (n_ubatch, sequential, keep_tail)
    #: of :func:`equal_split` on recurrent / hybrid memory; None: one decode (attention only)
    split: tuple[int, bool, int] | None = None
    #: how often a verify that carries replays was one pass anyway (its sequences' rows
    #: level): sequences whose rejections are independent make uneven layouts, extra
    #: passes; sequences in lockstep (the same prompt greedily, a batch of near-identical
    #: requests) reject together and stay level. Measured: the expected extra pass of an
    #: overflowing replay is priced at (1 - level).
    level: float = 0.0

    #: how far one observation moves an established point: the drift factor (which moves
    #: 0.3 of the way in log) takes ~90% of a change of speed, a point learns only what is
    #: its own shape. Noise in the factor costs little: it scales every decode alike.
    POINT_WEIGHT = 0.03

    def __post_init__(self) -> None:
        #: passes() by layout: equal_split was a third of a plain step's Python on one sequence
        self._passes: dict[tuple[object, ...], list[tuple[int, int]]] = {}
        self.verify = VerifyCost(self.drift, self.POINT_WEIGHT)
        self.draft = PiecewiseCost(0.004, 0.001, self.POINT_WEIGHT, self.drift)
        self.catch = RowCost(drift=self.drift)

    def sibling(self, split: tuple[int, bool, int] | None) -> CostModel:
        """The costs of the same engine on a target context with the other rollback mode
        (its verify cut by ``split``): the drift, the MTP draft curves and the step
        overhead are the same hardware's and shared; the verify curves are its own."""
        other = CostModel(drift=self.drift)
        other.draft, other.catch, other.overhead, other.split = self.draft, self.catch, self.overhead, split
        return other

    def passes(self, rows: list[int], ids: list[int] | None = None) -> list[tuple[int, int]]:
        """(sequences, rows) of each decode pass of a verify whose sequences (ids in batch
        order, default 0, 1, ...) hold ``rows`` tokens each."""
        if self.split is None:
            return [(len(rows), sum(rows))]
        key = (self.split, tuple(rows), tuple(ids) if ids is not None else None)
        got = self._passes.get(key)
        if got is None:
            n_ubatch, sequential, tail = self.split
            pairs = list(zip(ids if ids is not None else range(len(rows)), rows, strict=False))
            got = [(n, n * t) for n, t in equal_split(pairs, n_ubatch, sequential, tail)]
            if len(self._passes) >= 4096:  # layouts recur (a handful per step): a bound, not an LRU
                self._passes.clear()
            self._passes[key] = got
        return got

    def verify_layout(self, rows: list[int], ids: list[int] | None = None) -> float:
        """Seconds of such a verify: the sum of its passes."""
        return sum(self.verify(n, r) for n, r in self.passes(rows, ids))

    def row_seconds(self, n_seqs: int, rows: int) -> float:
        """What one more row per sequence costs a verify of ``n_seqs`` sequences and
        ``rows`` rows, per row (never negative)."""
        return max(0.0, (self.verify(n_seqs, rows + n_seqs) - self.verify(n_seqs, rows)) / n_seqs)

    def single_ubatch(self, rows: list[int], ids: list[int]) -> bool:
        """Whether a verify of this layout is one decode (what the per-count curves learn from)."""
        return len(self.passes(rows, ids)) <= 1

    def observe_level(self, level: bool) -> None:
        """A verify carrying replays was (``True``) or was not one pass."""
        self.level = 0.9 * self.level + 0.1 * float(level)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead = _ewma(self.overhead, seconds, 0.1)

    def observe_save(self, n: int, seconds: float) -> None:
        if n > 0:
            x = seconds / n
            # a sequence's first save also faults in the pages of its buffer (~10x a copy):
            # one such sample must not price every draft for the next hundred steps
            self.save = _ewma(self.save, min(x, 2.0 * self.save) if self.save > 0.0 else x, 0.2)

    def observe_restore(self, seconds: float) -> None:
        self.restore = _ewma(self.restore, seconds, 0.2)

    def observe_first(self, n: int, rows: int, seconds: float) -> None:
        """A drafting step's first MTP decode took ``seconds`` for ``n`` drafting
        sequences and ``rows`` rows in all (their start rows and the catch-up rows it
        carried): what it took beyond a pure draft decode of ``n`` is the rows' share."""
        if rows > n:
            self.catch.observe(rows - n, seconds - self.draft(n))

    def step_seconds(self, ks: list[int], backlog: list[int] | None = None, ids: list[int] | None = None,
                     carry: float = 0.0) -> float:
        """Seconds of a step whose sequences (``ids``, in batch order) draft ``ks`` tokens,
        with ``backlog`` replayed tokens each in the verify, and whose first MTP decode
        (if any sequence drafts) carries ``carry`` catch-up rows (0: a pure draft decode)."""
        rows = [1 + k for k in ks] if not backlog else [1 + k + b for k, b in zip(ks, backlog, strict=False)]
        t = self.overhead + self.verify_layout(rows, ids)
        longest = max(ks, default=0)
        for i in range(longest):
            t += self.draft(sum(1 for k in ks if k > i))
        if carry > 0.0 and longest > 0:
            t += self.catch(carry)
        return t


class Acceptance:
    """Per-position conditional acceptance of one sequence, exponentially weighted.

    Evidence decays every step (``tick``), observed or not. Draft lengths are
    chosen on the running estimate; whether a sequence that stopped drafting
    should be probed, and how long, is judged on an optimistic one -- the estimate
    plus a bonus that grows as its evidence fades (an upper confidence bound).
    A position with little evidence of its own follows the shallower positions.
    """

    def __init__(self, n_max: int, prior: float = 0.7, halflife: float = 32.0, pseudo: float = 3.0,
                 bonus: float = 0.3, parent: Acceptance | None = None) -> None:
        self.decay = 0.5 ** (1.0 / halflife)
        self.prior = prior
        #: what the sequence's estimates shrink towards where its own evidence is thin: the
        #: engine's pool of every sequence's evidence (same model, often the same kind of
        #: text; less this sequence's own) rather than a fixed prior -- a sequence that is
        #: not drafting hears of its acceptance only from a couple of shadow guesses every
        #: few dozen steps, and a fixed prior of 0.7 held four sequences at ~0.65 against
        #: the true 0.85 for a hundred steps
        self.parent = parent
        #: what the parent's estimate weighs at most, in observations: as much as the pool
        #: has seen besides this sequence (pooled evidence counts for more than a bare
        #: prior: one rejected first draft must not stop a new sequence), at least ``pseudo``
        self.parent_weight = 8.0
        self.pseudo = pseudo
        self.bonus = bonus
        self.hits = [0.0] * max(1, n_max)
        self.tries = [0.0] * max(1, n_max)
        self.fails = 0  # drafts in a row that did not pay for themselves (spaces out the probes)
        self.paid_last = False  # the last draft paid for itself (the next probe may come at once)

    def alpha(self, i: int) -> float:
        """The running estimate of P(draft position i accepted | earlier ones were).

        Each position shrinks towards the one before it (position 0 towards the
        prior), so a depth with little evidence of its own follows the shallower ones;
        with a ``parent``, position 0 shrinks towards the parent's estimate and each
        deeper one towards the one before it times the parent's ratio between the two
        (the pool's level for the first, its shape for the rest).
        """
        return self.alphas(i + 1)[i]

    def optimistic(self, i: int) -> float:
        return self.alphas(i + 1, optimistic=True)[i]

    def alphas(self, n: int, optimistic: bool = False, explore: float = 0.0,
               without: Acceptance | None = None, explore_power: float = EXPLORE_POWER,
               explore_pool: float = EXPLORE_POOL) -> list[float]:
        """``alpha(0 .. n-1)`` (or the optimistic estimates) in one pass over the evidence;
        ``explore``: a bonus for positions past the first, shrinking with their evidence;
        ``without``: leave that child's evidence out (a parent's estimate for the child
        must not count the child's own evidence twice); ``explore_pool``: how much the
        parent's evidence of a position counts towards what the bonus fades with."""
        hits, tries = self._evidence(without)
        return self._estimates(n, hits, tries, optimistic, explore, explore_power, explore_pool)

    def _estimates(self, n: int, hits: list[float], tries: list[float], optimistic: bool = False,
                   explore: float = 0.0, explore_power: float = EXPLORE_POWER,
                   explore_pool: float = EXPLORE_POOL) -> list[float]:
        """:meth:`alphas` on this evidence (the parent's, less this sequence's, taken once)."""
        out: list[float] = []
        est = self.prior
        base = base_tries = None
        if self.parent is not None:
            ph, base_tries = self.parent._evidence(self)
            base = self.parent._estimates(n, ph, base_tries)
        last = len(self.hits) - 1
        for i in range(n):
            j = min(i, last)
            # the pool's tries of this position (besides this sequence's)
            pooled = base_tries[min(j, len(base_tries) - 1)] if base_tries is not None else 0.0
            if i <= last:
                toward, w = est, self.pseudo
                if base is not None and base_tries is not None:  # the pool's level at position 0, its shape past it
                    toward = base[0] if i == 0 else min(1.0, est * base[i] / base[i - 1]) if base[i - 1] > 0 else est
                    # the pool weighs as much as it has seen (besides this sequence), up to parent_weight
                    w += min(max(0.0, self.parent_weight - self.pseudo), pooled)
                est = (hits[j] + w * toward) / (tries[j] + w)
            if optimistic:
                out.append(min(1.0, est + self.bonus / math.sqrt(tries[j] + 1.0)))
            elif explore > 0.0 and 0 < i <= last:
                # one position at a time: only past a position with evidence of its own
                # (a sequence new to drafting must not open with a long, dear draft)
                gate = min(1.0, tries[i - 1] / 4.0)
                # the bonus is for positions nobody has tested: where the pool has (other
                # sequences' drafts reached it), this sequence's estimate already follows
                # the pool's shape there -- a short request must not re-explore what the
                # engine knows (four ~75% sequences of 48 tokens each sat at k = 4, 0.9x of
                # k = 3, on the bonus of their few own tries)
                seen = tries[j] + explore_pool * pooled
                out.append(min(1.0, est + explore * gate / (seen + 1.0) ** explore_power))
            else:
                out.append(est)
        return out

    def _evidence(self, without: Acceptance | None = None) -> tuple[list[float], list[float]]:
        """(hits, tries) by position, less ``without``'s (a child's, counted in this pool)."""
        if without is None:
            return self.hits, self.tries
        m = min(len(self.hits), len(without.hits))
        hits = [max(0.0, h - without.hits[i]) if i < m else h for i, h in enumerate(self.hits)]
        tries = [max(h, t - without.tries[i]) if i < m else t for i, (h, t) in enumerate(zip(hits, self.tries, strict=True))]
        return hits, tries

    def tick(self) -> None:
        """One engine step passed: older evidence weighs less."""
        d = self.decay
        for i in range(len(self.hits)):
            self.hits[i] *= d
            self.tries[i] *= d

    def observe(self, drafted: int, accepted: int, paid: bool | None = None, shadow: bool = False) -> None:
        """One verify: ``drafted`` positions proposed, the first ``accepted`` taken;
        ``paid``: whether the draft earned its cost (:meth:`DraftPolicy.paid`; default:
        whether anything was accepted) -- the drafts in a row that did not space out
        the probes. ``shadow``: a guess nobody paid a verify for (evidence only)."""
        if drafted > 0 and not shadow:
            ok = accepted > 0 if paid is None else paid
            self.fails = 0 if ok else self.fails + 1
            self.paid_last = ok
        for i in range(min(drafted, len(self.hits))):
            if i > accepted:
                break  # position i was never tested: an earlier one was rejected
            self.tries[i] += 1.0
            if i < accepted:
                self.hits[i] += 1.0

    def expected_tokens(self, k: int, optimistic: bool = False) -> float:
        """Tokens one verify emits with a k-token draft: 1 + E[accepted]."""
        return self.expected_table(k, optimistic)[k]

    def rejection_table(self, k_max: int) -> list[tuple[float, float]]:
        """For k = 0 .. k_max: (P(a k-token draft is not taken whole), E[tokens accepted
        plus one, over the drafts that are not]) -- what a checkpoint rollback restores,
        and replays in the next verify."""
        out, run, rows = [(0.0, 0.0)], 1.0, 0.0
        for j, a in enumerate(self.alphas(k_max)):
            rows += run * (1.0 - a) * (j + 1)  # rejected at position j: j accepted + id_last replayed
            run *= a
            out.append((1.0 - run, rows))
        return out

    def overflow_table(self, k_max: int, backlog: int = 0) -> list[tuple[float, float]]:
        """For k = 0 .. k_max: (P, E[rows]) of a rejection whose replay -- ``backlog``
        tokens replayed now, the accepted ones and id_last -- is longer than k: the
        rows by which that sequence's next verify outgrows a k-token draft of the others
        (rejected at position j, the replay is backlog + j + 1 rows)."""
        alphas = self.alphas(k_max)
        out = []
        for k in range(k_max + 1):
            q = e = 0.0
            run = 1.0
            for j in range(k):
                p_j = run * (1.0 - alphas[j])
                over = backlog + j + 1 - k
                if over > 0:
                    q += p_j
                    e += p_j * over
                run *= alphas[j]
            out.append((q, e))
        return out

    def expected_table(self, k_max: int, optimistic: bool = False, explore: float = 0.0,
                       explore_power: float = EXPLORE_POWER, explore_pool: float = EXPLORE_POOL) -> list[float]:
        """``expected_tokens(k)`` for k = 0 .. k_max, in one pass."""
        out, total, run = [1.0], 1.0, 1.0
        for a in self.alphas(k_max, optimistic, explore, explore_power=explore_power, explore_pool=explore_pool):
            run *= a
            total += run
            out.append(total)
        return out


class Candidate(NamedTuple):
    """One sequence's say in a step's choice (a plain 4- or 5-tuple works too)."""

    #: the longest draft the sequence may verify now
    cap: int
    acc: Acceptance
    #: a fixed draft length, or None to choose
    fixed: int | None
    #: steps since it last drafted
    idle: int
    #: accepted tokens replayed in this verify after a checkpoint restore: a rejection
    #: restores the state from before them, so they are replayed again
    backlog: int = 0
    #: catch-up rows queued for it on the MTP context: the step's first MTP decode
    #: carries them if any sequence drafts (:attr:`DraftPolicy.resume_steps`)
    pending: int = 0


class DraftPolicy:
    """Chooses draft lengths for the sequences of one step."""

    def __init__(self, k_max: int, probe_every: int = 64, probe_gap: int = 8, hysteresis: float = 0.01,
                 margin: float = 0.03, probe_max: int = 512) -> None:
        self.k_max = k_max
        #: drafting must promise this much more than not drafting: the costs are estimates
        #: from noisy timings (10..20% run to run on a small shared CPU), so where they call
        #: it a tie, not drafting is the safe side
        self.margin = margin
        self.probe_gap = probe_gap  # the shortest wait before probing a sequence that stopped drafting
        #: a sequence whose last draft paid for itself is due a probe for this many steps after
        #: it (1: on the next step; 0: never for that reason) -- a probe that lands whole is
        #: evidence the estimate is behind, and waiting ``probe_gap`` steps per probe kept a
        #: new engine at ~75% on a 2-core CPU probing two-token drafts for 60 steps
        self.probe_after_paid = 1
        self.costs = CostModel()
        self.hysteresis = hysteresis
        #: after a search that drafts nothing, this many steps reuse it (while nobody is due
        #: a probe and no evidence came in that drafting may pay: :meth:`wake`): on text the
        #: drafter never gets right, the search is most of a step's Python (the estimates it
        #: reads have a half-life of dozens of steps) -- doubling (+1) after each such search
        #: in a row, up to ``quiet_max`` (one sequence at ~0% on a 2-core EPYC: the searches
        #: were ~0.5% of a 17 ms step at one in eight)
        self.quiet_steps = 7
        self.quiet_max = 31
        self._quiet = 0
        self._quiet_run = 0  # quiet searches in a row (each doubles the next quiet spell)
        self._quiet_accs: dict[int, Acceptance] = {}  # the sequences (and estimates) of that search
        self._quiet_due: set[int] = set()  # ... due a probe, but found not worth one on the optimistic estimates
        self._last: dict[int, int] = {}
        self._secs: dict[tuple[tuple[int, ...], float], float] = {}  # step_seconds of the layouts priced this choose()
        self.probe_every = probe_every
        #: optimism about draft positions past the first, shrinking as their evidence grows:
        #: they are tested only by drafts that reach them, so a sequence drafting one token
        #: never learns that the second would land (a planted 75% model: 0.85 at position 0,
        #: 0.97 at position 1 given position 0) and stays at one token for good
        self.explore = 0.3
        #: ... as explore / (evidence + 1) ** explore_power. 1.0: it is for positions not yet
        #: tested, and has faded by the time drafts reach them every step (0.3 / 47 at a
        #: half-life of 32 steps); at 0.5 it stayed at ~0.045 a position for good, and the
        #: compounded optimism held long drafts where shorter ones paid more (in-run, paired,
        #: on a 2-core Xeon: one sequence ~50% +5.8%, four ~75% +2.7%, other cells 0.99..1.01)
        self.explore_power = EXPLORE_POWER
        #: ... where the evidence is the sequence's own tries of the position plus this
        #: share of the engine pool's (other sequences'); 0.0: its own only (before 2026-12-06)
        self.explore_pool = EXPLORE_POOL
        #: the longest wait between probes, reached after drafts that did not pay kept
        #: coming (a long probe on a compute-bound CPU costs ~2..3 plain steps; every 64
        #: steps that is ~3% of plain speed where drafting never pays). The shadow guesses
        #: still move the running estimates meanwhile, so a sequence whose text turns
        #: predictable drafts again without waiting for a probe.
        self.probe_max = max(probe_max, probe_gap)
        #: paid()'s prices of the current step's layout: (plain step, what drafting adds, total drafted)
        self._paid_memo: dict[tuple[tuple[int, ...], tuple[int, ...] | None], tuple[float, float, int]] = {}
        # a sequence idle for probe_every steps is probed whatever the estimates say --
        # unless evidence still comes in without drafting (the engine's shadow guesses
        # keep ``tries[0]`` near 2..4): then the optimistic estimate alone decides
        self.fresh_evidence = 1.0
        #: rejected drafts are undone by restoring a checkpoint and replaying (no snapshots):
        #: a draft then also costs its checkpoint, and a rejection its restore and replay rows
        self.replays = False
        self._rej: list[list[tuple[float, float]]] | None = None
        self._over: list[list[tuple[float, float]]] | None = None  # Acceptance.overflow_table per sequence
        self._ids: list[int] | None = None       # this choose()'s sequences, in batch order
        self._backlog: list[int] | None = None   # their replayed tokens (None: none)
        self._sunk = 0.0                          # what the replays cost a step that drafts nothing
        #: catch-up rows the step's first MTP decode would carry, as priced (amortised: see
        #: resume_steps) and as they are (what the estimate realism is measured against uses)
        self._carry = self._carry_now = 0.0
        #: the catch-up rows queued for sequences that did not draft on the last step (a
        #: resumption: up to SKIP_KEEP = 8 rows each after a long idle spell, every row since
        #: it stopped after a short one) are priced spread over this many drafting steps --
        #: they are paid once, for the drafting run they start, and the first step of the run
        #: priced with all of them kept four sequences at ~50% on a 2-core CPU idle where one-
        #: token drafts made 1.04..1.11x plain; the queued rows of sequences that drafted on
        #: the last step (what it accepted) are paid by every drafting step, and priced whole.
        #: 1: every row priced whole.
        self.resume_steps = RESUME_STEPS
        self.estimated_tok_s = 0.0
        self.measured_tok_s = 0.0
        #: measured over estimated tokens/s (EWMA, count) of steps that drafted (True) and did not
        self._real: dict[bool, tuple[float, int]] = {True: (1.0, 0), False: (1.0, 0)}
        self._kind: bool | None = None  # which of them the step chosen last is
        self._apply = 1.0               # the realism _rate applies to drafting layouts now
        self._idle_rows = 0             # draft tokens of the layout where nobody choosing drafts
        self._ew = 0.9
        #: the other rollback mode the engine can switch its target context to (None: it
        #: cannot): its costs, whether it replays, and its realism measurements
        self.alt: CostModel | None = None
        self.alt_replays = False
        self._alt_real: dict[bool, tuple[float, int]] = {True: (1.0, 0), False: (1.0, 0)}
        #: the alternative must promise this much more (plus its switch's cost) ...
        self.switch_margin = 0.04
        #: ... compared every switch_every steps, and no sooner than switch_dwell steps after a switch
        self.switch_every = 4
        self.switch_dwell = 32
        self.switch_s = 0.1             # seconds a switch takes (measured by the engine's switches)
        self.switch_wanted = False      # the engine should switch to the alternative now
        self.switches = 0
        self._adv = 0.0                 # running log(alternative's rate / current rate)
        self._adv_n = 0
        self._cmp_accs: dict[int, Acceptance] = {}  # the sequences of the last comparison (by id)
        #: a comparison with sequences that were not in the last one starts the running
        #: advantage afresh (False: as before; for A/Bs)
        self.reset_on_join = True
        #: idle sequences may ride along a probe to keep its verify level (:meth:`_probe`;
        #: False: as before; for A/Bs)
        self.level_probes = True
        #: a draft pays only in a step whose drafts paid together (:meth:`paid_step`; False:
        #: each sequence on its own, as before; for A/Bs)
        self.whole_step_paid = True
        #: where a verify carries replays, the search tries a common row count as well as a
        #: common draft length (:meth:`_search`; False: a common draft length only, as
        #: before; for A/Bs)
        self.level_replays = True
        self._compare_in = self.switch_every  # steps to the next comparison
        self._snap_idle = False         # the last comparison's snapshot layout drafted nothing
        #: comparisons in a row that found it so (an engine memory keeps it: see SpeculativeEngine._recall)
        self.idle_comparisons = 0
        self._snap_hopeless = False     # ... and on the optimistic estimates too
        self._snap_backoff = 1          # switch_dwell multiplier before snapshots are tried again
        self._since_switch = self.switch_dwell  # a fresh engine may switch as soon as the evidence says

    def choose(self, cands: dict[int, Candidate] | dict[int, tuple]) -> dict[int, int]:  # type: ignore[type-arg]
        """Draft lengths for one step.

        ``cands[seq] = Candidate(cap, acceptance, fixed, idle, backlog=0, pending=0)``: the
        longest draft the sequence may verify now, its acceptance estimate, a fixed draft
        length (or None to choose), the steps since it last drafted, the replayed tokens
        this verify carries for it, and its catch-up rows queued on the MTP context.

        The search: the best common length for every choosing sequence (an MTP
        decode has a fixed cost, shared by all the sequences it drafts for), then
        single-sequence steps up or down while they raise the expected tokens per
        second. It runs on the running acceptance estimates; a second run on
        optimistic ones decides which sequences left at 0 get a probe, and how long.
        """
        cands = {s: Candidate(*c) for s, c in cands.items()}
        self._paid_memo.clear()  # paid()'s prices are of the step being chosen now
        self._since_switch += 1
        self._compare_in -= 1
        if self.alt is not None and self._compare_in <= 0:
            self._compare_modes(cands)
            self._compare_in = self.switch_every * (4 if self._far() else 1)
        if all(c.fixed is not None for c in cands.values()):
            # nothing to choose (fixed lengths, n-gram drafts): no search, no estimate
            self.estimated_tok_s, self._last, self._quiet = 0.0, {}, 0
            return {s: max(0, min(c.fixed or 0, c.cap)) for s, c in cands.items()}
        same = cands.keys() == self._quiet_accs.keys() and all(c.acc is self._quiet_accs[s] for s, c in cands.items())
        if self._quiet > 0 and same and all(
                c.fixed is None and c.backlog == 0 and (s in self._quiet_due or not self._due(c.acc, c.idle))
                for s, c in cands.items()):
            # nobody drafted last step, nobody is due a probe (or those due were found not
            # worth one on the optimistic estimates: at ~0% they stay due, and searching twice
            # every step was 2.5% of one sequence's plain step): the estimates move slowly
            # (a half-life of dozens of steps), so idle steps search again only every few steps
            self._quiet -= 1
            self._kind = False  # the estimate of the search it reuses still holds
            return {s: 0 for s in cands}
        if not same:
            self._quiet_run = 0  # other sequences than the quiet spell's: the backoff starts over
        seqs = list(cands)
        caps = [cands[s][0] for s in seqs]
        fixed = [cands[s][2] for s in seqs]
        auto = [i for i, f in enumerate(fixed) if f is None]
        tables = [cands[s][1].expected_table(c, explore=self.explore, explore_power=self.explore_power,
                                             explore_pool=self.explore_pool)
                  for s, c in zip(seqs, caps, strict=True)]
        self._prepare(cands, seqs, caps, fixed)
        self._apply = self.realism  # the main search prices drafts as they have turned out
        ks, best = self._search(caps, fixed, auto, tables, self.margin)
        # hysteresis: keep last step's lengths unless the new ones are clearly better
        prev = [min(self._last.get(s, -1), caps[i]) if fixed[i] is None else ks[i] for i, s in enumerate(seqs)]
        useless = any(prev[i] > 0 and tables[i][prev[i]] - 1.0 < 0.05 for i in auto)  # drafts nothing lands in
        if all(k >= 0 for k in prev) and not useless:
            floor = best / (1.0 + self.hysteresis)
            if any(prev[i] > 0 for i in auto):  # drafting on must still clear the margin over not drafting
                floor = max(floor, self._rate(self._idle(caps, fixed), tables) * (1.0 + self.margin))
            if self._rate(prev, tables) >= floor:
                ks = prev
        # sequences left at 0 that have waited long enough for a probe
        waiting = [i for i in auto if ks[i] == 0 and caps[i] > 0 and self._due(cands[seqs[i]][1], cands[seqs[i]][3])]
        self._apply = 1.0  # probes: on the model's own prices (they are what corrects the realism)
        if waiting:
            opt_tables = self._hopeless_bound(cands, seqs, caps) if self._probe_on_bound() else \
                [cands[s][1].expected_table(c, optimistic=True) for s, c in zip(seqs, caps, strict=True)]
            opt, _ = self._search(caps, fixed, auto, opt_tables)
            probing = [i for i in waiting if opt[i] > 0]
            if probing:
                # idle sequences half-way to their own probe ride along: on recurrent memory a
                # lone sequence's extra rows are a pass of their own (~0.8 of a plain step for
                # four sequences on a CPU), a probe of all of them about a third of that each
                # -- and riding along puts their next probes on the same step again
                probing += [i for i in auto if ks[i] == 0 and caps[i] > 0 and opt[i] > 0 and i not in waiting
                            and 2 * cands[seqs[i]].idle >= self.probe_wait(cands[seqs[i]].acc)]
                # where the verify is cut into micro-batches, every idle sequence may ride along:
                # a level probe of all of them is one pass where a lone one is a pass of its own
                pool = [i for i in auto if ks[i] == 0 and caps[i] > 0] \
                    if self.level_probes and self.costs.split is not None else []
                ks = self._probe(ks, probing, opt, caps, opt_tables, pool)
            for i in waiting:
                if opt[i] == 0 and self._faded(cands[seqs[i]][1], cands[seqs[i]][3]):
                    ks[i] = 1  # forced: nothing else will tell whether drafting pays again
        # the estimate realism is measured against: the running estimates alone (the explore
        # bonus is optimism on purpose -- measured against it, every draft looks short)
        plain = tables if self.explore <= 0.0 else [cands[s][1].expected_table(c) for s, c in zip(seqs, caps, strict=True)]
        self.estimated_tok_s = self._rate(ks, plain, self._carry_now)  # this step as it will cost
        # what the next observe_step() learns from: a step that drafts (or replays) or one that does not
        self._kind = bool(sum(ks) > self._idle_rows or self._backlog is not None)
        out = dict(zip(seqs, ks, strict=True))
        self._last = {s: k for s, k in out.items() if fixed[seqs.index(s)] is None}
        # quiet only after a search that was free to draft: a step whose replay barred
        # drafting (or whose caps were 0) says nothing about whether drafting pays -- at
        # four sequences in lockstep every rejection was followed by four idle steps
        free = all(caps[i] > 0 and cands[seqs[i]].backlog == 0 for i in auto)
        if len(auto) == len(seqs) and not any(ks) and free:
            self._quiet = min(self.quiet_max, (self.quiet_steps + 1) * 2 ** min(self._quiet_run, 8) - 1)
            self._quiet_run += 1
        else:
            self._quiet = self._quiet_run = 0
        self._quiet_accs = {s: c.acc for s, c in cands.items()} if self._quiet else {}
        self._quiet_due = {seqs[i] for i in waiting if ks[i] == 0} if self._quiet else set()
        return out

    def _prepare(self, cands: dict[int, Candidate], seqs: list[int], caps: list[int], fixed: list[int | None],
                 backlog: bool = True) -> None:
        """Set up :meth:`_rate` for a search over these sequences on the current costs
        (``backlog=False``: as if nothing were being replayed -- a mode's steady state)."""
        self._secs.clear()
        self._ids = seqs
        bl = [cands[s].backlog if backlog else 0 for s in seqs]
        self._backlog = bl if any(bl) else None
        self._sunk = 0.0
        pend = [cands[s].pending for s in seqs]
        self._carry_now = float(sum(pend))
        steps = max(1, self.resume_steps)
        self._carry = float(sum(p if cands[s].idle == 0 else p / steps for s, p in zip(seqs, pend, strict=True)))
        if self._backlog is not None:
            # replayed rows are paid whatever this step drafts: a step is priced by what its
            # drafts add to them (uneven rows cut the verify into more micro-batches, a draft
            # that evens them out costs little) on top of a step without replays -- a ratio
            # over a sunk cost would favour drafting into any expensive step
            zero = [0] * len(seqs)
            self._sunk = self.costs.step_seconds(zero, self._backlog, seqs) - self.costs.step_seconds(zero, None, seqs)
        self._rej = self._over = None
        if self.replays:  # a rejection also replays the backlog again
            self._rej = [[(p, rows + p * b) for p, rows in cands[s].acc.rejection_table(c)]
                         for s, c, b in zip(seqs, caps, bl, strict=True)]
            if self.costs.split is not None:
                self._over = [cands[s].acc.overflow_table(c, b) for s, c, b in zip(seqs, caps, bl, strict=True)]
        self._idle_rows = sum(self._idle(caps, fixed))

    # ------------------------------------------------------------ rollback modes

    def _swap(self) -> None:
        """Trade the current rollback mode's costs and measurements for the alternative's."""
        assert self.alt is not None
        self.alt.overhead = self.costs.overhead  # Python's share of a step: the same in either mode
        self.costs, self.alt = self.alt, self.costs
        self.replays, self.alt_replays = self.alt_replays, self.replays
        self._real, self._alt_real = self._alt_real, self._real
        self._secs.clear()

    def _compare_modes(self, cands: dict[int, Candidate]) -> None:
        """Snapshots or checkpoints: the best layout's expected tokens/s with snapshots
        (their tax on every decode included, and their realism where measured) against
        a step that drafts nothing without them, folded into a running advantage of the
        other mode; ``switch_wanted`` once it has been clear for long enough to pay for
        the switch.

        Checkpoint drafting is not what the comparison prices: with replays its model
        promised what it did not deliver (four sequences at ~75% on a CPU: 0.93x plain
        at k = 2 against 1.11x with snapshots; one sequence 1.07x against 1.23x), while
        the snapshot model measured within ~3%. So checkpoints are the mode for text
        where drafting does not pay (no tax; the policy still probes, and may draft),
        snapshots the mode for text where it does."""
        seqs = list(cands)
        caps = [cands[s].cap for s in seqs]
        fixed = [cands[s].fixed for s in seqs]
        auto = [i for i, f in enumerate(fixed) if f is None]
        if not auto or self.alt is None:
            return
        # with snapshots, on the tables their search drafts by (explore included: leaving
        # them because tables without it would not draft is leaving a mode that drafts);
        # towards them, on the running estimates alone (a switch is dear; optimism is what
        # the probes are for)
        snapshots_now = not self.replays
        tables = [cands[s].acc.expected_table(c, explore=self.explore if snapshots_now else 0.0,
                                              explore_power=self.explore_power, explore_pool=self.explore_pool)
                  for s, c in zip(seqs, caps, strict=True)]
        rates = {}
        for other in (False, True):
            if other:
                self._swap()
            try:
                self._prepare(cands, seqs, caps, fixed, backlog=False)
                if self.replays:  # checkpoints: a step that drafts nothing
                    self._apply = 1.0
                    rates["checkpoint"] = self._rate(self._idle(caps, fixed), tables)
                else:
                    self._apply = self.realism
                    ks, rates["snapshots"] = self._search(caps, fixed, auto, tables, self.margin)
                    self._snap_idle = ks == self._idle(caps, fixed)
                    # idle even on optimistic estimates, with evidence behind them? (one sequence
                    # on a CPU, one rejected first probe: nothing looked worth drafting at ~75%)
                    self._snap_hopeless = False
                    if self._snap_idle and snapshots_now and all(
                            self._heard(cands[seqs[i]].acc) >= self.HOPELESS_TRIES for i in auto):
                        self._apply = 1.0
                        # the first position's optimistic bound, every later one taken for sure
                        # (their evidence is thinnest: on one CPU sequence at ~75% they land
                        # 0.97 of the time, and an estimate shrunk towards 0.8 calls it hopeless)
                        opt = self._hopeless_bound(cands, seqs, caps)
                        self._snap_hopeless = self._search(caps, fixed, auto, opt, self.margin)[0] == ks
            finally:
                if other:
                    self._swap()
        self._apply = 1.0
        if min(rates.values()) <= 0.0:
            return
        x = math.log(rates["checkpoint"] / rates["snapshots"]) if snapshots_now else \
            math.log(rates["snapshots"] / rates["checkpoint"])
        # sequences that joined since the last comparison: the running advantage was of other
        # text (the last few sequences of a batch, idle at its end, had eight new ones leave
        # snapshots while they drafted two tokens each at a tie with idling)
        accs = {id(c.acc): c.acc for c in cands.values()}
        if self.reset_on_join and accs.keys() - self._cmp_accs.keys():
            self._adv_n = 0
        self._cmp_accs = accs  # (held: an id is not reused while its object lives)
        self._adv = x if self._adv_n == 0 else 0.7 * self._adv + 0.3 * x
        self._adv_n += 1
        self.idle_comparisons = self.idle_comparisons + 1 if self._snap_idle else 0
        if snapshots_now and self._snap_idle:
            # nothing drafts: snapshots only cost (every decode writes them) -- leave once that
            # is settled: on the optimistic estimates too (one sequence at ~75% on a CPU idles
            # for a probe's wait now and then), or for SWITCH_IDLE_N comparisons in a row. Not
            # on the priced tax: a few paired decodes at birth measure it to a few percent,
            # about its size on four sequences
            self.switch_wanted = (self._since_switch >= self.switch_dwell // 4 and (
                self.idle_comparisons >= self.SWITCH_IDLE_N or self.idle_comparisons >= 2 and self._snap_hopeless))
            return
        # otherwise the switch must pay for itself within SWITCH_HORIZON_S seconds at the
        # advantage; back to snapshots only after a backoff that doubles each time a stint
        # of them ended soon: the acceptance estimates of a sequence that does not draft
        # drift back towards the prior, and would have the engine try snapshots again every
        # few dozen steps
        need = self.switch_margin + self.switch_s / self.SWITCH_HORIZON_S
        dwell = self.switch_dwell * (1 if snapshots_now else self._snap_backoff)
        self.switch_wanted = self._adv > math.log1p(need) and self._adv_n >= 2 and self._since_switch >= dwell

    def _far(self) -> bool:
        """Far from a switch, so compared four times less often (the comparison is a search
        of its own): the other mode 5% behind or worse, or checkpoints while snapshots would
        not draft either -- only an estimate that moves can change that. Not snapshots that
        draft nothing: their way out counts comparisons (SWITCH_IDLE_N), and the advantage
        is then a running mean still full of the drafting that went before: up to 32 x 16
        steps of the snapshots' tax instead of 32 x 4 (four sequences on the shift model
        kept them through two more prompts after a drafting spell, now through one)."""
        return self.replays if self._snap_idle else self._adv < -0.05

    #: a switch of rollback mode pays for itself over this many seconds of the advantage
    SWITCH_HORIZON_S = 5.0
    #: snapshots are left once this many comparisons in a row found them idle (two, where
    #: even the optimistic estimates would not draft)
    SWITCH_IDLE_N = 32
    #: the evidence (position-0 tries, decayed; the engine's pool where there is one) behind
    #: each sequence before its optimistic estimates can call drafting hopeless
    HOPELESS_TRIES = 2.0

    #: a stint of snapshots shorter than this many dwells backs off the next (doubling, up to the max)
    SWITCH_SHORT = 4
    SWITCH_BACKOFF_MAX = 16

    @staticmethod
    def _hopeless_bound(cands: dict[int, Candidate], seqs: list[int], caps: list[int]) -> list[list[float]]:
        """Expected-token tables on the first position's optimistic bound with every later
        position taken for sure: what snapshots are left on when even it would not draft."""
        return [[1.0 + cands[s].acc.optimistic(0) * j for j in range(c + 1)] for s, c in zip(seqs, caps, strict=True)]

    def _probe_on_bound(self) -> bool:
        """Snapshots that the comparisons keep finding idle, but not hopeless: their tax is
        paid every step, and only a draft can tell whether they are worth it -- so probes
        are judged on the same bound that keeps them (a new sequence at ~1 after one at ~0
        sat out a whole run with snapshots, neither drafting nor leaving them)."""
        return (self.alt is not None and not self.replays and self.idle_comparisons >= 2
                and not self._snap_hopeless)

    @staticmethod
    def _heard(acc: Acceptance) -> float:
        """Position-0 evidence behind a sequence's estimates: its pool's (which holds its
        own and every other sequence's), else its own."""
        return (acc.parent if acc.parent is not None else acc).tries[0]

    def moved(self, src: int, dst: int) -> None:
        """The engine moved sequence ``src`` to slot ``dst``: its last draft length goes with it."""
        k = self._last.pop(src, None)
        self._last.pop(dst, None)
        if k is not None:
            self._last[dst] = k
        self._quiet = self._quiet_run = 0

    def wake(self) -> None:
        """Evidence that drafting may pay came in without a draft (a shadow guess the target
        confirmed): the next step searches again instead of reusing a quiet search. (A
        wrong guess only lowers estimates, which cannot make an idle search draft.)"""
        self._quiet = self._quiet_run = 0

    def stop_switching(self) -> None:
        """The engine cannot switch rollback modes (no room for the other context, a state
        that would not copy): price and ask for the current mode only from now on."""
        self.alt = None
        self.switch_wanted = False

    def start_in_alt(self) -> None:
        """The engine starts in the alternative rollback mode (the one an earlier engine
        ended in): its costs become the current ones, last step's choices are forgotten; no
        switch is counted or timed (:meth:`switched` does this and that)."""
        self._swap()
        self._last, self._quiet, self._quiet_run, self._kind = {}, 0, 0, None

    def switched(self, seconds: float) -> None:
        """The engine switched to the alternative rollback mode (it took ``seconds``)."""
        if not self.replays:  # leaving snapshots: a short stint backs the next one off
            short = self._since_switch < self.SWITCH_SHORT * self.switch_dwell
            self._snap_backoff = min(self.SWITCH_BACKOFF_MAX, 2 * self._snap_backoff) if short else 1
        self.start_in_alt()
        self.switch_s = _ewma(self.switch_s, seconds, 0.5)
        self._adv, self._adv_n, self._since_switch, self.switch_wanted, self.idle_comparisons = 0.0, 0, 0, False, 0
        self.switches += 1

    def paid(self, ks: list[int], i: int, accepted: int, ids: list[int] | None = None) -> bool:
        """Whether sequence ``i``'s draft of ``ks[i]`` tokens, of which ``accepted`` were
        taken, earned what it added to the step: its accepted tokens came at least as
        cheap as the tokens of a step that drafts nothing. A step's drafting cost (its
        MTP decodes and extra verify rows; with checkpoints a save, and for a rejection
        the restore and the rows it replays in the next step) is shared out by draft
        length -- exact for one sequence, and two prices a step whatever the number of
        sequences. One accepted token of a long draft resets
        nothing: where verify rows are dear, such probes lose time, and their wait
        must keep growing."""
        if ks[i] <= 0:
            return True
        base, extra = self._paid_prices(ks, i, accepted, ids)
        return accepted * base >= extra * len(ks)

    def paid_step(self, ks: list[int], accepted: list[int], ids: list[int] | None = None) -> list[bool]:
        """:meth:`paid` for every sequence of a step, where a draft pays only in a step
        whose drafts paid together: their accepted tokens came at least as cheap as the
        tokens of a step that drafts nothing (a sequence that did not draft: True).

        A sequence whose draft paid is due a probe on the next step (``probe_after_paid``),
        and where a verify is cut into micro-batches the idle sequences ride along. With
        many sequences one of them lands whatever the text: eight on a 2-core CPU at ~55%
        acceptance drafted all eight for 22 steps in a row that way (each step 0.8x the
        tokens/s of idling) -- the luckiest sequence set the pace of everyone's probes.
        One sequence: the same as :meth:`paid`."""
        if not self.whole_step_paid:  # (for A/Bs: each sequence on its own, as before)
            return [self.paid(ks, i, a, ids) for i, a in enumerate(accepted)]
        got, gain, cost = [], 0.0, 0.0
        for i, a in enumerate(accepted):
            if ks[i] <= 0:
                got.append(True)
                continue
            base, extra = self._paid_prices(ks, i, a, ids)
            got.append(a * base >= extra * len(ks))
            gain += a * base
            cost += extra * len(ks)
        if gain >= cost:
            return got
        return [ks[i] <= 0 for i in range(len(ks))]

    def _paid_prices(self, ks: list[int], i: int, accepted: int, ids: list[int] | None) -> tuple[float, float]:
        """(seconds of a step that drafts nothing, what sequence ``i``'s draft added to
        this one's) for :meth:`paid`."""
        k = ks[i]
        key = (tuple(ks), tuple(ids) if ids is not None else None)
        got = self._paid_memo.get(key)
        if got is None:
            c = self.costs
            base = c.step_seconds([0] * len(ks), None, ids)
            got = self._paid_memo[key] = (base, c.step_seconds(ks, None, ids, self._carry) - base, sum(ks))
        base, drafting, total = got
        extra = drafting * k / total
        if self.replays:
            c = self.costs
            extra += c.save
            if accepted < k:  # a restore, and the accepted tokens and the last replayed next step:
                # rows in a verify that other sequences share (level with theirs), or a pass of
                # their own (on recurrent memory, as often as replay verifies were not level)
                n = len(ks)
                rows = accepted + 1
                per_row = c.row_seconds(n, n)
                own = c.verify(1, rows) if c.split is not None and n > 1 else per_row * rows
                extra += c.restore + (1.0 - c.level) * own + c.level * per_row * rows
        return base, extra

    def _probe(self, ks: list[int], probing: list[int], opt: list[int], caps: list[int],
               opt_tables: list[list[float]], pool: list[int] | None = None) -> list[int]:
        """Probe lengths for the sequences in ``probing`` (the optimistic search drafts for
        them): the shortest common draft that pays on the optimistic estimates -- a probe
        is an experiment, and the cheapest one that can show drafting pays is the one to
        run: 1 token where short drafts pay (a memory-bound device, a shared batch), longer
        where only long ones can (a compute-bound verify on one sequence, where a 1-token
        probe loses a step and tests nothing past position 0) -- else the optimistic choice.

        ``pool``: the idle sequences that may ride along (a verify cut into micro-batches:
        one sequence drafting while seven do not is two passes, all eight drafting one
        token is one). Where a probe of all of them pays at a length the probing ones
        alone do not reach -- or pays more there -- all of them probe: eight sequences at
        ~75% on a 2-core CPU probed one to six at a time with 4..6 tokens (127..339 ms
        steps against 42 ms idle) where all eight with one token promised a gain."""
        base = self._rate(ks, opt_tables)

        def shortest(group: list[int]) -> tuple[list[int], float] | None:
            trial = list(ks)
            for k in range(1, max(opt[i] for i in group) + 1):  # (group holds probing: opt > 0)
                for i in group:
                    trial[i] = min(k, caps[i])
                r = self._rate(trial, opt_tables)
                if r > base:
                    return trial, r
            return None

        got = shortest(probing)
        if pool and set(pool) - set(probing):
            level = shortest(sorted(set(pool) | set(probing)))
            if level is not None and (got is None or level[1] > got[1]):
                got = level
        if got is not None:
            return got[0]
        trial = list(ks)
        for i in probing:
            trial[i] = opt[i]
        return trial

    def _due(self, acc: Acceptance, idle: int) -> bool:
        """Whether an idle sequence is due a probe: its backoff has passed, its last draft
        paid (``probe_after_paid``), its evidence has faded (no shadow guesses either) for
        ``probe_every`` steps, or nobody has seen any yet."""
        return (idle >= self.probe_wait(acc) or (acc.paid_last and idle < self.probe_after_paid)
                or self._faded(acc, idle) or self._unheard(acc))

    @staticmethod
    def _unheard(acc: Acceptance) -> bool:
        """Nothing seen yet, by the sequence or the engine's pool it belongs to (a fresh
        engine's first sequence): probe now -- waiting out ``probe_gap`` on the prior alone cost a run of
        128 tokens at ~97% six plain steps (0.94x of k = 6)."""
        return acc.parent is not None and acc.tries[0] <= 0.0 and acc.parent.tries[0] <= 0.0

    def _faded(self, acc: Acceptance, idle: int) -> bool:
        """Idle for ``probe_every`` steps with no fresh evidence (shadow guesses) either."""
        return idle >= self.probe_every and acc.tries[0] < self.fresh_evidence

    def probe_wait(self, acc: Acceptance) -> int:
        """Steps to wait before probing: ``probe_gap``, doubled for every failed draft in a
        row that did not pay, up to ``probe_max``."""
        factor: int = 2 ** max(0, min(acc.fails - 1, 16))
        return min(self.probe_max, self.probe_gap * factor)

    def _rate(self, ks: list[int], tables: list[list[float]], carry: float | None = None) -> float:
        """Expected tokens per second of a step drafting ``ks``: its catch-up rows as priced
        (``carry``: these instead)."""
        carry = self._carry if carry is None else carry
        # without micro-batch splits a step costs the same whichever sequence drafts what
        key = (tuple(sorted(ks)) if self.costs.split is None and self._backlog is None else tuple(ks), carry)
        secs = self._secs.get(key)
        if secs is None:
            secs = self._secs[key] = self.costs.step_seconds(ks, self._backlog, self._ids, carry) - self._sunk
        if self._rej is not None and len(self._rej) == len(ks):
            secs += self._rollback_seconds(ks, self._rej)
        rate = sum(t[k] for t, k in zip(tables, ks, strict=False)) / secs
        return rate * self._apply if self._apply != 1.0 and sum(ks) > self._idle_rows else rate

    def _rollback_seconds(self, ks: list[int], rej: list[list[tuple[float, float]]]) -> float:
        """Expected cost of checkpoint rollback for these draft lengths: a save per
        drafting sequence, a restore per rejection, the replayed rows in the next verify
        -- and, where the verify is cut into micro-batches, the extra pass that replays
        longer than the drafts make there (if the next step drafts like this one, a
        shorter replay keeps the sequence's rows level with the others'): one pass for
        the sequences whose replays overflow, priced by their expected number and rows."""
        c = self.costs
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if not drafting:
            return 0.0
        n = len(ks)
        rows = sum(1 + k for k in ks)
        per_row = c.row_seconds(n, rows)
        p_rej = sum(rej[i][ks[i]][0] for i in drafting)
        replay = sum(rej[i][ks[i]][1] for i in drafting)
        extra = 0.0
        if self._over is not None and len(self._over) == n:
            qs = [self._over[i][ks[i]] for i in drafting]
            none = 1.0
            for q, _ in qs:
                none *= 1.0 - q
            p_any = 1.0 - none
            if p_any > 1e-9:
                m = max(1, round(sum(q for q, _ in qs) / p_any))
                extra = (1.0 - c.level) * p_any * c.verify(m, max(m, round(sum(e for _, e in qs) / p_any)))
        return len(drafting) * c.save + p_rej * c.restore + replay * per_row + extra

    def _search(self, caps: list[int], fixed: list[int | None], auto: list[int],
                tables: list[list[float]], margin: float = 0.0) -> tuple[list[int], float]:
        ks = self._idle(caps, fixed)
        best = base = self._rate(ks, tables)
        if not auto:
            return ks, best
        # a common draft length; where this verify carries replays, a common row count too
        # (a sequence replaying b tokens drafts b fewer): level rows are one pass over the
        # weights, and no single-sequence move below finds them -- levelling one of four
        # replaying sequences leaves the verify as uneven as before
        bl = self._backlog
        best_ks = list(ks)
        for shift in ((None,) if bl is None or not self.level_replays else (None, bl)):
            for k in range(1, max(caps[i] for i in auto) + 1):
                for i in auto:
                    ks[i] = min(k if shift is None else max(0, k - shift[i]), caps[i])
                r = self._rate(ks, tables)
                if r > best * (1.0 + 1e-9):
                    best, best_ks = r, list(ks)
        ks = best_ks
        for _ in range(4 * len(auto)):  # single-sequence refinements (bounded)
            move = None
            for i in auto:
                for delta in (1, -1):
                    k0 = ks[i]
                    if not 0 <= k0 + delta <= caps[i]:
                        continue
                    ks[i] = k0 + delta
                    r = self._rate(ks, tables)
                    ks[i] = k0
                    if r > best * (1.0 + 1e-6):
                        best, move = r, (i, k0 + delta)
            if move is None:
                break
            ks[move[0]] = move[1]
        if best < base * (1.0 + margin):
            return self._idle(caps, fixed), base
        return ks, best

    def steady_ratios(self, accs: list[Acceptance], cap: int, others: int = 0) -> list[float]:
        """For each sequence (by its acceptance), what drafting steadily would earn: the
        best k's expected tokens per second, up to ``cap``, over a step that drafts
        nothing -- the sequence drafting alone in a batch with ``others`` sequences that
        draft nothing (their tokens counted on both sides), on the running cost estimates,
        with every first MTP decode priced as a pure draft decode (no catch-up rows).
        Above 1, drafting pays once it is under way, whatever resuming it costs. The
        batch matters: on a 2-core Xeon's prices, at ~0.66 acceptance, 1.11 alone but
        0.95 next to three idle sequences (its verify rows and MTP decodes are dear
        against a shared step of four); at 0.5, 1.00 and 0.92."""
        c = self.costs
        cap = max(1, cap)
        rest = [0] * max(0, others)
        seconds = [c.step_seconds([k, *rest]) for k in range(cap + 1)]
        out = []
        for acc in accs:
            tab = acc.expected_table(cap)
            out.append(max((tab[k] + len(rest)) / seconds[k] for k in range(1, len(tab)))
                       * seconds[0] / (1 + len(rest)))
        return out

    @staticmethod
    def _idle(caps: list[int], fixed: list[int | None]) -> list[int]:
        """The layout where every choosing sequence drafts nothing (fixed ones as fixed)."""
        return [min(f, c) if f is not None else 0 for f, c in zip(fixed, caps, strict=False)]

    @property
    def realism(self) -> float:
        """How drafting steps have measured against their estimate, relative to steps that
        do not draft (1.0 until both kinds were seen ``REALISM_MIN`` times): whatever the
        cost model misses -- replays that unlevel a shared batch, correlated rejections,
        catch-up -- shows here, and the main search scales the value of drafting by it."""
        (rd, nd), (ri, ni) = self._real[True], self._real[False]
        if nd < self.REALISM_MIN or ni < self.REALISM_MIN or ri <= 0.0:
            return 1.0
        return min(self.REALISM_MAX, max(self.REALISM_MIN_RATIO, rd / ri))

    REALISM_MIN = 8
    REALISM_MIN_RATIO = 0.6
    REALISM_MAX = 1.2

    def observe_step(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and self._kind is not None and self.estimated_tok_s > 0:
            r, n = self._real[self._kind]
            x = tokens / seconds / self.estimated_tok_s
            self._real[self._kind] = (x if n == 0 else 0.95 * r + 0.05 * x, n + 1)
            if not self._kind:  # steps without drafts: what drafting measured fades (half-life ~70 steps),
                (rd, nd), (ri, _) = self._real[True], self._real[False]  # so drafting that stopped is tried again
                self._real[True] = (rd + 0.01 * (ri - rd), nd)
        self._kind = None
        if seconds > 0:
            rate = tokens / seconds
            self.measured_tok_s = rate if self.measured_tok_s == 0 else self._ew * self.measured_tok_s + (1 - self._ew) * rate
