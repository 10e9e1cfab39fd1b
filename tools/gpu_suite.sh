#!/usr/bin/env bash
# The whole GPU check in one go on a GPU machine, from the repository root:
#   tools/gpu_suite.sh [stages...]     stages: build tests sanitize bench   (default: all)
# Builds both kernel modules for sm_90a into build/gpu (reused by later runs on the same machine), runs every tests/*_gpu.py file
# (several pytest processes share the GPU; the tests do not time anything), a
# compute-sanitizer memcheck pass over the small cases of each CUDA family (and memcheck +
# racecheck of each attention pipeline through tools/attention_sanitize.py),
# then the GPU benchmarks one at a time. Logs and a summary go to $OUT (or /tmp/rlx-out).
set -u
OUT=${OUT:-/tmp/rlx-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=" ${*:-build tests sanitize bench} "
has() { [[ "$stages" == *" $1 "* ]]; }
step() { echo "=== $* ($(date +%T))"; }
B=${RLX_GPU_BUILD:-$PWD/build/gpu}
# RLX_GPU_EXCLUDE: a regex of test file names (e.g. "attention") the tests and sanitize stages
# leave out; RLX_SANITIZE_ATTENTION=0 skips the per-pipeline attention sanitizer runs;
# RLX_BENCH_CASES / RLX_BENCH_REPS / RLX_BENCH_TIMEOUT: the bench stage's case modules, repetitions, time limit.
EXCLUDE=${RLX_GPU_EXCLUDE:-^$}
gpu_test_files() { for f in tests/test_*_gpu.py; do [[ "$(basename "$f")" =~ $EXCLUDE ]] || echo "$f"; done; }
if has build; then
  step build
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLX_JAX_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
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
  # one pytest process per file (at most 420 s each); the long files run as processes
  # split by -k, one log each ($n.partK.txt). Attention: five parts, then each
  # RLX_ATTENTION_CUDA_WGMMA setting's child of test_wgmma_forward in its own part, the settings
  # read from the test's own parametrisation (so a new setting gets a part).
  att_parts=("tensor_core_path" "kernel_specialisations" "deterministic" "ws_persistent"
             "not tensor_core_path and not kernel_specialisations and not wgmma and not deterministic and not ws_persistent")
  while read -r v; do
    att_parts+=("test_wgmma_forward and $v")
  done < <(python3 -m pytest -q --collect-only -p no:cacheprovider --import-mode=importlib -m "not slow" \
             tests/test_attention_gpu.py -k test_wgmma_forward 2>/dev/null |
           sed -n 's/.*::test_wgmma_forward\[\(.*\)\]$/\1/p')
  # pool: about 5 minutes alone on an H200, past the limit beside the other files, and its
  # second half still took 6.6 of the 7 minutes in two parts: three parts;
  # the segment kernels' file (4 minutes alone) ran past the limit beside the others: three;
  # the cuDNN forward route's served calls (four) took 6.2 minutes in one part: two parts of
  # them and one of the rest; cross-entropy took 6.3 minutes in one process: two parts
  seg_parts=("segment_kernels_match_oracle and causal" "segment_kernels_match_oracle and not causal"
             "not segment_kernels_match_oracle")
  cudnn_fwd_parts=("served_calls and causal" "served_calls and not causal" "not served_calls")
  pool_parts=("max_pool_gradient" "max_pool_forward_exact" "not max_pool_gradient and not max_pool_forward_exact")
  ce_parts=("loss_grad_kernel_matches_reference" "not loss_grad_kernel_matches_reference")
  run_parts() {  # run_parts FILE XLA_FLAGS SELECTION...: one pytest process per -k selection
    local f=$1 flags=$2 n i; shift 2
    n=$(basename "$f" .py)
    local parts=("$@")
    for i in "${!parts[@]}"; do
      ( XLA_FLAGS=$flags timeout 420 python3 -m pytest -q -p no:cacheprovider \
          --import-mode=importlib -m "not slow" "$f" -k "${parts[$i]}" >"$OUT/$n.part$i.txt" 2>&1
        echo "rc=$?" >>"$OUT/$n.part$i.txt" ) &
      pids+=($!)
    done
  }
  for f in $(gpu_test_files); do
    n=$(basename "$f" .py)
    case "$n" in  # the long files run as -k parts, the others as one process each
      test_attention_gpu) run_parts "$f" --xla_gpu_autotune_level=0 "${att_parts[@]}" ;;
      test_pool_gpu) run_parts "$f" "${XLA_FLAGS:-}" "${pool_parts[@]}" ;;
      test_attention_segments_gpu) run_parts "$f" "${XLA_FLAGS:-}" "${seg_parts[@]}" ;;
      test_attention_cudnn_forward_gpu) run_parts "$f" "${XLA_FLAGS:-}" "${cudnn_fwd_parts[@]}" ;;
      test_cross_entropy_gpu) run_parts "$f" "${XLA_FLAGS:-}" "${ce_parts[@]}" ;;
      *)
        ( timeout 420 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib -m "not slow" "$f" \
            >"$OUT/$n.txt" 2>&1; echo "rc=$?" >>"$OUT/$n.txt" ) &
        pids+=($!) ;;
    esac
  done
  wait "${pids[@]}"
  for f in $(gpu_test_files); do
    n=$(basename "$f" .py)
    for log in "$OUT/$n.txt" "$OUT/$n".part*.txt; do
      [ -f "$log" ] || continue
      printf "%-38s %s | %s\n" "$(basename "$log" .txt)" "$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)" "$(tail -1 "$log")"
    done
  done
  grep -h "^FAILED\|^ERROR" "$OUT"/test_*_gpu*.txt | head -30
fi
if has sanitize; then
  step sanitize
  # memcheck over the small cases of every CUDA family, one sanitizer process per test file
  # (one process over all files can crash compute-sanitizer itself after a few dozen tests,
  # with no error reported), side by side; the -k selection names those tests' small shapes.
  export XLA_PYTHON_CLIENT_ALLOCATOR=platform
  memcheck() {  # memcheck LOG PYTEST_ARGS...: one sanitizer process, its rc appended to LOG
    local log=$1; shift
    timeout 300 compute-sanitizer --tool memcheck --leak-check no --target-processes all python3 -m pytest -q \
      -p no:cacheprovider --import-mode=importlib -m "not slow" "$@" >"$log" 2>&1
    echo "rc=$?" >>"$log"
  }
  K="${RLX_SANITIZE_K:-37x64 or 33x999 or 37x5 or 3x6x5x7 or sanitizer or 2-37-37 or 1-96-96 or 1001 or odd_offsets or 16x8192 or 300x16384 or 531x32000 or 700x8200}"
  pids=()
  for f in $(gpu_test_files); do
    n=$(basename "$f" .py); [ "$n" = test_reliability_gpu ] && continue
    ( memcheck "$OUT/memcheck_$n.txt" "$f" -k "$K"
      # compute-sanitizer itself sometimes segfaults in a long process (GroupNorm's cluster
      # kernels) without reporting an error: then each selected test runs under
      # memcheck in its own process, and the file's line sums those runs
      if ! grep -q "ERROR SUMMARY" "$OUT/memcheck_$n.txt"; then
        python3 -m pytest -q --collect-only -p no:cacheprovider --import-mode=importlib -m "not slow" "$f" -k "$K" \
          2>/dev/null | grep "::" >"$OUT/ids_$n.txt"
        i=0
        while read -r id; do
          i=$((i + 1)); memcheck "$OUT/memcheck_${n}_$i.part" "$id"
        done <"$OUT/ids_$n.txt"
        { echo "tool crash in one process; per test: $(grep -l 'ERROR SUMMARY: 0 errors' "$OUT"/memcheck_"$n"_*.part | wc -l) of $i clean, $(cat "$OUT"/memcheck_"$n"_*.part | grep -c '^[0-9]* passed') passed"
          grep -h "ERROR SUMMARY: [1-9]" "$OUT"/memcheck_"$n"_*.part | head -3
          grep -q "ERROR SUMMARY: [1-9]" "$OUT"/memcheck_"$n"_*.part && echo "ERROR SUMMARY: errors in per-test runs" ||
            { [ "$(grep -l 'ERROR SUMMARY: 0 errors' "$OUT"/memcheck_"$n"_*.part | wc -l)" = "$i" ] && echo "========= ERROR SUMMARY: 0 errors (per test)"; }
          echo "rc=per-test"; } >>"$OUT/memcheck_$n.txt"
      fi ) &
    pids+=($!)
  done
  # attention: the forward and the backward of both head dims, with and without a key mask, the
  # PLAIN score loops and the general ones (softcap, bias; on sm_90a a softcap or a key mask without a bias,
  # mask kind none or causal, takes the wgmma CAP / MASK kernels), under memcheck and racecheck (the
  # shared-memory K / V buffers are where a race would be)
  [ "${RLX_SANITIZE_ATTENTION:-1}" = 1 ] && ( i=0
    for tool in memcheck racecheck; do
      for cfg in "64 bfloat16 causal fwd" "64 bfloat16 none fwd 1" "128 bfloat16 none fwd" "128 float16 causal bwd" \
                 "64 bfloat16 sliding bwd 1" "64 float32 causal bwd" "128 bfloat16 none bwd 0 softcap" "64 float16 causal bwd 0 softcap" \
                 "128 bfloat16 causal bwd 1" "64 bfloat16 none bwd 1 softcap" "128 bfloat16 sliding bwd 0 softcap" \
                 "64 float16 causal bwd 1 bias" "128 bfloat16 causal bwd 0 segments" \
                 "64 float16 sliding bwd 1 segments"; do
        i=$((i + 1))
        timeout 120 compute-sanitizer --tool $tool python3 tools/attention_sanitize.py $cfg >"$OUT/attn_$tool$i.txt" 2>&1
        echo "attention $tool [$cfg] rc=$? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/attn_$tool$i.txt" | tail -1)"
      done
    done
  ) >"$OUT/attention_sanitize.txt" 2>&1 &
  [ "${RLX_SANITIZE_ATTENTION:-1}" = 1 ] && pids+=($!)
  wait "${pids[@]}"
  for f in "$OUT"/memcheck_*.txt; do
    printf "%-40s %s | %s | %s\n" "$(basename "$f" .txt)" "$(grep -E 'passed|failed' "$f" | tail -1)" \
      "$(grep 'ERROR SUMMARY' "$f" | tail -1)" "$(tail -1 "$f")"
  done
  [ "${RLX_SANITIZE_ATTENTION:-1}" = 1 ] && cat "$OUT/attention_sanitize.txt"
fi
if has bench; then
  step bench
  timeout "${RLX_BENCH_TIMEOUT:-360}" python3 -m benchmarks.run --cases "${RLX_BENCH_CASES:-rms_norm,norms,rowwise,conv_pool}" --device gpu --reps "${RLX_BENCH_REPS:-10}" \
    --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
  echo "bench rc=$?"; grep -v Warning "$OUT/bench.txt" | tail -40
fi
step done
