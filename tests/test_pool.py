"""max_pool2d / avg_pool2d: kernels vs XLA's reduce_window and its autodiff, RLX's
first-maximum tie-break, count_include_pad, gradients in every mode, vmap, zero-sized
inputs, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import avg_pool2d, avg_pool2d_backward, max_pool2d, max_pool2d_backward

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
    assert {"rlx_max_pool2d_fwd", "rlx_max_pool2d_bwd", "rlx_avg_pool2d_bwd"} <= set(info["targets"])
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
    with pytest.raises(ValueError, match="dy must have the pooled shape"):
        max_pool2d_backward(x, jnp.zeros((1, 1, 3, 3)), kernel_size=2, stride=2)
    with pytest.raises(ValueError, match="dy must have the pooled shape"):
        avg_pool2d_backward(jnp.zeros((1, 1, 3, 3)), x_shape=(1, 1, 4, 4), kernel_size=2, stride=2)


def test_kernel_rejects_inconsistent_buffers():
    # a pooled shape that does not match the geometry: an error, not a crash
    call = jax.ffi.ffi_call("rlx_avg_pool2d_bwd", jax.ShapeDtypeStruct((1, 1, 4, 4), jnp.float32))
    geom = {k: np.int64(v) for k, v in dict(kh=2, kw=2, sh=2, sw=2, ph=0, pw=0).items()}
    with pytest.raises(Exception, match="pooled dims"):
        jax.block_until_ready(jax.jit(lambda d: call(d, **geom))(jnp.ones((1, 1, 3, 3))))
