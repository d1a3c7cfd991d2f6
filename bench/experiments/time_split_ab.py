"""Where each engine's time goes, per generated token, next to plain decoding: plain, fixed k
and auto engines (with variants) of one process, interleaved (order reversed every other
round), each reported as tokens/s, its ratio to the first engine (overall, and the median
and quartiles of per-round paired ratios) and the engine's time counters per token
(prefill, draft, verify, catch-up, restore, switch, step), steps per token and k histogram.

    python bench/experiments/time_split_ab.py LEVEL N_PAR ROUNDS [ENGINES [TEMPERATURE]]

ENGINES: comma-separated, default ``0,auto``; each ``K[:VARIANT+VARIANT...]`` with K an int
(0: plain) or ``auto``. Variants: ``rb=snapshots|checkpoint`` (rollback mode forced),
``noeager`` (no eager catch-up: ``eager_idle = 0``), ``eagerratio=X`` (the engine's
``eager_ratio``), ``eagerreal`` (eager catch-up priced with the policy's realism factor),
``pol.NAME=X`` (a DraftPolicy attribute, e.g. ``pol.probe_gap=16``). TEMPERATURE (default 0,
greedy): every engine samples with adaptive.py's ``--temp`` settings.
Results: bench/README.md, "Where auto's time goes at ~50%" (2026-12-07).
"""
import statistics
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.speculative import SpeculativeEngine  # noqa: E402

level, n_par, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4].split(",") if len(sys.argv) > 4 else ["0", "auto"]
temp = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
path, prompts = A.level_model(level)
model = lm.Model(path)
FIELDS = ["prefill_s", "draft_s", "verify_s", "catch_up_s", "restore_s", "switch_s", "step_s", "steps"]


def make(name: str) -> SpeculativeEngine:
    e, rest = A.variant_engine(model, name, n_par, 2, 4096, temp)
    for key, val in rest:
        if key == "noeager":
            e.eager_idle = 0
        elif key == "eagerratio":
            e.eager_ratio = float(val)
        elif key == "eagerreal":
            steady = e.policy.steady_ratios

            def real(self: Any, accs: Any, cap: int, others: int = 0, steady: Any = steady) -> list[float]:
                return [r * self.realism for r in steady(accs, cap, others)]
            e.policy.steady_ratios = types.MethodType(real, e.policy)  # type: ignore[method-assign]
        else:
            raise SystemExit(f"unknown variant {key}")
    return e


engs = {n: make(n) for n in names}
tot = {n: dict(wall=0.0, tok=0.0, **{f: 0.0 for f in FIELDS}) for n in names}
hist: dict[str, dict[int, int]] = {n: {} for n in names}
per: dict[str, list[float]] = {n: [] for n in names}
for r in range(rounds):
    for n in (names if r % 2 == 0 else names[::-1]):
        e = engs[n]
        before = {f: getattr(e.stats, f) for f in FIELDS}
        tok, sec, spec = A.timed(e, model, prompts, 96 if n_par == 1 else 48, n_par)
        t = tot[n]
        t["wall"] += sec
        t["tok"] += tok
        per[n].append(tok / sec)
        for f in FIELDS:
            t[f] += getattr(e.stats, f) - before[f]
        for kk, v in spec.draft_length_hist.items():
            hist[n][kk] = hist[n].get(kk, 0) + v
ref = tot[names[0]]
print(f"## level {level}, {n_par} sequence(s), {rounds} rounds x {len(prompts)} prompts, {A.sampling_line(temp)}")
for n in names:
    t = tot[n]
    ms = " ".join(f"{f.removesuffix('_s')}={1000 * t[f] / t['tok']:.3f}" for f in FIELDS[:-1])
    print(f"{n}: {t['tok'] / t['wall']:.1f} tok/s, {t['tok'] / t['wall'] / (ref['tok'] / ref['wall']):.3f}x "
          f"{names[0]}; per token ms: wall={1000 * t['wall'] / t['tok']:.3f} {ms} steps/token={t['steps'] / t['tok']:.3f}")
    pr = sorted(a / b for a, b in zip(per[n], per[names[0]], strict=True))
    q = [pr[min(len(pr) - 1, int(f * len(pr)))] for f in (0.25, 0.75)]
    print(f"   paired / {names[0]}: median {statistics.median(pr):.3f} (quartiles {q[0]:.3f} .. {q[1]:.3f}); "
          f"rollback {engs[n].rollback}, {engs[n].stats.rollback_switches} switches; k {dict(sorted(hist[n].items()))}")
