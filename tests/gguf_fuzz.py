"""GGUF fuzzing worker: mutate a valid tiny GGUF, load it, use it; report each case.

Run by tests/test_fuzz.py in a subprocess (a crash must not take the test run
down with it): ``python gguf_fuzz.py MODEL FIRST LAST SEED WORKDIR``. One line
per finished case on stdout: ``<case> <outcome>``. If the process dies, the
parent knows which case killed it and restarts after it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import numpy as np

EXTREMES = [0, 1, 2**8 - 1, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]


def mutate(data: bytes, header_end: int, case: int, seed: int) -> tuple[bytes, str]:
    """A deterministic mutation of ``data``; most land in the header (metadata, tensor table)."""
    rng = np.random.default_rng([seed, case])
    buf = bytearray(data)
    kind = int(rng.integers(0, 8))
    span = header_end if rng.random() < 0.9 else len(buf)
    if kind == 0:  # flip a few bits
        for _ in range(int(rng.integers(1, 9))):
            i = int(rng.integers(0, span))
            buf[i] ^= 1 << int(rng.integers(0, 8))
        return bytes(buf), "bitflip"
    if kind == 1:  # overwrite a run with random bytes
        i = int(rng.integers(0, span))
        n = int(rng.integers(1, 33))
        buf[i:i + n] = rng.integers(0, 256, size=min(n, len(buf) - i), dtype=np.uint8).tobytes()
        return bytes(buf), "overwrite"
    if kind in (2, 3):  # an extreme integer where a count, length, type or dimension lives
        width = 8 if kind == 2 else 4
        i = int(rng.integers(0, max(1, span - width)))
        i -= i % 4
        v = EXTREMES[int(rng.integers(0, len(EXTREMES)))] % (1 << (8 * width))
        buf[i:i + width] = v.to_bytes(width, "little")
        return bytes(buf), f"int{8 * width}"
    if kind == 4:  # truncate
        return bytes(buf[: int(rng.integers(0, len(buf)))]), "truncate"
    if kind == 5:  # insert bytes (shifts everything after)
        i = int(rng.integers(0, span))
        ins = rng.integers(0, 256, size=int(rng.integers(1, 17)), dtype=np.uint8).tobytes()
        return bytes(buf[:i]) + ins + bytes(buf[i:]), "insert"
    if kind == 6:  # delete bytes
        i = int(rng.integers(0, span))
        return bytes(buf[:i]) + bytes(buf[i + int(rng.integers(1, 17)):]), "delete"
    # duplicate a region onto another
    a, b = int(rng.integers(0, span)), int(rng.integers(0, span))
    n = int(rng.integers(1, 65))
    chunk = buf[a:a + n]
    buf[b:b + len(chunk)] = chunk
    return bytes(buf[: len(data)]), "copy"


def run_case(path: Path) -> str:
    import llama_mtp as lm

    try:
        model = lm.Model(path)
    except lm.ModelLoadError:
        return "load-error"
    try:
        with model, lm.Context(model, n_ctx=64, n_batch=16) as ctx:
            b = lm.Batch(4)
            b.extend([min(5, model.n_vocab - 1)] * 2, 0, 0)
            ctx.decode(b)
            np.asarray(ctx.logits(-1)).sum()
            if model.has_mtp:
                with lm.Context(model, n_ctx=64, n_batch=16, mtp=True) as dft:
                    bd = lm.Batch(2, hidden_dim=dft.hidden_dim)
                    bd.add(min(5, model.n_vocab - 1), 0, 0, output=True, hidden=np.zeros(dft.hidden_dim))
                    dft.decode(bd)
        return "ok"
    except lm.LlamaError as exc:
        return f"used:{type(exc).__name__}"


def main() -> None:
    model, first, last, seed, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    from llama_mtp import gguf_scan

    data = Path(model).read_bytes()
    info = gguf_scan.scan(model)
    header_end = info.data_offset if info else 4096  # metadata + tensor table: where loaders break
    target = work / f"case-{os.getpid()}.gguf"
    for case in range(first, last):
        blob, kind = mutate(data, header_end, case, seed)
        target.write_bytes(blob)
        print(f"{case} start {kind}", flush=True)
        faulthandler.dump_traceback_later(60, exit=True)  # a hang ends the worker: the parent counts it
        try:
            outcome = run_case(target)
        except Exception as exc:  # an untyped failure is a finding too, but not a crash
            outcome = f"untyped:{type(exc).__name__}"
        faulthandler.cancel_dump_traceback_later()
        print(f"{case} {outcome}", flush=True)
    target.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
