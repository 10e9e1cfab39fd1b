"""Fused inference ops produced by RLX's fusion passes."""

from __future__ import annotations

from typing import Optional

from .dtypes import DType
from .errors import OpFault
from .op import ActivationKind, Op, need_float, need_min_rank, need_rank, need_same_dtype, op_class
from .ops_linalg import MatMul
from .ops_norm import check_params
from .shape import Shape, dims_compatible


@op_class
class FusedMatMulBiasAct(Op):
    """``act(x @ w + bias)``: x ``[..., K]``, w ``[K, N]``, bias ``[N]``; ``activation``
    None means identity."""

    activation: Optional[ActivationKind] = None

    def arity(self):
        return 3

    def infer(self, ins):
        x, w, b = ins
        out = MatMul().infer([x, w])
        need_rank("fused_matmul_bias_act bias", b, 1)
        need_same_dtype("fused_matmul_bias_act", x, w, b)
        if not dims_compatible(b.dims[0], out.dims[-1]):
            raise OpFault(f"bias has {b.dims[0]} entries, output has {out.dims[-1]} columns")
        return out


def _residual_norm(name, has_bias, ins):
    x, res = ins[0], ins[1]
    rest = ins[2:]
    need_float(f"{name} x", x)
    need_min_rank(f"{name} x", x, 1)
    if x.dims != res.dims and not all(dims_compatible(a, b) for a, b in zip(x.dims, res.dims)):
        raise OpFault(f"{name} residual {res} differs from x {x}")
    need_same_dtype(name, x, res, *rest)
    d = (x.dims[-1],)
    check_params(name, rest, d, (("bias",) if has_bias else ()) + ("gamma", "beta"))
    return x


@op_class
class FusedResidualLN(Op):
    """``LayerNorm(x + residual [+ bias])`` over the last axis; inputs ``[x, residual,
    (bias), gamma, beta]``."""

    has_bias: bool
    eps: float

    def arity(self):
        return 5 if self.has_bias else 4

    def infer(self, ins):
        return _residual_norm("fused_residual_ln", self.has_bias, ins)


@op_class
class FusedResidualRmsNorm(Op):
    """``RmsNorm(x + residual [+ bias])`` over the last axis; same inputs as
    FusedResidualLN."""

    has_bias: bool
    eps: float

    def arity(self):
        return 5 if self.has_bias else 4

    def infer(self, ins):
        return _residual_norm("fused_residual_rms_norm", self.has_bias, ins)


@op_class
class FusedSwiGLU(Op):
    """``silu(gate) * up`` from one ``[..., 2F]`` input split in halves (up low, gate
    high; ``gate_first`` swaps) -> ``[..., F]`` (cast to ``cast_to`` when set)."""

    cast_to: Optional[DType] = None
    gate_first: bool = False

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        need_min_rank("fused_swiglu input", x, 1)
        need_float("fused_swiglu input", x)
        last = x.dims[-1]
        if not isinstance(last, int) or last % 2:
            raise OpFault(f"fused_swiglu last dim {last} must be static and even")
        return Shape(x.dims[:-1] + (last // 2,), self.cast_to or x.dtype)


def _check_keep_mask(hidden: Shape, mask: Shape) -> None:
    """RLX's Custom keep-mask is read as its first ``B * S`` elements: ``mask`` must hold
    at least that many (checked when both counts are static)."""
    b, s = hidden.dims[0], hidden.dims[1]
    need = b * s if isinstance(b, int) and isinstance(s, int) else None
    have = mask.numel()
    if need is not None and have is not None and have < need:
        raise OpFault(f"mask {mask} holds {have} elements; the [B, S] keep-mask needs {need}")


@op_class
class FusedAttentionBlock(Op):
    """QKV projection -> split -> [RoPE] -> SDPA -> output projection; inputs
    ``hidden [B, S, H*D], qkv_w [H*D, 3*H*D], out_w [H*D, H*D], mask [B, S]``, then
    ``qkv_b, out_b`` if ``has_bias``, then ``rope_cos, rope_sin`` if ``has_rope``;
    output shaped like hidden."""

    num_heads: int
    head_dim: int
    has_bias: bool
    has_rope: bool

    def arity(self):
        return 4 + 2 * self.has_bias + 2 * self.has_rope

    def infer(self, ins):
        x, wqkv, wout = ins[:3]
        need_rank("fused_attention_block hidden", x, 3)
        need_float("fused_attention_block hidden", x)
        hd = self.num_heads * self.head_dim
        if not dims_compatible(x.dims[2], hd):
            raise OpFault(f"hidden last dim {x.dims[2]} != num_heads*head_dim {hd}")
        need_rank("fused_attention_block qkv_w", wqkv, 2)
        need_rank("fused_attention_block out_w", wout, 2)
        if not dims_compatible(wqkv.dims[0], hd):
            raise OpFault(f"qkv_w {wqkv} must have {hd} rows")
        if not dims_compatible(wout.dims[1], x.dims[2]):
            raise OpFault(f"out_w {wout} must map back to {x.dims[2]} columns")
        _check_keep_mask(x, ins[3])
        return x


@op_class
class FusedTransformerLayer(Op):
    """A full post-LN transformer layer (attention + residual/LN + FFN + residual/LN);
    inputs ``hidden, qkv_w, [qkv_b], out_w, [out_b], ln1_g, ln1_b, fc1_w, [fc1_b],
    fc2_w, [fc2_b], ln2_g, ln2_b, mask`` (biases when ``has_bias``); without biases RLX's
    8-input form ``hidden, qkv_w, out_w, ln1_g, fc1_w, fc2_w, ln2_g, mask`` (zero betas)
    is accepted too. The mask is RLX's Custom keep-mask: its first ``B * S`` elements in
    row-major order, read as ``[B, S]`` (a ``[B, S]`` mask, or e.g. a ``[B, H, S, S]``
    tensor of which RLX's kernels read that prefix); output shaped like hidden."""

    num_heads: int
    head_dim: int
    intermediate_size: int
    eps1: float
    eps2: float
    activation: ActivationKind
    has_bias: bool

    def arity(self):
        return 14 if self.has_bias else None

    def infer(self, ins):
        if not self.has_bias and len(ins) not in (8, 10):
            raise OpFault(f"without bias takes 10 inputs (or RLX's 8, without the LayerNorm "
                          f"betas), got {len(ins)}")
        x = ins[0]
        need_rank("fused_transformer_layer hidden", x, 3)
        need_float("fused_transformer_layer hidden", x)
        hd = self.num_heads * self.head_dim
        if not dims_compatible(x.dims[2], hd):
            raise OpFault(f"hidden last dim {x.dims[2]} != num_heads*head_dim {hd}")
        _check_keep_mask(x, ins[-1])
        return x
