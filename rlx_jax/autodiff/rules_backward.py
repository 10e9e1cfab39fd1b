"""VJP rules of RLX's backward ops, so that a gradient graph can be differentiated
again (second order, hvp).

Backward ops that are linear in their inputs get direct rules (the gather / conv
transposes). The others are written in primitive ops (the closed forms of the
backward table in RLX_IR.md) and differentiated through that expansion
(:func:`~rlx_jax.autodiff.expansion.vjp_via_expansion`): the backward op itself stays
in the graph and keeps computing its value; only its derivative is spelled out.
"""

from __future__ import annotations

import math

import numpy as np

from rlx_jax.ir import DType, GraphError
from rlx_jax.ir.op import ActivationKind, AttentionBwdWrt, BinaryOp
from rlx_jax.ir.ops_attention import Rope
from rlx_jax.ir.ops_backward import Conv2dBackwardInput, Conv2dBackwardWeight
from rlx_jax.ir.ops_conv import Conv, Pool
from rlx_jax.ir.ops_reduce import Cumsum, Softmax
from rlx_jax.ir.ops_shape import Gather
from rlx_jax.ir.op import ReduceOp
from rlx_jax import ir

from . import emit as E
from .expansion import vjp_via_expansion
from .table import backprop, vjp_rule


def _expanding(build):
    """A VJP rule differentiating ``build(t, op, ins) -> out``."""
    def rule(g, node, dy):
        return vjp_via_expansion(g, node, dy, lambda t, ins: build(t, node.op, ins))
    return rule


# -- elementwise --------------------------------------------------------------------

def activation_derivative(t, kind, x):
    """``f'(x)`` for an RLX activation, in primitive ops."""
    k = ActivationKind.parse(kind)
    dt = E.dtype(t, x)

    def s(v):
        return E.scalar(t, v, dt)

    if k is ActivationKind.Gelu:
        # Phi(x) = gelu(x) / x (1/2 at 0), phi(x) = exp(-x^2/2) / sqrt(2 pi)
        is0 = E.cmp(t, "Eq", x, s(0))
        safe = E.where(t, is0, s(1), x)
        cdf = E.where(t, is0, s(0.5), E.div(t, E.act(t, k, x), safe))
        pdf = E.mul_s(t, E.act(t, "Exp", E.mul_s(t, E.mul(t, x, x), -0.5)), 1.0 / math.sqrt(2 * math.pi))
        return E.add(t, cdf, E.mul(t, x, pdf))
    if k is ActivationKind.GeluApprox:
        c = math.sqrt(2.0 / math.pi)
        x2 = E.mul(t, x, x)
        u = E.mul_s(t, E.add(t, x, E.mul_s(t, E.mul(t, x2, x), 0.044715)), c)
        th = E.act(t, "Tanh", u)
        one_m = E.sub(t, s(1), E.mul(t, th, th))
        du = E.mul_s(t, E.add_s(t, E.mul_s(t, x2, 3 * 0.044715), 1.0), c)
        return E.add(t, E.mul_s(t, E.add_s(t, th, 1.0), 0.5), E.mul_s(t, E.mul(t, E.mul(t, x, one_m), du), 0.5))
    if k is ActivationKind.Silu:
        sg = E.act(t, "Sigmoid", x)
        return E.mul(t, sg, E.add_s(t, E.mul(t, x, E.sub(t, s(1), sg)), 1.0))
    if k is ActivationKind.Sigmoid:
        sg = E.act(t, "Sigmoid", x)
        return E.mul(t, sg, E.sub(t, s(1), sg))
    if k is ActivationKind.Tanh:
        th = E.act(t, "Tanh", x)
        return E.sub(t, s(1), E.mul(t, th, th))
    if k is ActivationKind.Exp:
        return E.act(t, "Exp", x)
    if k is ActivationKind.Log:
        return E.div(t, s(1), x)
    if k is ActivationKind.Sqrt:
        return E.div(t, s(0.5), E.act(t, "Sqrt", x))
    if k is ActivationKind.Rsqrt:
        r = E.act(t, "Rsqrt", x)
        return E.mul_s(t, E.mul(t, E.mul(t, r, r), r), -0.5)
    if k is ActivationKind.Neg:
        return s(-1)
    if k is ActivationKind.Abs:
        return E.where(t, E.cmp(t, "Gt", x, s(0)), s(1), E.where(t, E.cmp(t, "Lt", x, s(0)), s(-1), s(0)))
    if k is ActivationKind.Sin:
        return E.act(t, "Cos", x)
    if k is ActivationKind.Cos:
        return E.neg(t, E.act(t, "Sin", x))
    if k is ActivationKind.Tan:
        tn = E.act(t, "Tan", x)
        return E.add_s(t, E.mul(t, tn, tn), 1.0)
    if k is ActivationKind.Atan:
        return E.div(t, s(1), E.add_s(t, E.mul(t, x, x), 1.0))
    if k is ActivationKind.Relu:
        return E.where(t, E.cmp(t, "Gt", x, s(0)), s(1), s(0))
    if k is ActivationKind.Round:
        return s(1)
    raise GraphError(f"no derivative for activation {k}")


@vjp_rule(ir.ActivationBackward)
def _act_bwd(g, node, dy):
    def build(t, ins):
        x, d = ins
        return E.expand(t, E.mul(t, d, activation_derivative(t, node.op.kind, x)), E.dims(t, x))
    return vjp_via_expansion(g, node, dy, build)


@vjp_rule(ir.ReluBackward)
def _relu_bwd(g, node, dy):
    def build(t, ins):
        x, d = ins
        return E.where(t, E.cmp(t, "Gt", x, E.scalar(t, 0, E.dtype(t, x))), d, E.scalar(t, 0, E.dtype(t, d)))
    return vjp_via_expansion(g, node, dy, build)


# -- norms ----------------------------------------------------------------------------

def _norm_axes(t, x, axis):
    """(axis, (axis,), the other axes): LayerNorm / RmsNorm normalise one axis."""
    r = E.shape(t, x).rank
    a = E.norm_axis(axis, r)
    return a, (a,), tuple(i for i in range(r) if i != a)


def _param(t, p, x, a):
    """A per-feature parameter [C] shaped to broadcast along axis ``a`` of ``x``."""
    r = E.shape(t, x).rank
    c = E.dims(t, p)[0]
    return E.reshape(t, p, tuple(c if i == a else 1 for i in range(r)))


def _ln_stats(t, x, axes, eps):
    mean = E.reduce(t, x, "Mean", axes, True)
    xc = E.sub(t, x, mean)
    var = E.reduce(t, E.mul(t, xc, xc), "Mean", axes, True)
    rstd = E.act(t, "Rsqrt", E.add_s(t, var, eps))
    return E.mul(t, xc, rstd), rstd


def _centre(t, v, axes):
    """``v - mean(v)`` over ``axes`` (keep dims)."""
    return E.sub(t, v, E.reduce(t, v, "Mean", axes, True))


def ln_input_grad(t, x, gdy, axes, eps):
    xhat, rstd = _ln_stats(t, x, axes, eps)
    m2 = E.reduce(t, E.mul(t, gdy, xhat), "Mean", axes, True)
    return E.mul(t, rstd, E.sub(t, _centre(t, gdy, axes), E.mul(t, xhat, m2)))


def _ln_bwd_input(t, op, ins):
    x, gamma, dy = ins
    a, axes, _ = _norm_axes(t, x, op.axis)
    return ln_input_grad(t, x, E.mul(t, dy, _param(t, gamma, x, a)), axes, op.eps)


def _ln_bwd_gamma(t, op, ins):
    x, dy = ins
    a, axes, rest = _norm_axes(t, x, op.axis)
    xhat, _ = _ln_stats(t, x, axes, op.eps)
    return E.sum_(t, E.mul(t, dy, xhat), rest)


def _rms_r(t, x, axes, eps):
    ms = E.reduce(t, E.mul(t, x, x), "Mean", axes, True)
    return E.act(t, "Rsqrt", E.add_s(t, ms, eps))


def _rms_bwd_input(t, op, ins):
    x, gamma, beta, dy = ins
    a, axes, _ = _norm_axes(t, x, op.axis)
    r = _rms_r(t, x, axes, op.eps)
    gdy = E.mul(t, dy, _param(t, gamma, x, a))
    m = E.reduce(t, E.mul(t, gdy, x), "Mean", axes, True)
    return E.mul(t, r, E.sub(t, gdy, E.mul(t, E.mul(t, x, E.mul(t, r, r)), m)))


def _rms_bwd_gamma(t, op, ins):
    x, gamma, beta, dy = ins
    a, axes, rest = _norm_axes(t, x, op.axis)
    r = _rms_r(t, x, axes, op.eps)
    return E.sum_(t, E.mul(t, dy, E.mul(t, x, r)), rest)


def _rms_bwd_beta(t, op, ins):
    x, gamma, beta, dy = ins
    a, axes, rest = _norm_axes(t, x, op.axis)
    return E.sum_(t, dy, rest)


def _grouped(t, v, groups):
    ds = E.dims(t, v)
    return E.reshape(t, v, (ds[0], groups, -1) if not E.is_static(ds) else
                     (ds[0], groups, E.numel(ds[1:]) // groups))


def _gn_xhat(t, x, groups, eps):
    xg = _grouped(t, x, groups)
    xhat, rstd = _ln_stats(t, xg, (2,), eps)
    return xhat, rstd


def _gn_bwd_input(t, op, ins):
    x, gamma, beta, dy = ins
    r = E.shape(t, x).rank
    c = E.dims(t, x)[1]
    gdy = E.mul(t, dy, E.reshape(t, gamma, (1, c) + (1,) * (r - 2)))
    dxg = ln_input_grad(t, _grouped(t, x, op.num_groups), _grouped(t, gdy, op.num_groups), (2,), op.eps)
    return E.reshape(t, dxg, E.dims(t, x))


def _gn_bwd_gamma(t, op, ins):
    x, dy = ins
    r = E.shape(t, x).rank
    xhat, _ = _gn_xhat(t, x, op.num_groups, op.eps)
    xh = E.reshape(t, xhat, E.dims(t, x))
    return E.sum_(t, E.mul(t, dy, xh), (0,) + tuple(range(2, r)))


def _gn_bwd_beta(t, op, ins):
    x, dy = ins
    r = E.shape(t, x).rank
    return E.sum_(t, dy, (0,) + tuple(range(2, r)))


def _chan(t, p, rank):
    c = E.dims(t, p)[0]
    return E.reshape(t, p, (1, c) + (1,) * (rank - 2))


def _bn_bwd_input(t, op, ins):
    x, gamma, mean, var, dy = ins
    r = E.shape(t, x).rank
    rstd = E.act(t, "Rsqrt", E.add_s(t, var, op.eps))
    return E.mul(t, dy, _chan(t, E.mul(t, gamma, rstd), r))


def _bn_bwd_gamma(t, op, ins):
    x, mean, var, dy = ins
    r = E.shape(t, x).rank
    rstd = E.act(t, "Rsqrt", E.add_s(t, var, op.eps))
    xh = E.mul(t, E.sub(t, x, _chan(t, mean, r)), _chan(t, rstd, r))
    return E.sum_(t, E.mul(t, dy, xh), (0,) + tuple(range(2, r)))


def _bn_bwd_beta(t, op, ins):
    (dy,) = ins
    r = E.shape(t, dy).rank
    return E.sum_(t, dy, (0,) + tuple(range(2, r)))


for _op_class, _b in ((ir.LayerNormBackwardInput, _ln_bwd_input), (ir.LayerNormBackwardGamma, _ln_bwd_gamma),
                   (ir.RmsNormBackwardInput, _rms_bwd_input), (ir.RmsNormBackwardGamma, _rms_bwd_gamma),
                   (ir.RmsNormBackwardBeta, _rms_bwd_beta),
                   (ir.GroupNormBackwardInput, _gn_bwd_input), (ir.GroupNormBackwardGamma, _gn_bwd_gamma),
                   (ir.GroupNormBackwardBeta, _gn_bwd_beta),
                   (ir.BatchNormInferenceBackwardInput, _bn_bwd_input),
                   (ir.BatchNormInferenceBackwardGamma, _bn_bwd_gamma),
                   (ir.BatchNormInferenceBackwardBeta, _bn_bwd_beta)):
    vjp_rule(_op_class)(_expanding(_b))


# -- position / scans / indexing ----------------------------------------------------------

@vjp_rule(ir.RopeBackward)
def _rope_bwd(g, node, dy):
    # dx = rope(dy, cos, -sin) is linear in dy: its transpose is rope(., cos, sin).
    from .rules_nn import rope_table_grads

    d, cos, sin = node.inputs
    # RopeBackward(d, cos, sin) = rope(d, cos, -sin): the sin gradient changes sign
    dc, dsn = rope_table_grads(g, d, dy, E.shape(g, cos), node.op.head_dim, node.op.n_rot)
    return [g.add_node(Rope(head_dim=node.op.head_dim, n_rot=node.op.n_rot), (dy, cos, sin)), dc, E.neg(g, dsn)]


@vjp_rule(ir.CumsumBackward)
def _cumsum_bwd(g, node, dy):
    # the transpose of the reverse cumulative sum is the forward cumulative sum
    return [g.add_node(Cumsum(axis=node.op.axis, exclusive=node.op.exclusive), (dy,))]


@vjp_rule(ir.GatherBackward)
def _gather_bwd(g, node, dy):
    d, idx = node.inputs
    axis = E.norm_axis(node.op.axis, node.shape.rank)
    if E.shape(g, d).rank == node.shape.rank - 1 + E.shape(g, idx).rank:
        return [g.take(dy, idx, axis), None]            # d in np.take's layout
    return [g.add_node(Gather(axis=axis), (dy, idx)), None]  # d in Gather's output layout


# -- conv / pool ------------------------------------------------------------------------

def _conv_kw(op):
    return dict(kernel_size=tuple(op.kernel_size), stride=tuple(op.stride), padding=tuple(op.padding),
                dilation=tuple(op.dilation), groups=op.groups)


@vjp_rule(ir.Conv2dBackwardInput)
def _conv_bwd_input(g, node, dy):
    # dx = conv^T(d, w) is bilinear: <G, dx> = <conv(G, w), d>
    d, w = node.inputs
    kw = _conv_kw(node.op)
    return [g.add_node(Conv(**kw), (dy, w)), g.add_node(Conv2dBackwardWeight(**kw), (dy, d))]


@vjp_rule(ir.Conv2dBackwardWeight)
def _conv_bwd_weight(g, node, dy):
    # dw = W^T(x, d): <G, dw> = <conv(x, G), d>
    x, d = node.inputs
    kw = _conv_kw(node.op)
    return [g.add_node(Conv2dBackwardInput(**kw), (d, dy), E.shape(g, x)), g.add_node(Conv(**kw), (x, dy))]


@vjp_rule(ir.MaxPool2dBackward)
def _maxpool_bwd(g, node, dy):
    """dx = P^T d with P the 0/1 matrix that picks each window's maximum, so the
    cotangent of d is P G: output (i, j) reads G at its window's argmax. x gets none
    (dx is piecewise constant in x).

    Any geometry (overlapping windows, stride < kernel, padding): for each kernel
    offset (a, b) in row-major order, a Gather of the flattened plane reads x and G at
    input position (i*sh - ph + a, j*sw - pw + b) for every output (a constant index
    table; positions in the padding are masked out). The forward's argmax rule is
    reproduced exactly: the first offset whose x equals the window maximum wins (a
    later equal value does not), and a window whose maximum is -inf (all padding or
    all -inf) passes nothing."""
    x, d = node.inputs
    op = node.op
    xd = E.dims(g, x)
    lead, (h, w) = tuple(xd[:-2]), xd[-2:]
    if not isinstance(h, int) or not isinstance(w, int):
        raise GraphError(f"node %{node.id} MaxPool2dBackward: second order needs static H and W")
    (kh, kw), (sh, sw), (ph, pw) = tuple(op.kernel_size), tuple(op.stride), tuple(op.padding)
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    dt = E.dtype(g, dy)
    if ho <= 0 or wo <= 0 or h * w == 0:
        return [None, E.zeros_like(g, d)]
    flat = lambda v, n: E.reshape(g, v, lead + (n,))                  # noqa: E731
    xf, gf = flat(x, h * w), flat(dy, h * w)
    y = flat(g.add_node(Pool(kind=ReduceOp.Max, kernel_size=(kh, kw), stride=(sh, sw), padding=(ph, pw)), (x,)),
             ho * wo)
    live = E.cmp(g, "Gt", y, E.scalar(g, -np.inf, E.dtype(g, y)))
    rows = np.arange(ho)[:, None] * sh - ph
    cols = np.arange(wo)[None, :] * sw - pw
    out, taken = None, None
    for a in range(kh):
        for b in range(kw):
            r, c = rows + a, cols + b
            inside = (r >= 0) & (r < h) & (c >= 0) & (c < w)
            if not inside.any():
                continue
            idx = E.const(g, np.where(inside, r * w + c, 0).reshape(-1).astype(np.int32), DType.I32)
            inside = inside.reshape(-1)
            xo = g.take(xf, idx, len(lead))
            hit = E.cmp(g, "Eq", xo, y)
            if not inside.all():
                hit = E.where(g, E.const(g, inside, DType.Bool), hit, E.scalar(g, False, DType.Bool))
            go = g.take(gf, idx, len(lead))
            if out is None:
                out, taken = E.where(g, hit, go, E.scalar(g, 0, dt)), hit
            else:
                first = E.where(g, taken, E.scalar(g, False, DType.Bool), hit)
                out = E.where(g, first, go, out)
                taken = E.where(g, taken, taken, hit)
    out = E.where(g, live, out, E.scalar(g, 0, dt))
    return [None, E.reshape(g, out, tuple(E.dims(g, d)))]


# -- loss / attention / complex ----------------------------------------------------------

def _xent_bwd(t, op, ins):
    # d logits = (softmax(logits) - onehot(label)) * dl per row; a row whose label is
    # outside [0, C) has no loss and no gradient. Its one-hot row is all zero, so the
    # row sum of the one-hot is the row's 0 / 1 validity.
    logits, labels, dl = ins
    n, c = E.dims(t, logits)
    dt = E.dtype(t, logits)
    p = t.add_node(Softmax(axis=-1), (logits,))
    iota = E.const(t, np.arange(c, dtype=np.int32).reshape(1, c), DType.I32)
    ids = E.reshape(t, E.index_ids(t, labels, c), (n, 1))
    hot = E.cast(t, E.cmp(t, "Eq", ids, iota), dt)
    valid = E.sum_(t, hot, [1], keep_dim=True)
    return E.mul(t, E.sub(t, E.mul(t, p, valid), hot), E.reshape(t, dl, (n, 1)))


vjp_rule(ir.SoftmaxCrossEntropyBackward)(_expanding(_xent_bwd))


@vjp_rule(ir.AttentionBackward)
def _attention_bwd(g, node, dy):
    """The attention VJP written in primitives, differentiated again."""
    from rlx_jax.ir.ops_attention import Attention

    op = node.op
    fop = Attention(num_heads=op.num_heads, head_dim=op.head_dim, mask_kind=op.mask_kind,
                    score_scale=None, attn_logit_softcap=None)
    which = {AttentionBwdWrt.Query: 0, AttentionBwdWrt.Key: 1, AttentionBwdWrt.Value: 2}[op.wrt]

    def build(t, ins):
        from .rules_attention import emit_attention

        q, k, v, d = ins[:4]
        extra = ins[4] if len(ins) > 4 else None
        out = emit_attention(t, fop, q, k, v, extra)
        grads = backprop(t, {out: d}, [(q, k, v)[which]])
        return grads[(q, k, v)[which]]

    return vjp_via_expansion(g, node, dy, build)


def _cns_bwd(t, op, ins):
    z, gg = ins
    return E.mul(t, E.cast(t, gg, DType.C64), z)


vjp_rule(ir.ComplexNormSqBackward)(_expanding(_cns_bwd))


# -- quantisation / signal ----------------------------------------------------------------

def _fq_bwd_expansion(t, op, ins):
    """dx = ste'(x) * d with FakeQuantize's per-batch scale s = max(max|x| / q, 1e-12)
    (per channel along ``axis``) held constant, as the forward op's gradient does."""
    from rlx_jax.ir.op import SteKind
    from rlx_jax.ir.ops_elementwise import StopGradient

    x, d = ins
    dt = E.dtype(t, x)
    q = float(2 ** (op.bits - 1) - 1)
    r = E.shape(t, x).rank
    axes = tuple(i for i in range(r) if op.axis is None or i != E.norm_axis(op.axis, r))
    amax = E.reduce(t, E.act(t, "Abs", x), "Max", axes, True)
    sc = t.add_node(StopGradient(), (E.binary(t, BinaryOp.Max, E.mul_s(t, amax, 1.0 / q),
                                                E.scalar(t, 1e-12, dt)),))
    if op.ste is SteKind.Tanh:
        th = E.act(t, "Tanh", E.div(t, x, sc))
        f = E.sub(t, E.scalar(t, 1.0, dt), E.mul(t, th, th))
    else:  # HardTanh
        z = E.act(t, "Abs", E.div(t, x, E.mul_s(t, sc, q)))
        f = E.binary(t, BinaryOp.Max, E.sub(t, E.scalar(t, 1.0, dt), z), E.scalar(t, 0.0, dt))
    return E.mul(t, d, f)


@vjp_rule(ir.FakeQuantizeBackward)
def _fq_bwd(g, node, dy):
    """dx = m(x) * d: self-adjoint in d. Identity / ClippedIdentity masks are piecewise
    constant (x gets none); Tanh / HardTanh factors are differentiated in primitives."""
    from rlx_jax.ir.op import SteKind
    from rlx_jax.ir.ops_backward import FakeQuantizeBackward

    op = node.op
    if op.ste in (SteKind.Tanh, SteKind.HardTanh):
        return vjp_via_expansion(g, node, dy, lambda t, ins: _fq_bwd_expansion(t, op, ins))
    x, d = node.inputs
    return [None, g.add_node(FakeQuantizeBackward(bits=op.bits, axis=op.axis, ste=op.ste), (x, dy))]


@vjp_rule(ir.FakeQuantizeLSQBackwardX)
def _lsq_bwd_x(g, node, dy):
    """dx = 1[x/s inside the range] * d: self-adjoint in d; x and s get none (a.e.)."""
    from rlx_jax.ir.ops_backward import FakeQuantizeLSQBackwardX

    x, s, d = node.inputs
    op = node.op
    return [None, None, g.add_node(FakeQuantizeLSQBackwardX(bits=op.bits, axis=op.axis), (x, s, dy))]


def _lsq_bwd_scale_expansion(t, op, ins):
    """dscale[c] = sum over channel c of d * psi(z), z = x / max(s, 1e-12),
    psi(z) = round(z) - z for |z| <= q, sign(z) q outside; in primitives.

    round(z), sign(z) and the inside mask are piecewise constant: they are held
    constant (StopGradient; the Round activation's own rule would be the
    straight-through 1), so d psi / dz = -1 inside and 0 outside, the derivative the
    JAX side's backward primitive has. Hence d/dd = psi, d/dx = -d / s inside and
    d/ds = d x / s^2 inside."""
    from rlx_jax.ir.ops_elementwise import StopGradient

    x, sc, d = ins
    dt = E.dtype(t, x)
    r = E.shape(t, x).rank
    q = float(2 ** (op.bits - 1) - 1)
    a = None if op.axis is None else E.norm_axis(op.axis, r)
    s_eff = E.binary(t, BinaryOp.Max, sc, E.scalar(t, 1e-12, E.dtype(t, sc)))
    if a is not None:
        s_eff = E.reshape(t, s_eff, tuple(E.dims(t, sc)[0] if i == a else 1 for i in range(r)))
    z = E.div(t, x, E.cast(t, s_eff, dt))

    def const(v):
        return t.add_node(StopGradient(), (v,))

    inside = E.cmp(t, "Le", E.act(t, "Abs", z), E.scalar(t, q, dt))
    sign = E.where(t, E.cmp(t, "Gt", z, E.scalar(t, 0, dt)), E.scalar(t, q, dt),
                   E.where(t, E.cmp(t, "Lt", z, E.scalar(t, 0, dt)), E.scalar(t, -q, dt), E.scalar(t, 0, dt)))
    psi = E.where(t, inside, E.sub(t, const(E.act(t, "Round", z)), z), sign)
    rest = tuple(i for i in range(r) if i != a)
    out = E.sum_(t, E.mul(t, E.cast(t, d, dt), psi), rest)
    return E.cast(t, E.reshape(t, out, E.dims(t, sc)), E.dtype(t, sc))


vjp_rule(ir.FakeQuantizeLSQBackwardScale)(_expanding(_lsq_bwd_scale_expansion))


def _log_mel_bwd(t, op, ins):
    """dS = (d / m * [m > 1e-10]) @ F^T with m = S @ F."""
    from .rules_linalg import matmul, t_last_2

    spec, fb, d = ins
    m = matmul(t, spec, fb)
    dt = E.dtype(t, m)
    eps = E.scalar(t, 1e-10, dt)
    live = E.cmp(t, "Gt", m, eps)
    q = E.where(t, live, E.div(t, d, E.binary(t, BinaryOp.Max, m, eps)), E.scalar(t, 0, dt))
    return matmul(t, q, t_last_2(t, fb))


vjp_rule(ir.LogMelBackward)(_expanding(_log_mel_bwd))


# -- scans ----------------------------------------------------------------------------------

def _scan_bwd_unrolled(t, op, ins, which):
    """ScanBackward(Xs) spelled out: the reverse sweep unrolled over the (static) length,
    ``body_vjp`` inlined at each step. The carry entering step s is ``init`` (s = 0),
    else trajectory row s - 1, or, for a checkpointed scan (0 < K < length, the
    trajectory holds K rows only), carry s recomputed from ``init`` with
    ``forward_body`` (as the lowering does; the trajectory then gets no gradient). The
    upstream has ``length`` rows, or K rows at the checkpoint steps floor(r L / K).
    Returns dinit (``which`` None) or the stacked d xs_which."""
    from rlx_jax.ir.ops_shape import Concat, Narrow

    from .prepare import inline

    if not op.save_trajectory:
        raise GraphError("second-order gradients of a scan need its trajectory (prepare saves it)")
    nx = op.num_xs
    length, k = int(op.length), int(op.num_checkpoints)
    checkpointed = 0 < k < length
    if checkpointed and op.forward_body is None:
        raise GraphError(f"second-order gradients of a scan with {k} of {length} checkpoints need the "
                         "ScanBackward's forward_body to recompute the carries")
    init, traj, up = ins[0], ins[1], ins[2]
    xs = ins[3:3 + nx]
    up_rows = E.dims(t, up)[0]
    ck_rows = [r * length // k for r in range(k)] if checkpointed else []
    if up_rows != length and not (checkpointed and up_rows == k):
        raise GraphError(f"ScanBackward upstream has {up_rows} rows; expected {length}"
                         + (f" or {k}" if checkpointed else ""))

    def row(a, s):
        ds = E.dims(t, a)
        return E.reshape(t, t.add_node(Narrow(axis=0, start=s, len=1), (a,)), tuple(ds[1:]))

    if checkpointed:
        carries = [init]
        for s in range(length - 1):
            (c,) = inline(t, op.forward_body, [carries[-1]] + [row(x, s) for x in xs])
            carries.append(E.cast(t, c, E.dtype(t, init)))
    else:
        carries = [init] + [row(traj, s) for s in range(length - 1)]

    def upstream(s):
        if up_rows == length:
            return row(up, s)
        return row(up, ck_rows.index(s)) if s in ck_rows else None

    dc = None
    dx_rows = {i: [None] * length for i in range(nx)}
    for s in range(length - 1, -1, -1):
        u = upstream(s)
        if u is not None:
            dc = u if dc is None else E.add(t, dc, u)
        if dc is None:
            dc = E.zeros(t, E.shape(t, init))
        outs = inline(t, op.body_vjp, [carries[s]] + [row(x, s) for x in xs], {"d_output": dc})
        dc = E.cast(t, outs[0], E.dtype(t, init))
        for i in range(nx):
            dx_rows[i][s] = E.reshape(t, outs[1 + i], (1,) + tuple(E.dims(t, xs[i])[1:]))
    if which is None:
        return dc if dc is not None else E.zeros(t, E.shape(t, init))
    parts = dx_rows[which]
    return parts[0] if len(parts) == 1 else t.add_node(Concat(axis=0), tuple(parts))


vjp_rule(ir.ScanBackward)(_expanding(lambda t, op, ins: _scan_bwd_unrolled(t, op, ins, None)))
vjp_rule(ir.ScanBackwardXs)(_expanding(lambda t, op, ins: _scan_bwd_unrolled(t, op, ins, op.xs_idx)))
