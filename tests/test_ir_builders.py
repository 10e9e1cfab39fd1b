"""Every builder's inferred shape and dtype, pyrlx style: ``g.shape_of(y) == (dims, dtype)``."""

import numpy as np
import pytest

import rlx_jax as rlx
from rlx_jax.ir import Graph


def G():
    return Graph("t")


def body_carry(shape=(3,), xs_shape=None, name="body"):
    """carry -> carry + x_t (or carry * 2 when no xs)."""
    b = Graph(name)
    c = b.input("carry", list(shape), "f32")
    if xs_shape is None:
        out = b.add(c, c)
    else:
        x = b.input("x_t", list(xs_shape), "f32")
        out = b.add(c, x)
    b.set_outputs([out])
    return b


# ---------------------------------------------------------------------------
# pyrlx surface
# ---------------------------------------------------------------------------

def test_input_param_dynamic():
    g = G()
    x = g.input("x", ["batch", 4], "f32")
    w = g.param("w", [4, 5], "bf16")
    assert g.shape_of(x) == (["batch", 4], "f32")
    assert g.shape_of(w) == ([4, 5], "bf16")
    assert g.node(x).shape.dims[0] == rlx.ir.Dynamic(0)


def test_matmul_batch_broadcast():
    g = G()
    a = g.input("a", [2, 1, 3, 4], "f32")
    b = g.input("b", [5, 4, 6], "f32")
    assert g.shape_of(g.matmul(a, b)) == ([2, 5, 3, 6], "f32")
    assert g.shape_of(g.matmul_with_shape(a, b, [2, 5, 3, 6], "f32")) == ([2, 5, 3, 6], "f32")


def test_lora_dense_solve():
    g = G()
    x, w = g.input("x", [2, 8], "f32"), g.param("w", [8, 4], "f32")
    a, b = g.param("a", [8, 2], "f32"), g.param("b", [2, 4], "f32")
    assert g.shape_of(g.lora_matmul(x, w, a, b, 0.5, [2, 4], "f32")) == ([2, 4], "f32")
    A, B = g.input("A", [3, 3], "f64"), g.input("B", [3, 2], "f64")
    assert g.shape_of(g.dense_solve(A, B, [3, 2], "f64")) == ([3, 2], "f64")
    A2, B2 = g.input("A2", [5, 3, 3], "f64"), g.input("B2", [5, 3], "f64")
    assert g.shape_of(g.batched_dense_solve(A2, B2, [5, 3], "f64")) == ([5, 3], "f64")


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max", "min", "pow", "+", "*"])
def test_binary(op):
    g = G()
    a, b = g.input("a", [3, 1], "f32"), g.input("b", [5], "f32")
    assert g.shape_of(g.binary(op, a, b)) == ([3, 5], "f32")


def test_binary_shortcuts():
    g = G()
    a, b = g.input("a", [3, 5], "f16"), g.input("b", [1, 5], "f16")
    for fn in (g.add, g.sub, g.mul, g.div, g.maximum, g.minimum, g.pow):
        assert g.shape_of(fn(a, b)) == ([3, 5], "f16")


@pytest.mark.parametrize("kind", ["gelu", "gelu_approx", "silu", "relu", "sigmoid", "tanh", "exp", "log",
                                  "sqrt", "rsqrt", "neg", "abs", "sin", "cos", "tan", "atan", "round"])
def test_activation(kind):
    g = G()
    x = g.input("x", [2, 3], "f32")
    y = g.activation(kind, x)
    assert g.shape_of(y) == ([2, 3], "f32")
    assert g.shape_of(getattr(g, kind)(x)) == ([2, 3], "f32")


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge", "==", "<"])
def test_compare_where(op):
    g = G()
    a, b = g.input("a", [4, 1], "f32"), g.input("b", [1, 3], "f32")
    c = g.compare(op, a, b)
    assert g.shape_of(c) == ([4, 3], "bool")
    assert g.shape_of(g.eq_(a, b)) == ([4, 3], "bool")
    assert g.shape_of(g.lt_(a, b)) == ([4, 3], "bool")
    assert g.shape_of(g.where_(c, a, b)) == ([4, 3], "f32")


def test_where_broadcast():
    g = G()
    c = g.input("c", [4, 1], "bool")
    a, b = g.input("a", [1, 3], "f32"), g.input("b", [], "f32")
    assert g.shape_of(g.where_(c, a, b)) == ([4, 3], "f32")


def test_reduce_keep_dim_and_negative_axes():
    g = G()
    x = g.input("x", [2, 3, 4], "f32")
    assert g.shape_of(g.reduce(x, "sum", [1])) == ([2, 4], "f32")
    assert g.shape_of(g.reduce(x, "max", [0, 2], True)) == ([1, 3, 1], "f32")
    assert g.shape_of(g.sum(x, [-1], False)) == ([2, 3], "f32")
    assert g.shape_of(g.mean(x, [0], True)) == ([1, 3, 4], "f32")
    assert g.shape_of(g.prod(x, [1])) == ([2, 4], "f32")
    assert g.shape_of(g.reduce_min(x, [1])) == ([2, 4], "f32")
    assert g.shape_of(g.reduce_max(x, [1])) == ([2, 4], "f32")


def test_softmax_cumsum_sample_topk():
    g = G()
    x = g.input("x", [2, 10], "f32")
    assert g.shape_of(g.softmax(x)) == ([2, 10], "f32")
    assert g.shape_of(g.cumsum(x, 1)) == ([2, 10], "f32")
    assert g.shape_of(g.cumsum(x, -1, True)) == ([2, 10], "f32")
    assert g.shape_of(g.sample(x, 5, 0.9, 0.7, 42, [2])) == ([2], "i32")
    assert g.shape_of(g.top_k(x, 3)) == ([2, 3], "f32")


def test_shape_ops():
    g = G()
    x = g.input("x", [2, 3, 4], "f32")
    assert g.shape_of(g.reshape(x, [6, -1])) == ([6, 4], "f32")
    assert g.shape_of(g.transpose(x, [2, 0, 1])) == ([4, 2, 3], "f32")
    assert g.shape_of(g.narrow(x, 2, 1, 2)) == ([2, 3, 2], "f32")
    y = g.input("y", [2, 5, 4], "f32")
    assert g.shape_of(g.concat([x, y], 1)) == ([2, 8, 4], "f32")
    assert g.shape_of(g.cast(x, "bf16")) == ([2, 3, 4], "bf16")
    e = g.input("e", [1, 4], "f32")
    assert g.shape_of(g.expand(e, [3, 5, 4])) == ([3, 5, 4], "f32")
    assert g.shape_of(g.expand(e, [7, -1])) == ([7, 4], "f32")


def test_gather_axes():
    g = G()
    table = g.param("emb", [100, 16], "f32")
    ids = g.input("ids", [2, 7], "i32")
    assert g.shape_of(g.gather(table, ids, 0)) == ([2, 7, 16], "f32")
    t3 = g.input("t3", [4, 5, 6], "f32")
    idx = g.input("idx", [3], "i64")
    assert g.shape_of(g.gather(t3, idx, 1)) == ([3, 6], "f32")  # RLX: indices + table[axis+1:]
    assert g.shape_of(g.take(t3, idx, 1)) == ([4, 3, 6], "f32")  # np.take


def test_dynamic_reshape_and_concat():
    g = G()
    x = g.input("x", ["batch", 3, 4], "f32")
    assert g.shape_of(g.reshape(x, [-1, 4])) == (["batch", 4], "f32")
    y = g.input("y", ["batch", 2, 4], "f32")
    assert g.shape_of(g.concat([x, y], 1)) == (["batch", 5, 4], "f32")
    s = g.input("s", ["tokens_for_test", 8], "f16")
    assert g.shape_of(s) == (["tokens_for_test", 8], "f16")


def test_norms():
    g = G()
    x = g.input("x", [2, 5, 8], "f32")
    ga, be = g.param("g", [8], "f32"), g.param("b", [8], "f32")
    assert g.shape_of(g.layer_norm(x, ga, be)) == ([2, 5, 8], "f32")
    assert g.shape_of(g.layer_norm(x, ga, be, -1, 1e-6)) == ([2, 5, 8], "f32")
    assert g.shape_of(g.rms_norm(x, ga, be)) == ([2, 5, 8], "f32")
    g2 = g.param("g2", [5], "f32")
    b2 = g.param("b2", [5], "f32")
    assert g.shape_of(g.layer_norm(x, g2, b2, 1)) == ([2, 5, 8], "f32")
    assert g.shape_of(g.rms_norm(x, g2, b2, 1e-6, 1)) == ([2, 5, 8], "f32")
    img = g.input("img", [2, 6, 4, 4], "f32")
    c6, c6b = g.param("c6", [6], "f32"), g.param("c6b", [6], "f32")
    assert g.shape_of(g.group_norm(img, c6, c6b, 3)) == ([2, 6, 4, 4], "f32")
    m, v = g.param("m", [6], "f32"), g.param("v", [6], "f32")
    assert g.shape_of(g.batch_norm_inference(img, c6, c6b, m, v)) == ([2, 6, 4, 4], "f32")
    assert g.shape_of(g.layer_norm2d(img, c6, c6b)) == ([2, 6, 4, 4], "f32")


def test_attention_variants():
    g = G()
    q = g.input("q", [2, 5, 8], "f32")
    k = g.input("k", [2, 7, 4], "f32")   # GQA: 1 kv head of 4 for 2 query heads
    v = g.input("v", [2, 7, 4], "f32")
    mask = g.input("mask", [2, 7], "f32")
    assert g.shape_of(g.attention(q, k, v, mask, 2, 4)) == ([2, 5, 8], "f32")
    assert g.shape_of(g.attention_kind(q, k, v, 2, 4, "causal")) == ([2, 5, 8], "f32")
    assert g.shape_of(g.attention_kind(q, k, v, 2, 4, "sliding:3")) == ([2, 5, 8], "f32")
    assert g.shape_of(g.attention_kind(q, k, v, 2, 4, "none")) == ([2, 5, 8], "f32")
    bias = g.input("bias", [1, 2, 5, 7], "f32")
    y = g.attention_opts(q, k, v, 2, 4, "bias", bias, score_scale=0.3, softcap=30.0)
    assert g.shape_of(y) == ([2, 5, 8], "f32")
    op = g.node(y).op
    assert op.score_scale == 0.3 and op.attn_logit_softcap == 30.0 and op.mask_kind.kind == "Bias"
    q4 = g.input("q4", [2, 5, 2, 4], "f32")
    k4 = g.input("k4", [2, 7, 1, 4], "f32")
    assert g.shape_of(g.attention_kind(q4, k4, k4, 2, 4, "causal")) == ([2, 5, 2, 4], "f32")
    qh = g.input("qh", [2, 2, 5, 4], "f32")   # [B, H, S, D]
    kh = g.input("kh", [2, 1, 7, 4], "f32")
    assert g.shape_of(g.attention_kind(qh, kh, kh, 2, 4, "none")) == ([2, 2, 5, 4], "f32")
    q2, k2 = g.input("q2", [5, 8], "f32"), g.input("k2", [7, 8], "f32")   # [S, H*D]
    assert g.shape_of(g.attention_kind(q2, k2, k2, 2, 4, "causal")) == ([5, 8], "f32")


def test_rope():
    g = G()
    x = g.input("x", [1, 6, 16], "f32")
    cos, sin = g.input("cos", [6, 4], "f32"), g.input("sin", [6, 4], "f32")
    assert g.shape_of(g.rope(x, cos, sin, 8)) == ([1, 6, 16], "f32")
    c2, s2 = g.input("c2", [6, 2], "f32"), g.input("s2", [6, 2], "f32")
    y = g.rope_n(x, c2, s2, 8, 4)
    assert g.shape_of(y) == ([1, 6, 16], "f32") and g.node(y).op.n_rot == 4
    assert g.shape_of(g.axial_rope2d(x, 2, 3, 8, 2)) == ([1, 6, 16], "f32")


def test_conv_pool():
    g = G()
    x = g.input("x", [2, 4, 9, 9], "f32")
    w = g.param("w", [6, 2, 3, 3], "f32")
    assert g.shape_of(g.conv2d(x, w, [3, 3], [2, 2], [1, 1], [1, 1], 2)) == ([2, 6, 5, 5], "f32")
    assert g.shape_of(g.conv2d(x, g.param("w1", [8, 4, 3, 3], "f32"))) == ([2, 8, 7, 7], "f32")
    assert g.shape_of(g.conv2d(x, g.param("w2", [8, 4, 3, 3], "f32"), dilation=2)) == ([2, 8, 5, 5], "f32")
    wt = g.param("wt", [4, 3, 3, 3], "f32")
    assert g.shape_of(g.conv_transpose2d(x, wt, stride=2, padding=1, output_padding=1)) == ([2, 3, 18, 18], "f32")
    assert g.shape_of(g.max_pool2d(x, [2, 2], [2, 2], [0, 0])) == ([2, 4, 4, 4], "f32")
    assert g.shape_of(g.avg_pool2d(x, 3, 1, 1)) == ([2, 4, 9, 9], "f32")
    assert g.shape_of(g.pool(x, "max", [3, 3], [2, 2])) == ([2, 4, 4, 4], "f32")
    assert g.shape_of(g.resize_nearest_2x(x)) == ([2, 4, 18, 18], "f32")
    x1 = g.input("x1", [1, 2, 10], "f32")
    assert g.shape_of(g.conv(x1, g.param("w1d", [3, 2, 4], "f32"), stride=2)) == ([1, 3, 4], "f32")


def test_loss_and_moe():
    g = G()
    logits, labels = g.input("logits", [4, 10], "f32"), g.input("labels", [4], "f32")
    assert g.shape_of(g.softmax_cross_entropy_with_logits(logits, labels)) == ([4], "f32")
    x, w, idx = g.input("x", [6, 8], "f32"), g.param("w", [3, 8, 5], "f32"), g.input("idx", [6], "f32")
    assert g.shape_of(g.grouped_matmul(x, w, idx)) == ([6, 5], "f32")
    upd, ind = g.input("upd", [6, 5], "f32"), g.input("ind", [6], "i32")
    assert g.shape_of(g.scatter_add(upd, ind, [10, 5])) == ([10, 5], "f32")
    upd2, ind2 = g.input("upd2", [2, 3, 5], "f32"), g.input("ind2", [2, 3], "i32")
    assert g.shape_of(g.scatter_add(upd2, ind2, [10, 5])) == ([10, 5], "f32")


def test_complex_and_stop_gradient():
    g = G()
    z = g.input("z", [3, 4], "c64")
    assert g.shape_of(g.complex_norm_sq(z)) == ([3, 4], "f32")
    assert g.shape_of(g.conjugate(z)) == ([3, 4], "c64")
    x = g.input("x", [3], "f32")
    assert g.shape_of(g.stop_gradient(x)) == ([3], "f32")


def test_dot_general():
    g = G()
    a, b = g.input("a", [7, 2, 3], "f32"), g.input("b", [7, 3, 5], "f32")
    assert g.shape_of(g.dot_general(a, b, [2], [1], [0], [0])) == ([7, 2, 5], "f32")


def test_quantisation():
    g = G()
    x = g.input("x", [4, 3], "f32")
    q = g.quantize(x, [0.1, 0.2, 0.3], [0, 0, 1], axis=1)
    assert g.shape_of(q) == ([4, 3], "i8")
    assert g.shape_of(g.dequantize(q, [0.1], [0])) == ([4, 3], "f32")
    assert g.shape_of(g.fake_quantize(x, 8)) == ([4, 3], "f32")
    st = g.input("state", [3], "f32")
    y = g.fake_quantize(x, 4, 1, "tanh", "ema:0.99", st)
    assert g.shape_of(y) == ([4, 3], "f32") and g.node(y).op.scale_mode.decay == 0.99
    sc = g.param("scale", [1], "f32")
    assert g.shape_of(g.fake_quantize_lsq(x, sc, 4)) == ([4, 3], "f32")
    wq, s, zp = g.param("wq", [3, 8], "i8"), g.param("s", [1, 8], "f32"), g.param("zp", [1, 8], "f32")
    assert g.shape_of(g.dequant_matmul([x, wq, s, zp], "int8_block:32", [4, 8])) == ([4, 8], "f32")
    packed = g.param("packed", [144], "u8")
    assert g.shape_of(g.dequant_matmul([x, packed], "gguf_q4k", [4, 8])) == ([4, 8], "f32")
    xi, wi, bi = g.input("xi", [4, 3], "i8"), g.param("wi", [3, 2], "i8"), g.param("bi", [2], "i32")
    assert g.shape_of(g.q_matmul(xi, wi, bi, 0, 0, 0, 0.01)) == ([4, 2], "i8")
    xc, wc, bc = g.input("xc", [1, 2, 5, 5], "i8"), g.param("wc", [4, 2, 3, 3], "i8"), g.param("bc", [4], "i32")
    assert g.shape_of(g.q_conv2d(xc, wc, bc, 3, 1, 1, 1, 1, -3, 0, 5, 0.02)) == ([1, 4, 5, 5], "i8")
    xm, pm, im = g.input("xm", [6, 8], "f32"), g.param("pm", [1000], "u8"), g.input("im", [6], "f32")
    assert g.shape_of(g.dequant_grouped_matmul(xm, pm, im, "gguf_q8_0", [6, 4])) == ([6, 4], "f32")
    assert g.shape_of(g.dequant_moe_weights(pm, "gguf_q8_0", [2, 8, 4])) == ([2, 8, 4], "f32")


def test_recurrent():
    g = G()
    x, dt = g.input("x", [2, 5, 3], "f32"), g.input("dt", [2, 5, 3], "f32")
    A = g.param("A", [3, 4], "f32")
    B, C = g.input("B", [2, 5, 4], "f32"), g.input("C", [2, 5, 4], "f32")
    assert g.shape_of(g.selective_scan(x, dt, A, B, C)) == ([2, 5, 3], "f32")
    q = g.input("q", [2, 5, 3, 4], "f32")
    gt, beta = g.input("gt", [2, 5, 3], "f32"), g.input("beta", [2, 5, 3], "f32")
    assert g.shape_of(g.gated_delta_net(q, q, q, gt, beta)) == ([2, 5, 3, 4], "f32")
    st = g.input("st", [2, 3, 4, 4], "f32")
    y = g.gated_delta_net(q, q, q, gt, beta, 4, st)
    assert g.shape_of(y) == ([2, 5, 3, 4], "f32") and g.node(y).op.carry_state


def test_fused():
    g = G()
    x, w, b = g.input("x", [2, 4], "f32"), g.param("w", [4, 6], "f32"), g.param("b", [6], "f32")
    assert g.shape_of(g.fused_matmul_bias_act(x, w, b, [2, 6], "f32", "gelu")) == ([2, 6], "f32")
    assert g.shape_of(g.fused_matmul_bias_act(x, w, b, [2, 6], "f32")) == ([2, 6], "f32")
    r = g.input("r", [2, 4], "f32")
    ga, be, bb = g.param("ga", [4], "f32"), g.param("be", [4], "f32"), g.param("bb", [4], "f32")
    assert g.shape_of(g.fused_residual_ln(x, r, ga, be)) == ([2, 4], "f32")
    assert g.shape_of(g.fused_residual_rms_norm(x, r, ga, be, 1e-6, bb)) == ([2, 4], "f32")
    assert g.shape_of(g.fused_swiglu(w)) == ([4, 3], "f32")
    assert g.shape_of(g.fused_swiglu(w, "f16", True)) == ([4, 3], "f16")
    h = g.input("h", [1, 3, 8], "f32")
    wqkv, wo, m = g.param("wqkv", [8, 24], "f32"), g.param("wo", [8, 8], "f32"), g.input("m", [1, 3], "f32")
    assert g.shape_of(g.fused_attention_block([h, wqkv, wo, m], 2, 4)) == ([1, 3, 8], "f32")
    p = [g.param(f"p{i}", [8], "f32") for i in range(9)]
    ins = [h, wqkv, p[0], wo, p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[0], m]
    assert g.shape_of(g.fused_transformer_layer(ins, 2, 4, 16)) == ([1, 3, 8], "f32")


def test_fft_surface():
    g = G()
    x = g.input("x", [2, 6], "f32")
    re, im = g.fft_real(x)
    assert g.shape_of(re) == ([2, 8], "f32") and g.shape_of(im) == ([2, 8], "f32")
    hr, hi = g.rfft(x, "ortho")
    assert g.shape_of(hr) == ([2, 5], "f32")
    assert g.shape_of(g.irfft(hr, hi, 6)) == ([2, 6], "f32")
    blk = g.input("blk", [3, 16], "f32")
    assert g.shape_of(g.fft(blk)) == ([3, 16], "f32")
    assert g.shape_of(g.fft_norm(blk, True, "forward")) == ([3, 16], "f32")
    z = g.input("z", [4, 8], "c64")
    assert g.shape_of(g.fft(z, True)) == ([4, 8], "c64")
    assert g.shape_of(g.fftfreq(8)) == ([8], "f64")
    assert g.shape_of(g.rfftfreq(8)) == ([5], "f64")
    assert g.shape_of(g.psd(hr, hi)) == ([2, 5], "f32")
    assert g.shape_of(g.psd_real(x)) == ([2, 5], "f32")


def test_log_mel():
    g = G()
    spec, fb = g.input("spec", [3, 20, 33], "f32"), g.param("fb", [33, 8], "f32")
    y = g.log_mel(spec, fb)
    assert g.shape_of(y) == ([3, 20, 8], "f32")
    assert g.shape_of(g.log_mel_backward(spec, fb, y)) == ([3, 20, 33], "f32")


def test_splat():
    g = G()
    n = 5
    ins = [g.input(nm, [k], "f32") for nm, k in
           (("pos", 3 * n), ("sc", 3 * n), ("rot", 4 * n), ("op", n), ("col", 3 * n), ("sh", 9 * n), ("meta", 23))]
    img = g.gaussian_splat_render(*ins, width=8, height=4)
    assert g.shape_of(img) == ([128], "f32")
    assert g.shape_of(g.gaussian_splat_render_backward(ins, img, 8, 4)) == ([14 * n + 9 * n], "f32")
    prep = g.gaussian_splat_prepare(ins, [1000], 8, 4)
    assert g.shape_of(prep) == ([1000], "f32")
    assert g.shape_of(g.gaussian_splat_rasterize(prep, ins[6], 8, 4)) == ([128], "f32")


def test_rng_and_constant():
    g = G()
    assert g.shape_of(g.rng_uniform([2, 3], "f32", 7)) == ([2, 3], "f32")
    assert g.shape_of(g.rng_normal([4], "bf16", 1, 0.0, 2.0)) == ([4], "bf16")
    c = g.constant(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert g.shape_of(c) == ([2, 3], "i32")
    np.testing.assert_array_equal(g.node(c).op.to_numpy(g.node(c).shape), np.arange(6).reshape(2, 3))
    assert g.shape_of(g.constant(np.ones(3, np.float32), "bf16")) == ([3], "bf16")
    assert g.shape_of(g.scalar(2.0)) == ([], "f32")


def test_u64_seeds_span_the_whole_range_and_round_trip():
    g = G()
    g.set_outputs([g.rng_uniform([2], "f32", 2**64 - 1), g.rng_normal([2], "f32", 2**63 + 5)])
    assert rlx.Graph.from_json(g.to_json()) == g
    for bad in (2**64, -1):
        with pytest.raises(rlx.GraphError, match="seed"):
            g.rng_uniform([2], "f32", bad)


def test_elementwise_region():
    from rlx_jax.ir import ChainOperand, ChainStep

    g = G()
    a, b = g.input("a", [4], "f32"), g.input("b", [4], "f32")
    chain = [ChainStep("Binary", "Add", (ChainOperand("Input", 0), ChainOperand("Input", 1))),
             ChainStep("Activation", "Relu", (ChainOperand("Step", 0),))]
    assert g.shape_of(g.elementwise_region([a, b], chain, [4], "f32")) == ([4], "f32")


# ---------------------------------------------------------------------------
# backward ops
# ---------------------------------------------------------------------------

def test_backward_elementwise_and_norms():
    g = G()
    x, dy = g.input("x", [2, 8], "f32"), g.input("dy", [2, 8], "f32")
    ga, be = g.param("g", [8], "f32"), g.param("b", [8], "f32")
    assert g.shape_of(g.relu_backward(x, dy)) == ([2, 8], "f32")
    assert g.shape_of(g.activation_backward("gelu", x, dy)) == ([2, 8], "f32")
    assert g.shape_of(g.layer_norm_backward_input(x, ga, dy, -1, 1e-5)) == ([2, 8], "f32")
    assert g.shape_of(g.layer_norm_backward_gamma(x, dy)) == ([8], "f32")
    assert g.shape_of(g.layer_norm_backward_gamma(x, dy, [8], -1, 1e-5)) == ([8], "f32")
    assert g.shape_of(g.layer_norm_backward_gamma(x, dy, None, 0)) == ([2], "f32")
    assert g.shape_of(g.rms_norm_backward_input(x, ga, be, dy)) == ([2, 8], "f32")
    assert g.shape_of(g.rms_norm_backward_gamma(x, ga, be, dy)) == ([8], "f32")
    assert g.shape_of(g.rms_norm_backward_beta(x, ga, be, dy)) == ([8], "f32")
    assert g.shape_of(g.cumsum_backward(dy, None, 1, True)) == ([2, 8], "f32")
    sc = g.param("sc", [8], "f32")
    assert g.shape_of(g.fake_quantize_backward(x, dy, 8, None, "clipped_identity")) == ([2, 8], "f32")
    assert g.shape_of(g.fake_quantize_lsq_backward_x(x, sc, dy, 4, 1)) == ([2, 8], "f32")
    assert g.shape_of(g.fake_quantize_lsq_backward_scale(x, sc, dy, 4, 1)) == ([8], "f32")


def test_backward_group_batch_norm():
    g = G()
    x, dy = g.input("x", [2, 6, 3, 3], "f32"), g.input("dy", [2, 6, 3, 3], "f32")
    c = [g.param(f"c{i}", [6], "f32") for i in range(4)]
    assert g.shape_of(g.group_norm_backward_input(x, c[0], c[1], dy, 3)) == ([2, 6, 3, 3], "f32")
    assert g.shape_of(g.group_norm_backward_gamma(x, dy, [6], 3)) == ([6], "f32")
    assert g.shape_of(g.group_norm_backward_beta(x, dy, None, 3)) == ([6], "f32")
    assert g.shape_of(g.batch_norm_inference_backward_input(x, c[0], c[2], c[3], dy)) == ([2, 6, 3, 3], "f32")
    assert g.shape_of(g.batch_norm_inference_backward_gamma(x, c[2], c[3], dy)) == ([6], "f32")
    assert g.shape_of(g.batch_norm_inference_backward_beta(dy, [6])) == ([6], "f32")


def test_backward_rope_gather_pool_conv():
    g = G()
    dy = g.input("dy", [1, 6, 16], "f32")
    cos, sin = g.input("cos", [6, 4], "f32"), g.input("sin", [6, 4], "f32")
    assert g.shape_of(g.rope_backward(dy, cos, sin, 8)) == ([1, 6, 16], "f32")
    gdy, ids = g.input("gdy", [2, 7, 16], "f32"), g.input("ids", [2, 7], "f32")
    assert g.shape_of(g.gather_backward(gdy, ids, [100, 16], 0)) == ([100, 16], "f32")
    x = g.input("x", [2, 4, 8, 8], "f32")
    pdy = g.input("pdy", [2, 4, 4, 4], "f32")
    assert g.shape_of(g.maxpool2d_backward(x, pdy, [2, 2], [2, 2], [0, 0])) == ([2, 4, 8, 8], "f32")
    w = g.param("w", [6, 2, 3, 3], "f32")
    cdy = g.input("cdy", [2, 6, 4, 4], "f32")
    dx = g.conv2d_backward_input(cdy, w, [2, 4, 8, 8], [3, 3], [2, 2], [1, 1], [1, 1], 2)
    assert g.shape_of(dx) == ([2, 4, 8, 8], "f32")
    dw = g.conv2d_backward_weight(x, cdy, [6, 2, 3, 3], [3, 3], [2, 2], [1, 1], [1, 1], 2)
    assert g.shape_of(dw) == ([6, 2, 3, 3], "f32")
    assert g.shape_of(g.conv2d_backward_weight(x, cdy, None, 3, 2, 1, 1, 2)) == ([6, 2, 3, 3], "f32")


def test_backward_loss_attention_complex():
    g = G()
    logits, labels, dl = g.input("l", [4, 10], "f32"), g.input("y", [4], "f32"), g.input("dl", [4], "f32")
    assert g.shape_of(g.softmax_cross_entropy_backward(logits, labels, dl)) == ([4, 10], "f32")
    q, k, v = g.input("q", [2, 5, 8], "f32"), g.input("k", [2, 7, 8], "f32"), g.input("v", [2, 7, 8], "f32")
    dy = g.input("dy", [2, 5, 8], "f32")
    dq, dk, dv = g.attention_backward_all(q, k, v, dy, 2, 4, "causal")
    assert [g.shape_of(i) for i in (dq, dk, dv)] == [([2, 5, 8], "f32"), ([2, 7, 8], "f32"), ([2, 7, 8], "f32")]
    m = g.input("m", [2, 7], "f32")
    y = g.attention_backward("key", q, k, v, dy, 2, 4, "custom", m)
    assert g.shape_of(y) == ([2, 7, 8], "f32") and len(g.node(y).inputs) == 5
    z, gg = g.input("z", [3], "c64"), g.input("gg", [3], "f32")
    assert g.shape_of(g.complex_norm_sq_backward(z, gg)) == ([3], "c64")


# ---------------------------------------------------------------------------
# control flow / extension
# ---------------------------------------------------------------------------

def test_scan_and_backward():
    g = G()
    init = g.input("init", [3], "f32")
    xs = g.input("xs", [5, 3], "f32")
    y = g.scan(init, body_carry((3,), (3,)), 5, xs=[xs])
    assert g.shape_of(y) == ([3], "f32")
    traj = g.scan(init, body_carry((3,), (3,)), 5, xs=[xs], save_trajectory=True)
    assert g.shape_of(traj) == ([5, 3], "f32")
    b = Graph("bc")
    c, k = b.input("carry", [3], "f32"), b.input("k", [3], "f32")
    b.set_outputs([b.mul(c, k)])
    assert g.shape_of(g.scan(init, b, 4, bcasts=[init], num_checkpoints=2)) == ([3], "f32")
    vjp = Graph("vjp")
    vc, vx, vd = vjp.input("carry", [3], "f32"), vjp.input("x_t", [3], "f32"), vjp.input("d_output", [3], "f32")
    vjp.set_outputs([vd, vd])
    up = g.input("up", [5, 3], "f32")
    assert g.shape_of(g.scan_backward(init, traj, up, [xs], vjp, 5, True)) == ([3], "f32")
    assert g.shape_of(g.scan_backward_xs(init, traj, up, [xs], vjp, 5, True, 0)) == ([5, 3], "f32")


def test_if_while():
    g = G()
    p = g.input("p", [], "bool")
    a = g.input("a", [2, 2], "f32")
    t, e = Graph("then"), Graph("else")
    ta = t.input("a", [2, 2], "f32")
    t.set_outputs([t.exp(ta)])
    ea = e.input("a", [2, 2], "f32")
    e.set_outputs([e.neg(ea)])
    assert g.shape_of(g.if_(p, t, e, [a])) == ([2, 2], "f32")
    cond = Graph("cond")
    ci = cond.input("i", [], "f32")
    lim = cond.constant(np.float32(10))
    cond.set_outputs([cond.lt_(ci, lim)])
    body = Graph("body")
    bi = body.input("i", [], "f32")
    one = body.constant(np.float32(1))
    body.set_outputs([body.add(bi, one)])
    i0 = g.input("i0", [], "f32")
    assert g.shape_of(g.while_([i0], cond, body, 100)) == ([], "f32")


def test_custom_fn_and_custom():
    g = G()
    x = g.input("x", [4], "f32")
    fwd = Graph("fwd")
    fx = fwd.input("x", [4], "f32")
    fwd.set_outputs([fwd.tanh(fx)])
    vjp = Graph("vjp")
    vjp.input("x", [4], "f32")
    vjp.input("primal_output", [4], "f32")
    d = vjp.input("d_output", [4], "f32")
    vjp.set_outputs([d])
    jvp = Graph("jvp")
    jvp.input("x", [4], "f32")
    t0 = jvp.input("tangent_0", [4], "f32")
    jvp.set_outputs([t0])
    y = g.custom_fn([x], fwd, vjp, jvp)
    assert g.shape_of(y) == ([4], "f32")

    rlx.register_op("test_builders_dup", lambda ins, attrs: (list(ins[0].dims) * 2, "f32"))
    z = g.custom("test_builders_dup", [x], b"\x01")
    assert g.shape_of(z) == ([4, 4], "f32")
    u = g.custom("not_registered_op", [x], out_shape=[2], dtype="f64")
    assert g.shape_of(u) == ([2], "f64")


def test_aliases_and_comparison_shortcuts():
    g = G()
    a, b = g.input("a", [2, 3], "f32"), g.input("b", [3], "f32")
    for fn in (g.ne_, g.le_, g.gt_, g.ge_):
        assert g.shape_of(fn(a, b)) == ([2, 3], "bool")
    assert g.shape_of(g.where(g.gt_(a, b), a, b)) == ([2, 3], "f32")
    assert g.shape_of(g.topk(a, 2)) == ([2, 2], "f32")
    img = g.input("img", [1, 2, 4, 4], "f32")
    assert g.shape_of(g.resize_nearest2x(img)) == ([1, 2, 8, 8], "f32")
    pdy = g.input("pdy", [1, 2, 2, 2], "f32")
    assert g.shape_of(g.max_pool2d_backward(img, pdy, 2)) == ([1, 2, 4, 4], "f32")


@pytest.mark.parametrize("build", [lambda g, x: g.transpose(x, None), lambda g, x: g.concat(x, 0),
                                   lambda g, x: g.expand(x, None), lambda g, x: g.reshape(x, 6)],
                         ids=["transpose", "concat", "expand", "reshape"])
def test_shape_builders_name_the_node_for_a_non_sequence_argument(build):
    g = G()
    x = g.input("x", [2, 3], "f32")
    with pytest.raises(rlx.GraphError, match="must be a sequence"):
        build(g, x)
