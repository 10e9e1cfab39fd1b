"""Pooling, embedding (gather) and fake-quantization backward: ours vs XLA; conv2d for
the record (its backward is XLA's own convolution in both columns).

Floors (bytes each op must move):
- max_pool2d fwd+bwd: x read, dy read, dx written (y and the argmax the forward saves for
  the backward are written and read on top: the kernels move 2 x + 2 y + 2 argmax; the
  argmax is one int8 per output for these windows, its place in its window);
- avg_pool2d bwd: dy read, dx written;
- embedding bwd: dy [K, D] read, d_table [V, D] written (the indices are O(K));
- fake-quantize bwd: x, dy read, dx written (LSQ: plus the O(C) dscale);
- conv2d bwd: x, w, dy read, dx, dw written (compute-bound: the ratio to this floor is
  not a target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.harness import Case
from rlx_jax.ops import avg_pool2d, conv2d, fake_quantize_backward, fake_quantize_lsq, gather, max_pool2d
from rlx_jax.vjp_rules.conv import reference_conv2d
from rlx_jax.vjp_rules.pool import out_size, reference_avg_pool2d
from rlx_jax.vjp_rules.quantize import _layout, per_batch_scale, q_max, reference_fake_quantize_bwd


def _nbytes(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    return n * jnp.dtype(dtype).itemsize


def _pooled(shape, k, s, p):
    return shape[:2] + tuple(out_size(n, k, s, p) for n in shape[2:])


def _max_pool_case(shape, k, s, p, dtype) -> Case:
    yshape = _pooled(shape, k, s, p)

    def make(key):
        kx, kd = jax.random.split(key)
        return (jax.random.normal(kx, shape, jnp.float32).astype(dtype),
                jax.random.normal(kd, yshape, jnp.float32).astype(dtype))

    def ours(x, dy):
        _, vjp = jax.vjp(lambda x: max_pool2d(x, kernel_size=k, stride=s, padding=p), x)
        return vjp(dy)

    def xla(x, dy):
        pads = ((0, 0), (0, 0), (p, p), (p, p))
        fwd = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, k, k), (1, 1, s, s), pads)
        _, vjp = jax.vjp(fwd, x)
        return vjp(dy)

    return Case(
        name=f"max_pool2d fwd+bwd {jnp.dtype(dtype).name} {'x'.join(map(str, shape))} k{k}s{s}p{p}",
        make=make, ours=ours, xla=xla,
        floor_bytes=2 * _nbytes(shape, dtype) + _nbytes(yshape, dtype),
    )


def _avg_pool_case(shape, k, s, p, dtype) -> Case:
    yshape = _pooled(shape, k, s, p)

    def make(key):
        return (jax.random.normal(key, shape, jnp.float32).astype(dtype),
                jax.random.normal(key, yshape, jnp.float32).astype(dtype))

    def ours(x, dy):
        _, vjp = jax.vjp(lambda x: avg_pool2d(x, kernel_size=k, stride=s, padding=p), x)
        return vjp(dy)

    def xla(x, dy):
        fwd = lambda x: reference_avg_pool2d(x, kernel_size=(k, k), stride=(s, s), padding=(p, p))[0]
        _, vjp = jax.vjp(fwd, x)
        return vjp(dy)

    return Case(
        name=f"avg_pool2d bwd {jnp.dtype(dtype).name} {'x'.join(map(str, shape))} k{k}s{s}p{p}",
        make=make, ours=ours, xla=xla,
        floor_bytes=_nbytes(shape, dtype) + _nbytes(yshape, dtype),
    )


def _embedding_case(v, d, k, dtype) -> Case:
    def make(key):
        kt, ki, kd = jax.random.split(key, 3)
        table = jax.random.normal(kt, (v, d), jnp.float32).astype(dtype)
        idx = jax.random.randint(ki, (k,), 0, v, jnp.int32)
        dy = jax.random.normal(kd, (k, d), jnp.float32).astype(dtype)
        return table, idx, dy

    def ours(table, idx, dy):
        _, vjp = jax.vjp(lambda t: gather(t, idx, axis=0), table)
        return vjp(dy)

    def xla(table, idx, dy):
        _, vjp = jax.vjp(lambda t: jnp.take(t, idx, axis=0), table)
        return vjp(dy)

    return Case(
        name=f"embedding bwd {jnp.dtype(dtype).name} {v}x{d} idx{k}",
        make=make, ours=ours, xla=xla,
        floor_bytes=_nbytes((k, d), dtype) + _nbytes((v, d), dtype),
    )


def _fake_quantize_case(shape, axis, ste, dtype, bits=4, fixed_scale=None) -> Case:
    """RLX's FakeQuantizeBackward: the per-batch scale is recomputed from x (one more
    read of x than the floor counts, in both columns), or ``fixed_scale`` is given (the
    kernel alone: x, dy read, dx written)."""

    def make(key):
        kx, kd = jax.random.split(key)
        return (jax.random.normal(kx, shape, jnp.float32).astype(dtype),
                jax.random.normal(kd, shape, jnp.float32).astype(dtype))

    def ours(x, dy):
        return fake_quantize_backward(x, dy, bits=bits, axis=axis, ste=ste, scale=fixed_scale)

    def xla(x, dy):
        x4, _ = _layout("bench", x, axis)
        q = float(q_max(bits))
        if fixed_scale is None:
            s = per_batch_scale(x4, q)
        else:
            s = jnp.full((1, x4.shape[2]), fixed_scale, jnp.float32)
        return reference_fake_quantize_bwd(x4, s, dy.reshape(x4.shape), q=q, ste=ste)[0].reshape(shape)

    scale_name = "" if fixed_scale is None else " fixed-scale"
    return Case(
        name=f"fake_quantize bwd {ste}{scale_name} {jnp.dtype(dtype).name} {'x'.join(map(str, shape))} axis={axis}",
        make=make, ours=ours, xla=xla, floor_bytes=3 * _nbytes(shape, dtype),
    )


def _lsq_case(shape, axis, dtype, bits=4) -> Case:
    c = 1 if axis is None else shape[axis]

    def make(key):
        kx, kd = jax.random.split(key)
        x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
        dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
        return x, jnp.full((c,), 0.3, jnp.float32), dy

    def ours(x, s, dy):
        _, vjp = jax.vjp(lambda x, s: fake_quantize_lsq(x, s, bits=bits, axis=axis), x, s)
        return vjp(dy)

    def xla(x, s, dy):
        def fwd(x, s):
            x4, _ = _layout("bench", x, axis)
            s4 = jnp.broadcast_to(s, (x4.shape[2],))[None]
            return _lsq_ste_plain(x4, s4, float(q_max(bits))).reshape(shape)

        _, vjp = jax.vjp(fwd, x, s)
        return vjp(dy)

    return Case(
        name=f"fake_quantize_lsq bwd {jnp.dtype(dtype).name} {'x'.join(map(str, shape))} axis={axis}",
        make=make, ours=ours, xla=xla, floor_bytes=3 * _nbytes(shape, dtype),
    )


def _lsq_ste_plain(x4, s4, q):
    """LSQ as a JAX user writes it (a straight-through stop_gradient round inside the
    range, the clamp value sign(z) q s outside), so XLA's autodiff gives RLX's dx and
    dscale."""
    from rlx_jax.vjp_rules.quantize import MIN_SCALE, round_half_away

    acc = jnp.float64 if x4.dtype == jnp.float64 else jnp.float32
    s = jnp.maximum(s4.astype(acc), MIN_SCALE)[:, None, :, None]
    z = x4.astype(acc) / s
    inside = jnp.abs(z) <= q
    zr = z + lax.stop_gradient(round_half_away(z) - z)
    return (jnp.where(inside, zr, jnp.sign(lax.stop_gradient(z)) * q) * s).astype(x4.dtype)


def _conv_case(n, c, hw, o, k, dtype) -> Case:
    xshape, wshape = (n, c, hw, hw), (o, c, k, k)
    pad = k // 2

    def make(key):
        kx, kw, kd = jax.random.split(key, 3)
        return (jax.random.normal(kx, xshape, jnp.float32).astype(dtype),
                (0.1 * jax.random.normal(kw, wshape, jnp.float32)).astype(dtype),
                jax.random.normal(kd, (n, o, hw, hw), jnp.float32).astype(dtype))

    def ours(x, w, dy):
        _, vjp = jax.vjp(lambda x, w: conv2d(x, w, padding=(pad, pad)), x, w)
        return vjp(dy)

    def xla(x, w, dy):
        fwd = lambda x, w: reference_conv2d(x, w, stride=(1, 1), padding=(pad, pad), dilation=(1, 1), groups=1)[0]
        _, vjp = jax.vjp(fwd, x, w)
        return vjp(dy)

    return Case(
        name=f"conv2d fwd+bwd (XLA both) {jnp.dtype(dtype).name} {n}x{c}x{hw}x{hw} o{o} k{k}",
        make=make, ours=ours, xla=xla,
        floor_bytes=2 * _nbytes(xshape, dtype) + 2 * _nbytes(wshape, dtype) + _nbytes((n, o, hw, hw), dtype),
    )


def _pool_gather_gpu_cases() -> list[Case]:
    """GPU sizes for the ops with CUDA kernels in ffi/cuda/pool.cu and gather.cu."""
    big = (128, 64, 112, 112)  # a ResNet stem's pooling input at batch 128
    return [
        _max_pool_case(big, 3, 2, 1, jnp.float32),
        _max_pool_case(big, 3, 2, 1, jnp.bfloat16),
        _max_pool_case(big, 2, 2, 0, jnp.float32),
        _avg_pool_case(big, 3, 2, 1, jnp.float32),
        _avg_pool_case(big, 3, 2, 1, jnp.bfloat16),
        _avg_pool_case(big, 2, 2, 0, jnp.float32),
        _avg_pool_case(big, 2, 2, 0, jnp.bfloat16),
        _embedding_case(32000, 4096, 16384, jnp.float32),
        _embedding_case(32000, 4096, 16384, jnp.bfloat16),
        _embedding_case(128256, 4096, 8192, jnp.bfloat16),
    ]


def cases(device_kind: str) -> list[Case]:
    if device_kind == "gpu":  # the CUDA LSQ kernel (ffi/cuda/quantize.cu)
        # 1 GiB per f32 tensor, so a call's fixed cost is small against its time. The STE
        # backward has no CUDA kernel in default builds (XLA's fusion is at the floor; the
        # opt-in kernel measured 0.68-0.90x XLA, docs/PERFORMANCE.md):
        # _fake_quantize_case(big, 0, "clipped_identity", jnp.float32, fixed_scale=0.3) times it.
        big = (65536, 4096)
        return [
            _lsq_case(big, None, jnp.float32),
            _lsq_case(big, 0, jnp.float32),
            _lsq_case(big, 1, jnp.float32),
            _lsq_case(big, 1, jnp.bfloat16),
        ] + _pool_gather_gpu_cases()
    shape = (32, 64, 56, 56)
    return [
        _max_pool_case(shape, 3, 2, 1, jnp.float32),
        _max_pool_case(shape, 2, 2, 0, jnp.float32),
        _max_pool_case(shape, 3, 2, 1, jnp.bfloat16),
        _avg_pool_case(shape, 3, 2, 1, jnp.float32),
        _avg_pool_case(shape, 2, 2, 0, jnp.float32),
        _embedding_case(32000, 1024, 8192, jnp.float32),
        _embedding_case(32000, 1024, 8192, jnp.bfloat16),
        _fake_quantize_case((8192, 1024), 0, "clipped_identity", jnp.float32),
        _fake_quantize_case((8192, 1024), 0, "tanh", jnp.float32),
        _fake_quantize_case((8192, 1024), 1, "hardtanh", jnp.float32),
        _lsq_case((8192, 1024), 0, jnp.float32),
        _lsq_case((8192, 1024), 1, jnp.float32),
        _lsq_case((8192, 1024), None, jnp.float32),
        _conv_case(8, 64, 56, 64, 3, jnp.float32),
    ]
