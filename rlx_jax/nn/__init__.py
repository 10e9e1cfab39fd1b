"""Flax NNX modules on rlx_jax's fused ops (the optional ``[flax]`` extra).

Same constructor arguments and parameter names as ``flax.nnx``'s modules, so a Flax
model switches by changing an import::

    from rlx_jax import nn as rnn
    norm = rnn.RMSNorm(512, rngs=nnx.Rngs(0))            # was nnx.RMSNorm
    attn = rnn.MultiHeadAttention(8, 512, num_kv_heads=2, rope_theta=10000.0, rngs=rngs)

- ``RMSNorm``, ``LayerNorm``: subclasses of ``nnx.RMSNorm`` / ``nnx.LayerNorm``; the
  normalisation over the last axis runs ``rlx_jax.ops.rms_norm`` / ``layer_norm``.
- ``MultiHeadAttention``: a subclass of ``nnx.MultiHeadAttention`` (grouped-query
  through ``num_kv_heads``) whose attention runs ``rlx_jax.ops.attention``, with
  optional rotary position embedding (``rope_theta``, ``rope_dims``).
- ``softmax_cross_entropy_with_integer_labels`` (optax's signature) and
  ``FusedLinearCrossEntropy`` (an output projection fused with the loss: no [N, V]
  logits in memory).
"""

from __future__ import annotations

try:
    import flax.nnx  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without flax
    raise ImportError("rlx_jax.nn needs flax: pip install 'rlx_jax[flax]'") from exc

from rlx_jax.nn.attention import MultiHeadAttention, rlx_attention_fn, rope_tables
from rlx_jax.nn.losses import FusedLinearCrossEntropy, softmax_cross_entropy_with_integer_labels
from rlx_jax.nn.normalization import LayerNorm, RMSNorm

__all__ = [
    "RMSNorm",
    "LayerNorm",
    "MultiHeadAttention",
    "rlx_attention_fn",
    "rope_tables",
    "softmax_cross_entropy_with_integer_labels",
    "FusedLinearCrossEntropy",
]
