#!/usr/bin/env bash
# Run an exported package from C++: build/dsv4_run (csrc/runner) loads the .pt2 with
# torch::inductor::AOTIModelPackageLoader, prefills and decodes greedily, prints the new token ids.
#
#   bash examples/run_from_cpp.sh [package.pt2]     (default: export the tiny model to build/tiny.pt2)
#
# On the GPU box (torch 2.11): LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 bash examples/run_from_cpp.sh
set -euo pipefail
PKG=$(realpath -m "${1:-$(dirname "$0")/../build/tiny.pt2}")
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ ! -f "$PKG" ]; then
  "$PY" -m dsv4_ops export --config tiny --out "$PKG" --max-batch-size 2 --max-seq-len 128 --prefill-chunk 16
fi
make runner RUNNER_PY="$PY"
build/dsv4_run "$PKG" --prompt 1,2,3 --prompt "$(seq -s, 5 44)" --max-new-tokens 16
