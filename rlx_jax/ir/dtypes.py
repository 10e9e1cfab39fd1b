"""The 12 RLX element types and their numpy / JAX equivalents.

``DType.F32.value == "F32"`` is the RLX serde name; ``DType.F32.short == "f32"`` is the
pyrlx / text name. ``bf16`` maps to ``ml_dtypes.bfloat16``; ``c64`` to ``complex64``.
"""

from __future__ import annotations

import enum

import numpy as np

try:  # ml_dtypes ships with jax
    import ml_dtypes as _mld

    _BF16 = np.dtype(_mld.bfloat16)
except Exception:  # pragma: no cover - jax always brings ml_dtypes
    _BF16 = None


class DType(str, enum.Enum):
    """Element type of a tensor (RLX ``DType``)."""

    F32 = "F32"
    F16 = "F16"
    BF16 = "BF16"
    F64 = "F64"
    I8 = "I8"
    I16 = "I16"
    I32 = "I32"
    I64 = "I64"
    U8 = "U8"
    U32 = "U32"
    Bool = "Bool"
    C64 = "C64"

    # -- names -----------------------------------------------------------------
    @property
    def short(self) -> str:
        """Lower-case pyrlx name: ``"f32"``, ``"bf16"``, ``"bool"``, ``"c64"``."""
        return self.value.lower()

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.short

    def __repr__(self) -> str:
        return f"DType.{self.name}"

    # -- classification --------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        """Bytes per element (C64 is two interleaved f32: 8 bytes)."""
        return _SIZES[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16, DType.F64)

    @property
    def is_int(self) -> bool:
        return self in (DType.I8, DType.I16, DType.I32, DType.I64, DType.U8, DType.U32)

    @property
    def is_complex(self) -> bool:
        return self is DType.C64

    # -- conversion ------------------------------------------------------------
    def to_numpy(self) -> np.dtype:
        """The numpy dtype (``bf16`` -> ``ml_dtypes.bfloat16``)."""
        if self is DType.BF16:
            if _BF16 is None:  # pragma: no cover
                raise TypeError("bf16 needs the ml_dtypes package")
            return _BF16
        return np.dtype(_NUMPY[self])

    def to_jax(self):
        """The ``jax.numpy`` dtype object (imports jax lazily)."""
        import jax.numpy as jnp

        return jnp.dtype(self.to_numpy())

    @classmethod
    def from_any(cls, value) -> "DType":
        """Accept a DType, a name (``"f32"``, ``"F32"``, ``"float32"``, ``"bfloat16"``),
        a numpy / ml_dtypes / jax dtype or scalar type."""
        if isinstance(value, DType):
            return value
        if value is None:  # np.dtype(None) is float64: refuse it rather than pick f64
            raise TypeError("dtype must be given (a DType, a name or a numpy dtype), got None")
        if isinstance(value, str):
            key = value.strip()
            hit = _BY_NAME.get(key) or _BY_NAME.get(key.lower())
            if hit is not None:
                return hit
            raise ValueError(
                f"unknown dtype {value!r}; expected one of "
                + ", ".join(d.short for d in DType)
            )
        try:
            npd = np.dtype(value)
        except Exception:
            raise TypeError(f"cannot interpret {value!r} as a dtype") from None
        if _BF16 is not None and npd == _BF16:
            return DType.BF16
        hit = _BY_NUMPY.get(npd)
        if hit is None:
            raise TypeError(f"numpy dtype {npd} has no RLX equivalent")
        return hit


_SIZES = {
    DType.Bool: 1, DType.I8: 1, DType.U8: 1,
    DType.F16: 2, DType.BF16: 2, DType.I16: 2,
    DType.F32: 4, DType.I32: 4, DType.U32: 4,
    DType.F64: 8, DType.I64: 8, DType.C64: 8,
}

_NUMPY = {
    DType.F32: np.float32, DType.F16: np.float16, DType.F64: np.float64,
    DType.I8: np.int8, DType.I16: np.int16, DType.I32: np.int32, DType.I64: np.int64,
    DType.U8: np.uint8, DType.U32: np.uint32, DType.Bool: np.bool_, DType.C64: np.complex64,
}

_BY_NUMPY = {np.dtype(v): k for k, v in _NUMPY.items()}

_BY_NAME: dict[str, DType] = {}
for _d in DType:
    _BY_NAME[_d.value] = _d
    _BY_NAME[_d.short] = _d
_BY_NAME.update({
    "float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16,
    "float64": DType.F64, "int8": DType.I8, "int16": DType.I16, "int32": DType.I32,
    "int64": DType.I64, "uint8": DType.U8, "uint32": DType.U32, "bool_": DType.Bool,
    "complex64": DType.C64,
})
