"""Gather along an axis (RLX ``Gather{axis}``, ``np.take``) and its gradient, the
scatter-add (RLX ``GatherBackward{axis}`` / ``ScatterAdd``).

Shapes: table [*pre, V, *post], integer indices [*idx] ->
out [*pre, *idx, *post], out[a, i, b] = table[a, indices[i], b] for an index in [0, V)
(out-of-range indices: below).
Internally: table [O, V, T] (O = prod(pre), T = prod(post)), indices [K] -> out [O, K, T].

The primitives DROP an index outside [0, V): the forward reads zeros there and the
backward adds nothing for it, so the gradient is always that of the function computed.
The public functions decide what an out-of-range index means before the primitives
see it: ``gather``'s ``mode`` (``"fill"``, the default, ``"clip"``,
``"promise_in_bounds"``, as ``jnp.take``); "clip" and RLX's ops clamp the indices into
[0, V - 1] (negative -> 0, >= V -> V - 1; JAX's ``x[idx]`` clamps too, but wraps negative
indices; RLX reads f32-encoded indices with a saturating cast, so negatives read row 0,
as here), and "fill" adds the fill value where the zero was read, so its reverse mode
is the same single scatter-add, with no masking pass over dy. A table with V = 0 takes
no indices.

Backward: d_table[o, v, :] = sum over k with indices[k] = v of dy[o, k, :], summed in
increasing k (deterministic; f32 accumulation for 16-bit dtypes).

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``gather_fwd``: (table [O, V, T], idx [K]) -> out [O, K, T]; linear in the table (XLA's
  gather, a copy); its transpose is the backward;
- ``gather_bwd``: (dy [O, K, T], idx [K]) -> d_table [O, V, T]; linear in dy; its
  transpose is the forward.                                          [rlx_gather_bwd]
The CPU kernel sorts the indices into per-row buckets (a counting sort) and gives each
thread whole table rows, so no two threads write the same row: no atomics, no races.
On CUDA, XLA sorts (indices, positions) stably before the call and the kernel reduces
each run of equal indices, one thread group per table row (same sums, same order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, Partition


def _acc(dtype):
    """The scatter's accumulation dtype: f64 and complex keep theirs, the rest sum in f32."""
    if dtype == jnp.float64 or jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype
    return jnp.float32


# ---- references (the test oracle and the fallback) ----------------------------------


def _in_range(idx, num_rows):
    return (idx >= 0) & (idx < num_rows)


def reference_gather(table, idx):
    """out[o, k, :] = table[o, idx[k], :] for idx[k] in [0, V), else 0."""
    v = table.shape[1]
    read = jnp.take(table, jnp.clip(idx, 0, max(v - 1, 0)), axis=1, mode="clip")
    return (jnp.where(_in_range(idx, v)[None, :, None], read, jnp.zeros((), table.dtype)),)


def reference_gather_bwd(dy, idx, *, num_rows):
    """d_table[o, v, :] = sum_{k: idx[k] = v} dy[o, k, :] (XLA's scatter-add; indices
    outside [0, V) are dropped: they are sent to V, which "drop" skips, since .at[]
    would wrap a negative one)."""
    o, _, t = dy.shape
    out = jnp.zeros((o, num_rows, t), _acc(dy.dtype))
    out = out.at[:, jnp.where(_in_range(idx, num_rows), idx, num_rows)].add(dy.astype(out.dtype), mode="drop")
    return (out.astype(dy.dtype),)


# ---- kernels ---------------------------------------------------------------------------


def _kernel_bwd(dy, idx, *, num_rows):
    o, _, t = dy.shape
    out = (jax.ShapeDtypeStruct((o, num_rows, t), dy.dtype),)
    return jax.ffi.ffi_call(ffi_target("rlx_gather_bwd"), out)(dy, idx)


def _kernel_bwd_cuda(dy, idx, *, num_rows):
    """The CUDA call takes the indices stably sorted with their positions (XLA's sort),
    so the kernel reduces each run of equal indices in increasing position without
    atomics: (dy, keys, order) -> (d_table, scratch: each row's run start, i32 [V + 1])
    (see ffi/cuda/gather.cu)."""
    o, k, t = dy.shape
    keys, order = jax.lax.sort((idx, jax.lax.iota(jnp.int32, k)), num_keys=1, is_stable=True)
    out = (jax.ShapeDtypeStruct((o, num_rows, t), dy.dtype), jax.ShapeDtypeStruct((num_rows + 1,), jnp.int32))
    d_table, _ = jax.ffi.ffi_call(ffi_target("rlx_gather_bwd"), out)(dy, keys, order)
    return (d_table,)


gather_fwd = FusedPrimitive("rlx_gather_fwd", reference_gather)
# SPMD: dy (outer, index, inner) and indices (index,) may split along outer and index;
# d_table (outer, row, inner) lacks the index axis, so the shards' scatter-adds are psum'd.
gather_bwd = FusedPrimitive(
    "rlx_gather_bwd", reference_gather_bwd, target="rlx_gather_bwd",
    kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda}, platforms=("cpu", "cuda"),
    partition=Partition(lambda avals_in, avals_out, **params: ([("o", "i", "t"), ("i",)], [("o", "r", "t")]),
                        shardable=["o", "i"]),
)


# ---- differentiation rules -------------------------------------------------------------


@gather_fwd.def_jvp
def _fwd_jvp(primals, tangents):
    (table, idx), (t_table, _) = primals, tangents
    out = gather_fwd(table, idx)
    if type(t_table) is ad.Zero:
        return out, [ad.Zero(jax.typeof(out[0]))]
    return out, gather_fwd(t_table, idx)


@gather_fwd.def_transpose
def _fwd_transpose(cts, table, idx):
    (ct,) = cts
    if ad.is_undefined_primal(idx):
        raise ValueError("gather is linear in the table only")
    if type(ct) is ad.Zero:
        return [ad.Zero(table.aval), None]
    (d_table,) = gather_bwd(ct, idx, num_rows=table.aval.shape[1])
    return [d_table, None]


@gather_bwd.def_jvp
def _bwd_jvp(primals, tangents, *, num_rows):
    (dy, idx), (t_dy, _) = primals, tangents
    out = gather_bwd(dy, idx, num_rows=num_rows)
    if type(t_dy) is ad.Zero:
        return out, [ad.Zero(jax.typeof(out[0]))]
    return out, gather_bwd(t_dy, idx, num_rows=num_rows)


@gather_bwd.def_transpose
def _bwd_transpose(cts, dy, idx, *, num_rows):
    (ct,) = cts
    if ad.is_undefined_primal(idx):
        raise ValueError("gather backward is linear in dy only")
    if type(ct) is ad.Zero:
        return [ad.Zero(dy.aval), None]
    return [gather_fwd(ct, idx)[0], None]


def _fold_indices(idx, di, num_rows):
    """Batched indices idx (batch axis di, [Bv, K] once moved to the front) as indices into
    Bv blocks of num_rows rows laid end to end: idx[b, k] + b num_rows where in [0, num_rows),
    -1 (dropped, as any out-of-range index) elsewhere; flattened to [Bv K]."""
    idx = jnp.moveaxis(idx, di, 0)
    block = jnp.arange(idx.shape[0], dtype=idx.dtype)[:, None] * num_rows
    return jnp.where(_in_range(idx, num_rows), idx + block, -1).reshape(-1), idx.shape[0]


def _folds(idx, rows) -> bool:
    """Whether idx's dtype holds every index into `rows` folded rows (else the batching
    rules fall back to vmap of the reference)."""
    return rows <= jnp.iinfo(idx.dtype).max


def _fold_outer(prim, x, dx, idx, **params):
    """prim on x [O, ., T] batched at axis dx with shared indices: the batch axis folds
    into O, and the result [B O, ., T] unfolds to [B, O, ., T]."""
    x = jnp.moveaxis(x, dx, 0)
    b, o = x.shape[:2]
    (out,) = prim(x.reshape((b * o,) + x.shape[2:]), idx, **params)
    return [out.reshape((b, o) + out.shape[1:])], [0]


def _fwd_batching(args, dims):
    """gather_fwd under vmap, through the primitive in every case. Only the table batched:
    its batch axis folds into O. Indices batched: they index Bv blocks of the table laid
    end to end along V (the table's batch axis moved next to V; an unbatched table is
    shared: its V rows once, the indices unshifted), and out [O, Bv K, T] unfolds to
    [O, Bv, K, T]."""
    (a, idx), (da, di) = args, dims
    if di is NOT_MAPPED:
        return _fold_outer(gather_fwd, a, da, idx)
    bv, k = idx.shape[di], idx.shape[1 - di]  # idx [K] batched: rank 2
    if da is NOT_MAPPED:
        flat = jnp.moveaxis(idx, di, 0).reshape(-1)
    else:
        a = jnp.moveaxis(a, da, 1)  # [O, Bv, V, T]
        o, _, v, t = a.shape
        if not _folds(idx, bv * v):
            return gather_fwd._reference_batch(args, dims)
        a = a.reshape(o, bv * v, t)
        flat, _ = _fold_indices(idx, di, v)
    (out,) = gather_fwd(a, flat)
    return [out.reshape(out.shape[0], bv, k, out.shape[2])], [1]


def _bwd_batching(args, dims, *, num_rows):
    """gather_bwd under vmap, through the primitive (its race-free scatter-add) in every
    case. Only dy batched: its batch axis folds into O. Indices batched (per-example
    gradients): each example's scatter goes to its own block of num_rows rows, the blocks
    laid end to end (indices shifted by b num_rows), dy [O, Bv K, T] (an unbatched dy
    broadcast), and d_table [O, Bv num_rows, T] unfolds to [O, Bv, num_rows, T]."""
    (dy, idx), (dd, di) = args, dims
    if di is NOT_MAPPED:
        return _fold_outer(gather_bwd, dy, dd, idx, num_rows=num_rows)
    if not _folds(idx, idx.shape[di] * num_rows):
        return gather_bwd._reference_batch(args, dims, num_rows=num_rows)
    flat, bv = _fold_indices(idx, di, num_rows)
    if dd is NOT_MAPPED:
        dy = jnp.broadcast_to(dy[:, None], (dy.shape[0], bv) + dy.shape[1:])
    else:
        dy = jnp.moveaxis(dy, dd, 1)  # [O, Bv, K, T]
    o, _, k, t = dy.shape
    (out,) = gather_bwd(dy.reshape(o, bv * k, t), flat, num_rows=bv * num_rows)
    return [out.reshape(o, bv, num_rows, t)], [1]


gather_fwd.def_batching(_fwd_batching)
gather_bwd.def_batching(_bwd_batching)


# ---- public functions ------------------------------------------------------------------


def _indices(fn, indices):
    indices = jnp.asarray(indices)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{fn}: indices must be an integer array, got {indices.dtype}")
    return indices


def _axis(fn, axis, ndim):
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{fn}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{fn}: axis {axis} out of range for a table of rank {ndim}")
    return axis % ndim


def _flat_indices(fn, indices, num_rows):
    if num_rows == 0 and indices.size:
        raise ValueError(f"{fn}: the gathered axis has size 0, so no index is valid")
    # clamp in the index dtype before narrowing to int32, so huge int64 indices clamp too
    return jnp.clip(indices, 0, max(num_rows - 1, 0)).astype(jnp.int32).reshape(-1)


GATHER_MODES = ("fill", "clip", "promise_in_bounds")


def _fill_value(fill_value, dtype):
    """jnp.take's defaults: NaN for inexact tables, the most negative value for signed
    integers, the largest for unsigned integers, True for booleans."""
    if fill_value is not None:
        return jnp.asarray(fill_value, dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return jnp.asarray(jnp.iinfo(dtype).min, dtype)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return jnp.asarray(jnp.iinfo(dtype).max, dtype)
    return jnp.asarray(True, dtype)


def gather(table, indices, *, axis: int = 0, mode: str | None = None, fill_value=None):
    """``jnp.take(table, indices, axis, mode=mode)``: table [*pre, V, *post], integer
    indices [*idx] -> [*pre, *idx, *post].

    ``mode`` says what an out-of-range index (``i < 0`` or ``i >= V``) reads. Negative
    indices never wrap (``jnp.take``'s "fill" reads ``-1`` as ``V - 1``; here it is out
    of range, so a padding id such as -100 cannot silently read a real row):

    - ``"fill"`` (the default, as ``jnp.take``'s): ``fill_value``, by default NaN for a
      floating table (the most negative value for a signed integer table, the largest
      for an unsigned one, True for bool). No gradient flows to the table from those
      positions.
    - ``"clip"``: the nearest row, ``table[clip(i, 0, V - 1)]`` (RLX's ``Gather``
      semantics); the gradient lands in the row that was read.
    - ``"promise_in_bounds"``: the caller guarantees every index is in range; an
      out-of-range index reads an unspecified row (today's implementation clips).

    Indices must be integers (a float array raises TypeError). Differentiable in the
    table in every mode; reverse mode runs the deterministic scatter-add kernel.
    """
    mode = "fill" if mode is None else mode
    if mode not in GATHER_MODES:
        raise ValueError(f"gather: mode must be one of {GATHER_MODES}, got {mode!r}")
    if fill_value is not None and mode != "fill":
        raise ValueError(f"gather: fill_value is only used with mode='fill' (got mode={mode!r})")
    table = jnp.asarray(table)
    indices = _indices("gather", indices)
    if table.ndim == 0:
        raise ValueError("gather: table must have at least one axis")
    axis = _axis("gather", axis, table.ndim)
    pre, v, post = table.shape[:axis], table.shape[axis], table.shape[axis + 1 :]
    if mode == "fill" and v == 0:
        # nothing to read: every index is out of range
        fill = _fill_value(fill_value, table.dtype)
        return jnp.broadcast_to(fill, pre + indices.shape + post)
    out_shape = pre + indices.shape + post
    in_range = _in_range(indices, v)
    # the in-range mask over [*idx], broadcast against [*pre, *idx, *post]
    valid = in_range.reshape((1,) * len(pre) + indices.shape + (1,) * len(post))
    if not jnp.issubdtype(table.dtype, jnp.inexact):
        out = jnp.take(table, _flat_indices("gather", indices, v), axis=axis, mode="clip").reshape(out_shape)
        return out if mode != "fill" else jnp.where(valid, out, _fill_value(fill_value, table.dtype))
    t3 = table.reshape((math.prod(pre), v, math.prod(post)))
    if mode != "fill":
        (out,) = gather_fwd(t3, _flat_indices("gather", indices, v))
        return out.reshape(out_shape)
    # "fill": the primitive reads zeros at out-of-range indices (sent to V, int32-safe for
    # any index dtype) and drops them in its backward; the fill is then ADDED: x + (-0.0)
    # is x exactly (signed zeros included; NaN stays NaN, with its payload on the CPU and
    # the GPU's canonical NaN on CUDA), 0 + fill is the fill. The add's
    # transpose passes dy through unchanged, so reverse mode is one scatter-add, where a
    # select would cost a pass over dy.
    # (an in-range index is below V <= 2^31 - 1, so its int32 cast is exact)
    idx = jnp.where(in_range, indices.astype(jnp.int32), jnp.int32(v)).reshape(-1)
    (out,) = gather_fwd(t3, idx)
    fill = _fill_value(fill_value, table.dtype)
    return out.reshape(out_shape) + jnp.where(valid, jnp.asarray(-0.0, table.dtype), fill)


def gather_backward(dy, indices, *, axis: int, table_shape):
    """RLX's GatherBackward{axis}: d_table [table_shape] for upstream dy
    [*pre, *idx, *post]; d_table[a, v, b] = sum of dy[a, i, b] over i with
    clip(indices[i]) = v."""
    dy = jnp.asarray(dy)
    indices = _indices("gather_backward", indices)
    if not jnp.issubdtype(dy.dtype, jnp.inexact):
        raise TypeError(f"gather_backward: dy must be floating point, got {dy.dtype}")
    table_shape = tuple(int(d) for d in table_shape)
    if not table_shape:
        raise ValueError("gather_backward: table_shape must have at least one axis")
    axis = _axis("gather_backward", axis, len(table_shape))
    pre, v, post = table_shape[:axis], table_shape[axis], table_shape[axis + 1 :]
    want = pre + indices.shape + post
    if dy.shape != want:
        raise ValueError(f"gather_backward: dy must have shape {want} (pre + indices + post), got {dy.shape}")
    idx = _flat_indices("gather_backward", indices, v)
    dy3 = dy.reshape((math.prod(pre), idx.shape[0], math.prod(post)))
    (d_table,) = gather_bwd(dy3, idx, num_rows=v)
    return d_table.reshape(table_shape)


def scatter_add(updates, indices, out_shape):
    """RLX's ScatterAdd: out [out_shape] = zeros, then out[clip(indices[i])] += updates[i].

    updates [*idx, *rest], integer indices [*idx]; out_shape = (V, *rest) (an int V means
    (V, *rest)). The gradient of ``gather(table, indices, axis=0)``; same kernel.
    """
    updates = jnp.asarray(updates)
    indices = _indices("scatter_add", indices)
    if updates.shape[: indices.ndim] != indices.shape:
        raise ValueError(
            f"scatter_add: updates shape {updates.shape} must start with the indices shape {indices.shape}"
        )
    rest = updates.shape[indices.ndim :]
    if isinstance(out_shape, int):
        out_shape = (out_shape,) + rest
    out_shape = tuple(int(d) for d in out_shape)
    if out_shape[1:] != rest:
        raise ValueError(f"scatter_add: out_shape {out_shape} must be (V,) + {rest} (the updates' trailing dims)")
    return gather_backward(updates, indices, axis=0, table_shape=out_shape)
