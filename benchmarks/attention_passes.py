"""Each attention pass alone: the ``attention_fwd`` primitive, and the ``attention_bwd`` primitive
(the kernel the VJP calls) on the forward's saved out and lse, so a kernel A/B sees one pass without
the other's share. To compare two builds or settings, run one process per setting, alternating
(RLX_ATTENTION_CUDA_WGMMA is read once per process), e.g. on the GPU machine:

    python3 -m benchmarks.attention_passes --passes fwd,bwd --kinds none,causal --batch 4 --head-dims 128
    RLX_ATTENTION_CUDA_WGMMA=0 python3 -m benchmarks.attention_passes ...   # the mma.sync kernels

Prints one row per case: ``<pass> D<d> <kind> B<b>: <ms> ms <TF/s> TF/s``; the time is the
runner's (benchmarks.harness.time_fn: median of --reps samples, each of default_batch calls back
to back) and the work counts the forward as 4 B H S^2 D flops (2 S x S x D products) and the
backward as 2.5 forward's (5 products), halved when causal; kind sliding (--window W: row i sees keys
i - W .. i) counts the visible (query, key) pairs, (W + 1) S - W (W + 1) / 2 for W < S, instead of S^2. Shapes [B, S, H, D], bf16 by default;
inputs from a fixed seed. --softcap C (> 0) caps the scaled scores, C tanh(s / C); --key-mask F
(0 < F <= 1) adds a key mask [B, S] keeping each key with probability F (fixed seed; at F < 1 nearly
every key tile holds a hidden key). The flop count is unchanged by either (hidden keys and the tanh
are not discounted or counted).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.harness import default_batch, time_fn
from rlx_jax.vjp_rules import attention as A


def pass_case(which: str, kind: str, b: int, s: int, h: int, d: int, dtype, softcap: float = 0.0,
              keep: float = 0.0, window: int = 0) -> tuple:
    """(jitted pass, its arguments, its flop count) of one case; which: fwd or bwd; keep > 0: a key
    mask keeping each key with that probability."""
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v, dy = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype) for kk in ks[:4])
    extras = [(jax.random.uniform(ks[4], (b, s)) < keep).astype(jnp.float32)] if keep > 0 else []
    params = dict(kind=kind, window=window if kind == "sliding" else 0, scale=d ** -0.5, softcap=softcap,
                  has_mask=bool(extras), has_bias=False)
    forward = jax.jit(lambda q, k, v, *e: A.attention_fwd(q, k, v, *e, **params))
    pairs = s * s * (0.5 if kind == "causal" else 1.0)
    if kind == "sliding":
        w = min(window, s - 1)
        pairs = (w + 1) * s - w * (w + 1) / 2
    flops = 4 * b * h * pairs * d
    if which == "fwd":
        return forward, (q, k, v, *extras), flops
    out, lse = forward(q, k, v, *extras)
    fn = jax.jit(lambda *x: A.attention_bwd(*x, **params))
    return fn, (q, k, v, out, lse, dy, jnp.zeros_like(lse), *extras), 2.5 * flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", default="bwd", help="passes, comma-separated (fwd, bwd)")
    parser.add_argument("--kinds", default="none,causal", help="mask kinds, comma-separated (none, causal, sliding)")
    parser.add_argument("--window", type=int, default=512, help="the sliding window (kind sliding)")
    parser.add_argument("--batch", default="4", help="batch sizes, comma-separated")
    parser.add_argument("--head-dims", default="128", help="head dims, comma-separated")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--softcap", type=float, default=0.0, help="softcap C of the scores (0: none)")
    parser.add_argument("--key-mask", type=float, default=0.0,
                        help="a key mask keeping each key with this probability (0: no mask)")
    parser.add_argument("--once", action="store_true", help="one call per case, no timing (for ncu)")
    args = parser.parse_args()
    if not args.softcap >= 0.0:
        parser.error(f"--softcap: {args.softcap} is not >= 0")
    if not 0.0 <= args.key_mask <= 1.0:
        parser.error(f"--key-mask: {args.key_mask} is not in [0, 1]")
    kinds, passes = args.kinds.split(","), args.passes.split(",")
    for kind in kinds:
        if kind not in ("none", "causal", "sliding"):
            parser.error(f"--kinds: {kind!r} is not none, causal or sliding")
    if args.window < 0:
        parser.error(f"--window: {args.window} is negative")
    for which in passes:
        if which not in ("fwd", "bwd"):
            parser.error(f"--passes: {which!r} is not fwd or bwd")
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    for d in (int(x) for x in args.head_dims.split(",")):
        for kind in kinds:
            for b in (int(x) for x in args.batch.split(",")):
                for which in passes:
                    fn, fargs, flops = pass_case(which, kind, b, args.seq, args.heads, d, dtype, args.softcap,
                                                 args.key_mask, args.window)
                    jax.block_until_ready(fn(*fargs))
                    if args.once:
                        continue
                    t = time_fn(fn, fargs, args.reps, batch=default_batch(device))
                    cap = f" softcap {args.softcap:g}" if args.softcap else ""
                    cap += f" key-mask {args.key_mask:g}" if args.key_mask else ""
                    cap += f" window {args.window}" if kind == "sliding" else ""
                    print(f"{which} D{d} {kind}{cap} B{b}: {t:.3f} ms {flops / t / 1e9:.1f} TF/s", flush=True)


if __name__ == "__main__":
    main()
