#!/usr/bin/env bash
# The CUDA check, as one script for a lent GPU machine that has no network and little
# time: install the prebuilt CUDA wheel, run the GPU tests and the whole suite on it,
# then the upstream comparison on the 1.6B benchmark model. Everything it needs was
# built on another machine (bench/device_pack.sh) and lies in $GPU_DIR (default .gpu/,
# git-ignored), as bundle.tar.xz or unpacked:
#
#   wheels/     llama_mtp (pip wheel . -C llama_mtp.backend=cuda
#               -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90-real), cffi, pycparser, gguf
#   upstream/   bin/ and lib/ of `CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90-real
#               python bench/upstream.py --backend cuda --shared` (same source, same flags)
#   cache/      calibration-*.json of `python bench/models.py --size 1.6b --calibrate-only`
#
# Results go to $OUT (default bench/results/device): log.txt, compare_upstream-cuda.*,
# adaptive-cuda.*, pytest.txt, profile.txt. BUDGET_S bounds the whole run (default 540 s).
set -uo pipefail
cd "$(dirname "$0")/.."
G=${GPU_DIR:-.gpu}
OUT=${OUT:-bench/results/device}
BUDGET_S=${BUDGET_S:-540}
SIZE=${SIZE:-1.6b}              # benchmark model size (bench/models.py)
LEVELS=${LEVELS:-75,97,50}      # acceptance levels, in the order they are measured
BENCH_ARGS=${BENCH_ARGS:---draft 1-6 --repeat 3}
ADAPTIVE_LEVELS=${ADAPTIVE_LEVELS:-0,50,shift}   # bench/adaptive.py after the comparison, if time is left
ADAPTIVE_ARGS=${ADAPTIVE_ARGS:---draft 1-4 --repeat 2 --parallel 1,4}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
nproc; python3 --version

if [ -f "$G/bundle.tar.xz" ]; then   # what bench/device_pack.sh made
    stamp "unpack $G/bundle.tar.xz"
    mkdir -p /tmp/gpu && xz -dc "$G/bundle.tar.xz" | tar -C /tmp/gpu -xf - || exit 1
    G=/tmp/gpu
fi

stamp "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$G"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
# the CUDA runtime and cuBLAS of the image (the wheel links libcudart.so.13 and libcublas.so.13)
libdirs=""
for lib in libcublas.so.13 libcudart.so.13; do
    f=$(find /usr/local /usr/lib /opt -name "$lib" 2>/dev/null | head -1)
    [ -n "$f" ] && libdirs="$libdirs:$(dirname "$f")"
done
export LD_LIBRARY_PATH="$G/upstream/lib$libdirs:${LD_LIBRARY_PATH:-}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
python3 -P - <<'EOF' || exit 1
import json, llama_mtp as lm
info = lm.build_info()
print(json.dumps({k: info[k] for k in ("llama_cpp_commit", "backends", "devices", "capabilities")}, indent=1))
EOF
"$G"/upstream/bin/llama-completion --version 2>&1 | tail -2

stamp "benchmark models, in the background (one process per level)"
export LLAMA_MTP_BENCH_CACHE=/tmp/bcache
mkdir -p "$LLAMA_MTP_BENCH_CACHE" && cp "$G"/cache/*.json "$LLAMA_MTP_BENCH_CACHE"/ 2>/dev/null
pids=""
for level in $(echo "$LEVELS,$ADAPTIVE_LEVELS" | tr ',' '\n' | sort -u); do
    python3 bench/models.py --size "$SIZE" --levels "$level" > "/tmp/model-$level.log" 2>&1 &
    pids="$pids $!"
done

stamp "GPU tests"
# -P: the checkout is not put on sys.path (the installed package is tested)
timeout 150 python3 -P -m pytest -q -p no:cacheprovider -rfE tests/test_gpu.py 2>&1 | tee "$OUT/pytest.txt" | tail -25

stamp "the whole suite on the CUDA build (12 workers, bounded while the models are written)"
par=$(python3 -c "import xdist, pytest_timeout; print('-n 12 --timeout 100')" 2>/dev/null)
# shellcheck disable=SC2086
timeout "${SUITE_S:-120}" python3 -P -m pytest -q -p no:cacheprovider -rfE $par 2>&1 \
    | tee -a "$OUT/pytest.txt" | tail -40

stamp "the README's first command, on the GPU"
timeout 60 llama-mtp generate -p "Multi-token prediction" 2>&1 | tail -3

stamp "waiting for the models"
for p in $pids; do wait "$p"; done
cat /tmp/model-*.log

stamp "ours vs llama.cpp's drivers ($(left) s left)"
# shellcheck disable=SC2086
timeout $(( $(left) > 260 ? ${COMPARE_S:-200} : $(left) - 60 )) python3 bench/compare_upstream.py --size "$SIZE" --levels "$LEVELS" $BENCH_ARGS \
    --upstream-bin "$G/upstream/bin" --tag cuda --out "$OUT"

stamp "draft_max=auto against plain and fixed k: bench/adaptive.py ($(left) s left)"
# shellcheck disable=SC2086
[ "$(left)" -gt 100 ] && timeout $(( $(left) - 60 )) python3 bench/adaptive.py --size "$SIZE" \
    --levels "$ADAPTIVE_LEVELS" $ADAPTIVE_ARGS --tag cuda --out "$OUT"

stamp "profiles of a step on the ~50% model: k=3, then auto with the policy's view ($(left) s left)"
{ timeout 25 python3 bench/profile_step.py --size "$SIZE" --level 50 -k 3 --top 12
  timeout 25 python3 bench/profile_step.py --size "$SIZE" --level 50 -k auto --explain --top 12; } \
    > "$OUT/profile.txt" 2>&1
grep -A6 "sequence(s)" "$OUT/profile.txt"
stamp "done"
