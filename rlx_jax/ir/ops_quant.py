"""Quantisation: Quantize / Dequantize (static int8), FakeQuantize and LSQ (QAT),
weight-only dequant matmuls, int8 QMatMul / QConv2d, MoE dequant variants."""

from __future__ import annotations

from typing import Optional

from .dtypes import DType
from .errors import OpFault
from .op import (
    Op, QuantScheme, ScaleMode, SteKind, need_dtype, need_float, need_min_rank, need_rank, op_class,
)
from .ops_conv import conv_shape
from .shape import Shape, dims_compatible


def check_channel(axis: Optional[int], x: Shape, n: int, what: str) -> None:
    """``n`` per-channel values fit ``axis`` of ``x`` (1 when per-tensor)."""
    if axis is None:
        if n != 1:
            raise OpFault(f"per-tensor {what} needs 1 value, got {n}")
        return
    if axis >= x.rank:
        raise OpFault(f"axis {axis} out of range for rank {x.rank}")
    d = x.dims[axis]
    if isinstance(d, int) and n != d:
        raise OpFault(f"{what} has {n} values, axis {axis} has {d} channels")


def check_scale_input(axis: Optional[int], x: Shape, s: Shape, what: str) -> None:
    need_rank(what, s, 1)
    n = s.dims[0]
    if isinstance(n, int):
        check_channel(axis, x, n, what)


@op_class
class Quantize(Op):
    """``q = saturate_i8(round(x / scale[c]) + zero_point[c])``, c indexing ``axis``
    (per-tensor when None): float -> i8."""

    axis: Optional[int]
    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    _signed = frozenset({"zero_points"})

    def validate(self):
        if not self.scales or len(self.scales) != len(self.zero_points):
            raise OpFault("scales and zero_points must be non-empty and of equal length")

    def arity(self):
        return 1

    def infer(self, ins):
        need_float("quantize input", ins[0])
        check_channel(self.axis, ins[0], len(self.scales), "scales")
        return ins[0].with_dtype(DType.I8)


@op_class
class Dequantize(Op):
    """``x = (q - zero_point[c]) * scale[c]``: i8 -> f32."""

    axis: Optional[int]
    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    _signed = frozenset({"zero_points"})

    def validate(self):
        if not self.scales or len(self.scales) != len(self.zero_points):
            raise OpFault("scales and zero_points must be non-empty and of equal length")

    def arity(self):
        return 1

    def infer(self, ins):
        if not ins[0].dtype.is_int:
            raise OpFault(f"dequantize input must be an integer tensor, got {ins[0].dtype.short}")
        check_channel(self.axis, ins[0], len(self.scales), "scales")
        return ins[0].with_dtype(DType.F32)


def _check_bits(bits: int):
    if not 2 <= bits <= 16:
        raise OpFault(f"bits must be in 2..16, got {bits}")


def q_max(bits: int) -> int:
    """Symmetric clamp bound ``2^(bits-1) - 1``."""
    return (1 << (bits - 1)) - 1


@op_class
class FakeQuantize(Op):
    """QAT fake quantisation ``clamp(round(x/s), -qmax, qmax) * s`` with
    ``qmax = 2^(bits-1)-1`` and ``s[c] = max|x[c]| / qmax`` (PerBatch) or the state
    input (EMA/Fixed: inputs ``[x, state]``); backward by ``ste``."""

    bits: int
    axis: Optional[int]
    ste: SteKind
    scale_mode: ScaleMode

    def validate(self):
        _check_bits(self.bits)

    def arity(self):
        return 1 if self.scale_mode.kind == "PerBatch" else 2

    def infer(self, ins):
        x = ins[0]
        need_float("fake_quantize input", x)
        if self.axis is not None and self.axis >= x.rank:
            raise OpFault(f"axis {self.axis} out of range for rank {x.rank}")
        if len(ins) == 2:
            check_scale_input(self.axis, x, ins[1], "fake_quantize state")
        return x


@op_class
class FakeQuantizeLSQ(Op):
    """Learned-step fake quantisation ``clamp(round(x/s[c]), -qmax, qmax) * s[c]``;
    inputs ``[x, scale]`` (scale ``[C]`` on ``axis`` or ``[1]``)."""

    bits: int
    axis: Optional[int]

    def validate(self):
        _check_bits(self.bits)

    def arity(self):
        return 2

    def infer(self, ins):
        x, s = ins
        need_float("fake_quantize_lsq input", x)
        check_scale_input(self.axis, x, s, "fake_quantize_lsq scale")
        return x


@op_class
class DequantMatMul(Op):
    """``x [m, k] @ dequant(w)`` for a weight-only ``scheme``; inputs ``[x, w_q, scale,
    zp]`` (GGUF: ``[x, packed_w]``); the output ``[m, n]`` is declared."""

    scheme: QuantScheme

    def arity(self):
        return 2 if self.scheme.is_gguf else 4

    def check_declared(self, ins, out):
        x = ins[0]
        need_float("dequant_matmul x", x)
        need_min_rank("dequant_matmul x", x, 1)
        if out.rank != x.rank or not all(dims_compatible(a, b) for a, b in zip(out.dims[:-1], x.dims[:-1])):
            raise OpFault(f"output {out} must keep x's leading dims {list(x.dims[:-1])}")


@op_class
class QMatMul(Op):
    """Int8 matmul with i32 accumulation: ``x [M, K]`` i8, ``w [K, N]`` i8, ``bias [N]``
    i32 -> ``[M, N]`` i8, ``out = sat_i8(round((sum (x-x_zp)(w-w_zp) + bias) * mult) + out_zp)``."""

    x_zp: int
    w_zp: int
    out_zp: int
    mult: float
    _signed = frozenset({"x_zp", "w_zp", "out_zp"})

    def arity(self):
        return 3

    def infer(self, ins):
        x, w, b = ins
        need_rank("q_matmul x", x, 2)
        need_rank("q_matmul w", w, 2)
        need_rank("q_matmul bias", b, 1)
        need_dtype("q_matmul x", x, DType.I8)
        need_dtype("q_matmul w", w, DType.I8)
        need_dtype("q_matmul bias", b, DType.I32)
        if not dims_compatible(x.dims[1], w.dims[0]):
            raise OpFault(f"q_matmul inner dims differ ({x.dims[1]} vs {w.dims[0]})")
        if not dims_compatible(b.dims[0], w.dims[1]):
            raise OpFault(f"q_matmul bias has {b.dims[0]} entries, output has {w.dims[1]} columns")
        return Shape((x.dims[0], w.dims[1]), DType.I8)


@op_class
class QConv2d(Op):
    """Int8 NCHW convolution (Conv geometry, QMatMul requantisation); inputs ``[x i8,
    w i8, bias [C_out] i32]`` -> i8."""

    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    x_zp: int
    w_zp: int
    out_zp: int
    mult: float
    _signed = frozenset({"x_zp", "w_zp", "out_zp"})

    def arity(self):
        return 3

    def infer(self, ins):
        x, w, b = ins
        need_dtype("q_conv2d x", x, DType.I8)
        need_dtype("q_conv2d w", w, DType.I8)
        need_dtype("q_conv2d bias", b, DType.I32)
        out = conv_shape(x, w, self.kernel_size, self.stride, self.padding, self.dilation, self.groups)
        need_rank("q_conv2d bias", b, 1)
        if not dims_compatible(b.dims[0], out.dims[1]):
            raise OpFault(f"q_conv2d bias has {b.dims[0]} entries, output has {out.dims[1]} channels")
        return out


@op_class
class DequantGroupedMatMul(Op):
    """GroupedMatMul with a packed GGUF expert stack: ``[x [M, K], packed_w u8,
    expert_idx [M]]``; output ``[M, N]`` declared."""

    scheme: QuantScheme

    def arity(self):
        return 3

    def check_declared(self, ins, out):
        x, w, idx = ins
        need_rank("dequant_grouped_matmul x", x, 2)
        need_rank("dequant_grouped_matmul expert_idx", idx, 1)
        if out.rank != 2 or not dims_compatible(out.dims[0], x.dims[0]):
            raise OpFault(f"output {out} must be [M={x.dims[0]}, N]")


@op_class
class DequantMoEWeights(Op):
    """Dequantise a packed MoE expert stack (u8) to ``[E, K, N]`` (declared)."""

    scheme: QuantScheme

    def arity(self):
        return 1

    def check_declared(self, ins, out):
        need_rank("dequant_moe_weights output", out, 3)
        need_float("dequant_moe_weights output", out)
