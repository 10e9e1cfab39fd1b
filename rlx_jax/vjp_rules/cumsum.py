"""Cumulative sum along one axis (RLX ``Cumsum{axis, exclusive}``).

    inclusive:  y[..., l, ...] = sum_{k <= l} x[..., k, ...]
    exclusive:  y[..., l, ...] = sum_{k <  l} x[..., k, ...]   (y[..., 0, ...] = 0)

Cumsum is linear; its transpose (RLX ``CumsumBackward``) is the reverse cumulative sum
of dy, inclusive or exclusive like the forward:

    dx[..., l, ...] = sum_{k >= l} dy[..., k, ...]   (k > l when exclusive)

Internally x is viewed as [O, L, I] (O = the axes before ``axis``, L = the scanned
axis, I = the axes after it; a free reshape). Primitives ``cumsum_fwd`` and
``cumsum_bwd`` are each other's transpose and lower to the FFI kernels
``rlx_cumsum_fwd`` / ``rlx_cumsum_bwd`` for floating inputs (integers use the reference).
Sums run in f32 for bf16/f16 (f64 for f64).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import FusedPrimitive, Partition


def _acc(dtype):
    if not jnp.issubdtype(dtype, jnp.floating):
        return dtype
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# ---- references (the test oracle and the fallback) ----------------------------------


def _scan(x, *, exclusive, reverse):
    """Cumulative sum over axis 1 of [O, L, I]."""
    acc = _acc(x.dtype)
    xf = jnp.flip(x, axis=1) if reverse else x
    y = jnp.cumsum(xf.astype(acc), axis=1)
    if exclusive:
        y = jnp.concatenate([jnp.zeros_like(y[:, :1]), y[:, :-1]], axis=1)
    y = jnp.flip(y, axis=1) if reverse else y
    return y.astype(x.dtype)


def reference_cumsum(x, *, exclusive):
    """y = cumsum(x) over axis 1 of [O, L, I]; returns (y,)."""
    return (_scan(x, exclusive=exclusive, reverse=False),)


def reference_cumsum_bwd(dy, *, exclusive):
    """dx = reverse cumsum(dy) over axis 1 of [O, L, I]; returns (dx,)."""
    return (_scan(dy, exclusive=exclusive, reverse=True),)


# ---- kernels ---------------------------------------------------------------------------


def _kernel(target):
    def call(x, *, exclusive):
        return jax.ffi.ffi_call(ffi_target(target), (jax.ShapeDtypeStruct(x.shape, x.dtype),))(x, exclusive=np.bool_(exclusive))

    return call


# CUDA: the same call plus a scratch result (the per-chunk totals of a long scan axis, or
# the chained row scan's carry slots and ticket counter, ffi/cuda/cumsum.cu); its size
# follows from the shape and dtype by the formula the kernel checks.
_CUDA_ROW_CHUNK_ALIGN = 4096
_CUDA_COL_TARGET = 1 << 18


def cuda_chunks(o: int, l: int, i: int) -> int:
    """Chunks the CUDA kernel splits the scan axis into (mirrors cumsum_chunks in
    ffi/cuda/cumsum.cu): several only for a long axis with few rows / columns."""
    if o == 0 or l == 0 or i == 0:
        return 1
    n = 1
    if i == 1:
        if o < 256 and l >= 16384:
            n = min(-(-512 // o), -(-l // 8192))
    elif o * i < _CUDA_COL_TARGET and l >= 128:
        n = min(-(-_CUDA_COL_TARGET // (o * i)), -(-l // 64), 1024)
    if n <= 1:
        return 1
    length = -(-l // n)
    if i == 1:
        length = -(-length // _CUDA_ROW_CHUNK_ALIGN) * _CUDA_ROW_CHUNK_ALIGN
    return -(-l // length)


# The chained row scan (chain_scan_k): tiles of 64 KB; its scratch holds a 64-bit slot
# per tile and a 32-bit ticket counter, counted here in 4-byte words.
_CUDA_CHAIN_TILE_BYTES = 1 << 16


def cuda_chain_tiles(l: int, itemsize: int) -> int:
    """Tiles of one row in the CUDA chained row scan (mirrors chain_tiles in cumsum.cu)."""
    return -(-l // (_CUDA_CHAIN_TILE_BYTES // itemsize))


# The chained column scan (col_chain_k): tiles of 256 scan positions x 256-byte strips,
# taken where there are at least 32 strips; a 64-bit slot per (tile, column).
_CUDA_COL_CHAIN_ROWS = 256
_CUDA_COL_CHAIN_MIN_STRIPS = 32


def cuda_col_chain_fits(o: int, i: int, itemsize: int) -> bool:
    """Whether chunked columns [o, ., i] may take the chained column scan (mirrors
    col_chain_fits in cumsum.cu; the kernel also needs 16-byte aligned buffers)."""
    cw = 256 // itemsize
    return itemsize <= 4 and i % cw == 0 and o * (i // cw) >= _CUDA_COL_CHAIN_MIN_STRIPS


def cuda_scratch_size(o: int, l: int, i: int, itemsize: int = 4) -> int:
    """Elements of the CUDA kernels' scratch result for x [o, l, i] of ``itemsize``-byte
    elements (mirrors cumsum_scratch_size in ffi/cuda/cumsum.cu): the chunk totals of the
    chunked passes, O * I * C; where a chained scan may run instead (either path may: the
    A/B switches, alignment), at least its carry slots and ticket counter in 4-byte words:
    rows 2 * O * tiles + 1, columns 2 * O * I * ceil(L / 256) + 1."""
    n = cuda_chunks(o, l, i)
    if n <= 1:
        return 1
    if i == 1 and itemsize <= 4:
        return max(o * n, 2 * o * cuda_chain_tiles(l, itemsize) + 1)
    if cuda_col_chain_fits(o, i, itemsize):
        return max(o * i * n, 2 * o * i * (-(-l // _CUDA_COL_CHAIN_ROWS)) + 1)
    return o * i * n


def _kernel_cuda(target):
    def call(x, *, exclusive):
        o, l, i = x.shape
        acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
        scratch = cuda_scratch_size(o, l, i, jnp.dtype(x.dtype).itemsize)
        out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((scratch,), acc))
        y, _ = jax.ffi.ffi_call(ffi_target(target), out)(x, exclusive=np.bool_(exclusive))
        return (y,)

    return call


def _kernel_ok(x, **params):
    return x.ndim == 3 and x.dtype in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)


# SPMD: x is (outer, scanned, inner); outer and inner may split, the scanned axis stays whole.
_PARTITION = Partition(lambda avals_in, avals_out, **params: ([("o", "a", "i")], [("o", "a", "i")]),
                       shardable=["o", "i"])
cumsum_fwd = FusedPrimitive(
    "rlx_cumsum_fwd",
    reference_cumsum,
    target="rlx_cumsum_fwd",
    kernel={"cpu": _kernel("rlx_cumsum_fwd"), "cuda": _kernel_cuda("rlx_cumsum_fwd")},
    kernel_ok=_kernel_ok,
    partition=_PARTITION,
    static_only=("cuda",),
)
cumsum_bwd = FusedPrimitive(
    "rlx_cumsum_bwd",
    reference_cumsum_bwd,
    target="rlx_cumsum_bwd",
    kernel={"cpu": _kernel("rlx_cumsum_bwd"), "cuda": _kernel_cuda("rlx_cumsum_bwd")},
    kernel_ok=_kernel_ok,
    partition=_PARTITION,
    static_only=("cuda",),
)

_TRANSPOSE = {cumsum_fwd: cumsum_bwd, cumsum_bwd: cumsum_fwd}


# ---- differentiation rules (both primitives are linear) --------------------------------


def _make_rules(prim):
    other = _TRANSPOSE[prim]

    def jvp(primals, tangents, *, exclusive):
        (x,), (tx,) = primals, tangents
        (y,) = prim(x, exclusive=exclusive)
        if type(tx) is ad.Zero:
            return (y,), (jnp.zeros_like(y),)
        return (y,), prim(tx, exclusive=exclusive)

    def transpose(cts, x, *, exclusive):
        (ct,) = cts
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval)]
        return [other(ct, exclusive=exclusive)[0]]

    def batch(args, dims, *, exclusive):
        """The batch axis folds into O: [vb, O, L, I] -> [vb * O, L, I]."""
        xb = jnp.moveaxis(args[0], dims[0], 0)
        vb, o, l, i = xb.shape
        (y,) = prim(xb.reshape(vb * o, l, i), exclusive=exclusive)
        return [y.reshape(vb, o, l, i)], [0]

    prim.def_jvp(jvp)
    prim.def_transpose(transpose)
    prim.def_batching(batch)


for _prim in (cumsum_fwd, cumsum_bwd):
    _make_rules(_prim)


# ---- public functions ------------------------------------------------------------------


def _fold(x, axis, who):
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.number)):
        raise TypeError(f"{who}: x must be numeric, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{who}: x must have at least one axis")
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{who}: axis {axis!r} out of range for x of rank {x.ndim}")
    axis = int(axis) % x.ndim
    o, l, i = math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :])
    return x.reshape(o, l, i)


def cumsum(x, *, axis: int, exclusive: bool = False):
    """Cumulative sum of x along ``axis`` (output shaped like x); with ``exclusive``
    each position holds the sum of the elements strictly before it. Differentiable in
    every mode; reverse mode runs the reverse-scan kernel ``rlx_cumsum_bwd``."""
    x3 = _fold(x, axis, "cumsum")
    (y,) = cumsum_fwd(x3, exclusive=bool(exclusive))
    return y.reshape(jnp.shape(x))


def cumsum_backward(dy, *, axis: int, exclusive: bool = False):
    """The RLX op CumsumBackward: the reverse cumulative sum of dy along ``axis``
    (``dx[l] = sum_{k >= l} dy[k]``, ``k > l`` when exclusive)."""
    dy3 = _fold(dy, axis, "cumsum_backward")
    (dx,) = cumsum_bwd(dy3, exclusive=bool(exclusive))
    return dx.reshape(jnp.shape(dy))
