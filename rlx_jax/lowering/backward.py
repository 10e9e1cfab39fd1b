"""RLX backward ops, lowered to the ``<family>_backward`` wrappers of
``rlx_jax.vjp_rules.<family>`` (the same backward primitive the fused ops' custom VJPs
transpose to, so a graph gradient and ``jax.grad`` run the same kernel).

Sibling nodes (dx / dgamma / dbeta of one norm, dq / dk / dv of one attention) lower to
one wrapper call: the result is memoised in the lowering context under the family and
the ids of the shared inputs.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp

from .nn import _to_bshd, attention_kwargs, attention_layout, class_labels, index_array
from .registry import enum_name, lowering_rule


def backward_fn(family: str, name: str | None = None):
    """``rlx_jax.vjp_rules.<family>.<name or family_backward>``: the wrapper the family's
    transpose rule calls too (imported at call time, so the IR imports stay light)."""
    return getattr(importlib.import_module(f"rlx_jax.vjp_rules.{family}"), name or f"{family}_backward")


def _attrs(op, *names):
    return tuple(getattr(op, n) for n in names)


# ---- RMSNorm -------------------------------------------------------------------------------

def _rms_all(op, args, ctx):
    x, gamma, beta, dy = args
    key = ("rms_norm", ctx.node_input_ids(), _attrs(op, "axis", "eps"))
    return ctx.memo(key, lambda: backward_fn("rms_norm")(x, gamma, beta, dy, axis=int(op.axis),
                                                         eps=float(op.eps)))


@lowering_rule("RmsNormBackwardInput")
def _rms_norm_backward_input(op, args, ctx):
    # [x, gamma, beta, dy] -> dx
    return ctx.cast_out(_rms_all(op, args, ctx)[0])


@lowering_rule("RmsNormBackwardGamma")
def _rms_norm_backward_gamma(op, args, ctx):
    # [x, gamma, beta, dy] -> dgamma = sum_rows(dy * x * rstd)
    return ctx.cast_out(_rms_all(op, args, ctx)[1])


@lowering_rule("RmsNormBackwardBeta")
def _rms_norm_backward_beta(op, args, ctx):
    # [x, gamma, beta, dy] -> dbeta = sum_rows(dy)
    return ctx.cast_out(_rms_all(op, args, ctx)[2])


# ---- sibling lookup ------------------------------------------------------------------------

def _sibling_value(ctx, op_name, match):
    """The value of an input of a sibling node (same graph, op ``op_name``) chosen by
    ``match(node) -> input id or None``, if it is already computed."""
    graph = ctx.graph
    if graph is None:
        return None
    for node in graph.nodes:
        if type(node.op).__name__ != op_name:
            continue
        iid = match(node)
        if iid is not None and iid in ctx.env:
            return ctx.env[iid]
    return None


def _same_attrs(a, b, names):
    return all(getattr(a, n) == getattr(b, n) for n in names)


# ---- LayerNorm -----------------------------------------------------------------------------

def _ln_all(op, ctx, x, gamma, dy, x_id, dy_id):
    """(dx, dgamma, dbeta) of LayerNorm for (x, dy); gamma None: borrow the sibling
    LayerNormBackwardInput's gamma if it has one (dgamma does not depend on gamma)."""
    key = ("layer_norm", x_id, dy_id, _attrs(op, "axis", "eps"))
    if key in ctx.cache:
        return ctx.cache[key]
    if gamma is None:
        gamma = _sibling_value(
            ctx, "LayerNormBackwardInput",
            lambda n: n.inputs[1] if (n.inputs[0] == x_id and n.inputs[2] == dy_id
                                      and _same_attrs(n.op, op, ("axis", "eps"))) else None)
    if gamma is None:
        gamma = jnp.ones((x.shape[int(op.axis) % x.ndim],), x.dtype)
    beta = jnp.zeros_like(gamma)
    out = backward_fn("layer_norm")(x, gamma, beta, dy, axis=int(op.axis), eps=float(op.eps))
    ctx.cache[key] = out
    return out


@lowering_rule("LayerNormBackwardInput")
def _layer_norm_backward_input(op, args, ctx):
    # [x, gamma, dy] -> dx = rstd (g dy - mean(g dy) - xhat mean(g dy xhat)).
    x, gamma, dy = args
    ids = ctx.node_input_ids()
    return ctx.cast_out(_ln_all(op, ctx, x, gamma, dy, ids[0], ids[2])[0])


@lowering_rule("LayerNormBackwardGamma")
def _layer_norm_backward_gamma(op, args, ctx):
    # [x, dy] -> dgamma = sum_rows(dy * xhat).
    x, dy = args
    ids = ctx.node_input_ids()
    return ctx.cast_out(_ln_all(op, ctx, x, None, dy, ids[0], ids[1])[1])


# ---- GroupNorm -------------------------------------------------------------------------------

def _gn_all(op, ctx, x, gamma, beta, dy, x_id, dy_id):
    key = ("group_norm", x_id, dy_id, _attrs(op, "num_groups", "eps"))
    if key in ctx.cache:
        return ctx.cache[key]
    if gamma is None:
        gamma = _sibling_value(
            ctx, "GroupNormBackwardInput",
            lambda n: n.inputs[1] if (n.inputs[0] == x_id and n.inputs[3] == dy_id
                                      and _same_attrs(n.op, op, ("num_groups", "eps"))) else None)
    if gamma is None:
        gamma = jnp.ones((x.shape[1],), x.dtype)
    if beta is None:
        beta = jnp.zeros_like(gamma)
    out = backward_fn("group_norm")(x, gamma, beta, dy, num_groups=int(op.num_groups),
                                    eps=float(op.eps))
    ctx.cache[key] = out
    return out


@lowering_rule("GroupNormBackwardInput")
def _group_norm_backward_input(op, args, ctx):
    # [x, gamma, beta, dy] -> dx (NCHW, statistics per sample and group).
    x, gamma, beta, dy = args
    ids = ctx.node_input_ids()
    return ctx.cast_out(_gn_all(op, ctx, x, gamma, beta, dy, ids[0], ids[3])[0])


@lowering_rule("GroupNormBackwardGamma")
def _group_norm_backward_gamma(op, args, ctx):
    # [x, dy] -> dgamma[c] = sum over batch and space of dy * xhat.
    x, dy = args
    ids = ctx.node_input_ids()
    return ctx.cast_out(_gn_all(op, ctx, x, None, None, dy, ids[0], ids[1])[1])


@lowering_rule("GroupNormBackwardBeta")
def _group_norm_backward_beta(op, args, ctx):
    # [x, dy] -> dbeta[c] = sum over batch and space of dy.
    x, dy = args
    ids = ctx.node_input_ids()
    return ctx.cast_out(_gn_all(op, ctx, x, None, None, dy, ids[0], ids[1])[2])


# ---- BatchNormInference ---------------------------------------------------------------------

def _bn_call(ctx, op, x, gamma, mean, var, dy, key):
    if key in ctx.cache:
        return ctx.cache[key]
    out = backward_fn("batch_norm", "batch_norm_inference_backward")(
        x, gamma, mean, var, dy, eps=float(getattr(op, "eps", 1e-5)))
    ctx.cache[key] = out
    return out


@lowering_rule("BatchNormInferenceBackwardInput")
def _bn_backward_input(op, args, ctx):
    # [x, gamma, mean, var, dy] -> dx = dy * gamma[c] / sqrt(var[c] + eps).
    x, gamma, mean, var, dy = args
    ids = ctx.node_input_ids()
    key = ("batch_norm", ids[0], ids[2], ids[3], ids[4], float(op.eps))
    return ctx.cast_out(_bn_call(ctx, op, x, gamma, mean, var, dy, key)[0])


@lowering_rule("BatchNormInferenceBackwardGamma")
def _bn_backward_gamma(op, args, ctx):
    # [x, mean, var, dy] -> dgamma[c] = sum dy * (x - mean[c]) / sqrt(var[c] + eps).
    x, mean, var, dy = args
    ids = ctx.node_input_ids()
    key = ("batch_norm", ids[0], ids[1], ids[2], ids[3], float(op.eps))
    gamma = jnp.ones_like(mean)  # dgamma does not depend on gamma
    return ctx.cast_out(_bn_call(ctx, op, x, gamma, mean, var, dy, key)[1])


@lowering_rule("BatchNormInferenceBackwardBeta")
def _bn_backward_beta(op, args, ctx):
    # [dy] -> dbeta[c] = sum of dy over every axis but 1. Taken from the sibling
    # BatchNormInferenceBackwardInput's fused call when there is one with the same dy.
    (dy,) = args
    dy_id = ctx.node_input_ids()[0]
    for (tag, *ids), val in list(ctx.cache.items()):
        if tag == "batch_norm" and ids[3] == dy_id:
            return ctx.cast_out(val[2])
    return ctx.cast_out(jnp.sum(dy, axis=tuple(i for i in range(dy.ndim) if i != 1)))


# ---- attention -------------------------------------------------------------------------------

def _attention_all(op, args, ctx):
    q, k, v, dy = args[:4]
    extra = args[4] if len(args) > 4 else None
    nh, hd = int(op.num_heads), int(op.head_dim)
    scale = getattr(op, "score_scale", None)
    softcap = getattr(op, "attn_logit_softcap", None)
    key = ("attention", ctx.node_input_ids(), nh, hd, str(op.mask_kind), scale, softcap)

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


@lowering_rule("AttentionBackward")
def _attention_backward(op, args, ctx):
    # [q, k, v, dy, (mask)] -> dq, dk or dv (wrt); the three siblings share one call.
    which = {"Query": 0, "Key": 1, "Value": 2}[enum_name(op.wrt)]
    return ctx.cast_out(_attention_all(op, args, ctx)[which])


# ---- single-output backward ops --------------------------------------------------------------

@lowering_rule("RopeBackward")
def _rope_backward(op, args, ctx):
    # [dy, cos, sin] -> the forward NeoX rotation with sin negated.
    dy, cos, sin = args
    return ctx.cast_out(backward_fn("rope")(dy, cos, sin, head_dim=int(op.head_dim),
                                            n_rot=int(op.n_rot)))


@lowering_rule("CumsumBackward")
def _cumsum_backward(op, args, ctx):
    # [dy] -> reverse cumulative sum along axis (shifted by one when exclusive).
    return ctx.cast_out(backward_fn("cumsum")(args[0], axis=int(op.axis),
                                              exclusive=bool(op.exclusive)))


@lowering_rule("GatherBackward")
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


@lowering_rule("MaxPool2dBackward")
def _max_pool2d_backward(op, args, ctx):
    # [x, dy] -> dx: each window's dy goes to its first maximum.
    x, dy = args
    ks = _pair(op.kernel_size, None)
    return ctx.cast_out(backward_fn("pool", "max_pool2d_backward")(
        x, dy, kernel_size=ks, stride=_pair(op.stride, ks), padding=_pair(op.padding, (0, 0))))


def _conv_kw(op):
    return dict(stride=_pair(op.stride, (1, 1)), padding=_pair(op.padding, (0, 0)),
                dilation=_pair(op.dilation, (1, 1)), groups=int(op.groups))


@lowering_rule("Conv2dBackwardInput")
def _conv2d_backward_input(op, args, ctx):
    # [dy, w] -> dx [N, C_in, H, W] (declared): the transposed conv of dy with w.
    dy, w = args
    if ctx.out_shape is None or None in ctx.out_shape:
        raise ValueError("Conv2dBackwardInput input shape has an unbound dynamic dim")
    return ctx.cast_out(backward_fn("conv", "conv2d_backward_input")(
        dy, w, x_shape=tuple(ctx.out_shape), **_conv_kw(op)))


@lowering_rule("Conv2dBackwardWeight")
def _conv2d_backward_weight(op, args, ctx):
    # [x, dy] -> dw [C_out, C_in/groups, kH, kW].
    x, dy = args
    c_out = dy.shape[1]
    ks = _pair(op.kernel_size, None)
    w_shape = (c_out, x.shape[1] // int(op.groups)) + tuple(ks)
    return ctx.cast_out(backward_fn("conv", "conv2d_backward_weight")(
        x, dy, w_shape=w_shape, **_conv_kw(op)))


@lowering_rule("SoftmaxCrossEntropyBackward")
def _softmax_xent_backward(op, args, ctx):
    # [logits, labels, d_loss] -> (softmax(logits) - onehot(labels)) * d_loss[:, None].
    logits, labels, dloss = args
    return ctx.cast_out(backward_fn("cross_entropy", "softmax_cross_entropy_backward")(
        logits, class_labels(labels, logits.shape[-1]), dloss, ignore_index=-1))


def _ste(op):
    return {"Identity": "identity", "ClippedIdentity": "clipped_identity", "Tanh": "tanh",
            "HardTanh": "hardtanh"}[enum_name(op.ste) or "Identity"]


@lowering_rule("FakeQuantizeBackward")
def _fake_quantize_backward(op, args, ctx):
    # [x, dy] -> ste'(x) * dy with the per-batch scale recomputed from x.
    x, dy = args
    axis = None if op.axis is None else int(op.axis)
    return ctx.cast_out(backward_fn("quantize", "fake_quantize_backward")(
        x, dy, bits=int(op.bits), axis=axis, ste=_ste(op)))


def _lsq_all(op, args, ctx):
    x, scale, dy = args
    axis = None if op.axis is None else int(op.axis)
    key = ("lsq", ctx.node_input_ids(), int(op.bits), axis)
    return ctx.memo(key, lambda: backward_fn("quantize", "fake_quantize_lsq_backward")(
        x, scale, dy, bits=int(op.bits), axis=axis))


@lowering_rule("FakeQuantizeLSQBackwardX")
def _lsq_backward_x(op, args, ctx):
    # [x, scale, dy] -> dx (STE inside the clamp range).
    return ctx.cast_out(_lsq_all(op, args, ctx)[0])


@lowering_rule("FakeQuantizeLSQBackwardScale")
def _lsq_backward_scale(op, args, ctx):
    # [x, scale, dy] -> dscale[c] = sum psi(x / s) dy.
    return ctx.cast_out(_lsq_all(op, args, ctx)[1])


@lowering_rule("ComplexNormSqBackward")
def _complex_norm_sq_backward(op, args, ctx):
    # [z, g] -> dz = g * z (Wirtinger).
    z, g = args
    return ctx.cast_out(backward_fn("complex", "complex_norm_sq_backward")(z, g))
