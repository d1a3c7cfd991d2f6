"""Helpers shared by the tests (importable as `helpers`: tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import llama_mtp as lm

ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = ROOT / "vendor" / "llama.cpp" / "models"


def greedy_reference(model: lm.Model, prompt: list[int], n: int, **ctx_kw) -> list[int]:
    """Plain greedy decoding, one token per decode: the ground truth."""
    with lm.Context(model, n_ctx=ctx_kw.pop("n_ctx", 512), **ctx_kw) as ctx:
        b = lm.Batch(max(len(prompt), 1))
        b.extend(prompt, 0, 0)
        ctx.decode(b)
        out = [int(np.argmax(ctx.logits(-1)))]
        pos = len(prompt)
        while len(out) < n:
            b.clear()
            b.add(out[-1], pos, 0, output=True)
            ctx.decode(b)
            out.append(int(np.argmax(ctx.logits(-1))))
            pos += 1
        return out


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    import math

    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    gln = math.lgamma(a)
    if z < a + 1.0:  # series for P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-14:
                break
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - gln))
    # continued fraction for Q (Lentz)
    tiny = 1e-300
    b = z + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return math.exp(-z + a * math.log(z) - gln) * h


def chi2_two_sample(a: dict, b: dict, min_expected: float = 5.0) -> tuple[float, int, float]:  # type: ignore[type-arg]
    """Chi-square test that two samples of categories come from one distribution.

    Categories with small expected counts are pooled into one bin. Returns
    (statistic, degrees of freedom, p-value).
    """
    keys = sorted(set(a) | set(b), key=str)
    na, nb = sum(a.values()), sum(b.values())
    rows = []
    pool = [0, 0]
    for k in keys:
        ca, cb = a.get(k, 0), b.get(k, 0)
        tot = ca + cb
        if min(tot * na, tot * nb) / (na + nb) < min_expected:
            pool[0] += ca
            pool[1] += cb
        else:
            rows.append((ca, cb))
    if sum(pool):
        rows.append(tuple(pool))
    stat = 0.0
    for ca, cb in rows:
        tot = ca + cb
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    dof = max(1, len(rows) - 1)
    return stat, dof, chi2_sf(stat, dof)
