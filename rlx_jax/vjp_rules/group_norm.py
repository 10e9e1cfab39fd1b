"""GroupNorm on NCHW: ``y = (x - mean) * rsqrt(var + eps) * gamma[c] + beta[c]`` with the
statistics of each (sample, group of channels).

Shapes: x [N, C, *spatial] (any number of trailing spatial axes, zero included);
gamma, beta [C]; C = G * K for ``num_groups`` G. Block (n, g) is x[n, g*K:(g+1)*K, ...],
M = K * prod(spatial) values; mean, rstd [N, G] with
``rstd = 1/sqrt(mean((x - mean)^2) + eps)`` and ``xhat = (x - mean) * rstd``.

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``group_norm_fwd``: (x, gamma, beta) -> (y, mean, rstd);
- ``group_norm_tangent``: (x, gamma, mean, rstd, tx, tgamma, tbeta) -> ty, linear in the
  tangents: ``ty = rstd * (tx - mean_blk(tx) - xhat * mean_blk(xhat * tx)) * gamma
  + xhat * tgamma + tbeta``; its transpose is the backward;
- ``group_norm_bwd``: (x, gamma, mean, rstd, dy) -> (dx, dgamma, dbeta) with
  ``u = dy * gamma[c]``, ``dx = rstd * (u - mean_blk(u) - xhat * mean_blk(u * xhat))``,
  ``dgamma[c] = sum_{n, spatial}(dy * xhat)``, ``dbeta[c] = sum_{n, spatial}(dy)``.

RLX's GroupNormBackwardInput [x, gamma, beta, dy], GroupNormBackwardGamma [x, dy] and
GroupNormBackwardBeta [x, dy] lower through ``group_norm_backward`` (same primitive).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, Partition, instantiate, np_scalar
from rlx_jax.vjp_rules.layer_norm import stat_dtype


def _blocks(a, num_groups):
    """[N, C, ...] -> [N, G, K * S] (a view of the groups as rows)."""
    return a.reshape(a.shape[0], num_groups, (a.shape[1] // num_groups) * int(np.prod(a.shape[2:])))


def _per_channel(p, ndim):
    """[C] -> [C, 1, ...] broadcasting against [N, C, *spatial] of rank ``ndim``."""
    return p.reshape(p.shape + (1,) * (ndim - 2))


def block_moments(x, num_groups, eps):
    """(mean, rstd) [N, G] of each (sample, group) block, in the statistics dtype."""
    xb = _blocks(x.astype(stat_dtype(x.dtype)), num_groups)
    mean = jnp.mean(xb, axis=-1)
    var = jnp.mean(jnp.square(xb - mean[..., None]), axis=-1)
    return mean, jax.lax.rsqrt(var + eps)


def _xhat(x, mean, rstd, num_groups):
    """(x - mean) * rstd, [N, C, ...] in the statistics dtype."""
    xb = _blocks(x.astype(rstd.dtype), num_groups)
    return ((xb - mean[..., None]) * rstd[..., None]).reshape(x.shape)


def _block_mean(a, num_groups):
    """Mean over each block, broadcast back to a's shape [N, C, ...]."""
    ab = _blocks(a, num_groups)
    return jnp.broadcast_to(jnp.mean(ab, axis=-1, keepdims=True), ab.shape).reshape(a.shape)


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_group_norm(x, gamma, beta, *, num_groups, eps):
    """Plain JAX with f32 (f64) accumulation; returns (y, mean [N, G], rstd [N, G])."""
    mean, rstd = block_moments(x, num_groups, eps)
    acc = rstd.dtype
    xhat = _xhat(x, mean, rstd, num_groups)
    y = xhat * _per_channel(gamma.astype(acc), x.ndim) + _per_channel(beta.astype(acc), x.ndim)
    return y.astype(x.dtype), mean, rstd


def reference_group_norm_tangent(x, gamma, mean, rstd, tx, tgamma, tbeta, *, num_groups, eps):
    acc = rstd.dtype
    xhat = _xhat(x, mean, rstd, num_groups)
    txf = tx.astype(acc)
    dxhat = txf - _block_mean(txf, num_groups) - xhat * _block_mean(xhat * txf, num_groups)
    dxhat = (_blocks(dxhat, num_groups) * rstd[..., None]).reshape(x.shape)
    ty = (dxhat * _per_channel(gamma.astype(acc), x.ndim) + xhat * _per_channel(tgamma.astype(acc), x.ndim)
          + _per_channel(tbeta.astype(acc), x.ndim))
    return (ty.astype(x.dtype),)


def reference_group_norm_bwd(x, gamma, mean, rstd, dy, *, num_groups, eps):
    acc = rstd.dtype
    xhat = _xhat(x, mean, rstd, num_groups)
    dyf = dy.astype(acc)
    u = dyf * _per_channel(gamma.astype(acc), x.ndim)
    dxb = _blocks(u - _block_mean(u, num_groups) - xhat * _block_mean(u * xhat, num_groups), num_groups)
    dx = (dxb * rstd[..., None]).reshape(x.shape)
    axes = (0, *range(2, x.ndim))
    dgamma = jnp.sum(dyf * xhat, axis=axes)
    dbeta = jnp.sum(dyf, axis=axes)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


# ---- kernels ---------------------------------------------------------------------------


def _kernel_fwd(x, gamma, beta, *, num_groups, eps):
    stat = jax.ShapeDtypeStruct((x.shape[0], num_groups), stat_dtype(x.dtype))
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), stat, stat)
    return jax.ffi.ffi_call(ffi_target("rlx_group_norm_fwd"), out)(
        x, gamma, beta, num_groups=np.int64(num_groups), eps=np_scalar(eps, np.float64)
    )


def _kernel_bwd(x, gamma, mean, rstd, dy, *, num_groups, eps):
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p)
    return jax.ffi.ffi_call(ffi_target("rlx_group_norm_bwd"), out)(x, gamma, mean, rstd, dy, num_groups=np.int64(num_groups))


def cuda_bwd_scratch_size(n: int, channels: int, num_groups: int) -> int:
    """f32 elements of the CUDA backward's scratch result: per (sample, channel) sums
    of dy and dy * (x - mean) ([2, N, C]), then per (sample, group) mean(u) and
    mean(u * xhat) ([2, N, G])."""
    return 2 * n * channels + 2 * n * num_groups


def _kernel_bwd_cuda(x, gamma, mean, rstd, dy, *, num_groups, eps):
    """The CUDA call: as ``_kernel_bwd`` plus an f32 scratch result (XLA allocates it;
    the kernel allocates nothing), dropped after the call."""
    scratch = jax.ShapeDtypeStruct((cuda_bwd_scratch_size(x.shape[0], x.shape[1], num_groups),), jnp.float32)
    p = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p, scratch)
    dx, dg, db, _ = jax.ffi.ffi_call(ffi_target("rlx_group_norm_bwd"), out)(
        x, gamma, mean, rstd, dy, num_groups=np.int64(num_groups)
    )
    return dx, dg, db


def _partition_factors(avals_in, avals_out, **params):
    """SPMD axes: x / dy / y / dx are (n, c, spatial...), the saved statistics (n, group);
    only the batch axis n may be split (a group spans channels and the whole image);
    dgamma / dbeta lack n, so they are psum'd across it."""
    spatial = tuple(f"s{i}" for i in range(len(avals_in[0].shape) - 2))
    x = ("n", "c") + spatial
    stat = ("n", "grp")
    if len(avals_in) == 3:  # forward: x, gamma, beta -> y, mean, rstd
        return [x, ("gc",), ("bc",)], [x, stat, stat]
    return [x, ("gc",), stat, stat, x], [x, ("dgc",), ("dbc",)]  # backward


_PARTITION = Partition(_partition_factors, shardable=["n"])

group_norm_fwd = FusedPrimitive(
    "rlx_group_norm_fwd", reference_group_norm, target="rlx_group_norm_fwd", kernel=_kernel_fwd,
    partition=_PARTITION,
)
group_norm_tangent = FusedPrimitive("rlx_group_norm_tangent", reference_group_norm_tangent)
group_norm_bwd = FusedPrimitive(
    "rlx_group_norm_bwd", reference_group_norm_bwd, target="rlx_group_norm_bwd",
    kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda},
    partition=_PARTITION,
)


# ---- differentiation rules -------------------------------------------------------------


@group_norm_fwd.def_jvp
def _fwd_jvp(primals, tangents, *, num_groups, eps):
    x, gamma, beta = primals
    tx, tg, tb = instantiate(tangents, primals)
    y, mean, rstd = group_norm_fwd(x, gamma, beta, num_groups=num_groups, eps=eps)
    (ty,) = group_norm_tangent(x, gamma, mean, rstd, tx, tg, tb, num_groups=num_groups, eps=eps)
    # d mean = mean_blk(tx), d rstd = -rstd^3 * mean_blk((x - mean) * tx)
    txb = _blocks(tx.astype(rstd.dtype), num_groups)
    xc = _blocks(x.astype(rstd.dtype), num_groups) - mean[..., None]
    t_mean = jnp.mean(txb, axis=-1)
    t_rstd = -(rstd**3) * jnp.mean(xc * txb, axis=-1)
    return (y, mean, rstd), (ty, t_mean, t_rstd)


@group_norm_tangent.def_transpose
def _tangent_transpose(cts, x, gamma, mean, rstd, tx, tg, tb, *, num_groups, eps):
    for residual in (x, gamma, mean, rstd):
        if ad.is_undefined_primal(residual):
            raise ValueError("group_norm tangent is linear in (tx, tgamma, tbeta) only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None] * 4 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (tx, tg, tb)]
    dx, dg, db = group_norm_bwd(x, gamma, mean, rstd, ct, num_groups=num_groups, eps=eps)
    return [None] * 4 + [d if ad.is_undefined_primal(t) else None for d, t in zip((dx, dg, db), (tx, tg, tb))]


def merge_samples(args, dims, which):
    """Moves the batch axis of ``args[i]`` (i in ``which``) to the front, broadcasting
    unbatched ones, and merges it into the sample axis N: [B, N, ...] -> [B*N, ...]."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    out = list(args)
    for i in which:
        a, d = args[i], dims[i]
        a = jnp.broadcast_to(a, (size, *a.shape)) if d is NOT_MAPPED else jnp.moveaxis(a, d, 0)
        out[i] = a.reshape(size * a.shape[1], *a.shape[2:])
    return out, size


def _sample_batching(prim, sample_args, param_args):
    """Batching for a primitive whose batched operands are per-sample ([N, ...]): the
    vmapped axis becomes part of N and every output is split back [B, N, ...]. A batched
    per-channel operand (gamma, beta, tangents of them) falls back to vmap of the
    reference."""

    def rule(args, dims, **params):
        if any(dims[i] is not NOT_MAPPED for i in param_args):
            return prim._reference_batch(args, dims, **params)
        merged, size = merge_samples(args, dims, sample_args)
        outs = prim(*merged, **params)
        return [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs], [0] * len(outs)

    return rule


group_norm_fwd.def_batching(_sample_batching(group_norm_fwd, sample_args=(0,), param_args=(1, 2)))
group_norm_tangent.def_batching(
    _sample_batching(group_norm_tangent, sample_args=(0, 2, 3, 4), param_args=(1, 5, 6))
)


@group_norm_bwd.def_batching
def _bwd_batch(args, dims, *, num_groups, eps):
    """Per-example backward: dx through the kernel over all samples; the parameter
    gradients reduced within each batch element."""
    if dims[1] is not NOT_MAPPED:
        return group_norm_bwd._reference_batch(args, dims, num_groups=num_groups, eps=eps)
    (x, gamma, mean, rstd, dy), size = merge_samples(args, dims, (0, 2, 3, 4))
    dx, _, _ = group_norm_bwd(x, gamma, mean, rstd, dy, num_groups=num_groups, eps=eps)
    acc = rstd.dtype
    xhat = _xhat(x, mean, rstd, num_groups)
    dyf = dy.astype(acc)
    split = lambda a: a.reshape(size, a.shape[0] // size, *a.shape[1:])  # noqa: E731
    axes = (1, *range(3, x.ndim + 1))
    dg = jnp.sum(split(dyf * xhat), axis=axes).astype(gamma.dtype)
    db = jnp.sum(split(dyf), axis=axes).astype(gamma.dtype)
    return [split(dx), dg, db], [0, 0, 0]


# ---- public functions ------------------------------------------------------------------


def _prepare(x, gamma, beta, num_groups, eps, who):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{who}: x must be [N, C, *spatial] (rank >= 2), got shape {x.shape}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
        raise ValueError(f"{who}: num_groups must be a positive int, got {num_groups!r}")
    channels = x.shape[1]
    if channels % num_groups:
        raise ValueError(f"{who}: channels x.shape[1]={channels} not divisible by num_groups={num_groups}")
    if not eps >= 0:
        raise ValueError(f"{who}: eps must be >= 0, got {eps}")
    gamma = jnp.asarray(gamma)
    beta = jnp.zeros((channels,), x.dtype) if beta is None else jnp.asarray(beta)
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p.shape != (channels,):
            raise ValueError(f"{who}: {name} must have shape ({channels},) (x.shape[1]), got {p.shape}")
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {p.dtype}")
    return x, gamma.astype(x.dtype), beta.astype(x.dtype), int(num_groups)


def group_norm(x, gamma, beta=None, *, num_groups: int, eps: float = 1e-5):
    """GroupNorm of NCHW ``x`` [N, C, *spatial]: each sample's channels are split into
    ``num_groups`` groups of C / num_groups adjacent channels, each group normalised by
    its own mean and (biased) variance, then scaled by gamma [C] and shifted by beta [C]
    (beta may be None). gamma and beta are cast to x's dtype; statistics accumulate in
    f32 (f64 for f64). Differentiable in every mode; reverse mode runs the fused
    backward kernel (dx, dgamma, dbeta in one pass)."""
    x, gamma, beta, num_groups = _prepare(x, gamma, beta, num_groups, eps, "group_norm")
    y, _, _ = group_norm_fwd(x, gamma, beta, num_groups=num_groups, eps=float(eps))
    return y


def group_norm_backward(x, gamma, beta, dy, *, num_groups: int, eps: float = 1e-5):
    """RLX's GroupNormBackwardInput / Gamma / Beta in one call: returns (dx, dgamma, dbeta)
    for upstream gradient dy (shaped like x). The statistics are recomputed from x (the
    RLX ops take none); the gradients come from the fused ``group_norm_bwd`` kernel.

    ``gamma=None`` stands for ones (GroupNormBackwardGamma / Beta [x, dy] have no gamma;
    dgamma and dbeta do not depend on it)."""
    if gamma is None:
        x = jnp.asarray(x)
        gamma = jnp.ones((x.shape[1] if x.ndim >= 2 else 0,), x.dtype)
    x, gamma_c, _, num_groups = _prepare(x, gamma, beta, num_groups, eps, "group_norm_backward")
    dy = jnp.asarray(dy)
    if dy.shape != x.shape:
        raise ValueError(f"group_norm_backward: dy shape {dy.shape} differs from x shape {x.shape}")
    mean, rstd = block_moments(x, num_groups, eps)
    dx, dg, db = group_norm_bwd(x, gamma_c, mean, rstd, dy.astype(x.dtype), num_groups=num_groups, eps=float(eps))
    gdt = jnp.asarray(gamma).dtype
    return dx, dg.astype(gdt), db.astype(gdt)
