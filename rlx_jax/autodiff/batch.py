"""``vmap(graph, batched_input_names, batch_size)``: the graph rewritten with a leading
batch axis of size ``batch_size`` on the named Inputs / Params.

Every node that depends on a batched leaf gets the leading axis; attributes that name
axes move by one. Ops fall into three groups:

* rank-polymorphic ops (elementwise, per-channel quantize / dequantize, reductions,
  softmax, cumsum, layer / RMS norm, shape ops, matmul, gather on the table): the batch
  axis is threaded through, batched operands of lower rank are reshaped to
  ``[B, 1.., dims]`` so numpy broadcasting lines up;
* ops whose axis 0 is already a batch of independent rows (conv, pool, group /
  batch norm, layer norm 2d, attention, cross-entropy, resize, their backward ops):
  the new axis is merged into axis 0 and split again afterwards;
* anything else (or an op with a batched operand where the first two groups need an
  unbatched one): the op is applied per batch element and the results stacked (exact;
  the graph grows with ``batch_size``).

Outputs that do not depend on a batched leaf are broadcast to the batch, as
``jax.vmap`` with ``out_axes=0`` does.
"""

from __future__ import annotations

import dataclasses

from rlx_jax import ir
from rlx_jax.ir import Graph, GraphError, Shape
from rlx_jax.ir.ops_shape import Concat, Narrow

from . import emit as E

_ELEMENTWISE = {ir.Activation, ir.Binary, ir.Compare, ir.Where, ir.Cast, ir.ComplexNormSq, ir.Conjugate,
                ir.StopGradient, ir.ReluBackward, ir.ActivationBackward, ir.ComplexNormSqBackward}
_AXIS_OPS = {ir.Softmax, ir.Cumsum, ir.CumsumBackward}
# elementwise with per-channel constants along ``axis`` (None: per-tensor)
_CHANNEL_OPS = {ir.Quantize, ir.Dequantize}
# ops whose axis 0 is a batch of independent rows, with the inputs that carry it
_ROWS = {
    ir.Conv: (0,), ir.Pool: (0,), ir.GroupNorm: (0,), ir.LayerNorm2d: (0,), ir.ResizeNearest2x: (0,),
    ir.BatchNormInference: (0,), ir.SoftmaxCrossEntropyWithLogits: (0, 1),
    ir.SoftmaxCrossEntropyBackward: (0, 1, 2), ir.MaxPool2dBackward: (0, 1),
    ir.Conv2dBackwardInput: (0,), ir.GroupNormBackwardInput: (0, 3),
    ir.BatchNormInferenceBackwardInput: (0, 4), ir.ConvTranspose2d: (0,),
}


def vmap(graph: Graph, batched_input_names, batch_size: int) -> Graph:
    if not isinstance(graph, Graph):
        raise TypeError(f"vmap expects an rlx_jax.Graph, got {type(graph).__name__}")
    if isinstance(batched_input_names, str):
        batched_input_names = [batched_input_names]
    names = set(batched_input_names)
    known = {n.op.name for n in graph.nodes if type(n.op) in (ir.Input, ir.Param)}
    missing = sorted(names - known)
    if missing:
        raise GraphError(f"vmap: graph {graph.name!r} has no input or param named {missing}")
    bsz = int(batch_size)
    if bsz <= 0:
        raise GraphError(f"vmap: batch_size must be positive, got {batch_size}")
    g = Graph(f"{graph.name}_vmap")
    m, batched = {}, set()
    for n in graph.nodes:
        kind = type(n.op)
        if kind in (ir.Input, ir.Param):
            if n.op.name in names:
                s = Shape((bsz,) + tuple(n.shape.dims), n.shape.dtype)
                m[n.id] = g.add_node(n.op, (), s, n.name)
                batched.add(n.id)
            else:
                m[n.id] = g.add_node(n.op, (), n.shape, n.name)
            continue
        read = sorted(_body_params(n.op) & names)
        if read:
            raise GraphError(f"vmap: node %{n.id} {kind.__name__}: its body reads batched Param(s) {read} by "
                             "name, which vmap cannot batch; pass them to the node as operands instead")
        ins = [m[i] for i in n.inputs]
        flags = [i in batched for i in n.inputs]
        if not any(flags) or kind == ir.Constant:
            m[n.id] = g.add_node(n.op, tuple(ins), n.shape, n.name)
            continue
        m[n.id] = _batch_node(g, n, ins, flags, bsz, graph)
        batched.add(n.id)
    outs = []
    for o in graph.outputs:
        if o in batched:
            outs.append(m[o])
        else:
            s = graph.node(o).shape
            outs.append(E.expand(g, E.reshape(g, m[o], (1,) + tuple(s.dims)), (bsz,) + tuple(s.dims)))
    g.set_outputs(outs)
    return g


def _body_params(op) -> set:
    """Names of the Params that ``op``'s bodies (graph-valued attributes: Scan, If, While,
    CustomFn...) read, nested bodies included. They bind to the outer graph's Params of
    the same name when lowered."""
    out = set()
    for f in dataclasses.fields(op):
        body = getattr(op, f.name)
        if isinstance(body, Graph):
            for n in body.nodes:
                if type(n.op) is ir.Param:
                    out.add(n.op.name)
                out |= _body_params(n.op)
    return out


def _lift(g, x, rank, bsz):
    """A batched operand ``[B, dims]`` reshaped to ``[B, 1.., dims]`` of rank ``rank + 1``."""
    ds = E.dims(g, x)
    r = len(ds) - 1
    if r >= rank:
        return x
    return E.reshape(g, x, (bsz,) + (1,) * (rank - r) + tuple(ds[1:]))


def _bcast(g, x, bsz):
    """An unbatched operand broadcast to ``[B, dims]``."""
    ds = E.dims(g, x)
    return E.expand(g, E.reshape(g, x, (1,) + tuple(ds)), (bsz,) + tuple(ds))


def _batch_node(g, n, ins, flags, bsz, src):
    op = n.op
    kind = type(op)
    out_rank = n.shape.rank
    try:
        if kind in _ELEMENTWISE or kind == ir.MatMul:
            rank = max(src.node(i).shape.rank for i in n.inputs)
            ins2 = [_lift(g, x, rank, bsz) if f else x for x, f in zip(ins, flags)]
            return g.add_node(op, tuple(ins2))
        if kind == ir.Reduce and flags[0]:
            return g.add_node(type(op)(op=op.op, axes=tuple(a + 1 for a in op.axes), keep_dim=op.keep_dim),
                              (ins[0],))
        if kind in _AXIS_OPS and flags[0]:
            ax = op.axis if op.axis < 0 else op.axis + 1
            return g.add_node(_replace(op, axis=ax), (ins[0],))
        if kind in _CHANNEL_OPS:
            ax = op.axis if op.axis is None or op.axis < 0 else op.axis + 1
            return g.add_node(_replace(op, axis=ax), (ins[0],))
        if kind in (ir.LayerNorm, ir.RmsNorm) and flags[0] and not any(flags[1:]):
            ax = op.axis if op.axis < 0 else op.axis + 1
            return g.add_node(_replace(op, axis=ax), tuple(ins))
        if kind == ir.Reshape and flags[0]:
            return g.add_node(_replace(op, new_shape=(bsz,) + tuple(op.new_shape)), (ins[0],))
        if kind == ir.Transpose and flags[0]:
            return g.add_node(_replace(op, perm=(0,) + tuple(p + 1 for p in op.perm)), (ins[0],))
        if kind == ir.Narrow and flags[0]:
            return g.add_node(_replace(op, axis=op.axis + 1), (ins[0],))
        if kind == ir.Concat:
            ins2 = [x if f else _bcast(g, x, bsz) for x, f in zip(ins, flags)]
            return g.add_node(_replace(op, axis=op.axis + 1), tuple(ins2))
        if kind == ir.Expand and flags[0]:
            x = _lift(g, ins[0], len(op.target_shape), bsz)
            return g.add_node(_replace(op, target_shape=(bsz,) + tuple(op.target_shape)), (x,))
        if kind == ir.Gather and flags[0] and not flags[1] and op.axis == 0:
            return g.take(ins[0], ins[1], 1)  # per-sample embedding lookup
        if kind in _ROWS or kind == ir.Attention:
            return _merge_rows(g, n, ins, flags, bsz, src)
    except _Fallback:
        pass
    return _unroll(g, n, ins, flags, bsz)


class _Fallback(Exception):
    pass


def _replace(op, **kw):
    import dataclasses

    return dataclasses.replace(op, **kw)


def _merge_rows(g, n, ins, flags, bsz, src):
    """Merge the batch into axis 0 of the row-carrying operands, run, split again."""
    kind = type(n.op)
    rows = _ROWS.get(kind)
    if kind == ir.Attention:   # every input carries rows but the per-head sinks [H], last
        rows = tuple(range(len(ins) - bool(n.op.sinks)))
        if n.op.mask_kind.kind == "Bias":
            raise _Fallback()
    for i, f in enumerate(flags):
        if f and i not in rows:
            raise _Fallback()
    ins2 = list(ins)
    for i in rows:
        x = ins[i] if flags[i] else _bcast(g, ins[i], bsz)
        ds = E.dims(g, x)
        if not E.is_static(ds):
            raise _Fallback()
        ins2[i] = E.reshape(g, x, (bsz * ds[1],) + tuple(ds[2:]))
    shape = None
    if kind == ir.Conv2dBackwardInput:
        s = n.shape
        shape = Shape((bsz * s.dims[0],) + tuple(s.dims[1:]), s.dtype)
    y = g.add_node(n.op, tuple(ins2), shape)
    s = n.shape
    return E.reshape(g, y, (bsz,) + tuple(s.dims))


def _unroll(g, n, ins, flags, bsz):
    """Apply the op per batch element and stack the results (any op, static shapes)."""
    parts = []
    for b in range(bsz):
        args = []
        for x, f in zip(ins, flags):
            if f:
                ds = E.dims(g, x)
                sl = g.add_node(Narrow(axis=0, start=b, len=1), (x,))
                args.append(E.reshape(g, sl, tuple(ds[1:])))
            else:
                args.append(x)
        y = g.add_node(n.op, tuple(args), n.shape)
        parts.append(E.reshape(g, y, (1,) + tuple(n.shape.dims)))
    return g.add_node(Concat(axis=0), tuple(parts))
