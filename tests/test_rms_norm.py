"""RMSNorm end to end: kernel vs pure-JAX reference, gradients in every mode, vmap,
errors, determinism. Runs on the default backend (CPU here, GPU on a GPU machine)."""

from __future__ import annotations

import hashlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import rms_norm
from rlx_jax.vjp_rules.rms_norm import reference_rms_norm, reference_rms_norm_bwd, rms_norm_backward

from testutil import assert_close, hlo_text, platform, assert_same_bits_on_one_core_without_avx512

EPS = 1e-6
SHAPES = [(4, 7), (3, 5, 33), (1, 1), (2, 3, 1025), (0, 16), (5, 0, 8)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _inputs(shape, dtype, seed=0):
    kx, kg, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = shape[-1]
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(kg, (h,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(kb, (h,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return x, g, b, dy


def _ref(x, g, b):
    return reference_rms_norm(x, g, b, eps=EPS)[0]


def test_compiled_kernels_are_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_rms_norm_fwd_v1", "rlx_rms_norm_fwd_v2", "rlx_rms_norm_bwd_v1"} <= set(info["targets"])
    x, g, b, _ = _inputs((4, 8), jnp.float32)
    text = hlo_text(jax.grad(lambda x, g, b: jnp.sum(rms_norm(x, g, b) ** 2), (0, 1, 2)), x, g, b)
    assert "rlx_rms_norm_fwd" in text and "rlx_rms_norm_bwd" in text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, dtype):
    x, g, b, _ = _inputs(shape, dtype)
    got = jax.jit(rms_norm)(x, g, b)
    assert got.dtype == dtype and got.shape == shape
    # the reference in f32 on the same (rounded) inputs is the oracle
    want = _ref(x.astype(jnp.float32), g.astype(jnp.float32), b.astype(jnp.float32))
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference(shape, dtype):
    x, g, b, dy = _inputs(shape, dtype, seed=1)
    _, vjp = jax.vjp(rms_norm, x, g, b)
    got = jax.jit(vjp)(dy)
    f32 = [a.astype(jnp.float32) for a in (x, g, b, dy)]
    _, vjp_ref = jax.vjp(_ref, *f32[:3])
    want = vjp_ref(f32[3])
    for gi, wi, primal in zip(got, want, (x, g, b)):
        assert gi.dtype == primal.dtype
        # dgamma/dbeta sum over all rows: scale the tolerance with the row count
        assert_close(gi, wi, dtype)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 33), (2, 3, 1025), (0, 16)])
def test_backward_with_y_matches_reference(shape, dtype, add):
    """rms_norm_bwd_y / add_rms_norm_bwd_y (rms_norm_linear's backward): the norm's
    gradients with rstd recomputed from x, plus the forward's y, against jax.vjp of the f32
    reference (dres added to dx)."""
    from rlx_jax.vjp_rules.rms_norm import add_rms_norm_bwd_y, rms_norm_bwd_y
    x, g, b, dy = _inputs(shape, dtype, seed=2)
    dres = _inputs(shape, dtype, seed=3)[3]
    if add:
        got = jax.jit(lambda *a: add_rms_norm_bwd_y(*a, eps=EPS))(x, g, b, dy, dres)
    else:
        got = jax.jit(lambda *a: rms_norm_bwd_y(*a, eps=EPS))(x, g, b, dy)
    f32 = [a.astype(jnp.float32) for a in (x, g, b, dy, dres)]
    y_ref, vjp_ref = jax.vjp(_ref, *f32[:3])
    dx_ref, dg_ref, db_ref = vjp_ref(f32[3])
    if add:
        dx_ref = dx_ref + f32[4]
    for gi, wi, what in zip(got, (dx_ref, dg_ref, db_ref, y_ref), ("dx", "dgamma", "dbeta", "y")):
        assert gi.dtype == dtype, what
        assert_close(gi, wi, dtype)
    # y is the forward's output
    assert_close(got[3], jax.jit(lambda *a: rms_norm(*a, eps=EPS))(x, g, b).astype(jnp.float32), dtype)


def test_float64_forward_and_backward(x64):
    if platform() != "cpu":
        pytest.skip("f64 kernels are CPU-only; on GPU f64 runs the reference")
    x, g, b, dy = _inputs((6, 5, 17), jnp.float64)
    assert_close(rms_norm(x, g, b), _ref(x, g, b))
    got = jax.vjp(rms_norm, x, g, b)[1](dy)
    want = jax.vjp(_ref, x, g, b)[1](dy)
    for gi, wi in zip(got, want):
        assert_close(gi, wi)


def test_check_grads_all_modes_second_order(x64):
    x, g, b, _ = _inputs((3, 4, 9), jnp.float64, seed=2)
    check_grads(rms_norm, (x, g, b), order=2, modes=("fwd", "rev"))


def test_hessian_matches_reference(x64):
    x, g, b, _ = _inputs((7,), jnp.float64, seed=3)
    f = lambda x: jnp.sum(jnp.sin(rms_norm(x, g, b)))
    fr = lambda x: jnp.sum(jnp.sin(_ref(x, g, b)))
    assert_close(jax.hessian(f)(x), jax.hessian(fr)(x))
    assert_close(jax.jacfwd(jax.grad(f))(x), jax.hessian(fr)(x))


def test_jvp_matches_reference():
    x, g, b, dy = _inputs((5, 12), jnp.float32, seed=4)
    t = (dy, 0.1 * g, 0.2 * b)
    y, ty = jax.jvp(rms_norm, (x, g, b), t)
    yr, tyr = jax.jvp(_ref, (x, g, b), t)
    assert_close(y, yr)
    assert_close(ty, tyr)


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_other_axes(axis):
    x, _, _, dy = _inputs((6, 5, 4), jnp.float32, seed=5)
    h = x.shape[axis]
    g = jnp.linspace(0.5, 1.5, h)
    f = lambda x, g: rms_norm(x, g, axis=axis, eps=EPS)
    fr = lambda x, g: jnp.moveaxis(_ref(jnp.moveaxis(x, axis, -1), g, jnp.zeros_like(g)), -1, axis)
    assert_close(f(x, g), fr(x, g))
    for a, w in zip(jax.vjp(f, x, g)[1](dy), jax.vjp(fr, x, g)[1](dy)):
        assert_close(a, w)


def test_beta_optional_and_mixed_precision_promotes():
    """bf16 x with f32 gamma computes and returns f32 (jnp.result_type, as flax's RMSNorm);
    x's gradient comes back in bf16, gamma's in f32; f32 x with bf16 gamma stays f32."""
    x, g, _, dy = _inputs((3, 8), jnp.bfloat16)
    g32 = g.astype(jnp.float32)
    y = rms_norm(x, g32)
    assert y.dtype == jnp.float32
    assert_close(y, _ref(x.astype(jnp.float32), g32, jnp.zeros(8)), jnp.float32)
    dx, dg = jax.grad(lambda x, g: jnp.sum(rms_norm(x, g) * dy.astype(jnp.float32)), argnums=(0, 1))(x, g32)
    assert dx.dtype == jnp.bfloat16 and dg.dtype == jnp.float32
    assert rms_norm(x.astype(jnp.float32), g).dtype == jnp.float32
    assert rms_norm(x, g).dtype == jnp.bfloat16
    bx, bg, bb = rms_norm_backward(x, g32, None, dy)
    assert bx.dtype == jnp.bfloat16 and bg.dtype == jnp.float32
    _, vjp = jax.vjp(lambda x, g: rms_norm(x, g), x, g32)
    assert_close(bx, vjp(dy.astype(jnp.float32))[0], jnp.bfloat16)


def test_matches_flax_rms_norm_in_mixed_precision():
    nnx = pytest.importorskip("flax.nnx")
    x, g, _, _ = _inputs((4, 16), jnp.bfloat16, seed=3)
    g32 = g.astype(jnp.float32)
    layer = nnx.RMSNorm(16, epsilon=1e-6, rngs=nnx.Rngs(0))
    layer.scale[...] = g32
    want = layer(x)
    got = rms_norm(x, g32, eps=1e-6)
    assert got.dtype == want.dtype == jnp.float32
    assert_close(got, want, jnp.float32)


def test_traced_eps_is_refused_by_name():
    x, g, _, _ = _inputs((3, 8), jnp.float32)
    with pytest.raises(TypeError, match="eps must be a static number"):
        jax.jit(lambda e: rms_norm(x, g, eps=e))(1e-5)
    with pytest.raises(TypeError, match="eps must be a static number"):
        jax.jit(lambda e: rms_norm_backward(x, g, None, x, eps=e))(1e-5)
    assert_close(jax.jit(lambda x: rms_norm(x, g, eps=np.float32(1e-3)))(x), rms_norm(x, g, eps=1e-3))


def test_vmap_forward_grad_and_per_example_gradients():
    x, g, b, _ = _inputs((4, 3, 10), jnp.float32, seed=6)
    assert_close(jax.vmap(rms_norm, in_axes=(1, None, None), out_axes=1)(x, g, b), _ref(x, g, b))
    loss = lambda x, g: jnp.sum(jnp.tanh(rms_norm(x, g, b)))
    loss_ref = lambda x, g: jnp.sum(jnp.tanh(_ref(x, g, b)))
    got = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None))(x, g)
    want = jax.vmap(jax.grad(loss_ref, (0, 1)), in_axes=(0, None))(x, g)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert_close(a, w)
    # batched gamma too (falls back to the reference under vmap)
    gs = jnp.stack([g, 2 * g, 3 * g, g])
    assert_close(jax.vmap(rms_norm, in_axes=(0, 0, None))(x, gs, b), jax.vmap(_ref, in_axes=(0, 0, None))(x, gs, b))


def test_backward_wrapper_matches_vjp():
    x, g, b, dy = _inputs((5, 2, 7), jnp.float32, seed=7)
    got = rms_norm_backward(x, g, b, dy, axis=-1, eps=EPS)
    want = jax.vjp(_ref, x, g, b)[1](dy)
    for a, w in zip(got, want):
        assert_close(a, w)


def test_zero_rows_give_zero_parameter_gradients():
    x, g, b, dy = _inputs((0, 16), jnp.float32)
    dx, dg, db = jax.vjp(rms_norm, x, g, b)[1](dy)
    assert dx.shape == (0, 16)
    np.testing.assert_array_equal(dg, np.zeros(16))
    np.testing.assert_array_equal(db, np.zeros(16))


def test_deterministic_bitwise():
    x, g, b, dy = _inputs((257, 300), jnp.float32, seed=8)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(rms_norm, x, g, b)[1](dy))
    first = [np.asarray(a) for a in f(x, g, b, dy)]
    for _ in range(3):
        for a, b_ in zip(first, f(x, g, b, dy)):
            np.testing.assert_array_equal(a, np.asarray(b_))


def test_all_zero_rows_are_finite():
    x = jnp.zeros((3, 8))
    g = jnp.ones(8)
    y, vjp = jax.vjp(lambda x: rms_norm(x, g, eps=1e-6), x)
    assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(vjp(jnp.ones_like(x))[0])).all()


def test_nan_propagates_like_reference():
    x, g, b, _ = _inputs((2, 8), jnp.float32)
    x = x.at[0, 3].set(jnp.nan)
    got = np.asarray(rms_norm(x, g, b))
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((jnp.ones((3, 4), jnp.int32), jnp.ones(4)), TypeError, "floating"),
        ((jnp.ones((3, 4)), jnp.ones(5)), ValueError, "gamma must have shape"),
        ((jnp.ones((3, 4)), jnp.ones(4), jnp.ones(3)), ValueError, "beta must have shape"),
        ((jnp.ones(()), jnp.ones(1)), ValueError, "at least one axis"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, error, match):
    with pytest.raises(error, match=match):
        rms_norm(*args)


def test_parameter_shape_error_names_the_axis():
    # the message docs/API.md quotes: the last axis as -1 (the default), another by its index
    with pytest.raises(ValueError) as e:
        rms_norm(jnp.ones((4, 512)), jnp.ones(256))
    assert str(e.value) == "rms_norm: gamma must have shape (512,) (x.shape[-1]), got (256,)"
    with pytest.raises(ValueError, match=re.escape("beta must have shape (4,) (x.shape[0]), got (3,)")):
        rms_norm(jnp.ones((4, 512)), jnp.ones(4), jnp.ones(3), axis=0)


def test_bad_axis_and_eps():
    with pytest.raises(ValueError, match="axis"):
        rms_norm(jnp.ones((3, 4)), jnp.ones(4), axis=2)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(jnp.ones((3, 4)), jnp.ones(4), eps=-1.0)


# ---- the CPU row bodies (16-element blocks, AVX-512 / AVX2 / baseline) ----------------
cpu_only = pytest.mark.skipif(platform() != "cpu", reason="the CPU kernels' row bodies")


@cpu_only
@pytest.mark.parametrize("width", [40, 1050])
def test_cpu_bf16_rounds_to_nearest_even(width):
    """y = x * rstd * gamma + beta rounded once to bf16, ties to even, in the 16-element
    blocks and in the row tail: with eps = 0, x = +-2 (rstd = 0.5 exactly) and gamma = 1
    the f32 value x / 2 + beta is exact, so the only rounding is the store."""
    r = np.random.default_rng(3)
    x = np.where(np.arange(width) % 3 == 0, -2.0, 2.0).astype(np.float32)[None].repeat(3, 0)
    # beta: exact ties (1 + 2^-8, 1 + 3 * 2^-8 after adding 1), values just off ties, random
    special = np.array([2.0**-8, 3 * 2.0**-8, 2.0**-8 + 2.0**-15, -(2.0**-9), 5 * 2.0**-9], np.float32)
    beta = r.normal(size=width).astype(np.float32)
    beta[: special.size] = special
    beta[-special.size:] = special
    beta = beta.astype(ml_dtypes.bfloat16).astype(np.float32)  # beta itself is bf16
    want = (x * np.float32(0.5) + beta).astype(ml_dtypes.bfloat16)
    got = jax.jit(lambda x, g, b: rms_norm(x, g, b, eps=0.0))(
        jnp.asarray(x, jnp.bfloat16), jnp.ones(width, jnp.bfloat16), jnp.asarray(beta, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


@cpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_nan_and_inf_rows(dtype):
    """NaN / inf in a row (inside a 16-block and in the tail) give the reference's NaN
    pattern; the other rows stay finite and close."""
    x, g, b, dy = _inputs((5, 45), dtype, seed=4)
    x = x.at[1, 20].set(jnp.nan).at[2, 3].set(jnp.inf).at[3, 44].set(-jnp.inf)
    y, vjp = jax.vjp(lambda x: rms_norm(x, g, b), x)
    dx = vjp(dy)[0]
    f32 = lambda a: a.astype(jnp.float32)
    want_y, rstd = reference_rms_norm(f32(x), f32(g), f32(b), eps=EPS)
    want_dx = reference_rms_norm_bwd(f32(x), f32(g), rstd, f32(dy), eps=EPS)[0]
    for got, want in ((y, want_y), (dx, want_dx)):
        got, want = np.asarray(f32(got)), np.asarray(want)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isfinite(got[[0, 4]]).all()
        assert_close(jnp.asarray(got[[0, 4]]), jnp.asarray(want[[0, 4]]), dtype)


def _rms_digest() -> str:
    """sha256 of the CPU kernels' y, dx, dgamma, dbeta for f32 and bf16 rows of widths
    that use 32-element blocks, a last 16-element block and a tail."""
    h = hashlib.sha256()
    for dtype in (jnp.float32, jnp.bfloat16):
        for shape in ((37, 1000), (9, 1050), (4, 7)):
            x, g, b, dy = _inputs(shape, dtype, seed=shape[1])
            y, vjp = jax.vjp(jax.jit(rms_norm), x, g, b)
            for leaf in (y, *vjp(dy)):
                h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


@cpu_only
def test_cpu_same_bits_with_the_avx2_body_and_one_thread():
    """A fresh process pinned to one core and forced onto the AVX2 / baseline row clones
    (RLX_JAX_CPU_NO_AVX512) gives the same bits as this one (several threads; the
    AVX-512 body where the CPU has it)."""
    assert_same_bits_on_one_core_without_avx512(_rms_digest)
