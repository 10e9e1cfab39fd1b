"""Shape ops: Reshape, Transpose, Narrow, Concat, Expand, ResizeNearest2x.

(``Gather`` is a fused-op family and lowers in ``nn.py``.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .registry import lowering_rule


def _target(spec, out_shape, what):
    """A Reshape/Expand target: ``-1`` marks a dynamic dim, taken from the node's
    bound output shape."""
    dims = []
    for i, d in enumerate(spec):
        d = int(d)
        if d < 0:
            bound = out_shape[i] if out_shape is not None and i < len(out_shape) else None
            dims.append(-1 if bound is None else int(bound))
        else:
            dims.append(d)
    if dims.count(-1) > 1:
        raise ValueError(f"{what}: more than one unbound dynamic dim in {list(spec)}")
    return tuple(dims)


@lowering_rule(ir.Reshape)
def _reshape(op, args, ctx):
    # Row-major reshape; the one -1 (the op allows one) is inferred from the element count,
    # not taken from the node's bound shape: RLX's shape rule names a dynamic input's -1 by
    # the input's dynamic dim even where it is a multiple of it ([batch, 3] -> [-1] is
    # declared [batch] and holds 3 * batch elements)
    return jnp.reshape(args[0], tuple(int(d) for d in op.new_shape))


@lowering_rule(ir.Transpose)
def _transpose(op, args, ctx):
    return jnp.transpose(args[0], tuple(int(p) for p in op.perm))


def _axis(axis, rank):
    a = int(axis)
    return a + rank if a < 0 else a


@lowering_rule(ir.Narrow)
def _narrow(op, args, ctx):
    # x[..., start:start+len, ...] along `axis`.
    x = args[0]
    ax = _axis(op.axis, x.ndim)
    if op.start + op.len > x.shape[ax]:
        raise ValueError(
            f"Narrow start {op.start} + len {op.len} exceeds axis {ax} of size {x.shape[ax]}"
        )
    return lax.slice_in_dim(x, int(op.start), int(op.start) + int(op.len), axis=ax)


@lowering_rule(ir.Concat)
def _concat(op, args, ctx):
    # Variadic concatenation along `axis`.
    ax = _axis(op.axis, args[0].ndim)
    dt = ctx.out_dtype if ctx.out_dtype is not None else jnp.result_type(*args)
    return jnp.concatenate([a.astype(dt) for a in args], axis=ax)


@lowering_rule(ir.Expand)
def _expand(op, args, ctx):
    # numpy broadcast_to; -1 entries are dynamic dims (bound output shape).
    x = args[0]
    target = list(_target(op.target_shape, ctx.out_shape, "Expand"))
    # an unbound -1 keeps the operand's (right-aligned) dim
    off = len(target) - x.ndim
    for i, d in enumerate(target):
        if d == -1:
            target[i] = x.shape[i - off] if i - off >= 0 else 1
    return jnp.broadcast_to(x, tuple(target))


@lowering_rule(ir.ResizeNearest2x)
def _resize_nearest_2x(op, args, ctx):
    # NCHW nearest-neighbour 2x upsample: out[n, c, y, x] = in[n, c, y // 2, x // 2].
    x = args[0]
    return jnp.repeat(jnp.repeat(x, 2, axis=-2), 2, axis=-1)
