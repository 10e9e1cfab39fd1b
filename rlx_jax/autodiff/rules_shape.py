"""Graph VJP rules: shape ops, reductions, softmax, cumsum, gather and the softmax
cross-entropy loss."""

from __future__ import annotations

from rlx_jax.ir import DType, GraphError
from rlx_jax.ir.op import CmpOp, ReduceOp
from rlx_jax.ir.ops_backward import CumsumBackward, GatherBackward, SoftmaxCrossEntropyBackward
from rlx_jax.ir.ops_linalg import ScatterAdd
from rlx_jax.ir.ops_shape import Concat, Narrow
from rlx_jax import ir

from . import emit as E
from .table import vjp_rule


@vjp_rule(ir.Reshape)
def _reshape(g, node, dy):
    (x,) = node.inputs
    return [E.reshape(g, dy, E.dims(g, x))]


@vjp_rule(ir.Transpose)
def _transpose(g, node, dy):
    return [E.transpose(g, dy, E.inverse_perm(node.op.perm))]


@vjp_rule(ir.Expand)
def _expand(g, node, dy):
    return [dy]  # the sweep sums over the broadcast axes


@vjp_rule(ir.Narrow)
def _narrow(g, node, dy):
    """Pad dy with zeros back to the input's extent along ``axis``."""
    (x,) = node.inputs
    xs = E.shape(g, x)
    ax, start, n = node.op.axis, node.op.start, node.op.len
    full = xs.dims[ax]
    if not isinstance(full, int):
        raise GraphError(f"node %{node.id} Narrow: reverse mode needs a static dim on axis {ax}")
    parts = []
    if start:
        parts.append(E.zeros(g, _sh(xs, ax, start)))
    parts.append(dy)
    rest = full - start - n
    if rest:
        parts.append(E.zeros(g, _sh(xs, ax, rest)))
    if len(parts) == 1:
        return [dy]
    return [g.add_node(Concat(axis=ax), tuple(parts))]


def _sh(s, ax, n):
    from rlx_jax.ir import Shape

    return Shape(s.dims[:ax] + (n,) + s.dims[ax + 1:], s.dtype)


@vjp_rule(ir.Concat)
def _concat(g, node, dy):
    ax = node.op.axis
    out, off = [], 0
    for i in node.inputs:
        n = E.dims(g, i)[ax]
        if not isinstance(n, int):
            raise GraphError(f"node %{node.id} Concat: reverse mode needs static dims on axis {ax}")
        out.append(g.add_node(Narrow(axis=ax, start=off, len=n), (dy,)))
        off += n
    return out


@vjp_rule(ir.ResizeNearest2x)
def _resize(g, node, dy):
    n, c, h, w = E.dims(g, node.inputs[0])
    r = E.reshape(g, dy, (n, c, h, 2, w, 2))
    return [E.sum_(g, r, (3, 5))]


def _keep_dims(xs, axes):
    return tuple(1 if i in axes else d for i, d in enumerate(xs.dims))


def _prod_derivative(g, x, yk, axes):
    """d prod(x) / d x_i = prod_{j != i} x_j over the reduced axes, without dividing by a
    zero. With z the count of zeros in x_i's slice, x' = x with its zeros replaced by 1 and
    rest = prod(x') (the product of the slice's non-zero elements):

    * at a non-zero x_i: y / x' (exact when z = 0, and 0 = y when z > 0);
    * at a zero x_i: rest when it is the slice's only zero (z = 1); rest * x_j when one
      other zero x_j remains (z = 2), written x_j = (sum of the slice's zeros) - x_i, which
      is 0 but carries the derivative rest towards x_j (the second derivative between the
      two zeros); 0 when z > 2.

    Each case is the polynomial prod_{j != i} x_j itself where z <= 2, so the derivatives of
    every order are exact there; where z > 2 the first and second are (both 0), and the
    third and later between zeros come out 0 (docs/API.md, graph autodiff conventions)."""
    dt = E.dtype(g, x)
    zero = E.cmp(g, CmpOp.Eq, x, E.scalar(g, 0, dt))
    safe = E.where(g, zero, E.scalar(g, 1, dt), x)
    z = E.sum_(g, E.cast(g, zero, dt), axes, keep_dim=True)
    # kept-dim [.., 1, ..] slice values, broadcast against x by Where / Mul / Sub
    rest = E.reduce(g, safe, ReduceOp.Prod, axes, keep_dim=True)
    zeros_sum = E.sum_(g, E.where(g, zero, x, E.scalar(g, 0, dt)), axes, keep_dim=True)
    other_zero = E.sub(g, zeros_sum, x)
    lone = E.cmp(g, CmpOp.Eq, z, E.scalar(g, 1, dt))
    pair = E.cmp(g, CmpOp.Eq, z, E.scalar(g, 2, dt))
    at_zero = E.where(g, lone, rest, E.where(g, pair, E.mul(g, rest, other_zero), E.scalar(g, 0, dt)))
    return E.where(g, zero, at_zero, E.div(g, yk, safe))


@vjp_rule(ir.Reduce)
def _reduce(g, node, dy):
    (x,) = node.inputs
    xs = E.shape(g, x)
    axes = tuple(node.op.axes)
    kd = _keep_dims(xs, axes)
    dyk = E.reshape(g, dy, kd)
    op = node.op.op
    if op is ReduceOp.Sum:
        return [E.expand_like(g, dyk, x)]
    if op is ReduceOp.Mean:
        cnt = E.numel([xs.dims[a] for a in axes])
        if cnt is None:   # a dynamic reduced dim: count the elements in the graph
            ones = E.where(g, E.scalar(g, True, DType.Bool), E.scalar(g, 1, xs.dtype), x)
            return [E.expand_like(g, E.div(g, dyk, E.sum_(g, ones, axes, keep_dim=True)), x)]
        # no element reduced: x is empty and so is its gradient
        return [E.expand_like(g, E.mul_s(g, dyk, 1.0 / cnt if cnt else 0.0), x)]
    yk = E.reshape(g, node.id, kd)
    if op in (ReduceOp.Max, ReduceOp.Min):
        # every element equal to the extreme receives the gradient (RLX semantics)
        hit = E.cmp(g, CmpOp.Eq, x, yk)
        return [E.where(g, hit, dyk, E.scalar(g, 0, E.dtype(g, dy)))]
    if op is ReduceOp.Prod:
        return [E.mul(g, dyk, _prod_derivative(g, x, yk, axes))]
    raise NotImplementedError(op)


@vjp_rule(ir.Softmax)
def _softmax(g, node, dy):
    y = node.id
    ax = E.norm_axis(node.op.axis, E.shape(g, y).rank)
    s = E.sum_(g, E.mul(g, dy, y), (ax,), keep_dim=True)
    return [E.mul(g, y, E.sub(g, dy, s))]


@vjp_rule(ir.Cumsum)
def _cumsum(g, node, dy):
    return [g.add_node(CumsumBackward(axis=node.op.axis, exclusive=node.op.exclusive), (dy,))]


@vjp_rule(ir.Gather)
def _gather(g, node, dy):
    table, idx = node.inputs
    ts, ids = E.shape(g, table), E.shape(g, idx)
    ax = node.op.axis
    if ax == 0 and ids.rank == 1:
        return [g.add_node(ScatterAdd(), (dy, idx), ts), None]
    return [g.add_node(GatherBackward(axis=ax), (dy, idx), ts), None]


@vjp_rule(ir.SoftmaxCrossEntropyWithLogits)
def _xent(g, node, dy):
    logits, labels = node.inputs
    return [g.add_node(SoftmaxCrossEntropyBackward(), (logits, labels, dy)), None]
