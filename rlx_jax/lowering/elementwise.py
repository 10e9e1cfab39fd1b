"""Elementwise ops: Activation, Binary, Compare, Where, Cast, Conjugate, StopGradient,
ElementwiseRegion, ReluBackward, ActivationBackward.

Binary/Compare/Where/Cast stay plain ``jax.numpy`` so XLA fuses them (each rule is the
one place of its op's maths); activations and their backward ops belong to the
activations family and go through ``rlx_jax.ops``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .registry import enum_name, jnp_dtype, lowering_rule


#: the activations the IR defines on integers (ops_elementwise._INT_OK), in integer arithmetic
#: (exact; no gradient flows to integers): Relu max(x, 0), Neg -x (wrapping), Abs |x|, Round x
_INTEGER_ACTIVATIONS = {"Relu": lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)), "Neg": jnp.negative,
                        "Abs": jnp.abs, "Round": lambda x: x}


def activation(kind, x):
    """RLX activation ``kind`` through the activations family (``rlx_jax.ops.activation``:
    the one place of the 17 forward forms and their closed-form derivatives); integer
    inputs, which the IR allows for Relu, Neg, Abs and Round, in integer arithmetic."""
    from .nn import fused

    if jnp.issubdtype(x.dtype, jnp.integer) and enum_name(kind) in _INTEGER_ACTIVATIONS:
        return _INTEGER_ACTIVATIONS[enum_name(kind)](x)
    return fused("activation")(kind, x)


@lowering_rule(ir.Activation)
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
    if name == "Pow" and jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.integer):
        return _integer_pow(a, b)
    return fn(a, b)


def _integer_pow(a, b):
    """a ** b of integers, truncated toward zero as integer Div is: 1 / a^|b| for b < 0,
    which is 0 but for a = 1 (1) and a = -1 (+-1 by the parity of b); a = 0 with b < 0 gives
    0. jnp.power leaves negative integer exponents undefined (garbage values)."""
    a, b = jnp.broadcast_arrays(a, b)
    dtype = jnp.result_type(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    zero, one = jnp.zeros((), dtype), jnp.ones((), dtype)
    positive = jnp.power(a, jnp.maximum(b, zero))
    if not jnp.issubdtype(dtype, jnp.signedinteger):
        return positive
    minus_one = jnp.where(b % 2 == 0, one, -one)
    negative = jnp.where(a == one, one, jnp.where(a == -one, minus_one, zero))
    return jnp.where(b < 0, negative, positive)


def swiglu_operands(ctx, node, args):
    """(gate, up) when graph node ``node`` (its lowered operands ``args``) is the Binary
    ``Mul(Activation Silu(gate), up)`` (either order) over one shape and one floating dtype,
    else None: such a product lowers to ``ops.swiglu``, whose reverse mode is one fused
    kernel (and a MatMul of it to ``ops.swiglu_linear``, ``lowering/linalg.py``). The Silu
    node keeps its own lowering; left without other consumers, XLA drops it."""
    if ctx.graph is None or node is None or not isinstance(node.op, ir.Binary) or enum_name(node.op.op) != "Mul":
        return None
    for k, node_id in enumerate(node.inputs):
        src = ctx.graph.node(node_id)
        if not (isinstance(src.op, ir.Activation) and enum_name(src.op.kind) == "Silu"):
            continue
        gate, up = ctx.env.get(src.inputs[0]), args[1 - k]
        if (gate is not None and gate.shape == up.shape == args[k].shape and gate.dtype == up.dtype == args[k].dtype
                and jnp.issubdtype(gate.dtype, jnp.floating)):
            return gate, up
    return None


@lowering_rule(ir.Binary)
def _binary(op, args, ctx):
    gated = swiglu_operands(ctx, ctx.node, args)
    if gated is not None:
        from .nn import fused

        return ctx.cast_out(fused("swiglu")(*gated))
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


@lowering_rule(ir.Compare)
def _compare(op, args, ctx):
    # RLX Compare: elementwise, broadcasting, result dtype Bool.
    return ctx.cast_out(compare(op.op, args[0], args[1]))


def truthy(c):
    """RLX condition semantics: a Bool, or any number treated as true iff non-zero."""
    return c if c.dtype == jnp.bool_ else c != 0


@lowering_rule(ir.Where)
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


@lowering_rule(ir.Cast)
def _cast(op, args, ctx):
    return cast(args[0], op.to)


@lowering_rule(ir.Conjugate)
def _conjugate(op, args, ctx):
    # Elementwise complex conjugate (C64 -> C64).
    return jnp.conj(args[0])


@lowering_rule(ir.StopGradient)
def _stop_gradient(op, args, ctx):
    # Identity forward, no gradient.
    return lax.stop_gradient(args[0])


@lowering_rule(ir.ReluBackward)
def _relu_backward(op, args, ctx):
    # [x, dy] -> dy where x > 0 else 0 (rlx_jax.ops.relu_backward).
    from .nn import fused

    x, dy = args
    return ctx.cast_out(fused("relu_backward")(x, dy))


@lowering_rule(ir.ActivationBackward)
def _activation_backward(op, args, ctx):
    # [x, dy] -> act'(x) * dy, closed forms of the activations family.
    from .nn import fused

    x, dy = args
    return ctx.cast_out(fused("activation_backward")(op.kind, x, dy))


def _chain_operand(ref, inputs, steps):
    # ChainOperand(kind="Input"|"Step", index)
    return inputs[int(ref.index)] if enum_name(ref.kind) == "Input" else steps[int(ref.index)]


def _region_input(x, i, op, out_shape):
    """Region input ``i`` as RLX's kernels read it at flat output index gid: element 0 when
    bit i of ``scalar_input_mask`` is set, ``x[gid % input_modulus[i]]`` when that is set
    (non-zero), else ``x[gid]``. An input of another size with neither set (which RLX's
    kernels would read out of bounds) broadcasts: numpy's rule when its shape is a trailing
    suffix of the output's, else a flat tiling."""
    if out_shape is None or None in out_shape:
        return x
    flat = x.reshape(-1)
    if (op.scalar_input_mask >> i) & 1:
        if x.size == 0:
            raise ValueError(f"ElementwiseRegion scalar input {i} is empty")
        return jnp.broadcast_to(flat[0], tuple(out_shape))
    modulus = op.input_modulus[i] if i < len(op.input_modulus) else 0
    if modulus:
        if modulus > x.size:
            raise ValueError(f"ElementwiseRegion input {i}: input_modulus {modulus} exceeds its {x.size} elements")
        total = math.prod(int(d) for d in out_shape)
        return jnp.take(flat, jnp.arange(total) % modulus).reshape(tuple(out_shape))
    if x.shape == tuple(out_shape):
        return x
    try:
        jnp.broadcast_shapes(x.shape, tuple(out_shape))
        return x
    except ValueError:
        total = 1
        for d in out_shape:
            total *= int(d)
        if x.size == 0 or total % x.size:
            raise ValueError(f"ElementwiseRegion input of shape {x.shape} does not tile the "
                             f"output {tuple(out_shape)}") from None
        return jnp.tile(x.reshape(-1), total // x.size).reshape(out_shape)


@lowering_rule(ir.ElementwiseRegion)
def _elementwise_region(op, args, ctx):
    # A fused chain of elementwise steps; each step reads region inputs (by index) or
    # earlier steps; the output is the last step. Inputs broadcast as RLX's modulo rule.
    args = [_region_input(a, i, op, ctx.out_shape) for i, a in enumerate(args)]
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
