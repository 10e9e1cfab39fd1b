"""Graph VJP rules: activations, binary arithmetic, select, casts, complex helpers,
the fused elementwise region.

Inside the sweep complex values follow JAX's cotangent convention (a cotangent is
transposed through holomorphic ops without conjugation; ``|z|^2`` gives ``2 g conj(z)``);
``grad_with_loss`` converts the seed and the complex gradients to RLX's convention at the
boundary (``reverse.py``).
"""

from __future__ import annotations

from rlx_jax.ir.op import ActivationKind, BinaryOp, CmpOp
from rlx_jax.ir.ops_backward import ActivationBackward, ComplexNormSqBackward, ReluBackward
from rlx_jax.ir.ops_elementwise import Conjugate
from rlx_jax import ir

from . import emit as E
from .expansion import vjp_via_expansion
from .table import vjp_rule


@vjp_rule(ir.Activation)
def _activation(g, node, dy):
    (x,) = node.inputs
    if node.op.kind is ActivationKind.Relu:
        return [g.add_node(ReluBackward(), (x, dy))]
    return [g.add_node(ActivationBackward(kind=node.op.kind), (x, dy))]


@vjp_rule(ir.Binary)
def _binary(g, node, dy):
    a, b = node.inputs
    op = node.op.op
    if op is BinaryOp.Add:
        return [dy, dy]
    if op is BinaryOp.Sub:
        return [dy, E.neg(g, dy)]
    if op is BinaryOp.Mul:
        return [E.mul(g, dy, b), E.mul(g, dy, a)]
    if op is BinaryOp.Div:
        da = E.div(g, dy, b)
        return [da, E.neg(g, E.mul(g, da, node.id))]
    if op in (BinaryOp.Max, BinaryOp.Min):
        # RLX's rule: a takes all of dy where a == y (ties included), b takes the rest.
        # (jax.grad of the lowered jnp.maximum / minimum splits ties 0.5 / 0.5.)
        a_wins = E.cmp(g, CmpOp.Eq, a, node.id)
        zero = E.scalar(g, 0, E.dtype(g, dy))
        return [E.where(g, a_wins, dy, zero), E.where(g, a_wins, zero, dy)]
    if op is BinaryOp.Pow:
        dt = E.dtype(g, dy)
        zero, one = E.scalar(g, 0, dt), E.scalar(g, 1, dt)
        # d/da = b * a^(b-1) (0 where b == 0); d/db = y * log(a) (a == 0 -> log 1)
        da_f = E.mul(g, b, E.pow_(g, a, E.sub(g, b, one)))
        da_f = E.where(g, E.cmp(g, CmpOp.Eq, b, zero), zero, da_f)
        safe_a = E.where(g, E.cmp(g, CmpOp.Eq, a, zero), one, a)
        db_f = E.mul(g, node.id, E.act(g, ActivationKind.Log, safe_a))
        return [E.mul(g, dy, da_f), E.mul(g, dy, db_f)]
    raise NotImplementedError(op)


@vjp_rule(ir.Where)
def _where(g, node, dy):
    c, a, b = node.inputs
    zero = E.scalar(g, 0, E.dtype(g, dy))
    return [None, E.where(g, c, dy, zero), E.where(g, c, zero, dy)]


@vjp_rule(ir.Cast, ir.Quantize, ir.Dequantize)
def _identity_like(g, node, dy):
    # Cast: the gradient is cast back (by the sweep); Quantize/Dequantize: straight-through.
    return [dy]


@vjp_rule(ir.ComplexNormSq)
def _complex_norm_sq(g, node, dy):
    # RLX's ComplexNormSqBackward gives the Wirtinger g * z; JAX's cotangent is its
    # conjugate times two: 2 g conj(z).
    (z,) = node.inputs
    w = g.add_node(ComplexNormSqBackward(), (z, E.mul_s(g, dy, 2.0)))
    return [g.add_node(Conjugate(), (w,))]


@vjp_rule(ir.Conjugate)
def _conjugate(g, node, dy):
    return [g.add_node(Conjugate(), (dy,))]


def emit_region(t, op, ins):
    """Primitive expansion of an ElementwiseRegion chain over region inputs ``ins``."""
    from rlx_jax.ir import DType

    steps = []

    def operand(ref):
        return ins[ref.index] if ref.kind == "Input" else steps[ref.index]

    for step in op.chain:
        args = [operand(r) for r in step.operands]
        if step.kind == "Activation":
            steps.append(E.act(t, step.attr, args[0]))
        elif step.kind == "Cast":
            steps.append(E.cast(t, args[0], DType.from_any(step.attr)))
        elif step.kind == "Binary":
            steps.append(E.binary(t, BinaryOp.parse(step.attr), *args))
        elif step.kind == "Compare":
            steps.append(E.cmp(t, step.attr, *args))
        else:
            steps.append(E.where(t, *args))
    return steps[-1]


def region_operands(t, op, ins, out_dims):
    """The region inputs as the lowering reads them (``lowering/elementwise.py``,
    ``_region_input``): element 0 of an input marked scalar, the first ``input_modulus[i]``
    elements tiled flat over the output where that is set and the shape is not the
    output's; others as they are (the chain broadcasts them)."""
    if not all(isinstance(d, int) for d in out_dims):
        return list(ins)
    from rlx_jax.ir.ops_shape import Narrow

    total = E.numel(out_dims)
    out = []
    for i, x in enumerate(ins):
        ds = E.dims(t, x)
        modulus = op.input_modulus[i] if i < len(op.input_modulus) else 0
        scalar = (op.scalar_input_mask >> i) & 1
        if not all(isinstance(d, int) for d in ds) or not (scalar or (modulus and tuple(ds) != tuple(out_dims))):
            out.append(x)
            continue
        flat = E.reshape(t, x, (E.numel(ds),))
        if scalar:
            out.append(E.reshape(t, t.add_node(Narrow(axis=0, start=0, len=1), (flat,)), ()))
            continue
        if modulus < E.numel(ds):
            flat = t.add_node(Narrow(axis=0, start=0, len=modulus), (flat,))
        reps = -(-total // modulus)
        tiled = E.reshape(t, E.expand(t, E.reshape(t, flat, (1, modulus)), (reps, modulus)), (reps * modulus,))
        if reps * modulus != total:
            tiled = t.add_node(Narrow(axis=0, start=0, len=total), (tiled,))
        out.append(E.reshape(t, tiled, tuple(out_dims)))
    return out


@vjp_rule(ir.ElementwiseRegion)
def _region(g, node, dy):
    def build(t, ins):
        y = emit_region(t, node.op, region_operands(t, node.op, ins, node.shape.dims))
        return E.expand(t, y, node.shape.dims)

    return vjp_via_expansion(g, node, dy, build)
