"""In-run A/B of the reduced draft vocabulary: plain, the full head and ``draft_vocab="auto"``
as three engines of one process, interleaved (rotating order), paired against plain.

    python bench/experiments/draft_vocab_ab.py LEVEL N_PAR ROUNDS K      (K: a draft length or auto)

Prints each engine's paired ratio to plain, its acceptance, draft and verify time per step,
and the reduced/full paired ratio. Results: draft-vocab-ab.txt.
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.speculative import SpeculativeEngine  # noqa: E402

name, n_par, rounds, k_arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
k: int | str = k_arg if k_arg == "auto" else int(k_arg)
path, prompts = A.level_model(name)
model = lm.Model(path)


def eng(dv: int | str | None, kk: int | str = k) -> SpeculativeEngine:
    mtp = kk == "auto" or int(kk) > 0
    return SpeculativeEngine(model, max_sequences=n_par, n_ctx=4096, draft_max=kk if mtp else 0,  # type: ignore[arg-type]
                             mtp=mtp, sampling=A.GREEDY, params=lm.ContextParams(n_threads=2), draft_vocab=dv)


engs = {"plain": eng(None, 0), "full": eng(None), "sub": eng("auto")}
print({x: (e.drafter.draft_vocab if e.drafter else None) for x, e in engs.items()})
n = 96 if n_par == 1 else 48
for e in engs.values():
    A.measure(e, model, prompts[:1], 16, n_par)
pairs: dict[str, list[float]] = {x: [] for x in engs}
acc = {x: [0, 0] for x in engs}
for r in range(rounds):
    order = list(engs)[r % 3:] + list(engs)[:r % 3]
    for p in prompts:
        rate = {}
        for x in order:
            tok, sec, spec = A.timed(engs[x], model, (p,), n, n_par)
            rate[x] = tok / sec
            acc[x][0] += spec.draft_n_accepted
            acc[x][1] += spec.draft_n
        for x in engs:
            pairs[x].append(rate[x] / rate["plain"])
for x, e in engs.items():
    st = e.stats
    print(x, f"vs plain {statistics.median(pairs[x]):.4f}", f"acc {acc[x][0] / max(1, acc[x][1]):.3f}",
          f"draft ms/step {st.draft_s / st.steps * 1e3:.3f} verify {st.verify_s / st.steps * 1e3:.3f}")
print("sub/full paired", statistics.median([a / b for a, b in zip(pairs["sub"], pairs["full"], strict=True)]))
