"""The RLX IR in Python: dtypes, shapes, every RLX op, Graph with builders, verifier,
text form and RLX serde JSON.

Contracts (docs/INTERNALS.md): op class name = RLX variant name, fields = RLX
``op.rs`` field names; ``OP_CLASSES`` maps variant name -> class; ``Graph.add(op,
inputs, shape=None, name=None)`` appends a verified node.
"""

from __future__ import annotations

from .dtypes import DType
from .errors import GraphError, OpFault
from .shape import BATCH, PAST_SEQ, ROWS, SEQ, Dynamic, Shape
from .op import (
    OP_CLASSES, ActivationKind, AttentionBwdWrt, BinaryOp, ChainOperand, ChainStep, CmpOp,
    FftNorm, MaskKind, Op, QuantScheme, ReduceOp, ScaleMode, SteKind,
)
from . import ops_leaf, ops_elementwise, ops_linalg, ops_shape, ops_reduce  # noqa: F401  (register ops)
from .graph import Graph, Node

globals().update(OP_CLASSES)

__all__ = [
    "DType", "GraphError", "OpFault", "Dynamic", "Shape", "BATCH", "SEQ", "ROWS", "PAST_SEQ",
    "OP_CLASSES", "Op", "ActivationKind", "AttentionBwdWrt", "BinaryOp", "ChainOperand",
    "ChainStep", "CmpOp", "FftNorm", "MaskKind", "QuantScheme", "ReduceOp", "ScaleMode",
    "SteKind", "Graph", "Node", *sorted(OP_CLASSES),
]
