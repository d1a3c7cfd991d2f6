"""A new engine for every request, as every `llama-mtp generate` call makes one: plain,
fixed k and auto engines (with variants), one sequence, 128 tokens a prompt, the engine
made before the clock starts (as the CLI does), interleaved (each configuration runs the
three prompts in a row; configuration order reversed every other round). Prints each
configuration's median tokens/s, the median of its paired ratios to the first
configuration (same prompt, same round) and to the second, and
the draft lengths auto chose, step by step, with the tokens each step emitted.

    python bench/experiments/fresh_engines.py LEVEL ROUNDS [ENGINES [TEMPERATURE [TOKENS]]]

ENGINES: comma-separated, default ``0,auto:nomem,auto``; each ``K[:VARIANT+VARIANT...]``
with K an int (0: plain) or ``auto``. Variants: ``nomem`` (the engine memory of earlier
engines is deleted first: a first run on this machine), ``rb=snapshots|checkpoint`` (the
rollback mode, fixed), ``pol.NAME=X`` (a DraftPolicy attribute). Engines without ``nomem`` start from what the engine before them kept: their
own configuration's run on the prompt before, or for the first prompt another
configuration's on the last -- always another text, as a user's next call starts from
their last one. Results: bench/README.md, "A new engine for every
request" (2026-12-07).
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import adaptive as A  # noqa: E402

import llama_mtp as lm  # noqa: E402
from llama_mtp.speculative import SpeculativeEngine, calibration  # noqa: E402

level, rounds = sys.argv[1], int(sys.argv[2])
names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["0", "auto:nomem", "auto"]
temp = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
n_tok = int(sys.argv[5]) if len(sys.argv) > 5 else 128
path, prompts = A.level_model(level)
model = lm.Model(path)


def make(name: str) -> SpeculativeEngine:
    if "nomem" in name.partition(":")[2].split("+"):  # before the engine reads the memory
        for f in calibration.cache_root().glob("*.memory.json"):
            f.unlink()
    e, rest = A.variant_engine(model, name, 1, 2, 4096, temp)
    for key, _ in rest:
        if key != "nomem":
            raise SystemExit(f"unknown variant {key}")
    return e


res: dict[str, list[float]] = {n: [] for n in names}
traces: dict[str, list[str]] = {n: [] for n in names}
remembered: dict[str, int] = {n: 0 for n in names}
for r in range(rounds):
    # each configuration runs the prompts in a row: an engine that remembers starts from its
    # own run on another text (or, on the first prompt, another configuration's)
    for n in (names if r % 2 == 0 else names[::-1]):
        for p in prompts:
            e = make(n)
            remembered[n] += e.remembered
            chosen: list[int] = []
            choose = e.policy.choose

            def logged(c, choose=choose, chosen=chosen):  # type: ignore[no-untyped-def]
                ks = choose(c)
                chosen.append(next(iter(ks.values())))
                return ks
            e.policy.choose = logged  # type: ignore[method-assign]
            emitted = []
            t0 = time.perf_counter()
            sid = e.add(prompt=model.tokenize(p), max_tokens=n_tok, ignore_eos=True)
            while e.active:
                emitted.append(len(e.step()[0].tokens))
            dt = time.perf_counter() - t0
            res[n].append(len(e.remove(sid).tokens) / dt)
            if chosen:
                traces[n].append(f"{p[:12]}: " + " ".join(f"{k}/{m}" for k, m in zip(chosen, emitted, strict=False)))
            e.close()
print(f"## level {level}, a new engine per request, {n_tok} tokens, {rounds} rounds x {len(prompts)} prompts, "
      f"{A.sampling_line(temp)}")
for i, n in enumerate(names):
    line = f"{n}: median {statistics.median(res[n]):.1f} tok/s; paired / {names[0]}: median " \
           f"{statistics.median(a / b for a, b in zip(res[n], res[names[0]], strict=True)):.3f}"
    if i >= 2:
        pr = [a / b for a, b in zip(res[n], res[names[1]], strict=True)]
        line += f"; / {names[1]}: median {statistics.median(pr):.3f}, mean {statistics.mean(pr):.3f}"
    print(line + (f"; remembered {remembered[n]} of {len(res[n])}" if n.startswith("auto") else ""))
for n in names:
    for t in traces[n][:len(prompts)]:
        print(f"   {n} {t}")
