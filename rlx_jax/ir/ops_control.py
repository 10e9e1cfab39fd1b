"""Control flow and extension ops with nested bodies: If, While, Scan (+ its backward
ops ScanBackward / ScanBackwardXs), CustomFn, and registry-backed Custom.

A body is a :class:`~rlx_jax.ir.Graph`; its parameters are its ``Input`` nodes in id
order and its results are its ``outputs``.
"""

from __future__ import annotations

from typing import Optional

from .dtypes import DType
from .errors import OpFault
from .op import Op, op_class
from .registry import get_custom_op
from .shape import Shape, dims_compatible, shapes_match


def body_inputs(g) -> list:
    """The body's Input nodes, in id order."""
    from .ops_leaf import Input

    return [n for n in g.nodes if isinstance(n.op, Input)]


def check_signature(label: str, g, in_shapes: list, out_shapes: Optional[list] = None,
                    n_out: Optional[int] = None) -> list:
    """Body ``g`` takes ``in_shapes`` (in Input order) and, when given, returns
    ``out_shapes`` (or ``n_out`` results); returns its output shapes."""
    params = body_inputs(g)
    if len(params) != len(in_shapes):
        raise OpFault(f"{label} body {g.name!r} has {len(params)} Input(s), expected {len(in_shapes)}")
    for k, (p, s) in enumerate(zip(params, in_shapes)):
        if not shapes_match(p.shape, s):
            raise OpFault(f"{label} body input {k} ({p.op.name!r}) is {p.shape}, expected {s}")
    outs = [g.nodes[o].shape for o in g.outputs]
    want = len(out_shapes) if out_shapes is not None else n_out
    if want is not None and len(outs) != want:
        raise OpFault(f"{label} body {g.name!r} has {len(outs)} output(s), expected {want}")
    if out_shapes is not None:
        for k, (o, s) in enumerate(zip(outs, out_shapes)):
            if not shapes_match(o, s):
                raise OpFault(f"{label} body output {k} is {o}, expected {s}")
    return outs


def _scalar_pred(label: str, s: Shape):
    n = s.numel()
    if n is not None and n != 1:
        raise OpFault(f"{label} must hold one element, got {s}")
    if s.dtype.is_complex:
        raise OpFault(f"{label} must be bool or real, got {s.dtype.short}")


@op_class
class If(Op):
    """``then_branch(*captures) if pred else else_branch(*captures)``; inputs ``[pred,
    captures...]``; each branch takes the captures and returns one value; both agree."""

    then_branch: "Graph"
    else_branch: "Graph"

    def arity(self):
        return None

    def infer(self, ins):
        if not ins:
            raise OpFault("if needs a predicate input")
        _scalar_pred("if predicate", ins[0])
        caps = ins[1:]
        (t,) = check_signature("If then", self.then_branch, caps, n_out=1)
        (e,) = check_signature("If else", self.else_branch, caps, n_out=1)
        if not shapes_match(t, e):
            raise OpFault(f"branches disagree: then gives {t}, else gives {e}")
        return t


@op_class
class While(Op):
    """``while cond(*carry): carry = body(*carry)`` (at most ``max_iterations`` times when
    set); inputs the initial carried values; ``cond`` returns a bool or real tensor of any
    shape, and the loop goes on while every element of it is non-zero (RLX's unrolled
    While: a one-element cond is the usual predicate); ``body`` returns the carried
    values. The node's value is the final carry 0."""

    cond: "Graph"
    body: "Graph"
    max_iterations: Optional[int] = None

    def arity(self):
        return None

    def infer(self, ins):
        if not ins:
            raise OpFault("while needs at least one carried value")
        (c,) = check_signature("While cond", self.cond, ins, n_out=1)
        if c.dtype.is_complex:
            raise OpFault(f"while cond output must be bool or real, got {c.dtype.short}")
        check_signature("While body", self.body, ins, out_shapes=list(ins))
        return ins[0]


def scan_xs_steps(length: int, xs: list) -> list:
    steps = []
    for k, s in enumerate(xs):
        if s.rank < 1 or not (s.dims[0] == length or not isinstance(s.dims[0], int)):
            raise OpFault(f"scan xs {k} {s} must be [length={length}, ...]")
        steps.append(Shape(s.dims[1:], s.dtype))
    return steps


@op_class
class Scan(Op):
    """``lax.scan``: ``carry = body(carry, *bcasts, *xs[t])`` for t < ``length``; inputs
    ``[init, bcasts (num_bcast), xs (num_xs, each [length, ...])]``; output the final
    carry, or ``[length, *carry]`` (row t = carry after step t+1) with
    ``save_trajectory``. ``num_checkpoints`` = K > 0 bounds backward memory; with
    ``save_trajectory`` and 0 < K < length only the K rows ``floor(t * length / K)``
    are kept: ``[K, *carry]`` (RLX's op.rs)."""

    body: "Graph"
    length: int
    save_trajectory: bool
    num_bcast: int
    num_xs: int
    num_checkpoints: int

    def validate(self):
        if self.num_checkpoints > self.length:
            raise OpFault(f"num_checkpoints {self.num_checkpoints} exceeds length {self.length}")

    def arity(self):
        return 1 + self.num_bcast + self.num_xs

    def infer(self, ins):
        init = ins[0]
        bc = ins[1: 1 + self.num_bcast]
        steps = scan_xs_steps(self.length, ins[1 + self.num_bcast:])
        check_signature("Scan", self.body, [init, *bc, *steps], out_shapes=[init])
        if self.save_trajectory:
            return Shape((trajectory_rows(self.length, self.num_checkpoints),) + init.dims, init.dtype)
        return init


def trajectory_rows(length: int, num_checkpoints: int) -> int:
    """Rows of a saved trajectory: ``length``, or K when 0 < K = num_checkpoints < length."""
    return num_checkpoints if 0 < num_checkpoints < length else length


def _check_scan_bwd(op, ins):
    init, traj, up = ins[:3]
    steps = scan_xs_steps(op.length, ins[3:])
    if op.save_trajectory:
        # the scan's output rows (K when checkpointed), or all `length` rows
        rows = {trajectory_rows(op.length, op.num_checkpoints), op.length}
        ok = up.rank == init.rank + 1 and any(dims_compatible(up.dims[0], r) for r in rows) and shapes_match(
            Shape(up.dims[1:], up.dtype), init)
        if not ok:
            want = " or ".join(f"[{r}, *carry]" for r in sorted(rows))
            raise OpFault(f"upstream {up} must match the scan output {want} for carry {init}")
    elif not shapes_match(up, init):
        raise OpFault(f"upstream {up} must match the scan output {init}")
    if traj.rank != init.rank + 1:
        raise OpFault(f"trajectory {traj} must be [length, *carry] for carry {init}")
    check_signature("ScanBackward body_vjp", op.body_vjp, [init, *steps, init],
                    out_shapes=[init, *steps])
    if op.forward_body is not None:
        check_signature("ScanBackward forward_body", op.forward_body, [init, *steps], out_shapes=[init])
    return steps


@op_class
class ScanBackward(Op):
    """Gradient w.r.t. the scan's ``init``. Inputs ``[init, trajectory [length, *carry],
    upstream, xs...]``; ``body_vjp`` takes ``(carry, x_t..., d_output)`` and returns
    ``(dcarry, dx_t...)``; ``forward_body`` recomputes carries when checkpointing."""

    body_vjp: "Graph"
    length: int
    save_trajectory: bool
    num_xs: int
    num_checkpoints: int
    forward_body: Optional["Graph"] = None
    is_backward = True

    def arity(self):
        return 3 + self.num_xs

    def infer(self, ins):
        _check_scan_bwd(self, ins)
        return ins[0]


@op_class
class ScanBackwardXs(Op):
    """Gradient w.r.t. ``xs[xs_idx]`` (``[length, ...]``); same inputs and body as
    ScanBackward."""

    body_vjp: "Graph"
    length: int
    save_trajectory: bool
    num_xs: int
    xs_idx: int
    num_checkpoints: int
    forward_body: Optional["Graph"] = None
    is_backward = True

    def validate(self):
        if self.xs_idx >= self.num_xs:
            raise OpFault(f"xs_idx {self.xs_idx} out of range for num_xs {self.num_xs}")

    def arity(self):
        return 3 + self.num_xs

    def infer(self, ins):
        _check_scan_bwd(self, ins)
        return ins[3 + self.xs_idx]


def _check_primals(label: str, body, ins, special) -> None:
    """The body's non-special Inputs (in id order) are the primal inputs."""
    primals = [n for n in body_inputs(body) if n.op.name not in special]
    if len(primals) != len(ins):
        raise OpFault(f"{label} has {len(primals)} primal Input(s), expected {len(ins)}")
    for k, (p, s) in enumerate(zip(primals, ins)):
        if not shapes_match(p.shape, s):
            raise OpFault(f"{label} primal input {k} ({p.op.name!r}) is {p.shape}, expected {s}")


@op_class
class CustomFn(Op):
    """A sub-graph with optional AD overrides. ``fwd_body`` takes the ``num_inputs``
    inputs and returns one value. ``vjp_body`` takes the primal inputs plus Inputs named
    ``primal_output`` and ``d_output`` and returns one gradient per input;
    ``jvp_body`` takes the primal inputs plus ``tangent_<i>`` Inputs and returns the
    output tangent."""

    fwd_body: "Graph"
    vjp_body: Optional["Graph"] = None
    jvp_body: Optional["Graph"] = None
    num_inputs: int = 0

    def arity(self):
        return self.num_inputs

    def infer(self, ins):
        (out,) = check_signature("CustomFn fwd", self.fwd_body, ins, n_out=1)
        if self.vjp_body is not None:
            params = {n.op.name: n.shape for n in body_inputs(self.vjp_body)}
            if "d_output" not in params or not shapes_match(params["d_output"], out):
                raise OpFault(f"vjp_body needs an Input 'd_output' shaped {out}")
            if "primal_output" in params and not shapes_match(params["primal_output"], out):
                raise OpFault(f"vjp_body Input 'primal_output' must be shaped {out}")
            _check_primals("vjp_body", self.vjp_body, ins, ("primal_output", "d_output"))
            grads = [self.vjp_body.nodes[o].shape for o in self.vjp_body.outputs]
            if len(grads) != len(ins) or not all(shapes_match(g, s) for g, s in zip(grads, ins)):
                raise OpFault(
                    f"vjp_body must return one gradient per input shaped {[str(s) for s in ins]}, "
                    f"got {[str(g) for g in grads]}"
                )
        if self.jvp_body is not None:
            params = {n.op.name: n.shape for n in body_inputs(self.jvp_body)}
            for i, s in enumerate(ins):
                t = params.get(f"tangent_{i}")
                if t is None or not shapes_match(t, s):
                    raise OpFault(f"jvp_body needs an Input 'tangent_{i}' shaped {s}")
            if "primal_output" in params and not shapes_match(params["primal_output"], out):
                raise OpFault(f"jvp_body Input 'primal_output' must be shaped {out}")
            _check_primals("jvp_body", self.jvp_body, ins,
                           ("primal_output",) + tuple(f"tangent_{i}" for i in range(len(ins))))
            tans = [self.jvp_body.nodes[o].shape for o in self.jvp_body.outputs]
            if len(tans) != 1 or not shapes_match(tans[0], out):
                raise OpFault(f"jvp_body must return one tangent shaped {out}")
        return out


@op_class
class Custom(Op):
    """A registered extension op (``rlx_jax.register_op``): ``name`` keys the registry,
    ``attrs`` is an opaque byte blob passed to its callbacks. Its shape comes from the
    registered shape rule (an unregistered op needs a declared shape)."""

    name: str
    num_inputs: int
    attrs: bytes = b""

    def arity(self):
        return self.num_inputs

    def infer(self, ins):
        d = get_custom_op(self.name)
        if d is None:
            return None
        try:
            out = d.shape_rule(list(ins), self.attrs)
        except (ValueError, TypeError) as exc:
            raise OpFault(f"custom op {self.name!r} rejected its inputs: {exc}") from None
        if isinstance(out, Shape):
            return out
        try:
            dims, dtype = out
            return Shape(tuple(dims), DType.from_any(dtype))
        except (TypeError, ValueError) as exc:
            raise OpFault(f"shape rule of custom op {self.name!r} returned {out!r}: {exc}") from None

    def check_declared(self, ins, out):
        """Unregistered: the declared shape is taken as is (e.g. loaded from JSON)."""

    def needs_shape_message(self) -> str:
        return (f"custom op {self.name!r} is not registered (rlx_jax.register_op) "
                "and no output shape was given")
