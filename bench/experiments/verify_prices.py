"""What the adaptive policy prices a verify at, next to what it measures: one auto engine
runs two rounds of the adaptive benchmark's prompts; every target decode is timed and
priced on the policy's verify curves (as they stand at that step), grouped by rollback
mode and layout (rows per sequence). Prints the calibrated curves, then each level layout
seen at least three times: its median measured and priced milliseconds.

    python bench/experiments/verify_prices.py [LEVEL] [N_PAR]

Written to see whether auto at eight sequences (~75%, 2-core EPYC) drafts on a verify
priced too low (bench/README.md, "Two policy changes measured and taken back"): there,
8 x 2 rows measured 76 ms and were priced at 67, 8 x 3 104 / 98, 8 x 4 126 / 119.
"""
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402

level = sys.argv[1] if len(sys.argv) > 1 else "75"
n_par = int(sys.argv[2]) if len(sys.argv) > 2 else 8
path, prompts = A.level_model(level)
model = lm.Model(path)
e = A.engine(model, "auto", n_par, 2, 4096)
print("calibration:", e.calibration, "| rollback:", e.rollback)
for n, curve in sorted(e.policy.costs.verify.curves.items()):
    print(f"curve, {n} sequence(s): rows -> ms", {r: round(v * 1e3, 1) for r, v in sorted(curve.points.items())})
measured: dict[tuple[str, tuple[int, ...]], list[float]] = collections.defaultdict(list)
priced: dict[tuple[str, tuple[int, ...]], list[float]] = collections.defaultdict(list)
step = e._step


def timed_step(seqs: Any) -> Any:
    target = e.target
    decode = target.decode

    def timed_decode(b: Any) -> Any:
        t0 = time.perf_counter()
        out = decode(b)
        dt = time.perf_counter() - t0
        layout = tuple(sorted(collections.Counter(int(b.seq[j, 0]) for j in range(b.n_tokens)).values()))
        measured[e.rollback, layout].append(dt)
        priced[e.rollback, layout].append(e.policy.costs.verify_layout(list(layout), None))
        return out

    target.decode = timed_decode  # type: ignore[method-assign]
    try:
        return step(seqs)
    finally:
        target.decode = decode  # type: ignore[method-assign]


e._step = timed_step  # type: ignore[method-assign]
for _ in range(2):
    A.timed(e, model, prompts, 48, n_par)
for key in sorted(measured, key=lambda k: (k[0], len(k[1]), sum(k[1]))):
    mode, layout = key
    if len(measured[key]) >= 3 and len(set(layout)) == 1:
        print(f"{mode}: {len(layout)} x {layout[0]} rows, {len(measured[key])} decodes: measured "
              f"{1e3 * statistics.median(measured[key]):.1f} ms, priced {1e3 * statistics.median(priced[key]):.1f} ms")
