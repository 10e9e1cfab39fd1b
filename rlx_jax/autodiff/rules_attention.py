"""Attention written in primitive ops, for the gradients RLX's AttentionBackward cannot
give: a logit softcap (the op has no softcap attribute) and the additive bias of mask
kind Bias (the op yields dq / dk / dv only).

Why an expansion and not AttentionBackward: RLX's AttentionBackward carries only
``num_heads, head_dim, mask_kind, wrt`` (RLX_IR.md's backward table; the seed's
attention VJP passes nothing else, which is the known RLX bug of dropping score_scale
and softcap). A score_scale s is still exact through AttentionBackward (feed
``q * s * sqrt(D)``, scale dq back, see ``rules_nn._attention``), but
``c * tanh(s / c)`` is not a rescaling of q, so the backward op cannot express it.
Adding fields to AttentionBackward would break the contract that rlx_jax's ops are
RLX's ops field for field (a graph saved for RLX would be read with the softcap
silently dropped), so the gradient of a softcapped attention is spelled out in
primitives: it materialises the [B, H, Sq, Sk] scores (O(S^2) memory) and is differentiable
again like any primitive graph. Checked for every mask kind with a score scale and a
softcap, in every layout (tests/autodiff_cases.py ``attention_*_softcap``).

Layouts as RLX: rank 3 ``[B, S, H*D]``; rank 4 ``[B, H, S, D]`` when dim 1 equals
num_heads, else ``[B, S, H, D]``; grouped kv heads (head h reads kv head h // G).
Scores ``q.k * scale`` (scale = score_scale or 1/sqrt(D)), then ``c * tanh(s / c)``,
then the bias / mask (masked scores -1e30), then softmax over keys.
"""

from __future__ import annotations

import math

import numpy as np

from rlx_jax.ir import DType, GraphError

from . import emit as E
from .expansion import vjp_via_expansion
from .rules_linalg import matmul

_NEG = -1e30


def _to_bhsd(t, x, num_heads, head_dim, bhsd):
    ds = E.dims(t, x)
    if len(ds) == 3:
        b, s, hd = ds
        h = hd // head_dim
        return E.transpose(t, E.reshape(t, x, (b, s, h, head_dim)), (0, 2, 1, 3)), h
    if bhsd:
        return x, ds[1]
    return E.transpose(t, x, (0, 2, 1, 3)), ds[2]


def _repeat_heads(t, x, h, hkv):
    if h == hkv:
        return x
    b, _, s, d = E.dims(t, x)
    rep = h // hkv
    y = E.reshape(t, x, (b, hkv, 1, s, d))
    y = E.expand(t, y, (b, hkv, rep, s, d))
    return E.reshape(t, y, (b, h, s, d))


def emit_attention(t, op, q, k, v, extra=None, segment_ids=None, sinks=None):
    """Attention output in primitive ops (same layout as q). ``segment_ids``: (q ids
    [B, Sq], kv ids [B, Sk]) hide keys of other segments; ``sinks`` [H]: the output is
    scaled by sigmoid(lse - sink_h) (the sink's extra softmax term, with no value). Rows
    with no visible key give 0 (probabilities zeroed where hidden)."""
    qd = E.dims(t, q)
    if not all(isinstance(d, int) for d in qd + E.dims(t, k)):
        raise GraphError("primitive attention needs static shapes")
    nh, hd = op.num_heads, op.head_dim
    bhsd = len(qd) == 4 and qd[1] == nh
    q4, _ = _to_bhsd(t, q, nh, hd, bhsd)
    k4, hkv = _to_bhsd(t, k, nh, hd, bhsd)
    v4, _ = _to_bhsd(t, v, nh, hd, bhsd)
    k4, v4 = _repeat_heads(t, k4, nh, hkv), _repeat_heads(t, v4, nh, hkv)
    b, _, sq, _ = E.dims(t, q4)
    sk = E.dims(t, k4)[2]
    scale = op.score_scale if op.score_scale is not None else 1.0 / math.sqrt(hd)
    s = E.mul_s(t, matmul(t, q4, E.transpose(t, k4, (0, 1, 3, 2))), float(scale))
    if op.attn_logit_softcap is not None:
        c = float(op.attn_logit_softcap)
        s = E.mul_s(t, E.act(t, "Tanh", E.mul_s(t, s, 1.0 / c)), c)
    kind = op.mask_kind.kind
    dt = E.dtype(t, q)
    if kind == "Bias":
        s = E.add(t, s, extra)
    vis = None
    if kind in ("Causal", "SlidingWindow"):
        i = np.arange(sq)[:, None] + (sk - sq)
        j = np.arange(sk)[None, :]
        keep = j <= i
        if kind == "SlidingWindow":
            keep &= j >= i - int(op.mask_kind.window)
        vis = E.const(t, keep, DType.Bool)
    elif kind == "Custom":
        m = E.reshape(t, extra, (E.dims(t, extra)[0], 1, 1, sk))
        vis = E.cmp(t, "Ge", m, E.scalar(t, 0.5, E.dtype(t, extra)))
    hidden = [vis] if vis is not None else []
    if segment_ids is not None:
        qs, ks = segment_ids
        qs = E.reshape(t, qs, (b, 1, sq, 1))
        ks = E.reshape(t, ks, (b, 1, 1, sk))
        hidden.append(E.cmp(t, "Eq", qs, ks))
    for keep in hidden:
        s = E.where(t, keep, s, E.scalar(t, _NEG, dt))
    from rlx_jax.ir.ops_reduce import Softmax

    p = t.add_node(Softmax(axis=-1), (s,))
    if segment_ids is not None or sinks is not None:
        zero = E.scalar(t, 0.0, dt)
        for keep in hidden:  # rows with no visible key: 0, not a uniform softmax
            p = E.where(t, keep, p, zero)
    o = matmul(t, p, v4)                                     # [B, H, Sq, D]
    if sinks is not None:
        m = E.reduce(t, s, "Max", (3,), keep_dim=True)        # [B, H, Sq, 1]
        lse = E.add(t, m, E.act(t, "Log", E.sum_(t, E.act(t, "Exp", E.sub(t, s, m)), (3,), keep_dim=True)))
        sk_h = E.reshape(t, E.cast(t, sinks, dt), (1, nh, 1, 1))
        o = E.mul(t, o, E.act(t, "Sigmoid", E.sub(t, lse, sk_h)))
    if len(qd) == 3:
        return E.reshape(t, E.transpose(t, o, (0, 2, 1, 3)), qd)
    if bhsd:
        return o
    return E.transpose(t, o, (0, 2, 1, 3))


def _build(node):
    def build(t, ins):
        q, k, v, extra, seg, sinks = node.op.split_inputs(ins)
        return emit_attention(t, node.op, q, k, v, extra, seg, sinks)
    return build


def attention_softcap_vjp(g, node, dy):
    """dq, dk, dv (and d bias, d sinks) of attention with a logit softcap, segment ids or
    sinks, in primitives: the reverse sweep over :func:`emit_attention` (RLX's
    AttentionBackward has none of these fields, see the module doc); the forward value
    still comes from the Attention node. Segment ids get no gradient."""
    n = len(node.inputs)
    wrt = [0, 1, 2] + ([3] if node.op.mask_kind.kind == "Bias" else [])
    if getattr(node.op, "sinks", None):
        wrt.append(n - 1)
    return vjp_via_expansion(g, node, dy, _build(node), wrt_inputs=wrt)[:n]


def attention_bias_grad(g, node, dy):
    """d bias of mask kind Bias (the softmax's input gradient), in primitives."""
    return vjp_via_expansion(g, node, dy, _build(node), wrt_inputs=[3])[3]
