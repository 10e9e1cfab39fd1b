"""Graph autodiff follows RLX's semantics where RLX and JAX differ: FFT adjoints, ties of
binary Max / Min, straight-through Quantize -> Dequantize, complex (Wirtinger) gradients,
truncated float indices, While with a multi-element condition, and FusedTransformerLayer's
8-input form with a [B, H, S, S] mask. Checked in float64 against central finite
differences (and ``jax.grad`` of the forward graph where the conventions agree)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax.ir import Graph, GraphError

from graph_fd import assert_grads_close, finite_difference, graph_grad, jax_grad


def _loss(g, y, rng):
    dims = tuple(g.node(y).shape.dims)
    r = g.constant(rng.randn(*dims).astype(g.node(y).shape.dtype.to_numpy()))
    g.set_outputs([g.sum(g.mul(y, r), list(range(len(dims))))])


def _check(g, params, wrt, inputs=None, jax_too=True, rtol=1e-6, h=1e-6):
    got = graph_grad(g, params, wrt, inputs)
    assert_grads_close(got, finite_difference(g, params, wrt, inputs, h=h), rtol=rtol, what=f"{g.name} vs FD")
    if jax_too:
        assert_grads_close(got, jax_grad(g, params, wrt, inputs), rtol=1e-8, what=f"{g.name} vs jax.grad")
    return got


# ---- FFT -------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm", ["backward", pytest.param("forward", marks=pytest.mark.slow),
                                  pytest.param("ortho", marks=pytest.mark.slow)])
def test_rfft_gradient(x64, norm):
    rng = np.random.RandomState(0)
    g = Graph(f"rfft_{norm}")
    x = g.param("x", [2, 8], "f64")
    re, im = g.rfft(x, norm)
    r = g.constant(rng.randn(2, 5))
    y = g.add(g.mul(im, r), g.mul(re, g.mul(re, r)))   # loss = sum(im r + re^2 r)
    g.set_outputs([g.sum(y, [0, 1])])
    _check(g, {"x": rng.randn(2, 8)}, ["x"])


@pytest.mark.parametrize("norm,inverse", [
    ("backward", False), ("ortho", True), pytest.param("forward", False, marks=pytest.mark.slow),
    pytest.param("forward", True, marks=pytest.mark.slow), pytest.param("backward", True, marks=pytest.mark.slow),
    pytest.param("ortho", False, marks=pytest.mark.slow)])
def test_real_block_fft_gradient(x64, norm, inverse):
    rng = np.random.RandomState(1)
    g = Graph("fft_block")
    x = g.param("x", [3, 6], "f64")   # [re | im] of 3 signals of length 3 (not a power of two)
    _loss(g, g.fft_norm(x, inverse, norm), rng)
    _check(g, {"x": rng.randn(3, 6)}, ["x"])


def test_psd_real_gradient(x64):
    rng = np.random.RandomState(2)
    g = Graph("psd_real")
    x = g.param("x", [2, 6], "f64")   # zero-padded to 8 inside
    _loss(g, g.psd_real(x), rng)
    _check(g, {"x": rng.randn(2, 6)}, ["x"])


@pytest.mark.parametrize("inverse", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_complex_fft_gradient_is_wirtinger(x64, inverse):
    rng = np.random.RandomState(3)
    g = Graph("fft_c64")
    z = g.param("z", [2, 4], "c64")
    y = g.complex_norm_sq(g.fft_norm(z, inverse, "ortho"))
    _loss(g, y, rng)
    zv = (rng.randn(2, 4) + 1j * rng.randn(2, 4)).astype(np.complex64)
    got = _check(g, {"z": zv}, ["z"], jax_too=False, rtol=2e-3, h=1e-2)   # c64: single precision
    want = np.conj(jax_grad(g, {"z": zv}, ["z"])["z"]) / 2
    np.testing.assert_allclose(got["z"], want, rtol=1e-5, atol=1e-5)


# ---- ties, straight-through, indices -----------------------------------------------------------

@pytest.mark.parametrize("op", ["max", "min"])
def test_binary_max_min_ties_go_to_a(op):
    g = Graph("tie")
    a, b = g.param("a", [5]), g.param("b", [5])
    y = g.binary(op, a, b)
    g.set_outputs([g.sum(g.mul(y, g.constant(np.arange(1.0, 6.0, dtype=np.float32))), [0])])
    av = np.array([1.0, 2.0, 3.0, 4.0, -1.0], np.float32)
    bv = np.array([1.0, 3.0, 3.0, 0.0, -1.0], np.float32)
    got = graph_grad(g, {"a": av, "b": bv}, ["a", "b"])
    a_is_y = av == (np.maximum(av, bv) if op == "max" else np.minimum(av, bv))
    w = np.arange(1.0, 6.0)
    np.testing.assert_array_equal(got["a"], np.where(a_is_y, w, 0.0))
    np.testing.assert_array_equal(got["b"], np.where(a_is_y, 0.0, w))


def test_binary_max_broadcast_tie(x64):
    """b broadcast over rows: its gradient sums the rows where b strictly wins."""
    g = Graph("tie_bcast")
    a, b = g.param("a", [2, 3], "f64"), g.param("b", [3], "f64")
    g.set_outputs([g.sum(g.binary("max", a, b), [0, 1])])
    av = np.array([[1.0, 5.0, 2.0], [0.0, 2.0, 7.0]])
    bv = np.array([1.0, 2.0, 3.0])
    got = graph_grad(g, {"a": av, "b": bv}, ["a", "b"])
    np.testing.assert_array_equal(got["a"], (av >= bv).astype(float))
    np.testing.assert_array_equal(got["b"], (av < bv).sum(0).astype(float))


@pytest.mark.parametrize("axis", [None, 1])
def test_quantize_dequantize_straight_through(axis):
    g = Graph("qdq")
    x = g.param("x", [2, 3])
    scales, zps = ([0.1], [0]) if axis is None else ([0.1, 0.2, 0.05], [0, 3, -2])
    d = g.dequantize(g.quantize(x, scales, zps, axis=axis), scales, zps, axis=axis)
    w = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    g.set_outputs([g.sum(g.mul(g.mul(d, d), g.constant(w)), [0, 1])])
    xv = np.random.RandomState(4).randn(2, 3).astype(np.float32)
    dv = np.asarray(rlx_jax.to_jax(g)({"x": xv}, {})[0])
    assert dv.shape == ()
    got = graph_grad(g, {"x": xv}, ["x"])
    deq = np.asarray(rlx_jax.to_jax(_dequantized(xv, scales, zps, axis))({"x": xv}, {})[0])
    np.testing.assert_allclose(got["x"], 2 * deq * w, rtol=1e-6)   # d/dx = d/d(dequant): identity


def _dequantized(xv, scales, zps, axis):
    g = Graph("qdq_value")
    x = g.param("x", list(xv.shape))
    g.set_outputs([g.dequantize(g.quantize(x, scales, zps, axis=axis), scales, zps, axis=axis)])
    return g


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_float_indices_truncate(x64, axis):
    rng = np.random.RandomState(5)
    g = Graph("gather_trunc")
    t = g.param("t", [4, 3], "f64")
    i = g.input("i", [4], "f64")
    y = g.gather(t, i, axis)
    idx = np.array([2.7, 0.2, 2.1, 1.999]) if axis == 0 else np.array([2.7, 0.9, 2.0, 1.5])
    dims = tuple(g.node(y).shape.dims)
    r = rng.randn(*dims)
    g.set_outputs([g.sum(g.mul(y, g.constant(r)), list(range(len(dims))))])
    tv = rng.randn(4, 3)
    rows = np.trunc(idx).astype(int)
    out = np.asarray(rlx_jax.to_jax(Graph.from_json(_value_graph(g, y).to_json()))({"t": tv}, {"i": idx})[0])
    # RLX's Gather: out = indices.shape + table.shape[axis + 1:], read from the first slice
    # along the dims before axis (axis 1 of [4, 3] reads row 0)
    lead = (0,) * axis
    np.testing.assert_array_equal(out, tv[lead][rows])
    got = _check(g, {"t": tv}, ["t"], {"i": idx})
    want = np.zeros_like(tv)
    np.add.at(want[lead], rows, r)
    np.testing.assert_allclose(got["t"], want, rtol=1e-12)


def _value_graph(g, node):
    h = g.copy()
    h.set_outputs([node])
    return h


def test_complex_norm_sq_and_mul_follow_rlx():
    g = Graph("cns")
    z = g.param("z", [2], "c64")
    g.set_outputs([g.sum(g.complex_norm_sq(z), [0])])
    zv = np.array([1 + 2j, 3 - 1j], np.complex64)
    np.testing.assert_allclose(graph_grad(g, {"z": zv}, ["z"])["z"], zv)   # dz = g * z
    # jax.grad of the same lowered graph keeps JAX's 2 g conj(z)
    np.testing.assert_allclose(jax_grad(g, {"z": zv}, ["z"])["z"], 2 * np.conj(zv))

    h = Graph("cmul")
    a, b = h.param("a", [3], "c64"), h.param("b", [3], "c64")
    h.set_outputs([h.sum(h.complex_norm_sq(h.mul(a, b)), [0])])
    rng = np.random.RandomState(6)
    av, bv = [(rng.randn(3) + 1j * rng.randn(3)).astype(np.complex64) for _ in range(2)]
    got = graph_grad(h, {"a": av, "b": bv}, ["a", "b"])
    y = av * bv
    np.testing.assert_allclose(got["a"], y * np.conj(bv), rtol=1e-5)   # g_y * conj(b), g_y = y
    np.testing.assert_allclose(got["b"], y * np.conj(av), rtol=1e-5)


def test_complex_gradient_vs_finite_differences(x64):
    rng = np.random.RandomState(7)
    g = Graph("c_chain")
    a, b = g.param("a", [3], "c64"), g.param("b", [3], "c64")
    y = g.complex_norm_sq(g.add(g.mul(a, g.conjugate(b)), g.mul(a, a)))
    _loss(g, y, rng)
    p = {k: (rng.randn(3) + 1j * rng.randn(3)).astype(np.complex64) for k in ("a", "b")}
    _check(g, p, ["a", "b"], jax_too=False, rtol=2e-3, h=1e-2)   # c64: single precision


def test_complex_to_real_boundary_gives_the_real_derivative(x64):
    """A real leaf reached through complex values gets the plain derivative dL/dx."""
    rng = np.random.RandomState(8)
    g = Graph("c_real")
    x = g.param("x", [4], "f64")
    z = g.mul(g.cast(x, "c64"), g.constant(np.array([1 + 1j, 2 - 1j, 0.5j, 3], np.complex64)))
    _loss(g, g.cast(g.complex_norm_sq(z), "f64"), rng)
    _check(g, {"x": rng.randn(4)}, ["x"], rtol=2e-3, h=1e-2)   # c64 intermediates


# ---- While with a multi-element condition -------------------------------------------------------

def _while_graph(max_iterations, cond_kind):
    s = [4]
    cond = Graph("cond")
    c = cond.input("c", s, "f64")
    if cond_kind == "value":          # the seed's form: cond returns the carry itself
        cond.set_outputs([c])
    else:                             # a [4] bool: every element below 2
        cond.set_outputs([cond.lt_(c, cond.constant(np.full(4, 2.0)))])
    body = Graph("body")
    bi = body.input("c", s, "f64")
    body.set_outputs([body.mul(bi, bi)])
    g = Graph("while_vec")
    x = g.param("x", s, "f64")
    w = g.while_([x], cond, body, max_iterations=max_iterations)
    g.set_outputs([g.sum(g.mul(w, g.constant(np.arange(1.0, 5.0))), [0])])
    return g


def _while_numpy(x, max_iterations, cond_kind):
    for _ in range(max_iterations):
        go = np.all(x != 0) if cond_kind == "value" else np.all(x < 2.0)
        if not go:
            break
        x = x * x
    return x


@pytest.mark.parametrize("cond_kind,xv", [
    ("value", [1.1, 0.9, -1.2, 0.5]),       # never zero: both iterations run
    ("value", [1.1, 0.0, -1.2, 0.5]),       # one zero element stops the loop at once
    ("bool", [1.1, 0.9, -1.2, 0.5]),        # 1.2^2 = 1.44 < 2, then 1.44^2 > 2: stops after 2
    ("bool", [1.5, 0.9, 0.3, 0.5]),         # 2.25 after one step: the second does not run
])
def test_while_multi_element_condition(x64, cond_kind, xv):
    g = _while_graph(3, cond_kind)
    xv = np.array(xv)
    want = _while_numpy(xv, 3, cond_kind)
    loss = np.asarray(rlx_jax.to_jax(g)({"x": xv}, {})[0])
    np.testing.assert_allclose(loss, (want * np.arange(1.0, 5.0)).sum(), rtol=1e-12)
    gg = rlx_jax.grad_with_loss(g, ["x"])
    assert len(gg.outputs) == 2
    got = graph_grad(g, {"x": xv}, ["x"])
    if np.any(xv == 0):
        # the loop stops at once, and any perturbation of the zero restarts it (no finite
        # difference there): the gradient of the untouched carry is the loss weights
        np.testing.assert_array_equal(got["x"], np.arange(1.0, 5.0))
    else:
        assert_grads_close(got, finite_difference(g, {"x": xv}, ["x"]), rtol=1e-6)


def test_while_cond_must_be_real():
    cond = Graph("cond")
    c = cond.input("c", [2])
    cond.set_outputs([cond.cast(c, "c64")])
    body = Graph("body")
    body.set_outputs([body.input("c", [2])])
    g = Graph("bad")
    x = g.input("x", [2])
    with pytest.raises(GraphError, match="while cond output must be bool or real"):
        g.while_([x], cond, body, max_iterations=2)


# ---- FusedTransformerLayer as RLX's tests build it ----------------------------------------------

def _ftl_graph(has_bias, mask_shape):
    g = Graph("ftl")
    h = g.input("h", [1, 2, 4], "f64")

    def p(name, shape):
        return g.param(name, shape, "f64")

    qkv_w, out_w, ln1_g = p("qkv_w", [4, 12]), p("out_w", [4, 4]), p("ln1_g", [4])
    fc1_w, fc2_w, ln2_g = p("fc1_w", [4, 8]), p("fc2_w", [8, 4]), p("ln2_g", [4])
    mask = g.input("mask", list(mask_shape), "f64")
    if has_bias:
        qkv_b, out_b, ln1_b = p("qkv_b", [12]), p("out_b", [4]), p("ln1_b", [4])
        fc1_b, fc2_b, ln2_b = p("fc1_b", [8]), p("fc2_b", [4]), p("ln2_b", [4])
        ins = [h, qkv_w, qkv_b, out_w, out_b, ln1_g, ln1_b, fc1_w, fc1_b, fc2_w, fc2_b, ln2_g, ln2_b, mask]
    else:
        ins = [h, qkv_w, out_w, ln1_g, fc1_w, fc2_w, ln2_g, mask]
    y = g.fused_transformer_layer(ins, num_heads=2, head_dim=2, intermediate_size=8, activation="gelu",
                                  has_bias=has_bias)
    _loss(g, y, np.random.RandomState(9))
    return g, y


def _ftl_params(g, rng):
    return {n.op.name: 0.5 * rng.randn(*n.shape.dims) for n in g.nodes if type(n.op).__name__ == "Param"}


@pytest.mark.parametrize("has_bias", [False, True])
def test_fused_transformer_layer_rlx_forms(x64, has_bias):
    rng = np.random.RandomState(10)
    g, y = _ftl_graph(has_bias, (1, 2, 2, 2))
    params = _ftl_params(g, rng)
    mask4 = np.array([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]).reshape(1, 2, 2, 2)
    inputs = {"h": rng.randn(1, 2, 4), "mask": mask4}
    wrt = sorted(params)
    gg = rlx_jax.grad_with_loss(g, wrt)
    assert len(gg.outputs) == 1 + len(wrt)
    got = graph_grad(g, params, wrt, inputs)
    assert_grads_close(got, jax_grad(g, params, wrt, inputs), rtol=1e-8, what="ftl vs jax.grad")
    few = ["ln1_g", "out_w"]   # finite differences on two of the weights keep the test short
    assert_grads_close({k: got[k] for k in few}, finite_difference(g, params, few, inputs), rtol=1e-6,
                       what="ftl vs FD")
    # the [1, 2, 2, 2] mask means what RLX's kernels read: its first B * S = 2 elements
    g2, y2 = _ftl_graph(has_bias, (1, 2))
    f4 = rlx_jax.to_jax(_value_graph(g, y))(params, inputs)[0]
    f2 = rlx_jax.to_jax(_value_graph(g2, y2))(params, {"h": inputs["h"], "mask": mask4.reshape(-1)[:2].reshape(1, 2)})[0]
    np.testing.assert_allclose(np.asarray(f4), np.asarray(f2), rtol=1e-12)


def test_fused_transformer_layer_input_count_and_mask_size_errors():
    g = Graph("ftl_bad")
    h = g.input("h", [1, 2, 4])
    ws = [g.param(f"w{i}", s) for i, s in enumerate([[4, 12], [4, 4], [4], [4, 8], [8, 4], [4]])]
    small = g.input("mask", [1])
    with pytest.raises(GraphError, match="keep-mask needs 2"):
        g.fused_transformer_layer([h, *ws, small], 2, 2, 8, has_bias=False)
    with pytest.raises(GraphError, match="got 7"):
        g.fused_transformer_layer([h, *ws], 2, 2, 8, has_bias=False)


def test_complex_loss_seed_in_rlx_convention():
    """A holomorphic c64 loss L(z) = sum(z^2) with d_output = d: RLX's rule chain gives
    d * conj(dL/dz) = 2 d conj(z)."""
    g = Graph("c_loss")
    z = g.param("z", [2], "c64")
    g.set_outputs([g.sum(g.mul(z, z), [0])])
    gg = rlx_jax.grad_with_loss(g, ["z"])
    zv = np.array([1 + 2j, 0.5 - 1j], np.complex64)
    d = np.complex64(0.5 + 1j)
    got = np.asarray(rlx_jax.to_jax(gg)({"z": zv}, {"d_output": d})[1])
    np.testing.assert_allclose(got, 2 * d * np.conj(zv), rtol=1e-6)
