"""Small graph-building helpers shared by the VJP rules and the graph transforms.

Every helper appends nodes to ``g`` (an :class:`rlx_jax.ir.Graph`) and returns the new
node id. Shapes are inferred by the IR's shape rules; dynamic dims are kept (reshape
and expand targets write them as -1).
"""

from __future__ import annotations

import numpy as np

from rlx_jax.ir import DType, Dynamic, GraphError, Shape
from rlx_jax.ir.ops_elementwise import Binary, Compare, Where, Activation, Cast
from rlx_jax.ir.ops_leaf import Constant
from rlx_jax.ir.ops_reduce import Reduce
from rlx_jax.ir.ops_shape import Expand, Reshape, Transpose
from rlx_jax.ir.op import ActivationKind, BinaryOp, CmpOp, ReduceOp


def shape(g, i) -> Shape:
    return g.node(i).shape


def dims(g, i) -> tuple:
    return tuple(g.node(i).shape.dims)


def dtype(g, i) -> DType:
    return g.node(i).shape.dtype


def is_float(dt: DType) -> bool:
    """Dtypes that carry gradients (floats and c64)."""
    return dt in (DType.F32, DType.F16, DType.BF16, DType.F64, DType.C64)


def is_static(ds) -> bool:
    return all(isinstance(d, int) for d in ds)


def target(ds) -> tuple:
    """Dims as a Reshape/Expand target (-1 for a dynamic dim)."""
    return tuple(-1 if isinstance(d, Dynamic) else int(d) for d in ds)


def scalar(g, value, dt: DType) -> int:
    """A rank-0 constant of dtype ``dt``."""
    arr = np.asarray(value, dtype=dt.to_numpy())
    return g.add_node(Constant(data=np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()),
                      (), Shape((), dt))


def const(g, array, dt: DType) -> int:
    arr = np.asarray(array, dtype=dt.to_numpy())
    return g.add_node(Constant(data=np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()),
                      (), Shape(arr.shape, dt))


def zeros(g, s: Shape) -> int:
    """Zeros of shape ``s`` (a Constant when static, else a select against ``like``)."""
    if is_static(s.dims):
        return const(g, np.zeros(s.dims, s.dtype.to_numpy()), s.dtype)
    raise GraphError(f"cannot build zeros of dynamic shape {s} without a reference node")


def zeros_like(g, x) -> int:
    s = shape(g, x)
    if is_static(s.dims):
        return zeros(g, s)
    f = scalar(g, False, DType.Bool)
    return where(g, f, x, scalar(g, 0, s.dtype))


def binary(g, op: BinaryOp, a, b) -> int:
    return g.add_node(Binary(op=op), (a, b))


def add(g, a, b):
    return binary(g, BinaryOp.Add, a, b)


def sub(g, a, b):
    return binary(g, BinaryOp.Sub, a, b)


def mul(g, a, b):
    return binary(g, BinaryOp.Mul, a, b)


def div(g, a, b):
    return binary(g, BinaryOp.Div, a, b)


def pow_(g, a, b):
    return binary(g, BinaryOp.Pow, a, b)


def mul_s(g, a, value: float) -> int:
    return mul(g, a, scalar(g, value, dtype(g, a)))


def add_s(g, a, value: float) -> int:
    return add(g, a, scalar(g, value, dtype(g, a)))


def act(g, kind, x) -> int:
    return g.add_node(Activation(kind=ActivationKind.parse(kind)), (x,))


def neg(g, x):
    return act(g, ActivationKind.Neg, x)


def cmp(g, op, a, b) -> int:
    return g.add_node(Compare(op=CmpOp.parse(op)), (a, b))


def where(g, c, a, b) -> int:
    return g.add_node(Where(), (c, a, b))


def cast(g, x, to: DType) -> int:
    if dtype(g, x) == to:
        return x
    return g.add_node(Cast(to=to), (x,))


def index_ids(g, ix, limit: int) -> int:
    """RLX indices / class ids as the lowering reads them (``lowering.nn.index_array``),
    as I32: a float id is truncated toward zero with negatives saturating to 0, i.e.
    min(max(x, 0), limit) then the cast's truncation (clamping at ``limit`` keeps an id
    past the end out of range without overflowing the cast; in F32, where ``limit`` is
    exact, not in a bf16 / f16 that would round it). Integer ids convert."""
    if is_float(dtype(g, ix)):
        ix = cast(g, ix, DType.F32)
        ix = binary(g, BinaryOp.Max, ix, scalar(g, 0, DType.F32))
        ix = binary(g, BinaryOp.Min, ix, scalar(g, limit, DType.F32))
    return cast(g, ix, DType.I32)


def reduce(g, x, op, axes, keep_dim=False) -> int:
    axes = tuple(sorted(int(a) for a in axes))
    if not axes:
        return x
    return g.add_node(Reduce(op=ReduceOp.parse(op), axes=axes, keep_dim=keep_dim), (x,))


def sum_(g, x, axes, keep_dim=False):
    return reduce(g, x, ReduceOp.Sum, axes, keep_dim)


def reshape(g, x, ds) -> int:
    if dims(g, x) == tuple(ds):
        return x
    src = g.node(x)
    if isinstance(src.op, Reshape) and is_static(ds):   # reshape of a reshape
        x = src.inputs[0]
        if dims(g, x) == tuple(ds):
            return x
    return g.add_node(Reshape(new_shape=target(ds)), (x,))


def as_shape(g, x, s: Shape) -> int:
    """``x`` cast to ``s.dtype`` and reshaped to ``s.dims`` (each only when it differs):
    a spliced sub-graph's result fitted to the node it stands for."""
    x = cast(g, x, s.dtype)
    return reshape(g, x, s.dims) if dims(g, x) != tuple(s.dims) else x


def transpose(g, x, perm) -> int:
    perm = tuple(int(p) for p in perm)
    src = g.node(x)
    if isinstance(src.op, Transpose):       # compose: transpose of a transpose
        perm = tuple(src.op.perm[p] for p in perm)
        x = src.inputs[0]
    if perm == tuple(range(len(perm))):
        return x
    return g.add_node(Transpose(perm=perm), (x,))


def inverse_perm(perm) -> tuple:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def expand(g, x, ds) -> int:
    if dims(g, x) == tuple(ds):
        return x
    return g.add_node(Expand(target_shape=target(ds)), (x,))


def expand_like(g, a, ref) -> int:
    """``a`` broadcast to node ``ref``'s shape (a select against ``ref`` when that shape
    has dynamic dims, which an Expand target cannot name)."""
    rd = dims(g, ref)
    if is_static(rd):
        return expand(g, a, rd)
    return where(g, scalar(g, True, DType.Bool), a, ref)


def broadcast_to(g, x, s: Shape) -> int:
    """Broadcast ``x`` (numpy rules) to the dims of ``s``."""
    return expand(g, x, s.dims)


def reduce_to(g, grad, s: Shape) -> int:
    """Unbroadcast: sum ``grad`` over the axes broadcasting added or stretched so it
    gets the dims of ``s`` (RLX's ``unbroadcast``)."""
    gs = shape(g, grad)
    if tuple(gs.dims) == tuple(s.dims):
        return grad
    extra = gs.rank - s.rank
    if extra < 0:
        # a scalar-like gradient for a bigger operand: broadcast it
        return expand(g, grad, s.dims)
    axes = list(range(extra))
    for i, d in enumerate(s.dims):
        gd = gs.dims[extra + i]
        if d == 1 and gd != 1:
            axes.append(extra + i)
    cur = grad
    if axes:
        cur = sum_(g, cur, axes, keep_dim=True)
    if tuple(dims(g, cur)) != tuple(s.dims):
        cur = reshape(g, cur, s.dims)
    return cur


def fit(g, grad, s: Shape) -> int:
    """Gradient ``grad`` made to match operand shape ``s``: unbroadcast and cast."""
    cur = reduce_to(g, grad, s)
    if dtype(g, cur) != s.dtype and is_float(s.dtype):
        # a complex cotangent for a real operand keeps its real part (JAX's convention)
        cur = cast(g, cur, s.dtype)
    return cur


def numel(ds):
    n = 1
    for d in ds:
        if not isinstance(d, int):
            return None
        n *= d
    return n


def norm_axis(a: int, rank: int) -> int:
    return a % rank if rank else a


def prune(g, keep_leaves=True, replace=None):
    """A copy of ``g`` without nodes its outputs do not need (Inputs / Params kept when
    ``keep_leaves``); ``replace`` maps node id -> (op, shape) substituted on the way."""
    replace = replace or {}
    need = set()
    stack = list(g.outputs)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        if n not in replace:
            stack.extend(g.node(n).inputs)
    out = type(g)(g.name)
    m = {}
    for n in g.nodes:
        leaf = type(n.op).__name__ in ("Input", "Param")
        if n.id in replace:
            if n.id in need:
                op, shape = replace[n.id]
                m[n.id] = out.add_node(op, (), shape)
            continue
        if n.id in need or (keep_leaves and leaf):
            m[n.id] = out.add_node(n.op, tuple(m[i] for i in n.inputs), n.shape, n.name)
    out.set_outputs([m[o] for o in g.outputs])
    return out
