"""Where one speculative step spends its time: the engine's own time split, and a
cProfile of the Python around the decodes.

    python bench/profile_step.py                        # ~75% model, one sequence, k=3
    python bench/profile_step.py --parallel 4 -k auto   # four sequences, adaptive
    python bench/profile_step.py --size 1.6b            # the GPU benchmark model

Prints the split (draft / verify / catch-up / restore / Python, from the engine's
counters) and the functions with the most time of their own. Writes nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import models  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.speculative import SpeculativeEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.3b", choices=sorted(models.SIZES))
    ap.add_argument("--level", type=int, default=75, help="acceptance level in percent")
    ap.add_argument("-k", "--draft-max", default="3", help="draft length, or auto")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rollback", default="auto", choices=["auto", "snapshots", "checkpoint"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--explain", action="store_true",
                    help="also print what the adaptive policy believes: its cost curves, expected vs "
                         "measured speed, the draft lengths it chose")
    args = ap.parse_args()
    k: int | str = args.draft_max if args.draft_max == "auto" else int(args.draft_max)

    path, _, _ = models.bench_model(args.level / 100, size=args.size)
    with lm.Model(path) as model, SpeculativeEngine(
            model, max_sequences=args.parallel, n_ctx=1024, draft_max=k, sampling=lm.SamplingParams(temperature=0),
            params=lm.ContextParams(n_threads=args.threads), rollback=args.rollback) as eng:  # type: ignore[arg-type]
        toks = model.tokenize(models.PROMPT)

        def generate(n: int) -> float:
            ids = eng.add_many([dict(prompt=toks, max_tokens=n, ignore_eos=True) for _ in range(args.parallel)])
            t0 = time.perf_counter()
            while eng.active:
                eng.step()
            dt = time.perf_counter() - t0
            return sum(len(eng.remove(i).tokens) for i in ids) / dt

        generate(16)  # warm-up: graphs, pages
        before = eng.stats.as_dict()
        prof = cProfile.Profile()
        prof.enable()
        rate = generate(args.tokens)
        prof.disable()
        after = eng.stats.as_dict()
        rollback, costs = eng.rollback, eng.policy.costs
        explain = policy_view(eng) if args.explain else ""
    split = {key: after[key] - before[key] for key in ("draft_s", "verify_s", "catch_up_s", "restore_s", "python_s",
                                                       "step_s")}
    step = split["step_s"] or 1.0
    print(f"{path.name}: {args.parallel} sequence(s), k={k}, rollback {rollback}, {rate:.1f} tok/s (under cProfile)")
    if costs.save or costs.restore:
        print(f"  checkpoint save {costs.save * 1e3:.2f} ms, restore {costs.restore * 1e3:.2f} ms (calibration)")
    print("  " + ", ".join(f"{key[:-2]} {v * 1e3:.1f} ms ({v / step:.1%})" for key, v in split.items() if key != "step_s"))
    if explain:
        print(explain)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue())


def policy_view(eng: SpeculativeEngine) -> str:
    """The adaptive policy's picture of this machine and text, in milliseconds."""
    c, st = eng.policy.costs, eng.stats

    def ms(points: dict[int, float]) -> str:
        return ", ".join(f"{r}: {v * 1e3:.2f}" for r, v in sorted(points.items()))

    lines = [f"  policy: expected {st.estimated_tok_s:.0f} tok/s, measured {st.measured_tok_s:.0f} tok/s; "
             f"overhead {c.overhead * 1e3:.2f} ms a step; drafts chosen {dict(sorted(st.spec.draft_length_hist.items()))}"]
    for n, curve in sorted(c.verify.curves.items()):
        lines.append(f"  verify, {n} sequence(s), ms by rows: {ms(curve.now())}")
    lines.append(f"  MTP draft decode, ms by outputs: {ms(c.draft.now())}; a catch-up row in the first: {c.catch.per_row * 1e3:.3f}; "
                 f"speed drift since calibration: x{c.drift.factor:.3f}")
    lines.append(f"  acceptance by position: {st.spec.accepted_per_position}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
