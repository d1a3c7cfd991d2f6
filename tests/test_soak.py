"""Resources: create/close cycles leak neither memory nor file descriptors; a long
run with sequences joining and leaving stays flat and exact. Reduced sizes here;
full sizes (1000 cycles, 4 x 2000 tokens) with ``pytest -m slow``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CYCLES = textwrap.dedent(
    """
    import ctypes, gc, json, os, sys
    import llama_mtp as lm
    from llama_mtp.speculative import SpeculativeEngine
    path, n = sys.argv[1], int(sys.argv[2])

    def rss():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the OS: measure what is live
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def fds():
        return len(os.listdir("/proc/self/fd"))

    def cycle():
        with lm.Model(path) as m, SpeculativeEngine(m, n_ctx=64, draft_max=3) as eng:
            s = eng.add("the model", max_tokens=4, sampling=lm.SamplingParams(temperature=0))
            while eng.active:
                eng.step()
            with lm.Context(m, n_ctx=64) as ctx:
                b = lm.Batch(2); b.add(5, 0, 0, output=True); ctx.decode(b); ctx.logits(-1).sum()

    for _ in range(max(10, n // 10)):  # warm up allocators and caches
        cycle()
    gc.collect()
    r0, f0 = rss(), fds()
    for _ in range(n):
        cycle()
    gc.collect()
    print(json.dumps({"rss0": r0, "rss1": rss(), "fd0": f0, "fd1": fds()}))
    """
)

SOAK = textwrap.dedent(
    """
    import ctypes, gc, json, os, sys
    import numpy as np
    import llama_mtp as lm
    from llama_mtp.speculative import SpeculativeEngine
    path, n_tok, n_prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def rss():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the OS: measure what is live
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    words = ["Multi-token prediction", "the model", "every accepted draft", "one pass", "a whole", "decoding step"]
    m = lm.Model(path)
    jobs = [(m.tokenize(words[i % 6] + " " + words[(i * 5 + 1) % 6]), n_tok - 41 * (i % 5)) for i in range(n_prompts)]
    g = lm.SamplingParams(temperature=0)

    eng = SpeculativeEngine(m, max_sequences=4, n_ctx=n_tok + 64, draft_max=3, sampling=g)

    def run():
        # 4 slots; a new sequence joins whenever one leaves (continuous batching)
        out = {}
        queue, owner = list(range(len(jobs))), {}
        while queue or eng.active:
            while queue and eng.free_slots:
                i = queue.pop(0)
                owner[eng.add(jobs[i][0], max_tokens=jobs[i][1])] = i
            eng.step()
            for sid in [s for s in owner if s not in eng.active]:
                out[owner.pop(sid)] = eng.remove(sid).tokens
        return out, eng.stats.spec

    run()  # the first pass sizes every buffer
    r1 = rss()
    got, spec = run()  # the same work again, on the same engine: nothing may grow
    r2 = rss()
    ok = 0
    with lm.Context(m, n_ctx=n_tok + 64) as ctx:
        for i, (toks, n) in enumerate(jobs):
            ctx.memory.clear()
            b = lm.Batch(len(toks)); b.extend(toks, 0, 0); ctx.decode(b)
            ref = [int(np.argmax(ctx.logits(-1)))]; pos = len(toks); bb = lm.Batch(1)
            while len(ref) < n:
                bb.clear(); bb.add(ref[-1], pos, 0, output=True); ctx.decode(bb)
                ref.append(int(np.argmax(ctx.logits(-1)))); pos += 1
            ok += ref == got[i]
    print(json.dumps({"rss1": r1, "rss2": r2, "exact": ok, "n": len(jobs),
                      "tokens": sum(len(t) for t in got.values()), "acceptance": round(spec.acceptance_rate, 4)}))
    """
)


def _script(tmp_path: Path, name: str, text: str, *args: str) -> dict:  # type: ignore[type-arg]
    script = tmp_path / name
    script.write_text(text)
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=3000, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cycles(tmp_path: Path, model: Path, n: int, record_property) -> None:  # type: ignore[no-untyped-def]
    r = _script(tmp_path, "cycles.py", CYCLES, str(model), str(n))
    record_property("cycles", r)
    assert r["fd1"] == r["fd0"], r
    assert r["rss1"] < r["rss0"] * 1.05, r


def _soak(tmp_path: Path, model: Path, n_tok: int, record_property) -> None:  # type: ignore[no-untyped-def]
    r = _script(tmp_path, "soak.py", SOAK, str(model), str(n_tok), "10")
    record_property("soak", r)
    assert r["exact"] == r["n"], r
    assert r["rss2"] < r["rss1"] * 1.05, r


def test_create_close_cycles(model_path, tmp_path: Path, record_property) -> None:  # type: ignore[no-untyped-def]
    _cycles(tmp_path, model_path("trunk"), 100, record_property)


def test_soak_join_leave(model_path, tmp_path: Path, record_property) -> None:  # type: ignore[no-untyped-def]
    _soak(tmp_path, model_path("trunk"), 300, record_property)


@pytest.mark.slow
def test_create_close_cycles_full(model_path, tmp_path: Path, record_property) -> None:  # type: ignore[no-untyped-def]
    _cycles(tmp_path, model_path("trunk"), 1000, record_property)


@pytest.mark.slow
def test_soak_full(model_path, tmp_path: Path, record_property) -> None:  # type: ignore[no-untyped-def]
    _soak(tmp_path, model_path("trunk"), 2000, record_property)
