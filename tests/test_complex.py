"""ComplexNormSq: value, RLX's Wirtinger backward, agreement of jax.grad with JAX's own
autodiff of |z|^2, every mode, vmap, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from rlx_jax.ops import complex_norm_sq, complex_norm_sq_backward
from testutil import assert_close


def _z(shape, dtype=jnp.complex64, seed=0):
    kr, ki = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(kr, shape) + 1j * jax.random.normal(ki, shape)).astype(dtype)


def test_value_and_dtype():
    z = _z((3, 4))
    y = complex_norm_sq(z)
    assert y.dtype == jnp.float32 and y.shape == (3, 4)
    assert_close(y, np.abs(np.asarray(z)) ** 2)
    assert complex_norm_sq(jnp.zeros((0, 2), jnp.complex64)).shape == (0, 2)


def test_rlx_backward_is_wirtinger_g_times_z():
    z, g = _z((5,)), jax.random.normal(jax.random.PRNGKey(3), (5,))
    dz = complex_norm_sq_backward(z, g)
    assert dz.dtype == jnp.complex64
    assert_close(dz.real, (g * z).real)
    assert_close(dz.imag, (g * z).imag)


def test_jax_grad_agrees_with_jax_autodiff():
    z, w = _z((6,)), jnp.arange(6.0)
    loss = lambda z: jnp.sum(complex_norm_sq(z) * w)
    plain = lambda z: jnp.sum(jnp.abs(z) ** 2 * w)
    g, gp = jax.grad(loss)(z), jax.grad(plain)(z)
    assert_close(g.real, gp.real)
    assert_close(g.imag, gp.imag)
    # the documented conversion: JAX cotangent = 2 * conj(RLX Wirtinger gradient)
    conv = 2 * jnp.conj(complex_norm_sq_backward(z, w))
    assert_close(g.real, conv.real)
    assert_close(g.imag, conv.imag)
    # through a further holomorphic map
    f = lambda z: jnp.sum(complex_norm_sq(z * (1 + 2j) + 0.5) ** 2)
    fp = lambda z: jnp.sum(jnp.abs(z * (1 + 2j) + 0.5) ** 4)
    assert_close(jax.grad(f)(z).imag, jax.grad(fp)(z).imag)


def test_every_mode_c128(x64):
    z = _z((2, 3), jnp.complex128)
    check_grads(complex_norm_sq, (z,), order=2, modes=("fwd", "rev"))
    t = _z((2, 3), jnp.complex128, seed=1)
    assert_close(jax.jvp(complex_norm_sq, (z,), (t,))[1], jax.jvp(lambda z: jnp.abs(z) ** 2, (z,), (t,))[1])
    assert_close(jax.vmap(complex_norm_sq)(z), jnp.abs(z) ** 2)


def test_errors():
    with pytest.raises(TypeError, match="complex"):
        complex_norm_sq(jnp.ones(3))
    with pytest.raises(ValueError, match="g shape"):
        complex_norm_sq_backward(_z((3,)), jnp.ones(2))
