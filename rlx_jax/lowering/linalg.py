"""Linear algebra: MatMul, DotGeneral, DenseSolve, BatchedDenseSolve, LoraMatMul.

Plain ``jax.numpy``/``lax`` (XLA's dots are the kernels); each rule states RLX's
semantics. A MatMul of a SwiGLU product lowers to ``ops.swiglu_linear``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .registry import lowering_rule


def matmul(a, b):
    """RLX MatMul: ``[..., M, K] x [..., K, N] -> [..., M, N]`` with the batch dims
    broadcast (numpy ``matmul``; a rank-1 operand is a vector)."""
    return jnp.matmul(a, b)


def _swiglu_linear_operands(args, ctx):
    """(gate, up) when this MatMul's left operand is a SwiGLU product
    (``elementwise.swiglu_operands``) and its right one a [F, O] weight of the product's
    dtype, else None. Such a MatMul lowers to ``ops.swiglu_linear``, whose reverse mode
    keeps gate and up but not the product (the transformer MLP's down projection)."""
    if ctx.graph is None or ctx.node is None:
        return None
    from .elementwise import swiglu_operands

    src = ctx.graph.node(ctx.node.inputs[0])
    h, w = args
    src_args = [ctx.env.get(i) for i in src.inputs]
    if any(a is None for a in src_args):
        return None
    gated = swiglu_operands(ctx, src, src_args)
    if (gated is None or h.ndim < 1 or w.ndim != 2 or w.shape[0] != h.shape[-1] or w.dtype != h.dtype
            or gated[0].dtype != h.dtype):
        return None
    return gated


@lowering_rule(ir.MatMul)
def _matmul(op, args, ctx):
    gated = _swiglu_linear_operands(args, ctx)
    if gated is not None:
        from .nn import fused

        return ctx.cast_out(fused("swiglu_linear")(*gated, args[1]))
    return ctx.cast_out(matmul(args[0], args[1]))


@lowering_rule(ir.DotGeneral)
def _dot_general(op, args, ctx):
    # XLA DotGeneral: output dims are batch, then lhs free, then rhs free.
    lhs, rhs = args
    dims = ((tuple(op.lhs_contracting), tuple(op.rhs_contracting)),
            (tuple(op.lhs_batch), tuple(op.rhs_batch)))
    out = lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.result_type(lhs, rhs))
    return ctx.cast_out(out)


def _solve(a, b):
    # x = A^{-1} b with b [.., N] (one right-hand side) or [.., N, K].
    if b.ndim == a.ndim - 1:
        return jnp.linalg.solve(a, b[..., None])[..., 0]
    return jnp.linalg.solve(a, b)


@lowering_rule(ir.DenseSolve)
def _dense_solve(op, args, ctx):
    # DenseSolve [A [N, N], b [N] or [N, K]] -> x with A x = b (LU, partial pivoting).
    return ctx.cast_out(_solve(args[0], args[1]))


@lowering_rule(ir.BatchedDenseSolve)
def _batched_dense_solve(op, args, ctx):
    # BatchedDenseSolve [A [B, N, N], b [B, N] or [B, N, K]]: one solve per batch item.
    return ctx.cast_out(_solve(args[0], args[1]))


def lora_matmul(x, w, a, b, scale):
    """RLX LoraMatMul: ``x @ w + scale * (x @ a) @ b`` (the rank-r path never forms
    ``a @ b``)."""
    return matmul(x, w) + scale * matmul(matmul(x, a), b)


@lowering_rule(ir.LoraMatMul)
def _lora_matmul(op, args, ctx):
    x, w, a, b = args
    return ctx.cast_out(lora_matmul(x, w, a, b, op.scale))
