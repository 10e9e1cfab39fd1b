"""Errors raised by the IR.

Every structural, shape or dtype fault of a graph surfaces as :class:`GraphError`
(a ``ValueError``), whose message names the offending node as
``node %<id> <Op> '<name>'`` followed by what is wrong.
"""

from __future__ import annotations


class GraphError(ValueError):
    """A malformed graph, a shape/dtype mismatch, or malformed serialised JSON."""


class OpFault(ValueError):
    """Internal: raised by an op's attribute check or shape rule.

    The graph catches it and re-raises a :class:`GraphError` that names the node.
    """


def describe_node(node_id, op_name: str, name: str | None = None) -> str:
    """``node %3 LayerNorm 'ln1'`` (the name part only when the node has one)."""
    text = f"node %{node_id} {op_name}"
    if name:
        text += f" {name!r}"
    return text


def node_error(node_id, op_name: str, name: str | None, fault: str) -> GraphError:
    """A :class:`GraphError` for one node: ``"<graph?> node %id Op 'name': fault"``."""
    return GraphError(f"{describe_node(node_id, op_name, name)}: {fault}")
