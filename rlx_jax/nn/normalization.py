"""``RMSNorm`` and ``LayerNorm``: ``flax.nnx``'s modules (same constructor, parameters
``scale`` [num_features] and ``bias`` [num_features]) whose normalisation runs the fused
``rlx_jax.ops`` kernels.

Dtypes follow flax: the input and the parameters are first promoted together by the
module's ``promote_dtype`` (to ``dtype`` when given, else to their common type: bf16
inputs with f32 parameters give an f32 result), then normalised. The fused path covers
the usual configuration (statistics and features over the last axis, no ``mask``, no
``axis_name``); any other configuration runs flax's own implementation, so every
flax argument keeps its meaning.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rlx_jax import ops


def _last_axis_only(axes, ndim: int) -> bool:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return len(axes) == 1 and axes[0] % max(ndim, 1) == ndim - 1


def _fused_ok(module, x, mask) -> bool:
    return (mask is None and module.axis_name is None and x.ndim >= 1
            and _last_axis_only(module.reduction_axes, x.ndim) and _last_axis_only(module.feature_axes, x.ndim))


class RMSNorm(nnx.RMSNorm):
    """``nnx.RMSNorm`` on ``rlx_jax.ops.rms_norm``:
    ``y = x * rsqrt(mean(x^2, -1) + epsilon) * scale`` (statistics in f32)."""

    def __call__(self, x, mask=None):
        if not _fused_ok(self, x, mask):
            return super().__call__(x, mask)
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        gamma = scale if scale is not None else jnp.ones((x.shape[-1],), x.dtype)
        return ops.rms_norm(x, gamma, eps=self.epsilon)


class LayerNorm(nnx.LayerNorm):
    """``nnx.LayerNorm`` on ``rlx_jax.ops.layer_norm``:
    ``y = (x - mean) * rsqrt(var + epsilon) * scale + bias`` over the last axis (biased
    variance, statistics in f32)."""

    def __call__(self, x, *, mask=None):
        if not _fused_ok(self, x, mask):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        gamma = scale if scale is not None else jnp.ones((x.shape[-1],), x.dtype)
        return ops.layer_norm(x, gamma, bias, eps=self.epsilon)
