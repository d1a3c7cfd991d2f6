#!/usr/bin/env bash
# Prepare $GPU_DIR (default .gpu/, git-ignored) for bench/device_cuda.sh: everything a
# GPU machine without network needs, built here (nvcc and cuBLAS's headers must be
# installed; no GPU needed), packed small enough to carry (xz: CUDA kernels shrink ~4x).
#
#   CUDA_ARCH=90-real bench/device_pack.sh     # H100/H200; 89-real for Ada, 80-real for A100 ...
#
# Builds: the package's wheel with -C llama_mtp.backend=cuda (build/...-cuda, cached) and
# llama.cpp's drivers with the same flags as shared libraries (bench/build/upstream-cuda-shared,
# cached: one copy of the kernels for the three drivers); calibrates the 1.6B benchmark
# models' MTP noise; fetches the Python wheels the package needs beside the machine's own.
# A CUDA build of both compiles ~150 kernel files twice: about 2 hours on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
G=${GPU_DIR:-.gpu}
ARCH=${CUDA_ARCH:-90-real}
PYVER=${DEVICE_PYTHON:-3.12}
rm -rf "$G/stage" && mkdir -p "$G/stage"
stage=$(cd "$G/stage" && pwd)
mkdir -p "$stage/wheels" "$stage/upstream/bin" "$stage/upstream/lib" "$stage/cache"

echo "== the package, CUDA backend, arch $ARCH"
pip wheel . --no-deps --no-build-isolation -w "$G/dist" -C llama_mtp.backend=cuda \
    -C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$ARCH"
whl=$(ls -t "$G"/dist/llama_mtp-*.whl | head -1)
# stored, not deflated: xz packs the kernels far better than zip does
tmp=$(mktemp -d) && unzip -q "$whl" -d "$tmp" && (cd "$tmp" && zip -q -0 -r "$stage/wheels/$(basename "$whl")" .)
rm -rf "$tmp"

echo "== llama.cpp's drivers, same flags, shared libraries"
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$ARCH ${CMAKE_ARGS:-}" python bench/upstream.py --backend cuda --shared
up=$(python bench/upstream.py --backend cuda --shared --print-flags | sed -n 1p)
for t in llama-completion llama-speculative-simple llama-server; do cp "$up/bin/$t" "$stage/upstream/bin/"; done
find "$up" -name "lib*.so*" \( -type f -o -type l \) -exec cp -a -t "$stage/upstream/lib/" {} +
strip --strip-unneeded "$stage"/upstream/bin/* "$stage"/upstream/lib/*.so* 2>/dev/null || true

echo "== calibration of the 1.6B benchmark models (cached in bench/.cache: ~5 minutes a level on 2 cores)"
python bench/models.py --size 1.6b --calibrate-only
cp "${LLAMA_MTP_BENCH_CACHE:-bench/.cache}"/calibration-*.json "$stage/cache/"

echo "== wheels for Python $PYVER (cffi: the version the extension was generated with)"
pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$stage/wheels" "cffi==$(python -c 'import cffi; print(cffi.__version__)')" pycparser gguf

echo "== pack"
tar -C "$stage" -cf - . | xz -T0 -6 > "$G/bundle.tar.xz"
rm -rf "$stage"
ls -la "$G/bundle.tar.xz"
