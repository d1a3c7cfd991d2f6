"""Helpers shared by the tests (importable as `helpers`: tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import llama_mtp as lm

ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = ROOT / "vendor" / "llama.cpp" / "models"


def greedy_reference(model: lm.Model, prompt: list[int], n: int, **ctx_kw) -> list[int]:
    """Plain greedy decoding, one token per decode: the ground truth."""
    with lm.Context(model, n_ctx=ctx_kw.pop("n_ctx", 512), **ctx_kw) as ctx:
        b = lm.Batch(max(len(prompt), 1))
        b.extend(prompt, 0, 0)
        ctx.decode(b)
        out = [int(np.argmax(ctx.logits(-1)))]
        pos = len(prompt)
        while len(out) < n:
            b.clear()
            b.add(out[-1], pos, 0, output=True)
            ctx.decode(b)
            out.append(int(np.argmax(ctx.logits(-1))))
            pos += 1
        return out
