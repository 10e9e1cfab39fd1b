"""Closed-form gradient ops (RLX's backward kernels).

Each takes the forward operands it needs plus the upstream gradient ``dy`` and yields
one gradient; shapes follow from the forward shapes (RLX_IR.md, backward table).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .dtypes import DType
from .errors import OpFault
from .op import (
    ActivationKind, AttentionBwdWrt, MaskKind, Op, SteKind, need_dtype, need_float,
    need_index, need_rank, op_class,
)
from .ops_attention import check_attention, check_rope
from .ops_conv import check_geometry, conv_shape, pool_shape
from .ops_norm import check_group_norm, check_params, norm_dims
from .ops_quant import _check_bits, check_scale_input
from .ops_reduce import SoftmaxCrossEntropyWithLogits
from .shape import Shape, dims_compatible, norm_axis, same_dims, shapes_match


def like(what: str, a: Shape, b: Shape) -> None:
    """``b`` has ``a``'s dims and dtype (e.g. dy like x)."""
    if not shapes_match(a, b):
        raise OpFault(f"{what}: {b} must match {a}")


@dataclasses.dataclass(frozen=True)
class _Backward(Op):
    is_backward = True


# -- elementwise --------------------------------------------------------------

@op_class
class ReluBackward(_Backward):
    """``dx = dy * (x > 0)``; inputs ``[x, dy]``."""

    def arity(self):
        return 2

    def infer(self, ins):
        like("relu_backward dy", ins[0], ins[1])
        return ins[0]


@op_class
class ActivationBackward(_Backward):
    """``dx = dy * f'(x)`` for activation ``kind`` (Round: straight-through);
    inputs ``[x, dy]``."""

    kind: ActivationKind

    def arity(self):
        return 2

    def infer(self, ins):
        like("activation_backward dy", ins[0], ins[1])
        return ins[0]


@op_class
class FakeQuantizeBackward(_Backward):
    """STE gradient of FakeQuantize (``ste`` picks Identity / ClippedIdentity / Tanh /
    HardTanh); inputs ``[x, dy]``."""

    bits: int
    axis: Optional[int]
    ste: SteKind

    def validate(self):
        _check_bits(self.bits)

    def arity(self):
        return 2

    def infer(self, ins):
        like("fake_quantize_backward dy", ins[0], ins[1])
        return ins[0]


@dataclasses.dataclass(frozen=True)
class _LsqBackward(_Backward):
    """The two LSQ gradients share fields and operands: inputs ``[x, scale, dy]``."""

    bits: int
    axis: Optional[int]

    def validate(self):
        _check_bits(self.bits)

    def arity(self):
        return 3

    def _checked(self, ins):
        x, s, dy = ins
        check_scale_input(self.axis, x, s, "scale")
        like("fake_quantize_lsq_backward dy", x, dy)
        return x, s


@op_class
class FakeQuantizeLSQBackwardX(_LsqBackward):
    """LSQ gradient w.r.t. x (STE inside the clamp range) -> x's shape."""

    def infer(self, ins):
        return self._checked(ins)[0]


@op_class
class FakeQuantizeLSQBackwardScale(_LsqBackward):
    """LSQ gradient w.r.t. the scale: ``dscale[c] = sum psi(x/s) dy`` with ``psi(z) =
    round(z) - z`` inside the range, ``sign(z) qmax`` outside -> scale's shape."""

    def infer(self, ins):
        return self._checked(ins)[1]


@op_class
class ComplexNormSqBackward(_Backward):
    """Wirtinger gradient of ``|z|^2``: ``dz = g * z`` (c64); inputs ``[z, g]`` with g
    f32 shaped like z."""

    def arity(self):
        return 2

    def infer(self, ins):
        z, g = ins
        need_dtype("complex_norm_sq_backward z", z, DType.C64)
        need_dtype("complex_norm_sq_backward g", g, DType.F32)
        same_dims("complex_norm_sq_backward", z, g)
        return z


# -- norms --------------------------------------------------------------------

def _axis_norm_inputs(op, x, params, dy, names):
    need_float(f"{op.op_name} x", x)
    like(f"{op.op_name} dy", x, dy)
    check_params(op.op_name, params, norm_dims(x, op.axis), names)


@dataclasses.dataclass(frozen=True)
class _AxisNormBackward(_Backward):
    axis: int
    eps: float
    _signed = frozenset({"axis"})


@op_class
class LayerNormBackwardInput(_AxisNormBackward):
    """LayerNorm ``dx = rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat))`` along
    ``axis``; inputs ``[x, gamma, dy]``."""

    def arity(self):
        return 3

    def infer(self, ins):
        x, g, dy = ins
        _axis_norm_inputs(self, x, [g], dy, ("gamma",))
        return x


@op_class
class LayerNormBackwardGamma(_AxisNormBackward):
    """LayerNorm ``dgamma = sum over rows of dy * xhat``; inputs ``[x, dy]`` ->
    ``[x.shape[axis]]``."""

    def arity(self):
        return 2

    def infer(self, ins):
        x, dy = ins
        _axis_norm_inputs(self, x, [], dy, ())
        return Shape(norm_dims(x, self.axis), x.dtype)


@op_class
class RmsNormBackwardInput(_AxisNormBackward):
    """RmsNorm ``dx = r * (g*dy - x * r^2 * mean(g*dy*x))``, ``r = rsqrt(mean(x^2)+eps)``;
    inputs ``[x, gamma, beta, dy]``."""

    def arity(self):
        return 4

    def infer(self, ins):
        x, g, b, dy = ins
        _axis_norm_inputs(self, x, [g, b], dy, ("gamma", "beta"))
        return x


@op_class
class RmsNormBackwardGamma(_AxisNormBackward):
    """RmsNorm ``dgamma = sum over rows of dy * x * r``; inputs ``[x, gamma, beta, dy]``
    -> gamma's shape."""

    def arity(self):
        return 4

    def infer(self, ins):
        x, g, b, dy = ins
        _axis_norm_inputs(self, x, [g, b], dy, ("gamma", "beta"))
        return g


@op_class
class RmsNormBackwardBeta(_AxisNormBackward):
    """RmsNorm ``dbeta = sum over rows of dy``; inputs ``[x, gamma, beta, dy]`` -> beta's
    shape."""

    def arity(self):
        return 4

    def infer(self, ins):
        x, g, b, dy = ins
        _axis_norm_inputs(self, x, [g, b], dy, ("gamma", "beta"))
        return b


@dataclasses.dataclass(frozen=True)
class _GroupNormBackward(_Backward):
    num_groups: int
    eps: float

    def validate(self):
        if self.num_groups == 0:
            raise OpFault("num_groups must be positive")


@op_class
class GroupNormBackwardInput(_GroupNormBackward):
    """GroupNorm (NCHW) dx; inputs ``[x, gamma, beta, dy]``."""

    def arity(self):
        return 4

    def infer(self, ins):
        x, g, b, dy = ins
        check_group_norm(x, self.num_groups)
        like("group_norm_backward dy", x, dy)
        check_params("GroupNormBackwardInput", (g, b), (x.dims[1],), ("gamma", "beta"))
        return x


@op_class
class GroupNormBackwardGamma(_GroupNormBackward):
    """GroupNorm ``dgamma[c] = sum dy * xhat`` over batch and space; inputs ``[x, dy]``
    -> ``[C]``."""

    def arity(self):
        return 2

    def infer(self, ins):
        x, dy = ins
        check_group_norm(x, self.num_groups)
        like("group_norm_backward dy", x, dy)
        return Shape((x.dims[1],), x.dtype)


@op_class
class GroupNormBackwardBeta(_GroupNormBackward):
    """GroupNorm ``dbeta[c] = sum dy`` over batch and space; inputs ``[x, dy]`` ->
    ``[C]``."""

    def arity(self):
        return 2

    def infer(self, ins):
        x, dy = ins
        check_group_norm(x, self.num_groups)
        like("group_norm_backward dy", x, dy)
        return Shape((x.dims[1],), x.dtype)


@op_class
class BatchNormInferenceBackwardInput(_Backward):
    """``dx = dy * gamma[c] / sqrt(var[c] + eps)``; inputs ``[x, gamma, mean, var, dy]``."""

    eps: float

    def arity(self):
        return 5

    def infer(self, ins):
        x, g, m, v, dy = ins
        need_float("batch_norm_backward x", x)
        like("batch_norm_backward dy", x, dy)
        check_params("BatchNormInferenceBackwardInput", (g, m, v), (x.dims[1],), ("gamma", "mean", "var"))
        return x


@op_class
class BatchNormInferenceBackwardGamma(_Backward):
    """``dgamma[c] = sum dy * (x - mean[c]) / sqrt(var[c] + eps)`` over all but axis 1;
    inputs ``[x, mean, var, dy]`` -> ``[C]``."""

    eps: float

    def arity(self):
        return 4

    def infer(self, ins):
        x, m, v, dy = ins
        need_float("batch_norm_backward x", x)
        like("batch_norm_backward dy", x, dy)
        check_params("BatchNormInferenceBackwardGamma", (m, v), (x.dims[1],), ("mean", "var"))
        return Shape((x.dims[1],), x.dtype)


@op_class
class BatchNormInferenceBackwardBeta(_Backward):
    """``dbeta[c] = sum dy`` over all but axis 1; inputs ``[dy]`` -> ``[C]``."""

    def arity(self):
        return 1

    def infer(self, ins):
        (dy,) = ins
        if dy.rank < 2:
            raise OpFault(f"dy {dy} must be [N, C, ...]")
        return Shape((dy.dims[1],), dy.dtype)


# -- position / scans -----------------------------------------------------------

@op_class
class RopeBackward(_Backward):
    """RoPE gradient: the forward rotation with sin negated; inputs ``[dy, cos, sin]``."""

    head_dim: int
    n_rot: int

    def validate(self):
        if self.head_dim == 0 or self.n_rot % 2 or self.n_rot > self.head_dim:
            raise OpFault(f"n_rot={self.n_rot} must be even and <= head_dim={self.head_dim} (> 0)")

    def arity(self):
        return 3

    def infer(self, ins):
        check_rope(self.head_dim, self.n_rot, *ins)
        return ins[0]


@op_class
class CumsumBackward(_Backward):
    """Reverse cumulative sum of dy along ``axis`` (shifted by one when ``exclusive``);
    inputs ``[dy]``."""

    axis: int
    exclusive: bool
    _signed = frozenset({"axis"})

    def arity(self):
        return 1

    def infer(self, ins):
        norm_axis(self.axis, ins[0].rank)
        return ins[0]


@op_class
class GatherBackward(_Backward):
    """Scatter-add of dy into zeros shaped like the table; inputs ``[dy, indices]``;
    the table shape ``[*lead, V, *post]`` is declared. dy comes in one of two layouts:
    ``np.take``'s ``[*lead, *idx, *post]`` (the seed kernel's: ``d_table[o, idx[k], t]
    += dy[o, k, t]``) or the Gather output's ``[*idx, *post]`` (what graph autodiff
    passes: the adjoint of Gather, ``d_table[0.., idx[k], t] += dy[k, t]``, zeros at
    every other lead position). The two differ in rank when ``lead`` is non-empty."""

    axis: int
    _signed = frozenset({"axis"})

    def arity(self):
        return 2

    def check_declared(self, ins, out):
        dy, idx = ins
        need_index("gather_backward indices", idx)
        a = norm_axis(self.axis, out.rank)
        take_layout = out.dims[:a] + idx.dims + out.dims[a + 1:]
        gather_layout = idx.dims + out.dims[a + 1:]
        if not any(
            dy.rank == len(want) and all(dims_compatible(x, y) for x, y in zip(dy.dims, want))
            for want in (take_layout, gather_layout)
        ):
            raise OpFault(f"dy {dy} matches neither the gather output {list(gather_layout)} nor "
                          f"the np.take layout {list(take_layout)} of table {out}")
        if dy.dtype != out.dtype:
            raise OpFault(f"table dtype {out.dtype.short} differs from dy {dy.dtype.short}")


# -- conv / pool ---------------------------------------------------------------

@op_class
class MaxPool2dBackward(_Backward):
    """Max-pool gradient: each window's dy goes to its first maximum; inputs ``[x, dy]``."""

    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]

    def validate(self):
        check_geometry(2, kernel_size=self.kernel_size, stride=self.stride, padding=self.padding)

    def arity(self):
        return 2

    def infer(self, ins):
        x, dy = ins
        like("max_pool2d_backward dy", pool_shape(x, self.kernel_size, self.stride, self.padding), dy)
        return x


@dataclasses.dataclass(frozen=True)
class _ConvBackward(_Backward):
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def validate(self):
        check_geometry(2, kernel_size=self.kernel_size, stride=self.stride, padding=self.padding,
                       dilation=self.dilation)
        if self.groups == 0:
            raise OpFault("groups must be positive")

    def _conv(self, x, w):
        return conv_shape(x, w, self.kernel_size, self.stride, self.padding, self.dilation, self.groups)


@op_class
class Conv2dBackwardInput(_ConvBackward):
    """Conv gradient w.r.t. the input (transposed conv of dy with w); inputs ``[dy, w]``;
    the input shape is declared (strides make it ambiguous)."""

    def arity(self):
        return 2

    def check_declared(self, ins, out):
        dy, w = ins
        like("conv2d_backward_input dy", self._conv(out, w), dy)


@op_class
class Conv2dBackwardWeight(_ConvBackward):
    """Conv gradient w.r.t. the weight; inputs ``[x, dy]`` -> ``[C_out, C_in/groups,
    kH, kW]``."""

    def arity(self):
        return 2

    def infer(self, ins):
        x, dy = ins
        need_rank("conv2d_backward_weight x", x, 4)
        need_rank("conv2d_backward_weight dy", dy, 4)
        cin = x.dims[1]
        if isinstance(cin, int) and cin % self.groups:
            raise OpFault(f"input channels {cin} are not divisible by groups {self.groups}")
        w = Shape((dy.dims[1], cin // self.groups if isinstance(cin, int) else cin) + self.kernel_size, x.dtype)
        like("conv2d_backward_weight dy", self._conv(x, w), dy)
        return w


# -- loss / attention ------------------------------------------------------------

@op_class
class SoftmaxCrossEntropyBackward(_Backward):
    """``dlogits = (softmax(logits) - onehot(labels)) * d_loss[:, None]``; inputs
    ``[logits, labels, d_loss]``."""

    def arity(self):
        return 3

    def infer(self, ins):
        logits, labels, dl = ins
        loss = SoftmaxCrossEntropyWithLogits().infer([logits, labels])
        like("softmax_cross_entropy_backward d_loss", loss, dl)
        return logits


@op_class
class AttentionBackward(_Backward):
    """Attention gradient w.r.t. q, k or v (``wrt``); inputs ``[q, k, v, dy]`` plus the
    mask for Custom/Bias."""

    num_heads: int
    head_dim: int
    mask_kind: MaskKind
    wrt: AttentionBwdWrt

    def validate(self):
        if self.num_heads == 0 or self.head_dim == 0:
            raise OpFault("num_heads and head_dim must be positive")

    def arity(self):
        return 5 if self.mask_kind.needs_mask_input else 4

    def infer(self, ins):
        q, k, v, dy = ins[:4]
        check_attention(self.num_heads, self.head_dim, self.mask_kind, q, k, v, *ins[4:])
        like("attention_backward dy", q, dy)
        return {AttentionBwdWrt.Query: q, AttentionBwdWrt.Key: k, AttentionBwdWrt.Value: v}[self.wrt]
