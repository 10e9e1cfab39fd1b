"""Graph gradients when backward nodes share some inputs and differ in others.

Sibling backward nodes (dx / dgamma / dbeta of one norm) lower to one fused call that is
memoised; the memo must never hand one node the result computed for another node's
operands. These graphs feed one x to two norms with different gamma (so the dx nodes share
x and dy but not gamma) and check ``grad_with_loss`` against central finite differences
and ``jax.grad`` of the forward graph, in float64. Hand-built backward graphs check the
node order (a gamma-free sibling lowered before the dx node) against closed forms.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx_jax
from rlx_jax.ir import Graph

from graph_fd import assert_grads_close, finite_difference, graph_grad, jax_grad


def _params(g, rng):
    out = {}
    for n in g.nodes:
        if type(n.op).__name__ == "Param":
            dims = tuple(n.shape.dims)
            out[n.op.name] = (rng.uniform(0.5, 2.0, dims) if n.op.name.startswith("pos")
                              else rng.randn(*dims))
    return out


def _weighted_sum(g, y, dims, rng):
    r = g.constant(rng.randn(*dims))
    return g.sum(g.mul(y, r), list(range(len(dims))))


def _two_layer_norms(rng):
    g = Graph("two_layer_norms")
    x = g.param("x", [3, 5], "f64")
    ps = [g.param(n, [5], "f64") for n in ("g1", "b1", "g2", "b2")]
    y = g.add(g.layer_norm(x, ps[0], ps[1]), g.layer_norm(x, ps[2], ps[3]))
    g.set_outputs([_weighted_sum(g, y, (3, 5), rng)])
    return g


def _two_layer_norms_other_axis(rng):
    g = Graph("two_layer_norms_axis0")
    x = g.param("x", [4, 3], "f64")
    ps = [g.param(n, [4], "f64") for n in ("g1", "b1", "g2", "b2")]
    y = g.mul(g.layer_norm(x, ps[0], ps[1], axis=0), g.layer_norm(x, ps[2], ps[3], axis=0, eps=1e-2))
    g.set_outputs([_weighted_sum(g, y, (4, 3), rng)])
    return g


def _two_group_norms(rng):
    g = Graph("two_group_norms")
    x = g.param("x", [2, 4, 3, 2], "f64")
    ps = [g.param(n, [4], "f64") for n in ("g1", "b1", "g2", "b2")]
    y = g.add(g.group_norm(x, ps[0], ps[1], 2), g.group_norm(x, ps[2], ps[3], 2))
    g.set_outputs([_weighted_sum(g, y, (2, 4, 3, 2), rng)])
    return g


def _group_norms_other_groups(rng):
    g = Graph("group_norms_groups")
    x = g.param("x", [2, 4, 3], "f64")
    ps = [g.param(n, [4], "f64") for n in ("g1", "b1", "g2", "b2")]
    y = g.add(g.group_norm(x, ps[0], ps[1], 2), g.group_norm(x, ps[2], ps[3], 4))
    g.set_outputs([_weighted_sum(g, y, (2, 4, 3), rng)])
    return g


def _two_batch_norms(rng):
    g = Graph("two_batch_norms")
    x = g.param("x", [2, 3, 2], "f64")
    ps = [g.param(n, [3], "f64") for n in ("g1", "b1", "g2", "b2", "m")]
    v = g.param("pos_v", [3], "f64")
    y = g.add(g.batch_norm_inference(x, ps[0], ps[1], ps[4], v),
              g.batch_norm_inference(x, ps[2], ps[3], ps[4], v))
    g.set_outputs([_weighted_sum(g, y, (2, 3, 2), rng)])
    return g


def _two_rms_norms(rng):
    g = Graph("two_rms_norms")
    x = g.param("x", [3, 4], "f64")
    ps = [g.param(n, [4], "f64") for n in ("g1", "b1", "g2", "b2")]
    y = g.add(g.rms_norm(x, ps[0], ps[1]), g.rms_norm(x, ps[2], ps[3]))
    g.set_outputs([_weighted_sum(g, y, (3, 4), rng)])
    return g


GRAPHS = {f.__name__[1:]: f for f in (_two_layer_norms, _two_layer_norms_other_axis, _two_group_norms,
                                      _group_norms_other_groups, _two_batch_norms, _two_rms_norms)}


DEFAULT = {"two_layer_norms", "two_group_norms", "two_batch_norms"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow)
                                  for n in sorted(GRAPHS)])
def test_shared_x_different_gamma(x64, name):
    rng = np.random.RandomState(0)
    g = GRAPHS[name](rng)
    params = _params(g, rng)
    wrt = sorted(params)
    got = graph_grad(g, params, wrt)
    assert_grads_close(got, finite_difference(g, params, wrt), rtol=1e-6, what=f"{name} vs FD")
    assert_grads_close(got, jax_grad(g, params, wrt), rtol=1e-7, what=f"{name} vs jax.grad")


def _bn_backward_graph(gamma_first: bool):
    """dx and dgamma of BatchNormInference built by hand, the dgamma node either before
    or after the dx node."""
    g = Graph("bn_backward_order")
    x = g.input("x", [2, 3, 4], "f64")
    gamma = g.input("gamma", [3], "f64")
    mean = g.input("mean", [3], "f64")
    var = g.input("var", [3], "f64")
    dy = g.input("dy", [2, 3, 4], "f64")
    if gamma_first:
        dg = g.batch_norm_inference_backward_gamma(x, mean, var, dy, eps=1e-3)
        dx = g.batch_norm_inference_backward_input(x, gamma, mean, var, dy, eps=1e-3)
    else:
        dx = g.batch_norm_inference_backward_input(x, gamma, mean, var, dy, eps=1e-3)
        dg = g.batch_norm_inference_backward_gamma(x, mean, var, dy, eps=1e-3)
    db = g.batch_norm_inference_backward_beta(dy)
    g.set_outputs([dx, dg, db])
    return g


@pytest.mark.parametrize("gamma_first", [True, False])
def test_batch_norm_backward_node_order(x64, gamma_first):
    rng = np.random.RandomState(1)
    f = {"x": rng.randn(2, 3, 4), "gamma": rng.randn(3), "mean": rng.randn(3),
         "var": rng.uniform(0.5, 2.0, 3), "dy": rng.randn(2, 3, 4)}
    dx, dg, db = (np.asarray(v) for v in rlx_jax.to_jax(_bn_backward_graph(gamma_first))({}, f))
    rstd = 1.0 / np.sqrt(f["var"] + 1e-3)[None, :, None]
    np.testing.assert_allclose(dx, f["dy"] * f["gamma"][None, :, None] * rstd, rtol=1e-9)
    xhat = (f["x"] - f["mean"][None, :, None]) * rstd
    np.testing.assert_allclose(dg, (f["dy"] * xhat).sum(axis=(0, 2)), rtol=1e-9)
    np.testing.assert_allclose(db, f["dy"].sum(axis=(0, 2)), rtol=1e-9)


def _ln_numpy(x, gamma, dy, eps):
    mu = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    gdy = gamma * dy
    dx = rstd * (gdy - gdy.mean(-1, keepdims=True) - xhat * (gdy * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0)


@pytest.mark.parametrize("gamma_first", [True, False])
def test_layer_norm_backward_two_gammas_one_gamma_node(x64, gamma_first):
    """Two dx nodes (gamma1, gamma2) and one dgamma node on the same x and dy: each dx
    uses its own gamma whatever the node order."""
    rng = np.random.RandomState(2)
    g = Graph("ln_backward_two_gammas")
    x, g1, g2, dy = (g.input("x", [3, 6], "f64"), g.input("g1", [6], "f64"),
                     g.input("g2", [6], "f64"), g.input("dy", [3, 6], "f64"))
    if gamma_first:
        dg = g.layer_norm_backward_gamma(x, dy, eps=1e-4)
    dx1 = g.layer_norm_backward_input(x, g1, dy, eps=1e-4)
    dx2 = g.layer_norm_backward_input(x, g2, dy, eps=1e-4)
    if not gamma_first:
        dg = g.layer_norm_backward_gamma(x, dy, eps=1e-4)
    g.set_outputs([dx1, dx2, dg])
    f = {"x": rng.randn(3, 6), "g1": rng.randn(6), "g2": rng.randn(6), "dy": rng.randn(3, 6)}
    got = [np.asarray(v) for v in rlx_jax.to_jax(g)({}, f)]
    want1, wg = _ln_numpy(f["x"], f["g1"], f["dy"], 1e-4)
    want2, _ = _ln_numpy(f["x"], f["g2"], f["dy"], 1e-4)
    np.testing.assert_allclose(got[0], want1, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got[1], want2, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got[2], wg, rtol=1e-9, atol=1e-12)


def test_group_norm_backward_nodes_differ_in_eps(x64):
    """Two GroupNorm dgamma nodes on the same x and dy but different eps."""
    rng = np.random.RandomState(3)
    g = Graph("gn_backward_eps")
    x, dy = g.input("x", [2, 4, 3], "f64"), g.input("dy", [2, 4, 3], "f64")
    a = g.group_norm_backward_gamma(x, dy, num_groups=2, eps=1e-5)
    b = g.group_norm_backward_gamma(x, dy, num_groups=2, eps=0.5)
    g.set_outputs([a, b])
    f = {"x": rng.randn(2, 4, 3), "dy": rng.randn(2, 4, 3)}
    got = [np.asarray(v) for v in rlx_jax.to_jax(g)({}, f)]
    for eps, val in zip((1e-5, 0.5), got):
        xg = f["x"].reshape(2, 2, 6)
        xhat = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + eps)).reshape(2, 4, 3)
        np.testing.assert_allclose(val, (f["dy"] * xhat).sum(axis=(0, 2)), rtol=1e-9)
