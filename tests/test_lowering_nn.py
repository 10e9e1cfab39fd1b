"""Norms, attention, RoPE, conv/pool, loss, cumsum, gather and |z|^2 lowered through
their fused-op families, checked against independent NumPy of the RLX semantics."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx

RNG = np.random.default_rng(4)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def run_graph(build, **arrays):
    g = rlx.Graph("nn")
    ids = {}
    for name, a in arrays.items():
        dt = {np.float32: "f32", np.int32: "i32", np.float64: "f64", np.complex64: "c64"}[a.dtype.type]
        ids[name] = g.input(name, list(a.shape), dt)
    out = build(g, ids)
    g.set_outputs(list(out) if isinstance(out, (list, tuple)) else [out])
    return [np.asarray(o) for o in rlx.to_jax(g)({}, arrays)]


# ---- norms -------------------------------------------------------------------------------

def np_layer_norm(x, g, b, axis, eps):
    """Normalise over one axis (gamma, beta [x.shape[axis]])."""
    m = x.mean(axis, keepdims=True)
    v = ((x - m) ** 2).mean(axis, keepdims=True)
    shape = [1] * x.ndim
    shape[axis] = -1
    return (x - m) / np.sqrt(v + eps) * g.reshape(shape) + b.reshape(shape)


def np_rms_norm(x, g, b, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g + b


def test_layer_norm_last_and_middle_axis():
    x, g, b = f32(3, 5, 7), f32(7), f32(7)
    (y,) = run_graph(lambda G, i: G.layer_norm(i["x"], i["g"], i["b"], -1, 1e-5), x=x, g=g, b=b)
    np.testing.assert_allclose(y, np_layer_norm(x, g, b, -1, 1e-5), rtol=1e-4, atol=1e-5)
    g2, b2 = f32(5), f32(5)
    (y,) = run_graph(lambda G, i: G.layer_norm(i["x"], i["g"], i["b"], 1, 1e-3), x=x, g=g2, b=b2)
    np.testing.assert_allclose(y, np_layer_norm(x, g2, b2, 1, 1e-3), rtol=1e-4, atol=1e-5)


def test_rms_norm():
    x, g, b = f32(2, 3, 9), f32(9), f32(9)
    (y,) = run_graph(lambda G, i: G.rms_norm(i["x"], i["g"], i["b"], 1e-5), x=x, g=g, b=b)
    np.testing.assert_allclose(y, np_rms_norm(x, g, b, 1e-5), rtol=1e-4, atol=1e-5)


def test_group_norm_nchw():
    x, g, b = f32(2, 6, 3, 5), f32(6), f32(6)
    (y,) = run_graph(lambda G, i: G.group_norm(i["x"], i["g"], i["b"], 3, 1e-5), x=x, g=g, b=b)
    xr = x.reshape(2, 3, -1)
    xn = ((xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
    np.testing.assert_allclose(y, xn * g[:, None, None] + b[:, None, None], rtol=1e-4, atol=1e-5)


def test_batch_norm_inference_and_layer_norm2d():
    x, g, b, m = f32(2, 4, 3, 3), f32(4), f32(4), f32(4)
    v = np.abs(f32(4)) + 0.5
    (y,) = run_graph(lambda G, i: G.batch_norm_inference(i["x"], i["g"], i["b"], i["m"], i["v"], 1e-5),
                     x=x, g=g, b=b, m=m, v=v)
    c = (slice(None), None, None)
    ref = (x - m[c]) / np.sqrt(v[c] + 1e-5) * g[c] + b[c]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    (y,) = run_graph(lambda G, i: G.layer_norm2d(i["x"], i["g"], i["b"], 1e-6), x=x, g=g, b=b)
    mu = x.mean(1, keepdims=True)
    var = x.var(1, keepdims=True)
    np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + 1e-6) * g[c] + b[c], rtol=1e-4, atol=1e-5)


# ---- attention --------------------------------------------------------------------------------

def np_attention(q, k, v, keep=None, bias=None, scale=None, softcap=None):
    """q [B, Sq, H, D], k/v [B, Sk, H, D]; keep [Sq, Sk] bool or None."""
    d = q.shape[-1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * (scale if scale is not None else 1 / np.sqrt(d))
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def _attn(mask_kind, sq=5, sk=5, extra=None, scale=None, softcap=None, layout="bsh"):
    b, h, d = 2, 3, 4
    q, k, v = f32(b, sq, h, d), f32(b, sk, h, d), f32(b, sk, h, d)
    def to_layout(t):
        if layout == "bsh":
            return t.reshape(t.shape[0], t.shape[1], h * d)
        if layout == "bhsd":
            return np.ascontiguousarray(t.transpose(0, 2, 1, 3))
        return t
    arrays = dict(q=to_layout(q), k=to_layout(k), v=to_layout(v))
    if extra is not None:
        arrays["m"] = extra

    def build(G, i):
        return G.attention_opts(i["q"], i["k"], i["v"], h, d, mask_kind, i.get("m"), scale, softcap)

    (y,) = run_graph(build, **arrays)
    if layout == "bsh":
        y = y.reshape(b, sq, h, d)
    elif layout == "bhsd":
        y = y.transpose(0, 2, 1, 3)
    return y, q, k, v


@pytest.mark.parametrize("layout", ["bsh", "bhsd", "bshd"])
def test_attention_no_mask_and_layouts(layout):
    y, q, k, v = _attn("none", layout=layout)
    np.testing.assert_allclose(y, np_attention(q, k, v), rtol=1e-4, atol=1e-5)


def test_attention_causal_bottom_right_with_longer_keys():
    y, q, k, v = _attn("causal", sq=3, sk=6)
    i, j = np.arange(3)[:, None], np.arange(6)[None]
    np.testing.assert_allclose(y, np_attention(q, k, v, keep=j <= i + 3), rtol=1e-4, atol=1e-5)


def test_attention_sliding_window():
    y, q, k, v = _attn("sliding:2", sq=6, sk=6)
    i, j = np.arange(6)[:, None], np.arange(6)[None]
    keep = (j <= i) & (j >= i - 2)
    np.testing.assert_allclose(y, np_attention(q, k, v, keep=keep), rtol=1e-4, atol=1e-5)


def test_attention_custom_mask_scale_and_softcap():
    m = np.ones((2, 5), np.float32)
    m[0, 3:] = 0.0
    m[1, 0] = 0.2  # < 0.5: masked
    y, q, k, v = _attn("custom", extra=m, scale=0.3, softcap=2.0)
    keep = (m >= 0.5)[:, None, None, :]
    np.testing.assert_allclose(y, np_attention(q, k, v, keep=keep, scale=0.3, softcap=2.0),
                               rtol=1e-4, atol=1e-5)


def test_attention_bias():
    bias = f32(2, 3, 5, 5)
    y, q, k, v = _attn("bias", extra=bias)
    np.testing.assert_allclose(y, np_attention(q, k, v, bias=bias), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 5, 5), (2, 1, 1, 5), (1, 3, 5, 1)])
def test_attention_bias_with_broadcast_dims(shape):
    """RLX's Bias mask may have size-1 dims; the lowering broadcasts it to [B, H, Sq, Sk]."""
    bias = f32(*shape)
    y, q, k, v = _attn("bias", extra=bias)
    full = np.broadcast_to(bias, (2, 3, 5, 5))
    np.testing.assert_allclose(y, np_attention(q, k, v, bias=full), rtol=1e-4, atol=1e-5)


def test_attention_custom_mask_shared_by_the_batch_and_its_bias_gradient():
    m = np.ones((1, 5), np.float32)
    m[0, 1] = 0.0
    y, q, k, v = _attn("custom", extra=m)
    np.testing.assert_allclose(y, np_attention(q, k, v, keep=(m >= 0.5)[:, None, None, :]), rtol=1e-4, atol=1e-5)
    # the gradient of a broadcast bias is the full bias's gradient summed over the size-1 dims,
    # from jax.grad of the lowered graph and from the graph's own reverse mode alike
    g = rlx.Graph("attn_bias")
    qi, ki, vi = (g.param(n, [2, 5, 12]) for n in "qkv")
    bi = g.param("b", [1, 3, 1, 5])
    out = g.attention_opts(qi, ki, vi, 3, 4, "bias", bi)
    g.set_outputs([g.sum(g.mul(out, out), [0, 1, 2])])
    feeds = {n: t.reshape(2, 5, 12) for n, t in zip("qkv", (q, k, v))} | {"b": f32(1, 3, 1, 5)}
    fn = rlx.to_jax(g)
    got = jax.grad(lambda p: fn(p, {})[0])(feeds)["b"]

    def full_loss(bias):
        o = np_free_attention(*(jnp.asarray(t) for t in (q, k, v)), bias)
        return jnp.sum(o * o)

    want = jax.grad(full_loss)(jnp.broadcast_to(feeds["b"], (2, 3, 5, 5))).sum(axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    gg = rlx.grad_with_loss(g, ["b"])
    np.testing.assert_allclose(rlx.to_jax(gg)(feeds, {"d_output": np.float32(1)})[1], want, rtol=1e-4, atol=1e-5)


def np_free_attention(q, k, v, bias):
    """softmax(q.k / sqrt(d) + bias) . v in jax.numpy, [B, S, H, D] operands, bias [B, H, Sq, Sk]."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


# ---- rope ---------------------------------------------------------------------------------------

def np_rope(x, cos, sin, head_dim, n_rot):
    """NeoX: per head, dims [0, n_rot) rotate as halves (i, i + n_rot/2); cos/sin [S, n_rot/2]."""
    *lead, hd_all = x.shape
    xh = x.reshape(*lead, hd_all // head_dim, head_dim).copy()
    half = n_rot // 2
    c = cos[:, None, :half]
    s = sin[:, None, :half]
    x1, x2 = xh[..., :half].copy(), xh[..., half:n_rot].copy()
    xh[..., :half] = x1 * c - x2 * s
    xh[..., half:n_rot] = x2 * c + x1 * s
    return xh.reshape(x.shape)


@pytest.mark.parametrize("n_rot", [8, 4])
def test_rope_neox_partial_rotation(n_rot):
    s, h, d = 5, 2, 8
    x = f32(2, s, h * d)
    ang = RNG.uniform(0, 3, (s, n_rot // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    (y,) = run_graph(lambda G, i: G.rope_n(i["x"], i["c"], i["s"], d, n_rot), x=x, c=cos, s=sin)
    np.testing.assert_allclose(y, np_rope(x, cos, sin, d, n_rot), rtol=1e-5, atol=1e-5)


# ---- conv / pool ------------------------------------------------------------------------------------

def np_conv2d(x, w, stride, pad, dil, groups):
    n, c, h, wd = x.shape
    co, cig, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    ho = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, co, ho, wo), np.float64)
    cog = co // groups
    for o in range(co):
        gi = o // cog
        for i in range(ho):
            for j in range(wo):
                patch = xp[:, gi * cig:(gi + 1) * cig,
                           i * stride[0]: i * stride[0] + dil[0] * (kh - 1) + 1: dil[0],
                           j * stride[1]: j * stride[1] + dil[1] * (kw - 1) + 1: dil[1]]
                out[:, o, i, j] = np.sum(patch * w[o], axis=(1, 2, 3))
    return out


def test_conv2d_groups_stride_dilation_padding():
    x, w = f32(2, 4, 7, 6), f32(6, 2, 3, 2)
    (y,) = run_graph(lambda G, i: G.conv2d(i["x"], i["w"], None, (2, 1), (1, 0), (1, 2), 2), x=x, w=w)
    np.testing.assert_allclose(y, np_conv2d(x, w, (2, 1), (1, 0), (1, 2), 2), rtol=1e-4, atol=1e-4)


def test_conv_transpose2d_is_adjoint_of_conv():
    # <conv(x, W), y> = <x, conv_transpose(y, W)> with PyTorch's weight layout [C_in, C_out/g, kH, kW]
    x, w = f32(1, 4, 7, 6), f32(6, 2, 3, 3)  # conv weight [C_out=6, C_in/g=2, 3, 3], groups 2
    stride, pad, dil = (2, 2), (1, 1), (1, 1)
    y = np_conv2d(x, w, stride, pad, dil, 2)
    dy = f32(*y.shape)
    # the transposed conv maps 6 channels back to 4: its weight is the conv weight itself
    (xt,) = run_graph(
        lambda G, i: G.conv_transpose2d(i["dy"], i["w"], None, stride, pad, dil, (0, 1), 2),
        dy=dy, w=w)
    assert xt.shape == (1, 4, 7, 6)
    np.testing.assert_allclose(np.sum(y * dy), np.sum(x * xt), rtol=1e-4)


def np_pool(x, k, s, p, kind, pad=None):
    """NumPy pooling; ``pad`` the padding value (default -inf for max, 0 for sum); with
    ``pad`` given the result keeps x's dtype."""
    n, c, h, w = x.shape
    fill = pad if pad is not None else (-np.inf if kind == "max" else 0.0)
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])), constant_values=fill)
    ho = (h + 2 * p[0] - k[0]) // s[0] + 1
    wo = (w + 2 * p[1] - k[1]) // s[1] + 1
    out = np.zeros((n, c, ho, wo), x.dtype if pad is not None else np.float64)
    for i in range(ho):
        for j in range(wo):
            win = xp[:, :, i * s[0]:i * s[0] + k[0], j * s[1]:j * s[1] + k[1]]
            out[:, :, i, j] = win.max((2, 3)) if kind == "max" else win.sum((2, 3))
    return out


def test_max_pool_padded_odd():
    x = f32(2, 3, 7, 5)
    (y,) = run_graph(lambda G, i: G.max_pool2d(i["x"], (3, 2), (2, 2), (1, 1)), x=x)
    np.testing.assert_allclose(y, np_pool(x, (3, 2), (2, 2), (1, 1), "max"), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8])
def test_max_pool_on_integers(dtype):
    """The IR's Pool{Max} on an integer image: exact, in its dtype, padding never wins
    (the reference pads with the dtype's minimum, as -inf for floats)."""
    lo, hi = (0, 200) if dtype == np.uint8 else (-100, 100)
    x = np.random.default_rng(7).integers(lo, hi, (2, 3, 7, 5)).astype(dtype)
    g = rlx.Graph("ipool")
    g.set_outputs([g.max_pool2d(g.input("x", [2, 3, 7, 5], {np.int32: "i32", np.int8: "i8", np.uint8: "u8"}[dtype]),
                                (3, 2), (2, 2), (1, 1))])
    (y,) = rlx.to_jax(g)({}, {"x": x})
    assert y.dtype == dtype
    want = np_pool(x.astype(np.int64), (3, 2), (2, 2), (1, 1), "max", pad=np.iinfo(np.int64).min)
    np.testing.assert_array_equal(np.asarray(y), want)


def test_avg_pool_interior_windows():
    x = f32(1, 2, 6, 6)
    (y,) = run_graph(lambda G, i: G.avg_pool2d(i["x"], (2, 3), (2, 3), (0, 0)), x=x)
    np.testing.assert_allclose(y, np_pool(x, (2, 3), (2, 3), (0, 0), "sum") / 6, rtol=1e-5, atol=1e-6)


# ---- loss / cumsum / gather / complex --------------------------------------------------------

def test_softmax_cross_entropy_with_f32_labels():
    logits = f32(5, 7)
    labels = np.array([0, 6, 3, 3, 1], np.float32)
    (y,) = run_graph(lambda G, i: G.softmax_cross_entropy_with_logits(i["l"], i["y"]), l=logits, y=labels)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(y, lse - logits[np.arange(5), labels.astype(int)], rtol=1e-5)


@pytest.mark.parametrize("exclusive", [False, True])
def test_cumsum(exclusive):
    x = f32(3, 5, 4)
    (y,) = run_graph(lambda G, i: G.cumsum(i["x"], 1, exclusive), x=x)
    ref = np.cumsum(x, 1)
    if exclusive:
        ref = ref - x
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_f32_indices(axis):
    table = f32(6, 5, 3)
    idx = np.array([[4, 0], [1, 4], [3, 3]], np.float32)
    if axis == 1:
        idx = np.minimum(idx, 4)
    (y,) = run_graph(lambda G, i: G.gather(i["t"], i["i"], axis), t=table, i=idx)
    # RLX's Gather: [*idx, *post], read from the first slice along the dims before axis
    np.testing.assert_array_equal(y, np.take(table[(0,) * axis], idx.astype(int), axis=0))
    (z,) = run_graph(lambda G, i: G.take(i["t"], i["i"], axis), t=table, i=idx)
    np.testing.assert_array_equal(z, np.take(table, idx.astype(int), axis=axis))


def test_complex_norm_sq():
    z = (f32(3, 4) + 1j * f32(3, 4)).astype(np.complex64)
    (y,) = run_graph(lambda G, i: G.complex_norm_sq(i["z"]), z=z)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, np.abs(z) ** 2, rtol=1e-5)


def test_grad_of_lowered_layer_norm_uses_family_and_matches_numeric():
    g = rlx.Graph("ln")
    x = g.input("x", [4, 6], "f32")
    ga = g.param("g", [6], "f32")
    be = g.param("b", [6], "f32")
    y = g.layer_norm(x, ga, be, -1, 1e-5)
    g.set_outputs([g.sum(g.mul(y, y), [0, 1])])
    f = rlx.to_jax(g)
    xs = f32(4, 6)
    p = {"g": f32(6), "b": f32(6)}
    gr = jax.grad(lambda p: f(p, {"x": xs})[0])(p)

    def ref(p):
        m = xs.mean(-1, keepdims=True)
        v = ((xs - m) ** 2).mean(-1, keepdims=True)
        yy = (xs - m) / jnp.sqrt(v + 1e-5) * p["g"] + p["b"]
        return jnp.sum(yy * yy)

    r = jax.grad(ref)(p)
    np.testing.assert_allclose(gr["g"], r["g"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gr["b"], r["b"], rtol=1e-4, atol=1e-4)


def np_axial_rope(x, end_x, end_y, head_dim, num_heads, theta, rep):
    b, s, _ = x.shape
    q4, half = head_dim // 4, head_dim // 2
    freqs = 1.0 / theta ** (4 * np.arange(q4) / head_dim)
    out = x.astype(np.float64).copy()
    for t in range(s):
        p = t // rep
        ax, ay = (p % end_x) * freqs, (p // end_x) * freqs
        for h in range(num_heads):
            base = h * head_dim
            for off, ang in ((0, ax), (half, ay)):
                for c in range(q4):
                    i0, i1 = base + off + 2 * c, base + off + 2 * c + 1
                    x0, x1 = x[:, t, i0].astype(np.float64), x[:, t, i1].astype(np.float64)
                    out[:, t, i0] = x0 * np.cos(ang[c]) - x1 * np.sin(ang[c])
                    out[:, t, i1] = x0 * np.sin(ang[c]) + x1 * np.cos(ang[c])
    return out


def test_axial_rope2d():
    end_x, end_y, hd, nh, rep = 3, 2, 8, 2, 2
    x = f32(2, end_x * end_y * rep, nh * hd)
    (y,) = run_graph(lambda G, i: G.axial_rope2d(i["x"], end_x, end_y, hd, nh, 100.0, rep), x=x)
    np.testing.assert_allclose(y, np_axial_rope(x, end_x, end_y, hd, nh, 100.0, rep), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,indices", [("u32", [3_000_000_000, 1, 4_294_967_295]), ("f32", [3e9, 1.5, 5e10])])
def test_gather_indices_past_int32_saturate_to_the_last_row(dtype, indices):
    """Indices wider than int32 saturate (then clip to the last row) instead of wrapping:
    u32 3e9 read row 0 before (3e9 wrapped to a negative int32, clipped to 0)."""
    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    g = rlx.Graph("gather_wide")
    g.set_outputs([g.gather(g.input("t", [4, 2], "f32"), g.input("i", [3], dtype), 0)])
    npd = {"u32": np.uint32, "f32": np.float32}[dtype]
    (y,) = rlx.to_jax(g)({}, {"t": table, "i": np.array(indices, npd)})
    np.testing.assert_array_equal(y, table[[3, 1, 3]])
