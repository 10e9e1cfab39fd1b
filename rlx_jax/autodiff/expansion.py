"""VJPs by primitive expansion.

Some ops have no closed-form backward op in RLX (the backward ops themselves, the
elementwise region, attention with a logit softcap). Their VJP is found by writing
the op's maths in primitive ops in a scratch graph, running the reverse sweep there,
and copying the needed part of that gradient graph into the caller's graph: the
primitive expansion's result node is identified with the op's own node, so the
forward value keeps coming from the op (its kernel) and only the gradient is spelled
in primitives. The emitted nodes are ordinary, differentiable again.
"""

from __future__ import annotations

from rlx_jax.ir import Graph, GraphError
from rlx_jax.ir.ops_leaf import Input

from . import emit as E
from .table import backprop


def vjp_via_expansion(g, node, dy, build, wrt_inputs=None):
    """``build(t, ins) -> out``: emit ``node.op``'s maths in scratch graph ``t`` over
    Input ids ``ins`` (shaped like ``node``'s inputs); returns one gradient id (in
    ``g``) or None per input of ``node``."""
    t = Graph("expansion")
    ins = [t.add_node(Input(name=f"x{i}"), (), g.node(j).shape) for i, j in enumerate(node.inputs)]
    out = build(t, ins)
    if tuple(t.node(out).shape.dims) != tuple(node.shape.dims) or t.node(out).shape.dtype != node.shape.dtype:
        raise GraphError(f"expansion of {type(node.op).__name__} gives {t.node(out).shape}, node has {node.shape}")
    upto = len(t.nodes)
    d = t.add_node(Input(name="d"), (), node.shape)
    if wrt_inputs is None:
        wrt_inputs = range(len(ins))
    wrt = [ins[i] for i in wrt_inputs if E.is_float(t.node(ins[i]).shape.dtype)]
    grads = backprop(t, {out: d}, wrt, upto)
    results = [grads.get(ins[i]) if i in set(wrt_inputs) else None for i in range(len(ins))]
    # copy what the results need into g
    need = set()
    stack = [r for r in results if r is not None]
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        if n in ins or n == d or n == out:
            continue
        stack.extend(t.node(n).inputs)
    mapping = {d: dy, out: node.id}
    for i, j in zip(ins, node.inputs):
        mapping[i] = j
    for n in t.nodes:
        if n.id in need and n.id not in mapping:
            mapping[n.id] = g.add_node(n.op, tuple(mapping[i] for i in n.inputs), n.shape)
    return [None if r is None else mapping[r] for r in results]
