"""What an idle auto engine's step costs next to plain decoding's, interleaved step by step
(one step of each, the order swapped every step) -- the finest interleaving there is:
batch-level A/Bs on this 2-core machine move by several percent from batch to batch.

    python bench/experiments/idle_steps.py LEVEL N_PAR ROUNDS

The auto engine keeps checkpoints (no snapshots' tax) and drafting is priced out (an MTP
decode costs a second), so it never drafts; it still queues, skips and flushes catch-up
rows and runs the policy's quiet searches, as an idle auto engine does. Only the steps
where every sequence of the batch is live are counted. Prints per engine: the verify
decode's median and mean, the whole step's mean, and what is not the verify (Python, and
the MTP decodes of catch-up flushes).
Results: bench/README.md, "A verify that carries replays" (2026-12-07).
"""
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.context import Context  # noqa: E402

level, n_par, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path, prompts = A.level_model(level)
model = lm.Model(path)
engines = {"plain": A.engine(model, 0, n_par, 2, 4096),
           "auto idle": A.engine(model, "auto", n_par, 2, 4096, rollback="checkpoint")}
costs = engines["auto idle"].policy.costs
costs.draft.points.clear()
costs.draft.calibrate([(1, 1.0), (n_par, 1.0)])
costs.draft.observe = costs.catch.observe = lambda *a: None  # type: ignore[method-assign]
targets = {id(e.target) for e in engines.values()}
last: dict[str, float] = {}
decode = Context.decode


def timed_decode(self: Context, *args: Any, **kw: Any) -> Any:
    t = time.perf_counter()
    out = decode(self, *args, **kw)
    key = "verify" if id(self) in targets else "mtp"
    last[key] = last.get(key, 0.0) + time.perf_counter() - t
    return out


Context.decode = timed_decode  # type: ignore[method-assign]
got: dict[str, dict[str, list[float]]] = {n: {"verify": [], "step": [], "mtp": []} for n in engines}
n_steps = 0
for _ in range(rounds):
    for p in prompts:
        toks = [model.tokenize(A.spread(p, j)) for j in range(n_par)]
        ids = {n: e.add_many([dict(prompt=t, max_tokens=48, ignore_eos=True) for t in toks])
               for n, e in engines.items()}
        while any(e.active for e in engines.values()):
            names = list(engines) if n_steps % 2 == 0 else list(engines)[::-1]
            n_steps += 1
            for n in names:
                e = engines[n]
                if not e.active:
                    continue
                full = len(e.active) == n_par
                last.clear()
                t0 = time.perf_counter()
                e.step()
                dt = time.perf_counter() - t0
                if full and "verify" in last:
                    got[n]["verify"].append(last["verify"])
                    got[n]["step"].append(dt)
                    got[n]["mtp"].append(last.get("mtp", 0.0))
        for n, e in engines.items():
            for i in ids[n]:
                e.remove(i)
assert not engines["auto idle"].stats.spec.draft_n, "the idle engine drafted"
print(f"## level {level}, {n_par} sequences, {rounds} rounds x {len(prompts)} prompts, steps interleaved")
for n, g in got.items():
    v, s, m = g["verify"], g["step"], g["mtp"]
    print(f"{n:9s} {len(v)} steps: verify median {1e3 * statistics.median(v):.2f} mean {1e3 * statistics.mean(v):.2f} ms; "
          f"step mean {1e3 * statistics.mean(s):.2f} ms; not the verify {1e3 * (statistics.mean(s) - statistics.mean(v)):.2f} ms "
          f"(MTP catch-up decodes {1e3 * statistics.mean(m):.2f})")
