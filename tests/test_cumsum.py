"""Cumsum: kernels vs NumPy on every axis, inclusive / exclusive, the reverse-scan
backward, gradients in every mode, vmap, integers, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import cumsum, cumsum_backward
from testutil import assert_close, hlo_text, numpy_cumsum as _oracle, platform

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _x(shape, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def test_kernels_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_cumsum_fwd_v1", "rlx_cumsum_bwd_v1"} <= set(info["targets"])
    text = hlo_text(jax.grad(lambda x: jnp.sum(cumsum(x, axis=1) ** 2)), _x((3, 4)))
    assert "rlx_cumsum_fwd" in text and "rlx_cumsum_bwd" in text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("shape,axis", [((4, 37), 1), ((3, 5, 7), 1), ((3, 5, 7), 0), ((11, 3), 0), ((9,), 0), ((2, 0, 3), 2)])
def test_forward_and_backward_match_numpy(shape, axis, exclusive, dtype):
    x = _x(shape, dtype)
    y = jax.jit(lambda x: cumsum(x, axis=axis, exclusive=exclusive))(x)
    assert y.dtype == dtype and y.shape == shape
    assert_close(y, _oracle(x, axis, exclusive), dtype)
    dx = jax.jit(lambda d: cumsum_backward(d, axis=axis, exclusive=exclusive))(x)
    assert_close(dx, _oracle(x, axis, exclusive, reverse=True), dtype)
    _, vjp = jax.vjp(lambda x: cumsum(x, axis=axis, exclusive=exclusive), x)
    assert_close(vjp(x)[0], dx, dtype)


def test_long_rows_accumulate_in_f32():
    x = jnp.full((2, 4096), 0.01, jnp.bfloat16)
    y = np.asarray(cumsum(x, axis=1), np.float32)
    assert abs(y[0, -1] - 4096 * float(x[0, 0])) < 0.01 * 4096 * 0.01  # a bf16 running sum would stall near 2-4


def test_integers_use_the_reference():
    x = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    np.testing.assert_array_equal(cumsum(x, axis=1, exclusive=True), _oracle(x, 1, True).astype(np.int32))


def test_check_grads_f64(x64):
    x = _x((3, 4, 2), jnp.float64)
    assert "rlx_cumsum_bwd" in hlo_text(jax.grad(lambda x: jnp.sum(cumsum(x, axis=1) ** 2)), x)
    for axis, exclusive in [(1, False), (2, True), (0, True)]:
        check_grads(lambda x: cumsum(x, axis=axis, exclusive=exclusive) ** 2, (x,), order=2, modes=("fwd", "rev"))
    check_grads(lambda x: cumsum_backward(x, axis=1, exclusive=True) ** 2, (x,), order=2, modes=("fwd", "rev"))


def test_vmap():
    x = _x((4, 3, 6))
    got = jax.vmap(lambda x: cumsum(x, axis=1, exclusive=True), in_axes=2, out_axes=2)(x)
    assert_close(got, _oracle(x, 1, True))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(cumsum(x, axis=0) ** 2)))(x)
    assert_close(g, jax.grad(lambda x: jnp.sum(jnp.cumsum(x, axis=1) ** 2))(x))


def test_errors():
    with pytest.raises(ValueError, match="axis"):
        cumsum(jnp.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match="at least one axis"):
        cumsum(jnp.float32(1.0), axis=0)
    with pytest.raises(TypeError, match="numeric"):
        cumsum(jnp.ones(3, bool), axis=0)
