"""The VJP rule table and the reverse sweep shared by every graph transform.

A rule is ``fn(g, node, dy) -> list`` with one entry per input of ``node``: the id of
the node holding d loss / d input (any broadcastable shape; the sweep unbroadcasts and
casts it), or ``None`` when no gradient flows to that input. ``g`` already contains
``node`` (same id) and its inputs; ``dy`` is the id of d loss / d node.
"""

from __future__ import annotations

from typing import Callable

from rlx_jax import ir
from rlx_jax.ir import GraphError

from . import emit as E

#: op class -> its graph VJP rule
VJP_RULES: dict[type, Callable] = {}

#: ops through which no gradient flows (RLX: Compare, TopK, Sample, RNG, StopGradient)
NO_GRADIENT = frozenset({ir.Compare, ir.TopK, ir.Sample, ir.RngUniform, ir.RngNormal, ir.StopGradient,
                         ir.Input, ir.Param, ir.Constant, ir.QMatMul, ir.QConv2d, ir.DequantMoEWeights})


#: ops with an integer output that still carry a (float) gradient: RLX's straight-through
#: rule for Quantize -> Dequantize passes dy through the int8 node unchanged
STRAIGHT_THROUGH = frozenset({ir.Quantize})


def carries_gradient(node) -> bool:
    """Whether a gradient may be stored for ``node``: float / c64 results, and the
    integer results of straight-through ops."""
    return E.is_float(node.shape.dtype) or type(node.op) in STRAIGHT_THROUGH


def vjp_rule(*op_classes):
    """Register the decorated function as the graph VJP rule of each given op class
    (a subclass of :class:`rlx_jax.ir.Op`); one rule per class."""
    if not op_classes:
        raise TypeError("vjp_rule needs at least one op class")
    for c in op_classes:
        if not (isinstance(c, type) and issubclass(c, ir.Op)):
            raise TypeError(f"vjp_rule takes rlx_jax.ir.Op classes, got {c!r}")

    def deco(fn):
        for c in op_classes:
            if c in VJP_RULES:
                raise ValueError(f"a VJP rule for {c.__name__} is already registered")
            VJP_RULES[c] = fn
        return fn

    return deco


def _load():
    from . import (  # noqa: F401
        rules_elementwise, rules_shape, rules_linalg, rules_nn, rules_backward, rules_control, rules_recurrent,
    )


def get_vjp_rule(op):
    _load()
    return VJP_RULES.get(type(op))


def has_vjp_rule(op) -> bool:
    """Whether reverse mode handles ``op`` (an op, op class or RLX variant name): it has
    a VJP rule or passes no gradient."""
    _load()
    if isinstance(op, str):
        cls = ir.OP_CLASSES.get(op)
    else:
        cls = op if isinstance(op, type) else type(op)
    return cls in VJP_RULES or cls in NO_GRADIENT


def depends_on(g, sources, upto=None) -> set:
    """Ids (< upto) whose value depends on a node in ``sources`` (float paths only)."""
    upto = len(g.nodes) if upto is None else upto
    dep = set(sources)
    for n in g.nodes[:upto]:
        if n.id in dep:
            continue
        if type(n.op) in NO_GRADIENT:
            continue
        if any(i in dep for i in n.inputs) and carries_gradient(n):
            dep.add(n.id)
    return dep


def backprop(g, seeds: dict, wrt, upto=None) -> dict:
    """Reverse sweep over nodes ``< upto`` of ``g`` (in place).

    ``seeds`` maps node id -> id of its upstream gradient; only nodes on a path from a
    ``wrt`` node are differentiated. Returns node id -> gradient id (fan-in summed with
    Add)."""
    upto = len(g.nodes) if upto is None else upto
    live = depends_on(g, wrt, upto)
    grads = dict(seeds)
    for nid in range(upto - 1, -1, -1):
        if nid not in grads or nid not in live:
            continue
        node = g.nodes[nid]
        name = type(node.op).__name__
        if type(node.op) in NO_GRADIENT:
            continue
        rule = get_vjp_rule(node.op)
        if rule is None:
            raise GraphError(
                f"node %{nid} {name}{' ' + repr(node.name) if node.name else ''}: graph-level "
                f"reverse mode has no VJP rule for {name}")
        outs = rule(g, node, grads[nid])
        if len(outs) > len(node.inputs):
            raise GraphError(f"VJP rule of {name} returned {len(outs)} gradients for "
                             f"{len(node.inputs)} inputs")
        for i, gi in enumerate(outs):
            if gi is None:
                continue
            tgt = node.inputs[i]
            if tgt not in live:
                continue
            tnode = g.node(tgt)
            ts = tnode.shape
            if not carries_gradient(tnode):
                continue
            gi = E.fit(g, gi, ts) if E.is_float(ts.dtype) else E.reduce_to(g, gi, ts)
            grads[tgt] = E.add(g, grads[tgt], gi) if tgt in grads else gi
    return grads
