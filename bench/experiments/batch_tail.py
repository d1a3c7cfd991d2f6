"""How much of a closed batch's time is its ragged tail: plain, fixed k and auto engines
(``time_split_ab.py``'s ``K[:VARIANT+...]`` names) in one process, interleaved (order
reversed every other round), each batch ``N_PAR`` sequences of 48 tokens from one prompt.

    python bench/experiments/batch_tail.py LEVEL N_PAR ROUNDS ENGINES

Per engine: tokens/s over whole batches; over the steps where every sequence of the batch
was live ("steady"); over the rest ("tail": sequences that drafted luckier finished first,
and their slots stay empty -- plain decoding has none); and the tail's loss, its seconds
less what its tokens cost at the steady rate, as a share of the wall clock.
Results: bench/README.md, "A verify that carries replays" (2026-12-07).
"""
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402

level, n_par, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4].split(",")
path, prompts = A.level_model(level)
model = lm.Model(path)
engs = {n: A.variant_engine(model, n, n_par, 2, 4096)[0] for n in names}
for e in engs.values():
    A.measure(e, model, prompts[:1], 16, n_par)
st: dict[str, dict[str, float]] = {n: collections.defaultdict(float) for n in names}
for r in range(rounds):
    for p in prompts:
        for n in (names if r % 2 == 0 else names[::-1]):
            e, a = engs[n], st[n]
            toks = [model.tokenize(A.spread(p, j)) for j in range(n_par)]
            t0 = time.perf_counter()
            ids = e.add_many([dict(prompt=t, max_tokens=48, ignore_eos=True) for t in toks])
            while e.active:
                kind = "full" if len(e.active) == n_par else "tail"
                t = time.perf_counter()
                ev = e.step()
                a[kind + "_s"] += time.perf_counter() - t
                a[kind + "_tok"] += sum(len(x.tokens) for x in ev)
                a[kind + "_n"] += 1
            a["wall"] += time.perf_counter() - t0
            for i in ids:
                e.remove(i)
for n in names:
    a = st[n]
    tok = a["full_tok"] + a["tail_tok"]
    steady = a["full_tok"] / a["full_s"]
    loss = a["tail_s"] - a["tail_tok"] / steady
    print(f"{n:12s} batch {tok / a['wall']:.1f} tok/s; steady {steady:.1f} tok/s ({a['full_n']:.0f} steps); "
          f"tail {a['tail_tok']:.0f} tok in {a['tail_s']:.2f} s ({a['tail_n']:.0f} steps); "
          f"tail loss {loss:.2f} s = {100 * loss / a['wall']:.1f}% of the wall clock")
