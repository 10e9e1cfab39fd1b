"""Prepare passes run before differentiation (RLX's ``prepare_graph_for_ad``):

* ``CustomFn`` without a ``vjp_body`` is inlined (its ``fwd_body`` spliced in);
* ``If`` becomes ``Where(pred, then, else)`` with both branches evaluated (forward mode;
  reverse mode keeps the ``If``, its branches' Params made operands, and differentiates
  the taken branch only: ``rules_control``);
* ``While`` with ``max_iterations`` is unrolled (each step masked by "still running");
* fused ops are unfused into the primitives they stand for (:mod:`.unfuse`, the
  decomposition their lowering evaluates too);
* a ``Scan`` that keeps only its final carry is rewritten to save its trajectory
  (its last row is the final carry), so that its gradient can be read off the rows;
  its broadcast operands become per-step xs (RLX's ScanBackward has none);
* the decomposed splat pair ``GaussianSplatRasterize(GaussianSplatPrepare(scene...,
  meta), meta)`` becomes one ``GaussianSplatRender(scene..., meta)`` (the same image:
  Rasterize re-bins the per-Gaussian section Prepare writes), whose VJP is the fused
  backward kernel.

:func:`prepare` returns the new graph and the map old node id -> new node id.
"""

from __future__ import annotations

from rlx_jax import ir
from rlx_jax.ir import DType, Graph, GraphError
from rlx_jax.ir.ops_leaf import Input, Param
from rlx_jax.ir.ops_shape import Narrow

from . import emit as E
from .unfuse import is_fused, unfuse_node

_SPECIAL = ("primal_output", "d_output")


def inline(g, body, args, named=None) -> list:
    """Splice ``body`` into ``g``: its Inputs bind to ``args`` positionally (node order)
    except names in ``named``; its Params bind to ``g``'s Params of the same name.
    Returns the ids (in ``g``) of the body's outputs."""
    named = named or {}
    m = {}
    pos = 0
    for n in body.nodes:
        if isinstance(n.op, Input):
            if n.op.name in named:
                m[n.id] = named[n.op.name]
            else:
                if pos >= len(args):
                    raise GraphError(f"body {body.name!r}: more Inputs than arguments")
                m[n.id] = args[pos]
                pos += 1
        elif isinstance(n.op, Param):
            pid = g.leaf_id(n.op.name)
            m[n.id] = pid if pid is not None else g.add_node(n.op, (), n.shape, n.name)
        else:
            m[n.id] = g.add_node(n.op, tuple(m[i] for i in n.inputs), n.shape)
    return [m[o] for o in body.outputs]


def _land(g, a, b):
    return E.where(g, a, b, E.scalar(g, False, DType.Bool))


# -- the pass ---------------------------------------------------------------------------

def _all_true(g, c):
    """Bool tensor -> Bool scalar: every element true (RLX's While condition)."""
    n = E.numel(E.dims(g, c))
    if n == 1:
        return E.reshape(g, c, ())
    from rlx_jax.ir.op import ReduceOp

    as_f = E.cast(g, c, DType.F32)
    low = E.reduce(g, as_f, ReduceOp.Min, tuple(range(len(E.dims(g, c)))))
    return E.reshape(g, E.cmp(g, "Ne", low, E.scalar(g, 0, DType.F32)), ())


def _while(g, node, ins, ready):
    op = node.op
    cond, body = ready(op.cond), ready(op.body)
    if op.max_iterations is None:
        raise GraphError(f"node %{node.id} While: reverse mode needs max_iterations to unroll the loop")
    vals = list(ins)
    # the body's input at the last step that ran: a masked step (the loop has exited) runs
    # the body on it again, not on the final carry, which may lie outside the body's domain
    # (the value that ended the loop), where its derivative, though multiplied by the
    # mask's 0, would be inf or NaN and poison the gradient
    last = list(ins)
    running = E.scalar(g, True, DType.Bool)
    for _ in range(int(op.max_iterations)):
        (c,) = inline(g, cond, vals)
        c = E.cmp(g, "Ne", c, E.scalar(g, 0, E.dtype(g, c))) if E.dtype(g, c) != DType.Bool else c
        c = _all_true(g, c)
        running = _land(g, running, c)
        last = [E.where(g, running, v, l) for v, l in zip(vals, last)]
        nxt = inline(g, body, last)
        vals = [E.where(g, running, n, v) for n, v in zip(nxt, vals)]
        vals = [E.cast(g, v, E.dtype(g, ins[k])) for k, v in enumerate(vals)]
    return vals[0]


def body_params(*bodies) -> list:
    """[(name, shape)] of the Params the bodies read (first seen first)."""
    out = {}
    for body in bodies:
        for n in body.nodes:
            if isinstance(n.op, Param):
                out.setdefault(n.op.name, n.shape)
    return list(out.items())


def _params_as_inputs(body, params=None):
    """(body with each Param of ``params`` (default: the body's own, ``body_params``) as
    a trailing Input, in that order, [(name, shape)] of them). A body's Params bind to
    the outer graph's Params of the same name; as Inputs they become operands of the
    node (Scan, If), whose VJP differentiates its bodies' Inputs only, so that the
    gradient reaches them. A name the body does not read gets an unused Input."""
    params = body_params(body) if params is None else params
    if not params:
        return body, []
    b = Graph(body.name)
    m = {}
    for n in body.nodes:  # Inputs keep their positions (id order) ahead of the new ones
        if isinstance(n.op, Input):
            m[n.id] = b.add_node(n.op, (), n.shape, n.name)
    by_name = {name: b.add_node(Input(name=f"param:{name}"), (), shape) for name, shape in params}
    for n in body.nodes:
        if isinstance(n.op, Param):
            m[n.id] = by_name[n.op.name]
        elif n.id not in m:
            m[n.id] = b.add_node(n.op, tuple(m[i] for i in n.inputs), n.shape, n.name)
    b.set_outputs([m[o] for o in body.outputs])
    return b, params


def _outer_params(g, params):
    """Ids in ``g`` of the Params named in ``params`` [(name, shape)], added where missing."""
    ids = [g.leaf_id(name) for name, _ in params]
    return [g.add_node(Param(name=name), (), shape) if pid is None else pid for pid, (name, shape) in zip(ids, params)]


def _ready(body, unroll_scans, keep_ifs):
    """``body`` prepared as the graph around it is, before it is inlined or kept: nested
    control flow is rewritten at every level, so a Param read deep inside (an If in a Scan
    body, a Scan in an If branch) ends up a Param of ``body`` itself, which inlining binds
    by name and :func:`_params_as_inputs` makes an operand. Without it such a Param got no
    gradient."""
    return prepare(body, unroll_scans=unroll_scans, keep_ifs=keep_ifs)[0] if needs_prepare(body) else body


def _if(g, node, ins, ready):
    """An If kept as an If for reverse mode (its VJP differentiates the taken branch only,
    ``rules_control``), with the Params its branches read as trailing operands."""
    then_b, else_b = ready(node.op.then_branch), ready(node.op.else_branch)
    params = body_params(then_b, else_b)
    then_b, _ = _params_as_inputs(then_b, params)
    else_b, _ = _params_as_inputs(else_b, params)
    changed = params or then_b is not node.op.then_branch or else_b is not node.op.else_branch
    op = ir.If(then_branch=then_b, else_branch=else_b) if changed else node.op
    return g.add_node(op, (*ins, *_outer_params(g, params)), node.shape)


def _scan(g, node, ins, ready):
    from rlx_jax.ir.ops_control import Scan

    op = node.op
    prepared = ready(op.body)
    body, read = _params_as_inputs(prepared)
    nb = op.num_bcast
    params = _outer_params(g, read)
    if nb or params:
        # broadcast operands (and the body's Params, now trailing Inputs) become per-step xs
        # (the body sees the same Inputs in the same order); their gradient is the sum over
        # steps (the Expand's VJP)
        steps = lambda b: E.expand(g, E.reshape(g, b, (1,) + E.dims(g, b)), (op.length,) + E.dims(g, b))  # noqa: E731
        ins = [ins[0], *map(steps, ins[1:1 + nb]), *ins[1 + nb:], *map(steps, params)]
    n_xs = nb + op.num_xs + len(params)
    if op.save_trajectory and n_xs == op.num_xs and body is op.body:
        return g.add_node(op, tuple(ins), node.shape)
    if op.save_trajectory:
        return g.add_node(Scan(body=body, length=op.length, save_trajectory=True, num_bcast=0,
                               num_xs=n_xs, num_checkpoints=op.num_checkpoints), tuple(ins))
    traj_op = Scan(body=body, length=op.length, save_trajectory=True, num_bcast=0,
                   num_xs=n_xs, num_checkpoints=0)
    traj = g.add_node(traj_op, tuple(ins))
    if op.length == 0:
        return ins[0]
    last = g.add_node(Narrow(axis=0, start=op.length - 1, len=1), (traj,))
    return E.reshape(g, last, node.shape.dims)


def _unroll_scan(g, node, ins, ready):
    """A Scan spelled out step by step (forward mode needs no ScanBackward)."""
    op = node.op
    body = ready(op.body)
    nb = op.num_bcast
    carry, bc, xs = ins[0], ins[1:1 + nb], ins[1 + nb:]
    rows = []
    for t in range(op.length):
        x_t = []
        for x in xs:
            ds = E.dims(g, x)
            x_t.append(E.reshape(g, g.add_node(Narrow(axis=0, start=t, len=1), (x,)), tuple(ds[1:])))
        (carry,) = inline(g, body, [carry, *bc, *x_t])
        carry = E.cast(g, carry, E.dtype(g, ins[0]))
        if op.save_trajectory:
            rows.append(E.reshape(g, carry, (1,) + tuple(E.dims(g, ins[0]))))
    if not op.save_trajectory:
        return carry
    if op.num_checkpoints and op.num_checkpoints < op.length:
        rows = [rows[t * op.length // op.num_checkpoints] for t in range(op.num_checkpoints)]
    if not rows:
        return E.zeros(g, node.shape)
    from rlx_jax.ir.ops_shape import Concat

    return rows[0] if len(rows) == 1 else g.add_node(Concat(axis=0), tuple(rows))


def prepare(graph, unroll_scans: bool = False, keep_ifs: bool = False):
    """(prepared graph, old id -> new id). ``unroll_scans`` spells scans out step by
    step (used by forward mode) instead of rewriting them to save their trajectory.
    ``keep_ifs`` (reverse mode) keeps each If an If, its branches' Params made operands,
    instead of rewriting it to Where(pred, then, else)."""
    g = Graph(graph.name)
    m = {}
    ready = lambda body: _ready(body, unroll_scans, keep_ifs)  # noqa: E731
    for n in graph.nodes:
        cls = type(n.op)
        ins = [m[i] for i in n.inputs]
        if cls is ir.CustomFn and n.op.vjp_body is None:
            (out,) = inline(g, ready(n.op.fwd_body), ins)
            m[n.id] = E.as_shape(g, out, n.shape)
        elif cls is ir.If and keep_ifs:
            m[n.id] = _if(g, n, ins, ready)
        elif cls is ir.If:
            (t,) = inline(g, ready(n.op.then_branch), ins[1:])
            (e,) = inline(g, ready(n.op.else_branch), ins[1:])
            pred = ins[0]
            if E.dtype(g, pred) != DType.Bool:
                pred = E.cmp(g, "Ne", pred, E.scalar(g, 0, E.dtype(g, pred)))
            pred = E.reshape(g, pred, ())
            m[n.id] = E.where(g, pred, t, e)
        elif cls is ir.While:
            m[n.id] = _while(g, n, ins, ready)
        elif is_fused(n.op):
            m[n.id] = unfuse_node(g, n.op, ins, n.shape)
        elif cls is ir.Scan:
            m[n.id] = _unroll_scan(g, n, ins, ready) if unroll_scans else _scan(g, n, ins, ready)
        elif cls is ir.GaussianSplatRasterize:
            m[n.id] = _fuse_splat(graph, g, n, m)
        elif cls is Param and g.leaf_id(n.op.name) is not None:
            # already added for a body that reads it ahead of its declaration here
            m[n.id] = g.leaf_id(n.op.name)
        else:
            m[n.id] = g.add_node(n.op, tuple(ins), n.shape, n.name)
    g.set_outputs([m[o] for o in graph.outputs])
    return g, m


_SPLAT_RENDER_FIELDS = ("width", "height", "tile_size", "alpha_cutoff", "max_splat_steps",
                        "transmittance_threshold", "max_list_entries")


def _fuse_splat(graph, g, n, m):
    """GaussianSplatRasterize over a GaussianSplatPrepare -> GaussianSplatRender.

    The render takes the camera from Prepare's meta and the background from
    Rasterize's, so both must be the same node; the compositing attributes come from
    Rasterize (Prepare's must agree, else its buffer would not fit), radius_scale
    from Prepare."""
    from rlx_jax.ir.ops_splat import GaussianSplatRender

    prep = graph.node(n.inputs[0])
    if type(prep.op) is not ir.GaussianSplatPrepare:
        raise GraphError(f"node %{n.id} GaussianSplatRasterize: autodiff fuses it with the GaussianSplatPrepare "
                         f"that feeds it, but its input %{prep.id} is {type(prep.op).__name__}")
    if prep.inputs[6] != n.inputs[1]:
        raise GraphError(f"node %{n.id} GaussianSplatRasterize: its meta %{n.inputs[1]} differs from its "
                         f"GaussianSplatPrepare's meta %{prep.inputs[6]}; the fused render has one meta")
    for f in _SPLAT_RENDER_FIELDS:
        if getattr(prep.op, f) != getattr(n.op, f):
            raise GraphError(f"node %{n.id} GaussianSplatRasterize: {f}={getattr(n.op, f)!r} differs from its "
                             f"GaussianSplatPrepare's {getattr(prep.op, f)!r}")
    op = GaussianSplatRender(radius_scale=prep.op.radius_scale, **{f: getattr(n.op, f) for f in _SPLAT_RENDER_FIELDS})
    out = g.add_node(op, tuple(m[i] for i in prep.inputs))
    return E.as_shape(g, out, n.shape)


def needs_prepare(graph) -> bool:
    return any(type(n.op) in _REWRITTEN or is_fused(n.op) for n in graph.nodes)


#: op classes the prepare pass rewrites (besides the fused ops)
_REWRITTEN = (ir.CustomFn, ir.If, ir.While, ir.Scan, ir.GaussianSplatRasterize)
