"""Fake quantization on the GPU: the CUDA kernels rlx_fake_quantize_lsq_bwd (dx and the
learned-scale gradient, a deterministic two-stage channel sum) and, in builds with
-DRLX_CUDA_FAKE_QUANTIZE_STE, rlx_fake_quantize_bwd (every STE code; skipped otherwise)
against the f32 references, on random data. Skipped where JAX sees no GPU.

Layouts [G, O, C, I] cover both work layouts of ffi/cuda/channel_reduce.cuh: the row
layout (I >= 32: one warp per segment of 4096 elements, vectorised when I is a multiple
of the vector width, several segments per row) and the column layout (I < 32: channel
last and small trailing axes), odd sizes, G > 1 (vmap) and zero-sized inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import assert_close, gpu, requires_gpu
from rlx_jax.ops import fake_quantize, fake_quantize_lsq, fake_quantize_lsq_backward
from rlx_jax.vjp_rules.quantize import (
    STE_CODES,
    _layout,
    cuda_lsq_scratch_size,
    lsq_bwd,
    per_batch_scale,
    reference_fake_quantize_bwd,
)

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 1e-3}
Q = 7.0  # 4 bits

LAYOUTS = [
    (1, 1, 1, 1000),  # one scale, one row (row layout)
    (1, 37, 1, 64),  # per tensor over rows of 64
    (1, 5, 3, 100),  # 100 is no multiple of 8: scalar row path for bf16 / f16
    (1, 3, 2, 9001),  # three segments per row, odd tail
    (3, 4, 6, 40),  # G > 1
    (1, 33, 7, 1),  # channel last, odd width (scalar column path)
    (1, 300, 1024, 1),  # channel last, vectorised, several row chunks
    (2, 9, 5, 3),  # small trailing axis (column layout, I = 3)
    (1, 0, 4, 8),  # zero rows
    (2, 4, 3, 0),  # zero width
]


def _ids(v):
    return "x".join(map(str, v))


def _inputs(shape, dtype, seed, scale_value=None):
    kx, kd, ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    dev = gpu()
    x = (2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    s = jax.random.uniform(ks, (shape[0], shape[2]), jnp.float32, 0.1, 0.6)
    if scale_value is not None:
        s = jnp.full_like(s, scale_value)
    return [jax.device_put(a, dev) for a in (x, s, dy)]


def _f32(a):
    return a.astype(jnp.float32)


def _fq_call(x, s, dy, code):
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype),)
    return jax.ffi.ffi_call("rlx_fake_quantize_bwd_v1", out)(x, s, dy, q_max=np.float32(Q), ste=np.int64(code))[0]


def _lsq_call(x, s, dy, scratch_len=None):
    n = cuda_lsq_scratch_size(*x.shape) if scratch_len is None else scratch_len
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(s.shape, s.dtype),
           jax.ShapeDtypeStruct((n,), jnp.float32))
    dx, ds, _ = jax.ffi.ffi_call("rlx_fake_quantize_lsq_bwd_v1", out)(x, s, dy, q_max=np.float32(Q))
    return dx, ds


def np_lsq_bwd(x4, s, dy4):
    """LSQ backward in NumPy: z = x / s_eff by IEEE f32 division (the kernels' contract;
    XLA may divide otherwise, and a z that lands on a half one way and not the other
    flips psi by 1), psi summed in f64. Returns (dx f32, dscale f64, sum |psi dy|)."""
    x = np.asarray(jnp.asarray(x4, jnp.float32))
    g = np.asarray(jnp.asarray(dy4, jnp.float32))
    se = np.maximum(np.asarray(s, np.float32), np.float32(1e-12))[:, None, :, None]
    z = x / se
    inside = np.abs(z) <= np.float32(Q)
    psi = np.where(inside, np.sign(z) * np.floor(np.abs(z) + np.float32(0.5)) - z, np.sign(z) * np.float32(Q))
    terms = psi.astype(np.float64) * g
    return np.where(inside, g, 0).astype(np.float32), terms.sum(axis=(1, 3)), np.abs(terms).sum(axis=(1, 3))


def _check_lsq(x, s, dy, dx, ds, dtype, what=""):
    dx_ref, ds_ref, mag = np_lsq_bwd(x, s, dy)
    assert dx.dtype == x.dtype and ds.dtype == jnp.float32
    assert_close(dx, dx_ref, TOL[jnp.dtype(dtype).type], what + "dx")
    # dscale: f32 sums of the same terms in another order; error relative to the sum of
    # the terms' magnitudes
    assert_close(ds, ds_ref, 2e-6, what + "dscale", scale=max(float(np.max(mag, initial=1.0)), 1.0))


def _ste_registered() -> bool:
    """rlx_fake_quantize_bwd is a CUDA target only in builds with -DRLX_CUDA_FAKE_QUANTIZE_STE
    (ffi/cuda/quantize.cu says why); otherwise the STE gradient is XLA's fusion on GPUs."""
    return "rlx_fake_quantize_bwd_v1" in rlx_jax.kernel_info()["cuda"]["targets"]


def _need_ste():
    if not _ste_registered():
        pytest.skip("rlx_fake_quantize_bwd not built for CUDA (opt-in: -DRLX_CUDA_FAKE_QUANTIZE_STE)")


def test_cuda_targets_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert "rlx_fake_quantize_lsq_bwd_v1" in info["targets"]
    x, _, dy = _inputs((1, 64, 48, 1), jnp.float32, 0)
    x, dy = x.reshape(64, 48), dy.reshape(64, 48)
    f = jax.jit(jax.grad(lambda x: jnp.sum(fake_quantize(x, bits=4, scale=0.3, ste="clipped_identity") * dy)))
    # the STE gradient runs the CUDA kernel exactly when it is registered
    assert ("rlx_fake_quantize_bwd" in f.lower(x).as_text()) == _ste_registered()
    g = jax.jit(jax.grad(lambda x, s: jnp.sum(fake_quantize_lsq(x, s, bits=4, axis=1) * dy), argnums=(0, 1)))
    text = g.lower(x, jnp.full((48,), 0.3)).as_text()
    assert "rlx_fake_quantize_lsq_bwd" in text
    # the CUDA call carries its scratch result (the CPU call has two results)
    assert f"tensor<{cuda_lsq_scratch_size(1, 64, 48, 1)}xf32>" in text


@pytest.mark.parametrize("code", sorted(STE_CODES.values()))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", LAYOUTS, ids=_ids)
def test_ste_backward_matches_reference(shape, dtype, code):
    _need_ste()
    ste = {v: k for k, v in STE_CODES.items()}[code]
    x, s, dy = _inputs(shape, dtype, seed=sum(shape) + code)
    dx = jax.jit(lambda x, s, dy: _fq_call(x, s, dy, code))(x, s, dy)
    assert dx.dtype == dtype
    assert_close(dx, np_ste_bwd(x, s, dy, code), TOL[jnp.dtype(dtype).type], f"dx ({ste})")
    if code != 2:  # XLA's f32 tanh differs from the f64 value by more than the f32 tolerance
        (want,) = reference_fake_quantize_bwd(_f32(x), s, _f32(dy), q=Q, ste=ste)
        assert_close(dx, want, TOL[jnp.dtype(dtype).type], f"dx ({ste}) vs the JAX reference")


def np_ste_bwd(x4, s, dy4, code):
    """STE backward in NumPy: x / s by IEEE f32 division, tanh in f64."""
    x = np.asarray(jnp.asarray(x4, jnp.float32))
    g = np.asarray(jnp.asarray(dy4, jnp.float32))
    sc = np.asarray(s, np.float32)[:, None, :, None]
    bound = np.float32(Q) * sc
    if code == 0:
        f = np.ones_like(x)
    elif code == 1:
        f = (np.abs(x) <= bound).astype(np.float32)
    elif code == 2:
        f = 1 - np.tanh((x / sc).astype(np.float64)) ** 2
    else:
        f = np.maximum(1 - np.abs(x / bound), 0)
    return (g * f).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", LAYOUTS, ids=_ids)
def test_lsq_backward_matches_reference(shape, dtype):
    x, s, dy = _inputs(shape, dtype, seed=sum(shape) + 7)
    dx, ds = jax.jit(lambda x, s, dy: lsq_bwd(x, s, dy, q=Q))(x, s, dy)
    _check_lsq(x, s, dy, dx, ds, dtype)


def test_lsq_rounds_halves_away_from_zero_and_keeps_the_edge():
    """z = x / s exactly at halves and at +-q: psi = round(z) - z with halves away from
    zero (+-0.5 sums that round-half-to-even would get wrong) and |z| == q inside."""
    z = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 7.0, -7.0, 7.5, -8.0, 3.25, 0.0], np.float32)
    rows = np.tile(z, (40, 1))  # [40, 12] with the axis 1 channels (column layout) ...
    s = np.float32(0.25)
    x = jax.device_put(jnp.asarray(rows * s), gpu())
    dy = jnp.ones_like(x)
    for axis, xx, dd in ((1, x, dy), (None, x.T.reshape(-1), dy.T.reshape(-1))):  # ... and one row layout
        c = 12 if axis == 1 else 1
        dx, ds = jax.jit(lambda x, dy: fake_quantize_lsq_backward(x, jnp.full((c,), s), dy, bits=4, axis=axis))(xx, dd)
        psi = np.where(np.abs(z) <= Q, np.sign(z) * np.floor(np.abs(z) + 0.5) - z, np.sign(z) * Q)
        want = 40 * psi if axis == 1 else np.array([40 * psi.sum()])
        np.testing.assert_array_equal(np.asarray(ds), want.astype(np.float32))
        inside = np.abs(z) <= Q
        mask = np.tile(inside, (40, 1)) if axis == 1 else np.tile(inside, (40, 1)).T.reshape(-1)
        np.testing.assert_array_equal(np.asarray(dx), mask.astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("axis", [None, 0, 1, 2])
def test_grads_through_public_ops(axis, dtype):
    shape = (6, 37, 33)
    x, _, dy = _inputs(shape, dtype, seed=3)
    c = 1 if axis is None else shape[axis]
    scale = jnp.linspace(0.2, 0.5, c, dtype=jnp.float32)
    f = jax.jit(lambda x, s, dy: jax.vjp(lambda x, s: fake_quantize_lsq(x, s, bits=4, axis=axis), x, s)[1](dy))
    dx, ds = f(x, scale, dy)
    x4, _ = _layout("t", x, axis)
    _check_lsq(x4, scale[None], dy.reshape(x4.shape), dx.reshape(x4.shape), ds[None], dtype, "public ")
    w_dx, w_ds = jax.jit(lambda x, s, dy: fake_quantize_lsq_backward(x, s, dy, bits=4, axis=axis))(x, scale, dy)
    np.testing.assert_array_equal(np.asarray(w_dx, np.float32), np.asarray(dx, np.float32))
    np.testing.assert_array_equal(np.asarray(w_ds), np.asarray(ds))
    for ste in ("clipped_identity", "hardtanh"):
        g = jax.jit(lambda x, dy: jax.vjp(lambda x: fake_quantize(x, bits=4, axis=axis, ste=ste), x)[1](dy)[0])
        got = g(x, dy)
        s4 = per_batch_scale(_f32(x4), Q)
        (want,) = reference_fake_quantize_bwd(_f32(x4), s4, _f32(dy).reshape(x4.shape), q=Q, ste=ste)
        assert_close(got, want.reshape(shape), TOL[jnp.dtype(dtype).type] + 2e-6, f"fake_quantize dx ({ste})")
        assert ("rlx_fake_quantize_bwd" in g.lower(x, dy).as_text()) == _ste_registered()


def test_vmap_gives_per_example_scale_gradients():
    x, _, dy = _inputs((5, 40, 24), jnp.float32, seed=4)
    scale = jnp.linspace(0.2, 0.4, 24, dtype=jnp.float32)
    f = jax.vmap(lambda x, dy: jax.vjp(lambda x, s: fake_quantize_lsq(x, s, bits=4, axis=1), x, scale)[1](dy))
    dx, ds = jax.jit(f)(x, dy)
    assert ds.shape == (5, 24)
    for b in range(5):
        as4 = lambda a: a[b][None, :, :, None]  # noqa: E731
        _check_lsq(as4(x), scale[None], as4(dy), as4(dx), ds[b][None], jnp.float32, f"example {b}: ")


@pytest.mark.parametrize("shape", [(1, 2000, 1, 4096), (1, 4000, 1024, 1)], ids=_ids)
def test_lsq_bitwise_deterministic(shape):
    x, s, dy = _inputs(shape, jnp.float32, seed=9)
    f = jax.jit(lambda x, s, dy: lsq_bwd(x, s, dy, q=Q))
    first = [np.asarray(a) for a in f(x, s, dy)]
    for _ in range(2):
        for a, b in zip(first, f(x, s, dy)):
            np.testing.assert_array_equal(a, np.asarray(b))


def test_bad_operands_are_errors():
    x, s, dy = _inputs((1, 8, 4, 64), jnp.float32, seed=1)
    with pytest.raises(Exception, match="scratch"):
        jax.block_until_ready(jax.jit(lambda x, s, dy: _lsq_call(x, s, dy, scratch_len=1))(x, s, dy))
    with pytest.raises(Exception, match="scale must be"):
        jax.block_until_ready(jax.jit(_lsq_call)(x, s[:, :2], dy))
    if _ste_registered():
        with pytest.raises(Exception, match="ste code"):
            jax.block_until_ready(jax.jit(lambda x, s, dy: _fq_call(x, s, dy, 5))(x, s, dy))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 5, 3, 100), (2, 9, 5, 3), (1, 33, 16, 1)], ids=_ids)
def test_lsq_and_ste_sanitizer_small(shape, dtype):
    """Small cases for compute-sanitizer (tools/gpu_suite.sh runs -k sanitizer)."""
    x, s, dy = _inputs(shape, dtype, seed=2)
    dx, ds = jax.jit(_lsq_call)(x, s, dy)
    _check_lsq(x, s, dy, dx, ds, dtype)
    for code, ste in ((1, "clipped_identity"), (2, "tanh"), (3, "hardtanh")) if _ste_registered() else ():
        got = jax.jit(lambda x, s, dy: _fq_call(x, s, dy, code))(x, s, dy)
        assert_close(got, np_ste_bwd(x, s, dy, code), TOL[jnp.dtype(dtype).type], ste)
