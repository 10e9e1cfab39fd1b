"""Softmax on the GPU: the CUDA kernels (rlx_softmax_fwd / rlx_softmax_bwd /
rlx_softmax_bwd_x on platform CUDA) against the f32 reference on random data. Skipped
where JAX sees no GPU.

Widths cover narrow rows (several rows per warp), the 16-byte vector path, the scalar
path (odd widths), rows of one register chunk (up to 8192 / 4096 elements per 512-thread
block) and rows of several chunks (re-read from L2), up to 65536."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import assert_close, gpu, requires_gpu
from rlx_jax.ops import softmax
from rlx_jax.vjp_rules.softmax import (
    reference_softmax, reference_softmax_bwd, reference_softmax_bwd_x, softmax_bwd, softmax_bwd_x, softmax_fwd,
)

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


_gpu = gpu


def _inputs(shape, dtype, seed):
    kx, kd = jax.random.split(jax.random.PRNGKey(seed))
    x = (3.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return [jax.device_put(a, _gpu()) for a in (x, dy)]


def _close(got, want, dtype, what, scale=None):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what, scale=scale, min_scale=1e-30)


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_softmax_fwd_v1", "rlx_softmax_bwd_v1", "rlx_softmax_bwd_x_v1"} <= set(info["targets"])
    x, dy = _inputs((8, 256), jnp.float32, 0)
    def value_and_pullback(x, dy):
        y, pull = jax.vjp(softmax, x)
        return y, pull(dy)[0]

    assert _targets(jax.jit(value_and_pullback).lower(x, dy).as_text()) == {"rlx_softmax_fwd_v1", "rlx_softmax_bwd_x_v1"}
    # the gradient alone: the forward kernel is dead code (the pullback reads x, not y)
    compiled = jax.jit(lambda x, dy: jax.vjp(softmax, x)[1](dy)[0]).lower(x, dy).compile().as_text()
    assert _targets(compiled) == {"rlx_softmax_bwd_x_v1"}


def _targets(text):
    """rlx_* custom-call targets by exact name (rlx_softmax_bwd is a prefix of ..._bwd_x)."""
    return set(re.findall(r"@(rlx_\w+)\(", text)) | set(re.findall(r'custom_call_target="(rlx_\w+)"', text))


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


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_from_x_matches_f32_reference(shape, dtype):
    """rlx_softmax_bwd_x (y recomputed in the kernel) against the reference on the same
    rounded inputs, computed in f32; every width path: rows per warp, 16-byte vectors,
    scalar (odd widths), one register chunk, several chunks (65536)."""
    x, dy = _inputs(shape, dtype, seed=sum(shape) % 1000 + 1)
    f = jax.jit(lambda x, dy: softmax_bwd_x(x, dy)[0])
    assert "rlx_softmax_bwd_x_v1" in _targets(f.lower(x, dy).as_text())
    dx = f(x, dy)
    (dx_ref,) = jax.jit(reference_softmax_bwd_x)(x.astype(jnp.float32), dy.astype(jnp.float32))
    assert dx.dtype == dtype and dx.shape == shape
    _close(dx, dx_ref, dtype, "dx")


@pytest.mark.parametrize("width", [4096, 12288, 65536, 65535])
@pytest.mark.parametrize("order", ["rising", "falling"])
def test_backward_from_x_wide_rows_running_max(width, order):
    """Rows of several chunks: the running max of each thread grows chunk after chunk
    (rising ramp: every chunk rescales the partial sums) or is set by the first chunk
    (falling ramp)."""
    kx, kd = jax.random.split(jax.random.PRNGKey(width))
    ramp = jnp.linspace(-20.0, 20.0, width, dtype=jnp.float32)
    ramp = ramp if order == "rising" else ramp[::-1]
    x = ramp[None, :] + jax.random.normal(kx, (3, width), jnp.float32)
    dy = jax.random.normal(kd, (3, width), jnp.float32)
    x, dy = jax.device_put(x, _gpu()), jax.device_put(dy, _gpu())
    dx = jax.jit(lambda x, dy: softmax_bwd_x(x, dy)[0])(x, dy)
    (dx_ref,) = jax.jit(reference_softmax_bwd_x)(x, dy)
    _close(dx, dx_ref, jnp.float32, "dx")


def test_backward_from_x_masked_and_extreme():
    x = jnp.array([[1e30, 0.0, -1e30, 5.0], [-jnp.inf, 0.0, 1.0, -jnp.inf], [88.0, 89.0, 90.0, -100.0]], jnp.float32)
    dy = jnp.array([[1.0, -2.0, 0.5, 3.0], [4.0, 1.0, -1.0, 2.0], [0.3, -0.7, 1.1, 5.0]], jnp.float32)
    dx = np.asarray(jax.jit(lambda x, dy: softmax_bwd_x(x, dy)[0])(jax.device_put(x, _gpu()), jax.device_put(dy, _gpu())))
    (dx_ref,) = reference_softmax_bwd_x(x, dy)
    _close(dx, dx_ref, jnp.float32, "dx", scale=1.0)
    assert dx[1, 0] == 0 and dx[1, 3] == 0  # masked entries get exactly zero


def test_backward_from_x_mismatched_operands_are_errors():
    x, dy = _inputs((4, 64), jnp.float32, seed=2)
    call = jax.ffi.ffi_call("rlx_softmax_bwd_x_v1", (jax.ShapeDtypeStruct((4, 64), jnp.float32),))
    with pytest.raises(Exception, match="dy must match"):
        jax.block_until_ready(jax.jit(call)(x, dy.astype(jnp.bfloat16)))
    bad = jax.ffi.ffi_call("rlx_softmax_bwd_x_v1", (jax.ShapeDtypeStruct((4, 64), jnp.float16),))
    with pytest.raises(Exception, match="dx must match"):
        jax.block_until_ready(jax.jit(bad)(x, dy))


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
    assert "rlx_softmax_bwd_x_v1" in _targets(text)
    want = jax.vmap(lambda x, dy: jax.vjp(lambda x: reference_softmax(x)[0], x)[1](dy)[0])(x, dy)
    _close(jax.jit(f)(x, dy), want, jnp.float32, "dx")


def test_mismatched_output_is_an_error_not_a_crash():
    x, dy = _inputs((4, 64), jnp.float32, seed=1)
    call = jax.ffi.ffi_call("rlx_softmax_bwd_v1", (jax.ShapeDtypeStruct((4, 64), jnp.bfloat16),))
    with pytest.raises(Exception, match="dx must match"):
        jax.block_until_ready(jax.jit(call)(x, dy))
