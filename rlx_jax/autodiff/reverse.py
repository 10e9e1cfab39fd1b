"""Graph-level reverse mode: ``grad_with_loss`` and ``grad`` (RLX semantics).

``grad_with_loss(forward, wrt)`` prepares the graph (see ``prepare.py``), copies it,
adds an input ``d_output`` shaped like output 0 (the loss), walks the nodes in reverse
applying each op's VJP rule (``rules_*.py``), sums fan-in with Add, unbroadcasts into
broadcast operands, and returns a graph whose outputs are ``[loss, aux outputs...,
d loss / d w for w in wrt]``. STRICT raises a GraphError naming a wrt node that gets
no gradient; TRAINING gives it zeros.

Complex values (c64) follow RLX's convention at the graph's boundary: the gradient of a
real loss L w.r.t. a complex node z is the Wirtinger derivative ``dL/d conj(z) = (dL/dRe z
+ i dL/dIm z) / 2`` (``|z|^2`` -> ``z``, and the VJP of ``a * b`` w.r.t. ``a`` is ``g *
conj(b)``), and the ``d_output`` of a complex loss is read in that convention too. The
rules themselves propagate JAX's cotangent (``2 conj`` of RLX's on every complex node,
the same on real nodes), which keeps them equal to ``jax.grad`` of the lowered ops;
the seed and the complex gradients are converted at the boundary, which gives exactly
the values RLX's rules compose to. Real wrt nodes get the plain derivative either way.
"""

from __future__ import annotations

import dataclasses

from rlx_jax.ir import DType, Graph, GraphError
from rlx_jax.ir.ops_elementwise import Conjugate
from rlx_jax.ir.ops_leaf import Input

from . import emit as E
from .prepare import prepare
from .table import backprop


@dataclasses.dataclass(frozen=True)
class GradWithLossOptions:
    """``zero_missing_wrt``: a wrt node with no gradient path gets zeros (TRAINING)
    instead of an error (STRICT)."""

    zero_missing_wrt: bool = False


GradWithLossOptions.STRICT = GradWithLossOptions(False)
GradWithLossOptions.TRAINING = GradWithLossOptions(True)


def unique_input_name(g, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... when the graph already binds that name
    (differentiating a gradient graph again)."""
    name, k = base, 0
    while g.leaf_id(name) is not None:
        k += 1
        name = f"{base}_{k}"
    return name


def resolve_wrt(graph, wrt) -> list:
    """wrt entries (node ids, or Input/Param names) -> node ids of ``graph``."""
    if isinstance(wrt, (int, str)):
        wrt = [wrt]
    ids = []
    for w in wrt:
        if isinstance(w, str):
            i = graph.leaf_id(w)
            if i is None:
                raise GraphError(f"grad_with_loss: graph {graph.name!r} has no input or param named {w!r}")
            ids.append(i)
        elif isinstance(w, int) and not isinstance(w, bool) and 0 <= w < len(graph.nodes):
            ids.append(int(w))
        else:
            raise GraphError(f"grad_with_loss: wrt entry {w!r} is not a node of graph {graph.name!r}")
    return ids


def _describe(graph, i) -> str:
    n = graph.node(i)
    label = f"%{i} {type(n.op).__name__}"
    nm = getattr(n.op, "name", None) or n.name
    return label + (f" {nm!r}" if nm else "")


def to_jax_cotangent(g, c):
    """RLX's cotangent of a node -> JAX's (``2 conj(c)`` for c64, ``c`` for reals)."""
    if E.dtype(g, c) != DType.C64:
        return c
    return E.mul_s(g, g.add_node(Conjugate(), (c,)), 2.0)


def to_rlx_cotangent(g, c):
    """JAX's cotangent of a node -> RLX's (``conj(c) / 2`` for c64, ``c`` for reals)."""
    if E.dtype(g, c) != DType.C64:
        return c
    return E.mul_s(g, g.add_node(Conjugate(), (c,)), 0.5)


def grad_with_loss(forward: Graph, wrt, options: GradWithLossOptions = GradWithLossOptions.STRICT,
                   d_output_name: str = "d_output") -> Graph:
    """Reverse-mode gradient graph of ``forward``'s output 0 (see the module doc)."""
    if not isinstance(forward, Graph):
        raise TypeError(f"grad_with_loss expects an rlx_jax.Graph, got {type(forward).__name__}")
    if not forward.outputs:
        raise GraphError(f"grad_with_loss: graph {forward.name!r} has no output (the loss)")
    if isinstance(options, bool):
        options = GradWithLossOptions(options)
    wrt_ids = resolve_wrt(forward, wrt)
    prepared, idmap = prepare(forward, keep_ifs=True)
    g = prepared.copy()
    g.name = f"{forward.name}_grad"
    upto = len(g.nodes)
    loss = g.outputs[0]
    d = g.add_node(Input(name=unique_input_name(g, d_output_name)), (), g.node(loss).shape,
                   unique_input_name(g, d_output_name))
    new_wrt = [idmap[i] for i in wrt_ids]
    grads = backprop(g, {loss: to_jax_cotangent(g, d)}, new_wrt, upto)
    outs = [loss] + list(g.outputs[1:])
    for old, i in zip(wrt_ids, new_wrt):
        gi = grads.get(i)
        if gi is None:
            if not options.zero_missing_wrt:
                raise GraphError(
                    f"grad_with_loss: no gradient flows to wrt node {_describe(forward, old)} of graph "
                    f"{forward.name!r}: the loss does not depend on it (or only through ops without "
                    "a gradient); use GradWithLossOptions.TRAINING to give it zeros")
            gi = E.zeros_like(g, i)
        else:
            gi = to_rlx_cotangent(g, gi)
        outs.append(gi)
    g.set_outputs(outs)
    return E.prune(g)


def grad(forward: Graph, wrt, options: GradWithLossOptions = GradWithLossOptions.STRICT) -> Graph:
    """pyrlx's ``grad``: ``grad_with_loss`` with outputs ``[loss, grads...]`` (aux
    outputs dropped)."""
    g = grad_with_loss(forward, wrt, options)
    n_aux = len(forward.outputs) - 1
    g.set_outputs([g.outputs[0]] + g.outputs[1 + n_aux:])
    return g
