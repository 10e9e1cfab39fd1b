"""NeoX rotary position embedding (RLX's ``Rope{head_dim, n_rot}``).

Layouts (the same memory; the public functions take either):

- heads-split, ``head_dim=None``: x [..., S, H, D]; head_dim = D = x.shape[-1];
- merged (RLX's), ``head_dim`` an int: x [..., S, H * head_dim].

In both, S is the sequence position s and leading axes are batch. cos, sin: [S, T]
tables indexed by position, shared by all heads and batch entries, with T >= n_rot / 2.
Only the first n_rot / 2 columns are read: T = n_rot / 2 is the compact form, T =
head_dim / 2 is RLX's own table width. In each head, with half = n_rot / 2, i < half,
c = cos[s, i], t = sin[s, i]:

      y[i]        = x[i] * c - x[half + i] * t
      y[half + i] = x[half + i] * c + x[i] * t
      y[j]        = x[j]        for n_rot <= j < head_dim (pass-through)

i.e. the first n_rot dims rotate as two halves (NeoX / GPT-NeoX style, not the
interleaved GPT-J pairs); the rest pass through.

RoPE is linear in x with an orthogonal map, so its transpose (the backward, RLX's
``RopeBackward``) is the same rotation with sin negated: ``dx = rope(dy, cos, -sin)``.
Gradients also flow into cos and sin (RLX's backward op gives dx only; JAX users may
differentiate tables): ``d y[i] = x[i] dc - x[half+i] dt``, ``d y[half+i] = x[half+i] dc
+ x[i] dt``.

Primitives: ``rope_fwd`` (x, cos, sin) -> y and ``rope_bwd`` (dy, cos, sin) -> dx on
x [B, S, H, D], each linear in its first operand and the transpose of the other, each
lowering to its FFI kernel (``rlx_rope_fwd`` / ``rlx_rope_bwd``) where registered. The
kernels read [B, S, H * D], a reshape of the same memory (no transpose). Under SPMD
sharding the primitives split over batch, sequence (the tables split with it) and whole
heads: a merged axis sharded on head boundaries stays sharded.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, Partition


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# ---- references (the test oracle and the fallback) ----------------------------------


def _rotate(x, cos, sin, *, n_rot, sign, passthrough=True):
    """The NeoX rotation of x [..., S, H, D] by tables [S, >= n_rot/2], sin scaled by
    ``sign``; with passthrough=False the unrotated dims are zero (the table tangent)."""
    acc = _acc(x.dtype)
    half = n_rot // 2
    xh = x.astype(acc)
    c = cos[:, :half].astype(acc)[:, None, :]  # [S, 1, half]
    t = sign * sin[:, :half].astype(acc)[:, None, :]
    a, b, rest = xh[..., :half], xh[..., half:n_rot], xh[..., n_rot:]
    ya, yb = a * c - b * t, b * c + a * t
    rest = rest if passthrough else jnp.zeros_like(rest)
    return jnp.concatenate([ya, yb, rest], axis=-1).astype(x.dtype)


def reference_rope(x, cos, sin, *, n_rot):
    """y = rope(x) for x [B, S, H, D]; returns (y,)."""
    return (_rotate(x, cos, sin, n_rot=n_rot, sign=1.0),)


def reference_rope_bwd(dy, cos, sin, *, n_rot):
    """dx = rope(dy) with sin negated; returns (dx,)."""
    return (_rotate(dy, cos, sin, n_rot=n_rot, sign=-1.0),)


# ---- kernels ---------------------------------------------------------------------------


def _kernel(target):
    def call(x, cos, sin, *, n_rot):
        # the kernel reads [B, S, H * D]: the same memory as x [B, S, H, D]
        b, s, h, d = x.shape
        out = (jax.ShapeDtypeStruct((b, s, h * d), x.dtype),)
        (y,) = jax.ffi.ffi_call(ffi_target(target), out)(x.reshape(b, s, h * d), cos, sin, head_dim=np.int64(d),
                                             n_rot=np.int64(n_rot))
        return (y.reshape(x.shape),)

    return call


def _kernel_ok(x, cos, sin, **params):
    return (
        x.ndim == 4
        and x.shape[3] > 0
        and x.dtype in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
        and cos.dtype == x.dtype
        and sin.dtype == x.dtype
        and cos.ndim == 2
        and cos.shape == sin.shape
    )


# SPMD: x / y are (batch, seq, heads, head dim), cos / sin (seq, table): batch, sequence (the
# tables split with it) and heads may split across devices; each head's D values stay whole.
_PARTITION = Partition(lambda avals_in, avals_out, **params: ([("b", "s", "h", "d"), ("s", "t"), ("s", "t")],
                                                             [("b", "s", "h", "d")]),
                       shardable=["b", "s", "h"])
rope_fwd = FusedPrimitive(
    "rlx_rope_fwd", reference_rope, target="rlx_rope_fwd", kernel=_kernel("rlx_rope_fwd"), kernel_ok=_kernel_ok,
    partition=_PARTITION,
)
rope_bwd = FusedPrimitive(
    "rlx_rope_bwd", reference_rope_bwd, target="rlx_rope_bwd", kernel=_kernel("rlx_rope_bwd"), kernel_ok=_kernel_ok,
    partition=_PARTITION,
)

_SIGN = {rope_fwd: 1.0, rope_bwd: -1.0}
_TRANSPOSE = {rope_fwd: rope_bwd, rope_bwd: rope_fwd}


# ---- differentiation rules -------------------------------------------------------------


def _make_jvp(prim):
    sign = _SIGN[prim]

    def jvp(primals, tangents, *, n_rot):
        x, cos, sin = primals
        tx, tc, ts = tangents
        (y,) = prim(x, cos, sin, n_rot=n_rot)
        parts = []
        if type(tx) is not ad.Zero:
            parts.append(prim(tx, cos, sin, n_rot=n_rot)[0])
        if type(tc) is not ad.Zero or type(ts) is not ad.Zero:
            tc = jnp.zeros_like(cos) if type(tc) is ad.Zero else tc
            ts = jnp.zeros_like(sin) if type(ts) is ad.Zero else ts
            parts.append(_rotate(x, tc, ts, n_rot=n_rot, sign=sign, passthrough=False))
        if not parts:
            return (y,), (jnp.zeros_like(y),)
        return (y,), (parts[0] if len(parts) == 1 else parts[0] + parts[1],)

    return jvp


def _make_transpose(prim):
    other = _TRANSPOSE[prim]

    def transpose(cts, x, cos, sin, *, n_rot):
        if ad.is_undefined_primal(cos) or ad.is_undefined_primal(sin):
            raise ValueError("rope is linear in x only (cos and sin must be known)")
        (ct,) = cts
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval), None, None]
        (dx,) = other(ct, cos, sin, n_rot=n_rot)
        return [dx, None, None]

    return transpose


def _make_batching(prim):
    def batch(args, dims, *, n_rot):
        x, cos, sin = args
        if dims[1] is not NOT_MAPPED or dims[2] is not NOT_MAPPED:
            return prim._reference_batch(args, dims, n_rot=n_rot)
        xb = jnp.moveaxis(x, dims[0], 0)  # [vb, B, S, H, D] -> [vb * B, S, H, D]
        vb, b = xb.shape[:2]
        (y,) = prim(xb.reshape(vb * b, *xb.shape[2:]), cos, sin, n_rot=n_rot)
        return [y.reshape(xb.shape)], [0]

    return batch


for _prim in (rope_fwd, rope_bwd):
    _prim.def_jvp(_make_jvp(_prim))
    _prim.def_transpose(_make_transpose(_prim))
    _prim.def_batching(_make_batching(_prim))


# ---- public functions ------------------------------------------------------------------


def _prepare(x, cos, sin, head_dim, n_rot, who):
    """x as [B, S, H, D] (leading axes flattened into B), the tables in x's dtype, n_rot,
    and the shape to give the result back in."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    if head_dim is None:
        if x.ndim < 3:
            raise ValueError(f"{who}: x must be [..., S, H, D] (rank >= 3) when head_dim is None; for the "
                             f"merged layout [..., S, H * head_dim] pass head_dim, got shape {x.shape}")
        layout = "[..., S, H, D]"
        s, h, d = x.shape[-3:]
    else:
        if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim <= 0:
            raise ValueError(f"{who}: head_dim must be a positive int (or None for x [..., S, H, D]), "
                             f"got {head_dim!r}")
        if x.ndim < 2:
            raise ValueError(f"{who}: x must be [..., S, H * head_dim] (rank >= 2), got shape {x.shape}")
        layout = "[..., S, H * head_dim]"
        s, w = x.shape[-2:]
        d = int(head_dim)
        if w % d:
            raise ValueError(f"{who}: the last axis of x ({w}) must be a multiple of head_dim ({d})")
        h = w // d
        if x.ndim >= 3 and cos.ndim == 2 and cos.shape[0] != s and cos.shape[0] == x.shape[-3]:
            raise ValueError(
                f"{who}: with head_dim={d}, x {x.shape} is read as the merged layout [..., S={s}, H * head_dim="
                f"{w}], but cos has {cos.shape[0]} positions, x.shape[-3]: for x laid out [..., S, H, D], "
                f"drop head_dim (head_dim=None takes D = x.shape[-1])")
    n_rot = d if n_rot is None else n_rot
    if isinstance(n_rot, bool) or not isinstance(n_rot, (int, np.integer)) or not 0 <= n_rot <= d or n_rot % 2:
        raise ValueError(f"{who}: n_rot must be an even int in [0, head_dim={d}], got {n_rot!r}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.ndim != 2 or t.shape[0] != s or t.shape[1] < n_rot // 2:
            raise ValueError(f"{who}: {name} must be [S={s}, T] with T >= n_rot/2={n_rot // 2} "
                             f"(x is {x.shape}, read as {layout}), got {t.shape}")
    if cos.shape != sin.shape:
        raise ValueError(f"{who}: cos {cos.shape} and sin {sin.shape} must have the same shape")
    lead = x.shape[:-3] if head_dim is None else x.shape[:-2]
    x4 = x.reshape(math.prod(lead), s, h, d)
    return x4, cos.astype(x.dtype), sin.astype(x.dtype), int(n_rot), x.shape


def rope(x, cos, sin, *, head_dim: int | None = None, n_rot: int | None = None):
    """NeoX RoPE of x with tables cos, sin [S, T >= n_rot/2].

    x: [..., S, H, D] when ``head_dim`` is None (head_dim = D), or RLX's merged layout
    [..., S, H * head_dim] when ``head_dim`` is an int (the same memory: both run the same
    kernel, no transpose). The first ``n_rot`` (default head_dim) dims of each head rotate
    as two halves; the rest pass through (module docstring for the exact formula).
    cos/sin are cast to x's dtype; arithmetic is f32 (f64 for f64). Differentiable in x,
    cos and sin in every mode; reverse mode in x runs the kernel ``rlx_rope_bwd``. Under
    SPMD sharding it runs shard-local over batch, sequence (shard cos/sin like S) and
    whole heads. Returns x's shape and dtype.
    """
    x4, cos, sin, n_rot, shape = _prepare(x, cos, sin, head_dim, n_rot, "rope")
    (y,) = rope_fwd(x4, cos, sin, n_rot=n_rot)
    return y.reshape(shape)


def rope_backward(dy, cos, sin, *, head_dim: int | None = None, n_rot: int | None = None):
    """The RLX op RopeBackward: ``dx = rope(dy, cos, -sin)`` (same layouts as ``rope``)."""
    dy4, cos, sin, n_rot, shape = _prepare(dy, cos, sin, head_dim, n_rot, "rope_backward")
    (dx,) = rope_bwd(dy4, cos, sin, n_rot=n_rot)
    return dx.reshape(shape)
