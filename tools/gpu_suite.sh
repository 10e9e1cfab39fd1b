#!/usr/bin/env bash
# The whole GPU check in one call on the GPU machine (device tool), from the repository root:
#   tools/gpu_suite.sh [stages...]     stages: build tests sanitize bench   (default: all)
# Builds both kernel modules for sm_90 into build/gpu (kept between calls while the machine is warm), runs every tests/*_gpu.py file
# (several pytest processes share the GPU; the tests do not time anything), a
# compute-sanitizer memcheck/racecheck pass over the small cases of each CUDA family,
# then the GPU benchmarks one at a time. Logs and a summary go to $OUT (or /tmp/rlx-out).
set -u
OUT=${OUT:-/tmp/rlx-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=" ${*:-build tests sanitize bench} "
has() { [[ "$stages" == *" $1 "* ]]; }
step() { echo "=== $* ($(date +%T))"; }
B=${RLX_GPU_BUILD:-$PWD/build/gpu}
if has build; then
  step build
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLX_JAX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/build.log" 2>&1 &&
    cmake --build $B -j 16 >>"$OUT/build.log" 2>&1
  rc=$?
  echo "build rc=$rc"
  if [ $rc -ne 0 ]; then grep -B2 -A10 -i "error" "$OUT/build.log" | head -60; exit 1; fi
fi
export RLX_JAX_KERNEL_DIR=$B PYTHONPATH=$PWD
python3 -c 'import jax, rlx_jax; i = rlx_jax.kernel_info(); print("jax", jax.__version__, jax.devices()); print("cuda targets:", len(i["cuda"]["targets"]), i["cuda"]["error"] or "")'
if has tests; then
  step tests
  pids=()
  for f in tests/*_gpu.py; do
    n=$(basename "$f" .py)
    ( timeout 420 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib -m "not slow" "$f" \
        >"$OUT/$n.txt" 2>&1; echo "rc=$?" >>"$OUT/$n.txt" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  for f in tests/*_gpu.py; do
    n=$(basename "$f" .py)
    printf "%-32s %s | %s\n" "$n" "$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/$n.txt" | tail -1)" "$(tail -1 "$OUT/$n.txt")"
  done
  grep -h "^FAILED\|^ERROR" "$OUT"/test_*_gpu.txt | head -30
fi
if has sanitize; then
  step memcheck
  # small cases of every CUDA family (the -k selections name those tests' small shapes)
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 300 compute-sanitizer --tool memcheck --leak-check no \
    --target-processes all python3 -m pytest -q -p no:cacheprovider --import-mode=importlib -m "not slow" -x \
    tests/test_rms_norm_gpu.py tests/test_layer_norm_gpu.py tests/test_group_norm_gpu.py tests/test_softmax_gpu.py \
    tests/test_cross_entropy_gpu.py tests/test_gaussian_splat_gpu.py tests/test_attention_gpu.py \
    -k "${RLX_SANITIZE_K:-37x64 or 33x999 or 37x5 or 3x6x5x7 or sanitizer or 2-37-37 or 1-96-96}" \
    >"$OUT/memcheck.txt" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.txt" | tail -3
fi
if has bench; then
  step bench
  timeout 360 python3 -m benchmarks.run --cases rms_norm,norms,rowwise --device gpu --reps 10 \
    --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
  echo "bench rc=$?"; grep -v Warning "$OUT/bench.txt" | tail -40
fi
step done
