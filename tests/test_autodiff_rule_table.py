"""Every graph-level VJP rule (``rlx_jax.autodiff.table.VJP_RULES``) against central finite
differences in float64.

Each rule gets one small case, found automatically: a forward op's rule is checked on the
first graph of ``autodiff_cases.CASES`` that contains the op (built in float64); a backward
op's rule (second order) on the first case whose gradient graph contains it, by
differentiating ``sum(d loss / d w * R)`` again. Rules that cannot be checked this way are
listed in ``NOT_BY_FINITE_DIFFERENCES`` with the reason; a rule with neither a case nor a
reason fails ``test_every_rule_has_a_case``.

The default run checks one representative per rule family; the whole table is marked slow.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import rlx_jax
from rlx_jax.autodiff.table import VJP_RULES, _load
from rlx_jax.ir import Graph

from autodiff_cases import CASES, feeds_for
from graph_fd import assert_grads_close, finite_difference, graph_grad

_load()

NOT_BY_FINITE_DIFFERENCES = {
    "Quantize": "straight-through: the int8 rounding is piecewise constant, so finite differences "
                "see 0 where RLX's rule passes dy (test_autodiff_rlx_semantics checks dx = dy exactly)",
    "Dequantize": "as Quantize (its input is the int8 output of Quantize)",
    "GaussianSplatRenderBackward": "has no VJP (no RLX op for it; test_autodiff_gaps checks the error)",
    "FakeQuantize": "a straight-through estimator: the rounding is piecewise constant, so finite "
                    "differences see 0 or jumps where the rule passes ste'(x) dy (test_quantize checks "
                    "the rule against its closed form)",
    "FakeQuantizeLSQ": "as FakeQuantize: LSQ's scale gradient round(x/s) - x/s is an estimator, not the "
                       "derivative of the rounded forward",
    "Custom": "rlx_jax's registered JAX functions (the splat's second order); "
              "test_autodiff_splat_second_order checks them against jax.grad",
}


class F64Graph(Graph):
    """A Graph whose float32 leaves and constants are created as float64 (so the cases
    of ``autodiff_cases`` build in double precision)."""

    def param(self, name, shape, dtype="f32"):
        return super().param(name, shape, "f64" if str(dtype) in ("f32", "F32") else dtype)

    def input(self, name, shape, dtype="f32"):
        return super().input(name, shape, "f64" if str(dtype) in ("f32", "F32") else dtype)

    def elementwise_region(self, inputs, chain, out_shape, dtype, *args, **kwargs):
        return super().elementwise_region(inputs, chain, out_shape, "f64" if str(dtype) in ("f32", "F32") else dtype,
                                          *args, **kwargs)

    def constant(self, array, dtype=None, name=None):
        arr = np.asarray(array)
        if dtype is None and arr.dtype == np.float32:
            arr = arr.astype(np.float64)
        return super().constant(arr, dtype, name)


def _scan_case(g):
    body = Graph("body")
    c, x = body.input("carry", [3], "f64"), body.input("x_t", [3], "f64")
    body.set_outputs([body.add(body.mul(body.activation("tanh", c), x), x)])
    return g.scan(g.param("init", [3], "f64"), body, 4, xs=[g.param("xs", [4, 3], "f64")])


def _custom_fn_case(g):
    fwd = Graph("cube")
    xb = fwd.input("x", [3], "f64")
    fwd.set_outputs([fwd.mul(fwd.mul(xb, xb), xb)])
    vjp = Graph("cube_vjp")
    xv = vjp.input("x", [3], "f64")
    vjp.input("primal_output", [3], "f64")
    d = vjp.input("d_output", [3], "f64")
    vjp.set_outputs([vjp.mul(vjp.mul(vjp.mul(xv, xv), vjp.constant(np.full(3, 3.0))), d)])
    return g.custom_fn([g.param("x", [3], "f64")], fwd, vjp)


def _if_case(g):
    # the taken branch reads a Param of the outer graph; the untaken one is singular at the
    # captures (sqrt at a negative value), which must not reach the gradient
    x, y = g.param("x", [3], "f64"), g.param("y", [3], "f64")
    then = Graph("then")
    a, c = then.input("a", [3], "f64"), then.input("c", [3], "f64")
    then.set_outputs([then.mul(then.mul(a, c), then.param("w", [3], "f64"))])
    other = Graph("else")
    a2, c2 = other.input("a", [3], "f64"), other.input("c", [3], "f64")
    other.set_outputs([other.sqrt(other.sub(a2, c2))])
    g.param("w", [3], "f64")
    return g.if_(g.gt_(g.sum(g.mul(x, x), [0]), g.scalar(0.0, "f64")), then, other, [x, g.add(x, g.abs(y))])


def _complex_chain_case(g):
    z = g.param("z", [2, 3], "c64")
    return g.mul(g.conjugate(z), g.mul(z, z))


#: float64 cases for ops whose ``autodiff_cases`` graphs do not build in float64
#: (sub-graph bodies) or whose second order needs a complex gradient
LOCAL_CASES = {"f64_scan": (_scan_case, {}), "f64_custom_fn_vjp": (_custom_fn_case, {}),
               "f64_if": (_if_case, {}), "c64_chain": (_complex_chain_case, {})}
ALL_CASES = {**CASES, **LOCAL_CASES}


UPSTREAM = "upstream_weights"


def _loss_graph(name, graph_cls, upstream_param=False):
    """loss = sum(y * R), R a fixed random constant, or a Param named ``UPSTREAM`` (then
    the upstream gradient of y, the dy every backward op of the gradient graph reads,
    depends on a differentiable leaf)."""
    build, explicit = ALL_CASES[name]
    g = graph_cls(name)
    y = build(g)
    s = g.node(y).shape
    yr = y
    if s.dtype.short == "c64":
        yr = g.complex_norm_sq(y)
    if g.node(yr).shape.dtype.short not in ("f64",):
        yr = g.cast(yr, "f64")
    r = g.param(UPSTREAM, list(s.dims), "f64") if upstream_param else g.constant(np.random.RandomState(1).randn(*s.dims))
    prod = g.mul(yr, r)
    g.set_outputs([g.sum(prod, list(range(len(s.dims)))) if s.dims else prod])
    return g, explicit


@functools.lru_cache(maxsize=None)
def _case_graph(name):
    """(graph, explicit feeds) of a case in float64, or None when it cannot be built so."""
    try:
        return _loss_graph(name, F64Graph)
    except Exception:   # a case whose op has no f64 form (e.g. int8 / c64-only operands)
        return None


def _wrt(g):
    return sorted(n.op.name for n in g.nodes if type(n.op).__name__ == "Param"
                  and (n.shape.dtype.is_float or n.shape.dtype.short == "c64"))


def _ops(g):
    return {type(n.op).__name__ for n in g.nodes}


@functools.lru_cache(maxsize=None)
def _first_order_ops(name):
    built = _case_graph(name)
    return frozenset() if built is None else frozenset(_ops(built[0]))


@functools.lru_cache(maxsize=None)
def _second_order_graph(name):
    """sum(d loss / d w0 * R2) as a graph of the params (w0 the first wrt of the case), or
    None; the loss weights are a Param, so every backward op's dy is differentiable."""
    try:
        g, explicit = _loss_graph(name, F64Graph, upstream_param=True)
    except Exception:
        return None
    wrt = [w for w in _wrt(g) if w != UPSTREAM]
    if not wrt:
        return None
    try:
        h = rlx_jax.grad_with_loss(g, wrt, rlx_jax.GradWithLossOptions.TRAINING)
    except Exception:
        return None
    gw = h.outputs[1]
    s = h.node(gw).shape
    if s.dtype.short == "c64":
        gw = h.cast(h.complex_norm_sq(gw), "f64")
    elif s.dtype.short != "f64":
        return None
    prod = h.mul(gw, h.constant(np.random.RandomState(2).randn(*s.dims)))
    h.set_outputs([h.sum(prod, list(range(len(s.dims)))) if s.dims else prod])
    return h, explicit


def _second_order_ops(name):
    built = _second_order_graph(name)
    if built is None:
        return frozenset()
    h = built[0]
    first = _first_order_ops(name)
    return frozenset(_ops(h) - first)


#: cases chosen by hand: the first automatic case puts an input on a kink of the rule
#: (the max-abs element of a per-batch fake-quantised tensor sits exactly at |x| = q s,
#: where the clipped / hard-tanh STE derivative jumps); the identity STE has no kink
CASE_OVERRIDE = {"FakeQuantizeBackward": ("second", "fake_quantize_identity")}


def _case_for(rule):
    """('first' | 'second', case name) checking ``rule``, or None."""
    if rule in CASE_OVERRIDE:
        return CASE_OVERRIDE[rule]
    for name in sorted(ALL_CASES):
        if rule in _first_order_ops(name):
            return "first", name
    for name in sorted(ALL_CASES):
        if rule in _second_order_ops(name):
            return "second", name
    return None


def _feeds(g, explicit, order):
    if order == "second":
        explicit = dict(explicit, d_output=1.0)
    return feeds_for(g, explicit, np.random.RandomState(0))


def _check(order, name):
    if order == "first":
        g, explicit = _case_graph(name)
    else:
        g, explicit = _second_order_graph(name)
    params, inputs = _feeds(g, explicit, order)
    wrt = [w for w in _wrt(g) if w in params]
    got = graph_grad(g, params, wrt, inputs,
                     rlx_jax.GradWithLossOptions.TRAINING if order == "second" else None)
    single = any(n.shape.dtype.short in ("c64", "f32", "f16", "bf16") for n in g.nodes)
    # c64 and ops computing in f32 have no double-precision form: a larger step and
    # tolerance where a single-precision value is on the path
    want = finite_difference(g, params, wrt, inputs, h=1e-2 if single else 1e-5)
    assert_grads_close(got, want, rtol=5e-3 if single else 1e-4, what=f"{order}-order {name}")


ALL_RULES = sorted(c.__name__ for c in VJP_RULES)

# one representative per family in the default run (the rest: -m slow)
DEFAULT = {"Binary", "LayerNorm", "Fft", "Gather", "GroupNormBackwardInput", "BatchNormInferenceBackwardGamma"}


def test_every_rule_has_a_case():
    explained = set(NOT_BY_FINITE_DIFFERENCES)
    assert explained <= set(ALL_RULES), f"reasons for rules that do not exist: {explained - set(ALL_RULES)}"
    missing = [r for r in ALL_RULES if r not in explained and _case_for(r) is None]
    assert not missing, f"VJP rules without a finite-difference case (add one to autodiff_cases): {missing}"


@pytest.mark.parametrize("rule", [pytest.param(r, marks=() if r in DEFAULT else pytest.mark.slow)
                                  for r in ALL_RULES if r not in NOT_BY_FINITE_DIFFERENCES])
def test_rule_matches_finite_differences(x64, rule):
    found = _case_for(rule)
    assert found is not None, f"no case for {rule}"
    _check(*found)
