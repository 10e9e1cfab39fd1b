"""Graph and Node: RLX's append-only SSA graph.

A :class:`Graph` holds nodes in topological (insertion) order; node ``i`` has id ``i``
and may only read nodes with smaller ids. Every node has one output whose
:class:`~rlx_jax.ir.shape.Shape` is inferred by the op's shape rule (or declared where
RLX needs it). ``Input``/``Param`` leaves are bound by name; names are unique across
both. The builders (pyrlx surface and one per op) come from the ``builders_*`` mixins.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

from .builders_backward import BackwardBuilders
from .builders_control import ControlBuilders
from .builders_core import CoreBuilders
from .builders_nn import NNBuilders
from .builders_signal import SignalBuilders
from .errors import GraphError, node_error
from .op import Op
from .ops_leaf import Input, Param
from .shape import Shape
from . import verify as _verify


@dataclasses.dataclass(frozen=True)
class Node:
    """One SSA value: ``id`` (its position), ``op``, ``inputs`` (earlier ids),
    ``shape``, optional ``name`` and RLX's optional provenance ``origin`` (kept as the
    JSON object it was loaded from)."""

    id: int
    op: Op
    inputs: tuple
    shape: Shape
    name: Optional[str] = None
    origin: Optional[dict] = None


class Graph(CoreBuilders, NNBuilders, SignalBuilders, BackwardBuilders, ControlBuilders):
    """An RLX graph (a superset of pyrlx's ``Graph``): ``Graph(name)``."""

    def __init__(self, name: str = "graph"):
        if not isinstance(name, str):
            raise TypeError(f"graph name must be a string, got {type(name).__name__}")
        self.name = name
        self.nodes: list[Node] = []
        self.outputs: list[int] = []
        self._leaf_names: dict[str, int] = {}

    # -- core ------------------------------------------------------------------
    def node(self, id: int) -> Node:
        """The node with id ``id`` (GraphError when there is none)."""
        try:
            i = operator.index(id) if not isinstance(id, bool) else None
        except TypeError:
            i = None
        if i is None or not 0 <= i < len(self.nodes):
            raise GraphError(
                f"graph {self.name!r}: no node %{id} (graph has {len(self.nodes)} nodes)"
            )
        return self.nodes[i]

    def shape(self, id: int) -> Shape:
        return self.node(id).shape

    def add_node(self, op: Op, inputs=(), shape: Optional[Shape] = None, name: Optional[str] = None,
            origin: Optional[dict] = None) -> int:
        """Append a node of ``op`` (any :class:`~rlx_jax.ir.Op`) reading ``inputs`` (ids of
        earlier nodes) and return its id.

        Its shape comes from the op's shape rule when ``shape`` is None; a declared
        ``shape`` is checked against the rule. ``name`` labels the node (an ``Input`` /
        ``Param`` is bound by its op's name, which must be unique); ``origin`` is RLX's
        optional provenance object. A bad op, input id, arity, shape or dtype raises
        GraphError naming the new node. Every builder method goes through here."""
        new_id = len(self.nodes)
        if not isinstance(op, Op):
            raise GraphError(f"node %{new_id}: op must be an rlx_jax.ir.Op, got {type(op).__name__}")
        try:
            inputs = tuple(operator.index(i) if not isinstance(i, bool) else i for i in inputs)
        except TypeError:
            raise node_error(new_id, op.op_name, name, f"inputs must be node ids, got {inputs!r}") from None
        if shape is not None and not isinstance(shape, Shape):
            raise node_error(new_id, op.op_name, name, f"shape must be a Shape, got {shape!r}")
        if name is not None and not isinstance(name, str):
            raise node_error(new_id, op.op_name, name, f"name must be a string, got {name!r}")
        out = _verify.check_node(self, new_id, op, inputs, shape, name)
        if isinstance(op, (Input, Param)):
            if op.name in self._leaf_names:
                raise node_error(
                    new_id, op.op_name, name,
                    f"duplicate input/param name {op.name!r} (already node %{self._leaf_names[op.name]})",
                )
            self._leaf_names[op.name] = new_id
        self.nodes.append(Node(new_id, op, inputs, out, name, origin))
        return new_id

    def set_outputs(self, outputs) -> None:
        """Set the graph outputs (node ids, in order)."""
        if isinstance(outputs, int):
            outputs = [outputs]
        out = []
        for i in outputs:
            try:
                k = operator.index(i) if not isinstance(i, bool) else -1
            except TypeError:
                k = -1
            if not 0 <= k < len(self.nodes):
                raise GraphError(
                    f"graph {self.name!r}: output %{i} is not a node (graph has {len(self.nodes)} nodes)"
                )
            out.append(int(k))
        self.outputs = out

    def shape_of(self, id: int) -> tuple:
        """``(dims, dtype)`` pyrlx-style: ``([3, 'batch'], 'f32')`` (dynamic dims by name)."""
        s = self.node(id).shape
        return (s.py_dims(), s.dtype.short)

    def inputs_by_name(self) -> dict:
        """Input name -> node id."""
        return {n.op.name: n.id for n in self.nodes if isinstance(n.op, Input)}

    def params_by_name(self) -> dict:
        """Param name -> node id."""
        return {n.op.name: n.id for n in self.nodes if isinstance(n.op, Param)}

    def leaf_id(self, name: str) -> Optional[int]:
        return self._leaf_names.get(name)

    def verify(self) -> "Graph":
        """Re-check the whole graph (ids, arity, shapes, dtypes, bodies); raise
        GraphError naming the first bad node. Returns ``self``."""
        _verify.verify_graph(self)
        return self

    # -- text / JSON -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"<rlx_jax.Graph {self.name!r} nodes={len(self.nodes)} outputs={self.outputs}>"

    def __str__(self) -> str:
        from .text import graph_text

        return graph_text(self)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (
            self.name == other.name
            and self.outputs == other.outputs
            and len(self.nodes) == len(other.nodes)
            and all(
                (a.op, a.inputs, a.shape, a.name) == (b.op, b.inputs, b.shape, b.name)
                for a, b in zip(self.nodes, other.nodes)
            )
        )

    def __hash__(self) -> int:  # consistent with __eq__ (equal graphs: same name/size)
        return hash((self.name, len(self.nodes)))

    def to_json(self, indent: Optional[int] = None) -> str:
        """RLX serde JSON (``serde_json`` layout of ``rlx_ir::Graph``)."""
        from .serde import graph_to_json

        return graph_to_json(self, indent=indent)

    @classmethod
    def from_json(cls, text) -> "Graph":
        """Load RLX serde JSON; any malformed content raises GraphError."""
        from .serde import graph_from_json

        return graph_from_json(text)

    def copy(self) -> "Graph":
        """A shallow structural copy (ops and shapes are immutable)."""
        g = Graph(self.name)
        g.nodes = list(self.nodes)
        g.outputs = list(self.outputs)
        g._leaf_names = dict(self._leaf_names)
        return g
