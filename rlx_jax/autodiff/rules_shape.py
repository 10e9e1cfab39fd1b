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
        return [E.expand_like(g, E.mul_s(g, dyk, 1.0 / cnt), x)]
    yk = E.reshape(g, node.id, kd)
    if op in (ReduceOp.Max, ReduceOp.Min):
        # every element equal to the extreme receives the gradient (RLX semantics)
        hit = E.cmp(g, CmpOp.Eq, x, yk)
        return [E.where(g, hit, dyk, E.scalar(g, 0, E.dtype(g, dy)))]
    if op is ReduceOp.Prod:
        return [E.div(g, E.mul(g, dyk, yk), x)]
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
