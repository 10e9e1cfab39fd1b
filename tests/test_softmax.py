"""Softmax: kernels vs pure-JAX references, gradients in every mode, vmap, errors."""

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
from rlx_jax.ops import softmax, softmax_backward
from rlx_jax.vjp_rules.softmax import reference_softmax_bwd_x, softmax_bwd_x
from testutil import assert_close, hlo_text, platform, assert_same_bits_on_one_core_without_avx512

SHAPES = [(3, 5, 33), (1, 1), (2, 1025), (0, 16), (3, 0)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _x(shape, dtype, seed=0, scale=3.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)).astype(dtype)


def test_kernels_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_softmax_fwd_v1", "rlx_softmax_bwd_v1", "rlx_softmax_bwd_x_v1"} <= set(info["targets"])
    x = _x((4, 8), jnp.float32)
    # reverse mode runs the backward from x (exact target names: rlx_softmax_bwd is a prefix)
    assert _targets(hlo_text(jax.grad(lambda x: jnp.sum(softmax(x) ** 2)), x)) == {
        "rlx_softmax_fwd_v1", "rlx_softmax_bwd_x_v1"}
    # forward mode runs it as the tangent map
    assert "rlx_softmax_bwd_x_v1" in _targets(hlo_text(lambda x: jax.jvp(softmax, (x,), (x,))[1], x))
    # the RLX SoftmaxBackward op's wrapper, which receives y, keeps rlx_softmax_bwd
    assert _targets(hlo_text(softmax_backward, x, x)) == {"rlx_softmax_bwd_v1"}


def _targets(text):
    """The rlx_* custom-call targets in a lowered (StableHLO) or compiled (HLO) text."""
    return set(re.findall(r"@(rlx_\w+)\(", text)) | set(re.findall(r'custom_call_target="(rlx_\w+)"', text))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, dtype):
    x = _x(shape, dtype)
    got = jax.jit(softmax)(x)
    assert got.dtype == dtype and got.shape == shape
    assert_close(got, jax.nn.softmax(x.astype(jnp.float32), axis=-1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_autodiff(shape, dtype):
    x, dy = _x(shape, dtype), _x(shape, dtype, seed=1, scale=1.0)
    y = softmax(x)
    got = jax.jit(softmax_backward)(y, dy)
    yf = y.astype(jnp.float32)
    # oracle: dx = y * (dy - <y, dy>) in f32 from the rounded y
    want = yf * (dy.astype(jnp.float32) - jnp.sum(yf * dy.astype(jnp.float32), -1, keepdims=True))
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    # and jax.grad of the op equals XLA's autodiff of jax.nn.softmax
    gx = jax.grad(lambda x: jnp.sum(softmax(x).astype(jnp.float32) * dy.astype(jnp.float32)))(x)
    gr = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x.astype(jnp.float32)) * dy.astype(jnp.float32)))(x)
    assert_close(gx, gr, dtype)


@pytest.mark.parametrize("axis", [0, 1, -1, -3])
def test_any_axis(axis):
    x, w = _x((3, 4, 5), jnp.float32), _x((3, 4, 5), jnp.float32, seed=2)
    assert_close(softmax(x, axis=axis), jax.nn.softmax(x, axis=axis))
    g = jax.grad(lambda x: jnp.sum(softmax(x, axis=axis) * w))(x)
    assert_close(g, jax.grad(lambda x: jnp.sum(jax.nn.softmax(x, axis=axis) * w))(x))
    assert_close(softmax_backward(softmax(x, axis=axis), w, axis=axis), g)


def test_masked_entries_are_exactly_zero():
    x = jnp.array([[0.0, -jnp.inf, 1.0, -jnp.inf], [-jnp.inf, 2.0, 2.0, -1e30]], jnp.float32)
    y = np.asarray(softmax(x))
    assert y[0, 1] == 0 and y[0, 3] == 0 and y[1, 0] == 0 and y[1, 3] == 0
    assert_close(y, jax.nn.softmax(x))


def test_large_logits_are_stable():
    x = jnp.array([[1e4, 1e4 - 1.0, -1e4]], jnp.float32)
    assert_close(softmax(x), jax.nn.softmax(x))


def test_check_grads_f64(x64):
    x = jax.random.normal(jax.random.PRNGKey(3), (3, 6), jnp.float64)
    assert "rlx_softmax_bwd" in hlo_text(jax.grad(lambda x: jnp.sum(softmax(x) ** 3)), x)
    check_grads(lambda x: softmax(x, axis=0), (x,), order=2, modes=("fwd", "rev"))
    check_grads(lambda x: softmax(x) ** 2, (x,), order=2, modes=("fwd", "rev"))
    dy = jax.random.normal(jax.random.PRNGKey(4), (3, 6), jnp.float64)
    check_grads(lambda y, d: softmax_backward(y, d), (softmax(x), dy), order=2, modes=("fwd", "rev"))


def test_vmap():
    x = _x((5, 3, 7), jnp.float32)
    assert_close(jax.vmap(softmax, in_axes=1, out_axes=1)(x), jax.nn.softmax(x))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(softmax(x) ** 2)))(x)
    assert_close(g, jax.vmap(jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) ** 2)))(x))
    y, dy = softmax(x), _x((5, 3, 7), jnp.float32, seed=1)
    assert_close(jax.vmap(softmax_backward, in_axes=(0, None))(y, dy[0]), jax.vmap(softmax_backward)(y, jnp.broadcast_to(dy[0], y.shape)))


def test_errors():
    with pytest.raises(TypeError, match="floating"):
        softmax(jnp.arange(4))
    with pytest.raises(ValueError, match="axis"):
        softmax(jnp.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match="at least one axis"):
        softmax(jnp.float32(1.0))
    with pytest.raises(ValueError, match="dy shape"):
        softmax_backward(jnp.ones((2, 3)), jnp.ones((3, 2)))


# ---- the backward from x (target rlx_softmax_bwd_x) -----------------------------------

BWD_X_SHAPES = SHAPES + [(4, 7), (3, 17), (2, 1031), (5, 2, 9)]


def _bwd_x_oracle(x, dy):
    """NumPy f64: y = softmax(x), dx = y * (dy - sum(dy * y))."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    if x.size == 0:
        return np.zeros(x.shape)
    e = np.exp(x - x.max(-1, keepdims=True))
    y = e / e.sum(-1, keepdims=True)
    return y * (dy - (y * dy).sum(-1, keepdims=True))


def test_grad_drops_the_forward_kernel_when_y_is_unused():
    """sum(softmax(x) * w): the pullback reads x only, so the compiled gradient has no
    forward kernel left (XLA removes it as dead code); the value-and-grad keeps it."""
    x, w = _x((16, 40), jnp.float32), _x((16, 40), jnp.float32, seed=5)
    grad = jax.grad(lambda x: jnp.sum(softmax(x) * w))
    compiled = jax.jit(grad).lower(x).compile().as_text()
    assert _targets(compiled) == {"rlx_softmax_bwd_x_v1"}
    assert_close(grad(x), _bwd_x_oracle(x, w))
    vg = jax.jit(jax.value_and_grad(lambda x: jnp.sum(softmax(x) * w))).lower(x).compile().as_text()
    assert _targets(vg) == {"rlx_softmax_fwd_v1", "rlx_softmax_bwd_x_v1"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BWD_X_SHAPES)
def test_backward_from_x_matches_reference(shape, dtype):
    x, dy = _x(shape, dtype, seed=6), _x(shape, dtype, seed=7, scale=1.0)
    f = jax.jit(lambda x, dy: softmax_bwd_x(x, dy)[0])
    assert "rlx_softmax_bwd_x_v1" in _targets(f.lower(x, dy).as_text())
    got = f(x, dy)
    assert got.dtype == dtype and got.shape == shape
    assert_close(got, _bwd_x_oracle(x.astype(jnp.float32), dy.astype(jnp.float32)), dtype)
    assert_close(got, reference_softmax_bwd_x(x, dy)[0], dtype)


def test_backward_from_x_f64(x64):
    x = jax.random.normal(jax.random.PRNGKey(8), (7, 37), jnp.float64) * 4
    dy = jax.random.normal(jax.random.PRNGKey(9), (7, 37), jnp.float64)
    f = jax.jit(lambda x, dy: softmax_bwd_x(x, dy)[0])
    if platform() == "cpu":  # the CUDA kernels take no f64: the reference runs there
        assert "rlx_softmax_bwd_x_v1" in _targets(f.lower(x, dy).as_text())
    np.testing.assert_allclose(np.asarray(f(x, dy)), _bwd_x_oracle(x, dy), rtol=1e-12, atol=1e-13)
    check_grads(lambda x, d: softmax_bwd_x(x, d)[0], (x[:3, :6], dy[:3, :6]), order=2, modes=("fwd", "rev"))


def test_backward_from_x_masked_and_large_logits():
    x = jnp.array([[0.0, -jnp.inf, 1.0, -jnp.inf, 3.0], [1e4, 1e4 - 1.0, -1e4, -jnp.inf, 2.0]], jnp.float32)
    dy = _x(x.shape, jnp.float32, seed=10, scale=1.0)
    got = np.asarray(jax.jit(lambda x, dy: softmax_bwd_x(x, dy)[0])(x, dy))
    assert got[0, 1] == 0 and got[0, 3] == 0 and got[1, 3] == 0
    assert_close(got, _bwd_x_oracle(x, dy))
    # jax.grad through ops.softmax agrees with XLA's autodiff of jax.nn.softmax there
    g = jax.grad(lambda x: jnp.sum(softmax(x) * dy))(x)
    assert_close(g, jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) * dy))(x))


def test_backward_from_x_vmap_keeps_kernel():
    x, dy = _x((4, 3, 9), jnp.float32, seed=11), _x((4, 3, 9), jnp.float32, seed=12)
    f = jax.vmap(lambda x, d: softmax_bwd_x(x, d)[0], in_axes=(1, None), out_axes=1)
    assert "rlx_softmax_bwd_x_v1" in _targets(hlo_text(f, x, dy[:, 0]))
    want = _bwd_x_oracle(x, np.broadcast_to(np.asarray(dy[:, 0])[:, None], x.shape))
    assert_close(f(x, dy[:, 0]), want)
    # per-example gradients through the op
    g = jax.vmap(jax.grad(lambda x, d: jnp.sum(softmax(x) * d)))
    assert "rlx_softmax_bwd_x_v1" in _targets(hlo_text(g, x, dy))
    assert_close(g(x, dy), _bwd_x_oracle(x, dy))


def test_backward_from_x_rejects_mismatched_operands():
    x = jnp.ones((4, 8), jnp.float32)
    call = jax.ffi.ffi_call("rlx_softmax_bwd_x_v1", (jax.ShapeDtypeStruct((4, 8), jnp.float32),))
    with pytest.raises(Exception, match="dy must match"):
        jax.block_until_ready(jax.jit(call)(x, jnp.ones((4, 8), jnp.bfloat16)))
    bad = jax.ffi.ffi_call("rlx_softmax_bwd_x_v1", (jax.ShapeDtypeStruct((8, 4), jnp.float32),))
    with pytest.raises(Exception, match="dx must match"):
        jax.block_until_ready(jax.jit(bad)(x, x))


# ---- f32 / bf16 rows in 16-element blocks (CPU) -----------------------------------------

cpu_only = pytest.mark.skipif(platform() != "cpu", reason="the CPU kernels' row bodies")

BLOCK_WIDTHS = (7, 16, 45, 1000, 1050)  # tail only, one block, blocks + tail, 32-blocks + tail


def _three_kernels(x, dy):
    """y = softmax(x), the backward from y (rlx_softmax_bwd) and from x (rlx_softmax_bwd_x)."""
    y = jax.jit(softmax)(x)
    return y, jax.jit(softmax_backward)(y, dy), jax.jit(lambda x, d: softmax_bwd_x(x, d)[0])(x, dy)


@cpu_only
@pytest.mark.parametrize("width", BLOCK_WIDTHS)
def test_cpu_bf16_rows_are_the_f32_rows_rounded(width):
    """A bf16 row runs the f32 row's operations on the widened values and rounds each result
    once (to nearest even): its bits are the f32 kernel's on the same values, rounded."""
    x = _x((5, width), jnp.bfloat16, seed=width)
    dy = _x((5, width), jnp.bfloat16, seed=width + 1, scale=1.0)
    y16 = softmax(x)
    got = _three_kernels(x, dy)[::2] + (jax.jit(softmax_backward)(y16, dy),)
    f32 = lambda a: a.astype(jnp.float32)
    want = (jax.jit(softmax)(f32(x)), jax.jit(lambda x, d: softmax_bwd_x(x, d)[0])(f32(x), f32(dy)),
            jax.jit(softmax_backward)(f32(y16), f32(dy)))
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16),
                                      np.asarray(w).astype(ml_dtypes.bfloat16).view(np.uint16))


@cpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_inf_and_nan_in_blocks_and_tail(dtype):
    """-inf entries (in a 16-block and in the tail) get exactly 0 in y and dx; a NaN makes
    its row NaN, as in the reference; the other rows stay finite and close."""
    x = _x((4, 45), dtype, seed=13)
    x = x.at[0, 5].set(-jnp.inf).at[0, 40].set(-jnp.inf).at[1, 20].set(jnp.nan).at[2, 44].set(jnp.nan)
    dy = _x((4, 45), dtype, seed=14, scale=1.0)
    y, dx_y, dx_x = (np.asarray(a.astype(jnp.float32)) for a in _three_kernels(x, dy))
    assert y[0, 5] == 0 and y[0, 40] == 0 and dx_x[0, 5] == 0 and dx_x[0, 40] == 0 and dx_y[0, 40] == 0
    want_y = np.asarray(jax.nn.softmax(x.astype(jnp.float32), axis=-1))
    want_dx = _bwd_x_oracle(x.astype(jnp.float32), dy.astype(jnp.float32))
    for got, want in ((y, want_y), (dx_x, want_dx)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(got[[1, 2]]).all() and np.isfinite(got[[0, 3]]).all()
        assert_close(jnp.asarray(got[[0, 3]]), jnp.asarray(want[[0, 3]]), dtype)


def _softmax_digest() -> str:
    """sha256 of the CPU kernels' y, dx (from y) and dx (from x) for f32 and bf16 rows of
    widths that use 32-element blocks, a last 16-element block and a tail."""
    h = hashlib.sha256()
    for dtype in (jnp.float32, jnp.bfloat16):
        for width in BLOCK_WIDTHS:
            x = _x((9, width), dtype, seed=width)
            dy = _x((9, width), dtype, seed=width + 1, scale=1.0)
            for leaf in _three_kernels(x, dy):
                h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


@cpu_only
def test_cpu_same_bits_with_the_avx2_body_and_one_thread():
    """A fresh process pinned to one core and forced onto the AVX2 / baseline row clones
    (RLX_JAX_CPU_NO_AVX512) gives the same bits as this one (several threads; the
    AVX-512 body where the CPU has it)."""
    assert_same_bits_on_one_core_without_avx512(_softmax_digest)
