"""The in-tree build backend: pin, fetch (with the user's pip), cache, extraction, options."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_build_backend():  # type: ignore[no-untyped-def]
    """Import build_backend from the checkout without putting the checkout on sys.path
    (which would shadow the installed llama_mtp with the uncompiled source tree)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build_backend", ROOT / "build_backend" / "__init__.py",
        submodule_search_locations=[str(ROOT / "build_backend")],
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_backend"] = module
    spec.loader.exec_module(module)
    return module


bb = _load_build_backend()
SETTING_BACKEND, _backend_choice, source = bb.SETTING_BACKEND, bb._backend_choice, bb.source


def test_pin_is_complete() -> None:
    pin = source.Pin.load()
    assert pin.package == "llama-cpp-python" and pin.version == "0.3.36"
    assert pin.sha256 == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert pin.commit.startswith("0c1e570") and len(pin.commit) == 40
    assert pin.subdir == "llama_cpp_python-0.3.36/vendor/llama.cpp"
    assert "docs" in pin.exclude


def _fake_sdist(tmp: Path, pin: source.Pin) -> tuple[source.Pin, Path]:
    """A tarball shaped like the pinned sdist, and a pin matching its sha256."""
    path = tmp / pin.filename
    files = {
        "CMakeLists.txt": b"project(x)\n",
        "include/llama.h": b"// llama\n",
        "src/llama-ext.h": b"// ext\n",
        "docs/big.md": b"x" * 1000,
        "models/ggml-vocab-qwen35.gguf": b"GGUF",
        "models/ggml-vocab-huge.gguf": b"GGUF" * 100,
    }
    with tarfile.open(path, "w:gz") as tar:
        for rel, data in files.items():
            info = tarfile.TarInfo(f"{pin.subdir}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("llama_cpp_python-0.3.36/setup.py")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    fake = source.Pin(**{**pin.__dict__, "sha256": source.sha256_of(path)})
    return fake, path


def test_extract_filters_and_marks(tmp_path: Path) -> None:
    pin, tarball = _fake_sdist(tmp_path, source.Pin.load())
    dest = tmp_path / "vendor" / "llama.cpp"
    source.extract(pin, tarball, dest, log=lambda *_: None)
    assert (dest / "include" / "llama.h").is_file()
    assert not (dest / "docs").exists()
    assert (dest / "models" / "ggml-vocab-qwen35.gguf").is_file()
    assert not (dest / "models" / "ggml-vocab-huge.gguf").exists()
    assert not (dest / "setup.py").exists()
    assert json.loads((dest / source.MARKER).read_text()) == pin.marker()


def test_extract_refuses_wrong_sha(tmp_path: Path) -> None:
    pin, tarball = _fake_sdist(tmp_path, source.Pin.load())
    bad = source.Pin(**{**pin.__dict__, "sha256": "0" * 64})
    with pytest.raises(source.SourceError, match="sha256"):
        source.extract(bad, tarball, tmp_path / "out", log=lambda *_: None)


def test_fetch_uses_cache_then_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pin, tarball = _fake_sdist(tmp_path, source.Pin.load())
    cache = tmp_path / "cache"
    monkeypatch.setenv(source.ENV_CACHE, str(cache))
    calls: list[list[str]] = []
    envs: list[dict[str, str]] = []
    # as inside pip's PEP 517 hook for this package: the nested pip must not inherit them
    monkeypatch.setenv("_PYPROJECT_HOOKS_BUILD_BACKEND", "build_backend")
    monkeypatch.setenv("_PYPROJECT_HOOKS_BACKEND_PATH_JSON", '["."]')
    monkeypatch.setenv("PEP517_BUILD_BACKEND", "build_backend")  # pip < 24 (pyproject-hooks 1.0)
    monkeypatch.setenv("PEP517_BACKEND_PATH", ".")

    def fake_run(cmd, capture_output, text, env):  # type: ignore[no-untyped-def]
        calls.append(cmd)
        envs.append(env)
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / pin.filename).write_bytes(tarball.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(source.subprocess, "run", fake_run)
    got = source.fetch(pin, log=lambda *_: None)
    assert got == cache / "src" / pin.filename and got.is_file()
    assert calls and calls[0][1:4] == ["-m", "pip", "download"]
    assert f"{pin.package}=={pin.version}" in calls[0]
    assert "--no-binary" in calls[0]
    assert not [k for k in envs[0] if k.startswith(("_PYPROJECT_HOOKS_", "PEP517_"))] and envs[0]["PATH"] == os.environ["PATH"]
    # a second fetch is served from the cache
    source.fetch(pin, log=lambda *_: None)
    assert len(calls) == 1


def test_offline_without_cache_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pin = source.Pin.load()
    monkeypatch.setenv(source.ENV_CACHE, str(tmp_path / "empty-cache"))
    monkeypatch.setattr(
        source.subprocess,
        "run",
        lambda cmd, capture_output, text, env: subprocess.CompletedProcess(cmd, 1, "", "ERROR: network is unreachable"),
    )
    with pytest.raises(source.SourceError) as info:
        source.fetch(pin, log=lambda *_: None)
    text = str(info.value)
    assert "network is unreachable" in text
    assert pin.filename in text and source.ENV_DIR in text and pin.sha256 in text


def test_wrong_sha_from_registry_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pin = source.Pin.load()
    monkeypatch.setenv(source.ENV_CACHE, str(tmp_path / "cache"))

    def fake_run(cmd, capture_output, text, env):  # type: ignore[no-untyped-def]
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / pin.filename).write_bytes(b"tampered")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(source.subprocess, "run", fake_run)
    with pytest.raises(source.SourceError, match="refusing"):
        source.fetch(pin, log=lambda *_: None)


def test_user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(source.ENV_DIR, str(tmp_path))
    with pytest.raises(source.SourceError, match="does not look like"):
        source.user_dir()
    for rel in ("CMakeLists.txt", "include/llama.h", "src/llama-ext.h"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert source.user_dir() == tmp_path.resolve()
    assert source.ensure_source(log=lambda *_: None) == tmp_path.resolve()
    assert source.needs_fetch() is False


@pytest.mark.parametrize("value", ["cpu", "cuda", "metal", "vulkan", "blas", "rpc", "cuda,rpc", "AUTO"])
def test_backend_choices(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_MTP_BACKEND", raising=False)
    assert _backend_choice({SETTING_BACKEND: value}) == value.lower()


@pytest.mark.parametrize("value", ["cdua", "cpu,cuda", ","])
def test_backend_typos_fail_early(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_MTP_BACKEND", value)
    with pytest.raises(source.SourceError):
        _backend_choice(None)


def test_vendor_source_is_not_tracked() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "vendor/"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert sorted(out.stdout.split()) == ["vendor/README.md", "vendor/llama.cpp.lock.toml"]


def test_cdef_matches_the_header() -> None:
    import importlib

    drift = importlib.import_module("build_backend.check_header_drift")

    llama_cpp = ROOT / "vendor" / "llama.cpp"
    if not (llama_cpp / "include" / "llama.h").exists():
        pytest.skip("vendor/llama.cpp not populated")
    header, bound = drift.header_functions(llama_cpp), drift.cdef_functions()
    assert bound - header == set()
    assert len(bound & header) >= 70
