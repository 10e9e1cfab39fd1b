"""Reductions and sampling: Reduce, Softmax, TopK, Sample, RngNormal, RngUniform.

(``Softmax`` and ``Cumsum`` are fused-op families, reached through ``rlx_jax.ops``.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .registry import enum_name, lowering_rule

_REDUCERS = {
    "Sum": jnp.sum,
    "Mean": jnp.mean,
    "Max": jnp.max,
    "Min": jnp.min,
    "Prod": jnp.prod,
}


def reduce(kind, x, axes, keep_dim, acc_dtype=None):
    """RLX Reduce over ``axes`` (negative axes count from the end); ``keep_dim``
    keeps the reduced axes as size 1. ``acc_dtype``, a float dtype wider than x's, is
    the one Sum and Mean accumulate and return in (a bf16 graph's f32 loss)."""
    name = enum_name(kind)
    fn = _REDUCERS.get(name)
    if fn is None:
        raise NotImplementedError(f"unknown reduce op {name!r}")
    ax = tuple(sorted({int(a) + x.ndim if int(a) < 0 else int(a) for a in axes}))
    if (name in ("Sum", "Mean") and acc_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
            and jnp.issubdtype(acc_dtype, jnp.floating) and jnp.finfo(acc_dtype).bits > jnp.finfo(x.dtype).bits):
        x = x.astype(acc_dtype)
    return fn(x, axis=ax, keepdims=bool(keep_dim))


@lowering_rule(ir.Reduce)
def _reduce(op, args, ctx):
    return ctx.cast_out(reduce(op.op, args[0], op.axes, op.keep_dim, ctx.out_dtype))


@lowering_rule(ir.Softmax)
def _softmax(op, args, ctx):
    # exp(x - max) / sum(exp(x - max)) along `axis` (the softmax family, rlx_jax.ops).
    from .nn import fused

    return ctx.cast_out(fused("softmax")(args[0], axis=int(op.axis)))


def topk_indices(x, k):
    """Indices of the ``k`` largest values along the last axis, sorted descending,
    ties broken by the smaller index (XLA TopK's order)."""
    _, idx = lax.top_k(x, int(k))
    return idx


@lowering_rule(ir.TopK)
def _topk(op, args, ctx):
    # RLX TopK returns f32-encoded indices [..., k] (the node's dtype).
    idx = topk_indices(args[0], op.k)
    return lax.stop_gradient(idx.astype(ctx.out_dtype or jnp.float32))


def sample(logits, top_k, top_p, temperature, seed):
    """RLX Sample: logits [..., V] -> one token id per row.

    logits / temperature -> keep the top_k largest (0 = all) -> keep the smallest
    prefix of the descending distribution whose mass reaches top_p (1.0 = all) ->
    softmax -> one categorical draw from ``PRNGKey(seed)``. temperature <= 0 is
    greedy (argmax). Deterministic for a given seed.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)
    z = logits / temperature
    neg = jnp.finfo(jnp.float32).min
    order = jnp.argsort(-z, axis=-1, stable=True)
    zs = jnp.take_along_axis(z, order, axis=-1)
    keep = jnp.ones(zs.shape, bool)
    if 0 < top_k < v:
        keep = keep & (jnp.arange(v) < top_k)
    if top_p < 1.0:
        p = jax.nn.softmax(jnp.where(keep, zs, neg), axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each token
        keep = keep & (before < top_p)
    zs = jnp.where(keep, zs, -jnp.inf)
    key = seed_key(seed)
    pick = jax.random.categorical(key, zs, axis=-1)
    return jnp.take_along_axis(order, pick[..., None], axis=-1)[..., 0]


@lowering_rule(ir.Sample)
def _sample(op, args, ctx):
    tok = sample(lax.stop_gradient(args[0]), int(op.top_k), float(op.top_p),
                 float(op.temperature), int(op.seed))
    out = tok.astype(ctx.out_dtype or jnp.float32)
    if ctx.out_shape is not None and None not in ctx.out_shape and out.shape != ctx.out_shape:
        out = out.reshape(ctx.out_shape)
    return out


def _rng_shape(op, ctx):
    shape = ctx.out_shape
    if shape is None or None in shape:
        raise ValueError("RNG op output shape has an unbound dynamic dim")
    return shape


def seed_key(seed: int):
    """A PRNG key for a u64 RLX seed (low 32 bits, then the high 32 folded in)."""
    seed = int(seed)
    key = jax.random.PRNGKey(seed & 0xFFFFFFFF)
    hi = (seed >> 32) & 0xFFFFFFFF
    return jax.random.fold_in(key, hi) if hi else key


def _rng_key(op):
    return seed_key(op.seed)


@lowering_rule(ir.RngNormal)
def _rng_normal(op, args, ctx):
    # N(mean, std^2) samples of the node's shape from PRNGKey(seed).
    x = jax.random.normal(_rng_key(op), _rng_shape(op, ctx), jnp.float32) * float(op.std) + float(op.mean)
    return x.astype(ctx.out_dtype)


@lowering_rule(ir.RngUniform)
def _rng_uniform(op, args, ctx):
    # U[low, high) samples of the node's shape from PRNGKey(seed).
    x = jax.random.uniform(_rng_key(op), _rng_shape(op, ctx), jnp.float32, float(op.low),
                           float(op.high))
    return x.astype(ctx.out_dtype)
