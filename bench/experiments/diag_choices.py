"""Why auto drafts what it drafts: fixed k = 0..K engines and auto in one process, interleaved,
and for auto every searched step's view -- the rate of each common draft length on the
running estimates (``est``), on the main search's tables (explore bonus, realism factor:
``search``), what it chose, and what the step then measured.

    python bench/experiments/diag_choices.py LEVEL N_PAR ROUNDS [K_MAX]

Prints, per common k: tokens/s measured by the fixed-k engine (relative to plain), and
auto's mean estimate of that k (relative to its estimate of k = 0) over the steps where
every sequence was free to draft; then auto's chosen layouts and its speed.
"""
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402

name, n_par, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k_max = int(sys.argv[4]) if len(sys.argv) > 4 else 5
path, prompts = A.level_model(name)
model = lm.Model(path)
engs = {f"k{k}": A.engine(model, k, n_par, 2, 4096) for k in range(k_max + 1)}
engs["auto"] = A.engine(model, "auto", n_par, 2, 4096)
auto = engs["auto"]
pol = auto.policy
views: list[dict] = []
real_choose = pol.choose


last_ks: list[tuple[int, ...]] = []


def choose(cands):  # type: ignore[no-untyped-def]
    out = real_choose(cands)
    cs = list(cands.values())
    last_ks.append(tuple(out.values()))
    if not cs or any(c.fixed is not None for c in cs):
        return out
    if any(c.backlog for c in cs) or len(cs) != n_par or min(c.cap for c in cs) < k_max:
        return out
    est = [c.acc.expected_table(c.cap) for c in cs]
    srch = [c.acc.expected_table(c.cap, explore=pol.explore, explore_power=pol.explore_power,
                                 explore_pool=pol.explore_pool) for c in cs]
    pol._apply = pol.realism
    v = {"mode": auto.rollback, "ks": tuple(out.values()), "realism": pol.realism,
         "est": [pol._rate([k] * len(cs), est) for k in range(k_max + 1)],
         "search": [pol._rate([k] * len(cs), srch) for k in range(k_max + 1)],
         "secs": [pol.costs.step_seconds([k] * len(cs), None, list(cands)) for k in range(k_max + 1)],
         "tok": [sum(t[k] for t in est) for k in range(k_max + 1)]}
    pol._apply = 1.0
    views.append(v)
    return out


pol.choose = choose  # type: ignore[method-assign]
real_step = auto.step
steps: list[tuple[float, int]] = []


def step():  # type: ignore[no-untyped-def]
    n0 = len(views)
    t0 = time.perf_counter()
    ev = real_step()
    dt = time.perf_counter() - t0
    got = sum(len(e.tokens) for e in ev) if ev and hasattr(ev[0], "tokens") else None
    if len(views) > n0:
        views[-1]["dt"], views[-1]["got"] = dt, got
    if last_ks:
        every.append((last_ks[-1], dt, got))
        last_ks.clear()
    return ev


every: list[tuple[tuple[int, ...], float, int]] = []


auto.step = step  # type: ignore[method-assign]

#: every engine's steps by phase: (live sequences, "tail" where one has <= K_MAX + 1 tokens
#: left, else "body") -> [steps, seconds, tokens]
phases: dict[str, dict[tuple[int, str], list[float]]] = {k: collections.defaultdict(lambda: [0, 0.0, 0])
                                                          for k in engs}


def phased(key, eng):  # type: ignore[no-untyped-def]
    inner = eng.step

    def run():  # type: ignore[no-untyped-def]
        live = [q for q in eng._seqs.values() if not q.state.finished]
        tail = min((q.max_tokens - len(q.state.tokens) for q in live), default=0) <= k_max + 1
        t0 = time.perf_counter()
        ev = inner()
        g = phases[key][len(live), "tail" if tail else "body"]
        g[0] += 1
        g[1] += time.perf_counter() - t0
        g[2] += sum(len(e.tokens) for e in ev)
        return ev
    eng.step = run  # type: ignore[method-assign]


for key, eng in engs.items():
    phased(key, eng)
n = 96 if n_par == 1 else 48
for e in engs.values():
    A.measure(e, model, prompts[:1], 16, n_par)
views.clear()
every.clear()
for ph in phases.values():
    ph.clear()
for e in engs.values():
    e.stats = type(e.stats)()
wall = dict.fromkeys(engs, 0.0)
rates = {k: [] for k in engs}
hist = collections.Counter()
keys = list(engs)
for r in range(rounds):
    order = keys[r % len(keys):] + keys[:r % len(keys)]
    for p in prompts:
        rate = {}
        for k in order:
            tok, sec, spec = A.timed(engs[k], model, (p,), n, n_par)
            rate[k] = tok / sec
            wall[k] += sec
            if k == "auto":
                for a, b in spec.draft_length_hist.items():
                    hist[a] += b
        for k in keys:
            rates[k].append(rate[k] / rate["k0"])
med = {k: statistics.median(v) for k, v in rates.items()}
print(f"{name} x{n_par}, {rounds} rounds x {len(prompts)} prompts; measured / plain (paired medians):")
print("  ", {k: round(v, 3) for k, v in med.items()})
free = [v for v in views if v["mode"] == "snapshots"]
for mode in ("snapshots", "checkpoint"):
    vs = [v for v in views if v["mode"] == mode]
    if not vs:
        continue
    print(f"auto's searched steps with every sequence free, {mode}: {len(vs)}")
    for key in ("est", "search"):
        row = [statistics.mean(v[key][k] / v["est"][0] for v in vs) for k in range(k_max + 1)]
        print(f"  {key:6s} k -> rate / est(k=0):", [round(x, 3) for x in row])
    print("  step secs predicted by k (ms):", [round(1e3 * statistics.mean(v["secs"][k] for v in vs), 1)
                                                for k in range(k_max + 1)])
    print("  tokens a step predicted by k:", [round(statistics.mean(v["tok"][k] for v in vs), 2)
                                               for k in range(k_max + 1)])
    print("  realism:", round(statistics.mean(v["realism"] for v in vs), 3))
    lay = collections.Counter(v["ks"] for v in vs)
    print("  chosen layouts:", lay.most_common(8))
    by = collections.defaultdict(list)
    for v in vs:
        if v.get("got") is not None:
            by[v["ks"]].append((v["got"], v["dt"]))
    for ks, xs in sorted(by.items(), key=lambda kv: -len(kv[1]))[:6]:
        tok = statistics.mean(g for g, _ in xs)
        secs = statistics.mean(d for _, d in xs)
        print(f"  measured {ks}: {len(xs)} steps, {tok:.2f} tokens in {1e3 * secs:.1f} ms")
print("ms per 100 tokens (engine time counters):")
for k, e in engs.items():
    st = e.stats
    per = 1e5 / max(1, st.spec.predicted_n)
    print(f"  {k:5s} wall {wall[k] * per:6.1f} prefill {st.prefill_s * per:5.1f} verify {st.verify_s * per:6.1f}"
          f" draft {st.draft_s * per:5.1f} catch-up {st.catch_up_s * per:4.1f} restore {st.restore_s * per:4.1f}"
          f" switch {st.switch_s * per:4.1f} python {st.python_s * per:4.1f} steps {st.steps}")
print("steps by phase (live sequences, body/tail): tokens/s (share of the engine's step time)")
for key, ph in phases.items():
    tot = sum(g[1] for g in ph.values())
    print(f"  {key:5s}", "  ".join(f"{n}{t[0]} {g[2] / g[1]:.0f} ({g[1] / tot:.0%})" for (n, t), g in
                                   sorted(ph.items(), key=lambda kv: (-kv[0][0], kv[0][1]))))
groups = collections.defaultdict(lambda: [0, 0.0, 0])
for ks, dt, got in every:
    kind = ("idle" if not any(ks) else "level" if len(set(ks)) == 1 else
            "some idle" if 0 in ks else "uneven")
    g = groups[kind, len(ks)]
    g[0] += 1
    g[1] += dt
    g[2] += got or 0
tot = sum(g[1] for g in groups.values())
print("auto's steps by layout kind (sequences): steps, share of step time, tokens/s")
for key, (cnt, secs, tok) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
    print(f"  {key}: {cnt} steps, {secs / tot:.1%} of the time, {tok / secs:.1f} tok/s")
lay = collections.Counter(ks for ks, _, _ in every if len(ks) == n_par)
print("  most common full layouts:", lay.most_common(12))
print("auto hist", dict(sorted(hist.items())), "switches", auto.stats.rollback_switches,
      f"switch_s {auto.stats.switch_s:.3f}")
