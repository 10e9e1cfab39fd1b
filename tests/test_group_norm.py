"""GroupNorm (NCHW) end to end: kernel vs pure-JAX reference, gradients in every mode,
vmap, the RLX backward wrapper, errors, determinism. Runs on the default backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import group_norm, group_norm_backward
from rlx_jax.vjp_rules.group_norm import reference_group_norm

from testutil import assert_close, hlo_text, platform

EPS = 1e-5
# (shape, num_groups): 2-d spatial, none, 1-d, 3-d, one group, one channel per group, empties
CASES = [
    ((2, 6, 5, 7), 3),
    ((3, 8), 4),
    ((2, 4, 33), 1),
    ((1, 6, 2, 3, 2), 6),
    ((0, 4, 3, 3), 2),
    ((2, 4, 0, 3), 2),
    ((2, 0, 5), 1),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _inputs(shape, dtype, seed=0, offset=1.0):
    kx, kg, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    c = shape[1]
    x = (offset + 2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(kg, (c,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(kb, (c,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return x, g, b, dy


def _ref(groups):
    return lambda x, g, b: reference_group_norm(x, g, b, num_groups=groups, eps=EPS)[0]


def _ours(groups):
    return lambda x, g, b: group_norm(x, g, b, num_groups=groups, eps=EPS)


def _numpy_group_norm(x, g, b, groups):
    """float64 NumPy oracle, written independently of the JAX reference."""
    x = np.asarray(x, np.float64)
    n, c = x.shape[:2]
    xb = x.reshape(n, groups, -1)
    mu = xb.mean(-1, keepdims=True)
    var = ((xb - mu) ** 2).mean(-1, keepdims=True)
    xh = ((xb - mu) / np.sqrt(var + EPS)).reshape(x.shape)
    bshape = (c,) + (1,) * (x.ndim - 2)
    return xh * np.asarray(g, np.float64).reshape(bshape) + np.asarray(b, np.float64).reshape(bshape)


def test_compiled_kernels_are_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_group_norm_fwd_v1", "rlx_group_norm_fwd_v2", "rlx_group_norm_bwd_v1"} <= set(info["targets"])
    x, g, b, _ = _inputs((2, 4, 3, 3), jnp.float32)
    text = hlo_text(jax.grad(lambda x, g, b: jnp.sum(_ours(2)(x, g, b) ** 2), (0, 1, 2)), x, g, b)
    assert "rlx_group_norm_fwd" in text and "rlx_group_norm_bwd" in text
    text = hlo_text(lambda x, g, b, dy: group_norm_backward(x, g, b, dy, num_groups=2), x, g, b, x)
    assert "rlx_group_norm_bwd" in text


def test_forward_matches_numpy_oracle():
    x, g, b, _ = _inputs((3, 6, 4, 5), jnp.float32, offset=3.0)
    np.testing.assert_allclose(group_norm(x, g, b, num_groups=3), _numpy_group_norm(x, g, b, 3), atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, groups", CASES)
def test_forward_and_backward_match_reference(shape, groups, dtype):
    x, g, b, dy = _inputs(shape, dtype, seed=1)
    y, vjp = jax.vjp(_ours(groups), x, g, b)
    assert y.dtype == dtype and y.shape == shape
    xf, gf, bf, dyf = (a.astype(jnp.float32) for a in (x, g, b, dy))
    yr, vjp_ref = jax.vjp(_ref(groups), xf, gf, bf)
    assert_close(y, yr, dtype)
    for gi, wi, primal in zip(jax.jit(vjp)(dy), vjp_ref(dyf), (x, g, b)):
        assert gi.dtype == primal.dtype and gi.shape == primal.shape
        assert_close(gi, wi, dtype)


def test_float64_forward_and_backward(x64):
    if platform() != "cpu":
        pytest.skip("f64 kernels are CPU-only; on GPU f64 runs the reference")
    x, g, b, dy = _inputs((2, 6, 3, 5), jnp.float64)
    f = _ours(3)
    assert "rlx_group_norm_bwd" in hlo_text(lambda x: jax.vjp(f, x, g, b)[1](dy), x)
    assert_close(f(x, g, b), _numpy_group_norm(x, g, b, 3))
    for gi, wi in zip(jax.vjp(f, x, g, b)[1](dy), jax.vjp(_ref(3), x, g, b)[1](dy)):
        assert_close(gi, wi)


def test_check_grads_all_modes_second_order(x64):
    x, g, b, _ = _inputs((2, 4, 3, 2), jnp.float64, seed=2)
    check_grads(_ours(2), (x, g, b), order=2, modes=("fwd", "rev"))


def test_check_grads_backward_wrapper(x64):
    x, g, b, dy = _inputs((2, 4, 3), jnp.float64, seed=9)
    check_grads(lambda x, g, dy: group_norm_backward(x, g, b, dy, num_groups=2), (x, g, dy),
                order=1, modes=("fwd", "rev"))


def test_jvp_matches_reference():
    x, g, b, dy = _inputs((2, 6, 4), jnp.float32, seed=4)
    t = (dy, 0.1 * g, 0.2 * b)
    y, ty = jax.jvp(_ours(3), (x, g, b), t)
    yr, tyr = jax.jvp(_ref(3), (x, g, b), t)
    assert_close(y, yr)
    assert_close(ty, tyr)


def test_vmap_forward_grad_and_per_example_gradients():
    x = _inputs((3, 2, 4, 5), jnp.float32, seed=6)[0]  # vmapped over axis 0 or 1: C = 4
    _, g, b, _ = _inputs((1, 4), jnp.float32, seed=5)
    f, fr = _ours(2), _ref(2)
    assert_close(jax.vmap(f, in_axes=(1, None, None), out_axes=1)(x, g, b),
                 jax.vmap(fr, in_axes=(1, None, None), out_axes=1)(x, g, b))
    loss = lambda x, g, b: jnp.sum(jnp.tanh(f(x, g, b)))
    loss_ref = lambda x, g, b: jnp.sum(jnp.tanh(fr(x, g, b)))
    got = jax.vmap(jax.grad(loss, (0, 1, 2)), in_axes=(0, None, None))(x, g, b)
    want = jax.vmap(jax.grad(loss_ref, (0, 1, 2)), in_axes=(0, None, None))(x, g, b)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert_close(a, w)
    gs = jnp.stack([g, 2 * g, 3 * g])
    assert_close(jax.vmap(f, in_axes=(0, 0, None))(x, gs, b), jax.vmap(fr, in_axes=(0, 0, None))(x, gs, b))


def test_backward_wrapper_matches_vjp_and_vmaps():
    x, _, _, dy = _inputs((3, 2, 6, 4), jnp.float32, seed=7)  # per call: N = 2, C = 6
    _, g, b, _ = _inputs((1, 6), jnp.float32, seed=5)
    got = jax.vmap(lambda x, dy: group_norm_backward(x, g, b, dy, num_groups=3, eps=EPS))(x, dy)
    want = jax.vmap(lambda x, dy: jax.vjp(_ref(3), x, g, b)[1](dy))(x, dy)
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert_close(a, w)


def test_zero_sized_give_zero_parameter_gradients():
    for shape in ((0, 4, 3), (2, 4, 0)):
        x, g, b, dy = _inputs(shape, jnp.float32)
        dx, dg, db = jax.vjp(_ours(2), x, g, b)[1](dy)
        assert dx.shape == shape
        np.testing.assert_array_equal(dg, np.zeros(4))
        np.testing.assert_array_equal(db, np.zeros(4))


def test_deterministic_bitwise():
    x, g, b, dy = _inputs((9, 16, 7, 5), jnp.float32, seed=8)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(_ours(4), x, g, b)[1](dy))
    first = [np.asarray(a) for a in f(x, g, b, dy)]
    for _ in range(3):
        for a, b_ in zip(first, f(x, g, b, dy)):
            np.testing.assert_array_equal(a, np.asarray(b_))


def test_constant_groups_are_finite():
    x = jnp.full((2, 4, 3), 1.5)
    y, vjp = jax.vjp(lambda x: group_norm(x, jnp.ones(4), jnp.zeros(4), num_groups=2), x)
    np.testing.assert_allclose(y, 0.0, atol=1e-6)
    assert np.isfinite(np.asarray(vjp(jnp.ones_like(x))[0])).all()


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((jnp.ones((2, 4), jnp.int32), jnp.ones(4), jnp.ones(4)), {"num_groups": 2}, TypeError, "floating"),
        ((jnp.ones((2, 4)), jnp.ones(3), jnp.ones(4)), {"num_groups": 2}, ValueError, "gamma must have shape"),
        ((jnp.ones((2, 4)), jnp.ones(4), jnp.ones(5)), {"num_groups": 2}, ValueError, "beta must have shape"),
        ((jnp.ones((2, 6)), jnp.ones(6), jnp.ones(6)), {"num_groups": 4}, ValueError, "not divisible"),
        ((jnp.ones((2, 4)), jnp.ones(4), jnp.ones(4)), {"num_groups": 0}, ValueError, "num_groups"),
        ((jnp.ones(4), jnp.ones(4), jnp.ones(4)), {"num_groups": 2}, ValueError, "rank >= 2"),
        ((jnp.ones((2, 4)), jnp.ones(4), jnp.ones(4)), {"num_groups": 2, "eps": -1.0}, ValueError, "eps"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        group_norm(*args, **kwargs)


def test_kernel_rejects_bad_buffers_with_an_error():
    if platform() != "cpu":
        pytest.skip("CPU handler check")
    out = (jax.ShapeDtypeStruct((2, 6), jnp.float32), jax.ShapeDtypeStruct((2, 4), jnp.float32),
           jax.ShapeDtypeStruct((2, 4), jnp.float32))
    bad = jax.ffi.ffi_call("rlx_group_norm_fwd_v1", out)
    with pytest.raises(Exception, match="not divisible"):
        jax.block_until_ready(bad(jnp.ones((2, 6)), jnp.ones(6), jnp.ones(6), num_groups=np.int64(4),
                                  eps=np.float32(EPS)))


def test_backward_wrapper_without_gamma_gives_parameter_gradients():
    x, g, b, dy = _inputs((2, 4, 5), jnp.float32, seed=11)
    _, dg, db = group_norm_backward(x, None, None, dy, num_groups=2, eps=EPS)
    _, want_g, want_b = jax.vjp(_ref(2), x, g, b)[1](dy)
    assert_close(dg, want_g)
    assert_close(db, want_b)


@pytest.mark.skipif(platform() != "cpu", reason="the CPU kernels' row conversions")
@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 7), 3), ((2, 4, 33), 2), ((1, 8, 4, 4), 4)])
def test_cpu_bf16_blocks_are_the_f32_blocks_rounded(shape, groups):
    """bf16 (n, g) blocks are widened exactly, run the f32 arithmetic and are rounded once
    (to nearest even): y, dx, dgamma, dbeta equal the f32 kernel's results on the widened
    inputs, rounded, bit for bit (block sizes 70, 66 and 32: tails and whole blocks)."""
    def outs(x, g, b, dy):
        y, vjp = jax.vjp(jax.jit(lambda x, g, b: group_norm(x, g, b, num_groups=groups, eps=EPS)), x, g, b)
        return (y, *vjp(dy))
    x, g, b, dy = _inputs(shape, jnp.bfloat16, seed=7)
    got = outs(x, g, b, dy)
    want = outs(*(a.astype(jnp.float32) for a in (x, g, b, dy)))
    for gv, wv in zip(got, want):
        assert gv.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(gv).view(np.uint16),
                                      np.asarray(wv.astype(jnp.bfloat16)).view(np.uint16))
