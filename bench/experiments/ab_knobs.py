"""In-run A/B of the auto policy's knobs: plain, one fixed k, main's auto and a variant's
auto as four engines of one process, interleaved (rotating order), paired against plain.

    python bench/experiments/ab_knobs.py LEVEL N_PAR ROUNDS [K_REF]   (env VAR=<variant>)

Variants (set on the variant engine's policy): trust (margin 0, no realism factor),
sticky (trust + hysteresis 0.1), norealism, snap (rollback="snapshots"); with
realism-sums.patch applied (it keeps main's path behind ``DraftPolicy.REALISM_SUMS``,
which this script sets False on the main engine): sums (the patch alone), sumstrust
(+ margin 0), noback (+ margin 0, probe_max = probe_gap). For those, the "main" engine
gets ``eager_idle = 0`` (every idle sequence queues its catch-up rows, as before eager
catch-up landed), so no variant (VAR unset) compares eager catch-up with queueing; queue:
both queue. (The eager-catch-up patch's none / priced variants of eager-catch-up-ab.txt
are what landed: priced, plus no eager flush while another sequence drafts.) Against
main as it is: noexplore (explore 0), sqrt (the explore bonus fading as 1 / sqrt(evidence),
not 1 / evidence: main before 2026-12-06, whose A/B ran as "explore1", the variant then).
Against main as it is (2026-12-06, second session): alone (eager catch-up priced as if each
sequence were alone in the batch), stalefar (idle snapshots compared every 16 steps while the
running advantage remembers drafting), fullq (long-idle sequences queue every row until a
flush drops all but the last SKIP_KEEP), halfexplore (explore bonus 0.15), power<x> (the
explore bonus fading as 1 / evidence ** x); ownexplore: *main* fades the explore bonus with
the sequence's own tries only (before 2026-12-06 evening), the variant as main is (the pool's
tries count too). calib0 (with calibrate-running.patch applied):
*main* calibrated at position 0 (CALIBRATION_WINDOW = 0), the variant on running sequences.
quietback: *main* reuses a quiet search for 7 steps (not 7, 15, 31), wakes on every shadow
guess and prices eager catch-up every step (before 2026-12-06 night), the variant as main is.
spare: *main* builds a new target context at every switch of rollback mode (before 2026-12-06
night), the variant keeps the one it left (as main is).
Results: knobs-50-xeon-ab.txt, eager-catch-up-ab.txt, explore-ab.txt, idle-overhead-ab.txt.
"""
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.speculative import SpeculativeEngine  # noqa: E402
from llama_mtp.speculative.engine import CATCH_UP_QUEUE  # noqa: E402

name, n_par, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ref = int(sys.argv[4]) if len(sys.argv) > 4 else 2
path, prompts = A.level_model(name)
model = lm.Model(path)
engs = {"plain": A.engine(model, 0, n_par, 2, 4096), f"k{ref}": A.engine(model, ref, n_par, 2, 4096),
        "main": A.engine(model, "auto", n_par, 2, 4096), "var": A.engine(model, "auto", n_par, 2, 4096)}
engs["main"].policy.REALISM_SUMS = False  # main's path where the patch is applied; harmless without it
var = os.environ.get("VAR", "")
if var in ("", "queue", "trust", "sticky", "norealism", "snap", "sums", "sumstrust", "noback"):
    engs["main"].eager_idle = 0  # main before EAGER_IDLE (queue every idle sequence)
pol = engs["var"].policy  # the variant's
if var == "queue":  # the variant queues too (both engines as before EAGER_IDLE)
    engs["var"].eager_idle = 0
if var in ("trust", "sticky", "norealism"):
    pol.REALISM_MIN = 10**9
if var in ("trust", "sticky", "sumstrust", "noback"):
    pol.margin = 0.0
if var == "sticky":
    pol.hysteresis = 0.1
if var == "halfexplore":  # explore bonus 0.15 (main: 0.3)
    pol.explore = 0.15
if var.startswith("power"):  # the explore bonus fading as 1 / evidence ** power (main: 1)
    pol.explore_power = float(var[5:])
if var == "ownexplore":  # *main* fades the explore bonus with the sequence's own tries only (before 2026-12-06 eve)
    engs["main"].policy.explore_pool = 0.0
if var == "noexplore":
    pol.explore = 0.0
if var == "sqrt":  # the explore bonus shrinking as 1/sqrt(evidence), as before 2026-12-06
    pol.explore_power = 0.5
if var == "alone":  # eager catch-up priced as if each sequence were alone in the batch (before 2026-12-06 noon)
    _ratios = pol.steady_ratios
    pol.steady_ratios = lambda accs, cap, others=0: _ratios(accs, cap)  # type: ignore[method-assign]
if var == "stalefar":  # idle snapshots compared every 16 steps while the advantage is stale (before 2026-12-06)
    pol._far = lambda: pol._adv < -0.05 or (pol.replays and pol._snap_idle)  # type: ignore[method-assign]
if var == "fullq":  # long-idle sequences queue every row until a flush drops them (before 2026-12-06 noon)
    _d = engs["var"].drafter
    _skip = _d.skip
    _d.skip = lambda seq, keep: _skip(seq, keep) if _d.pending(seq) > CATCH_UP_QUEUE else 0  # type: ignore[method-assign]
if var == "calib0":  # with calibrate-running.patch: main calibrated at position 0, as main is
    from llama_mtp.speculative import engine as _em
    _w, _em.CALIBRATION_WINDOW = _em.CALIBRATION_WINDOW, 0
    engs["main"].close()
    engs["main"] = A.engine(model, "auto", n_par, 2, 4096)
    _em.CALIBRATION_WINDOW = _w
if var == "spare":  # *main* closes the context of the mode it leaves (a switch builds a new one), as before 2026-12-06 night
    _m = engs["main"]
    if _m._spare is not None:
        _m._spare.close()
        _m._spare = None
    _m._stash = lambda ctx: ctx.close()  # type: ignore[method-assign]
if var == "quietback":  # *main* as before 2026-12-06 night: a quiet search reused for 7 steps, not 7/15/31;
    # every shadow guess wakes the policy (not only a confirmed one); eager catch-up priced every step
    _m = engs["main"]
    _m.policy.quiet_max = _m.policy.quiet_steps
    _shadow = _m._shadow_evidence

    def _wake_all() -> None:
        _shadow()
        if _m.drafter is not None and _m.drafter.shadow_predictions:
            _m.policy.wake()
    _m._shadow_evidence = _wake_all  # type: ignore[method-assign]
    _eager = _m._eager

    def _eager_every_step(live, queued):  # type: ignore[no-untyped-def]
        for q in live:
            q.eager_at = -(1 << 30)
        return _eager(live, queued)
    _m._eager = _eager_every_step  # type: ignore[method-assign]
if var == "noback":
    pol.probe_max = pol.probe_gap
if var == "snap":
    engs["var"].close()
    engs["var"] = SpeculativeEngine(model, max_sequences=n_par, n_ctx=4096, draft_max="auto", mtp=True,
                                    sampling=A.GREEDY, params=lm.ContextParams(n_threads=2), rollback="snapshots")
n = 96 if n_par == 1 else 48
for e in engs.values():
    A.measure(e, model, prompts[:1], 16, n_par)
pairs = {k: [] for k in engs}
hist = {k: {} for k in engs}
keys = list(engs)
for r in range(rounds):
    order = keys[r % 4:] + keys[:r % 4]
    for p in prompts:
        rate = {}
        for k in order:
            tok, sec, spec = A.timed(engs[k], model, (p,), n, n_par)
            rate[k] = tok / sec
            for a, b in spec.draft_length_hist.items():
                hist[k][a] = hist[k].get(a, 0) + b
        for k in keys:
            pairs[k].append(rate[k] / rate["plain"])
    print(r, {k: round(statistics.median(v), 3) for k, v in pairs.items()}, flush=True)
print(name, f"x{n_par}", {k: round(statistics.median(v), 4) for k, v in pairs.items()},
      "var/main paired", round(statistics.median(a / b for a, b in zip(pairs["var"], pairs["main"], strict=True)), 4))
print("switches main", engs["main"].stats.rollback_switches, f"{engs['main'].stats.switch_s:.3f} s",
      "var", engs["var"].stats.rollback_switches, f"{engs['var'].stats.switch_s:.3f} s")
for _k in ("plain", "main", "var"):
    _st = engs[_k].stats
    _per = 1e3 / max(1, _st.spec.predicted_n)
    print(f"  {_k}: ms/token verify {_st.verify_s * _per:.3f} draft {_st.draft_s * _per:.3f} catch-up "
          f"{_st.catch_up_s * _per:.3f} restore {_st.restore_s * _per:.3f} python {_st.python_s * _per:.3f}")
print("hist main", dict(sorted(hist["main"].items())), "var", dict(sorted(hist["var"].items())))
