"""Attention and positional ops: Attention, Rope (NeoX halves), AxialRope2d.

Layouts (RLX): q ``[B, Sq, H*D]``, k/v ``[B, Sk, Hkv*D]`` (``H % Hkv == 0``); also
``[S, H*D]`` (batch 1) and rank 4 ``[B, S, H, D]`` or ``[B, H, S, D]`` (the latter when
q's dim 1 equals num_heads). The output has q's shape.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from .errors import OpFault
from .op import MaskKind, Op, need_float, need_min_rank, need_rank, need_same_dtype, op_class
from .shape import dims_compatible


def attention_bhsd(q: Shape, num_heads: int) -> bool:
    """Rank-4 operands are ``[B, H, S, D]`` when q's dim 1 equals ``num_heads``, else
    ``[B, S, H, D]`` (the rule the lowering follows too)."""
    return q.rank == 4 and q.dims[1] == num_heads


def _logical(what: str, s: Shape, head_dim: int, bhsd: bool) -> tuple:
    """An attention operand as logical ``(B, S, H, D)``: rank 2 ``[S, H*D]`` (B = 1),
    rank 3 ``[B, S, H*D]``, rank 4 ``[B, S, H, D]`` or ``[B, H, S, D]``."""
    if s.rank in (2, 3):
        last = s.dims[-1]
        if isinstance(last, int) and (last == 0 or last % head_dim):
            raise OpFault(f"attention {what} last dim {last} is not a positive multiple of head_dim {head_dim}")
        heads = last // head_dim if isinstance(last, int) else last
        b, sq = (1, s.dims[0]) if s.rank == 2 else (s.dims[0], s.dims[1])
        return b, sq, heads, head_dim
    if s.rank == 4:
        if bhsd:
            return s.dims[0], s.dims[2], s.dims[1], s.dims[3]
        return s.dims[0], s.dims[1], s.dims[2], s.dims[3]
    raise OpFault(f"attention {what} must have rank 2, 3 or 4, got {s}")


def check_attention(num_heads: int, head_dim: int, mask_kind: MaskKind, q, k, v, mask=None):
    """Check q/k/v (and the mask of Custom/Bias) for ``num_heads`` x ``head_dim``:
    q has ``num_heads`` heads, k/v share a head count dividing it (GQA), a key length
    and the batch; the output has q's shape."""
    need_float("attention q", q)
    need_same_dtype("attention q/k/v", q, k, v)
    bhsd = attention_bhsd(q, num_heads)
    qb, qs, qh, qd = _logical("q", q, head_dim, bhsd)
    if not (dims_compatible(qh, num_heads) and dims_compatible(qd, head_dim)):
        raise OpFault(f"attention q {q} does not hold num_heads*head_dim = {num_heads}x{head_dim}")
    kv = []
    for nm, s in (("k", k), ("v", v)):
        if s.rank != q.rank:
            raise OpFault(f"attention {nm} rank {s.rank} differs from q rank {q.rank}")
        b, sl, h, d = _logical(nm, s, head_dim, bhsd)
        if not dims_compatible(b, qb):
            raise OpFault(f"attention {nm} batch {b} differs from q batch {qb}")
        if not dims_compatible(d, head_dim):
            raise OpFault(f"attention {nm} head dim {d} != head_dim {head_dim}")
        if isinstance(h, int) and (h == 0 or num_heads % h):
            raise OpFault(f"attention {nm} has {h} heads, which does not divide num_heads {num_heads}")
        kv.append((sl, h))
    if not dims_compatible(kv[0][0], kv[1][0]) or not dims_compatible(kv[0][1], kv[1][1]):
        raise OpFault(f"attention k {k} and v {v} disagree in length or heads")
    k_len = kv[0][0]
    if mask_kind.kind == "Custom":
        need_rank("attention Custom mask", mask, 2)
        if not (_bcast_ok(mask.dims[0], qb) and dims_compatible(mask.dims[1], k_len)):
            raise OpFault(f"attention Custom mask must be [batch, key_len] = [{qb}, {k_len}], got {mask}")
    elif mask_kind.kind == "Bias":
        need_rank("attention Bias mask", mask, 4)
        want = (qb, num_heads, qs, k_len)
        if not all(_bcast_ok(a, b) for a, b in zip(mask.dims, want)):
            raise OpFault(
                f"attention Bias mask must be [batch, heads, q_len, k_len] = {list(want)}, got {mask}"
            )


def check_segments_and_sinks(num_heads: int, head_dim: int, q, k, q_segment_ids=None,
                             kv_segment_ids=None, sinks=None):
    """Segment ids ``[B, Sq]`` / ``[B, Sk]`` with an integer dtype (logical batch and
    lengths of q and k); sinks ``[num_heads]`` floating."""
    bhsd = attention_bhsd(q, num_heads)
    qb, qs, _, _ = _logical("q", q, head_dim, bhsd)
    _, ks, _, _ = _logical("k", k, head_dim, bhsd)
    for what, ids, length in (("q_segment_ids", q_segment_ids, qs), ("kv_segment_ids", kv_segment_ids, ks)):
        if ids is None:
            continue
        need_rank(f"attention {what}", ids, 2)
        if not ids.dtype.is_int:
            raise OpFault(f"attention {what} must have an integer dtype, got {ids.dtype.short}")
        if not (dims_compatible(ids.dims[0], qb) and dims_compatible(ids.dims[1], length)):
            raise OpFault(f"attention {what} must be [batch, len] = [{qb}, {length}], got {ids}")
    if sinks is not None:
        need_rank("attention sinks", sinks, 1)
        need_float("attention sinks", sinks)
        if not dims_compatible(sinks.dims[0], num_heads):
            raise OpFault(f"attention sinks must be [num_heads] = [{num_heads}], got {sinks}")


def _bcast_ok(d, want) -> bool:
    return d == 1 or dims_compatible(d, want)


@op_class
class Attention(Op):
    """Scaled dot-product attention: scores ``q.k * (score_scale or 1/sqrt(head_dim))``,
    then ``c*tanh(s/c)`` when ``attn_logit_softcap`` is set, then the mask, softmax over
    keys, times v. Inputs ``[q, k, v]`` plus the mask for Custom/Bias, then
    ``q_segment_ids [B, Sq], kv_segment_ids [B, Sk]`` (integer) when ``segment_ids``
    (query i sees key j only where the ids are equal, on top of the mask), then
    ``sinks [num_heads]`` when ``sinks`` (a per-head logit joining each row's softmax
    denominator, with no value). The two flags are rlx_jax extensions: serde writes them
    only when set, so graphs without them stay RLX's JSON."""

    num_heads: int
    head_dim: int
    mask_kind: MaskKind
    score_scale: Optional[float] = None
    attn_logit_softcap: Optional[float] = None
    segment_ids: Optional[bool] = None
    sinks: Optional[bool] = None

    #: fields serde omits when None (rlx_jax extensions RLX does not know)
    _omit_if_none: ClassVar[tuple] = ("segment_ids", "sinks")

    def validate(self):
        if self.num_heads == 0 or self.head_dim == 0:
            raise OpFault("num_heads and head_dim must be positive")
        if self.attn_logit_softcap is not None and not self.attn_logit_softcap > 0:
            raise OpFault(f"attn_logit_softcap must be > 0, got {self.attn_logit_softcap}")

    def arity(self):
        return 3 + bool(self.mask_kind.needs_mask_input) + 2 * bool(self.segment_ids) + bool(self.sinks)

    def split_inputs(self, ins):
        """(q, k, v, mask or None, (q_segment_ids, kv_segment_ids) or None, sinks or None)."""
        ins = list(ins)
        q, k, v = ins[:3]
        rest = ins[3:]
        mask = rest.pop(0) if self.mask_kind.needs_mask_input else None
        seg = (rest.pop(0), rest.pop(0)) if self.segment_ids else None
        sinks = rest.pop(0) if self.sinks else None
        return q, k, v, mask, seg, sinks

    def infer(self, ins):
        q, k, v, mask, seg, sinks = self.split_inputs(ins)
        check_attention(self.num_heads, self.head_dim, self.mask_kind, q, k, v, mask)
        check_segments_and_sinks(self.num_heads, self.head_dim, q, k, *(seg or (None, None)), sinks)
        return q


def check_rope(head_dim: int, n_rot: int, x, cos, sin):
    """x ``[..., S, H*head_dim]`` (float), cos = sin shape ``[S, T]`` with
    ``T >= n_rot/2``."""
    need_min_rank("rope x", x, 2)
    need_float("rope x", x)
    last = x.dims[-1]
    if isinstance(last, int) and last % head_dim:
        raise OpFault(f"rope x last dim {last} is not a multiple of head_dim {head_dim}")
    if cos.dims != sin.dims:
        raise OpFault(f"rope cos {cos} and sin {sin} differ")
    need_float("rope cos", cos)
    need_rank("rope cos", cos, 2)
    if not dims_compatible(cos.dims[0], x.dims[-2]):
        raise OpFault(f"rope cos/sin have {cos.dims[0]} rows, x has sequence length {x.dims[-2]}")
    c = cos.dims[-1]
    if isinstance(c, int) and c < n_rot // 2:
        raise OpFault(f"rope cos/sin last dim {c} must be >= n_rot/2 = {n_rot // 2}")


@op_class
class Rope(Op):
    """NeoX RoPE per head of ``head_dim``: the first ``n_rot`` dims rotate as two halves
    ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``, the rest pass through; inputs
    ``[x [..., S, H*head_dim], cos [S, T], sin [S, T]]`` with ``T >= n_rot/2`` (the
    first n_rot/2 columns are used)."""

    head_dim: int
    n_rot: int

    def validate(self):
        if self.head_dim == 0 or self.n_rot % 2 or self.n_rot > self.head_dim:
            raise OpFault(
                f"n_rot={self.n_rot} must be even and <= head_dim={self.head_dim} (> 0)"
            )

    def arity(self):
        return 3

    def infer(self, ins):
        check_rope(self.head_dim, self.n_rot, *ins)
        return ins[0]


@op_class
class AxialRope2d(Op):
    """SAM2 axial 2-D RoPE on ``[B, S, num_heads*head_dim]`` for an ``end_x`` x ``end_y``
    grid (``theta`` base, keys repeated ``repeat_factor`` times)."""

    end_x: int
    end_y: int
    head_dim: int
    num_heads: int
    theta: float
    repeat_factor: int

    def validate(self):
        if self.head_dim == 0 or self.head_dim % 4:
            raise OpFault(f"head_dim {self.head_dim} must be a positive multiple of 4")
        if self.num_heads == 0 or self.repeat_factor == 0:
            raise OpFault("num_heads and repeat_factor must be positive")

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        need_rank("axial_rope2d x", x, 3)
        need_float("axial_rope2d x", x)
        if not dims_compatible(x.dims[2], self.num_heads * self.head_dim):
            raise OpFault(f"x last dim {x.dims[2]} != num_heads*head_dim {self.num_heads * self.head_dim}")
        return x
