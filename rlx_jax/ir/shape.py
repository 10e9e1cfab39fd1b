"""Dimensions and shapes.

A dimension is a Python ``int`` (static) or a :class:`Dynamic` symbol. Symbols are
process-wide and keyed by name: ``batch`` = 0, ``seq`` = 1, ``rows`` = 2,
``past_seq`` = 3 (RLX's well-known symbols); any other name gets the next free
symbol (4, 5, ...). Two dynamic dims are the same dimension iff their symbols match;
the name is for people (``shape_of`` gives it back).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterable, Sequence

from .dtypes import DType
from .errors import OpFault

BATCH, SEQ, ROWS, PAST_SEQ = 0, 1, 2, 3
WELL_KNOWN = {"batch": BATCH, "seq": SEQ, "rows": ROWS, "past_seq": PAST_SEQ}

_lock = threading.Lock()
_by_name: dict[str, int] = dict(WELL_KNOWN)
_by_symbol: dict[int, str] = {v: k for k, v in WELL_KNOWN.items()}

#: largest accepted static dimension / element count (guards JSON and builders)
MAX_DIM = 2**48


def symbol_for(name: str) -> int:
    """The symbol of a named dynamic dimension (allocating one for a new name)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"dynamic dimension name must be a non-empty string, got {name!r}")
    with _lock:
        sym = _by_name.get(name)
        if sym is None:
            sym = max(max(_by_symbol, default=3) + 1, 4)
            _by_name[name] = sym
            _by_symbol[sym] = name
        return sym


def name_for(symbol: int) -> str:
    """The name of a symbol (``"dyn<k>"`` for a symbol never named in this process)."""
    with _lock:
        name = _by_symbol.get(symbol)
        if name is None:
            name = f"dyn{symbol}"
            if name not in _by_name:
                _by_name[name] = symbol
            _by_symbol[symbol] = name
        return name


def bind_name(symbol: int, name: str) -> None:
    """Record ``name`` for ``symbol`` when loading JSON (first binding wins)."""
    with _lock:
        if symbol not in _by_symbol and name not in _by_name:
            _by_symbol[symbol] = name
            _by_name[name] = symbol


@dataclasses.dataclass(frozen=True)
class Dynamic:
    """A dynamic dimension: RLX ``Dim::Dynamic(symbol)``; ``name`` is cosmetic."""

    symbol: int
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        if not isinstance(self.symbol, int) or isinstance(self.symbol, bool) or not (
            0 <= self.symbol < 2**32
        ):
            raise ValueError(f"dynamic symbol must be a u32, got {self.symbol!r}")
        if not self.name:
            object.__setattr__(self, "name", name_for(self.symbol))

    @classmethod
    def named(cls, name: str) -> "Dynamic":
        return cls(symbol_for(name), name)

    def __repr__(self) -> str:
        return f"Dynamic({self.symbol}, {self.name!r})"

    def __str__(self) -> str:
        return self.name


Dim = "int | Dynamic"


def as_dim(value) -> "int | Dynamic":
    """Builder shape entry -> dim: non-negative int, a name string, or a Dynamic."""
    if isinstance(value, Dynamic):
        return value
    if isinstance(value, str):
        return Dynamic.named(value)
    if isinstance(value, bool):
        raise ValueError(f"shape entry must be an int or a dimension name, got {value!r}")
    try:
        import operator

        n = operator.index(value)
    except TypeError:
        raise ValueError(
            f"shape entry must be an int or a dimension name, got {value!r}"
        ) from None
    if n < 0 or n > MAX_DIM:
        raise ValueError(f"shape entry {n} out of range (0..{MAX_DIM})")
    return int(n)


@dataclasses.dataclass(frozen=True)
class Shape:
    """RLX ``Shape``: a tuple of dims plus a dtype."""

    dims: tuple
    dtype: DType

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(as_dim(d) for d in self.dims))
        object.__setattr__(self, "dtype", DType.from_any(self.dtype))
        # the JSON loader's rule (running product of the static dims), so that every
        # shape a builder makes also loads back
        total = 1
        for d in self.dims:
            if isinstance(d, int):
                total *= d
                if total > MAX_DIM:
                    raise ValueError(f"shape {self.dims} declares more than {MAX_DIM} elements")

    @classmethod
    def of(cls, dims: Iterable, dtype) -> "Shape":
        if isinstance(dims, (str, bytes)):
            raise ValueError(f"shape must be a sequence of dims, got {dims!r}")
        return cls(tuple(dims), DType.from_any(dtype))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.dims)

    def numel(self) -> int | None:
        """Element count, ``None`` when a dim is dynamic."""
        total = 1
        for d in self.dims:
            if not isinstance(d, int):
                return None
            total *= d
        return total

    def with_dims(self, dims) -> "Shape":
        return Shape(tuple(dims), self.dtype)

    def with_dtype(self, dtype) -> "Shape":
        return Shape(self.dims, DType.from_any(dtype))

    def py_dims(self) -> list:
        """Dims as ``shape_of`` returns them: ints, dynamic dims as their name."""
        return [d if isinstance(d, int) else d.name for d in self.dims]

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.dims) + "] " + self.dtype.short


# ---------------------------------------------------------------------------
# shape algebra used by the op rules (raise OpFault; the graph adds the node)
# ---------------------------------------------------------------------------

def dims_equal(a, b) -> bool:
    """Two dims are known equal (dynamic dims by symbol)."""
    return a == b


def dims_compatible(a, b) -> bool:
    """Two dims may be equal: equal, or either dynamic."""
    return a == b or isinstance(a, Dynamic) or isinstance(b, Dynamic)


def broadcast_dims(a: Sequence, b: Sequence) -> tuple:
    """numpy broadcasting of two dim tuples (a dynamic dim matches anything but a
    different static dim stays an error)."""
    rank = max(len(a), len(b))
    pa = (1,) * (rank - len(a)) + tuple(a)
    pb = (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(pa, pb):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        elif isinstance(x, Dynamic):
            out.append(x)
        elif isinstance(y, Dynamic):
            out.append(y)
        else:
            raise OpFault(
                f"shapes {list(a)} and {list(b)} do not broadcast (dim {x} vs {y})"
            )
    return tuple(out)


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    """Normalise a possibly negative axis into ``0..rank-1``."""
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise OpFault(f"{what} must be an int, got {axis!r}")
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise OpFault(f"{what} {axis} out of range for rank {rank}")
    return a


def same_dims(what: str, a: Shape, b: Shape) -> None:
    if len(a.dims) != len(b.dims) or not all(
        dims_compatible(x, y) for x, y in zip(a.dims, b.dims)
    ):
        raise OpFault(f"{what}: shapes {a} and {b} differ")


def shapes_match(declared: Shape, inferred: Shape) -> bool:
    """A declared shape agrees with an inferred one: same dtype and rank with
    compatible dims, or (as RLX's verifier allows) both hold exactly one element
    (``[]`` vs ``[1]``)."""
    if declared.dtype != inferred.dtype:
        return False
    if declared.rank == inferred.rank and all(
        dims_compatible(x, y) for x, y in zip(declared.dims, inferred.dims)
    ):
        return True
    return declared.numel() == 1 and inferred.numel() == 1


def leading_flatten(s: Shape) -> "Shape | None":
    """``[..., H] -> [prod(...), H]`` (RLX's fused-norm row layout); a dynamic leading
    dim stays dynamic (``rows`` when there are several)."""
    if s.rank < 2 or not isinstance(s.dims[-1], int):
        return None
    lead = s.dims[:-1]
    syms = sorted({d.symbol for d in lead if isinstance(d, Dynamic)})
    if not syms:
        n = 1
        for d in lead:
            n *= d
        first = n
    else:
        first = Dynamic(syms[0]) if len(syms) == 1 else Dynamic(ROWS)
    return Shape((first, s.dims[-1]), s.dtype)
