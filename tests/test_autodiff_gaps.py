"""Graph autodiff of the ops whose rules close issue 5's remaining gaps, each checked
against the JAX door (jax.grad of to_jax) or finite differences:

- MaxPool2dBackward's own VJP (the cotangent of its dy) with overlapping windows,
  padding and ties (first maximum wins, as the forward's argmax);
- FakeQuantizeLSQBackwardScale's VJP (second order of LSQ in the scale), and
  check_grads order 2 in float64 of the lowered LSQ backward;
- a checkpointed (partial-trajectory) ScanBackward differentiated again, and
  check_grads order 2 in float64 of its lowering;
- DequantMatMul: the dequantisation parameters get no gradient (STRICT names them);
- the decomposed splat pair is fused before differentiation (and refused when it
  cannot be);
- the softcap attention expansion is used only with a softcap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ir import Graph, GraphError

RTOL = 2e-4
_NP = {"f32": np.float32, "f64": np.float64}


def _close(got, want, what, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(float(np.max(np.abs(want))) if want.size else 1.0, 1.0)
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= rtol * scale, f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


def _weighted_sum(g, y, seed, dtype=np.float32):
    s = g.node(y).shape
    r = np.random.RandomState(seed).randn(*s.dims).astype(dtype)
    return g.sum(g.mul(y, g.constant(r)), list(range(len(s.dims))))


def _grad_vs_jax(g, params, inputs, wrt):
    """to_jax(grad_with_loss(g, wrt)) against jax.grad of to_jax(g)."""
    gg = rlx_jax.grad_with_loss(g, wrt)
    gg.verify()
    assert Graph.from_json(gg.to_json()) == gg
    outs = jax.jit(rlx_jax.to_jax(gg))(params, dict(inputs, d_output=np.asarray(1, params[wrt[0]].dtype)))
    f = rlx_jax.to_jax(g)
    ref = jax.grad(lambda p: f(p, inputs)[0])(params)
    _close(outs[0], f(params, inputs)[0], "loss")
    for w, got in zip(wrt, outs[1:]):
        _close(got, ref[w], f"d loss / d {w}")
    return gg, outs


# -- MaxPool2dBackward's VJP ---------------------------------------------------------------

@pytest.mark.parametrize("shape,k,s,p,ties", [
    ((2, 3, 7, 6), (3, 3), (1, 1), (1, 1), True),       # overlapping, padded, ties
    ((1, 2, 8, 7), (3, 2), (2, 1), (1, 0), True),       # rectangular, stride < kernel on one axis
    pytest.param((1, 1, 5, 5), (2, 2), (2, 2), (1, 1), False, marks=pytest.mark.slow),  # non-overlapping, padded
    pytest.param((1, 2, 4, 4), (2, 2), (3, 3), (0, 0), False, marks=pytest.mark.slow),  # stride > kernel
    ((1, 2, 3, 3), (5, 5), (1, 1), (2, 2), True),       # kernel > input, windows mostly padding
])
def test_max_pool_backward_cotangent_of_dy(shape, k, s, p, ties):
    """loss = sum(MaxPool2dBackward(x, d) * R): d loss / d d = P R, R read at each
    window's first maximum; x (fed, integer-valued when ``ties``) gets none."""
    rng = np.random.RandomState(0)
    xv = (rng.randint(-2, 3, shape) if ties else rng.randn(*shape)).astype(np.float32)
    g = Graph("mpb")
    x = g.input("x", list(shape))
    ho = (shape[-2] + 2 * p[0] - k[0]) // s[0] + 1
    wo = (shape[-1] + 2 * p[1] - k[1]) // s[1] + 1
    d = g.param("d", list(shape[:-2]) + [ho, wo])
    g.set_outputs([_weighted_sum(g, g.max_pool2d_backward(x, d, k, s, p), 1)])
    params = {"d": rng.randn(*shape[:-2], ho, wo).astype(np.float32)}
    _, outs = _grad_vs_jax(g, params, {"x": xv}, ["d"])
    # an independent NumPy oracle: window (i, j) reads R at its first maximum
    r = np.random.RandomState(1).randn(*shape).astype(np.float32)
    xp = np.pad(xv, [(0, 0)] * (len(shape) - 2) + [(p[0], p[0]), (p[1], p[1])], constant_values=-np.inf)
    rp = np.pad(r, [(0, 0)] * (len(shape) - 2) + [(p[0], p[0]), (p[1], p[1])])
    want = np.zeros(params["d"].shape, np.float32)
    for idx in np.ndindex(*shape[:-2]):
        for i in range(ho):
            for j in range(wo):
                win = xp[idx + (slice(i * s[0], i * s[0] + k[0]), slice(j * s[1], j * s[1] + k[1]))]
                a = np.argmax(win.reshape(-1))          # first occurrence, row-major
                want[idx + (i, j)] = rp[idx + (i * s[0] + a // k[1], j * s[1] + a % k[1])]
    _close(outs[1], want, "P R (NumPy)")


def test_max_pool_backward_vjp_all_minus_inf_window():
    """A window whose maximum is -inf passes nothing (the forward's argmax -1)."""
    g = Graph("ninf")
    x = g.input("x", [1, 1, 4, 4])
    d = g.param("d", [1, 1, 2, 2])
    g.set_outputs([_weighted_sum(g, g.max_pool2d_backward(x, d, 2, 2), 3)])
    xv = np.random.RandomState(0).randn(1, 1, 4, 4).astype(np.float32)
    xv[0, 0, :2, :2] = -np.inf
    _, outs = _grad_vs_jax(g, {"d": np.ones((1, 1, 2, 2), np.float32)}, {"x": xv}, ["d"])
    got = np.asarray(outs[1])[0, 0]
    assert got[0, 0] == 0 and np.all(got.reshape(-1)[1:] != 0)


# -- FakeQuantizeLSQBackwardScale: second order ------------------------------------------------

def _lsq_graph(dt, axis, shape=(3, 4, 5), bits=3):
    g = Graph("lsq")
    x = g.param("x", list(shape), dt)
    s = g.param("s", [shape[axis]] if axis is not None else [1], dt)
    y = g.fake_quantize_lsq(x, s, bits, axis=axis)
    g.set_outputs([_weighted_sum(g, y, 1, _NP[dt])])
    return g


def _lsq_feeds(dt, axis, shape=(3, 4, 5)):
    rng = np.random.RandomState(0)
    return {"x": (2.0 * rng.randn(*shape)).astype(dt),
            "s": rng.uniform(0.5, 1.5, [shape[axis]] if axis is not None else [1]).astype(dt)}


@pytest.mark.parametrize("axis", [pytest.param(None, marks=pytest.mark.slow), 1])
def test_lsq_scale_gradient_differentiated_again(axis):
    """loss2 = sum(d loss / d s * R2): its gradient in x and s runs through the VJP of
    FakeQuantizeLSQBackwardScale; compared with JAX's grad-of-grad."""
    g = _lsq_graph("f32", axis)
    p = _lsq_feeds("float32", axis)
    gg = rlx_jax.grad_with_loss(g, ["x", "s"])
    h = gg.copy()
    ds = h.outputs[2]
    h.set_outputs([_weighted_sum(h, ds, 2)])
    hh = rlx_jax.grad_with_loss(h, ["x", "s"])
    hh.verify()
    names = [n.op.name for n in hh.nodes if type(n.op).__name__ == "Input"]
    outs = jax.jit(rlx_jax.to_jax(hh))(p, {nm: np.float32(1) for nm in names})
    f = rlx_jax.to_jax(g)
    r2 = np.random.RandomState(2).randn(*p["s"].shape).astype(np.float32)

    def loss2(q):
        return jnp.sum(jax.grad(lambda z: f(z, {})[0])(q)["s"] * r2)

    ref = jax.grad(loss2)(p)
    _close(outs[0], loss2(p), "loss2")
    _close(outs[1], ref["x"], "d loss2 / d x")
    _close(outs[2], ref["s"], "d loss2 / d s")
    assert float(np.max(np.abs(np.asarray(outs[1])))) > 1e-3      # not vacuous: -d/s inside
    assert float(np.max(np.abs(np.asarray(outs[2])))) > 1e-3


@pytest.mark.parametrize("axis", [pytest.param(None, marks=pytest.mark.slow), 1])
def test_lsq_backward_check_grads_order2_f64(axis, x64):
    """The lowered gradient graph (LSQ backward X and Scale) in float64: check_grads
    order 2 in both modes against finite differences."""
    g = _lsq_graph("f64", axis)
    gg = rlx_jax.grad_with_loss(g, ["x", "s"])
    f = rlx_jax.to_jax(gg)
    p = _lsq_feeds("float64", axis)

    def dscale(x, s):
        return f({"x": x, "s": s}, {"d_output": jnp.float64(1.3)})[2]

    check_grads(jax.jit(dscale), (p["x"], p["s"]), order=2, modes=("fwd", "rev"))
    d2 = jax.jacrev(dscale, argnums=1)(p["x"], p["s"])
    assert np.all(np.isfinite(np.asarray(d2))) and float(np.max(np.abs(np.asarray(d2)))) > 0


# -- checkpointed (partial-trajectory) ScanBackward differentiated again ---------------------

def _body(name, fn, n=2, shape=(3,), dt="f32"):
    b = Graph(name)
    ins = [b.input(f"i{k}", list(shape), dt) for k in range(n)]
    b.set_outputs([fn(b, *ins)])
    return b


def _scan_bwd_graph(dt, length=5, k=2):
    """dinit and d xs of c' = tanh(c * x + x) over a scan whose trajectory input has
    only K rows (never read: the carries are recomputed with forward_body)."""
    step = lambda b, c, x: b.tanh(b.add(b.mul(c, x), x))            # noqa: E731
    fwd = _body("step", step, dt=dt)
    vjp = Graph("step_vjp")
    c, x = vjp.input("i0", [3], dt), vjp.input("i1", [3], dt)
    d = vjp.input("d_output", [3], dt)
    t = vjp.tanh(vjp.add(vjp.mul(c, x), x))
    u = vjp.mul(d, vjp.sub(vjp.scalar(1.0, dt), vjp.mul(t, t)))
    vjp.set_outputs([vjp.mul(u, x), vjp.mul(u, vjp.add(c, vjp.scalar(1.0, dt)))])
    g = Graph("scan_bwd")
    init, xs, up = g.param("init", [3], dt), g.param("xs", [length, 3], dt), g.param("up", [length, 3], dt)
    traj = g.input("traj", [k, 3], dt)
    kw = dict(num_checkpoints=k, forward_body=fwd)
    di = g.scan_backward(init, traj, up, [xs], vjp, length, True, **kw)
    dx = g.scan_backward_xs(init, traj, up, [xs], vjp, length, True, 0, **kw)
    g.set_outputs([g.add(_weighted_sum(g, di, 1, _NP[dt]), _weighted_sum(g, dx, 2, _NP[dt]))])
    return g


def _scan_feeds(dt, length=5, k=2):
    rng = np.random.RandomState(0)
    p = {"init": rng.randn(3).astype(dt), "xs": (0.7 * rng.randn(length, 3)).astype(dt),
         "up": rng.randn(length, 3).astype(dt)}
    return p, {"traj": np.full((k, 3), np.nan, dt)}


def test_checkpointed_scan_backward_differentiated_again():
    g = _scan_bwd_graph("f32")
    p, i = _scan_feeds("float32")
    gg, outs = _grad_vs_jax(g, p, i, ["init", "xs", "up"])
    assert any(type(n.op).__name__ == "ScanBackward" for n in gg.nodes)
    assert all(np.all(np.isfinite(np.asarray(o))) for o in outs)      # the NaN trajectory is not read


@pytest.mark.slow
def test_checkpointed_scan_backward_check_grads_order2_f64(x64):
    g = _scan_bwd_graph("f64")
    f = rlx_jax.to_jax(g)
    p, i = _scan_feeds("float64")

    def loss(init, xs, up):
        return f({"init": init, "xs": xs, "up": up}, i)[0]

    check_grads(jax.jit(loss), (p["init"], p["xs"], p["up"]), order=2, modes=("fwd", "rev"))
    # and the graph door's gradient graph of it, in f64, once more
    gg = rlx_jax.grad_with_loss(g, ["init", "xs", "up"])
    fg = rlx_jax.to_jax(gg)

    def dinit(init, xs, up):
        return fg({"init": init, "xs": xs, "up": up}, dict(i, d_output=jnp.float64(1)))[1]

    check_grads(jax.jit(dinit), (p["init"], p["xs"], p["up"]), order=1, modes=("fwd", "rev"))


def test_checkpointed_scan_backward_second_order_needs_forward_body():
    from rlx_jax.autodiff.rules_backward import _scan_bwd_unrolled
    from rlx_jax.ir import OP_CLASSES

    g = _scan_bwd_graph("f32")
    node = next(n for n in g.nodes if type(n.op).__name__ == "ScanBackward")
    op = OP_CLASSES["ScanBackward"](body_vjp=node.op.body_vjp, length=5, save_trajectory=True, num_xs=1,
                                    num_checkpoints=2, forward_body=None)
    with pytest.raises(GraphError, match="forward_body"):
        _scan_bwd_unrolled(g, op, list(node.inputs), None)


# -- DequantMatMul: no gradient for the dequantisation parameters ------------------------------

def _dqmm_graph(scale_is_param):
    g = Graph("dqmm")
    x = g.param("x", [3, 8])
    w = g.input("w", [8, 5], "i8")
    s = g.param("s", [2, 5]) if scale_is_param else g.input("s", [2, 5])
    z = g.input("z", [2, 5])
    g.set_outputs([_weighted_sum(g, g.dequant_matmul([x, w, s, z], "Int8BlockAsym:4", [3, 5]), 1)])
    return g


def test_dequant_matmul_scale_gets_no_gradient():
    g = _dqmm_graph(True)
    with pytest.raises(GraphError, match=r"Param 's'"):
        rlx_jax.grad_with_loss(g, ["x", "s"])
    gg = rlx_jax.grad_with_loss(g, ["x", "s"], rlx_jax.GradWithLossOptions.TRAINING)
    rng = np.random.RandomState(0)
    p = {"x": rng.randn(3, 8).astype("f4"), "s": rng.uniform(0.1, 0.2, (2, 5)).astype("f4")}
    i = {"w": rng.randint(-128, 128, (8, 5)).astype("i1"), "z": rng.randn(2, 5).astype("f4")}
    outs = rlx_jax.to_jax(gg)(p, dict(i, d_output=np.float32(1)))
    np.testing.assert_array_equal(np.asarray(outs[2]), np.zeros((2, 5), np.float32))
    # d x = R @ W^T with W dequantised in NumPy
    blk = np.arange(8) // 4
    wd = (i["w"].astype(np.float32) - i["z"][blk]) * p["s"][blk]
    r = np.random.RandomState(1).randn(3, 5).astype(np.float32)
    _close(outs[1], r @ wd.T, "d x (NumPy)")


# -- splat: the decomposed pair is fused before differentiating -------------------------------

def test_splat_pair_is_fused_and_refused_when_it_cannot_be():
    from autodiff_cases import CASES

    build, _ = CASES["gaussian_splat_prepare_rasterize"]
    g = Graph("splat")
    y = build(g)
    g.set_outputs([g.sum(y, [0])])
    gg = rlx_jax.grad_with_loss(g, ["positions", "colors"])
    kinds = {type(n.op).__name__ for n in gg.nodes}
    assert "GaussianSplatRenderBackward" in kinds and "GaussianSplatRasterize" not in kinds
    bwd = next(n.op for n in gg.nodes if type(n.op).__name__ == "GaussianSplatRenderBackward")
    assert (bwd.loss_grad_clip, bwd.sh_band, bwd.max_anisotropy) == (0.0, 3, 0.0)

    # a Rasterize whose meta is not its Prepare's meta cannot become one render
    g2 = Graph("splat2")
    y2 = build(g2)
    other = g2.input("meta2", [23])
    rast = g2.node(y2)
    y3 = g2.add_node(rast.op, (rast.inputs[0], other))
    g2.set_outputs([g2.sum(y3, [0])])
    with pytest.raises(GraphError, match="meta"):
        rlx_jax.grad_with_loss(g2, ["positions"])

    # second order through the splat backward uses rlx_jax's Custom op (no RLX op has
    # that derivative; values: tests/test_autodiff_splat_second_order.py)
    h = gg.copy()
    h.set_outputs([h.sum(h.outputs[1], [0])])
    hh = rlx_jax.grad_with_loss(h, ["positions"])
    assert any(type(n.op).__name__ == "Custom" and n.op.name == "rlx_jax.gaussian_splat_render_backward_vjp"
               for n in hh.nodes)


# -- attention: the primitive expansion only with a softcap ----------------------------------

@pytest.mark.parametrize("softcap", [None, 2.0])
def test_attention_softcap_expansion_only_when_needed(softcap):
    g = Graph("attn")
    q, k, v = (g.param(n, [1, 4, 2, 4]) for n in "qkv")
    y = g.attention_opts(q, k, v, 2, 4, "causal", score_scale=0.5, softcap=softcap)
    g.set_outputs([_weighted_sum(g, y, 1)])
    kinds = [type(n.op).__name__ for n in rlx_jax.grad_with_loss(g, ["q", "k", "v"]).nodes]
    if softcap is None:
        assert kinds.count("AttentionBackward") == 3 and "Softmax" not in kinds
    else:
        assert "AttentionBackward" not in kinds and "Softmax" in kinds


def test_splat_zero_gaussians():
    """N = 0: the render is the background and every scene gradient is empty."""
    from autodiff_cases import _splat_meta

    g = Graph("splat0")
    ids = [g.param(n, [0]) for n in ("p", "s", "r", "o", "c", "sh")] + [g.input("meta", [23])]
    y = g.gaussian_splat_render(*ids, width=4, height=2, tile_size=4)
    g.set_outputs([g.sum(y, [0])])
    gg = rlx_jax.grad_with_loss(g, ["p", "o", "sh"])
    gg.verify()
    p = {n: np.zeros((0,), np.float32) for n in ("p", "s", "r", "o", "c", "sh")}
    outs = rlx_jax.to_jax(gg)(p, {"meta": _splat_meta(None), "d_output": np.float32(1)})
    assert [np.asarray(o).shape for o in outs[1:]] == [(0,), (0,), (0,)]
    _close(outs[0], rlx_jax.to_jax(g)(p, {"meta": _splat_meta(None)})[0], "loss")


# -- coverage: every RLX op is differentiable, gradient-free, or rewritten first -------------

#: ops with no graph VJP rule, each with the reason
NO_RULE = {
    "While": "prepare unrolls it to max_iterations",
    "GaussianSplatPrepare": "prepare fuses Prepare -> Rasterize into GaussianSplatRender",
    "GaussianSplatRasterize": "prepare fuses Prepare -> Rasterize into GaussianSplatRender",
}


def test_every_op_has_a_vjp_rule_or_a_reason():
    from rlx_jax.autodiff.unfuse import DECOMPOSITIONS
    from rlx_jax.autodiff.table import NO_GRADIENT, VJP_RULES, has_vjp_rule
    from rlx_jax.ir import OP_CLASSES

    has_vjp_rule("MatMul")                      # loads the rule modules
    missing = {c.__name__ for c in set(OP_CLASSES.values()) - set(VJP_RULES) - NO_GRADIENT - set(DECOMPOSITIONS)}
    assert missing == set(NO_RULE), sorted(missing ^ set(NO_RULE))


def test_vjp_rules_are_registered_by_op_class():
    from rlx_jax.autodiff.table import VJP_RULES, get_vjp_rule, has_vjp_rule, vjp_rule
    from rlx_jax.ir import OP_CLASSES, LayerNorm

    has_vjp_rule("MatMul")                      # loads the rule modules
    assert all(OP_CLASSES[c.__name__] is c for c in VJP_RULES)
    assert get_vjp_rule(LayerNorm(axis=-1, eps=1e-5)) is VJP_RULES[LayerNorm]
    assert has_vjp_rule(LayerNorm) and has_vjp_rule("LayerNorm") and has_vjp_rule(LayerNorm(axis=0, eps=1.0))
    assert has_vjp_rule("Compare") and not has_vjp_rule("NoSuchOp")
    with pytest.raises(TypeError, match="Op classes, got 'LayerNorm'"):
        vjp_rule("LayerNorm")
    with pytest.raises(ValueError, match="a VJP rule for LayerNorm is already registered"):
        vjp_rule(LayerNorm)(lambda g, node, dy: [None])


# -- a forward graph with a checkpointed trajectory: [K, *carry] ----------------------------

def test_checkpointed_trajectory_scan_forward_graph_declares_k_rows_and_differentiates():
    """Scan(save_trajectory, num_checkpoints=K < length) outputs the K rows
    floor(t * length / K) (RLX's op.rs); the shape rule declares [K, *carry], the graph
    lowers, and grad_with_loss through it matches jax.grad."""
    length, k = 7, 3
    body = Graph("step")
    c, b, x = body.input("c", [4], "f32"), body.input("b", [4], "f32"), body.input("x", [4], "f32")
    body.set_outputs([body.tanh(body.add(body.mul(c, b), x))])
    g = Graph("ckpt_traj")
    init, b, xs = g.param("init", [4], "f32"), g.param("b", [4], "f32"), g.param("xs", [length, 4], "f32")
    traj = g.scan(init, body, length, bcasts=[b], xs=[xs], save_trajectory=True, num_checkpoints=k)
    assert g.node(traj).shape.dims == (k, 4)
    g.set_outputs([_weighted_sum(g, traj, 3)])
    g.verify()
    rng = np.random.RandomState(1)
    params = {"init": rng.randn(4).astype(np.float32), "b": rng.randn(4).astype(np.float32),
              "xs": (0.5 * rng.randn(length, 4)).astype(np.float32)}
    gg, _ = _grad_vs_jax(g, params, {}, ["init", "b", "xs"])
    assert any(type(n.op).__name__ == "ScanBackward" for n in gg.nodes)
