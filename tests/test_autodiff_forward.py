"""Graph-level forward mode, Hessian-vector products, vmap and jacfwd against JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax.ir import Graph, GraphError

from autodiff_cases import CASES, feeds_for

RTOL = 3e-4


def _close(got, want, what, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not want.size:
        return
    scale = max(float(np.max(np.abs(want))), 1.0)
    err = float(np.max(np.abs(got - want)))
    assert err <= rtol * scale, f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


def _leaves(g):
    return [n.op.name for n in g.nodes if type(n.op).__name__ == "Param"]


def _split(g, feeds):
    params = {n.op.name for n in g.nodes if type(n.op).__name__ == "Param"}
    return ({k: v for k, v in feeds.items() if k in params}, {k: v for k, v in feeds.items() if k not in params})


# -- jvp ------------------------------------------------------------------------------

JVP_CASES = ["act_gelu", "act_tanh", "binary_div", "binary_pow", "where_compare", "softmax", "reduce_max",
             "matmul_batched", "dot_general", "layer_norm", "rms_norm", "group_norm", "batch_norm_inference",
             "attention_causal", "attention_softcap", "conv2d_stride_pad_dil_groups", "max_pool2d",
             "avg_pool2d", "softmax_cross_entropy", "cumsum", "gather_axis0", "concat", "narrow",
             "fused_swiglu", "if_where", "scan_final_carry", "scan_body_param", "scan_body_if_param", "scan_in_scan_param",
             "if_scan_param", "scan_body_while_param", "dense_solve", "rope",
             # forward mode through the transposition identity needs the VJPs of the backward
             # ops: MaxPool2dBackward (any geometry), FakeQuantizeLSQBackwardScale
             "max_pool2d_overlap", "max_pool2d_ties", "fake_quantize_lsq", "fake_quantize_lsq_per_channel",
             "dequant_matmul_int8_asym", "dequant_grouped_matmul_gguf", "attention_custom_scale_softcap"]


JVP_FAST = {"act_gelu", "binary_pow", "softmax", "layer_norm", "group_norm", "attention_softcap",
            "conv2d_stride_pad_dil_groups", "max_pool2d", "softmax_cross_entropy", "scan_final_carry", "scan_body_param",
            "scan_body_if_param", "scan_in_scan_param", "if_scan_param", "if_where", "dense_solve", "max_pool2d_ties", "fake_quantize_lsq_per_channel"}
VMAP_FAST = {"binary_add", "where_compare", "reduce_mean", "softmax", "matmul_batched", "layer_norm",
             "reshape_transpose", "concat", "conv2d", "attention_custom", "dense_solve", "scan_trajectory"}


def _marked(names, fast):
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in names]


def _case_graph(name):
    build, explicit = CASES[name]
    g = Graph(name)
    y = build(g)
    g.set_outputs([y])
    return g, explicit


@pytest.mark.parametrize("name", _marked(JVP_CASES, JVP_FAST))
def test_jvp_matches_jax(name):
    g, explicit = _case_graph(name)
    params, inputs = feeds_for(g, explicit, np.random.RandomState(0))
    names = _leaves(g)
    jg = rlx_jax.jvp(g, names)
    jg.verify()
    assert Graph.from_json(jg.to_json()) == jg
    rng = np.random.RandomState(5)
    tangents = {f"tangent_{k}": rng.randn(*np.shape(v)).astype(v.dtype) for k, v in params.items()}
    outs = jax.jit(rlx_jax.to_jax(jg))(params, dict(inputs, **tangents))
    f = rlx_jax.to_jax(g)
    prim, tan = jax.jit(lambda p, t: jax.jvp(lambda q: f(q, inputs), (p,), (t,)))(
        params, {k: tangents[f"tangent_{k}"] for k in params})
    assert len(outs) == 2
    _close(outs[0], prim[0], "primal")
    _close(outs[1], tan[0], "tangent")


def test_jvp_norm_statistics_are_not_frozen():
    """d LayerNorm(x) in direction t includes the change of mean and variance."""
    g = Graph("ln")
    x = g.input("x", [2, 6])
    y = g.layer_norm(x, g.constant(np.ones(6, np.float32)), g.constant(np.zeros(6, np.float32)))
    g.set_outputs([y])
    jg = rlx_jax.jvp(g, ["x"])
    xv = np.random.RandomState(0).randn(2, 6).astype("f4")
    t = np.ones((2, 6), np.float32)           # a shift: LayerNorm is invariant to it
    outs = rlx_jax.to_jax(jg)({}, {"x": xv, "tangent_x": t})
    assert float(np.max(np.abs(np.asarray(outs[1])))) < 1e-5


def test_jvp_errors():
    g, _ = _case_graph("act_tanh")
    with pytest.raises(GraphError, match="nope"):
        rlx_jax.jvp(g, ["nope"])


def test_jvp_output_listed_twice_gets_its_tangent_each_time(x64):
    """An output node named twice in the outputs has one tangent, returned at both places."""
    g = Graph("dup")
    x = g.param("x", [3], "f64")
    y = g.exp(x)
    g.set_outputs([y, g.sin(x), y])
    xv, tv = np.array([0.1, -0.2, 0.3]), np.array([1.0, 2.0, 3.0])
    outs = rlx_jax.to_jax(rlx_jax.jvp(g, ["x"]))({"x": xv}, {"tangent_x": tv})
    assert len(outs) == 6
    _close(outs[3], np.exp(xv) * tv, "first y", 1e-12)
    _close(outs[4], np.cos(xv) * tv, "sin", 1e-12)
    _close(outs[5], np.exp(xv) * tv, "second y", 1e-12)


def test_hvp_wrt_leaves_sharing_one_gradient_node(x64):
    """loss = sum(exp(a + b)): d/da and d/db are the same node of the gradient graph, so
    its outputs name that node twice; (H v)_b must not be lost to the repeat."""
    g = Graph("shared")
    a, b = g.param("a", [3], "f64"), g.param("b", [3], "f64")
    g.set_outputs([g.sum(g.exp(g.add(a, b)), [0])])
    av, bv = np.array([0.1, 0.2, 0.3]), np.array([-0.3, 0.1, 0.0])
    ta, tb = np.array([1.0, 0.0, 2.0]), np.array([0.5, 1.0, -1.0])
    outs = rlx_jax.to_jax(rlx_jax.hvp(g, ["a", "b"]))({"a": av, "b": bv}, {"tangent_a": ta, "tangent_b": tb})
    # the Hessian of sum(exp(a + b)) is diag(exp(a + b)) in every block, so (H v)_a = (H v)_b
    want = np.exp(av + bv) * (ta + tb)
    _close(outs[1], np.exp(av + bv), "grad a", 1e-12)
    _close(outs[2], np.exp(av + bv), "grad b", 1e-12)
    _close(outs[3], want, "Hv a", 1e-12)
    _close(outs[4], want, "Hv b", 1e-12)


@pytest.mark.parametrize("ldt,labels", [
    ("f32", [0.0, 3.0, 2.7, 3.99]),         # a float id is truncated toward zero
    ("f32", [0.0, 3.0, -1.5, -0.5]),        # a negative float id saturates to class 0
    ("f32", [0.0, 4.0, 1e9, 2.0]),          # past the last class: the row is ignored
    ("i32", [0, 3, 7, 2]),
    ("i32", [0, -100, 2, -1]),              # a negative integer id: the row is ignored
], ids=["float_fraction", "float_negative", "float_past_end", "int_past_end", "int_negative"])
def test_cross_entropy_second_order_follows_the_label_rules(x64, ldt, labels):
    """jvp and hvp of a cross-entropy loss differentiate its backward op again; that must
    map labels to classes as the op does (lowering.nn.class_labels), or rows with
    fractional, negative or out-of-range ids get a tangent the loss does not have."""
    g = Graph("xent")
    x = g.param("x", [4, 4], "f64")
    lab = g.input("lab", [4], ldt)
    g.set_outputs([g.sum(g.softmax_cross_entropy_with_logits(x, lab), [0])])
    labv = np.array(labels, np.float32 if ldt == "f32" else np.int32)
    rng = np.random.RandomState(0)
    xv, tv = rng.randn(4, 4), rng.randn(4, 4)
    f = rlx_jax.to_jax(g)

    def loss(a):
        return f({"x": a}, {"lab": labv})[0]
    jv = rlx_jax.to_jax(rlx_jax.jvp(g, ["x"]))({"x": xv}, {"lab": labv, "tangent_x": tv})[1]
    _, jv_ref = jax.jvp(loss, (xv,), (tv,))
    fd = (loss(xv + 1e-6 * tv) - loss(xv - 1e-6 * tv)) / 2e-6
    _close(jv_ref, fd, "jax.jvp against central differences", 1e-7)
    _close(jv, jv_ref, "jvp", 1e-12)
    hv = rlx_jax.to_jax(rlx_jax.hvp(g, ["x"]))({"x": xv}, {"lab": labv, "tangent_x": tv})[-1]
    _, hv_ref = jax.jvp(jax.grad(loss), (xv,), (tv,))
    _close(hv, hv_ref, "Hv", 1e-12)


# -- hvp --------------------------------------------------------------------------------

def mlp_graph(dt="f64"):
    g = Graph("mlp")
    x = g.input("x", [5, 4], dt)
    w1, b1, w2 = g.param("w1", [4, 6], dt), g.param("b1", [6], dt), g.param("w2", [6, 3], dt)
    labels = g.input("labels", [5], "i32")
    h = g.gelu(g.add(g.matmul(x, w1), b1))
    loss = g.mean(g.softmax_cross_entropy_with_logits(g.matmul(h, w2), labels), [0])
    g.set_outputs([loss])
    feeds = {"x": np.random.RandomState(1).randn(5, 4).astype("f4"),
             "labels": np.array([0, 2, 1, 1, 0], np.int32)}
    return g, ["w1", "b1", "w2"], feeds


def cnn_graph(dt="f64"):
    g = Graph("cnn")
    x = g.input("x", [2, 2, 6, 6], dt)
    w = g.param("w", [4, 2, 3, 3], dt)
    gamma, beta = g.param("gamma", [4], dt), g.param("beta", [4], dt)
    fc = g.param("fc", [4 * 2 * 2, 3], dt)
    labels = g.input("labels", [2], "i32")
    c = g.conv2d(x, w, padding=(1, 1))
    c = g.group_norm(c, gamma, beta, 2)
    c = g.max_pool2d(g.silu(c), 3, stride=3)
    logits = g.matmul(g.reshape(c, [2, 16]), fc)
    loss = g.mean(g.softmax_cross_entropy_with_logits(logits, labels), [0])
    g.set_outputs([loss])
    feeds = {"x": np.random.RandomState(2).randn(2, 2, 6, 6).astype("f4"), "labels": np.array([1, 2], np.int32)}
    return g, ["w", "gamma", "beta", "fc"], feeds


def cnn_overlap_graph(dt="f64"):
    """The CNN with overlapping, padded max pooling (3x3, stride 2, padding 1): its hvp
    runs through MaxPool2dBackward's own VJP."""
    g = Graph("cnn_overlap")
    x = g.input("x", [2, 2, 6, 6], dt)
    w = g.param("w", [4, 2, 3, 3], dt)
    gamma, beta = g.param("gamma", [4], dt), g.param("beta", [4], dt)
    fc = g.param("fc", [4 * 3 * 3, 3], dt)
    labels = g.input("labels", [2], "i32")
    c = g.group_norm(g.conv2d(x, w, padding=(1, 1)), gamma, beta, 2)
    c = g.max_pool2d(g.silu(c), 3, stride=2, padding=(1, 1))
    logits = g.matmul(g.reshape(c, [2, 36]), fc)
    g.set_outputs([g.mean(g.softmax_cross_entropy_with_logits(logits, labels), [0])])
    feeds = {"x": np.random.RandomState(2).randn(2, 2, 6, 6).astype("f4"), "labels": np.array([1, 2], np.int32)}
    return g, ["w", "gamma", "beta", "fc"], feeds


def transformer_graph(dt="f64"):
    g = Graph("block")
    b, s, h, d = 2, 3, 2, 4
    e = h * d
    x = g.input("x", [b, s, e], dt)
    wq, wk, wv, wo = (g.param(n, [e, e], dt) for n in ("wq", "wk", "wv", "wo"))
    g1, b1 = g.param("ln_g", [e], dt), g.param("ln_b", [e], dt)
    w1, w2 = g.param("w1", [e, 2 * e], dt), g.param("w2", [2 * e, e], dt)
    hn = g.layer_norm(x, g1, b1)
    att = g.attention_opts(g.matmul(hn, wq), g.matmul(hn, wk), g.matmul(hn, wv), h, d, "causal")
    x2 = g.add(x, g.matmul(att, wo))
    ff = g.matmul(g.gelu_approx(g.matmul(g.rms_norm(x2, g.constant(np.ones(e, np.float64)),
                                                    g.constant(np.zeros(e, np.float64))), w1)), w2)
    out = g.add(x2, ff)
    loss = g.mean(g.mul(out, out), [0, 1, 2])
    g.set_outputs([loss])
    feeds = {"x": np.random.RandomState(3).randn(b, s, e).astype("f4")}
    return g, ["wq", "wk", "wv", "wo", "ln_g", "ln_b", "w1", "w2"], feeds


@pytest.mark.parametrize("maker", [mlp_graph, pytest.param(cnn_graph, marks=pytest.mark.slow),
                                   pytest.param(cnn_overlap_graph, marks=pytest.mark.slow), transformer_graph],
                         ids=["mlp", "cnn", "cnn_overlap_pool", "transformer"])
def test_hvp_matches_jax_hessian(maker, x64):
    g, wrt, inputs = maker()
    rng = np.random.RandomState(0)
    params = {n.op.name: (rng.randn(*n.shape.dims) * 0.5).astype(np.float64)
              for n in g.nodes if type(n.op).__name__ == "Param"}
    inputs = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in inputs.items()}
    hg = rlx_jax.hvp(g, wrt)
    hg.verify()
    assert Graph.from_json(hg.to_json()) == hg
    vs = {w: rng.randn(*params[w].shape) for w in wrt}
    outs = jax.jit(rlx_jax.to_jax(hg))(params, dict(inputs, **{f"tangent_{w}": vs[w] for w in wrt}))
    f = rlx_jax.to_jax(g)

    def flat_loss(flat):
        p, k = dict(params), 0
        for w in wrt:
            n = params[w].size
            p[w] = flat[k:k + n].reshape(params[w].shape)
            k += n
        return f(p, inputs)[0]

    flat = np.concatenate([params[w].ravel() for w in wrt])
    hess = jax.jit(jax.hessian(flat_loss))(flat)
    hv = hess @ np.concatenate([vs[w].ravel() for w in wrt])
    assert len(outs) == 1 + 2 * len(wrt)
    _close(outs[0], flat_loss(flat), "loss", 1e-9)
    grad = jax.jit(jax.grad(flat_loss))(flat)
    k = 0
    for i, w in enumerate(wrt):
        n = params[w].size
        _close(outs[1 + i], grad[k:k + n].reshape(params[w].shape), f"grad {w}", 1e-9)
        _close(outs[1 + len(wrt) + i], hv[k:k + n].reshape(params[w].shape), f"Hv {w}", 1e-9)
        k += n


# -- vmap ---------------------------------------------------------------------------------

VMAP_CASES = ["act_silu", "binary_add", "binary_max", "where_compare", "softmax", "reduce_sum", "reduce_mean",
              "cumsum", "matmul_batched", "layer_norm", "rms_norm", "reshape_transpose", "narrow", "concat",
              "expand", "gather_axis1", "conv2d", "max_pool2d", "avg_pool2d", "group_norm", "attention_causal",
              "attention_custom", "softmax_cross_entropy", "rope", "dot_general", "cumsum_exclusive",
              "fake_quantize_identity", "dense_solve", "fused_residual_ln", "scan_trajectory", "scan_body_param"]


@pytest.mark.parametrize("name", _marked(VMAP_CASES, VMAP_FAST))
def test_vmap_matches_jax(name):
    g, explicit = _case_graph(name)
    params, inputs = feeds_for(g, explicit, np.random.RandomState(0))
    batched = _leaves(g)[:2]
    bsz = 3
    vg = rlx_jax.vmap(g, batched, bsz)
    vg.verify()
    rng = np.random.RandomState(7)
    bparams = dict(params)
    for k in batched:
        v = params[k]
        bparams[k] = (np.abs(rng.randn(bsz, *v.shape)) + 0.5 if k.startswith("pos") else rng.randn(bsz, *v.shape)
                      ).astype(v.dtype)
    out = jax.jit(rlx_jax.to_jax(vg))(bparams, inputs)
    f = rlx_jax.to_jax(g)
    ref = jax.jit(jax.vmap(lambda *xs: f(dict(params, **dict(zip(batched, xs))), inputs)))(
        *[bparams[k] for k in batched])
    _close(out[0], ref[0], "vmap")


def test_vmap_refuses_a_batched_param_read_inside_a_body():
    """A body's Param binds to the outer Param of its name; vmap batches operands, so a
    batched Param read inside a body is refused by name, not lowered at the wrong rank."""
    g, _ = _case_graph("scan_body_param")
    rlx_jax.vmap(g, ["c0", "u"], 2).verify()  # operands of the scan: batched
    with pytest.raises(GraphError, match=r"Scan: its body reads batched Param\(s\) \['w'\]"):
        rlx_jax.vmap(g, ["w"], 2)


@pytest.mark.parametrize("axis,bsz", [(0, 2), (0, 3), (1, 3), (1, 2), (None, 2)],
                         ids=["rows_b_eq_channels", "rows", "cols_b_eq_channels", "cols", "per_tensor"])
def test_vmap_quantize_keeps_its_channel_axis(axis, bsz):
    """Quantize / Dequantize index their scales along ``axis``; under vmap that axis moves
    past the new batch axis (with the batch as long as the channel count a wrong axis
    would still verify and quantize along the batch)."""
    n = {0: 2, 1: 3, None: 1}[axis]
    scales, zps = [0.1, 0.5, 0.25][:n], [0, 1, -2][:n]
    g = Graph("q")
    x = g.input("x", [2, 3], "f32")
    q = g.quantize(x, scales, zps, axis=axis)
    g.set_outputs([g.dequantize(q, scales, zps, axis=axis), q])
    xs = (np.random.RandomState(1).randn(bsz, 2, 3) * 0.7).astype("f4")
    got = rlx_jax.to_jax(rlx_jax.vmap(g, ["x"], bsz))({}, {"x": xs})
    f = rlx_jax.to_jax(g)
    want = jax.vmap(lambda a: f({}, {"x": a}))(xs)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    _close(got[0], want[0], "dequantized")


@pytest.mark.parametrize("batched", [["x"], ["x", "s"], ["s"]], ids=["x", "x_and_sinks", "sinks"])
def test_vmap_attention_with_sinks(x64, batched):
    """The per-head sinks [H] are not rows of the attention: unbatched they stay [H] while
    q, k, v merge the batch into their rows; batched, the op runs per sample."""
    g = Graph("sinks")
    x, s = g.param("x", [2, 3, 4], "f64"), g.param("s", [2], "f64")
    g.set_outputs([g.attention_opts(x, x, x, 2, 2, "causal", sinks=s)])
    rng = np.random.RandomState(0)
    params = {"x": rng.randn(2, 3, 4), "s": np.array([0.3, -0.2])}
    bparams = dict(params, **{k: rng.randn(3, *params[k].shape) for k in batched})
    got = rlx_jax.to_jax(rlx_jax.vmap(g, batched, 3))(bparams, {})[0]
    f = rlx_jax.to_jax(g)
    want = jax.vmap(lambda *xs: f(dict(params, **dict(zip(batched, xs))), {})[0])(*[bparams[k] for k in batched])
    _close(got, want, "vmap", 1e-12)


def test_vmap_unbatched_output_is_broadcast():
    g = Graph("two")
    x, y = g.input("x", [3]), g.input("y", [3])
    g.set_outputs([g.exp(x), g.sin(y)])
    vg = rlx_jax.vmap(g, ["x"], 2)
    xs = np.random.RandomState(0).randn(2, 3).astype("f4")
    yv = np.ones(3, np.float32)
    a, b = rlx_jax.to_jax(vg)({}, {"x": xs, "y": yv})
    _close(a, np.exp(xs), "batched")
    _close(b, np.broadcast_to(np.sin(yv), (2, 3)), "broadcast")
    with pytest.raises(GraphError):
        rlx_jax.vmap(g, ["z"], 2)


# -- jacfwd ---------------------------------------------------------------------------------

def test_jacfwd_full_jacobian(x64):
    g = Graph("f")
    x = g.input("x", [3], "f64")
    w = g.param("w", [3, 2], "f64")
    y = g.tanh(g.matmul(g.reshape(x, [1, 3]), w))
    g.set_outputs([g.reshape(y, [2])])
    jg = rlx_jax.jvp(g, ["x"])
    rng = np.random.RandomState(0)
    xv, wv = rng.randn(3), rng.randn(3, 2)
    (jac,) = rlx_jax.jacfwd(jg, {"x": xv, "w": wv}, "x", [3])
    f = rlx_jax.to_jax(g)
    ref = jax.jacfwd(lambda v: f({"w": wv}, {"x": v})[0])(xv)
    assert jac.shape == (2, 3) and jac.dtype == np.float64
    _close(jac, ref, "jacobian", 1e-9)


def test_jacfwd_through_a_session(x64):
    g = Graph("f")
    x = g.input("x", [2], "f64")
    w = g.param("w", [2], "f64")
    g.set_outputs([g.mul(g.sin(x), w), g.sum(g.exp(x), [0])])
    compiled = rlx_jax.Session("cpu").compile(rlx_jax.jvp(g, ["x"]))
    xv, wv = np.array([0.3, -1.2]), np.array([2.0, 0.5])
    j1, j2 = rlx_jax.jacfwd(compiled, {"x": xv, "w": wv}, "x", [2])
    _close(j1, np.diag(np.cos(xv) * wv), "jacobian 1", 1e-9)
    _close(j2, np.exp(xv), "jacobian 2", 1e-9)
