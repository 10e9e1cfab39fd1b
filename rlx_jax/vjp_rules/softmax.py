"""Softmax: ``y = exp(x - max(x)) / sum(exp(x - max(x)))`` over ``axis``.

Shapes: x [..., W, ...] normalised over ``axis``; internally that axis is moved last and
every other axis is a row: x [R, W].

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``softmax_fwd``: x -> y;
- ``softmax_bwd_x``: (x, dy) -> dx = y * (dy - sum(dy * y)) with y = softmax(x)
  recomputed per row inside the kernel (target ``rlx_softmax_bwd_x``);
- ``softmax_bwd``: (y, dy) -> dx = y * (dy - sum(dy * y)) from a given y (target
  ``rlx_softmax_bwd``: what the RLX SoftmaxBackward op, which receives y, lowers to).

The softmax Jacobian ``diag(y) - y y^T`` is symmetric, so ``softmax_bwd_x`` serves as
both the tangent map (forward mode: ty = softmax_bwd_x(x, tx)) and its own transpose
(reverse mode: dx = softmax_bwd_x(x, ct)). The pullback's residual is therefore x, not
y: when nothing else reads y, the forward kernel is dead code in a gradient computation
(3 passes over memory, as XLA's own autodiff, instead of 5). ``softmax_bwd`` keeps the
same symmetric tangent / transpose structure for the RLX backward op. Second order
differentiates both backwards through their JVP rules below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import FusedPrimitive, RowPartition, instantiate, rowwise_batching


def _acc(dtype):
    """Arithmetic type: f32 for f32/bf16/f16, f64 for f64."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_softmax(x):
    """Softmax over the last axis in f32 (f64) arithmetic; returns (y,)."""
    xf = x.astype(_acc(x.dtype))
    m = jax.lax.stop_gradient(jnp.max(xf, axis=-1, keepdims=True, initial=-jnp.inf))
    e = jnp.exp(xf - m)
    return ((e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype),)


def reference_softmax_bwd_x(x, dy):
    """dx = y * (dy - sum(dy * y)) with y = softmax(x) kept in f32 (f64), unrounded, as
    the kernel keeps it; returns (dx,)."""
    acc = _acc(x.dtype)
    xf, dyf = x.astype(acc), dy.astype(acc)
    m = jax.lax.stop_gradient(jnp.max(xf, axis=-1, keepdims=True, initial=-jnp.inf))
    e = jnp.exp(xf - m)
    yf = e / jnp.sum(e, axis=-1, keepdims=True)
    dot = jnp.sum(yf * dyf, axis=-1, keepdims=True)
    return ((yf * (dyf - dot)).astype(x.dtype),)


def reference_softmax_bwd(y, dy):
    """dx = y * (dy - sum(dy * y)) over the last axis; returns (dx,)."""
    acc = _acc(y.dtype)
    yf, dyf = y.astype(acc), dy.astype(acc)
    dot = jnp.sum(yf * dyf, axis=-1, keepdims=True)
    return ((yf * (dyf - dot)).astype(y.dtype),)


# ---- kernels ---------------------------------------------------------------------------


def _kernel_fwd(x):
    return jax.ffi.ffi_call(ffi_target("rlx_softmax_fwd"), (jax.ShapeDtypeStruct(x.shape, x.dtype),))(x)


def _kernel_bwd(y, dy):
    return jax.ffi.ffi_call(ffi_target("rlx_softmax_bwd"), (jax.ShapeDtypeStruct(y.shape, y.dtype),))(y, dy)


def _kernel_bwd_x(x, dy):
    return jax.ffi.ffi_call(ffi_target("rlx_softmax_bwd_x"), (jax.ShapeDtypeStruct(x.shape, x.dtype),))(x, dy)


def _kernel_fwd_cuda(x):
    """CUDA: the same call; f64 (which the CUDA kernels do not take) lowers the reference."""
    return reference_softmax(x) if x.dtype == jnp.float64 else _kernel_fwd(x)


def _kernel_bwd_cuda(y, dy):
    return reference_softmax_bwd(y, dy) if y.dtype == jnp.float64 else _kernel_bwd(y, dy)


def _kernel_bwd_x_cuda(x, dy):
    return reference_softmax_bwd_x(x, dy) if x.dtype == jnp.float64 else _kernel_bwd_x(x, dy)


def _kernel_ok(*avals, **params):
    x = avals[0]
    return (
        x.ndim >= 1
        and x.dtype in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
        and all(a.dtype == x.dtype and a.shape == x.shape for a in avals)
    )


# Under SPMD sharding the rows split across devices (the softmax axis stays whole).
softmax_fwd = FusedPrimitive(
    "rlx_softmax_fwd", reference_softmax, target="rlx_softmax_fwd",
    kernel={"cpu": _kernel_fwd, "cuda": _kernel_fwd_cuda}, kernel_ok=_kernel_ok,
    partition=RowPartition(row_args=(0,)),
)
softmax_bwd = FusedPrimitive(
    "rlx_softmax_bwd", reference_softmax_bwd, target="rlx_softmax_bwd",
    kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda}, kernel_ok=_kernel_ok,
    partition=RowPartition(row_args=(0, 1)),
)
softmax_bwd_x = FusedPrimitive(
    "rlx_softmax_bwd_x", reference_softmax_bwd_x, target="rlx_softmax_bwd_x",
    kernel={"cpu": _kernel_bwd_x, "cuda": _kernel_bwd_x_cuda}, kernel_ok=_kernel_ok,
    partition=RowPartition(row_args=(0, 1)),
)


# ---- differentiation rules -------------------------------------------------------------


@softmax_fwd.def_jvp
def _fwd_jvp(primals, tangents):
    (x,) = primals
    (tx,) = instantiate(tangents, primals)
    (y,) = softmax_fwd(x)
    # the tangent map reads x, not y: under reverse mode the residual is x
    (ty,) = softmax_bwd_x(x, tx.astype(x.dtype))
    return (y,), (ty,)


def _bwd_x_jvp(primals, tangents):
    """d/d(x, dy) of dx = y * (dy - <y, dy>), y = softmax(x): linear in t_dy through the
    kernel primitive itself (transposable onto the kernel); for t_x, with
    t_y = softmax_bwd_x(x, t_x) (the symmetric Jacobian again), the product rule gives
    t_y * (dy - <y, dy>) - y * <t_y, dy>, in plain JAX on the recomputed y."""
    x, dy = primals
    tx, tdy = tangents
    (dx,) = softmax_bwd_x(x, dy)
    parts = []
    if type(tdy) is not ad.Zero:
        parts.append(softmax_bwd_x(x, tdy)[0])
    if type(tx) is not ad.Zero:
        acc = _acc(x.dtype)
        (y,) = softmax_fwd(x)
        (ty,) = softmax_bwd_x(x, tx)
        yf, dyf, tyf = y.astype(acc), dy.astype(acc), ty.astype(acc)
        dot = jnp.sum(yf * dyf, axis=-1, keepdims=True)
        tdot = jnp.sum(tyf * dyf, axis=-1, keepdims=True)
        parts.append((tyf * (dyf - dot) - yf * tdot).astype(x.dtype))
    if not parts:
        return (dx,), (jnp.zeros_like(dx),)
    t = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return (dx,), (t,)


softmax_bwd_x.def_jvp(_bwd_x_jvp)


@softmax_bwd_x.def_transpose
def _bwd_x_transpose(cts, x, dy):
    """softmax_bwd_x is linear in dy, and symmetric: its transpose is itself."""
    if ad.is_undefined_primal(x):
        raise ValueError("softmax backward is linear in dy only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, ad.Zero(dy.aval)]
    (dx,) = softmax_bwd_x(x, ct)
    return [None, dx]


def _bwd_jvp(primals, tangents):
    """d/d(y, dy) of y * (dy - <y, dy>): linear in t_dy through the kernel primitive
    itself (so the linearised map stays transposable onto the kernel), plus the
    y-tangent part in plain JAX."""
    y, dy = primals
    ty, tdy = tangents
    (dx,) = softmax_bwd(y, dy)
    parts = []
    if type(tdy) is not ad.Zero:
        parts.append(softmax_bwd(y, tdy)[0])
    if type(ty) is not ad.Zero:
        acc = _acc(y.dtype)
        yf, dyf, tyf = y.astype(acc), dy.astype(acc), ty.astype(acc)
        dot = jnp.sum(yf * dyf, axis=-1, keepdims=True)
        tdot = jnp.sum(tyf * dyf, axis=-1, keepdims=True)
        parts.append((tyf * (dyf - dot) - yf * tdot).astype(y.dtype))
    if not parts:
        return (dx,), (jnp.zeros_like(dx),)
    t = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return (dx,), (t,)


softmax_bwd.def_jvp(_bwd_jvp)


@softmax_bwd.def_transpose
def _bwd_transpose(cts, y, dy):
    """softmax_bwd is linear in dy, and symmetric: its transpose is itself."""
    if ad.is_undefined_primal(y):
        raise ValueError("softmax backward is linear in dy only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, ad.Zero(dy.aval)]
    (dx,) = softmax_bwd(y, ct)
    return [None, dx]


softmax_fwd.def_batching(rowwise_batching(softmax_fwd, row_args=(0,)))
softmax_bwd.def_batching(rowwise_batching(softmax_bwd, row_args=(0, 1)))
softmax_bwd_x.def_batching(rowwise_batching(softmax_bwd_x, row_args=(0, 1)))


# ---- public functions ------------------------------------------------------------------


def _check(x, axis, who):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{who}: x must have at least one axis")
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{who}: axis {axis!r} out of range for x of rank {x.ndim}")
    return x, axis % x.ndim


def softmax(x, *, axis: int = -1):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` (any shape, same output shape).

    Arithmetic in f32 for f32/bf16/f16 inputs (f64 for f64). Differentiable in every
    mode; reverse mode runs the fused backward kernel ``rlx_softmax_bwd_x``, which
    recomputes y from x (the pullback keeps x, not y).
    """
    x, axis = _check(x, axis, "softmax")
    (y,) = softmax_fwd(jnp.moveaxis(x, axis, -1))
    return jnp.moveaxis(y, -1, axis)


def softmax_backward(y, dy, *, axis: int = -1):
    """The gradient of softmax given its output: ``dx = y * (dy - sum(dy * y, axis))``.

    y: the softmax output; dy: the upstream gradient (same shape). This is what the
    RLX graph autodiff emits for Softmax and what the custom rule above calls.
    """
    y, axis = _check(y, axis, "softmax_backward")
    dy = jnp.asarray(dy)
    if dy.shape != y.shape:
        raise ValueError(f"softmax_backward: dy shape {dy.shape} differs from y shape {y.shape}")
    (dx,) = softmax_bwd(jnp.moveaxis(y, axis, -1), jnp.moveaxis(dy.astype(y.dtype), axis, -1))
    return jnp.moveaxis(dx, -1, axis)
