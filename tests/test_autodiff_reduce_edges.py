"""Graph autodiff of reductions at their edges: a product over a slice holding zeros (its
derivative is the product of the other elements, never y / x), and a mean over a
zero-sized axis (an empty gradient, not a division by the zero count). Reverse mode,
forward mode and the Hessian-vector product, each against ``jax`` on the lowered
forward graph in float64."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import rlx_jax
from rlx_jax.ir import Graph

from graph_fd import graph_grad, jax_grad


def _prod_graph(shape, axes):
    g = Graph("prod")
    x = g.param("x", list(shape), "f64")
    w = g.constant(np.linspace(0.5, 1.5, int(np.prod([d for i, d in enumerate(shape) if i not in axes])))
                   .reshape([d for i, d in enumerate(shape) if i not in axes]))
    g.set_outputs([g.sum(g.mul(g.prod(x, list(axes)), w), list(range(len(shape) - len(axes))))])
    return g


# rows with no zero, one zero and two zeros, reduced over either axis
PROD_X = np.array([[2.0, 0.0, 3.0, -1.5],
                   [1.5, -2.0, 0.5, 4.0],
                   [0.0, 1.0, 0.0, 2.0]])


@pytest.mark.parametrize("axes", [(1,), (0,), (0, 1)], ids=["rows", "cols", "all"])
def test_prod_gradient_at_zeros(x64, axes):
    g = _prod_graph(PROD_X.shape, axes)
    params = {"x": PROD_X}
    got = graph_grad(g, params, ["x"])["x"]
    want = jax_grad(g, params, ["x"])["x"]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # the lone zero of row 0 gets the product of the rest of its row
    if axes == (1,):
        assert got[0, 1] == pytest.approx(0.5 * (2.0 * 3.0 * -1.5))   # 0.5: row 0's weight
        assert np.all(got[2] == 0.0)            # two zeros: every derivative is zero


@pytest.mark.parametrize("axes", [(1,), (0,), (0, 1)], ids=["rows", "cols", "all"])
@pytest.mark.parametrize("zeros", ["as PROD_X", "one a slice", "three in a row"])
def test_prod_jvp_and_hvp_at_zeros(x64, axes, zeros):
    """Forward mode and the Hessian-vector product at zeros: PROD_X's row 2 holds two (the
    second derivative between them is the product of the rest of the row), all of it
    three; then at most one zero a slice; then three zeros in one row (second derivatives
    between them 0, as the product of the rest still holds a zero)."""
    xs = PROD_X.copy()
    if zeros == "one a slice":
        xs[2, 2] = 0.75
        if axes == (0, 1):
            xs[2, 0] = -0.5
    elif zeros == "three in a row":
        xs[2, 3] = 0.0
    g = _prod_graph(xs.shape, axes)
    f = rlx_jax.to_jax(g)

    def loss(a):
        return f({"x": a}, {})[0]
    t = np.random.RandomState(0).randn(*xs.shape)
    jv = rlx_jax.to_jax(rlx_jax.jvp(g, ["x"]))({"x": xs}, {"tangent_x": t})[1]
    np.testing.assert_allclose(jv, jax.jvp(loss, (xs,), (t,))[1], rtol=1e-12)
    hv = rlx_jax.to_jax(rlx_jax.hvp(g, ["x"]))({"x": xs}, {"tangent_x": t})[-1]
    want = jax.jvp(jax.grad(loss), (xs,), (t,))[1]
    assert np.all(np.isfinite(hv))
    np.testing.assert_allclose(hv, want, rtol=1e-12, atol=1e-12)


def test_mean_over_a_zero_sized_axis(x64):
    g = Graph("empty_mean")
    x = g.param("x", [2, 0], "f64")
    y = g.param("y", [2], "f64")
    g.set_outputs([g.sum(g.add(g.mean(x, [1]), g.mul(y, y)), [0])])
    params = {"x": np.zeros((2, 0)), "y": np.array([0.5, -1.0])}
    got = graph_grad(g, params, ["x", "y"])
    assert got["x"].shape == (2, 0)
    np.testing.assert_allclose(got["y"], 2 * params["y"])
    jg = rlx_jax.jvp(g, ["x", "y"])
    outs = rlx_jax.to_jax(jg)(params, {"tangent_x": np.zeros((2, 0)), "tangent_y": np.ones(2)})
    np.testing.assert_allclose(outs[1], np.sum(2 * params["y"]))
