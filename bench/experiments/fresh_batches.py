"""New auto engines (no engine memory) on their first batches, next to plain decoding: per
trial, one new engine of each configuration runs the three prompts (N_PAR sequences of each
at once, spread, TOKENS tokens each), right after a long-lived plain engine ran the same;
configuration order reversed every other trial. Prints each trial's ratio to plain, the
draft lengths chosen (sequence-steps by k) and the rollback mode it ended in; then each
configuration's median and mean ratio and the median of its drafted sequence-steps.

    python bench/experiments/fresh_batches.py LEVEL N_PAR TRIALS ENGINES [TOKENS]

ENGINES: comma-separated ``auto[:VARIANT+VARIANT...]`` (adaptive.py's variant_engine:
``rb=``, ``pol.NAME=X``). The engines use n_ctx 2048 a sequence, a calibration key of
their own, and never keep an engine memory. Results: bench/README.md, "Whether a draft
paid, judged by the step" (2026-12-07).
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402

level, n_par, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4].split(",")
n_tok = int(sys.argv[5]) if len(sys.argv) > 5 else 48
N_CTX = 2048
path, prompts = A.level_model(level)
model = lm.Model(path)
plain = A.engine(model, 0, n_par, 2, N_CTX)
A.timed(plain, model, prompts[:1], 16, n_par)  # warm-up
ratios: dict[str, list[float]] = {n: [] for n in names}
drafted: dict[str, list[int]] = {n: [] for n in names}
for t in range(trials):
    for name in (names if t % 2 == 0 else names[::-1]):
        e, rest = A.variant_engine(model, name, n_par, 2, N_CTX)
        if rest:
            raise SystemExit(f"unknown variants {rest}")
        if e.remembered:
            raise SystemExit("an engine memory exists for this key: these are not fresh engines")
        tok_p, sec_p, _ = A.timed(plain, model, prompts, n_tok, n_par)
        tok_e, sec_e, spec = A.timed(e, model, prompts, n_tok, n_par)
        hist = dict(sorted(spec.draft_length_hist.items()))
        drafted[name].append(sum(v for k, v in hist.items() if k))
        ratios[name].append((tok_e / sec_e) / (tok_p / sec_p))
        print(t, name, f"{ratios[name][-1]:.3f}", hist, e.rollback, e.stats.rollback_switches, flush=True)
        e._memory_key = None  # keep no memory: the next engine is fresh too
        e.close()
for name in names:
    print(name, "vs plain: median", round(statistics.median(ratios[name]), 3), "mean",
          round(statistics.mean(ratios[name]), 3), "drafted sequence-steps: median", statistics.median(drafted[name]))
