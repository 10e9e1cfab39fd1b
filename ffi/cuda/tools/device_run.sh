#!/usr/bin/env bash
# The RMSNorm CUDA kernels' development check on a GPU machine, from the repository root:
#   ffi/cuda/tools/device_run.sh [stages...]   stages: build sweep test bench sanitize
# build: the stand-alone harness (rms_norm_sweep.cu, every variant) and the modules; sweep: its
# correctness checks and timings; test / bench: the RMSNorm tests and benchmark; sanitize:
# memcheck and racecheck of the harness, memcheck of the kernels through JAX. Logs go to $OUT
# (default /tmp/rlx-out).
set -u
OUT=${OUT:-/tmp/rlx-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=" ${*:-build sweep test bench} "
has() { [[ "$stages" == *" $1 "* ]]; }
step() { echo "=== $* ($(date +%T))"; }
B=/tmp/rlx-b
if has build; then
  step env
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
  INC=$(python3 -c 'import jax; print(jax.ffi.include_dir())')
  step build
  nvcc -std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -lineinfo -DRLX_RMS_ALL_VARIANTS -I ffi -isystem "$INC" \
    ffi/cuda/tools/rms_norm_sweep.cu -o /tmp/rms_sweep >"$OUT/sweep_build.log" 2>&1 &
  sweep_pid=$!
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLX_JAX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/build.log" 2>&1 &&
    cmake --build $B -j 16 --target _ffi_cuda >>"$OUT/build.log" 2>&1
  echo "cuda module build rc=$?"
  cmake --build $B -j 16 --target _ffi_cpu >>"$OUT/build.log" 2>&1
  echo "cpu module build rc=$? (not needed on GPU)"
  wait $sweep_pid
  echo "sweep build rc=$?"
  grep -i -B2 -A6 "error" "$OUT/build.log" | head -40
  tail -5 "$OUT/sweep_build.log"
fi
export RLX_JAX_KERNEL_DIR=$B PYTHONPATH=$PWD
if has sweep; then
  step sweep
  timeout 300 /tmp/rms_sweep >"$OUT/sweep.txt" 2>&1
  echo "sweep rc=$?"
  grep -E "FAIL|failures|COPY|TIME|device" "$OUT/sweep.txt"
fi
if has test; then
  step pytest
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_rms_norm_gpu.py tests/test_rms_norm.py >"$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"
  grep -E "passed|failed|error|Error" "$OUT/pytest.txt" | tail -25
fi
if has bench; then
  step bench
  timeout 300 python3 -m benchmarks.run --cases rms_norm --device gpu --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
  echo "bench rc=$?"
  tail -12 "$OUT/bench.txt"
fi
if has sanitize; then
  step memcheck-harness
  timeout 240 compute-sanitizer --tool memcheck --leak-check no /tmp/rms_sweep quick >"$OUT/memcheck.txt" 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|failures" "$OUT/memcheck.txt"
  step racecheck-harness
  timeout 240 compute-sanitizer --tool racecheck /tmp/rms_sweep quick >"$OUT/racecheck.txt" 2>&1
  echo "rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|failures" "$OUT/racecheck.txt"
  step memcheck-jax
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 300 compute-sanitizer --tool memcheck --leak-check no \
    python3 ffi/cuda/tools/sanitize_rms_norm.py >"$OUT/memcheck_jax.txt" 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|sanitize script done" "$OUT/memcheck_jax.txt"
fi
step done
