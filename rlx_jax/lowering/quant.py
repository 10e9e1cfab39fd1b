"""Quantization: Quantize, Dequantize, QMatMul, QConv2d, DequantMatMul (int8/int4/fp8
block schemes), FakeQuantize (with its scale modes) and FakeQuantizeLSQ.

Integer ops follow RLX's CPU kernels bit for bit: i32 accumulation, Rust ``f32::round``
(half away from zero), clamp to i8. FakeQuantize/LSQ are fused-op families
(``rlx_jax.ops``).
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp
from jax import lax

from .nn import fused
from .registry import enum_name, lowering_rule


def round_half_away(x):
    """Rust ``f32::round``: halves round away from zero."""
    return jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)


def _channel_param(values, axis, x, dtype):
    """Per-tensor (axis None: element 0) or per-channel vector broadcast along ``axis``."""
    v = jnp.asarray(np.asarray(values, dtype=dtype))
    if axis is None:
        return v[0]
    shape = [1] * x.ndim
    shape[int(axis)] = v.shape[0]
    return v.reshape(shape)


@lowering_rule("Quantize")
def _quantize(op, args, ctx):
    # q = saturate_i8(round(x / scale[c]) + zp[c]), c = index along `axis` (or 0).
    x = args[0].astype(jnp.float32)
    s = _channel_param(op.scales, op.axis, x, np.float32)
    zp = _channel_param(op.zero_points, op.axis, x, np.int32)
    q = round_half_away(x * (1.0 / s)).astype(jnp.int32) + zp
    return jnp.clip(q, -128, 127).astype(ctx.out_dtype or jnp.int8)


@lowering_rule("Dequantize")
def _dequantize(op, args, ctx):
    # x = (q - zp[c]) * scale[c].
    q = args[0].astype(jnp.int32)
    s = _channel_param(op.scales, op.axis, q, np.float32)
    zp = _channel_param(op.zero_points, op.axis, q, np.int32)
    return ((q - zp).astype(jnp.float32) * s).astype(ctx.out_dtype or jnp.float32)


def requantize(acc, mult, out_zp):
    """i32 accumulator -> i8: clamp(round(acc * mult) + out_zp, -128, 127)."""
    r = round_half_away(acc.astype(jnp.float32) * jnp.float32(mult)).astype(jnp.int32) + out_zp
    return jnp.clip(r, -128, 127).astype(jnp.int8)


@lowering_rule("QMatMul")
def _qmatmul(op, args, ctx):
    # out = requantize(bias[n] + sum_k (x - x_zp)(w - w_zp)) with i32 accumulation.
    x, w, bias = args
    xi = x.astype(jnp.int32) - int(op.x_zp)
    wi = w.astype(jnp.int32) - int(op.w_zp)
    acc = lax.dot(xi, wi, preferred_element_type=jnp.int32) + bias.astype(jnp.int32)
    return requantize(acc, op.mult, int(op.out_zp)).astype(ctx.out_dtype or jnp.int8)


@lowering_rule("QConv2d")
def _qconv2d(op, args, ctx):
    # NCHW / OIHW integer conv (zero padding in x's offset domain: padded taps are
    # skipped, as RLX's kernel does), i32 accumulation, + bias[c_out], requantize.
    x, w, bias = args
    xi = x.astype(jnp.int32) - int(op.x_zp)
    wi = w.astype(jnp.int32) - int(op.w_zp)
    st = tuple(int(s) for s in op.stride)
    pd = [(int(p), int(p)) for p in op.padding]
    dl = tuple(int(d) for d in op.dilation)
    acc = lax.conv_general_dilated(
        xi, wi, window_strides=st, padding=pd, rhs_dilation=dl,
        dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=int(op.groups),
        preferred_element_type=jnp.int32)
    acc = acc + bias.astype(jnp.int32)[None, :, None, None]
    return requantize(acc, op.mult, int(op.out_zp)).astype(ctx.out_dtype or jnp.int8)


# ---- DequantMatMul ---------------------------------------------------------------------

def fp8_e4m3_decode(b):
    """FP8 E4M3 byte -> f32 (exp bias 7; exp 15 is inf/nan as RLX decodes it)."""
    b = b.astype(jnp.int32)
    sign = jnp.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0x0F
    m = (b & 0x07).astype(jnp.float32)
    normal = sign * (1.0 + m / 8.0) * jnp.exp2(e.astype(jnp.float32) - 7.0)
    sub = sign * m * 2.0**-9
    special = jnp.where(m == 0, sign * jnp.inf, jnp.nan)
    return jnp.where(e == 0, sub, jnp.where(e == 0x0F, special, normal)).astype(jnp.float32)


def fp8_e5m2_decode(b):
    """FP8 E5M2 byte -> f32 (exp bias 15)."""
    b = b.astype(jnp.int32)
    sign = jnp.where(b & 0x80, -1.0, 1.0)
    e = (b >> 2) & 0x1F
    m = (b & 0x03).astype(jnp.float32)
    normal = sign * (1.0 + m / 4.0) * jnp.exp2(e.astype(jnp.float32) - 15.0)
    sub = sign * m * 2.0**-16
    special = jnp.where(m == 0, sign * jnp.inf, jnp.nan)
    return jnp.where(e == 0, sub, jnp.where(e == 0x1F, special, normal)).astype(jnp.float32)


def dequant_weight(scheme, w_q, scale, zp, k, n):
    """Dequantise a DequantMatMul weight to f32 [k, n] (RLX CPU layouts):

    - Int8Block{b} / Int8BlockAsym{b}: w_q i8 [k, n]; scale/zp f32 [ceil(k/b), n];
      w = (q - zp) * scale (zp = 0 when symmetric).
    - Int4Block{b}: w_q u8 holding k*n nibbles row-major, element e in byte e // 2
      (low nibble first); unsigned 0..15; w = nibble * scale.
    - Fp8E4m3 / Fp8E5m2: w_q u8 [k, n] decoded; optional per-column scale [n].
    """
    kind = scheme.kind if hasattr(scheme, "kind") else enum_name(scheme)
    if kind in ("Int8Block", "Int8BlockAsym"):
        bs = int(scheme.block_size)
        q = w_q.astype(jnp.float32).reshape(k, n)
        blk = jnp.arange(k) // bs
        s = scale.reshape(-1, n)[blk]
        z = zp.reshape(-1, n)[blk] if kind == "Int8BlockAsym" else 0.0
        return (q - z) * s
    if kind == "Int4Block":
        bs = int(scheme.block_size)
        flat = w_q.reshape(-1).astype(jnp.uint8)
        lo = flat & 0x0F
        hi = flat >> 4
        nib = jnp.stack([lo, hi], axis=-1).reshape(-1)[: k * n].astype(jnp.float32).reshape(k, n)
        blk = jnp.arange(k) // bs
        return nib * scale.reshape(-1, n)[blk]
    if kind in ("Fp8E4m3", "Fp8E5m2"):
        dec = fp8_e4m3_decode if kind == "Fp8E4m3" else fp8_e5m2_decode
        w = dec(w_q.reshape(k, n))
        if scale is not None and scale.size == n:
            w = w * scale.reshape(1, n).astype(jnp.float32)
        return w
    raise NotImplementedError(f"DequantMatMul scheme {kind} is not lowered (GGUF / NVFP4 packed "
                              "formats are not supported yet)")


@lowering_rule("DequantMatMul")
def _dequant_matmul(op, args, ctx):
    # x [m, k] @ dequant(w_q) [k, n] -> [m, n] f32.
    x = args[0]
    scale = args[2] if len(args) > 2 else None
    zp = args[3] if len(args) > 3 else None
    n = ctx.out_shape[-1]
    k = x.shape[-1]
    w = dequant_weight(op.scheme, args[1], scale, zp, k, n)
    return ctx.cast_out(jnp.matmul(x.astype(jnp.float32), w))


# ---- fake quantization (fused families) ---------------------------------------------

def _q_max(bits: int) -> float:
    table = {8: 127.0, 4: 7.0, 2: 1.0}
    if int(bits) not in table:
        raise ValueError(f"FakeQuantize supports bits 8, 4 or 2, got {bits}")
    return table[int(bits)]


def _ste_name(ste) -> str:
    name = enum_name(ste) or "Identity"
    return {"Identity": "identity", "ClippedIdentity": "clipped_identity", "Tanh": "tanh",
            "HardTanh": "hard_tanh"}[name]


@lowering_rule("FakeQuantize")
def _fake_quantize(op, args, ctx):
    # out = clamp(round(x / s[c]), -q_max, q_max) * s[c]; q_max = 127 / 7 / 1 for 8 / 4 / 2
    # bits. PerBatch: s = max(max|x| / q_max, 1e-12); Fixed: s = max(state, 1e-12);
    # EMA: s = decay * state + (1 - decay) * s_batch (state <= 0 seeds with s_batch).
    x = args[0]
    mode = enum_name(op.scale_mode) or "PerBatch"
    axis = None if op.axis is None else int(op.axis)
    kw = dict(bits=int(op.bits), axis=axis, ste=_ste_name(op.ste))
    if mode == "PerBatch":
        return ctx.cast_out(fused("fake_quantize")(x, **kw))
    state = lax.stop_gradient(args[1].astype(jnp.float32))
    qm = _q_max(op.bits)
    if mode == "Fixed":
        s = jnp.maximum(state, 1e-12)
    else:
        ax = tuple(i for i in range(x.ndim) if i != axis) if axis is not None else None
        cur = jnp.maximum(jnp.max(jnp.abs(lax.stop_gradient(x)), axis=ax).astype(jnp.float32) / qm,
                          1e-12)
        decay = float(op.scale_mode.decay)
        s = jnp.where(state <= 0, cur, decay * state + (1.0 - decay) * cur)
    s = s.reshape(-1)
    return ctx.cast_out(fused("fake_quantize")(x, scale=s, **kw))


@lowering_rule("FakeQuantizeLSQ")
def _fake_quantize_lsq(op, args, ctx):
    # Same forward with a learned scale [C] (or [1]); LSQ gradients for x and scale.
    x, scale = args
    axis = None if op.axis is None else int(op.axis)
    return ctx.cast_out(fused("fake_quantize_lsq")(x, scale, bits=int(op.bits), axis=axis))
