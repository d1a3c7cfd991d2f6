"""Interrupting a long decode: from another thread, and with Ctrl-C (SIGINT)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import llama_mtp as lm
from llama_mtp.tiny import write_tiny_model

N = 4096

SLOW = dict(weights="random", n_embd=512, n_layer=4, n_ff=1024, head_dim=64, n_head=4, n_head_kv=2, dtype="f16")


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Big enough that a 4096-token prefill takes a good fraction of a second."""
    return write_tiny_model(tmp_path_factory.mktemp("slow") / "slow.gguf", **SLOW)


def long_batch() -> lm.Batch:
    b = lm.Batch(N)
    b.extend([10 + (i % 400) for i in range(N)], 0, 0)
    return b


def test_interrupt_from_another_thread(slow_model: Path) -> None:
    with lm.Model(slow_model) as m, lm.Context(m, n_ctx=N, n_batch=N) as ctx:
        b = long_batch()
        t0 = time.perf_counter()
        ctx.decode(b)
        full = time.perf_counter() - t0
        ctx.memory.clear()

        timer = threading.Timer(full / 5, ctx.interrupt)
        timer.start()
        t0 = time.perf_counter()
        with pytest.raises(lm.AbortedError) as info:
            ctx.decode(b)
        took = time.perf_counter() - t0
        timer.join()
        assert info.value.code == 2
        assert took < full * 0.9
        # hybrid memory: the interrupted sequence was removed, cleanly
        assert info.value.dropped == [0]
        assert ctx.memory.pos_max(0) == -1
        # and the context still works
        small = lm.Batch(4)
        small.extend([5, 6, 7], 0, 0)
        ctx.decode(small)
        assert np.isfinite(ctx.logits(-1)).all()


SCRIPT = textwrap.dedent(
    """
    import os, signal, threading, time, sys
    import llama_mtp as lm
    m = lm.Model(sys.argv[1])
    ctx = lm.Context(m, n_ctx={N}, n_batch={N})
    b = lm.Batch({N})
    b.extend([10 + (i % 400) for i in range({N})], 0, 0)
    t0 = time.perf_counter(); ctx.decode(b); full = time.perf_counter() - t0
    ctx.memory.clear()
    threading.Timer(full / 5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.perf_counter()
    try:
        ctx.decode(b)
        print("not interrupted")
    except KeyboardInterrupt:
        took = time.perf_counter() - t0
        print("interrupted", round(took / full, 2), ctx.memory.pos_max(0))
    small = lm.Batch(4); small.extend([5, 6, 7], 0, 0); ctx.decode(small)
    print("recovered", ctx.memory.pos_max(0))
    """
).format(N=N)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT abort hook is POSIX-only")
def test_ctrl_c_during_decode(slow_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "ctrl_c.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(slow_model)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    head = lines[0].split()
    assert head[0] == "interrupted", out.stdout
    assert float(head[1]) < 0.9  # the decode stopped early, not after finishing
    assert head[2] == "-1"  # the interrupted sequence was cleanly removed
    assert lines[1] == "recovered 2"
