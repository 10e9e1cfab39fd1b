"""Elementwise ops: activations, binary arithmetic, comparisons, select, casts,
complex helpers, StopGradient and RLX's fused ElementwiseRegion."""

from __future__ import annotations

from .dtypes import DType
from .errors import OpFault
from .op import (
    ActivationKind, BinaryOp, ChainStep, CmpOp, Op, need_dtype, need_same_dtype, op_class,
)
from .shape import Shape, broadcast_dims

#: activations defined on integer tensors too
_INT_OK = {ActivationKind.Relu, ActivationKind.Neg, ActivationKind.Abs, ActivationKind.Round}


def _check_act_dtype(kind, s: Shape, what: str):
    if s.dtype is DType.Bool:
        raise OpFault(f"{what} is not defined on bool tensors")
    if s.dtype.is_int and kind not in _INT_OK:
        raise OpFault(f"{what} {kind.value} needs a float or complex input, got {s.dtype.short}")


@op_class
class Activation(Op):
    """``y = f(x)`` elementwise for ``kind`` in ActivationKind (shape and dtype kept)."""

    kind: ActivationKind
    _serde = "newtype"

    def arity(self):
        return 1

    def infer(self, ins):
        _check_act_dtype(self.kind, ins[0], "activation")
        return ins[0]


@op_class
class Binary(Op):
    """``y = a <op> b`` with numpy broadcasting; both operands share a dtype."""

    op: BinaryOp
    _serde = "newtype"

    def arity(self):
        return 2

    def infer(self, ins):
        a, b = ins
        need_same_dtype(f"binary {self.op.value}", a, b)
        return Shape(broadcast_dims(a.dims, b.dims), a.dtype)


@op_class
class Compare(Op):
    """``y = a <cmp> b`` with broadcasting; result dtype Bool."""

    op: CmpOp
    _serde = "newtype"

    def arity(self):
        return 2

    def infer(self, ins):
        a, b = ins
        need_same_dtype(f"compare {self.op.value}", a, b)
        if a.dtype.is_complex and self.op not in (CmpOp.Eq, CmpOp.Ne):
            raise OpFault(f"ordering comparison {self.op.value} is not defined on c64")
        return Shape(broadcast_dims(a.dims, b.dims), DType.Bool)


@op_class
class Where(Op):
    """``y = cond ? a : b`` (inputs ``[cond, a, b]``, broadcast; cond is truthy when
    non-zero; a and b share the output dtype)."""

    def arity(self):
        return 3

    def infer(self, ins):
        c, a, b = ins
        if c.dtype.is_complex:
            raise OpFault("where condition must be bool or real, got c64")
        need_same_dtype("where branches", a, b)
        return Shape(broadcast_dims(broadcast_dims(c.dims, a.dims), b.dims), a.dtype)


@op_class
class Cast(Op):
    """Convert elements to dtype ``to`` (shape kept)."""

    to: DType

    def arity(self):
        return 1

    def infer(self, ins):
        return ins[0].with_dtype(self.to)


@op_class
class ComplexNormSq(Op):
    """``|z|^2 = re^2 + im^2``: c64 -> f32, same dims."""

    def arity(self):
        return 1

    def infer(self, ins):
        need_dtype("complex_norm_sq input", ins[0], DType.C64)
        return ins[0].with_dtype(DType.F32)


@op_class
class Conjugate(Op):
    """``conj(z) = re - i*im`` on c64 (shape kept)."""

    def arity(self):
        return 1

    def infer(self, ins):
        need_dtype("conjugate input", ins[0], DType.C64)
        return ins[0]


@op_class
class StopGradient(Op):
    """Identity in the forward pass; no gradient flows through it."""

    def arity(self):
        return 1

    def infer(self, ins):
        return ins[0]


@op_class
class ElementwiseRegion(Op):
    """RLX's fused elementwise chain: ``chain`` steps run per element over
    ``num_inputs`` inputs; the last step is the result. ``scalar_input_mask`` bit i marks
    input i as a scalar; ``input_modulus[i]`` is input i's element count when it tiles
    the output (0 = same size). The output shape is declared."""

    chain: tuple[ChainStep, ...]
    num_inputs: int
    scalar_input_mask: int
    input_modulus: tuple[int, ...]

    def validate(self):
        if len(self.input_modulus) != 16:
            raise OpFault(f"input_modulus must have 16 entries, got {len(self.input_modulus)}")
        if not self.chain:
            raise OpFault("chain must have at least one step")
        if self.num_inputs > 16:
            raise OpFault(f"num_inputs {self.num_inputs} exceeds 16")
        for pos, step in enumerate(self.chain):
            for operand in step.operands:
                limit = self.num_inputs if operand.kind == "Input" else pos
                if operand.index >= limit:
                    raise OpFault(
                        f"chain step {pos} reads {operand.kind}({operand.index}) out of range"
                    )

    def arity(self):
        return self.num_inputs
