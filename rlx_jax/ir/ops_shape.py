"""Shape ops: Reshape, Transpose, Narrow, Concat, Expand, Gather, ResizeNearest2x."""

from __future__ import annotations

from .errors import OpFault
from .op import Op, need_index, need_rank, op_class
from .shape import ROWS, Dynamic, Shape, dims_compatible


def reshape_dims(s: Shape, new_shape) -> tuple:
    """RLX reshape rule: at most one -1; static input -> the -1 is inferred and the
    element counts must agree; dynamic input -> the -1 becomes the input's dynamic
    symbol (``rows`` when there are several)."""
    if sum(1 for d in new_shape if d == -1) > 1:
        raise OpFault("reshape: at most one -1")
    for d in new_shape:
        if d < -1:
            raise OpFault(f"reshape: invalid dim {d}")
    known = 1
    for d in new_shape:
        if d != -1:
            known *= d
    total = s.numel()
    if total is not None:
        if -1 in new_shape:
            if known == 0 or total % known:
                raise OpFault(f"reshape: cannot reshape {s} into {list(new_shape)}")
            return tuple(total // known if d == -1 else d for d in new_shape)
        if known != total:
            raise OpFault(
                f"reshape: element count {total} of {s} differs from {known} of {list(new_shape)}"
            )
        return tuple(new_shape)
    syms = sorted({d.symbol for d in s.dims if isinstance(d, Dynamic)})
    if -1 not in new_shape:
        static_in = 1
        for d in s.dims:
            if isinstance(d, int):
                static_in *= d
        if static_in and known % static_in:
            raise OpFault(f"reshape: element count of {s} cannot equal {known}")
        raise OpFault(f"reshape: dynamic input {s} needs a -1 in the target {list(new_shape)}")
    sym = syms[0] if len(syms) == 1 else ROWS
    return tuple(Dynamic(sym) if d == -1 else d for d in new_shape)


@op_class
class Reshape(Op):
    """Row-major reshape to ``new_shape`` (-1 marks the one inferred / dynamic dim)."""

    new_shape: tuple[int, ...]
    _signed = frozenset({"new_shape"})

    def arity(self):
        return 1

    def infer(self, ins):
        return Shape(reshape_dims(ins[0], self.new_shape), ins[0].dtype)

    def check_declared(self, ins, out):  # pragma: no cover - infer always answers
        pass


@op_class
class Transpose(Op):
    """``y = x.transpose(perm)``: output dim i is input dim ``perm[i]``."""

    perm: tuple[int, ...]

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        if sorted(self.perm) != list(range(x.rank)):
            raise OpFault(f"perm {list(self.perm)} is not a permutation of rank {x.rank}")
        return Shape(tuple(x.dims[i] for i in self.perm), x.dtype)


@op_class
class Narrow(Op):
    """Slice ``[start, start + len)`` along ``axis``."""

    axis: int
    start: int
    len: int

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        if self.axis >= x.rank:
            raise OpFault(f"axis {self.axis} out of range for rank {x.rank}")
        d = x.dims[self.axis]
        if isinstance(d, int) and self.start + self.len > d:
            raise OpFault(
                f"narrow [{self.start}, {self.start + self.len}) out of bounds for dim {d} on axis {self.axis}"
            )
        return Shape(x.dims[: self.axis] + (self.len,) + x.dims[self.axis + 1:], x.dtype)


@op_class
class Concat(Op):
    """Concatenate all inputs (variadic, at least one) along ``axis``."""

    axis: int

    def arity(self):
        return None

    def infer(self, ins):
        if not ins:
            raise OpFault("concat needs at least one input")
        base = ins[0]
        if self.axis >= base.rank:
            raise OpFault(f"axis {self.axis} out of range for rank {base.rank}")
        total, dyn = 0, None
        for k, s in enumerate(ins):
            if s.rank != base.rank:
                raise OpFault(f"input {k} has rank {s.rank}, input 0 has {base.rank}")
            if s.dtype != base.dtype:
                raise OpFault(f"input {k} dtype {s.dtype.short} differs from {base.dtype.short}")
            for i, (a, b) in enumerate(zip(s.dims, base.dims)):
                if i != self.axis and not dims_compatible(a, b):
                    raise OpFault(f"input {k} shape {s} differs from {base} off the concat axis")
            d = s.dims[self.axis]
            if isinstance(d, int):
                total += d
            else:
                if dyn is not None and dyn != d:
                    raise OpFault("concat of different dynamic dims on the concat axis")
                dyn = d
        out = dyn if dyn is not None else total
        return Shape(base.dims[: self.axis] + (out,) + base.dims[self.axis + 1:], base.dtype)


@op_class
class Expand(Op):
    """Broadcast to ``target_shape`` (numpy rules, right-aligned; -1 keeps the input dim)."""

    target_shape: tuple[int, ...]
    _signed = frozenset({"target_shape"})

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        t = self.target_shape
        if len(t) < x.rank:
            raise OpFault(f"target {list(t)} has lower rank than input {x}")
        off = len(t) - x.rank
        out = []
        for i, d in enumerate(t):
            src = x.dims[i - off] if i >= off else None
            if d < -1:
                raise OpFault(f"invalid target dim {d}")
            if d == -1:
                if src is None:
                    raise OpFault(f"-1 at new leading axis {i}")
                out.append(src)
                continue
            if src is not None and src != 1 and not isinstance(src, Dynamic) and src != d:
                raise OpFault(f"cannot expand {x} to {list(t)} (dim {src} vs {d})")
            out.append(d)
        return Shape(tuple(out), x.dtype)


@op_class
class Gather(Op):
    """RLX's ``Gather{axis}``: table ``[*lead, V, *post]`` (``lead`` = the ``axis``
    dims before the gathered one), indices ``[*idx]`` -> ``[*idx, *post]``;
    ``out[i, p] = table[0, ..., 0, indices[i], p]``.

    For axis 0 this is the embedding lookup (``np.take``). For axis >= 1 the output
    has no ``lead`` dims (RLX's shape rule) and reads the table's first slice along
    them, the elements RLX's kernel writes inside its output; when every lead dim is 1
    it equals ``np.take`` with those unit dims dropped. ``Graph.take`` builds
    ``np.take`` along any axis."""

    axis: int

    def arity(self):
        return 2

    def infer(self, ins):
        t, idx = ins
        if self.axis >= t.rank:
            raise OpFault(f"axis {self.axis} out of range for table {t}")
        need_index("gather indices", idx)
        return Shape(idx.dims + t.dims[self.axis + 1:], t.dtype)


@op_class
class ResizeNearest2x(Op):
    """Nearest-neighbour 2x upsample of NCHW: ``[N, C, H, W] -> [N, C, 2H, 2W]``."""

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        need_rank("resize_nearest_2x input", x, 4)
        h, w = x.dims[2], x.dims[3]
        if not (isinstance(h, int) and isinstance(w, int)):
            raise OpFault("resize_nearest_2x needs static spatial dims")
        return Shape(x.dims[:2] + (2 * h, 2 * w), x.dtype)
