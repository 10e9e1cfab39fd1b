"""Quantization: Quantize, Dequantize, QMatMul, QConv2d, DequantMatMul (int8/int4/fp8
block schemes, NVFP4, the GGUF schemes), DequantGroupedMatMul,
DequantMoEWeights, FakeQuantize (with its scale modes) and FakeQuantizeLSQ.

Integer ops follow RLX's CPU kernels bit for bit: i32 accumulation, Rust ``f32::round``
(half away from zero), clamp to i8. FakeQuantize/LSQ are fused-op families
(``rlx_jax.ops``).
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

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


@lowering_rule(ir.Quantize)
def _quantize(op, args, ctx):
    # q = saturate_i8(round(x / scale[c]) + zp[c]), c = index along `axis` (or 0).
    x = args[0].astype(jnp.float32)
    s = _channel_param(op.scales, op.axis, x, np.float32)
    zp = _channel_param(op.zero_points, op.axis, x, np.int32)
    q = round_half_away(x * (1.0 / s)).astype(jnp.int32) + zp
    return jnp.clip(q, -128, 127).astype(ctx.out_dtype or jnp.int8)


@lowering_rule(ir.Dequantize)
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


@lowering_rule(ir.QMatMul)
def _qmatmul(op, args, ctx):
    # out = requantize(bias[n] + sum_k (x - x_zp)(w - w_zp)) with i32 accumulation.
    x, w, bias = args
    xi = x.astype(jnp.int32) - int(op.x_zp)
    wi = w.astype(jnp.int32) - int(op.w_zp)
    acc = lax.dot(xi, wi, preferred_element_type=jnp.int32) + bias.astype(jnp.int32)
    return requantize(acc, op.mult, int(op.out_zp)).astype(ctx.out_dtype or jnp.int8)


def _int_conv_split(xi, wi, conv):
    """Exact integer conv through f32 convs (GPU convolution libraries have no s32
    conv): operands in [-256, 255] split into 16 * hi + lo nibbles; each of the four
    partial convs has |terms| <= 256, exact in f32 below 65536 taps per output."""
    xh, xl = xi >> 4, xi & 15
    wh, wl = wi >> 4, wi & 15

    def c(a, b):
        return conv(a.astype(jnp.float32), b.astype(jnp.float32)).astype(jnp.int32)

    return 256 * c(xh, wh) + 16 * (c(xh, wl) + c(xl, wh)) + c(xl, wl)


@lowering_rule(ir.QConv2d)
def _qconv2d(op, args, ctx):
    # NCHW / OIHW integer conv (zero padding in x's offset domain: padded taps are
    # skipped, as RLX's kernel does), i32 accumulation, + bias[c_out], requantize.
    x, w, bias = args
    xi = x.astype(jnp.int32) - int(op.x_zp)
    wi = w.astype(jnp.int32) - int(op.w_zp)
    st = tuple(int(s) for s in op.stride)
    pd = [(int(p), int(p)) for p in op.padding]
    dl = tuple(int(d) for d in op.dilation)

    def conv(a, b, out_type=None):
        return lax.conv_general_dilated(
            a, b, window_strides=st, padding=pd, rhs_dilation=dl,
            dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=int(op.groups),
            preferred_element_type=out_type)

    acc = lax.platform_dependent(
        xi, wi,
        cpu=lambda a, b: conv(a, b, jnp.int32),          # XLA:CPU convolves s32 exactly
        default=lambda a, b: _int_conv_split(a, b, conv),  # cuDNN has no s32 conv
    )
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
    raise NotImplementedError(f"DequantMatMul scheme {kind} has no block dequantiser")


# ---- NVFP4 and GGUF packed formats ----------------------------------------------------

_FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                      -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def nvfp4_scale_decode(b):
    """NVFP4 block scale byte (FP8 E4M3, no infinities) -> f32; the NaN code 0x7f/0xff
    decodes to 0 (RLX keeps the matmul finite)."""
    b = b.astype(jnp.int32)
    sign = jnp.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0x0F
    m = (b & 0x07).astype(jnp.float32)
    v = jnp.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * jnp.exp2(e.astype(jnp.float32) - 7.0))
    v = jnp.where((e == 0x0F) & (m == 7), 0.0, v)
    return (sign * v).astype(jnp.float32)


def _nibbles(flat_u8, count):
    """Element e of a low-nibble-first packed byte stream, for e < count."""
    flat = flat_u8.reshape(-1).astype(jnp.uint8)
    return jnp.stack([flat & 0x0F, flat >> 4], axis=-1).reshape(-1)[:count]


def nvfp4_weight(w_q, scale, global_scale, k, n):
    """Nvfp4Block: element (p, j) is FP4 E2M1 nibble p*n + j (low nibble first) times the
    E4M3 scale of block p // 16, column j, times the global scale."""
    nib = _nibbles(w_q, k * n).astype(jnp.int32).reshape(k, n)
    w = jnp.asarray(_FP4_E2M1)[nib]
    s = nvfp4_scale_decode(scale.reshape(-1, n))[jnp.arange(k) // 16]
    g = global_scale.reshape(-1)[0].astype(jnp.float32) if global_scale is not None else 1.0
    return w * s * g


def _f16(b2):
    """[..., 2] little-endian bytes -> f32 (an f16 value)."""
    return lax.bitcast_convert_type(b2.astype(jnp.uint8), jnp.float16).astype(jnp.float32)


def _i8(b):
    return lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.int8).astype(jnp.float32)


def _scale_min_k4(sc):
    """The 8 (scale, min) 6-bit pairs packed in a K-quant block's 12 scale bytes."""
    sc = sc.astype(jnp.int32)
    lo_s, lo_m = sc[:, 0:4] & 63, sc[:, 4:8] & 63
    hi_s = (sc[:, 8:12] & 0x0F) | ((sc[:, 0:4] >> 6) << 4)
    hi_m = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return (jnp.concatenate([lo_s, hi_s], 1).astype(jnp.float32),
            jnp.concatenate([lo_m, hi_m], 1).astype(jnp.float32))


def gguf_dequant_blocks(kind, blocks):
    """GGML block dequantisation, blocks [B, block_bytes] u8 -> [B, block_elems] f32."""
    if kind == "GgufQ8_0":  # f16 d, 32 x i8
        return _f16(blocks[:, 0:2])[:, None] * _i8(blocks[:, 2:34])
    if kind == "GgufQ4_0":  # f16 d, 16 bytes: low nibbles = elements 0..15, high = 16..31
        qs = blocks[:, 2:18].astype(jnp.int32)
        q = jnp.concatenate([qs & 0x0F, qs >> 4], 1) - 8
        return _f16(blocks[:, 0:2])[:, None] * q.astype(jnp.float32)
    if kind == "GgufQ8K":  # f32 d, 256 x i8 (then 16 i16 sums, unused)
        d = lax.bitcast_convert_type(blocks[:, 0:4].astype(jnp.uint8), jnp.float32)
        return d[:, None] * _i8(blocks[:, 4:260])
    if kind in ("GgufQ4K", "GgufQ5K"):
        # f16 d, f16 dmin, 12 scale bytes, [Q5: 32 high-bit bytes], 128 nibble bytes; four
        # 64-element groups g: low nibbles of qs[32g:32g+32] with pair 2g, high with 2g+1
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        off = 16 + (32 if kind == "GgufQ5K" else 0)
        qs = blocks[:, off:off + 128].astype(jnp.int32).reshape(-1, 4, 32)
        q = jnp.stack([qs & 0x0F, qs >> 4], axis=2)  # [B, 4, 2, 32]
        if kind == "GgufQ5K":
            qh = blocks[:, 16:48].astype(jnp.int32)  # bit 2g (low half) / 2g+1 (high half)
            bit = jnp.arange(8).reshape(4, 2)
            q = q + ((qh[:, None, None, :] >> bit[None, :, :, None]) & 1) * 16
        scale = (d[:, None] * sc).reshape(-1, 4, 2, 1)
        mins = (dmin[:, None] * mn).reshape(-1, 4, 2, 1)
        return (scale * q.astype(jnp.float32) - mins).reshape(-1, 256)
    if kind == "GgufQ6K":
        # ql 128, qh 64, 16 i8 scales, f16 d; two halves of 128: for l < 32 four values
        # at l, l+32, l+64, l+96 from ql[64h + l], ql[64h + l + 32] nibbles and qh bits
        ql = blocks[:, 0:128].astype(jnp.int32).reshape(-1, 2, 2, 32)   # [B, h, 2, 32]
        qh = blocks[:, 128:192].astype(jnp.int32).reshape(-1, 2, 32)    # [B, h, 32]
        sc = _i8(blocks[:, 192:208]).reshape(-1, 2, 8)                 # [B, h, 8]
        d = _f16(blocks[:, 208:210])
        lo = jnp.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], 2)
        hi = jnp.stack([(qh >> (2 * i)) & 3 for i in range(4)], 2)       # [B, h, 4, 32]
        q = (lo | (hi << 4)) - 32
        is_ = jnp.arange(32) // 16                                     # [32]
        sidx = is_[None, :] + 2 * jnp.arange(4)[:, None]               # [4, 32]
        s = sc[:, :, sidx]                                             # [B, h, 4, 32]
        return (d[:, None, None, None] * s * q.astype(jnp.float32)).reshape(-1, 256)
    if kind in ("GgufQ2K", "GgufQ3K"):
        return _gguf_2_3bit(kind, blocks)
    raise NotImplementedError(f"GGUF scheme {kind} has no dequantiser")


def _gguf_2_3bit(kind, blocks):
    """Q2_K / Q3_K in RLX's byte order (the f16 scale(s) first). Output element
    128 n + 32 j + 16 h + l (n < 2, j < 4, h < 2, l < 16) takes 2 bits at shift 2j of
    qs[32 n + 16 h + l], with sub-block scale index 8 n + 2 j + h."""
    nj = jnp.arange(4)
    if kind == "GgufQ2K":
        # f16 d, f16 min, 16 scale bytes (low nibble scale, high nibble min), 64 qs bytes
        d, mn = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc = blocks[:, 4:20].astype(jnp.int32).reshape(-1, 2, 4, 2)
        qs = blocks[:, 20:84].astype(jnp.int32).reshape(-1, 2, 1, 2, 16)
        q = (qs >> (2 * nj)[None, None, :, None, None]) & 3            # [B, 2, 4, 2, 16]
        dl = d[:, None, None, None] * (sc & 0x0F)
        ml = mn[:, None, None, None] * (sc >> 4)
        return (dl[..., None] * q - ml[..., None]).reshape(-1, 256)
    # Q3_K: f16 d, 12 bytes of 16 packed 6-bit scales, 32 high-bit-mask bytes, 64 qs bytes
    d = _f16(blocks[:, 0:2])
    raw = blocks[:, 2:14].astype(jnp.int32)
    a, b, t = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = jnp.concatenate([(a & 15) | ((t & 3) << 4), (b & 15) | (((t >> 2) & 3) << 4),
                          (a >> 4) | (((t >> 4) & 3) << 4), (b >> 4) | (((t >> 6) & 3) << 4)], 1)
    sc = (sc - 32).astype(jnp.float32).reshape(-1, 2, 4, 2)
    hm = blocks[:, 14:46].astype(jnp.int32).reshape(-1, 1, 1, 2, 16)
    qs = blocks[:, 46:110].astype(jnp.int32).reshape(-1, 2, 1, 2, 16)
    q = (qs >> (2 * nj)[None, None, :, None, None]) & 3               # [B, 2, 4, 2, 16]
    bit = (jnp.arange(2)[:, None] * 4 + nj[None, :])[None, :, :, None, None]  # 4 n + j
    q = q - jnp.where((hm >> bit) & 1, 0, 4)
    return (d[:, None, None, None, None] * sc[..., None] * q).reshape(-1, 256)


def gguf_matrix(kind, packed, k, n):
    """A GGUF-packed [n, k] row-major matrix (RLX's B^T layout) -> f32 [k, n]."""
    from rlx_jax.ir.op import GGUF_BLOCKS

    elems, nbytes = GGUF_BLOCKS[kind]
    if (k * n) % elems:
        raise ValueError(f"{kind}: k*n = {k * n} is not a multiple of the block size {elems}")
    blocks = packed.reshape(-1)[: (k * n) // elems * nbytes].reshape(-1, nbytes)
    return gguf_dequant_blocks(kind, blocks).reshape(n, k).T


def _scheme_kind(scheme):
    return scheme.kind if hasattr(scheme, "kind") else enum_name(scheme)


@lowering_rule(ir.DequantMatMul)
def _dequant_matmul(op, args, ctx):
    # x [m, k] @ dequant(w) [k, n] -> [m, n] f32 (block int8/int4, fp8, NVFP4, GGUF).
    x = args[0]
    n = ctx.out_shape[-1]
    k = x.shape[-1]
    kind = _scheme_kind(op.scheme)
    if kind.startswith("Gguf"):
        w = gguf_matrix(kind, args[1], k, n)
    elif kind == "Nvfp4Block":
        w = nvfp4_weight(args[1], args[2], args[3] if len(args) > 3 else None, k, n)
    else:
        scale = args[2] if len(args) > 2 else None
        zp = args[3] if len(args) > 3 else None
        w = dequant_weight(op.scheme, args[1], scale, zp, k, n)
    return ctx.cast_out(jnp.matmul(x.astype(jnp.float32), w))


def gguf_expert_stack(kind, packed, e, k, n):
    """E contiguous GGUF slabs (each an [n, k] matrix) -> f32 [E, K, N]."""
    from rlx_jax.ir.op import GGUF_BLOCKS

    elems, nbytes = GGUF_BLOCKS[kind]
    slab = (k * n) // elems * nbytes
    flat = packed.reshape(-1)[: e * slab]
    return jnp.stack([gguf_matrix(kind, flat[i * slab:(i + 1) * slab], k, n) for i in range(e)])


@lowering_rule(ir.DequantMoEWeights)
def _dequant_moe_weights(op, args, ctx):
    # packed GGUF expert slabs -> [E, K, N] f32 (GroupedMatMul layout, declared shape).
    e, k, n = (int(d) for d in ctx.out_shape)
    return ctx.cast_out(gguf_expert_stack(_scheme_kind(op.scheme), args[0], e, k, n))


@lowering_rule(ir.DequantGroupedMatMul)
def _dequant_grouped_matmul(op, args, ctx):
    # [x [M, K], packed GGUF expert slabs, expert_idx [M]] -> [M, N]: dequantise the
    # stack once, then the grouped GEMM of GroupedMatMul (sorted, lax.ragged_dot).
    from .moe import grouped_matmul

    x, packed, idx = args
    n = int(ctx.out_shape[-1])
    k = x.shape[-1]
    from rlx_jax.ir.op import GGUF_BLOCKS

    kind = _scheme_kind(op.scheme)
    elems, nbytes = GGUF_BLOCKS[kind]
    e = packed.size // ((k * n) // elems * nbytes)
    w = gguf_expert_stack(kind, packed, e, k, n)
    return ctx.cast_out(grouped_matmul(x.astype(jnp.float32), w, idx))


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


@lowering_rule(ir.FakeQuantize)
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


@lowering_rule(ir.FakeQuantizeLSQ)
def _fake_quantize_lsq(op, args, ctx):
    # Same forward with a learned scale [C] (or [1]); LSQ gradients for x and scale.
    x, scale = args
    axis = None if op.axis is None else int(op.axis)
    return ctx.cast_out(fused("fake_quantize_lsq")(x, scale, bits=int(op.bits), axis=axis))
