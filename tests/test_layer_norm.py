"""LayerNorm end to end: kernel vs pure-JAX reference, gradients in every mode, vmap,
the RLX backward wrapper, errors, determinism. Runs on the default backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import layer_norm, layer_norm_backward
from rlx_jax.vjp_rules.layer_norm import reference_layer_norm

from testutil import assert_close, hlo_text, platform, assert_same_bits_on_one_core_without_avx512

EPS = 1e-5
SHAPES = [(4, 7), (3, 5, 33), (1, 1), (2, 1025), (5, 0, 8), (3, 0)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _inputs(shape, dtype, seed=0, offset=1.0):
    kx, kg, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = shape[-1]
    # an offset and a scale: the mean and variance both matter
    x = (offset + 2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(kg, (h,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(kb, (h,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return x, g, b, dy


def _ref(x, g, b):
    return reference_layer_norm(x, g, b, eps=EPS)[0]


def _f32(*arrays):
    return [a.astype(jnp.float32) for a in arrays]


def test_compiled_kernels_are_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_layer_norm_fwd_v1", "rlx_layer_norm_fwd_v2", "rlx_layer_norm_bwd_v1"} <= set(info["targets"])
    x, g, b, _ = _inputs((4, 8), jnp.float32)
    text = hlo_text(jax.grad(lambda x, g, b: jnp.sum(layer_norm(x, g, b) ** 2), (0, 1, 2)), x, g, b)
    assert "rlx_layer_norm_fwd" in text and "rlx_layer_norm_bwd" in text
    text = hlo_text(lambda x, g, b, dy: layer_norm_backward(x, g, b, dy), x, g, b, x)
    assert "rlx_layer_norm_bwd" in text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, dtype):
    x, g, b, _ = _inputs(shape, dtype)
    got = jax.jit(layer_norm)(x, g, b)
    assert got.dtype == dtype and got.shape == shape
    assert_close(got, _ref(*_f32(x, g, b)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference(shape, dtype):
    x, g, b, dy = _inputs(shape, dtype, seed=1)
    _, vjp = jax.vjp(layer_norm, x, g, b)
    got = jax.jit(vjp)(dy)
    xf, gf, bf, dyf = _f32(x, g, b, dy)
    want = jax.vjp(_ref, xf, gf, bf)[1](dyf)
    for gi, wi, primal in zip(got, want, (x, g, b)):
        assert gi.dtype == primal.dtype and gi.shape == primal.shape
        assert_close(gi, wi, dtype)


def test_statistics_saved_by_the_forward_kernel():
    from rlx_jax.vjp_rules.layer_norm import layer_norm_fwd

    x, g, b, _ = _inputs((6, 37), jnp.float32, offset=5.0)
    y, mean, rstd = jax.jit(lambda *a: layer_norm_fwd(*a, eps=EPS))(x, g, b)
    xn = np.asarray(x, np.float64)
    np.testing.assert_allclose(mean, xn.mean(-1), rtol=1e-5)
    np.testing.assert_allclose(rstd, 1.0 / np.sqrt(xn.var(-1) + EPS), rtol=1e-5)


def test_float64_forward_and_backward(x64):
    if platform() != "cpu":
        pytest.skip("f64 kernels are CPU-only; on GPU f64 runs the reference")
    x, g, b, dy = _inputs((6, 5, 17), jnp.float64)
    assert "rlx_layer_norm_bwd" in hlo_text(lambda x: jax.vjp(layer_norm, x, g, b)[1](dy), x)
    assert_close(layer_norm(x, g, b), _ref(x, g, b))
    got = jax.vjp(layer_norm, x, g, b)[1](dy)
    want = jax.vjp(_ref, x, g, b)[1](dy)
    for gi, wi in zip(got, want):
        assert_close(gi, wi)


def test_check_grads_all_modes_second_order(x64):
    x, g, b, _ = _inputs((3, 4, 9), jnp.float64, seed=2)
    check_grads(layer_norm, (x, g, b), order=2, modes=("fwd", "rev"))


def test_check_grads_backward_wrapper(x64):
    """The RLX backward ops are differentiable too (second order through them)."""
    x, g, b, dy = _inputs((3, 6), jnp.float64, seed=9)
    check_grads(lambda x, g, dy: layer_norm_backward(x, g, b, dy), (x, g, dy), order=1, modes=("fwd", "rev"))


def test_hessian_matches_reference(x64):
    x, g, b, _ = _inputs((7,), jnp.float64, seed=3)
    f = lambda x: jnp.sum(jnp.sin(layer_norm(x, g, b)))
    fr = lambda x: jnp.sum(jnp.sin(_ref(x, g, b)))
    assert_close(jax.hessian(f)(x), jax.hessian(fr)(x))
    assert_close(jax.jacfwd(jax.grad(f))(x), jax.hessian(fr)(x))


def test_jvp_matches_reference():
    x, g, b, dy = _inputs((5, 12), jnp.float32, seed=4)
    t = (dy, 0.1 * g, 0.2 * b)
    y, ty = jax.jvp(layer_norm, (x, g, b), t)
    yr, tyr = jax.jvp(_ref, (x, g, b), t)
    assert_close(y, yr)
    assert_close(ty, tyr)


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_other_axes(axis):
    x, _, _, dy = _inputs((6, 5, 4), jnp.float32, seed=5)
    h = x.shape[axis]
    g, b = jnp.linspace(0.5, 1.5, h), jnp.linspace(-1.0, 1.0, h)
    f = lambda x, g, b: layer_norm(x, g, b, axis=axis, eps=EPS)
    fr = lambda x, g, b: jnp.moveaxis(_ref(jnp.moveaxis(x, axis, -1), g, b), -1, axis)
    assert_close(f(x, g, b), fr(x, g, b))
    for a, w in zip(jax.vjp(f, x, g, b)[1](dy), jax.vjp(fr, x, g, b)[1](dy)):
        assert_close(a, w)
    for a, w in zip(layer_norm_backward(x, g, b, dy, axis=axis, eps=EPS), jax.vjp(fr, x, g, b)[1](dy)):
        assert_close(a, w)


def test_beta_optional_and_mixed_precision_promotes():
    """bf16 x with f32 gamma / beta computes and returns f32 (jnp.result_type, as flax's
    LayerNorm); gradients come back in each operand's own dtype."""
    x, g, b, dy = _inputs((3, 8), jnp.bfloat16)
    y = layer_norm(x, g.astype(jnp.float32))
    assert y.dtype == jnp.float32
    assert_close(y, _ref(*_f32(x, g), jnp.zeros(8)), jnp.float32)
    assert layer_norm(x, g).dtype == jnp.bfloat16
    assert layer_norm(x, g, b.astype(jnp.float32)).dtype == jnp.float32
    dx, dg = jax.grad(lambda x, g: jnp.sum(layer_norm(x, g)), argnums=(0, 1))(x, g.astype(jnp.float32))
    assert dx.dtype == jnp.bfloat16 and dg.dtype == jnp.float32
    bx, bg, _ = layer_norm_backward(x, g.astype(jnp.float32), None, dy)
    assert bx.dtype == jnp.bfloat16 and bg.dtype == jnp.float32


def test_matches_flax_layer_norm_in_mixed_precision():
    nnx = pytest.importorskip("flax.nnx")
    x, g, b, _ = _inputs((4, 16), jnp.bfloat16, seed=3)
    layer = nnx.LayerNorm(16, epsilon=1e-5, rngs=nnx.Rngs(0))
    layer.scale[...], layer.bias[...] = _f32(g, b)
    want = layer(x)
    got = layer_norm(x, *_f32(g, b), eps=1e-5)
    assert got.dtype == want.dtype == jnp.float32
    assert_close(got, want, jnp.float32)


def test_traced_eps_is_refused_by_name():
    x, g, b, _ = _inputs((3, 8), jnp.float32)
    with pytest.raises(TypeError, match="eps must be a static number"):
        jax.jit(lambda e: layer_norm(x, g, b, eps=e))(1e-5)
    with pytest.raises(TypeError, match="eps must be a static number"):
        jax.jit(lambda e: layer_norm_backward(x, g, b, x, eps=e))(1e-5)


def test_vmap_forward_grad_and_per_example_gradients():
    x, g, b, _ = _inputs((4, 3, 10), jnp.float32, seed=6)
    assert_close(jax.vmap(layer_norm, in_axes=(1, None, None), out_axes=1)(x, g, b), _ref(x, g, b))
    loss = lambda x, g, b: jnp.sum(jnp.tanh(layer_norm(x, g, b)))
    loss_ref = lambda x, g, b: jnp.sum(jnp.tanh(_ref(x, g, b)))
    got = jax.vmap(jax.grad(loss, (0, 1, 2)), in_axes=(0, None, None))(x, g, b)
    want = jax.vmap(jax.grad(loss_ref, (0, 1, 2)), in_axes=(0, None, None))(x, g, b)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert_close(a, w)
    # forward mode under vmap, and a batched gamma (vmap of the reference)
    t = jnp.ones_like(x)
    jv = jax.vmap(lambda x, t: jax.jvp(lambda x: layer_norm(x, g, b), (x,), (t,))[1])(x, t)
    jr = jax.vmap(lambda x, t: jax.jvp(lambda x: _ref(x, g, b), (x,), (t,))[1])(x, t)
    assert_close(jv, jr)
    gs = jnp.stack([g, 2 * g, 3 * g, g])
    assert_close(jax.vmap(layer_norm, in_axes=(0, 0, None))(x, gs, b), jax.vmap(_ref, in_axes=(0, 0, None))(x, gs, b))


def test_vmap_of_backward_wrapper():
    x, g, b, dy = _inputs((3, 4, 9), jnp.float32, seed=10)
    got = jax.vmap(lambda x, dy: layer_norm_backward(x, g, b, dy))(x, dy)
    want = jax.vmap(lambda x, dy: jax.vjp(_ref, x, g, b)[1](dy))(x, dy)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert_close(a, w)


def test_backward_wrapper_matches_vjp():
    x, g, b, dy = _inputs((5, 2, 7), jnp.float32, seed=7)
    got = layer_norm_backward(x, g, b, dy, axis=-1, eps=EPS)
    want = jax.vjp(_ref, x, g, b)[1](dy)
    for a, w in zip(got, want):
        assert_close(a, w)


def test_zero_rows_give_zero_parameter_gradients():
    x, g, b, dy = _inputs((0, 16), jnp.float32)
    dx, dg, db = jax.vjp(layer_norm, x, g, b)[1](dy)
    assert dx.shape == (0, 16)
    np.testing.assert_array_equal(dg, np.zeros(16))
    np.testing.assert_array_equal(db, np.zeros(16))


def test_deterministic_bitwise():
    x, g, b, dy = _inputs((257, 300), jnp.float32, seed=8)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(layer_norm, x, g, b)[1](dy))
    first = [np.asarray(a) for a in f(x, g, b, dy)]
    for _ in range(3):
        for a, b_ in zip(first, f(x, g, b, dy)):
            np.testing.assert_array_equal(a, np.asarray(b_))


def test_constant_rows_are_finite():
    x = jnp.full((3, 8), 2.5)
    g = jnp.ones(8)
    y, vjp = jax.vjp(lambda x: layer_norm(x, g, jnp.zeros(8)), x)
    np.testing.assert_allclose(y, 0.0, atol=1e-6)
    assert np.isfinite(np.asarray(vjp(jnp.ones_like(x))[0])).all()


def _numpy_layer_norm_grads(x, g, dy):
    """float64 NumPy oracle: (y without beta, dx, dgamma)."""
    x, g, dy = (np.asarray(a, np.float64) for a in (x, g, dy))
    mu = x.mean(-1, keepdims=True)
    r = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS)
    xh = (x - mu) * r
    u = dy * g
    dx = r * (u - u.mean(-1, keepdims=True) - xh * (u * xh).mean(-1, keepdims=True))
    return xh * g, dx, (dy * xh).sum(0)


def test_large_offset_is_stable():
    """Two-pass variance: rows far from zero keep their precision in f32 (a one-pass
    E[x^2] - E[x]^2 would lose every digit here)."""
    x, g, b, dy = _inputs((4, 64), jnp.float32, offset=1e4)
    y_want, dx_want, dg_want = _numpy_layer_norm_grads(x, g, dy)
    np.testing.assert_allclose(layer_norm(x, g), y_want, atol=2e-3 * np.abs(y_want).max())
    dx, dg, db = jax.vjp(layer_norm, x, g, b)[1](dy)
    np.testing.assert_allclose(dx, dx_want, atol=2e-3 * np.abs(dx_want).max())
    np.testing.assert_allclose(dg, dg_want, atol=2e-3 * np.abs(dg_want).max())
    np.testing.assert_allclose(db, np.asarray(dy, np.float64).sum(0), rtol=1e-5)


def test_nan_propagates_like_reference():
    x, g, b, _ = _inputs((2, 8), jnp.float32)
    x = x.at[0, 3].set(jnp.nan)
    got = np.asarray(layer_norm(x, g, b))
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
        layer_norm(*args)


def test_bad_axis_eps_and_dy():
    with pytest.raises(ValueError, match="axis"):
        layer_norm(jnp.ones((3, 4)), jnp.ones(4), axis=2)
    with pytest.raises(ValueError, match="eps"):
        layer_norm(jnp.ones((3, 4)), jnp.ones(4), eps=-1.0)
    with pytest.raises(ValueError, match="dy shape"):
        layer_norm_backward(jnp.ones((3, 4)), jnp.ones(4), jnp.ones(4), jnp.ones((4, 3)))


def test_kernel_rejects_bad_buffers_with_an_error():
    """A malformed call reaching the FFI handler raises, never crashes."""
    if platform() != "cpu":
        pytest.skip("CPU handler check")
    x = jnp.ones((3, 4))
    out = (jax.ShapeDtypeStruct((3, 4), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32),
           jax.ShapeDtypeStruct((3,), jnp.float32))
    bad = jax.ffi.ffi_call("rlx_layer_norm_fwd_v1", out)
    with pytest.raises(Exception, match="gamma must have shape"):
        jax.block_until_ready(bad(x, jnp.ones(5), jnp.ones(4), eps=np.float32(EPS)))


def test_backward_wrapper_without_gamma_gives_parameter_gradients():
    """LayerNormBackwardGamma [x, dy] has no gamma: gamma=None stands for ones."""
    x, g, b, dy = _inputs((4, 9), jnp.float32, seed=11)
    _, dg, db = layer_norm_backward(x, None, None, dy)
    _, want_g, want_b = jax.vjp(_ref, x, g, b)[1](dy)
    assert_close(dg, want_g)
    assert_close(db, want_b)


# ---- bf16 rows through the 16-element conversion blocks of rowwise.h (CPU) -------------

cpu_only = pytest.mark.skipif(platform() != "cpu", reason="the CPU kernels' row conversions")


def _bits(a):
    return np.asarray(a).view(np.uint16)


def _ln_outputs(x, g, b, dy):
    y, vjp = jax.vjp(jax.jit(lambda x, g, b: layer_norm(x, g, b, eps=EPS)), x, g, b)
    return (y, *vjp(dy))


@cpu_only
@pytest.mark.parametrize("shape", [(3, 7), (4, 16), (5, 45), (3, 1050)])
def test_cpu_bf16_rows_are_the_f32_rows_rounded(shape):
    """bf16 rows are widened exactly, run the f32 rows' arithmetic and are rounded once (to
    nearest even, blocks and tail): y, dx, dgamma, dbeta are the f32 kernel's results on
    the widened inputs, rounded, bit for bit."""
    x, g, b, dy = _inputs(shape, jnp.bfloat16, seed=shape[-1])
    got = _ln_outputs(x, g, b, dy)
    want = _ln_outputs(*_f32(x, g, b, dy))
    for gv, wv in zip(got, want):
        assert gv.dtype == jnp.bfloat16
        np.testing.assert_array_equal(_bits(gv), _bits(wv.astype(jnp.bfloat16)))


def _ln_digest() -> str:
    import hashlib
    h = hashlib.sha256()
    for dtype in (jnp.float32, jnp.bfloat16):
        for shape in ((9, 1050), (4, 45), (3, 7), (2, 16)):
            for leaf in _ln_outputs(*_inputs(shape, dtype, seed=shape[-1])):
                h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


@cpu_only
def test_cpu_same_bits_with_the_avx2_conversions_and_one_thread():
    """A fresh process pinned to one core and forced onto the AVX2 / baseline row clones
    (RLX_JAX_CPU_NO_AVX512) gives the same f32 and bf16 bits (y, dx, dgamma, dbeta) as this
    one (several threads; the AVX-512 body where the CPU has it)."""
    assert_same_bits_on_one_core_without_avx512(_ln_digest)
