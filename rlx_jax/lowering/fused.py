"""Fused ops, lowered as the composition of their primitive rules (same numbers as the
unfused graph RLX's ``unfuse`` pass produces): FusedMatMulBiasAct, FusedResidualLN,
FusedResidualRmsNorm, FusedSwiGLU, FusedAttentionBlock, FusedTransformerLayer.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .elementwise import activation, cast
from .linalg import matmul
from .nn import attention_kwargs, fused, layer_norm, rms_norm, rope
from .registry import lowering_rule


@lowering_rule("FusedMatMulBiasAct")
def _fused_matmul_bias_act(op, args, ctx):
    # act(x @ w + bias); no activation when `activation` is None.
    x, w, b = args
    y = matmul(x, w) + b
    if op.activation is not None:
        y = activation(op.activation, y)
    return ctx.cast_out(y)


def _residual(args, has_bias):
    x, res = args[0], args[1]
    if has_bias:
        return x + res + args[2], args[3], args[4]
    return x + res, args[2], args[3]


@lowering_rule("FusedResidualLN")
def _fused_residual_ln(op, args, ctx):
    # LayerNorm(x + residual (+ bias)) over the last axis: [x, res, (bias), gamma, beta].
    h, gamma, beta = _residual(args, bool(op.has_bias))
    return ctx.cast_out(layer_norm(h, gamma, beta, -1, op.eps))


@lowering_rule("FusedResidualRmsNorm")
def _fused_residual_rms_norm(op, args, ctx):
    # RmsNorm(x + residual (+ bias)) over the last axis: [x, res, (bias), gamma, beta].
    h, gamma, beta = _residual(args, bool(op.has_bias))
    return ctx.cast_out(rms_norm(h, gamma, beta, -1, op.eps))


def swiglu(packed, gate_first: bool):
    """silu(gate) * up from a [..., 2N] input: up = low half, gate = high half
    (swapped when gate_first)."""
    n = packed.shape[-1] // 2
    lo = lax.slice_in_dim(packed, 0, n, axis=-1)
    hi = lax.slice_in_dim(packed, n, 2 * n, axis=-1)
    up, gate = (hi, lo) if gate_first else (lo, hi)
    return activation("Silu", gate) * up


@lowering_rule("FusedSwiGLU")
def _fused_swiglu(op, args, ctx):
    y = swiglu(args[0], bool(op.gate_first))
    if op.cast_to is not None:
        y = cast(y, op.cast_to)
    return ctx.cast_out(y)


def _split_heads(qkv, num_heads, head_dim):
    """[B, S, 3*H*D] -> three [B, S, H, D] (q, k, v narrows of RLX's unfuse)."""
    hd = num_heads * head_dim
    b, s = qkv.shape[0], qkv.shape[1]
    parts = [lax.slice_in_dim(qkv, i * hd, (i + 1) * hd, axis=-1) for i in range(3)]
    return [p.reshape(b, s, num_heads, head_dim) for p in parts]


def keep_mask(mask, batch: int, seq: int):
    """RLX's Custom keep-mask as ``[B, S_k]``: the first ``B * S_k`` elements of ``mask`` in
    row-major order (RLX's kernels read that prefix of the buffer, so a ``[B, H, S, S]``
    mask is accepted with that meaning)."""
    if mask.shape == (batch, seq):
        return mask
    if mask.size < batch * seq:
        raise ValueError(f"mask of shape {mask.shape} holds fewer than B * S_k = {batch * seq} elements")
    return mask.reshape(-1)[:batch * seq].reshape(batch, seq)


def _attend(q, k, v, mask):
    """Attention with a Custom [B, S_k] keep-mask on [B, S, H, D] operands."""
    mask = keep_mask(mask, k.shape[0], k.shape[1])
    return fused("attention")(q, k, v, **attention_kwargs("Custom", mask, None, None))


def attention_block(hidden, qkv_w, out_w, mask, qkv_b, out_b, cos, sin, num_heads, head_dim):
    """QKV projection -> split heads -> [NeoX RoPE on q, k] -> attention (Custom mask)
    -> merge heads -> output projection."""
    qkv = matmul(hidden, qkv_w)
    if qkv_b is not None:
        qkv = qkv + qkv_b
    q, k, v = _split_heads(qkv, num_heads, head_dim)
    if cos is not None:
        # RLX applies Rope on the [B, H, S, D] view with head_dim = n_rot = D.
        q = jnp.swapaxes(rope(jnp.swapaxes(q, 1, 2), cos, sin, head_dim, head_dim), 1, 2)
        k = jnp.swapaxes(rope(jnp.swapaxes(k, 1, 2), cos, sin, head_dim, head_dim), 1, 2)
    o = _attend(q, k, v, mask)
    o = o.reshape(o.shape[0], o.shape[1], num_heads * head_dim)
    y = matmul(o, out_w)
    if out_b is not None:
        y = y + out_b
    return y


@lowering_rule("FusedAttentionBlock")
def _fused_attention_block(op, args, ctx):
    # Inputs: hidden, qkv_w, out_w, mask, [qkv_b, out_b] if has_bias, [cos, sin] if has_rope.
    hidden, qkv_w, out_w, mask = args[:4]
    i = 4
    qkv_b = out_b = cos = sin = None
    if op.has_bias:
        qkv_b, out_b = args[i], args[i + 1]
        i += 2
    if op.has_rope:
        cos, sin = args[i], args[i + 1]
    y = attention_block(hidden, qkv_w, out_w, mask, qkv_b, out_b, cos, sin,
                        int(op.num_heads), int(op.head_dim))
    return ctx.cast_out(y)


def _transformer_inputs(args, has_bias):
    """Name the FusedTransformerLayer inputs (RLX order; missing biases/betas None)."""
    names_bias = ["hidden", "qkv_w", "qkv_b", "out_w", "out_b", "ln1_g", "ln1_b", "fc1_w",
                  "fc1_b", "fc2_w", "fc2_b", "ln2_g", "ln2_b", "mask"]
    names_10 = ["hidden", "qkv_w", "out_w", "ln1_g", "ln1_b", "fc1_w", "fc2_w", "ln2_g",
                "ln2_b", "mask"]
    names_8 = ["hidden", "qkv_w", "out_w", "ln1_g", "fc1_w", "fc2_w", "ln2_g", "mask"]
    if has_bias:
        names = names_bias
    elif len(args) == 10:
        names = names_10
    elif len(args) == 8:
        names = names_8
    else:
        raise ValueError(f"FusedTransformerLayer without bias takes 10 (or 8) inputs, got {len(args)}")
    if len(args) != len(names):
        raise ValueError(f"FusedTransformerLayer takes {len(names)} inputs, got {len(args)}")
    d = dict(zip(names, args))
    for n in names_bias:
        d.setdefault(n, None)
    return d


def transformer_layer(p, num_heads, head_dim, eps1, eps2, act):
    """Post-LN layer: h1 = LN1(attn_block(x) + x); out = LN2(fc2(act(fc1(h1))) + h1)."""
    x = p["hidden"]
    zeros = jnp.zeros((x.shape[-1],), x.dtype)
    attn = attention_block(x, p["qkv_w"], p["out_w"], p["mask"], p["qkv_b"], p["out_b"],
                           None, None, num_heads, head_dim)
    h1 = layer_norm(attn + x, p["ln1_g"], zeros if p["ln1_b"] is None else p["ln1_b"], -1, eps1)
    f = matmul(h1, p["fc1_w"])
    if p["fc1_b"] is not None:
        f = f + p["fc1_b"]
    f = matmul(activation(act, f), p["fc2_w"])
    if p["fc2_b"] is not None:
        f = f + p["fc2_b"]
    return layer_norm(f + h1, p["ln2_g"], zeros if p["ln2_b"] is None else p["ln2_b"], -1, eps2)


@lowering_rule("FusedTransformerLayer")
def _fused_transformer_layer(op, args, ctx):
    p = _transformer_inputs(list(args), bool(op.has_bias))
    y = transformer_layer(p, int(op.num_heads), int(op.head_dim), op.eps1, op.eps2, op.activation)
    return ctx.cast_out(y)
