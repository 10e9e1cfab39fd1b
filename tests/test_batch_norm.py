"""BatchNormInference end to end: kernel vs pure-JAX reference, gradients for all five
inputs in every mode, vmap, the RLX backward wrapper, errors. Runs on the default backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import batch_norm_inference, batch_norm_inference_backward
from rlx_jax.vjp_rules.batch_norm import reference_batch_norm_inference

from testutil import assert_close, hlo_text, platform

EPS = 1e-5
SHAPES = [(2, 6, 5, 7), (5, 8), (2, 4, 33), (1, 3, 2, 3, 2), (0, 4, 3), (2, 4, 0), (3, 0, 2)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _inputs(shape, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    c = shape[1]
    x = (1.0 + 2.0 * jax.random.normal(ks[0], shape, jnp.float32)).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(ks[1], (c,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(ks[2], (c,), jnp.float32)).astype(dtype)
    m = jax.random.normal(ks[3], (c,), jnp.float32).astype(dtype)
    v = jnp.exp(0.5 * jax.random.normal(ks[4], (c,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(ks[5], shape, jnp.float32).astype(dtype)
    return (x, g, b, m, v), dy


def _ref(x, g, b, m, v):
    return reference_batch_norm_inference(x, g, b, m, v, eps=EPS)[0]


def _ours(x, g, b, m, v):
    return batch_norm_inference(x, g, b, m, v, eps=EPS)


def _numpy_grads(x, g, m, v, dy):
    """float64 NumPy oracle for (dx, dgamma, dbeta, dmean, dvar)."""
    x, g, m, v, dy = (np.asarray(a, np.float64) for a in (x, g, m, v, dy))
    shp = (-1,) + (1,) * (x.ndim - 2)
    axes = (0, *range(2, x.ndim))
    r = 1.0 / np.sqrt(v + EPS)
    dx = dy * (g * r).reshape(shp)
    dg = (dy * (x - m.reshape(shp))).sum(axes) * r
    db = dy.sum(axes)
    dm = -g * r * db
    dv = -0.5 * g * r**3 * (dy * (x - m.reshape(shp))).sum(axes)
    return dx, dg, db, dm, dv


def test_compiled_kernel_is_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    if platform() != "cpu":
        pytest.skip("the backward kernel is CPU-only")
    assert {"rlx_batch_norm_inference_bwd_v1", "rlx_batch_norm_inference_bwd_v2"} <= set(info["targets"])
    args, _ = _inputs((2, 4, 3), jnp.float32)
    text = hlo_text(jax.grad(lambda *a: jnp.sum(_ours(*a) ** 2), (0, 1, 2, 3, 4)), *args)
    assert "rlx_batch_norm_inference_bwd" in text
    x, g, _, m, v = args
    text = hlo_text(lambda *a: batch_norm_inference_backward(*a, eps=EPS), x, g, m, v, x)
    assert "rlx_batch_norm_inference_bwd" in text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_match_reference(shape, dtype):
    args, dy = _inputs(shape, dtype, seed=1)
    y, vjp = jax.vjp(_ours, *args)
    assert y.dtype == dtype and y.shape == shape
    f32 = [a.astype(jnp.float32) for a in args]
    yr, vjp_ref = jax.vjp(_ref, *f32)
    assert_close(y, yr, dtype)
    for gi, wi, primal in zip(jax.jit(vjp)(dy), vjp_ref(dy.astype(jnp.float32)), args):
        assert gi.dtype == primal.dtype and gi.shape == primal.shape
        assert_close(gi, wi, dtype)


def test_gradients_match_numpy_oracle():
    (x, g, b, m, v), dy = _inputs((3, 5, 4, 6), jnp.float32, seed=3)
    got = jax.vjp(_ours, x, g, b, m, v)[1](dy)
    want = _numpy_grads(x, g, m, v, dy)
    for gi, wi in zip((got[0], got[1], got[2], got[3], got[4]), want):
        np.testing.assert_allclose(gi, wi, rtol=1e-4, atol=1e-4 * np.abs(wi).max())


def test_float64_and_check_grads_all_modes_second_order(x64):
    args, dy = _inputs((2, 3, 4), jnp.float64, seed=2)
    if platform() == "cpu":
        assert "rlx_batch_norm_inference_bwd" in hlo_text(lambda *a: jax.vjp(_ours, *a)[1](dy), *args)
    for gi, wi in zip(jax.vjp(_ours, *args)[1](dy), _numpy_grads(args[0], args[1], args[3], args[4], dy)):
        assert_close(gi, wi)
    check_grads(_ours, args, order=2, modes=("fwd", "rev"))


def test_check_grads_backward_wrapper(x64):
    (x, g, _, m, v), dy = _inputs((2, 3, 4), jnp.float64, seed=9)
    check_grads(lambda x, g, m, v, dy: batch_norm_inference_backward(x, g, m, v, dy, eps=EPS),
                (x, g, m, v, dy), order=1, modes=("fwd", "rev"))


def test_jvp_matches_reference():
    args, dy = _inputs((2, 3, 5), jnp.float32, seed=4)
    tangents = (dy, *(0.1 * a for a in args[1:]))
    y, ty = jax.jvp(_ours, args, tangents)
    yr, tyr = jax.jvp(_ref, args, tangents)
    assert_close(y, yr)
    assert_close(ty, tyr)


def test_vmap_forward_grad_and_per_example_gradients():
    x = _inputs((3, 2, 4, 5), jnp.float32, seed=6)[0][0]  # vmapped over axis 0 or 1: C = 4
    (_, g, b, m, v), _ = _inputs((1, 4), jnp.float32, seed=5)
    assert_close(jax.vmap(_ours, in_axes=(1, None, None, None, None), out_axes=1)(x, g, b, m, v),
                 jax.vmap(_ref, in_axes=(1, None, None, None, None), out_axes=1)(x, g, b, m, v))
    loss = lambda *a: jnp.sum(jnp.tanh(_ours(*a)))
    loss_ref = lambda *a: jnp.sum(jnp.tanh(_ref(*a)))
    axes = (0, None, None, None, None)
    got = jax.vmap(jax.grad(loss, (0, 1, 2, 3, 4)), in_axes=axes)(x, g, b, m, v)
    want = jax.vmap(jax.grad(loss_ref, (0, 1, 2, 3, 4)), in_axes=axes)(x, g, b, m, v)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert_close(a, w)
    vs = jnp.stack([v, 2 * v, 3 * v])
    assert_close(jax.vmap(_ours, in_axes=(0, None, None, None, 0))(x, g, b, m, vs),
                 jax.vmap(_ref, in_axes=(0, None, None, None, 0))(x, g, b, m, vs))


def test_backward_wrapper_matches_vjp_and_vmaps():
    (x, _, _, _, _), dy = _inputs((3, 2, 6, 4), jnp.float32, seed=7)
    (_, g, b, m, v), _ = _inputs((1, 6), jnp.float32, seed=5)
    got = jax.vmap(lambda x, dy: batch_norm_inference_backward(x, g, m, v, dy, eps=EPS))(x, dy)
    want = jax.vmap(lambda x, dy: jax.vjp(_ref, x, g, b, m, v)[1](dy)[:3])(x, dy)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert_close(a, w)


def test_zero_sized_give_zero_parameter_gradients():
    for shape in ((0, 4, 3), (2, 4, 0)):
        args, dy = _inputs(shape, jnp.float32)
        grads = jax.vjp(_ours, *args)[1](dy)
        assert grads[0].shape == shape
        for gr in grads[1:]:
            np.testing.assert_array_equal(gr, np.zeros(4))


def test_deterministic_bitwise():
    args, dy = _inputs((9, 16, 7, 5), jnp.float32, seed=8)
    f = jax.jit(lambda *a: jax.vjp(_ours, *a[:5])[1](a[5]))
    first = [np.asarray(a) for a in f(*args, dy)]
    for _ in range(3):
        for a, b_ in zip(first, f(*args, dy)):
            np.testing.assert_array_equal(a, np.asarray(b_))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((jnp.ones((2, 4), jnp.int32), *[jnp.ones(4)] * 4), TypeError, "floating"),
        ((jnp.ones((2, 4)), jnp.ones(3), *[jnp.ones(4)] * 3), ValueError, "gamma must have shape"),
        ((jnp.ones((2, 4)), *[jnp.ones(4)] * 3, jnp.ones(5)), ValueError, "var must have shape"),
        ((jnp.ones(4), *[jnp.ones(4)] * 4), ValueError, "rank >= 2"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, error, match):
    with pytest.raises(error, match=match):
        batch_norm_inference(*args)


def test_kernel_rejects_bad_buffers_with_an_error():
    if platform() != "cpu":
        pytest.skip("CPU handler check")
    out = (jax.ShapeDtypeStruct((2, 4), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32),
           jax.ShapeDtypeStruct((4,), jnp.float32))
    bad = jax.ffi.ffi_call("rlx_batch_norm_inference_bwd_v1", out)
    with pytest.raises(Exception, match="var must have shape"):
        jax.block_until_ready(bad(jnp.ones((2, 4)), jnp.ones(4), jnp.ones(4), jnp.ones(3), jnp.ones((2, 4)),
                                  eps=np.float32(EPS)))


def test_backward_wrapper_without_gamma_gives_parameter_gradients():
    (x, g, b, m, v), dy = _inputs((2, 4, 5), jnp.float32, seed=11)
    _, dg, db = batch_norm_inference_backward(x, None, m, v, dy, eps=EPS)
    want = jax.vjp(_ref, x, g, b, m, v)[1](dy)
    assert_close(dg, want[1])
    assert_close(db, want[2])


@pytest.mark.skipif(platform() != "cpu", reason="the CPU kernels' row conversions")
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (2, 4, 16), (6, 45), (4, 1050)])
def test_cpu_bf16_rows_are_the_f32_rows_rounded(shape):
    """bf16 planes / rows are widened exactly, run the f32 arithmetic and are rounded once
    (to nearest even): y, dx, dgamma, dbeta equal the f32 kernel's results on the widened
    inputs, rounded, bit for bit (both layouts: spatial planes and [N, C] rows)."""
    def outs(x, g, b, m, v, dy):
        y, vjp = jax.vjp(jax.jit(lambda x, g, b: batch_norm_inference(x, g, b, m, v)), x, g, b)
        return (y, *vjp(dy))
    (x, g, b, m, v), dy = _inputs(shape, jnp.bfloat16, seed=3)
    got = outs(x, g, b, m, v, dy)
    want = outs(*(a.astype(jnp.float32) for a in (x, g, b, m, v, dy)))
    for gv, wv in zip(got, want):
        assert gv.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(gv).view(np.uint16),
                                      np.asarray(wv.astype(jnp.bfloat16)).view(np.uint16))
