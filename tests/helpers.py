"""Helpers shared by the tests (importable as `helpers`: tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import llama_mtp as lm

ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = ROOT / "vendor" / "llama.cpp" / "models"


#: Layers run on a GPU here (a GPU build with a device; models offload by default).
GPU = bool(lm.build_info()["capabilities"]["gpu_offload"])
#: How far logits of one position may move with the batch it is decoded in. On a CPU ~1e-6
#: with F32 weights. On a GPU the batched kernels (ggml-cuda's tensor-core paths) round F32
#: products through TF32: a verify of k+1 rows and a one-row decode differ by ~2e-3 of the
#: logits' scale (measured on an H200: up to 0.0073 on logits of magnitude ~3,
#: tests/test_context.py), so where the reference's two best logits are closer than
#: NEAR_TIE greedy decoding may resolve the near-tie either way (README, "Exactness").
#: On a CPU no slack at all: the tests demand the same tokens.
LOGITS_RTOL_GPU = 4e-3
NEAR_TIE = 2e-2 if GPU else 0.0


def logits_atol(reference: np.ndarray, cpu: float) -> float:
    """Absolute tolerance for logits compared across batchings: ``cpu`` on a CPU, a share
    of the logits' scale on a GPU."""
    return LOGITS_RTOL_GPU * max(1.0, float(np.abs(reference).max())) if GPU else cpu


def greedy_reference(model: lm.Model, prompt: list[int], n: int, **ctx_kw) -> list[int]:
    """Plain greedy decoding, one token per decode: the ground truth."""
    return greedy_reference_margins(model, prompt, n, **ctx_kw)[0]


def greedy_reference_margins(model: lm.Model, prompt: list[int], n: int, **ctx_kw) -> tuple[list[int], list[float]]:
    """Plain greedy decoding, and at each step the gap between the two best logits."""
    out: list[int] = []
    margins: list[float] = []

    def take(logits: np.ndarray) -> None:
        top = np.partition(logits, len(logits) - 2)[-2:]
        out.append(int(np.argmax(logits)))
        margins.append(float(top[1] - top[0]))

    with lm.Context(model, n_ctx=ctx_kw.pop("n_ctx", 512), **ctx_kw) as ctx:
        b = lm.Batch(max(len(prompt), 1))
        b.extend(prompt, 0, 0)
        ctx.decode(b)
        take(ctx.logits(-1))
        pos = len(prompt)
        while len(out) < n:
            b.clear()
            b.add(out[-1], pos, 0, output=True)
            ctx.decode(b)
            take(ctx.logits(-1))
            pos += 1
        return out, margins


def assert_greedy_matches(got: list[int], ref: tuple[list[int], list[float]], near_tie: float = NEAR_TIE) -> None:
    """``got`` is the reference token for token -- or parts from it only where the
    reference itself stood on a near-tie (two best logits within ``near_tie``; 0 on a CPU:
    no parting at all), after which nothing more can be compared."""
    tokens, margins = ref
    for i, (g, r) in enumerate(zip(got, tokens, strict=False)):  # lengths: checked after
        if g != r:
            assert margins[i] < near_tie, (
                f"token {i}: {g} where plain greedy decoding gives {r} (its two best logits {margins[i]:.3g} apart)"
                f"\n got {got}\n ref {tokens}")
            return
    assert len(got) == len(tokens), f"{len(got)} tokens where the reference has {len(tokens)}"


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


def count_decodes(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """Every ``Context.decode`` from now on (this test), as its batch's token count."""
    calls: list[int] = []
    real = lm.Context.decode

    def counting(self: lm.Context, batch: lm.Batch) -> None:
        calls.append(batch.n_tokens)
        real(self, batch)

    monkeypatch.setattr(lm.Context, "decode", counting)
    return calls
