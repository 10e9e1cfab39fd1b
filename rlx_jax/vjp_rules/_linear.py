"""The linear map that ends an op ending in a matmul (``swiglu_linear``,
``rms_norm_linear``): ``out = y @ W`` with y [..., K] the op's activation and W [K, O],
differentiated with y recomputed in the backward rather than kept.

Both pieces follow ``y @ W`` as JAX differentiates it: products in the promoted dtype of
their operands at JAX's default precision."""

from __future__ import annotations

import jax.numpy as jnp


def linear_tangent(y, ty, w, tw):
    """d(y @ W) = ty W + y tW, in the promoted dtype of y and W."""
    return (jnp.matmul(ty, w) + jnp.matmul(y, tw)).astype(jnp.result_type(y.dtype, w.dtype))


def linear_weight_grad(y, ct, dtype):
    """dW = sum over the leading axes of y^T ct: [K, O] in ``dtype`` (W's)."""
    lead = tuple(range(y.ndim - 1))
    return jnp.tensordot(y, ct, axes=(lead, lead)).astype(dtype)
