"""Quantize / Dequantize / QMatMul / QConv2d (integer semantics of RLX's kernels),
DequantMatMul block schemes, FakeQuantize scale modes and LSQ, vs NumPy."""

import numpy as np
import pytest

import rlx_jax as rlx

RNG = np.random.default_rng(8)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def rust_round(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def run_graph(build, **arrays):
    names = {np.float32: "f32", np.int8: "i8", np.int32: "i32", np.uint8: "u8"}
    g = rlx.Graph("q")
    ids = {n: g.input(n, list(a.shape), names[a.dtype.type]) for n, a in arrays.items()}
    out = build(g, ids)
    g.set_outputs(list(out) if isinstance(out, (list, tuple)) else [out])
    return [np.asarray(o) for o in rlx.to_jax(g)({}, arrays)]


@pytest.mark.parametrize("axis", [None, 1])
def test_quantize_dequantize_per_tensor_and_channel(axis):
    x = f32(2, 3, 4) * 3
    x[0, 0, :2] = [0.25, -0.75]  # halves round away from zero
    scales = [0.5] if axis is None else [0.5, 0.1, 0.02]
    zps = [3] if axis is None else [0, -5, 7]
    (q,) = run_graph(lambda G, i: G.quantize(i["x"], scales, zps, axis), x=x)
    s = np.array(scales, np.float32).reshape((1, -1, 1) if axis is not None else ())
    z = np.array(zps).reshape((1, -1, 1) if axis is not None else ())
    ref = np.clip(rust_round(x * (1 / s)).astype(np.int32) + z, -128, 127).astype(np.int8)
    assert q.dtype == np.int8
    np.testing.assert_array_equal(q, ref)
    (d,) = run_graph(lambda G, i: G.dequantize(i["q"], scales, zps, axis), q=ref)
    np.testing.assert_allclose(d, (ref.astype(np.int32) - z) * s, rtol=1e-6)


def requant(acc, mult, out_zp):
    return np.clip(rust_round(acc.astype(np.float32) * np.float32(mult)).astype(np.int32) + out_zp,
                   -128, 127).astype(np.int8)


def test_qmatmul_integer_semantics():
    x = RNG.integers(-128, 128, (5, 7)).astype(np.int8)
    w = RNG.integers(-128, 128, (7, 3)).astype(np.int8)
    bias = RNG.integers(-1000, 1000, 3).astype(np.int32)
    (y,) = run_graph(lambda G, i: G.q_matmul(i["x"], i["w"], i["b"], 3, -2, 5, 0.0021), x=x, w=w, b=bias)
    acc = (x.astype(np.int32) - 3) @ (w.astype(np.int32) + 2) + bias
    np.testing.assert_array_equal(y, requant(acc, 0.0021, 5))


def test_qconv2d_integer_semantics():
    x = RNG.integers(-128, 128, (1, 4, 5, 5)).astype(np.int8)
    w = RNG.integers(-128, 128, (2, 2, 3, 3)).astype(np.int8)
    bias = RNG.integers(-100, 100, 2).astype(np.int32)
    (y,) = run_graph(lambda G, i: G.q_conv2d(i["x"], i["w"], i["b"], (3, 3), (2, 2), (1, 1), (1, 1), 2,
                                              4, 1, -3, 0.001), x=x, w=w, b=bias)
    xi = np.pad(x.astype(np.int32) - 4, ((0, 0), (0, 0), (1, 1), (1, 1)))
    wi = w.astype(np.int32) - 1
    acc = np.zeros((1, 2, 3, 3), np.int64)
    for o in range(2):
        gi = o  # 2 groups, 1 output channel each
        for i in range(3):
            for j in range(3):
                acc[0, o, i, j] = np.sum(xi[0, 2 * gi:2 * gi + 2, 2 * i:2 * i + 3, 2 * j:2 * j + 3] * wi[o])
    acc += bias[None, :, None, None]
    np.testing.assert_array_equal(y, requant(acc, 0.001, -3))


@pytest.mark.parametrize("scheme", ["Int8Block", "Int8BlockAsym", "Int4Block"])
def test_dequant_matmul_block_schemes(scheme):
    m, k, n, bs = 3, 8, 5, 4
    x = f32(m, k)
    scale = np.abs(f32(k // bs, n)) + 0.1
    zp = f32(k // bs, n) if scheme == "Int8BlockAsym" else np.zeros((k // bs, n), np.float32)
    blk = np.arange(k) // bs
    if scheme == "Int4Block":
        nib = RNG.integers(0, 16, k * n).astype(np.uint8)
        wq = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
        w = nib.reshape(k, n).astype(np.float32) * scale[blk]
    else:
        wq = RNG.integers(-128, 128, (k, n)).astype(np.int8)
        w = (wq.astype(np.float32) - zp[blk]) * scale[blk]
    (y,) = run_graph(lambda G, i: G.dequant_matmul([i["x"], i["w"], i["s"], i["z"]], f"{scheme}:{bs}", [m, n]),
                     x=x, w=wq, s=scale, z=zp)
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)


def np_fake_quant(x, s, qmax):
    return np.clip(rust_round(x / s), -qmax, qmax) * s


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7), (2, 1)])
def test_fake_quantize_per_batch(bits, qmax):
    x = f32(4, 6)
    (y,) = run_graph(lambda G, i: G.fake_quantize(i["x"], bits), x=x)
    np.testing.assert_allclose(y, np_fake_quant(x, np.abs(x).max() / qmax, qmax), rtol=1e-5, atol=1e-6)
    (y,) = run_graph(lambda G, i: G.fake_quantize(i["x"], bits, 0), x=x)
    s = np.abs(x).max(1, keepdims=True) / qmax
    np.testing.assert_allclose(y, np_fake_quant(x, s, qmax), rtol=1e-5, atol=1e-6)


def test_fake_quantize_fixed_and_ema_state():
    x = f32(3, 5)
    state = np.array([0.05, 0.0, 0.2], np.float32)
    (y,) = run_graph(lambda G, i: G.fake_quantize(i["x"], 4, 0, "identity", "fixed", i["s"]), x=x, s=state)
    np.testing.assert_allclose(y, np_fake_quant(x, np.maximum(state, 1e-12)[:, None], 7), rtol=1e-5, atol=1e-6)
    (y,) = run_graph(lambda G, i: G.fake_quantize(i["x"], 4, 0, "identity", "ema:0.9", i["s"]), x=x, s=state)
    cur = np.maximum(np.abs(x).max(1) / 7, 1e-12)
    s = np.where(state <= 0, cur, 0.9 * state + 0.1 * cur)
    np.testing.assert_allclose(y, np_fake_quant(x, s[:, None], 7), rtol=1e-5, atol=1e-6)


def test_fake_quantize_lsq_forward():
    x = f32(3, 5)
    scale = np.array([0.1, 0.3, 0.05], np.float32)
    (y,) = run_graph(lambda G, i: G.fake_quantize_lsq(i["x"], i["s"], 4, 0), x=x, s=scale)
    np.testing.assert_allclose(y, np_fake_quant(x, scale[:, None], 7), rtol=1e-5, atol=1e-6)


def np_fp8_e4m3(b):
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    out = np.where(e == 0, sign * m * 2.0**-9, sign * (1 + m / 8) * 2.0 ** (e - 7.0))
    return np.where((e == 15) & (m != 0), np.nan, np.where(e == 15, sign * np.inf, out))


def test_dequant_matmul_fp8_e4m3_with_column_scale():
    m, k, n = 2, 6, 3
    x = f32(m, k)
    codes = RNG.integers(0, 256, (k, n)).astype(np.uint8)
    codes[(codes & 0x78) == 0x78] = 0x3C  # avoid inf/nan codes (exponent 15)
    scale = np.abs(f32(n)) + 0.5
    zp = np.zeros(n, np.float32)  # unused by fp8 (RLX's 4-input contract)
    (y,) = run_graph(lambda G, i: G.dequant_matmul([i["x"], i["w"], i["s"], i["z"]], "fp8_e4m3", [m, n]),
                     x=x, w=codes, s=scale, z=zp)
    np.testing.assert_allclose(y, x @ (np_fp8_e4m3(codes) * scale), rtol=1e-4, atol=1e-4)


# ---- NVFP4 and GGUF: random packed bytes, decoded by per-block NumPy loops --------------

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def np_e4m3_scale(b):
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 0:
        return sign * m / 8 * 2.0**-6
    if e == 15 and m == 7:
        return 0.0
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def test_dequant_matmul_nvfp4():
    m, k, n = 2, 32, 3
    x = f32(m, k)
    wq = RNG.integers(0, 256, (k * n) // 2).astype(np.uint8)
    sc = RNG.integers(0, 256, (k // 16, n)).astype(np.uint8)
    sc[0, 0] = 0x7F  # the NaN code decodes to 0
    gs = np.array([0.75], np.float32)
    w = np.zeros((k, n))
    for p in range(k):
        for j in range(n):
            e = p * n + j
            nib = wq[e // 2] & 0xF if e % 2 == 0 else wq[e // 2] >> 4
            w[p, j] = FP4[nib] * np_e4m3_scale(int(sc[p // 16, j])) * 0.75
    (y,) = run_graph(lambda G, i: G.dequant_matmul([i["x"], i["w"], i["s"], i["g"]], "nvfp4_block", [m, n]),
                     x=x, w=wq, s=sc, g=gs)
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-3)


def f16_bytes(v):
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


def np_scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def np_gguf_block(kind, b):
    """GGML's block decoders, element by element."""
    b = [int(v) for v in b]
    i8 = lambda v: v - 256 if v > 127 else v  # noqa: E731
    f16 = lambda lo, hi: float(np.frombuffer(bytes([lo, hi]), np.float16)[0])  # noqa: E731
    out = []
    if kind == "GgufQ8_0":
        d = f16(b[0], b[1])
        return [d * i8(q) for q in b[2:34]]
    if kind == "GgufQ4_0":
        d = f16(b[0], b[1])
        qs = b[2:18]
        return [d * ((q & 15) - 8) for q in qs] + [d * ((q >> 4) - 8) for q in qs]
    if kind == "GgufQ8K":
        d = float(np.frombuffer(bytes(b[0:4]), np.float32)[0])
        return [d * i8(q) for q in b[4:260]]
    if kind in ("GgufQ4K", "GgufQ5K"):
        d, dmin = f16(b[0], b[1]), f16(b[2], b[3])
        sc = b[4:16]
        qh = b[16:48]
        qs = b[48:176] if kind == "GgufQ5K" else b[16:144]
        for g in range(4):
            for half in range(2):
                s, mn = np_scale_min_k4(2 * g + half, sc)
                for l in range(32):
                    q = qs[32 * g + l]
                    q = (q & 15) if half == 0 else (q >> 4)
                    if kind == "GgufQ5K" and qh[l] & (1 << (2 * g + half)):
                        q += 16
                    out.append(d * s * q - dmin * mn)
        return out
    if kind == "GgufQ6K":
        ql, qh, sc, d = b[0:128], b[128:192], [i8(v) for v in b[192:208]], f16(b[208], b[209])
        out = [0.0] * 256
        for h in range(2):
            for l in range(32):
                is_ = l // 16
                hb = qh[32 * h + l]
                a, c = ql[64 * h + l], ql[64 * h + l + 32]
                vals = [(a & 15) | ((hb & 3) << 4), (c & 15) | (((hb >> 2) & 3) << 4),
                        (a >> 4) | (((hb >> 4) & 3) << 4), (c >> 4) | (((hb >> 6) & 3) << 4)]
                for i, v in enumerate(vals):
                    out[128 * h + 32 * i + l] = d * sc[8 * h + is_ + 2 * i] * (v - 32)
        return out
    if kind == "GgufQ2K":
        d, mn = f16(b[0], b[1]), f16(b[2], b[3])
        sc, qs = b[4:20], b[20:84]
        for n in range(2):
            q = qs[32 * n:32 * n + 32]
            for j in range(4):
                for h in range(2):
                    s = sc[8 * n + 2 * j + h]
                    for l in range(16):
                        out.append(d * (s & 15) * ((q[16 * h + l] >> (2 * j)) & 3) - mn * (s >> 4))
        return out
    if kind == "GgufQ3K":
        d = f16(b[0], b[1])
        raw, hm, qs = b[2:14], b[14:46], b[46:110]
        scales = []
        for lo_src, shift in ((0, 0), (4, 2)):
            scales += [(raw[lo_src + i] & 15) | (((raw[8 + i] >> shift) & 3) << 4) for i in range(4)]
        for lo_src, shift in ((0, 4), (4, 6)):
            scales += [(raw[lo_src + i] >> 4) | (((raw[8 + i] >> shift) & 3) << 4) for i in range(4)]
        for n in range(2):
            q = qs[32 * n:32 * n + 32]
            for j in range(4):
                for h in range(2):
                    s = scales[8 * n + 2 * j + h] - 32
                    for l in range(16):
                        high = 0 if hm[16 * h + l] & (1 << (4 * n + j)) else 4
                        out.append(d * s * (((q[16 * h + l] >> (2 * j)) & 3) - high))
        return out
    raise AssertionError(kind)


GGUF = {"GgufQ2K": (256, 84), "GgufQ3K": (256, 110), "GgufQ4_0": (32, 18), "GgufQ8_0": (32, 34), "GgufQ8K": (256, 292), "GgufQ4K": (256, 144),
        "GgufQ5K": (256, 176), "GgufQ6K": (256, 210)}


def random_gguf(kind, nblocks):
    elems, nbytes = GGUF[kind]
    raw = RNG.integers(0, 256, (nblocks, nbytes)).astype(np.uint8)
    for blk in raw:
        if kind == "GgufQ2K":
            blk[0:2] = f16_bytes(RNG.uniform(0.001, 0.05))
            blk[2:4] = f16_bytes(RNG.uniform(0.001, 0.05))
        elif kind == "GgufQ8K":
            blk[0:4] = np.frombuffer(np.float32(RNG.uniform(0.01, 0.1)).tobytes(), np.uint8)
        elif kind == "GgufQ6K":
            blk[208:210] = f16_bytes(RNG.uniform(0.001, 0.01))
        else:
            blk[0:2] = f16_bytes(RNG.uniform(0.001, 0.05))
            if kind in ("GgufQ4K", "GgufQ5K"):
                blk[2:4] = f16_bytes(RNG.uniform(0.001, 0.05))
    ref = np.concatenate([np_gguf_block(kind, blk) for blk in raw]).astype(np.float64)
    return raw.reshape(-1), ref


@pytest.mark.parametrize("kind", sorted(GGUF))
def test_dequant_matmul_gguf(kind):
    elems = GGUF[kind][0]
    k, n, m = elems, 2, 3
    packed, ref = random_gguf(kind, (k * n) // elems)
    w = ref.reshape(n, k).T  # RLX stores B^T ([n, k] row-major)
    x = f32(m, k)
    (y,) = run_graph(lambda G, i: G.dequant_matmul([i["x"], i["w"]], kind, [m, n]), x=x, w=packed)
    np.testing.assert_allclose(y, x @ w, rtol=2e-4, atol=2e-3)


def test_dequant_moe_weights_and_grouped_matmul_gguf():
    kind, e, k, n, m = "GgufQ8_0", 3, 32, 2, 7
    slabs = [random_gguf(kind, (k * n) // 32) for _ in range(e)]
    packed = np.concatenate([s[0] for s in slabs])
    w = np.stack([s[1].reshape(n, k).T for s in slabs])  # [E, K, N]
    x = f32(m, k)
    idx = RNG.integers(0, e, m).astype(np.float32)
    (wd,) = run_graph(lambda G, i: G.dequant_moe_weights(i["w"], kind, [e, k, n]), w=packed)
    np.testing.assert_allclose(wd, w, rtol=1e-5, atol=1e-6)
    (y,) = run_graph(lambda G, i: G.dequant_grouped_matmul(i["x"], i["w"], i["i"], kind, [m, n]),
                     x=x, w=packed, i=idx)
    ref = np.stack([x[r] @ w[int(idx[r])] for r in range(m)])
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_qconv2d_split_path_is_exact_at_the_extremes():
    # the f32 nibble-split conv used where no s32 conv exists (GPUs) is exact
    import jax.numpy as jnp
    from jax import lax
    from rlx_jax.lowering.quant import _int_conv_split

    x = RNG.choice([-256, -255, 255, 0, 1, -1], (2, 64, 6, 6)).astype(np.int64)
    w = RNG.choice([-256, 255, -255, 7], (3, 64, 3, 3)).astype(np.int64)

    def conv(a, b, out_type=None):
        return lax.conv_general_dilated(a, b, (1, 1), [(1, 1), (1, 1)],
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                        preferred_element_type=out_type)

    got = np.asarray(_int_conv_split(jnp.asarray(x, jnp.int32), jnp.asarray(w, jnp.int32), conv))
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros((2, 3, 6, 6), np.int64)
    for i in range(3):
        for j in range(3):
            ref += np.einsum("nchw,oc->nohw", xp[:, :, i:i + 6, j:j + 6], w[:, :, i, j])
    np.testing.assert_array_equal(got, ref)
