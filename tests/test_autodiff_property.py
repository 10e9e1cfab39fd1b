"""Property test of graph-level reverse mode on random small graphs with shared
subexpressions: one x [B, S, D] feeds several norm, attention, matmul and elementwise
nodes (and blocks feed each other), so backward nodes share inputs. Two blocks are a
pre-norm decoder's halves, the patterns the lowering fuses (an RmsNorm whose users are
all projections -> ``rms_norm_linear``, with the Rope nodes of q and k -> one packed
product split by ``rope_split``; ``Mul(Silu(gate), up)`` -> ``swiglu`` and its MatMul ->
``swiglu_linear``). For every drawn graph, ``grad_with_loss`` agrees with ``jax.grad`` of
``to_jax(forward)`` and with central finite differences, in float64: the gradient graph
lowers those nodes along other paths (its RmsNorm outputs also feed backward nodes).

The default run draws a few small graphs; the ``slow`` profile draws many more."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx_jax.ir import Graph

from graph_fd import assert_grads_close, finite_difference, graph_grad, jax_grad

B, S, D = 2, 3, 4          # D = num_heads * head_dim = 2 * 2; GroupNorm sees C = S = 3

F = 6                      # the SwiGLU block's hidden width
BLOCKS = ("layer_norm", "layer_norm_axis1", "rms_norm", "group_norm", "batch_norm", "attention", "matmul",
          "tanh", "square", "max", "pre_norm_attention", "pre_norm_swiglu")


def _add_block(g, kind, h, k, params):
    """One block reading ``h`` ([B, S, D]); new Params named ``<kind>_<k>_*``."""
    def p(name, shape, positive=False):
        full = f"{kind}_{k}_{name}"
        params.append((full, tuple(shape), positive))
        return g.param(full, list(shape), "f64")

    if kind == "layer_norm":
        return g.layer_norm(h, p("g", [D]), p("b", [D]))
    if kind == "layer_norm_axis1":
        return g.layer_norm(h, p("g", [S]), p("b", [S]), axis=1, eps=1e-3)
    if kind == "rms_norm":
        return g.rms_norm(h, p("g", [D]), p("b", [D]))
    if kind == "group_norm":           # NCHW view: N = B, C = S, spatial D; 3 groups
        return g.group_norm(h, p("g", [S]), p("b", [S]), 3, eps=1e-3)
    if kind == "batch_norm":
        return g.batch_norm_inference(h, p("g", [S]), p("b", [S]), p("m", [S]), p("v", [S], positive=True))
    if kind == "attention":
        q = g.matmul(h, p("wq", [D, D]))
        return g.attention_kind(q, h, h, 2, 2, "causal")
    if kind == "matmul":
        return g.add(g.matmul(h, p("w", [D, D])), p("b", [D]))
    if kind == "tanh":
        return g.tanh(g.mul(h, p("s", [D])))
    if kind == "square":
        return g.mul(h, h)
    if kind == "pre_norm_attention":   # norm -> q, k, v; RoPE on q and k (shared tables); causal attention; wo
        y = g.rms_norm(h, p("g", [D]), p("b", [D]))
        angles = np.arange(S)[:, None] * np.array([[0.7]])  # [S, head_dim / 2]
        cos, sin = g.constant(np.cos(angles)), g.constant(np.sin(angles))
        q = g.rope(g.matmul(y, p("wq", [D, D])), cos, sin, 2)
        k = g.rope(g.matmul(y, p("wk", [D, D])), cos, sin, 2)
        v = g.matmul(y, p("wv", [D, D]))
        return g.matmul(g.attention_kind(q, k, v, 2, 2, "causal"), p("wo", [D, D]))
    if kind == "pre_norm_swiglu":      # norm -> gate, up; silu(gate) * up; down
        y = g.rms_norm(h, p("g", [D]), p("b", [D]))
        gate, up = g.matmul(y, p("wg", [D, F])), g.matmul(y, p("wu", [D, F]))
        return g.matmul(g.mul(g.silu(gate), up), p("wd", [F, D]))
    return g.binary("max", h, p("c", [S, D]))


@st.composite
def graphs(draw, max_blocks):
    n = draw(st.integers(2, max_blocks))
    kinds = draw(st.lists(st.sampled_from(BLOCKS), min_size=n, max_size=n))
    # each block reads x (shared) or an earlier block's output
    sources = [draw(st.integers(0, k)) for k in range(n)]
    seed = draw(st.integers(0, 2 ** 16))
    return kinds, sources, seed


def _build(kinds, sources, seed):
    rng = np.random.RandomState(seed)
    g = Graph("random")
    x = g.param("x", [B, S, D], "f64")
    params = [("x", (B, S, D), False)]
    values = [x]
    for k, (kind, src) in enumerate(zip(kinds, sources)):
        values.append(_add_block(g, kind, values[src], k, params))
    total = values[1]
    for v in values[2:]:
        total = g.add(total, v)
    g.set_outputs([g.sum(g.mul(total, g.constant(rng.randn(B, S, D))), [0, 1, 2])])
    feeds = {name: (rng.uniform(0.5, 2.0, shape) if positive else rng.randn(*shape))
             for name, shape, positive in params}
    return g, feeds


def _check(case):
    g, params = _build(*case)
    wrt = sorted(params)
    got = graph_grad(g, params, wrt)
    assert_grads_close(got, jax_grad(g, params, wrt), rtol=1e-7, what="vs jax.grad")
    assert_grads_close(got, finite_difference(g, params, wrt), rtol=1e-5, what="vs finite differences")


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(graphs(max_blocks=3))
def test_random_shared_graphs(x64, case):
    _check(case)


@pytest.mark.slow
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(graphs(max_blocks=7))
def test_random_shared_graphs_many(x64, case):
    _check(case)


def test_every_block_kind_once(x64):
    """The norm and attention blocks on one shared x (what the random draws may miss), the norms twice
    (two norms on one x with different gamma share every backward input but gamma)."""
    kinds = ["layer_norm", "group_norm", "batch_norm", "attention", "layer_norm", "group_norm", "batch_norm"]
    _check((kinds, [0] * len(kinds), 7))


def test_pre_norm_blocks_chained_and_shared(x64):
    """The fused-lowering blocks as a decoder layer stacks them (attention, then the MLP
    reading its output, each also reading x) and both twice on one x; the forward lowers
    through the fused ops (else these cases would test the plain lowering twice)."""
    import re

    import jax

    import rlx_jax

    g, params = _build(["pre_norm_attention", "pre_norm_swiglu"], [0, 1], 3)
    jaxpr = str(jax.make_jaxpr(lambda p: rlx_jax.to_jax(g)(p, {}))(params))
    assert {"rlx_rms_norm_linear_fwd", "rlx_rope_split", "rlx_swiglu_linear_fwd"} <= set(re.findall(r"rlx_\w+", jaxpr))
    _check((["pre_norm_attention", "pre_norm_swiglu", "pre_norm_swiglu"], [0, 1, 0], 3))
    _check((["pre_norm_attention", "pre_norm_attention", "pre_norm_swiglu"], [0, 0, 2], 11))
