"""Signal processing: Fft (last axis) with RLX's FftNorm; LogMel and its backward.

RLX layouts: a C64 tensor is transformed as complex; a real tensor [..., 2N] is the
"real block" layout (first N = real parts, last N = imaginary parts) and the result
uses the same layout.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from rlx_jax import ir

from .registry import enum_name, lowering_rule


def fft_scale(norm, n: int, inverse: bool) -> float:
    """RLX FftNorm.output_scale: Backward 1 both ways (ifft(fft(x)) = N x); Forward
    1/N on the inverse only; Ortho 1/sqrt(N) both ways."""
    name = enum_name(norm) or "Backward"
    if name == "Backward":
        return 1.0
    if name == "Forward":
        return 1.0 / n if inverse else 1.0
    if name == "Ortho":
        return 1.0 / math.sqrt(n)
    raise NotImplementedError(f"unknown FftNorm {name!r}")


def fft(z, inverse: bool, norm):
    """Unnormalised DFT (sign -1 forward, +1 inverse) of complex z along the last axis,
    times ``fft_scale``."""
    n = z.shape[-1]
    y = jnp.fft.ifft(z, axis=-1) * n if inverse else jnp.fft.fft(z, axis=-1)
    s = fft_scale(norm, n, inverse)
    return y * s if s != 1.0 else y


@lowering_rule(ir.Fft)
def _fft(op, args, ctx):
    x = args[0]
    norm = getattr(op, "norm", None)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return ctx.cast_out(fft(x, bool(op.inverse), norm))
    two_n = x.shape[-1]
    if two_n % 2:
        raise ValueError(f"real-block Fft needs an even last axis, got {two_n}")
    n = two_n // 2
    cdt = jnp.complex128 if x.dtype == jnp.float64 else jnp.complex64
    z = x[..., :n].astype(cdt) + 1j * x[..., n:].astype(cdt)
    y = fft(z, bool(op.inverse), norm)
    out = jnp.concatenate([jnp.real(y), jnp.imag(y)], axis=-1).astype(x.dtype)
    return ctx.cast_out(out)


_MEL_FLOOR = 1e-10


@lowering_rule(ir.LogMel)
def _log_mel(op, args, ctx):
    # y = log(max(spectrum @ filterbank, 1e-10)); spectrum [..., F], filterbank [F, M].
    spec, fb = args
    return ctx.cast_out(jnp.log(jnp.maximum(jnp.matmul(spec, fb), _MEL_FLOOR)))


@lowering_rule(ir.LogMelBackward)
def _log_mel_backward(op, args, ctx):
    # [spectrum, filterbank, dy] -> dspectrum = (dy / mel * [mel > 1e-10]) @ filterbank^T.
    spec, fb, dy = args
    mel = jnp.matmul(spec, fb)
    live = mel > _MEL_FLOOR
    g = jnp.where(live, dy / jnp.where(live, mel, 1.0), 0.0)
    return ctx.cast_out(jnp.matmul(g, jnp.swapaxes(fb, -1, -2)))
