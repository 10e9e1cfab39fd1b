"""Mixture of experts: GroupedMatMul and ScatterAdd.

No per-token weight gather: GroupedMatMul sorts the tokens by expert and runs one
``lax.ragged_dot`` (a grouped GEMM) over the contiguous groups.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

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


@lowering_rule("GroupedMatMul")
def _grouped_matmul(op, args, ctx):
    x, w, idx = args
    return ctx.cast_out(grouped_matmul(x, w, idx))


def scatter_add(updates, indices, out_dim):
    """out = zeros([out_dim, *trailing]); out[indices[i]] += updates[i]."""
    idx = index_array(indices).reshape(-1)
    out = jnp.zeros((out_dim,) + updates.shape[1:], updates.dtype)
    return out.at[idx].add(updates, mode="drop")


@lowering_rule("ScatterAdd")
def _scatter_add(op, args, ctx):
    # out_dim comes from the node's declared output shape.
    updates, indices = args
    out_dim = ctx.out_shape[0]
    if out_dim is None:
        raise ValueError("ScatterAdd output dim 0 is dynamic and unbound")
    return ctx.cast_out(scatter_add(updates, indices, int(out_dim)))
