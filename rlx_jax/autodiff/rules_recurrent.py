"""Graph VJP rules of the recurrent ops (RLX has no backward op for them): SelectiveScan
and GatedDeltaNet are written out step by step in primitive ops (the sequence length
is static) and differentiated through that expansion. The forward value keeps coming
from the op itself."""

from __future__ import annotations

import math

from rlx_jax.ir import GraphError
from rlx_jax.ir.ops_shape import Concat, Narrow
from rlx_jax import ir

from . import emit as E
from .expansion import vjp_via_expansion
from .table import vjp_rule


def _step(t, x, axis, s, keep_shape):
    """Row ``s`` of ``x`` along ``axis``, reshaped to ``keep_shape``."""
    return E.reshape(t, t.add_node(Narrow(axis=axis, start=s, len=1), (x,)), keep_shape)


def _stack(t, rows, axis):
    return rows[0] if len(rows) == 1 else t.add_node(Concat(axis=axis), tuple(rows))


def emit_selective_scan(t, ins):
    """h_t = exp(d_t a) h_{t-1} + d_t x_t b_t; y_t = sum_n c_t[n] h_t[:, n] (h_0 = 0)."""
    x, delta, a, b, c = ins
    bs, s, h = E.dims(t, x)
    n = E.dims(t, a)[-1]
    if not all(isinstance(d, int) for d in (bs, s, h, n)):
        raise GraphError("SelectiveScan reverse mode needs static shapes")
    hs, ys = None, []
    for i in range(s):
        x_t, d_t = _step(t, x, 1, i, (bs, h)), _step(t, delta, 1, i, (bs, h))
        b_t, c_t = _step(t, b, 1, i, (bs, 1, n)), _step(t, c, 1, i, (bs, 1, n))
        inj = E.mul(t, E.reshape(t, E.mul(t, d_t, x_t), (bs, h, 1)), b_t)
        if hs is None:
            hs = inj
        else:
            decay = E.act(t, "Exp", E.mul(t, E.reshape(t, d_t, (bs, h, 1)), a))
            hs = E.add(t, E.mul(t, decay, hs), inj)
        ys.append(E.reshape(t, E.sum_(t, E.mul(t, hs, c_t), (2,)), (bs, 1, h)))
    return _stack(t, ys, 1)


@vjp_rule(ir.SelectiveScan)
def _selective_scan(g, node, dy):
    return vjp_via_expansion(g, node, dy, emit_selective_scan)


def emit_gated_delta_net(t, ins):
    """S *= exp(g_t); d = (v_t - S^T k_t) beta_t; S += k_t d^T; o_t = S^T q_t / sqrt(N)."""
    q, k, v, gg, beta = ins[:5]
    st = ins[5] if len(ins) > 5 else None
    bs, s, h, n = E.dims(t, q)
    if not all(isinstance(d, int) for d in (bs, s, h, n)):
        raise GraphError("GatedDeltaNet reverse mode needs static shapes")
    scale = 1.0 / math.sqrt(n)
    outs = []
    for i in range(s):
        q_t, k_t, v_t = (_step(t, z, 1, i, (bs, h, n)) for z in (q, k, v))
        g_t, b_t = _step(t, gg, 1, i, (bs, h, 1, 1)), _step(t, beta, 1, i, (bs, h, 1))
        if st is not None:
            st = E.mul(t, st, E.act(t, "Exp", g_t))
            sk = E.sum_(t, E.mul(t, st, E.reshape(t, k_t, (bs, h, n, 1))), (2,))     # [B, H, N]
            d = E.mul(t, E.sub(t, v_t, sk), b_t)
        else:
            d = E.mul(t, v_t, b_t)
        outer = E.mul(t, E.reshape(t, k_t, (bs, h, n, 1)), E.reshape(t, d, (bs, h, 1, n)))
        st = outer if st is None else E.add(t, st, outer)
        o = E.sum_(t, E.mul(t, st, E.reshape(t, q_t, (bs, h, n, 1))), (2,))
        outs.append(E.reshape(t, E.mul_s(t, o, scale), (bs, 1, h, n)))
    return _stack(t, outs, 1)


@vjp_rule(ir.GatedDeltaNet)
def _gated_delta_net(g, node, dy):
    return vjp_via_expansion(g, node, dy, emit_gated_delta_net)
