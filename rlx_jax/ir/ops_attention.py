"""Attention and positional ops: Attention, Rope (NeoX halves), AxialRope2d.

Layout (RLX): q ``[B, Sq, H*D]``, k/v ``[B, Sk, Hkv*D]`` (``H % Hkv == 0``); the 4-D
layout ``[B, S, H, D]`` is accepted too. The output has q's shape.
"""

from __future__ import annotations

from typing import Optional

from .errors import OpFault
from .op import MaskKind, Op, need_float, need_min_rank, need_rank, need_same_dtype, op_class
from .shape import dims_compatible


def check_attention(num_heads: int, head_dim: int, mask_kind: MaskKind, q, k, v, mask=None):
    """Check q/k/v (and the mask of Custom/Bias) for ``num_heads`` x ``head_dim``."""
    need_rank("attention q", q, 3, 4)
    need_float("attention q", q)
    need_same_dtype("attention q/k/v", q, k, v)
    for nm, s in (("k", k), ("v", v)):
        if s.rank != q.rank:
            raise OpFault(f"attention {nm} rank {s.rank} differs from q rank {q.rank}")
        if not dims_compatible(s.dims[0], q.dims[0]):
            raise OpFault(f"attention {nm} batch {s.dims[0]} differs from q batch {q.dims[0]}")
    if not dims_compatible(k.dims[1], v.dims[1]):
        raise OpFault(f"attention k length {k.dims[1]} differs from v length {v.dims[1]}")
    if q.rank == 3:
        if not dims_compatible(q.dims[2], num_heads * head_dim):
            raise OpFault(
                f"attention q last dim {q.dims[2]} != num_heads*head_dim = {num_heads * head_dim}"
            )
        for nm, s in (("k", k), ("v", v)):
            d = s.dims[2]
            if isinstance(d, int) and (d % head_dim or num_heads % max(d // head_dim, 1) or d == 0):
                raise OpFault(
                    f"attention {nm} last dim {d} is not a head count dividing {num_heads} times head_dim {head_dim}"
                )
    else:
        if not (dims_compatible(q.dims[2], num_heads) and dims_compatible(q.dims[3], head_dim)):
            raise OpFault(f"attention q {q} must be [B, S, {num_heads}, {head_dim}]")
        for nm, s in (("k", k), ("v", v)):
            h = s.dims[2]
            if not dims_compatible(s.dims[3], head_dim) or (isinstance(h, int) and (h == 0 or num_heads % h)):
                raise OpFault(f"attention {nm} {s} must be [B, S, Hkv, {head_dim}] with Hkv dividing {num_heads}")
    if mask_kind.kind == "Custom":
        need_rank("attention Custom mask", mask, 2)
        if not (_bcast_ok(mask.dims[0], q.dims[0]) and dims_compatible(mask.dims[1], k.dims[1])):
            raise OpFault(f"attention Custom mask must be [batch, key_len] = [{q.dims[0]}, {k.dims[1]}], got {mask}")
    elif mask_kind.kind == "Bias":
        need_rank("attention Bias mask", mask, 4)
        want = (q.dims[0], num_heads, q.dims[1], k.dims[1])
        if not all(_bcast_ok(a, b) for a, b in zip(mask.dims, want)):
            raise OpFault(
                f"attention Bias mask must be [batch, heads, q_len, k_len] = {list(want)}, got {mask}"
            )


def _bcast_ok(d, want) -> bool:
    return d == 1 or dims_compatible(d, want)


@op_class
class Attention(Op):
    """Scaled dot-product attention: scores ``q.k * (score_scale or 1/sqrt(head_dim))``,
    then ``c*tanh(s/c)`` when ``attn_logit_softcap`` is set, then the mask, softmax over
    keys, times v. Inputs ``[q, k, v]`` plus the mask for Custom/Bias."""

    num_heads: int
    head_dim: int
    mask_kind: MaskKind
    score_scale: Optional[float] = None
    attn_logit_softcap: Optional[float] = None

    def validate(self):
        if self.num_heads == 0 or self.head_dim == 0:
            raise OpFault("num_heads and head_dim must be positive")
        if self.attn_logit_softcap is not None and not self.attn_logit_softcap > 0:
            raise OpFault(f"attn_logit_softcap must be > 0, got {self.attn_logit_softcap}")

    def arity(self):
        return 4 if self.mask_kind.needs_mask_input else 3

    def infer(self, ins):
        check_attention(self.num_heads, self.head_dim, self.mask_kind, *ins)
        return ins[0]


def check_rope(head_dim: int, n_rot: int, x, cos, sin):
    need_min_rank("rope x", x, 1)
    need_float("rope x", x)
    last = x.dims[-1]
    if isinstance(last, int) and last % head_dim:
        raise OpFault(f"rope x last dim {last} is not a multiple of head_dim {head_dim}")
    if cos.dims != sin.dims:
        raise OpFault(f"rope cos {cos} and sin {sin} differ")
    need_float("rope cos", cos)
    need_min_rank("rope cos", cos, 1)
    c = cos.dims[-1]
    if isinstance(c, int) and c not in (n_rot // 2, n_rot):
        raise OpFault(f"rope cos/sin last dim {c} must be n_rot/2 = {n_rot // 2} (or n_rot)")


@op_class
class Rope(Op):
    """NeoX RoPE per head of ``head_dim``: the first ``n_rot`` dims rotate as two halves
    ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``, the rest pass through; inputs
    ``[x [..., H*head_dim], cos, sin]`` (cos/sin ``[..., n_rot/2]``)."""

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
