"""BatchNorm in inference mode: ``y = (x - mean) * rsqrt(var + eps) * gamma + beta`` with
per-channel running statistics given as inputs (channel axis 1).

Shapes: x [N, C, *spatial] (any number of trailing axes, zero included); gamma, beta,
mean, var [C]. With ``rstd = rsqrt(var + eps)`` and ``s = gamma * rstd`` the op is an
affine map of x per channel, so its gradients are closed-form:
``dx = s * dy``, ``dgamma = rstd * sum(dy * (x - mean))``, ``dbeta = sum(dy)``,
``dmean = -s * dbeta``, ``dvar = -gamma * rstd^2 * dgamma / 2`` (sums over every axis
but the channel axis).

Primitives:
- ``batch_norm_inference_fwd``: (x, gamma, beta, mean, var) -> (y,); its reference is
  one elementwise XLA fusion, already a single read of x and write of y, so it has no
  kernel of its own;
- ``batch_norm_inference_tangent``: (x, gamma, mean, var, tx, tgamma, tbeta, tmean,
  tvar) -> ty, linear in the tangents; its transpose calls the backward;
- ``batch_norm_inference_bwd``: (x, gamma, mean, var, dy) -> (dx, dgamma, dbeta), the
  RLX ops BatchNormInferenceBackwardInput / Gamma / Beta; CPU and CUDA kernel
  ``rlx_batch_norm_inference_bwd`` (one read of x and dy; the CUDA call adds an f32
  scratch result for its deterministic two-stage channel sums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, Partition, instantiate, np_scalar
from rlx_jax.vjp_rules.group_norm import merge_samples
from rlx_jax.vjp_rules.layer_norm import stat_dtype


def _chan(p, ndim):
    """[C] -> [C, 1, ...] broadcasting against [N, C, *spatial] of rank ``ndim``."""
    return p.reshape(p.shape + (1,) * (ndim - 2))


def _stats(gamma, var, eps, acc):
    """(rstd, scale = gamma * rstd) [C] in the accumulation dtype."""
    rstd = jax.lax.rsqrt(var.astype(acc) + eps)
    return rstd, gamma.astype(acc) * rstd


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_batch_norm_inference(x, gamma, beta, mean, var, *, eps):
    acc = stat_dtype(x.dtype)
    rstd, _ = _stats(gamma, var, eps, acc)
    n = x.ndim
    y = (x.astype(acc) - _chan(mean.astype(acc), n)) * _chan(rstd, n) * _chan(gamma.astype(acc), n)
    return ((y + _chan(beta.astype(acc), n)).astype(x.dtype),)


def reference_batch_norm_inference_tangent(x, gamma, mean, var, tx, tgamma, tbeta, tmean, tvar, *, eps):
    """``ty = s*(tx - tmean) + (x - mean) * (rstd*tgamma - gamma*rstd^3*tvar/2) + tbeta``."""
    acc = stat_dtype(x.dtype)
    rstd, s = _stats(gamma, var, eps, acc)
    n = x.ndim
    xc = x.astype(acc) - _chan(mean.astype(acc), n)
    coef = rstd * tgamma.astype(acc) - 0.5 * gamma.astype(acc) * rstd**3 * tvar.astype(acc)
    ty = _chan(s, n) * (tx.astype(acc) - _chan(tmean.astype(acc), n)) + xc * _chan(coef, n)
    return ((ty + _chan(tbeta.astype(acc), n)).astype(x.dtype),)


def reference_batch_norm_inference_bwd(x, gamma, mean, var, dy, *, eps):
    acc = stat_dtype(x.dtype)
    rstd, s = _stats(gamma, var, eps, acc)
    n = x.ndim
    dyf = dy.astype(acc)
    axes = (0, *range(2, n))
    dx = dyf * _chan(s, n)
    dgamma = rstd * jnp.sum(dyf * (x.astype(acc) - _chan(mean.astype(acc), n)), axis=axes)
    dbeta = jnp.sum(dyf, axis=axes)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


# ---- kernels ---------------------------------------------------------------------------


def _kernel_bwd(x, gamma, mean, var, dy, *, eps):
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p)
    call = jax.ffi.ffi_call(ffi_target("rlx_batch_norm_inference_bwd"), out)
    return call(x, gamma, mean, var, dy, eps=np_scalar(eps, np.float64))


def cuda_bwd_scratch_size(shape) -> int:
    """f32 elements of the CUDA backward's scratch result for x of ``shape`` [N, C, S..]:
    two partial sums (dgamma, dbeta) per entry of ffi/cuda/channel_reduce.cuh's plan for
    the view [1, N, C, S] (S >= 32: one per 4096-element segment of a plane; else one per
    (chunk of max(16, ceil(N / 256)) samples, column)). At least 1."""
    n, c = shape[0], shape[1]
    s = 1
    for d in shape[2:]:
        s *= d
    if s >= 32:
        per_sum = n * c * -(-s // 4096)
    else:
        rpc = max(16, -(-n // 256))
        per_sum = -(-n // rpc) * c * s
    return max(1, 2 * per_sum)


def _kernel_bwd_cuda(x, gamma, mean, var, dy, *, eps):
    """The CUDA call: as ``_kernel_bwd`` plus an f32 scratch result (XLA allocates it;
    the kernel allocates nothing), dropped after the call."""
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    scratch = jax.ShapeDtypeStruct((cuda_bwd_scratch_size(x.shape),), jnp.float32)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p, scratch)
    call = jax.ffi.ffi_call(ffi_target("rlx_batch_norm_inference_bwd"), out)
    dx, dg, db, _ = call(x, gamma, mean, var, dy, eps=np_scalar(eps, np.float64))
    return dx, dg, db


batch_norm_inference_fwd = FusedPrimitive("rlx_batch_norm_inference_fwd", reference_batch_norm_inference)
batch_norm_inference_tangent = FusedPrimitive(
    "rlx_batch_norm_inference_tangent", reference_batch_norm_inference_tangent
)
def _partition_factors(avals_in, avals_out, **params):
    """SPMD axes of the backward (x, gamma, mean, var, dy) -> (dx, dgamma, dbeta): x, dy
    and dx are (n, c, spatial...) and may split along n and the spatial axes (the
    channel statistics are per-channel constants); dgamma / dbeta are psum'd."""
    spatial = tuple(f"s{i}" for i in range(len(avals_in[0].shape) - 2))
    x = ("n", "c") + spatial
    return [x, ("gc",), ("mc",), ("vc",), x], [x, ("dgc",), ("dbc",)]


batch_norm_inference_bwd = FusedPrimitive(
    "rlx_batch_norm_inference_bwd",
    reference_batch_norm_inference_bwd,
    target="rlx_batch_norm_inference_bwd",
    kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda},
    partition=Partition(_partition_factors, shardable=["n"] + [f"s{i}" for i in range(8)]),
    static_only=("cuda",),
)


# ---- differentiation rules -------------------------------------------------------------


@batch_norm_inference_fwd.def_jvp
def _fwd_jvp(primals, tangents, *, eps):
    x, gamma, beta, mean, var = primals
    tx, tg, tb, tm, tv = instantiate(tangents, primals)
    (y,) = batch_norm_inference_fwd(x, gamma, beta, mean, var, eps=eps)
    (ty,) = batch_norm_inference_tangent(x, gamma, mean, var, tx, tg, tb, tm, tv, eps=eps)
    return (y,), (ty,)


@batch_norm_inference_tangent.def_transpose
def _tangent_transpose(cts, x, gamma, mean, var, tx, tg, tb, tm, tv, *, eps):
    for residual in (x, gamma, mean, var):
        if ad.is_undefined_primal(residual):
            raise ValueError("batch_norm_inference tangent is linear in its tangents only")
    tangents = (tx, tg, tb, tm, tv)
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None] * 4 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in tangents]
    dx, dg, db = batch_norm_inference_bwd(x, gamma, mean, var, ct, eps=eps)
    acc = stat_dtype(x.dtype)
    rstd, s = _stats(gamma, var, eps, acc)
    dmean = -s * db.astype(acc)
    dvar = -0.5 * gamma.astype(acc) * rstd * rstd * dg.astype(acc)
    grads = (dx, dg, db, dmean.astype(mean.dtype), dvar.astype(var.dtype))
    return [None] * 4 + [d if ad.is_undefined_primal(t) else None for d, t in zip(grads, tangents)]


@batch_norm_inference_bwd.def_batching
def _bwd_batch(args, dims, *, eps):
    """Per-example backward: dx and the per-channel sums through the kernel over all
    samples when only x and dy are batched; the parameter gradients are then summed
    within each batch element."""
    if any(dims[i] is not NOT_MAPPED for i in (1, 2, 3)):
        return batch_norm_inference_bwd._reference_batch(args, dims, eps=eps)
    (x, gamma, mean, var, dy), size = merge_samples(args, dims, (0, 4))
    dx, _, _ = batch_norm_inference_bwd(x, gamma, mean, var, dy, eps=eps)
    acc = stat_dtype(x.dtype)
    rstd, _ = _stats(gamma, var, eps, acc)
    split = lambda a: a.reshape(size, a.shape[0] // size, *a.shape[1:])  # noqa: E731
    axes = (1, *range(3, x.ndim + 1))
    dyf = dy.astype(acc)
    xc = x.astype(acc) - _chan(mean.astype(acc), x.ndim)
    dg = (rstd * jnp.sum(split(dyf * xc), axis=axes)).astype(gamma.dtype)
    db = jnp.sum(split(dyf), axis=axes).astype(gamma.dtype)
    return [split(dx), dg, db], [0, 0, 0]


# ---- public functions ------------------------------------------------------------------


def _prepare(x, params, eps, who):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{who}: x must be [N, C, *spatial] (rank >= 2), got shape {x.shape}")
    if not eps >= 0:
        raise ValueError(f"{who}: eps must be >= 0, got {eps}")
    channels = x.shape[1]
    out = []
    for name, p in params:
        p = jnp.asarray(p)
        if p.shape != (channels,):
            raise ValueError(f"{who}: {name} must have shape ({channels},) (x.shape[1]), got {p.shape}")
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {p.dtype}")
        out.append(p.astype(x.dtype))
    return x, out


def batch_norm_inference(x, gamma, beta, mean, var, *, eps: float = 1e-5):
    """``(x - mean) * rsqrt(var + eps) * gamma + beta`` per channel of x [N, C, *spatial]
    (channel axis 1) with running statistics ``mean``, ``var`` [C] given as inputs.

    gamma, beta, mean, var are cast to x's dtype; arithmetic in f32 (f64 for f64).
    Differentiable in every mode w.r.t. all five inputs; reverse mode runs the fused
    backward kernel (dx, dgamma, dbeta from one read of x and dy)."""
    x, (gamma, beta, mean, var) = _prepare(
        x, (("gamma", gamma), ("beta", beta), ("mean", mean), ("var", var)), eps, "batch_norm_inference"
    )
    (y,) = batch_norm_inference_fwd(x, gamma, beta, mean, var, eps=float(eps))
    return y


def batch_norm_inference_backward(x, gamma, mean, var, dy, *, eps: float = 1e-5):
    """RLX's BatchNormInferenceBackwardInput / Gamma / Beta in one call: returns
    (dx, dgamma, dbeta) for upstream gradient dy (shaped like x), from the fused
    ``batch_norm_inference_bwd`` kernel. ``gamma=None`` stands for ones
    (BatchNormInferenceBackwardGamma [x, mean, var, dy] has no gamma; dgamma and dbeta do
    not depend on it)."""
    who = "batch_norm_inference_backward"
    if gamma is None:
        x = jnp.asarray(x)
        gamma = jnp.ones((x.shape[1] if x.ndim >= 2 else 0,), x.dtype)
    x, (gamma_c, mean, var) = _prepare(x, (("gamma", gamma), ("mean", mean), ("var", var)), eps, who)
    dy = jnp.asarray(dy)
    if dy.shape != x.shape:
        raise ValueError(f"{who}: dy shape {dy.shape} differs from x shape {x.shape}")
    dx, dg, db = batch_norm_inference_bwd(x, gamma_c, mean, var, dy.astype(x.dtype), eps=float(eps))
    gdt = jnp.asarray(gamma).dtype
    return dx, dg.astype(gdt), db.astype(gdt)
