"""RLX backward ops lowered through the families' ``*_backward`` wrappers, checked
against ``jax.vjp`` of an independent plain-JAX forward; sibling nodes share one call."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx

RNG = np.random.default_rng(5)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def run_graph(build, **arrays):
    g = rlx.Graph("bwd")
    ids = {}
    for name, a in arrays.items():
        dt = {np.float32: "f32", np.int32: "i32", np.complex64: "c64"}[a.dtype.type]
        ids[name] = g.input(name, list(a.shape), dt)
    out = build(g, ids)
    g.set_outputs(list(out) if isinstance(out, (list, tuple)) else [out])
    return g, [np.asarray(o) for o in rlx.to_jax(g)({}, arrays)]


def vjp(fn, primals, dy):
    _, pull = jax.vjp(fn, *primals)
    return [np.asarray(t) for t in pull(jnp.asarray(dy))]


def close(a, b, tol=1e-4):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def count_calls(monkeypatch, module, name):
    import importlib

    mod = importlib.import_module(f"rlx_jax.vjp_rules.{module}")
    real = getattr(mod, name)
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(mod, name, wrapped)
    return calls


def ln_ref(x, g, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + eps) * g + b


def test_layer_norm_backward_siblings_share_one_call(monkeypatch):
    calls = count_calls(monkeypatch, "layer_norm", "layer_norm_backward")
    x, g, dy = f32(3, 4, 6), f32(6), f32(3, 4, 6)
    b = np.zeros(6, np.float32)

    def build(G, i):
        return [G.layer_norm_backward_gamma(i["x"], i["dy"]),
                G.layer_norm_backward_input(i["x"], i["g"], i["dy"])]

    _, (dg, dx) = run_graph(build, x=x, g=g, dy=dy)
    rx, rg, _ = vjp(ln_ref, (x, g, b), dy)
    close(dx, rx)
    close(dg, rg)
    assert len(calls) == 1


def test_rms_norm_backward_three_siblings(monkeypatch):
    calls = count_calls(monkeypatch, "rms_norm", "rms_norm_backward")
    x, g, b, dy = f32(5, 7), f32(7), f32(7), f32(5, 7)

    def build(G, i):
        a = (i["x"], i["g"], i["b"], i["dy"])
        return [G.rms_norm_backward_input(*a, eps=1e-5), G.rms_norm_backward_gamma(*a, eps=1e-5),
                G.rms_norm_backward_beta(*a, eps=1e-5)]

    _, (dx, dg, db) = run_graph(build, x=x, g=g, b=b, dy=dy)

    def ref(x, g, b):
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g + b

    rx, rg, rb = vjp(ref, (x, g, b), dy)
    close(dx, rx)
    close(dg, rg)
    close(db, rb)
    assert len(calls) == 1


def test_group_norm_backward():
    x, g, b, dy = f32(2, 6, 3, 3), f32(6), f32(6), f32(2, 6, 3, 3)

    def build(G, i):
        return [G.group_norm_backward_input(i["x"], i["g"], i["b"], i["dy"], 3, 1e-5),
                G.group_norm_backward_gamma(i["x"], i["dy"], None, 3, 1e-5),
                G.group_norm_backward_beta(i["x"], i["dy"], None, 3, 1e-5)]

    _, (dx, dg, db) = run_graph(build, x=x, g=g, b=b, dy=dy)

    def ref(x, g, b):
        xr = x.reshape(2, 3, -1)
        m = xr.mean(-1, keepdims=True)
        v = ((xr - m) ** 2).mean(-1, keepdims=True)
        xn = ((xr - m) / jnp.sqrt(v + 1e-5)).reshape(x.shape)
        return xn * g[:, None, None] + b[:, None, None]

    rx, rg, rb = vjp(ref, (x, g, b), dy)
    close(dx, rx)
    close(dg, rg)
    close(db, rb)


def test_batch_norm_inference_backward():
    x, g, m, dy = f32(2, 4, 3, 2), f32(4), f32(4), f32(2, 4, 3, 2)
    v = np.abs(f32(4)) + 0.3

    def build(G, i):
        return [G.batch_norm_inference_backward_input(i["x"], i["g"], i["m"], i["v"], i["dy"], 1e-5),
                G.batch_norm_inference_backward_gamma(i["x"], i["m"], i["v"], i["dy"], None, 1e-5),
                G.batch_norm_inference_backward_beta(i["dy"])]

    _, (dx, dg, db) = run_graph(build, x=x, g=g, m=m, v=v, dy=dy)
    c = (slice(None), None, None)

    def ref(x, g, b):
        return (x - m[c]) / jnp.sqrt(v[c] + 1e-5) * g[c] + b[c]

    rx, rg, rb = vjp(ref, (x, g, np.zeros(4, np.float32)), dy)
    close(dx, rx)
    close(dg, rg)
    close(db, rb)


def test_rope_cumsum_gather_backward():
    s, h, d = 4, 2, 6
    dy = f32(2, s, h * d)
    ang = RNG.uniform(0, 3, (s, d // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    _, (dx,) = run_graph(lambda G, i: G.rope_backward(i["dy"], i["c"], i["s"], d), dy=dy, c=cos, s=sin)

    def rope_ref(x):
        xh = x.reshape(2, s, h, d)
        x1, x2 = xh[..., : d // 2], xh[..., d // 2:]
        c, sn = cos[:, None], sin[:, None]
        return jnp.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], -1).reshape(x.shape)

    close(dx, vjp(rope_ref, (f32(2, s, h * d),), dy)[0])

    dyc = f32(3, 5)
    for excl in (False, True):
        _, (dxc,) = run_graph(lambda G, i: G.cumsum_backward(i["dy"], None, 1, excl), dy=dyc)

        def cs(x, excl=excl):
            c = jnp.cumsum(x, 1)
            return c - x if excl else c

        close(dxc, vjp(cs, (f32(3, 5),), dyc)[0])

    table = f32(6, 3)
    idx = np.array([[1, 4], [1, 0]], np.float32)
    dyg = f32(2, 2, 3)
    _, (dt,) = run_graph(lambda G, i: G.gather_backward(i["dy"], i["i"], [6, 3], 0), dy=dyg, i=idx)
    close(dt, vjp(lambda t: jnp.take(t, idx.astype(int), 0), (table,), dyg)[0])


def test_max_pool_backward_first_maximum():
    x = np.zeros((1, 1, 4, 4), np.float32)  # all ties: the first element of each window wins
    dy = f32(1, 1, 2, 2)
    _, (dx,) = run_graph(lambda G, i: G.max_pool2d_backward(i["x"], i["dy"], (2, 2), (2, 2)), x=x, dy=dy)
    ref = np.zeros((1, 1, 4, 4), np.float32)
    ref[0, 0, ::2, ::2] = dy[0, 0]
    np.testing.assert_allclose(dx, ref)
    x = f32(2, 3, 5, 5)
    dy = f32(2, 3, 2, 2)
    _, (dx,) = run_graph(lambda G, i: G.max_pool2d_backward(i["x"], i["dy"], (3, 3), (2, 2)), x=x, dy=dy)

    def mp(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "VALID")

    close(dx, vjp(mp, (x,), dy)[0])


def test_conv2d_backward_input_and_weight():
    x, w = f32(2, 4, 6, 5), f32(6, 2, 3, 2)
    kw = dict(window_strides=(2, 1), padding=((1, 1), (0, 0)), rhs_dilation=(1, 2),
              dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=2)

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, **kw)

    y = conv(x, w)
    dy = f32(*y.shape)

    def build(G, i):
        return [G.conv2d_backward_input(i["dy"], i["w"], list(x.shape), None, (2, 1), (1, 0), (1, 2), 2),
                G.conv2d_backward_weight(i["x"], i["dy"], list(w.shape), None, (2, 1), (1, 0), (1, 2), 2)]

    _, (dx, dw) = run_graph(build, x=x, w=w, dy=dy)
    rx, rw = vjp(conv, (x, w), dy)
    close(dx, rx)
    close(dw, rw)


def test_softmax_cross_entropy_backward():
    logits, labels, dl = f32(4, 5), np.array([0, 4, 2, 2], np.float32), f32(4)
    _, (dz,) = run_graph(lambda G, i: G.softmax_cross_entropy_backward(i["z"], i["y"], i["d"]),
                         z=logits, y=labels, d=dl)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    close(dz, (p - np.eye(5)[labels.astype(int)]) * dl[:, None])


@pytest.mark.parametrize("mask_kind", ["none", "causal", "custom", "bias"])
def test_attention_backward_three_wrt_one_call(mask_kind, monkeypatch):
    import rlx_jax.lowering.backward as lb

    calls = []
    real = lb.backward_fn

    def spy(family, name=None):
        fn = real(family, name)
        if family == "attention":
            def wrapped(*a, **k):
                calls.append(1)
                return fn(*a, **k)
            return wrapped
        return fn

    monkeypatch.setattr(lb, "backward_fn", spy)
    b, s, h, d = 2, 4, 2, 3
    q, k, v, dy = (f32(b, s, h * d) for _ in range(4))
    arrays = dict(q=q, k=k, v=v, dy=dy)
    keep = np.ones((b, s), np.float32)
    keep[1, 2:] = 0
    bias = f32(b, h, s, s)
    if mask_kind == "custom":
        arrays["m"] = keep
    if mask_kind == "bias":
        arrays["m"] = bias

    def build(G, i):
        return G.attention_backward_all(i["q"], i["k"], i["v"], i["dy"], h, d, mask_kind, i.get("m"))

    _, grads = run_graph(build, **arrays)

    def ref(q, k, v):
        q4, k4, v4 = (t.reshape(b, s, h, d) for t in (q, k, v))
        sc = jnp.einsum("bqhd,bkhd->bhqk", q4, k4) / np.sqrt(d)
        if mask_kind == "bias":
            sc = sc + bias
        if mask_kind == "causal":
            sc = jnp.where(np.tril(np.ones((s, s), bool)), sc, -jnp.inf)
        if mask_kind == "custom":
            sc = jnp.where(keep[:, None, None, :] >= 0.5, sc, -jnp.inf)
        p = jax.nn.softmax(sc, -1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v4).reshape(b, s, h * d)

    for got, want in zip(grads, vjp(ref, (q, k, v), dy)):
        close(got, want)
    assert len(calls) == 1


def test_fake_quantize_backward_and_lsq(monkeypatch):
    x, dy = f32(3, 8) * 2, f32(3, 8)
    _, (dx,) = run_graph(lambda G, i: G.fake_quantize_backward(i["x"], i["dy"], 4, None, "clipped_identity"),
                         x=x, dy=dy)
    # ClippedIdentity: dy where |x| <= q_max * s (per-batch s = max|x| / q_max: everywhere)
    close(dx, dy)
    _, (dx,) = run_graph(lambda G, i: G.fake_quantize_backward(i["x"], i["dy"], 4, None, "tanh"), x=x, dy=dy)
    s = np.abs(x).max() / 7
    close(dx, dy * (1 - np.tanh(x / s) ** 2))

    calls = count_calls(monkeypatch, "quantize", "fake_quantize_lsq_backward")
    scale = np.array([0.3, 0.2, 0.5], np.float32)

    def build(G, i):
        return [G.fake_quantize_lsq_backward_x(i["x"], i["s"], i["dy"], 4, 0),
                G.fake_quantize_lsq_backward_scale(i["x"], i["s"], i["dy"], 4, 0)]

    _, (dxl, ds) = run_graph(build, x=x, s=scale, dy=dy)
    z = x / scale[:, None]
    inside = np.abs(z) <= 7
    close(dxl, dy * inside)
    psi = np.where(inside, np.sign(z) * np.floor(np.abs(z) + 0.5) - z, np.sign(z) * 7)
    close(ds, (psi * dy).sum(1))
    assert len(calls) == 1


def test_complex_norm_sq_backward():
    z = (f32(3, 2) + 1j * f32(3, 2)).astype(np.complex64)
    gr = f32(3, 2)
    _, (dz,) = run_graph(lambda G, i: G.complex_norm_sq_backward(i["z"], i["g"]), z=z, g=gr)
    close(dz, gr * z)


def test_relu_and_activation_backward_nodes():
    x, dy = f32(4, 5), f32(4, 5)
    _, (dr, ds) = run_graph(lambda G, i: [G.relu_backward(i["x"], i["dy"]),
                                          G.activation_backward("silu", i["x"], i["dy"])], x=x, dy=dy)
    close(dr, np.where(x > 0, dy, 0))
    close(ds, vjp(jax.nn.silu, (x,), dy)[0])


def test_log_mel_and_backward():
    spec = np.abs(f32(3, 8))
    fb = np.abs(f32(8, 4))
    fb[:, 0] = 0.0  # a dead band: mel = 0 < 1e-10 -> floored, no gradient
    dy = f32(3, 4)
    _, (y, ds) = run_graph(lambda G, i: [G.log_mel(i["s"], i["f"]), G.log_mel_backward(i["s"], i["f"], i["dy"])],
                           s=spec, f=fb, dy=dy)
    mel = spec @ fb
    close(y, np.log(np.maximum(mel, 1e-10)))
    g = np.where(mel > 1e-10, dy / np.where(mel > 1e-10, mel, 1), 0)
    close(ds, g @ fb.T)


def test_grad_with_loss_graph_lowers_to_jax_grad():
    """A gradient graph (norms, attention, loss backward ops) run through to_jax equals
    jax.grad of the lowered forward graph."""
    g = rlx.Graph("net")
    x = g.input("x", [2, 4, 8], "f32")
    lab = g.input("y", [8], "f32")
    w = g.param("w", [8, 8], "f32")
    gam = g.param("g", [8], "f32")
    bet = g.param("b", [8], "f32")
    h = g.layer_norm(g.matmul(x, w), gam, bet, -1, 1e-5)
    a = g.attention_kind(h, h, h, 2, 4, "causal")
    r = g.rms_norm(g.gelu(a), gam, bet, 1e-5)
    loss = g.mean(g.softmax_cross_entropy_with_logits(g.reshape(r, [8, 8]), lab), [0], False)
    g.set_outputs([loss])
    gg = rlx.grad_with_loss(g, [w, gam, bet])
    p = {"w": f32(8, 8) * 0.3, "g": 1 + 0.1 * f32(8), "b": 0.1 * f32(8)}
    inp = {"x": f32(2, 4, 8), "y": RNG.integers(0, 8, 8).astype(np.float32)}
    outs = rlx.to_jax(gg)(p, dict(inp, d_output=np.ones((), np.float32)))
    fwd = rlx.to_jax(g)
    ref = jax.grad(lambda p: fwd(p, inp)[0])(p)
    close(outs[0], fwd(p, inp)[0], 1e-6)
    for name, got in zip(["w", "g", "b"], outs[1:]):
        close(got, ref[name], 1e-5)
