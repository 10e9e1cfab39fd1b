"""Numerics at the edges, on the fused kernels (CPU): NaN / Inf propagate as in a plain
jnp formula; cross-entropy with logits of magnitude 1e4 (f32 and bf16) stays finite;
fully masked attention rows give zeros in values and gradients; RMSNorm / LayerNorm
of all-zero rows stay finite; eps = 0 behaves as documented in docs/RELIABILITY.md.

Every test asserts that the op really ran its kernel (the target is in the lowered HLO),
so a silent fallback to the pure-JAX reference cannot make it pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax import ops
from rlx_jax._kernels import target as kernel_target
from testutil import hlo_text

F32 = jnp.float32


def _require(target, fn, *args):
    target = kernel_target(target)  # the versioned name ("rlx_rms_norm_fwd" -> "rlx_rms_norm_fwd_v1")
    if target not in rlx_jax.kernel_info()["cpu"]["targets"]:
        pytest.skip(f"{target} not compiled: {rlx_jax.kernel_info()['cpu']['error']}")
    assert target in hlo_text(fn, *args), f"{target} not in the lowered HLO (silent fallback)"


def _grad(fn, argnums=0):
    """Gradient of sum(fn * fixed weights): a cotangent that is not all ones."""
    def loss(*a):
        y = fn(*a).astype(F32)
        w = jnp.cos(jnp.arange(y.size, dtype=F32)).reshape(y.shape)
        return jnp.sum(y * w)
    return jax.jit(jax.grad(loss, argnums=argnums))


def assert_same_nonfinite(got, want, rtol=1e-4, atol=1e-5):
    """Same NaN positions, same +-Inf positions, finite values close."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg="+Inf positions differ")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg="-Inf positions differ")
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=atol)


# ---- plain jnp formulas (the "reference" of the NaN/Inf contract) ----------------------

def jnp_rms(x, g, b, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g + b


def jnp_ln(x, g, b, eps):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * g + b


def jnp_ce(logits, labels):
    lf = logits.astype(F32)
    return (jax.nn.logsumexp(lf, -1) - jnp.take_along_axis(lf, labels[:, None], -1)[:, 0])


def pkg_ce(logits, labels):
    """The package's pure-JAX reference (max-shifted logsumexp): a +Inf logit gives a NaN
    loss (Inf - Inf), where jax.nn.logsumexp special-cases it to +Inf."""
    from rlx_jax.vjp_rules.cross_entropy import reference_softmax_cross_entropy

    return reference_softmax_cross_entropy(logits, labels)[0]


def _poisoned(shape, seed=0):
    """Random rows with a NaN in row 1, +Inf in row 2 and -Inf in row 3 (others clean)."""
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    x[3, -1] = -np.inf
    return jnp.asarray(x)


# ---------------------------------------------------------------------------
# NaN / Inf propagation
# ---------------------------------------------------------------------------

NORMS = {
    "rms_norm": ("rlx_rms_norm", lambda x, g, b: ops.rms_norm(x, g, b, eps=1e-6), lambda x, g, b: jnp_rms(x, g, b, 1e-6)),
    "layer_norm": ("rlx_layer_norm", lambda x, g, b: ops.layer_norm(x, g, b, eps=1e-5),
                   lambda x, g, b: jnp_ln(x, g, b, 1e-5)),
}


@pytest.mark.parametrize("name", sorted(NORMS))
def test_norms_propagate_nan_and_inf(name):
    prefix, op, ref = NORMS[name]
    x = _poisoned((6, 16))
    g = jnp.linspace(0.5, 1.5, 16, dtype=F32)
    b = jnp.linspace(-0.1, 0.1, 16, dtype=F32)
    _require(prefix + "_fwd", op, x, g, b)
    _require(prefix + "_bwd", _grad(op, (0, 1, 2)), x, g, b)
    assert_same_nonfinite(jax.jit(op)(x, g, b), ref(x, g, b))
    got, want = _grad(op, (0, 1, 2))(x, g, b), _grad(ref, (0, 1, 2))(x, g, b)
    for a, w in zip(got, want):
        assert_same_nonfinite(a, w, rtol=1e-3, atol=1e-4)
    # the poisoned rows stay in their rows: clean rows are finite
    y = np.asarray(jax.jit(op)(x, g, b))
    assert np.isfinite(y[[0, 4, 5]]).all()


def test_softmax_propagates_nan_and_inf():
    x = _poisoned((6, 9))
    _require("rlx_softmax_fwd_v1", ops.softmax, x)
    _require("rlx_softmax_bwd_x_v1", _grad(ops.softmax), x)
    assert_same_nonfinite(jax.jit(ops.softmax)(x), jax.nn.softmax(x, -1))
    assert_same_nonfinite(_grad(ops.softmax)(x), _grad(lambda x: jax.nn.softmax(x, -1))(x))


def test_cross_entropy_propagates_nan_and_inf():
    x = _poisoned((6, 9))
    labels = jnp.asarray([0, 1, 2, 3, 4, 8], jnp.int32)
    _require("rlx_softmax_ce_fwd_v1", ops.softmax_cross_entropy, x, labels)
    assert_same_nonfinite(jax.jit(ops.softmax_cross_entropy)(x, labels), pkg_ce(x, labels))
    got = np.asarray(_grad(ops.softmax_cross_entropy)(x, labels))
    want = np.asarray(_grad(pkg_ce)(x, labels))
    assert_same_nonfinite(got, want)
    assert np.isfinite(got[[0, 3, 4, 5]]).all()  # clean rows and the -Inf row stay finite
    assert np.isnan(got[[1, 2]]).all()


def test_cumsum_propagates_nan_and_inf():
    x = _poisoned((6, 9))
    f = lambda x: ops.cumsum(x, axis=-1)
    _require("rlx_cumsum_fwd_v1", f, x)
    assert_same_nonfinite(jax.jit(f)(x), jnp.cumsum(x, -1))
    assert_same_nonfinite(_grad(f)(x), _grad(lambda x: jnp.cumsum(x, -1))(x))


def test_attention_propagates_nan_to_its_rows():
    """A NaN in one query row poisons exactly that row's output (and every key's grad,
    as in the jnp formula)."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 2, 8)), F32) for _ in range(3))
    q = q.at[0, 3, 1, 2].set(jnp.nan)
    f = lambda q, k, v: ops.attention(q, k, v)

    def ref(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8.0)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    _require("rlx_attention_fwd_v1", f, q, k, v)
    _require("rlx_attention_bwd_v1", _grad(f, (0, 1, 2)), q, k, v)
    assert_same_nonfinite(jax.jit(f)(q, k, v), ref(q, k, v))
    for a, w in zip(_grad(f, (0, 1, 2))(q, k, v), _grad(ref, (0, 1, 2))(q, k, v)):
        assert_same_nonfinite(a, w, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------
# cross-entropy with huge logits
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("magnitude", [1e4, 3e4])
def test_cross_entropy_huge_logits_stay_finite(dtype, magnitude):
    rng = np.random.default_rng(2)
    logits = rng.choice([-1.0, 1.0], size=(8, 33)) * magnitude * rng.uniform(0.5, 1.0, size=(8, 33))
    logits[0] = magnitude  # a row of equal huge logits
    logits[1] = -magnitude
    logits = jnp.asarray(logits, dtype)
    labels = jnp.asarray(rng.integers(0, 33, size=8), jnp.int32)
    _require("rlx_softmax_ce_fwd_v1", ops.softmax_cross_entropy, logits, labels)
    _require("rlx_softmax_ce_bwd_v1", _grad(ops.softmax_cross_entropy), logits, labels)
    loss = np.asarray(jax.jit(ops.softmax_cross_entropy)(logits, labels), np.float64)
    dlog = np.asarray(_grad(ops.softmax_cross_entropy)(logits, labels), np.float64)
    assert np.isfinite(loss).all() and np.isfinite(dlog).all()
    want = np.asarray(jnp_ce(logits, labels), np.float64)
    np.testing.assert_allclose(loss, want, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-3)
    np.testing.assert_allclose(loss[:2], np.log(33.0), rtol=1e-2)  # equal logits: log(C)
    # each gradient row is softmax - onehot: sums to 0, entries in [-1, 1]
    assert np.all(np.abs(dlog) <= 1.0 + 1e-2)


def test_fused_linear_cross_entropy_huge_logits_stay_finite():
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(6, 16)) * 100, F32)
    w = jnp.asarray(rng.normal(size=(16, 40)) * 100, F32)  # logits ~ 1e4 .. 1e5
    labels = jnp.asarray(rng.integers(0, 40, size=6), jnp.int32)
    f = lambda h, w: ops.fused_linear_cross_entropy(h, w, labels, chunk_size=16)
    loss = jax.jit(f)(h, w)
    dh, dw = _grad(f, (0, 1))(h, w)
    assert np.isfinite(np.asarray(loss)).all()
    assert np.isfinite(np.asarray(dh)).all() and np.isfinite(np.asarray(dw)).all()
    np.testing.assert_allclose(np.asarray(loss), np.asarray(jnp_ce(h @ w, labels)), rtol=1e-4, atol=1e-2)


# ---------------------------------------------------------------------------
# fully masked attention rows
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fully_masked_attention_rows_are_zero_in_values_and_grads(dtype):
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 4, 2, 8)), dtype) for _ in range(3))
    mask = jnp.asarray([[0, 0, 0, 0], [1, 0, 1, 1]], F32)  # batch 0: no key visible
    f = lambda q, k, v: ops.attention(q, k, v, mask=mask)
    _require("rlx_attention_fwd_v1", f, q, k, v)
    _require("rlx_attention_bwd_v1", _grad(f, (0, 1, 2)), q, k, v)
    out = np.asarray(jax.jit(f)(q, k, v), np.float32)
    assert np.isfinite(out).all()
    assert np.all(out[0] == 0)
    assert np.any(out[1] != 0)
    for g in _grad(f, (0, 1, 2))(q, k, v):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all()
        assert np.all(g[0] == 0)
    dk = np.asarray(_grad(f, 1)(q, k, v), np.float32)
    assert np.all(dk[1, 1] == 0)  # the masked key of batch 1 gets no gradient


# ---------------------------------------------------------------------------
# all-zero rows, eps = 0
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norms_of_all_zero_rows_are_finite(name, dtype):
    prefix, op, _ = NORMS[name]
    x = np.random.default_rng(6).normal(size=(4, 16)).astype(np.float32)
    x[0] = 0.0
    x[2] = 3.0  # constant row: variance exactly 0 for layer norm
    x = jnp.asarray(x, dtype)
    g = jnp.linspace(0.5, 1.5, 16, dtype=dtype)
    b = jnp.linspace(-0.1, 0.1, 16, dtype=dtype)
    _require(prefix + "_fwd", op, x, g, b)
    y = np.asarray(jax.jit(op)(x, g, b), np.float32)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0], np.asarray(b, np.float32), atol=1e-6)  # 0 * rstd * g + b
    for d in _grad(op, (0, 1, 2))(x, g, b):
        assert np.isfinite(np.asarray(d, np.float32)).all()


@pytest.mark.parametrize("name", sorted(NORMS))
def test_eps_zero_matches_the_formula(name):
    """eps = 0 is accepted (negative eps is refused): rows with a nonzero mean square
    (variance) are normalised exactly; an all-zero (constant) row divides 0 by 0 and
    gives NaN, exactly as the plain formula does (docs/RELIABILITY.md)."""
    prefix = NORMS[name][0]
    op = {"rms_norm": lambda x, g, b: ops.rms_norm(x, g, b, eps=0.0),
          "layer_norm": lambda x, g, b: ops.layer_norm(x, g, b, eps=0.0)}[name]
    ref = {"rms_norm": lambda x, g, b: jnp_rms(x, g, b, 0.0), "layer_norm": lambda x, g, b: jnp_ln(x, g, b, 0.0)}[name]
    x = np.random.default_rng(7).normal(size=(4, 16)).astype(np.float32)
    x[0] = 0.0
    x = jnp.asarray(x)
    g = jnp.linspace(0.5, 1.5, 16, dtype=F32)
    b = jnp.zeros(16, F32)
    _require(prefix + "_fwd", op, x, g, b)
    y = np.asarray(jax.jit(op)(x, g, b))
    assert_same_nonfinite(y, ref(x, g, b))
    assert np.isfinite(y[1:]).all() and np.isnan(y[0]).all()
    with pytest.raises(ValueError, match="eps"):
        {"rms_norm": ops.rms_norm, "layer_norm": ops.layer_norm}[name](x, g, b, eps=-1e-6)
