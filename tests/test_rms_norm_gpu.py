"""RMSNorm on the GPU: the CUDA kernels (rlx_rms_norm_fwd / rlx_rms_norm_bwd /
rlx_add_rms_norm_bwd on platform CUDA) against the f32 reference on random data. Skipped
where JAX sees no GPU.

Widths cover the 16-byte vector path (multiples of 16 bytes), the scalar path (odd
widths), narrow rows (several rows per warp), the one-pass limit (8192) and the slabbed
wide-row path (> 8192 columns)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import as_f32, assert_close, gpu, requires_gpu
from rlx_jax.ops import add_rms_norm, rms_norm
from rlx_jax.vjp_rules.rms_norm import (
    add_rms_norm_bwd,
    cuda_bwd_scratch_size,
    reference_rms_norm,
    reference_rms_norm_bwd,
    rms_norm_bwd,
    rms_norm_fwd,
)

pytestmark = requires_gpu

EPS = 1e-6
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# relative (to max |ref|) max-abs error allowed per dtype
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


_gpu = gpu


def _inputs(shape, dtype, seed):
    kx, kg, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = shape[-1]
    dev = _gpu()
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(kg, (h,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(kb, (h,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return [jax.device_put(a, dev) for a in (x, g, b, dy)]


def _close(got, want, dtype, what):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what)


_f32 = as_f32


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_rms_norm_fwd_v1", "rlx_rms_norm_fwd_v2", "rlx_rms_norm_bwd_v1"} <= set(info["targets"])
    x, g, b, dy = _inputs((8, 256), jnp.float32, 0)
    fn = jax.jit(lambda x, g, b, dy: jax.vjp(rms_norm, x, g, b)[1](dy))
    text = fn.lower(x, g, b, dy).as_text()
    assert "rlx_rms_norm_fwd" in text and "rlx_rms_norm_bwd" in text
    # the CUDA call carries its scratch result (the CPU call has three results)
    assert f"tensor<{cuda_bwd_scratch_size(8, 256)}xf32>" in text


SHAPES = [
    (1, 64),
    (37, 64),
    (5, 3, 100),  # bf16/f16: 200 bytes a row -> scalar path
    (33, 999),  # odd width: scalar path
    (64, 1000),
    (257, 1024),
    (130, 4096),
    (17, 8192),  # widest one-pass row
    (9, 12288),  # slabbed wide-row path
    (3, 65536),
    (0, 512),  # zero rows
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_f32_reference(shape, dtype):
    x, g, b, dy = _inputs(shape, dtype, seed=hash(shape) % 1000)
    y, rstd = jax.jit(lambda x, g, b: rms_norm_fwd(x, g, b, eps=EPS))(x, g, b)
    y_ref, rstd_ref = reference_rms_norm(*_f32(x, g, b), eps=EPS)
    _close(y, y_ref, dtype, "y")
    _close(rstd, rstd_ref, jnp.float32, "rstd")
    # backward from the reference rstd, compared with the f32 reference backward
    dx, dg, db = jax.jit(lambda *a: rms_norm_bwd(*a, eps=EPS))(x, g, rstd_ref, dy)
    dx_ref, dg_ref, db_ref = reference_rms_norm_bwd(*_f32(x, g), rstd_ref, dy.astype(jnp.float32), eps=EPS)
    assert dx.dtype == dtype and dg.dtype == dtype and db.dtype == dtype
    _close(dx, dx_ref, dtype, "dx")
    _close(dg, dg_ref, dtype, "dgamma")
    _close(db, db_ref, dtype, "dbeta")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_grad_through_custom_vjp(dtype):
    x, g, b, dy = _inputs((4, 3, 768), dtype, seed=5)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(lambda *a: rms_norm(*a, eps=EPS), x, g, b)[1](dy))
    got = f(x, g, b, dy)
    want = jax.vjp(lambda *a: reference_rms_norm(*a, eps=EPS)[0], *_f32(x, g, b))[1](dy.astype(jnp.float32))
    for a, w, what in zip(got, want, ("dx", "dgamma", "dbeta")):
        _close(a, w, dtype, what)


def test_zero_rows_give_zero_parameter_gradients():
    x, g, b, dy = _inputs((0, 4096), jnp.bfloat16, seed=2)
    dx, dg, db = jax.jit(lambda x, g, b, dy: jax.vjp(rms_norm, x, g, b)[1](dy))(x, g, b, dy)
    assert dx.shape == (0, 4096)
    np.testing.assert_array_equal(np.asarray(dg, np.float32), 0)
    np.testing.assert_array_equal(np.asarray(db, np.float32), 0)


@pytest.mark.parametrize("shape", [(4099, 4096), (1000, 333), (64, 12288)], ids=str)
def test_backward_bitwise_deterministic(shape):
    x, g, b, dy = _inputs(shape, jnp.float32, seed=9)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(rms_norm, x, g, b)[1](dy))
    first = [np.asarray(a) for a in f(x, g, b, dy)]
    second = [np.asarray(a) for a in f(x, g, b, dy)]
    for a, c in zip(first, second):
        np.testing.assert_array_equal(a, c)


def test_vmap_keeps_kernel():
    x, g, b, dy = _inputs((3, 16, 512), jnp.float32, seed=3)
    f = jax.vmap(lambda x, dy: jax.vjp(lambda x: rms_norm(x, g, b, eps=EPS), x)[1](dy)[0])
    got = jax.jit(f)(x, dy)
    want = jax.vmap(lambda x, dy: jax.vjp(lambda x: reference_rms_norm(x, g, b, eps=EPS)[0], x)[1](dy)[0])(x, dy)
    _close(got, want, jnp.float32, "dx")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1031, 2048), (65, 1032)], ids=lambda s: "x".join(map(str, s)))
def test_staged_forward_sanitizer_small(shape, dtype):
    """The sm_90 staged forward (rows of at least 2 KB, several rows per block, uneven rows
    per block) with every row at its own scale: y and rstd vs the f32 reference."""
    x, g, b, _ = _inputs(shape, dtype, seed=29)
    rows = jnp.arange(shape[0], dtype=jnp.float32)[:, None]
    x = jax.device_put((x.astype(jnp.float32) * (1.0 + rows % 7)).astype(dtype), gpu())
    y, rstd = jax.jit(lambda x, g, b: rms_norm_fwd(x, g, b, eps=EPS))(x, g, b)
    y_ref, rstd_ref = reference_rms_norm(*_f32(x, g, b), eps=EPS)
    _close(y, y_ref, dtype, "y")
    _close(rstd / rstd_ref, jnp.ones_like(rstd_ref), jnp.float32, "rstd / rstd_ref")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_add_backward_sums_the_residual_gradient_on_every_path(shape, dtype):
    """rlx_add_rms_norm_bwd on the register, staged and slabbed paths: dx = dres + the norm's
    dx (in f32, rounded once), dgamma and dbeta as the plain backward's."""
    x, g, _, dy = _inputs(shape, dtype, seed=hash(shape) % 1000 + 1)
    dres = _inputs(shape, dtype, seed=hash(shape) % 1000 + 2)[3]
    _, rstd_ref = reference_rms_norm(*_f32(x, g), jnp.zeros(g.shape, jnp.float32), eps=EPS)
    dx, dg, db = jax.jit(lambda *a: add_rms_norm_bwd(*a, eps=EPS))(x, g, rstd_ref, dy, dres)
    dx_ref, dg_ref, db_ref = reference_rms_norm_bwd(*_f32(x, g), rstd_ref, dy.astype(jnp.float32), eps=EPS)
    assert dx.dtype == dtype
    _close(dx, dx_ref + dres.astype(jnp.float32), dtype, "dx + dres")
    _close(dg, dg_ref, dtype, "dgamma")
    _close(db, db_ref, dtype, "dbeta")


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("shape, dtype", [
    ((4, 512, 2048), jnp.bfloat16),  # the staged kernel (sm_90), y written by the backward
    ((4, 512, 2048), jnp.float16),
    ((1024, 2048), jnp.float32),
    ((64, 37), jnp.float32),  # unaligned: the register kernel, then the forward for y
    ((2, 131072), jnp.bfloat16),  # wider than a stage: the register kernels
    ((3, 300000), jnp.float32),  # the slabbed path
])
def test_backward_with_y_kernel(shape, dtype, add):
    """rlx_rms_norm_bwd_y / rlx_add_rms_norm_bwd_y: dx (with dres), dgamma, dbeta and the
    forward's y, with rstd recomputed from x, against the f32 reference; y matches the
    forward kernel's output (to rounding: rstd is reduced in another order)."""
    from rlx_jax.vjp_rules.rms_norm import add_rms_norm_bwd_y, rms_norm_bwd_y
    x, g, b, dy = _inputs(shape, dtype, seed=21)
    dres = _inputs(shape, dtype, seed=22)[3]
    if add:
        f = jax.jit(lambda *a: add_rms_norm_bwd_y(*a, eps=EPS))
        args = (x, g, b, dy, dres)
    else:
        f = jax.jit(lambda *a: rms_norm_bwd_y(*a, eps=EPS))
        args = (x, g, b, dy)
    target = "rlx_add_rms_norm_bwd_y" if add else "rlx_rms_norm_bwd_y"
    assert target in f.lower(*args).as_text()
    got = f(*args)
    ref = lambda x, g, b: reference_rms_norm(x, g, b, eps=EPS)[0]
    y_ref, vjp = jax.vjp(ref, *_f32(x, g, b))
    dx_ref, dg_ref, db_ref = vjp(dy.astype(jnp.float32))
    if add:
        dx_ref = dx_ref + dres.astype(jnp.float32)
    for a, w, what in zip(got, (dx_ref, dg_ref, db_ref, y_ref), ("dx", "dgamma", "dbeta", "y")):
        assert a.dtype == dtype, what
        _close(a, w, dtype, what)
    y_fwd, _ = jax.jit(lambda *a: rms_norm_fwd(*a, eps=EPS))(x, g, b)
    _close(got[3], y_fwd.astype(jnp.float32), dtype, "y against the forward kernel")
    again = f(*args)
    for a, c in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_rms_norm_linear_backward_takes_y_from_the_backward_kernel():
    """The lean ops' backward on CUDA: no forward kernel runs again, the y-writing backward
    does (rms_norm_linear: rlx_rms_norm_bwd_y; add_rms_norm_linear: rlx_add_rms_norm_bwd_y)."""
    from rlx_jax.ops import add_rms_norm_linear, rms_norm_linear
    x, g, _, r = _inputs((4, 256, 512), jnp.bfloat16, seed=23)
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(24), (512, 384), jnp.float32)).astype(jnp.bfloat16)
    plain = jax.jit(jax.grad(lambda x, g, w: jnp.sum(rms_norm_linear(x, g, w).astype(jnp.float32) ** 2), (0, 1, 2)))
    text = plain.lower(x, g, w).as_text()
    forward = jax.jit(lambda x, g, w: rms_norm_linear(x, g, w)).lower(x, g, w).as_text()
    assert text.count("rlx_rms_norm_fwd") == forward.count("rlx_rms_norm_fwd") > 0
    assert "rlx_rms_norm_bwd_y" in text

    def add_loss(x, r, g, w):
        s, out = add_rms_norm_linear(x, r, g, w)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(s.astype(jnp.float32)))

    added = jax.jit(jax.grad(add_loss, (0, 1, 2, 3)))
    text = added.lower(x, r, g, w).as_text()
    assert "rlx_rms_norm_fwd" not in text and "rlx_add_rms_norm_bwd_y" in text
    # against the same maths through the plain ops (y kept from the forward)
    from rlx_jax.ops import add_rms_norm

    def add_loss_plain(x, r, g, w):
        s, y = add_rms_norm(x, r, g, eps=1e-6)
        return jnp.sum((y @ w).astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(s.astype(jnp.float32)))

    want = jax.jit(jax.grad(add_loss_plain, (0, 1, 2, 3)))(x, r, g, w)
    for a, b_, what in zip(added(x, r, g, w), want, ("dx", "dresidual", "dgamma", "dw")):
        _close(a, b_.astype(jnp.float32), jnp.bfloat16, what)


def test_add_rms_norm_forward_is_xla_fusion_on_cuda():
    """On CUDA the forward lowers to XLA's fused add + norm (measured faster than the add
    followed by the forward kernel): no forward kernel in the program, the values of the
    f32 reference of the rounded sum, the sum itself exact."""
    for dtype in (jnp.float32, jnp.bfloat16):
        x, g, _, r = _inputs((4, 512, 2048), dtype, seed=13)
        f = jax.jit(lambda x, r, g: add_rms_norm(x, r, g, eps=EPS))
        assert "rlx_rms_norm_fwd" not in f.lower(x, r, g).as_text()
        s, y = f(x, r, g)
        np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + r, np.float32))
        y_ref, _ = reference_rms_norm(*_f32(x + r, g), jnp.zeros(g.shape, jnp.float32), eps=EPS)
        _close(y, y_ref, dtype, "y")


def test_add_rms_norm_gradients_and_kernel_in_hlo():
    x, g, b, dy = _inputs((4, 512, 2048), jnp.bfloat16, seed=11)
    r, ds = _inputs((4, 512, 2048), jnp.bfloat16, seed=12)[::3]
    f = jax.jit(lambda x, r, g, ds, dy: jax.vjp(lambda *a: add_rms_norm(*a, eps=EPS), x, r, g)[1]((ds, dy)))
    assert "rlx_add_rms_norm_bwd" in f.lower(x, r, g, ds, dy).as_text()
    got = f(x, r, g, ds, dy)
    s = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(jnp.bfloat16)
    ref = lambda s, g: reference_rms_norm(s, g, jnp.zeros(g.shape, jnp.float32), eps=EPS)[0]
    ds_ref, dg_ref = jax.vjp(ref, *_f32(s, g))[1](dy.astype(jnp.float32))
    ds_ref = ds_ref + ds.astype(jnp.float32)
    for a, w, what in zip(got, (ds_ref, ds_ref, dg_ref), ("dx", "dresidual", "dgamma")):
        _close(a, w, jnp.bfloat16, what)
    again = f(x, r, g, ds, dy)
    for a, c in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
