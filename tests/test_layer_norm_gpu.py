"""LayerNorm on the GPU: the CUDA kernels (rlx_layer_norm_fwd / rlx_layer_norm_bwd on
platform CUDA) against the f32 reference on random data. Skipped where JAX sees no GPU.

Widths cover the 16-byte vector path, the scalar path (odd widths; 16-bit rows that are
not a multiple of 16 bytes), narrow rows (several rows per warp), the one-pass limit
(8192) and the slabbed wide-row path (> 8192 columns, up to 65536).

Rows of at least 2 KB take the sm_90 staged backward and forward (bulk copies into shared
memory, several rows per block): test_staged_rows_sanitizer_small and
test_staged_forward_sanitizer_small give every row its own mean and scale, so a statistic
taken from the wrong row (or a stage read before its copy landed) fails. f32 rows and rows
under 2 KB take the register forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import as_f32, assert_close, gpu, requires_gpu
from rlx_jax.ops import layer_norm
from rlx_jax.vjp_rules.layer_norm import (
    cuda_bwd_scratch_size,
    layer_norm_bwd,
    layer_norm_fwd,
    reference_layer_norm,
    reference_layer_norm_bwd,
)

pytestmark = requires_gpu

EPS = 1e-5
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# relative (to max |ref|, at least 1) max-abs error allowed per dtype
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


_gpu = gpu


def _inputs(shape, dtype, seed):
    kx, kg, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = shape[-1]
    # a non-zero mean, so a kernel that skipped the centring would fail
    x = (0.7 + 1.5 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(kg, (h,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(kb, (h,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return [jax.device_put(a, _gpu()) for a in (x, g, b, dy)]


def _close(got, want, dtype, what):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what)


_f32 = as_f32


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_layer_norm_fwd_v1", "rlx_layer_norm_fwd_v2", "rlx_layer_norm_bwd_v1"} <= set(info["targets"])
    x, g, b, dy = _inputs((8, 256), jnp.float32, 0)
    fn = jax.jit(lambda x, g, b, dy: jax.vjp(layer_norm, x, g, b)[1](dy))
    text = fn.lower(x, g, b, dy).as_text()
    assert "rlx_layer_norm_fwd" in text and "rlx_layer_norm_bwd" in text
    # the CUDA call carries its scratch result (the CPU call has three results)
    assert f"tensor<{cuda_bwd_scratch_size(8, 256)}xf32>" in text


SHAPES = [
    (1, 64),
    (37, 64),
    (5, 3, 100),  # 16-bit: 200 bytes a row -> scalar path
    (33, 999),  # odd width: scalar path
    (64, 1000),
    (257, 1024),
    (65, 1032),  # staged forward, last thread group's second vector outside the row (16-bit: 96 threads)
    (130, 4096),
    (17, 8192),  # widest one-pass row
    (9, 12288),  # slabbed wide-row path
    (3, 65536),
    (0, 512),  # zero rows
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_f32_reference(shape, dtype):
    x, g, b, dy = _inputs(shape, dtype, seed=sum(shape) % 1000)
    y, mean, rstd = jax.jit(lambda x, g, b: layer_norm_fwd(x, g, b, eps=EPS))(x, g, b)
    y_ref, mean_ref, rstd_ref = jax.jit(lambda *a: reference_layer_norm(*a, eps=EPS))(*_f32(x, g, b))
    assert y.dtype == dtype and mean.dtype == jnp.float32 and rstd.dtype == jnp.float32
    _close(y, y_ref, dtype, "y")
    _close(mean, mean_ref, jnp.float32, "mean")
    _close(rstd, rstd_ref, jnp.float32, "rstd")
    # backward from the reference statistics, compared with the f32 reference backward
    dx, dg, db = jax.jit(lambda *a: layer_norm_bwd(*a, eps=EPS))(x, g, mean_ref, rstd_ref, dy)
    dx_ref, dg_ref, db_ref = jax.jit(lambda *a: reference_layer_norm_bwd(*a, eps=EPS))(
        *_f32(x, g), mean_ref, rstd_ref, dy.astype(jnp.float32))
    assert dx.dtype == dtype and dg.dtype == dtype and db.dtype == dtype
    _close(dx, dx_ref, dtype, "dx")
    _close(dg, dg_ref, dtype, "dgamma")
    _close(db, db_ref, dtype, "dbeta")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_grad_through_custom_vjp(dtype):
    x, g, b, dy = _inputs((4, 3, 768), dtype, seed=5)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(lambda *a: layer_norm(*a, eps=EPS), x, g, b)[1](dy))
    got = f(x, g, b, dy)
    want = jax.vjp(lambda *a: reference_layer_norm(*a, eps=EPS)[0], *_f32(x, g, b))[1](dy.astype(jnp.float32))
    for a, w, what in zip(got, want, ("dx", "dgamma", "dbeta")):
        _close(a, w, dtype, what)


def test_non_last_axis_and_jvp():
    x, g, b, _ = _inputs((6, 5, 96), jnp.float32, seed=7)
    x = jnp.moveaxis(x, 2, 1)  # [6, 96, 5], normalised over axis 1 (size 96 = gamma's)
    tx = jax.random.normal(jax.random.PRNGKey(8), x.shape, jnp.float32)
    f = lambda x: layer_norm(x, g, b, axis=1, eps=EPS)  # noqa: E731
    ref = lambda x: jnp.moveaxis(reference_layer_norm(jnp.moveaxis(x, 1, -1), g, b, eps=EPS)[0], -1, 1)  # noqa: E731
    y, ty = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, tx)
    y_ref, ty_ref = jax.jvp(ref, (x,), (tx,))
    _close(y, y_ref, jnp.float32, "y")
    _close(ty, ty_ref, jnp.float32, "ty")


def test_zero_rows_give_zero_parameter_gradients():
    x, g, b, dy = _inputs((0, 4096), jnp.bfloat16, seed=2)
    dx, dg, db = jax.jit(lambda x, g, b, dy: jax.vjp(layer_norm, x, g, b)[1](dy))(x, g, b, dy)
    assert dx.shape == (0, 4096)
    np.testing.assert_array_equal(np.asarray(dg, np.float32), 0)
    np.testing.assert_array_equal(np.asarray(db, np.float32), 0)


def test_empty_rows_give_nan_statistics():
    """Width 0: mean and rstd are 0/0 (NaN), as in the reference and the CPU kernel, not
    left unwritten."""
    x = jax.device_put(jnp.zeros((5, 0), jnp.float32), _gpu())
    g = jax.device_put(jnp.zeros((0,), jnp.float32), _gpu())
    y, mean, rstd = jax.jit(lambda x, g: layer_norm_fwd(x, g, g, eps=EPS))(x, g)
    assert y.shape == (5, 0)
    assert np.isnan(np.asarray(mean)).all() and np.isnan(np.asarray(rstd)).all()


@pytest.mark.parametrize("shape", [(4099, 4096), (1000, 333), (64, 12288)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_backward_bitwise_deterministic(shape, dtype):
    x, g, b, dy = _inputs(shape, dtype, seed=9)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(layer_norm, x, g, b)[1](dy))
    first = [np.asarray(a.astype(jnp.float32)) for a in f(x, g, b, dy)]
    second = [np.asarray(a.astype(jnp.float32)) for a in f(x, g, b, dy)]
    for a, c in zip(first, second):
        np.testing.assert_array_equal(a, c)


def test_vmap_keeps_kernel():
    x, g, b, dy = _inputs((3, 16, 512), jnp.float32, seed=3)
    f = jax.vmap(lambda x, dy: jax.vjp(lambda x: layer_norm(x, g, b, eps=EPS), x)[1](dy)[0])
    got = jax.jit(f)(x, dy)
    want = jax.vmap(lambda x, dy: jax.vjp(lambda x: reference_layer_norm(x, g, b, eps=EPS)[0], x)[1](dy)[0])(x, dy)
    _close(got, want, jnp.float32, "dx")


def test_bad_scratch_is_an_error_not_a_crash():
    x, g, b, dy = _inputs((16, 256), jnp.float32, seed=4)
    mean, rstd = jnp.zeros((16,), jnp.float32), jnp.ones((16,), jnp.float32)
    p = jax.ShapeDtypeStruct(g.shape, g.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p, jax.ShapeDtypeStruct((7,), jnp.float32))
    call = jax.ffi.ffi_call("rlx_layer_norm_bwd_v1", out)
    with pytest.raises(Exception, match="scratch"):
        jax.block_until_ready(jax.jit(call)(x, g, mean, rstd, dy))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1031, 2048), (45, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_staged_rows_sanitizer_small(shape, dtype):
    """Staged backward over several rows per block (1031 rows: uneven rows per block), each
    row with its own mean, through the public op's vjp and the saved statistics."""
    x, g, b, dy = _inputs(shape, dtype, seed=21)
    offset = jnp.linspace(-40.0, 40.0, shape[0], dtype=jnp.float32)[:, None]
    x = jax.device_put((x.astype(jnp.float32) + offset).astype(dtype), _gpu())
    got = jax.jit(lambda x, g, b, dy: jax.vjp(lambda *a: layer_norm(*a, eps=EPS), x, g, b)[1](dy))(x, g, b, dy)
    want = jax.vjp(lambda *a: reference_layer_norm(*a, eps=EPS)[0], *_f32(x, g, b))[1](dy.astype(jnp.float32))
    for a, w, what in zip(got, want, ("dx", "dgamma", "dbeta")):
        _close(a, w, dtype, what)



@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1031, 2048), (45, 4096), (65, 1032)], ids=lambda s: "x".join(map(str, s)))
def test_staged_forward_sanitizer_small(shape, dtype):
    """Staged forward over several rows per block (uneven rows per block; 1032: a partial
    last vector group), each row with its own mean and scale: y, mean, rstd vs the f32
    reference, and the custom VJP's gradients from the saved statistics."""
    x, g, b, dy = _inputs(shape, dtype, seed=23)
    rows = jnp.arange(shape[0], dtype=jnp.float32)[:, None]
    x = jax.device_put((x.astype(jnp.float32) * (1.0 + rows % 5) + 30.0 * jnp.sin(rows)).astype(dtype), _gpu())
    y, mean, rstd = jax.jit(lambda x, g, b: layer_norm_fwd(x, g, b, eps=EPS))(x, g, b)
    y_ref, mean_ref, rstd_ref = jax.jit(lambda *a: reference_layer_norm(*a, eps=EPS))(*_f32(x, g, b))
    _close(y, y_ref, dtype, "y")
    _close(mean, mean_ref, jnp.float32, "mean")
    _close(rstd / rstd_ref, jnp.ones_like(rstd_ref), jnp.float32, "rstd / rstd_ref")
    got = jax.jit(lambda x, g, b, dy: jax.vjp(lambda *a: layer_norm(*a, eps=EPS), x, g, b)[1](dy))(x, g, b, dy)
    want = jax.vjp(lambda *a: reference_layer_norm(*a, eps=EPS)[0], *_f32(x, g, b))[1](dy.astype(jnp.float32))
    for a, w, what in zip(got, want, ("dx", "dgamma", "dbeta")):
        _close(a, w, dtype, what)
