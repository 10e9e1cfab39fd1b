"""2-D max and average pooling (RLX ``Pool{Max|Mean}``) on NCHW tensors.

Shapes: x [..., H, W] (NCHW, or any leading axes: every leading index is one plane);
kernel (kh, kw), stride (sh, sw), padding (ph, pw) on both sides;
y [..., Ho, Wo] with Ho = (H + 2 ph - kh) // sh + 1 (Wo likewise). Window (i, j) covers
input rows i*sh - ph ... i*sh - ph + kh - 1 (and the same for columns).

Max: padding is -inf. The forward saves, per output, the position of the window's FIRST
maximum in row-major window order (a later equal value does not replace it: RLX's
tie-break), or -1 when no element of the window exceeds -inf (a window entirely in the
padding, or all -inf). The saved index (``argmax``) is
- window-local int8 where kh * kw <= 127: a = (h - i*sh + ph) * kw + (w - j*sw + pw), the
  maximum's place inside its own window (padding positions counted), so the index costs
  one byte per output instead of four;
- else the int32 flat in-plane index h * W + w.
``argmax_dtype(kernel_size)`` says which; ``flat_argmax`` decodes either to the flat index
(-1 kept). The backward scatters each dy to its decoded index (windows with index -1 pass
no gradient):
    dx[p, a] = sum over outputs o of plane p with flat(argmax[p, o]) = a of dy[p, o].

Mean: RLX's Pool{Mean} divides every window by kh * kw, padded cells included
(``count_include_pad=True``; padding is zero). It is linear:
    y[i, j] = sum_{window} x / (kh kw),   dx[h, w] = sum_{windows containing (h, w)} dy / (kh kw).

Primitives (each lowers to its FFI kernel where registered, else to its reference):
- ``max_pool2d_fwd``: x -> (y, argmax int8 | int32)               [rlx_max_pool2d_fwd]
- ``max_pool2d_tangent``: (tx, argmax) -> ty = tx gathered at the decoded argmax (linear
  in tx; its transpose is the backward)
- ``max_pool2d_bwd``: (dy, argmax) -> dx (linear in dy; transpose: the tangent)
                                                                   [rlx_max_pool2d_bwd]
  (its call carries the window geometry on both platforms: the kernels decode the
  window-local index with it; the CUDA kernel gathers per input element over the windows
  covering it, an argmax always lying in its own window)
- ``avg_pool2d_fwd``: x -> y (linear; XLA's reduce_window; transpose: the backward)
- ``avg_pool2d_bwd``: dy -> dx (linear; transpose: the forward)    [rlx_avg_pool2d_bwd]
  (on CUDA the kernel, except f32 with non-overlapping windows: XLA's code, faster there)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._args import int_pair
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, Partition


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def out_size(size: int, k: int, s: int, p: int) -> int:
    """Pooled length of one spatial axis: (size + 2p - k) // s + 1."""
    return (size + 2 * p - k) // s + 1


# ---- references (the test oracle and the fallback) ----------------------------------


def _windows(x, kernel_size, stride, padding, fill):
    """The kh*kw shifted strided views of the padded x: [kh*kw, ..., Ho, Wo] in row-major
    window order, with the flat in-plane index of each view's element ([kh*kw, Ho, Wo],
    -1 in the padding)."""
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    h, w = x.shape[-2:]
    ho, wo = out_size(h, kh, sh, ph), out_size(w, kw, sw, pw)
    lead = [(0, 0)] * (x.ndim - 2)
    xp = jnp.pad(x, lead + [(ph, ph), (pw, pw)], constant_values=fill)
    views, index = [], []
    rows = np.arange(ho) * sh - ph
    cols = np.arange(wo) * sw - pw
    for a in range(kh):
        for b in range(kw):
            views.append(xp[..., a::sh, b::sw][..., :ho, :wo])  # ho or wo may be 0
            r, c = rows[:, None] + a, cols[None, :] + b
            inside = (r >= 0) & (r < h) & (c >= 0) & (c < w)
            index.append(np.where(inside, r * w + c, -1))
    return jnp.stack(views), np.stack(index).astype(np.int32)


def argmax_dtype(kernel_size):
    """The saved argmax's dtype: int8 (window-local index) where the window has at most
    127 positions, else int32 (flat in-plane index)."""
    kh, kw = kernel_size
    return jnp.int8 if kh * kw <= 127 else jnp.int32


def flat_argmax(argmax, *, kernel_size, stride, padding, in_hw):
    """The flat in-plane index h * W + w (int32; -1 kept) of a saved argmax [..., Ho, Wo].
    int32 argmax is flat already; an int8 window-local a of output (i, j) is
    h = i*sh - ph + a // kw, w = j*sw - pw + a % kw. An index outside its window or its
    plane (which the forward never writes) decodes to -1 (no gradient), as in the kernels."""
    if argmax.dtype != jnp.int8:
        return argmax.astype(jnp.int32)
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    h, w = in_hw
    ho, wo = argmax.shape[-2:]
    a = argmax.astype(jnp.int32)
    r = (np.arange(ho, dtype=np.int32) * sh - ph)[:, None] + a // kw
    c = (np.arange(wo, dtype=np.int32) * sw - pw)[None, :] + a % kw
    ok = (a >= 0) & (a < kh * kw) & (r >= 0) & (r < h) & (c >= 0) & (c < w)
    return jnp.where(ok, r * w + c, -1).astype(jnp.int32)


def reference_max_pool2d(x, *, kernel_size, stride, padding):
    """(y, argmax): y = window max (-inf padding; NaN where the window holds a NaN);
    argmax = the first maximum (strictly greater than -inf), or the first NaN, as its
    window-local position (int8, kh * kw <= 127) or its flat in-plane index (int32), else
    -1."""
    views, index = _windows(x, kernel_size, stride, padding, -jnp.inf)
    first = jnp.argmax(views, axis=0)  # first occurrence of the maximum (or of a NaN): its window position
    # y read at that position rather than jnp.max: differentiated by JAX (fused_ops(False)),
    # the gradient then goes to the first maximum alone, RLX's tie-break, as the kernels
    # send it (jnp.max would share it among tied elements)
    y = jnp.take_along_axis(views, first[None], axis=0)[0]
    found = ~(y <= -jnp.inf)  # above -inf, or NaN
    dtype = argmax_dtype(kernel_size)
    if dtype == jnp.int8:
        return y, jnp.where(found, first, -1).astype(jnp.int8)
    index = index.reshape((index.shape[0],) + (1,) * (y.ndim - 2) + index.shape[1:])
    idx = jnp.take_along_axis(jnp.broadcast_to(index, (index.shape[0],) + y.shape), first[None], 0)[0]
    argmax = jnp.where(found, idx, -1).astype(jnp.int32)
    return y, argmax


def reference_max_pool2d_tangent(tx, argmax, *, kernel_size, stride, padding):
    """ty[p, o] = tx[p, flat(argmax[p, o])] (0 where argmax is -1)."""
    h, w = tx.shape[-2:]
    am = flat_argmax(argmax, kernel_size=kernel_size, stride=stride, padding=padding, in_hw=(h, w))
    flat = tx.reshape(tx.shape[:-2] + (h * w,))
    am = am.reshape(am.shape[:-2] + (am.shape[-2] * am.shape[-1],))
    picked = jnp.take_along_axis(flat, jnp.clip(am, 0, max(h * w - 1, 0)), axis=-1, mode="clip")
    ty = jnp.where(am >= 0, picked, jnp.zeros((), tx.dtype))
    return (ty.reshape(argmax.shape),)


def reference_max_pool2d_bwd(dy, argmax, *, kernel_size, stride, padding, in_hw):
    """dx[p, a] = sum of dy[p, o] over outputs o with flat(argmax[p, o]) = a (f32
    accumulation)."""
    h, w = in_hw
    lead = dy.shape[:-2]
    planes = math.prod(lead)  # symbolic under jax.export (a batch dim), so not np.prod
    n_out = dy.shape[-2] * dy.shape[-1]
    d = dy.reshape((planes, n_out)).astype(_acc(dy.dtype))
    am = flat_argmax(argmax, kernel_size=kernel_size, stride=stride, padding=padding, in_hw=in_hw)
    am = am.reshape((planes, n_out))
    am = jnp.where(am >= 0, am, h * w)  # -1 -> out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(planes)[:, None], am.shape)
    dx = jnp.zeros((planes, h * w), d.dtype).at[rows, am].add(d, mode="drop")
    return (dx.astype(dy.dtype).reshape(lead + (h, w)),)


def reference_avg_pool2d(x, *, kernel_size, stride, padding):
    """Window sum (zero padding) / (kh * kw), f32 accumulation."""
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    acc = _acc(x.dtype)
    ones = (1,) * (x.ndim - 2)
    pads = [(0, 0)] * (x.ndim - 2) + [(ph, ph), (pw, pw)]
    s = lax.reduce_window(x.astype(acc), np.zeros((), acc), lax.add, ones + (kh, kw), ones + (sh, sw), pads)
    return ((s / (kh * kw)).astype(x.dtype),)


def reference_avg_pool2d_bwd(dy, *, kernel_size, stride, padding, in_hw):
    """XLA's transpose of the average pool (what XLA autodiff runs)."""
    spec = jax.ShapeDtypeStruct(dy.shape[:-2] + tuple(in_hw), dy.dtype)
    fwd = lambda x: reference_avg_pool2d(x, kernel_size=kernel_size, stride=stride, padding=padding)[0]
    (dx,) = jax.linear_transpose(fwd, spec)(dy)
    return (dx,)


# ---- kernels ---------------------------------------------------------------------------


def _geom(kernel_size, stride, padding):
    """FFI attributes: the window geometry as int64 scalars."""
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    return {k: np.int64(v) for k, v in dict(kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw).items()}


def _kernel_max_fwd(x, *, kernel_size, stride, padding):
    h, w = x.shape[-2:]
    ho, wo = (out_size(n, k, s, p) for n, k, s, p in zip((h, w), kernel_size, stride, padding))
    shape = x.shape[:-2] + (ho, wo)
    out = (jax.ShapeDtypeStruct(shape, x.dtype), jax.ShapeDtypeStruct(shape, argmax_dtype(kernel_size)))
    return jax.ffi.ffi_call(ffi_target("rlx_max_pool2d_fwd"), out)(x, **_geom(kernel_size, stride, padding))


def _kernel_max_bwd(dy, argmax, *, kernel_size, stride, padding, in_hw):
    """dy, argmax and the window geometry on both platforms (the kernels decode the
    window-local index with it; the CUDA one also gathers per input element over the
    windows covering it: no scatter, no atomics; see ffi/cuda/pool.cu)."""
    out = (jax.ShapeDtypeStruct(dy.shape[:-2] + tuple(in_hw), dy.dtype),)
    return jax.ffi.ffi_call(ffi_target("rlx_max_pool2d_bwd"), out)(dy, argmax, **_geom(kernel_size, stride, padding))


def _kernel_avg_bwd(dy, *, kernel_size, stride, padding, in_hw):
    out = (jax.ShapeDtypeStruct(dy.shape[:-2] + tuple(in_hw), dy.dtype),)
    return jax.ffi.ffi_call(ffi_target("rlx_avg_pool2d_bwd"), out)(dy, **_geom(kernel_size, stride, padding))


def _kernel_avg_bwd_cuda(dy, *, kernel_size, stride, padding, in_hw):
    """CUDA: the kernel, except for f32 (and f64) where windows do not overlap (kh <= sh and
    kw <= sw, e.g. k2s2: every dx element is one dy / (kh kw), an upsampling). There XLA's
    fusion of the reference is already near the copy floor and beat the kernel on an H200
    (f32 k2s2 128x64x112x112: kernel 0.370 ms, XLA 0.252, copy 0.236), so that case lowers
    the reference. For 16-bit dy the direct kernel won every A/B round at k2s2 (bf16: kernel
    0.151 ms, XLA 0.209, copy 0.149)."""
    non_overlapping = all(k <= s for k, s in zip(kernel_size, stride))
    if non_overlapping and jnp.dtype(dy.dtype).itemsize > 2:
        return reference_avg_pool2d_bwd(dy, kernel_size=kernel_size, stride=stride, padding=padding, in_hw=in_hw)
    return _kernel_avg_bwd(dy, kernel_size=kernel_size, stride=stride, padding=padding, in_hw=in_hw)


def _partition_factors(avals_in, avals_out, **params):
    """SPMD axes: every operand and result is (planes..., height, width); the planes
    (batch, channels) may split across devices, each plane's window stays whole."""
    def axes(a, hw):
        return tuple(f"p{i}" for i in range(len(a.shape) - 2)) + hw

    f_in = [axes(a, ("ih", "iw") if i == 0 and "in_hw" not in params else ("oh", "ow"))
            for i, a in enumerate(avals_in)]
    f_out = [axes(a, ("ih", "iw") if "in_hw" in params else ("oh", "ow")) for a in avals_out]
    return f_in, f_out


_PARTITION = Partition(_partition_factors, shardable=[f"p{i}" for i in range(8)])

max_pool2d_fwd = FusedPrimitive(
    "rlx_max_pool2d_fwd", reference_max_pool2d, target="rlx_max_pool2d_fwd", kernel=_kernel_max_fwd,
    platforms=("cpu", "cuda"), partition=_PARTITION,
)
max_pool2d_tangent = FusedPrimitive("rlx_max_pool2d_tangent", reference_max_pool2d_tangent)
max_pool2d_bwd = FusedPrimitive(
    "rlx_max_pool2d_bwd", reference_max_pool2d_bwd, target="rlx_max_pool2d_bwd",
    kernel=_kernel_max_bwd, platforms=("cpu", "cuda"), partition=_PARTITION,
)
avg_pool2d_fwd = FusedPrimitive("rlx_avg_pool2d_fwd", reference_avg_pool2d)
# avg pool backward: the same call (dy and the geometry attributes) on CPU and CUDA; on CUDA
# except f32 with non-overlapping windows (_kernel_avg_bwd_cuda).
avg_pool2d_bwd = FusedPrimitive(
    "rlx_avg_pool2d_bwd", reference_avg_pool2d_bwd, target="rlx_avg_pool2d_bwd",
    kernel={"cpu": _kernel_avg_bwd, "cuda": _kernel_avg_bwd_cuda}, platforms=("cpu", "cuda"), partition=_PARTITION,
)


# ---- differentiation rules -------------------------------------------------------------


@max_pool2d_fwd.def_jvp
def _max_fwd_jvp(primals, tangents, **geom):
    (x,), (tx,) = primals, tangents
    y, argmax = max_pool2d_fwd(x, **geom)
    t_arg = ad.Zero(jax.typeof(argmax).to_tangent_aval())
    if type(tx) is ad.Zero:
        return (y, argmax), (ad.Zero(jax.typeof(y)), t_arg)
    (ty,) = max_pool2d_tangent(tx, argmax, **geom)
    return (y, argmax), (ty, t_arg)


@max_pool2d_tangent.def_jvp
def _max_tangent_jvp(primals, tangents, **geom):
    (tx, argmax), (ttx, _) = primals, tangents
    out = max_pool2d_tangent(tx, argmax, **geom)
    if type(ttx) is ad.Zero:
        return out, [ad.Zero(jax.typeof(out[0]))]
    return out, max_pool2d_tangent(ttx, argmax, **geom)


@max_pool2d_tangent.def_transpose
def _max_tangent_transpose(cts, tx, argmax, **geom):
    (ct,) = cts
    if ad.is_undefined_primal(argmax):
        raise ValueError("max_pool2d tangent is linear in tx only")
    if type(ct) is ad.Zero:
        return [ad.Zero(tx.aval), None]
    (dx,) = max_pool2d_bwd(ct, argmax, in_hw=tuple(tx.aval.shape[-2:]), **geom)
    return [dx, None]


@max_pool2d_bwd.def_jvp
def _max_bwd_jvp(primals, tangents, **params):
    (dy, argmax), (tdy, _) = primals, tangents
    out = max_pool2d_bwd(dy, argmax, **params)
    if type(tdy) is ad.Zero:
        return out, [ad.Zero(jax.typeof(out[0]))]
    return out, max_pool2d_bwd(tdy, argmax, **params)


@max_pool2d_bwd.def_transpose
def _max_bwd_transpose(cts, dy, argmax, *, in_hw, **geom):
    (ct,) = cts
    if ad.is_undefined_primal(argmax):
        raise ValueError("max_pool2d backward is linear in dy only")
    if type(ct) is ad.Zero:
        return [ad.Zero(dy.aval), None]
    (d_dy,) = max_pool2d_tangent(ct, argmax, **geom)
    return [d_dy, None]


@avg_pool2d_fwd.def_jvp
def _avg_fwd_jvp(primals, tangents, **geom):
    (x,), (tx,) = primals, tangents
    out = avg_pool2d_fwd(x, **geom)
    if type(tx) is ad.Zero:
        return out, [ad.Zero(jax.typeof(out[0]))]
    return out, avg_pool2d_fwd(tx, **geom)


@avg_pool2d_fwd.def_transpose
def _avg_fwd_transpose(cts, x, **geom):
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return avg_pool2d_bwd(ct, in_hw=tuple(x.aval.shape[-2:]), **geom)


@avg_pool2d_bwd.def_jvp
def _avg_bwd_jvp(primals, tangents, **params):
    (dy,), (tdy,) = primals, tangents
    out = avg_pool2d_bwd(dy, **params)
    if type(tdy) is ad.Zero:
        return out, [ad.Zero(jax.typeof(out[0]))]
    return out, avg_pool2d_bwd(tdy, **params)


@avg_pool2d_bwd.def_transpose
def _avg_bwd_transpose(cts, dy, *, in_hw, **geom):
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [ad.Zero(dy.aval)]
    return avg_pool2d_fwd(ct, **geom)


def _planewise_batching(prim):
    """Batching rule for a per-plane primitive: every operand is [..., h, w], so the
    batch axis moved to the front is one more leading (plane) axis; an unbatched
    operand is broadcast along it."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
        moved = [
            jnp.broadcast_to(a, (size,) + a.shape) if d is NOT_MAPPED else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims)
        ]
        outs = prim(*moved, **params)
        return outs, [0] * len(outs)

    return rule


for _prim in (max_pool2d_fwd, max_pool2d_tangent, max_pool2d_bwd, avg_pool2d_fwd, avg_pool2d_bwd):
    _prim.def_batching(_planewise_batching(_prim))


# ---- public functions ------------------------------------------------------------------


def _prepare(fn, x, kernel_size, stride, padding):
    """Validates x [..., H, W] (rank >= 3; NCHW in RLX) and the window geometry."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: x must be floating point, got {x.dtype}")
    if x.ndim < 3:
        raise ValueError(f"{fn}: x must be NCHW (rank >= 3 with H, W last), got shape {x.shape}")
    geom = dict(
        kernel_size=int_pair(fn, "kernel_size", kernel_size, 1),
        stride=int_pair(fn, "stride", stride if stride is not None else kernel_size, 1),
        padding=int_pair(fn, "padding", padding, 0),
    )
    for axis, (n, k, p) in enumerate(zip(x.shape[-2:], geom["kernel_size"], geom["padding"])):
        if n + 2 * p < k:
            raise ValueError(
                f"{fn}: kernel_size {k} exceeds the padded input along axis {x.ndim - 2 + axis} "
                f"({n} + 2*{p})"
            )
    return x, geom


def max_pool2d(x, *, kernel_size, stride, padding=(0, 0)):
    """Max over each window of x [N, C, H, W] (padding = -inf) -> [N, C, Ho, Wo].

    The gradient goes to each window's first maximum (RLX's tie-break); windows with no
    element above -inf pass none. Differentiable in every mode; reverse mode runs the
    fused argmax-scatter kernel.
    """
    x, geom = _prepare("max_pool2d", x, kernel_size, stride, padding)
    y, _ = max_pool2d_fwd(x, **geom)
    return y


def max_pool2d_backward(x, dy, *, kernel_size, stride, padding=(0, 0)):
    """RLX's MaxPool2dBackward: dx [x.shape] for upstream dy [N, C, Ho, Wo]; the argmax
    is recomputed from x (forward kernel), then dy is scattered to it."""
    x, geom = _prepare("max_pool2d_backward", x, kernel_size, stride, padding)
    y, argmax = max_pool2d_fwd(x, **geom)
    dy = jnp.asarray(dy, x.dtype)
    if dy.shape != y.shape:
        raise ValueError(f"max_pool2d_backward: dy must have the pooled shape {y.shape}, got {dy.shape}")
    (dx,) = max_pool2d_bwd(dy, argmax, in_hw=tuple(x.shape[-2:]), **geom)
    return dx


def avg_pool2d(x, *, kernel_size, stride, padding=(0, 0)):
    """Mean over each window of x [N, C, H, W] -> [N, C, Ho, Wo]; every window is divided
    by kh * kw, zero padding included (RLX Pool{Mean}: count_include_pad=True).
    Linear; its gradient is the fused ``avg_pool2d_backward`` kernel."""
    x, geom = _prepare("avg_pool2d", x, kernel_size, stride, padding)
    (y,) = avg_pool2d_fwd(x, **geom)
    return y


def avg_pool2d_backward(dy, *, x_shape, kernel_size, stride, padding=(0, 0)):
    """dx [x_shape]: each dy / (kh kw) spread over its window (RLX lowers this as a
    depthwise Conv2dBackwardInput with a constant 1/(kh kw) kernel)."""
    x_shape = tuple(int(d) for d in x_shape)
    spec = jnp.zeros((0,) * (len(x_shape) - 2) + x_shape[-2:], jnp.asarray(dy).dtype)
    _, geom = _prepare("avg_pool2d_backward", spec, kernel_size, stride, padding)
    dy = jnp.asarray(dy)
    h, w = x_shape[-2:]
    want = x_shape[:-2] + tuple(out_size(n, k, s, p) for n, k, s, p in zip((h, w), *geom.values()))
    if dy.shape != want:
        raise ValueError(f"avg_pool2d_backward: dy must have the pooled shape {want}, got {dy.shape}")
    (dx,) = avg_pool2d_bwd(dy, in_hw=(h, w), **geom)
    return dx
