"""Linear algebra: MatMul, DotGeneral, dense solves, LoRA, grouped (MoE) matmul,
ScatterAdd."""

from __future__ import annotations

from .errors import OpFault
from .op import Op, need_index, need_min_rank, need_rank, need_same_dtype, op_class
from .shape import Shape, broadcast_dims, dims_compatible


def _k_match(what, k1, k2):
    if not dims_compatible(k1, k2):
        raise OpFault(f"{what}: inner dimensions differ ({k1} vs {k2})")


@op_class
class MatMul(Op):
    """``[..., M, K] @ [..., K, N] -> [..., M, N]``; batch dims broadcast (numpy)."""

    def arity(self):
        return 2

    def infer(self, ins):
        a, b = ins
        need_min_rank("matmul lhs", a, 2)
        need_min_rank("matmul rhs", b, 2)
        need_same_dtype("matmul", a, b)
        _k_match("matmul", a.dims[-1], b.dims[-2])
        batch = broadcast_dims(a.dims[:-2], b.dims[:-2])
        return Shape(batch + (a.dims[-2], b.dims[-1]), a.dtype)


@op_class
class DotGeneral(Op):
    """XLA dot_general: output dims = batch dims, then lhs free dims, then rhs free dims."""

    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]

    def validate(self):
        if len(self.lhs_contracting) != len(self.rhs_contracting):
            raise OpFault("lhs_contracting and rhs_contracting differ in length")
        if len(self.lhs_batch) != len(self.rhs_batch):
            raise OpFault("lhs_batch and rhs_batch differ in length")
        for side, c, b in (("lhs", self.lhs_contracting, self.lhs_batch),
                           ("rhs", self.rhs_contracting, self.rhs_batch)):
            if len(set(c) | set(b)) != len(c) + len(b):
                raise OpFault(f"{side} contracting/batch dims repeat")

    def arity(self):
        return 2

    def infer(self, ins):
        a, b = ins
        need_same_dtype("dot_general", a, b)
        for side, s, dims in (("lhs", a, self.lhs_contracting + self.lhs_batch),
                              ("rhs", b, self.rhs_contracting + self.rhs_batch)):
            for d in dims:
                if d >= s.rank:
                    raise OpFault(f"{side} dim {d} out of range for {s}")
        for i, j in zip(self.lhs_contracting, self.rhs_contracting):
            _k_match("dot_general contracting", a.dims[i], b.dims[j])
        for i, j in zip(self.lhs_batch, self.rhs_batch):
            if not dims_compatible(a.dims[i], b.dims[j]):
                raise OpFault(f"dot_general batch dims differ ({a.dims[i]} vs {b.dims[j]})")
        used_a = set(self.lhs_contracting) | set(self.lhs_batch)
        used_b = set(self.rhs_contracting) | set(self.rhs_batch)
        dims = tuple(a.dims[i] for i in self.lhs_batch)
        dims += tuple(d for i, d in enumerate(a.dims) if i not in used_a)
        dims += tuple(d for i, d in enumerate(b.dims) if i not in used_b)
        return Shape(dims, a.dtype)


@op_class
class DenseSolve(Op):
    """Solve ``A x = b``: ``A [N, N]``, ``b [N]`` or ``[N, K]`` -> x shaped like b."""

    def arity(self):
        return 2

    def infer(self, ins):
        a, b = ins
        need_rank("dense_solve A", a, 2)
        need_rank("dense_solve b", b, 1, 2)
        need_same_dtype("dense_solve", a, b)
        if not dims_compatible(a.dims[0], a.dims[1]):
            raise OpFault(f"dense_solve A must be square, got {a}")
        _k_match("dense_solve", a.dims[1], b.dims[0])
        return b


@op_class
class BatchedDenseSolve(Op):
    """Batched solve: ``A [B, N, N]``, ``b [B, N]`` or ``[B, N, K]`` -> shaped like b."""

    def arity(self):
        return 2

    def infer(self, ins):
        a, b = ins
        need_rank("batched_dense_solve A", a, 3)
        need_rank("batched_dense_solve b", b, 2, 3)
        need_same_dtype("batched_dense_solve", a, b)
        if not dims_compatible(a.dims[1], a.dims[2]):
            raise OpFault(f"batched_dense_solve A must be [B, N, N], got {a}")
        if not dims_compatible(a.dims[0], b.dims[0]):
            raise OpFault(f"batched_dense_solve batch dims differ ({a.dims[0]} vs {b.dims[0]})")
        _k_match("batched_dense_solve", a.dims[2], b.dims[1])
        return b


@op_class
class LoraMatMul(Op):
    """``y = x @ W + scale * (x @ A) @ B``: x ``[..., K]``, W ``[K, N]``, A ``[K, R]``,
    B ``[R, N]`` -> ``[..., N]``."""

    scale: float

    def arity(self):
        return 4

    def infer(self, ins):
        x, w, a, b = ins
        need_min_rank("lora_matmul x", x, 1)
        for nm, s in (("w", w), ("a", a), ("b", b)):
            need_rank(f"lora_matmul {nm}", s, 2)
        need_same_dtype("lora_matmul", x, w, a, b)
        _k_match("lora_matmul x/w", x.dims[-1], w.dims[0])
        _k_match("lora_matmul x/a", x.dims[-1], a.dims[0])
        _k_match("lora_matmul a/b rank", a.dims[1], b.dims[0])
        _k_match("lora_matmul w/b", w.dims[1], b.dims[1])
        return Shape(x.dims[:-1] + (w.dims[1],), x.dtype)


@op_class
class GroupedMatMul(Op):
    """MoE GEMM: ``x [M, K]``, ``w [E, K, N]``, ``expert_idx [M]`` -> ``[M, N]`` with
    ``y[i] = x[i] @ w[expert_idx[i]]``."""

    def arity(self):
        return 3

    def infer(self, ins):
        x, w, idx = ins
        need_rank("grouped_matmul x", x, 2)
        need_rank("grouped_matmul w", w, 3)
        need_rank("grouped_matmul expert_idx", idx, 1)
        need_index("grouped_matmul expert_idx", idx)
        need_same_dtype("grouped_matmul", x, w)
        _k_match("grouped_matmul", x.dims[1], w.dims[1])
        if not dims_compatible(x.dims[0], idx.dims[0]):
            raise OpFault(f"expert_idx has {idx.dims[0]} rows, x has {x.dims[0]}")
        return Shape((x.dims[0], w.dims[2]), x.dtype)


@op_class
class ScatterAdd(Op):
    """``out[indices[i...]] += updates[i..., :]``: indices ``[U...]`` (RLX: ``[U]``),
    updates ``[U..., T...]``; the output ``[out_dim, T...]`` is declared (out_dim is not
    inferable). Initial output is zero."""

    def arity(self):
        return 2

    def check_declared(self, ins, out):
        upd, idx = ins
        need_index("scatter_add indices", idx)
        k = idx.rank
        if upd.rank < k or not all(dims_compatible(a, b) for a, b in zip(upd.dims[:k], idx.dims)):
            raise OpFault(f"updates {upd} must start with the indices dims {list(idx.dims)}")
        trailing = upd.dims[k:]
        if out.rank != 1 + len(trailing) or not all(
            dims_compatible(x, y) for x, y in zip(out.dims[1:], trailing)
        ):
            raise OpFault(f"output {out} must be [out_dim, {', '.join(map(str, trailing))}]")
        if out.dtype != upd.dtype:
            raise OpFault(f"output dtype {out.dtype.short} differs from updates {upd.dtype.short}")
