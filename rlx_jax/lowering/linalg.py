"""Linear algebra: MatMul, DotGeneral, DenseSolve, BatchedDenseSolve, LoraMatMul.

Plain ``jax.numpy``/``lax`` (XLA's dots are the kernels); each rule states RLX's
semantics. A MatMul of a SwiGLU product lowers to ``ops.swiglu_linear``; the MatMuls that
read an RmsNorm's output lower together to one ``ops.rms_norm_linear``, and when some of
their products are read only by Rope nodes sharing tables (a block's q and k), to one
product over the packed weights split and rotated by ``ops.rope_split``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .registry import lowering_rule


def matmul(a, b):
    """RLX MatMul: ``[..., M, K] x [..., K, N] -> [..., M, N]`` with the batch dims
    broadcast (numpy ``matmul``; a rank-1 operand is a vector)."""
    return jnp.matmul(a, b)


def _left_source(ctx):
    """The graph node of the node's first operand (a MatMul's left one); None when the
    lowering has no graph."""
    if ctx.graph is None or ctx.node is None:
        return None
    return ctx.graph.node(ctx.node.inputs[0])


def _swiglu_linear_operands(args, ctx):
    """(gate, up) when this MatMul's left operand is a SwiGLU product
    (``elementwise.swiglu_operands``) and its right one a [F, O] weight of the product's
    dtype, else None. Such a MatMul lowers to ``ops.swiglu_linear``, whose reverse mode
    keeps gate and up but not the product (the transformer MLP's down projection)."""
    src = _left_source(ctx)
    if src is None:
        return None
    from .elementwise import swiglu_operands

    h, w = args
    src_args = [ctx.env.get(i) for i in src.inputs]
    if any(a is None for a in src_args):
        return None
    gated = swiglu_operands(ctx, src, src_args)
    if (gated is None or h.ndim < 1 or w.ndim != 2 or w.shape[0] != h.shape[-1] or w.dtype != h.dtype
            or gated[0].dtype != h.dtype):
        return None
    return gated


def _users(ctx) -> dict:
    """node id -> ids of the nodes that take it as an input, graph outputs counted as a
    user (-1); built once per lowering."""
    def build():
        users: dict = {}
        for node in ctx.graph.nodes:
            for i in node.inputs:
                users.setdefault(i, []).append(node.id)
        for o in ctx.graph.outputs:
            users.setdefault(o, []).append(-1)
        return users
    return ctx.memo(("users", id(ctx.graph)), build)


def _norm_projection_weights(src, ctx):
    """{MatMul id: [H, O] weight} when every user of the RmsNorm node ``src`` (normalised
    over its last axis) is a MatMul taking it as the left operand and a 2-D Param [H, O]
    as the right one, else None. Weights whose Param node comes later in the graph (a
    block's k and v after q) are read from the params."""
    from .core import _bind, _op_name

    rank = len(ctx.graph.node(src.inputs[0]).shape.dims)
    if rank < 1 or src.op.axis not in (-1, rank - 1):
        return None
    weights = {}
    for uid in _users(ctx).get(src.id, ()):
        if uid < 0:
            return None
        user = ctx.graph.node(uid)
        if not isinstance(user.op, ir.MatMul) or user.inputs[0] != src.id or user.inputs[1] == src.id:
            return None
        wnode = ctx.graph.node(user.inputs[1])
        if _op_name(wnode.op) != "Param" or len(wnode.shape.dims) != 2:
            return None
        w = ctx.env.get(wnode.id)
        if w is None:
            name = wnode.op.name
            if name not in ctx.params:  # reported where the Param node is bound
                return None
            w = _bind(wnode, f"param {name!r}", ctx.params[name], ctx.dims, ctx.dtype_map)
        weights[uid] = w
    return weights


def _projection_ropes(weights, ctx) -> dict:
    """{MatMul id: Rope node} for the projections in ``weights`` whose product's one user is a
    Rope node rotating it (a block's q and k), when those Rope nodes share their tables (the
    same cos / sin nodes, already lowered), head_dim and n_rot, every weight's width is a
    whole number of heads and there are at most ``rope_split``'s 8 parts; else {}."""
    from rlx_jax.vjp_rules.rope import MAX_SPLIT_PARTS

    users = _users(ctx)
    ropes = {}
    for uid in weights:
        (only, *more) = users.get(uid, (-1,))
        if not more and only >= 0:
            node = ctx.graph.node(only)
            if isinstance(node.op, ir.Rope) and node.inputs[0] == uid:
                ropes[uid] = node
    if not ropes:
        return {}
    key = lambda r: (tuple(r.inputs[1:3]), int(r.op.head_dim), int(r.op.n_rot))  # noqa: E731
    first = next(iter(ropes.values()))
    hd = int(first.op.head_dim)
    if (any(key(r) != key(first) for r in ropes.values()) or hd <= 0 or len(weights) > MAX_SPLIT_PARTS
            or any(w.shape[1] % hd for w in weights.values()) or any(ctx.env.get(i) is None for i in first.inputs[1:3])):
        return {}
    return ropes


def _norm_linear_products(src, y, ctx):
    """({MatMul id: product}, {Rope id: rotated product}) for the users of the RmsNorm node
    ``src`` (output ``y``) through one ``ops.rms_norm_linear``, when they are all
    projections (``_norm_projection_weights``) and the norm's input (shaped as y: not the
    row-flattened output), parameters and weights are in y's dtype (so that the op's dtype
    promotion is the graph's); else None. Reverse mode then keeps the norm's input, not its
    output, and runs the norm's backward once for the summed input gradient.

    When some products feed Rope nodes only (``_projection_ropes``), the op takes one product
    over the packed weights and ``ops.rope_split`` reads it into the products, the rotated
    ones for those Rope nodes: no slices of XLA's merged q / k / v product in the forward, no
    concatenation of their gradients in the backward. The MatMul nodes of the rotated parts
    then get the unrotated slice, which their Rope node, their one user, does not read."""
    weights = _norm_projection_weights(src, ctx)
    if weights is None:
        return None
    x, gamma, *beta = (ctx.env.get(i) for i in src.inputs)
    beta = beta[0] if beta else None
    operands = [a for a in (x, gamma, beta, *weights.values()) if a is not None]
    if x.shape != y.shape or any(a.dtype != y.dtype for a in operands):
        return None
    from .nn import fused

    ropes = _projection_ropes(weights, ctx)
    if not ropes:
        outs = fused("rms_norm_linear")(x, gamma, list(weights.values()), beta, eps=float(src.op.eps))
        return dict(zip(weights, outs)), {}
    packed = fused("rms_norm_linear")(x, gamma, jnp.concatenate(list(weights.values()), axis=1), beta,
                                      eps=float(src.op.eps))
    rope = next(iter(ropes.values()))
    hd = int(rope.op.head_dim)
    cos, sin = (ctx.env[i] for i in rope.inputs[1:3])
    parts = fused("rope_split")(packed, cos, sin, [w.shape[1] // hd for w in weights.values()],
                                rotate=[uid in ropes for uid in weights], head_dim=hd, n_rot=int(rope.op.n_rot))
    products, rotated, start = {}, {}, 0
    for (uid, w), part in zip(weights.items(), parts):
        if uid in ropes:
            rotated[ropes[uid].id] = part
            part = packed[..., start:start + w.shape[1]]
        products[uid] = part
        start += w.shape[1]
    return products, rotated


def _norm_linear_product(args, ctx):
    """This MatMul's product when its left operand is an RmsNorm lowered with its users
    (``_norm_linear_products``), else None: the first of them computes every product (a
    block's q / k / v, or gate / up), the others take theirs from the lowering's cache."""
    src = _left_source(ctx)
    if src is None or not isinstance(src.op, ir.RmsNorm):
        return None
    lowered = ctx.memo(("rms_norm_linear", src.id), lambda: _norm_linear_products(src, args[0], ctx))
    return None if lowered is None else lowered[0][ctx.node.id]


def split_rope_part(ctx):
    """For a Rope node: its rotated product when its input is a projection lowered through
    ``ops.rope_split`` with the other products of its RmsNorm (``_norm_linear_products``),
    else None."""
    matmul_node = _left_source(ctx)  # the Rope's x
    if matmul_node is None or not isinstance(matmul_node.op, ir.MatMul):
        return None
    lowered = ctx.cache.get(("rms_norm_linear", matmul_node.inputs[0]))
    return None if lowered is None else lowered[1].get(ctx.node.id)


@lowering_rule(ir.MatMul)
def _matmul(op, args, ctx):
    gated = _swiglu_linear_operands(args, ctx)
    if gated is not None:
        from .nn import fused

        return ctx.cast_out(fused("swiglu_linear")(*gated, args[1]))
    product = _norm_linear_product(args, ctx)
    if product is not None:
        return ctx.cast_out(product)
    return ctx.cast_out(matmul(args[0], args[1]))


@lowering_rule(ir.DotGeneral)
def _dot_general(op, args, ctx):
    # XLA DotGeneral: output dims are batch, then lhs free, then rhs free.
    lhs, rhs = args
    dims = ((tuple(op.lhs_contracting), tuple(op.rhs_contracting)),
            (tuple(op.lhs_batch), tuple(op.rhs_batch)))
    out = lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.result_type(lhs, rhs))
    return ctx.cast_out(out)


def _solve(a, b):
    # x = A^{-1} b with b [.., N] (one right-hand side) or [.., N, K].
    if b.ndim == a.ndim - 1:
        return jnp.linalg.solve(a, b[..., None])[..., 0]
    return jnp.linalg.solve(a, b)


@lowering_rule(ir.DenseSolve)
def _dense_solve(op, args, ctx):
    # DenseSolve [A [N, N], b [N] or [N, K]] -> x with A x = b (LU, partial pivoting).
    return ctx.cast_out(_solve(args[0], args[1]))


@lowering_rule(ir.BatchedDenseSolve)
def _batched_dense_solve(op, args, ctx):
    # BatchedDenseSolve [A [B, N, N], b [B, N] or [B, N, K]]: one solve per batch item.
    return ctx.cast_out(_solve(args[0], args[1]))


def lora_matmul(x, w, a, b, scale):
    """RLX LoraMatMul: ``x @ w + scale * (x @ a) @ b`` (the rank-r path never forms
    ``a @ b``)."""
    return matmul(x, w) + scale * matmul(matmul(x, a), b)


@lowering_rule(ir.LoraMatMul)
def _lora_matmul(op, args, ctx):
    x, w, a, b = args
    return ctx.cast_out(lora_matmul(x, w, a, b, op.scale))
