"""Leaves: graph inputs, parameters and constants (0 inputs; shape declared)."""

from __future__ import annotations

from .errors import OpFault
from .op import Op, op_class
from .shape import Shape


@op_class
class Input(Op):
    """A graph input bound by ``name`` at run time; its shape is the node's shape."""

    name: str

    def validate(self):
        if not self.name:
            raise OpFault("input name must be non-empty")


@op_class
class Param(Op):
    """A parameter (weight) bound by ``name``; its shape is the node's shape."""

    name: str

    def validate(self):
        if not self.name:
            raise OpFault("param name must be non-empty")


@op_class
class Constant(Op):
    """A constant tensor: ``data`` holds the little-endian element bytes in row-major
    order (RLX ``Vec<u8>``; bool one byte, c64 interleaved re/im f32)."""

    data: bytes

    def check_declared(self, ins, out: Shape):
        n = out.numel()
        if n is None:
            raise OpFault(f"constant shape {out} must be static")
        want = n * out.dtype.size_bytes
        if len(self.data) != want:
            raise OpFault(
                f"constant data has {len(self.data)} bytes, shape {out} needs {want}"
            )

    def attr_text(self) -> str:
        return f"data=<{len(self.data)} bytes>"

    def to_numpy(self, shape: Shape):
        """The constant as a numpy array of ``shape`` (a read-only view)."""
        import numpy as np

        dt = shape.dtype.to_numpy().newbyteorder("<") if shape.dtype.size_bytes > 1 else shape.dtype.to_numpy()
        return np.frombuffer(self.data, dtype=dt).reshape(shape.dims)
