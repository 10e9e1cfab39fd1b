"""Graph VJP rules of the fused-op families: norms, attention, RoPE, conv / pool,
quantisation, FFT, log-mel. Each emits RLX's closed-form backward op(s)."""

from __future__ import annotations

import math

import numpy as np

from rlx_jax.ir import DType, GraphError, Shape
from rlx_jax.ir.op import AttentionBwdWrt, ReduceOp
from rlx_jax.ir.ops_backward import (
    AttentionBackward, BatchNormInferenceBackwardBeta, BatchNormInferenceBackwardGamma,
    BatchNormInferenceBackwardInput, Conv2dBackwardInput, Conv2dBackwardWeight,
    FakeQuantizeBackward, FakeQuantizeLSQBackwardScale, FakeQuantizeLSQBackwardX,
    GroupNormBackwardBeta, GroupNormBackwardGamma, GroupNormBackwardInput,
    LayerNormBackwardGamma, LayerNormBackwardInput, MaxPool2dBackward, RmsNormBackwardBeta,
    RmsNormBackwardGamma, RmsNormBackwardInput, RopeBackward,
)
from rlx_jax.ir.ops_conv import Conv
from rlx_jax.ir.ops_signal import Fft, LogMelBackward
from rlx_jax import ir

from . import emit as E
from .expansion import vjp_via_expansion
from .table import vjp_rule


# -- norms ---------------------------------------------------------------------------

@vjp_rule(ir.LayerNorm)
def _layer_norm(g, node, dy):
    x, gamma, beta = node.inputs
    ax, eps = node.op.axis, node.op.eps
    xs = E.shape(g, x)
    a = E.norm_axis(ax, xs.rank)
    dx = g.add_node(LayerNormBackwardInput(axis=ax, eps=eps), (x, gamma, dy))
    dg = g.add_node(LayerNormBackwardGamma(axis=ax, eps=eps), (x, dy))
    db = E.sum_(g, dy, tuple(i for i in range(xs.rank) if i != a))   # gamma/beta: [x.shape[axis]]
    return [dx, dg, db]


@vjp_rule(ir.RmsNorm)
def _rms_norm(g, node, dy):
    ins = tuple(node.inputs) + (dy,)
    kw = dict(axis=node.op.axis, eps=node.op.eps)
    return [g.add_node(RmsNormBackwardInput(**kw), ins), g.add_node(RmsNormBackwardGamma(**kw), ins),
            g.add_node(RmsNormBackwardBeta(**kw), ins)]


@vjp_rule(ir.GroupNorm)
def _group_norm(g, node, dy):
    x, gamma, beta = node.inputs
    kw = dict(num_groups=node.op.num_groups, eps=node.op.eps)
    return [g.add_node(GroupNormBackwardInput(**kw), (x, gamma, beta, dy)),
            g.add_node(GroupNormBackwardGamma(**kw), (x, dy)),
            g.add_node(GroupNormBackwardBeta(**kw), (x, dy))]


def _per_channel(g, p, rank):
    """[C] -> [1, C, 1, ...] for broadcasting against NC... tensors."""
    c = E.dims(g, p)[0]
    return E.reshape(g, p, (1, c) + (1,) * (rank - 2))


@vjp_rule(ir.BatchNormInference)
def _batch_norm(g, node, dy):
    x, gamma, beta, mean, var = node.inputs
    eps = node.op.eps
    r = E.shape(g, x).rank
    dx = g.add_node(BatchNormInferenceBackwardInput(eps=eps), (x, gamma, mean, var, dy))
    dg = g.add_node(BatchNormInferenceBackwardGamma(eps=eps), (x, mean, var, dy))
    db = g.add_node(BatchNormInferenceBackwardBeta(), (dy,))
    # running statistics: y = (x - m) * gamma * (v + eps)^-1/2 + beta
    axes = (0,) + tuple(range(2, r))
    rstd = E.act(g, "Rsqrt", E.add_s(g, var, eps))               # [C]
    sdy = E.sum_(g, dy, axes)                                      # [C]
    dmean = E.neg(g, E.mul(g, E.mul(g, sdy, gamma), rstd))
    xc = E.sub(g, x, _per_channel(g, mean, r))
    sxdy = E.sum_(g, E.mul(g, dy, xc), axes)                       # [C]
    r3 = E.mul(g, E.mul(g, rstd, rstd), rstd)
    dvar = E.mul_s(g, E.mul(g, E.mul(g, sxdy, gamma), r3), -0.5)
    return [dx, dg, db, dmean, dvar]


@vjp_rule(ir.LayerNorm2d)
def _layer_norm_2d(g, node, dy):
    """NCHW, normalised over C per position: the LayerNorm backward ops on the NHWC view."""
    x, gamma, beta = node.inputs
    eps = node.op.eps
    xt = E.transpose(g, x, (0, 2, 3, 1))
    dyt = E.transpose(g, dy, (0, 2, 3, 1))
    dxt = g.add_node(LayerNormBackwardInput(axis=3, eps=eps), (xt, gamma, dyt))
    dg = g.add_node(LayerNormBackwardGamma(axis=3, eps=eps), (xt, dyt))
    return [E.transpose(g, dxt, (0, 3, 1, 2)), dg, E.sum_(g, dy, (0, 2, 3))]


# -- attention / position -------------------------------------------------------------

@vjp_rule(ir.Attention)
def _attention(g, node, dy):
    """AttentionBackward (one per q / k / v) when it can express the op: any mask kind
    and score_scale (through a rescaled q). With a logit softcap it cannot (RLX's
    AttentionBackward has no softcap field; adding one would break RLX compatibility),
    so the gradient is expanded in primitives (``rules_attention``, O(S^2) memory)."""
    op = node.op
    q, k, v = node.inputs[:3]
    mask = tuple(node.inputs[3:])
    if op.attn_logit_softcap is not None or getattr(op, "segment_ids", None) or getattr(op, "sinks", None):
        # softcap, segment ids and sinks have no AttentionBackward field: expanded
        from .rules_attention import attention_softcap_vjp

        return attention_softcap_vjp(g, node, dy)
    # AttentionBackward uses scale 1/sqrt(head_dim); a score_scale s is honoured by
    # feeding q * (s * sqrt(head_dim)) and scaling dq by the same factor.
    c = None
    if op.score_scale is not None:
        c = float(op.score_scale) * math.sqrt(op.head_dim)
        if abs(c - 1.0) < 1e-15:
            c = None
    qq = q if c is None else E.mul_s(g, q, c)
    kw = dict(num_heads=op.num_heads, head_dim=op.head_dim, mask_kind=op.mask_kind)
    grads = [g.add_node(AttentionBackward(wrt=w, **kw), (qq, k, v, dy) + mask)
             for w in (AttentionBwdWrt.Query, AttentionBwdWrt.Key, AttentionBwdWrt.Value)]
    if c is not None:
        grads[0] = E.mul_s(g, grads[0], c)
    if op.mask_kind.kind == "Bias":
        from .rules_attention import attention_bias_grad

        return grads + [attention_bias_grad(g, node, dy)]
    return grads + [None] * len(mask)


@vjp_rule(ir.Rope)
def _rope(g, node, dy):
    x, cos, sin = node.inputs
    dc, ds = rope_table_grads(g, x, dy, E.shape(g, cos), node.op.head_dim, node.op.n_rot)
    return [g.add_node(RopeBackward(head_dim=node.op.head_dim, n_rot=node.op.n_rot), (dy, cos, sin)), dc, ds]


def rope_table_grads(g, x, dy, table, head_dim, n_rot):
    """d cos, d sin of NeoX RoPE on x [..., S, H*D]: with a = x[:half], b = x[half:n_rot]
    per head, dcos = sum(dy_a a + dy_b b), dsin = sum(dy_b a - dy_a b) over batch and
    heads; table columns >= n_rot/2 are not read (zero gradient)."""
    from rlx_jax.ir.ops_shape import Concat, Narrow

    ds_ = E.dims(g, x)
    lead, s, w = tuple(ds_[:-2]), ds_[-2], ds_[-1]
    h, half = w // head_dim, n_rot // 2
    shp = lead + (s, h, head_dim)
    xh, dh = E.reshape(g, x, shp), E.reshape(g, dy, shp)
    ax = len(shp) - 1

    def part(v, start):
        return g.add_node(Narrow(axis=ax, start=start, len=half), (v,))

    a, b, da, db = part(xh, 0), part(xh, half), part(dh, 0), part(dh, half)
    red = tuple(range(len(lead))) + (len(lead) + 1,)
    dc = E.sum_(g, E.add(g, E.mul(g, da, a), E.mul(g, db, b)), red)       # [S, half]
    dsn = E.sum_(g, E.sub(g, E.mul(g, db, a), E.mul(g, da, b)), red)
    t = table.dims[1]
    if t > half:
        z = E.zeros(g, Shape((s, t - half), E.dtype(g, dc)))
        dc = g.add_node(Concat(axis=1), (dc, z))
        dsn = g.add_node(Concat(axis=1), (dsn, z))
    return dc, dsn


# -- conv / pool ------------------------------------------------------------------------

def _conv_kw(op):
    return dict(kernel_size=tuple(op.kernel_size), stride=tuple(op.stride), padding=tuple(op.padding),
                dilation=tuple(op.dilation), groups=op.groups)


@vjp_rule(ir.Conv)
def _conv(g, node, dy):
    x, w = node.inputs
    if len(node.op.kernel_size) != 2:
        raise GraphError(f"node %{node.id} Conv: RLX's backward ops cover 2-D convolution only")
    kw = _conv_kw(node.op)
    dx = g.add_node(Conv2dBackwardInput(**kw), (dy, w), E.shape(g, x))
    dw = g.add_node(Conv2dBackwardWeight(**kw), (x, dy))
    return [dx, dw]


@vjp_rule(ir.ConvTranspose2d)
def _conv_transpose(g, node, dy):
    """y = conv_transpose(x, w) is the input-gradient of conv(., w): its VJP w.r.t. x is
    the direct conv of dy with w, w.r.t. w the conv weight gradient with x as dy."""
    x, w = node.inputs
    op = node.op
    kw = dict(kernel_size=tuple(op.kernel_size), stride=tuple(op.stride), padding=tuple(op.padding),
              dilation=tuple(op.dilation), groups=op.groups)
    dx = g.add_node(Conv(**kw), (dy, w))
    dw = g.add_node(Conv2dBackwardWeight(**kw), (dy, x))
    return [dx, dw]


@vjp_rule(ir.Pool)
def _pool(g, node, dy):
    (x,) = node.inputs
    op = node.op
    if op.kind is ReduceOp.Max:
        return [g.add_node(MaxPool2dBackward(kernel_size=tuple(op.kernel_size), stride=tuple(op.stride),
                                             padding=tuple(op.padding)), (x, dy))]
    # Mean (count_include_pad): the input gradient of a depthwise conv with weight 1/(kh kw)
    xs = E.shape(g, x)
    c = xs.dims[1]
    if not isinstance(c, int):
        raise GraphError(f"node %{node.id} Pool Mean: reverse mode needs a static channel dim")
    kh, kw_ = op.kernel_size
    w = E.const(g, np.full((c, 1, kh, kw_), 1.0 / (kh * kw_)), xs.dtype)
    return [g.add_node(Conv2dBackwardInput(kernel_size=(kh, kw_), stride=tuple(op.stride),
                                           padding=tuple(op.padding), dilation=(1, 1), groups=c),
                       (dy, w), xs)]


# -- quantisation ---------------------------------------------------------------------

@vjp_rule(ir.FakeQuantize)
def _fake_quantize(g, node, dy):
    x = node.inputs[0]
    op = node.op
    dx = g.add_node(FakeQuantizeBackward(bits=op.bits, axis=op.axis, ste=op.ste), (x, dy))
    return [dx] + [None] * (len(node.inputs) - 1)


@vjp_rule(ir.FakeQuantizeLSQ)
def _fake_quantize_lsq(g, node, dy):
    x, s = node.inputs
    kw = dict(bits=node.op.bits, axis=node.op.axis)
    return [g.add_node(FakeQuantizeLSQBackwardX(**kw), (x, s, dy)),
            g.add_node(FakeQuantizeLSQBackwardScale(**kw), (x, s, dy))]


# -- signal ------------------------------------------------------------------------------

@vjp_rule(ir.Fft)
def _fft(g, node, dy):
    """``y = s W z`` with ``W`` the unscaled DFT (``exp(-+2 pi i jk / N)``), ``s`` the
    norm's scale for this direction, z complex [..., N] or the real block [re | im]
    [..., 2N].

    * Real block: the op is the real linear map ``M = [[Re W, -Im W], [Im W, Re W]]``;
      its transpose is ``[[Re W, Im W], [-Im W, Re W]]``, the real block of ``conj(W)``:
      the DFT in the opposite direction, with the same scale ``s``.
    * Complex (JAX's cotangent convention, see ``reverse.py``): the transpose
      ``s W^T = s W`` (W is symmetric), the same direction.
    """
    from rlx_jax.lowering.signal import fft_scale

    op = node.op
    x = node.inputs[0]
    complex_in = E.dtype(g, x) == DType.C64
    inverse = bool(op.inverse) if complex_in else not bool(op.inverse)
    dz = g.add_node(Fft(inverse=inverse, norm=op.norm), (dy,))
    n = E.dims(g, x)[-1] if complex_in else E.dims(g, x)[-1] // 2
    ratio = fft_scale(op.norm, n, bool(op.inverse)) / fft_scale(op.norm, n, inverse)
    return [dz if ratio == 1.0 else E.mul_s(g, dz, ratio)]


@vjp_rule(ir.LogMel)
def _log_mel(g, node, dy):
    spec, fb = node.inputs
    dfb = vjp_via_expansion(g, node, dy, _log_mel_primitives, wrt_inputs=[1])[1]
    return [g.add_node(LogMelBackward(), (spec, fb, dy)), dfb]


def _log_mel_primitives(t, ins):
    """y = log(max(spectrum @ filterbank, 1e-10)) in primitive ops."""
    from rlx_jax.ir.op import BinaryOp

    from .rules_linalg import matmul

    spec, fb = ins
    m = matmul(t, spec, fb)
    return E.act(t, "Log", E.binary(t, BinaryOp.Max, m, E.scalar(t, 1e-10, E.dtype(t, m))))


@vjp_rule(ir.AxialRope2d)
def _axial_rope(g, node, dy):
    """A rotation of interleaved (even, odd) pairs: R^T = S R S with S negating the odd
    element of each pair, so dx = S * AxialRope2d(S * dy)."""
    (x,) = node.inputs
    xs = E.shape(g, x)
    width = xs.dims[-1]
    sign = E.const(g, np.tile(np.array([1.0, -1.0]), width // 2), xs.dtype)
    return [E.mul(g, g.add_node(node.op, (E.mul(g, dy, sign),)), sign)]


# -- Gaussian splatting ---------------------------------------------------------------------

#: backward options of the emitted GaussianSplatRenderBackward: all off, so the graph
#: gradient is the exact derivative of the render, the one ``jax.grad`` of the lowered
#: GaussianSplatRender gives (loss_grad_clip 0 and max_anisotropy 0 switch those off;
#: sh_band 3 keeps the gradient of all (3 + 1)^2 = 16 SH coefficients, the most a
#: Gaussian has). RLX's own rule uses its training defaults (1.0, 0, 10.0); build a
#: GaussianSplatRenderBackward node directly to get those.
SPLAT_EXACT_BACKWARD = dict(loss_grad_clip=0.0, sh_band=3, max_anisotropy=0.0)

_SPLAT_FIELDS = ("width", "height", "tile_size", "radius_scale", "alpha_cutoff", "max_splat_steps",
                 "transmittance_threshold", "max_list_entries")


@vjp_rule(ir.GaussianSplatRender)
def _gaussian_splat_render(g, node, dy):
    """One GaussianSplatRenderBackward (the fused backward kernel) gives the packed
    scene gradient ``[positions 3N | scales 3N | rotations 4N | opacities N | colors 3N
    | sh]``; Narrow unpacks it. meta gets zeros (RLX's rule; the render is not
    differentiable in the camera)."""
    from rlx_jax.ir.ops_shape import Narrow
    from rlx_jax.ir.ops_splat import GaussianSplatRenderBackward

    op = node.op
    kw = {f: getattr(op, f) for f in _SPLAT_FIELDS}
    packed = g.add_node(GaussianSplatRenderBackward(**kw, **SPLAT_EXACT_BACKWARD), tuple(node.inputs) + (dy,))
    out, start = [], 0
    for i in node.inputs[:6]:
        ln = E.dims(g, i)[0]
        out.append(g.add_node(Narrow(axis=0, start=start, len=ln), (packed,)) if ln else E.zeros_like(g, i))
        start += ln
    return out + [E.zeros_like(g, node.inputs[6])]


@vjp_rule(ir.GaussianSplatRenderBackward)
def _gaussian_splat_render_backward(g, node, dy):
    """Second order of the render. RLX has no op for the derivative of its splat
    backward, so this emits rlx_jax's own Custom op (``jax_custom.py``):
    ``rlx_jax.gaussian_splat_render_backward_vjp``: one node packing the six scene
    cotangents (unpacked with Narrow) and one for the image cotangent ``dy``, each
    lowering to ``jax.vjp`` of the backward (all of its options honoured) and
    differentiable again by the same mechanism. The ``dy``
    node is the render's forward mode (J t), which is how ``rlx_jax.jvp`` / ``hvp``
    (built on the transposition identity, no separate JVP table) reach the render.
    meta gets zeros. Such graphs run through ``to_jax``; RLX itself would need these
    Custom ops registered to run them."""
    from .jax_custom import SPLAT_BACKWARD, emit_vjp

    op = node.op
    params = {f: getattr(op, f) for f in _SPLAT_FIELDS}
    params.update(loss_grad_clip=float(op.loss_grad_clip), sh_band=int(op.sh_band),
                  max_anisotropy=float(op.max_anisotropy))
    for f in ("width", "height", "tile_size", "max_splat_steps", "max_list_entries"):
        params[f] = int(params[f])
    for f in ("radius_scale", "alpha_cutoff", "transmittance_threshold"):
        params[f] = float(params[f])
    return emit_vjp(g, SPLAT_BACKWARD, params, [], list(node.inputs), dy)
