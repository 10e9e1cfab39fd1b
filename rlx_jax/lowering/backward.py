"""RLX backward ops, lowered to the ``<family>_backward`` wrappers of
``rlx_jax.vjp_rules.<family>`` (the same backward primitive the fused ops' custom VJPs
transpose to, so a graph gradient and ``jax.grad`` run the same kernel).

Sibling nodes (dx / dgamma / dbeta of one norm, dq / dk / dv of one attention) lower to
one wrapper call: the result is memoised in the lowering context under the family and
the ids of the shared inputs.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp

from .registry import lowering_rule


def backward_fn(family: str, name: str | None = None):
    """``rlx_jax.vjp_rules.<family>.<name or family_backward>`` (imported at call time)."""
    name = name or f"{family}_backward"
    try:
        mod = importlib.import_module(f"rlx_jax.vjp_rules.{family}")
    except ModuleNotFoundError:
        mod = None
    fn = getattr(mod, name, None) if mod is not None else None
    if fn is None:
        raise NotImplementedError(f"rlx_jax.vjp_rules.{family}.{name} is not available yet")
    return fn


def _attrs(op, *names):
    return tuple(getattr(op, n) for n in names)


# ---- RMSNorm -------------------------------------------------------------------------------

def _rms_all(op, args, ctx):
    x, gamma, beta, dy = args
    key = ("rms_norm", ctx.node_input_ids(), _attrs(op, "axis", "eps"))
    return ctx.memo(key, lambda: backward_fn("rms_norm")(x, gamma, beta, dy, axis=int(op.axis),
                                                         eps=float(op.eps)))


@lowering_rule("RmsNormBackwardInput")
def _rms_norm_backward_input(op, args, ctx):
    # [x, gamma, beta, dy] -> dx
    return ctx.cast_out(_rms_all(op, args, ctx)[0])


@lowering_rule("RmsNormBackwardGamma")
def _rms_norm_backward_gamma(op, args, ctx):
    # [x, gamma, beta, dy] -> dgamma = sum_rows(dy * x * rstd)
    return ctx.cast_out(_rms_all(op, args, ctx)[1])


@lowering_rule("RmsNormBackwardBeta")
def _rms_norm_backward_beta(op, args, ctx):
    # [x, gamma, beta, dy] -> dbeta = sum_rows(dy)
    return ctx.cast_out(_rms_all(op, args, ctx)[2])
