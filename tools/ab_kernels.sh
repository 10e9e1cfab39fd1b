#!/usr/bin/env bash
# A/B timing of an older revision's compiled kernels against the working tree's, on the GPU
# machine, in alternating processes on the same warm GPU (the Python side is the working
# tree's in both, so the old kernels must keep the same call contract).
#
# On the development machine, once:   tools/ab_kernels.sh prepare REV
#   extracts REV's CMakeLists.txt, pyproject.toml and ffi/ into build/ab/tree (git-ignored:
#   copy build/ab to the GPU machine with the working tree).
# On the GPU machine:                 tools/ab_kernels.sh run ROUNDS [benchmarks.run args...]
#   builds the old tree's modules into build/ab/tree/b (the new ones must already be in
#   build/gpu: tools/gpu_suite.sh build), then ROUNDS x (new, old) runs of
#   python3 -m benchmarks.run --device gpu <args>; rows go to $OUT/ab_new.txt / ab_old.txt.
set -u
OUT=${OUT:-/tmp/rlx-out}
tree=build/ab/tree
case "${1:-}" in
  prepare)
    rev=${2:?revision}
    rm -rf "$tree" && mkdir -p "$tree"
    git archive "$rev" CMakeLists.txt pyproject.toml ffi | tar -x -C "$tree"
    echo "$rev" >build/ab/REV
    echo "old tree: $(cat build/ab/REV) in $tree"
    ;;
  run)
    rounds=${2:-2}; shift 2
    mkdir -p "$OUT"
    (cd "$tree" && cmake -S . -B b -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLX_JAX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
       -DPython_EXECUTABLE="$(command -v python3)" >/dev/null && cmake --build b -j 16 >/dev/null) \
      || { echo "old build failed"; exit 1; }
    echo "old kernels: $(cat build/ab/REV 2>/dev/null) built"
    for round in $(seq 1 "$rounds"); do
      for which in new old; do
        dir=$PWD/build/gpu; [ $which = old ] && dir=$PWD/$tree/b
        echo "--- round $round: $which" | tee -a "$OUT/ab_$which.txt"
        RLX_JAX_KERNEL_DIR=$dir PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 \
          python3 -m benchmarks.run --device gpu "$@" 2>&1 | grep -vi warning | grep -E "^[a-z_]+.* [0-9.]+ +[0-9.]+" \
          | sort -u | tee -a "$OUT/ab_$which.txt"
      done
    done
    ;;
  *) echo "usage: tools/ab_kernels.sh prepare REV | run ROUNDS [benchmarks.run args]"; exit 2 ;;
esac
