"""Fused ops (FusedMatMulBiasAct, FusedResidualLN, FusedResidualRmsNorm, FusedSwiGLU,
FusedAttentionBlock, FusedTransformerLayer), lowered by evaluating their decomposition
into primitive IR ops (:mod:`rlx_jax.autodiff.unfuse`, the one definition autodiff
differentiates too), so a fused node gives the numbers of its unfused primitives.
"""

from __future__ import annotations

from rlx_jax.autodiff.unfuse import DECOMPOSITIONS, decomposition

from .registry import lowering_rule


def _lower_decomposed(op, args, ctx):
    """Evaluate the cached decomposition of ``op`` for the node's operand shapes (as
    declared in the graph, dynamic dims included) on ``args``."""
    in_shapes = tuple(ctx.graph.node(i).shape for i in ctx.node.inputs)
    body = decomposition(op, in_shapes, ctx.node.shape)
    (y,) = ctx.lower_body(body, args)
    return ctx.cast_out(y)


lowering_rule(*DECOMPOSITIONS)(_lower_decomposed)
