"""Builders, part 1: leaves and pyrlx's elementwise / linear-algebra / shape /
reduction surface (names, positional order and defaults as in pyrlx).

Every builder returns the new node's id (a plain int) and checks its arguments at
once: a bad argument or shape raises GraphError naming the node it would have made.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

from .dtypes import DType
from .errors import GraphError, OpFault, node_error
from .op import ActivationKind, BinaryOp, CmpOp, ReduceOp
from .shape import Dynamic, Shape, as_dim


class BuilderBase:
    """Shared helpers of the builder mixins."""

    def _fault(self, op_name: str, msg: str, name=None) -> GraphError:
        return node_error(len(self.nodes), op_name, name, msg)

    def _sequence(self, op_name: str, value, what: str) -> tuple:
        """``value`` as a tuple; a GraphError naming the node when it is not a sequence."""
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise self._fault(op_name, f"{what} must be a sequence, got {value!r}")
        return tuple(value)

    def _make(self, cls, **attrs):
        """Construct an op; an attribute fault becomes a GraphError naming the node."""
        try:
            return cls(**attrs)
        except OpFault as exc:
            raise self._fault(cls.__name__, str(exc)) from None
        except TypeError as exc:
            raise self._fault(cls.__name__, f"bad attributes: {exc}") from None

    def _build(self, cls, inputs, shape: Optional[Shape] = None, node_name=None, **attrs) -> int:
        return self.add_node(self._make(cls, **attrs), tuple(inputs), shape, node_name)

    def _shape(self, op_name: str, dims, dtype) -> Shape:
        """Builder ``(dims, dtype)`` -> Shape; strings in dims name dynamic dims."""
        try:
            if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__"):
                raise ValueError(f"shape must be a sequence, got {dims!r}")
            return Shape(tuple(as_dim(d) for d in dims), DType.from_any(dtype))
        except (TypeError, ValueError) as exc:
            raise self._fault(op_name, str(exc)) from None

    def _axis(self, op_name: str, axis, x: int) -> int:
        """Normalise a possibly negative axis against node ``x``'s rank."""
        rank = self.node(x).shape.rank
        try:
            a = operator.index(axis)
        except TypeError:
            raise self._fault(op_name, f"axis must be an int, got {axis!r}") from None
        if not -rank <= a < rank:
            raise self._fault(op_name, f"axis {axis} out of range for rank {rank}")
        return a % rank if rank else a

    def _axes(self, op_name: str, axes, x: int) -> tuple:
        if isinstance(axes, int):
            axes = (axes,)
        return tuple(self._axis(op_name, a, x) for a in axes)

    def _enum(self, enum_cls, op_name: str, value):
        try:
            return enum_cls.parse(value)
        except OpFault as exc:
            raise self._fault(op_name, str(exc)) from None

    def _opt_shape(self, op_name: str, shape, default_dtype) -> Optional[Shape]:
        """None | Shape | (dims, dtype) | dims (dtype defaults) -> Shape or None."""
        if shape is None or isinstance(shape, Shape):
            return shape
        if (isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[1], (str, DType))
                and not isinstance(shape[0], (str, int))):
            return self._shape(op_name, shape[0], shape[1])
        return self._shape(op_name, shape, default_dtype)

    def _dt(self, x: int) -> DType:
        return self.node(x).shape.dtype


class CoreBuilders(BuilderBase):
    # -- leaves ------------------------------------------------------------------
    def input(self, name: str, shape: Sequence, dtype="f32") -> int:
        """Graph input ``name`` of ``shape`` (strings name dynamic dims) and ``dtype``."""
        from .ops_leaf import Input

        return self.add_node(self._make(Input, name=name), (), self._shape("Input", shape, dtype), name)

    def param(self, name: str, shape: Sequence, dtype="f32") -> int:
        """Parameter ``name`` of ``shape`` and ``dtype``."""
        from .ops_leaf import Param

        return self.add_node(self._make(Param, name=name), (), self._shape("Param", shape, dtype), name)

    def constant(self, array, dtype=None, name: Optional[str] = None) -> int:
        """A Constant node holding ``array`` (numpy-convertible; ``dtype`` overrides)."""
        import numpy as np

        from .ops_leaf import Constant

        try:
            dt = DType.from_any(dtype if dtype is not None else np.asarray(array).dtype)
            arr = np.asarray(array, dtype=dt.to_numpy())
        except (TypeError, ValueError) as exc:
            raise self._fault("Constant", str(exc)) from None
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(arr).tobytes()
        return self.add_node(Constant(data=data), (), Shape(arr.shape, dt), name)

    def scalar(self, value: float, dtype="f32") -> int:
        """A rank-0 constant."""
        return self.constant(value, dtype)

    # -- linear algebra -------------------------------------------------------------
    def matmul(self, lhs: int, rhs: int) -> int:
        """``[..., M, K] @ [..., K, N] -> [..., M, N]`` (batch dims broadcast)."""
        from .ops_linalg import MatMul

        return self._build(MatMul, (lhs, rhs))

    def matmul_with_shape(self, lhs: int, rhs: int, out_shape, dtype) -> int:
        """MatMul with a declared output shape (checked against the inferred one)."""
        from .ops_linalg import MatMul

        return self._build(MatMul, (lhs, rhs), self._shape("MatMul", out_shape, dtype))

    def dot_general(self, lhs: int, rhs: int, lhs_contracting, rhs_contracting,
                    lhs_batch=(), rhs_batch=()) -> int:
        from .ops_linalg import DotGeneral

        return self._build(DotGeneral, (lhs, rhs), lhs_contracting=lhs_contracting,
                           rhs_contracting=rhs_contracting, lhs_batch=lhs_batch, rhs_batch=rhs_batch)

    def lora_matmul(self, x: int, w: int, a: int, b: int, scale: float, out_shape=None, dtype=None) -> int:
        """``x @ w + scale * (x @ a) @ b`` (out_shape/dtype as pyrlx; checked)."""
        from .ops_linalg import LoraMatMul

        s = None if out_shape is None else self._shape("LoraMatMul", out_shape, dtype or self.node(x).shape.dtype)
        return self._build(LoraMatMul, (x, w, a, b), s, scale=scale)

    def dense_solve(self, a: int, b: int, out_shape=None, dtype=None) -> int:
        """Solve ``a x = b`` (a ``[N, N]``)."""
        from .ops_linalg import DenseSolve

        s = None if out_shape is None else self._shape("DenseSolve", out_shape, dtype or self.node(b).shape.dtype)
        return self._build(DenseSolve, (a, b), s)

    def batched_dense_solve(self, a: int, b: int, out_shape=None, dtype=None) -> int:
        from .ops_linalg import BatchedDenseSolve

        s = None if out_shape is None else self._shape("BatchedDenseSolve", out_shape, dtype or self.node(b).shape.dtype)
        return self._build(BatchedDenseSolve, (a, b), s)

    def grouped_matmul(self, x: int, w: int, expert_idx: int) -> int:
        """MoE GEMM ``y[i] = x[i] @ w[expert_idx[i]]``."""
        from .ops_linalg import GroupedMatMul

        return self._build(GroupedMatMul, (x, w, expert_idx))

    def scatter_add(self, updates: int, indices: int, out_shape, dtype=None) -> int:
        """``out[indices[i]] += updates[i]`` into zeros of ``out_shape``."""
        from .ops_linalg import ScatterAdd

        dt = dtype or self.node(updates).shape.dtype
        return self._build(ScatterAdd, (updates, indices), self._shape("ScatterAdd", out_shape, dt))

    # -- elementwise ---------------------------------------------------------------
    def binary(self, op, lhs: int, rhs: int) -> int:
        """``lhs <op> rhs`` for op in add/sub/mul/div/max/min/pow (or + - * /)."""
        from .ops_elementwise import Binary

        return self._build(Binary, (lhs, rhs), op=self._enum(BinaryOp, "Binary", op))

    def add(self, *args, **kwargs):  # noqa: D401 - doc below
        """``add(a, b)`` builds Binary Add; ``add(op, inputs, shape=None, name=None)``
        with an :class:`~rlx_jax.ir.Op` is :meth:`add_node` (pyrlx's ``Graph.add``)."""
        from .op import Op

        if args and isinstance(args[0], Op):
            return self.add_node(*args, **kwargs)
        if "op" in kwargs:
            return self.add_node(**kwargs)
        names = ("a", "b")
        if len(args) > 2 or set(kwargs) - set(names[len(args):]):
            raise TypeError("add(a, b) takes two node ids (or add(op, inputs, shape=None, name=None))")
        vals = dict(zip(names, args), **kwargs)
        if set(vals) != set(names):
            raise TypeError("add(a, b) needs both a and b")
        return self.binary(BinaryOp.Add, vals["a"], vals["b"])

    def sub(self, a: int, b: int) -> int:
        return self.binary(BinaryOp.Sub, a, b)

    def mul(self, a: int, b: int) -> int:
        return self.binary(BinaryOp.Mul, a, b)

    def div(self, a: int, b: int) -> int:
        return self.binary(BinaryOp.Div, a, b)

    def maximum(self, a: int, b: int) -> int:
        return self.binary(BinaryOp.Max, a, b)

    def minimum(self, a: int, b: int) -> int:
        return self.binary(BinaryOp.Min, a, b)

    def pow(self, a: int, b: int) -> int:
        return self.binary(BinaryOp.Pow, a, b)

    def activation(self, kind, input: int) -> int:
        """Unary activation ``kind`` (gelu, gelu_approx, silu, relu, sigmoid, tanh, exp,
        log, sqrt, rsqrt, neg, abs, sin, cos, tan, atan, round)."""
        from .ops_elementwise import Activation

        return self._build(Activation, (input,), kind=self._enum(ActivationKind, "Activation", kind))

    def gelu(self, x): return self.activation(ActivationKind.Gelu, x)
    def gelu_approx(self, x): return self.activation(ActivationKind.GeluApprox, x)
    def silu(self, x): return self.activation(ActivationKind.Silu, x)
    def relu(self, x): return self.activation(ActivationKind.Relu, x)
    def sigmoid(self, x): return self.activation(ActivationKind.Sigmoid, x)
    def tanh(self, x): return self.activation(ActivationKind.Tanh, x)
    def exp(self, x): return self.activation(ActivationKind.Exp, x)
    def log(self, x): return self.activation(ActivationKind.Log, x)
    def sqrt(self, x): return self.activation(ActivationKind.Sqrt, x)
    def rsqrt(self, x): return self.activation(ActivationKind.Rsqrt, x)
    def neg(self, x): return self.activation(ActivationKind.Neg, x)
    def abs(self, x): return self.activation(ActivationKind.Abs, x)
    def sin(self, x): return self.activation(ActivationKind.Sin, x)
    def cos(self, x): return self.activation(ActivationKind.Cos, x)
    def tan(self, x): return self.activation(ActivationKind.Tan, x)
    def atan(self, x): return self.activation(ActivationKind.Atan, x)
    def round(self, x): return self.activation(ActivationKind.Round, x)

    def compare(self, op, lhs: int, rhs: int) -> int:
        """``lhs <cmp> rhs`` -> bool (eq ne lt le gt ge, or == != < <= > >=)."""
        from .ops_elementwise import Compare

        return self._build(Compare, (lhs, rhs), op=self._enum(CmpOp, "Compare", op))

    def eq_(self, a, b): return self.compare(CmpOp.Eq, a, b)
    def ne_(self, a, b): return self.compare(CmpOp.Ne, a, b)
    def lt_(self, a, b): return self.compare(CmpOp.Lt, a, b)
    def le_(self, a, b): return self.compare(CmpOp.Le, a, b)
    def gt_(self, a, b): return self.compare(CmpOp.Gt, a, b)
    def ge_(self, a, b): return self.compare(CmpOp.Ge, a, b)

    def where_(self, cond: int, a: int, b: int) -> int:
        """``cond ? a : b`` (broadcast)."""
        from .ops_elementwise import Where

        return self._build(Where, (cond, a, b))

    where = where_

    def cast(self, x: int, to) -> int:
        from .ops_elementwise import Cast

        return self._build(Cast, (x,), to=to)

    def complex_norm_sq(self, z: int) -> int:
        """``|z|^2`` (c64 -> f32)."""
        from .ops_elementwise import ComplexNormSq

        return self._build(ComplexNormSq, (z,))

    def conjugate(self, z: int) -> int:
        from .ops_elementwise import Conjugate

        return self._build(Conjugate, (z,))

    def stop_gradient(self, x: int) -> int:
        """Identity that blocks gradients."""
        from .ops_elementwise import StopGradient

        return self._build(StopGradient, (x,))

    def elementwise_region(self, inputs, chain, out_shape, dtype, scalar_input_mask=0,
                           input_modulus=None) -> int:
        """RLX's fused elementwise chain (see ElementwiseRegion)."""
        from .ops_elementwise import ElementwiseRegion

        inputs = tuple(inputs)
        mod = tuple(input_modulus) if input_modulus is not None else (0,) * 16
        return self._build(ElementwiseRegion, inputs, self._shape("ElementwiseRegion", out_shape, dtype),
                           chain=tuple(chain), num_inputs=len(inputs),
                           scalar_input_mask=scalar_input_mask, input_modulus=mod)

    # -- reductions --------------------------------------------------------------
    def reduce(self, input: int, op, axes, keep_dim: bool = False) -> int:
        """Reduce ``axes`` (negative allowed) with sum/mean/max/min/prod."""
        from .ops_reduce import Reduce

        return self._build(Reduce, (input,), op=self._enum(ReduceOp, "Reduce", op),
                           axes=self._axes("Reduce", axes, input), keep_dim=keep_dim)

    def sum(self, x: int, axes, keep_dim: bool = False) -> int:
        return self.reduce(x, ReduceOp.Sum, axes, keep_dim)

    def mean(self, x: int, axes, keep_dim: bool = False) -> int:
        return self.reduce(x, ReduceOp.Mean, axes, keep_dim)

    def reduce_max(self, x: int, axes, keep_dim: bool = False) -> int:
        return self.reduce(x, ReduceOp.Max, axes, keep_dim)

    def reduce_min(self, x: int, axes, keep_dim: bool = False) -> int:
        return self.reduce(x, ReduceOp.Min, axes, keep_dim)

    def prod(self, x: int, axes, keep_dim: bool = False) -> int:
        return self.reduce(x, ReduceOp.Prod, axes, keep_dim)

    def softmax(self, input: int, axis: int = -1) -> int:
        from .ops_reduce import Softmax

        return self._build(Softmax, (input,), axis=axis)

    def cumsum(self, input: int, axis: int, exclusive: bool = False) -> int:
        from .ops_reduce import Cumsum

        return self._build(Cumsum, (input,), axis=axis, exclusive=exclusive)

    def top_k(self, x: int, k: int) -> int:
        """f32-encoded indices of the k largest entries along the last axis."""
        from .ops_reduce import TopK

        return self._build(TopK, (x,), k=k)

    topk = top_k

    def sample(self, logits: int, top_k: int, top_p: float, temperature: float, seed: int,
               output_shape, dtype="i32") -> int:
        from .ops_reduce import Sample

        return self._build(Sample, (logits,), self._shape("Sample", output_shape, dtype),
                           top_k=top_k, top_p=top_p, temperature=temperature, seed=seed)

    def softmax_cross_entropy_with_logits(self, logits: int, labels: int) -> int:
        """Per-row softmax cross-entropy: logits ``[N, C]``, labels ``[N]`` -> ``[N]``."""
        from .ops_reduce import SoftmaxCrossEntropyWithLogits

        return self._build(SoftmaxCrossEntropyWithLogits, (logits, labels))

    # -- shape ops ---------------------------------------------------------------
    def reshape(self, x: int, new_shape) -> int:
        """Reshape (one -1 allowed: inferred, or the input's dynamic dim; a dimension
        name in ``new_shape`` is written as -1, as RLX does)."""
        from .ops_shape import Reshape

        new_shape = self._sequence("Reshape", new_shape, "new_shape")
        tgt = tuple(-1 if isinstance(d, (str, Dynamic)) else d for d in new_shape)
        return self._build(Reshape, (x,), new_shape=tgt)

    def transpose(self, x: int, perm) -> int:
        from .ops_shape import Transpose

        rank = self.node(x).shape.rank
        perm = self._sequence("Transpose", perm, "perm")
        perm = tuple(p % rank if isinstance(p, int) and -rank <= p < 0 else p for p in perm)
        return self._build(Transpose, (x,), perm=perm)

    def narrow(self, x: int, axis: int, start: int, length: int) -> int:
        """Slice ``[start, start + length)`` along ``axis``."""
        from .ops_shape import Narrow

        return self._build(Narrow, (x,), axis=self._axis("Narrow", axis, x), start=start, len=length)

    def concat(self, inputs, axis: int) -> int:
        from .ops_shape import Concat

        inputs = self._sequence("Concat", inputs, "inputs")
        if not inputs:
            raise self._fault("Concat", "concat needs at least one input")
        return self._build(Concat, inputs, axis=self._axis("Concat", axis, inputs[0]))

    def expand(self, x: int, target_shape) -> int:
        """Broadcast to ``target_shape`` (-1 or a dimension name keeps the input dim)."""
        from .ops_shape import Expand

        target_shape = self._sequence("Expand", target_shape, "target_shape")
        tgt = tuple(-1 if isinstance(d, str) else d for d in target_shape)
        return self._build(Expand, (x,), target_shape=tgt)

    def gather(self, table: int, indices: int, axis: int = 0) -> int:
        """RLX's Gather: table ``[*lead, V, *post]``, indices ``[*idx]`` ->
        ``[*idx, *post]`` with ``out[i, p] = table[0, ..., 0, indices[i], p]`` (the
        embedding lookup for axis 0; for axis >= 1 the ``lead`` dims are not in the
        output, as in RLX and pyrlx). Use :meth:`take` for ``np.take`` along an axis."""
        from .ops_shape import Gather

        return self._build(Gather, (table, indices), axis=self._axis("Gather", axis, table))

    def take(self, table: int, indices: int, axis: int = 0) -> int:
        """``np.take(table, indices, axis)``: ``[*lead, V, *post]`` ->
        ``[*lead, *idx, *post]``, built from Gather along axis 0 between two
        Transposes (``V`` moved to the front, then the index dims moved back to
        ``axis``); for axis 0 a single Gather."""
        axis = self._axis("Gather", axis, table)
        if axis == 0:
            return self.gather(table, indices, 0)
        rank = self.node(table).shape.rank
        k = self.node(indices).shape.rank
        front = self.transpose(table, (axis, *range(axis), *range(axis + 1, rank)))
        picked = self.gather(front, indices, 0)          # [*idx, *lead, *post]
        back = (*range(k, k + axis), *range(k), *range(k + axis, k + rank - 1))
        return self.transpose(picked, back)

    def resize_nearest_2x(self, x: int) -> int:
        from .ops_shape import ResizeNearest2x

        return self._build(ResizeNearest2x, (x,))
