"""The compiled binding: import, version, pinned commit, system facts."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import llama_mtp
from llama_mtp._native import calls

ROOT = Path(__file__).resolve().parent.parent


def pinned_commit() -> str:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads((ROOT / "vendor" / "llama.cpp.lock.toml").read_text())["llama_cpp"]["commit"]


def test_version_matches_binary() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", llama_mtp.__version__)
    assert calls.version() == llama_mtp.__version__


def test_llama_commit_is_the_pin() -> None:
    assert calls.llama_commit() == pinned_commit()


def test_system_info_and_devices() -> None:
    import llama_mtp._native as native

    native.ensure_backend()
    info = calls.system_info()
    assert "CPU" in info
    devs = calls.devices()
    assert any(d.kind == "cpu" for d in devs)
    assert "CPU" in calls.backends()
    caps = calls.capabilities()
    assert caps["max_parallel_sequences"] >= 64
    assert caps["mmap"] is True


def test_constants_come_from_the_headers() -> None:
    assert calls.DEFAULT_SEED == 0xFFFFFFFF
    assert calls.TOKEN_NULL == -1
    assert calls.STATE_PARTIAL_ONLY == 1
    assert calls.GGML_TYPES["f16"] == 1 and "q8_0" in calls.GGML_TYPES


def test_defaults_are_llama_cpps() -> None:
    d = calls.context_default_params()
    assert d["n_batch"] == 2048 and d["n_ubatch"] == 512 and d["n_seq_max"] == 1
    assert calls.model_default_params()["load_mtp"] is False


def test_stale_binary_is_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    import llama_mtp._native as native

    monkeypatch.setattr(md, "version", lambda name: "999.0.0")
    with pytest.raises(ImportError, match="stale"):
        native._check_version()


def test_only_native_touches_ffi() -> None:
    """The layering rule: only llama_mtp/_native imports the compiled module or ffi/lib."""
    offenders = []
    for path in (ROOT / "llama_mtp").rglob("*.py"):
        if "_native" in path.parts:
            continue
        text = path.read_text()
        if re.search(r"(?<![\w.])(ffi|lib)\.\w+|_native\._llama|from \._native import .*\b(ffi|lib)\b|_native\.(ffi|lib)\b", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_import_has_no_side_effects(tmp_path: Path) -> None:
    code = (
        "import llama_mtp, llama_mtp._native._llama as m, logging;"
        "assert not logging.getLogger('llama_mtp.native').handlers;"
        "print('ok')"
    )
    import subprocess

    # cwd elsewhere: `python -c` puts the cwd first on sys.path (the source tree would shadow the install)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok" and out.stderr == ""


def test_load_error_names_a_missing_gpu_runtime() -> None:
    """A CUDA build on a machine without the CUDA runtime: say which library is missing and
    how to supply it, not 'reinstall for this Python'."""
    from llama_mtp._native import _load_error

    gpu = _load_error(ImportError("libcublas.so.13: cannot open shared object file: No such file or directory"))
    assert "needs libcublas.so.13" in gpu and "LD_LIBRARY_PATH" in gpu and "backend=cpu" in gpu
    other = _load_error(ImportError("undefined symbol: PyFoo_Bar"))
    assert "compiled for this Python" in other and "LD_LIBRARY_PATH" not in other
