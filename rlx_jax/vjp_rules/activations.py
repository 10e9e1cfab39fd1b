"""RLX's 17 elementwise activations with their closed-form derivatives.

``activation(kind, x)`` applies RLX ``Activation(kind)``; ``activation_backward(kind, x,
dy)`` is RLX ``ActivationBackward{kind}`` (and ``ReluBackward`` for Relu): ``dx = f'(x) *
dy`` with the closed forms below. The forward is a ``jax.custom_jvp`` whose tangent
rule calls ``activation_backward``, which is linear in dy: JAX transposes it for
reverse mode and differentiates it again for higher orders, so every mode uses the
same closed form. Plain JAX, no kernel: XLA fuses elementwise chains.

| kind | f(x) | f'(x) |
| --- | --- | --- |
| Gelu | x Phi(x) (erf form) | Phi(x) + x phi(x) |
| GeluApprox | 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3), c = sqrt(2/pi) | 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2) |
| Silu | x sigmoid(x) | s (1 + x (1 - s)) |
| Relu | max(x, 0) | 1 where x > 0, else 0 (ReluBackward: dy where x > 0) |
| Sigmoid | 1 / (1 + e^-x) | s (1 - s) |
| Tanh | tanh x | 1 - tanh^2 x |
| Exp / Log | e^x / ln x | e^x / 1 / x |
| Sqrt / Rsqrt | sqrt x / 1 / sqrt x | 0.5 / sqrt x / -0.5 x^-1.5 |
| Neg / Abs | -x / abs x | -1 / sign x (0 at 0) |
| Sin / Cos / Tan / Atan | | cos x / -sin x / 1 + tan^2 x / 1 / (1 + x^2) |
| Round | round half away from zero (Rust f32::round, RLX's CPU semantics) | 1 (straight-through) |

bf16/f16 inputs are computed in f32 and rounded back.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

#: RLX Activation variant names, in RLX order
KINDS = (
    "Gelu", "GeluApprox", "Silu", "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt",
    "Rsqrt", "Neg", "Abs", "Sin", "Cos", "Tan", "Atan", "Round",
)  # fmt: skip

_SNAKE = {
    "gelu": "Gelu", "gelu_approx": "GeluApprox", "silu": "Silu", "relu": "Relu",
    "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "log": "Log", "sqrt": "Sqrt",
    "rsqrt": "Rsqrt", "neg": "Neg", "abs": "Abs", "sin": "Sin", "cos": "Cos",
    "tan": "Tan", "atan": "Atan", "round": "Round",
}  # fmt: skip

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def activation_kind(kind) -> str:
    """The RLX variant name of ``kind``: an ``ActivationKind``, a variant name ("GeluApprox")
    or a pyrlx snake_case name ("gelu_approx")."""
    name = getattr(kind, "value", kind)
    if isinstance(name, str):
        if name in KINDS:
            return name
        if name.lower() in _SNAKE:
            return _SNAKE[name.lower()]
    raise ValueError(f"activation: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")


def _compute_dtype(dtype):
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


_FORWARD = {
    "Gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "GeluApprox": lambda x: jax.nn.gelu(x, approximate=True),
    "Silu": jax.nn.silu,
    "Relu": jax.nn.relu,
    "Sigmoid": jax.nn.sigmoid,
    "Tanh": jnp.tanh,
    "Exp": jnp.exp,
    "Log": jnp.log,
    "Sqrt": jnp.sqrt,
    "Rsqrt": lax.rsqrt,
    "Neg": jnp.negative,
    "Abs": jnp.abs,
    "Sin": jnp.sin,
    "Cos": jnp.cos,
    "Tan": jnp.tan,
    "Atan": jnp.arctan,
    "Round": lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
}


def _derivative(name, x):
    """f'(x) in closed form (x already in its compute dtype)."""
    if name == "Gelu":
        cdf = 0.5 * (1.0 + lax.erf(x / math.sqrt(2.0)))
        pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return cdf + x * pdf
    if name == "GeluApprox":
        t = jnp.tanh(_GELU_C * (x + _GELU_K * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_K * x * x)
    if name == "Silu":
        s = jax.nn.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if name == "Relu":
        return (x > 0).astype(x.dtype)
    if name == "Sigmoid":
        s = jax.nn.sigmoid(x)
        return s * (1.0 - s)
    if name == "Tanh":
        t = jnp.tanh(x)
        return 1.0 - t * t
    if name == "Exp":
        return jnp.exp(x)
    if name == "Log":
        return 1.0 / x
    if name == "Sqrt":
        return 0.5 / jnp.sqrt(x)
    if name == "Rsqrt":
        r = lax.rsqrt(x)
        return -0.5 * r * r * r
    if name == "Neg":
        return jnp.full_like(x, -1)
    if name == "Abs":
        return jnp.sign(x)
    if name == "Sin":
        return jnp.cos(x)
    if name == "Cos":
        return -jnp.sin(x)
    if name == "Tan":
        t = jnp.tan(x)
        return 1.0 + t * t
    if name == "Atan":
        return 1.0 / (1.0 + x * x)
    if name == "Round":
        return jnp.ones_like(x)
    raise AssertionError(name)


def reference_activation(kind, x):
    """f(x) in plain JAX (no custom rule): the test oracle."""
    name = activation_kind(kind)
    cd = _compute_dtype(x.dtype)
    return _FORWARD[name](x.astype(cd)).astype(x.dtype)


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _activation(name, x):
    return reference_activation(name, x)


@_activation.defjvp
def _activation_jvp(name, primals, tangents):
    (x,), (tx,) = primals, tangents
    return _activation(name, x), activation_backward(name, x, tx)


def _check_x(x, who):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    return x


def activation(kind, x):
    """RLX ``Activation(kind)`` applied elementwise to x (any shape, same dtype).

    kind: an ``ActivationKind``, a variant name ("Gelu", ...) or a snake_case name
    ("gelu_approx", ...). Differentiable in every mode through the closed-form
    derivative (``activation_backward``); Round's gradient is straight-through.
    """
    name = activation_kind(kind)
    return _activation(name, _check_x(x, "activation"))


def activation_backward(kind, x, dy):
    """RLX ``ActivationBackward{kind}`` / ``ReluBackward``: ``dx = f'(x) * dy`` (closed
    form; linear in dy). x and dy have the same shape; dx has x's dtype."""
    name = activation_kind(kind)
    x = _check_x(x, "activation_backward")
    dy = jnp.asarray(dy)
    if dy.shape != x.shape:
        raise ValueError(f"activation_backward: dy shape {dy.shape} differs from x shape {x.shape}")
    cd = _compute_dtype(x.dtype)
    return (_derivative(name, x.astype(cd)) * dy.astype(cd)).astype(x.dtype)


def relu_backward(x, dy):
    """RLX ``ReluBackward``: dy where x > 0, else 0."""
    return activation_backward("Relu", x, dy)
