"""Graph VJP rules: MatMul, DotGeneral, dense solves, LoRA, grouped (MoE) matmul,
ScatterAdd."""

from __future__ import annotations

from rlx_jax.ir import DType, Shape
from rlx_jax.ir.ops_linalg import (
    BatchedDenseSolve, DenseSolve, DotGeneral, GroupedMatMul, MatMul, ScatterAdd,
)
from rlx_jax.ir.ops_shape import Gather
from rlx_jax import ir

from . import emit as E
from .table import vjp_rule


def matmul(g, a, b):
    return g.add_node(MatMul(), (a, b))


def t_last(g, x):
    r = E.shape(g, x).rank
    return E.transpose(g, x, tuple(range(r - 2)) + (r - 1, r - 2))


@vjp_rule(ir.MatMul)
def _matmul(g, node, dy):
    a, b = node.inputs
    return [matmul(g, dy, t_last(g, b)), matmul(g, t_last(g, a), dy)]


def _dot_transpose(g, dy, other, nb, self_batch, self_contract, other_batch, other_contract,
                   self_rank, other_rank, free_pos, free_count):
    """Cotangent of one dot_general operand (``self``) from ``dy`` and the other one.

    ``dy`` dims: [batch (nb), lhs free..., rhs free...]; ``free_pos`` is where the
    other operand's free dims start in dy and ``free_count`` how many."""
    other_free = [i for i in range(other_rank) if i not in other_batch and i not in other_contract]
    dy_free = list(range(free_pos, free_pos + free_count))
    res = g.add_node(DotGeneral(lhs_contracting=tuple(dy_free), rhs_contracting=tuple(other_free),
                                lhs_batch=tuple(range(nb)), rhs_batch=tuple(other_batch)), (dy, other))
    # result dims: batch, dy's remaining (self free) dims, other's contracting dims
    # (ascending in other) -> self dims
    self_free = [i for i in range(self_rank) if i not in self_batch and i not in self_contract]
    src = list(self_batch) + self_free
    for j in sorted(other_contract):
        src.append(self_contract[list(other_contract).index(j)])
    perm = tuple(src.index(k) for k in range(self_rank))
    return E.transpose(g, res, perm)


@vjp_rule(ir.DotGeneral)
def _dot_general(g, node, dy):
    a, b = node.inputs
    op = node.op
    ra, rb = E.shape(g, a).rank, E.shape(g, b).rank
    nb = len(op.lhs_batch)
    nfa = ra - nb - len(op.lhs_contracting)
    nfb = rb - nb - len(op.rhs_contracting)
    da = _dot_transpose(g, dy, b, nb, op.lhs_batch, op.lhs_contracting, op.rhs_batch, op.rhs_contracting,
                        ra, rb, nb + nfa, nfb)
    # for rhs: dy's self-free dims come after lhs free ones; contract dy's lhs-free dims
    db_res = g.add_node(DotGeneral(
        lhs_contracting=tuple(range(nb, nb + nfa)),
        rhs_contracting=tuple(i for i in range(ra) if i not in op.lhs_batch and i not in op.lhs_contracting),
        lhs_batch=tuple(range(nb)), rhs_batch=tuple(op.lhs_batch)), (dy, a))
    b_free = [i for i in range(rb) if i not in op.rhs_batch and i not in op.rhs_contracting]
    src = list(op.rhs_batch) + b_free
    for j in sorted(op.lhs_contracting):
        src.append(op.rhs_contracting[list(op.lhs_contracting).index(j)])
    db = E.transpose(g, db_res, tuple(src.index(k) for k in range(rb)))
    return [da, db]


@vjp_rule(ir.DenseSolve)
def _dense_solve(g, node, dy):
    a, b = node.inputs
    x = node.id
    db = g.add_node(DenseSolve(), (E.transpose(g, a, (1, 0)), dy))
    if E.shape(g, b).rank == 1:
        n = E.dims(g, b)[0]
        da = matmul(g, E.reshape(g, db, (n, 1)), E.reshape(g, x, (1, n)))
    else:
        da = matmul(g, db, E.transpose(g, x, (1, 0)))
    return [E.neg(g, da), db]


@vjp_rule(ir.BatchedDenseSolve)
def _batched_dense_solve(g, node, dy):
    a, b = node.inputs
    x = node.id
    db = g.add_node(BatchedDenseSolve(), (E.transpose(g, a, (0, 2, 1)), dy))
    if E.shape(g, b).rank == 2:
        bb, n = E.dims(g, b)
        da = matmul(g, E.reshape(g, db, (bb, n, 1)), E.reshape(g, x, (bb, 1, n)))
    else:
        da = matmul(g, db, E.transpose(g, x, (0, 2, 1)))
    return [E.neg(g, da), db]


@vjp_rule(ir.LoraMatMul)
def _lora(g, node, dy):
    """y = x W + s (x A) B, on x viewed as rows [M, K]."""
    x, w, a, b = node.inputs
    s = float(node.op.scale)
    k = E.dims(g, x)[-1]
    n = E.dims(g, w)[1]
    x2 = E.reshape(g, x, (-1, k)) if E.shape(g, x).rank != 2 else x
    d2 = E.reshape(g, dy, (-1, n)) if E.shape(g, dy).rank != 2 else dy
    d2bt = matmul(g, d2, t_last_2(g, b))                                   # [M, R]
    dx2 = E.add(g, matmul(g, d2, t_last_2(g, w)), E.mul_s(g, matmul(g, d2bt, t_last_2(g, a)), s))
    dx = E.reshape(g, dx2, E.dims(g, x))
    xt = E.transpose(g, x2, (1, 0))
    dw = matmul(g, xt, d2)
    da = E.mul_s(g, matmul(g, xt, d2bt), s)
    xa = matmul(g, x2, a)
    db = E.mul_s(g, matmul(g, E.transpose(g, xa, (1, 0)), d2), s)
    return [dx, dw, da, db]


def t_last_2(g, m):
    return E.transpose(g, m, (1, 0))


@vjp_rule(ir.GroupedMatMul)
def _grouped(g, node, dy):
    x, w, idx = node.inputs
    m, k = E.dims(g, x)
    e, _, n = E.dims(g, w)
    dx = g.add_node(GroupedMatMul(), (dy, E.transpose(g, w, (0, 2, 1)), idx))
    outer = matmul(g, E.reshape(g, x, (m, k, 1)), E.reshape(g, dy, (m, 1, n)))
    # a token whose expert id is past the last expert takes no part in the forward
    # product (it falls outside every group); ScatterAdd would clamp it onto expert e - 1
    dt = E.dtype(g, outer)
    live = E.cmp(g, "Lt", E.index_ids(g, idx, e), E.scalar(g, e, DType.I32))
    outer = E.mul(g, outer, E.reshape(g, E.cast(g, live, dt), (m, 1, 1)))
    dw = g.add_node(ScatterAdd(), (outer, idx), Shape((e, k, n), E.dtype(g, w)))
    return [dx, dw, None]


@vjp_rule(ir.ScatterAdd)
def _scatter_add(g, node, dy):
    upd, idx = node.inputs
    return [g.add_node(Gather(axis=0), (dy, idx)), None]


# -- weight-only quantised matmuls ------------------------------------------------------
#
# y = x @ W with W = dequant(w_q, scale, zp) [K, N]. As in RLX, only x gets a gradient:
# dx = dy @ W^T. The quantised weights (integer / packed bytes) carry none, and the
# dequantisation parameters get none either (RLX gives them zeros; here they are "no
# gradient", so STRICT names them and TRAINING zero-fills them).

def dequant_weight_node(g, node, k: int, n: int):
    """W [K, N] (f32) of a DequantMatMul node, as a graph node.

    GGUF schemes: ``DequantMoEWeights`` of the packed slab viewed as one expert. The
    other schemes have no dequantisation op in RLX, so W is read off the op itself:
    ``DequantMatMul(I_K, w_q, scale, zp)`` (the identity's rows pick W's rows; each
    output is one product with 1.0, so W comes out exactly; costs K*K*N multiply-adds,
    once per backward)."""
    import numpy as np

    from rlx_jax.ir import DType
    from rlx_jax.ir.ops_quant import DequantMatMul, DequantMoEWeights

    op = node.op
    if op.scheme.is_gguf:
        w3 = g.add_node(DequantMoEWeights(scheme=op.scheme), (node.inputs[1],), Shape((1, k, n), DType.F32))
        return E.reshape(g, w3, (k, n))
    eye = E.const(g, np.eye(k, dtype=np.float32), DType.F32)
    return g.add_node(DequantMatMul(scheme=op.scheme), (eye,) + tuple(node.inputs[1:]), Shape((k, n), DType.F32))


def _static_kn(node, x_dims, what):
    from rlx_jax.ir import GraphError

    k, n = x_dims[-1], node.shape.dims[-1]
    if not isinstance(k, int) or not isinstance(n, int):
        raise GraphError(f"node %{node.id} {what}: reverse mode needs static K and N (got K={k}, N={n})")
    return k, n


@vjp_rule(ir.DequantMatMul)
def _dequant_matmul(g, node, dy):
    x = node.inputs[0]
    xd = E.dims(g, x)
    k, n = _static_kn(node, xd, "DequantMatMul")
    w = E.cast(g, dequant_weight_node(g, node, k, n), E.dtype(g, dy))
    wt = t_last_2(g, w)                                                   # [N, K]
    if len(xd) == 1:
        dx = E.reshape(g, matmul(g, E.reshape(g, dy, (1, n)), wt), (k,))
    else:
        dx = matmul(g, dy, wt)
    return [dx] + [None] * (len(node.inputs) - 1)


@vjp_rule(ir.DequantGroupedMatMul)
def _dequant_grouped(g, node, dy):
    """dx[i] = dy[i] @ W[e_i]^T with W = DequantMoEWeights(packed) [E, K, N] (RLX's rule)."""
    from rlx_jax.ir import DType, GraphError
    from rlx_jax.ir.op import GGUF_BLOCKS
    from rlx_jax.ir.ops_quant import DequantMoEWeights

    x, packed, idx = node.inputs
    op = node.op
    k, n = _static_kn(node, E.dims(g, x), "DequantGroupedMatMul")
    if not op.scheme.is_gguf:
        raise GraphError(f"node %{node.id} DequantGroupedMatMul: scheme {op.scheme.kind} is not a GGUF scheme")
    elems, nbytes = GGUF_BLOCKS[op.scheme.kind]
    total = E.numel(E.dims(g, packed))
    slab = (k * n) // elems * nbytes
    if total is None or slab == 0 or total % slab:
        raise GraphError(f"node %{node.id} DequantGroupedMatMul: packed weight of {total} bytes is not a whole "
                         f"number of {slab}-byte [{k}, {n}] expert slabs")
    w = g.add_node(DequantMoEWeights(scheme=op.scheme), (packed,), Shape((total // slab, k, n), DType.F32))
    w = E.cast(g, w, E.dtype(g, dy))
    dx = g.add_node(GroupedMatMul(), (dy, E.transpose(g, w, (0, 2, 1)), idx))
    return [dx, None, None]
