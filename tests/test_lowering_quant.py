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
