"""Context-parallel attention against the plain fused kernel, loss and gradients under jit.

On the devices of one host, ``rlx_jax.parallel.context_parallel_attention`` over a mesh of
``--devices`` devices (the sequence split, zig-zag order) is timed against
``rlx_jax.ops.attention`` on one device, in interleaved rounds (median). On a 1-device mesh
the ratio is the overhead of the context-parallel entry itself. Prints ms, TFLOP/s
(forward + backward = 3.5x the forward's 4 B H S^2 D, halved for causal) and the ratio.

    python -m benchmarks.context_parallel --seq 8192 --devices 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlx_jax.ops import attention
from rlx_jax.parallel import context_parallel_attention


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mask-kind", default="causal", choices=["none", "causal"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (a.batch, a.seq, a.heads, a.head_dim), dtype)
    k = jax.random.normal(keys[1], (a.batch, a.seq, a.kv_heads, a.head_dim), dtype)
    v = jax.random.normal(keys[2], (a.batch, a.seq, a.kv_heads, a.head_dim), dtype)
    mesh = Mesh(np.array(jax.devices()[: a.devices]), ("cp",))

    def plain(q, k, v):
        return attention(q, k, v, mask_kind=a.mask_kind)

    def ring(q, k, v):
        return context_parallel_attention(q, k, v, mesh=mesh, axis_name="cp", mask_kind=a.mask_kind)

    def step(f):
        loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, (0, 1, 2)))

    fns = {"ops.attention": step(plain), f"context_parallel x{a.devices}": step(ring)}
    for f in fns.values():
        jax.block_until_ready(f(q, k, v))
    times = {n: [] for n in fns}
    for _ in range(a.rounds):
        for n, f in fns.items():
            t = time.perf_counter()
            for _ in range(a.reps):
                out = f(q, k, v)
            jax.block_until_ready(out)
            times[n].append((time.perf_counter() - t) / a.reps)
    flops = 3.5 * 4 * a.batch * a.heads * a.seq * a.seq * a.head_dim * (0.5 if a.mask_kind == "causal" else 1)
    base = statistics.median(times["ops.attention"])
    print(f"B{a.batch} S{a.seq} H{a.heads}/{a.kv_heads} D{a.head_dim} {a.mask_kind} {a.dtype}, "
          f"{jax.devices()[0].device_kind}, median of {a.rounds} rounds")
    for n, ts in times.items():
        m = statistics.median(ts)
        print(f"{n:24s} {m * 1e3:8.3f} ms  {flops / m / 1e12:7.1f} TFLOP/s  {base / m:6.3f}x")


if __name__ == "__main__":
    main()
