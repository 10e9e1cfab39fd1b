"""LayerNorm, GroupNorm and BatchNormInference: ours vs XLA's autodiff of the reference.

Two kinds of case per op:
- ``bwd``: the backward pass alone, given what each forward saved (our forward kernel's
  mean/rstd; whatever JAX's linearisation of the reference kept). The arguments are the
  two ``jax.vjp`` closures (pytrees of their residuals) and dy; each side applies its
  own. Floor: x and dy read, dx written, 3 * N * H elements (parameters are O(H)).
- ``fwd+bwd``: one training step's worth, ``y, vjp = jax.vjp(op, ...)`` then
  ``vjp(dy)``, returning y and every gradient. Floor: x and dy read, y and dx written,
  4 * N * H elements.

Measured with ``python -m benchmarks.run --cases norms,rms_norm --device cpu``
2 cores via ``taskset -c 0,1`` on an otherwise idle 16-core Xeon host, jax 0.11.2;
(XLA/ours = speed-up, ours/copy = time over the copy floor):

    case                                        ours ms  XLA ms  XLA/ours  ours/copy
    layer_norm f32 8192x1024 bwd                  11.98   14.74      1.23       1.01
    layer_norm f32 8192x1024 fwd+bwd              25.77   72.25      2.80       1.44
    layer_norm bf16 8192x1024 fwd+bwd             16.80   76.74      4.57       1.46
    group_norm f32 16x256x32x32 G32 bwd            1.60    7.95      4.98       1.23
    group_norm f32 16x256x32x32 G32 fwd+bwd        3.18   17.97      5.66       0.28
    batch_norm_inference f32 16x256x32x32 bwd      1.83    6.25      3.42       1.35
    batch_norm_inference f32 8192x1024 bwd        15.07   28.92      1.92       0.97
    batch_norm_inference f32 8192x1024 fwd+bwd    25.74   64.58      2.51       1.20

The "bwd" rows compare against XLA's backward given XLA's own residuals, which hold
(x - mean) * rstd and its products as [N, H] arrays: XLA pays for them in its forward
(see the fwd+bwd rows). Copy floors of the bf16 and 16x256x32x32 cases fit in the last
level cache of that host (ours/copy overstates the gap to DRAM bandwidth there), and a
copy timing can be an outlier (group_norm fwd+bwd's 0.28): read ratios across rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from rlx_jax.ops import batch_norm_inference, group_norm, layer_norm
from rlx_jax.vjp_rules.batch_norm import reference_batch_norm_inference
from rlx_jax.vjp_rules.group_norm import reference_group_norm
from rlx_jax.vjp_rules.layer_norm import reference_layer_norm

EPS = 1e-5


def _vjp_pair(ours, ref, *primals):
    """The jax.vjp closures of ours and of the reference at the same point."""
    _, vjp_ours = jax.jit(lambda *a: jax.vjp(ours, *a))(*primals)
    _, vjp_ref = jax.jit(lambda *a: jax.vjp(ref, *a))(*primals)
    return vjp_ours, vjp_ref


def _cases_for(name, make_primals, ours, ref, elements, itemsize):
    """A bwd case and a fwd+bwd case for op ``ours`` vs ``ref`` at the primals (and dy)
    that ``make_primals(key)`` returns."""

    def make_bwd(key):
        *primals, dy = make_primals(key)
        vjp_ours, vjp_ref = _vjp_pair(ours, ref, *primals)
        return vjp_ours, vjp_ref, dy

    def make_step(key):
        return tuple(make_primals(key))

    def step(fn):
        def run(*args):
            *primals, dy = args
            y, vjp = jax.vjp(fn, *primals)
            return y, vjp(dy)

        return run

    return [
        Case(name=f"{name} bwd", make=make_bwd, ours=lambda vo, vr, dy: vo(dy), xla=lambda vo, vr, dy: vr(dy),
             floor_bytes=3 * elements * itemsize),
        Case(name=f"{name} fwd+bwd", make=make_step, ours=step(ours), xla=step(ref),
             floor_bytes=4 * elements * itemsize),
    ]


def _normal(key, shape, dtype, loc=0.0, scale=1.0):
    return (loc + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def layer_norm_cases(n: int, h: int, dtype) -> list[Case]:
    def make(key):
        kx, kg, kb, kd = jax.random.split(key, 4)
        return (_normal(kx, (n, h), dtype, 0.5, 2.0), _normal(kg, (h,), dtype, 1.0, 0.1),
                _normal(kb, (h,), dtype, 0.0, 0.1), _normal(kd, (n, h), dtype))

    ours = lambda x, g, b: layer_norm(x, g, b, eps=EPS)  # noqa: E731
    ref = lambda x, g, b: reference_layer_norm(x, g, b, eps=EPS)[0]  # noqa: E731
    label = f"layer_norm {jnp.dtype(dtype).name} {n}x{h}"
    return _cases_for(label, make, ours, ref, n * h, jnp.dtype(dtype).itemsize)


def group_norm_cases(shape, groups: int, dtype) -> list[Case]:
    c = shape[1]

    def make(key):
        kx, kg, kb, kd = jax.random.split(key, 4)
        return (_normal(kx, shape, dtype, 0.5, 2.0), _normal(kg, (c,), dtype, 1.0, 0.1),
                _normal(kb, (c,), dtype, 0.0, 0.1), _normal(kd, shape, dtype))

    ours = lambda x, g, b: group_norm(x, g, b, num_groups=groups, eps=EPS)  # noqa: E731
    ref = lambda x, g, b: reference_group_norm(x, g, b, num_groups=groups, eps=EPS)[0]  # noqa: E731
    label = f"group_norm {jnp.dtype(dtype).name} {'x'.join(map(str, shape))} G{groups}"
    size = 1
    for d in shape:
        size *= d
    return _cases_for(label, make, ours, ref, size, jnp.dtype(dtype).itemsize)


def batch_norm_cases(shape, dtype) -> list[Case]:
    c = shape[1]

    def make(key):
        kx, kg, kb, km, kv, kd = jax.random.split(key, 6)
        var = jnp.exp(_normal(kv, (c,), jnp.float32, 0.0, 0.3)).astype(dtype)
        return (_normal(kx, shape, dtype, 0.5, 2.0), _normal(kg, (c,), dtype, 1.0, 0.1),
                _normal(kb, (c,), dtype, 0.0, 0.1), _normal(km, (c,), dtype, 0.5, 0.1), var,
                _normal(kd, shape, dtype))

    ours = lambda x, g, b, m, v: batch_norm_inference(x, g, b, m, v, eps=EPS)  # noqa: E731
    ref = lambda x, g, b, m, v: reference_batch_norm_inference(x, g, b, m, v, eps=EPS)[0]  # noqa: E731
    label = f"batch_norm_inference {jnp.dtype(dtype).name} {'x'.join(map(str, shape))}"
    size = 1
    for d in shape:
        size *= d
    return _cases_for(label, make, ours, ref, size, jnp.dtype(dtype).itemsize)


def cases(device_kind: str) -> list[Case]:
    if device_kind == "gpu":  # the CUDA kernels (ffi/cuda/layer_norm.cu, group_norm.cu, batch_norm.cu)
        return [*layer_norm_cases(32768, 4096, jnp.float32), *layer_norm_cases(32768, 4096, jnp.bfloat16),
                *group_norm_cases((32, 512, 64, 64), 32, jnp.float32),
                *group_norm_cases((32, 512, 64, 64), 32, jnp.bfloat16),
                *batch_norm_cases((128, 512, 64, 64), jnp.float32),  # ffi/cuda/batch_norm.cu
                *batch_norm_cases((65536, 4096), jnp.bfloat16)]
    return [
        *layer_norm_cases(8192, 1024, jnp.float32),
        *layer_norm_cases(8192, 1024, jnp.bfloat16),
        *group_norm_cases((16, 256, 32, 32), 32, jnp.float32),
        *batch_norm_cases((16, 256, 32, 32), jnp.float32),
        *batch_norm_cases((8192, 1024), jnp.float32),
    ]
