"""Fused ops give the numbers of their unfused primitives (and of NumPy); a 12-layer
transformer graph jit-compiles quickly."""

import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx

RNG = np.random.default_rng(9)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def run_graph(build, **arrays):
    g = rlx.Graph("f")
    ids = {n: g.input(n, list(a.shape), "f32") for n, a in arrays.items()}
    out = build(g, ids)
    g.set_outputs(list(out) if isinstance(out, (list, tuple)) else [out])
    return [np.asarray(o) for o in rlx.to_jax(g)({}, arrays)]


def close(a, b, tol=1e-4):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("act", [None, "gelu", "relu"])
def test_fused_matmul_bias_act_equals_primitives(act):
    arr = dict(x=f32(2, 3, 4), w=f32(4, 5), b=f32(5))
    (fused,) = run_graph(lambda G, i: G.fused_matmul_bias_act(i["x"], i["w"], i["b"], activation=act), **arr)

    def prim(G, i):
        y = G.add(G.matmul(i["x"], i["w"]), i["b"])
        return y if act is None else G.activation(act, y)

    (ref,) = run_graph(prim, **arr)
    close(fused, ref, 1e-6)


@pytest.mark.parametrize("norm", ["ln", "rms"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_residual_norms_equal_primitives(norm, bias):
    arr = dict(x=f32(3, 6), r=f32(3, 6), g=f32(6), b=f32(6), bb=f32(6))

    def fused(G, i):
        fn = G.fused_residual_ln if norm == "ln" else G.fused_residual_rms_norm
        return fn(i["x"], i["r"], i["g"], i["b"], 1e-5, i["bb"] if bias else None)

    def prim(G, i):
        h = G.add(i["x"], i["r"])
        if bias:
            h = G.add(h, i["bb"])
        fn = G.layer_norm if norm == "ln" else G.rms_norm
        return fn(h, i["g"], i["b"], eps=1e-5) if norm == "rms" else fn(h, i["g"], i["b"], -1, 1e-5)

    close(run_graph(fused, **arr)[0], run_graph(prim, **arr)[0], 1e-6)


@pytest.mark.parametrize("gate_first", [False, True])
def test_fused_swiglu(gate_first):
    x = f32(2, 3, 8)
    (y,) = run_graph(lambda G, i: G.fused_swiglu(i["x"], None, gate_first), x=x)
    lo, hi = x[..., :4], x[..., 4:]
    up, gate = (hi, lo) if gate_first else (lo, hi)
    close(y, gate / (1 + np.exp(-gate)) * up)
    (y16,) = run_graph(lambda G, i: G.fused_swiglu(i["x"], "f16", gate_first), x=x)
    assert y16.dtype == np.float16


def np_attention_custom(q, k, v, keep):
    d = q.shape[-1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    s = np.where(keep[:, None, None, :] >= 0.5, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def np_ln(x, g, b, eps):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(x.var(-1, keepdims=True) + eps) * g + b


def np_rope_bhsd(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def np_attention_block(p, nh, hd, rope=None):
    b, s, _ = p["hidden"].shape
    qkv = p["hidden"] @ p["qkv_w"] + p.get("qkv_b", 0)
    q, k, v = (qkv[..., i * nh * hd:(i + 1) * nh * hd].reshape(b, s, nh, hd) for i in range(3))
    if rope is not None:
        cos, sin = rope
        q = np_rope_bhsd(q.transpose(0, 2, 1, 3), cos, sin).transpose(0, 2, 1, 3)
        k = np_rope_bhsd(k.transpose(0, 2, 1, 3), cos, sin).transpose(0, 2, 1, 3)
    o = np_attention_custom(q, k, v, p["mask"]).reshape(b, s, nh * hd)
    return o @ p["out_w"] + p.get("out_b", 0)


def block_params(b, s, nh, hd, bias):
    hid = nh * hd
    p = dict(hidden=f32(b, s, hid), qkv_w=f32(hid, 3 * hid) * 0.3, out_w=f32(hid, hid) * 0.3,
             mask=np.ones((b, s), np.float32))
    p["mask"][0, -1] = 0.0
    if bias:
        p.update(qkv_b=f32(3 * hid), out_b=f32(hid))
    return p


@pytest.mark.parametrize("bias,rope", [(False, False), (True, True)])
def test_fused_attention_block(bias, rope):
    b, s, nh, hd = 2, 5, 2, 4
    p = block_params(b, s, nh, hd, bias)
    if rope:
        ang = RNG.uniform(0, 3, (s, hd // 2)).astype(np.float32)
        p.update(cos=np.cos(ang), sin=np.sin(ang))
    order = ["hidden", "qkv_w", "out_w", "mask"] + (["qkv_b", "out_b"] if bias else []) + \
        (["cos", "sin"] if rope else [])
    (y,) = run_graph(lambda G, i: G.fused_attention_block([i[n] for n in order], nh, hd, bias, rope),
                     **{n: p[n] for n in order})
    close(y, np_attention_block(p, nh, hd, (p["cos"], p["sin"]) if rope else None))


def layer_params(b, s, nh, hd, inter, bias=True):
    hid = nh * hd
    p = block_params(b, s, nh, hd, bias)
    p.update(ln1_g=1 + 0.1 * f32(hid), ln1_b=0.1 * f32(hid), fc1_w=f32(hid, inter) * 0.3,
             fc2_w=f32(inter, hid) * 0.3, ln2_g=1 + 0.1 * f32(hid), ln2_b=0.1 * f32(hid))
    if bias:
        p.update(fc1_b=f32(inter), fc2_b=f32(hid))
    return p


ORDER_BIAS = ["hidden", "qkv_w", "qkv_b", "out_w", "out_b", "ln1_g", "ln1_b", "fc1_w", "fc1_b",
              "fc2_w", "fc2_b", "ln2_g", "ln2_b", "mask"]
ORDER_NOBIAS = ["hidden", "qkv_w", "out_w", "ln1_g", "ln1_b", "fc1_w", "fc2_w", "ln2_g", "ln2_b", "mask"]


def np_layer(p, nh, hd, eps1, eps2):
    h1 = np_ln(np_attention_block(p, nh, hd) + p["hidden"], p["ln1_g"], p["ln1_b"], eps1)
    f = h1 @ p["fc1_w"] + p.get("fc1_b", 0)
    f = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f**3)))
    f = f @ p["fc2_w"] + p.get("fc2_b", 0)
    return np_ln(f + h1, p["ln2_g"], p["ln2_b"], eps2)


@pytest.mark.parametrize("bias", [True, False])
def test_fused_transformer_layer_post_ln(bias):
    b, s, nh, hd, inter = 2, 4, 2, 4, 12
    p = layer_params(b, s, nh, hd, inter, bias)
    order = ORDER_BIAS if bias else ORDER_NOBIAS
    (y,) = run_graph(lambda G, i: G.fused_transformer_layer([i[n] for n in order], nh, hd, inter, 1e-5, 1e-6,
                                                            "gelu_approx", bias), **{n: p[n] for n in order})
    close(y, np_layer(p, nh, hd, 1e-5, 1e-6), 2e-4)


def transformer_graph(layers, b, s, nh, hd, inter):
    g = rlx.Graph("transformer")
    h = g.input("hidden", [b, s, nh * hd], "f32")
    mask = g.input("mask", [b, s], "f32")
    hid = nh * hd
    shapes = dict(qkv_w=[hid, 3 * hid], qkv_b=[3 * hid], out_w=[hid, hid], out_b=[hid], ln1_g=[hid],
                  ln1_b=[hid], fc1_w=[hid, inter], fc1_b=[inter], fc2_w=[inter, hid], fc2_b=[hid],
                  ln2_g=[hid], ln2_b=[hid])
    for layer in range(layers):
        ids = {n: g.param(f"l{layer}.{n}", shp, "f32") for n, shp in shapes.items()}
        ids.update(hidden=h, mask=mask)
        h = g.fused_transformer_layer([ids[n] for n in ORDER_BIAS], nh, hd, inter, 1e-5, 1e-5, "gelu", True)
    g.set_outputs([g.mean(h, [0, 1, 2])])
    params = {f"l{layer}.{n}": (RNG.standard_normal(shp) * 0.1).astype(np.float32)
              for layer in range(layers) for n, shp in shapes.items()}
    return g, params


def _twelve_layers():
    g, params = transformer_graph(12, 2, 64, 4, 32, 512)
    inputs = {"hidden": jnp.asarray(f32(2, 64, 128)), "mask": jnp.ones((2, 64), jnp.float32)}
    return rlx.to_jax(g), params, inputs


def test_twelve_layer_transformer_compiles_under_20s():
    f, params, inputs = _twelve_layers()
    t0 = time.perf_counter()
    jax.jit(f).lower(params, inputs).compile()
    dt = time.perf_counter() - t0
    assert dt < 20.0, f"12-layer transformer forward took {dt:.1f} s to compile"


@pytest.mark.slow
def test_twelve_layer_transformer_gradient_compiles_under_20s():
    f, params, inputs = _twelve_layers()
    t0 = time.perf_counter()
    jax.jit(jax.grad(lambda p: f(p, inputs)[0])).lower(params).compile()
    dt = time.perf_counter() - t0
    assert dt < 20.0, f"12-layer transformer gradient took {dt:.1f} s to compile"


def test_small_transformer_stack_runs_and_differentiates():
    g, params = transformer_graph(2, 1, 6, 2, 4, 16)
    f = rlx.to_jax(g)
    inputs = {"hidden": f32(1, 6, 8), "mask": np.ones((1, 6), np.float32)}
    grads = jax.jit(jax.grad(lambda p: f(p, inputs)[0]))(params)
    assert set(grads) == set(params)
    assert all(np.all(np.isfinite(v)) for v in grads.values())


# -- one decomposition for lowering and autodiff ----------------------------------------------

def test_decomposition_holds_only_primitives_and_is_shared_with_prepare():
    """Lowering evaluates the same decomposition autodiff's prepare splices in: the
    decomposed graph has no fused node, and it gives the fused node's numbers."""
    from rlx_jax.autodiff.prepare import prepare
    from rlx_jax.autodiff.unfuse import DECOMPOSITIONS, decomposition, is_fused

    b, s, nh, hd, inter = 2, 3, 2, 2, 6
    p = layer_params(b, s, nh, hd, inter, True)
    g = rlx.Graph("layer")
    ids = {n: g.input(n, list(p[n].shape), "f32") for n in ORDER_BIAS}
    # one tensor (hidden) feeds a fused layer and a fused residual norm
    y = g.fused_transformer_layer([ids[n] for n in ORDER_BIAS], nh, hd, inter, 1e-5, 1e-5, "gelu_approx",
                                  True)
    z = g.fused_residual_rms_norm(y, ids["hidden"], ids["ln1_g"], ids["ln1_b"], 1e-6)
    g.set_outputs([z])
    node = g.node(y)
    body = decomposition(node.op, tuple(g.node(i).shape for i in node.inputs), node.shape)
    assert body.outputs and not any(is_fused(n.op) for n in body.nodes)
    assert decomposition(node.op, tuple(g.node(i).shape for i in node.inputs), node.shape) is body
    assert {c.__name__ for c in DECOMPOSITIONS} == {
        "FusedMatMulBiasAct", "FusedResidualLN", "FusedResidualRmsNorm", "FusedSwiGLU",
        "FusedAttentionBlock", "FusedTransformerLayer"}
    unfused, _ = prepare(g)
    assert not any(is_fused(n.op) for n in unfused.nodes)
    feed = {n: p[n] for n in ORDER_BIAS}
    (a,) = rlx.to_jax(g)({}, feed)
    (r,) = rlx.to_jax(unfused)({}, feed)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    h1 = np_layer(p, nh, hd, 1e-5, 1e-5)
    ref = h1 + p["hidden"]
    ref = ref / np.sqrt((ref**2).mean(-1, keepdims=True) + 1e-6) * p["ln1_g"] + p["ln1_b"]
    close(np.asarray(a), ref, 2e-4)


def test_fused_ops_with_a_dynamic_batch_lower_under_jit_and_vmap():
    """Decompositions are built from the graph's declared shapes, dynamic dims included."""
    nh, hd = 2, 4
    hid = nh * hd
    g = rlx.Graph("dyn")
    h = g.input("hidden", ["batch", 5, hid], "f32")
    mask = g.input("mask", ["batch", 5], "f32")
    wq, wo = g.param("qkv_w", [hid, 3 * hid], "f32"), g.param("out_w", [hid, hid], "f32")
    up = g.param("up", [hid, 2 * hid], "f32")
    a = g.fused_attention_block([h, wq, wo, mask], nh, hd, False, False)
    g.set_outputs([g.fused_swiglu(g.matmul(a, up))])
    f = rlx.to_jax(g)
    params = {"qkv_w": f32(hid, 3 * hid) * 0.3, "out_w": f32(hid, hid) * 0.3, "up": f32(hid, 2 * hid) * 0.3}
    for batch in (1, 3):
        p = block_params(batch, 5, nh, hd, False)
        p.update(qkv_w=params["qkv_w"], out_w=params["out_w"])
        (y,) = jax.jit(f)(params, {"hidden": p["hidden"], "mask": p["mask"]})
        t = np_attention_block(p, nh, hd) @ params["up"]
        close(np.asarray(y), t[..., hid:] / (1 + np.exp(-t[..., hid:])) * t[..., :hid], 2e-4)
    hs = f32(4, 2, 5, hid)
    masks = np.ones((4, 2, 5), np.float32)
    ys = jax.vmap(lambda x, m: f(params, {"hidden": x, "mask": m})[0])(hs, masks)
    for i in range(4):
        close(np.asarray(ys[i]), np.asarray(f(params, {"hidden": hs[i], "mask": masks[i]})[0]), 1e-5)


@pytest.mark.parametrize("rows", [0, 3])
def test_fused_chain_with_zero_and_odd_rows(rows):
    """FusedMatMulBiasAct feeding FusedSwiGLU and also an output (one tensor, two users)."""
    arr = dict(x=f32(rows, 5), w=f32(5, 6), b=f32(6))
    y, h = run_graph(lambda G, i: (G.fused_swiglu(G.fused_matmul_bias_act(i["x"], i["w"], i["b"], activation="relu")),
                                   G.fused_matmul_bias_act(i["x"], i["w"], i["b"], activation="relu")), **arr)
    ref_h = np.maximum(arr["x"] @ arr["w"] + arr["b"], 0)
    assert y.shape == (rows, 3) and h.shape == (rows, 6)
    close(h, ref_h, 1e-5)
    close(y, ref_h[:, 3:] / (1 + np.exp(-ref_h[:, 3:])) * ref_h[:, :3], 1e-5)


def test_fused_attention_block_rejects_a_mask_smaller_than_b_times_s():
    g = rlx.Graph("m")
    h = g.input("hidden", [2, 5, 8], "f32")
    wq, wo = g.param("qkv_w", [8, 24], "f32"), g.param("out_w", [8, 8], "f32")
    with pytest.raises(rlx.GraphError, match=r"FusedAttentionBlock: mask \[1, 3\] f32 holds 3 elements; "
                                             r"the \[B, S\] keep-mask needs 10"):
        g.fused_attention_block([h, wq, wo, g.input("small", [1, 3], "f32")], 2, 4, False, False)
    # a larger mask is read as its first B * S elements (RLX's kernels read that prefix)
    p = block_params(2, 5, 2, 4, False)
    big = np.ones((2, 2, 5, 5), np.float32)
    big.reshape(-1)[:10] = p["mask"].reshape(-1)
    (y,) = run_graph(lambda G, i: G.fused_attention_block([i["hidden"], i["qkv_w"], i["out_w"], i["mask"]],
                                                          2, 4, False, False),
                     hidden=p["hidden"], qkv_w=p["qkv_w"], out_w=p["out_w"], mask=big)
    close(y, np_attention_block(p, 2, 4))


@pytest.mark.parametrize("case", ["plain", "product_reused", "batched_weight"])
def test_matmul_of_a_swiglu_product_lowers_to_swiglu_linear(case):
    """MatMul(Mul(Silu(a), b), w) with a [F, O] weight lowers to ops.swiglu_linear: its
    gradient runs rlx_swiglu_bwd_product and keeps no product. A product that also feeds
    another op is still right; a batched [B, F, O] weight keeps the plain matmul (and the
    swiglu kernel). Values and gradients equal the NumPy maths."""
    g = rlx.Graph("mlp_down")
    a_in, b_in = g.input("a", [3, 5, 8], "f32"), g.input("b", [3, 5, 8], "f32")
    w_shape = [3, 8, 4] if case == "batched_weight" else [8, 4]
    w_in = g.param("w", w_shape, "f32")
    prod = g.mul(g.silu(a_in), b_in)
    out = g.matmul(prod, w_in)
    if case == "product_reused":
        out = g.add(out, g.sum(prod, [2], True))
    g.set_outputs([out])
    fn = rlx.to_jax(g)
    a, b = f32(3, 5, 8), f32(3, 5, 8)
    w = f32(*w_shape)

    def loss(a, b, w):
        return jnp.sum(jnp.sin(fn({"w": w}, {"a": a, "b": b})[0]))

    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(a, b, w).as_text()
    assert ("rlx_swiglu_bwd_product" in text) == (case != "batched_weight")
    assert "rlx_swiglu_bwd" in text
    A, B, W = (x.astype(np.float64) for x in (a, b, w))
    sig = 1 / (1 + np.exp(-A))
    h = A * sig * B
    y = h @ W + (h.sum(axis=2, keepdims=True) if case == "product_reused" else 0)
    close(np.asarray(fn({"w": w}, {"a": a, "b": b})[0]), y, 1e-5)
    c = np.cos(y)
    dh = c @ np.swapaxes(W, -1, -2) + (c.sum(axis=2, keepdims=True) if case == "product_reused" else 0)
    want = (dh * B * sig * (1 + A * (1 - sig)), dh * A * sig,
            np.einsum("bsf,bso->fo", h, c) if W.ndim == 2 else np.einsum("bsf,bso->bfo", h, c))
    for got, ref in zip(jax.grad(loss, (0, 1, 2))(a, b, w), want):
        close(np.asarray(got), ref, 1e-4)


@pytest.mark.parametrize("case", ["projections", "norm_reused", "one_projection", "input_weight"])
def test_matmuls_of_an_rms_norm_lower_to_rms_norm_linear(case):
    """The MatMuls that read an RmsNorm (a block's q / k / v, their weights' Param nodes
    after the norm) lower together to one ops.rms_norm_linear, whose reverse mode keeps
    the norm's input and not its output. A norm output that also feeds another op, or a
    weight that is no Param (an input here), keeps the plain norm and matmuls. Values and
    gradients equal the NumPy maths either way."""
    g = rlx.Graph("qkv")
    x_in = g.input("x", [3, 5, 8], "f32")
    gamma_in, beta_in = g.param("gamma", [8], "f32"), g.param("beta", [8], "f32")
    y = g.rms_norm(x_in, gamma_in, beta_in, 1e-5)
    outs_w = (4,) if case == "one_projection" else (4, 2, 2)
    w_ids = [g.input(f"w{i}", [8, o], "f32") if case == "input_weight" and i == 1 else g.param(f"w{i}", [8, o], "f32")
             for i, o in enumerate(outs_w)]
    outs = [g.matmul(y, w) for w in w_ids]
    if case == "norm_reused":
        outs[0] = g.add(outs[0], g.sum(y, [2], True))
    g.set_outputs(outs)
    fn = rlx.to_jax(g)
    x, gamma, beta = f32(3, 5, 8), f32(8) + 1, f32(8)
    ws = [f32(8, o) for o in outs_w]
    names = [f"w{i}" for i in range(len(outs_w))]
    weight_input = {"w1": ws[1]} if case == "input_weight" else {}

    def loss(x, gamma, beta, ws):
        params = {"gamma": gamma, "beta": beta, **{n: w for n, w in zip(names, ws) if n not in weight_input}}
        inputs = {"x": x, **{n: w for n, w in zip(names, ws) if n in weight_input}}
        return sum(jnp.sum(jnp.sin(o) * (k + 1)) for k, o in enumerate(fn(params, inputs)))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(x, gamma, beta, ws))
    assert ("rms_norm_linear" in jaxpr) == (case in ("projections", "one_projection"))
    X, G, B = (a.astype(np.float64) for a in (x, gamma, beta))
    W = [w.astype(np.float64) for w in ws]
    rstd = 1 / np.sqrt(np.mean(X * X, axis=-1, keepdims=True) + 1e-5)
    Y = X * rstd * G + B
    Os = [Y @ w for w in W]
    if case == "norm_reused":
        Os[0] = Os[0] + Y.sum(axis=2, keepdims=True)
    params = {"gamma": gamma, "beta": beta, **{n: w for n, w in zip(names, ws) if n not in weight_input}}
    for got, want in zip(fn(params, {"x": x, **weight_input}), Os):
        close(np.asarray(got), want, 1e-5)
    cs = [np.cos(o) * (k + 1) for k, o in enumerate(Os)]
    dY = sum(c @ w.T for c, w in zip(cs, W))
    if case == "norm_reused":
        dY = dY + cs[0].sum(axis=2, keepdims=True)
    xhat = X * rstd
    dxhat = dY * G
    dX = rstd * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    want = (dX, (dY * xhat).sum(axis=(0, 1)), dY.sum(axis=(0, 1)),
            [np.einsum("bsh,bso->ho", Y, c) for c in cs])
    got = jax.grad(loss, (0, 1, 2, 3))(x, gamma, beta, ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        close(np.asarray(a), b, 1e-4)


def _np_rope(x, cos, sin, hd):
    """NumPy NeoX rotation of x [..., S, H * hd] by tables [S, hd / 2]."""
    h = x.reshape(*x.shape[:-1], -1, hd)
    a, b = h[..., :hd // 2], h[..., hd // 2:]
    c, t = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * t, b * c + a * t], -1).reshape(x.shape)


@pytest.mark.parametrize("case", ["qkv", "rope_reused", "other_tables", "no_rope"])
def test_rotated_projections_of_an_rms_norm_lower_to_rope_split(case):
    """A block's q = Rope(MatMul(RmsNorm(x), wq)), k likewise and v = MatMul(RmsNorm(x), wv)
    lower to one rms_norm_linear product over the packed weights read by ops.rope_split (q
    and k rotated, v copied; its transpose rlx_rope_merge in the gradient). A rotated
    product that also feeds another op is split unrotated (q here) and rotated by its own
    Rope; Rope nodes with different tables, or no Rope, keep the per-weight products. Values
    and gradients equal the NumPy maths in every case."""
    s, hd = 5, 4
    g = rlx.Graph("qkv_rope")
    x_in = g.input("x", [2, s, 8], "f32")
    gamma_in, beta_in = g.param("gamma", [8], "f32"), g.param("beta", [8], "f32")
    y = g.rms_norm(x_in, gamma_in, beta_in, 1e-5)
    ang = np.arange(s)[:, None] * np.array([1.0, 0.3])[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    c_id, s_id = g.constant(cos, name="cos"), g.constant(sin, name="sin")
    c2_id = g.constant((0.5 * cos).astype(np.float32), name="cos2")
    ws = {"wq": 8, "wk": 4, "wv": 4}
    w_ids = {n: g.param(n, [8, o], "f32") for n, o in ws.items()}
    q_raw, k_raw, v = (g.matmul(y, w_ids[n]) for n in ws)
    if case == "no_rope":
        q, k = q_raw, k_raw
    else:
        q = g.rope(q_raw, c_id, s_id, hd)
        k = g.rope(k_raw, c2_id if case == "other_tables" else c_id, s_id, hd)
    outs = [q, k, v] + ([q_raw] if case == "rope_reused" else [])
    g.set_outputs(outs)
    fn = rlx.to_jax(g)
    x, gamma, beta = f32(2, s, 8), f32(8) + 1, 0.1 * f32(8)
    w = {n: f32(8, o) for n, o in ws.items()}

    def loss(x, gamma, w):
        return sum(jnp.sum(jnp.sin(o) * (i + 1))
                   for i, o in enumerate(fn({"gamma": gamma, "beta": beta, **w}, {"x": x})))

    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, gamma, w).as_text()
    split = case in ("qkv", "rope_reused")
    assert ("rlx_rope_split" in str(jax.make_jaxpr(loss)(x, gamma, w))) == split
    assert ("rlx_rope_merge" in str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, gamma, w))) == split
    assert ("rlx_rope_split" in text) == split

    def np_loss(x, gamma, w):
        X = x.astype(np.float64)
        Y = X / np.sqrt(np.mean(X * X, -1, keepdims=True) + 1e-5) * gamma + beta
        qr, kr, vv = (Y @ w[n] for n in ws)
        if case == "no_rope":
            outs = [qr, kr, vv]
        else:
            kc = 0.5 * cos if case == "other_tables" else cos
            outs = [_np_rope(qr, cos, sin, hd), _np_rope(kr, kc, sin, hd), vv] + ([qr] if case == "rope_reused" else [])
        return outs, sum(np.sum(np.sin(o) * (i + 1)) for i, o in enumerate(outs))

    want_outs, _ = np_loss(x, gamma, w)
    for got, want in zip(fn({"gamma": gamma, "beta": beta, **w}, {"x": x}), want_outs):
        close(np.asarray(got), want, 1e-5)
    # central differences of the f64 NumPy loss along a random direction of every input
    got = jax.grad(loss, (0, 1, 2))(x, gamma, w)
    rng = np.random.default_rng(0)
    dirs = (rng.standard_normal(x.shape), rng.standard_normal(gamma.shape),
            {n: rng.standard_normal(a.shape) for n, a in w.items()})
    eps = 1e-5
    shift = lambda t: (x + t * dirs[0], gamma + t * dirs[1], {n: w[n] + t * dirs[2][n] for n in w})  # noqa: E731
    fd = (np_loss(*shift(eps))[1] - np_loss(*shift(-eps))[1]) / (2 * eps)
    ours = float(np.sum(got[0] * dirs[0]) + np.sum(got[1] * dirs[1]) + sum(np.sum(got[2][n] * dirs[2][n]) for n in w))
    assert abs(ours - fd) <= 1e-3 * max(1.0, abs(fd)), (ours, fd)


def _swiglu_graph(order, extra_use, up_shape):
    g = rlx.Graph("mlp")
    a = g.input("a", [3, 5, 8], "f32")
    b = g.input("b", list(up_shape), "f32")
    s = g.silu(a)
    out = g.mul(s, b) if order == "silu_first" else g.mul(b, s)
    if extra_use:  # the Silu output also feeds another op: it is computed for that one
        out = g.add(out, s)
    g.set_outputs([out])
    return g


@pytest.mark.parametrize("order", ["silu_first", "up_first"])
@pytest.mark.parametrize("extra_use", [False, True])
@pytest.mark.parametrize("up_shape", [(3, 5, 8), (8,)], ids=["same_shape", "broadcast"])
def test_mul_of_silu_lowers_to_the_swiglu_op(order, extra_use, up_shape):
    """Mul(Silu(a), b) over one shape lowers to ops.swiglu (its fused backward kernel in the
    gradient); a broadcast product keeps the plain multiply. Values and gradients equal the
    NumPy maths either way."""
    graph = _swiglu_graph(order, extra_use, up_shape)
    fn = rlx.to_jax(graph)
    a, b = f32(3, 5, 8), f32(*up_shape)

    def loss(a, b):
        return jnp.sum(jnp.sin(fn({}, {"a": a, "b": b})[0]))

    text = jax.jit(jax.grad(loss, (0, 1))).lower(a, b).as_text()
    assert ("rlx_swiglu_bwd" in text) == (up_shape == (3, 5, 8))
    sig = 1 / (1 + np.exp(-a.astype(np.float64)))
    silu = a * sig
    h = silu * b + (silu if extra_use else 0)
    close(np.asarray(fn({}, {"a": a, "b": b})[0]), h, 1e-5)
    da, db = jax.grad(loss, (0, 1))(a, b)
    c = np.cos(h)
    dsilu = sig * (1 + a * (1 - sig))
    want_da = c * (b + (1 if extra_use else 0)) * dsilu
    want_db = c * silu
    if up_shape != (3, 5, 8):
        want_db = want_db.sum(axis=(0, 1))
    close(np.asarray(da), want_da, 1e-5)
    close(np.asarray(db), want_db, 1e-5)
