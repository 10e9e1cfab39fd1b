"""The fused residual add + RMSNorm (``ops.add_rms_norm``): values and gradients of both
outputs against a NumPy float64 reference, every autodiff mode, the backward kernel that
sums the residual stream's gradient, vmap, scan / remat compositions, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from rlx_jax.ops import add_rms_norm, rms_norm
from rlx_jax.vjp_rules._primitive import fused_ops

from testutil import assert_close, hlo_text

EPS = 1e-5
SHAPES = [(4, 7), (3, 5, 33), (1, 1), (2, 3, 1025), (0, 16), (5, 0, 8)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _inputs(shape, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    h = shape[-1]
    x, r, ds, dy = (jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in ks[:4])
    g = (1.0 + 0.5 * jax.random.normal(ks[4], (h,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(ks[5], (h,), jnp.float32)).astype(dtype)
    return x, r, g, b, ds, dy


def _np64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def numpy_add_rms_norm(x, r, g, b, ds, dy):
    """(s, y, dx, dg, db) in float64: s = x + r, y = s / rms(s) * g + b, and the gradients of
    <s, ds> + <y, dy> (dx is also the residual's gradient)."""
    x, r, g, b, ds, dy = map(_np64, (x, r, g, b, ds, dy))
    s = x + r
    n = s.shape[-1]
    inv = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS) if n else np.ones(s.shape[:-1] + (1,))
    y = s * inv * g + b
    u = dy * g
    dx = ds + inv * u - s * inv**3 * np.sum(u * s, axis=-1, keepdims=True) / max(n, 1)
    rows = tuple(range(s.ndim - 1))
    return s, y, dx, np.sum(dy * s * inv, axis=rows), np.sum(dy, axis=rows)


def _tol(dtype):
    return {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}[dtype]


def _close(got, want, dtype):
    got = _np64(got)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=_tol(dtype), atol=_tol(dtype) * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_values_and_gradients_of_both_outputs_match_numpy(shape, dtype):
    x, r, g, b, ds, dy = _inputs(shape, dtype)
    (s, y), vjp = jax.vjp(jax.jit(add_rms_norm), x, r, g, b)
    dx, dr, dg, db = vjp((ds, dy))
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == shape
    # the sum is rounded to the dtype before the norm, as a separate add would be: the oracle
    # takes the rounded sum
    s_rounded = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(dtype)
    want = numpy_add_rms_norm(s_rounded, jnp.zeros_like(x), g, b, ds, dy)
    for got, w in zip((s, y, dx, dr, dg, db), (want[0], want[1], want[2], want[2], want[3], want[4])):
        _close(got, w, dtype)


def test_backward_kernel_takes_both_cotangents():
    x, r, g, b, *_ = _inputs((6, 40), jnp.float32)
    both = lambda x, r, g: jnp.sum(jax.tree.reduce(lambda a, c: a + jnp.sin(c), add_rms_norm(x, r, g), 0.0))
    text = hlo_text(jax.grad(both, (0, 1, 2)), x, r, g)
    assert "rlx_add_rms_norm_bwd" in text and "rlx_rms_norm_fwd" in text
    # only the normalised output used: the plain backward kernel, no residual gradient to add
    only_y = lambda x, r, g: jnp.sum(jnp.sin(add_rms_norm(x, r, g)[1]))
    text = hlo_text(jax.grad(only_y, (0, 1, 2)), x, r, g)
    assert "rlx_rms_norm_bwd" in text and "rlx_add_rms_norm_bwd" not in text
    with fused_ops(False):
        text = hlo_text(jax.grad(both, (0, 1, 2)), x, r, g)
    assert "rlx_" not in text


def test_one_output_unused():
    x, r, g, b, ds, dy = _inputs((5, 24), jnp.float32, seed=1)
    want = numpy_add_rms_norm(x, r, g, b, ds, dy)
    _, vjp = jax.vjp(lambda x, r, g, b: add_rms_norm(x, r, g, b)[0], x, r, g, b)
    dx, dr, dg, db = vjp(ds)
    np.testing.assert_array_equal(dx, ds)
    np.testing.assert_array_equal(dr, ds)
    assert not np.any(np.asarray(dg)) and not np.any(np.asarray(db))
    _, vjp = jax.vjp(lambda x, r, g, b: add_rms_norm(x, r, g, b)[1], x, r, g, b)
    dx, _, dg, db = vjp(dy)
    z = numpy_add_rms_norm(x, r, g, b, np.zeros(ds.shape), dy)
    for got, w in zip((dx, dg, db), (z[2], z[3], z[4])):
        _close(got, w, jnp.float32)


def test_check_grads_all_modes_second_order(x64):
    x, r, g, b, *_ = (a.astype(jnp.float64) for a in _inputs((3, 4, 9), jnp.float32, seed=2))

    def f(x, r, g, b):
        s, y = add_rms_norm(x, r, g, b, eps=EPS)
        return jnp.sin(s) * 1.5 + y * jnp.cos(y)

    check_grads(f, (x, r, g, b), order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_jvp_matches_plain_jax():
    x, r, g, b, ds, dy = _inputs((4, 17), jnp.float32, seed=3)
    tangents = _inputs((4, 17), jnp.float32, seed=4)[:4]
    got = jax.jvp(add_rms_norm, (x, r, g, b), tangents)
    with fused_ops(False):
        want = jax.jvp(add_rms_norm, (x, r, g, b), tangents)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, w, jnp.float32)


@pytest.mark.parametrize("axis", [0, 1])
def test_other_axes(axis):
    x, r, _, _, ds, dy = _inputs((6, 5, 7), jnp.float32, seed=5)
    g = jnp.linspace(0.5, 1.5, x.shape[axis])
    (s, y), vjp = jax.vjp(lambda x, r, g: add_rms_norm(x, r, g, axis=axis), x, r, g)
    got = vjp((ds, dy))
    move = lambda a: np.moveaxis(np.asarray(a), axis, -1)
    want = numpy_add_rms_norm(move(x), move(r), g, np.zeros(g.shape), move(ds), move(dy))
    _close(move(s), want[0], jnp.float32)
    _close(move(y), want[1], jnp.float32)
    _close(move(got[0]), want[2], jnp.float32)
    _close(move(got[1]), want[2], jnp.float32)
    _close(got[2], want[3], jnp.float32)


def test_mixed_precision_promotes():
    x, r, g, *_ = _inputs((3, 8), jnp.bfloat16)
    s, y = add_rms_norm(x, r.astype(jnp.float32), g)
    assert s.dtype == y.dtype == jnp.float32
    dx, dr = jax.grad(lambda x, r: jnp.sum(add_rms_norm(x, r, g)[1] ** 2), (0, 1))(x, r.astype(jnp.float32))
    assert dx.dtype == jnp.bfloat16 and dr.dtype == jnp.float32


def test_vmap_of_gradients():
    x, r, g, b, *_ = _inputs((3, 4, 16), jnp.float32, seed=6)
    loss = lambda x, r, g: jnp.sum(jnp.sin(add_rms_norm(x, r, g)[0]) * add_rms_norm(x, r, g)[1])
    got = jax.vmap(jax.grad(loss, (0, 1, 2)), in_axes=(0, 1, None))(x, jnp.swapaxes(r, 0, 1), g)
    with fused_ops(False):
        want = jax.vmap(jax.grad(loss, (0, 1, 2)), in_axes=(0, 1, None))(x, jnp.swapaxes(r, 0, 1), g)
    for a, w in zip(got, want):
        assert_close(a, w, jnp.float32)
    # per-example gamma: a batched parameter
    gs = jnp.stack([g, 2 * g, g + 1])
    got = jax.vmap(jax.grad(loss, (0, 1, 2)))(x, r, gs)
    with fused_ops(False):
        want = jax.vmap(jax.grad(loss, (0, 1, 2)))(x, r, gs)
    for a, w in zip(got, want):
        assert_close(a, w, jnp.float32)


def _decoder(params, x, use_scan, remat):
    """A toy pre-norm residual stack: each layer's add + norm feeds a tanh branch whose output
    is the next layer's residual; the stream runs through the sums."""

    def layer(carry, p):
        stream, branch = carry
        stream, h = add_rms_norm(stream, branch, p["g"])
        return (stream, jnp.tanh(h @ p["w"])), None

    if remat:
        layer = jax.checkpoint(layer)
    carry = (x, jnp.zeros_like(x))
    if use_scan:
        carry, _ = jax.lax.scan(layer, carry, params)
    else:
        for i in range(params["g"].shape[0]):
            carry, _ = layer(carry, jax.tree.map(lambda a: a[i], params))
    stream, branch = carry
    return jnp.sum(rms_norm(stream + branch, jnp.ones(x.shape[-1])) ** 2)


@pytest.mark.parametrize("use_scan,remat", [(False, False), (True, False), (True, True)])
def test_residual_stack_inside_scan_and_remat_matches_plain_jax(use_scan, remat):
    key = jax.random.PRNGKey(7)
    layers, width = 3, 24
    params = {"g": 1 + 0.1 * jax.random.normal(key, (layers, width)),
              "w": jax.random.normal(jax.random.fold_in(key, 1), (layers, width, width)) / np.sqrt(width)}
    x = jax.random.normal(jax.random.fold_in(key, 2), (5, width))
    f = jax.jit(jax.value_and_grad(lambda p, x: _decoder(p, x, use_scan, remat), (0, 1)))
    got = f(params, x)
    text = hlo_text(jax.grad(lambda p, x: _decoder(p, x, use_scan, remat), (0, 1)), params, x)
    assert "rlx_add_rms_norm_bwd" in text
    with fused_ops(False):
        want = jax.value_and_grad(lambda p, x: _decoder(p, x, use_scan, remat), (0, 1))(params, x)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_same_tensor_as_both_inputs_and_sum_reused():
    x, _, g, *_ = _inputs((4, 12), jnp.float32, seed=8)

    def f(x, g):
        s, y = add_rms_norm(x, x, g)
        return jnp.sum(s * y) + jnp.sum(jnp.exp(s / 4))

    got = jax.grad(f, (0, 1))(x, g)
    with fused_ops(False):
        want = jax.grad(f, (0, 1))(x, g)
    for a, w in zip(got, want):
        assert_close(a, w, jnp.float32)


def test_deterministic_bitwise():
    x, r, g, b, ds, dy = _inputs((300, 256), jnp.float32, seed=9)
    f = jax.jit(lambda *a: jax.vjp(add_rms_norm, *a)[1]((ds, dy)))
    first = [np.asarray(a) for a in f(x, r, g, b)]
    for _ in range(2):
        for a, w in zip(f(x, r, g, b), first):
            np.testing.assert_array_equal(np.asarray(a), w)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((np.ones((2, 3)), np.ones((2, 4)), np.ones(3)), ValueError, "residual shape"),
        ((np.ones((2, 3)), np.ones((2, 3), np.int32), np.ones(3)), TypeError, "residual must be floating"),
        ((np.ones((2, 3)), np.ones((2, 3)), np.ones(4)), ValueError, "gamma must have shape"),
        ((np.ones((2, 3), np.int32), np.ones((2, 3)), np.ones(3)), TypeError, "x must be floating"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, error, match):
    with pytest.raises(error, match=match):
        add_rms_norm(*args)


def test_traced_eps_is_refused():
    x = jnp.ones((2, 3))
    with pytest.raises(TypeError, match="add_rms_norm: eps must be a static number"):
        jax.jit(lambda e: add_rms_norm(x, x, jnp.ones(3), eps=e))(1e-5)
