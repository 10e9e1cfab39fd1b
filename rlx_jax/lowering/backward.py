"""RLX backward ops, lowered to the ``<family>_backward`` wrappers of
``rlx_jax.vjp_rules.<family>`` (the same backward primitive the fused ops' custom VJPs
transpose to, so a graph gradient and ``jax.grad`` run the same kernel).

Sibling nodes (dx / dgamma / dbeta of one norm, dq / dk / dv of one attention) lower to
one wrapper call: the result is memoised in the lowering context under a key holding the
family, every input id and every attribute the result depends on (``sibling_key``).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp

from rlx_jax import ir

from .nn import _to_bshd, attention_kwargs, attention_layout, class_labels, index_array
from .registry import enum_name, lowering_rule


def backward_fn(family: str, name: str | None = None):
    """``rlx_jax.vjp_rules.<family>.<name or family_backward>``: the wrapper the family's
    transpose rule calls too (imported at call time, so the IR imports stay light)."""
    return getattr(importlib.import_module(f"rlx_jax.vjp_rules.{family}"), name or f"{family}_backward")


def _hashable(value):
    """``value`` when it can key a dict, else its identity (sub-graph fields)."""
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def op_attr_key(op, skip=()) -> tuple:
    """Every attribute of ``op`` except those in ``skip`` (the field that tells sibling
    nodes apart, e.g. ``wrt``), as a hashable tuple: part of every memo key, so two
    nodes share a result only when every attribute the result depends on agrees."""
    return tuple((f.name, _hashable(getattr(op, f.name)))
                 for f in dataclasses.fields(op) if f.name not in skip)


def sibling_key(family: str, op, ctx, skip=()) -> tuple:
    """Memo key of a node whose siblings read the same inputs: the family, every input
    id and every attribute (but ``skip``)."""
    return (family, ctx.node_input_ids(), op_attr_key(op, skip))


# ---- RMSNorm -------------------------------------------------------------------------------

def _rms_all(op, args, ctx):
    x, gamma, beta, dy = args
    return ctx.memo(sibling_key("rms_norm", op, ctx),
                    lambda: backward_fn("rms_norm")(x, gamma, beta, dy, axis=int(op.axis),
                                                    eps=float(op.eps)))


@lowering_rule(ir.RmsNormBackwardInput)
def _rms_norm_backward_input(op, args, ctx):
    # [x, gamma, beta, dy] -> dx
    return ctx.cast_out(_rms_all(op, args, ctx)[0])


@lowering_rule(ir.RmsNormBackwardGamma)
def _rms_norm_backward_gamma(op, args, ctx):
    # [x, gamma, beta, dy] -> dgamma = sum_rows(dy * x * rstd)
    return ctx.cast_out(_rms_all(op, args, ctx)[1])


@lowering_rule(ir.RmsNormBackwardBeta)
def _rms_norm_backward_beta(op, args, ctx):
    # [x, gamma, beta, dy] -> dbeta = sum_rows(dy)
    return ctx.cast_out(_rms_all(op, args, ctx)[2])


# ---- norms whose dgamma / dbeta nodes do not read gamma ---------------------------------------
#
# LayerNorm, GroupNorm and BatchNormInference emit a dx node that reads gamma and dgamma /
# dbeta nodes that do not (those gradients do not depend on gamma). The backward wrapper
# returns all three from one call, which needs a gamma. Two memo entries keep this both
# shared and right:
#   * ``(family, every input id of the dx node, attributes)``: the full result for one
#     gamma (only a dx node with exactly these inputs may read its dx);
#   * ``(family + " dgamma", ids of the gamma-free inputs, attributes)``: a result whose
#     dgamma / dbeta entries are valid for any gamma.
# A gamma-free node computes with the gamma of a dx sibling already lowered with the same
# gamma-free inputs (then the dx node finds the full entry), else with gamma = 1.


def _norm_with_gamma(ctx, family, attrs, free_ids, full_ids, compute):
    """The full result for the dx node whose inputs are ``full_ids``."""
    key = (family, full_ids, attrs)
    out = ctx.memo(key, compute)
    ctx.cache.setdefault((family + " dgamma", free_ids, attrs), out)
    return out


def _norm_gamma_free(ctx, family, attrs, free_ids, sibling, compute):
    """A result whose gamma-independent entries are valid. ``sibling()`` -> (full input
    ids, gamma value, extra values) of a lowered dx sibling, or None; ``compute(gamma,
    extra)`` runs the wrapper (gamma None: ones)."""
    free_key = (family + " dgamma", free_ids, attrs)
    if free_key in ctx.cache:
        return ctx.cache[free_key]
    found = sibling()
    if found is not None:
        full_ids, gamma, extra = found
        return _norm_with_gamma(ctx, family, attrs, free_ids, full_ids, lambda: compute(gamma, extra))
    return ctx.memo(free_key, lambda: compute(None, None))


def _lowered_sibling(ctx, op_name, attrs, match):
    """(input ids, input values) of a node of the graph with op ``op_name`` and the same
    attributes for which ``match(inputs)`` holds and whose inputs are all lowered."""
    graph = ctx.graph
    if graph is None:
        return None
    for node in graph.nodes:
        if type(node.op).__name__ != op_name or op_attr_key(node.op) != attrs:
            continue
        if match(node.inputs) and all(i in ctx.env for i in node.inputs):
            return tuple(node.inputs), [ctx.env[i] for i in node.inputs]
    return None


# ---- LayerNorm -----------------------------------------------------------------------------

def _ln_compute(op, x, dy):
    def compute(gamma, _extra):
        if gamma is None:
            gamma = jnp.ones((x.shape[int(op.axis) % x.ndim],), x.dtype)
        return backward_fn("layer_norm")(x, gamma, jnp.zeros_like(gamma), dy, axis=int(op.axis),
                                         eps=float(op.eps))
    return compute


@lowering_rule(ir.LayerNormBackwardInput)
def _layer_norm_backward_input(op, args, ctx):
    # [x, gamma, dy] -> dx = rstd (g dy - mean(g dy) - xhat mean(g dy xhat)).
    x, gamma, dy = args
    ids = ctx.node_input_ids()
    out = _norm_with_gamma(ctx, "layer_norm", op_attr_key(op), (ids[0], ids[2]), ids,
                           lambda: _ln_compute(op, x, dy)(gamma, None))
    return ctx.cast_out(out[0])


@lowering_rule(ir.LayerNormBackwardGamma)
def _layer_norm_backward_gamma(op, args, ctx):
    # [x, dy] -> dgamma = sum_rows(dy * xhat) (independent of gamma).
    x, dy = args
    ids, attrs = ctx.node_input_ids(), op_attr_key(op)

    def sibling():
        found = _lowered_sibling(ctx, "LayerNormBackwardInput", attrs,
                                 lambda ins: (ins[0], ins[2]) == ids)
        return None if found is None else (found[0], found[1][1], None)

    return ctx.cast_out(_norm_gamma_free(ctx, "layer_norm", attrs, ids, sibling,
                                         _ln_compute(op, x, dy))[1])


# ---- GroupNorm -------------------------------------------------------------------------------

def _gn_compute(op, x, dy):
    def compute(gamma, beta):
        if gamma is None:
            gamma = jnp.ones((x.shape[1],), x.dtype)
        if beta is None:
            beta = jnp.zeros_like(gamma)
        return backward_fn("group_norm")(x, gamma, beta, dy, num_groups=int(op.num_groups),
                                         eps=float(op.eps))
    return compute


@lowering_rule(ir.GroupNormBackwardInput)
def _group_norm_backward_input(op, args, ctx):
    # [x, gamma, beta, dy] -> dx (NCHW, statistics per sample and group).
    x, gamma, beta, dy = args
    ids = ctx.node_input_ids()
    out = _norm_with_gamma(ctx, "group_norm", op_attr_key(op), (ids[0], ids[3]), ids,
                           lambda: _gn_compute(op, x, dy)(gamma, beta))
    return ctx.cast_out(out[0])


def _gn_gamma_free(op, args, ctx):
    x, dy = args
    ids, attrs = ctx.node_input_ids(), op_attr_key(op)

    def sibling():
        found = _lowered_sibling(ctx, "GroupNormBackwardInput", attrs,
                                 lambda ins: (ins[0], ins[3]) == ids)
        return None if found is None else (found[0], found[1][1], found[1][2])

    return _norm_gamma_free(ctx, "group_norm", attrs, ids, sibling, _gn_compute(op, x, dy))


@lowering_rule(ir.GroupNormBackwardGamma)
def _group_norm_backward_gamma(op, args, ctx):
    # [x, dy] -> dgamma[c] = sum over batch and space of dy * xhat.
    return ctx.cast_out(_gn_gamma_free(op, args, ctx)[1])


@lowering_rule(ir.GroupNormBackwardBeta)
def _group_norm_backward_beta(op, args, ctx):
    # [x, dy] -> dbeta[c] = sum over batch and space of dy.
    return ctx.cast_out(_gn_gamma_free(op, args, ctx)[2])


# ---- BatchNormInference ---------------------------------------------------------------------

def _bn_compute(op, x, mean, var, dy):
    def compute(gamma, _extra):
        if gamma is None:
            gamma = jnp.ones_like(mean)
        return backward_fn("batch_norm", "batch_norm_inference_backward")(
            x, gamma, mean, var, dy, eps=float(op.eps))
    return compute


def _bn_note_dbeta(ctx, dy_id, out):
    ctx.cache.setdefault(("batch_norm dbeta", dy_id), out[2])
    return out


@lowering_rule(ir.BatchNormInferenceBackwardInput)
def _bn_backward_input(op, args, ctx):
    # [x, gamma, mean, var, dy] -> dx = dy * gamma[c] / sqrt(var[c] + eps).
    x, gamma, mean, var, dy = args
    ids = ctx.node_input_ids()
    free = (ids[0], ids[2], ids[3], ids[4])
    out = _norm_with_gamma(ctx, "batch_norm", op_attr_key(op), free, ids,
                           lambda: _bn_compute(op, x, mean, var, dy)(gamma, None))
    return ctx.cast_out(_bn_note_dbeta(ctx, ids[4], out)[0])


@lowering_rule(ir.BatchNormInferenceBackwardGamma)
def _bn_backward_gamma(op, args, ctx):
    # [x, mean, var, dy] -> dgamma[c] = sum dy * (x - mean[c]) / sqrt(var[c] + eps).
    x, mean, var, dy = args
    ids, attrs = ctx.node_input_ids(), op_attr_key(op)

    def sibling():
        found = _lowered_sibling(ctx, "BatchNormInferenceBackwardInput", attrs,
                                 lambda ins: (ins[0],) + tuple(ins[2:]) == ids)
        return None if found is None else (found[0], found[1][1], None)

    out = _norm_gamma_free(ctx, "batch_norm", attrs, ids, sibling, _bn_compute(op, x, mean, var, dy))
    return ctx.cast_out(_bn_note_dbeta(ctx, ids[3], out)[1])


@lowering_rule(ir.BatchNormInferenceBackwardBeta)
def _bn_backward_beta(op, args, ctx):
    # [dy] -> dbeta[c] = sum of dy over every axis but 1 (depends on dy only), taken from a
    # sibling's fused call on the same dy when one was lowered.
    (dy,) = args
    dy_id = ctx.node_input_ids()[0]
    cached = ctx.cache.get(("batch_norm dbeta", dy_id))
    if cached is not None:
        return ctx.cast_out(cached)
    return ctx.cast_out(jnp.sum(dy, axis=tuple(i for i in range(dy.ndim) if i != 1)))


# ---- attention -------------------------------------------------------------------------------

def _attention_all(op, args, ctx):
    q, k, v, dy = args[:4]
    extra = args[4] if len(args) > 4 else None
    nh, hd = int(op.num_heads), int(op.head_dim)
    scale = getattr(op, "score_scale", None)
    softcap = getattr(op, "attn_logit_softcap", None)
    key = sibling_key("attention", op, ctx, skip=("wrt",))

    def compute():
        bhsd = attention_layout(q, nh)
        q4, back_q = _to_bshd(q, nh, hd, bhsd)
        k4, back_k = _to_bshd(k, nh, hd, bhsd)
        v4, back_v = _to_bshd(v, nh, hd, bhsd)
        dy4, _ = _to_bshd(dy, nh, hd, bhsd)
        kw = attention_kwargs(op.mask_kind, extra, scale, softcap)
        mask, bias = kw.pop("mask", None), kw.pop("bias", None)
        dq, dk, dv = backward_fn("attention")(q4, k4, v4, dy4, mask, bias, **kw)
        return back_q(dq), back_k(dk), back_v(dv)

    return ctx.memo(key, compute)


@lowering_rule(ir.AttentionBackward)
def _attention_backward(op, args, ctx):
    # [q, k, v, dy, (mask)] -> dq, dk or dv (wrt); the three siblings share one call.
    which = {"Query": 0, "Key": 1, "Value": 2}[enum_name(op.wrt)]
    return ctx.cast_out(_attention_all(op, args, ctx)[which])


# ---- single-output backward ops --------------------------------------------------------------

@lowering_rule(ir.RopeBackward)
def _rope_backward(op, args, ctx):
    # [dy, cos, sin] -> the forward NeoX rotation with sin negated.
    dy, cos, sin = args
    return ctx.cast_out(backward_fn("rope")(dy, cos, sin, head_dim=int(op.head_dim),
                                            n_rot=int(op.n_rot)))


@lowering_rule(ir.CumsumBackward)
def _cumsum_backward(op, args, ctx):
    # [dy] -> reverse cumulative sum along axis (shifted by one when exclusive).
    return ctx.cast_out(backward_fn("cumsum")(args[0], axis=int(op.axis),
                                              exclusive=bool(op.exclusive)))


@lowering_rule(ir.GatherBackward)
def _gather_backward(op, args, ctx):
    # [dy, indices] -> d_table (declared table shape): scatter-add of dy rows.
    dy, idx = args
    if ctx.out_shape is None or None in ctx.out_shape:
        raise ValueError("GatherBackward table shape has an unbound dynamic dim")
    a = int(op.axis) % len(ctx.out_shape)
    lead = tuple(ctx.out_shape[:a])
    if a and dy.ndim == idx.ndim + len(ctx.out_shape) - 1 - a:
        # Gather-output layout [*idx, *post]: it is the first slice along lead of the
        # np.take layout [*lead, *idx, *post]; the other lead positions get no gradient.
        dy = jnp.zeros(lead + dy.shape, dy.dtype).at[(0,) * a].set(dy)
    return ctx.cast_out(backward_fn("gather")(dy, index_array(idx), axis=a,
                                              table_shape=tuple(ctx.out_shape)))


def _pair(v, default):
    v = tuple(int(a) for a in (v or ()))
    if not v:
        return default
    return v if len(v) == 2 else (v[0], v[0])


@lowering_rule(ir.MaxPool2dBackward)
def _max_pool2d_backward(op, args, ctx):
    # [x, dy] -> dx: each window's dy goes to its first maximum.
    x, dy = args
    ks = _pair(op.kernel_size, None)
    return ctx.cast_out(backward_fn("pool", "max_pool2d_backward")(
        x, dy, kernel_size=ks, stride=_pair(op.stride, ks), padding=_pair(op.padding, (0, 0))))


def _conv_kw(op):
    return dict(stride=_pair(op.stride, (1, 1)), padding=_pair(op.padding, (0, 0)),
                dilation=_pair(op.dilation, (1, 1)), groups=int(op.groups))


@lowering_rule(ir.Conv2dBackwardInput)
def _conv2d_backward_input(op, args, ctx):
    # [dy, w] -> dx [N, C_in, H, W] (declared): the transposed conv of dy with w.
    dy, w = args
    if ctx.out_shape is None or None in ctx.out_shape:
        raise ValueError("Conv2dBackwardInput input shape has an unbound dynamic dim")
    return ctx.cast_out(backward_fn("conv", "conv2d_backward_input")(
        dy, w, x_shape=tuple(ctx.out_shape), **_conv_kw(op)))


@lowering_rule(ir.Conv2dBackwardWeight)
def _conv2d_backward_weight(op, args, ctx):
    # [x, dy] -> dw [C_out, C_in/groups, kH, kW].
    x, dy = args
    c_out = dy.shape[1]
    ks = _pair(op.kernel_size, None)
    w_shape = (c_out, x.shape[1] // int(op.groups)) + tuple(ks)
    return ctx.cast_out(backward_fn("conv", "conv2d_backward_weight")(
        x, dy, w_shape=w_shape, **_conv_kw(op)))


@lowering_rule(ir.SoftmaxCrossEntropyBackward)
def _softmax_xent_backward(op, args, ctx):
    # [logits, labels, d_loss] -> (softmax(logits) - onehot(labels)) * d_loss[:, None].
    logits, labels, dloss = args
    return ctx.cast_out(backward_fn("cross_entropy", "softmax_cross_entropy_backward")(
        logits, class_labels(labels, logits.shape[-1]), dloss, ignore_index=-1))


def _ste(op):
    return {"Identity": "identity", "ClippedIdentity": "clipped_identity", "Tanh": "tanh",
            "HardTanh": "hardtanh"}[enum_name(op.ste) or "Identity"]


@lowering_rule(ir.FakeQuantizeBackward)
def _fake_quantize_backward(op, args, ctx):
    # [x, dy] -> ste'(x) * dy with the per-batch scale recomputed from x.
    x, dy = args
    axis = None if op.axis is None else int(op.axis)
    return ctx.cast_out(backward_fn("quantize", "fake_quantize_backward")(
        x, dy, bits=int(op.bits), axis=axis, ste=_ste(op)))


def _lsq_all(op, args, ctx):
    x, scale, dy = args
    axis = None if op.axis is None else int(op.axis)
    return ctx.memo(sibling_key("lsq", op, ctx), lambda: backward_fn("quantize", "fake_quantize_lsq_backward")(
        x, scale, dy, bits=int(op.bits), axis=axis))


@lowering_rule(ir.FakeQuantizeLSQBackwardX)
def _lsq_backward_x(op, args, ctx):
    # [x, scale, dy] -> dx (STE inside the clamp range).
    return ctx.cast_out(_lsq_all(op, args, ctx)[0])


@lowering_rule(ir.FakeQuantizeLSQBackwardScale)
def _lsq_backward_scale(op, args, ctx):
    # [x, scale, dy] -> dscale[c] = sum psi(x / s) dy.
    return ctx.cast_out(_lsq_all(op, args, ctx)[1])


@lowering_rule(ir.ComplexNormSqBackward)
def _complex_norm_sq_backward(op, args, ctx):
    # [z, g] -> dz = g * z (Wirtinger).
    z, g = args
    return ctx.cast_out(backward_fn("complex", "complex_norm_sq_backward")(z, g))
