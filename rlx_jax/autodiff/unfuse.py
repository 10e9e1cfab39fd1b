"""The fused IR ops written as the primitive IR ops they stand for (RLX's ``unfuse``).

This module is the one definition of what a fused op computes. Both stages use it:

* autodiff's prepare pass splices :func:`unfuse_node` into the graph it differentiates,
  so the gradient is read off the primitives' VJP rules;
* lowering evaluates :func:`decomposition`, the same nodes as a standalone sub-graph,
  so a fused node gives the numbers of its unfused primitives.

A decomposition is ``fn(g, op, ins) -> id``: it appends nodes to ``g`` reading the fused
node's input ids ``ins`` and returns the id of the result (callers fit it to the fused
node's declared shape and dtype). Register one per op class with :func:`decomposes`.
"""

from __future__ import annotations

import functools
from typing import Callable

from rlx_jax.ir import Graph, Shape
from rlx_jax.ir.op import ActivationKind, MaskKind
from rlx_jax.ir.ops_attention import Attention, Rope
from rlx_jax.ir.ops_fused import (
    FusedAttentionBlock, FusedMatMulBiasAct, FusedResidualLN, FusedResidualRmsNorm, FusedSwiGLU,
    FusedTransformerLayer,
)
from rlx_jax.ir.ops_leaf import Input
from rlx_jax.ir.ops_norm import LayerNorm, RmsNorm
from rlx_jax.ir.ops_shape import Narrow

from . import emit as E
from .rules_linalg import matmul

#: fused op class -> its decomposition ``fn(g, op, ins) -> id``
DECOMPOSITIONS: dict[type, Callable] = {}


def decomposes(op_class: type):
    """Register the decorated function as the decomposition of ``op_class``."""

    def deco(fn):
        if op_class in DECOMPOSITIONS:
            raise ValueError(f"a decomposition of {op_class.__name__} is already registered")
        DECOMPOSITIONS[op_class] = fn
        return fn

    return deco


def is_fused(op) -> bool:
    """Whether ``op`` (an op or op class) has a decomposition."""
    return (op if isinstance(op, type) else type(op)) in DECOMPOSITIONS


def unfuse(g, op, ins) -> int:
    """Append the decomposition of ``op`` reading ``ins`` to ``g``; the result's id."""
    return DECOMPOSITIONS[type(op)](g, op, list(ins))


def unfuse_node(g, op, ins, out_shape: Shape) -> int:
    """:func:`unfuse`, with the result cast and reshaped to ``out_shape`` (the fused
    node's declared shape)."""
    return E.as_shape(g, unfuse(g, op, ins), out_shape)


@functools.lru_cache(maxsize=512)
def decomposition(op, in_shapes: tuple, out_shape: Shape) -> Graph:
    """The decomposition of ``op`` as a graph: one ``Input`` per operand (``x0, x1, ...``
    of ``in_shapes``, in order) and one output of ``out_shape``. Cached: ops and shapes
    are immutable."""
    g = Graph(type(op).__name__)
    ins = [g.add_node(Input(name=f"x{i}"), (), s) for i, s in enumerate(in_shapes)]
    g.set_outputs([unfuse_node(g, op, ins, out_shape)])
    return g


# -- the decompositions ------------------------------------------------------------------

@decomposes(FusedMatMulBiasAct)
def _matmul_bias_act(g, op, ins):
    # act(x @ w + bias); identity when activation is None
    x, w, b = ins
    y = E.add(g, matmul(g, x, w), b)
    return y if op.activation is None else E.act(g, op.activation, y)


def _residual(g, op, ins):
    """(x + residual [+ bias], gamma, beta) from ``[x, residual, (bias), gamma, beta]``."""
    if op.has_bias:
        return E.add(g, E.add(g, ins[0], ins[1]), ins[2]), ins[3], ins[4]
    return E.add(g, ins[0], ins[1]), ins[2], ins[3]


@decomposes(FusedResidualLN)
def _residual_ln(g, op, ins):
    h, gamma, beta = _residual(g, op, ins)
    return g.add_node(LayerNorm(axis=E.shape(g, h).rank - 1, eps=op.eps), (h, gamma, beta))


@decomposes(FusedResidualRmsNorm)
def _residual_rms_norm(g, op, ins):
    h, gamma, beta = _residual(g, op, ins)
    return g.add_node(RmsNorm(axis=E.shape(g, h).rank - 1, eps=op.eps), (h, gamma, beta))


@decomposes(FusedSwiGLU)
def _swiglu(g, op, ins):
    # [..., 2F] -> silu(gate) * up; up is the low half, gate the high half (swapped
    # when gate_first)
    (x,) = ins
    r = E.shape(g, x).rank
    n = E.dims(g, x)[-1] // 2
    lo = g.add_node(Narrow(axis=r - 1, start=0, len=n), (x,))
    hi = g.add_node(Narrow(axis=r - 1, start=n, len=n), (x,))
    up, gate = (hi, lo) if op.gate_first else (lo, hi)
    y = E.mul(g, E.act(g, ActivationKind.Silu, gate), up)
    return y if op.cast_to is None else E.cast(g, y, op.cast_to)


def keep_mask(g, mask, b, s) -> int:
    """RLX's Custom keep-mask as ``[B, S]``: the first ``B * S`` elements of ``mask`` in
    row-major order (RLX's kernels read that prefix of the buffer, so e.g. a
    ``[B, H, S, S]`` mask is accepted with that meaning)."""
    if tuple(E.dims(g, mask)) == (b, s):
        return mask
    flat = E.reshape(g, mask, (E.numel(E.dims(g, mask)),))
    return E.reshape(g, g.add_node(Narrow(axis=0, start=0, len=b * s), (flat,)), (b, s))


def attention_block(g, hidden, qkv_w, out_w, mask, qkv_b, out_b, cos, sin, nh, hd) -> int:
    """hidden ``[B, S, H*D]`` -> QKV projection -> split q, k, v -> [NeoX RoPE on q, k,
    applied on the ``[B, H, S, D]`` view with ``n_rot = D``] -> attention with the Custom
    keep-mask -> output projection ``[B, S, H*D]``."""
    b, s, _ = E.dims(g, hidden)
    qkv = matmul(g, hidden, qkv_w)
    if qkv_b is not None:
        qkv = E.add(g, qkv, qkv_b)
    w = nh * hd
    parts = [g.add_node(Narrow(axis=2, start=i * w, len=w), (qkv,)) for i in range(3)]
    if cos is not None:
        for i in (0, 1):
            t = E.transpose(g, E.reshape(g, parts[i], (b, s, nh, hd)), (0, 2, 1, 3))
            t = g.add_node(Rope(head_dim=hd, n_rot=hd), (t, cos, sin))
            parts[i] = E.reshape(g, E.transpose(g, t, (0, 2, 1, 3)), (b, s, w))
    attn = Attention(num_heads=nh, head_dim=hd, mask_kind=MaskKind("Custom"), score_scale=None,
                     attn_logit_softcap=None)
    o = g.add_node(attn, (parts[0], parts[1], parts[2], keep_mask(g, mask, b, s)))
    y = matmul(g, o, out_w)
    return y if out_b is None else E.add(g, y, out_b)


@decomposes(FusedAttentionBlock)
def _attention_block(g, op, ins):
    # inputs: hidden, qkv_w, out_w, mask, [qkv_b, out_b] if has_bias, [cos, sin] if has_rope
    hidden, qkv_w, out_w, mask = ins[:4]
    i = 4
    qkv_b = out_b = cos = sin = None
    if op.has_bias:
        qkv_b, out_b = ins[i], ins[i + 1]
        i += 2
    if op.has_rope:
        cos, sin = ins[i], ins[i + 1]
    return attention_block(g, hidden, qkv_w, out_w, mask, qkv_b, out_b, cos, sin, op.num_heads, op.head_dim)


#: FusedTransformerLayer operand names in RLX order: with biases (14), without (10), and
#: RLX's 8-input form without the LayerNorm betas (zero betas)
_LAYER_INPUTS_BIAS = ("hidden", "qkv_w", "qkv_b", "out_w", "out_b", "ln1_g", "ln1_b", "fc1_w", "fc1_b",
                      "fc2_w", "fc2_b", "ln2_g", "ln2_b", "mask")
_LAYER_INPUTS_10 = ("hidden", "qkv_w", "out_w", "ln1_g", "ln1_b", "fc1_w", "fc2_w", "ln2_g", "ln2_b", "mask")
_LAYER_INPUTS_8 = ("hidden", "qkv_w", "out_w", "ln1_g", "fc1_w", "fc2_w", "ln2_g", "mask")


@decomposes(FusedTransformerLayer)
def _transformer_layer(g, op, ins):
    # post-LN: h1 = LN1(attention_block(x) + x); out = LN2(fc2(act(fc1(h1))) + h1)
    names = _LAYER_INPUTS_BIAS if op.has_bias else (_LAYER_INPUTS_10 if len(ins) == 10 else _LAYER_INPUTS_8)
    p = dict(zip(names, ins))
    x = p["hidden"]
    xs = E.shape(g, x)
    axis = xs.rank - 1

    def beta(name):
        if p.get(name) is not None:
            return p[name]
        return E.zeros(g, Shape((xs.dims[-1],), xs.dtype))

    attn = attention_block(g, x, p["qkv_w"], p["out_w"], p["mask"], p.get("qkv_b"), p.get("out_b"),
                           None, None, op.num_heads, op.head_dim)
    h1 = g.add_node(LayerNorm(axis=axis, eps=op.eps1), (E.add(g, attn, x), p["ln1_g"], beta("ln1_b")))
    f = matmul(g, h1, p["fc1_w"])
    if p.get("fc1_b") is not None:
        f = E.add(g, f, p["fc1_b"])
    f = matmul(g, E.act(g, op.activation, f), p["fc2_w"])
    if p.get("fc2_b") is not None:
        f = E.add(g, f, p["fc2_b"])
    return g.add_node(LayerNorm(axis=axis, eps=op.eps2), (E.add(g, f, h1), p["ln2_g"], beta("ln2_b")))
