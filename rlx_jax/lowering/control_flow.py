"""Control flow and user extensions: Scan, ScanBackward(Xs), If, While, CustomFn, Custom.

Sub-graphs are lowered with ``ctx.lower_body``: their ``Input`` nodes bind positionally
in node order (RLX's convention), special names (``d_output``, ``primal_output``,
``tangent_<i>``) by name.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .core import one_element_as_declared
from .elementwise import truthy
from .registry import custom_lowering, lowering_rule


def _like(y, ref):
    """Cast ``y`` to ``ref``'s dtype and shape (a carry must keep its type)."""
    y = jnp.asarray(y)
    if y.dtype != ref.dtype:
        y = y.astype(ref.dtype)
    if y.shape != ref.shape:
        # one element either side: the IR lets [] and [1] stand for each other
        y = y.reshape(ref.shape) if y.size == 1 == ref.size else jnp.broadcast_to(y, ref.shape)
    return y


# ---- Scan --------------------------------------------------------------------------------

def checkpoint_rows(length: int, k: int) -> list[int]:
    """RLX's saved trajectory rows for ``num_checkpoints = k``: ``floor(t * L / k)``."""
    return [t * length // k for t in range(k)]


def _segments(length: int, k: int, save_trajectory: bool) -> list[int]:
    """Step counts at which a checkpointed scan records its carry.

    With a trajectory: after row ``r`` of ``checkpoint_rows`` (i.e. ``r + 1`` steps).
    Without: ``k`` near-equal segments ending at ``length``.
    """
    if save_trajectory:
        return [r + 1 for r in checkpoint_rows(length, k)]
    return [((t + 1) * length) // k for t in range(k)]


def scan(step, init, xs: list, length: int, save_trajectory: bool, num_checkpoints: int):
    """RLX Scan semantics on a step function ``step(carry, [x_t...]) -> carry``.

    - ``save_trajectory=False``: the final carry.
    - ``save_trajectory=True``: stacked carries ``[length, *carry]`` (row t = carry
      after step t + 1), or with ``0 < K < length`` checkpoints only the K rows
      ``floor(t * length / K)``: ``[K, *carry]``.
    - ``0 < K < length`` also bounds reverse-mode memory to O(K + length / K) carries:
      the scan runs as K rematerialised (``jax.checkpoint``) segments.
    """
    k = int(num_checkpoints)
    if length == 0:
        if save_trajectory:
            return jnp.zeros((0,) + init.shape, init.dtype)
        return init
    if k <= 0 or k >= length:
        def body(c, x_t):
            n = _like(step(c, list(x_t)), c)
            return n, (n if save_trajectory else None)

        c, ys = lax.scan(body, init, tuple(xs), length=length)
        return ys if save_trajectory else c

    ends = _segments(length, k, save_trajectory)
    starts = [0] + ends[:-1]
    lens = [e - s for s, e in zip(starts, ends)]
    m = max(lens)

    if all(n == m for n in lens) and m * k == length:
        # equal segments tiling the sequence: xs viewed as [K, m, ...] (no copy)
        def seg_body(c, xs_seg):
            def inner(c, x_t):
                return _like(step(c, list(x_t)), c), None

            return lax.scan(inner, c, xs_seg)[0]

        seg_in = tuple(x.reshape((k, m) + x.shape[1:]) for x in xs)
    else:
        # unequal segments: each step reads xs[start + j] from the whole (closed-over) xs;
        # padded steps (j >= len) leave the carry unchanged
        def seg_body(c, seg):
            start, n = seg

            def inner(c, j):
                t = jnp.minimum(start + j, length - 1)
                x_t = [lax.dynamic_index_in_dim(x, t, 0, keepdims=False) for x in xs]
                return jnp.where(j < n, _like(step(c, x_t), c), c), None

            return lax.scan(inner, c, jnp.arange(m))[0]

        seg_in = (jnp.asarray(starts, jnp.int32), jnp.asarray(lens, jnp.int32))

    segment = jax.checkpoint(seg_body)

    def outer(c, seg):
        c = segment(c, seg)
        return c, (c if save_trajectory else None)

    c, ys = lax.scan(outer, init, seg_in)
    return ys if save_trajectory else c


@lowering_rule(ir.Scan)
def _scan(op, args, ctx):
    # Inputs [init, bcast..., xs...]; body Inputs [carry, bcast..., x_t...] -> next carry.
    nb, nx = int(op.num_bcast), int(op.num_xs)
    init, bcasts, xs = args[0], args[1:1 + nb], args[1 + nb:1 + nb + nx]
    length = int(op.length)
    for i, x in enumerate(xs):
        if x.shape[:1] != (length,):
            raise ValueError(f"Scan xs_{i} has shape {x.shape}, expected leading dim {length}")

    def step(c, x_t):
        return ctx.lower_body(op.body, [c, *bcasts, *x_t])[0]

    out = scan(step, init, list(xs), length, bool(op.save_trajectory), int(op.num_checkpoints))
    return ctx.cast_out(out)


def _scan_backward_all(op, args, ctx):
    """Every gradient of a ScanBackward family in one reverse sweep:
    returns (dinit, [dxs_i stacked [L, ...]]).

    Without checkpoints the trajectory's ``length`` rows are the carries. With
    ``0 < K < length`` checkpoints (RLX: K trajectory rows ``floor(t * length / K)``) the
    carries are recomputed from ``init`` with ``forward_body``, as RLX's executor does.
    The upstream has ``length`` rows, or ``K`` rows at the checkpoint positions; without
    a trajectory it is the final carry's gradient.
    """
    nx = int(op.num_xs)
    init, traj, upstream = args[0], args[1], args[2]
    xs = list(args[3:3 + nx])
    length = int(op.length)
    k = int(op.num_checkpoints)
    save = bool(op.save_trajectory)
    fwd = getattr(op, "forward_body", None)

    checkpointed = 0 < k < length and fwd is not None
    if save and not checkpointed and traj.shape[0] == length:
        full = traj
    else:
        if fwd is None:
            raise ValueError(
                "ScanBackward needs forward_body to recompute the carries "
                f"(save_trajectory={save}, num_checkpoints={k}, length={length}, "
                f"trajectory rows={traj.shape[0] if traj.ndim else 0})")

        def step(c, x_t):
            return ctx.lower_body(fwd, [c, *x_t])[0]

        full = scan(step, init, xs, length, True, 0)
    before = jnp.concatenate([init[None], full[:-1]], axis=0)  # carry entering step t

    if save:
        if upstream.shape[0] == length:
            up = upstream
        elif 0 < k < length and upstream.shape[0] == k:
            rows = jnp.asarray(checkpoint_rows(length, k))
            up = jnp.zeros((length,) + init.shape, upstream.dtype).at[rows].add(upstream)
        else:
            raise ValueError(f"ScanBackward upstream has {upstream.shape[0]} rows; expected "
                             f"{length}" + (f" or {k}" if 0 < k < length else ""))
        dc0 = jnp.zeros_like(init)
    else:
        up = None
        dc0 = _like(upstream, init)

    def body(dc, s):
        c_t, x_t, up_t = s
        if up_t is not None:
            dc = dc + up_t.astype(dc.dtype)
        outs = ctx.lower_body(op.body_vjp, [c_t, *x_t], named={"d_output": dc})
        dcarry = _like(outs[0], c_t)
        dx = [_like(g, x[0]) for g, x in zip(outs[1:1 + nx], xs)]
        return dcarry, dx

    dinit, dxs = lax.scan(body, dc0, (before, list(xs), up), reverse=True)
    return dinit, list(dxs)


def _scan_backward_key(op, ctx):
    # ScanBackward and its ScanBackwardXs siblings share one sweep: the key holds every
    # input id and every attribute but the xs index that tells the siblings apart.
    from .backward import op_attr_key

    return ("ScanBackward", ctx.node_input_ids(), op_attr_key(op, skip=("xs_idx",)))


@lowering_rule(ir.ScanBackward)
def _scan_backward(op, args, ctx):
    # dinit: walk t = L-1..0 through body_vjp, adding the trajectory's upstream rows.
    dinit, _ = ctx.memo(_scan_backward_key(op, ctx), lambda: _scan_backward_all(op, args, ctx))
    return ctx.cast_out(dinit)


@lowering_rule(ir.ScanBackwardXs)
def _scan_backward_xs(op, args, ctx):
    # stacked d xs_{xs_idx} [L, ...] from the same sweep as ScanBackward.
    _, dxs = ctx.memo(_scan_backward_key(op, ctx), lambda: _scan_backward_all(op, args, ctx))
    return ctx.cast_out(dxs[int(op.xs_idx)])


# ---- If / While ----------------------------------------------------------------------------

def _scalar_pred(p):
    p = truthy(p)
    if p.size != 1:
        raise ValueError(f"If/While predicate must have one element, got shape {p.shape}")
    return p.reshape(())


@lowering_rule(ir.If)
def _if(op, args, ctx):
    # [pred, captures...]: both branches take the captures; lax.cond picks one.
    pred, caps = args[0], list(args[1:])

    def branch(g):
        def f(c):
            y = ctx.lower_body(g, list(c))[0]
            return one_element_as_declared(ctx.cast_out(jnp.asarray(y)), ctx.out_shape)
        return f

    return lax.cond(_scalar_pred(pred), branch(op.then_branch), branch(op.else_branch), caps)


@lowering_rule(ir.While)
def _while(op, args, ctx):
    # Loop-carried values [v...]; cond(v) -> any shape, true while all non-zero; body(v) -> next v.
    # Bounded by max_iterations: a scan of that many steps with a done flag (stays
    # reverse-differentiable). Unbounded: lax.while_loop (forward-mode only).
    init = list(args)

    def cond_fn(vals):
        # RLX: the loop goes on while every element of cond's output is non-zero
        return jnp.all(truthy(ctx.lower_body(op.cond, list(vals))[0]))

    def body_fn(vals):
        outs = ctx.lower_body(op.body, list(vals))
        return [_like(o, v) for o, v in zip(outs, vals)]

    if op.max_iterations is None:
        final = lax.while_loop(cond_fn, body_fn, init)
    else:
        def step(carry, _):
            vals, done = carry
            go = jnp.logical_and(jnp.logical_not(done), cond_fn(vals))
            nxt = lax.cond(go, body_fn, lambda v: list(v), vals)
            return (nxt, jnp.logical_not(go)), None

        (final, _), _ = lax.scan(step, (init, jnp.asarray(False)), None,
                                 length=int(op.max_iterations))
    return ctx.cast_out(final[0])


# ---- CustomFn / Custom ------------------------------------------------------------------

def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


@lowering_rule(ir.CustomFn)
def _custom_fn(op, args, ctx):
    # fwd_body(inputs) -> y. vjp_body(inputs, primal_output, d_output) -> one gradient
    # per input (jax.custom_vjp); else jvp_body(inputs, tangent_i..., primal_output)
    # -> tangent of y (jax.custom_jvp); else AD through fwd_body.
    def forward(*xs):
        return ctx.cast_out(jnp.asarray(ctx.lower_body(op.fwd_body, list(xs))[0]))

    if op.vjp_body is not None:
        f = jax.custom_vjp(forward)

        def f_fwd(*xs):
            y = forward(*xs)
            return y, (xs, y)

        def f_bwd(res, g):
            xs, y = res
            grads = ctx.lower_body(op.vjp_body, list(xs),
                                   named={"primal_output": y, "d_output": g})
            out = []
            for i, x in enumerate(xs):
                if not jnp.issubdtype(x.dtype, jnp.inexact):
                    out.append(_zero_cotangent(x))
                elif i < len(grads):
                    out.append(_like(grads[i], x))
                else:
                    out.append(jnp.zeros_like(x))
            return tuple(out)

        f.defvjp(f_fwd, f_bwd)
        return f(*args)

    if op.jvp_body is not None:
        f = jax.custom_jvp(forward)

        def f_jvp(primals, tangents):
            y = forward(*primals)
            named = {"primal_output": y}
            for i, (p, t) in enumerate(zip(primals, tangents)):
                if type(t) is jax.custom_derivatives.SymbolicZero or getattr(t, "dtype", None) == jax.dtypes.float0:
                    t = jnp.zeros_like(p)
                named[f"tangent_{i}"] = t
            ty = ctx.lower_body(op.jvp_body, list(primals), named=named)[0]
            return y, _like(ty, y)

        f.defjvp(f_jvp)
        return f(*args)

    return forward(*args)


@lowering_rule(ir.Custom)
def _custom(op, args, ctx):
    # A registered op: its lowering is looked up by name (register_custom_lowering),
    # else through the IR's op registry entry (an attribute `lower` or `jax_fn`).
    fn = custom_lowering(op.name)
    if fn is None and op.name.startswith("rlx_jax."):
        # rlx_jax's own Custom ops (autodiff of ops with no RLX derivative op) register
        # when rlx_jax.autodiff is imported: a graph loaded from JSON may come first
        import rlx_jax.autodiff  # noqa: F401
    if fn is None:
        try:
            lookup = getattr(ir, "custom_op", None) or getattr(ir, "get_custom_op", None)
            entry = lookup(op.name) if lookup is not None else None
        except Exception:  # noqa: BLE001 - no IR registry: fall through to the error
            entry = None
        fn = getattr(entry, "lower", None) or getattr(entry, "jax_fn", None)
    if fn is None:
        raise NotImplementedError(
            f"custom op {op.name!r} has no lowering; register one with "
            "rlx_jax.lowering.register_custom_lowering(name, fn(args, attrs, ctx))")
    return ctx.cast_out(jnp.asarray(fn(list(args), bytes(op.attrs), ctx)))
