"""Graph-level second order and forward mode of GaussianSplatRender through rlx_jax's
Custom ops (rlx_jax/autodiff/jax_custom.py), checked against JAX autodiff of
``to_jax(g)``: grad_with_loss applied twice, rlx_jax.jvp, rlx_jax.hvp, the JSON round
trip of the second-order graph, a backward node with RLX's training options, and the
attrs / shape checks of the Custom ops. Tiny scenes in float64 (the pure-JAX reference
path); the float32 variants (fused CPU kernels on the first-order path) and the third
order are marked slow (XLA compiles each second-order graph for 10-30 s on this
2-core machine)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import rlx_jax
from rlx_jax.ir import Graph, GraphError

N, K, W, H, TILE = 3, 4, 6, 5, 4
NAMES = ("p", "s", "r", "o", "c", "sh")
KW = dict(width=W, height=H, tile_size=TILE, max_splat_steps=8, max_list_entries=64)


def _meta(dt):
    from rlx_jax.ops import gaussian_splat_render_meta

    return np.asarray(gaussian_splat_render_meta([0.3, -0.2, -4], [0, 0, 0], [0, 1, 0], 45.0, 0.1, 100.0,
                                                 [0.1, 0.2, 0.3]), dt)


def _scene(seed, dt):
    r = np.random.RandomState(seed)
    p = r.uniform(-1, 1, (N, 3))
    p[:, 2] *= 0.5
    vals = dict(p=p.reshape(-1), s=np.log(r.uniform(0.25, 0.6, 3 * N)), r=r.randn(4 * N), o=r.randn(N),
                c=r.uniform(0, 1, 3 * N), sh=0.2 * r.randn(N * K * 3))
    return {k: v.astype(dt) for k, v in vals.items()}


def _graph(dt, seed=0):
    """loss = sum(R * img^2) of a splat render (img^2 so that d img / d loss depends on
    the scene: the second order exercises the backward's derivative in dy too)."""
    tn = {np.float32: "f32", np.float64: "f64"}[dt]
    g = Graph("splat2")
    ids = [g.param(n, [len(v)], tn) for n, v in _scene(0, dt).items()] + [g.input("meta", [23], tn)]
    y = g.gaussian_splat_render(*ids, **KW)
    rr = np.random.RandomState(seed + 7).randn(W * H * 4).astype(dt)
    g.set_outputs([g.sum(g.mul(g.mul(y, y), g.constant(rr)), [0])])
    g.verify()
    return g


def _close(got, want, what, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(float(np.max(np.abs(want))) if want.size else 1.0, 1e-3)
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= rtol * scale, f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


def _customs(g):
    return [n for n in g.nodes if type(n.op).__name__ == "Custom"]


@pytest.mark.parametrize("dt,rtol", [(np.float64, 1e-9),
                                     pytest.param(np.float32, 2e-3, marks=pytest.mark.slow)])
def test_grad_with_loss_twice_equals_jax_grad_of_grad(dt, rtol, x64):
    g = _graph(dt)
    params, meta = _scene(1, dt), _meta(dt)
    gg = rlx_jax.grad_with_loss(g, ["p", "o", "c"])
    h = gg.copy()
    h.name = "splat2_gsq"
    # a scalar function of the gradients: sum(dp^2) + sum(do * c_grad[:N])
    dp, do, dc = h.outputs[1:4]
    first = h.sum(h.mul(dp, dp), [0])
    second = h.sum(h.mul(do, h.narrow(dc, 0, 0, N)), [0])
    h.set_outputs([h.add(first, second)])
    hh = rlx_jax.grad_with_loss(h, ["p", "s", "o", "sh"])
    hh.verify()
    names = {n.op.name for n in _customs(hh)}
    assert names == {"rlx_jax.gaussian_splat_render_backward_vjp"}, names
    out = jax.jit(rlx_jax.to_jax(hh))(params, {"meta": meta, "d_output": dt(1), "d_output_1": dt(1)})

    f = rlx_jax.to_jax(g)

    def phi(q):
        d = jax.grad(lambda z: f(z, {"meta": meta})[0])(q)
        return (d["p"] ** 2).sum() + (d["o"] * d["c"][:N]).sum()

    want = jax.grad(phi)(params)
    _close(out[0], phi(params), "phi", rtol)
    for w, got in zip(["p", "s", "o", "sh"], out[1:]):
        _close(got, want[w], f"d phi / d {w}", rtol)
    assert np.any(np.abs(np.asarray(want["p"])) > 1e-6)  # the check is not vacuous

    # the second-order graph round-trips through JSON and still lowers to the same values
    back = Graph.from_json(hh.to_json())
    assert back == hh
    assert [n.op.attrs for n in _customs(back)] == [n.op.attrs for n in _customs(hh)]


@pytest.mark.slow
def test_third_order_differentiates_the_custom_op_again(x64):
    """grad_with_loss of a graph that already holds the Custom VJP op: the op's own
    rule emits a deeper level (wrt chain of length 2), equal to JAX's third order."""
    dt = np.float64
    g = _graph(dt)
    params, meta = _scene(2, dt), _meta(dt)
    gg = rlx_jax.grad_with_loss(g, ["o"])
    h = gg.copy()
    h.set_outputs([h.sum(h.mul(h.outputs[1], h.outputs[1]), [0])])
    hh = rlx_jax.grad_with_loss(h, ["o"])
    k = hh.copy()
    k.set_outputs([k.sum(k.mul(k.outputs[1], k.outputs[1]), [0])])
    kk = rlx_jax.grad_with_loss(k, ["o"])
    kk.verify()
    from rlx_jax.autodiff.jax_custom import decode_attrs

    depth = max(len(decode_attrs(n.op.attrs)[1]) for n in _customs(kk))
    assert depth == 2
    feeds = {"meta": meta, "d_output": dt(1), "d_output_1": dt(1), "d_output_2": dt(1)}
    out = rlx_jax.to_jax(Graph.from_json(kk.to_json()))(params, feeds)  # the loaded graph runs
    f = rlx_jax.to_jax(g)

    def g1(q):
        return jax.grad(lambda z: f(z, {"meta": meta})[0])(q)["o"]

    def g2(q):
        return jax.grad(lambda z: (g1(z) ** 2).sum())(q)["o"]

    want = jax.grad(lambda z: (g2(z) ** 2).sum())(params)["o"]
    _close(out[1], want, "third order d / d o", 1e-8)


@pytest.mark.slow  # 1-2 min of XLA compiles; grad-of-grad above keeps second order in the default run
@pytest.mark.parametrize("dt,rtol", [(np.float64, 1e-9), (np.float32, 2e-3)])
def test_jvp_and_hvp_of_a_splat_graph_equal_jax(dt, rtol, x64):
    g = _graph(dt, seed=3)
    params, meta = _scene(4, dt), _meta(dt)
    r = np.random.RandomState(5)
    tans = {k: r.randn(*v.shape).astype(dt) for k, v in params.items()}
    f = rlx_jax.to_jax(g)

    jg = rlx_jax.jvp(g, ["p", "s", "c"])
    jg.verify()
    assert Graph.from_json(jg.to_json()) == jg
    assert _customs(jg)
    out = rlx_jax.to_jax(jg)(params, {"meta": meta, **{f"tangent_{k}": tans[k] for k in ("p", "s", "c")}})
    zero = {k: np.zeros_like(v) for k, v in params.items()}
    want_y, want_t = jax.jvp(lambda q: f(q, {"meta": meta})[0], (params,),
                             (dict(zero, p=tans["p"], s=tans["s"], c=tans["c"]),))
    _close(out[0], want_y, "primal", rtol)
    _close(out[1], want_t, "tangent", rtol)

    hg = rlx_jax.hvp(g, ["p", "o"])
    hg.verify()
    assert Graph.from_json(hg.to_json()) == hg
    out = rlx_jax.to_jax(hg)(params, {"meta": meta, "tangent_p": tans["p"], "tangent_o": tans["o"]})
    loss = lambda q: f(q, {"meta": meta})[0]  # noqa: E731
    _, hv = jax.jvp(jax.grad(loss), (params,), (dict(zero, p=tans["p"], o=tans["o"]),))
    gr = jax.grad(loss)(params)
    _close(out[0], loss(params), "loss", rtol)
    _close(out[1], gr["p"], "grad p", rtol)
    _close(out[2], gr["o"], "grad o", rtol)
    _close(out[3], hv["p"], "(Hv)_p", rtol)
    _close(out[4], hv["o"], "(Hv)_o", rtol)


def test_backward_node_with_training_options_differentiates(x64):
    """A GaussianSplatRenderBackward built with RLX's training options (loss_grad_clip,
    sh_band, max_anisotropy): its graph VJP honours them, = jax.vjp of the lowered node."""
    dt = np.float64
    params, meta = _scene(6, dt), _meta(dt)
    g = Graph("bwd")
    ids = [g.param(n, [len(v)], "f64") for n, v in params.items()] + [g.input("meta", [23], "f64")]
    dy = g.param("dy", [W * H * 4], "f64")
    b = g.gaussian_splat_render_backward(ids, dy, W, H, TILE, 3.0, 1 / 255, 8, 1e-4, 64, 0.5, 0, 1.5)
    rr = np.random.RandomState(8).randn(14 * N + N * K * 3)
    g.set_outputs([g.sum(g.mul(b, g.constant(rr)), [0])])
    g.verify()
    params["dy"] = np.random.RandomState(9).randn(W * H * 4)  # some |dy| > clip
    gg = rlx_jax.grad_with_loss(g, ["s", "sh", "dy"])
    gg.verify()
    out = rlx_jax.to_jax(gg)(params, {"meta": meta, "d_output": dt(1)})
    f = rlx_jax.to_jax(g)
    want = jax.grad(lambda q: f(q, {"meta": meta})[0])(params)
    for w, got in zip(["s", "sh", "dy"], out[1:]):
        _close(got, want[w], f"d / d {w}", 1e-9)
    # sh_band 0 keeps only the first SH coefficient's gradient, whose d / d sh is zero
    # here (the render is linear in sh); the clipped dy entries get no gradient
    assert np.all(np.asarray(out[3])[np.abs(params["dy"]) > 0.5] == 0)
    assert np.any(np.asarray(out[3]) != 0)


def test_custom_op_attrs_and_shape_checks(x64):
    from rlx_jax.autodiff.jax_custom import SPLAT_BACKWARD, decode_attrs, encode_attrs
    from rlx_jax.ir import get_custom_op

    assert get_custom_op(SPLAT_BACKWARD + "_vjp") is not None
    g = _graph(np.float64)
    h = rlx_jax.grad_with_loss(g, ["p"])
    node = next(n for n in h.nodes if type(n.op).__name__ == "GaussianSplatRenderBackward")
    ins = list(node.inputs)
    a = encode_attrs({"width": W}, [[1, 2]])
    assert decode_attrs(a) == ({"width": W}, [[1, 2]])
    with pytest.raises(ValueError, match="attrs"):
        decode_attrs(b"not json")
    # meta (input 6) is not differentiable, and wrt must name an input
    with pytest.raises(GraphError, match="not differentiable"):
        h.custom(SPLAT_BACKWARD + "_vjp", ins + [ins[6]], encode_attrs({}, [[0, 6]]))
    with pytest.raises(GraphError, match="wrt"):
        h.custom(SPLAT_BACKWARD + "_vjp", ins + [ins[0]], encode_attrs({}, [[9]]))
    with pytest.raises(GraphError, match="wrt"):
        h.custom(SPLAT_BACKWARD + "_vjp", ins, encode_attrs({}, []))
    with pytest.raises(GraphError, match="empty"):
        h.custom(SPLAT_BACKWARD + "_vjp", ins + [ins[0]], encode_attrs({}, [[]]))


def test_second_order_graph_prints(x64):
    g = _graph(np.float64)
    gg = rlx_jax.grad_with_loss(g, ["o"])
    h = gg.copy()
    h.set_outputs([h.sum(h.mul(h.outputs[1], h.outputs[1]), [0])])
    text = str(rlx_jax.grad_with_loss(h, ["o"]))
    assert "rlx_jax.gaussian_splat_render_backward_vjp" in text
