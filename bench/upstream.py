"""Build llama.cpp's own drivers from the *same pinned source* the package compiles.

    python bench/upstream.py                          # build (cached in bench/build/upstream)
    LLAMA_MTP_BACKEND=cuda python bench/upstream.py   # the CUDA build (bench/build/upstream-cuda)
    python bench/upstream.py --backend cuda --shared  # ggml/llama as shared libraries (one copy
                                                      # of the GPU kernels for the three drivers)

Targets: llama-completion (plain decoding), llama-speculative-simple (one
sequence with --spec-type draft-mtp) and llama-server (parallel slots). The
CMake flags match the package's build (static, position-independent, GGML_NATIVE
off unless LLAMA_MTP_NATIVE=1; the backend's defines are read from the package's
own pyproject.toml, and ``CMAKE_ARGS`` is passed on as it is to the package), so
both sides run the same ggml kernels. Nothing here is committed: bench/build/ is
git-ignored.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = Path(os.environ.get("LLAMA_MTP_LLAMA_CPP_DIR") or ROOT / "vendor" / "llama.cpp")
TARGETS = ("llama-completion", "llama-speculative-simple", "llama-server")
#: where prebuilt drivers may be found instead (a directory holding the three binaries)
ENV_BIN = "LLAMA_MTP_UPSTREAM_BIN"


def native() -> bool:
    return os.environ.get("LLAMA_MTP_NATIVE", "").lower() in ("1", "on", "true", "yes")


def backend_defines(backend: str) -> list[str]:
    """The CMake defines the package's build adds for ``backend`` (``cuda``, ``vulkan,rpc``, ...),
    read from pyproject.toml's overrides, so both builds stay in step by construction."""
    if backend in ("", "auto"):
        return []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    out: list[str] = []
    for ov in project["tool"]["scikit-build"].get("overrides", []):
        pattern = ov.get("if", {}).get("config-setting", {}).get("llama_mtp.backend")
        if pattern and re.search(pattern, backend):
            out += [f"-D{k}={v}" for k, v in ov.get("cmake", {}).get("define", {}).items()]
    if not out:
        sys.exit(f"unknown backend {backend!r}: see [tool.scikit-build.overrides] in pyproject.toml")
    return out


def _backend(backend: str | None) -> str:
    """The backend asked for, else the package's own setting (``LLAMA_MTP_BACKEND``, default auto)."""
    return os.environ.get("LLAMA_MTP_BACKEND", "auto") if backend is None else backend


def cmake_flags(backend: str | None = None, shared: bool = False) -> list[str]:
    backend = _backend(backend)
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}",
        "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
        f"-DGGML_NATIVE={'ON' if native() else 'OFF'}",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_EXAMPLES=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_ALL_WARNINGS=OFF",
        *backend_defines(backend),
        *shlex.split(os.environ.get("CMAKE_ARGS", "")),
    ]


def build_dir(backend: str | None = None, shared: bool = False) -> Path:
    backend = _backend(backend)
    tag = "" if backend in ("", "auto") else "-" + backend.replace(",", "-")
    return HERE / "build" / f"upstream{tag}{'-shared' if shared else ''}"


def binaries(bin_dir: Path) -> dict[str, Path]:
    return {t: bin_dir / t for t in TARGETS}


def prebuilt(bin_dir: str | os.PathLike[str] | None = None) -> dict[str, Path] | None:
    """The drivers in ``bin_dir`` (or ``$LLAMA_MTP_UPSTREAM_BIN``), if given; None otherwise."""
    where = bin_dir or os.environ.get(ENV_BIN)
    if not where:
        return None
    bins = binaries(Path(where))
    missing = [str(p) for p in bins.values() if not p.exists()]
    if missing:
        sys.exit(f"prebuilt upstream drivers missing: {missing}")
    return bins


def build(log=print, backend: str | None = None, shared: bool = False) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    if not (SRC / "CMakeLists.txt").is_file():
        sys.exit(f"no llama.cpp source in {SRC}: run `pip install .` first (it fetches the pinned source)")
    out = build_dir(backend, shared)
    bins = binaries(out / "bin")
    cmake = shutil.which("cmake") or "cmake"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.time()
    if not (out / "CMakeCache.txt").exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([cmake, "-S", str(SRC), "-B", str(out), *gen, *cmake_flags(backend, shared)], check=True,
                       stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", str(out), "--target", *TARGETS, "-j", str(os.cpu_count() or 2)], check=True,
                   stdout=subprocess.DEVNULL)
    missing = [str(p) for p in bins.values() if not p.exists()]
    if missing:
        sys.exit(f"build finished but {missing} are missing")
    log(f"upstream drivers ready in {out / 'bin'} ({time.time() - t0:.0f} s)")
    return bins


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=None, help="as the package's llama_mtp.backend (default: $LLAMA_MTP_BACKEND "
                                                    "or auto)")
    ap.add_argument("--shared", action="store_true", help="build ggml and llama as shared libraries")
    ap.add_argument("--print-flags", action="store_true", help="print the CMake flags and the build dir, build nothing")
    a = ap.parse_args()
    if a.print_flags:
        print(build_dir(a.backend, a.shared))
        print(" ".join(cmake_flags(a.backend, a.shared)))
    else:
        build(backend=a.backend, shared=a.shared)
