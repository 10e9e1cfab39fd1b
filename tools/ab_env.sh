#!/usr/bin/env bash
# A/B timing of two settings of a kernel switch (environment variables read once per process)
# on the GPU machine, in alternating processes on the same warm GPU and the same build:
#   tools/ab_env.sh ROUNDS "A_ENV" "B_ENV" [benchmarks.run args...]
# AB_CMD replaces the timed command (default "python3 -m benchmarks.run --device gpu"; any
# command whose rows are a name, then numbers, the first of them a time), e.g. the wgmma
# attention kernels against the mma.sync ones:
#   AB_CMD="python3 -m benchmarks.cases_attention" tools/ab_env.sh 3 "" "RLX_ATTENTION_CUDA_WGMMA=0" --reps 5 --quick
# A kernel variant under trial is built in beside the default behind a temporary switch and
# measured the same way (tools/ab_kernels.sh compares two commits' builds instead).
# A_ENV / B_ENV: space-separated NAME=VALUE assignments ("" for the defaults). The kernels come
# from RLX_JAX_KERNEL_DIR (default build/gpu: tools/gpu_suite.sh build). Each round runs A then
# B ($AB_CMD <args>); rows go to $OUT/ab_env_A.txt / ab_env_B.txt,
# and the last lines print each row's per-round B/A time ratios (> 1: B slower), so one look
# shows whether a difference is larger than the spread between rounds.
set -u
OUT=${OUT:-/tmp/rlx-out}
rounds=${1:?rounds}
envs=("${2-}" "${3-}")
shift 3
mkdir -p "$OUT"
export RLX_JAX_KERNEL_DIR=${RLX_JAX_KERNEL_DIR:-$PWD/build/gpu} PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
: >"$OUT/ab_env_A.txt"
: >"$OUT/ab_env_B.txt"
for round in $(seq 1 "$rounds"); do
  for i in 0 1; do
    which=$([ $i = 0 ] && echo A || echo B)
    echo "--- round $round: $which [${envs[$i]}]" | tee -a "$OUT/ab_env_$which.txt"
    # shellcheck disable=SC2086
    env ${envs[$i]} timeout 300 ${AB_CMD:-python3 -m benchmarks.run --device gpu} "$@" 2>&1 | grep -vi warning \
      | grep -E "^[a-z_]+.* [0-9.]+ +[0-9.]+" | grep -v "^#" | tee -a "$OUT/ab_env_$which.txt"
  done
done
# per row: B/A of the first time column ("ours ms") in each round
python3 - "$OUT/ab_env_A.txt" "$OUT/ab_env_B.txt" <<'EOF'
import re, sys
def rounds(path):
    out, cur = [], None
    for line in open(path):
        if line.startswith("--- round"):
            cur = {}
            out.append(cur)
            continue
        m = re.match(r"^(\S.*?\S)\s+([0-9.]+)\s+[0-9.]+", line)
        if m and cur is not None:
            cur[m.group(1)] = float(m.group(2))
    return out
a, b = rounds(sys.argv[1]), rounds(sys.argv[2])
for name in (a[0] if a else {}):
    ratios = [rb[name] / ra[name] for ra, rb in zip(a, b) if name in ra and name in rb and ra[name] > 0]
    print(f"B/A {name:52s} " + " ".join(f"{r:.3f}" for r in ratios))
EOF
