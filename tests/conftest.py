"""Tiny qwen35 MTP models, written once per test session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llama_mtp as lm
from llama_mtp.tiny import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = ROOT / "vendor" / "llama.cpp" / "models"

# name -> TinySpec overrides
MODELS = {
    "planted": {},                                   # ~100% MTP acceptance
    "random": {"weights": "random"},                 # ~0% acceptance: every draft rolled back
    "noisy": {"mtp_noise": 0.3},                     # partial acceptance
    "trunk": {"trunk_scale": 1.0},                   # history matters (recurrent state + attention)
    "nomtp": {"mtp": False},                         # a qwen35 without MTP layers
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for name, kw in MODELS.items():
        write_tiny_model(d / f"{name}.gguf", **kw)
    return d


@pytest.fixture(scope="session")
def model_path(model_dir: Path):
    def get(name: str) -> Path:
        return model_dir / f"{name}.gguf"
    return get


@pytest.fixture(scope="session")
def planted(model_path) -> lm.Model:
    m = lm.Model(model_path("planted"))
    yield m
    m.close()


@pytest.fixture(scope="session")
def trunk(model_path) -> lm.Model:
    m = lm.Model(model_path("trunk"))
    yield m
    m.close()


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
