"""Readable text form of a graph: one node per line, bodies indented.

    graph 'mlp' (4 nodes, outputs [3])
      %0 = Input(name=x) -> [batch, 4] f32 'x'
      %2 = MatMul (%0, %1) -> [batch, 8] f32
"""

from __future__ import annotations


def node_line(node) -> str:
    ins = "(" + ", ".join(f"%{i}" for i in node.inputs) + ")" if node.inputs else ""
    text = f"%{node.id} = {node.op}"
    if ins:
        text += " " + ins
    text += f" -> {node.shape}"
    if node.name and not (getattr(node.op, "name", None) == node.name):
        text += f" {node.name!r}"
    return text


def graph_text(graph, indent: int = 0) -> str:
    pad = " " * indent
    lines = [f"{pad}graph {graph.name!r} ({len(graph.nodes)} nodes, outputs "
             f"[{', '.join('%' + str(o) for o in graph.outputs)}])"]
    for node in graph.nodes:
        lines.append(pad + "  " + node_line(node))
        for key, body in node.op.bodies().items():
            lines.append(f"{pad}      {key}:")
            lines.append(graph_text(body, indent + 8))
    return "\n".join(lines)
