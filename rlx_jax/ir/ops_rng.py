"""Random tensors (no inputs; the output shape is declared; no gradient).

RLX names the variants ``RngUniform`` / ``RngNormal``; their attributes are rlx_jax's
own: a u64 ``seed`` plus the distribution's parameters.
"""

from __future__ import annotations

from .errors import OpFault
from .op import Op, need_float, op_class


@op_class
class RngUniform(Op):
    """Samples uniform on ``[low, high)`` from ``seed``."""

    seed: int
    low: float = 0.0
    high: float = 1.0

    def validate(self):
        if self.seed >= 2**64:
            raise OpFault("seed must fit a u64")
        if not self.low < self.high:
            raise OpFault(f"low {self.low} must be < high {self.high}")

    def check_declared(self, ins, out):
        need_float("rng_uniform output", out)


@op_class
class RngNormal(Op):
    """Samples ``mean + std * N(0, 1)`` from ``seed``."""

    seed: int
    mean: float = 0.0
    std: float = 1.0

    def validate(self):
        if self.seed >= 2**64:
            raise OpFault("seed must fit a u64")
        if not self.std >= 0.0:
            raise OpFault(f"std must be >= 0, got {self.std}")

    def check_declared(self, ins, out):
        need_float("rng_normal output", out)
