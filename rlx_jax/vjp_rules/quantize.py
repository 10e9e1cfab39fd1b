"""Fake quantization for quantization-aware training: RLX ``FakeQuantize{bits, axis, ste}``
(max-abs scale) and ``FakeQuantizeLSQ{bits, axis}`` (learned step size), with their
backward ops ``FakeQuantizeBackward`` and ``FakeQuantizeLSQBackwardX / Scale``.

Forward (both):  y = clamp(round(x / s[c]), -q, q) * s[c],   q = 2^(bits-1) - 1
(127 / 7 / 1 for bits 8 / 4 / 2, RLX's widths; 2 <= bits <= 16 is accepted), symmetric,
``round`` = half away from zero (Rust's ``f32::round``), c = the index along ``axis``
(one scale for the whole tensor when axis is None).

FakeQuantize's scale (RLX ScaleMode::PerBatch): s[c] = max(max|x[..c..]| / q, 1e-12),
treated as a constant by the gradient (a caller may instead pass a fixed ``scale``, as
RLX's Fixed / EMA modes do). The round has no useful derivative, so the gradient is a
straight-through estimator chosen by ``ste`` (RLX SteKind), with z = x / s:
    identity          dx = dy
    clipped_identity  dx = dy * [|x| <= q s]
    tanh              dx = dy * (1 - tanh(z)^2)
    hardtanh          dx = dy * max(0, 1 - |x / (q s)|)
Forward mode uses the same factor: ty = ste'(x) * tx.

LSQ (Esser et al. 2020, as RLX implements it: no gradient scaling), s_eff = max(s, 1e-12),
z = x / s_eff:
    dx       = dy * [|z| <= q]
    dscale_c = sum over channel c of dy * psi(z),  psi(z) = round(z) - z if |z| <= q
                                                            else sign(z) q.

Layout inside: x [G, O, C, I] (G: groups from vmap, O: axes before ``axis``, C: the
channel axis, I: axes after it; axis None -> C = 1), scales [G, C] in f32 (f64 for f64 x).

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``fake_quantize_fwd`` (x, s) -> y; ``fake_quantize_tangent`` (x, s, tx) -> ste' * tx,
  linear in tx, transposed by ``fake_quantize_bwd`` (x, s, dy) -> dx  [rlx_fake_quantize_bwd
  for clipped_identity and hardtanh on the CPU; tanh stays on XLA, whose vectorised tanh
  wins there. On GPUs the STE gradient is XLA's fusion, already at the copy floor: the
  CUDA kernel is built only with -DRLX_CUDA_FAKE_QUANTIZE_STE, see ffi/cuda/quantize.cu]
- ``lsq_fwd`` (x, s) -> y; ``lsq_tangent`` (x, s, tx, ts) -> [|z|<=q] tx + psi(z) ts,
  linear in (tx, ts), transposed by ``lsq_bwd`` (x, s, dy) -> (dx, ds)
                                             [rlx_fake_quantize_lsq_bwd, CPU and CUDA;
                                              the CUDA call adds an f32 scratch result]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, instantiate

#: the smallest step size (RLX clamps every scale to it)
MIN_SCALE = 1e-12

#: STE kind -> kernel code
STE_CODES = {"identity": 0, "clipped_identity": 1, "tanh": 2, "hardtanh": 3}
_STE_ALIASES = {"identity": "identity", "clippedidentity": "clipped_identity", "tanh": "tanh", "hardtanh": "hardtanh"}


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def q_max(bits: int) -> int:
    """Largest code of a symmetric ``bits``-bit quantizer: 2^(bits-1) - 1."""
    return (1 << (int(bits) - 1)) - 1


def round_half_away(z):
    """Round to nearest, halves away from zero (Rust ``f32::round``), exactly."""
    t = jnp.trunc(z)
    return t + jnp.where(jnp.abs(z - t) >= 0.5, jnp.sign(z), jnp.zeros_like(z))


def _chan(s, x):
    """Scales [G, C] broadcast against x [G, O, C, I]."""
    return s[:, None, :, None]


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_fake_quantize(x, s, *, q, ste="identity"):
    """y = clamp(round(x / s), -q, q) * s (s already >= MIN_SCALE); ``ste`` only selects
    the gradient."""
    acc = s.dtype
    sc = _chan(s, x)
    y = jnp.clip(round_half_away(x.astype(acc) / sc), -q, q) * sc
    return (y.astype(x.dtype),)


def ste_factor(x, s, *, q, ste):
    """d y / d x under the straight-through estimator ``ste`` (see the module docstring)."""
    acc = s.dtype
    xf, sc = x.astype(acc), _chan(s, x)
    if ste == "identity":
        return jnp.ones_like(xf)
    if ste == "clipped_identity":
        return (jnp.abs(xf) <= q * sc).astype(acc)
    if ste == "tanh":
        t = jnp.tanh(xf / sc)
        return 1 - t * t
    return jnp.maximum(1 - jnp.abs(xf / (q * sc)), 0)


def reference_fake_quantize_tangent(x, s, tx, *, q, ste):
    return ((ste_factor(x, s, q=q, ste=ste) * tx.astype(s.dtype)).astype(x.dtype),)


def reference_fake_quantize_bwd(x, s, dy, *, q, ste):
    return ((ste_factor(x, s, q=q, ste=ste) * dy.astype(s.dtype)).astype(x.dtype),)


def _lsq_parts(x, s, q):
    """(inside mask, psi(z)) with z = x / max(s, MIN_SCALE)."""
    acc = s.dtype
    z = x.astype(acc) / _chan(jnp.maximum(s, MIN_SCALE), x)
    inside = jnp.abs(z) <= q
    psi = jnp.where(inside, round_half_away(z) - z, jnp.sign(z) * q)
    return inside, psi


def reference_lsq(x, s, *, q):
    return reference_fake_quantize(x, jnp.maximum(s, MIN_SCALE), q=q)


def reference_lsq_tangent(x, s, tx, ts, *, q):
    inside, psi = _lsq_parts(x, s, q)
    acc = s.dtype
    ty = jnp.where(inside, tx.astype(acc), 0) + psi * _chan(ts.astype(acc), x)
    return (ty.astype(x.dtype),)


def reference_lsq_bwd(x, s, dy, *, q):
    inside, psi = _lsq_parts(x, s, q)
    dyf = dy.astype(s.dtype)
    dx = jnp.where(inside, dyf, 0).astype(x.dtype)
    ds = jnp.sum(psi * dyf, axis=(1, 3))
    return dx, ds


# ---- kernels ---------------------------------------------------------------------------


def _kernel_bwd(x, s, dy, *, q, ste):
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype),)
    return jax.ffi.ffi_call(ffi_target("rlx_fake_quantize_bwd"), out)(
        x, s, dy, q_max=np.float32(q), ste=np.int64(STE_CODES[ste])
    )


def _kernel_lsq_bwd(x, s, dy, *, q):
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(s.shape, s.dtype))
    return jax.ffi.ffi_call(ffi_target("rlx_fake_quantize_lsq_bwd"), out)(x, s, dy, q_max=np.float32(q))


def cuda_lsq_scratch_size(g: int, o: int, c: int, i: int) -> int:
    """f32 elements of the CUDA LSQ backward's scratch result for x [G, O, C, I]: the
    partial sums of dscale, as ffi/cuda/channel_reduce.cuh plans them (I >= 32: one per
    row segment of 4096 elements; else one per (chunk of rows, column), with chunks of
    max(16, ceil(O / 256)) rows). At least 1."""
    if i >= 32:
        per_sum = g * o * c * -(-i // 4096)
    else:
        rpc = max(16, -(-o // 256))
        per_sum = -(-o // rpc) * g * c * i
    return max(1, per_sum)


def _kernel_bwd_cuda(x, s, dy, *, q, ste):
    """The CUDA call (same contract as the CPU one; f32, bf16, f16: f64 lowers the
    reference). Used only where rlx_fake_quantize_bwd is registered for CUDA (opt-in
    builds, see the module docstring)."""
    if x.dtype == jnp.float64:
        return reference_fake_quantize_bwd(x, s, dy, q=q, ste=ste)
    return _kernel_bwd(x, s, dy, q=q, ste=ste)


def _kernel_lsq_bwd_cuda(x, s, dy, *, q):
    """The CUDA call: as ``_kernel_lsq_bwd`` plus an f32 scratch result of per-block
    partial sums of dscale (XLA allocates it; the kernel allocates nothing), dropped."""
    scratch = jax.ShapeDtypeStruct((cuda_lsq_scratch_size(*x.shape),), jnp.float32)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(s.shape, s.dtype), scratch)
    dx, ds, _ = jax.ffi.ffi_call(ffi_target("rlx_fake_quantize_lsq_bwd"), out)(x, s, dy, q_max=np.float32(q))
    return dx, ds


def _straight_through(reference, tangent, scale_tangent):
    """``reference`` (x, s, **params) -> (y,) as a ``jax.custom_jvp`` whose tangent is the
    op's straight-through one, ``tangent`` (x, s, tx[, ts], **params) (``ts`` when
    ``scale_tangent``). The forward primitives run this where they run their reference
    without a primitive (``fused_ops(False)``, the plain-XLA baseline): JAX's own
    derivative of round is 0 almost everywhere, which would give the baseline no
    gradient through the quantizer instead of the op's estimator."""

    def differentiable(x, s, **params):
        @jax.custom_jvp
        def f(x, s):
            return reference(x, s, **params)

        @f.defjvp
        def f_jvp(primals, tangents):
            x, s = primals
            tx, ts = tangents
            extra = (ts,) if scale_tangent else ()
            return f(x, s), tangent(x, s, tx, *extra, **params)

        return f(x, s)

    return differentiable


fake_quantize_fwd = FusedPrimitive("rlx_fake_quantize_fwd",
                                   _straight_through(reference_fake_quantize, reference_fake_quantize_tangent, False))
fake_quantize_tangent = FusedPrimitive("rlx_fake_quantize_tangent", reference_fake_quantize_tangent)
def _bwd_kernel_ok(x, s, dy, *, q, ste):
    """The kernel earns its place for the clipped and hard-tanh STEs; for tanh, XLA's
    vectorised tanh beats the kernel's scalar std::tanh (benchmarks/cases_conv_pool.py),
    so that STE stays on XLA. Identity never reaches a kernel (dx = dy)."""
    return ste in ("clipped_identity", "hardtanh")


fake_quantize_bwd = FusedPrimitive(
    "rlx_fake_quantize_bwd", reference_fake_quantize_bwd, target="rlx_fake_quantize_bwd",
    kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda}, kernel_ok=_bwd_kernel_ok,
)
lsq_fwd = FusedPrimitive("rlx_fake_quantize_lsq_fwd", _straight_through(reference_lsq, reference_lsq_tangent, True))
lsq_tangent = FusedPrimitive("rlx_fake_quantize_lsq_tangent", reference_lsq_tangent)
lsq_bwd = FusedPrimitive(
    "rlx_fake_quantize_lsq_bwd", reference_lsq_bwd, target="rlx_fake_quantize_lsq_bwd",
    kernel={"cpu": _kernel_lsq_bwd, "cuda": _kernel_lsq_bwd_cuda}, static_only=("cuda",),
)


# ---- differentiation rules -------------------------------------------------------------


@fake_quantize_fwd.def_jvp
def _fq_fwd_jvp(primals, tangents, *, q, ste):
    """The STE tangent ste'(x) * tx; the scale is a constant of the gradient."""
    x, s = primals
    tx = instantiate([tangents[0]], [x])[0]
    out = fake_quantize_fwd(x, s, q=q, ste=ste)
    if ste == "identity":
        return out, [tx]
    return out, fake_quantize_tangent(x, s, tx, q=q, ste=ste)


@fake_quantize_tangent.def_transpose
def _fq_tangent_transpose(cts, x, s, tx, *, q, ste):
    if ad.is_undefined_primal(x) or ad.is_undefined_primal(s):
        raise ValueError("fake_quantize tangent is linear in tx only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None, ad.Zero(tx.aval)]
    return [None, None, fake_quantize_bwd(x, s, ct, q=q, ste=ste)[0]]


@lsq_fwd.def_jvp
def _lsq_fwd_jvp(primals, tangents, *, q):
    x, s = primals
    tx, ts = instantiate(tangents, primals)
    return lsq_fwd(x, s, q=q), lsq_tangent(x, s, tx, ts, q=q)


@lsq_tangent.def_transpose
def _lsq_tangent_transpose(cts, x, s, tx, ts, *, q):
    if ad.is_undefined_primal(x) or ad.is_undefined_primal(s):
        raise ValueError("fake_quantize_lsq tangent is linear in (tx, tscale) only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None] + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (tx, ts)]
    dx, ds = lsq_bwd(x, s, ct, q=q)
    return [None, None] + [d if ad.is_undefined_primal(t) else None for d, t in zip((dx, ds), (tx, ts))]


def _group_batching(prim):
    """Batching for primitives over x [G, O, C, I] with scales [G, C]: the batch axis
    joins G (shared operands are broadcast), so every example keeps its own scales and,
    for the LSQ backward, gets its own dscale."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
        moved = []
        for a, d in zip(args, dims):
            a = jnp.broadcast_to(a, (size,) + a.shape) if d is NOT_MAPPED else jnp.moveaxis(a, d, 0)
            moved.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
        outs = prim(*moved, **params)
        return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs], [0] * len(outs)

    return rule


for _prim in (fake_quantize_fwd, fake_quantize_tangent, fake_quantize_bwd, lsq_fwd, lsq_tangent, lsq_bwd):
    _prim.def_batching(_group_batching(_prim))


# ---- public functions ------------------------------------------------------------------


def _ste(ste) -> str:
    key = str(getattr(ste, "value", ste)).replace("_", "").replace("-", "").lower()
    if key not in _STE_ALIASES:
        raise ValueError(f"fake_quantize: ste must be one of {sorted(STE_CODES)}, got {ste!r}")
    return _STE_ALIASES[key]


def _bits(fn, bits) -> int:
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 2 <= int(bits) <= 16:
        raise ValueError(f"{fn}: bits must be an int in [2, 16] (RLX uses 8, 4, 2), got {bits!r}")
    return int(bits)


def _layout(fn, x, axis):
    """(x as [1, O, C, I], axis normalised or None)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: x must be floating point, got {x.dtype}")
    if axis is None:
        if x.ndim == 0:
            return x.reshape(1, 1, 1, 1), None
        return x.reshape(1, math.prod(x.shape[:-1]), 1, x.shape[-1]), None
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{fn}: axis must be an int or None, got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}: axis {axis} out of range for x of rank {x.ndim}")
    axis = int(axis) % x.ndim
    shape = (1, math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :]))
    return x.reshape(shape), axis


def per_batch_scale(x4, q):
    """RLX ScaleMode::PerBatch: s[c] = max(max|x[.., c, ..]| / q, 1e-12) -> [1, C]."""
    acc = _acc(x4.dtype)
    m = jnp.max(jnp.abs(x4.astype(acc)), axis=(0, 1, 3), initial=0.0)
    return jnp.maximum(m / q, MIN_SCALE)[None]


def _scale_operand(fn, scale, x4, q, *, name="scale"):
    """A given scale ([C], [1] or a scalar) as [1, C] in the accumulation dtype."""
    c = x4.shape[2]
    s = jnp.asarray(scale)
    if not jnp.issubdtype(s.dtype, jnp.floating):
        raise TypeError(f"{fn}: {name} must be floating point, got {s.dtype}")
    if s.size not in (1, c) or s.ndim > 1:
        raise ValueError(f"{fn}: {name} must be a scalar, [1] or [{c}] (one per channel), got shape {s.shape}")
    return jnp.broadcast_to(s.reshape(-1).astype(_acc(x4.dtype)), (c,))[None]


def fake_quantize(x, *, bits: int, axis=None, ste="identity", scale=None):
    """Quantize-dequantize x symmetrically to ``bits`` bits: clamp(round(x/s), -q, q) * s.

    x: any shape, float; axis: the channel axis of a per-channel scale, or None (one
    scale); scale: None for RLX's per-batch max-abs scale, else a fixed scale ([C], [1] or
    scalar; not differentiated). ste: "identity", "clipped_identity", "tanh" or
    "hardtanh" (see the module docstring). Differentiable in x in every mode (the STE).
    """
    bits = _bits("fake_quantize", bits)
    ste = _ste(ste)
    x4, _ = _layout("fake_quantize", x, axis)
    q = q_max(bits)
    s = per_batch_scale(x4, q) if scale is None else jnp.maximum(_scale_operand("fake_quantize", scale, x4, q), MIN_SCALE)
    s = lax.stop_gradient(s)
    (y,) = fake_quantize_fwd(x4, s, q=float(q), ste=ste)
    return y.reshape(jnp.shape(x))


def fake_quantize_backward(x, dy, *, bits: int, axis=None, ste="identity", scale=None):
    """RLX's FakeQuantizeBackward{bits, axis, ste}: dx = ste'(x) * dy (shaped like x);
    the scale is recomputed from x (per batch) unless given."""
    bits = _bits("fake_quantize_backward", bits)
    ste = _ste(ste)
    x4, _ = _layout("fake_quantize_backward", x, axis)
    dy = jnp.asarray(dy, x4.dtype)
    if dy.shape != jnp.shape(x):
        raise ValueError(f"fake_quantize_backward: dy shape {dy.shape} differs from x shape {jnp.shape(x)}")
    if ste == "identity":
        return dy
    q = q_max(bits)
    s = per_batch_scale(x4, q) if scale is None else jnp.maximum(
        _scale_operand("fake_quantize_backward", scale, x4, q), MIN_SCALE)
    (dx,) = fake_quantize_bwd(x4, s, dy.reshape(x4.shape), q=float(q), ste=ste)
    return dx.reshape(dy.shape)


def fake_quantize_lsq(x, scale, *, bits: int, axis=None):
    """LSQ fake quantization with a learned step size ``scale`` ([C] along ``axis``, or
    [1] / scalar when axis is None): clamp(round(x/s), -q, q) * s, s = max(scale, 1e-12).
    Differentiable in x (clipped STE) and in scale (the LSQ gradient), every mode."""
    bits = _bits("fake_quantize_lsq", bits)
    x4, _ = _layout("fake_quantize_lsq", x, axis)
    s = _scale_operand("fake_quantize_lsq", scale, x4, q_max(bits))
    (y,) = lsq_fwd(x4, s, q=float(q_max(bits)))
    return y.reshape(jnp.shape(x))


def fake_quantize_lsq_backward(x, scale, dy, *, bits: int, axis=None):
    """RLX's FakeQuantizeLSQBackwardX and ...Scale in one call: (dx [x.shape],
    dscale [scale.shape], in scale's dtype)."""
    bits = _bits("fake_quantize_lsq_backward", bits)
    x4, _ = _layout("fake_quantize_lsq_backward", x, axis)
    scale = jnp.asarray(scale)
    s = _scale_operand("fake_quantize_lsq_backward", scale, x4, q_max(bits))
    dy = jnp.asarray(dy, x4.dtype)
    if dy.shape != jnp.shape(x):
        raise ValueError(f"fake_quantize_lsq_backward: dy shape {dy.shape} differs from x shape {jnp.shape(x)}")
    dx, ds = lsq_bwd(x4, s, dy.reshape(x4.shape), q=float(q_max(bits)))
    ds = ds[0]
    if scale.size != ds.shape[0]:  # one shared scale broadcast over the channels
        ds = jnp.sum(ds, keepdims=True)
    return dx.reshape(dy.shape), ds.reshape(scale.shape).astype(scale.dtype)
