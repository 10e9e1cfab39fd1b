#!/usr/bin/env bash
# Development build of the compiled kernels into a private folder, without installing:
#   tools/build_kernels.sh /tmp/rlx-build [cuda: AUTO|ON|OFF]
#   RLX_JAX_KERNEL_DIR=/tmp/rlx-build PYTHONPATH=$PWD python -m pytest tests/...
# Several developers can each build and test the same tree this way at once.
set -euo pipefail
out=${1:?usage: tools/build_kernels.sh OUT_DIR [AUTO|ON|OFF]}
cuda=${2:-OFF}
here=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$here" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLX_JAX_CUDA="$cuda" \
  -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build "$out" -j "$(nproc)"
