"""Forward mode on graphs: ``jvp``, ``hvp`` and pyrlx's ``jacfwd`` helper.

``jvp`` is exact for every op that has a VJP rule (no frozen statistics, unlike RLX's
approximate forward rules): it uses the transposition identity. For
``r(u) = J^T u`` (one reverse sweep seeded with dual cotangents ``u`` on the outputs),
``r`` is linear in ``u``, so a second reverse sweep of ``<r(u), t>`` w.r.t. ``u`` gives
``J t``. The result does not depend on ``u``; the dual inputs are replaced by zeros
and the graph is pruned, leaving an ordinary graph with inputs ``tangent_<name>`` and
outputs ``[primals..., tangents...]``.

``hvp`` is forward-over-reverse: the ``jvp`` of the gradient graph (with the loss's
upstream gradient fixed to 1), giving ``H v`` for tangents ``v``.
"""

from __future__ import annotations

import numpy as np

from rlx_jax.ir import Graph, GraphError
from rlx_jax.ir.ops_leaf import Constant, Input

from . import emit as E
from .prepare import prepare
from .reverse import grad_with_loss, resolve_wrt, unique_input_name
from .table import backprop
from .emit import prune


def _zeros_op(shape):
    if not E.is_static(shape.dims):
        raise GraphError(f"jvp: dual input of dynamic shape {shape} cannot be zeroed")
    return Constant(data=np.zeros(shape.dims, shape.dtype.to_numpy()).astype(
        shape.dtype.to_numpy().newbyteorder("<")).tobytes()), shape


def jvp(graph: Graph, tangent_for) -> Graph:
    """Forward-mode graph: inputs of ``graph`` plus ``tangent_<name>`` for each name in
    ``tangent_for`` (Inputs / Params, or their node ids); outputs ``[primals...,
    tangents...]`` (one tangent per output of ``graph``)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"jvp expects an rlx_jax.Graph, got {type(graph).__name__}")
    ids = resolve_wrt(graph, tangent_for)
    prepared, idmap = prepare(graph, unroll_scans=True)
    g = prepared.copy()
    g.name = f"{graph.name}_jvp"
    xs = [idmap[i] for i in ids]
    n_fwd = len(g.nodes)
    outs = list(g.outputs)
    # first sweep: r_x = sum_k J_kx^T u_k
    duals, seeds = {}, {}
    for k, o in enumerate(outs):
        s = g.node(o).shape
        if not E.is_float(s.dtype) or o in seeds:
            continue
        u = g.add_node(Input(name=unique_input_name(g, f"__dual_{k}")), (), s)
        duals[k] = u
        seeds[o] = u
    upto = len(g.nodes)
    r = backprop(g, seeds, xs, n_fwd) if seeds else {}
    # second sweep: d <r, t> / d u_k = J_k t
    tangents = {}
    t_seeds = {}
    for i, x in zip(ids, xs):
        name = getattr(graph.node(i).op, "name", None) or f"n{i}"
        t = g.add_node(Input(name=unique_input_name(g, f"tangent_{name}")), (), g.node(x).shape)
        tangents[x] = t
        if x in r:
            rx = r[x]
            t_seeds[rx] = E.add(g, t_seeds[rx], t) if rx in t_seeds else t
    upto2 = len(g.nodes)
    jt = backprop(g, t_seeds, list(duals.values()), upto2) if t_seeds else {}
    tan_outs = []
    for o in outs:
        u = seeds.get(o)                        # an output listed twice shares its dual
        if u is not None and u in jt:
            tan_outs.append(jt[u])
        elif o in tangents:                     # an output that is a wrt leaf itself
            tan_outs.append(tangents[o])
        else:
            tan_outs.append(E.zeros_like(g, o))
    g.set_outputs(outs + tan_outs)
    repl = {u: _zeros_op(g.node(u).shape) for u in duals.values()}
    return prune(g, replace=repl)


def hvp(graph: Graph, wrt) -> Graph:
    """Hessian-vector products of ``graph``'s scalar output 0 (forward over reverse).

    Inputs: those of ``graph`` plus ``tangent_<name>`` (the vector v, one per wrt);
    outputs ``[loss, d loss / d w..., (H v)_w...]``."""
    ids = resolve_wrt(graph, wrt)
    loss = graph.node(graph.outputs[0]).shape
    if loss.numel() != 1:
        raise GraphError(f"hvp: output 0 of {graph.name!r} must be a scalar loss, got {loss}")
    if any(type(n.op).__name__ == "Scan" for n in graph.nodes):
        unrolled, idmap = prepare(graph, unroll_scans=True)
        graph, ids = unrolled, [idmap[i] for i in ids]
    gg = grad_with_loss(graph, ids)
    # fix the upstream gradient to one: the d_output Input becomes a constant
    dname = unique_input_name(graph, "d_output")
    d = gg.leaf_id(dname)
    s = gg.node(d).shape
    one = Constant(data=np.ones(s.dims, s.dtype.to_numpy()).astype(
        s.dtype.to_numpy().newbyteorder("<")).tobytes())
    fixed = Graph(gg.name)
    m = {}
    for n in gg.nodes:
        if n.id == d:
            m[n.id] = fixed.add_node(one, (), s)
        else:
            m[n.id] = fixed.add_node(n.op, tuple(m[i] for i in n.inputs), n.shape, n.name)
    n_aux = len(graph.outputs) - 1
    fixed.set_outputs([m[gg.outputs[0]]] + [m[o] for o in gg.outputs[1 + n_aux:]])
    names = [getattr(graph.node(i).op, "name", None) for i in ids]
    if any(nm is None for nm in names):
        raise GraphError("hvp: wrt must be Inputs or Params")
    jg = jvp(fixed, names)
    k = len(fixed.outputs)
    jg.set_outputs(jg.outputs[:k] + jg.outputs[k + 1:])
    jg.name = f"{graph.name}_hvp"
    return jg


def jacfwd(compiled_jvp, primals: dict, wrt_name: str, wrt_shape, dtype="f64") -> list:
    """pyrlx's helper: the full Jacobian of every output w.r.t. ``wrt_name`` from a
    compiled jvp graph, one run per basis vector of the tangent.

    ``compiled_jvp`` is a ``jvp`` graph (lowered here with ``to_jax``), a
    ``Session(...).compile(jvp_graph)`` (params are uploaded with ``set_param``) or a callable
    ``fn(feeds: dict) -> list`` over all of its inputs by name (primals and tangents);
    ``primals`` maps the graph's Inputs and Params to arrays. Returns, per output
    tangent, an array ``[*out_shape, *wrt_shape]`` of ``dtype``."""
    wrt_shape = tuple(int(d) for d in wrt_shape)
    np_dt = np.dtype({"f64": np.float64, "f32": np.float32}.get(dtype, dtype))
    tname = f"tangent_{wrt_name}"
    if isinstance(compiled_jvp, Graph):
        from rlx_jax.lowering import to_jax

        fn = to_jax(compiled_jvp)
        params = {n.op.name for n in compiled_jvp.nodes if type(n.op).__name__ == "Param"}
        leaves = {n.op.name: n for n in compiled_jvp.nodes if type(n.op).__name__ in ("Input", "Param")}
        tangent_names = [nm for nm in leaves if nm.startswith("tangent_")]
        if tname not in leaves:
            raise GraphError(f"jacfwd: the jvp graph has no input {tname!r}")
        n_out = len(compiled_jvp.outputs) // 2

        def run(feeds):
            p = {k: v for k, v in feeds.items() if k in params}
            i = {k: v for k, v in feeds.items() if k not in params}
            return fn(p, i)
        zero_tangents = {nm: np.zeros(tuple(leaves[nm].shape.dims), leaves[nm].shape.dtype.to_numpy())
                         for nm in tangent_names}
    elif hasattr(compiled_jvp, "run") and isinstance(getattr(compiled_jvp, "_graph", None), Graph):
        # a Session-compiled jvp graph (pyrlx's usage): params go through set_param
        cg = compiled_jvp
        jgraph = cg._graph
        params = {n.op.name for n in jgraph.nodes if type(n.op).__name__ == "Param"}
        leaves = {n.op.name: n for n in jgraph.nodes if type(n.op).__name__ in ("Input", "Param")}
        if tname not in leaves:
            raise GraphError(f"jacfwd: the jvp graph has no input {tname!r}")
        n_out = len(jgraph.outputs) // 2
        zero_tangents = {nm: np.zeros(tuple(leaves[nm].shape.dims), leaves[nm].shape.dtype.to_numpy())
                         for nm in leaves if nm.startswith("tangent_")}

        def run(feeds):
            for k, v in feeds.items():
                if k in params:
                    cg.set_param(k, v)
            # declared dtypes and shapes (run() converts to pyrlx's f32 outputs)
            return cg._call({k: v for k, v in feeds.items() if k not in params})
    else:
        run = compiled_jvp
        zero_tangents = {}
        n_out = None
    size = int(np.prod(wrt_shape)) if wrt_shape else 1
    cols = []
    for j in range(size):
        e = np.zeros(size, np_dt)
        e[j] = 1
        feeds = dict(primals)
        feeds.update(zero_tangents)
        tdt = zero_tangents[tname].dtype if tname in zero_tangents else np_dt
        feeds[tname] = e.reshape(wrt_shape).astype(tdt)
        outs = run(feeds)
        if n_out is None:
            n_out = len(outs) // 2
        cols.append([np.asarray(o, np_dt) for o in outs[n_out:]])
    jac = []
    for k in range(n_out):
        stacked = np.stack([c[k] for c in cols], axis=-1)
        jac.append(stacked.reshape(stacked.shape[:-1] + wrt_shape))
    return jac
