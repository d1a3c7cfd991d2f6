#!/bin/bash
# The package at an older commit against the working tree, in alternating processes that
# each start from the same copy of the calibration cache (and so the same engine memory):
#
#     bench/experiments/old_new.sh REV N [adaptive.py ARGS...]
#
# e.g. `old_new.sh 3369eca 2 --levels 50 --parallel 4 --draft 1,2 --repeat 3`. REV's
# llama_mtp (Python only: the compiled extension of the editable install is copied next to
# it, so REV must not change the C side) runs with the editable finder switched off; both
# run this tree's bench/adaptive.py. The cache copied is $LLAMA_MTP_CACHE_DIR (default
# ~/.cache/llama-mtp) as it is when the script starts, or $CACHE0 (a prepared copy: e.g.
# one whose engine memory was edited to start both sides in checkpoint mode). Prints each run's "=>" lines, tagged
# "old i" / "new i"; results under /tmp/old_new.*/res_{old,new}I.
set -euo pipefail
rev=$1; n=$2; shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python}
work=$(mktemp -d /tmp/old_new.XXXXXX)
git -C "$here" archive "$rev" llama_mtp | tar -x -C "$work"
so=$("$py" -c "import importlib.util as u; print(u.find_spec('llama_mtp._native._llama').origin)")
cp "$so" "$work/llama_mtp/_native/"
# the scikit-build-core editable finder steps aside for a build dir listed here
skip=$("$py" -c "import sys; print(''.join(m.path for m in sys.meta_path if type(m).__name__.startswith('ScikitBuild')))")
got=$(cd "$work" && SKBUILD_EDITABLE_SKIP="$skip" PYTHONPATH="$work" "$py" -c "import llama_mtp; print(llama_mtp.__file__)")
[ "$got" = "$work/llama_mtp/__init__.py" ] || { echo "old package not imported ($got)" >&2; exit 1; }
cp -r "${CACHE0:-${LLAMA_MTP_CACHE_DIR:-$HOME/.cache/llama-mtp}}" "$work/cache0"
echo "old: $rev in $work; cache snapshot $work/cache0"
for i in $(seq 1 "$n"); do
  for v in old new; do
    rm -rf "$work/cache"; cp -r "$work/cache0" "$work/cache"
    if [ "$v" = old ]; then
      (cd "$work" && SKBUILD_EDITABLE_SKIP="$skip" PYTHONPATH="$work" LLAMA_MTP_CACHE_DIR="$work/cache" \
        "$py" "$here/bench/adaptive.py" "$@" --out "$work/res_$v$i" 2>&1 | grep "=>" | sed "s/^/$v $i /")
    else
      (cd "$here" && LLAMA_MTP_CACHE_DIR="$work/cache" \
        "$py" "$here/bench/adaptive.py" "$@" --out "$work/res_$v$i" 2>&1 | grep "=>" | sed "s/^/$v $i /")
    fi
  done
done
