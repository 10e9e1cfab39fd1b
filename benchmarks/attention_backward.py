"""The attention backward alone: the ``attention_bwd`` primitive (the kernel the VJP calls) on
the forward's saved out and lse, so a kernel A/B sees the backward without the forward's
share. Run one process per setting of a kernel switch (RLX_ATTENTION_CUDA_* variables are read
once per process), alternating, e.g. on the GPU machine:

    python3 -m benchmarks.attention_backward --kinds none,causal --batch 4 --head-dims 128
    RLX_ATTENTION_CUDA_WGMMA_BWD=6 python3 -m benchmarks.attention_backward ...

Prints one row per case: ``bwd D<d> <kind> B<b>: <ms> ms <TF/s> TF/s``; the time is the
runner's (benchmarks.harness.time_fn: median of --reps samples, each of default_batch calls back
to back) and the work counts the backward as 2.5 forward's (5 S x S x D products), halved when
causal. Shapes [B, S, H, D], bf16 by default; inputs from a fixed seed.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.harness import default_batch, time_fn
from rlx_jax.vjp_rules import attention as A


def backward_case(kind: str, b: int, s: int, h: int, d: int, dtype) -> tuple:
    """(jitted backward, its arguments, its flop count) of one case."""
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, dy = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype) for kk in ks)
    params = dict(kind=kind, window=0, scale=d ** -0.5, softcap=0.0, has_mask=False, has_bias=False)
    out, lse = jax.jit(lambda q, k, v: A.attention_fwd(q, k, v, **params))(q, k, v)
    fn = jax.jit(lambda *x: A.attention_bwd(*x, **params))
    args = (q, k, v, out, lse, dy, jnp.zeros_like(lse))
    flops = 4 * b * h * s * s * d * 2.5 * (0.5 if kind == "causal" else 1.0)
    return fn, args, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="none,causal", help="mask kinds, comma-separated (none, causal)")
    parser.add_argument("--batch", default="4", help="batch sizes, comma-separated")
    parser.add_argument("--head-dims", default="128", help="head dims, comma-separated")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--once", action="store_true", help="one call per case, no timing (for ncu)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in ("none", "causal"):
            parser.error(f"--kinds: {kind!r} is not none or causal")
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    for d in (int(x) for x in args.head_dims.split(",")):
        for kind in kinds:
            for b in (int(x) for x in args.batch.split(",")):
                fn, fargs, flops = backward_case(kind, b, args.seq, args.heads, d, dtype)
                jax.block_until_ready(fn(*fargs))
                if args.once:
                    continue
                t = time_fn(fn, fargs, args.reps, batch=default_batch(device))
                print(f"bwd D{d} {kind} B{b}: {t:.3f} ms {flops / t / 1e9:.1f} TF/s", flush=True)


if __name__ == "__main__":
    main()
