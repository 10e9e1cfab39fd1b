"""``MultiHeadAttention``: ``flax.nnx.MultiHeadAttention`` (same constructor, same
``query`` / ``key`` / ``value`` / ``out`` parameters, grouped-query through
``num_kv_heads``) whose attention runs ``rlx_jax.ops.attention``, plus optional rotary
position embedding of the projected queries and keys.

``rlx_attention_fn`` is the attention function itself, with the signature flax passes
to ``attention_fn`` (query [..., Sq, H, D], key / value [..., Sk, Hkv, D]).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx_jax import ops


def rope_tables(length: int, rope_dims: int, theta: float):
    """NeoX RoPE tables for positions 0..length-1: cos, sin [length, rope_dims / 2] with
    angle[s, i] = s * theta^(-2 i / rope_dims) (f32). A static length builds them in f64 with
    NumPy (constants); a symbolic one (jax.export) with jnp in f32, the angles rounded once
    more, since its positions exist only when the program runs."""
    inv = 1.0 / (theta ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims))
    if not isinstance(length, (int, np.integer)):
        ang = jnp.arange(length, dtype=jnp.float32)[:, None] * jnp.asarray(inv, jnp.float32)[None, :]
        return jnp.cos(ang), jnp.sin(ang)
    ang = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def _apply_rope(x, theta, rope_dims):
    """x [B, S, H, D] -> NeoX RoPE over the first rope_dims of each head (positions 0..S-1)."""
    b, s, h, d = x.shape
    cos, sin = rope_tables(s, rope_dims, theta)
    return ops.rope(x.reshape(b, s, h * d), cos, sin, head_dim=d, n_rot=rope_dims).reshape(b, s, h, d)


def _as_4d(x):
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])


def rlx_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                     dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                     promote_dtype=None, is_causal=False, *, rope_theta=None, rope_dims=None):
    """flax's ``dot_product_attention`` contract on ``rlx_jax.ops.attention``:
    ``softmax(q k^T / sqrt(D) + bias, masked) v`` per head.

    query [..., Sq, H, D]; key, value [..., Sk, Hkv, D] (Hkv dividing H); ``mask``
    (True keeps) and ``bias`` broadcast to [..., H, Sq, Sk]. ``is_causal`` is flax's and
    jax.nn's: query i sees keys j <= i (aligned top-left). Attention dropout and the
    weights' ``sow`` (``module``) need the probabilities, which the fused kernel never
    forms: asking for them raises. ``rope_theta`` rotates queries and keys first
    (positions 0..S-1, NeoX halves over the first ``rope_dims`` of each head).
    """
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError("rlx_attention_fn: attention dropout (dropout_rate > 0) is not supported by "
                                  "the fused attention kernel; use dropout_rate=0 or deterministic=True")
    if module is not None:
        raise NotImplementedError("rlx_attention_fn: sow_weights needs the attention probabilities, which the "
                                  "fused kernel does not form")
    if dtype is not None:
        query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
    batch = query.shape[:-3]
    q, k, v = _as_4d(query), _as_4d(key), _as_4d(value)
    bsz, sq, h, d = q.shape
    sk = k.shape[1]
    if rope_theta is not None:
        n_rot = d if rope_dims is None else int(rope_dims)
        q, k = _apply_rope(q, rope_theta, n_rot), _apply_rope(k, rope_theta, n_rot)
    mask_kind = "none"
    if is_causal and sq == sk and mask is None and bias is None:
        mask_kind = "causal"  # the same as top-left when the lengths agree: the kernel skips masked tiles
    elif is_causal:
        tril = jnp.tril(jnp.ones((sq, sk), bool))
        mask = tril if mask is None else jnp.logical_and(mask, tril)
    add = None
    if bias is not None:
        add = jnp.broadcast_to(jnp.asarray(bias, jnp.float32), batch + (h, sq, sk)).reshape(bsz, h, sq, sk)
    empty = None
    if mask is not None:
        # flax's masking: a masked score becomes the dtype's most negative value
        keep = jnp.broadcast_to(jnp.asarray(mask, bool), batch + (h, sq, sk)).reshape(bsz, h, sq, sk)
        # A row with no visible key then has Sk equal scores: flax's softmax is uniform and
        # the row is the mean of the values, constant in q and k. The kernel's backward
        # would form its probabilities from a log-sum-exp in which log(Sk) rounds away next
        # to the most negative value (each probability read as 1), so such rows run
        # unmasked and are replaced by the mean below: [bsz, h, sq]
        empty = jnp.logical_not(jnp.any(keep, axis=-1))
        keep = jnp.logical_or(keep, empty[..., None])
        big_neg = jnp.finfo(q.dtype).min
        add = jnp.where(keep, 0.0 if add is None else add, big_neg)
    if add is not None:
        add = add.astype(q.dtype)
    out = ops.attention(q, k, v, mask_kind=mask_kind, bias=add)
    if empty is not None:
        # query head i reads kv head i // (H / Hkv), as jax.nn.dot_product_attention
        mean_v = jnp.repeat(jnp.mean(v.astype(jnp.float32), axis=1), h // k.shape[2], axis=1)   # [bsz, h, d]
        out = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], mean_v[:, None].astype(out.dtype), out)
    return out.reshape(batch + (sq, h, d))


class MultiHeadAttention(nnx.MultiHeadAttention):
    """``nnx.MultiHeadAttention`` on ``rlx_jax.ops.attention``.

    Arguments as ``nnx.MultiHeadAttention`` (``num_heads``, ``in_features``,
    ``qkv_features``, ``out_features``, ``num_kv_heads``, ``in_kv_features``, ``dtype``,
    ``param_dtype``, ``kernel_init``, ``use_bias``, ``normalize_qk``, ``decode``, ...;
    ``attention_fn`` is this module's), plus:

    - ``rope_theta``: rotary position embedding base (None: no RoPE); queries and keys
      are rotated after their projections (and ``normalize_qk``), positions 0..S-1;
    - ``rope_dims``: how many dims of each head rotate (default: all; even).

    Attention dropout is not supported (``dropout_rate`` must be 0 unless calls are
    deterministic); RoPE is not supported with ``decode=True`` (the cached query's
    position is not known to the attention function).
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None,
                 in_kv_features: int | None = None, *, rope_theta: float | None = None,
                 rope_dims: int | None = None, **kwargs):
        if "attention_fn" in kwargs:
            raise TypeError("MultiHeadAttention: attention_fn is rlx_jax's fused attention; use "
                            "flax.nnx.MultiHeadAttention for another attention function")
        if rope_theta is not None and not rope_theta > 0:
            raise ValueError(f"MultiHeadAttention: rope_theta must be positive, got {rope_theta}")
        fn = functools.partial(rlx_attention_fn, rope_theta=rope_theta, rope_dims=rope_dims)
        super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features,
                         attention_fn=fn, **kwargs)
        if rope_dims is not None and not (0 < rope_dims <= self.head_dim and rope_dims % 2 == 0):
            raise ValueError(f"MultiHeadAttention: rope_dims must be even and in (0, head_dim={self.head_dim}], "
                             f"got {rope_dims}")
        self.rope_theta = rope_theta
        self.rope_dims = rope_dims

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, decode=None, **kwargs):
        if self.rope_theta is not None and (decode if decode is not None else self.decode):
            raise NotImplementedError("MultiHeadAttention: rope_theta with decode=True is not supported")
        return super().__call__(inputs_q, inputs_k, inputs_v, decode=decode, **kwargs)
