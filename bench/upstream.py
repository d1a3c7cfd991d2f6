"""Build llama.cpp's own drivers from the *same pinned source* the package compiles.

    python bench/upstream.py            # build (cached in bench/build/upstream)

Targets: llama-completion (plain decoding), llama-speculative-simple (one
sequence with --spec-type draft-mtp) and llama-server (parallel slots). The
CMake flags match the package's build (static, position-independent, GGML_NATIVE
off unless LLAMA_MTP_NATIVE=1), so both sides run the same ggml kernels.
Nothing here is committed: bench/build/ is git-ignored.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = Path(os.environ.get("LLAMA_MTP_LLAMA_CPP_DIR") or ROOT / "vendor" / "llama.cpp")
BUILD = HERE / "build" / "upstream"
TARGETS = ("llama-completion", "llama-speculative-simple", "llama-server")


def native() -> bool:
    return os.environ.get("LLAMA_MTP_NATIVE", "").lower() in ("1", "on", "true", "yes")


def cmake_flags() -> list[str]:
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
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
    ]


def binaries() -> dict[str, Path]:
    return {t: BUILD / "bin" / t for t in TARGETS}


def build(log=print) -> dict[str, Path]:
    if not (SRC / "CMakeLists.txt").is_file():
        sys.exit(f"no llama.cpp source in {SRC}: run `pip install .` first (it fetches the pinned source)")
    bins = binaries()
    cmake = shutil.which("cmake") or "cmake"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.time()
    if not (BUILD / "CMakeCache.txt").exists():
        BUILD.mkdir(parents=True, exist_ok=True)
        subprocess.run([cmake, "-S", str(SRC), "-B", str(BUILD), *gen, *cmake_flags()], check=True,
                       stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", str(BUILD), "--target", *TARGETS, "-j", str(os.cpu_count() or 2)], check=True,
                   stdout=subprocess.DEVNULL)
    missing = [str(p) for p in bins.values() if not p.exists()]
    if missing:
        sys.exit(f"build finished but {missing} are missing")
    log(f"upstream drivers ready in {BUILD / 'bin'} ({time.time() - t0:.0f} s)")
    return bins


if __name__ == "__main__":
    build()
