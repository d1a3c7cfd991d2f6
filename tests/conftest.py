"""Tiny qwen35 MTP models, written once per test session (no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import llama_mtp as lm
from llama_mtp.tiny import write_tiny_model

# name -> TinySpec overrides
MODELS = {
    "planted": {},                                   # ~100% MTP acceptance
    "random": {"weights": "random"},                 # ~0% acceptance: every draft rolled back
    "noisy": {"mtp_noise": 0.3},                     # partial acceptance
    "shift": {"mtp_blind": (8, 20)},                 # acceptance ~1, then 0, then ~1 again, cycling
    "trunk": {"trunk_scale": 1.0},                   # history matters (recurrent state + attention)
    "nomtp": {"mtp": False},                         # a qwen35 without MTP layers
}


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Nothing the tests run lands in the user's cache (demo models, calibrations of the
    CLI's subprocesses): one cache directory for the session."""
    d = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLAMA_MTP_CACHE_DIR", str(d))
        yield d


@pytest.fixture(autouse=True)
def calibration_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own, empty calibration cache in this process: engines measure at
    birth as a new install's first run does."""
    from llama_mtp.speculative import calibration

    root = tmp_path_factory.mktemp("calibration")
    monkeypatch.setattr(calibration, "cache_root", lambda: root)
    return root


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


@pytest.fixture(scope="session")
def soft_model(tmp_path_factory: pytest.TempPathFactory) -> lm.Model:
    """Planted but soft: the next token is likely, not certain (variety at T = 1)."""
    path = write_tiny_model(tmp_path_factory.mktemp("soft") / "soft.gguf", logit_scale=3.0, mtp_noise=0.2)
    m = lm.Model(path)
    yield m
    m.close()
