"""conv2d: XLA's convolution forward, RLX's Conv2dBackwardInput / Weight as its exact
transposes, gradients in every mode (stride, padding, dilation, groups), vmap, zero-sized
inputs, errors. Conv stays on XLA's convolution (no FFI kernel: see the module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

from rlx_jax.ops import conv2d, conv2d_backward, conv2d_backward_input, conv2d_backward_weight

from testutil import assert_close, hlo_text

# (x shape, w shape, stride, padding, dilation, groups)
CONFIGS = [
    ((2, 3, 8, 7), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((1, 4, 9, 10), (6, 2, 3, 2), (2, 1), (0, 2), (1, 2), 2),
    ((2, 4, 7, 7), (4, 1, 3, 3), (2, 2), (1, 1), (2, 1), 4),  # depthwise
    ((3, 2, 5, 6), (3, 2, 1, 1), (3, 2), (0, 0), (1, 1), 1),
]


def xla_conv(x, w, stride, padding, dilation, groups):
    return lax.conv_general_dilated(x, w, stride, [(p, p) for p in padding], rhs_dilation=dilation,
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups)


def _inputs(xs, ws, dtype=jnp.float32, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(kx, xs, jnp.float32).astype(dtype),
            jax.random.normal(kw, ws, jnp.float32).astype(dtype))


@pytest.mark.parametrize("xs,ws,s,p,d,g", CONFIGS)
def test_forward_and_gradients_match_xla(xs, ws, s, p, d, g):
    x, w = _inputs(xs, ws)
    kw = dict(stride=s, padding=p, dilation=d, groups=g)
    dy = jax.random.normal(jax.random.PRNGKey(1), xla_conv(x, w, s, p, d, g).shape)

    @jax.jit
    def ours(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: conv2d(x, w, **kw), x, w)
        # RLX's two backward ops, alone and together
        return (y, *vjp(dy), conv2d_backward_input(dy, w, x_shape=xs, **kw),
                conv2d_backward_weight(x, dy, w_shape=ws, **kw), *conv2d_backward(x, w, dy, **kw))

    y, dx, dw, bi, bw, both_x, both_w = ours(x, w, dy)
    want, want_vjp = jax.vjp(lambda x, w: xla_conv(x, w, s, p, d, g), x, w)
    dx_want, dw_want = want_vjp(dy)
    assert_close(y, want)
    for got in (dx, bi, both_x):
        assert_close(got, dx_want)
    for got in (dw, bw, both_w):
        assert_close(got, dw_want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(dtype):
    xs, ws, s, p, d, g = CONFIGS[1]
    x, w = _inputs(xs, ws, dtype)
    y = conv2d(x, w, stride=s, padding=p, dilation=d, groups=g)
    assert y.dtype == dtype
    assert_close(y, xla_conv(x.astype(jnp.float32), w.astype(jnp.float32), s, p, d, g), dtype)
    dx, dw = jax.grad(lambda x, w: jnp.sum(conv2d(x, w, stride=s, padding=p, dilation=d, groups=g)), (0, 1))(x, w)
    assert dx.dtype == dw.dtype == dtype


@pytest.mark.parametrize(
    "xs,ws,s,p,d,g",
    [CONFIGS[1], pytest.param(*CONFIGS[0], marks=pytest.mark.slow), pytest.param(*CONFIGS[2], marks=pytest.mark.slow)],
)
def test_check_grads_f64(x64, xs, ws, s, p, d, g):
    x, w = _inputs(xs, ws, jnp.float64)
    kw = dict(stride=s, padding=p, dilation=d, groups=g)
    check_grads(lambda x, w: conv2d(x, w, **kw), (x, w), order=2, modes=("fwd", "rev"))
    dy = jax.random.normal(jax.random.PRNGKey(2), conv2d(x, w, **kw).shape, jnp.float64)
    check_grads(lambda dy, w: conv2d_backward_input(dy, w, x_shape=xs, **kw), (dy, w), order=2,
                modes=("fwd", "rev"))
    check_grads(lambda x, dy: conv2d_backward_weight(x, dy, w_shape=ws, **kw), (x, dy), order=2,
                modes=("fwd", "rev"))


def test_hessian_and_jacfwd():
    x, w = _inputs((1, 2, 4, 4), (2, 2, 2, 2))
    f = lambda x, w: jnp.sum(jnp.tanh(conv2d(x, w, padding=1)))
    g = lambda x, w: jnp.sum(jnp.tanh(xla_conv(x, w, (1, 1), (1, 1), (1, 1), 1)))
    assert_close(jax.hessian(f, 1)(x, w), jax.hessian(g, 1)(x, w))
    assert_close(jax.jacfwd(f)(x, w), jax.jacfwd(g)(x, w))


def test_vmap():
    x, w = _inputs((2, 2, 4, 5, 5), (3, 4, 3, 3))
    f = lambda x: conv2d(x, w, stride=2, padding=1)
    assert_close(jax.vmap(f)(x), jnp.stack([f(xi) for xi in x]))
    assert "rlx_conv2d" in str(jax.make_jaxpr(jax.vmap(f))(x))  # folded into N, one primitive
    ws = jnp.stack([w, 2 * w])
    got = jax.vmap(lambda w: conv2d(x[0], w, padding=1))(ws)
    assert_close(got, jnp.stack([conv2d(x[0], wi, padding=1) for wi in ws]))
    grad = jax.grad(lambda x, w: jnp.sum(conv2d(x, w, padding=1) ** 2), 1)
    assert_close(jax.vmap(grad, (0, None))(x, w), jnp.stack([grad(xi, w) for xi in x]))


def test_stays_on_xla_convolution():
    x, w = _inputs((1, 2, 5, 5), (3, 2, 3, 3))
    text = hlo_text(jax.grad(lambda x, w: jnp.sum(conv2d(x, w) ** 2), (0, 1)), x, w)
    assert "convolution" in text and "custom_call" not in text


def test_zero_sized():
    x, w = _inputs((0, 2, 5, 5), (3, 2, 3, 3))
    assert conv2d(x, w).shape == (0, 3, 3, 3)
    dx, dw = jax.grad(lambda x, w: jnp.sum(conv2d(x, w)), (0, 1))(x, w)
    assert dx.shape == x.shape
    np.testing.assert_array_equal(dw, np.zeros(w.shape))
    x, w = _inputs((1, 2, 5, 5), (0, 2, 3, 3))
    assert conv2d(x, w).shape == (1, 0, 3, 3)


def test_errors():
    x, w = _inputs((1, 4, 5, 5), (2, 4, 3, 3))
    with pytest.raises(TypeError, match="x must be floating"):
        conv2d(jnp.ones((1, 4, 5, 5), jnp.int32), w)
    with pytest.raises(ValueError, match="NCHW"):
        conv2d(x[0], w)
    with pytest.raises(ValueError, match="OIHW"):
        conv2d(x, w[0])
    with pytest.raises(ValueError, match="groups=3 must divide"):
        conv2d(x, w, groups=3)
    with pytest.raises(ValueError, match=r"w.shape\[1\]=4 must be C_in/groups=2"):
        conv2d(x, w, groups=2)
    with pytest.raises(ValueError, match="exceeds the padded input"):
        conv2d(x, w, dilation=3)
    with pytest.raises(ValueError, match="stride"):
        conv2d(x, w, stride=(0, 1))
    with pytest.raises(ValueError, match="groups must be a positive int"):
        conv2d(x, w, groups=0)


@pytest.mark.parametrize("kw", [dict(padding=(1.7, 1.7)), dict(stride=(1.5, 1.5)), dict(dilation=(2.9, 1.0)),
                                dict(stride=(True, True)), dict(padding=1.0), dict(stride=(2, 2.0))])
def test_geometry_that_is_not_integers_is_refused(kw):
    """A float or bool in a pair is refused, not truncated (padding (1.7, 1.7) ran as 1)."""
    x, w = _inputs((1, 2, 6, 6), (3, 2, 3, 3))
    with pytest.raises(TypeError, match="must be an int or a pair of ints"):
        conv2d(x, w, **kw)


def test_numpy_integers_are_geometry():
    x, w = _inputs((1, 2, 6, 6), (3, 2, 3, 3))
    got = conv2d(x, w, stride=np.int64(2), padding=(np.int32(1), 1), groups=np.int64(1))
    np.testing.assert_array_equal(got, conv2d(x, w, stride=2, padding=1))
