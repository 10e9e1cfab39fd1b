"""Signal processing: Fft (last axis) and LogMel (+ its backward)."""

from __future__ import annotations

from .dtypes import DType
from .errors import OpFault
from .op import FftNorm, Op, need_float, need_min_rank, need_rank, need_same_dtype, op_class
from .shape import Shape, dims_compatible

#: LogMel's floor: ``y = log(max(mel, LOG_MEL_FLOOR))``
LOG_MEL_FLOOR = 1e-10


def check_fft_input(x: Shape) -> None:
    """c64 ``[..., N]``, or f32/f64 ``[..., 2N]`` (RLX's real block: N real parts then N
    imaginary parts)."""
    need_min_rank("fft input", x, 1)
    last = x.dims[-1]
    if x.dtype in (DType.F32, DType.F64):
        if not isinstance(last, int) or last == 0 or last % 2:
            raise OpFault(f"fft real-block input needs a static, even last dim (2N), got {last}")
    elif x.dtype is not DType.C64:
        raise OpFault(f"fft needs f32, f64 or c64, got {x.dtype.short}")


@op_class
class Fft(Op):
    """1-D DFT along the last axis (``inverse`` flips the exponent sign). ``norm``:
    Backward leaves both directions unscaled (RLX default), Forward scales the inverse
    by 1/N, Ortho scales both by 1/sqrt(N). Shape and dtype are kept."""

    inverse: bool
    norm: FftNorm

    def arity(self):
        return 1

    def infer(self, ins):
        check_fft_input(ins[0])
        return ins[0]


@op_class
class LogMel(Op):
    """Log-mel spectrogram: ``y = log(max(spectrum @ filterbank, 1e-10))`` with
    spectrum ``[..., F]`` (power) and filterbank ``[F, M]`` -> ``[..., M]``."""

    def arity(self):
        return 2

    def infer(self, ins):
        s, fb = ins
        need_min_rank("log_mel spectrum", s, 1)
        need_rank("log_mel filterbank", fb, 2)
        need_float("log_mel spectrum", s)
        need_same_dtype("log_mel", s, fb)
        if not dims_compatible(s.dims[-1], fb.dims[0]):
            raise OpFault(f"spectrum bins {s.dims[-1]} != filterbank rows {fb.dims[0]}")
        return Shape(s.dims[:-1] + (fb.dims[1],), s.dtype)


@op_class
class LogMelBackward(Op):
    """``dspectrum = (dy / mel * [mel > 1e-10]) @ filterbank^T``; inputs ``[spectrum,
    filterbank, dy]`` -> spectrum's shape."""

    is_backward = True

    def arity(self):
        return 3

    def infer(self, ins):
        s, fb, dy = ins
        out = LogMel().infer([s, fb])
        if not (out.rank == dy.rank and all(dims_compatible(a, b) for a, b in zip(out.dims, dy.dims))):
            raise OpFault(f"dy {dy} must match the forward output {out}")
        return s
