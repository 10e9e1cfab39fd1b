"""LayerNorm: ``y = (x - mean) * rsqrt(var + eps) * gamma + beta`` over one axis.

Shapes: x [..., H, ...] normalised over ``axis`` (size H); gamma, beta [H]. Internally
the normalised axis is moved last and every other axis is a row: x [R, H].

With ``xhat = (x - mean) * rstd``, ``rstd = 1/sqrt(mean((x - mean)^2) + eps)``:

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``layer_norm_fwd``: (x, gamma, beta) -> (y, mean [R], rstd [R]);
- ``layer_norm_tangent``: (x, gamma, mean, rstd, tx, tgamma, tbeta) -> ty, linear in
  the tangents: ``ty = rstd * (tx - mean(tx) - xhat * mean(xhat * tx)) * gamma
  + xhat * tgamma + tbeta``; its transpose is the backward;
- ``layer_norm_bwd``: (x, gamma, mean, rstd, dy) -> (dx, dgamma, dbeta) with
  ``u = dy * gamma``, ``dx = rstd * (u - mean(u) - xhat * mean(u * xhat))``,
  ``dgamma = sum_rows(dy * xhat)``, ``dbeta = sum_rows(dy)``; one kernel, one read of
  x and dy.

RLX's LayerNormBackwardInput [x, gamma, dy] and LayerNormBackwardGamma [x, dy] (beta's
gradient is the row sum of dy) lower through ``layer_norm_backward``, which calls the
same ``layer_norm_bwd`` primitive.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import (
    NOT_MAPPED, FusedPrimitive, RowPartition, instantiate, np_scalar, rowwise_batching,
)
from rlx_jax.vjp_rules.rms_norm import cuda_bwd_scratch_size as rms_cuda_bwd_scratch_size
from rlx_jax.vjp_rules.rms_norm import promoted_dtype, static_eps


def stat_dtype(dtype):
    """Saved statistics are f32, or f64 for f64 inputs."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def row_moments(x, eps):
    """(mean, rstd) over the last axis, accumulated in the statistics dtype."""
    xf = x.astype(stat_dtype(x.dtype))
    mean = jnp.mean(xf, axis=-1)
    var = jnp.mean(jnp.square(xf - mean[..., None]), axis=-1)
    return mean, jax.lax.rsqrt(var + eps)


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_layer_norm(x, gamma, beta, *, eps):
    """Plain JAX over the last axis with f32 (f64) accumulation; returns (y, mean, rstd)."""
    mean, rstd = row_moments(x, eps)
    acc = mean.dtype
    xhat = (x.astype(acc) - mean[..., None]) * rstd[..., None]
    y = xhat * gamma.astype(acc) + beta.astype(acc)
    return y.astype(x.dtype), mean, rstd


def reference_layer_norm_tangent(x, gamma, mean, rstd, tx, tgamma, tbeta, *, eps):
    """d y for tangents (tx, tgamma, tbeta) at fixed (x, gamma): the statistics move
    with x, ``d xhat = rstd * (tx - mean(tx) - xhat * mean(xhat * tx))``."""
    acc = rstd.dtype
    r = rstd[..., None]
    xhat = (x.astype(acc) - mean[..., None]) * r
    txf = tx.astype(acc)
    dxhat = r * (txf - jnp.mean(txf, axis=-1, keepdims=True)
                 - xhat * jnp.mean(xhat * txf, axis=-1, keepdims=True))
    ty = dxhat * gamma.astype(acc) + xhat * tgamma.astype(acc) + tbeta.astype(acc)
    return (ty.astype(x.dtype),)


def reference_layer_norm_bwd(x, gamma, mean, rstd, dy, *, eps):
    acc = rstd.dtype
    r = rstd[..., None]
    xhat = (x.astype(acc) - mean[..., None]) * r
    dyf = dy.astype(acc)
    u = dyf * gamma.astype(acc)
    dx = r * (u - jnp.mean(u, axis=-1, keepdims=True)
              - xhat * jnp.mean(u * xhat, axis=-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    dgamma = jnp.sum(dyf * xhat, axis=rows)
    dbeta = jnp.sum(dyf, axis=rows)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


# ---- kernels ---------------------------------------------------------------------------


def _kernel_fwd(x, gamma, beta, *, eps):
    stat = jax.ShapeDtypeStruct(x.shape[:-1], stat_dtype(x.dtype))
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), stat, stat)
    return jax.ffi.ffi_call(ffi_target("rlx_layer_norm_fwd"), out)(x, gamma, beta, eps=np_scalar(eps, np.float64))


def _kernel_bwd(x, gamma, mean, rstd, dy, *, eps):
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p)
    return jax.ffi.ffi_call(ffi_target("rlx_layer_norm_bwd"), out)(x, gamma, mean, rstd, dy)


def cuda_bwd_scratch_size(rows: int, width: int) -> int:
    """f32 elements of the CUDA backward's scratch result: per-block partial sums of
    dgamma and dbeta ([P, 2, width], P at most 1024 blocks, rows and 2^23 / (2 width))
    followed by two f32 per row (the wide-row path's sum(u) and sum(u * xhat)); the
    same layout and size as RMSNorm's."""
    return rms_cuda_bwd_scratch_size(rows, width)


def _kernel_bwd_cuda(x, gamma, mean, rstd, dy, *, eps):
    """The CUDA call: as ``_kernel_bwd`` plus an f32 scratch result (XLA allocates it;
    the kernel allocates nothing), dropped after the call."""
    rows = math.prod(x.shape[:-1])
    scratch = jax.ShapeDtypeStruct((cuda_bwd_scratch_size(rows, x.shape[-1]),), jnp.float32)
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p, scratch)
    dx, dg, db, _ = jax.ffi.ffi_call(ffi_target("rlx_layer_norm_bwd"), out)(x, gamma, mean, rstd, dy)
    return dx, dg, db


# Under SPMD sharding the rows split across devices; dgamma / dbeta are psum'd.
layer_norm_fwd = FusedPrimitive(
    "rlx_layer_norm_fwd", reference_layer_norm, target="rlx_layer_norm_fwd", kernel=_kernel_fwd,
    partition=RowPartition(row_args=(0,), row_outputs=(0,), stat_outputs=(1, 2)),
)
layer_norm_tangent = FusedPrimitive("rlx_layer_norm_tangent", reference_layer_norm_tangent)
layer_norm_bwd = FusedPrimitive(
    "rlx_layer_norm_bwd", reference_layer_norm_bwd, target="rlx_layer_norm_bwd",
    kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda},
    partition=RowPartition(row_args=(0, 4), stat_args=(2, 3), row_outputs=(0,)),
)


# ---- differentiation rules -------------------------------------------------------------


@layer_norm_fwd.def_jvp
def _fwd_jvp(primals, tangents, *, eps):
    x, gamma, beta = primals
    tx, tg, tb = instantiate(tangents, primals)
    y, mean, rstd = layer_norm_fwd(x, gamma, beta, eps=eps)
    (ty,) = layer_norm_tangent(x, gamma, mean, rstd, tx, tg, tb, eps=eps)
    # statistics' tangents, needed only when they are differentiated themselves:
    # d mean = mean(tx), d rstd = -rstd^3 * mean((x - mean) * tx)
    txf = tx.astype(rstd.dtype)
    t_mean = jnp.mean(txf, axis=-1)
    t_rstd = -(rstd**3) * jnp.mean((x.astype(rstd.dtype) - mean[..., None]) * txf, axis=-1)
    return (y, mean, rstd), (ty, t_mean, t_rstd)


@layer_norm_tangent.def_transpose
def _tangent_transpose(cts, x, gamma, mean, rstd, tx, tg, tb, *, eps):
    for residual in (x, gamma, mean, rstd):
        if ad.is_undefined_primal(residual):
            raise ValueError("layer_norm tangent is linear in (tx, tgamma, tbeta) only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None] * 4 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (tx, tg, tb)]
    dx, dg, db = layer_norm_bwd(x, gamma, mean, rstd, ct, eps=eps)
    return [None] * 4 + [d if ad.is_undefined_primal(t) else None for d, t in zip((dx, dg, db), (tx, tg, tb))]


layer_norm_fwd.def_batching(rowwise_batching(layer_norm_fwd, row_args=(0,)))
layer_norm_tangent.def_batching(rowwise_batching(layer_norm_tangent, row_args=(0, 2, 3, 4)))


@layer_norm_bwd.def_batching
def _bwd_batch(args, dims, *, eps):
    """Per-example backward: dx through the kernel over all rows; the parameter
    gradients reduced within each batch element."""
    x, gamma, mean, rstd, dy = args
    if dims[1] is not NOT_MAPPED:
        return layer_norm_bwd._reference_batch(args, dims, eps=eps)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)

    def front(a, d):
        return jnp.broadcast_to(a, (size, *a.shape)) if d is NOT_MAPPED else jnp.moveaxis(a, d, 0)

    x, mean, rstd, dy = (front(a, d) for a, d in zip((x, mean, rstd, dy), (dims[0], *dims[2:])))
    dx, _, _ = layer_norm_bwd(x, gamma, mean, rstd, dy, eps=eps)
    acc = rstd.dtype
    rows = tuple(range(1, x.ndim - 1))
    dyf = dy.astype(acc)
    xhat = (x.astype(acc) - mean[..., None]) * rstd[..., None]
    dg = jnp.sum(dyf * xhat, axis=rows).astype(gamma.dtype)
    db = jnp.sum(dyf, axis=rows).astype(gamma.dtype)
    return [dx, dg, db], [0, 0, 0]


# ---- public functions ------------------------------------------------------------------


def _prepare(x, gamma, beta, axis, eps, who="layer_norm"):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{who}: x must have at least one axis")
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{who}: axis {axis!r} out of range for x of rank {x.ndim}")
    axis = axis % x.ndim
    width = x.shape[axis]
    gamma = jnp.asarray(gamma)
    named = -1 if axis == x.ndim - 1 else axis  # how the message names the axis: the last as -1
    if gamma.shape != (width,):
        raise ValueError(f"{who}: gamma must have shape ({width},) (x.shape[{named}]), got {gamma.shape}")
    has_beta = beta is not None
    beta = jnp.zeros((width,), x.dtype) if beta is None else jnp.asarray(beta)
    if beta.shape != (width,):
        raise ValueError(f"{who}: beta must have shape ({width},) (x.shape[{named}]), got {beta.shape}")
    for name, p in (("gamma", gamma), ("beta", beta)):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {p.dtype}")
    dtype = promoted_dtype(x, gamma, beta if has_beta else None)
    return x.astype(dtype), gamma.astype(dtype), beta.astype(dtype), axis


def layer_norm(x, gamma, beta=None, *, axis: int = -1, eps: float = 1e-5):
    """``(x - mean) * rsqrt(var + eps) * gamma + beta`` with mean and (biased) var
    taken over ``axis``.

    x: any shape, normalised over ``axis``; gamma, beta: [x.shape[axis]] (beta may be
    None: no shift). The result's dtype is ``jnp.result_type(x, gamma[, beta])`` (as
    flax's LayerNorm: bf16 x with f32 gamma computes and returns f32; x's gradient comes
    back in x's dtype); statistics accumulate in f32 (f64 for f64). ``eps`` is a static
    number (a traced eps raises TypeError). Differentiable in every mode; reverse mode runs
    the fused backward kernel (dx, dgamma, dbeta in one pass). Under SPMD sharding it runs
    shard-local over every axis but ``axis``.
    """
    eps = static_eps(eps, "layer_norm")
    x, gamma, beta, axis = _prepare(x, gamma, beta, axis, eps)
    xt = jnp.moveaxis(x, axis, -1)
    y, _, _ = layer_norm_fwd(xt, gamma, beta, eps=eps)
    return jnp.moveaxis(y, -1, axis)


def layer_norm_backward(x, gamma, beta, dy, *, axis: int = -1, eps: float = 1e-5):
    """RLX's LayerNormBackwardInput and LayerNormBackwardGamma (and beta's gradient, the
    row sum of dy) in one call: returns (dx, dgamma, dbeta) for upstream gradient dy
    (shaped like x), in the dtypes of x, gamma and gamma (computed in the promoted dtype,
    as ``layer_norm``). The statistics are recomputed from x (the RLX ops take no saved
    statistics); the gradients come from the fused ``layer_norm_bwd`` kernel.

    ``gamma=None`` stands for ones: LayerNormBackwardGamma [x, dy] has no gamma input,
    and dgamma, dbeta do not depend on it (dx then is that of gamma = 1)."""
    if gamma is None:
        x = jnp.asarray(x)
        gamma = jnp.ones((x.shape[axis] if x.ndim and -x.ndim <= axis < x.ndim else 0,), x.dtype)
    eps = static_eps(eps, "layer_norm_backward")
    xdt = jnp.asarray(x).dtype
    x, gamma_c, beta, axis = _prepare(x, gamma, beta, axis, eps, who="layer_norm_backward")
    dy = jnp.asarray(dy)
    if dy.shape != x.shape:
        raise ValueError(f"layer_norm_backward: dy shape {dy.shape} differs from x shape {x.shape}")
    dy = dy.astype(x.dtype)
    xt, dyt = jnp.moveaxis(x, axis, -1), jnp.moveaxis(dy, axis, -1)
    mean, rstd = row_moments(xt, eps)
    dx, dg, db = layer_norm_bwd(xt, gamma_c, mean, rstd, dyt, eps=eps)
    gdt = jnp.asarray(gamma).dtype
    return jnp.moveaxis(dx, -1, axis).astype(xdt), dg.astype(gdt), db.astype(gdt)
