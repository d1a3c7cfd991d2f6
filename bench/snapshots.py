"""What llama.cpp's recurrent-state snapshots (``n_rs_seq``) cost a decode that needs none.

    python bench/snapshots.py                # 1, 4 and 8 sequences (~3 min on 2 cores)
    python bench/snapshots.py --parallel 4 --steps 100
    python bench/snapshots.py --parallel 1,4 --rows 1,4   # also verifies of 3 drafts

MTP rollback of a rejected draft on a Gated-DeltaNet model needs a context whose
recurrent state keeps per-token snapshots (``n_rs_seq > 0``). Such a context pays
for them on *every* decode, also on the plain one-token-per-sequence decodes that
``draft_max="auto"`` runs while drafting does not pay -- which is why auto stays a
few percent below plain decoding on text the MTP head never gets right. This script
measures that cost alone: contexts on one model file that differ only in
``n_rs_seq``, each decoding the same one-token-per-sequence steps, interleaved;
median milliseconds per decode and the ratio to ``n_rs_seq = 0``.
Results: bench/results/snapshots.{json,md}.
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


def run(model: lm.Model, n_seqs: int, depths: list[int], steps: int, threads: int,
        n_ctx: int, rows: int = 1) -> dict[int, float]:
    """Median seconds of one decode (``rows`` tokens for each of ``n_seqs`` sequences: a
    verify of ``rows - 1`` drafts each) by n_rs_seq."""
    n_ctx = max(n_ctx, 16 + steps * rows)
    ctxs = {d: lm.Context(model, lm.ContextParams(n_threads=threads, n_ctx=n_ctx * n_seqs, n_seq_max=n_seqs,
                                                   n_rs_seq=d))
            for d in depths}
    try:
        for c in ctxs.values():
            c.set_hidden_output(True)  # as the engine's target context (MTP catch-up reads these rows)
        batch = lm.Batch(max(8, rows) * n_seqs)
        times: dict[int, list[float]] = {d: [] for d in depths}
        prompt = model.tokenize(models.PROMPT)
        for c in ctxs.values():  # a short prompt first, as in generation
            batch.clear()
            for s in range(n_seqs):
                batch.extend(prompt[:8], 0, s, outputs="last")
            c.decode(batch)
        pos = len(prompt[:8])
        for step in range(steps):
            for d, c in ctxs.items():
                batch.clear()
                for s in range(n_seqs):
                    batch.extend([prompt[(step + j) % len(prompt)] for j in range(rows)], pos, s, outputs="all")
                t0 = time.perf_counter()
                c.decode(batch)
                times[d].append(time.perf_counter() - t0)
            pos += rows
        skip = min(5, steps // 4)  # the first decodes also build graphs and touch fresh memory
        return {d: statistics.median(v[skip:]) for d, v in times.items()}
    finally:
        for c in ctxs.values():
            c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", default="1,4,8", help="sequences per decode, e.g. 1,4,8")
    ap.add_argument("--rows", default="1", help="tokens per sequence per decode, e.g. 1,4 (4: a verify of 3 drafts)")
    ap.add_argument("--depths", default="0,1,6", help="n_rs_seq values to compare (0 first: the baseline)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    depths = sorted({int(x) for x in args.depths.split(",")})
    if depths[0] != 0:
        ap.error("--depths must include 0 (the baseline)")
    path = models.bench_model(0.75)[0]
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                              "llama_cpp_commit": lm.build_info()["llama_cpp_commit"], "model": path.name,
                              "settings": {"steps": args.steps, "threads": args.threads, "depths": depths},
                              "sequences": {}}
    with lm.Model(path) as model:
        for rows in (int(x) for x in args.rows.split(",")):
            for n in (int(x) for x in args.parallel.split(",")):
                med = run(model, n, depths, args.steps, args.threads, args.n_ctx, rows)
                key = str(n) if rows == 1 else f"{n}x{rows}"
                report["sequences"][key] = {str(d): {"ms": round(1000 * t, 3), "vs_0": round(t / med[0], 4)}
                                            for d, t in med.items()}
                print(f"{n} sequence(s) x {rows} row(s): " + "  ".join(
                    f"n_rs_seq={d}: {1000 * t:.2f} ms ({t / med[0]:.3f}x)" for d, t in med.items()), flush=True)
    lines = [f"### n_rs_seq snapshots: what a decode pays for them ({report['date']})", "",
             f"{report['machine']['cpu']}, {report['machine']['cores']} cores, {args.threads} threads; "
             f"llama.cpp `{report['llama_cpp_commit']}`; {path.name}; median of {args.steps} interleaved decodes; "
             f"`N` = N sequences x 1 token, `NxR` = N sequences x R tokens (a verify of R - 1 drafts each).", "",
             "| sequences | " + " | ".join(f"n_rs_seq={d}" for d in depths) + " |",
             "|---|" + "---|" * len(depths)]
    for n, row in report["sequences"].items():
        lines.append(f"| {n} | " + " | ".join(f"{row[str(d)]['ms']:.2f} ms ({row[str(d)]['vs_0']:.3f}x)"
                                               for d in depths) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapshots.json").write_text(json.dumps(report, indent=2))
    (out / "snapshots.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
