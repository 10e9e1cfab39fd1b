"""Softmax: kernels vs pure-JAX references, gradients in every mode, vmap, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import softmax, softmax_backward
from testutil import assert_close, hlo_text, platform

SHAPES = [(3, 5, 33), (1, 1), (2, 1025), (0, 16), (3, 0)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _x(shape, dtype, seed=0, scale=3.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)).astype(dtype)


def test_kernels_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_softmax_fwd", "rlx_softmax_bwd"} <= set(info["targets"])
    x = _x((4, 8), jnp.float32)
    text = hlo_text(jax.grad(lambda x: jnp.sum(softmax(x) ** 2)), x)
    assert "rlx_softmax_fwd" in text and "rlx_softmax_bwd" in text
    # forward mode runs the backward kernel as the tangent map
    assert "rlx_softmax_bwd" in hlo_text(lambda x: jax.jvp(softmax, (x,), (x,))[1], x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, dtype):
    x = _x(shape, dtype)
    got = jax.jit(softmax)(x)
    assert got.dtype == dtype and got.shape == shape
    assert_close(got, jax.nn.softmax(x.astype(jnp.float32), axis=-1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_autodiff(shape, dtype):
    x, dy = _x(shape, dtype), _x(shape, dtype, seed=1, scale=1.0)
    y = softmax(x)
    got = jax.jit(softmax_backward)(y, dy)
    yf = y.astype(jnp.float32)
    # oracle: dx = y * (dy - <y, dy>) in f32 from the rounded y
    want = yf * (dy.astype(jnp.float32) - jnp.sum(yf * dy.astype(jnp.float32), -1, keepdims=True))
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    # and jax.grad of the op equals XLA's autodiff of jax.nn.softmax
    gx = jax.grad(lambda x: jnp.sum(softmax(x).astype(jnp.float32) * dy.astype(jnp.float32)))(x)
    gr = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x.astype(jnp.float32)) * dy.astype(jnp.float32)))(x)
    assert_close(gx, gr, dtype)


@pytest.mark.parametrize("axis", [0, 1, -1, -3])
def test_any_axis(axis):
    x, w = _x((3, 4, 5), jnp.float32), _x((3, 4, 5), jnp.float32, seed=2)
    assert_close(softmax(x, axis=axis), jax.nn.softmax(x, axis=axis))
    g = jax.grad(lambda x: jnp.sum(softmax(x, axis=axis) * w))(x)
    assert_close(g, jax.grad(lambda x: jnp.sum(jax.nn.softmax(x, axis=axis) * w))(x))
    assert_close(softmax_backward(softmax(x, axis=axis), w, axis=axis), g)


def test_masked_entries_are_exactly_zero():
    x = jnp.array([[0.0, -jnp.inf, 1.0, -jnp.inf], [-jnp.inf, 2.0, 2.0, -1e30]], jnp.float32)
    y = np.asarray(softmax(x))
    assert y[0, 1] == 0 and y[0, 3] == 0 and y[1, 0] == 0 and y[1, 3] == 0
    assert_close(y, jax.nn.softmax(x))


def test_large_logits_are_stable():
    x = jnp.array([[1e4, 1e4 - 1.0, -1e4]], jnp.float32)
    assert_close(softmax(x), jax.nn.softmax(x))


def test_check_grads_f64(x64):
    x = jax.random.normal(jax.random.PRNGKey(3), (3, 6), jnp.float64)
    assert "rlx_softmax_bwd" in hlo_text(jax.grad(lambda x: jnp.sum(softmax(x) ** 3)), x)
    check_grads(lambda x: softmax(x, axis=0), (x,), order=2, modes=("fwd", "rev"))
    check_grads(lambda x: softmax(x) ** 2, (x,), order=2, modes=("fwd", "rev"))
    dy = jax.random.normal(jax.random.PRNGKey(4), (3, 6), jnp.float64)
    check_grads(lambda y, d: softmax_backward(y, d), (softmax(x), dy), order=2, modes=("fwd", "rev"))


def test_vmap():
    x = _x((5, 3, 7), jnp.float32)
    assert_close(jax.vmap(softmax, in_axes=1, out_axes=1)(x), jax.nn.softmax(x))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(softmax(x) ** 2)))(x)
    assert_close(g, jax.vmap(jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) ** 2)))(x))
    y, dy = softmax(x), _x((5, 3, 7), jnp.float32, seed=1)
    assert_close(jax.vmap(softmax_backward, in_axes=(0, None))(y, dy[0]), jax.vmap(softmax_backward)(y, jnp.broadcast_to(dy[0], y.shape)))


def test_errors():
    with pytest.raises(TypeError, match="floating"):
        softmax(jnp.arange(4))
    with pytest.raises(ValueError, match="axis"):
        softmax(jnp.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match="at least one axis"):
        softmax(jnp.float32(1.0))
    with pytest.raises(ValueError, match="dy shape"):
        softmax_backward(jnp.ones((2, 3)), jnp.ones((3, 2)))
