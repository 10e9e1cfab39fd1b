"""Builders, part 5: control flow with nested bodies and extension ops.

Bodies are copied when stored (later edits to the caller's Graph do not change the op).
"""

from __future__ import annotations

from typing import Optional

from .builders_core import BuilderBase


class ControlBuilders(BuilderBase):
    def _body(self, op_name: str, g, what: str):
        from .graph import Graph

        if g is None:
            return None
        if not isinstance(g, Graph):
            raise self._fault(op_name, f"{what} must be a Graph, got {type(g).__name__}")
        return g.copy()

    def scan(self, init: int, body, length: int, bcasts=(), xs=(), save_trajectory: bool = False,
             num_checkpoints: int = 0) -> int:
        """``lax.scan``: body(carry, *bcasts, *xs[t]) -> carry."""
        from .ops_control import Scan

        bcasts, xs = tuple(bcasts), tuple(xs)
        return self._build(Scan, (init,) + bcasts + xs, body=self._body("Scan", body, "body"), length=length,
                           save_trajectory=save_trajectory, num_bcast=len(bcasts), num_xs=len(xs),
                           num_checkpoints=num_checkpoints)

    def scan_backward(self, init: int, trajectory: int, upstream: int, xs, body_vjp, length: int,
                      save_trajectory: bool = True, num_checkpoints: int = 0, forward_body=None) -> int:
        from .ops_control import ScanBackward

        xs = tuple(xs)
        return self._build(ScanBackward, (init, trajectory, upstream) + xs,
                           body_vjp=self._body("ScanBackward", body_vjp, "body_vjp"), length=length,
                           save_trajectory=save_trajectory, num_xs=len(xs), num_checkpoints=num_checkpoints,
                           forward_body=self._body("ScanBackward", forward_body, "forward_body"))

    def scan_backward_xs(self, init: int, trajectory: int, upstream: int, xs, body_vjp, length: int,
                         save_trajectory: bool = True, xs_idx: int = 0, num_checkpoints: int = 0,
                         forward_body=None) -> int:
        from .ops_control import ScanBackwardXs

        xs = tuple(xs)
        return self._build(ScanBackwardXs, (init, trajectory, upstream) + xs,
                           body_vjp=self._body("ScanBackwardXs", body_vjp, "body_vjp"), length=length,
                           save_trajectory=save_trajectory, num_xs=len(xs), xs_idx=xs_idx,
                           num_checkpoints=num_checkpoints,
                           forward_body=self._body("ScanBackwardXs", forward_body, "forward_body"))

    def if_(self, pred: int, then_branch, else_branch, captures=()) -> int:
        """``then_branch(*captures) if pred else else_branch(*captures)``."""
        from .ops_control import If

        return self._build(If, (pred,) + tuple(captures), then_branch=self._body("If", then_branch, "then_branch"),
                           else_branch=self._body("If", else_branch, "else_branch"))

    def while_(self, init, cond, body, max_iterations: Optional[int] = None) -> int:
        """Loop ``body`` over the carried values ``init`` while ``cond``; value: carry 0."""
        from .ops_control import While

        init = (init,) if isinstance(init, int) else tuple(init)
        return self._build(While, init, cond=self._body("While", cond, "cond"), body=self._body("While", body, "body"),
                           max_iterations=max_iterations)

    def custom_fn(self, inputs, fwd_body, vjp_body=None, jvp_body=None) -> int:
        """pyrlx custom_fn: a sub-graph with optional VJP / JVP override bodies."""
        from .ops_control import CustomFn

        inputs = tuple(inputs)
        return self._build(CustomFn, inputs, fwd_body=self._body("CustomFn", fwd_body, "fwd_body"),
                           vjp_body=self._body("CustomFn", vjp_body, "vjp_body"),
                           jvp_body=self._body("CustomFn", jvp_body, "jvp_body"), num_inputs=len(inputs))

    def custom(self, name: str, inputs, attrs: bytes = b"", out_shape=None, dtype=None) -> int:
        """A registered Custom op (``rlx_jax.register_op``); ``out_shape`` is needed only
        when the op is not registered."""
        from .ops_control import Custom

        inputs = tuple(inputs)
        s = None
        if out_shape is not None:
            dt = dtype or (self.node(inputs[0]).shape.dtype if inputs else "f32")
            s = self._shape("Custom", out_shape, dt)
        return self._build(Custom, inputs, s, name=name, num_inputs=len(inputs), attrs=bytes(attrs))
