"""Softmax on the GPU: the CUDA kernels (rlx_softmax_fwd / rlx_softmax_bwd on platform
CUDA) against the f32 reference on random data. Skipped where JAX sees no GPU.

Widths cover narrow rows (several rows per warp), the 16-byte vector path, the scalar
path (odd widths), rows of one register chunk (up to 8192 / 4096 elements per 512-thread
block) and rows of several chunks (re-read from L2), up to 65536."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax.ops import softmax
from rlx_jax.vjp_rules.softmax import reference_softmax, reference_softmax_bwd, softmax_bwd, softmax_fwd

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
pytestmark = pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to JAX: the CUDA kernels cannot run here")

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _gpu():
    return next(d for d in jax.devices() if d.platform == "gpu")


def _inputs(shape, dtype, seed):
    kx, kd = jax.random.split(jax.random.PRNGKey(seed))
    x = (3.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return [jax.device_put(a, _gpu()) for a in (x, dy)]


def _close(got, want, dtype, what, scale=None):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if got.size == 0:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite values (unwritten output?)"
    scale = scale if scale is not None else max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want)))
    tol = TOL[jnp.dtype(dtype).type]
    assert err <= tol * scale, f"{what}: max abs err {err:.3g} > {tol:.1g} * {scale:.3g}"


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_softmax_fwd", "rlx_softmax_bwd"} <= set(info["targets"])
    x, dy = _inputs((8, 256), jnp.float32, 0)
    text = jax.jit(lambda x, dy: jax.vjp(softmax, x)[1](dy)).lower(x, dy).as_text()
    assert "rlx_softmax_fwd" in text and "rlx_softmax_bwd" in text


SHAPES = [(1, 1), (37, 5), (64, 64), (33, 999), (5, 3, 100), (257, 1024), (130, 4096), (17, 8192),
          (9, 12288), (8, 32000), (3, 65536), (0, 512)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_f32_reference(shape, dtype):
    x, dy = _inputs(shape, dtype, seed=sum(shape) % 1000)
    (y,) = jax.jit(softmax_fwd)(x)
    (y_ref,) = jax.jit(reference_softmax)(x.astype(jnp.float32))
    assert y.dtype == dtype
    _close(y, y_ref, dtype, "y")
    if y.size:  # rows sum to one
        np.testing.assert_allclose(np.asarray(jnp.sum(y.astype(jnp.float32), -1)), 1.0, rtol=0, atol=4 * TOL[dtype])
    (dx,) = jax.jit(softmax_bwd)(y, dy)
    (dx_ref,) = jax.jit(reference_softmax_bwd)(y.astype(jnp.float32), dy.astype(jnp.float32))
    assert dx.dtype == dtype
    _close(dx, dx_ref, dtype, "dx")


def test_grad_and_jvp_non_last_axis():
    x, dy = _inputs((6, 300, 7), jnp.float32, seed=3)
    f = lambda x: softmax(x, axis=1)  # noqa: E731
    ref = lambda x: jnp.moveaxis(reference_softmax(jnp.moveaxis(x, 1, -1))[0], -1, 1)  # noqa: E731
    got = jax.jit(lambda x, dy: jax.vjp(f, x)[1](dy)[0])(x, dy)
    want = jax.vjp(ref, x)[1](dy)[0]
    _close(got, want, jnp.float32, "dx")
    y, ty = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, dy)
    y_ref, ty_ref = jax.jvp(ref, (x,), (dy,))
    _close(y, y_ref, jnp.float32, "y")
    _close(ty, ty_ref, jnp.float32, "ty")


def test_extreme_values():
    x = jnp.array([[1e30, 0.0, -1e30, 5.0], [-jnp.inf, 0.0, 1.0, -jnp.inf], [88.0, 89.0, 90.0, -100.0]], jnp.float32)
    (y,) = jax.jit(softmax_fwd)(jax.device_put(x, _gpu()))
    (y_ref,) = reference_softmax(x)
    _close(y, y_ref, jnp.float32, "y")


def test_vmap_keeps_kernel():
    x, dy = _inputs((3, 16, 512), jnp.float32, seed=4)
    f = jax.vmap(lambda x, dy: jax.vjp(softmax, x)[1](dy)[0])
    text = jax.jit(f).lower(x, dy).as_text()
    assert "rlx_softmax_bwd" in text
    want = jax.vmap(lambda x, dy: jax.vjp(lambda x: reference_softmax(x)[0], x)[1](dy)[0])(x, dy)
    _close(jax.jit(f)(x, dy), want, jnp.float32, "dx")


def test_mismatched_output_is_an_error_not_a_crash():
    x, dy = _inputs((4, 64), jnp.float32, seed=1)
    call = jax.ffi.ffi_call("rlx_softmax_bwd", (jax.ShapeDtypeStruct((4, 64), jnp.bfloat16),))
    with pytest.raises(Exception, match="dx must match"):
        jax.block_until_ready(jax.jit(call)(x, dy))
