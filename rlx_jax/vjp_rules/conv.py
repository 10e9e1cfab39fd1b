"""Conv2d (RLX ``Conv``): NCHW input, OIHW weight ``[C_out, C_in/groups, kH, kW]``, no bias.

    y[n, o, i, j] = sum_{c, a, b} x_pad[n, g(o)*C_in/G + c, i*sh + a*dh, j*sw + b*dw] * w[o, c, a, b]

with ``x_pad`` zero-padded by ``padding`` on both sides of H and W, ``g(o) = o // (C_out/G)``,
and output size ``(H + 2 p - d (k - 1) - 1) // s + 1`` per spatial axis.

The forward is XLA's convolution (``lax.conv_general_dilated``). The backward ops RLX
names ``Conv2dBackwardInput`` / ``Conv2dBackwardWeight`` are written once here
(``conv2d_backward_input``, ``conv2d_backward_weight``) as the transposes of the
convolution in x and in w, and the primitive's transpose rule calls them. They also stay
on XLA's convolution: no kernel of ours is compiled for conv (issue 6 asks for one only
where it beats XLA, whose CPU convolution is a tuned library call; see
``benchmarks/cases_conv_pool.py``).

Primitive:
- ``conv2d_p``: (x, w) -> (y,); bilinear, so its JVP is ``conv(tx, w) + conv(x, tw)``
  through the same primitive and its transpose (one operand undefined) is the matching
  backward function. That gives forward mode, reverse mode and every higher order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad

from rlx_jax.vjp_rules._args import int_pair, is_int
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive

_DIMS = ("NCHW", "OIHW", "NCHW")


# ---- reference -------------------------------------------------------------------------


def reference_conv2d(x, w, *, stride, padding, dilation, groups):
    """XLA's convolution: x [N, C_in, H, W], w [C_out, C_in/groups, kH, kW] -> (y,),
    y [N, C_out, H_out, W_out]; f32 accumulation for 16-bit inputs."""
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    y = lax.conv_general_dilated(
        x,
        w,
        window_strides=stride,
        padding=[(p, p) for p in padding],
        rhs_dilation=dilation,
        dimension_numbers=_DIMS,
        feature_group_count=groups,
        preferred_element_type=acc if x.dtype != acc else None,
    )
    return (y.astype(x.dtype),)


conv2d_p = FusedPrimitive("rlx_conv2d", reference_conv2d)


# ---- backward functions (RLX Conv2dBackwardInput / Conv2dBackwardWeight) ---------------


def conv2d_backward_input(dy, w, *, x_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    """dx [x_shape] for upstream dy [N, C_out, H_out, W_out]: the transpose of
    ``x -> conv2d(x, w)`` applied to dy (XLA's transposed convolution)."""
    attrs = _attrs(stride, padding, dilation, groups)
    dy, w = jnp.asarray(dy), jnp.asarray(w)
    return _backward_input(dy, w.astype(dy.dtype), tuple(int(d) for d in x_shape), attrs)


def conv2d_backward_weight(x, dy, *, w_shape, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    """dw [w_shape] for upstream dy [N, C_out, H_out, W_out]: the transpose of
    ``w -> conv2d(x, w)`` applied to dy (XLA's weight-gradient convolution)."""
    attrs = _attrs(stride, padding, dilation, groups)
    x, dy = jnp.asarray(x), jnp.asarray(dy)
    return _backward_weight(x, dy.astype(x.dtype), tuple(int(d) for d in w_shape), attrs)


def _backward_input(dy, w, x_shape, attrs):
    """Plain JAX (differentiable again): lax's transpose of the convolution in x."""
    spec = jax.ShapeDtypeStruct(x_shape, dy.dtype)
    (dx,) = jax.linear_transpose(lambda x: reference_conv2d(x, w, **attrs)[0], spec)(dy)
    return dx


def _backward_weight(x, dy, w_shape, attrs):
    """Plain JAX (differentiable again): lax's transpose of the convolution in w."""
    spec = jax.ShapeDtypeStruct(w_shape, dy.dtype)
    (dw,) = jax.linear_transpose(lambda w: reference_conv2d(x, w, **attrs)[0], spec)(dy)
    return dw


# ---- differentiation rules -------------------------------------------------------------


@conv2d_p.def_jvp
def _conv_jvp(primals, tangents, **attrs):
    x, w = primals
    tx, tw = tangents
    (y,) = conv2d_p(x, w, **attrs)
    terms = []
    if type(tx) is not ad.Zero:
        terms.append(conv2d_p(tx, w, **attrs)[0])
    if type(tw) is not ad.Zero:
        terms.append(conv2d_p(x, tw, **attrs)[0])
    ty = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    return (y,), (ty,)


@conv2d_p.def_transpose
def _conv_transpose(cts, x, w, **attrs):
    """The product rule's two linear terms: dx when x is the undefined (linear) operand,
    dw when w is: the backward functions of RLX's Conv2dBackwardInput / Weight."""
    (ct,) = cts
    if ad.is_undefined_primal(x) and ad.is_undefined_primal(w):
        raise ValueError("conv2d is bilinear: it is linear in x or in w, not in both at once")
    if ad.is_undefined_primal(x):
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval), None]
        return [_backward_input(ct, w, x.aval.shape, attrs), None]
    if type(ct) is ad.Zero:
        return [None, ad.Zero(w.aval)]
    return [None, _backward_weight(x, ct, w.aval.shape, attrs)]


@conv2d_p.def_batching
def _conv_batch(args, dims, **attrs):
    """A batched x with a shared w folds the batch into N and stays one primitive;
    anything else is ``vmap`` of XLA's convolution."""
    x, w = args
    dx, dw = dims
    if dx is NOT_MAPPED or dw is not NOT_MAPPED:
        return conv2d_p._reference_batch(args, dims, **attrs)
    x = jnp.moveaxis(x, dx, 0)
    b, n = x.shape[:2]
    (y,) = conv2d_p(x.reshape((b * n,) + x.shape[2:]), w, **attrs)
    return [y.reshape((b, n) + y.shape[1:])], [0]


# ---- public function -------------------------------------------------------------------


def _attrs(stride, padding, dilation, groups):
    if not is_int(groups) or groups < 1:
        raise ValueError(f"conv2d: groups must be a positive int, got {groups!r}")
    return dict(
        stride=int_pair("conv2d", "stride", stride, 1),
        padding=int_pair("conv2d", "padding", padding, 0),
        dilation=int_pair("conv2d", "dilation", dilation, 1),
        groups=int(groups),
    )


def _check(x, w, attrs):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"conv2d: x must be floating point, got {x.dtype}")
    if x.ndim != 4:
        raise ValueError(f"conv2d: x must be NCHW (rank 4), got shape {x.shape}")
    if w.ndim != 4:
        raise ValueError(f"conv2d: w must be OIHW (rank 4), got shape {w.shape}")
    g = attrs["groups"]
    if x.shape[1] % g or w.shape[0] % g:
        raise ValueError(f"conv2d: groups={g} must divide C_in={x.shape[1]} and C_out={w.shape[0]}")
    if w.shape[1] * g != x.shape[1]:
        raise ValueError(f"conv2d: w.shape[1]={w.shape[1]} must be C_in/groups={x.shape[1] // g}")
    for axis in (0, 1):
        span = attrs["dilation"][axis] * (w.shape[2 + axis] - 1) + 1
        if x.shape[2 + axis] + 2 * attrs["padding"][axis] < span:
            raise ValueError(
                f"conv2d: the dilated kernel ({span}) exceeds the padded input along axis "
                f"{2 + axis} ({x.shape[2 + axis]} + 2*{attrs['padding'][axis]})"
            )


def conv2d(x, w, *, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    """2-D convolution, NCHW input x [N, C_in, H, W], OIHW weight w [C_out, C_in/groups,
    kH, kW], no bias -> [N, C_out, H_out, W_out] with
    H_out = (H + 2 padding - dilation (kH - 1) - 1) // stride + 1 (W likewise).

    w is cast to x's dtype; 16-bit inputs accumulate in f32. Differentiable in every
    mode; the gradients are ``conv2d_backward_input`` / ``conv2d_backward_weight``.
    """
    attrs = _attrs(stride, padding, dilation, groups)
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    _check(x, w, attrs)
    (y,) = conv2d_p(x, w.astype(x.dtype), **attrs)
    return y


def conv2d_backward(x, w, dy, *, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    """RLX's Conv2dBackwardInput and Conv2dBackwardWeight in one call: (dx, dw)."""
    attrs = _attrs(stride, padding, dilation, groups)
    x, w, dy = jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)
    _check(x, w, attrs)
    w = w.astype(x.dtype)
    dy = dy.astype(x.dtype)
    return _backward_input(dy, w, x.shape, attrs), _backward_weight(x, dy, w.shape, attrs)


__all__ = ["conv2d", "conv2d_backward", "conv2d_backward_input", "conv2d_backward_weight", "reference_conv2d"]
