"""Attention (RLX ``Attention`` / ``AttentionBackward{wrt}``), flash-style on the CPU.

Shapes: q [B, Sq, H, D]; k, v [B, Sk, Hkv, D] with Hkv dividing H (head h reads kv head
h // (H // Hkv)); optional key mask [B, Sk] (key j kept where mask >= 0.5) and additive
bias [B, H, Sq, Sk]. With scale = ``scale`` or 1/sqrt(D):

    r_ij = scale * q_i . k_j
    s_ij = c * tanh(r_ij / c)  (softcap c, when set)  else r_ij;   s_ij += bias_ij
    s_ij = -inf where key j is hidden from query i (mask kind and key mask)
    P = softmax_j(s);   out_i = sum_j P_ij v_j;   lse_i = log sum_j exp(s_ij)

Mask kinds, with off = max(Sk - Sq, 0) (RLX aligns bottom-right when keys outnumber
queries; the public functions' ``causal_alignment="top_left"`` gives off = 0 by dropping the
keys no query can see) and pos_i = i + off: "none"; "causal": j <= pos_i; "sliding" (window w):
pos_i - w <= j <= pos_i. A row that sees no key gives out = 0, lse = -inf and zero
gradients (never NaN).

Packed documents: with ``has_segments``, two int32 operands q_segment_ids [B, Sq] and
kv_segment_ids [B, Sk] follow [mask], [bias] in every primitive below, and key j is also
hidden from query i where their ids differ (``attention_segments``).

Sinks: with ``has_sinks`` (``attention_fwd`` only), one more operand sinks [B, H] (the
accumulation dtype) follows them: z_bh joins row i's softmax denominator with no value,
out_i = sum_j exp(s_ij) v_j / (exp(z) + sum_j exp(s_ij)), and lse_i = log(exp(z) + sum_j
exp(s_ij)) is that of the whole denominator (a row that sees no key: out 0, lse z). So
P_ij = exp(s_ij - lse_i) are the probabilities of the visible keys, and the tangent and
backward primitives below, given this (out, lse), are exact without knowing the sinks; the
sinks' own terms are XLA ops in the forward's JVP (``_sink_tangent``).

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``attention_fwd``: (q, k, v, [mask], [bias], [segment ids], [sinks]) -> (out, lse [B, H, Sq]
  f32 (f64 for f64));
- ``attention_tangent``: (q, k, v, out, lse, [mask], [bias], [segment ids], tq, tk, tv, [tbias]) ->
  (tout, tlse), linear in the tangents: with ts = (1 - tanh^2) * scale * (tq.k + q.tk)
  + tbias on visible entries, tlse_i = sum_j P_ij ts_ij and
  tout_i = sum_j P_ij (ts_ij v_j + tv_j) - tlse_i out_i; its transpose is the backward;
- ``attention_bwd``: (q, k, v, out, lse, dout, dlse, [mask], [bias], [segment ids]) -> (dq, dk, dv,
  [dbias]) with delta_i = sum_d dout_id out_id - dlse_i, dS_ij = P_ij (dout_i.v_j - delta_i)
  (= dbias), dR = dS * (1 - tanh^2(r / c)) (softcap), dq = scale dR k, dk = scale dR^T q,
  dv = P^T dout (k, v gradients summed over the heads sharing a kv head); P is recomputed
  from lse. dlse (the cotangent of lse) is zero in plain reverse mode and carries second
  order terms.

Unlike RLX's own VJP, the gradients here include score_scale and the softcap derivative.
"""

from __future__ import annotations

import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir

from rlx_jax._kernels import has_kernel
from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules.attention_segments import finish_sinks, segment_tile_info, segment_tile_order, segment_visible
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, Partition, instantiate, np_scalar, static_shape

MASK_KINDS = ("none", "causal", "sliding")
_KIND_CODE = {"none": 0, "causal": 1, "sliding": 2}


def _acc_dtype(dtype):
    """Accumulation and statistics dtype: f32, or f64 for f64 inputs."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _split(args, has_mask, has_bias, has_segments=False):
    """(mask or None, bias or None, (q_segment_ids, kv_segment_ids) or None, remaining args)
    from ``[mask], [bias], [q_segment_ids, kv_segment_ids], rest...``."""
    args = list(args)
    mask = args.pop(0) if has_mask else None
    bias = args.pop(0) if has_bias else None
    segments = (args.pop(0), args.pop(0)) if has_segments else None
    return mask, bias, segments, args


def _without_sinks(extras, params):
    """(extras, params, sinks): a forward's operands and params without its sinks operand (the
    last extra under ``has_sinks``), and that sinks [B, H] (None without)."""
    params = dict(params)
    if params.pop("has_sinks", False):
        return list(extras[:-1]), params, extras[-1]
    return list(extras), params, None


def _segment_visible(segments):
    """``segment_visible`` of (q_segment_ids, kv_segment_ids), or None without them."""
    return None if segments is None else segment_visible(*segments)


# ---- references (the test oracle and the fallback) ----------------------------------


def _visible(sq, sk, kind, window, mask):
    """Boolean [B or 1, 1, Sq, Sk]: key j visible from query i."""
    # bottom-right alignment: query i sits at key position i + max(Sk - Sq, 0) (computed in
    # the program where jax.export leaves the lengths symbolic)
    shift = max(sk - sq, 0) if static_shape((sq, sk)) else jnp.maximum(sk - sq, 0)
    i = jnp.arange(sq)[:, None] + shift
    j = jnp.arange(sk)[None, :]
    ok = jnp.ones((sq, sk), bool)
    if kind in ("causal", "sliding"):
        ok = ok & (j <= i)
    if kind == "sliding":
        ok = ok & (j >= i - window)
    ok = ok[None, None]
    if mask is not None:
        ok = ok & (mask >= 0.5)[:, None, None, :]
    return ok


def _heads(q, hkv):
    """[B, S, H, D] -> [B, S, Hkv, G, D] (head h = kv head h // G, member h % G)."""
    b, s, h, d = q.shape
    return q.reshape(b, s, hkv, h // hkv, d)


# The references hold scores in the grouped layout [B, Hkv, Sq, G, Sk] (query head
# h = Hkv-index * G + member): it is the layout XLA's dot_general emits for q [B, Sq, Hkv,
# G, D] . k [B, Sk, Hkv, D] (batch dims, then the lhs's free dims, then the rhs's), so no
# [..., Sq, Sk] transpose is materialised between the matmuls and the softmax. On 2 CPU
# cores (f32, B8 S256 H8 / 2 D32, causal; python -m benchmarks.attention_cpu) the forward
# runs at 1.27x jax.nn.dot_product_attention's XLA path and forward + backward at 1.20x,
# where the [B, H, Sq, Sk] layout ran at 0.78x and 0.82x.


def _grouped(x, hkv):
    """[B, H, Sq, Sk] (or [B, 1, Sq, Sk], broadcast over heads) -> [B, Hkv, Sq, G, Sk]
    (or [B, 1, Sq, 1, Sk])."""
    b, h, sq, sk = x.shape
    if h == 1:
        return x[:, :, :, None, :]
    return x.reshape(b, hkv, h // hkv, sq, sk).transpose(0, 1, 3, 2, 4)


def _ungrouped(x):
    """[B, Hkv, Sq, G, Sk] -> [B, H, Sq, Sk]."""
    b, hkv, sq, g, sk = x.shape
    return x.transpose(0, 1, 3, 2, 4).reshape(b, hkv * g, sq, sk)


def _rows_grouped(x, hkv):
    """Per-row [B, H, Sq] -> [B, Hkv, Sq, G]."""
    b, h, sq = x.shape
    return x.reshape(b, hkv, h // hkv, sq).transpose(0, 1, 3, 2)


def _rows_ungrouped(x):
    """Per-row [B, Hkv, Sq, G] -> [B, H, Sq]."""
    b, hkv, sq, g = x.shape
    return x.transpose(0, 1, 3, 2).reshape(b, hkv * g, sq)


def _rows_by_query(x):
    """Per-row [B, Hkv, Sq, G] -> [B, Sq, H] (out's layout without D)."""
    b, hkv, sq, g = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, sq, hkv * g)


def _qk(q, k):
    """[B, Hkv, Sq, G, Sk] = q . k per query head (grouped heads share their kv head)."""
    return jnp.einsum("bqhgd,bkhd->bhqgk", _heads(q, k.shape[2]), k)


def _pv(p, v):
    """[B, Sq, H, D] = sum_k p[b, h, q, g, k] v[b, k, h, :] for grouped p. The product runs
    on p viewed as [B, Hkv, Sq G, Sk] (a free reshape): given the 5-d einsum, XLA's CPU
    emitter copied p first and ran 3.4x slower (S 1024, D 64)."""
    b, hkv, sq, g, sk = p.shape
    o = jnp.einsum("bhmk,bkhd->bhmd", p.reshape(b, hkv, sq * g, sk), v)
    return o.reshape(b, hkv, sq, g, v.shape[3]).transpose(0, 2, 1, 3, 4).reshape(b, sq, hkv * g, v.shape[3])


def _pt_x(p, x):
    """[B, Sk, Hkv, D] = sum over queries q and group members g of p[b, h, q, g, k] x[b, q,
    h G + g, :]: the transposed product, summed over the heads sharing a kv head."""
    return jnp.einsum("bhqgk,bqhgd->bkhd", p, _heads(x, p.shape[1]))


def _scores(q, k, bias, mask, *, kind, window, scale, softcap, visible=None):
    """(s, th, visible), grouped: scores after softcap and bias, tanh(r / c) (None without a
    softcap), and the visibility mask (ANDed with ``visible`` [B or 1, 1, Sq, Sk] when
    given: the segment ids of ``attention_segments``); all in the accumulation dtype."""
    acc = _acc_dtype(q.dtype)
    hkv = k.shape[2]
    r = _qk(q.astype(acc), k.astype(acc)) * scale
    th = None
    if softcap:
        th = jnp.tanh(r / softcap)
        s = softcap * th
    else:
        s = r
    if bias is not None:
        s = s + _grouped(bias.astype(acc), hkv)
    vis = _visible(q.shape[1], k.shape[1], kind, window, mask)
    if visible is not None:
        vis = vis & visible
    return s, th, _grouped(vis, hkv)


def _probs_from_lse(s, vis, lse):
    """P = exp(s - lse) on visible entries, 0 elsewhere (rows with lse = -inf: 0); s and
    vis grouped, lse [B, Hkv, Sq, G]."""
    live = vis & jnp.isfinite(lse)[..., None]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    return jnp.where(live, jnp.exp(jnp.where(live, s, lse_safe) - lse_safe), 0.0)


def reference_attention(q, k, v, *extras, kind, window, scale, softcap, has_mask, has_bias,
                        has_segments=False, has_sinks=False):
    """Plain JAX, O(Sq * Sk) memory; returns (out, lse)."""
    mask, bias, segments, rest = _split(extras, has_mask, has_bias, has_segments)
    acc = _acc_dtype(q.dtype)
    hkv = k.shape[2]
    s, _, vis = _scores(q, k, bias, mask, kind=kind, window=window, scale=scale, softcap=softcap,
                        visible=_segment_visible(segments))
    m = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, initial=-jnp.inf)
    z = None
    if has_sinks:  # [B, H] -> [B, Hkv, 1, G]; the shift covers the sink too (no overflow)
        b, h = rest[0].shape
        z = rest[0].astype(acc).reshape(b, hkv, 1, h // hkv)
        m = jnp.maximum(m, z)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))[..., None]
    e = jnp.where(vis, jnp.exp(jnp.where(vis, s, m) - m), 0.0)
    total = jnp.sum(e, axis=-1)
    if z is not None:
        total = total + jnp.exp(z - m[..., 0])
    live = total > 0
    total_safe = jnp.where(live, total, 1.0)
    p = e / total_safe[..., None]
    out = _pv(p, v.astype(acc))
    lse = jnp.where(live, m[..., 0] + jnp.log(total_safe), -jnp.inf)
    return out.astype(q.dtype), _rows_ungrouped(lse).astype(acc)


def reference_attention_tangent(q, k, v, out, lse, *rest, kind, window, scale, softcap, has_mask,
                                has_bias, has_segments=False):
    """(tout, tlse) for tangents (tq, tk, tv, [tbias]); see the module docstring."""
    mask, bias, segments, tangents = _split(rest, has_mask, has_bias, has_segments)
    tq, tk, tv = tangents[:3]
    tbias = tangents[3] if has_bias else None
    acc = _acc_dtype(q.dtype)
    hkv = k.shape[2]
    qf, kf = q.astype(acc), k.astype(acc)
    s, th, vis = _scores(q, k, bias, mask, kind=kind, window=window, scale=scale, softcap=softcap,
                         visible=_segment_visible(segments))
    p = _probs_from_lse(s, vis, _rows_grouped(lse, hkv))
    ts = (_qk(tq.astype(acc), kf) + _qk(qf, tk.astype(acc))) * scale
    if th is not None:
        ts = ts * (1.0 - th * th)
    if tbias is not None:
        ts = ts + _grouped(tbias.astype(acc), hkv)
    pts = p * jnp.where(vis, ts, 0.0)
    tlse = jnp.sum(pts, axis=-1)
    tout = _pv(pts, v.astype(acc)) + _pv(p, tv.astype(acc))
    tout = tout - _rows_by_query(tlse)[..., None] * out.astype(acc)
    return tout.astype(q.dtype), _rows_ungrouped(tlse).astype(lse.dtype)


def reference_attention_bwd(q, k, v, out, lse, dout, dlse, *extras, kind, window, scale, softcap,
                            has_mask, has_bias, has_segments=False):
    """(dq, dk, dv, [dbias]); see the module docstring."""
    mask, bias, segments, _ = _split(extras, has_mask, has_bias, has_segments)
    acc = _acc_dtype(q.dtype)
    hkv = k.shape[2]
    qf, kf, vf, dof = (x.astype(acc) for x in (q, k, v, dout))
    s, th, vis = _scores(q, k, bias, mask, kind=kind, window=window, scale=scale, softcap=softcap,
                         visible=_segment_visible(segments))
    p = _probs_from_lse(s, vis, _rows_grouped(lse, hkv))
    b, sq, h, _ = q.shape
    row_dot = jnp.sum(dof * out.astype(acc), axis=-1).reshape(b, sq, hkv, h // hkv).transpose(0, 2, 1, 3)
    delta = row_dot - _rows_grouped(dlse.astype(acc), hkv)
    dp = _qk(dof, vf)
    ds = p * (dp - delta[..., None])
    dr = ds * (1.0 - th * th) if th is not None else ds
    dq = _pv(dr, kf) * scale
    dk = _pt_x(dr, qf) * scale
    dv = _pt_x(p, dof)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    if has_bias:
        grads = grads + (_ungrouped(ds).astype(bias.dtype),)
    return grads


# ---- kernels ---------------------------------------------------------------------------


def _attrs(kind, window, scale, softcap, has_mask, has_bias):
    return dict(
        scale=np_scalar(scale, np.float64),
        softcap=np_scalar(softcap or 0.0, np.float64),
        mask_kind=np.int64(_KIND_CODE[kind]),
        window=np.int64(window),
        has_mask=np.int64(has_mask),
        has_bias=np.int64(has_bias),
    )


def _dummies(q, mask, bias):
    """FFI operands are positional: absent mask / bias pass an empty array."""
    mask = jnp.zeros((0,), jnp.float32) if mask is None else mask
    bias = jnp.zeros((0,), q.dtype) if bias is None else bias
    return mask, bias


def _kernel_fwd(q, k, v, *extras, kind, window, scale, softcap, has_mask, has_bias, has_segments=False,
                cuda=False, sinks=None):
    """The forward kernel: ``rlx_attention_fwd``, or ``rlx_attention_segments_fwd`` with the
    segment ids as two more operands. ``cuda``: CUDA's targets, which take the sinks [B, H] f32
    (or [0]) after the bias, and with segment ids also their granule tables and the forward's
    tile order (ffi/cuda/attention.cu)."""
    mask, bias, segments, _ = _split(extras, has_mask, has_bias, has_segments)
    b, sq, h, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), _acc_dtype(q.dtype)))
    m, bb = _dummies(q, mask, bias)
    head = (q, k, v, m, bb)
    if cuda:
        head += (jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),)
    attrs = _attrs(kind, window, scale, softcap, has_mask, has_bias)
    if segments is not None:
        seg = segments
        if cuda:
            seg = _segment_operands(segments)
            seg = (*seg, segment_tile_order(seg[2], sq, k.shape[1], causal=kind != "none"))
        return jax.ffi.ffi_call(ffi_target(SEGMENTS_FWD), out)(*head, *seg, **attrs)
    return jax.ffi.ffi_call(ffi_target("rlx_attention_fwd"), out)(*head, **attrs)


def _kernel_bwd(q, k, v, out, lse, dout, dlse, *extras, kind, window, scale, softcap, has_mask,
                has_bias, has_segments=False):
    mask, bias, segments, _ = _split(extras, has_mask, has_bias, has_segments)
    m, bb = _dummies(q, mask, bias)
    shapes = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(bb.shape, bb.dtype),
    )
    attrs = _attrs(kind, window, scale, softcap, has_mask, has_bias)
    if segments is not None:
        res = jax.ffi.ffi_call(ffi_target(SEGMENTS_BWD), shapes)(q, k, v, out, lse, dout, dlse, m, bb,
                                                                 *segments, **attrs)
    else:
        res = jax.ffi.ffi_call(ffi_target("rlx_attention_bwd"), shapes)(q, k, v, out, lse, dout, dlse, m, bb,
                                                                         **attrs)
    return tuple(res) if has_bias else tuple(res[:3])


#: largest head dim of the CUDA kernels (ffi/cuda/attention_generic.cuh, kGenMaxD)
CUDA_MAX_HEAD_DIM = 256

#: dtypes the op runs through its CUDA kernels at every size. f32 lowers to the pure-JAX
#: reference on CUDA below ``CUDA_F32_KERNEL_MIN_SCORE_BYTES``: there XLA's f32 matmuls use
#: TF32 tensor cores under JAX's default matmul precision, while the f32 kernel is a SIMT
#: kernel, about 3x slower, so XLA's code keeps the op at least as fast as plain JAX for that
#: dtype. f64 always lowers to the reference (no f64 CUDA kernel). (Adding jnp.float32 here
#: routes f32 to the kernel at every size.)
CUDA_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)

#: f32 on CUDA takes the kernel from this many bytes of the reference's [B, H, Sq, Sk] f32
#: scores up: XLA's attention holds such a matrix, its backward several, so at long
#: sequences it runs out of memory where the kernel's O(S) memory does not; slower there,
#: but the op keeps the memory it promises. Under symbolic shapes (jax.export) f32 stays
#: XLA's code, so an exported function computes what the same function jitted at small
#: static shapes does (the kernel's full-f32 products differ from TF32 ones by ~1e-4).
CUDA_F32_KERNEL_MIN_SCORE_BYTES = 1 << 30


def _scores_reach(q, k, threshold, symbolic: bool = True) -> bool:
    """Would the reference's [B, H, Sq, Sk] f32 scores take at least ``threshold`` bytes?
    ``symbolic`` under symbolic shapes (jax.export), where any size may come."""
    b, sq, h, _ = q.shape
    dims = (b, h, sq, k.shape[1])
    if not all(isinstance(d, (int, np.integer)) for d in dims):
        return symbolic
    return b * h * sq * k.shape[1] * 4 >= threshold


def _cuda_ok(q, k):
    """The CUDA kernels serve dtypes in ``CUDA_KERNEL_DTYPES``, and f32 from
    ``CUDA_F32_KERNEL_MIN_SCORE_BYTES`` of scores up, with head dim <= 256; anything else
    lowers to the reference on the GPU."""
    if q.shape[3] > CUDA_MAX_HEAD_DIM:
        return False
    if q.dtype in CUDA_KERNEL_DTYPES:
        return True
    return q.dtype == jnp.float32 and _scores_reach(q, k, CUDA_F32_KERNEL_MIN_SCORE_BYTES, symbolic=False)


def cuda_segments_served(q, k, *, has_bias, scale) -> bool:
    """Do the CUDA kernels' segment forms serve this call (ffi/cuda/attention_segments.cuh):
    bf16 / f16, head dim 64 or 128, no bias, scale > 0, the segment targets built, a
    compute capability 9.0 device (the sm_90a wgmma kernels), and Sk at most 128 keys per
    SM (the fused backward holds a (batch, kv head)'s key blocks on the device at once)?
    Elsewhere segment ids run the reference on CUDA."""
    if not (q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[3] in (64, 128) and not has_bias
            and float(scale) > 0):
        return False
    if not (has_kernel("cuda", SEGMENTS_FWD) and has_kernel("cuda", SEGMENTS_BWD)):
        return False
    dev = _hopper()
    sk = k.shape[1]
    return dev is not None and isinstance(sk, (int, np.integer)) and sk <= 128 * (getattr(dev, "core_count", 0) or 0)


def _hopper():
    """The first GPU if it has compute capability 9.0 (the sm_90a kernels' and the
    measurements' device), else None."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    return dev if getattr(dev, "compute_capability", "") == "9.0" else None


def _segment_operands(segments):
    """The CUDA segment targets' id operands: the ids and their granule tables."""
    return (*segments, *segment_tile_info(*segments))


def _kernel_fwd_cuda(q, k, v, *extras, **params):
    """CUDA's forward; every kernel there applies the sinks in its epilogue (row_finish)."""
    if not _cuda_ok(q, k) or (params.get("has_segments") and not cuda_segments_served(
            q, k, has_bias=params["has_bias"], scale=params["scale"])):
        return reference_attention(q, k, v, *extras, **params)
    extras, params, sinks = _without_sinks(extras, params)
    return _kernel_fwd(q, k, v, *extras, **params, cuda=True, sinks=sinks)


#: Head splits of the CUDA fused backward (``FusedSplit`` in ffi/cuda/attention_fused_bwd.cuh):
#: at most this many blocks share a (batch, kv head, key block), each over a part of the
#: group's query heads (``kMaxFusedSplits`` there).
MAX_FUSED_SPLITS = 4


def fused_bwd_splits(h: int, hkv: int) -> int:
    """The most head splits the fused backward's scratch is sized for: the largest power of 2
    up to ``MAX_FUSED_SPLITS`` that divides the group ``h // hkv`` (1 without grouping)."""
    group, n = max(1, h // max(1, hkv)), 1
    while n * 2 <= MAX_FUSED_SPLITS and group % (n * 2) == 0:
        n *= 2
    return n


def cuda_bwd_scratch_size(b: int, h: int, sq: int, d: int = 0, fused: bool = False, hkv: int = 0,
                          sk: int = 0) -> int:
    """f32 elements of the CUDA backward's scratch result: delta_i = sum_d dout_id out_id
    - dlse_i per (batch, head, query) row (at least one element). ``fused`` (the fused
    backward of ffi/cuda/attention_fused_bwd.cuh, head dim ``d``): after delta (padded to a
    multiple of 4) the f32 dQ accumulator [B, H, Sq, D] and one uint32 per (batch, head,
    query tile of ``fused_rows(d)`` rows: 128 at d 64, else 64) plus two (semaphores, ticket
    counter, the converter blocks' tile counter); with ``hkv`` kv heads and ``sk`` keys and a
    group that splits (``fused_bwd_splits``: n > 1), then two uint32 per node of the head
    splits' sum tree (n - 1 per (batch, kv head, block of 128 keys)) and, from the next
    multiple of 4, a 2 x 128 x D f32 partial per node. The sizes must match
    ``fused_bwd_scratch`` there."""
    if not fused:
        return max(1, b * h * sq) if static_shape((b, h, sq)) else b * h * sq  # symbolic dims are >= 1
    rows = 128 if d == 64 else 64
    nqt = -(-sq // rows)
    base = -(-(b * h * sq) // 4) * 4 + b * h * sq * d + b * h * nqt + 2
    splits = fused_bwd_splits(h, hkv) if hkv else 1
    if splits == 1:
        return base
    nodes = b * hkv * -(-sk // 128) * (splits - 1)
    return -(-(base + 2 * nodes) // 4) * 4 + nodes * 2 * 128 * d


def _cuda_fused_bwd(q, kind, scale, softcap, has_mask, has_bias) -> bool:
    """Can the CUDA backward take the fused kernel (ffi/cuda/attention_fused_bwd.cuh): at head
    dims 64 and 128, bf16 / f16, scale > 0, mask kinds none, causal and sliding, with or without
    a softcap or a key mask, no bias. Where it can, the scratch is sized for it. The kernel picks
    its backward at run time (a process-wide switch, see attention_launch_impl.cuh) and takes
    the fused one only when the scratch is large enough (and the device can hold a head's key
    blocks at once); the other backwards read only the scratch's first B * H * Sq elements. So
    the scratch, hence the traced program, depends on shapes and options only, never on the
    kernel's environment: jit's cache stays valid whatever the switch says."""
    return (q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[3] in (64, 128) and not has_bias
            and kind in MASK_KINDS and float(scale) > 0)


def _kernel_bwd_cuda(q, k, v, out, lse, dout, dlse, *extras, kind, window, scale, softcap, has_mask,
                     has_bias, has_segments=False):
    """As ``_kernel_bwd`` plus an f32 scratch result (XLA allocates it; the kernel allocates
    nothing), dropped after the call."""
    params = dict(kind=kind, window=window, scale=scale, softcap=softcap, has_mask=has_mask,
                  has_bias=has_bias, has_segments=has_segments)
    if not _cuda_ok(q, k) or (has_segments and not cuda_segments_served(q, k, has_bias=has_bias, scale=scale)):
        return reference_attention_bwd(q, k, v, out, lse, dout, dlse, *extras, **params)
    mask, bias, segments, _ = _split(extras, has_mask, has_bias, has_segments)
    m, bb = _dummies(q, mask, bias)
    b, sq, h, _ = q.shape
    shapes = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(bb.shape, bb.dtype),
        jax.ShapeDtypeStruct((cuda_bwd_scratch_size(
            b, h, sq, q.shape[3], _cuda_fused_bwd(q, kind, scale, softcap, has_mask, has_bias),
            hkv=k.shape[2], sk=k.shape[1]),), jnp.float32),
    )
    attrs = _attrs(kind, window, scale, softcap, has_mask, has_bias)
    operands = (q, k, v, out, lse, dout, dlse, m, bb)
    if segments is not None:
        res = jax.ffi.ffi_call(ffi_target(SEGMENTS_BWD), shapes)(*operands, *_segment_operands(segments), **attrs)
    else:
        res = jax.ffi.ffi_call(ffi_target("rlx_attention_bwd"), shapes)(*operands, **attrs)
    return tuple(res[:4]) if has_bias else tuple(res[:3])


#: On the CPU the op lowers to XLA's attention (the reference: two matmuls around a softmax)
#: unless the reference's [B, H, Sq, Sk] f32 scores would take at least this many bytes.
#: Measured on 2 cores, f32, causal, loss + gradients: XLA ran 6.3x faster than the kernel at
#: B 2, S 256, H 8 / 2, D 32; 4.4x at S 1024, H 4, D 64; 3.0x at S 2048, H 2, D 64. The
#: kernel's edge is memory: O(S) where XLA holds the scores, so it serves the long sequences.
CPU_KERNEL_MIN_SCORE_BYTES = 1 << 30


#: FFI targets of the kernels with segment ids (packed documents): the operands of
#: ``rlx_attention_fwd`` / ``rlx_attention_bwd`` followed by q_segment_ids [B, Sq] and
#: kv_segment_ids [B, Sk] (int32), and on CUDA also their granule tables
#: (``segment_tile_info``). Query / key tile pairs whose id ranges do not meet are skipped,
#: so a packed batch costs about its visible work.
SEGMENTS_FWD, SEGMENTS_BWD = "rlx_attention_segments_fwd", "rlx_attention_segments_bwd"

#: With segment ids the CPU lowering is the kernel from this many bytes of the reference's
#: [B, H, Sq, Sk] f32 scores up (the reference computes every score whatever the documents;
#: the kernel skips the tiles that cross documents but its matmuls are slower than XLA's).
#: Measured on 2 cores, f32, causal, loss + gradients, B2 H4 / 2 D64, lognormal documents
#: of mean length 256: the reference ran 1.26x faster at S 2048 (128 MiB of scores, 18 % of
#: the causal pairs visible) and the kernel 1.53x faster at S 4096 (512 MiB, 12 % visible)
#: (benchmarks/results/attention_segments_cpu.txt). Shorter documents move the crossover
#: down, longer ones up.
CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES = 1 << 28


def _cpu_kernel_serves(q, k, has_segments=False) -> bool:
    if has_segments and not (has_kernel("cpu", SEGMENTS_FWD) and has_kernel("cpu", SEGMENTS_BWD)):
        return False
    # symbolic shapes (jax.export): any size may come, the kernel's memory is O(S)
    return _scores_reach(q, k, CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES if has_segments else CPU_KERNEL_MIN_SCORE_BYTES)


def _kernel_fwd_cpu(q, k, v, *extras, **params):
    """The CPU's forward; its kernel takes no sinks: XLA applies them to its (out, lse)."""
    if not _cpu_kernel_serves(q, k, params.get("has_segments", False)):
        return reference_attention(q, k, v, *extras, **params)
    extras, params, sinks = _without_sinks(extras, params)
    out, lse = _kernel_fwd(q, k, v, *extras, **params)
    return (out, lse) if sinks is None else finish_sinks(out, lse, sinks)


def _kernel_bwd_cpu(q, k, v, out, lse, dout, dlse, *extras, **params):
    if not _cpu_kernel_serves(q, k, params.get("has_segments", False)):
        return reference_attention_bwd(q, k, v, out, lse, dout, dlse, *extras, **params)
    return _kernel_bwd(q, k, v, out, lse, dout, dlse, *extras, **params)


def _kernel_ok(q, k, v, *rest, **params):
    """The kernels take q, k, v (and bias, out, dout) of one dtype."""
    allowed = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
    return q.dtype in allowed and k.dtype == q.dtype and v.dtype == q.dtype


def _partition_factors(avals_in, avals_out, *, has_mask, has_bias, has_segments=False, has_sinks=False,
                       **params):
    """SPMD axes: q, out (b, s, h, d); k, v (b, t, h, d); lse (b, h, s); key mask (b, t);
    bias (b, h, s, t); segment ids (b, s) and (b, t); sinks (b, h). Batch and heads may split
    across devices. With grouped kv heads (H = Hkv * G) a query-head axis is the compound
    (h, g): query head h * G + g reads kv head h, so splitting the H axis into contiguous
    shards on group boundaries (mesh axes dividing Hkv) gives each shard the kv heads of its
    own groups: q, k, v, lse and the gradients all stay local. With one kv head (multi-query)
    the query heads split over g, k and v are replicated and their gradients are summed over
    the shards."""
    hq, hkv = avals_in[0].shape[2], avals_in[1].shape[2]
    grouped = hkv != hq and hkv > 1
    h = ("h", "g") if grouped else "g" if hkv == 1 and hq > 1 else "h"
    sizes = {"g": hq // hkv} if grouped else {}
    q, kv, lse = ("b", "s", h, "d"), ("b", "t", "h", "d"), ("b", h, "s")
    bias = ("b", h, "s", "t")
    extras = [("b", "t")] * has_mask + [bias] * has_bias + [("b", "s"), ("b", "t")] * has_segments
    if len(avals_out) == 2:  # forward: q, k, v, [mask], [bias], [segment ids], [sinks] -> out, lse
        return [q, kv, kv, *extras, *[("b", h)] * has_sinks], [q, lse], sizes
    # backward: q, k, v, out, lse, dout, dlse, [mask], [bias], [segment ids] -> dq, dk, dv, [dbias]
    return [q, kv, kv, q, lse, q, lse, *extras], [q, kv, kv] + [bias] * has_bias, sizes


_PARTITION = Partition(_partition_factors, shardable=["b", "h", "g"])

attention_fwd = FusedPrimitive(
    "rlx_attention_fwd", reference_attention, target="rlx_attention_fwd",
    kernel={"cpu": _kernel_fwd_cpu, "cuda": _kernel_fwd_cuda},
    kernel_ok=_kernel_ok, platforms=("cpu", "cuda"), partition=_PARTITION,
)

# ---- cuDNN's forward where it is faster ----------------------------------------------------

#: Whether the CUDA forward of plain attention runs cuDNN's flash forward (``_cudnn_forward``).
#: ``RLX_ATTENTION_CUDNN_FORWARD=0`` in the environment (read at import) or False here keeps
#: our forward kernel there too: the GPU tests of our kernels and the sanitizer runs do. It is
#: read when a call is lowered: a function jit has already compiled keeps its route.
CUDNN_FORWARD = os.environ.get("RLX_ATTENTION_CUDNN_FORWARD", "1") != "0"

#: the refusals of cuDNN's forward in JAX (no cuDNN or too old, a shape it does not take, an
#: internal signature of another jax version): any of them leaves the call to our kernel
_CUDNN_REFUSALS = (ImportError, AttributeError, TypeError, ValueError, NotImplementedError, RuntimeError)


def _cudnn_attention(q, k, v, *, kind, scale):
    """(out [B, Sq, H, D], lse [B, H, Sq] f32) from cuDNN's flash forward as JAX runs it for
    ``jax.nn.dot_product_attention(implementation="cudnn")``: its softmax statistics are the
    natural-log lse of the scaled scores, the lse our backward reads (they agree with our
    kernel's to 1e-6 on an H200). Its causal mask is top-left, ours bottom-right: the same
    where Sq == Sk, the only causal calls routed here."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    mask = cudnn.MaskType.CAUSAL if kind == "causal" else cudnn.MaskType.NO_MASK
    out, stats = cudnn.dot_product_attention(q, k, v, scale=scale, mask_type=mask, qkv_layout="BTNH",
                                             return_residual=True)
    return out, stats.reshape(q.shape[0], q.shape[2], q.shape[1]).astype(jnp.float32)


def _cudnn_forward(avals, params):
    """The forward through cuDNN for this call, or None to run ours. On CUDA, plain
    attention (q, k, v only: no key mask, bias, segment ids or sinks; bf16 / f16; head dim
    64 or 128; mask kind none, or causal with Sq == Sk; no softcap; scale > 0) on a compute
    capability 9.0 device runs cuDNN's flash forward, and the backward ours (the
    deterministic one): at the Llama shapes of docs/PERFORMANCE.md its forward takes
    0.88-0.98x the time of our warp-specialised kernel (``benchmarks.attention_kernels``), and
    the ``llama-v32k`` step gains 0.08-0.35 ms of its 47 (two in-process A/Bs; cuDNN's
    forward has no atomics: the step stays bitwise reproducible). Masks, softcaps, windows,
    segment ids, sinks, other head dims and other devices keep our forward."""
    if not CUDNN_FORWARD or len(avals) != 3 or params.get("has_segments") or params.get("has_sinks"):
        return None
    q, k, v = avals
    kind = params["kind"]
    if not static_shape(q.shape, k.shape):  # jax.export's symbolic dims: our kernel takes them
        return None
    if (q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype
            or q.shape[3] not in (64, 128) or v.shape[3] != q.shape[3] or 0 in (*q.shape, *k.shape)):
        return None
    if params["softcap"] or float(params["scale"]) <= 0 or kind not in ("none", "causal"):
        return None
    if kind == "causal" and q.shape[1] != k.shape[1]:
        return None
    if _hopper() is None:
        return None
    fn = partial(_cudnn_attention, kind=kind, scale=float(params["scale"]))
    try:
        jax.eval_shape(fn, q, k, v)  # raises where JAX's cuDNN path refuses the call
    except _CUDNN_REFUSALS:
        return None
    return fn


_our_cuda_forward = attention_fwd._lowering("cuda")


def _cuda_forward_lowering(ctx, *args, **params):
    """attention_fwd on CUDA: cuDNN's forward where ``_cudnn_forward`` picks it (its own
    sharding rules split it over batch and heads under SPMD), else our kernel's lowering."""
    fn = _cudnn_forward(ctx.avals_in, params)
    if fn is None:
        return _our_cuda_forward(ctx, *args, **params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(attention_fwd.p, _cuda_forward_lowering, platform="cuda")

attention_tangent = FusedPrimitive("rlx_attention_tangent", reference_attention_tangent)
attention_bwd = FusedPrimitive(
    "rlx_attention_bwd", reference_attention_bwd, target="rlx_attention_bwd",
    kernel={"cpu": _kernel_bwd_cpu, "cuda": _kernel_bwd_cuda},
    kernel_ok=_kernel_ok, platforms=("cpu", "cuda"), partition=_PARTITION,
)


# ---- differentiation rules -------------------------------------------------------------


def _sink_tangent(out, lse, sinks, tsinks, tout, tlse):
    """The sinks' terms of the forward's tangent: with p_i = exp(z - lse_i) the sink's
    probability (z of the row's head; 0 where lse = -inf), d lse_i = ... + p_i dz and
    d out_i = ... - p_i dz out_i, added to the tangent primitive's (tout, tlse), which it
    computed from the same (out, lse) with the sink's tangent left out."""
    acc = lse.dtype
    z = sinks.astype(acc)[..., None]                                   # [B, H, 1]
    p = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(z - jnp.where(lse == -jnp.inf, 0.0, lse)))
    dl = p * tsinks.astype(acc)[..., None]                             # [B, H, Sq]
    tout = (tout.astype(acc) - jnp.swapaxes(dl, 1, 2)[..., None] * out.astype(acc)).astype(tout.dtype)
    return tout, (tlse + dl).astype(tlse.dtype)


@attention_fwd.def_jvp
def _fwd_jvp(primals, tangents, **params):
    q, k, v, *extras = primals
    tq, tk, tv, *textras = instantiate(tangents, primals)
    out, lse = attention_fwd(q, k, v, *extras, **params)
    core, core_params, sinks = _without_sinks(extras, params)
    lin = [tq, tk, tv] + ([textras[params["has_mask"]]] if params["has_bias"] else [])
    tout, tlse = attention_tangent(q, k, v, out, lse, *core, *lin, **core_params)
    if sinks is not None:
        tout, tlse = _sink_tangent(out, lse, sinks, textras[-1], tout, tlse)
    return (out, lse), (tout, tlse)


@attention_tangent.def_transpose
def _tangent_transpose(cts, *args, **params):
    n_res = 5 + params["has_mask"] + params["has_bias"] + 2 * params.get("has_segments", False)
    residuals, linear = args[:n_res], args[n_res:]
    if any(ad.is_undefined_primal(r) for r in residuals):
        raise ValueError("attention tangent is linear in (tq, tk, tv, tbias) only")
    ct_out, ct_lse = cts
    if type(ct_out) is ad.Zero and type(ct_lse) is ad.Zero:
        return [None] * n_res + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in linear]
    q, k, v, out, lse, *extras = residuals
    ct_out = jnp.zeros(out.shape, out.dtype) if type(ct_out) is ad.Zero else ct_out
    ct_lse = jnp.zeros(lse.shape, lse.dtype) if type(ct_lse) is ad.Zero else ct_lse
    grads = attention_bwd(q, k, v, out, lse, ct_out, ct_lse, *extras, **params)
    return [None] * n_res + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, linear)]


def _batch_into_b(prim: FusedPrimitive):
    """Batching rule: every operand and result of the attention primitives leads with the
    batch axis B, so a vmapped axis N is folded into it ([N, B, ...] -> [N * B, ...])."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
        folded = []
        for a, d in zip(args, dims):
            a = jnp.broadcast_to(a, (size, *a.shape)) if d is NOT_MAPPED else jnp.moveaxis(a, d, 0)
            folded.append(a.reshape(size * a.shape[1], *a.shape[2:]))
        batch = jnp.moveaxis(args[0], dims[0], 0).shape[1] if dims[0] is not NOT_MAPPED else args[0].shape[0]
        outs = prim(*folded, **params)
        return [o.reshape(size, batch, *o.shape[1:]) for o in outs], [0] * len(outs)

    return rule


for _prim in (attention_fwd, attention_tangent, attention_bwd):
    _prim.def_batching(_batch_into_b(_prim))


# ---- public functions ------------------------------------------------------------------


CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


def _check_qkv(q, k, v, who):
    """q, k, v flattened to [B, S, H, D] (their leading batch axes folded into B) and the
    leading axes to give the result back."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {x.dtype}")
        if x.ndim < 3:
            raise ValueError(f"{who}: {name} must have shape [..., S, H, D] (rank >= 3), got {x.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{who}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{who}: k {k.shape} and v {v.shape} must have the same shape")
    lead = q.shape[:-3]
    if k.shape[:-3] != lead or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{who}: k {k.shape} must match q {q.shape} in its leading (batch) axes and head dim")
    h, hkv = q.shape[-2], k.shape[-2]
    if (hkv == 0 and h != 0) or (hkv != 0 and h % hkv != 0):
        raise ValueError(f"{who}: kv heads ({hkv}) must divide query heads ({h})")
    b = math.prod(lead)
    flat = lambda x: x.reshape(b, *x.shape[-3:])
    return flat(q), flat(k), flat(v), lead


def _scalar(value, name, who):
    """float(value), or None when value is traced (known only when the program runs)."""
    if isinstance(value, str) or jnp.ndim(value) != 0:
        raise ValueError(f"{who}: {name} must be a real scalar, got {value!r}")
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return None
    except TypeError:
        raise TypeError(f"{who}: {name} must be a real scalar, got {value!r}") from None


def _check_options(q, k, lead, mask_kind, window, mask, bias, scale, softcap, causal_alignment, who):
    """Validated static params, the (cast, flattened) mask / bias operands and a traced
    scale (or None). q, k are [B, S, H, D]; mask and bias carry the leading axes ``lead``."""
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"{who}: mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"{who}: causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")
    if mask_kind == "sliding":
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
            raise ValueError(f"{who}: mask_kind='sliding' needs an int window >= 0, got {window!r}")
    elif window is not None:
        raise ValueError(f"{who}: window is only used with mask_kind='sliding' (got {window!r})")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != (*lead, sk):
            raise ValueError(f"{who}: mask must have shape (..., Sk) = {(*lead, sk)}, got {mask.shape}")
        if jnp.issubdtype(mask.dtype, jnp.complexfloating):
            raise TypeError(f"{who}: mask must be real or bool, got {mask.dtype}")
        mask = mask.astype(jnp.float32).reshape(b, sk)
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (*lead, h, sq, sk):
            raise ValueError(f"{who}: bias must have shape (..., H, Sq, Sk) = {(*lead, h, sq, sk)}, got {bias.shape}")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"{who}: bias must be floating point, got {bias.dtype}")
        # kept in its own dtype until _with_shifted_bias has shifted it: a -1e9 row would
        # be -inf in f16 before the shift and finite differences after it
        bias = bias.reshape(b, h, sq, sk)
    traced_scale = None
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    else:
        value = _scalar(scale, "scale", who)
        if value is None:  # traced: folded into q, the kernels take scale 1
            traced_scale, scale = scale, 1.0
        elif not math.isfinite(value):
            raise ValueError(f"{who}: scale must be finite, got {scale}")
        else:
            scale = value
    if softcap is not None:
        value = _scalar(softcap, "softcap", who)
        if value is None:
            raise TypeError(
                f"{who}: softcap must be a static number (the kernels take it as a compile-time constant), "
                "got a traced value: pass it as a static argument (jit's static_argnums, or a closure)")
        if not value > 0:
            raise ValueError(f"{who}: softcap must be > 0 (None disables it), got {softcap}")
        softcap = value
    params = dict(
        kind=mask_kind,
        # a window past every key is the causal mask: clamp (keeps the kernel's int64 safe)
        window=min(int(window), sq + sk) if mask_kind == "sliding" else 0,
        scale=float(scale),
        softcap=softcap if softcap is not None else 0.0,
        has_mask=mask is not None,
        has_bias=bias is not None,
    )
    return params, mask, bias, traced_scale


def _top_left(k, v, mask, bias, sq, kind, causal_alignment):
    """Top-left causal alignment (query i sees keys j <= i, as jax.nn.dot_product_attention's
    is_causal) through the bottom-right kernels: keys past Sq are then hidden from every
    query, so dropping them leaves Sk = Sq, where both alignments agree. Their gradients are
    0 (the slice's transpose pads them)."""
    if causal_alignment == "bottom_right" or kind == "none" or k.shape[1] <= sq:
        return k, v, mask, bias
    k, v = k[:, :sq], v[:, :sq]
    mask = None if mask is None else mask[:, :sq]
    bias = None if bias is None else bias[..., :sq]
    return k, v, mask, bias


def _prepare(q, k, v, mask, bias, mask_kind, window, scale, softcap, causal_alignment, who):
    """Everything the primitives take: (q, k, v, extras, params, traced scale, lead axes)."""
    q, k, v, lead = _check_qkv(q, k, v, who)
    params, mask, bias, traced_scale = _check_options(q, k, lead, mask_kind, window, mask, bias, scale,
                                                      softcap, causal_alignment, who)
    k, v, mask, bias = _top_left(k, v, mask, bias, q.shape[1], mask_kind, causal_alignment)
    extras = [x for x in (mask, bias) if x is not None]
    return q, k, v, extras, params, traced_scale, lead


# A bias row whose largest visible value is beyond this magnitude is shifted (below).
BIAS_SHIFT_FROM = 1024.0


def _with_shifted_bias(extras, params, dtype, segments=None, shift=True):
    """The primitives' extras (mask, bias: as ``_prepare`` gives them) with the bias, when
    there is one, through ``_shift_bias`` (unless not ``shift``: a call with sinks) in the
    wider of its dtype and ``dtype``, then rounded to ``dtype`` (q's, which the kernels
    take); ``segments``: (q_segment_ids, kv_segment_ids)."""
    if not params["has_bias"]:
        return extras
    mask = extras[0] if params["has_mask"] else None
    bias = extras[-1].astype(jnp.promote_types(extras[-1].dtype, dtype))
    if shift:
        bias = _shift_bias(bias, mask, segments, params["kind"], params["window"])
    return [*extras[:-1], bias.astype(dtype)]


def _shift_bias(bias, mask, segments, kind, window):
    """bias [B, H, Sq, Sk] with, on each row whose largest value over the visible keys m
    has |m| > BIAS_SHIFT_FROM, m subtracted (a constant per row: softmax is unchanged in
    exact arithmetic, and no gradient flows through m). Why: a bias that masks with a
    huge finite value (-1e9, finfo.min) on every visible key of a row (a padding query,
    or a left-padded row under a causal mask) puts the row's log-sum-exp m + log(l) at
    |m| ~ 1e9, where log(l) rounds away; the backward forms each probability as
    exp(s - lse) from it, gets them about l times too large, and sends wrong dq and wrong
    dk, dv to the keys (also the visible ones of other rows). Shifted, such a row is the
    softmax of its scores plus the bias's differences, with gradients to match. Other rows
    are left bit for bit as given."""
    sq, sk = bias.shape[-2:]
    vis = _visible(sq, sk, kind, window, mask)
    if segments is not None:
        vis = vis & _segment_visible(segments)
    wide = bias.astype(_acc_dtype(bias.dtype))
    m = jnp.max(jnp.where(vis, wide, -jnp.inf), axis=-1, keepdims=True)
    far = jnp.isfinite(m) & (jnp.abs(m) > BIAS_SHIFT_FROM)
    shifted = (wide - jax.lax.stop_gradient(jnp.where(far, m, 0.0))).astype(bias.dtype)
    return jnp.where(far, shifted, bias)


def _fold_scale(q, scale):
    """q * scale (a traced scale: scale * q.k = (scale q).k), rounded once to q's dtype."""
    acc = _acc_dtype(q.dtype)
    return (q.astype(acc) * jnp.asarray(scale, acc)).astype(q.dtype)


def attention(q, k, v, *, mask_kind="none", window=None, mask=None, bias=None, scale=None,
              softcap=None, causal_alignment="bottom_right", q_segment_ids=None, kv_segment_ids=None,
              sinks=None):
    """softmax(mask(softcap(scale * q k^T) + bias)) v, per head.

    q: [..., Sq, H, D]; k, v: [..., Sk, Hkv, D] with the same leading (batch) axes, any
    number of them (folded into one batch axis), and Hkv dividing H (grouped-query: query
    head h reads kv head h // (H // Hkv)). mask: [..., Sk] key mask (>= 0.5 keeps); bias:
    [..., H, Sq, Sk] added after the softcap. scale: default 1/sqrt(D); a Python number,
    or a traced scalar (then q is multiplied by it before the kernel, one extra rounding
    of q in its dtype, and the gradient flows to scale). softcap: c > 0 for c * tanh(s / c),
    a static number (a traced softcap raises TypeError).

    mask_kind: "none" | "causal" | "sliding" (with ``window`` w: keys [pos_i - w, pos_i]).
    causal_alignment says where query i sits among the keys:
    "bottom_right" (the default, RLX's rule): pos_i = i + max(Sk - Sq, 0), the last query
    sees every key, as when decoding new queries after a cache; "top_left": pos_i = i, as
    ``jax.nn.dot_product_attention(is_causal=True)``. With Sq = 2, Sk = 6 and "causal",
    bottom-right lets query 0 see keys 0..4 and query 1 keys 0..5; top-left, query 0 key 0
    and query 1 keys 0..1. When Sq >= Sk both agree.

    q_segment_ids [..., Sq], kv_segment_ids [..., Sk] (integers, given together): packed
    documents; query i sees key j only where the ids are equal (ANDed with the mask kind,
    window and key mask). On the CPU these run the kernel, which skips the (query tile, key
    tile) pairs whose id ranges do not meet (ids sorted within a row, as packing gives, make
    the cost about the visible work), from ``CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES`` of scores
    up, and the pure-JAX reference below (O(Sq * Sk) memory); on CUDA the Hopper kernels'
    segment forms where ``cuda_segments_served`` says so, else the reference.
    sinks [H]: a per-head logit joining each row's softmax denominator with no value,
    out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)); differentiable in the
    sinks too. The CUDA kernels apply them in their epilogue; on the CPU XLA applies them
    to the kernel's (out, lse) (see ``attention_segments``).

    Returns [..., Sq, H, D] in q's dtype (f32 accumulation). Rows with no visible key are
    0. Differentiable in every mode; reverse mode runs the fused backward kernel, and
    memory is O(S) on the kernel path. On CUDA the kernels serve bf16 and f16 (head dim
    <= 256); f32 and f64 run XLA's code (the pure-JAX reference, O(Sq * Sk) memory), whose
    f32 matmuls use TF32 tensor cores under JAX's default matmul precision and beat the
    f32 SIMT kernel. On the CPU, XLA's code below ``CPU_KERNEL_MIN_SCORE_BYTES`` of scores.
    Under SPMD sharding it runs shard-local over the batch and over heads (under
    grouped-query attention: over kv-head groups, the query heads split on group
    boundaries).
    """
    from .attention_segments import check_segments_and_sinks

    sk = jnp.shape(k)[-3] if jnp.ndim(k) >= 3 else 0
    q, k, v, extras, params, traced_scale, lead = _prepare(q, k, v, mask, bias, mask_kind, window, scale,
                                                           softcap, causal_alignment, "attention")
    if traced_scale is not None:
        q = _fold_scale(q, traced_scale)
    b, sq = q.shape[:2]
    flat_ids = lambda ids, n: ids if ids is None or jnp.shape(ids) != (*lead, n) else jnp.reshape(ids, (b, n))
    full_k = jax.ShapeDtypeStruct((b, sk, *k.shape[2:]), k.dtype)  # before a top-left slice
    q_seg, kv_seg, sinks = check_segments_and_sinks(q, full_k, flat_ids(q_segment_ids, sq),
                                                    flat_ids(kv_segment_ids, sk), sinks, "attention")
    # with sinks no shift: the sinks' term of the denominator is not shifted with a row
    extras = _with_shifted_bias(extras, params, q.dtype, None if q_seg is None else (q_seg, kv_seg[:, :k.shape[1]]),
                                shift=sinks is None)
    if q_seg is not None:
        extras = [*extras, q_seg, kv_seg[:, :k.shape[1]]]
    if sinks is not None:  # one logit a (batch, head): vmap folds into the batch axis as q does
        extras = [*extras, jnp.broadcast_to(sinks.astype(_acc_dtype(q.dtype))[None], (b, q.shape[2]))]
    out, _ = attention_fwd(q, k, v, *extras, has_segments=q_seg is not None, has_sinks=sinks is not None,
                           **params)
    return out.reshape(*lead, *out.shape[1:])


def attention_backward(q, k, v, dy, mask=None, bias=None, *, mask_kind="none", window=None,
                       scale=None, softcap=None, causal_alignment="bottom_right"):
    """The RLX backward ops AttentionBackward{wrt = Query, Key, Value} in one call:
    (dq, dk, dv) for upstream gradient dy shaped like q (same options and layouts as
    ``attention``). The forward is recomputed (out and lse, O(S) memory), then the fused
    backward runs."""
    k_shape = jnp.shape(k)
    q_shape = jnp.shape(q)
    q, k, v, extras, params, traced_scale, lead = _prepare(q, k, v, mask, bias, mask_kind, window, scale,
                                                           softcap, causal_alignment, "attention_backward")
    dy = jnp.asarray(dy)
    if dy.shape != q_shape:
        raise ValueError(f"attention_backward: dy shape {dy.shape} differs from q shape {q_shape}")
    dy = dy.astype(q.dtype).reshape(q.shape)
    extras = _with_shifted_bias(extras, params, q.dtype)
    qs = q if traced_scale is None else _fold_scale(q, traced_scale)
    out, lse = attention_fwd(qs, k, v, *extras, **params)
    dq, dk, dv = attention_bwd(qs, k, v, out, lse, dy, jnp.zeros_like(lse), *extras, **params)[:3]
    if traced_scale is not None:  # d(scale q) / dq = scale
        dq = _fold_scale(dq, traced_scale)
    sk = k_shape[-3]
    if dk.shape[1] != sk:  # top-left alignment dropped keys no query sees: their gradients are 0
        pad = ((0, 0), (0, sk - dk.shape[1]), (0, 0), (0, 0))
        dk, dv = jnp.pad(dk, pad), jnp.pad(dv, pad)
    return dq.reshape(q_shape), dk.reshape(k_shape), dv.reshape(k_shape)


def _from_rlx(x, heads, head_dim, name):
    """[B, S, heads * head_dim] (or [S, ...]) -> [B, S, heads, head_dim]."""
    x = jnp.asarray(x)
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3 or x.shape[-1] % head_dim:
        raise ValueError(
            f"attention_rlx: {name} must be [B, S, heads * {head_dim}] (or [S, ...]), got {x.shape}")
    n = x.shape[-1] // head_dim
    if heads is not None and n != heads:
        raise ValueError(f"attention_rlx: {name} has {n} heads of {head_dim}, expected {heads}")
    return x.reshape(*x.shape[:2], n, head_dim)


def attention_rlx(q, k, v, *, num_heads, head_dim, mask_kind="none", window=None, mask=None,
                  bias=None, scale=None, softcap=None, q_segment_ids=None, kv_segment_ids=None,
                  sinks=None):
    """``attention`` on RLX's layout: q [B, Sq, num_heads * head_dim], k, v
    [B, Sk, Hkv * head_dim] (rank 2 means B = 1); returns q's layout. Segment ids
    [B, Sq] / [B, Sk] and sinks [num_heads] as in ``attention``."""
    q = jnp.asarray(q)
    q4 = _from_rlx(q, num_heads, head_dim, "q")
    k4 = _from_rlx(k, None, head_dim, "k")
    v4 = _from_rlx(v, None, head_dim, "v")
    out = attention(q4, k4, v4, mask_kind=mask_kind, window=window, mask=mask, bias=bias,
                    scale=scale, softcap=softcap, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, sinks=sinks)
    return out.reshape(q.shape)
