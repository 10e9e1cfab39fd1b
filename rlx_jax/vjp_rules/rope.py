"""NeoX rotary position embedding (RLX's ``Rope{head_dim, n_rot}``).

Layout (the one implemented, matching RLX's CPU Rope/RopeBackward kernels):

- x: [..., S, H * head_dim]: the second-to-last axis is the sequence position s, the
  last axis holds H heads of ``head_dim`` values each; leading axes are batch.
- cos, sin: [S, T] tables indexed by position, shared by all heads and batch entries,
  with T >= n_rot / 2. Only the first n_rot / 2 columns are read: T = n_rot / 2 is the
  compact form, T = head_dim / 2 is RLX's own table width (RLX reads ``cos[s, i]`` for
  i < n_rot / 2 out of rows of head_dim / 2).
- In each head, with half = n_rot / 2, i < half, c = cos[s, i], t = sin[s, i]:

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

Primitives: ``rope_fwd`` (x, cos, sin) -> y and ``rope_bwd`` (dy, cos, sin) -> dx, each
linear in its first operand and the transpose of the other, each lowering to its FFI
kernel (``rlx_rope_fwd`` / ``rlx_rope_bwd``) where registered. Internally x is [B, S, W].
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


def _rotate(x, cos, sin, *, head_dim, n_rot, sign, passthrough=True):
    """The NeoX rotation of x [..., S, W] by tables [S, >= n_rot/2], sin scaled by
    ``sign``; with passthrough=False the unrotated dims are zero (the table tangent)."""
    acc = _acc(x.dtype)
    half = n_rot // 2
    *lead, s, w = x.shape
    heads = w // head_dim
    xh = x.astype(acc).reshape(*lead, s, heads, head_dim)
    c = cos[:, :half].astype(acc)[:, None, :]  # [S, 1, half]
    t = sign * sin[:, :half].astype(acc)[:, None, :]
    a, b, rest = xh[..., :half], xh[..., half:n_rot], xh[..., n_rot:]
    ya, yb = a * c - b * t, b * c + a * t
    rest = rest if passthrough else jnp.zeros_like(rest)
    y = jnp.concatenate([ya, yb, rest], axis=-1)
    return y.reshape(x.shape).astype(x.dtype)


def reference_rope(x, cos, sin, *, head_dim, n_rot):
    """y = rope(x); returns (y,)."""
    return (_rotate(x, cos, sin, head_dim=head_dim, n_rot=n_rot, sign=1.0),)


def reference_rope_bwd(dy, cos, sin, *, head_dim, n_rot):
    """dx = rope(dy) with sin negated; returns (dx,)."""
    return (_rotate(dy, cos, sin, head_dim=head_dim, n_rot=n_rot, sign=-1.0),)


# ---- kernels ---------------------------------------------------------------------------


def _kernel(target):
    def call(x, cos, sin, *, head_dim, n_rot):
        out = (jax.ShapeDtypeStruct(x.shape, x.dtype),)
        return jax.ffi.ffi_call(ffi_target(target), out)(x, cos, sin, head_dim=np.int64(head_dim), n_rot=np.int64(n_rot))

    return call


def _kernel_ok(x, cos, sin, **params):
    return (
        x.ndim == 3
        and x.dtype in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
        and cos.dtype == x.dtype
        and sin.dtype == x.dtype
        and cos.ndim == 2
        and cos.shape == sin.shape
    )


# SPMD: x / y are (batch, seq, features), cos / sin (seq, table): batch and sequence may
# split across devices (the tables split with the sequence), each position's features stay whole.
_PARTITION = Partition(lambda avals_in, avals_out, **params: ([("b", "s", "f"), ("s", "t"), ("s", "t")],
                                                             [("b", "s", "f")]),
                       shardable=["b", "s"])
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

    def jvp(primals, tangents, *, head_dim, n_rot):
        x, cos, sin = primals
        tx, tc, ts = tangents
        (y,) = prim(x, cos, sin, head_dim=head_dim, n_rot=n_rot)
        parts = []
        if type(tx) is not ad.Zero:
            parts.append(prim(tx, cos, sin, head_dim=head_dim, n_rot=n_rot)[0])
        if type(tc) is not ad.Zero or type(ts) is not ad.Zero:
            tc = jnp.zeros_like(cos) if type(tc) is ad.Zero else tc
            ts = jnp.zeros_like(sin) if type(ts) is ad.Zero else ts
            parts.append(_rotate(x, tc, ts, head_dim=head_dim, n_rot=n_rot, sign=sign, passthrough=False))
        if not parts:
            return (y,), (jnp.zeros_like(y),)
        return (y,), (parts[0] if len(parts) == 1 else parts[0] + parts[1],)

    return jvp


def _make_transpose(prim):
    other = _TRANSPOSE[prim]

    def transpose(cts, x, cos, sin, *, head_dim, n_rot):
        if ad.is_undefined_primal(cos) or ad.is_undefined_primal(sin):
            raise ValueError("rope is linear in x only (cos and sin must be known)")
        (ct,) = cts
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval), None, None]
        (dx,) = other(ct, cos, sin, head_dim=head_dim, n_rot=n_rot)
        return [dx, None, None]

    return transpose


def _make_batching(prim):
    def batch(args, dims, *, head_dim, n_rot):
        x, cos, sin = args
        if dims[1] is not NOT_MAPPED or dims[2] is not NOT_MAPPED:
            return prim._reference_batch(args, dims, head_dim=head_dim, n_rot=n_rot)
        xb = jnp.moveaxis(x, dims[0], 0)  # [vb, B, S, W] -> [vb * B, S, W]
        vb, b, s, w = xb.shape
        (y,) = prim(xb.reshape(vb * b, s, w), cos, sin, head_dim=head_dim, n_rot=n_rot)
        return [y.reshape(vb, b, s, w)], [0]

    return batch


for _prim in (rope_fwd, rope_bwd):
    _prim.def_jvp(_make_jvp(_prim))
    _prim.def_transpose(_make_transpose(_prim))
    _prim.def_batching(_make_batching(_prim))


# ---- public functions ------------------------------------------------------------------


def _prepare(x, cos, sin, head_dim, n_rot, who):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{who}: x must be [..., S, H * head_dim] (rank >= 2), got shape {x.shape}")
    if not isinstance(head_dim, (int, np.integer)) or head_dim <= 0:
        raise ValueError(f"{who}: head_dim must be a positive int, got {head_dim!r}")
    n_rot = head_dim if n_rot is None else n_rot
    if not isinstance(n_rot, (int, np.integer)) or not 0 <= n_rot <= head_dim or n_rot % 2:
        raise ValueError(f"{who}: n_rot must be an even int in [0, head_dim={head_dim}], got {n_rot!r}")
    s, w = x.shape[-2:]
    if w % head_dim:
        raise ValueError(f"{who}: the last axis of x ({w}) must be a multiple of head_dim ({head_dim})")
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.ndim != 2 or t.shape[0] != s or t.shape[1] < n_rot // 2:
            raise ValueError(
                f"{who}: {name} must be [S={s}, T] with T >= n_rot/2={n_rot // 2} (x is {x.shape}), got {t.shape}"
            )
    if cos.shape != sin.shape:
        raise ValueError(f"{who}: cos {cos.shape} and sin {sin.shape} must have the same shape")
    lead = x.shape[:-2]
    x3 = x.reshape(math.prod(lead), s, w)
    return x3, cos.astype(x.dtype), sin.astype(x.dtype), int(head_dim), int(n_rot), lead


def rope(x, cos, sin, *, head_dim: int, n_rot: int | None = None):
    """NeoX RoPE of x [..., S, H * head_dim] with tables cos, sin [S, T >= n_rot/2].

    The first ``n_rot`` (default head_dim) dims of each head rotate as two halves; the
    rest pass through (module docstring for the exact formula). cos/sin are cast to
    x's dtype; arithmetic is f32 (f64 for f64). Differentiable in x, cos and sin in
    every mode; reverse mode in x runs the kernel ``rlx_rope_bwd``.
    """
    x3, cos, sin, head_dim, n_rot, lead = _prepare(x, cos, sin, head_dim, n_rot, "rope")
    (y,) = rope_fwd(x3, cos, sin, head_dim=head_dim, n_rot=n_rot)
    return y.reshape(*lead, *y.shape[1:])


def rope_backward(dy, cos, sin, *, head_dim: int, n_rot: int | None = None):
    """The RLX op RopeBackward: ``dx = rope(dy, cos, -sin)`` (same layout as ``rope``)."""
    dy3, cos, sin, head_dim, n_rot, lead = _prepare(dy, cos, sin, head_dim, n_rot, "rope_backward")
    (dx,) = rope_bwd(dy3, cos, sin, head_dim=head_dim, n_rot=n_rot)
    return dx.reshape(*lead, *dx.shape[1:])
