"""Convolution and pooling (NCHW activations, OIHW weights, no bias).

Output spatial size per axis: ``(in + 2p - d*(k-1) - 1) // s + 1`` (conv and pool,
d = 1 for pool); transposed conv: ``(in-1)*s + output_padding + d*(k-1) - 2p + 1``.
"""

from __future__ import annotations

from .errors import OpFault
from .op import Op, ReduceOp, need_rank, need_same_dtype, op_class
from .shape import Shape


def conv_out(n: int, k: int, s: int, p: int, d: int = 1) -> int:
    span = d * (k - 1) + 1
    if n + 2 * p < span:
        raise OpFault(f"window {span} (kernel {k}, dilation {d}) exceeds padded input {n + 2 * p}")
    return (n + 2 * p - span) // s + 1


def conv_transpose_out(n: int, k: int, s: int, p: int, d: int, op: int) -> int:
    out = (n - 1) * s + op + d * (k - 1) - 2 * p + 1
    if out <= 0:
        raise OpFault(f"transposed conv output size {out} is not positive")
    return out


def check_geometry(nsp: int, **lists) -> None:
    """Each list has ``nsp`` entries; strides and dilations positive."""
    for name, vals in lists.items():
        if len(vals) != nsp:
            raise OpFault(f"{name} has {len(vals)} entries, expected {nsp}")
        if name in ("kernel_size", "stride", "dilation") and any(v == 0 for v in vals):
            raise OpFault(f"{name} entries must be positive, got {list(vals)}")


def spatial(x: Shape, nsp: int, what: str) -> tuple:
    sp = x.dims[2:]
    if not all(isinstance(d, int) for d in sp):
        raise OpFault(f"{what} needs static spatial dims, got {x}")
    return sp


def conv_shape(x: Shape, w: Shape, kernel_size, stride, padding, dilation, groups) -> Shape:
    """Forward Conv output shape with all channel / group checks."""
    nsp = len(kernel_size)
    check_geometry(nsp, kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation)
    need_rank("conv input", x, nsp + 2)
    need_rank("conv weight", w, nsp + 2)
    if groups == 0:
        raise OpFault("groups must be positive")
    cin, cout, wcin = x.dims[1], w.dims[0], w.dims[1]
    if tuple(w.dims[2:]) != tuple(kernel_size):
        raise OpFault(f"weight spatial dims {list(w.dims[2:])} differ from kernel_size {list(kernel_size)}")
    if isinstance(cin, int) and isinstance(wcin, int) and wcin * groups != cin:
        raise OpFault(f"weight C_in/groups = {wcin} times groups = {groups} != input channels {cin}")
    if isinstance(cout, int) and cout % groups:
        raise OpFault(f"output channels {cout} are not divisible by groups {groups}")
    sp = spatial(x, nsp, "conv")
    out = tuple(conv_out(n, k, s, p, d) for n, k, s, p, d in zip(sp, kernel_size, stride, padding, dilation))
    return Shape((x.dims[0], cout) + out, x.dtype)


@op_class
class Conv(Op):
    """N-d convolution (RLX uses 2-D): x ``[N, C_in, *S]``, w ``[C_out, C_in/groups,
    *kernel_size]`` -> ``[N, C_out, *S_out]``; no bias (add it separately)."""

    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def validate(self):
        check_geometry(len(self.kernel_size), kernel_size=self.kernel_size, stride=self.stride,
                       padding=self.padding, dilation=self.dilation)
        if self.groups == 0:
            raise OpFault("groups must be positive")

    def arity(self):
        return 2

    def infer(self, ins):
        x, w = ins
        need_same_dtype("conv", x, w)
        return conv_shape(x, w, self.kernel_size, self.stride, self.padding, self.dilation, self.groups)


@op_class
class ConvTranspose2d(Op):
    """2-D transposed conv: x ``[N, C_in, H, W]``, w ``[C_in, C_out/groups, kH, kW]``
    -> ``[N, C_out, H_out, W_out]``."""

    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int

    def validate(self):
        check_geometry(2, kernel_size=self.kernel_size, stride=self.stride, padding=self.padding,
                       dilation=self.dilation, output_padding=self.output_padding)
        if self.groups == 0:
            raise OpFault("groups must be positive")

    def arity(self):
        return 2

    def infer(self, ins):
        x, w = ins
        need_rank("conv_transpose2d input", x, 4)
        need_rank("conv_transpose2d weight", w, 4)
        need_same_dtype("conv_transpose2d", x, w)
        cin = x.dims[1]
        if isinstance(cin, int) and isinstance(w.dims[0], int) and w.dims[0] != cin:
            raise OpFault(f"weight C_in {w.dims[0]} != input channels {cin}")
        if isinstance(cin, int) and cin % self.groups:
            raise OpFault(f"input channels {cin} are not divisible by groups {self.groups}")
        if tuple(w.dims[2:]) != tuple(self.kernel_size):
            raise OpFault(f"weight spatial dims {list(w.dims[2:])} differ from kernel_size {list(self.kernel_size)}")
        sp = spatial(x, 2, "conv_transpose2d")
        out = tuple(conv_transpose_out(n, k, s, p, d, o) for n, k, s, p, d, o in zip(
            sp, self.kernel_size, self.stride, self.padding, self.dilation, self.output_padding))
        cout = w.dims[1] * self.groups if isinstance(w.dims[1], int) else w.dims[1]
        return Shape((x.dims[0], cout) + out, x.dtype)


def pool_shape(x: Shape, kernel_size, stride, padding) -> Shape:
    nsp = len(kernel_size)
    check_geometry(nsp, kernel_size=kernel_size, stride=stride, padding=padding)
    need_rank("pool input", x, nsp + 2)
    for k, p in zip(kernel_size, padding):
        if 2 * p > k:
            raise OpFault(f"padding {p} exceeds half the kernel {k}")
    sp = spatial(x, nsp, "pool")
    out = tuple(conv_out(n, k, s, p) for n, k, s, p in zip(sp, kernel_size, stride, padding))
    return Shape(x.dims[:2] + out, x.dtype)


@op_class
class Pool(Op):
    """Max or mean pooling over NCHW windows (``kind`` Max or Mean; padded cells are
    ignored by Max and count as zeros for Mean)."""

    kind: ReduceOp
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]

    def validate(self):
        if self.kind not in (ReduceOp.Max, ReduceOp.Mean):
            raise OpFault(f"pool kind must be Max or Mean, got {self.kind.value}")
        check_geometry(len(self.kernel_size), kernel_size=self.kernel_size, stride=self.stride,
                       padding=self.padding)

    def arity(self):
        return 1

    def infer(self, ins):
        return pool_shape(ins[0], self.kernel_size, self.stride, self.padding)
