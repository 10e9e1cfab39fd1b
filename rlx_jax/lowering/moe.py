"""Mixture of experts: GroupedMatMul and ScatterAdd.

No per-token weight gather: GroupedMatMul sorts the tokens by expert and runs one
``lax.ragged_dot`` (a grouped GEMM) over the contiguous groups. ScatterAdd is the gather
family's ``scatter_add`` (rlx_jax.ops).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .nn import index_array
from .registry import lowering_rule


def grouped_matmul(x, w, expert_idx):
    """out[i] = x[i] @ w[expert_idx[i]] for x [M, K], w [E, K, N], expert_idx [M]."""
    e = w.shape[0]
    idx = index_array(expert_idx).reshape(-1)
    order = jnp.argsort(idx, stable=True)
    sizes = jnp.bincount(idx, length=e).astype(jnp.int32)
    dt = jnp.result_type(x, w)
    y_sorted = lax.ragged_dot(x[order].astype(dt), w.astype(dt), sizes)
    inv = jnp.argsort(order)
    return y_sorted[inv]


@lowering_rule(ir.GroupedMatMul)
def _grouped_matmul(op, args, ctx):
    x, w, idx = args
    return ctx.cast_out(grouped_matmul(x, w, idx))


@lowering_rule(ir.ScatterAdd)
def _scatter_add(op, args, ctx):
    # out = zeros(out_shape); out[indices[i]] += updates[i] (the gather family's
    # scatter_add); out_dim comes from the node's declared output shape.
    from .nn import fused

    updates, indices = args
    if ctx.out_shape is None or None in ctx.out_shape:
        raise ValueError("ScatterAdd output shape has an unbound dynamic dim")
    indices = index_array(indices)
    if jnp.issubdtype(updates.dtype, jnp.integer):
        # integer sums have no gradient and the kernels are floating point: XLA's scatter,
        # with the indices clipped into [0, V - 1] as the kernel's
        out_shape = tuple(ctx.out_shape)
        rows = jnp.clip(indices, 0, max(out_shape[0] - 1, 0)).reshape(-1)
        flat = updates.reshape((rows.shape[0],) + out_shape[1:])
        return ctx.cast_out(jnp.zeros(out_shape, updates.dtype).at[rows].add(flat))
    return ctx.cast_out(fused("scatter_add")(updates, indices, tuple(ctx.out_shape)))
