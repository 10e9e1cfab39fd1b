"""Recurrent ops: SelectiveScan (Mamba) and GatedDeltaNet, each one ``lax.scan`` over
time (never unrolled), so compile time does not grow with the sequence length.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from rlx_jax import ir

from .registry import lowering_rule


def selective_scan(x, delta, a, b, c):
    """Mamba recurrence, x/delta [B, S, H], a [H, N], b/c [B, S, N] -> y [B, S, H]:

    h_t = exp(delta_t * a) * h_{t-1} + delta_t * b_t * x_t   (h [B, H, N], h_0 = 0)
    y_t = sum_n c_t[n] * h_t[:, n]
    """
    bsz, _, h = x.shape
    n = a.shape[-1]
    dt = jnp.result_type(x, delta, a, b, c)
    h0 = jnp.zeros((bsz, h, n), dt)
    xs = tuple(jnp.moveaxis(t.astype(dt), 1, 0) for t in (x, delta, b, c))

    def step(hs, s):
        x_t, d_t, b_t, c_t = s                      # [B,H], [B,H], [B,N], [B,N]
        decay = jnp.exp(d_t[..., None] * a)          # [B, H, N]
        hs = decay * hs + (d_t * x_t)[..., None] * b_t[:, None, :]
        y = jnp.einsum("bhn,bn->bh", hs, c_t)
        return hs, y

    _, ys = lax.scan(step, h0, xs)
    return jnp.moveaxis(ys, 0, 1)


@lowering_rule(ir.SelectiveScan)
def _selective_scan(op, args, ctx):
    x, delta, a, b, c = args
    return ctx.cast_out(selective_scan(x, delta, a, b, c))


def gated_delta_net(q, k, v, g, beta, state=None):
    """Gated delta rule, q/k/v [B, S, H, N], g/beta [B, S, H], state [B, H, N, N]
    (default zeros) -> o [B, S, H, N]. Per step and head, S [N, N]:

    S *= exp(g_t); d = (v_t - S^T k_t) * beta_t; S += k_t d^T; o_t = S^T q_t / sqrt(N)
    """
    bsz, _, h, n = q.shape
    dt = jnp.result_type(q, k, v, g, beta)
    s0 = jnp.zeros((bsz, h, n, n), dt) if state is None else state.astype(dt)
    scale = 1.0 / math.sqrt(n)
    xs = tuple(jnp.moveaxis(t.astype(dt), 1, 0) for t in (q, k, v, g, beta))

    def step(s, inp):
        q_t, k_t, v_t, g_t, b_t = inp                # [B,H,N] x3, [B,H] x2
        s = s * jnp.exp(g_t)[..., None, None]
        sk = jnp.einsum("bhij,bhi->bhj", s, k_t)
        d = (v_t - sk) * b_t[..., None]
        s = s + k_t[..., :, None] * d[..., None, :]
        o = jnp.einsum("bhij,bhi->bhj", s, q_t) * scale
        return s, o

    _, os_ = lax.scan(step, s0, xs)
    return jnp.moveaxis(os_, 0, 1)


@lowering_rule(ir.GatedDeltaNet)
def _gated_delta_net(op, args, ctx):
    # [q, k, v, g, beta, (state if carry_state)] -> o; the final state is not an output.
    q, k, v, g, beta = args[:5]
    state = args[5] if bool(op.carry_state) and len(args) > 5 else None
    return ctx.cast_out(gated_delta_net(q, k, v, g, beta, state))
