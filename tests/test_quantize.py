"""fake_quantize (4 STEs) and fake_quantize_lsq: RLX's forward (max-abs scale, symmetric
clamp, half-away rounding), gradients against the documented STE / LSQ formulas (the
round has no derivative, so check_grads applies to the smooth backward maps only),
kernels vs references, forward mode, vmap, zero-sized inputs, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import fake_quantize, fake_quantize_backward, fake_quantize_lsq, fake_quantize_lsq_backward

from testutil import assert_close, hlo_text

STES = ["identity", "clipped_identity", "tanh", "hardtanh"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _x(shape, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


# ---- NumPy oracles (RLX's CPU kernels' formulas) --------------------------------------


def np_round(z):
    return np.where(z >= 0, np.floor(z + 0.5), -np.floor(-z + 0.5))


def np_scales(x, axis, q, work=np.float64):
    """max(max|x| / q, 1e-12) per channel, computed in ``work`` (RLX: f32 for f32 data,
    so q * s may fall one ulp below max|x|)."""
    x = np.asarray(x, work)
    if axis is None:
        m = np.abs(x).max(initial=0.0)
    else:
        m = np.abs(x).max(axis=tuple(i for i in range(x.ndim) if i != axis), keepdims=True, initial=0.0)
    return np.maximum(m / work(q), work(1e-12))


def np_fake_quantize(x, axis, q, s=None):
    x = np.asarray(x, np.float64)
    s = np_scales(x, axis, q) if s is None else s
    return np.clip(np_round(x / s), -q, q) * s


def np_ste(x, axis, q, ste, work=np.float32):
    x = np.asarray(x, work)
    s = np_scales(x, axis, q, work)
    if ste == "identity":
        return np.ones_like(x)
    if ste == "clipped_identity":
        return (np.abs(x) <= work(q) * s).astype(np.float64)
    if ste == "tanh":
        return 1 - np.tanh(x / s) ** 2
    return np.maximum(1 - np.abs(x / (q * s)), 0)


def np_lsq(x, s, dy, axis, q):
    """(y, dx, dscale) of RLX's LSQ; s broadcast along axis."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    shape = [1] * x.ndim
    if axis is not None:
        shape[axis] = -1
    sb = np.maximum(np.asarray(s, np.float64).reshape(shape), 1e-12)
    z = x / sb
    inside = np.abs(z) <= q
    psi = np.where(inside, np_round(z) - z, np.sign(z) * q)
    red = tuple(i for i in range(x.ndim) if i != axis) if axis is not None else None
    return np.clip(np_round(z), -q, q) * sb, np.where(inside, dy, 0), (psi * dy).sum(axis=red)


# ---- tests ---------------------------------------------------------------------------


def test_kernels_registered_and_used():
    info = rlx_jax.kernel_info()["cpu"]
    assert info["loaded"], info["error"]
    assert {"rlx_fake_quantize_bwd_v1", "rlx_fake_quantize_lsq_bwd_v1"} <= set(info["targets"])
    x = _x((8, 16))
    for ste in ("clipped_identity", "hardtanh"):
        g = jax.grad(lambda x: jnp.sum(fake_quantize(x, bits=4, axis=0, ste=ste) ** 2))
        assert "rlx_fake_quantize_bwd" in hlo_text(g, x)
    # tanh stays on XLA (its vectorised tanh wins; see the module docstring)
    g = jax.grad(lambda x: jnp.sum(fake_quantize(x, bits=4, ste="tanh") ** 2))
    assert "rlx_fake_quantize_bwd" not in hlo_text(g, x)
    g = jax.grad(lambda x, s: jnp.sum(fake_quantize_lsq(x, s, bits=4, axis=1) ** 2), (0, 1))
    assert "rlx_fake_quantize_lsq_bwd" in hlo_text(g, x, jnp.full((16,), 0.2))


@pytest.mark.parametrize("bits,q", [(8, 127), (4, 7), (2, 1)])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_forward_matches_rlx(bits, q, axis):
    x = _x((6, 5, 4))
    y = jax.jit(lambda x: fake_quantize(x, bits=bits, axis=axis))(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, np_fake_quantize(x, None if axis is None else axis % 3, q))
    # every value lies on its channel's grid of at most 2q + 1 levels
    assert len(np.unique(np.asarray(y[:, 0, 0] if axis == 0 else y))) <= (2 * q + 1) * (1 if axis is None else 6 * 5 * 4)


def test_rounding_is_half_away_from_zero_and_clamps():
    x = jnp.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 9.0, -9.0])
    y = fake_quantize(x, bits=4, scale=1.0)
    np.testing.assert_array_equal(y, [1.0, 2.0, 3.0, -1.0, -3.0, 0.0, 7.0, -7.0])
    np.testing.assert_array_equal(fake_quantize(jnp.zeros(3), bits=8), jnp.zeros(3))  # scale 1e-12


@pytest.mark.parametrize("ste", STES)
@pytest.mark.parametrize("axis", [None, 1, -1])
def test_gradient_is_the_documented_ste(ste, axis):
    x = _x((7, 6, 5), seed=1) * 3
    dy = _x(x.shape, seed=2)
    f = lambda x: fake_quantize(x, bits=4, axis=axis, ste=ste)
    (dx,) = jax.vjp(f, x)[1](dy)
    ax = None if axis is None else axis % 3
    assert_close(dx, np_ste(x, ax, 7, ste) * np.asarray(dy))
    _, t = jax.jvp(f, (x,), (dy,))  # forward mode: the same factor on the tangent
    assert_close(t, np_ste(x, ax, 7, ste) * np.asarray(dy))
    assert_close(fake_quantize_backward(x, dy, bits=4, axis=axis, ste=ste), dx)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ste", ["clipped_identity", "tanh", "hardtanh"])
def test_dtypes(dtype, ste):
    x = _x((9, 33), dtype, seed=4) * 2
    dy = _x(x.shape, dtype, seed=5)
    y = fake_quantize(x, bits=4, axis=1, ste=ste)
    assert y.dtype == dtype
    assert_close(y, np_fake_quantize(x.astype(jnp.float32), 1, 7), dtype)
    dx = fake_quantize_backward(x, dy, bits=4, axis=1, ste=ste)
    assert dx.dtype == dtype
    want = np_ste(x.astype(jnp.float32), 1, 7, ste) * np.asarray(dy, np.float32)
    # |x| <= q s at a channel's maximum itself depends on the last bit of q * (max / q):
    # leave those elements out of the comparison
    xf = np.abs(np.asarray(x, np.float32))
    edge = np.isclose(xf, xf.max(axis=0, keepdims=True), rtol=1e-6)
    assert_close(np.where(edge, 0, dx), np.where(edge, 0, want), dtype)


def test_f64_kernels(x64):
    x = _x((5, 8), jnp.float64) * 2
    dy = _x(x.shape, jnp.float64, seed=1)
    f = lambda x, dy: fake_quantize_backward(x, dy, bits=8, axis=0, ste="hardtanh")
    assert "rlx_fake_quantize_bwd" in hlo_text(f, x, dy)
    assert_close(f(x, dy), np_ste(x, 0, 127, "hardtanh", np.float64) * np.asarray(dy), jnp.float64)
    s = jnp.array([0.1, 0.2, 0.3, 0.05, 0.4, 0.1, 0.2, 0.3])
    dx, ds = fake_quantize_lsq_backward(x, s, dy, bits=4, axis=1)
    _, dx_want, ds_want = np_lsq(x, s, dy, 1, 7)
    assert dx.dtype == ds.dtype == jnp.float64
    assert_close(dx, dx_want, jnp.float64)
    assert_close(ds, ds_want, jnp.float64)


def test_identity_ste_passes_dy_through_exactly():
    x, dy = _x((4, 4)), _x((4, 4), seed=1)
    (dx,) = jax.vjp(lambda x: fake_quantize(x, bits=2), x)[1](dy)
    np.testing.assert_array_equal(dx, dy)


def test_fixed_scale_is_not_differentiated():
    x = _x((4, 3))
    s = jnp.array([0.1, 0.2, 0.3])
    y = fake_quantize(x, bits=4, axis=1, scale=s)
    assert_close(y, np_fake_quantize(x, 1, 7, np.asarray(s)[None]))
    ds = jax.grad(lambda s: jnp.sum(fake_quantize(x, bits=4, axis=1, scale=s)))(s)
    np.testing.assert_array_equal(ds, np.zeros(3))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("axis,s", [(1, [0.2, 0.05, 0.4, 0.1, 0.3]), (0, [0.3] * 6), (None, [0.25]), (None, 0.25)])
def test_lsq_matches_formulas(axis, s, dtype):
    x = _x((6, 5), dtype, seed=6) * 2
    dy = _x(x.shape, dtype, seed=7)
    s = jnp.asarray(s, jnp.float32)
    y, vjp = jax.vjp(lambda x, s: fake_quantize_lsq(x, s, bits=4, axis=axis), x, s)
    dx, ds = vjp(dy)
    y_want, dx_want, ds_want = np_lsq(x.astype(jnp.float32), s, dy.astype(jnp.float32), axis, 7)
    assert y.dtype == dx.dtype == dtype and ds.shape == s.shape and ds.dtype == s.dtype
    assert_close(y, y_want, dtype)
    assert_close(dx, dx_want, dtype)
    assert_close(ds, np.reshape(ds_want, s.shape), jnp.float32 if dtype == jnp.float32 else dtype)
    dx2, ds2 = fake_quantize_lsq_backward(x, s, dy, bits=4, axis=axis)
    np.testing.assert_array_equal(dx2, dx)
    assert_close(ds2, ds)


@pytest.mark.parametrize("ste", STES)
def test_plain_xla_baseline_keeps_the_straight_through_gradients(ste):
    """Under fused_ops(False) the ops run their references and JAX differentiates them; the
    estimators must survive that (round's own derivative is 0), in both modes."""
    x, dy = _x((6, 5), seed=12) * 2, _x((6, 5), seed=13)
    s = jnp.array([0.2, 0.05, 0.4, 0.1, 0.3])
    fq = lambda x: fake_quantize(x, bits=4, axis=1, ste=ste)  # noqa: E731
    lsq = lambda x, s: fake_quantize_lsq(x, s, bits=4, axis=1)  # noqa: E731
    fused = jax.vjp(fq, x)[1](dy), jax.vjp(lsq, x, s)[1](dy), jax.jvp(lsq, (x, s), (dy, s))[1]
    assert_close(fused[0][0], np_ste(x, 1, 7, ste) * np.asarray(dy))
    with rlx_jax.fused_ops(False):
        plain = jax.vjp(fq, x)[1](dy), jax.vjp(lsq, x, s)[1](dy), jax.jvp(lsq, (x, s), (dy, s))[1]
        assert "rlx_fake_quantize" not in hlo_text(jax.grad(lambda x: jnp.sum(fq(x))), x)
    for got, want in zip(jax.tree.leaves(plain), jax.tree.leaves(fused)):
        assert_close(got, want)


def test_lsq_shared_scale_broadcast_over_channels():
    x, dy = _x((4, 3), seed=8), _x((4, 3), seed=9)
    s = jnp.array([0.2])
    dx, ds = fake_quantize_lsq_backward(x, s, dy, bits=4, axis=1)
    _, _, per_channel = np_lsq(x, np.full(3, 0.2), dy, 1, 7)
    assert ds.shape == (1,)
    assert_close(ds, [per_channel.sum()])
    g = jax.grad(lambda s: jnp.sum(fake_quantize_lsq(x, s, bits=4, axis=1) * dy))(s)
    assert_close(g, ds)


def test_lsq_forward_mode():
    x = _x((5, 4), seed=10) * 2
    s = jnp.array([0.3, 0.2, 0.1, 0.4])
    tx, ts = _x(x.shape, seed=11), jnp.array([1.0, -2.0, 0.5, 3.0])
    _, t = jax.jvp(lambda x, s: fake_quantize_lsq(x, s, bits=4, axis=1), (x, s), (tx, ts))
    z = np.asarray(x, np.float64) / np.asarray(s)
    inside = np.abs(z) <= 7
    psi = np.where(inside, np_round(z) - z, np.sign(z) * 7)
    assert_close(t, np.where(inside, tx, 0) + psi * np.asarray(ts))


def test_backward_maps_check_grads(x64):
    """The backward ops are smooth maps of dy (linear) and, for tanh with a fixed scale,
    of x: check_grads order 2 on them, through the kernels' JVPs and transposes."""
    x, dy = _x((4, 6), jnp.float64) * 2, _x((4, 6), jnp.float64, seed=1)
    s = jnp.array([0.2, 0.3, 0.1, 0.25, 0.15, 0.3])
    for ste in ("clipped_identity", "tanh", "hardtanh"):
        check_grads(lambda d: fake_quantize_backward(x, d, bits=4, axis=1, ste=ste), (dy,), order=2,
                    modes=("fwd", "rev"))
    check_grads(lambda x: fake_quantize_backward(x, dy, bits=4, axis=1, ste="tanh", scale=s), (x,), order=2,
                modes=("fwd", "rev"))
    check_grads(lambda d: fake_quantize_lsq_backward(x, s, d, bits=4, axis=1), (dy,), order=2,
                modes=("fwd", "rev"))
    # second order through the forward op: d/dx of the STE gradient is the STE's derivative
    g = jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(fake_quantize(x, bits=4, ste="tanh", scale=0.3)))(x)))
    z = np.asarray(x) / 0.3
    assert_close(g(x), -2 * np.tanh(z) * (1 - np.tanh(z) ** 2) / 0.3, jnp.float64)


def test_vmap_keeps_per_example_scales():
    xs = _x((3, 6, 4), seed=12) * jnp.array([1.0, 5.0, 0.1])[:, None, None]
    for ste in ("clipped_identity", "hardtanh"):
        grad = jax.grad(lambda x: jnp.sum(jnp.sin(fake_quantize(x, bits=4, axis=1, ste=ste))))
        assert_close(jax.vmap(grad)(xs), jnp.stack([grad(x) for x in xs]))
        assert "rlx_fake_quantize_bwd" in hlo_text(jax.vmap(grad), xs)
    s = jnp.array([0.1, 0.2, 0.3, 0.4])
    lsq_grad = jax.grad(lambda s, x: jnp.sum(jnp.sin(fake_quantize_lsq(x, s, bits=4, axis=1))))
    got = jax.vmap(lsq_grad, in_axes=(None, 0))(s, xs)  # per-example dscale
    assert got.shape == (3, 4)
    assert_close(got, jnp.stack([lsq_grad(s, x) for x in xs]))
    assert "rlx_fake_quantize_lsq_bwd" in hlo_text(jax.vmap(lsq_grad, in_axes=(None, 0)), s, xs)


def test_zero_sized():
    x = jnp.zeros((0, 4))
    assert fake_quantize(x, bits=8, axis=1, ste="hardtanh").shape == (0, 4)
    assert jax.grad(lambda x: jnp.sum(fake_quantize(x, bits=8, axis=1, ste="hardtanh")))(x).shape == (0, 4)
    dx, ds = fake_quantize_lsq_backward(x, jnp.ones(4), x, bits=8, axis=1)
    assert dx.shape == (0, 4)
    np.testing.assert_array_equal(ds, np.zeros(4))
    assert fake_quantize(jnp.zeros((3, 0)), bits=4).shape == (3, 0)


def test_errors():
    x = _x((3, 4))
    with pytest.raises(ValueError, match="bits"):
        fake_quantize(x, bits=1)
    with pytest.raises(ValueError, match="ste must be one of"):
        fake_quantize(x, bits=8, ste="round")
    with pytest.raises(ValueError, match="axis 2 out of range"):
        fake_quantize(x, bits=8, axis=2)
    with pytest.raises(TypeError, match="x must be floating"):
        fake_quantize(jnp.ones((3,), jnp.int32), bits=8)
    with pytest.raises(ValueError, match="scale must be"):
        fake_quantize_lsq(x, jnp.ones(3), bits=4, axis=1)
    with pytest.raises(ValueError, match="dy shape"):
        fake_quantize_backward(x, jnp.ones((4, 3)), bits=4, ste="tanh")
    with pytest.raises(ValueError, match="dy shape"):
        fake_quantize_lsq_backward(x, jnp.ones(4), jnp.ones((4, 3)), bits=4, axis=1)
    assert fake_quantize(x, bits=8, ste="HardTanh").shape == x.shape  # RLX's names work too


def test_kernel_rejects_inconsistent_buffers():
    call = jax.ffi.ffi_call("rlx_fake_quantize_lsq_bwd_v1", (jax.ShapeDtypeStruct((1, 2, 3, 4), jnp.float32),
                                                          jax.ShapeDtypeStruct((1, 3), jnp.float32)))
    x = jnp.ones((1, 2, 3, 4))
    with pytest.raises(Exception, match="scale must be"):
        jax.block_until_ready(jax.jit(lambda x, s: call(x, s, x, q_max=np.float32(7)))(x, jnp.ones((1, 2))))
