"""Packed documents (segment ids) and attention sinks for ``rlx_jax.ops.attention``.

Segment ids: ``q_segment_ids`` [B, Sq] and ``kv_segment_ids`` [B, Sk] (integers); query i
sees key j only where ``q_segment_ids[b, i] == kv_segment_ids[b, j]``, on top of the mask
kind, window and key mask (a logical AND of the visibility sets; the bias is still added
to the visible scores).

Sinks: ``sinks`` [H], one logit per query head that joins every row's softmax
denominator and carries no value. With s_ij the visible scores and
lse0_i = log sum_j exp(s_ij) (the attention without sinks):

    p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)),    out_i = sum_j p_ij v_j
         = out0_i * sigma(lse0_i - sink_h),

with out0 the attention without sinks and sigma the logistic function. They are an operand
of the forward primitive (``has_sinks``, broadcast to [B, H] so that vmap folds them into
the batch axis as it does q), which returns (out, lse) with lse_i = logaddexp(lse0_i,
sink_h), the log of the whole denominator: exp(s_ij - lse_i) are then the visible keys'
probabilities and p_sink,i = exp(sink_h - lse_i) the sink's, so the tangent and backward
primitives run unchanged on this (out, lse), and the sink's own terms are XLA ops
(d sink_h = sum_{b,i} p_sink,i (dlse_i - dout_i . out_i), from the forward's JVP). The CUDA
kernels apply the sink in their epilogue, with no pass over the output (``row_finish`` in
ffi/cuda/attention_generic.cuh); on the CPU, XLA applies it to the kernel's (out0, lse0)
(``finish_sinks``). A row that sees no key has output 0 and lse = sink_h.

Routing: the segment ids are two more operands of the attention primitives
(``has_segments``), so every mode (reverse through the fused backward, forward mode,
vmap, higher orders) works as without them. On the CPU they lower to the kernel's
segment-id targets (``rlx_attention_segments_fwd`` / ``_bwd``), which skip every
(query tile, key tile) pair whose segment-id ranges do not meet, from
``CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES`` of scores up, and below that to the pure-JAX
reference (dense [B, H, Sq, Sk] scores with this visibility), which is faster there. On
CUDA the same targets run the Hopper (sm_90a) kernels' segment forms (the warp-specialised
forward and the fused backward) where those serve the call (``cuda_segments_served``:
bf16 / f16, head dim 64 or 128, no bias, scale > 0, a compute capability 9.0 device and
at most 128 keys per SM); they take two more operands, the granule tables of
``segment_tile_info``, from which a query tile computes only the key tiles whose ids can
meet its own (and a key block only such query tiles), and the forward a third,
``segment_tile_order``, the order in which its persistent blocks take the query tiles.
Everywhere else on CUDA the reference runs. Under SPMD sharding the segment ids shard with
q's batch axis (kv ids with k's); the kernels gather the sequence axes as they do q's and k's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _segment_ids_int32(q_ids, kv_ids):
    """Segment ids ``[B, Sq]`` and ``[B, Sk]`` as int32 with equality and order kept (the
    kernels compare ids and skip tiles by their ranges). Ids of at most 32 bits, signed,
    convert; wider ones (or uint32) could wrap onto each other (2**32 onto 0), so each is
    replaced by its rank among its batch row's q and kv ids: the count of smaller ones."""
    i32 = jnp.iinfo(jnp.int32)
    if all(i32.min <= jnp.iinfo(x.dtype).min and jnp.iinfo(x.dtype).max <= i32.max for x in (q_ids, kv_ids)):
        return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    dt = jnp.promote_types(q_ids.dtype, kv_ids.dtype)
    if not jnp.issubdtype(dt, jnp.integer):   # uint64 with a signed type: no common integer type
        raise TypeError(f"segment ids of dtypes {q_ids.dtype} and {kv_ids.dtype} have no common integer "
                        "type; give both one dtype")
    both = jnp.concatenate([q_ids.astype(dt), kv_ids.astype(dt)], axis=-1)      # [B, Sq + Sk]
    ranks = jax.vmap(jnp.searchsorted)(jnp.sort(both, axis=-1), both).astype(jnp.int32)
    sq = q_ids.shape[-1]
    return ranks[..., :sq], ranks[..., sq:]


def check_segments_and_sinks(q, k, q_segment_ids, kv_segment_ids, sinks, who):
    """Validated (q_segment_ids, kv_segment_ids, sinks) as int32, int32 and floating
    arrays (None where absent). Segment ids come in pairs."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        missing = "kv_segment_ids" if kv_segment_ids is None else "q_segment_ids"
        raise ValueError(f"{who}: q_segment_ids and kv_segment_ids go together; {missing} is missing")
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    ids = []
    for name, x, want in (("q_segment_ids", q_segment_ids, (b, sq)),
                          ("kv_segment_ids", kv_segment_ids, (b, sk))):
        if x is None:
            ids.append(None)
            continue
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{who}: {name} must be an integer array, got {x.dtype}")
        if x.shape != want:
            raise ValueError(f"{who}: {name} must have shape {want}, got {x.shape}")
        ids.append(x)
    if ids[0] is not None:
        ids = list(_segment_ids_int32(ids[0], ids[1]))
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"{who}: sinks must be floating point, got {sinks.dtype}")
        if sinks.shape != (h,):
            raise ValueError(f"{who}: sinks must have shape (H,) = {(h,)}, got {sinks.shape}")
    return ids[0], ids[1], sinks


def segment_visible(q_segment_ids, kv_segment_ids):
    """Boolean [B, 1, Sq, Sk]: query i and key j lie in the same segment."""
    return (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]


def finish_sinks(out, lse, sinks):
    """(out, lse) of the attention with sinks from those without: out [B, Sq, H, D], lse [B, H,
    Sq] (-inf for a row that sees no key) and sinks [B, H] -> (out * sigma(lse - sink),
    logaddexp(lse, sink)). Rows that see no key keep output 0 (lse = sink); NaN stays NaN."""
    acc = lse.dtype
    z = sinks.astype(acc)[..., None]                             # [B, H, 1]
    lse_s = jnp.logaddexp(lse, z)
    dead = lse == -jnp.inf
    w = jnp.where(dead, 0.0, jnp.exp(jnp.where(dead, 0.0, lse) - jnp.where(dead, 0.0, lse_s)))
    w = jnp.swapaxes(w, 1, 2)[..., None]                         # [B, Sq, H, 1]
    return (out.astype(acc) * w).astype(out.dtype), lse_s


#: rows (keys) per granule of the CUDA kernels' segment tables (ffi/cuda/attention_segments.cuh,
#: kSegGranule): every kernel tile is a whole number of granules.
SEGMENT_GRANULE = 64


def _granule_ranges(ids, granule):
    """Per granule of ``granule`` consecutive positions of ids [B, S]: (min, max) [B, ceil(S / g)]
    (the last granule's padding repeats its last id, so it widens nothing)."""
    b, s = ids.shape
    n = -(-s // granule)
    if s == 0:
        empty = jnp.zeros((b, 0), jnp.int32)
        return empty, empty
    x = jnp.pad(ids, ((0, 0), (0, n * granule - s)), mode="edge").reshape(b, n, granule)
    return x.min(-1), x.max(-1)


def segment_tile_info(q_segment_ids, kv_segment_ids, granule=SEGMENT_GRANULE):
    """The CUDA kernels' granule tables: (qinfo [B, ceil(Sq / g), 4], kinfo [B, ceil(Sk / g), 4])
    int32. Row (b, i) of qinfo is (min id, max id, first, end) of query granule i: [first, end)
    the key granules whose id range [min, max] meets its own (first >= end: none); kinfo the
    same for key granules over query granules. A tile's keys (queries) outside the union of
    its granules' ranges hold no id of the tile, so the kernels skip them; for ids that do
    not decrease along the sequence (packed documents) every tile inside the union holds a
    pair of equal ids. Cost: the [B, Sq / g, Sk / g] comparison (128 x 128 a batch row at 8192
    tokens), fused by XLA into the reductions."""
    qmin, qmax = _granule_ranges(q_segment_ids, granule)
    kmin, kmax = _granule_ranges(kv_segment_ids, granule)
    meet = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])

    def hull(m):  # [B, n, n_other] -> first, end over the last axis
        n_other = m.shape[-1]
        idx = jnp.arange(n_other, dtype=jnp.int32)
        first = jnp.min(jnp.where(m, idx, n_other), axis=-1, initial=n_other)
        end = jnp.max(jnp.where(m, idx + 1, 0), axis=-1, initial=0)
        return first, end

    qf, qe = hull(meet)
    kf, ke = hull(jnp.swapaxes(meet, 1, 2))
    qinfo = jnp.stack([qmin, qmax, qf, qe], axis=-1).astype(jnp.int32)
    kinfo = jnp.stack([kmin, kmax, kf, ke], axis=-1).astype(jnp.int32)
    return qinfo, kinfo


#: query rows (and keys) of the CUDA forward's tiles: the unit of its tile order
#: (ffi/cuda/attention_segments.cuh, kSegOrderRows).
SEGMENT_FWD_TILE = 128


def segment_tile_order(qinfo, sq, sk, causal, tile=SEGMENT_FWD_TILE, granule=SEGMENT_GRANULE):
    """The CUDA forward's tile order: [B * ceil(Sq / tile)] int32, the (batch, query tile) pairs
    ``b * nqt + qt`` by descending work, ties in index order. A query tile's work is the key
    tiles it computes (the hull of its granules' ranges in ``qinfo``, from a tile edge, cut
    at its last row's causal end when ``causal``, as the kernel's seg_key_range takes them)
    plus one (its Q load and output). The persistent forward deals tile t to the pair at
    t // H, head t % H, in boustrophedon passes over its blocks, so the heaviest tiles start
    first and the blocks finish together: by the model of this work, about 1 % above the
    blocks' mean load on log-normal documents (B4 S8192, 132 SMs), against 1.2x in the
    order without ids."""
    b, nqg = qinfo.shape[0], qinfo.shape[1]
    per = tile // granule
    nqt = -(-sq // tile)
    if b * nqt == 0:
        return jnp.zeros((0,), jnp.int32)
    # the tile's granules (the last tile's padding is empty: first >= end)
    pad = nqt * per - nqg
    first = jnp.pad(qinfo[..., 2], ((0, 0), (0, pad)), constant_values=2 ** 30).reshape(b, nqt, per)
    end = jnp.pad(qinfo[..., 3], ((0, 0), (0, pad)), constant_values=0).reshape(b, nqt, per)
    live = first < end
    any_live = live.any(axis=-1)
    lo = jnp.where(any_live, jnp.min(jnp.where(live, first, 2 ** 30), axis=-1), 0)
    hi = jnp.max(jnp.where(live, end, 0), axis=-1)
    kbeg = lo * granule // tile * tile
    kend = jnp.minimum(hi * granule, sk)
    if causal:
        last_row = jnp.minimum(jnp.arange(nqt, dtype=jnp.int32) * tile + tile - 1, sq - 1)
        kend = jnp.minimum(kend, last_row + max(sk - sq, 0) + 1)
    tiles = jnp.where(any_live & (kend > kbeg), (kend - kbeg + tile - 1) // tile, 0)
    work = (tiles + 1).reshape(-1)
    return jnp.argsort(-work, stable=True).astype(jnp.int32)
