"""Reductions and friends: Reduce, Softmax, Cumsum, TopK, Sample, and the fused
softmax cross-entropy loss."""

from __future__ import annotations

from .dtypes import DType
from .errors import OpFault
from .op import Op, ReduceOp, need_float, need_index, need_min_rank, need_rank, op_class
from .shape import Shape, dims_compatible, norm_axis


@op_class
class Reduce(Op):
    """Reduce ``axes`` with ``op``; reduced dims become 1 when ``keep_dim`` else vanish."""

    op: ReduceOp
    axes: tuple[int, ...]
    keep_dim: bool

    def validate(self):
        if len(set(self.axes)) != len(self.axes):
            raise OpFault(f"reduce axes {list(self.axes)} repeat")

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        for a in self.axes:
            if a >= x.rank:
                raise OpFault(f"reduce axis {a} out of range for rank {x.rank}")
        if x.dtype is DType.Bool and self.op in (ReduceOp.Sum, ReduceOp.Mean, ReduceOp.Prod):
            raise OpFault(f"reduce {self.op.value} is not defined on bool")
        dims = []
        for i, d in enumerate(x.dims):
            if i in self.axes:
                if self.keep_dim:
                    dims.append(1)
            else:
                dims.append(d)
        return Shape(tuple(dims), x.dtype)


@op_class
class Softmax(Op):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` (negative counts from the end)."""

    axis: int
    _signed = frozenset({"axis"})

    def arity(self):
        return 1

    def infer(self, ins):
        norm_axis(self.axis, ins[0].rank)
        need_float("softmax input", ins[0])
        return ins[0]


@op_class
class Cumsum(Op):
    """Cumulative sum along ``axis``; ``exclusive`` shifts by one (first element 0)."""

    axis: int
    exclusive: bool
    _signed = frozenset({"axis"})

    def arity(self):
        return 1

    def infer(self, ins):
        norm_axis(self.axis, ins[0].rank)
        return ins[0]


@op_class
class TopK(Op):
    """Indices of the ``k`` largest entries along the last axis, as f32
    (``[..., N] -> [..., k]``, ties to the smaller index)."""

    k: int

    def arity(self):
        return 1

    def infer(self, ins):
        (x,) = ins
        need_min_rank("topk input", x, 1)
        last = x.dims[-1]
        if isinstance(last, int) and self.k > last:
            raise OpFault(f"k={self.k} exceeds the last dim {last}")
        return Shape(x.dims[:-1] + (self.k,), DType.F32)


@op_class
class Sample(Op):
    """Token sampling from logits ``[..., V]`` (top_k 0 = off, top_p 1.0 = off,
    temperature 1.0 = neutral, seed 0 = counter); output shape declared."""

    top_k: int
    top_p: float
    temperature: float
    seed: int

    def validate(self):
        if not 0.0 < self.top_p <= 1.0:
            raise OpFault(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0.0:
            raise OpFault(f"temperature must be >= 0, got {self.temperature}")
        if self.seed >= 2**64:
            raise OpFault("seed must fit a u64")

    def arity(self):
        return 1

    def check_declared(self, ins, out):
        need_min_rank("sample logits", ins[0], 1)


@op_class
class SoftmaxCrossEntropyWithLogits(Op):
    """Per-row loss ``logsumexp(logits[i]) - logits[i, labels[i]]``: logits ``[N, C]``,
    labels ``[N]`` (f32-encoded or integer class ids) -> ``[N]``."""

    def arity(self):
        return 2

    def infer(self, ins):
        logits, labels = ins
        need_rank("logits", logits, 2)
        need_rank("labels", labels, 1)
        need_float("logits", logits)
        need_index("labels", labels)
        if not dims_compatible(logits.dims[0], labels.dims[0]):
            raise OpFault(f"labels has {labels.dims[0]} rows, logits has {logits.dims[0]}")
        return Shape((logits.dims[0],), logits.dtype)
