"""Graph VJP rules: CustomFn with a ``vjp_body``, registered Custom ops, If, Scan."""

from __future__ import annotations

from rlx_jax.ir import Graph, GraphError, get_custom_op
from rlx_jax.ir.ops_control import ScanBackward, ScanBackwardXs, body_inputs
from rlx_jax.ir.ops_leaf import Input
from rlx_jax import ir

from . import emit as E
from .table import backprop, carries_gradient, vjp_rule


@vjp_rule(ir.CustomFn)
def _custom_fn(g, node, dy):
    from .prepare import inline

    op = node.op
    if op.vjp_body is None:  # prepare inlines these
        raise GraphError(f"node %{node.id} CustomFn without vjp_body must be inlined first")
    return inline(g, op.vjp_body, list(node.inputs), {"primal_output": node.id, "d_output": dy})


@vjp_rule(ir.Custom)
def _custom(g, node, dy):
    d = get_custom_op(node.op.name)
    if d is None or d.vjp is None:
        raise GraphError(f"node %{node.id} Custom {node.op.name!r}: no vjp registered (register_op(..., vjp=))")
    return list(d.vjp(g, node, dy))


def body_vjp_graph(body: Graph, n_diff: int) -> Graph:
    """A graph with the body's Inputs plus ``d_output`` returning d body / d input for
    the first ``n_diff`` Inputs (zeros where no gradient flows)."""
    from .reverse import unique_input_name

    t = body.copy()
    t.name = f"{body.name}_vjp"
    upto = len(t.nodes)
    out = body.outputs[0]
    # a unique name: a body differentiated again (second order) already has a d_output
    d = t.add_node(Input(name=unique_input_name(t, "d_output")), (), t.node(out).shape)
    ins = [n.id for n in body_inputs(body)][:n_diff]
    grads = backprop(t, {out: d}, ins, upto)
    outs = []
    for i in ins:
        gi = grads.get(i)
        outs.append(gi if gi is not None else E.zeros_like(t, i))
    t.set_outputs(outs)
    return t


@vjp_rule(ir.If)
def _if(g, node, dy):
    """d capture_i = If(pred, d then / d capture_i, d else / d capture_i) on (pred,
    captures, dy): the taken branch alone is differentiated, as it alone runs, so a branch
    not taken that is singular at the captures (sqrt at 0) cannot make the gradient NaN.
    Each branch is prepared (fused ops unfused, nested control flow rewritten) first."""
    from .prepare import prepare

    caps = node.inputs[1:]
    grads = [body_vjp_graph(prepare(b, keep_ifs=True)[0], len(caps))
             for b in (node.op.then_branch, node.op.else_branch)]
    outs = [None]
    for i, c in enumerate(caps):
        if not carries_gradient(g.node(c)):
            outs.append(None)
            continue
        then_i, else_i = (gr.copy() for gr in grads)
        then_i.set_outputs([grads[0].outputs[i]])
        else_i.set_outputs([grads[1].outputs[i]])
        outs.append(g.add_node(ir.If(then_branch=then_i, else_branch=else_i), (node.inputs[0], *caps, dy)))
    return outs


@vjp_rule(ir.Scan)
def _scan(g, node, dy):
    op = node.op
    if not op.save_trajectory:
        raise GraphError(f"node %{node.id} Scan: prepare rewrites scans to save their trajectory first")
    if op.num_bcast:
        raise GraphError(f"node %{node.id} Scan: RLX's ScanBackward has no broadcast operands "
                         f"(num_bcast={op.num_bcast})")
    bv = body_vjp_graph(op.body, 1 + op.num_xs)
    init = node.inputs[0]
    xs = tuple(node.inputs[1:])
    common = dict(body_vjp=bv, length=op.length, save_trajectory=True, num_xs=op.num_xs,
                  num_checkpoints=op.num_checkpoints, forward_body=op.body)
    dinit = g.add_node(ScanBackward(**common), (init, node.id, dy) + xs, E.shape(g, init))
    dxs = [g.add_node(ScanBackwardXs(xs_idx=i, **common), (init, node.id, dy) + xs, E.shape(g, x))
           for i, x in enumerate(xs)]
    return [dinit] + dxs
