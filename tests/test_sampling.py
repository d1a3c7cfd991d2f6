"""Samplers, and the exactness of speculative verification at temperature > 0."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import chi2_sf

import llama_mtp as lm
from llama_mtp.sampling import Sampler, dense
from llama_mtp.speculative import SpeculativeEngine, verify_match, verify_rejection
from llama_mtp.tiny import write_tiny_model

# ---------------------------------------------------------------- samplers

V = 10


def sp(**kw) -> Sampler:  # type: ignore[no-untyped-def]
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    return Sampler(lm.SamplingParams(**{**base, **kw}), V)


LOGITS = np.array([2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 2.5, -2.0, 1.5, 0.2], dtype=np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_distribution() -> None:
    for t in (0.5, 1.0, 2.0):
        d = dense(sp(temperature=t).distribution(LOGITS), V)
        np.testing.assert_allclose(d, softmax(LOGITS.astype(np.float64) / t), rtol=1e-9)


def test_greedy_and_bias() -> None:
    s = sp(temperature=0.0)
    assert s.sample(LOGITS) == 3 and s.argmax(LOGITS) == 3
    s = sp(temperature=0.0, logit_bias={3: float("-inf")})
    assert s.sample(LOGITS) == 6
    s = sp(logit_bias={7: 100.0})
    assert s.sample(LOGITS) == 7


def test_top_k_top_p_min_p() -> None:
    ids, p = sp(top_k=3).distribution(LOGITS)
    assert set(ids.tolist()) == {3, 6, 0}
    np.testing.assert_allclose(p.sum(), 1.0)
    probs = softmax(LOGITS.astype(np.float64))
    order = np.argsort(-probs)
    ids, _ = sp(top_p=0.6).distribution(LOGITS)
    n = int(np.searchsorted(np.cumsum(probs[order]), 0.6)) + 1
    assert set(ids.tolist()) == set(order[:n].tolist())
    ids, _ = sp(min_p=0.3).distribution(LOGITS)
    assert set(ids.tolist()) == set(np.flatnonzero(probs >= 0.3 * probs.max()).tolist())
    # top-p and min-p look at the distribution before temperature (llama.cpp's order)
    hot, _ = sp(min_p=0.3, temperature=5.0).distribution(LOGITS)
    assert set(hot.tolist()) == set(ids.tolist())


def test_penalties() -> None:
    s = sp(temperature=0.0, repeat_penalty=2.0)
    x = s.adjust(LOGITS, [3, 4])
    assert x[3] == pytest.approx(1.5) and x[4] == pytest.approx(-2.0) and x[0] == LOGITS[0]
    s = sp(presence_penalty=1.0, frequency_penalty=0.5, temperature=0.0)
    x = s.adjust(LOGITS, [6, 6, 0])
    assert x[6] == pytest.approx(2.5 - 1.0 - 1.0) and x[0] == pytest.approx(2.0 - 1.0 - 0.5)
    assert sp(temperature=0.0, repeat_penalty=100.0).sample(LOGITS, [3]) == 6


def test_seeded_streams() -> None:
    a, b = sp(seed=5), sp(seed=5)
    assert [a.sample(LOGITS) for _ in range(50)] == [b.sample(LOGITS) for _ in range(50)]
    c, d = sp(seed=5), sp(seed=5).spawn(1)
    assert [c.sample(LOGITS) for _ in range(50)] != [d.sample(LOGITS) for _ in range(50)]


def test_nonfinite_logits() -> None:
    x = np.full(V, -np.inf, dtype=np.float32)
    x[4] = 0.0
    assert sp().sample(x) == 4
    ids, p = sp(top_k=3).distribution(x)
    assert ids.tolist() == [4] and p.tolist() == [1.0]


@pytest.mark.parametrize("row", ["normal", "peaked", "flat", "ties", "ascending", "few_finite"])
@pytest.mark.parametrize("k", [1, 40, 500])
def test_top_k_finds_the_k_largest(row: str, k: int) -> None:
    """The threshold cut of a long row keeps exactly the k largest values (ties at the
    boundary: any of them), on rows that defeat a sampled threshold too."""
    from llama_mtp.sampling import _top_k

    rng = np.random.default_rng(len(row) * 1000 + k)
    n = 32000
    x = {"normal": lambda: rng.standard_normal(n), "peaked": lambda: rng.standard_normal(n) * 20,
         "flat": lambda: np.zeros(n), "ties": lambda: np.repeat(np.arange(100.0), n // 100),
         "ascending": lambda: np.arange(float(n)),
         "few_finite": lambda: np.where(rng.random(n) < 0.01, rng.standard_normal(n), -1e30)}[row]().astype(np.float32)
    got = _top_k(x, k)
    assert len(got) == k and len(set(got.tolist())) == k
    np.testing.assert_array_equal(np.sort(x[got]), np.sort(x)[n - k:])


@pytest.mark.parametrize("kw", [dict(), dict(top_k=3), dict(top_k=40), dict(top_p=0.8), dict(min_p=0.2),
                                dict(top_k=4, top_p=0.9, min_p=0.05, temperature=0.7)])
def test_a_masked_row_samples_as_its_finite_part(kw: dict) -> None:  # type: ignore[type-arg]
    """A reduced draft head's row over the whole vocabulary is -inf outside its tokens:
    the distribution is that of the finite part, token ids in ascending order (what a
    draw maps the uniform onto must not hang on numpy's partition order), and the same
    whichever tokens are masked around it."""
    rng = np.random.default_rng(5)
    n, keep = 200, np.sort(rng.choice(200, size=60, replace=False))
    finite = rng.standard_normal(60).astype(np.float32)
    row = np.full(n, -np.inf, dtype=np.float32)
    row[keep] = finite
    big = Sampler(lm.SamplingParams(**{**dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), **kw}), n)
    small = Sampler(lm.SamplingParams(**{**dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), **kw}), 60)
    ids, p = big.distribution(row)
    ids2, p2 = small.distribution(finite)
    assert np.all(np.diff(ids) > 0) or kw.get("top_p", 1.0) < 1.0 or kw.get("min_p", 0.0) > 0.0
    assert sorted(ids.tolist()) == sorted(keep[ids2].tolist())
    np.testing.assert_allclose(dense((ids, p), n)[keep], dense((ids2, p2), 60), rtol=1e-12, atol=1e-15)
    # the same seed draws the same token from either
    assert [big.sample(row) for _ in range(20)] == [int(keep[small.sample(finite)]) for _ in range(20)]


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=1.5), dict(min_p=-1), dict(top_k=-1),
                                 dict(temperature=float("nan")), dict(seed=-1), dict(logit_bias={1: float("nan")}),
                                 dict(logit_bias={-1: 1.0})])
def test_invalid_sampling_values(bad: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        lm.SamplingParams(**bad)


# ---------------------------------------------------------------- exactness, synthetic

N_SYN = 20_000
K_SYN = 3


def _synthetic_rows(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """Target logits per position (independent of history) and draft distributions q."""
    rows = rng.normal(0, 1.2, size=(8, V)).astype(np.float32)
    q = []
    for i in range(8):
        qq = softmax(rows[i].astype(np.float64) + rng.normal(0, 1.0, V))  # a biased drafter
        q.append((np.arange(V, dtype=np.int64), qq))
    return rows, q


def _generate_two(verify, rows, q, seed: int, k: int = K_SYN) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Emit tokens until two exist, drafting k tokens from q at each step."""
    target = sp(seed=seed)
    drafter, accept = target.spawn(1), target.spawn(2)
    out: list[int] = []
    while len(out) < 2:
        j = len(out)
        drafts = [int(q[j + i][0][drafter.draw(q[j + i][1])]) for i in range(k)]
        n_acc, new = verify(rows[j: j + k + 1], drafts, q[j: j + k], target, accept, out)
        out += drafts[:n_acc] + [new]
    return out[0], out[1]


def _broken_accept_p(rows, drafts, q, sampler, accept, history):  # type: ignore[no-untyped-def]
    """A wrong rule: accept with probability p(d) (ignores q), resample from p."""
    for i, d in enumerate(drafts):
        ids, p = sampler.distribution(rows[i])
        if accept.uniform() < float(p[ids == d].sum()):
            continue
        return i, sampler.sample(rows[i])
    return len(drafts), sampler.sample(rows[len(drafts)])


def _broken_residual(rows, drafts, q, sampler, accept, history):  # type: ignore[no-untyped-def]
    """A wrong rule: the right acceptance test, but the rejected token is redrawn from p, not p - q."""
    for i, d in enumerate(drafts):
        ids, p = sampler.distribution(rows[i])
        p_d = float(p[ids == d].sum())
        q_d = float(q[i][1][q[i][0] == d].sum())
        if accept.uniform() * q_d < p_d:
            continue
        return i, sampler.sample(rows[i])
    return len(drafts), sampler.sample(rows[len(drafts)])


def _chi2_gof(counts: Counter, expected: dict, n: int) -> tuple[float, int, float]:  # type: ignore[type-arg]
    stat, bins, pooled_o, pooled_e = 0.0, 0, 0, 0.0
    for key, pr in expected.items():
        e = pr * n
        o = counts.get(key, 0)
        if e < 5:
            pooled_o += o
            pooled_e += e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        bins += 1
    dof = bins - 1
    return stat, dof, chi2_sf(stat, dof)


def _synthetic_test(verify) -> float:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    rows, q = _synthetic_rows(rng)
    p0 = softmax(rows[0].astype(np.float64))
    p1 = softmax(rows[1].astype(np.float64))
    expected = {(a, b): p0[a] * p1[b] for a in range(V) for b in range(V)}
    counts = Counter(_generate_two(verify, rows, q, seed) for seed in range(N_SYN))
    return _chi2_gof(counts, expected, N_SYN)[2]


def test_rejection_sampling_is_exact_synthetic() -> None:
    assert _synthetic_test(verify_rejection) > 0.01


def test_match_is_exact_synthetic() -> None:
    """Sample-and-match with a deterministic (argmax-of-q) draft."""

    def gen(seed: int) -> tuple[int, int]:
        rng = np.random.default_rng(0)
        rows, q = _synthetic_rows(rng)
        target = sp(seed=seed)
        out: list[int] = []
        while len(out) < 2:
            j = len(out)
            drafts = [int(np.argmax(q[j + i][1])) for i in range(K_SYN)]
            n_acc, new = verify_match(rows[j: j + K_SYN + 1], drafts, target, out)
            out += drafts[:n_acc] + [new]
        return out[0], out[1]

    rows, _ = _synthetic_rows(np.random.default_rng(0))
    p0, p1 = softmax(rows[0].astype(np.float64)), softmax(rows[1].astype(np.float64))
    expected = {(a, b): p0[a] * p1[b] for a in range(V) for b in range(V)}
    counts = Counter(gen(s) for s in range(N_SYN))
    assert _chi2_gof(counts, expected, N_SYN)[2] > 0.01


@pytest.mark.parametrize("broken", [_broken_accept_p, _broken_residual])
def test_the_test_catches_a_broken_rule(broken) -> None:  # type: ignore[no-untyped-def]
    assert _synthetic_test(broken) < 0.01


# ---------------------------------------------------------------- exactness, end to end

N_E2E = 20_000
SAMPLING = dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0)
PROMPT = "Multi-token prediction drafts"


@pytest.fixture(scope="module")
def soft(tmp_path_factory: pytest.TempPathFactory) -> lm.Model:
    """A planted model whose next-token distribution is soft, with a noisy MTP head."""
    path = write_tiny_model(tmp_path_factory.mktemp("soft") / "soft.gguf", logit_scale=3.0, mtp_noise=0.25,
                            trunk_scale=0.3)
    m = lm.Model(path)
    yield m
    m.close()


def exact_distribution(model: lm.Model, n: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) of plain sampling, by enumerating the top-k tree with the model."""
    prompt = model.tokenize(PROMPT)
    sampler = Sampler(lm.SamplingParams(**SAMPLING), model.n_vocab)
    out: dict[tuple[int, ...], float] = {}
    with lm.Context(model, n_ctx=64) as ctx:
        b = lm.Batch(64)

        def walk(prefix: list[int], prob: float) -> None:
            ctx.memory.clear()
            b.clear()
            b.extend(prompt + prefix, 0, 0)
            ctx.decode(b)
            ids, p = sampler.distribution(np.array(ctx.logits(-1)))
            for t, pt in zip(ids.tolist(), p.tolist(), strict=True):
                if len(prefix) + 1 == n:
                    out[tuple(prefix + [t])] = prob * pt
                else:
                    walk(prefix + [t], prob * pt)

        walk([], 1.0)
    return out


def engine_samples(model: lm.Model, verify: str, k: int, n_samples: int, n: int = 3, seed0: int = 0,
                   mtp: bool = True) -> list[tuple[int, ...]]:
    prompt = model.tokenize(PROMPT)
    spec = lm.SpecParams(draft_max=k, verify=verify)  # type: ignore[arg-type]
    out: list[tuple[int, ...]] = []
    par = 64
    with SpeculativeEngine(model, max_sequences=par, n_ctx=16, draft_max=max(k, 1), mtp=mtp, spec=spec) as eng:
        for start in range(seed0, seed0 + n_samples, par):
            seeds = range(start, min(start + par, seed0 + n_samples))
            ids = eng.add_many([dict(prompt=prompt, max_tokens=n, ignore_eos=True,
                                     sampling=lm.SamplingParams(**SAMPLING, seed=s)) for s in seeds])
            while eng.active:
                eng.step()
            out += [tuple(eng.remove(i).tokens) for i in ids]
    return out


@pytest.mark.parametrize("verify", ["rejection", "match"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_first_tokens_follow_the_target_distribution(soft: lm.Model, verify: str, k: int) -> None:
    """The first three tokens with MTP (any k, both modes) ~ plain sampling's exact law."""
    expected = exact_distribution(soft, 3)
    got = engine_samples(soft, verify, k, N_E2E)
    stat, dof, p = _chi2_gof(Counter(got), expected, len(got))
    assert dof >= 20, dof
    assert p > 0.01, (stat, dof, p)


def test_acceptance_rejection_beats_match(soft: lm.Model, record_property) -> None:  # type: ignore[no-untyped-def]
    rates = {}
    for t in (0.7, 1.0):
        for verify in ("match", "rejection"):
            prompt = soft.tokenize(PROMPT)
            with SpeculativeEngine(soft, max_sequences=8, n_ctx=256, draft_max=3,
                                   spec=lm.SpecParams(draft_max=3, verify=verify)) as eng:  # type: ignore[arg-type]
                eng.add_many([dict(prompt=prompt, max_tokens=96, ignore_eos=True,
                                   sampling=lm.SamplingParams(temperature=t, top_k=0, top_p=1.0, min_p=0.0, seed=s))
                              for s in range(8)])
                while eng.active:
                    eng.step()
                by = eng.stats.spec.by_verify
                rates[(t, verify)] = by[verify][1] / by[verify][0]
        assert rates[(t, "rejection")] > rates[(t, "match")]
    record_property("acceptance", {f"T={t} {v}": round(r, 3) for (t, v), r in rates.items()})


def test_deterministic_with_and_without_other_sequences(soft: lm.Model) -> None:
    """Same seed, same tokens, whether the sequence runs alone or batched with others."""
    prompt = soft.tokenize(PROMPT)
    sampling = lm.SamplingParams(temperature=1.0, seed=42)
    for verify in ("rejection", "match"):
        spec = lm.SpecParams(draft_max=3, verify=verify)  # type: ignore[arg-type]
        with SpeculativeEngine(soft, max_sequences=4, n_ctx=256, draft_max=3, spec=spec) as eng:
            alone = eng.add(prompt, max_tokens=48, sampling=sampling)
            while eng.active:
                eng.step()
            want = eng.remove(alone).tokens
            others = [eng.add(soft.tokenize(t), max_tokens=60, sampling=lm.SamplingParams(temperature=1.0, seed=i))
                      for i, t in enumerate(["the model", "one pass", "every"])]
            again = eng.add(prompt, max_tokens=48, sampling=sampling)
            while eng.active:
                eng.step()
            assert eng.sequence(again).tokens == want
            assert len(others) == 3


def test_end_to_end_test_catches_a_broken_rule(soft: lm.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same end-to-end check fails when the engine verifies with a wrong rule."""
    import llama_mtp.speculative.engine as engine_mod

    monkeypatch.setattr(engine_mod, "verify_rejection", _broken_residual)
    expected = exact_distribution(soft, 3)
    got = engine_samples(soft, "rejection", 3, N_E2E)
    assert _chi2_gof(Counter(got), expected, len(got))[2] < 0.01
