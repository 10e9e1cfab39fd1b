"""max_pool2d / avg_pool2d: kernels vs XLA's reduce_window and its autodiff, RLX's
first-maximum tie-break, count_include_pad, gradients in every mode, vmap, zero-sized
inputs, errors; the saved argmax (window-local int8 where kh * kw <= 127, else the flat
int32 index) against a NumPy oracle, its dtype at the 127 / 128 boundary and its decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import avg_pool2d, avg_pool2d_backward, max_pool2d, max_pool2d_backward
from rlx_jax.vjp_rules._primitive import fused_ops
from rlx_jax.vjp_rules.pool import (
    argmax_dtype,
    flat_argmax,
    max_pool2d_bwd,
    max_pool2d_fwd,
    reference_max_pool2d,
    reference_max_pool2d_bwd,
)

from testutil import assert_close, hlo_text

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (x shape, kernel, stride, padding): overlapping, strided past the kernel, rectangular,
# padded, a 1x1 plane, odd sizes
GEOMS = [
    ((2, 3, 9, 8), (3, 3), (2, 2), (1, 1)),
    ((1, 2, 7, 11), (2, 3), (3, 2), (0, 1)),
    ((2, 1, 6, 6), (2, 2), (2, 2), (0, 0)),
    ((3, 2, 5, 4), (3, 2), (1, 1), (1, 0)),
    ((1, 1, 1, 1), (1, 1), (1, 1), (0, 0)),
    ((2, 5, 4), (2, 2), (1, 2), (1, 1)),  # CHW: any leading axes are planes
]


def _pads(x, padding):
    return [(0, 0)] * (x.ndim - 2) + [(p, p) for p in padding]


def xla_max_pool(x, k, s, p):
    ones = (1,) * (x.ndim - 2)
    return lax.reduce_window(x, -jnp.inf, lax.max, ones + k, ones + s, _pads(x, p))


def xla_avg_pool(x, k, s, p):
    ones = (1,) * (x.ndim - 2)
    summed = lax.reduce_window(x.astype(jnp.float32), 0.0, lax.add, ones + k, ones + s, _pads(x, p))
    return summed / (k[0] * k[1])


def _x(shape, dtype=jnp.float32, seed=0):
    # a permutation: distinct values, so every window has one maximum (no ties)
    n = int(np.prod(shape))
    perm = jax.random.permutation(jax.random.PRNGKey(seed), n).astype(jnp.float32)
    return ((perm - n / 2) / max(n, 1)).reshape(shape).astype(dtype)


def test_kernels_registered_and_used():
    info = rlx_jax.kernel_info()["cpu"]
    assert info["loaded"], info["error"]
    assert {"rlx_max_pool2d_fwd_v1", "rlx_max_pool2d_bwd_v1", "rlx_avg_pool2d_bwd_v1"} <= set(info["targets"])
    x = _x((2, 3, 8, 8))
    kw = dict(kernel_size=2, stride=2)
    text = hlo_text(jax.grad(lambda x: jnp.sum(max_pool2d(x, **kw) ** 2)), x)
    assert "rlx_max_pool2d_fwd" in text and "rlx_max_pool2d_bwd" in text
    assert "rlx_avg_pool2d_bwd" in hlo_text(jax.grad(lambda x: jnp.sum(avg_pool2d(x, **kw) ** 2)), x)
    dy = jnp.ones((2, 3, 4, 4))
    assert "rlx_max_pool2d_bwd" in hlo_text(lambda x, dy: max_pool2d_backward(x, dy, **kw), x, dy)


CASES = [(g, jnp.float32) for g in GEOMS] + [(g, d) for g in GEOMS[:2] for d in DTYPES[1:]]


@pytest.mark.parametrize("geom,dtype", CASES)
def test_max_pool_forward_and_backward_match_xla(geom, dtype):
    shape, k, s, p = geom
    x = _x(shape, dtype)
    fn = lambda x: max_pool2d(x, kernel_size=k, stride=s, padding=p)
    y, vjp = jax.vjp(jax.jit(fn), x)
    want, want_vjp = jax.vjp(lambda x: xla_max_pool(x, k, s, p), x.astype(jnp.float32))
    assert y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want))
    dy = jax.random.normal(jax.random.PRNGKey(1), y.shape).astype(dtype)
    (dx,) = vjp(dy)
    (dx_want,) = want_vjp(dy.astype(jnp.float32))
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, dx_want, dtype)


@pytest.mark.parametrize("geom,dtype", CASES)
def test_avg_pool_forward_and_backward_match_xla(geom, dtype):
    shape, k, s, p = geom
    x = _x(shape, dtype)
    fn = lambda x: avg_pool2d(x, kernel_size=k, stride=s, padding=p)
    y, vjp = jax.vjp(jax.jit(fn), x)
    want, want_vjp = jax.vjp(lambda x: xla_avg_pool(x, k, s, p), x.astype(jnp.float32))
    assert_close(y, want, dtype)
    dy = jax.random.normal(jax.random.PRNGKey(1), y.shape).astype(dtype)
    assert_close(vjp(dy)[0], want_vjp(dy.astype(jnp.float32))[0], dtype)


def test_max_pool_gradient_goes_to_the_first_maximum():
    # RLX's own example: window [1, 3; 2, 0] sends dy to the 3
    x = jnp.array([[[[1.0, 3.0], [2.0, 0.0]]]])
    dx = max_pool2d_backward(x, jnp.array([[[[2.0]]]]), kernel_size=2, stride=2)
    np.testing.assert_array_equal(dx, [[[[0.0, 2.0], [0.0, 0.0]]]])
    # ties: the first maximum in row-major window order takes the whole gradient
    x = jnp.array([[[[5.0, 1.0, 5.0], [5.0, 5.0, 2.0], [0.0, 5.0, 5.0]]]])
    dx = max_pool2d_backward(x, jnp.ones((1, 1, 2, 2)), kernel_size=2, stride=1)
    # windows start at (0,0), (0,1), (1,0), (1,1); their first 5s: (0,0), (0,2), (1,0), (1,1)
    np.testing.assert_array_equal(dx[0, 0], [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    g = jax.grad(lambda x: jnp.sum(max_pool2d(x, kernel_size=2, stride=1)))(x)
    np.testing.assert_array_equal(g, dx)
    # the same tie-break where JAX differentiates the reference (fused_ops(False), the
    # plain-XLA baseline) and in forward mode: it shared a tie's gradient ([0, .5, .5, 0])
    with fused_ops(False):
        g_ref = jax.grad(lambda x: jnp.sum(max_pool2d(x, kernel_size=2, stride=1)))(x)
    np.testing.assert_array_equal(g_ref, dx)
    t = jnp.arange(9.0).reshape(x.shape)
    for fused in (True, False):
        with fused_ops(fused):
            ty = jax.jvp(lambda x: max_pool2d(x, kernel_size=2, stride=1), (x,), (t,))[1]
        np.testing.assert_array_equal(ty[0, 0], [[0.0, 2.0], [3.0, 4.0]])


def test_max_pool_propagates_nan_and_sends_the_gradient_to_the_first_nan():
    x = jnp.array([[[[1.0, jnp.nan], [jnp.nan, 3.0]]]])  # one window: NaN, its first NaN at (0, 1)
    y, vjp = jax.vjp(lambda x: max_pool2d(x, kernel_size=2, stride=2), x)
    assert np.isnan(np.asarray(y)).all()
    np.testing.assert_array_equal(vjp(jnp.full_like(y, 2.0))[0], [[[[0.0, 2.0], [0.0, 0.0]]]])


@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[1], ((1, 2, 15, 14), (12, 12), (1, 2), (1, 0))],
                         ids=["overlap", "strided", "int32_argmax"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_max_pool_nan_windows_match_the_reference(geom, dtype):
    """Kernel against the op's reference (jnp.max / jnp.argmax: NaN wins, the first NaN is
    the argmax), values and gradients, with NaNs scattered over the input."""
    shape, k, s, p = geom
    x = _x(shape, dtype, seed=5)
    nans = np.random.default_rng(6).choice(x.size, 3, replace=False)  # a few: most windows stay NaN-free
    x = x.reshape(-1).at[nans].set(jnp.nan).reshape(shape)
    fn = lambda x: max_pool2d(x, kernel_size=k, stride=s, padding=p)  # noqa: E731
    y, vjp = jax.vjp(jax.jit(fn), x)
    with rlx_jax.fused_ops(False):
        want, want_vjp = jax.vjp(jax.jit(fn), x)
    assert np.isnan(np.asarray(want, np.float32)).any() and not np.isnan(np.asarray(want, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    dy = _x(y.shape, dtype, seed=7)
    np.testing.assert_array_equal(np.asarray(vjp(dy)[0], np.float32), np.asarray(want_vjp(dy)[0], np.float32))


def test_max_pool_windows_in_the_padding_pass_no_gradient():
    x = jnp.arange(4.0).reshape(1, 1, 2, 2)
    y = max_pool2d(x, kernel_size=1, stride=1, padding=1)
    assert y.shape == (1, 1, 4, 4)
    assert np.isneginf(np.asarray(y[0, 0, 0])).all() and (y[0, 0, 1:3, 1:3] == x[0, 0]).all()
    dx = max_pool2d_backward(x, jnp.ones_like(y), kernel_size=1, stride=1, padding=1)
    np.testing.assert_array_equal(dx, jnp.ones_like(x))
    # an all -inf window has no maximum above -inf: no gradient either
    x = jnp.full((1, 1, 2, 2), -jnp.inf).at[0, 0, 1, 1].set(1.0)
    dx = max_pool2d_backward(x, jnp.ones((1, 1, 2, 2)), kernel_size=1, stride=1)
    np.testing.assert_array_equal(dx, [[[[0.0, 0.0], [0.0, 1.0]]]])


def test_avg_pool_counts_the_padding():
    # RLX Pool{Mean} divides by kh*kw always (count_include_pad=True)
    y = avg_pool2d(jnp.ones((1, 1, 2, 2)), kernel_size=2, stride=1, padding=1)
    np.testing.assert_allclose(y[0, 0], [[0.25, 0.5, 0.25], [0.5, 1.0, 0.5], [0.25, 0.5, 0.25]])
    dx = avg_pool2d_backward(jnp.ones((1, 1, 3, 3)), x_shape=(1, 1, 2, 2), kernel_size=2, stride=1, padding=1)
    np.testing.assert_allclose(dx, jnp.ones((1, 1, 2, 2)))  # every cell is in 4 windows of weight 1/4


@pytest.mark.parametrize("shape,k,s,p", [GEOMS[0], GEOMS[3]])
def test_check_grads_f64(x64, shape, k, s, p):
    x = _x(shape, jnp.float64, seed=3)
    check_grads(lambda x: max_pool2d(x, kernel_size=k, stride=s, padding=p), (x,), order=2,
                modes=("fwd", "rev"), eps=1e-6)
    check_grads(lambda x: avg_pool2d(x, kernel_size=k, stride=s, padding=p), (x,), order=2,
                modes=("fwd", "rev"))
    dy = jax.random.normal(jax.random.PRNGKey(2), max_pool2d(x, kernel_size=k, stride=s, padding=p).shape,
                           jnp.float64)
    # the backward ops are linear in dy: differentiable again through the same kernels
    check_grads(lambda dy: max_pool2d_backward(x, dy, kernel_size=k, stride=s, padding=p), (dy,),
                order=2, modes=("fwd", "rev"))
    check_grads(lambda dy: avg_pool2d_backward(dy, x_shape=shape, kernel_size=k, stride=s, padding=p),
                (dy,), order=2, modes=("fwd", "rev"))


def test_f64_kernels_match_xla(x64):
    x = _x((2, 3, 9, 8), jnp.float64)
    for ours, xla in ((max_pool2d, xla_max_pool), (avg_pool2d, None)):
        g = jax.grad(lambda x: jnp.sum(jnp.sin(ours(x, kernel_size=3, stride=2, padding=1))))(x)
        if xla is None:
            xla = lambda x, k, s, p: lax.reduce_window(x, 0.0, lax.add, (1, 1) + k, (1, 1) + s,
                                                       _pads(x, p)) / 9
        want = jax.grad(lambda x: jnp.sum(jnp.sin(xla(x, (3, 3), (2, 2), (1, 1)))))(x)
        assert g.dtype == jnp.float64
        assert_close(g, want, jnp.float64)


def test_forward_mode_and_hessian():
    x = _x((1, 2, 5, 5))
    f = lambda x: max_pool2d(x, kernel_size=2, stride=2)
    t = jax.random.normal(jax.random.PRNGKey(4), x.shape)
    _, ty = jax.jvp(f, (x,), (t,))
    _, ty_want = jax.jvp(lambda x: xla_max_pool(x, (2, 2), (2, 2), (0, 0)), (x,), (t,))
    assert_close(ty, ty_want)
    h = jax.hessian(lambda x: jnp.sum(avg_pool2d(x, kernel_size=2, stride=1) ** 2))(x)
    h_want = jax.hessian(lambda x: jnp.sum(xla_avg_pool(x, (2, 2), (1, 1), (0, 0)) ** 2))(x)
    assert_close(h, h_want)


@pytest.mark.parametrize("fn", [max_pool2d, avg_pool2d])
def test_vmap(fn):
    xs = _x((3, 2, 2, 7, 6))
    kw = dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0))
    grad = jax.grad(lambda x: jnp.sum(fn(x, **kw) ** 2))
    got = jax.vmap(grad)(xs)
    want = jnp.stack([grad(x) for x in xs])
    assert_close(got, want)
    assert_close(jax.vmap(lambda x: fn(x, **kw), in_axes=2, out_axes=2)(xs),
                 jnp.stack([fn(xs[:, :, i], **kw) for i in range(xs.shape[2])], axis=2))
    assert "rlx_" in hlo_text(jax.vmap(grad), xs)


@pytest.mark.parametrize("shape", [(0, 3, 5, 5), (2, 0, 4, 4)])
@pytest.mark.parametrize("fn", [max_pool2d, avg_pool2d])
def test_zero_sized(shape, fn):
    x = jnp.zeros(shape)
    kw = dict(kernel_size=2, stride=2)
    y = fn(x, **kw)
    assert y.size == 0
    g = jax.grad(lambda x: jnp.sum(fn(x, **kw)))(x)
    assert g.shape == shape


def test_max_pool_backward_zero_pooled_plane_gives_zero_grad():
    # H=1 with kernel 1 and stride 2 along W=1: the plane has outputs; with padding the
    # plane of a 0-width pooled output still needs dx zeros
    x = jnp.ones((1, 1, 3, 3))
    dx = avg_pool2d_backward(jnp.ones((1, 1, 1, 1)), x_shape=x.shape, kernel_size=1, stride=3)
    np.testing.assert_array_equal(dx[0, 0], [[1.0, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_errors():
    x = jnp.zeros((1, 1, 4, 4))
    with pytest.raises(TypeError, match="x must be floating"):
        max_pool2d(jnp.zeros((1, 1, 4, 4), jnp.int32), kernel_size=2, stride=2)
    with pytest.raises(ValueError, match="rank >= 3"):
        avg_pool2d(jnp.zeros((4, 4)), kernel_size=2, stride=2)
    with pytest.raises(ValueError, match="kernel_size 5 exceeds"):
        max_pool2d(x, kernel_size=5, stride=1)
    with pytest.raises(ValueError, match="stride"):
        avg_pool2d(x, kernel_size=2, stride=0)
    with pytest.raises(ValueError, match="padding"):
        avg_pool2d(x, kernel_size=2, stride=1, padding=(-1, 0))
    with pytest.raises(TypeError, match="kernel_size"):
        max_pool2d(x, kernel_size=None, stride=1)
    # floats and bools are refused, not truncated (kernel_size (2.0, 2.0), padding 1.9 ran)
    for pool in (max_pool2d, avg_pool2d):
        for kw in (dict(kernel_size=(2.0, 2.0), stride=2), dict(kernel_size=2, stride=(2.5, 2.5)),
                   dict(kernel_size=2, stride=2, padding=(1.9, 1.9)), dict(kernel_size=(True, 2), stride=2)):
            with pytest.raises(TypeError, match="must be an int or a pair of ints"):
                pool(x, **kw)
    with pytest.raises(ValueError, match="dy must have the pooled shape"):
        max_pool2d_backward(x, jnp.zeros((1, 1, 3, 3)), kernel_size=2, stride=2)
    with pytest.raises(ValueError, match="dy must have the pooled shape"):
        avg_pool2d_backward(jnp.zeros((1, 1, 3, 3)), x_shape=(1, 1, 4, 4), kernel_size=2, stride=2)


def test_kernel_rejects_inconsistent_buffers():
    # a pooled shape that does not match the geometry: an error, not a crash
    call = jax.ffi.ffi_call("rlx_avg_pool2d_bwd_v1", jax.ShapeDtypeStruct((1, 1, 4, 4), jnp.float32))
    geom = {k: np.int64(v) for k, v in dict(kh=2, kw=2, sh=2, sw=2, ph=0, pw=0).items()}
    with pytest.raises(Exception, match="pooled dims"):
        jax.block_until_ready(jax.jit(lambda d: call(d, **geom))(jnp.ones((1, 1, 3, 3))))


# ---- the saved argmax: encoding, dtype, decoding -----------------------------------------


def numpy_max_pool(x, k, s, p):
    """NumPy oracle: (y, flat argmax, window-local argmax). The window positions are
    visited in row-major order (a, b), each against every window at once: a position
    replaces the running maximum (from -inf) only when strictly greater, so the first
    maximum wins and NaN never does; positions in the padding read -inf and never win;
    -1 where nothing exceeds -inf."""
    x = np.asarray(x, np.float64)
    (kh, kw), (sh, sw), (ph, pw) = k, s, p
    h, w = x.shape[-2:]
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    planes = np.pad(x.reshape(-1, h, w), ((0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    y = np.full((planes.shape[0], ho, wo), -np.inf)
    flat = np.full(y.shape, -1, np.int64)
    local = np.full(y.shape, -1, np.int64)
    rows, cols = np.arange(ho)[:, None] * sh - ph, np.arange(wo)[None, :] * sw - pw  # window origins
    for a in range(kh):
        for b in range(kw):
            cand = planes[:, a : a + sh * (ho - 1) + 1 : sh, b : b + sw * (wo - 1) + 1 : sw]
            wins = cand > y
            y = np.where(wins, cand, y)
            flat = np.where(wins, (rows + a) * w + (cols + b), flat)
            local = np.where(wins, a * kw + b, local)
    lead = x.shape[:-2]
    return y.reshape(lead + (ho, wo)), flat.reshape(lead + (ho, wo)), local.reshape(lead + (ho, wo))


def _geom_kw(k, s, p):
    return dict(kernel_size=k, stride=s, padding=p)


def _tied(shape, seed, neg_inf_plane=True):
    """Few distinct values (many tied maxima per window), one plane of -inf, one -inf row."""
    x = jnp.round(2 * jax.random.normal(jax.random.PRNGKey(seed), shape))
    flat = x.reshape((-1,) + shape[-2:])
    if neg_inf_plane and flat.shape[0] > 1:
        flat = flat.at[0].set(-jnp.inf)
    flat = flat.at[-1, 0].set(-jnp.inf)
    return flat.reshape(shape)


# (x shape, kernel, stride, padding): int8 windows of GEOMS plus the 127 / 128 boundary
# (1x127 int8; 1x128 and 8x16 int32) and windows wholly in the padding
ARGMAX_GEOMS = GEOMS + [
    ((2, 2, 3, 140), (1, 127), (1, 3), (0, 1)),
    ((2, 2, 3, 140), (1, 128), (2, 3), (1, 2)),
    ((1, 3, 11, 21), (8, 16), (3, 2), (2, 3)),
    ((1, 2, 13, 13), (11, 11), (2, 1), (1, 0)),  # 121 positions: int8 up to index 120
    ((1, 1, 4, 5), (2, 2), (1, 1), (2, 2)),  # windows wholly in the padding
]


@pytest.mark.parametrize("k,want", [((1, 127), jnp.int8), ((127, 1), jnp.int8), ((11, 11), jnp.int8),
                                    ((1, 128), jnp.int32), ((8, 16), jnp.int32), ((12, 11), jnp.int32),
                                    ((3, 3), jnp.int8), ((1, 1), jnp.int8)])
def test_argmax_dtype_from_the_window(k, want):
    assert argmax_dtype(k) == want
    x = jax.ShapeDtypeStruct((1, 2, 130, 130), jnp.float32)
    _, am = jax.eval_shape(lambda x: max_pool2d_fwd(x, **_geom_kw(k, (1, 1), (0, 0))), x)
    assert am.dtype == want


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("geom", ARGMAX_GEOMS, ids=lambda g: f"{g[0]}-k{g[1]}s{g[2]}p{g[3]}")
def test_argmax_matches_numpy_oracle(geom, ties):
    """The kernel's argmax equals the reference's bit for bit, its dtype follows the
    window, and both decode to the NumPy oracle's flat first-maximum index (the int8 one
    is also the oracle's window position)."""
    shape, k, s, p = geom
    x = _tied(shape, seed=5) if ties else _x(shape)
    kw = _geom_kw(k, s, p)
    y, am = jax.jit(lambda x: max_pool2d_fwd(x, **kw))(x)
    y_ref, am_ref = jax.jit(lambda x: reference_max_pool2d(x, **kw))(x)  # one compile, not kh * kw eager slices
    y_np, flat_np, local_np = numpy_max_pool(x, k, s, p)
    assert am.dtype == am_ref.dtype == argmax_dtype(k)
    np.testing.assert_array_equal(np.asarray(am), np.asarray(am_ref))
    np.testing.assert_array_equal(np.asarray(y), y_np.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(flat_argmax(am, in_hw=shape[-2:], **kw)), flat_np)
    if am.dtype == jnp.int8:
        np.testing.assert_array_equal(np.asarray(am), local_np)
    else:
        np.testing.assert_array_equal(np.asarray(am), flat_np)


@pytest.mark.parametrize("geom", ARGMAX_GEOMS[-5:], ids=lambda g: f"k{g[1]}s{g[2]}p{g[3]}")
def test_argmax_backward_and_gradients_at_the_boundary(geom):
    """dx of the kernel (through jax.vjp and max_pool2d_backward) vs the NumPy oracle's
    scatter at its flat index, for int8 and int32 windows; ties and -inf windows."""
    shape, k, s, p = geom
    kw = _geom_kw(k, s, p)
    x = _tied(shape, seed=9)
    y, vjp = jax.vjp(jax.jit(lambda x: max_pool2d(x, **kw)), x)
    dy = jax.random.normal(jax.random.PRNGKey(3), y.shape)
    (dx,) = vjp(dy)
    _, flat_np, _ = numpy_max_pool(x, k, s, p)
    want = np.zeros((int(np.prod(shape[:-2])), shape[-2] * shape[-1]))
    for q, (f, d) in enumerate(zip(flat_np.reshape(want.shape[0], -1), np.asarray(dy, np.float64).reshape(want.shape[0], -1))):
        for fo, do in zip(f, d):
            if fo >= 0:
                want[q, fo] += do
    assert_close(dx, want.reshape(shape))
    assert_close(max_pool2d_backward(x, dy, **kw), want.reshape(shape))
    t = jax.random.normal(jax.random.PRNGKey(4), shape)
    _, ty = jax.jvp(lambda x: max_pool2d(x, **kw), (x,), (t,))
    t_np = np.asarray(t).reshape(want.shape[0], -1)
    f = flat_np.reshape(want.shape[0], -1)
    ty_want = np.where(f >= 0, np.take_along_axis(t_np, np.maximum(f, 0), 1), 0.0).reshape(y.shape)
    assert_close(ty, ty_want)


def test_backward_kernel_matches_reference_scatter_bitwise_and_drops_bad_indices():
    """f32: the kernel's dx equals the reference's scatter at the decoded index; indices
    outside their window (which the forward never writes) pass no gradient in both."""
    shape, k, s, p = (2, 3, 9, 8), (3, 3), (2, 2), (1, 1)
    kw = _geom_kw(k, s, p)
    x = _tied(shape, seed=2)
    _, am = max_pool2d_fwd(x, **kw)
    dy = jax.random.normal(jax.random.PRNGKey(6), am.shape)
    bwd = jax.jit(lambda dy, am: max_pool2d_bwd(dy, am, in_hw=shape[-2:], **kw)[0])
    assert "rlx_max_pool2d_bwd" in bwd.lower(dy, am).as_text()
    (want,) = reference_max_pool2d_bwd(dy, am, in_hw=shape[-2:], **kw)
    np.testing.assert_array_equal(np.asarray(bwd(dy, am)), np.asarray(want))
    # 9, -128, 127: outside a 3x3 window's positions 0..8
    bad = am.at[0, 0, 0, :].set(jnp.int8(9)).at[0, 1, 1, 1].set(jnp.int8(-128)).at[1, 2, 2, 2].set(jnp.int8(127))
    (want_bad,) = reference_max_pool2d_bwd(dy, bad, in_hw=shape[-2:], **kw)
    got_bad = np.asarray(bwd(dy, bad))
    np.testing.assert_array_equal(got_bad, np.asarray(want_bad))
    # window (0, 0) covers rows/cols -1..1: local index 0 is in the padding, so nothing
    bad0 = am.at[0, 0, 0, 0].set(jnp.int8(0))
    (want0,) = reference_max_pool2d_bwd(dy, bad0, in_hw=shape[-2:], **kw)
    np.testing.assert_array_equal(np.asarray(bwd(dy, bad0)), np.asarray(want0))


def test_flat_argmax_round_trip():
    """Decoding every window position of every output gives the element it names."""
    k, s, p, hw = (3, 4), (2, 3), (1, 2), (7, 10)
    ho, wo = (hw[0] + 2 * p[0] - k[0]) // s[0] + 1, (hw[1] + 2 * p[1] - k[1]) // s[1] + 1
    for a in range(-1, k[0] * k[1] + 1):
        am = jnp.full((1, ho, wo), a, jnp.int8)
        got = np.asarray(flat_argmax(am, kernel_size=k, stride=s, padding=p, in_hw=hw))[0]
        for i in range(ho):
            for j in range(wo):
                r, c = i * s[0] - p[0] + a // k[1], j * s[1] - p[1] + a % k[1]
                inside = 0 <= a < k[0] * k[1] and 0 <= r < hw[0] and 0 <= c < hw[1]
                assert got[i, j] == (r * hw[1] + c if inside else -1), (a, i, j)
    flat = jnp.arange(-1, 11, dtype=jnp.int32).reshape(1, 3, 4)
    np.testing.assert_array_equal(flat_argmax(flat, kernel_size=(8, 16), stride=s, padding=p, in_hw=hw), flat)


@pytest.mark.parametrize("k", [(3, 3), (8, 16)], ids=["int8", "int32"])
def test_argmax_vmap_and_zero_sized(k):
    kw = _geom_kw(k, (2, 2), (1, 1))
    xs = _tied((3, 2, 2, 10, 18), seed=4)
    y, am = jax.vmap(lambda x: max_pool2d_fwd(x, **kw), in_axes=2, out_axes=2)(xs)
    for i in range(xs.shape[2]):
        y_i, am_i = max_pool2d_fwd(xs[:, :, i], **kw)
        np.testing.assert_array_equal(np.asarray(am[:, :, i]), np.asarray(am_i))
        np.testing.assert_array_equal(np.asarray(y[:, :, i]), np.asarray(y_i))
    assert am.dtype == argmax_dtype(k)
    for shape in ((0, 3, 10, 18), (2, 0, 10, 18)):
        y, am = jax.jit(lambda x: max_pool2d_fwd(x, **kw))(jnp.zeros(shape))
        assert am.dtype == argmax_dtype(k) and am.size == 0
        g = jax.grad(lambda x: jnp.sum(max_pool2d(x, **kw)))(jnp.zeros(shape))
        assert g.shape == shape


def test_check_grads_f64_int32_window(x64):
    shape, k, s, p = (1, 2, 10, 18), (8, 16), (2, 1), (1, 0)
    assert argmax_dtype(k) == jnp.int32
    x = _x(shape, jnp.float64, seed=8)
    check_grads(lambda x: max_pool2d(x, kernel_size=k, stride=s, padding=p), (x,), order=2,
                modes=("fwd", "rev"), eps=1e-6)
    dy = jax.random.normal(jax.random.PRNGKey(2), max_pool2d(x, kernel_size=k, stride=s, padding=p).shape,
                           jnp.float64)
    check_grads(lambda dy: max_pool2d_backward(x, dy, kernel_size=k, stride=s, padding=p), (dy,),
                order=2, modes=("fwd", "rev"))


def test_argmax_operand_dtype_is_checked():
    """The backward kernel refuses an argmax whose dtype does not match the window."""
    geom = {n: np.int64(v) for n, v in dict(kh=2, kw=2, sh=2, sw=2, ph=0, pw=0).items()}
    call = jax.ffi.ffi_call("rlx_max_pool2d_bwd_v1", jax.ShapeDtypeStruct((1, 1, 4, 4), jnp.float32))
    with pytest.raises(Exception, match="argmax must be i8"):
        jax.block_until_ready(jax.jit(lambda d, a: call(d, a, **geom))(jnp.ones((1, 1, 2, 2)),
                                                                        jnp.zeros((1, 1, 2, 2), jnp.int32)))
    call = jax.ffi.ffi_call("rlx_max_pool2d_fwd_v1", (jax.ShapeDtypeStruct((1, 1, 2, 2), jnp.float32),
                                                  jax.ShapeDtypeStruct((1, 1, 2, 2), jnp.int32)))
    with pytest.raises(Exception, match="argmax must be i8"):
        jax.block_until_ready(jax.jit(lambda x: call(x, **geom))(jnp.ones((1, 1, 4, 4))))
