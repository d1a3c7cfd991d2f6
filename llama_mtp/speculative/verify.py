"""Verification of a draft against the target's logits: which drafts are accepted,
and which token comes after them. Every mode leaves the output distributed exactly
as plain sampling from the target would.

All functions take the target's logits for the verify rows ``[id_last, d_0 .. d_{k-1}]``
(row ``i`` predicts the token after ``d_{i-1}``) and return ``(n_accepted, next_token)``:
``d_0 .. d_{n_accepted-1}`` are accepted and ``next_token`` is sampled from row
``n_accepted``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from ..sampling import Distribution, Sampler

__all__ = ["verify_greedy", "verify_match", "verify_rejection"]

Rows = npt.NDArray[np.float32]


def verify_greedy(rows: Rows, drafts: Sequence[int], sampler: Sampler, history: list[int]) -> tuple[int, int]:
    """Accept while the draft is the target's argmax (temperature 0)."""
    k = len(drafts)
    if sampler._plain_greedy:
        best = rows[: k + 1].argmax(axis=1)
        n = 0
        while n < k and int(best[n]) == drafts[n]:
            n += 1
        return n, int(best[n])
    return _accept_while_equal(sampler.argmax, rows, drafts, history)


def verify_match(rows: Rows, drafts: Sequence[int], sampler: Sampler, history: list[int]) -> tuple[int, int]:
    """Sample-and-match: sample the target at each row, accept while the sample equals
    the draft. One draw per emitted token, exactly as plain sampling makes."""
    return _accept_while_equal(sampler.sample, rows, drafts, history)


def _accept_while_equal(pick: Callable[[npt.NDArray[np.float32], list[int]], int], rows: Rows,
                        drafts: Sequence[int], history: list[int]) -> tuple[int, int]:
    """Pick a token at each row (seeing the accepted drafts as history); accept the
    draft while the pick equals it; the first pick that differs (or the pick after
    the last draft) is the next token."""
    k = len(drafts)
    n = 0
    while True:
        t = pick(rows[n], history + list(drafts[:n]))
        if n < k and t == drafts[n]:
            n += 1
            continue
        return n, t


def verify_rejection(
    rows: Rows,
    drafts: Sequence[int],
    q: Sequence[Distribution],
    sampler: Sampler,
    accept: Sampler,
    history: list[int],
) -> tuple[int, int]:
    """Speculative (rejection) sampling: draft ``d_i`` was drawn from ``q_i``; accept it
    with probability ``min(1, p_i(d_i) / q_i(d_i))``; on rejection sample from
    ``normalize(max(0, p_i - q_i))``; if every draft is accepted, sample the bonus
    token from ``p_k``. ``sampler`` shapes ``p`` (same transform as plain sampling),
    ``accept`` supplies the uniforms of the acceptance tests."""
    k = len(drafts)
    for i in range(k):
        p_ids, p_probs = sampler.distribution(rows[i], history + list(drafts[:i]))
        d = drafts[i]
        q_ids, q_probs = q[i]
        p_d = float(p_probs[p_ids == d].sum())
        q_d = float(q_probs[q_ids == d].sum())
        if q_d > 0.0 and accept.uniform() * q_d < p_d:
            continue  # accepted with probability min(1, p_d / q_d)
        # residual: max(0, p - q) over the union of both supports
        ids = np.union1d(p_ids, q_ids)
        pv = np.zeros(len(ids))
        qv = np.zeros(len(ids))
        pv[np.searchsorted(ids, p_ids)] = p_probs
        qv[np.searchsorted(ids, q_ids)] = q_probs
        resid = np.maximum(pv - qv, 0.0)
        total = resid.sum()
        if total <= 0.0:  # p == q up to rounding: any draw from p is exact
            resid, total = pv, pv.sum()
        return i, int(ids[sampler.draw(resid / total)])
    return k, sampler.sample(rows[k], history + list(drafts))
