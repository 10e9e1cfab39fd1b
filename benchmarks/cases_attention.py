"""Attention forward and forward+backward: ours (flash kernels, O(S) memory) vs XLA's
autodiff of the pure-JAX reference (O(S^2): it materialises the score matrices).

Shapes [B, S, H, D] (default B2 S1024 H8 D64 on CPU). Floor: the bytes an attention must
move at least: q, k, v read and out written (fwd); plus dy read and dq, dk, dv written
(fwd+bwd). Attention is compute bound, so ``extra`` also reports GFLOP/s (fwd 4*B*H*Sq*Sk*D
flops, fwd+bwd 3.5x that, halved for causal) and the compiled scratch memory
(``memory_analysis().temp_size_in_bytes``) of both, which shows O(S) vs O(S^2).

    python -m benchmarks.run --cases attention --device cpu --reps 5
    python -m benchmarks.cases_attention            # same cases, with GFLOP/s and memory
    python -m benchmarks.cases_attention --reps 10  # on a GPU: ours / cuDNN / XLA TFLOP/s

"Ours" is ``rlx_jax.ops.attention`` as a user gets it: on a compute capability 9.0 GPU its
plain bf16 / f16 calls run cuDNN's forward and our backward (docs/API.md). With
``RLX_ATTENTION_CUDNN_FORWARD=0`` in the environment they run our forward kernel too, as
the tables of docs/PERFORMANCE.md measured it (``benchmarks.attention_kernels`` and
``benchmarks.attention_power`` time these same functions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from rlx_jax.ops import attention
from rlx_jax.vjp_rules.attention import reference_attention


def attention_flops(b: int, h: int, s: int, d: int, *, causal: bool, backward: bool) -> float:
    """The work counted for one attention call of [B, S, H, D]: the forward's two S x S x D
    products, 4 B H S^2 D flops, 3.5x that with the backward's five; halved when causal."""
    return 4 * b * h * s * s * d * (3.5 if backward else 1.0) * (0.5 if causal else 1.0)


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
    flops = attention_flops(b, h, s, d, causal=causal, backward=backward)
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


# ---- GPU: ours vs cuDNN vs XLA in one run (TFLOP/s) ------------------------------------------


def _tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def gpu_inputs(b: int, s: int, h: int, d: int, device, hkv: int | None = None) -> tuple:
    """(q, k, v, dy) bf16 on ``device``, standard normal from a fixed seed: q and dy [B, S, H, D],
    k and v [B, S, Hkv, D] (``hkv`` default h): the inputs of the attention GPU scripts'
    fwd+bwd steps."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    heads = (h, hkv or h, hkv or h, h)
    return tuple(jax.device_put(jax.random.normal(kk, (b, s, n, d), jnp.float32).astype(jnp.bfloat16), device)
                 for kk, n in zip(keys, heads))


def _gpu_fns(kind_, *, softcap=None, mask=None):
    """(ours, cudnn or None, xla) forward functions of (q, k, v)."""
    causal = kind_ == "causal"

    def ours(q, k, v):
        return attention(q, k, v, mask_kind=kind_, softcap=softcap, mask=mask)

    def xla_ref(q, k, v):  # XLA's fusion of the pure-JAX reference (softcap / key mask cases)
        d = q.shape[-1]
        params = dict(kind=kind_, window=0, scale=d**-0.5, softcap=float(softcap or 0.0),
                      has_mask=mask is not None, has_bias=False)
        extras = [mask] if mask is not None else []
        return reference_attention(q, k, v, *extras, **params)[0]

    if softcap is not None or mask is not None:
        return ours, None, xla_ref

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    return ours, cudnn, xla


def _fwd_bwd(fn):
    def run(q, k, v, dy):
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(dy)

    return run


def _max_rel(a, b) -> float:
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        errs.append(float(jnp.linalg.norm(x - y) / jnp.maximum(jnp.linalg.norm(y), 1e-6)))
    return max(errs)


def gpu_table(reps: int = 10, shapes=((4, 4096, 16, 128), (4, 4096, 16, 64)), quick: bool = False,
              ours_only: bool = False) -> None:
    """TFLOP/s of ours, cuDNN and XLA (jax.nn.dot_product_attention implementations), bf16,
    fwd and fwd+bwd, causal and not; then softcap and key-mask cases vs XLA (the pure-JAX
    reference: cuDNN through JAX has no softcap). FLOPs: fwd 4 B H S^2 D (halved for
    causal), fwd+bwd 3.5x fwd. ``rel err`` is ||ours - other|| / ||other|| (l2) of the
    outputs or the gradients. ``ours_only`` (A/B runs of our kernels, tools/ab_env.sh): time ours
    alone; the cuDNN, XLA and error columns are nan."""
    from benchmarks.harness import default_batch, time_fn

    dev = next(d for d in jax.devices() if d.platform == "gpu")
    batch = default_batch(dev)
    print(f"# device: {dev.device_kind}; jax {jax.__version__}; bf16; median of {reps} reps of {batch} calls "
          "back to back (the runner's timing), 3 warmup")
    head = (f"{'case':44s} {'ours ms':>8s} {'ours TF/s':>9s} {'cuDNN TF/s':>10s} {'XLA TF/s':>9s} "
            f"{'ours/cuDNN':>10s} {'ours/XLA':>8s} {'rel err':>8s}")
    print(head)
    print("-" * len(head))
    rows = []
    for b, s, h, d in shapes:
        key = jax.random.PRNGKey(0)
        ks = jax.random.split(key, 5)
        q, k, v, dy = (jax.device_put(jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16), dev)
                       for kk in ks[:4])
        key_mask = jax.device_put((jax.random.uniform(ks[4], (b, s)) > 0.2).astype(jnp.float32), dev)
        variants = [("none", {}), ("causal", {})]
        if not quick:
            variants += [("none", dict(softcap=30.0)), ("causal", dict(softcap=30.0)),
                         ("none", dict(mask=key_mask))]
        for kind_, extra in variants:
            ours, cudnn, xla = _gpu_fns(kind_, **extra)
            if ours_only:
                cudnn = xla = None
            tag = kind_ + ("+softcap" if "softcap" in extra else "") + ("+keymask" if "mask" in extra else "")
            for backward in (False, True):
                flops = attention_flops(b, h, s, d, causal=kind_ == "causal", backward=backward)
                fns = [f for f in (ours, cudnn, xla)]
                if backward:
                    fns = [None if f is None else _fwd_bwd(f) for f in fns]
                args = (q, k, v, dy) if backward else (q, k, v)
                jitted = [None if f is None else jax.jit(f) for f in fns]
                res = [None if f is None else f(*args) for f in jitted]
                other = res[1] if res[1] is not None else res[2]
                err = float("nan") if other is None else _max_rel(res[0], other)
                times = []
                for f in jitted:
                    if f is None:
                        times.append(float("nan"))
                        continue
                    try:
                        times.append(time_fn(f, args, reps, batch=batch))
                    except Exception as e:  # e.g. XLA running out of memory on the O(S^2) path
                        print(f"#   {type(e).__name__}: {str(e)[:120]}")
                        times.append(float("nan"))
                t_ours, t_cudnn, t_xla = times
                name = f"{'fwd+bwd' if backward else 'fwd'} {tag} B{b} S{s} H{h} D{d}"
                tf = [_tflops(flops, t) for t in times]
                print(f"{name:44s} {t_ours:8.3f} {tf[0]:9.1f} {tf[1]:10.1f} {tf[2]:9.1f} "
                      f"{t_cudnn / t_ours:10.2f} {t_xla / t_ours:8.2f} {err:8.1e}", flush=True)
                rows.append((name, t_ours, t_cudnn, t_xla, err))
                del res
    return rows


def main() -> None:
    """The runner's timing plus GFLOP/s and compiled scratch memory per case; on a GPU,
    the ours / cuDNN / XLA TFLOP/s table (``gpu_table``) instead."""
    import argparse

    from benchmarks.harness import run_case

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="GPU: only plain and causal cases")
    parser.add_argument("--ours-only", action="store_true", help="GPU: time only our kernels (A/B runs)")
    args = parser.parse_args()
    device = jax.devices()[0]
    kind = "gpu" if device.platform in ("gpu", "cuda") else "cpu"
    if kind == "gpu":
        gpu_table(args.reps, quick=args.quick, ours_only=args.ours_only)
        return
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
