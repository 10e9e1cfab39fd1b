"""RMSNorm then linear maps: ``y = rms_norm(x, gamma, beta)``, ``out_i = y @ W_i`` (a
pre-norm block's q / k / v or gate / up projections), optionally after the residual add
(``s = x + residual`` normalised, returned with the projections), with a backward that
keeps no copy of the normalised y.

Shapes: x (and residual) [..., H], normalised over the last axis; gamma, beta [H];
W_i [H, O_i]; out_i [..., O_i]; s [..., H]. With u the normalised input (x, or s):

    forward:   (y, rstd) = rms_norm_fwd(u, gamma, beta),  out_i = y W_i
    backward:  dy = sum_i dout_i W_i^T
               (du, dgamma, dbeta, y) = rms_norm_bwd_y(u, gamma, beta, dy)   (y recomputed)
               (with the residual add: add_rms_norm_bwd_y, which adds ds into du; dx = dres = du)
               dW_i = sum over the leading axes of y^T dout_i

Why one op: differentiated as separate ops, y is a residual of every matmul (dW_i needs
it), held from the forward to the backward beside u, which the norm's backward keeps
anyway. In a Llama step at [16384, 2048] bf16 that is 64 MiB per norm, two norms a layer.
Here the residuals are u, gamma, beta and the weights; the backward forms y again
behind an optimization barrier on the cotangents (as ``jax.checkpoint`` does) so that XLA
neither merges it with the forward's identical call nor moves it into the forward. On CUDA
the norm's backward kernel writes y from the rows of u it reads anyway (one more write);
elsewhere the forward kernel runs again first (a read of u and a write of y). At the
Llama step's [16384, 2048] bf16 on an H200: 90 us a norm for the backward with y, against
44 for the forward run again and 80 for the backward.

Primitives (``add`` static: whether the residual add comes first):
- ``rms_norm_linear_fwd``: (x, gamma, beta, *W) -> (*out), or with ``add``
  (x, residual, gamma, beta, *W) -> (s, *out); the norm's forward (``rms_norm_fwd``, or
  ``add_rms_norm_fwd``: on CUDA XLA's fused add + norm) and XLA's matmuls;
- ``rms_norm_linear_tangent``: (u, gamma, beta, *W, tx, [tres,] tgamma, tbeta, *tW) ->
  ([ts,] *tout), linear in the tangents; its transpose is the backward above.
The matmuls run in the promoted dtype of y and W at JAX's default precision, as
``y @ W`` does; dy is one product over the concatenated weights where they are narrow
(q / k / v, summed in the matmul's accumulator) and the per-weight products added in
that dtype where they are wide (``_input_grad``). Under vmap (parameters unbatched) the
batch axis moves to the front of the activations; under SPMD sharding the norm kernels
run shard-local over the rows and XLA partitions the matmuls (column-parallel weights
included).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src import dispatch
from jax.interpreters import ad

from rlx_jax.vjp_rules._linear import linear_tangent, linear_weight_grad
from rlx_jax.vjp_rules._primitive import FusedPrimitive, instantiate, rowwise_batching
from rlx_jax.vjp_rules.rms_norm import (
    _prepare, add_rms_norm_bwd_y, add_rms_norm_fwd, reference_rms_norm, reference_rms_norm_tangent, rms_norm_bwd_y,
    rms_norm_fwd, static_eps,
)


def _split(args, add):
    """(u-side operands, gamma, beta, weights) of a forward's operands."""
    lead = 2 if add else 1
    return args[:lead], args[lead], args[lead + 1], args[lead + 2:]


# ---- forward and tangent -----------------------------------------------------------------


def reference_rms_norm_linear(*args, eps, add):
    """(*out) or (s, *out): the norm through its own primitives (kernels where registered),
    then the matmuls."""
    xs, gamma, beta, ws = _split(args, add)
    if add:
        s, y, _ = add_rms_norm_fwd(*xs, gamma, beta, eps=eps)
    else:
        y, _ = rms_norm_fwd(xs[0], gamma, beta, eps=eps)
    outs = tuple(jnp.matmul(y, w) for w in ws)
    return (s, *outs) if add else outs


def reference_rms_norm_linear_tangent(u, gamma, beta, *rest, eps, add):
    """([ts,] *tout): tu = tx (+ tres), ty the norm's tangent at u, tout_i = ty W_i + y tW_i."""
    k = (len(rest) - (4 if add else 3)) // 2
    ws, tangents = rest[:k], rest[k:]
    tx, *tangents = tangents
    tu = tx + tangents.pop(0) if add else tx
    tg, tb, tws = tangents[0], tangents[1], tangents[2:]
    y, rstd = reference_rms_norm(u, gamma, beta, eps=eps)
    (ty,) = reference_rms_norm_tangent(u, gamma, rstd, tu, tg, tb, eps=eps)
    touts = tuple(linear_tangent(y, ty, w, tw) for w, tw in zip(ws, tws))
    return (tu, *touts) if add else touts


rms_norm_linear_fwd = FusedPrimitive("rlx_rms_norm_linear_fwd", reference_rms_norm_linear)
rms_norm_linear_tangent = FusedPrimitive("rlx_rms_norm_linear_tangent", reference_rms_norm_linear_tangent)
# the norm kernels inside the forward split under SPMD through custom_partitioning, which
# needs the device assignment while lowering
dispatch.prim_requires_devices_during_lowering.add(rms_norm_linear_fwd.p)


# ---- differentiation rules -------------------------------------------------------------


@rms_norm_linear_fwd.def_jvp
def _fwd_jvp(primals, tangents, *, eps, add):
    tangents = instantiate(tangents, primals)
    outs = rms_norm_linear_fwd(*primals, eps=eps, add=add)
    xs, gamma, beta, ws = _split(primals, add)
    u = outs[0] if add else xs[0]  # the normalised input: s = x + residual, or x
    touts = rms_norm_linear_tangent(u, gamma, beta, *ws, *tangents, eps=eps, add=add)
    return outs, touts


def _input_grad(live, dtype):
    """dy = sum_i dout_i W_i^T [..., H] in ``dtype``, for the (W_i, dout_i) pairs of
    ``live``. Narrow outputs (a block's q / k / v: 2 sum_i O_i < (k + 1) H) take one
    product of the concatenated cotangents and weights, [..., sum O_i] x [sum O_i, H],
    the sum inside the matmul's f32 accumulator; XLA concatenates those cotangents anyway
    for its merged weight-gradient product, and separate products would write k [..., H]
    outputs and add them in a further pass. Wide ones (gate / up) are multiplied one by
    one and added: concatenating them would copy more than the adds read."""
    ws, cts = zip(*live)
    width, outs = ws[0].shape[0], sum(w.shape[1] for w in ws)
    if len(live) > 1 and 2 * outs < (len(live) + 1) * width:
        return jnp.matmul(jnp.concatenate(cts, axis=-1), jnp.concatenate(ws, axis=1).T).astype(dtype)
    return sum(jnp.matmul(ct, w.T) for w, ct in live).astype(dtype)


@rms_norm_linear_tangent.def_transpose
def _tangent_transpose(cts, u, gamma, beta, *rest, eps, add):
    k = (len(rest) - (4 if add else 3)) // 2
    ws, linear = rest[:k], rest[k:]
    if any(ad.is_undefined_primal(v) for v in (u, gamma, beta, *ws)):
        raise ValueError("rms_norm_linear tangent is linear in its tangents only")
    ct_s, cts = (cts[0], cts[1:]) if add else (None, cts)
    live = [(w, ct) for w, ct in zip(ws, cts) if type(ct) is not ad.Zero]
    zero = lambda a: jnp.zeros(a.shape, a.dtype)  # noqa: E731
    y = None
    if live:
        # y recomputed, not kept from the forward. The barrier makes the recomputation wait
        # for the cotangents: without it XLA merges it with the forward's identical call (CSE)
        # or schedules it there, and y stays alive after all.
        u, gamma, beta, _ = lax.optimization_barrier((u, gamma, beta, [ct for _, ct in live]))
        dy = _input_grad(live, u.dtype)
        if add and type(ct_s) is not ad.Zero:
            du, dg, db, y = add_rms_norm_bwd_y(u, gamma, beta, dy, ct_s, eps=eps)
        else:
            du, dg, db, y = rms_norm_bwd_y(u, gamma, beta, dy, eps=eps)
    elif add and type(ct_s) is not ad.Zero:  # only the sum is used
        du, dg, db = ct_s, zero(gamma), zero(beta)
    else:
        du = None
    dws = [None if type(ct) is ad.Zero or not ad.is_undefined_primal(tw) else linear_weight_grad(y, ct, w.dtype)
           for w, ct, tw in zip(ws, cts, linear[len(linear) - k:])]
    if du is None:
        dg = db = None
    grads = [du, du] if add else [du]
    grads += [dg, db, *dws]
    out = [None] * (3 + k)
    for g, t in zip(grads, linear):
        out.append(None if not ad.is_undefined_primal(t) else (ad.Zero(t.aval) if g is None else g))
    return out


def _fwd_batching(args, dims, *, eps, add):
    row_args = (0, 1) if add else (0,)
    return rowwise_batching(rms_norm_linear_fwd, row_args)(args, dims, eps=eps, add=add)


def _tangent_batching(args, dims, *, eps, add):
    k = (len(args) - (7 if add else 6)) // 2
    row_args = (0, 3 + k, 4 + k) if add else (0, 3 + k)
    return rowwise_batching(rms_norm_linear_tangent, row_args)(args, dims, eps=eps, add=add)


rms_norm_linear_fwd.def_batching(_fwd_batching)
rms_norm_linear_tangent.def_batching(_tangent_batching)


# ---- public functions ------------------------------------------------------------------


def _weights(weights, width, who):
    """(tuple of [H, O_i] floating arrays, whether one array was given)."""
    single = not isinstance(weights, (tuple, list))
    ws = (weights,) if single else tuple(weights)
    if not ws:
        raise ValueError(f"{who}: weights must be one [H, O] array or a non-empty sequence of them")
    out = []
    for i, w in enumerate(ws):
        w = jnp.asarray(w)
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise TypeError(f"{who}: weights[{i}] must be floating point, got {w.dtype}")
        if w.ndim != 2 or w.shape[0] != width:
            raise ValueError(f"{who}: weights[{i}] must be [H, O] with H = x's last axis {width}, got {w.shape}")
        out.append(w)
    return tuple(out), single


def rms_norm_linear(x, gamma, weights, beta=None, *, eps: float = 1e-6):
    """``rms_norm(x, gamma, beta) @ W`` for each W in ``weights``, with a backward that
    recomputes the normalised x instead of keeping it.

    x: [..., H], normalised over its last axis; gamma, beta: [H] (beta optional); weights:
    one [H, O] array, or a sequence of them (a block's q, k, v projections, say). Returns
    one [..., O] array, or a tuple with one per weight. The norm is ``rms_norm``'s (its
    kernels, dtype promotion and static ``eps``); each product is ``y @ W`` in the promoted
    dtype of y and W at JAX's default precision. Reverse mode keeps x, the parameters and
    the weights, not y: the backward forms y again inside the norm's backward (on CUDA the
    backward kernel writes it; elsewhere the forward kernel runs again first) and takes the
    weight gradients from it. Differentiable in every
    mode; under SPMD sharding the norm runs shard-local over the rows.
    """
    eps = static_eps(eps, "rms_norm_linear")
    x, gamma, beta, _ = _prepare(x, gamma, beta, -1, "rms_norm_linear")
    ws, single = _weights(weights, x.shape[-1], "rms_norm_linear")
    outs = rms_norm_linear_fwd(x, gamma, beta, *ws, eps=eps, add=False)
    return outs[0] if single else tuple(outs)


def add_rms_norm_linear(x, residual, gamma, weights, beta=None, *, eps: float = 1e-6):
    """``add_rms_norm`` followed by linear maps: returns ``(s, out)`` with ``s = x +
    residual`` and ``out = rms_norm(s, gamma, beta) @ W`` for each W in ``weights`` (one
    array for one weight, a tuple for a sequence), with a backward that recomputes the
    normalised s instead of keeping it.

    Shapes, dtypes and ``eps`` as in ``add_rms_norm`` (normalised over the last axis) and
    ``rms_norm_linear``. Reverse mode keeps s, the parameters and the weights; the gradient
    of s and the norm's input gradient are summed inside the fused backward kernel, as in
    ``add_rms_norm``. A pre-norm decoder carries the residual stream through ``s``::

        x, (q, k, v) = add_rms_norm_linear(x, attention_branch, attn_norm, (wq, wk, wv))
    """
    eps = static_eps(eps, "add_rms_norm_linear")
    x, residual = jnp.asarray(x), jnp.asarray(residual)
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm_linear: residual shape {residual.shape} differs from x shape {x.shape}")
    if not jnp.issubdtype(residual.dtype, jnp.floating):
        raise TypeError(f"add_rms_norm_linear: residual must be floating point, got {residual.dtype}")
    x, gamma, beta, _ = _prepare(x, gamma, beta, -1, "add_rms_norm_linear")
    dtype = jnp.result_type(x.dtype, residual.dtype)
    x, residual, gamma, beta = (a.astype(dtype) for a in (x, residual, gamma, beta))
    ws, single = _weights(weights, x.shape[-1], "add_rms_norm_linear")
    s, *outs = rms_norm_linear_fwd(x, residual, gamma, beta, *ws, eps=eps, add=True)
    return s, (outs[0] if single else tuple(outs))
