"""The RLX IR in Python: dtypes, shapes, every RLX op, Graph with builders, verifier,
text form and RLX serde JSON.

Contracts (docs/ARCHITECTURE.md): op class name = RLX variant name, fields = RLX
``op.rs`` field names; ``OP_CLASSES`` maps variant name -> class; ``Graph.add(op,
inputs, shape=None, name=None)`` appends a verified node (``Graph.add(a, b)`` with two
node ids is pyrlx's elementwise add).

Decisions where RLX's ``op.rs`` is silent or differs:

* Variants the seeds use but ``op.rs`` lacks: ``StopGradient`` (unit),
  ``BatchNormInference{eps}``, ``BatchNormInferenceBackwardInput{eps}`` /
  ``...Gamma{eps}`` / ``...Beta`` (unit), ``LogMel`` and ``LogMelBackward`` (unit;
  ``y = log(max(spectrum @ filterbank, 1e-10))``), ``RngUniform{seed, low, high}`` and
  ``RngNormal{seed, mean, std}`` (0 inputs, declared shape).
* ``Gather{axis}`` has RLX's shape rule ``indices + table[axis+1:]`` and reads the
  first slice along ``table[:axis]`` (``np.take`` for axis 0; ``Graph.take`` builds
  ``np.take`` along any axis). ``GatherBackward`` takes dy in that layout or in
  ``np.take``'s ``table[:axis] + indices + table[axis+1:]`` (the seed kernel's).
* ``While``'s node value is the final carry 0; ``If`` branches return one value.
* Index operands (Gather, ScatterAdd, GroupedMatMul, loss labels) take integer dtypes
  or RLX's f32/f64-encoded indices; bool, complex and half floats are refused.
* Dynamic dims serialise as ``{"Dynamic": symbol}``; names other than batch / seq /
  rows / past_seq travel in an extra top-level ``"dim_names"`` object (Rust ignores it).
"""

from __future__ import annotations

from .dtypes import DType
from .errors import GraphError, OpFault
from .shape import BATCH, PAST_SEQ, ROWS, SEQ, Dynamic, Shape
from .op import (
    OP_CLASSES, ActivationKind, AttentionBwdWrt, BinaryOp, ChainOperand, ChainStep, CmpOp,
    FftNorm, MaskKind, Op, QuantScheme, ReduceOp, ScaleMode, SteKind,
)
from . import (  # noqa: F401  (importing registers the op classes)
    ops_leaf, ops_elementwise, ops_linalg, ops_shape, ops_reduce, ops_norm, ops_attention, ops_conv,
    ops_quant, ops_recurrent, ops_fused, ops_signal, ops_splat, ops_rng, ops_control, ops_backward,
)
from .registry import CustomOpDef, get_custom_op, register_op
from .graph import Graph, Node

globals().update(OP_CLASSES)

__all__ = [
    "DType", "GraphError", "OpFault", "Dynamic", "Shape", "BATCH", "SEQ", "ROWS", "PAST_SEQ",
    "OP_CLASSES", "Op", "ActivationKind", "AttentionBwdWrt", "BinaryOp", "ChainOperand",
    "ChainStep", "CmpOp", "FftNorm", "MaskKind", "QuantScheme", "ReduceOp", "ScaleMode",
    "SteKind", "Graph", "Node", "register_op", "get_custom_op", "CustomOpDef", *sorted(OP_CLASSES),
]
