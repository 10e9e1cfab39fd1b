"""Prepare passes run before differentiation (RLX's ``prepare_graph_for_ad``):

* ``CustomFn`` without a ``vjp_body`` is inlined (its ``fwd_body`` spliced in);
* ``If`` becomes ``Where(pred, then, else)`` with both branches evaluated;
* ``While`` with ``max_iterations`` is unrolled (each step masked by "still running");
* fused ops are unfused into the primitives they stand for (the same composition
  their lowering uses);
* a ``Scan`` that keeps only its final carry is rewritten to save its trajectory
  (its last row is the final carry), so that its gradient can be read off the rows;
  its broadcast operands become per-step xs (RLX's ScanBackward has none);
* the decomposed splat pair ``GaussianSplatRasterize(GaussianSplatPrepare(scene...,
  meta), meta)`` becomes one ``GaussianSplatRender(scene..., meta)`` (the same image:
  Rasterize re-bins the per-Gaussian section Prepare writes), whose VJP is the fused
  backward kernel.

:func:`prepare` returns the new graph and the map old node id -> new node id.
"""

from __future__ import annotations

import numpy as np

from rlx_jax.ir import DType, Graph, GraphError, Shape
from rlx_jax.ir.op import ActivationKind, MaskKind
from rlx_jax.ir.ops_attention import Attention, Rope
from rlx_jax.ir.ops_control import body_inputs
from rlx_jax.ir.ops_leaf import Input, Param
from rlx_jax.ir.ops_norm import LayerNorm, RmsNorm
from rlx_jax.ir.ops_shape import Narrow

from . import emit as E
from .rules_linalg import matmul

_SPECIAL = ("primal_output", "d_output")


def inline(g, body, args, named=None) -> list:
    """Splice ``body`` into ``g``: its Inputs bind to ``args`` positionally (node order)
    except names in ``named``; its Params bind to ``g``'s Params of the same name.
    Returns the ids (in ``g``) of the body's outputs."""
    named = named or {}
    m = {}
    pos = 0
    for n in body.nodes:
        if isinstance(n.op, Input):
            if n.op.name in named:
                m[n.id] = named[n.op.name]
            else:
                if pos >= len(args):
                    raise GraphError(f"body {body.name!r}: more Inputs than arguments")
                m[n.id] = args[pos]
                pos += 1
        elif isinstance(n.op, Param):
            pid = g.leaf_id(n.op.name)
            m[n.id] = pid if pid is not None else g.add_node(n.op, (), n.shape, n.name)
        else:
            m[n.id] = g.add_node(n.op, tuple(m[i] for i in n.inputs), n.shape)
    return [m[o] for o in body.outputs]


def _land(g, a, b):
    return E.where(g, a, b, E.scalar(g, False, DType.Bool))


# -- fused ops ------------------------------------------------------------------------

def _fused_matmul_bias_act(g, op, ins):
    x, w, b = ins
    y = E.add(g, matmul(g, x, w), b)
    return y if op.activation is None else E.act(g, op.activation, y)


def _residual(g, op, ins):
    if op.has_bias:
        return E.add(g, E.add(g, ins[0], ins[1]), ins[2]), ins[3], ins[4]
    return E.add(g, ins[0], ins[1]), ins[2], ins[3]


def _fused_residual_ln(g, op, ins):
    h, gamma, beta = _residual(g, op, ins)
    return g.add_node(LayerNorm(axis=E.shape(g, h).rank - 1, eps=op.eps), (h, gamma, beta))


def _fused_residual_rms(g, op, ins):
    h, gamma, beta = _residual(g, op, ins)
    return g.add_node(RmsNorm(axis=E.shape(g, h).rank - 1, eps=op.eps), (h, gamma, beta))


def _fused_swiglu(g, op, ins):
    (x,) = ins
    r = E.shape(g, x).rank
    n = E.dims(g, x)[-1] // 2
    lo = g.add_node(Narrow(axis=r - 1, start=0, len=n), (x,))
    hi = g.add_node(Narrow(axis=r - 1, start=n, len=n), (x,))
    up, gate = (hi, lo) if op.gate_first else (lo, hi)
    y = E.mul(g, E.act(g, ActivationKind.Silu, gate), up)
    return y if op.cast_to is None else E.cast(g, y, op.cast_to)


def _keep_mask(g, mask, b, s):
    """RLX's Custom keep-mask as [B, S]: the first B * S elements of ``mask`` (row-major),
    the prefix RLX's kernels read (``lowering.fused.keep_mask``)."""
    if tuple(E.dims(g, mask)) == (b, s):
        return mask
    flat = E.reshape(g, mask, (E.numel(E.dims(g, mask)),))
    return E.reshape(g, g.add_node(Narrow(axis=0, start=0, len=b * s), (flat,)), (b, s))


def attention_block(g, hidden, qkv_w, out_w, mask, qkv_b, out_b, cos, sin, nh, hd):
    b, s, _ = E.dims(g, hidden)
    qkv = matmul(g, hidden, qkv_w)
    if qkv_b is not None:
        qkv = E.add(g, qkv, qkv_b)
    w = nh * hd
    parts = [g.add_node(Narrow(axis=2, start=i * w, len=w), (qkv,)) for i in range(3)]
    if cos is not None:
        for i in (0, 1):
            t = E.transpose(g, E.reshape(g, parts[i], (b, s, nh, hd)), (0, 2, 1, 3))
            t = g.add_node(Rope(head_dim=hd, n_rot=hd), (t, cos, sin))
            parts[i] = E.reshape(g, E.transpose(g, t, (0, 2, 1, 3)), (b, s, w))
    o = g.add_node(Attention(num_heads=nh, head_dim=hd, mask_kind=MaskKind("Custom"), score_scale=None,
                              attn_logit_softcap=None), (parts[0], parts[1], parts[2], _keep_mask(g, mask, b, s)))
    y = matmul(g, o, out_w)
    return y if out_b is None else E.add(g, y, out_b)


def _fused_attention_block(g, op, ins):
    hidden, qkv_w, out_w, mask = ins[:4]
    i = 4
    qkv_b = out_b = cos = sin = None
    if op.has_bias:
        qkv_b, out_b = ins[i], ins[i + 1]
        i += 2
    if op.has_rope:
        cos, sin = ins[i], ins[i + 1]
    return attention_block(g, hidden, qkv_w, out_w, mask, qkv_b, out_b, cos, sin, op.num_heads, op.head_dim)


def _fused_transformer_layer(g, op, ins):
    names_bias = ["hidden", "qkv_w", "qkv_b", "out_w", "out_b", "ln1_g", "ln1_b", "fc1_w",
                  "fc1_b", "fc2_w", "fc2_b", "ln2_g", "ln2_b", "mask"]
    names_10 = ["hidden", "qkv_w", "out_w", "ln1_g", "ln1_b", "fc1_w", "fc2_w", "ln2_g", "ln2_b", "mask"]
    names_8 = ["hidden", "qkv_w", "out_w", "ln1_g", "fc1_w", "fc2_w", "ln2_g", "mask"]
    names = names_bias if op.has_bias else (names_10 if len(ins) == 10 else names_8)
    p = dict(zip(names, ins))
    x = p["hidden"]
    xs = E.shape(g, x)
    axis = xs.rank - 1

    def beta(name):
        if p.get(name) is not None:
            return p[name]
        return E.zeros(g, Shape((xs.dims[-1],), xs.dtype))

    attn = attention_block(g, x, p["qkv_w"], p["out_w"], p["mask"], p.get("qkv_b"), p.get("out_b"),
                           None, None, op.num_heads, op.head_dim)
    h1 = g.add_node(LayerNorm(axis=axis, eps=op.eps1), (E.add(g, attn, x), p["ln1_g"], beta("ln1_b")))
    f = matmul(g, h1, p["fc1_w"])
    if p.get("fc1_b") is not None:
        f = E.add(g, f, p["fc1_b"])
    f = matmul(g, E.act(g, op.activation, f), p["fc2_w"])
    if p.get("fc2_b") is not None:
        f = E.add(g, f, p["fc2_b"])
    return g.add_node(LayerNorm(axis=axis, eps=op.eps2), (E.add(g, f, h1), p["ln2_g"], beta("ln2_b")))


UNFUSE = {
    "FusedMatMulBiasAct": _fused_matmul_bias_act,
    "FusedResidualLN": _fused_residual_ln,
    "FusedResidualRmsNorm": _fused_residual_rms,
    "FusedSwiGLU": _fused_swiglu,
    "FusedAttentionBlock": _fused_attention_block,
    "FusedTransformerLayer": _fused_transformer_layer,
}


# -- the pass ---------------------------------------------------------------------------

def _all_true(g, c):
    """Bool tensor -> Bool scalar: every element true (RLX's While condition)."""
    n = E.numel(E.dims(g, c))
    if n == 1:
        return E.reshape(g, c, ())
    from rlx_jax.ir.op import ReduceOp

    as_f = E.cast(g, c, DType.F32)
    low = E.reduce(g, as_f, ReduceOp.Min, tuple(range(len(E.dims(g, c)))))
    return E.reshape(g, E.cmp(g, "Ne", low, E.scalar(g, 0, DType.F32)), ())


def _while(g, node, ins):
    op = node.op
    if op.max_iterations is None:
        raise GraphError(f"node %{node.id} While: reverse mode needs max_iterations to unroll the loop")
    vals = list(ins)
    running = E.scalar(g, True, DType.Bool)
    for _ in range(int(op.max_iterations)):
        (c,) = inline(g, op.cond, vals)
        c = E.cmp(g, "Ne", c, E.scalar(g, 0, E.dtype(g, c))) if E.dtype(g, c) != DType.Bool else c
        c = _all_true(g, c)
        running = _land(g, running, c)
        nxt = inline(g, op.body, vals)
        vals = [E.where(g, running, n, v) for n, v in zip(nxt, vals)]
        vals = [E.cast(g, v, E.dtype(g, ins[k])) for k, v in enumerate(vals)]
    return vals[0]


def _scan(g, node, ins):
    from rlx_jax.ir.ops_control import Scan

    op = node.op
    nb = op.num_bcast
    if nb:
        # broadcast operands become per-step xs (the body sees the same Inputs in the same
        # order); their gradient is the sum over steps (the Expand's VJP)
        bc = [E.expand(g, E.reshape(g, b, (1,) + E.dims(g, b)), (op.length,) + E.dims(g, b))
              for b in ins[1:1 + nb]]
        ins = [ins[0], *bc, *ins[1 + nb:]]
    if op.save_trajectory and not nb:
        return g.add_node(op, tuple(ins), node.shape)
    if op.save_trajectory:
        return g.add_node(Scan(body=op.body, length=op.length, save_trajectory=True, num_bcast=0,
                                num_xs=nb + op.num_xs, num_checkpoints=op.num_checkpoints), tuple(ins))
    traj_op = Scan(body=op.body, length=op.length, save_trajectory=True, num_bcast=0,
                   num_xs=nb + op.num_xs, num_checkpoints=0)
    traj = g.add_node(traj_op, tuple(ins))
    if op.length == 0:
        return ins[0]
    last = g.add_node(Narrow(axis=0, start=op.length - 1, len=1), (traj,))
    return E.reshape(g, last, node.shape.dims)


def _unroll_scan(g, node, ins):
    """A Scan spelled out step by step (forward mode needs no ScanBackward)."""
    op = node.op
    nb = op.num_bcast
    carry, bc, xs = ins[0], ins[1:1 + nb], ins[1 + nb:]
    rows = []
    for t in range(op.length):
        x_t = []
        for x in xs:
            ds = E.dims(g, x)
            x_t.append(E.reshape(g, g.add_node(Narrow(axis=0, start=t, len=1), (x,)), tuple(ds[1:])))
        (carry,) = inline(g, op.body, [carry, *bc, *x_t])
        carry = E.cast(g, carry, E.dtype(g, ins[0]))
        if op.save_trajectory:
            rows.append(E.reshape(g, carry, (1,) + tuple(E.dims(g, ins[0]))))
    if not op.save_trajectory:
        return carry
    if op.num_checkpoints and op.num_checkpoints < op.length:
        rows = [rows[t * op.length // op.num_checkpoints] for t in range(op.num_checkpoints)]
    if not rows:
        return E.zeros(g, node.shape)
    from rlx_jax.ir.ops_shape import Concat

    return rows[0] if len(rows) == 1 else g.add_node(Concat(axis=0), tuple(rows))


def prepare(graph, unroll_scans: bool = False):
    """(prepared graph, old id -> new id). ``unroll_scans`` spells scans out step by
    step (used by forward mode) instead of rewriting them to save their trajectory."""
    g = Graph(graph.name)
    m = {}
    for n in graph.nodes:
        name = type(n.op).__name__
        ins = [m[i] for i in n.inputs]
        if name == "CustomFn" and n.op.vjp_body is None:
            (out,) = inline(g, n.op.fwd_body, ins)
            m[n.id] = _prep_body_result(g, out, n)
        elif name == "If":
            (t,) = inline(g, n.op.then_branch, ins[1:])
            (e,) = inline(g, n.op.else_branch, ins[1:])
            pred = ins[0]
            if E.dtype(g, pred) != DType.Bool:
                pred = E.cmp(g, "Ne", pred, E.scalar(g, 0, E.dtype(g, pred)))
            pred = E.reshape(g, pred, ())
            m[n.id] = E.where(g, pred, t, e)
        elif name == "While":
            m[n.id] = _while(g, n, ins)
        elif name in UNFUSE:
            m[n.id] = _prep_body_result(g, UNFUSE[name](g, n.op, ins), n)
        elif name == "Scan":
            m[n.id] = _unroll_scan(g, n, ins) if unroll_scans else _scan(g, n, ins)
        elif name == "GaussianSplatRasterize":
            m[n.id] = _fuse_splat(graph, g, n, m)
        else:
            m[n.id] = g.add_node(n.op, tuple(ins), n.shape, n.name)
    g.set_outputs([m[o] for o in graph.outputs])
    return g, m


_SPLAT_RENDER_FIELDS = ("width", "height", "tile_size", "alpha_cutoff", "max_splat_steps",
                        "transmittance_threshold", "max_list_entries")


def _fuse_splat(graph, g, n, m):
    """GaussianSplatRasterize over a GaussianSplatPrepare -> GaussianSplatRender.

    The render takes the camera from Prepare's meta and the background from
    Rasterize's, so both must be the same node; the compositing attributes come from
    Rasterize (Prepare's must agree, else its buffer would not fit), radius_scale
    from Prepare."""
    from rlx_jax.ir.ops_splat import GaussianSplatRender

    prep = graph.node(n.inputs[0])
    if type(prep.op).__name__ != "GaussianSplatPrepare":
        raise GraphError(f"node %{n.id} GaussianSplatRasterize: autodiff fuses it with the GaussianSplatPrepare "
                         f"that feeds it, but its input %{prep.id} is {type(prep.op).__name__}")
    if prep.inputs[6] != n.inputs[1]:
        raise GraphError(f"node %{n.id} GaussianSplatRasterize: its meta %{n.inputs[1]} differs from its "
                         f"GaussianSplatPrepare's meta %{prep.inputs[6]}; the fused render has one meta")
    for f in _SPLAT_RENDER_FIELDS:
        if getattr(prep.op, f) != getattr(n.op, f):
            raise GraphError(f"node %{n.id} GaussianSplatRasterize: {f}={getattr(n.op, f)!r} differs from its "
                             f"GaussianSplatPrepare's {getattr(prep.op, f)!r}")
    op = GaussianSplatRender(radius_scale=prep.op.radius_scale, **{f: getattr(n.op, f) for f in _SPLAT_RENDER_FIELDS})
    out = g.add_node(op, tuple(m[i] for i in prep.inputs))
    return _prep_body_result(g, out, n)


def _prep_body_result(g, out, n):
    s = E.shape(g, out)
    if s.dtype != n.shape.dtype:
        out = E.cast(g, out, n.shape.dtype)
    if tuple(s.dims) != tuple(n.shape.dims):
        out = E.reshape(g, out, n.shape.dims)
    return out


def needs_prepare(graph) -> bool:
    return any(type(n.op).__name__ in ("CustomFn", "If", "While", "Scan", "GaussianSplatRasterize", *UNFUSE)
               for n in graph.nodes)
