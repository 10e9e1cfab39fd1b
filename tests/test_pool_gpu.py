"""Pooling on the GPU: the CUDA kernels rlx_max_pool2d_fwd, rlx_max_pool2d_bwd and
rlx_avg_pool2d_bwd against the pure-JAX references (f32 on the GPU), and the f32 average
pooling gradient against the CPU kernel bit for bit (same order of additions). Skipped
where JAX sees no GPU.

Geometries: non-overlapping, overlapping, padded, non-square windows and strides,
windows lying wholly in the padding (argmax -1, y = -inf), odd plane sizes, an empty
spatial axis, zero planes, planes too large for one block's shared memory (bands of rows)
rows too wide for any (the untiled fallback kernels), and the direct kernels' geometries
(k3s2p1 and k2s2p0 on rows of whole 16-byte vectors, aligned and unaligned output rows); ties (integer-valued inputs) must pick the first maximum in
row-major window order as the CPU kernel does. The saved argmax is window-local int8 where
kh * kw <= 127, else the flat int32 index: windows of 127 (1x127) and 128 (8x16, 2x64)
positions on the tiled and untiled kernels check both encodings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
import rlx_jax._kernels
from gpu_testutil import as_f32, assert_close, gpu, requires_gpu
from rlx_jax.ops import avg_pool2d, avg_pool2d_backward, max_pool2d, max_pool2d_backward
from rlx_jax.vjp_rules.pool import (
    argmax_dtype,
    flat_argmax,
    max_pool2d_fwd,
    out_size,
    reference_avg_pool2d,
    reference_avg_pool2d_bwd,
    reference_max_pool2d,
    reference_max_pool2d_bwd,
)

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
TARGETS = ("rlx_max_pool2d_fwd_v1", "rlx_max_pool2d_bwd_v1")
AVG_TARGET = "rlx_avg_pool2d_bwd_v1"

# (x shape, kernel, stride, padding)
GEOMS = [
    ((2, 3, 8, 8), (2, 2), (2, 2), (0, 0)),
    ((2, 3, 7, 9), (3, 3), (2, 2), (1, 1)),
    ((1, 2, 11, 13), (3, 3), (1, 1), (1, 1)),  # overlap: every input in up to 9 windows
    ((3, 2, 9, 10), (2, 3), (1, 2), (1, 0)),  # non-square window / stride / padding
    ((1, 1, 4, 5), (2, 2), (1, 1), (2, 2)),  # windows wholly in the padding
    ((2, 2, 5, 5), (5, 5), (1, 1), (0, 0)),  # one window = the whole plane
    ((2, 1, 3, 6, 7), (3, 2), (3, 1), (1, 1)),  # rank 5: three plane axes
    ((1, 1, 33, 65), (4, 4), (3, 5), (2, 1)),
    ((1, 2, 200, 150), (3, 3), (2, 2), (1, 1)),  # planes over the shared-memory budget: bands
    ((1, 1, 97, 301), (3, 2), (1, 2), (1, 0)),  # bands, odd rows and columns
    ((1, 2, 3, 7001), (2, 2), (1, 1), (0, 0)),  # rows too wide for 48 KB: untiled kernels
    # the direct kernels (k3s2p1 / k2s2p0, width a multiple of a 16-byte vector, else tiled;
    # max pooling in every dtype, the average backward in bf16 / f16):
    ((2, 3, 9, 16), (3, 3), (2, 2), (1, 1)),  # odd height; f32 and 16-bit: direct
    ((1, 2, 13, 20), (3, 3), (2, 2), (1, 1)),  # f32 direct with Wo = 10 (unaligned output rows); 16-bit tiled
    ((3, 2, 10, 24), (2, 2), (2, 2), (0, 0)),
    ((1, 1, 7, 12), (2, 2), (2, 2), (0, 0)),  # f32 direct, Wo = 6, the last input row in no window
]
# the argmax encodings' boundary: 127 window positions (int8, indices up to 126) and 128
# (int32 flat index). Their pure-JAX references take 127-128 strided views, slow to compile
# for every dtype: in the default set they run in f32 against the CPU kernels
# (test_max_pool_f32_same_bits_as_cpu_kernel) and in the boundary sanitizer test; the
# dtype x ties matrices take them under -m slow.
BOUNDARY_GEOMS = [
    ((2, 2, 3, 140), (1, 127), (1, 3), (0, 1)),  # int8, tiled
    ((1, 2, 20, 40), (8, 16), (3, 5), (2, 3)),  # int32, tiled
    ((1, 1, 3, 7001), (2, 64), (1, 1), (0, 0)),  # int32, rows too wide for 48 KB: untiled
]


def _gid(g):
    shape, k, s, p = g
    return f"{'x'.join(map(str, shape))}-k{k[0]}{k[1]}s{s[0]}{s[1]}p{p[0]}{p[1]}"


BASE_GEOMS = list(GEOMS)
GEOMS = BASE_GEOMS + [pytest.param(g, marks=pytest.mark.slow, id=_gid(g)) for g in BOUNDARY_GEOMS]


def _geom(k, s, p):
    return dict(kernel_size=k, stride=s, padding=p)


def _put(*arrays):
    dev = gpu()
    return [jax.device_put(a, dev) for a in arrays]


def _x(shape, dtype, seed, ties=False):
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
    if ties:  # few distinct values: many equal maxima per window
        x = jnp.round(2 * x)
    return x.astype(dtype)


def _dy(shape, dtype, seed):
    return jax.random.normal(jax.random.PRNGKey(seed + 1000), shape, jnp.float32).astype(dtype)


def _close(got, want, dtype, what):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what)


def test_cuda_targets_registered_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert set(TARGETS) <= set(info["targets"])
    (x,) = _put(_x((2, 3, 8, 8), jnp.float32, 0))
    geom = _geom((3, 3), (2, 2), (1, 1))
    loss = lambda x: jnp.sum(max_pool2d(x, **geom) ** 2)
    text = jax.jit(jax.grad(loss)).lower(x).as_text()
    for t in TARGETS:
        assert t in text, f"{t} not in the lowered HLO on GPU (silent fallback)"
    assert AVG_TARGET in info["targets"]
    text = jax.jit(jax.grad(lambda x: jnp.sum(avg_pool2d(x, **geom) ** 2))).lower(x).as_text()
    assert AVG_TARGET in text, "rlx_avg_pool2d_bwd not in the lowered HLO on GPU (silent fallback)"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("g", GEOMS, ids=_gid)
def test_max_pool_forward_exact(g, ties, dtype):
    """y and argmax equal the reference's bit for bit (max is exact; first maximum)."""
    shape, k, s, p = g
    (x,) = _put(_x(shape, dtype, seed=len(shape) + k[0], ties=ties))
    y, am = jax.jit(lambda x: max_pool2d_fwd(x, **_geom(k, s, p)))(x)
    y_ref, am_ref = reference_max_pool2d(x, **_geom(k, s, p))
    assert y.dtype == dtype and am.dtype == am_ref.dtype == argmax_dtype(k)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(y_ref.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(am), np.asarray(am_ref))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("g", GEOMS, ids=_gid)
def test_max_pool_gradient(g, ties, dtype):
    """dx through jax.vjp of max_pool2d and through max_pool2d_backward (the RLX op's
    wrapper) vs the f32 reference scatter at the reference argmax; without ties also vs
    XLA's autodiff of the reference max (f32)."""
    shape, k, s, p = g
    geom = _geom(k, s, p)
    x = _x(shape, dtype, seed=7 + k[1], ties=ties)
    y_ref, am_ref = reference_max_pool2d(x, **geom)
    dy = _dy(y_ref.shape, dtype, seed=3)
    x, dy = _put(x, dy)
    y, pull = jax.vjp(lambda x: max_pool2d(x, **geom), x)
    (dx,) = jax.jit(pull)(dy)
    dx2 = jax.jit(lambda x, dy: max_pool2d_backward(x, dy, **geom))(x, dy)
    (want,) = reference_max_pool2d_bwd(dy.astype(jnp.float32), am_ref, in_hw=shape[-2:], **geom)
    assert dx.dtype == dtype and dx.shape == x.shape
    _close(dx, want, dtype, "dx (vjp)")
    _close(dx2, want, dtype, "dx (max_pool2d_backward)")
    if not ties and dtype == jnp.float32:  # 16-bit rounding makes ties even in normal data
        xf, dyf = as_f32(x, dy)
        (want_ad,) = jax.vjp(lambda x: reference_max_pool2d(x, **geom)[0], xf)[1](dyf)
        _close(dx, want_ad, dtype, "dx vs XLA autodiff")


def test_max_pool_sanitizer_small():
    """Small overlapping + padded case with ties and -inf windows (run under memcheck)."""
    geom = _geom((3, 2), (2, 1), (1, 1))
    x = _x((2, 3, 5, 6), jnp.float32, seed=1, ties=True)
    x = x.at[0, 0].set(-jnp.inf)  # a plane of -inf: argmax -1 everywhere, no gradient
    y_ref, am_ref = reference_max_pool2d(x, **geom)
    dy = _dy(y_ref.shape, jnp.float32, seed=2)
    x, dy = _put(x, dy)
    y, pull = jax.vjp(lambda x: max_pool2d(x, **geom), x)
    _, am = jax.jit(lambda x: max_pool2d_fwd(x, **geom))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(am), np.asarray(am_ref))
    assert (np.asarray(am)[0, 0] == -1).all()
    (dx,) = pull(dy)
    (want,) = reference_max_pool2d_bwd(dy, am_ref, in_hw=(5, 6), **geom)
    _close(dx, want, jnp.float32, "dx")
    np.testing.assert_array_equal(np.asarray(dx)[0, 0], 0)


@pytest.mark.parametrize("shape,k,s,p", [((0, 3, 6, 6), (2, 2), (2, 2), (0, 0)),
                                         ((2, 3, 0, 5), (2, 2), (1, 1), (1, 1))],
                         ids=["zero_planes", "zero_height"])
def test_zero_sized(shape, k, s, p):
    geom = _geom(k, s, p)
    (x,) = _put(jnp.zeros(shape, jnp.float32))
    y, am = jax.jit(lambda x: max_pool2d_fwd(x, **geom))(x)
    y_ref, am_ref = reference_max_pool2d(x, **geom)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))  # zero height: all -inf
    np.testing.assert_array_equal(np.asarray(am), np.asarray(am_ref))
    dy = jnp.ones(y.shape, jnp.float32)
    (dx,) = jax.jit(jax.vjp(lambda x: max_pool2d(x, **geom), x)[1])(dy)
    assert dx.shape == shape


def test_vmap_keeps_kernels():
    geom = _geom((3, 3), (2, 2), (1, 1))
    x, dy = _put(_x((4, 2, 3, 9, 9), jnp.float32, seed=8), _dy((4, 2, 3, 5, 5), jnp.float32, seed=8))

    f = jax.jit(jax.vmap(lambda x, dy: jax.vjp(lambda x: max_pool2d(x, **geom), x)[1](dy)[0]))
    text = f.lower(x, dy).as_text()
    for t in TARGETS:
        assert t in text
    dm = f(x, dy)
    wm = jax.vmap(lambda x, dy: jax.vjp(lambda x: reference_max_pool2d(x, **geom)[0], x)[1](dy)[0])(x, dy)
    _close(dm, wm, jnp.float32, "max dx")


def test_second_order_through_kernels():
    """grad of (grad . v): the backward's transpose is the tangent; max pool is piecewise
    linear, so the gradient of <dL/dx, v> w.r.t. dy-weights is checked against jvp."""
    geom = _geom((2, 2), (2, 2), (0, 0))
    (x,) = _put(_x((1, 2, 6, 6), jnp.float32, seed=9))
    v = jnp.ones_like(x)
    f = lambda x: jnp.sum(jnp.sin(max_pool2d(x, **geom)))
    hvp = jax.jit(lambda x: jax.jvp(jax.grad(f), (x,), (v,))[1])(x)
    fr = lambda x: jnp.sum(jnp.sin(reference_max_pool2d(x, **geom)[0]))
    want = jax.jvp(jax.grad(fr), (x,), (v,))[1]
    _close(hvp, want, jnp.float32, "hvp")


def test_bad_operands_raise():
    """The CUDA handlers refuse inconsistent calls with an error, not a crash."""
    geom = dict(kh=np.int64(2), kw=np.int64(2), sh=np.int64(2), sw=np.int64(2), ph=np.int64(0), pw=np.int64(0))
    dy, am = _put(jnp.ones((1, 2, 3, 3), jnp.float32), jnp.zeros((1, 2, 3, 3), jnp.int8))
    bad_dx = (jax.ShapeDtypeStruct((1, 2, 9, 9), jnp.float32),)  # 9x9 pools to 4x4, not 3x3
    with pytest.raises(Exception, match="pooled dims"):
        jax.block_until_ready(jax.jit(lambda dy, am: jax.ffi.ffi_call("rlx_max_pool2d_bwd_v1", bad_dx)(dy, am, **geom))(dy, am))
    with pytest.raises(Exception, match="stride"):
        jax.block_until_ready(jax.jit(lambda dy, am: jax.ffi.ffi_call("rlx_max_pool2d_bwd_v1", bad_dx)(
            dy, am, **{**geom, "sh": np.int64(0)}))(dy, am))
    # a 2x2 window saves an int8 window-local argmax: an int32 one is refused
    (am32,) = _put(jnp.zeros((1, 2, 3, 3), jnp.int32))
    good_dx = (jax.ShapeDtypeStruct((1, 2, 6, 6), jnp.float32),)
    with pytest.raises(Exception, match="argmax must be i8"):
        jax.block_until_ready(jax.jit(lambda dy, am: jax.ffi.ffi_call("rlx_max_pool2d_bwd_v1", good_dx)(dy, am, **geom))(dy, am32))


@pytest.mark.parametrize("g", BASE_GEOMS + BOUNDARY_GEOMS, ids=_gid)
def test_max_pool_f32_same_bits_as_cpu_kernel(g):
    """f32: y, argmax (its dtype by the window) and dx (max_pool2d_backward: forward +
    backward kernels) equal the CPU kernels' bit for bit (same first maximum, same sums in
    the same order), with ties."""
    shape, k, s, p = g
    geom = _geom(k, s, p)
    if not rlx_jax._kernels.has_kernel("cpu", "rlx_max_pool2d_bwd_v1"):
        pytest.skip("no CPU kernel compiled: nothing to compare bits with")
    x = _x(shape, jnp.float32, seed=31, ties=True)
    ho, wo = (out_size(n, kk, ss, pp) for n, kk, ss, pp in zip(shape[-2:], k, s, p))
    dy = _dy(shape[:-2] + (ho, wo), jnp.float32, seed=31)
    fwd = jax.jit(lambda x: max_pool2d_fwd(x, **geom))
    bwd = jax.jit(lambda x, dy: max_pool2d_backward(x, dy, **geom))
    cpu = jax.devices("cpu")[0]
    xc, dyc = jax.device_put(x, cpu), jax.device_put(dy, cpu)
    (y, am), (yc, amc) = fwd(*_put(x)), fwd(xc)
    assert am.dtype == amc.dtype == argmax_dtype(k)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(yc))
    np.testing.assert_array_equal(np.asarray(am), np.asarray(amc))
    np.testing.assert_array_equal(np.asarray(bwd(*_put(x, dy))), np.asarray(bwd(xc, dyc)))


def test_max_pool_argmax_boundary_sanitizer_small():
    """Windows of 127 positions (int8 argmax up to 126) and 128 (int32 flat argmax), tiled
    kernels, ties, a -inf plane and windows reaching into the padding: argmax equal to the
    reference, decoded to the same flat index, dx equal to the reference scatter (run
    under memcheck / racecheck)."""
    for shape, k, s, p in (((2, 2, 3, 133), (1, 127), (1, 2), (0, 1)), ((1, 2, 12, 20), (8, 16), (2, 3), (1, 2))):
        geom = _geom(k, s, p)
        x = _x(shape, jnp.float32, seed=41, ties=True).at[0, 0].set(-jnp.inf)
        y_ref, am_ref = reference_max_pool2d(x, **geom)
        dy = _dy(y_ref.shape, jnp.float32, seed=41)
        x, dy = _put(x, dy)
        y, am = jax.jit(lambda x: max_pool2d_fwd(x, **geom))(x)
        assert am.dtype == argmax_dtype(k) == (jnp.int8 if k[0] * k[1] <= 127 else jnp.int32)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
        np.testing.assert_array_equal(np.asarray(am), np.asarray(am_ref))
        np.testing.assert_array_equal(np.asarray(flat_argmax(am, in_hw=shape[-2:], **geom)),
                                      np.asarray(flat_argmax(am_ref, in_hw=shape[-2:], **geom)))
        assert (np.asarray(am)[0, 0] == -1).all()
        dx = jax.jit(lambda x, dy: max_pool2d_backward(x, dy, **geom))(x, dy)
        (want,) = reference_max_pool2d_bwd(dy, am_ref, in_hw=shape[-2:], **geom)
        _close(dx, want, jnp.float32, "dx")


# ---- average pooling backward -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("g", GEOMS, ids=_gid)
def test_avg_pool_gradient(g, dtype):
    """dx through jax.vjp of avg_pool2d and through avg_pool2d_backward vs the f32
    reference (XLA's transpose of the f32 average pool)."""
    shape, k, s, p = g
    geom = _geom(k, s, p)
    x = _x(shape, dtype, seed=11 + k[0])
    dy = _dy(reference_avg_pool2d(x, **geom)[0].shape, dtype, seed=5)
    x, dy = _put(x, dy)
    _, pull = jax.vjp(lambda x: avg_pool2d(x, **geom), x)
    (dx,) = jax.jit(pull)(dy)
    dx2 = jax.jit(lambda dy: avg_pool2d_backward(dy, x_shape=shape, **geom))(dy)
    (want,) = reference_avg_pool2d_bwd(dy.astype(jnp.float32), in_hw=shape[-2:], **geom)
    assert dx.dtype == dtype and dx.shape == x.shape
    _close(dx, want, dtype, "dx (vjp)")
    _close(dx2, want, dtype, "dx (avg_pool2d_backward)")


@pytest.mark.parametrize("g", GEOMS, ids=_gid)
def test_avg_pool_f32_same_bits_as_cpu_kernel(g):
    """f32: the CUDA kernel adds in the CPU kernel's order (row sums over the covering
    columns, then over the covering rows, times 1/(kh kw)), so dx is bitwise equal."""
    shape, k, s, p = g
    geom = _geom(k, s, p)
    if k[0] <= s[0] and k[1] <= s[1]:
        pytest.skip("windows do not overlap: f32 runs XLA's code on CUDA (test_avg_pool_no_overlap_routing)")
    if not rlx_jax._kernels.has_kernel("cpu", AVG_TARGET):
        pytest.skip("no CPU kernel compiled: nothing to compare bits with")
    ho, wo = (out_size(n, kk, ss, pp) for n, kk, ss, pp in zip(shape[-2:], k, s, p))
    dy = _dy(shape[:-2] + (ho, wo), jnp.float32, seed=17)
    f = jax.jit(lambda dy: avg_pool2d_backward(dy, x_shape=shape, **geom))
    got = np.asarray(f(*_put(dy)))
    want = np.asarray(f(jax.device_put(dy, jax.devices("cpu")[0])))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_avg_pool_no_overlap_routing(dtype):
    """Non-overlapping windows (k <= s on both axes): f32 lowers XLA's code of the
    reference on CUDA (XLA's upsampling fusion was faster there), 16-bit dtypes the kernel
    (it beat XLA there); values match the reference either way."""
    geom = _geom((2, 2), (2, 2), (0, 0))
    x, dy = _put(_x((2, 3, 8, 10), dtype, seed=3), _dy((2, 3, 4, 5), dtype, seed=3))
    f = jax.jit(lambda x, dy: jax.vjp(lambda x: avg_pool2d(x, **geom), x)[1](dy)[0])
    lowered = AVG_TARGET in f.lower(x, dy).as_text()
    assert lowered == (jnp.dtype(dtype).itemsize == 2)
    (want,) = reference_avg_pool2d_bwd(dy.astype(jnp.float32), in_hw=(8, 10), **geom)
    _close(f(x, dy), want, dtype, "dx")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_avg_pool_sanitizer_small(dtype):
    """Small overlapping, padded, odd-sized case (run under memcheck / racecheck)."""
    geom = _geom((3, 2), (2, 1), (1, 1))
    shape = (2, 3, 5, 7)
    dy = _dy(reference_avg_pool2d(jnp.zeros(shape, jnp.float32), **geom)[0].shape, dtype, seed=4)
    (dy,) = _put(dy)
    dx = jax.jit(lambda dy: avg_pool2d_backward(dy, x_shape=shape, **geom))(dy)
    (want,) = reference_avg_pool2d_bwd(dy.astype(jnp.float32), in_hw=shape[-2:], **geom)
    _close(dx, want, dtype, "dx")


def test_pool_band_sanitizer_small():
    """Planes over the shared-memory budget (bands of rows, halo rows shared by two
    bands): max forward and backward, average backward; small enough for memcheck and
    racecheck."""
    geom = _geom((3, 3), (2, 2), (1, 1))
    shape = (1, 1, 130, 200)
    x = _x(shape, jnp.float32, seed=6, ties=True)
    y_ref, am_ref = reference_max_pool2d(x, **geom)
    dy = _dy(y_ref.shape, jnp.float32, seed=6)
    x, dy = _put(x, dy)
    y, am = jax.jit(lambda x: max_pool2d_fwd(x, **geom))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(am), np.asarray(am_ref))
    dx = jax.jit(lambda x, dy: max_pool2d_backward(x, dy, **geom))(x, dy)
    (want,) = reference_max_pool2d_bwd(dy, am_ref, in_hw=shape[-2:], **geom)
    _close(dx, want, jnp.float32, "max dx")
    dx = jax.jit(lambda dy: avg_pool2d_backward(dy, x_shape=shape, **geom))(dy)
    (want,) = reference_avg_pool2d_bwd(dy, in_hw=shape[-2:], **geom)
    _close(dx, want, jnp.float32, "avg dx")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_pool_direct_sanitizer_small(dtype):
    """The direct kernels (ffi/cuda/pool.cu, k3s2p1 and k2s2p0 on rows of whole 16-byte
    vectors): max forward (ties, a -inf plane) and backward, average backward (direct in
    bf16 / f16, the tiled kernel in f32); the average k2s2p0 kernel through its FFI target (in f32 avg_pool2d lowers XLA's code for
    non-overlapping windows), against the references and, in f32, the CPU kernel's bits. Small enough for
    memcheck and racecheck."""
    shape = (2, 2, 11, 16)
    for k, s, p in (((3, 3), (2, 2), (1, 1)), ((2, 2), (2, 2), (0, 0))):
        geom = _geom(k, s, p)
        x = _x(shape, dtype, seed=21, ties=True).at[1, 0].set(-jnp.inf)
        y_ref, am_ref = reference_max_pool2d(x, **geom)
        dy = _dy(y_ref.shape, dtype, seed=21)
        x, dy = _put(x, dy)
        y, am = jax.jit(lambda x: max_pool2d_fwd(x, **geom))(x)
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(y_ref.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(am), np.asarray(am_ref))
        dx = jax.jit(lambda x, dy: max_pool2d_backward(x, dy, **geom))(x, dy)
        (want,) = reference_max_pool2d_bwd(dy.astype(jnp.float32), am_ref, in_hw=shape[-2:], **geom)
        _close(dx, want, dtype, "max dx")
        attrs = {n: np.int64(v) for n, v in zip(("kh", "kw", "sh", "sw", "ph", "pw"), k + s + p)}
        call = jax.jit(lambda dy: jax.ffi.ffi_call(AVG_TARGET, jax.ShapeDtypeStruct(shape, dtype))(dy, **attrs))
        assert AVG_TARGET in call.lower(dy).as_text()
        dxa = call(dy)
        (want,) = reference_avg_pool2d_bwd(dy.astype(jnp.float32), in_hw=shape[-2:], **geom)
        _close(dxa, want, dtype, "avg dx")
        if dtype == jnp.float32 and rlx_jax._kernels.has_kernel("cpu", AVG_TARGET):
            cpu = jax.devices("cpu")[0]
            np.testing.assert_array_equal(np.asarray(dxa), np.asarray(call(jax.device_put(dy, cpu))))


@pytest.mark.parametrize("shape", [(0, 3, 6, 6), (2, 3, 0, 5)], ids=["zero_planes", "zero_height"])
def test_avg_zero_sized(shape):
    geom = _geom((2, 2), (1, 1), (1, 1))
    (x,) = _put(jnp.zeros(shape, jnp.float32))
    y, pull = jax.vjp(lambda x: avg_pool2d(x, **geom), x)
    (dx,) = jax.jit(pull)(jnp.ones(y.shape, jnp.float32))
    assert dx.shape == shape


def test_avg_vmap_keeps_kernel():
    geom = _geom((3, 3), (2, 2), (1, 1))
    x, dy = _put(_x((4, 2, 3, 9, 9), jnp.float32, seed=8), _dy((4, 2, 3, 5, 5), jnp.float32, seed=8))
    f = jax.jit(jax.vmap(lambda x, dy: jax.vjp(lambda x: avg_pool2d(x, **geom), x)[1](dy)[0]))
    assert AVG_TARGET in f.lower(x, dy).as_text()
    wm = jax.vmap(lambda x, dy: jax.vjp(lambda x: reference_avg_pool2d(x, **geom)[0], x)[1](dy)[0])(x, dy)
    _close(f(x, dy), wm, jnp.float32, "avg dx")


def test_avg_bad_operands_raise():
    geom = dict(kh=np.int64(2), kw=np.int64(2), sh=np.int64(2), sw=np.int64(2), ph=np.int64(0), pw=np.int64(0))
    (dy,) = _put(jnp.ones((1, 2, 3, 3), jnp.float32))
    bad_dx = (jax.ShapeDtypeStruct((1, 2, 9, 9), jnp.float32),)
    with pytest.raises(Exception, match="pooled dims"):
        jax.block_until_ready(jax.jit(lambda dy: jax.ffi.ffi_call("rlx_avg_pool2d_bwd_v1", bad_dx)(dy, **geom))(dy))
    with pytest.raises(Exception, match="dtype"):
        jax.block_until_ready(jax.jit(lambda dy: jax.ffi.ffi_call(
            "rlx_avg_pool2d_bwd_v1", (jax.ShapeDtypeStruct((1, 2, 6, 6), jnp.bfloat16),))(dy, **geom))(dy))
