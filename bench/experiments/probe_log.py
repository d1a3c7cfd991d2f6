"""Every drafting step of one auto engine on one level (one sequence): the steps since it last
drafted, its probe back-off (fails, wait, due), the length chosen, the first position's
running and optimistic estimates, the rollback mode, and whether the draft paid.

    python bench/experiments/probe_log.py [LEVEL] [ROUNDS]

Written to find why one sequence at ~50% on a 2-core EPYC probed every 8..16 steps although
plain decoding beats every fixed k there (bench/README.md, "Idle overhead on a faster EPYC").
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402

level = sys.argv[1] if len(sys.argv) > 1 else "50"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
path, prompts = A.level_model(level)
model = lm.Model(path)
e = A.engine(model, "auto", 1, 2, 4096)
pol = e.policy
orig_choose, orig_paid = pol.choose, pol.paid
log: list[dict] = []


def choose(c):  # type: ignore[no-untyped-def]
    cc = next(iter(c.values()))
    row = dict(idle=cc.idle, fails=cc.acc.fails, wait=pol.probe_wait(cc.acc), due=pol._due(cc.acc, cc.idle),
               a0=round(cc.acc.alpha(0), 2), opt=round(cc.acc.optimistic(0), 2), mode=e.rollback)
    out = orig_choose(c)
    k = next(iter(out.values()))
    if k:
        log.append({**row, "k": k})
    return out


def paid(ks, i, acc, ids=None):  # type: ignore[no-untyped-def]
    r = orig_paid(ks, i, acc, ids)
    if log:
        log[-1].update(accepted=acc, paid=r)
    return r


pol.choose, pol.paid = choose, paid  # type: ignore[method-assign]
for rnd in range(rounds):
    t, s, spec = A.timed(e, model, prompts, 96, 1)
    print("round", rnd, f"{t / s:.1f} tok/s", dict(sorted(spec.draft_length_hist.items())))
for row in log:
    print(row)
