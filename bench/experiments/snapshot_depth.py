"""What the depth of the rollback snapshots costs a fixed-k engine: the same k with
``n_rs_seq`` = each of DEPTHS (``draft_cap``), next to plain decoding, interleaved per prompt
(order reversed every other round); paired ratios to the shallowest depth.

    python bench/experiments/snapshot_depth.py LEVEL N_PAR ROUNDS [K [DEPTHS]]

K default 1, DEPTHS default ``1,2,3,6`` (each >= K). An auto engine sizes its snapshots for
its longest draft (``AUTO_DRAFT_CAP`` = 6), so a fixed k beside it runs on shallower ones.
Results: bench/README.md, "The first MTP decode priced by the rows it carries" (2026-12-08).
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402

level, n_par, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = int(sys.argv[4]) if len(sys.argv) > 4 else 1
depths = [int(x) for x in sys.argv[5].split(",")] if len(sys.argv) > 5 else [1, 2, 3, 6]
if k < 1 or min(depths) < k:
    raise SystemExit("K >= 1 and every depth >= K")
path, prompts = A.level_model(level)
model = lm.Model(path)
engs = {"plain": A.engine(model, 0, n_par, 2, 4096)}
for d in depths:
    engs[f"k{k} depth {d}"] = A.engine(model, k, n_par, 2, 4096, draft_cap=d)
ref = f"k{k} depth {min(depths)}"
names = list(engs)
per: dict[str, list[float]] = {n: [] for n in names}
for n in names:
    A.measure(engs[n], model, prompts[:1], 16, n_par)
for r in range(rounds):
    for p in prompts:
        rate = {}
        for n in (names if r % 2 == 0 else names[::-1]):
            tok, sec, _ = A.timed(engs[n], model, (p,), 96 if n_par == 1 else 48, n_par)
            rate[n] = tok / sec
        for n in names:
            per[n].append(rate[n] / rate[ref])
print(f"## level {level}, {n_par} sequence(s), {rounds} rounds x {len(prompts)} prompts; paired / {ref}")
for n in names:
    print(f"{n}: n_rs_seq {engs[n].target.n_rs_seq}, median {statistics.median(per[n]):.3f} "
          f"{sorted(round(x, 3) for x in per[n])}")
for e in engs.values():
    e.close()
