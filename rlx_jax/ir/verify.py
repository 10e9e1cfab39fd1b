"""Node and graph verification.

``check_node`` is the one gate every node passes (builders, ``Graph.add``, JSON
loading, ``Graph.verify``): input ids exist and come earlier, the input count matches
the op's arity, and the op's shape rule accepts the input shapes and yields (or agrees
with) the node's shape. Nested bodies are verified recursively.
"""

from __future__ import annotations

from .errors import GraphError, OpFault, node_error
from .shape import Shape, shapes_match


def check_node(graph, node_id: int, op, inputs: tuple, shape, name):
    """Check one node against the nodes before it; return its (inferred) shape."""
    opn = op.op_name
    for i in inputs:
        if isinstance(i, bool) or not isinstance(i, int):
            raise node_error(node_id, opn, name, f"input {i!r} is not a node id")
        if i < 0 or i >= node_id:
            if 0 <= i < len(graph.nodes) or i == node_id:
                raise node_error(
                    node_id, opn, name, f"input %{i} does not come before the node (SSA order)"
                )
            raise node_error(node_id, opn, name, f"input %{i} does not exist")
    try:
        arity = op.arity()
        if arity is not None and len(inputs) != arity:
            raise OpFault(f"expects {arity} input(s), got {len(inputs)}")
        ins = [graph.nodes[i].shape for i in inputs]
        inferred = op.infer(ins)
        if shape is None:
            if inferred is None:
                raise OpFault(op.needs_shape_message())
            return inferred
        if inferred is not None:
            if not shapes_match(shape, inferred) and not op.accepts_declared(ins, shape, inferred):
                raise OpFault(f"declared shape {shape} does not match the inferred {inferred}")
        else:
            op.check_declared(ins, shape)
        return shape
    except OpFault as exc:
        raise node_error(node_id, opn, name, str(exc)) from None
    except GraphError as exc:
        raise node_error(node_id, opn, name, str(exc)) from None


def verify_graph(graph) -> None:
    """Verify every node in order, leaf-name uniqueness, outputs, nested bodies."""
    from .ops_leaf import Input, Param

    leaf: dict[str, int] = {}
    for pos, node in enumerate(graph.nodes):
        if node.id != pos:
            raise node_error(node.id, node.op.op_name, node.name,
                             f"id does not match its position {pos}")
        if not isinstance(node.shape, Shape):
            raise node_error(node.id, node.op.op_name, node.name, "shape is not a Shape")
        for key, body in node.op.bodies().items():
            try:
                verify_graph(body)
            except GraphError as exc:
                raise node_error(node.id, node.op.op_name, node.name,
                                 f"in body {key!r}: {exc}") from None
        check_node(graph, node.id, node.op, node.inputs, node.shape, node.name)
        if isinstance(node.op, (Input, Param)):
            if node.op.name in leaf:
                raise node_error(
                    node.id, node.op.op_name, node.name,
                    f"duplicate input/param name {node.op.name!r} (already node %{leaf[node.op.name]})",
                )
            leaf[node.op.name] = node.id
    for o in graph.outputs:
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < len(graph.nodes):
            raise GraphError(f"graph {graph.name!r}: output %{o} is not a node")
