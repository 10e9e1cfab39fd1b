"""A dense reference for ``rlx_jax.ops.attention``, written independently of the kernels.

``dense_attention(q, k, v, ...)`` builds the full ``[B, H, Sq, Sk]`` score matrix in plain
``jnp``: ``s = scale * q k^T`` (``scale`` defaults to ``D ** -0.5``), softcapped to
``softcap * tanh(s / softcap)``, plus ``bias``; a key is visible where the mask kind allows
it AND the key mask (``mask[b, k] >= 0.5``) allows it AND the query's and key's segment ids
are equal; the softmax runs over the visible keys only, and a row with no visible key gives
0. ``sinks[h]`` adds one more softmax column per head, always visible, with value 0.

Shapes: q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` with ``H % Hkv == 0`` (each KV head
serves ``H // Hkv`` query heads); bias broadcastable to ``[B, H, Sq, Sk]``; mask ``[B, Sk]``;
q_segment_ids ``[B, Sq]``, kv_segment_ids ``[B, Sk]``; sinks ``[H]``. Returns ``[B, Sq, H, D]``
in f32 (f64 for f64 q).

Causal and sliding masks align the last query with the last key (query i sits at position
``i + max(Sk - Sq, 0)``) unless ``top_left=True`` (query i at position i); the sliding window
keeps keys ``pos - window <= j <= pos``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dense_attention(q, k, v, *, mask_kind="none", window=None, mask=None, bias=None, scale=None,
                    softcap=None, top_left=False, q_segment_ids=None, kv_segment_ids=None, sinks=None):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    q, k, v = (x.astype(acc) for x in (q, k, v))
    k, v = jnp.repeat(k, h // hkv, axis=2), jnp.repeat(v, h // hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (scale if scale is not None else d ** -0.5)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias.astype(acc)
    pos = np.arange(sq)[:, None] + (0 if top_left else max(sk - sq, 0))
    j = np.arange(sk)[None, :]
    vis = np.ones((sq, sk), bool)
    if mask_kind in ("causal", "sliding"):
        vis &= j <= pos
    if mask_kind == "sliding":
        vis &= j >= pos - window
    vis = jnp.asarray(vis)[None, None]
    if mask is not None:
        vis = vis & (jnp.asarray(mask)[:, None, None, :] >= 0.5)
    if q_segment_ids is not None or kv_segment_ids is not None:
        vis = vis & (jnp.asarray(q_segment_ids)[:, None, :, None] == jnp.asarray(kv_segment_ids)[:, None, None, :])
    vis = jnp.broadcast_to(vis, s.shape)
    if sinks is not None:  # one more column per row: always visible, its value row is 0
        s = jnp.concatenate([s, jnp.broadcast_to(sinks.astype(acc)[None, :, None, None], (b, h, sq, 1))], -1)
        vis = jnp.concatenate([vis, jnp.ones((b, h, sq, 1), bool)], -1)
        v = jnp.concatenate([v, jnp.zeros((b, 1, h, d), acc)], 1)
    s = jnp.where(vis, s, 0.0)
    # the row max over visible scores (-1e30 where none is visible) keeps exp in range; a
    # row with no visible key has e = 0 everywhere and gives 0 through den = 1.
    m = jax.lax.stop_gradient(jnp.max(jnp.where(vis, s, -1e30), axis=-1, keepdims=True, initial=-1e30))
    e = jnp.where(vis, jnp.exp(s - jnp.where(m > -1e29, m, 0.0)), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)
