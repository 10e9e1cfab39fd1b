"""RMSNorm: ``y = x * rsqrt(mean(x^2, axis) + eps) * gamma + beta``.

Shapes: x [..., H, ...] normalised over ``axis`` (size H); gamma, beta [H]. Internally
the normalised axis is moved last and every other axis is a row: x [R, H].

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``rms_norm_fwd``: (x, gamma, beta) -> (y, rstd [R]), rstd = 1/sqrt(mean(x^2) + eps);
- ``rms_norm_tangent``: (x, gamma, rstd, tx, tgamma, tbeta) -> ty, linear in the
  tangents; its transpose is the backward;
- ``rms_norm_bwd``: (x, gamma, rstd, dy) -> (dx, dgamma, dbeta) with u = dy * gamma,
  dx = rstd * u - x * rstd^3 * sum(u * x) / H, dgamma = sum_rows(dy * x * rstd),
  dbeta = sum_rows(dy);
- ``rms_norm_bwd_y`` / ``add_rms_norm_bwd_y``: (x, gamma, beta, dy[, dres]) -> (dx,
  dgamma, dbeta, y), the backward with rstd recomputed from x that also returns the
  forward's y (for a caller that kept no y: ``rms_norm_linear``'s backward); on CUDA one
  kernel pass writes y from the rows it reads, elsewhere the forward runs again.

The residual add + RMSNorm of a pre-norm transformer, s = x + residual, y = rms_norm(s),
has its own three (``add_rms_norm``): the forward returns s with y and rstd; the tangent
gives (ts, ty) together; and the backward, given the gradients of both outputs, returns
ds = dres + (the norm's dx) from one kernel (``rlx_add_rms_norm_bwd``), so the residual
stream's gradient is never summed by a separate pass. With s and y from two separate ops
the gradient of s arrives as two cotangents that XLA adds in its own kernel (a read of
three and a write of one [rows, H] tensor per norm; about 50-60 us per norm of a
16384 x 2048 bf16 step on an H200).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import (
    NOT_MAPPED, FusedPrimitive, RowPartition, instantiate, np_scalar, rowwise_batching, static_shape,
)


def _stat_dtype(dtype):
    """Saved statistics are f32, or f64 for f64 inputs."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_rms_norm(x, gamma, beta, *, eps):
    """Plain JAX over the last axis with f32 (f64) accumulation; returns (y, rstd)."""
    acc = _stat_dtype(x.dtype)
    xf = x.astype(acc)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    y = xf * rstd[..., None] * gamma.astype(acc) + beta.astype(acc)
    return y.astype(x.dtype), rstd


def reference_rms_norm_tangent(x, gamma, rstd, tx, tgamma, tbeta, *, eps):
    """d y for tangents (tx, tgamma, tbeta): with d rstd = -rstd^3 * mean(x * tx),
    ty = tx*rstd*gamma + x*(d rstd)*gamma + x*rstd*tgamma + tbeta."""
    acc = rstd.dtype
    xf, g, r = x.astype(acc), gamma.astype(acc), rstd[..., None]
    txf = tx.astype(acc)
    dr = -(r**3) * jnp.mean(xf * txf, axis=-1, keepdims=True)
    ty = txf * r * g + xf * dr * g + xf * r * tgamma.astype(acc) + tbeta.astype(acc)
    return (ty.astype(x.dtype),)


def _reference_bwd_acc(x, gamma, rstd, dy):
    """(dx, dgamma, dbeta) in the statistics' dtype, before rounding."""
    acc = rstd.dtype
    xf, g, dyf, r = x.astype(acc), gamma.astype(acc), dy.astype(acc), rstd[..., None]
    u = dyf * g
    dot = jnp.sum(u * xf, axis=-1, keepdims=True)
    dx = r * u - xf * r**3 * dot / x.shape[-1]
    rows = tuple(range(x.ndim - 1))
    return dx, jnp.sum(dyf * xf * r, axis=rows), jnp.sum(dyf, axis=rows)


def reference_rms_norm_bwd(x, gamma, rstd, dy, *, eps):
    dx, dgamma, dbeta = _reference_bwd_acc(x, gamma, rstd, dy)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


def reference_add_rms_norm(x, residual, gamma, beta, *, eps):
    """(s, y, rstd): s = x + residual (rounded to x's dtype, as the step's own add would),
    then the norm of s."""
    s = x + residual
    y, rstd = reference_rms_norm(s, gamma, beta, eps=eps)
    return s, y, rstd


def reference_add_rms_norm_tangent(s, gamma, rstd, tx, tres, tgamma, tbeta, *, eps):
    """(ts, ty): ts = tx + tres, ty the norm's tangent at s for (ts, tgamma, tbeta)."""
    ts = tx + tres
    (ty,) = reference_rms_norm_tangent(s, gamma, rstd, ts, tgamma, tbeta, eps=eps)
    return ts, ty


def reference_add_rms_norm_bwd(s, gamma, rstd, dy, dres, *, eps):
    """(ds, dgamma, dbeta): ds = dres + the norm's dx, added before rounding (as the kernels)."""
    dx, dgamma, dbeta = _reference_bwd_acc(s, gamma, rstd, dy)
    ds = dx + dres.astype(dx.dtype)
    return ds.astype(s.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


# ---- kernels ---------------------------------------------------------------------------


def _kernel_fwd(x, gamma, beta, *, eps):
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], _stat_dtype(x.dtype)))
    return jax.ffi.ffi_call(ffi_target("rlx_rms_norm_fwd"), out)(x, gamma, beta, eps=np_scalar(eps, np.float64))


def _bwd_call(target, x, gamma, *operands, cuda=False):
    """(dx, dgamma, dbeta) from backward target ``target`` on (x, gamma, *operands); on CUDA
    (``cuda``) the call also returns an f32 scratch result (XLA allocates it; the kernel
    allocates nothing), dropped after the call."""
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p)
    if cuda:
        rows = math.prod(x.shape[:-1])
        out += (jax.ShapeDtypeStruct((cuda_bwd_scratch_size(rows, x.shape[-1]),), jnp.float32),)
    return tuple(jax.ffi.ffi_call(ffi_target(target), out)(x, gamma, *operands)[:3])


def _kernel_bwd(x, gamma, rstd, dy, *, eps):
    return _bwd_call("rlx_rms_norm_bwd", x, gamma, rstd, dy)


def _kernel_bwd_cuda(x, gamma, rstd, dy, *, eps):
    return _bwd_call("rlx_rms_norm_bwd", x, gamma, rstd, dy, cuda=True)


def cuda_bwd_scratch_size(rows: int, width: int) -> int:
    """f32 elements of the CUDA backward's scratch result: per-block partial sums of
    dgamma and dbeta ([P, 2, width], P at most 1024 blocks, rows and 2^23 / (2 width))
    followed by two f32 per row (the wide-row path's row dot products, and a per-row slot
    the scratch layout shared with the kernels reserves)."""
    if width == 0:
        return 2 * rows
    parts = max(1, min(1024, (1 << 23) // (2 * width)))
    if static_shape((rows,)):
        parts = min(parts, max(rows, 1))
    # a symbolic row count (jax.export) keeps the bound without rows: the kernel takes the
    # most parts the scratch holds, capped at rows, so it picks the same parts either way
    return parts * 2 * width + 2 * rows


def _kernel_add_fwd(x, residual, gamma, beta, *, eps):
    """The sum in XLA (an elementwise fusion it may merge with the producer of residual),
    the norm in the forward kernel. CPU only: on CUDA the forward lowers the reference,
    which XLA fuses into passes that read x and residual once and write s and y, where this
    pair writes s and reads it back (16384 x 2048 on an H200: 100 against 103 us in bf16,
    176 against 186 in f32; ``benchmarks.run --cases rms_norm --filter add_rms``)."""
    s = x + residual
    y, rstd = _kernel_fwd(s, gamma, beta, eps=eps)
    return s, y, rstd


def _kernel_add_bwd(s, gamma, rstd, dy, dres, *, eps):
    return _bwd_call("rlx_add_rms_norm_bwd", s, gamma, rstd, dy, dres)


def _kernel_add_bwd_cuda(s, gamma, rstd, dy, dres, *, eps):
    return _bwd_call("rlx_add_rms_norm_bwd", s, gamma, rstd, dy, dres, cuda=True)


# Under SPMD sharding the rows split across devices; dgamma / dbeta are psum'd.
rms_norm_fwd = FusedPrimitive(
    "rlx_rms_norm_fwd", reference_rms_norm, target="rlx_rms_norm_fwd", kernel=_kernel_fwd,
    partition=RowPartition(row_args=(0,), row_outputs=(0,), stat_outputs=(1,)),
)
rms_norm_tangent = FusedPrimitive("rlx_rms_norm_tangent", reference_rms_norm_tangent)
rms_norm_bwd = FusedPrimitive(
    "rlx_rms_norm_bwd",
    reference_rms_norm_bwd,
    target="rlx_rms_norm_bwd",
    kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda},
    partition=RowPartition(row_args=(0, 3), stat_args=(2,), row_outputs=(0,)),
)
add_rms_norm_fwd = FusedPrimitive(
    "rlx_add_rms_norm_fwd", reference_add_rms_norm, target="rlx_rms_norm_fwd", kernel={"cpu": _kernel_add_fwd},
    partition=RowPartition(row_args=(0, 1), row_outputs=(0, 1), stat_outputs=(2,)),
)
add_rms_norm_tangent = FusedPrimitive("rlx_add_rms_norm_tangent", reference_add_rms_norm_tangent)
add_rms_norm_bwd = FusedPrimitive(
    "rlx_add_rms_norm_bwd",
    reference_add_rms_norm_bwd,
    target="rlx_add_rms_norm_bwd",
    kernel={"cpu": _kernel_add_bwd, "cuda": _kernel_add_bwd_cuda},
    partition=RowPartition(row_args=(0, 3, 4), stat_args=(2,), row_outputs=(0,)),
)


# ---- the backward that also returns the forward's y -----------------------------------------
# For a backward that keeps no y from the forward (rms_norm_linear's): y for the weight
# gradients and the norm's gradients from one pass over x. rstd is recomputed from x.


def reference_rms_norm_bwd_y(x, gamma, beta, dy, *dres, eps):
    """(dx, dgamma, dbeta, y): the forward run again for (y, rstd), then the backward
    (``add_rms_norm_bwd`` with the residual gradient ``dres`` when given); both through
    their primitives, so their kernels where registered."""
    y, rstd = rms_norm_fwd(x, gamma, beta, eps=eps)
    if dres:
        dx, dgamma, dbeta = add_rms_norm_bwd(x, gamma, rstd, dy, dres[0], eps=eps)
    else:
        dx, dgamma, dbeta = rms_norm_bwd(x, gamma, rstd, dy, eps=eps)
    return dx, dgamma, dbeta, y


def _kernel_bwd_y_cuda(x, gamma, beta, dy, *dres, eps):
    """One CUDA kernel pass where the rows fit its staged form (16-bit and f32 rows of up to
    tens of KiB on sm_90): y is written from the row of x the backward holds."""
    rows = math.prod(x.shape[:-1])
    like_x = jax.ShapeDtypeStruct(x.shape, x.dtype)
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    scratch = jax.ShapeDtypeStruct((cuda_bwd_scratch_size(rows, x.shape[-1]),), jnp.float32)
    target = "rlx_add_rms_norm_bwd_y" if dres else "rlx_rms_norm_bwd_y"
    call = jax.ffi.ffi_call(ffi_target(target), (like_x, p, p, like_x, scratch))
    return tuple(call(x, gamma, beta, dy, *dres, eps=np_scalar(eps))[:4])


rms_norm_bwd_y = FusedPrimitive(
    "rlx_rms_norm_bwd_y", reference_rms_norm_bwd_y, target="rlx_rms_norm_bwd_y",
    kernel={"cuda": _kernel_bwd_y_cuda},
    partition=RowPartition(row_args=(0, 3), row_outputs=(0, 3)),
)
add_rms_norm_bwd_y = FusedPrimitive(
    "rlx_add_rms_norm_bwd_y", reference_rms_norm_bwd_y, target="rlx_add_rms_norm_bwd_y",
    kernel={"cuda": _kernel_bwd_y_cuda},
    partition=RowPartition(row_args=(0, 3, 4), row_outputs=(0, 3)),
)


# ---- differentiation rules -------------------------------------------------------------


@rms_norm_fwd.def_jvp
def _fwd_jvp(primals, tangents, *, eps):
    x, gamma, beta = primals
    tx, tg, tb = instantiate(tangents, primals)
    y, rstd = rms_norm_fwd(x, gamma, beta, eps=eps)
    (ty,) = rms_norm_tangent(x, gamma, rstd, tx, tg, tb, eps=eps)
    # d rstd = -rstd^3 * mean(x * tx): only needed when rstd itself is differentiated
    t_rstd = -(rstd**3) * jnp.mean(x.astype(rstd.dtype) * tx.astype(rstd.dtype), axis=-1)
    return (y, rstd), (ty, t_rstd)


@rms_norm_tangent.def_transpose
def _tangent_transpose(cts, x, gamma, rstd, tx, tg, tb, *, eps):
    for residual in (x, gamma, rstd):
        if ad.is_undefined_primal(residual):
            raise ValueError("rms_norm tangent is linear in (tx, tgamma, tbeta) only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None, None] + [
            ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (tx, tg, tb)
        ]
    dx, dg, db = rms_norm_bwd(x, gamma, rstd, ct, eps=eps)
    return [None, None, None] + [
        d if ad.is_undefined_primal(t) else None for d, t in zip((dx, dg, db), (tx, tg, tb))
    ]


rms_norm_fwd.def_batching(rowwise_batching(rms_norm_fwd, row_args=(0,)))
rms_norm_tangent.def_batching(rowwise_batching(rms_norm_tangent, row_args=(0, 2, 3)))


def _rows_bwd_batching(prim):
    """Per-example backward (operands x, gamma, rstd, dy[, dres]): dx through the kernel over
    all rows; the parameter gradients reduced within each batch element."""

    def rule(args, dims, *, eps):
        if dims[1] is not NOT_MAPPED:
            return prim._reference_batch(args, dims, eps=eps)
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)

        def front(a, d):
            return jnp.broadcast_to(a, (size, *a.shape)) if d is NOT_MAPPED else jnp.moveaxis(a, d, 0)

        gamma = args[1]
        x, rstd, dy, *rest = [front(a, d) for i, (a, d) in enumerate(zip(args, dims)) if i != 1]
        dx, _, _ = prim(x, gamma, rstd, dy, *rest, eps=eps)
        acc = rstd.dtype
        rows = tuple(range(1, x.ndim - 1))
        dyf = dy.astype(acc)
        dg = jnp.sum(dyf * x.astype(acc) * rstd[..., None], axis=rows).astype(gamma.dtype)
        db = jnp.sum(dyf, axis=rows).astype(gamma.dtype)
        return [dx, dg, db], [0, 0, 0]

    return rule


rms_norm_bwd.def_batching(_rows_bwd_batching(rms_norm_bwd))
add_rms_norm_bwd.def_batching(_rows_bwd_batching(add_rms_norm_bwd))


@add_rms_norm_fwd.def_jvp
def _add_fwd_jvp(primals, tangents, *, eps):
    x, res, gamma, beta = primals
    tx, tres, tg, tb = instantiate(tangents, primals)
    s, y, rstd = add_rms_norm_fwd(x, res, gamma, beta, eps=eps)
    # ts and ty come from one linear primitive, so that its transpose receives both
    # cotangents and sums them inside the backward kernel
    ts, ty = add_rms_norm_tangent(s, gamma, rstd, tx, tres, tg, tb, eps=eps)
    t_rstd = -(rstd**3) * jnp.mean(s.astype(rstd.dtype) * ts.astype(rstd.dtype), axis=-1)
    return (s, y, rstd), (ts, ty, t_rstd)


@add_rms_norm_tangent.def_transpose
def _add_tangent_transpose(cts, s, gamma, rstd, tx, tres, tg, tb, *, eps):
    for residual in (s, gamma, rstd):
        if ad.is_undefined_primal(residual):
            raise ValueError("add_rms_norm tangent is linear in (tx, tres, tgamma, tbeta) only")
    ct_s, ct_y = cts
    zero_s, zero_y = type(ct_s) is ad.Zero, type(ct_y) is ad.Zero
    linear = (tx, tres, tg, tb)
    if zero_s and zero_y:
        return [None, None, None] + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in linear]
    if zero_y:  # only the sum is used: its gradient passes to x and residual, none to the norm
        ds, dg, db = ct_s, jnp.zeros(gamma.shape, gamma.dtype), jnp.zeros(gamma.shape, gamma.dtype)
    elif zero_s:  # only the norm is used
        ds, dg, db = rms_norm_bwd(s, gamma, rstd, ct_y, eps=eps)
    else:
        ds, dg, db = add_rms_norm_bwd(s, gamma, rstd, ct_y, ct_s, eps=eps)
    return [None, None, None] + [
        d if ad.is_undefined_primal(t) else None for d, t in zip((ds, ds, dg, db), linear)
    ]


add_rms_norm_fwd.def_batching(rowwise_batching(add_rms_norm_fwd, row_args=(0, 1)))
add_rms_norm_tangent.def_batching(rowwise_batching(add_rms_norm_tangent, row_args=(0, 2, 3, 4)))


# ---- public functions ------------------------------------------------------------------


def static_eps(eps, who):
    """eps as a Python float >= 0. The kernels take it as a compile-time constant, so a
    traced eps is refused with an error naming it."""
    try:
        value = float(eps)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(f"{who}: eps must be a static number (a compile-time constant of the kernels), got a "
                        "traced value: pass it as a static argument (jit's static_argnums, or a closure)") from None
    except TypeError:
        raise TypeError(f"{who}: eps must be a real number, got {eps!r}") from None
    if not value >= 0:
        raise ValueError(f"{who}: eps must be >= 0, got {eps}")
    return value


def promoted_dtype(x, gamma, beta=None):
    """The dtype a norm computes and returns in: ``jnp.result_type`` of x and its parameters
    (as flax.nnx's RMSNorm / LayerNorm do): bf16 x with f32 gamma gives f32, f32 x with
    bf16 gamma f32."""
    return jnp.result_type(*(a.dtype for a in (x, gamma, beta) if a is not None))


def _prepare(x, gamma, beta, axis, who="rms_norm"):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{who}: x must have at least one axis")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{who}: axis {axis} out of range for x of rank {x.ndim}")
    axis = axis % x.ndim
    width = x.shape[axis]
    gamma = jnp.asarray(gamma)
    named = -1 if axis == x.ndim - 1 else axis  # how the message names the axis: the last as -1
    if gamma.shape != (width,):
        raise ValueError(f"{who}: gamma must have shape ({width},) (x.shape[{named}]), got {gamma.shape}")
    beta = None if beta is None else jnp.asarray(beta)
    if beta is not None and beta.shape != (width,):
        raise ValueError(f"{who}: beta must have shape ({width},) (x.shape[{named}]), got {beta.shape}")
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None and not jnp.issubdtype(p.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {p.dtype}")
    dtype = promoted_dtype(x, gamma, beta)
    beta = jnp.zeros((width,), dtype) if beta is None else beta
    return x.astype(dtype), gamma.astype(dtype), beta.astype(dtype), axis


def rms_norm(x, gamma, beta=None, *, axis: int = -1, eps: float = 1e-6):
    """``x * rsqrt(mean(x^2, axis) + eps) * gamma (+ beta)``.

    x: any shape, normalised over ``axis``; gamma, beta: [x.shape[axis]] (beta optional).
    The result's dtype is ``jnp.result_type(x, gamma[, beta])`` (as flax's RMSNorm: bf16
    x with f32 gamma computes and returns f32; x's gradient comes back in x's dtype);
    statistics accumulate in f32 (f64 for f64). ``eps`` is a static number (a traced eps
    raises TypeError). Differentiable in every mode; reverse mode runs the fused backward
    kernel. Under SPMD sharding it runs shard-local over every axis but ``axis``.
    """
    eps = static_eps(eps, "rms_norm")
    x, gamma, beta, axis = _prepare(x, gamma, beta, axis)
    xt = jnp.moveaxis(x, axis, -1)
    y, _ = rms_norm_fwd(xt, gamma, beta, eps=eps)
    return jnp.moveaxis(y, -1, axis)


def rms_norm_backward(x, gamma, beta, dy, *, axis: int = -1, eps: float = 1e-6):
    """The RLX backward ops RmsNormBackwardInput/Gamma/Beta in one call:
    returns (dx, dgamma, dbeta) for upstream gradient dy (shaped like x), in the dtypes
    of x, gamma and gamma (computed in the promoted dtype, as ``rms_norm``)."""
    eps = static_eps(eps, "rms_norm_backward")
    xdt = jnp.asarray(x).dtype
    x, gamma_c, beta, axis = _prepare(x, gamma, beta, axis, "rms_norm_backward")
    dy = jnp.asarray(dy, x.dtype)
    if dy.shape != x.shape:
        raise ValueError(f"rms_norm_backward: dy shape {dy.shape} differs from x shape {x.shape}")
    xt, dyt = jnp.moveaxis(x, axis, -1), jnp.moveaxis(dy, axis, -1)
    acc = _stat_dtype(x.dtype)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xt.astype(acc)), axis=-1) + eps)
    dx, dg, db = rms_norm_bwd(xt, gamma_c, rstd, dyt, eps=eps)
    gdt = jnp.asarray(gamma).dtype
    return jnp.moveaxis(dx, -1, axis).astype(xdt), dg.astype(gdt), db.astype(gdt)


def add_rms_norm(x, residual, gamma, beta=None, *, axis: int = -1, eps: float = 1e-6):
    """The residual add and RMSNorm of a pre-norm transformer block, fused:
    returns ``(s, y)`` with ``s = x + residual`` and ``y = rms_norm(s, gamma, beta)``.

    x, residual: one shape, normalised over ``axis``; gamma, beta: [x.shape[axis]] (beta
    optional). s and y are in ``jnp.result_type(x, residual, gamma[, beta])``; statistics
    accumulate in f32 (f64 for f64); ``eps`` is static, as in ``rms_norm``. Reverse mode
    runs one backward kernel that takes the gradients of both outputs: the gradient of s
    (the residual stream past this block) is added to the norm's input gradient inside it,
    in f32, before the result is rounded once; x and residual both receive that sum.
    Differentiable in every mode; under SPMD sharding it runs shard-local over every axis
    but ``axis``.

    A decoder written with it carries the residual stream through the ``s`` outputs::

        x, h = add_rms_norm(x, attention_out, attn_norm)   # x: the stream, h: the MLP input
    """
    eps = static_eps(eps, "add_rms_norm")
    x = jnp.asarray(x)
    residual = jnp.asarray(residual)
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: residual shape {residual.shape} differs from x shape {x.shape}")
    if not jnp.issubdtype(residual.dtype, jnp.floating):
        raise TypeError(f"add_rms_norm: residual must be floating point, got {residual.dtype}")
    x, gamma, beta, axis = _prepare(x, gamma, beta, axis, "add_rms_norm")
    dtype = jnp.result_type(x.dtype, residual.dtype)
    x, gamma, beta = x.astype(dtype), gamma.astype(dtype), beta.astype(dtype)
    xt, rt = jnp.moveaxis(x, axis, -1), jnp.moveaxis(residual.astype(dtype), axis, -1)
    s, y, _ = add_rms_norm_fwd(xt, rt, gamma, beta, eps=eps)
    return jnp.moveaxis(s, -1, axis), jnp.moveaxis(y, -1, axis)
