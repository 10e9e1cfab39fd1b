"""Where the benchmark harness's time goes: each RMSNorm GPU case of
benchmarks/cases_rms_norm.py timed two ways on the same jitted functions:
- sync: median of single calls each waited for (what benchmarks/harness.py does: it
  includes dispatch and the wait for the result);
- pipelined: 50 calls issued back to back, then one wait; time / 50 (GPU throughput:
  dispatch overlaps the previous call's kernels).
Run it under XLA_FLAGS=--xla_gpu_enable_command_buffer= too, to see whether command
buffers change anything."""

import os
import statistics
import time

import jax
import jax.numpy as jnp

import rlx_jax  # noqa: F401  (registers the kernels)
from benchmarks import cases_rms_norm as C
from benchmarks.harness import copy_floor_fn


def sync_ms(fn, args, reps=30):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def pipelined_ms(fn, args, n=50, rounds=5):
    jax.block_until_ready(fn(*args))
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(n)]
        jax.block_until_ready(outs)
        best.append((time.perf_counter() - t0) * 1e3 / n)
        del outs
    return statistics.median(best)


print("XLA_FLAGS =", os.environ.get("XLA_FLAGS", ""))
dev = jax.devices()[0]
for case in C.cases("gpu"):
    args = jax.device_put(case.make(jax.random.PRNGKey(0)), dev)
    ours, xla = jax.jit(case.ours), jax.jit(case.xla)
    floor_fn, floor_args = copy_floor_fn(case.floor_bytes, dev)
    r = {}
    for name, fn, a in (("ours", ours, args), ("xla", xla, args), ("copy", floor_fn, floor_args)):
        r[name] = (sync_ms(fn, a), pipelined_ms(fn, a))
    # a second floor with the op's own read/write mix: x + dy (two reads, one write)
    x, dy = args[0], args[-1]
    r["x+dy"] = (sync_ms(jax.jit(jnp.add), (x, dy)), pipelined_ms(jax.jit(jnp.add), (x, dy)))
    gbs = case.floor_bytes / r["ours"][1] / 1e6
    print(f"{case.name:40s} sync: ours {r['ours'][0]:.3f} xla {r['xla'][0]:.3f} copy {r['copy'][0]:.3f} "
          f"ours/copy {r['ours'][0] / r['copy'][0]:.3f} | pipelined: ours {r['ours'][1]:.3f} xla {r['xla'][1]:.3f} "
          f"copy {r['copy'][1]:.3f} ours/copy {r['ours'][1] / r['copy'][1]:.3f} xla/ours {r['xla'][1] / r['ours'][1]:.2f} "
          f"ours {gbs:.0f} GB/s | x+dy {r['x+dy'][1]:.3f} ours/(x+dy) {r['ours'][1] / r['x+dy'][1]:.3f}", flush=True)
