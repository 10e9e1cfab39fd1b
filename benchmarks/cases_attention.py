"""Attention forward and forward+backward: ours (flash kernels, O(S) memory) vs XLA's
autodiff of the pure-JAX reference (O(S^2): it materialises the score matrices).

Shapes [B, S, H, D] (default B2 S1024 H8 D64 on CPU). Floor: the bytes an attention must
move at least: q, k, v read and out written (fwd); plus dy read and dq, dk, dv written
(fwd+bwd). Attention is compute bound, so ``extra`` also reports GFLOP/s (fwd 4*B*H*Sq*Sk*D
flops, fwd+bwd 3.5x that, halved for causal) and the compiled scratch memory
(``memory_analysis().temp_size_in_bytes``) of both, which shows O(S) vs O(S^2).

    python -m benchmarks.run --cases attention --device cpu --reps 5
    python -m benchmarks.cases_attention            # same cases, with GFLOP/s and memory
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from rlx_jax.ops import attention
from rlx_jax.vjp_rules.attention import reference_attention


def _reference(q, k, v, causal):
    params = dict(kind="causal" if causal else "none", window=0, scale=q.shape[-1] ** -0.5,
                  softcap=0.0, has_mask=False, has_bias=False)
    return reference_attention(q, k, v, **params)[0]


def _temp_mb(fn, args) -> float:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def _case(b, s, h, d, dtype, *, backward: bool, causal: bool = False) -> Case:
    kind = "causal" if causal else "none"

    def make(key):
        ks = jax.random.split(key, 4)
        shape = (b, s, h, d)
        return tuple(jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in ks)

    def ours(q, k, v, dy):
        if not backward:
            return attention(q, k, v, mask_kind=kind)
        _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, mask_kind=kind), q, k, v)
        return vjp(dy)

    def xla(q, k, v, dy):
        if not backward:
            return _reference(q, k, v, causal)
        _, vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, causal), q, k, v)
        return vjp(dy)

    itemsize = jnp.dtype(dtype).itemsize
    tensor = b * s * h * d * itemsize
    flops = 4 * b * h * s * s * d * (3.5 if backward else 1.0) * (0.5 if causal else 1.0)
    spec = tuple(jax.ShapeDtypeStruct((b, s, h, d), dtype) for _ in range(4))
    extra = {
        "gflop": flops / 1e9,
        "ours_temp_MB": _temp_mb(ours, spec),
        "xla_temp_MB": _temp_mb(xla, spec),
    }
    what = "fwd+bwd" if backward else "fwd"
    return Case(
        name=f"attention {what} {kind} {jnp.dtype(dtype).name} B{b} S{s} H{h} D{d}",
        make=make,
        ours=ours,
        xla=xla,
        floor_bytes=(7 if backward else 4) * tensor,
        extra=extra,
    )


def cases(device_kind: str) -> list[Case]:
    if device_kind == "gpu":
        shape = (4, 4096, 16, 128)
        return [_case(*shape, jnp.bfloat16, backward=bw, causal=c) for bw in (False, True) for c in (False, True)]
    shape = (2, 1024, 8, 64)
    return [
        _case(*shape, jnp.float32, backward=False),
        _case(*shape, jnp.float32, backward=True),
        _case(*shape, jnp.float32, backward=True, causal=True),
        _case(*shape, jnp.bfloat16, backward=True),
    ]


def main() -> None:
    """The runner's timing plus GFLOP/s and compiled scratch memory per case."""
    import argparse

    from benchmarks.harness import run_case

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = jax.devices()[0]
    kind = "gpu" if device.platform in ("gpu", "cuda") else "cpu"
    print(f"# device: {device.device_kind} ({device.platform}); jax {jax.__version__}")
    head = (f"{'case':48s} {'ours ms':>9s} {'XLA ms':>9s} {'XLA/ours':>8s} {'ours GF/s':>9s} "
            f"{'XLA GF/s':>9s} {'ours tmp MB':>11s} {'XLA tmp MB':>10s}")
    print(head)
    print("-" * len(head))
    for case in cases(kind):
        r = run_case(case, device, args.reps)
        print(f"{r['case']:48s} {r['ours_ms']:9.2f} {r['xla_ms']:9.2f} {r['xla_over_ours']:8.2f} "
              f"{r['gflop'] / r['ours_ms'] * 1e3:9.1f} {r['gflop'] / r['xla_ms'] * 1e3:9.1f} "
              f"{r['ours_temp_MB']:11.2f} {r['xla_temp_MB']:10.1f}", flush=True)


if __name__ == "__main__":
    main()
