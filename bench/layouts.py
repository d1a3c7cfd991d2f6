"""What a verify costs when its sequences carry different row counts (recurrent memory).

    python bench/layouts.py                  # 4 sequences, n_rs_seq 0 and 6 (~2 min on 2 cores)
    python bench/layouts.py --reps 30

On recurrent and hybrid memory llama.cpp cuts a batch into micro-batches that take
the same number of tokens from every sequence in them (``split_equal``; with a
per-sequence KV cache, only from runs of consecutive sequence ids; with rollback
snapshots, never splitting a sequence's last ``n_rs_seq + 1`` tokens). Each
micro-batch is a pass over the weights, so a verify where one sequence drafts a token
and three draft none costs about what all four drafting would. The adaptive policy
prices a layout by those passes (``llama_mtp.speculative.policy.equal_split``); this
script measures layouts against that prediction: each micro-batch priced at the
measured time of an even layout of its shape. Results: bench/results/layouts.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import models  # noqa: E402
from compare_upstream import RESULTS, machine  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.speculative.policy import equal_split  # noqa: E402

UNEVEN = ((2, 1, 1, 1), (1, 1, 1, 2), (3, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (4, 1, 1, 1), (3, 3, 1, 1))
PROMPT_ROWS = 20


def shapes_needed(layouts: list[tuple[int, ...]], n_ubatch: int, tail: int) -> set[tuple[int, int]]:
    out = set()
    for lay in layouts:
        out.update(equal_split(list(enumerate(lay)), n_ubatch, keep_tail=tail))
    return out


def measure(ctx: lm.Context, layout: tuple[int, ...], batch: lm.Batch) -> float:
    for s in range(ctx.n_seq_max):
        ctx.memory.seq_rm(s, -1, -1)
    batch.clear()
    for s in range(len(layout)):
        batch.extend([5] * PROMPT_ROWS, 0, s, outputs="none")
    ctx.decode(batch)
    batch.clear()
    for s, r in enumerate(layout):
        batch.extend([7] * r, PROMPT_ROWS, s, outputs="all")
    t0 = time.perf_counter()
    ctx.decode(batch)
    return time.perf_counter() - t0


def run(model: lm.Model, n_rs: int, reps: int, threads: int) -> dict[str, Any]:
    n = 4
    ctx = lm.Context(model, lm.ContextParams(n_threads=threads, n_ctx=256 * n, n_seq_max=n, n_batch=512,
                                             n_ubatch=512, n_rs_seq=n_rs))
    try:
        ctx.set_hidden_output(True)  # as the engine's target context
        tail = n_rs + 1 if n_rs else 0
        uneven = [lay for lay in UNEVEN if len(lay) == n]
        even = sorted(shapes_needed(uneven, ctx.n_ubatch, tail) | {(n, t) for t in range(1, max(map(max, uneven)) + 1)})
        # an even shape (k sequences x t rows) runs on sequences 0..k-1: one micro-batch
        probes = {lay: lay for lay in uneven} | {(k, t): (t,) * k for k, t in even}
        batch = lm.Batch(512)
        times: dict[Any, list[float]] = {key: [] for key in probes}
        for rep in range(reps + 2):  # interleaved; the first two rounds warm up
            for key, lay in probes.items():
                dt = measure(ctx, lay, batch)
                if rep >= 2:
                    times[key].append(dt)
        med = {key: statistics.median(v) for key, v in times.items()}
        rows = []
        for lay in uneven:
            parts = equal_split(list(enumerate(lay)), ctx.n_ubatch, keep_tail=tail)
            predicted = sum(med[p] for p in parts)
            level = (max(lay),) * n
            rows.append({"layout": list(lay), "ms": round(1000 * med[lay], 2), "passes": len(parts),
                         "micro_batches": [list(p) for p in parts], "predicted_ms": round(1000 * predicted, 2),
                         "ratio_to_prediction": round(med[lay] / predicted, 3),
                         "level_layout": list(level), "level_ms": round(1000 * med[(n, max(lay))], 2)})
        return {"even_ms": {f"{k}x{t}": round(1000 * med[(k, t)], 2) for k, t in even}, "uneven": rows}
    finally:
        ctx.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="0,6", help="n_rs_seq values (0: checkpoint rollback, 6: snapshots)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    path = models.bench_model(0.75)[0]
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                              "llama_cpp_commit": lm.build_info()["llama_cpp_commit"], "model": path.name,
                              "settings": {"reps": args.reps, "threads": args.threads}, "n_rs_seq": {}}
    with lm.Model(path) as model:
        for d in (int(x) for x in args.depths.split(",")):
            report["n_rs_seq"][str(d)] = run(model, d, args.reps, args.threads)
            print(f"n_rs_seq={d}: done", flush=True)
    lines = [f"### Uneven verifies: micro-batches ({report['date']})", "",
             f"{report['machine']['cpu']}, {report['machine']['cores']} cores, {args.threads} threads; "
             f"llama.cpp `{report['llama_cpp_commit']}`; {path.name}; 4 sequences, rows per sequence as listed; "
             f"median of {args.reps} interleaved decodes. Predicted: llama.cpp's split simulated "
             f"(`equal_split`), each micro-batch at the measured time of an even layout of its shape.", ""]
    for d, r in report["n_rs_seq"].items():
        lines += [f"n_rs_seq = {d} (even layouts: "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in r["even_ms"].items()) + ")", "",
                  "| rows per sequence | measured | micro-batches | predicted | measured / predicted | "
                  "level layout (every sequence at the longest) |",
                  "|---|---|---|---|---|---|"]
        for row in r["uneven"]:
            level = f"{row['level_layout']}: {row['level_ms']:.1f} ms"
            lines.append(f"| {row['layout']} | {row['ms']:.1f} ms | {row['passes']}: "
                         + " + ".join(f"{k}x{t}" for k, t in row["micro_batches"])
                         + f" | {row['predicted_ms']:.1f} ms | {row['ratio_to_prediction']:.3f} | {level} |")
        lines.append("")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layouts.json").write_text(json.dumps(report, indent=2))
    (out / "layouts.md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
