"""RLX's 17 activations: forward vs plain JAX, closed-form backward vs JAX autodiff,
every mode through the custom JVP, names, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from rlx_jax.ops import activation, activation_backward, relu_backward
from rlx_jax.vjp_rules.activations import KINDS, activation_kind
from testutil import assert_close

# plain-JAX definitions autodiff is checked against
PLAIN = {
    "Gelu": lambda x: 0.5 * x * (1 + jax.lax.erf(x / np.sqrt(2.0))),
    "GeluApprox": lambda x: 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "Silu": lambda x: x / (1 + jnp.exp(-x)),
    "Relu": lambda x: jnp.maximum(x, 0),
    "Sigmoid": lambda x: 1 / (1 + jnp.exp(-x)),
    "Tanh": jnp.tanh,
    "Exp": jnp.exp,
    "Log": jnp.log,
    "Sqrt": jnp.sqrt,
    "Rsqrt": lambda x: 1 / jnp.sqrt(x),
    "Neg": lambda x: -x,
    "Abs": jnp.abs,
    "Sin": jnp.sin,
    "Cos": jnp.cos,
    "Tan": jnp.tan,
    "Atan": jnp.arctan,
}
POSITIVE = {"Log", "Sqrt", "Rsqrt"}


def _x(kind, shape=(5, 7), dtype=jnp.float32, seed=0):
    x = jax.random.uniform(jax.random.PRNGKey(seed), shape, jnp.float32, -1.4, 1.4)
    if kind in POSITIVE:
        x = jnp.abs(x) + 0.2
    else:
        x = jnp.where(jnp.abs(x) < 0.05, 0.3, x)  # keep away from the kinks of Relu / Abs
    return x.astype(dtype)


def test_all_17_kinds():
    assert len(KINDS) == 17 and set(PLAIN) | {"Round"} == set(KINDS)


@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_forward_and_backward_match_plain_jax(kind):
    x, dy = _x(kind), _x("Exp", seed=1)
    assert_close(activation(kind, x), PLAIN[kind](x))
    want = jax.vjp(PLAIN[kind], x)[1](dy)[0]
    assert_close(activation_backward(kind, x, dy), want)
    assert_close(jax.grad(lambda x: jnp.sum(activation(kind, x) * dy))(x), want)
    assert_close(jax.jvp(lambda x: activation(kind, x), (x,), (dy,))[1], jax.jvp(PLAIN[kind], (x,), (dy,))[1])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kind", ["Gelu", "Silu", "Tanh", "Rsqrt"])
def test_low_precision(kind, dtype):
    x, dy = _x(kind, dtype=dtype), _x("Exp", dtype=dtype, seed=1)
    y = activation(kind, x)
    assert y.dtype == dtype
    assert_close(y, PLAIN[kind](x.astype(jnp.float32)), dtype)
    g = activation_backward(kind, x, dy)
    assert g.dtype == dtype
    assert_close(g, jax.vjp(PLAIN[kind], x.astype(jnp.float32))[1](dy.astype(jnp.float32))[0], dtype)


@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_check_grads_f64(kind, x64):
    x = _x(kind, (2, 3), jnp.float64)
    check_grads(lambda x: activation(kind, x), (x,), order=2, modes=("fwd", "rev"))


def test_round_is_straight_through():
    x = jnp.array([0.5, 1.5, -0.5, -2.5, 2.4, -0.2], jnp.float32)
    # RLX's CPU semantics (Rust f32::round): halves away from zero
    np.testing.assert_array_equal(activation("Round", x), [1.0, 2.0, -1.0, -3.0, 2.0, -0.0])
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(activation("Round", x) * 3))(x), np.full(6, 3.0))
    np.testing.assert_array_equal(activation_backward("Round", x, x), x)
    assert_close(jax.hessian(lambda x: jnp.sum(activation("Round", x) ** 2))(x), 2 * np.eye(6))


def test_relu_backward_and_kinks():
    x = jnp.array([-1.0, 0.0, 2.0])
    np.testing.assert_array_equal(relu_backward(x, jnp.array([5.0, 6.0, 7.0])), [0.0, 0.0, 7.0])
    np.testing.assert_array_equal(activation_backward("Abs", x, jnp.ones(3)), [-1.0, 0.0, 1.0])


def test_names_and_vmap():
    from rlx_jax.ir.op import ActivationKind

    assert activation_kind(ActivationKind.GeluApprox) == activation_kind("gelu_approx") == "GeluApprox"
    x = _x("Silu", (3, 4))
    assert_close(jax.vmap(lambda r: activation("silu", r))(x), PLAIN["Silu"](x))
    assert_close(jax.vmap(jax.grad(lambda r: jnp.sum(activation("Tanh", r))))(x), 1 - jnp.tanh(x) ** 2)


def test_errors():
    with pytest.raises(ValueError, match="unknown kind"):
        activation("Swish", jnp.ones(2))
    with pytest.raises(TypeError, match="floating"):
        activation("Relu", jnp.arange(3))
    with pytest.raises(ValueError, match="dy shape"):
        activation_backward("Relu", jnp.ones(3), jnp.ones(2))
