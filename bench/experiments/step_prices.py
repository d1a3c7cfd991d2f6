"""A drafting step's price, part by part, next to what it measured: one auto engine runs the
adaptive benchmark's prompts (ROUNDS rounds, 48 tokens a sequence); for every step where all
N_PAR sequences draft the same length, the policy's expected tokens (running estimates),
its verify, MTP-decode and whole-step seconds are logged with the step's measured tokens and
time counters; printed as means per rollback mode and length.

    python bench/experiments/step_prices.py LEVEL N_PAR ROUNDS

Eight sequences at ~75% on the 2-core EPYC (2026-12-07 night, 3 rounds): expected tokens
matched (k = 1: 14.4 / 14.8 ... k = 5: 40.2 / 42.0), steps were priced 6..8% low (verify
6..10%, the MTP decodes 25..55%).
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

level, n_par, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path, prompts = A.level_model(level)
model = lm.Model(path)
e = A.engine(model, "auto", n_par, 2, 4096)
pol = e.policy
cur: dict[str, Any] = {}
choose = pol.choose


def priced_choose(cands: Any) -> Any:
    ks = choose(cands)
    seqs = sorted(ks)
    kl = [ks[s] for s in seqs]
    tables = [cands[s][1].expected_table(cands[s][0]) for s in seqs]
    c = pol.costs
    cur.update(ks=tuple(kl), mode=e.rollback,
               tokens=sum(t[min(k, len(t) - 1)] for t, k in zip(tables, kl, strict=True)),
               verify=c.verify_layout([1 + k for k in kl], None),
               draft=sum(c.draft(sum(1 for k in kl if k > i)) for i in range(max(kl, default=0))),
               step=c.step_seconds(kl))
    return ks


pol.choose = priced_choose  # type: ignore[method-assign]
step = e.step
log: dict[tuple[str, int], list[tuple[float, ...]]] = collections.defaultdict(list)


def logged_step() -> Any:
    s0 = e.stats.as_dict()
    cur.clear()
    t0 = time.perf_counter()
    events = step()
    dt = time.perf_counter() - t0
    s1 = e.stats.as_dict()
    if cur and len(cur["ks"]) == n_par and len(set(cur["ks"])) == 1:
        got = sum(len(x.tokens) for x in events)
        log[cur["mode"], cur["ks"][0]].append((cur["tokens"], got, cur["verify"], s1["verify_s"] - s0["verify_s"],
                                               cur["draft"], s1["draft_s"] - s0["draft_s"], cur["step"], dt))
    return events


e.step = logged_step  # type: ignore[method-assign]
for _ in range(rounds):
    A.timed(e, model, prompts, 48, n_par)
for (mode, k), rows in sorted(log.items()):
    if len(rows) < 3:
        continue
    m = [statistics.mean(r[i] for r in rows) for i in range(8)]
    print(f"{mode:10s} k={k} steps {len(rows):3d}: tokens expected {m[0]:5.1f} got {m[1]:5.1f} | ms, priced / "
          f"measured: verify {1e3 * m[2]:6.1f} / {1e3 * m[3]:6.1f}, MTP decodes {1e3 * m[4]:5.1f} / "
          f"{1e3 * m[5]:5.1f}, step {1e3 * m[6]:6.1f} / {1e3 * m[7]:6.1f}")
