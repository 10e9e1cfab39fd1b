"""Normalisations: LayerNorm, RmsNorm, GroupNorm (NCHW), BatchNormInference, LayerNorm2d.

All keep the input's shape and dtype; parameter shapes are checked.
"""

from __future__ import annotations

import dataclasses

from .errors import OpFault
from .op import Op, need_float, need_min_rank, need_same_dtype, op_class
from .shape import Shape, dims_compatible, leading_flatten, norm_axis


def check_params(what: str, params, want_dims: tuple, names) -> None:
    """Each parameter's dims equal ``want_dims``."""
    for nm, p in zip(names, params):
        if p.rank != len(want_dims) or not all(
            dims_compatible(a, b) for a, b in zip(p.dims, want_dims)
        ):
            raise OpFault(f"{what} {nm} must have shape {list(want_dims)}, got {p}")


def norm_dims(x: Shape, axis: int) -> tuple:
    """Shape of a per-feature parameter: ``(x.dims[axis],)`` (axis may be negative)."""
    return (x.dims[norm_axis(axis, x.rank)],)


@dataclasses.dataclass(frozen=True)
class _AxisNorm(Op):
    """Shared rule of LayerNorm / RmsNorm (not an op itself)."""

    axis: int
    eps: float
    _signed = frozenset({"axis"})

    def validate(self):
        if not self.eps >= 0.0:
            raise OpFault(f"eps must be >= 0, got {self.eps}")

    def arity(self):
        return 3

    def infer(self, ins):
        x, g, b = ins
        need_min_rank(f"{self.op_name} input", x, 1)
        need_float(f"{self.op_name} input", x)
        need_same_dtype(self.op_name, x, g, b)
        check_params(self.op_name, (g, b), norm_dims(x, self.axis), ("gamma", "beta"))
        return x


@op_class
class LayerNorm(_AxisNorm):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` along ``axis`` (mean and
    biased variance over that axis; every other axis is a row); inputs ``[x, gamma,
    beta]`` with gamma/beta ``[x.shape[axis]]``."""


@op_class
class RmsNorm(_AxisNorm):
    """``y = x * rsqrt(mean(x^2) + eps) * gamma + beta`` along ``axis``; inputs ``[x,
    gamma, beta]`` with gamma/beta ``[x.shape[axis]]``. As in RLX, a node may declare the row-flattened output
    ``[prod(leading), H]`` of a rank > 2 input (a fused-layout variant)."""

    def accepts_declared(self, ins, declared, inferred):
        flat = leading_flatten(ins[0])
        return ins[0].rank > 2 and flat is not None and declared == flat


@op_class
class GroupNorm(Op):
    """NCHW group norm: channels split into ``num_groups``; statistics over each group's
    channels and all spatial positions; ``y = xhat * gamma[c] + beta[c]``; inputs
    ``[x [N, C, ...], gamma [C], beta [C]]``."""

    num_groups: int
    eps: float

    def validate(self):
        if self.num_groups == 0:
            raise OpFault("num_groups must be positive")
        if not self.eps >= 0.0:
            raise OpFault(f"eps must be >= 0, got {self.eps}")

    def arity(self):
        return 3

    def infer(self, ins):
        x, g, b = ins
        check_group_norm(x, self.num_groups)
        need_same_dtype("GroupNorm", x, g, b)
        check_params("GroupNorm", (g, b), (x.dims[1],), ("gamma", "beta"))
        return x


def check_group_norm(x: Shape, num_groups: int) -> None:
    need_min_rank("GroupNorm input", x, 2)
    need_float("GroupNorm input", x)
    c = x.dims[1]
    if isinstance(c, int) and c % num_groups:
        raise OpFault(f"channels {c} are not divisible by num_groups {num_groups}")


@op_class
class BatchNormInference(Op):
    """``y = (x - mean[c]) / sqrt(var[c] + eps) * gamma[c] + beta[c]`` with channel
    axis 1; inputs ``[x [N, C, ...], gamma, beta, mean, var]`` (each ``[C]``)."""

    eps: float

    def validate(self):
        if not self.eps >= 0.0:
            raise OpFault(f"eps must be >= 0, got {self.eps}")

    def arity(self):
        return 5

    def infer(self, ins):
        x, *params = ins
        need_min_rank("BatchNormInference input", x, 2)
        need_float("BatchNormInference input", x)
        need_same_dtype("BatchNormInference", x, *params)
        check_params("BatchNormInference", params, (x.dims[1],), ("gamma", "beta", "mean", "var"))
        return x


@op_class
class LayerNorm2d(Op):
    """NCHW LayerNorm across channels at each spatial position (SAM/candle);
    inputs ``[x [N, C, H, W], gamma [C], beta [C]]``."""

    eps: float

    def arity(self):
        return 3

    def infer(self, ins):
        x, g, b = ins
        need_min_rank("LayerNorm2d input", x, 2)
        need_float("LayerNorm2d input", x)
        need_same_dtype("LayerNorm2d", x, g, b)
        check_params("LayerNorm2d", (g, b), (x.dims[1],), ("gamma", "beta"))
        return x
