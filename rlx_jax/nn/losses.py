"""Cross-entropy losses on rlx_jax's fused kernels.

- ``softmax_cross_entropy_with_integer_labels(logits, labels)``: optax's function of the
  same name and signature (logits [..., V], integer labels [...] -> loss [...]), on
  ``rlx_jax.ops.softmax_cross_entropy`` (one fused pass forward and backward).
- ``FusedLinearCrossEntropy``: an output projection fused with the loss, the
  parameter ``kernel`` [in_features, num_classes] named and initialised as
  ``nnx.Linear``'s (``use_bias=False``), so ``loss = module(hidden, labels)`` equals
  ``optax.softmax_cross_entropy_with_integer_labels(nnx.Linear(...)(hidden), labels)``
  without materialising the [N, V] logits.

Labels follow ``rlx_jax.ops.softmax_cross_entropy``'s rules (integers only; see its
docstring for out-of-range labels).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from rlx_jax import ops


def _check_labels(labels, fn):
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{fn}: labels must be integers, got {labels.dtype}")
    return labels


def softmax_cross_entropy_with_integer_labels(logits, labels):
    """``logsumexp(logits, -1) - take(logits, labels, -1)`` per position: logits
    [..., V] floating, labels [...] integers -> loss [...] in the logits' dtype."""
    logits = jnp.asarray(logits)
    labels = _check_labels(labels, "softmax_cross_entropy_with_integer_labels")
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(f"softmax_cross_entropy_with_integer_labels: labels shape {labels.shape} must be "
                         f"logits' shape without its last axis {logits.shape[:-1]}")
    lead = logits.shape[:-1]
    loss = ops.softmax_cross_entropy(logits.reshape(math.prod(lead), logits.shape[-1]), labels.reshape(-1))
    return loss.reshape(lead)


class FusedLinearCrossEntropy(nnx.Module):
    """``loss[...] = cross_entropy(hidden[...] @ kernel, labels[...])`` with hidden
    [..., in_features], labels [...], computed by ``rlx_jax.ops.fused_linear_cross_entropy``
    in blocks, never holding the [N, out_features] logits.

    Arguments as ``nnx.Linear`` (without bias): ``in_features``, ``out_features`` (the
    number of classes), ``dtype`` (computation dtype; default: the common dtype of
    hidden and kernel, as flax promotes), ``param_dtype``, ``kernel_init``, ``rngs``;
    plus ``chunk_size`` (None: the op's default) and ``logits_dtype`` (None: f32 logits
    blocks; ``jnp.bfloat16`` rounds them as an unfused bf16 ``nnx.Linear`` would), passed
    to the op.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.nn.linear.default_kernel_init, chunk_size: int | None = None, logits_dtype=None,
                 rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.chunk_size = chunk_size
        self.logits_dtype = logits_dtype
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))

    def __call__(self, hidden, labels):
        hidden = jnp.asarray(hidden)
        labels = _check_labels(labels, "FusedLinearCrossEntropy")
        if hidden.shape[-1:] != (self.in_features,) or labels.shape != hidden.shape[:-1]:
            raise ValueError(f"FusedLinearCrossEntropy: hidden must be [..., {self.in_features}] and labels its "
                             f"leading shape; got hidden {hidden.shape}, labels {labels.shape}")
        kernel = self.kernel[...]
        dtype = self.dtype or jnp.result_type(hidden, kernel)
        lead = hidden.shape[:-1]
        chunk = {} if self.chunk_size is None else {"chunk_size": self.chunk_size}
        loss = ops.fused_linear_cross_entropy(hidden.reshape(-1, self.in_features).astype(dtype),
                                              kernel.astype(dtype), labels.reshape(-1),
                                              logits_dtype=self.logits_dtype, **chunk)
        return loss.reshape(lead)
