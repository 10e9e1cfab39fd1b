"""The op base class, RLX's attribute enums and the op-class registry.

Every RLX op is a frozen dataclass subclass of :class:`Op` whose class name is the RLX
variant name and whose fields are the RLX ``op.rs`` field names. An op knows:

* ``arity()``: its exact input count (``None`` for variadic ops, which check their
  inputs in ``infer``);
* ``validate()``: its attribute check (run at construction);
* ``infer(ins)``: its shape rule: given the input shapes, check them and return the
  output :class:`~rlx_jax.ir.shape.Shape`, or ``None`` when RLX needs the output shape
  spelled out (then ``check_declared(ins, out)`` checks the declared one).

Faults raise :class:`~rlx_jax.ir.errors.OpFault`; the graph turns them into a
:class:`~rlx_jax.ir.errors.GraphError` naming the node.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
import types
import typing
from typing import ClassVar, Optional

from .dtypes import DType
from .errors import OpFault
from .shape import Shape

#: variant name -> op class (every op of the IR)
OP_CLASSES: dict[str, type["Op"]] = {}


# ---------------------------------------------------------------------------
# enums (values are the RLX variant names)
# ---------------------------------------------------------------------------

class _RlxEnum(str, enum.Enum):
    """A str enum whose values are RLX variant names; ``parse`` also accepts the
    snake_case spelling (``"gelu_approx"`` -> ``GeluApprox``)."""

    @classmethod
    def parse(cls, value):
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip()
            for member in cls:
                if key == member.value or _squash(key) == _squash(member.value):
                    return member
            alias = getattr(cls, "_ALIASES", {}).get(key.lower()) if hasattr(cls, "_ALIASES") else None
            if alias is not None:
                return cls(alias)
        raise OpFault(
            f"unknown {cls.__name__} {value!r}; expected one of "
            + ", ".join(_snake(m.value) for m in cls)
        )

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


def _squash(name: str) -> str:
    """Case- and underscore-insensitive key: ``"gelu_approx"`` ~ ``"GeluApprox"``."""
    return name.replace("_", "").replace("-", "").lower()


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        elif ch.isupper() and i and name[i - 1].isupper() and i + 1 < len(name) and name[i + 1].islower():
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


class ActivationKind(_RlxEnum):
    """Unary elementwise activations (RLX ``Activation``)."""

    Gelu = "Gelu"
    GeluApprox = "GeluApprox"
    Silu = "Silu"
    Relu = "Relu"
    Sigmoid = "Sigmoid"
    Tanh = "Tanh"
    Exp = "Exp"
    Log = "Log"
    Sqrt = "Sqrt"
    Rsqrt = "Rsqrt"
    Neg = "Neg"
    Abs = "Abs"
    Sin = "Sin"
    Cos = "Cos"
    Tan = "Tan"
    Atan = "Atan"
    Round = "Round"


class BinaryOp(_RlxEnum):
    """Binary elementwise ops with numpy broadcasting."""

    Add = "Add"
    Sub = "Sub"
    Mul = "Mul"
    Div = "Div"
    Max = "Max"
    Min = "Min"
    Pow = "Pow"


BinaryOp._ALIASES = {"+": "Add", "-": "Sub", "*": "Mul", "/": "Div", "**": "Pow"}


class CmpOp(_RlxEnum):
    """Comparisons (result dtype Bool)."""

    Eq = "Eq"
    Ne = "Ne"
    Lt = "Lt"
    Le = "Le"
    Gt = "Gt"
    Ge = "Ge"


CmpOp._ALIASES = {"==": "Eq", "!=": "Ne", "<": "Lt", "<=": "Le", ">": "Gt", ">=": "Ge"}


class ReduceOp(_RlxEnum):
    Sum = "Sum"
    Mean = "Mean"
    Max = "Max"
    Min = "Min"
    Prod = "Prod"


class SteKind(_RlxEnum):
    """Straight-through estimator of FakeQuantize's backward."""

    Identity = "Identity"
    ClippedIdentity = "ClippedIdentity"
    Tanh = "Tanh"
    HardTanh = "HardTanh"


class FftNorm(_RlxEnum):
    """Backward: unscaled forward; Forward: inverse scaled by 1/N; Ortho: 1/sqrt(N) both."""

    Backward = "Backward"
    Forward = "Forward"
    Ortho = "Ortho"


FftNorm._ALIASES = {"none": "Backward", "orthonormal": "Ortho"}


class AttentionBwdWrt(_RlxEnum):
    Query = "Query"
    Key = "Key"
    Value = "Value"


AttentionBwdWrt._ALIASES = {"q": "Query", "k": "Key", "v": "Value", "dq": "Query", "dk": "Key", "dv": "Value"}


# ---------------------------------------------------------------------------
# data-carrying enums
# ---------------------------------------------------------------------------

_MASK_KINDS = ("None", "Causal", "SlidingWindow", "Custom", "Bias")


@dataclasses.dataclass(frozen=True)
class MaskKind:
    """Attention mask kind: ``None``, ``Causal``, ``SlidingWindow`` (with ``window``),
    ``Custom`` (extra input ``[batch, k_len]``, 1 = keep) or ``Bias`` (extra additive
    input ``[batch, heads, q_len, k_len]``)."""

    kind: str
    window: Optional[int] = None

    def __post_init__(self):
        if self.kind not in _MASK_KINDS:
            raise OpFault(f"unknown mask kind {self.kind!r}; expected one of {_MASK_KINDS}")
        if self.kind == "SlidingWindow":
            if not _is_uint(self.window):
                raise OpFault(f"SlidingWindow needs a non-negative int window, got {self.window!r}")
        elif self.window is not None:
            raise OpFault(f"mask kind {self.kind} takes no window")

    @property
    def needs_mask_input(self) -> bool:
        return self.kind in ("Custom", "Bias")

    @classmethod
    def parse(cls, value) -> "MaskKind":
        """Accept a MaskKind, ``"none" | "causal" | "sliding:N" | "custom" | "bias"``
        or an RLX variant name."""
        if isinstance(value, MaskKind):
            return value
        if value is None:
            return cls("None")
        if isinstance(value, str):
            key = value.strip().lower()
            if key.startswith("sliding:") or key.startswith("sliding_window:"):
                rest = key.split(":", 1)[1]
                try:
                    w = int(rest)
                except ValueError:
                    raise OpFault(f"sliding window size must be an int, got {rest!r}") from None
                if w < 0:
                    raise OpFault(f"sliding window size must be non-negative, got {w}")
                return cls("SlidingWindow", w)
            for k in _MASK_KINDS:
                if key == k.lower() and k != "SlidingWindow":
                    return cls(k)
        raise OpFault(
            f"unknown mask kind {value!r} (none, causal, sliding:<N>, custom, bias)"
        )

    def __str__(self) -> str:
        return f"SlidingWindow({self.window})" if self.kind == "SlidingWindow" else self.kind


@dataclasses.dataclass(frozen=True)
class ScaleMode:
    """FakeQuantize scale tracking: ``PerBatch``, ``EMA`` (with ``decay``) or ``Fixed``."""

    kind: str = "PerBatch"
    decay: Optional[float] = None

    def __post_init__(self):
        if self.kind not in ("PerBatch", "EMA", "Fixed"):
            raise OpFault(f"unknown scale mode {self.kind!r} (PerBatch, EMA, Fixed)")
        if self.kind == "EMA":
            if not _is_real(self.decay) or not 0.0 <= float(self.decay) <= 1.0:
                raise OpFault(f"EMA decay must be a float in [0, 1], got {self.decay!r}")
            object.__setattr__(self, "decay", float(self.decay))
        elif self.decay is not None:
            raise OpFault(f"scale mode {self.kind} takes no decay")

    @classmethod
    def parse(cls, value) -> "ScaleMode":
        if isinstance(value, ScaleMode):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            key = value.strip().lower()
            if key.startswith("ema:"):
                return cls("EMA", float(key.split(":", 1)[1]))
            for k in ("PerBatch", "Fixed"):
                if key in (k.lower(), _snake(k)):
                    return cls(k)
        raise OpFault(f"unknown scale mode {value!r} (per_batch, ema:<decay>, fixed)")

    def __str__(self) -> str:
        return f"EMA({self.decay})" if self.kind == "EMA" else self.kind


_QUANT_BLOCK = ("Int8Block", "Int8BlockAsym", "Int4Block")
_QUANT_UNIT = (
    "Fp8E4m3", "Fp8E5m2", "GgufQ4K", "GgufQ5K", "GgufQ6K", "GgufQ8K", "GgufQ2K",
    "GgufQ3K", "GgufQ4_0", "GgufQ8_0", "Nvfp4Block",
)
#: (elements per block, bytes per block) of the GGUF schemes
GGUF_BLOCKS = {
    "GgufQ4K": (256, 144), "GgufQ5K": (256, 176), "GgufQ6K": (256, 210),
    "GgufQ8K": (256, 292), "GgufQ2K": (256, 84), "GgufQ3K": (256, 110),
    "GgufQ4_0": (32, 18), "GgufQ8_0": (32, 34),
}


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """RLX ``QuantScheme``: ``Int8Block``/``Int8BlockAsym``/``Int4Block`` carry a
    ``block_size``; the fp8, GGUF and NVFP4 schemes carry nothing."""

    kind: str
    block_size: Optional[int] = None

    def __post_init__(self):
        if self.kind in _QUANT_BLOCK:
            if not _is_uint(self.block_size) or self.block_size == 0:
                raise OpFault(f"{self.kind} needs a positive block_size, got {self.block_size!r}")
        elif self.kind in _QUANT_UNIT:
            if self.block_size is not None:
                raise OpFault(f"quant scheme {self.kind} takes no block_size")
        else:
            raise OpFault(
                f"unknown quant scheme {self.kind!r}; expected one of "
                + ", ".join(_QUANT_BLOCK + _QUANT_UNIT)
            )

    @property
    def is_gguf(self) -> bool:
        return self.kind in GGUF_BLOCKS

    @classmethod
    def parse(cls, value) -> "QuantScheme":
        if isinstance(value, QuantScheme):
            return value
        if isinstance(value, str):
            key = value.strip()
            if ":" in key:
                k, n = key.split(":", 1)
                for kind in _QUANT_BLOCK:
                    if _squash(k) == _squash(kind):
                        return cls(kind, int(n))
            for kind in _QUANT_UNIT:
                if _squash(key) == _squash(kind):
                    return cls(kind)
        raise OpFault(f"unknown quant scheme {value!r}")

    def __str__(self) -> str:
        return f"{self.kind}({self.block_size})" if self.block_size is not None else self.kind


@dataclasses.dataclass(frozen=True)
class ChainOperand:
    """Operand of an ElementwiseRegion step: region input ``index`` (kind ``Input``)
    or the result of an earlier step (kind ``Step``)."""

    kind: str
    index: int

    def __post_init__(self):
        if self.kind not in ("Input", "Step"):
            raise OpFault(f"chain operand kind must be Input or Step, got {self.kind!r}")
        if not _is_uint(self.index):
            raise OpFault(f"chain operand index must be a non-negative int, got {self.index!r}")


@dataclasses.dataclass(frozen=True)
class ChainStep:
    """One step of an ElementwiseRegion chain: ``kind`` is ``Activation`` / ``Cast`` /
    ``Binary`` / ``Compare`` / ``Where``; ``attr`` the ActivationKind / DType /
    BinaryOp / CmpOp (``None`` for Where); ``operands`` 1, 1, 2, 2 or 3 operands."""

    kind: str
    attr: object
    operands: tuple

    _ARITY: ClassVar[dict] = {"Activation": 1, "Cast": 1, "Binary": 2, "Compare": 2, "Where": 3}

    def __post_init__(self):
        if self.kind not in self._ARITY:
            raise OpFault(f"unknown chain step {self.kind!r}")
        attr = self.attr
        if self.kind == "Activation":
            attr = ActivationKind.parse(attr)
        elif self.kind == "Cast":
            attr = _dtype(attr)
        elif self.kind == "Binary":
            attr = BinaryOp.parse(attr)
        elif self.kind == "Compare":
            attr = CmpOp.parse(attr)
        elif attr is not None:
            raise OpFault("a Where chain step has no attribute")
        object.__setattr__(self, "attr", attr)
        ops = tuple(self.operands)
        if len(ops) != self._ARITY[self.kind] or not all(isinstance(o, ChainOperand) for o in ops):
            raise OpFault(f"chain step {self.kind} needs {self._ARITY[self.kind]} ChainOperand(s)")
        object.__setattr__(self, "operands", ops)


# ---------------------------------------------------------------------------
# small validators (shared by the op modules)
# ---------------------------------------------------------------------------

def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dtype(v) -> DType:
    try:
        return DType.from_any(v)
    except (TypeError, ValueError) as exc:
        raise OpFault(str(exc)) from None


def need_float(what: str, s: Shape) -> None:
    if not s.dtype.is_float:
        raise OpFault(f"{what} must have a float dtype, got {s.dtype.short}")


def need_dtype(what: str, s: Shape, *dtypes: DType) -> None:
    if s.dtype not in dtypes:
        raise OpFault(
            f"{what} must have dtype {'/'.join(d.short for d in dtypes)}, got {s.dtype.short}"
        )


def need_index(what: str, s: Shape) -> None:
    """Index operands: an integer dtype, or f32/f64 holding integers (RLX's
    f32-encoded indices). Bool, complex and half floats are refused."""
    if not (s.dtype.is_int or s.dtype in (DType.F32, DType.F64)):
        raise OpFault(
            f"{what} must have an integer dtype (or RLX's f32-encoded indices), got {s.dtype.short}"
        )


def need_rank(what: str, s: Shape, *ranks: int) -> None:
    if s.rank not in ranks:
        raise OpFault(f"{what} must have rank {' or '.join(map(str, ranks))}, got {s}")


def need_min_rank(what: str, s: Shape, rank: int) -> None:
    if s.rank < rank:
        raise OpFault(f"{what} must have rank >= {rank}, got {s}")


def need_same_dtype(what: str, *shapes: Shape) -> None:
    dts = {s.dtype for s in shapes}
    if len(dts) > 1:
        raise OpFault(f"{what}: dtypes differ ({', '.join(s.dtype.short for s in shapes)})")


# ---------------------------------------------------------------------------
# the base class
# ---------------------------------------------------------------------------

def _coerce(cls_name: str, field: str, hint, value, signed: bool):
    """Coerce/validate one attribute against its type hint (ints, floats, tuples,
    enums, optionals); raises OpFault."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in args if a is not type(None)]
        if value is None:
            return None
        return _coerce(cls_name, field, inner[0], value, signed)
    if hint is int:
        if isinstance(value, bool):
            raise OpFault(f"{cls_name}.{field} must be an int, got {value!r}")
        try:
            v = operator.index(value)
        except TypeError:
            raise OpFault(f"{cls_name}.{field} must be an int, got {value!r}") from None
        if not signed and v < 0:
            raise OpFault(f"{cls_name}.{field} must be >= 0, got {v}")
        if v >= (2**63 if signed else 2**64) or v < -(2**63):  # i64, or u64 / usize (seeds)
            raise OpFault(f"{cls_name}.{field} out of range: {v}")
        return int(v)
    if hint is float:
        if not _is_real(value) and not hasattr(value, "__float__"):
            raise OpFault(f"{cls_name}.{field} must be a number, got {value!r}")
        return float(value)
    if hint is bool:
        if not isinstance(value, (bool,)) and type(value).__name__ != "bool_":
            raise OpFault(f"{cls_name}.{field} must be a bool, got {value!r}")
        return bool(value)
    if hint is str:
        if not isinstance(value, str):
            raise OpFault(f"{cls_name}.{field} must be a string, got {value!r}")
        return value
    if hint is bytes:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        raise OpFault(f"{cls_name}.{field} must be bytes, got {type(value).__name__}")
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise OpFault(f"{cls_name}.{field} must be a sequence, got {value!r}")
        return tuple(_coerce(cls_name, field, args[0], v, signed) for v in value)
    if hint is DType:
        return _dtype(value)
    if isinstance(hint, type) and hasattr(hint, "parse"):
        return hint.parse(value)
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    if isinstance(hint, type):
        raise OpFault(f"{cls_name}.{field} must be a {hint.__name__}, got {type(value).__name__}")
    return value


_HINTS: dict[type, dict] = {}


def op_hints(cls) -> dict:
    """Resolved field type hints of an op class (``Graph`` resolved lazily)."""
    hints = _HINTS.get(cls)
    if hints is None:
        from .graph import Graph  # circular at import time only

        hints = typing.get_type_hints(cls, localns={"Graph": Graph, "Optional": Optional})
        hints = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        _HINTS[cls] = hints
    return hints


@dataclasses.dataclass(frozen=True)
class Op:
    """Base of every RLX op (see the module docstring)."""

    #: "unit", "newtype" or "struct": how RLX serde writes the variant
    _serde: ClassVar[str] = "struct"
    #: int fields that may be negative (RLX i32/i64 fields)
    _signed: ClassVar[frozenset] = frozenset()
    #: True for the closed-form gradient ops
    is_backward: ClassVar[bool] = False

    def __post_init__(self):
        cls = type(self)
        hints = op_hints(cls)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            hint = hints[f.name]
            object.__setattr__(
                self, f.name, _coerce(cls.__name__, f.name, hint, value, f.name in cls._signed)
            )
        self.validate()

    # -- overridable -----------------------------------------------------------
    @property
    def op_name(self) -> str:
        return type(self).__name__

    def arity(self) -> Optional[int]:
        """Exact number of inputs; ``None`` for variadic ops (checked in ``infer``)."""
        return 0

    def validate(self) -> None:
        """Attribute checks beyond the field types (raise OpFault)."""

    def infer(self, ins: list) -> Optional[Shape]:
        """Check the input shapes and return the output shape (``None``: RLX needs
        the output shape declared)."""
        return None

    def check_declared(self, ins: list, out: Shape) -> None:
        """Checks on a declared output shape of an op whose shape is not inferred."""

    def accepts_declared(self, ins: list, declared: Shape, inferred: Shape) -> bool:
        """Whether a declared shape that differs from the inferred one is still valid
        (an RLX layout variant); default: no."""
        return False

    def needs_shape_message(self) -> str:
        """The fault when no shape is declared and ``infer`` cannot give one."""
        return "needs an explicit output shape"

    def bodies(self) -> dict:
        """Nested sub-graphs by field name (control flow / CustomFn)."""
        from .graph import Graph

        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Graph)
        }

    def attr_values(self) -> dict:
        """Attribute values by field name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def attr_text(self) -> str:
        """``axis=-1, eps=1e-05`` (bodies shown by name; long bytes by length)."""
        from .graph import Graph

        parts = []
        for k, v in self.attr_values().items():
            if isinstance(v, Graph):
                v = f"<graph {v.name!r}: {len(v)} nodes>"
            elif isinstance(v, bytes):
                v = f"<{len(v)} bytes>"
            elif isinstance(v, tuple) and len(v) > 16:
                v = f"<{len(v)} values>"
            elif isinstance(v, tuple):
                v = "[" + ", ".join(str(x.value if isinstance(x, enum.Enum) else x) for x in v) + "]"
            elif isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, str):
                v = repr(v)
            elif isinstance(v, float):
                v = repr(v) if math.isfinite(v) else str(v)
            parts.append(f"{k}={v}")
        return ", ".join(parts)

    def __str__(self) -> str:
        text = self.attr_text()
        return f"{self.op_name}({text})" if text else self.op_name


def op_class(cls):
    """Class decorator: make ``cls`` a frozen dataclass op and register it."""
    cls = dataclasses.dataclass(frozen=True, eq=True)(cls)
    if cls.__name__ in OP_CLASSES:
        raise ValueError(f"op {cls.__name__} registered twice")
    OP_CLASSES[cls.__name__] = cls
    if not dataclasses.fields(cls) and cls._serde == "struct":
        cls._serde = "unit"
    return cls
