"""Builders, part 3: pyrlx's FFT surface, composed from ``Fft`` and shape ops as RLX
does.

``Fft`` works on the last axis of a real block ``[..., 2N]`` (N real parts then N
imaginary parts) or on c64. ``fft_real`` zero-pads a real signal to a power of two,
appends zero imaginary parts, transforms, and splits the spectrum; ``rfft`` keeps the
``N/2 + 1`` non-negative frequencies; ``irfft`` mirrors a half spectrum (Hermitian),
inverts it and keeps the first ``n`` real samples; ``psd`` is ``(re^2 + im^2) / N``.
"""

from __future__ import annotations

import numpy as np

from .builders_core import BuilderBase
from .dtypes import DType
from .op import FftNorm


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


class SignalBuilders(BuilderBase):
    def _static_last(self, op_name: str, x: int) -> int:
        s = self.node(x).shape
        if s.rank < 1 or not isinstance(s.dims[-1], int) or not s.is_static:
            raise self._fault(op_name, f"needs a static shape with a last axis, got {s}")
        return s.dims[-1]

    def _zeros_like_dims(self, dims, dtype) -> int:
        return self.constant(np.zeros(tuple(dims), dtype=DType.from_any(dtype).to_numpy()))

    def fft(self, x: int, inverse: bool = False) -> int:
        """DFT of the last axis with RLX's default (Backward: unscaled) normalisation."""
        return self.fft_norm(x, inverse, FftNorm.Backward)

    def fft_norm(self, x: int, inverse: bool = False, norm="backward") -> int:
        from .ops_signal import Fft

        return self._build(Fft, (x,), inverse=inverse, norm=self._enum(FftNorm, "Fft", norm))

    def _pad_last_pow2(self, x: int) -> int:
        s = self.node(x).shape
        n = s.dims[-1]
        n_pad = next_pow2(n)
        if n_pad == n:
            return x
        z = self._zeros_like_dims(s.dims[:-1] + (n_pad - n,), s.dtype)
        return self.concat([x, z], s.rank - 1)

    def fft_real(self, x: int, norm="backward") -> tuple:
        """Full spectrum ``(re, im)`` of a real signal (zero-padded to a power of two)."""
        self._static_last("Fft", x)
        s = self.node(x).shape
        if not s.dtype.is_float or s.dtype not in (DType.F32, DType.F64):
            raise self._fault("Fft", f"fft_real needs an f32/f64 input, got {s.dtype.short}")
        padded = self._pad_last_pow2(x)
        ps = self.node(padded).shape
        last = ps.rank - 1
        n = ps.dims[-1]
        block = self.concat([padded, self._zeros_like_dims(ps.dims, ps.dtype)], last)
        spec = self.fft_norm(block, False, norm)
        return self.narrow(spec, last, 0, n), self.narrow(spec, last, n, n)

    def rfft(self, x: int, norm="backward") -> tuple:
        """Half spectrum ``(re, im)`` (``N/2 + 1`` bins)."""
        re, im = self.fft_real(x, norm)
        last = self.node(re).shape.rank - 1
        half = self.node(re).shape.dims[-1] // 2 + 1
        return self.narrow(re, last, 0, half), self.narrow(im, last, 0, half)

    def _reverse_last(self, x: int) -> int:
        s = self.node(x).shape
        n = s.dims[-1]
        if n <= 1:
            return x
        idx = self.constant(np.arange(n - 1, -1, -1, dtype=np.int32))
        return self.take(x, idx, s.rank - 1)

    def irfft(self, re: int, im: int, n: int, norm="backward") -> int:
        """Real signal of length ``n`` from a half spectrum (Hermitian mirror, inverse
        Fft, first ``n`` real samples)."""
        rs, is_ = self.node(re).shape, self.node(im).shape
        if rs != is_:
            raise self._fault("Fft", f"irfft: re {rs} and im {is_} differ")
        self._static_last("Fft", re)
        n_pad = next_pow2(int(n))
        half = n_pad // 2 + 1
        last = rs.rank - 1
        if rs.dims[-1] != half:
            raise self._fault("Fft", f"irfft: expected a half spectrum of {half} bins, got {rs.dims[-1]}")
        if half > 2:
            m = half - 2
            mre = self._reverse_last(self.narrow(re, last, 1, m))
            mim = self._reverse_last(self.narrow(im, last, 1, m))
            mim = self.neg(mim)
            re_full = self.concat([re, mre], last)
            im_full = self.concat([im, mim], last)
        else:
            re_full, im_full = re, im
        block = self.concat([re_full, im_full], last)
        out = self.fft_norm(block, True, norm)
        full = self.node(re_full).shape.dims[-1]
        real = self.narrow(out, last, 0, full)
        return self.narrow(real, last, 0, int(n))

    def _freq_len(self, n) -> int:
        """``n`` of fftfreq / rfftfreq, checked before numpy allocates ``[n]`` f64
        (0 divides by zero; a huge n would try to allocate terabytes)."""
        from .serde import MAX_BYTES

        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise self._fault("Constant", f"fftfreq: n must be an int, got {n!r}")
        if not 1 <= int(n) <= MAX_BYTES // 8:
            raise self._fault("Constant", f"fftfreq: n={n} must be in 1..{MAX_BYTES // 8}")
        return int(n)

    def fftfreq(self, n: int) -> int:
        """Constant f64 ``[n]`` of DFT sample frequencies (cycles per sample)."""
        return self.constant(np.fft.fftfreq(self._freq_len(n)).astype(np.float64))

    def rfftfreq(self, n: int) -> int:
        return self.constant(np.fft.rfftfreq(self._freq_len(n)).astype(np.float64))

    def psd(self, re: int, im: int) -> int:
        """Power spectral density ``(re^2 + im^2) / N`` (N = last dim of re)."""
        n = self._static_last("Binary", re)
        power = self.add(self.mul(re, re), self.mul(im, im))
        inv = self.constant(np.asarray(1.0 / n, dtype=self.node(re).shape.dtype.to_numpy()))
        return self.mul(power, inv)

    def psd_real(self, x: int, norm="backward") -> int:
        re, im = self.rfft(x, norm)
        return self.psd(re, im)
