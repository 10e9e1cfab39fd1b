"""Norms, attention, RoPE, conv/pool, loss, cumsum, gather, complex |z|^2.

These are fused-op families: the maths lives once in ``rlx_jax.vjp_rules.<family>``
and is reached through ``rlx_jax.ops.<fn>`` (so ``jax.grad`` of a lowered graph uses
the fused backward kernels). The rules here only translate RLX attributes and
layouts. ``rlx_jax.ops`` is imported when a rule runs, not at import time.
ConvTranspose2d and AxialRope2d are not fused families and are written here.
"""

from __future__ import annotations

import importlib

import numpy as np

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .registry import enum_name, lowering_rule


def fused(name: str):
    """``rlx_jax.ops.<name>`` (imported at call time, so the IR imports stay light)."""
    return getattr(importlib.import_module("rlx_jax.ops"), name)


def index_array(ix):
    """RLX indices are f32-encoded (or integer): -> int32. A float index converts as RLX's
    ``as usize`` does: truncated toward zero (2.7 -> 2), negatives saturating to 0. Values
    past int32's range saturate rather than wrap (a u32 index of 3e9 must not read row 0),
    so they stay out of range: clipped to the last row, or no class."""
    from rlx_jax.vjp_rules._vocab_parallel import saturate_to_int32

    if jnp.issubdtype(ix.dtype, jnp.integer):
        return saturate_to_int32(ix)
    # 2**31 - 128: the largest f32 below 2**31, so the conversion cannot overflow
    return jnp.clip(jnp.trunc(ix), 0, 2.0**31 - 128).astype(jnp.int32)


def class_labels(labels, classes: int):
    """RLX class ids (f32-encoded or integer) -> int32, every id outside [0, classes)
    mapped to -1: RLX's cross-entropy gives such rows loss 0 and no gradient, which is
    ``rlx_jax.ops``' ``ignore_index`` rule with ``ignore_index=-1``."""
    ix = index_array(labels)
    return jnp.where((ix >= 0) & (ix < classes), ix, -1)


# ---- norms ---------------------------------------------------------------------------

def layer_norm(x, gamma, beta, axis, eps):
    """RLX LayerNorm over one ``axis`` (gamma, beta [x.shape[axis]])."""
    return fused("layer_norm")(x, gamma, beta, axis=int(axis), eps=float(eps))


def rms_norm(x, gamma, beta, axis, eps):
    """RLX RmsNorm over one ``axis`` (gamma, beta [x.shape[axis]])."""
    return fused("rms_norm")(x, gamma, beta, axis=int(axis), eps=float(eps))


@lowering_rule(ir.LayerNorm)
def _layer_norm(op, args, ctx):
    # (x - mean) * rsqrt(var + eps) * gamma + beta over `axis` (gamma, beta [x.shape[axis]]).
    x, gamma, beta = args
    return ctx.cast_out(layer_norm(x, gamma, beta, op.axis, op.eps))


@lowering_rule(ir.RmsNorm)
def _rms_norm(op, args, ctx):
    # x * rsqrt(mean(x^2) + eps) * gamma + beta over `axis`; a node may declare the
    # row-flattened output [prod(leading), H].
    x, gamma = args[0], args[1]
    beta = args[2] if len(args) > 2 else None
    y = rms_norm(x, gamma, beta, op.axis, op.eps)
    if ctx.out_shape is not None and None not in ctx.out_shape and y.shape != ctx.out_shape:
        y = y.reshape(ctx.out_shape)
    return ctx.cast_out(y)


@lowering_rule(ir.GroupNorm)
def _group_norm(op, args, ctx):
    # NCHW; statistics over (C / num_groups) x H x W per sample and group.
    x, gamma, beta = args
    return ctx.cast_out(fused("group_norm")(x, gamma, beta, num_groups=int(op.num_groups),
                                            eps=float(op.eps)))


@lowering_rule(ir.BatchNormInference)
def _batch_norm_inference(op, args, ctx):
    # (x - mean) * rsqrt(var + eps) * gamma + beta, channel axis 1.
    x, gamma, beta, mean, var = args
    return ctx.cast_out(fused("batch_norm_inference")(x, gamma, beta, mean, var,
                                                      eps=float(op.eps)))


@lowering_rule(ir.LayerNorm2d)
def _layer_norm_2d(op, args, ctx):
    # NCHW: normalise across channels at each spatial position (SAM / candle).
    x, gamma, beta = args
    xt = jnp.moveaxis(x, 1, -1)
    y = layer_norm(xt, gamma, beta, -1, op.eps)
    return ctx.cast_out(jnp.moveaxis(y, -1, 1))


# ---- attention / rope ------------------------------------------------------------------

def _to_bshd(t, num_heads, head_dim, bhsd):
    """RLX attention operand -> [B, S, H, D]; returns the inverse transform."""
    if t.ndim == 2:  # [S, H*D]
        y = t.reshape(1, t.shape[0], -1, head_dim)
        return y, lambda o: o.reshape(o.shape[1], -1)
    if t.ndim == 3:  # [B, S, H*D]
        y = t.reshape(t.shape[0], t.shape[1], -1, head_dim)
        return y, lambda o: o.reshape(o.shape[0], o.shape[1], -1)
    if t.ndim == 4:
        if bhsd:
            return jnp.swapaxes(t, 1, 2), lambda o: jnp.swapaxes(o, 1, 2)
        return t, lambda o: o
    raise ValueError(f"attention operands must have rank 2, 3 or 4, got shape {t.shape}")


def attention_layout(q, num_heads):
    """RLX's rule: rank 4 is [B, H, S, D] when dim 1 equals num_heads, else [B, S, H, D]."""
    return q.ndim == 4 and q.shape[1] == num_heads


def attention_kwargs(mask_kind, extra, score_scale, softcap):
    """``rlx_jax.ops.attention`` keyword arguments for an RLX MaskKind."""
    kind = enum_name(mask_kind)
    kw = {"scale": None if score_scale is None else float(score_scale),
          "softcap": None if softcap is None else float(softcap)}
    if kind == "None":
        kw["mask_kind"] = "none"
    elif kind == "Causal":
        kw["mask_kind"] = "causal"
    elif kind == "SlidingWindow":
        kw["mask_kind"] = "sliding"
        kw["window"] = int(mask_kind.window)
    elif kind == "Custom":
        kw["mask_kind"] = "none"
        kw["mask"] = extra
    elif kind == "Bias":
        kw["mask_kind"] = "none"
        kw["bias"] = extra
    else:
        raise NotImplementedError(f"unknown attention mask kind {kind!r}")
    return kw


def attention(q, k, v, extra, *, num_heads, head_dim, mask_kind, score_scale=None,
              softcap=None, segment_ids=None, sinks=None):
    """RLX Attention in any of its layouts through ``rlx_jax.ops.attention``;
    ``segment_ids``: (q ids [B, Sq], kv ids [B, Sk]) or None; ``sinks``: [H] or None."""
    bhsd = attention_layout(q, num_heads)
    q4, back = _to_bshd(q, num_heads, head_dim, bhsd)
    k4, _ = _to_bshd(k, num_heads, head_dim, bhsd)
    v4, _ = _to_bshd(v, num_heads, head_dim, bhsd)
    kw = attention_kwargs(mask_kind, extra, score_scale, softcap)
    # RLX's masks may have size-1 dims (a bias shared by the batch or the heads, a keep mask
    # shared by the batch); the op takes them whole: [B, H, Sq, Sk] and [B, Sk]
    (b, sq, h, _), sk = q4.shape, k4.shape[1]
    if kw.get("bias") is not None:
        kw["bias"] = jnp.broadcast_to(kw["bias"], (b, h, sq, sk))
    if kw.get("mask") is not None:
        kw["mask"] = jnp.broadcast_to(kw["mask"], (b, sk))
    if segment_ids is not None:
        kw.update(q_segment_ids=segment_ids[0], kv_segment_ids=segment_ids[1])
    if sinks is not None:
        kw["sinks"] = sinks
    return back(fused("attention")(q4, k4, v4, **kw))


@lowering_rule(ir.Attention)
def _attention(op, args, ctx):
    # softmax(mask(softcap(q.k * scale))) . v per head; scale = score_scale or
    # 1/sqrt(head_dim); Custom: [B, Sk] keep mask; Bias: additive [B, H, Sq, Sk].
    # Optional segment ids (q [B, Sq], kv [B, Sk]) and sinks [H] follow the mask.
    q, k, v, extra, seg, sinks = op.split_inputs(args)
    out = attention(q, k, v, extra, num_heads=int(op.num_heads), head_dim=int(op.head_dim),
                    mask_kind=op.mask_kind, score_scale=getattr(op, "score_scale", None),
                    softcap=getattr(op, "attn_logit_softcap", None), segment_ids=seg, sinks=sinks)
    return ctx.cast_out(out)


def rope(x, cos, sin, head_dim, n_rot):
    return fused("rope")(x, cos, sin, head_dim=int(head_dim), n_rot=int(n_rot))


@lowering_rule(ir.Rope)
def _rope(op, args, ctx):
    # NeoX: in each head the first n_rot dims rotate as two halves, the rest pass. A rotated
    # projection of an RmsNorm may already be computed by that norm's rope_split
    from .linalg import split_rope_part

    rotated = split_rope_part(ctx)
    if rotated is not None:
        return ctx.cast_out(rotated)
    x, cos, sin = args
    return ctx.cast_out(rope(x, cos, sin, op.head_dim, op.n_rot))


# ---- conv / pool --------------------------------------------------------------------------

def _pair(v, default):
    v = tuple(int(a) for a in (v or ()))
    if not v:
        return default
    return v if len(v) == 2 else (v[0], v[0])


@lowering_rule(ir.Conv)
def _conv(op, args, ctx):
    # NCHW input, OIHW weight [C_out, C_in/groups, kH, kW], no bias.
    x, w = args
    out = fused("conv2d")(x, w, stride=_pair(op.stride, (1, 1)), padding=_pair(op.padding, (0, 0)),
                          dilation=_pair(op.dilation, (1, 1)), groups=int(op.groups))
    return ctx.cast_out(out)


def conv_transpose2d(x, w, stride, padding, dilation, output_padding, groups):
    """PyTorch ConvTranspose2d: x [N, C_in, H, W], w [C_in, C_out/groups, kH, kW];
    H_out = (H - 1) * s - 2p + d (k - 1) + output_padding + 1."""
    c_in, c_out_g, kh, kw = w.shape
    g = groups
    # -> OIHW of the equivalent direct conv: [C_out, C_in/g, kH, kW], spatially flipped
    wt = w.reshape(g, c_in // g, c_out_g, kh, kw).transpose(0, 2, 1, 3, 4)
    wt = wt.reshape(g * c_out_g, c_in // g, kh, kw)[:, :, ::-1, ::-1]
    pads = []
    for k, p, d, op_ in zip((kh, kw), padding, dilation, output_padding):
        lo = d * (k - 1) - p
        pads.append((lo, lo + op_))
    return lax.conv_general_dilated(
        x, wt, window_strides=(1, 1), padding=pads, lhs_dilation=tuple(stride),
        rhs_dilation=tuple(dilation), dimension_numbers=("NCHW", "OIHW", "NCHW"),
        feature_group_count=g)


@lowering_rule(ir.ConvTranspose2d)
def _conv_transpose2d(op, args, ctx):
    x, w = args
    out = conv_transpose2d(x, w, _pair(op.stride, (1, 1)), _pair(op.padding, (0, 0)),
                           _pair(op.dilation, (1, 1)), _pair(op.output_padding, (0, 0)),
                           int(op.groups))
    return ctx.cast_out(out)


@lowering_rule(ir.Pool)
def _pool(op, args, ctx):
    # NCHW 2-D pooling (kind Max or Mean): the pool family's max_pool2d / avg_pool2d.
    x = args[0]
    kind = enum_name(op.kind)
    ks = _pair(op.kernel_size, None)
    kw = dict(kernel_size=ks, stride=_pair(op.stride, ks), padding=_pair(op.padding, (0, 0)))
    if kind == "Max" and jnp.issubdtype(x.dtype, jnp.integer):
        return ctx.cast_out(_integer_max_pool2d(x, **kw))
    if kind == "Max":
        return ctx.cast_out(fused("max_pool2d")(x, **kw))
    if kind == "Mean":
        return ctx.cast_out(fused("avg_pool2d")(x, **kw))
    raise NotImplementedError(f"Pool kind {kind} (RLX pools are Max or Mean)")


def _integer_max_pool2d(x, kernel_size, stride, padding):
    """Max over each window of an integer x [N, C, H, W], the padding the dtype's minimum
    (the integer -inf: a window of padding only gives it). Integers have no gradient, so
    XLA's window reduction serves; the fused op's kernels are floating point."""
    low = jnp.iinfo(x.dtype).min
    (ph, pw) = padding
    return lax.reduce_window(x, jnp.array(low, x.dtype), lax.max, (1, 1, *kernel_size), (1, 1, *stride),
                             ((0, 0), (0, 0), (ph, ph), (pw, pw)))


# ---- loss / scans / indexing -----------------------------------------------------------

@lowering_rule(ir.SoftmaxCrossEntropyWithLogits)
def _softmax_xent(op, args, ctx):
    # loss[n] = logsumexp(logits[n]) - logits[n, labels[n]]; labels f32-encoded.
    logits, labels = args
    classes = logits.shape[-1]
    return ctx.cast_out(fused("softmax_cross_entropy")(logits, class_labels(labels, classes), ignore_index=-1))


@lowering_rule(ir.Cumsum)
def _cumsum(op, args, ctx):
    # Inclusive cumulative sum along `axis`; exclusive shifts it so out[0] = 0.
    return ctx.cast_out(fused("cumsum")(args[0], axis=int(op.axis), exclusive=bool(op.exclusive)))


@lowering_rule(ir.Gather)
def _gather(op, args, ctx):
    # RLX Gather: table [*lead, V, *post], idx [*idx] -> [*idx, *post], reading the
    # first slice along lead (a table with a zero-sized lead dim has none: zeros).
    table, idx = args
    lead = table.shape[: int(op.axis)]
    if 0 in lead:
        return ctx.cast_out(jnp.zeros(idx.shape + table.shape[len(lead) + 1:], table.dtype))
    first = table[(0,) * len(lead)]
    return ctx.cast_out(fused("gather")(first, index_array(idx), axis=0, mode="clip"))


@lowering_rule(ir.ComplexNormSq)
def _complex_norm_sq(op, args, ctx):
    # |z|^2 = re^2 + im^2 (C64 -> F32).
    return ctx.cast_out(fused("complex_norm_sq")(args[0]))


# ---- SAM2 axial 2-D RoPE (not a fused family) ---------------------------------------------

def axial_rope_tables(seq, end_x, end_y, head_dim, theta, repeat_factor):
    """cos/sin tables [seq, head_dim/4] for the x and y axes. Token t sits at grid cell
    p = t // repeat_factor, column p % end_x, row p // end_x; frequency c is
    theta^(-4c / head_dim)."""
    q4 = head_dim // 4
    rep = max(int(repeat_factor), 1)
    if seq != end_x * end_y * rep:
        raise ValueError(f"AxialRope2d: seq {seq} != end_x * end_y * repeat_factor "
                         f"({end_x} * {end_y} * {rep})")
    freqs = (1.0 / np.power(np.float32(theta), (4 * np.arange(q4)).astype(np.float32)
                            / np.float32(head_dim))).astype(np.float32)
    pos = np.arange(seq) // rep
    tx = (pos % end_x).astype(np.float32)[:, None] * freqs
    ty = (pos // end_x).astype(np.float32)[:, None] * freqs
    return np.cos(tx), np.sin(tx), np.cos(ty), np.sin(ty)


@lowering_rule(ir.AxialRope2d)
def _axial_rope2d(op, args, ctx):
    # x [B, S, H*D]: per head, interleaved pairs (2c, 2c+1) of the first half rotate by
    # the token's column angle, those of the second half by its row angle.
    x = args[0]
    b, s, _ = x.shape
    hd, nh = int(op.head_dim), int(op.num_heads)
    cx, sx, cy, sy = (jnp.asarray(t, x.dtype)[:, None, :] for t in
                      axial_rope_tables(s, int(op.end_x), int(op.end_y), hd, float(op.theta),
                                        int(op.repeat_factor)))
    xh = x.reshape(b, s, nh, 2, hd // 4, 2)  # [.., half, pair c, (even, odd)]
    x0, x1 = xh[..., 0], xh[..., 1]
    cos = jnp.stack([cx, cy], axis=2)  # [S, 1, 2, q4]
    sin = jnp.stack([sx, sy], axis=2)
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    return ctx.cast_out(jnp.stack([y0, y1], axis=-1).reshape(x.shape))
