"""Elementwise ops: Activation, Binary, Compare, Where, Cast, Conjugate, StopGradient,
ElementwiseRegion, ReluBackward, ActivationBackward.

These stay plain ``jax.numpy`` so XLA fuses them; each rule is the one place of its
op's maths.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .registry import enum_name, jnp_dtype, lowering_rule


def _round_ste(x):
    # RLX Round: round half to even in the forward; straight-through gradient.
    return x + lax.stop_gradient(jnp.round(x) - x)


# RLX Activation semantics (rlx-ir op.rs): Gelu is the erf form, GeluApprox the tanh form.
_ACTIVATIONS = {
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
    "Round": _round_ste,
}


def activation(kind, x):
    """Apply RLX activation ``kind`` (variant name or enum) to ``x``."""
    name = enum_name(kind)
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise NotImplementedError(f"unknown activation {name!r}")
    return fn(x)


def _sqrt_2_over_pi():
    return math.sqrt(2.0 / math.pi)


def activation_derivative(kind, x):
    """``d act(x) / dx`` in closed form (RLX ``ActivationBackward`` table)."""
    name = enum_name(kind)
    if name == "Gelu":
        cdf = 0.5 * (1.0 + lax.erf(x / math.sqrt(2.0)))
        pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return cdf + x * pdf
    if name == "GeluApprox":
        c = _sqrt_2_over_pi()
        u = c * (x + 0.044715 * x**3)
        t = jnp.tanh(u)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)
    if name == "Silu":
        s = jax.nn.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
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
        return -0.5 * x ** (-1.5)
    if name == "Neg":
        return -jnp.ones_like(x)
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
    if name == "Relu":
        return (x > 0).astype(x.dtype)
    if name == "Round":
        return jnp.ones_like(x)
    raise NotImplementedError(f"unknown activation {name!r}")


@lowering_rule("Activation")
def _activation(op, args, ctx):
    return ctx.cast_out(activation(op.kind, args[0]))


_BINARY = {
    "Add": jnp.add,
    "Sub": jnp.subtract,
    "Mul": jnp.multiply,
    "Div": jnp.divide,
    "Max": jnp.maximum,
    "Min": jnp.minimum,
    "Pow": jnp.power,
}


def binary(op_kind, a, b):
    """RLX Binary with numpy broadcasting."""
    name = enum_name(op_kind)
    fn = _BINARY.get(name)
    if fn is None:
        raise NotImplementedError(f"unknown binary op {name!r}")
    if name == "Div" and jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.integer):
        # integer Div truncates toward zero (Rust semantics)
        return lax.div(*jnp.broadcast_arrays(a, b))
    return fn(a, b)


@lowering_rule("Binary")
def _binary(op, args, ctx):
    a, b = args
    return ctx.cast_out(binary(op.op, a, b))


_COMPARE = {
    "Eq": jnp.equal,
    "Ne": jnp.not_equal,
    "Lt": jnp.less,
    "Le": jnp.less_equal,
    "Gt": jnp.greater,
    "Ge": jnp.greater_equal,
}


def compare(op_kind, a, b):
    name = enum_name(op_kind)
    fn = _COMPARE.get(name)
    if fn is None:
        raise NotImplementedError(f"unknown compare op {name!r}")
    return fn(a, b)


@lowering_rule("Compare")
def _compare(op, args, ctx):
    # RLX Compare: elementwise, broadcasting, result dtype Bool.
    return ctx.cast_out(compare(op.op, args[0], args[1]))


def truthy(c):
    """RLX condition semantics: a Bool, or any number treated as true iff non-zero."""
    return c if c.dtype == jnp.bool_ else c != 0


@lowering_rule("Where")
def _where(op, args, ctx):
    # Where [cond, on_true, on_false] with broadcasting.
    c, a, b = args
    return ctx.cast_out(jnp.where(truthy(c), a, b))


def cast(x, to_dtype):
    """RLX Cast: float -> int truncates toward zero, bool -> 1/0, real -> C64 with zero
    imaginary part."""
    dt = jnp_dtype(to_dtype)
    if x.dtype == dt:
        return x
    if jnp.issubdtype(x.dtype, jnp.complexfloating) and not jnp.issubdtype(dt, jnp.complexfloating):
        x = jnp.real(x)
    return x.astype(dt)


@lowering_rule("Cast")
def _cast(op, args, ctx):
    return cast(args[0], op.to)


@lowering_rule("Conjugate")
def _conjugate(op, args, ctx):
    # Elementwise complex conjugate (C64 -> C64).
    return jnp.conj(args[0])


@lowering_rule("StopGradient")
def _stop_gradient(op, args, ctx):
    # Identity forward, no gradient.
    return lax.stop_gradient(args[0])


@lowering_rule("ReluBackward")
def _relu_backward(op, args, ctx):
    # dx = dy where x > 0 else 0.
    x, dy = args
    return ctx.cast_out(jnp.where(x > 0, dy, jnp.zeros_like(dy)))


@lowering_rule("ActivationBackward")
def _activation_backward(op, args, ctx):
    # dx = act'(x) * dy with the closed forms of RLX's ActivationBackward.
    x, dy = args
    return ctx.cast_out(activation_derivative(op.kind, x) * dy)


def _chain_operand(ref, inputs, steps):
    # ChainOperand(kind="Input"|"Step", index)
    return inputs[int(ref.index)] if enum_name(ref.kind) == "Input" else steps[int(ref.index)]


@lowering_rule("ElementwiseRegion")
def _elementwise_region(op, args, ctx):
    # A fused chain of elementwise steps; each step reads graph inputs (by index) or
    # earlier steps; the output is the last step. Broadcasting as numpy.
    steps: list = []
    for step in op.chain:
        kind = enum_name(step.kind)
        opnds = [_chain_operand(r, args, steps) for r in getattr(step, "operands", ())]
        if kind == "Activation":
            steps.append(activation(step.attr, opnds[0]))
        elif kind == "Cast":
            steps.append(cast(opnds[0], step.attr))
        elif kind == "Binary":
            steps.append(binary(step.attr, opnds[0], opnds[1]))
        elif kind == "Compare":
            steps.append(compare(step.attr, opnds[0], opnds[1]))
        elif kind == "Where":
            steps.append(jnp.where(truthy(opnds[0]), opnds[1], opnds[2]))
        else:
            raise NotImplementedError(f"unknown ChainStep {kind!r}")
    if not steps:
        raise ValueError("ElementwiseRegion with an empty chain")
    out = steps[-1]
    if ctx.out_shape is not None and None not in ctx.out_shape and out.shape != ctx.out_shape:
        out = jnp.broadcast_to(out, ctx.out_shape)
    return ctx.cast_out(out)
