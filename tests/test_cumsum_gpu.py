"""Cumsum on the GPU: the CUDA kernels (rlx_cumsum_fwd / rlx_cumsum_bwd on platform CUDA,
with their scratch result) against a NumPy f64 oracle and the pure-JAX reference on
random data. Skipped where JAX sees no GPU.

Shapes cover both layouts of ffi/cuda/cumsum.cu: scans along contiguous rows (I == 1:
short rows with several rows per warp, 16-byte vectors, odd lengths with scalar loads,
long rows split into chunks: chunk totals, their prefix pass and the rescan) and scans
across rows (I > 1: vectors over I, odd I, chunked long axes), inclusive / exclusive,
forward and the reverse-scan backward, zero-sized inputs, vmap, f64 and the handler's
own operand errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import assert_close, gpu, requires_gpu
from testutil import numpy_cumsum as _oracle
from rlx_jax.ops import cumsum, cumsum_backward
from rlx_jax.vjp_rules.cumsum import (
    cuda_chunks,
    cuda_col_chain_fits,
    cuda_scratch_size,
    cumsum_fwd,
    reference_cumsum,
)

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _x(shape, dtype=jnp.float32, seed=0):
    return jax.device_put(jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype), gpu())


def _fold(shape, axis):
    axis %= len(shape)
    return int(np.prod(shape[:axis])), shape[axis], int(np.prod(shape[axis + 1 :]))


def _close(got, want, dtype, what):
    # scale: the largest |partial sum| (rounding of the stored output is relative to it)
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what)


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_cumsum_fwd_v1", "rlx_cumsum_bwd_v1"} <= set(info["targets"])
    x = _x((3, 40000))
    text = jax.jit(jax.grad(lambda x: jnp.sum(cumsum(x, axis=1) ** 2))).lower(x).as_text()
    assert "rlx_cumsum_fwd" in text and "rlx_cumsum_bwd" in text
    # the CUDA call carries its scratch result (chunked: 3 rows x 5 chunks)
    assert cuda_chunks(3, 40000, 1) > 1
    assert f"tensor<{cuda_scratch_size(3, 40000, 1)}xf32>" in text
    # 16-bit rows: the chained scan's slots are counted for 64 KB tiles of 2-byte elements
    xb = _x((3, 70000), jnp.bfloat16)
    text = jax.jit(lambda x: cumsum_backward(x, axis=1)).lower(xb).as_text()
    assert "rlx_cumsum_bwd" in text
    assert cuda_scratch_size(3, 70000, 1, 2) == max(3 * cuda_chunks(3, 70000, 1), 2 * 3 * 3 + 1)
    assert f"tensor<{cuda_scratch_size(3, 70000, 1, 2)}xf32>" in text


# (shape, axis): O, L, I = folded shape; comments say which path
SHAPES = [
    ((4, 37), 1),  # short odd rows: scalar loads, 4..64 threads a row
    ((1000, 24), 1),  # many short rows: several groups a block, partial last block
    ((3, 1000), 1),  # vector rows, one group of 256 threads
    ((5, 7, 33), 2),
    ((1, 20000), 1),  # chunked row (3 chunks of 8192)
    ((2, 40001), 1),  # chunked odd-length row: scalar loads, partial last chunk
    ((37, 5), 0),  # columns, short axis: one pass
    ((300, 64), 0),  # columns chunked (5 chunks), vectors
    ((2, 1000, 3), 1),  # columns chunked, odd I: scalar
    ((517, 4096), 0),  # f32: single-pass column strips (256 strips, a partial second tile)
    ((3, 600, 1024), 1),  # f32: column strips of three outer slices
    ((3, 5, 7), 0),
    ((11, 3), 0),
    ((9,), 0),
    # the chained row scan (chunked rows with 16-byte vectors; 64 KB tiles: 16384 f32 /
    # 32768 16-bit elements) and the shapes around its threshold (rows >= 16384 long, fewer
    # than 256 of them)
    ((3, 16383), 1),  # just below: one pass of row_scan_k (odd: scalar loads)
    ((3, 16384), 1),  # at: chained, one tile (f32) / half a tile (16-bit) a row
    ((2, 40008), 1),  # above: chained, 3 tiles a row (f32; 2 for 16-bit), a partial last tile
    ((255, 16400), 1),  # chained, 255 rows x 2 tiles (f32): tickets c * O + row
    ((256, 16384), 1),  # 256 rows: not chunked, one pass of row_scan_k
    ((2, 16, 20000), 2),  # chained rows under two leading axes
    # the chained column scan (chunked columns, strips of 256 bytes: 64 f32 / 128 16-bit
    # columns, at least 32 strips; tiles of 256 scan positions)
    ((700, 2048), 0),  # f32: 32 strips, chained (3 tiles, a partial last); 16-bit: 16 strips, not
    ((700, 1984), 0),  # f32: 31 strips: column strips (col_strip_k); 16-bit: chunked passes
    ((2, 700, 2048), 1),  # two outer slices: f32 64 strips, 16-bit 32: chained
]


def _id(c):
    return "x".join(map(str, c[0])) + f"-ax{c[1]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("exclusive", [False, True], ids=["incl", "excl"])
@pytest.mark.parametrize("case", SHAPES, ids=_id)
def test_forward_and_backward_match_oracle(case, exclusive, dtype):
    shape, axis = case
    x = _x(shape, dtype)
    y = jax.jit(lambda x: cumsum(x, axis=axis, exclusive=exclusive))(x)
    assert y.dtype == x.dtype and y.shape == shape
    _close(y, _oracle(x, axis, exclusive), dtype, "y")
    want_dx = _oracle(x, axis, exclusive, reverse=True)
    dx = jax.jit(lambda d: cumsum_backward(d, axis=axis, exclusive=exclusive))(x)
    _close(dx, want_dx, dtype, "cumsum_backward")
    vjp = jax.jit(lambda x, d: jax.vjp(lambda x: cumsum(x, axis=axis, exclusive=exclusive), x)[1](d)[0])
    _close(vjp(x, x), want_dx, dtype, "vjp")


def test_matches_jax_reference_f32():
    """Against the pure-JAX reference (XLA's cumsum in f32) on the GPU, both layouts."""
    for shape, axis in (((7, 3000), 1), ((1, 50000), 1), ((500, 40), 0), ((5, 70000), 1)):
        x = _x(shape, seed=5)
        o, l, i = _fold(shape, axis)
        want = reference_cumsum(x.reshape(o, l, i), exclusive=False)[0].reshape(shape)
        assert_close(cumsum(x, axis=axis), want, 3e-5, f"{shape} axis {axis}")


def test_grad_against_xla_autodiff():
    x = _x((6, 20000), seed=2)
    w = _x((6, 20000), seed=3)
    ours = jax.jit(jax.grad(lambda x: jnp.sum(cumsum(x, axis=1, exclusive=True) * w)))(x)
    want = jax.grad(lambda x: jnp.sum((jnp.cumsum(x, axis=1) - x) * w))(x)
    assert_close(ours, want, 3e-5, "grad")


def test_bitwise_deterministic_chunked():
    for shape, axis in (((1, 300000), 1), ((4000, 16), 0)):
        x = _x(shape, seed=7)
        f = jax.jit(lambda x: cumsum_backward(x, axis=axis))
        a, b = np.asarray(f(x)), np.asarray(f(x))
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_chained_rows_bitwise_deterministic(dtype):
    """The chained row scan: many tiles a row and more tiles than fit on the GPU at once
    (blocks wait on their predecessors' carries in ticket order); values against the
    oracle, and two runs give identical bits, forward and reverse, inclusive and exclusive."""
    shape = (12, 1 << 19)  # f32: 32 tiles a row, 384 tiles; 16-bit: 16 a row
    x = _x(shape, dtype, seed=19)
    for exclusive in (False, True):
        f = jax.jit(lambda x: cumsum_backward(x, axis=1, exclusive=exclusive))
        g = jax.jit(lambda x: cumsum(x, axis=1, exclusive=exclusive))
        for fn, rev in ((f, True), (g, False)):
            a, b = np.asarray(fn(x)), np.asarray(fn(x))
            assert a.tobytes() == b.tobytes(), (exclusive, rev)
            _close(a, _oracle(x, 1, exclusive, rev), dtype, f"excl={exclusive} rev={rev}")


def test_vmap_keeps_kernel():
    x = _x((3, 5, 40))
    f = jax.jit(jax.vmap(lambda x, d: jax.vjp(lambda x: cumsum(x, axis=1), x)[1](d)[0]))
    assert "rlx_cumsum_bwd" in f.lower(x, x).as_text()
    assert_close(f(x, x), _oracle(x, 2, reverse=True), 2e-5, "vmap dx")


@pytest.mark.parametrize("shape,axis", [((2, 0, 3), 1), ((0, 5), 1), ((4, 0), 0), ((0,), 0)])
def test_zero_sized(shape, axis):
    x = _x(shape)
    assert cumsum(x, axis=axis).shape == shape
    assert cumsum_backward(x, axis=axis, exclusive=True).shape == shape


def test_f64(x64):
    for shape, axis in (((3, 20000), 1), ((300, 7), 0), ((5, 9), 1)):
        x = _x(shape).astype(jnp.float64)
        o, l, i = _fold(shape, axis)
        text = jax.jit(lambda x: cumsum(x, axis=axis)).lower(x).as_text()
        assert "rlx_cumsum_fwd" in text
        if cuda_chunks(o, l, i) > 1:
            assert f"tensor<{cuda_scratch_size(o, l, i, 8)}xf64>" in text
        y = cumsum(x, axis=axis, exclusive=True)
        assert y.dtype == jnp.float64
        assert_close(y, _oracle(x, axis, True), 1e-12, "f64 y")
        assert_close(cumsum_backward(x, axis=axis), _oracle(x, axis, reverse=True), 1e-12, "f64 dx")


def test_handler_rejects_bad_operands():
    x = _x((2, 40000, 1))

    def call(x, n, dtype=jnp.float32):
        out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((n,), dtype))
        return jax.ffi.ffi_call("rlx_cumsum_fwd_v1", out)(x, exclusive=np.bool_(False))

    need = cuda_scratch_size(2, 40000, 1)
    assert need > 1
    with pytest.raises(Exception, match="scratch must be"):
        jax.block_until_ready(jax.jit(call, static_argnums=(1,))(x, need - 1))
    with pytest.raises(Exception, match="scratch must be"):
        jax.block_until_ready(jax.jit(call, static_argnums=(1, 2))(x, need, jnp.int32))
    with pytest.raises(Exception, match=r"\[outer, len, inner\]"):
        jax.block_until_ready(jax.jit(call, static_argnums=(1,))(x[0], 1))
    (y,) = cumsum_fwd(x, exclusive=False)  # the right size works
    assert_close(y, _oracle(x, 1), 2e-5, "y")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_cumsum_sanitizer_small(dtype):
    """Small cases of every path for compute-sanitizer (-k sanitizer)."""
    for shape, axis in (((5, 37), 1), ((2, 16), 1), ((1, 17000), 1), ((33, 3), 0), ((200, 8), 0)):
        x = _x(shape, dtype, seed=11)
        for exclusive in (False, True):
            _close(cumsum(x, axis=axis, exclusive=exclusive), _oracle(x, axis, exclusive), dtype, "y")
            _close(cumsum_backward(x, axis=axis, exclusive=exclusive), _oracle(x, axis, exclusive, True), dtype, "dx")


def test_cumsum_column_strips_sanitizer_small():
    """The single-pass column strip kernel (f32, >= 132 strips of 16 columns, a long axis
    that the chunked path would split) against the oracle and bitwise repeatable, small
    enough for compute-sanitizer (-k sanitizer)."""
    x = _x((200, 2128), jnp.float32, seed=17)  # 133 strips of 16 columns; not 64-column strips
    assert cuda_chunks(1, 200, 2128) > 1 and not cuda_col_chain_fits(1, 2128, 4)
    for exclusive in (False, True):
        a = np.asarray(cumsum_backward(x, axis=0, exclusive=exclusive))
        _close(a, _oracle(x, 0, exclusive, True), jnp.float32, "dx")
        assert a.tobytes() == np.asarray(cumsum_backward(x, axis=0, exclusive=exclusive)).tobytes()
        _close(cumsum(x, axis=0, exclusive=exclusive), _oracle(x, 0, exclusive), jnp.float32, "y")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_cumsum_chained_rows_sanitizer_small(dtype):
    """The chained row scan on a few tiles (a partial last one), small enough for
    compute-sanitizer (-k sanitizer): forward / reverse, inclusive / exclusive, bitwise
    repeatable."""
    x = _x((3, 2 * 16384 + 24), dtype, seed=23)
    assert cuda_chunks(3, x.shape[1], 1) > 1
    for exclusive in (False, True):
        a = np.asarray(cumsum_backward(x, axis=1, exclusive=exclusive))
        _close(a, _oracle(x, 1, exclusive, True), dtype, "dx")
        assert a.tobytes() == np.asarray(cumsum_backward(x, axis=1, exclusive=exclusive)).tobytes()
        _close(cumsum(x, axis=1, exclusive=exclusive), _oracle(x, 1, exclusive), dtype, "y")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_chained_columns_bitwise_deterministic(dtype):
    """The chained column scan: 32 / 64 strips x 12 tiles (f32: more tiles than fit on the
    GPU at once), values against the oracle and identical bits in two runs, both directions."""
    shape = (3000, 8192)
    assert cuda_col_chain_fits(1, 8192, jnp.dtype(dtype).itemsize) and cuda_chunks(1, 3000, 8192) > 1
    x = _x(shape, dtype, seed=29)
    for exclusive in (False, True):
        f = jax.jit(lambda x: cumsum_backward(x, axis=0, exclusive=exclusive))
        g = jax.jit(lambda x: cumsum(x, axis=0, exclusive=exclusive))
        for fn, rev in ((f, True), (g, False)):
            a, b = np.asarray(fn(x)), np.asarray(fn(x))
            assert a.tobytes() == b.tobytes(), (exclusive, rev)
            _close(a, _oracle(x, 0, exclusive, rev), dtype, f"excl={exclusive} rev={rev}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_cumsum_chained_columns_sanitizer_small(dtype):
    """The chained column scan on 32 strips x 2 tiles (a partial last one), small enough
    for compute-sanitizer (-k sanitizer), both directions, bitwise repeatable."""
    w = 32 * 256 // jnp.dtype(dtype).itemsize
    x = _x((300, w), dtype, seed=31)
    assert cuda_col_chain_fits(1, w, jnp.dtype(dtype).itemsize) and cuda_chunks(1, 300, w) > 1
    for exclusive in (False, True):
        a = np.asarray(cumsum_backward(x, axis=0, exclusive=exclusive))
        _close(a, _oracle(x, 0, exclusive, True), dtype, "dx")
        assert a.tobytes() == np.asarray(cumsum_backward(x, axis=0, exclusive=exclusive)).tobytes()
        _close(cumsum(x, axis=0, exclusive=exclusive), _oracle(x, 0, exclusive), dtype, "y")


@pytest.mark.slow
@pytest.mark.parametrize("shape,axis", [((64, 1 << 20), 1), ((1, 1 << 22), 1), ((1 << 16, 64), 0), ((8, 1 << 20), 1), ((64, 4096, 16), 1)])
def test_large_slow(shape, axis):
    x = _x(shape, jnp.bfloat16, seed=13)
    _close(cumsum(x, axis=axis), _oracle(x, axis), jnp.bfloat16, "y")
    _close(cumsum_backward(x, axis=axis, exclusive=True), _oracle(x, axis, True, True), jnp.bfloat16, "dx")
