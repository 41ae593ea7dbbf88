#!/usr/bin/env bash
# Build build/dsv4_run against the libtorch of PYTHON's torch (argument 1):  bash csrc/runner/build.sh PYTHON
# Configures once (again only when the torch install changes); `cmake --build` is a no-op when
# nothing changed. Several builds at once (parallel test workers) take turns on a lock file.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:?usage: build.sh PYTHON}
build=build/runner
cm=$( [ -x .venv/bin/cmake ] && echo .venv/bin/cmake || command -v cmake ) || { echo "[runner] cmake not found"; exit 1; }
mkdir -p build
if command -v flock >/dev/null; then  # util-linux; without it builds simply do not take turns
  exec 9>build/.runner.lock
  flock 9
fi
prefix=$("$py" -c "import torch; print(torch.utils.cmake_prefix_path)")
if ! grep -qF "CMAKE_PREFIX_PATH:UNINITIALIZED=$prefix" $build/CMakeCache.txt 2>/dev/null; then
  "$cm" -S csrc/runner -B $build -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$PWD/build" >/dev/null
fi
"$cm" --build $build -j "$(nproc)"
