"""SwiGLU then a linear map: ``y = swiglu(gate, up) @ weight``, the down projection of a
Llama MLP (``swiglu(x @ w_gate, x @ w_up) @ w_down``), with a backward that keeps no copy
of the product.

Shapes: gate a and up b [..., F] (one shape, rank >= 1), weight W [F, O]; y [..., O].
With h = a s b (s = sigmoid(a)):

    forward:   h = swiglu(a, b),  y = h W
    backward:  dh = dy W^T
               (da, db, h) = swiglu_bwd_product(a, b, dh)
               dW = sum over the leading axes of h^T dy

Why one op: differentiated as two ops, the product h is a residual of the matmul (dW
needs it), held from the forward to the backward beside a and b, which the SwiGLU
backward keeps anyway. In a Llama step at [16384, 5632] bf16 that is 176 MiB a layer.
Here the residuals are a, b and W; the backward recomputes h in the SwiGLU backward
kernel it runs anyway (``rlx_swiglu_bwd_product``: one more write of h, no more reads)
and only then takes dW. h is recomputed with the backward's sigmoid, so it may differ
from the forward's by one rounding of the dtype.

Primitives:
- ``swiglu_linear_fwd``: (a, b, W) -> (y,), XLA's elementwise fusion and matmul (no
  kernel: the product fuses with its neighbours and the matmul is cuBLAS's / XLA's);
- ``swiglu_linear_tangent``: (a, b, W, ta, tb, tW) -> (ty,) with ty = th W + h tW and th
  ``swiglu``'s tangent; linear in (ta, tb, tW), and its transpose is the backward above.
The matmuls run in the operands' promoted dtype at JAX's default precision, as
``swiglu(a, b) @ W`` does. Under vmap (W unbatched) the batch axis moves to the front of
the activations and the same primitives run; under SPMD sharding XLA partitions the
matmuls and the SwiGLU kernel runs shard-local (the FFN axis of tensor parallelism
included).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad

from rlx_jax.vjp_rules._linear import linear_tangent, linear_weight_grad
from rlx_jax.vjp_rules._primitive import FusedPrimitive, instantiate, rowwise_batching
from rlx_jax.vjp_rules.swiglu import (
    _prepare, reference_swiglu, reference_swiglu_tangent, swiglu_bwd_product, swiglu_fwd,
)


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_swiglu_linear(a, b, w):
    """y = swiglu(a, b) @ W; returns (y,)."""
    (h,) = reference_swiglu(a, b)
    return (jnp.matmul(h, w),)


def reference_swiglu_linear_tangent(a, b, w, ta, tb, tw):
    """ty = th W + h tW; returns (ty,)."""
    (h,) = reference_swiglu(a, b)
    (th,) = reference_swiglu_tangent(a, b, ta, tb)
    return (linear_tangent(h, th, w, tw),)


swiglu_linear_fwd = FusedPrimitive("rlx_swiglu_linear_fwd", reference_swiglu_linear)
swiglu_linear_tangent = FusedPrimitive("rlx_swiglu_linear_tangent", reference_swiglu_linear_tangent)


# ---- differentiation rules -------------------------------------------------------------


@swiglu_linear_fwd.def_jvp
def _fwd_jvp(primals, tangents):
    a, b, w = primals
    ta, tb, tw = instantiate(tangents, primals)
    (y,) = swiglu_linear_fwd(a, b, w)
    (ty,) = swiglu_linear_tangent(a, b, w, ta, tb, tw)
    return (y,), (ty,)


@swiglu_linear_tangent.def_transpose
def _tangent_transpose(cts, a, b, w, ta, tb, tw):
    if any(ad.is_undefined_primal(x) for x in (a, b, w)):
        raise ValueError("swiglu_linear tangent is linear in (ta, tb, tw) only")
    (ct,) = cts
    linear = (ta, tb, tw)
    if type(ct) is ad.Zero:
        return [None] * 3 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in linear]
    want_ab = ad.is_undefined_primal(ta) or ad.is_undefined_primal(tb)
    if want_ab:
        dh = jnp.matmul(ct, w.T).astype(a.dtype)
        da, db, h = swiglu_bwd_product(a, b, dh)
    else:  # only W's cotangent: the product recomputed by the forward's fusion, behind a
        # barrier on the cotangent so that XLA does not merge it with the forward's (CSE)
        da = db = None
        a, b, _ = lax.optimization_barrier((a, b, ct))
        (h,) = swiglu_fwd(a, b)
    dw = linear_weight_grad(h, ct, w.dtype) if ad.is_undefined_primal(tw) else None
    return [None] * 3 + [d if ad.is_undefined_primal(t) else None for d, t in zip((da, db, dw), linear)]


# W unbatched: the batch axis goes to the front of the activations and the primitive runs
# on the enlarged leading axes (a batched W falls back to vmap of the reference).
swiglu_linear_fwd.def_batching(rowwise_batching(swiglu_linear_fwd, row_args=(0, 1)))
swiglu_linear_tangent.def_batching(rowwise_batching(swiglu_linear_tangent, row_args=(0, 1, 3, 4)))


# ---- public function -------------------------------------------------------------------


def swiglu_linear(gate, up, weight):
    """``swiglu(gate, up) @ weight``: SwiGLU followed by a linear map (a Llama MLP's down
    projection), whose backward recomputes the product instead of keeping it.

    gate, up: [..., F], one shape (rank >= 1), floating (promoted with
    ``jnp.result_type``); weight: [F, O], floating. Returns [..., O] in the promoted dtype
    of the product and weight, computed as ``swiglu(gate, up) @ weight`` is (XLA's fusion,
    then the matmul at JAX's default precision). Reverse mode keeps gate, up and weight,
    not the [..., F] product: the fused SwiGLU backward kernel writes it again beside
    dgate and dup, and the weight gradient is taken from that. Differentiable in every
    mode; under SPMD sharding the kernel runs shard-local.
    """
    a, b = _prepare(gate, up, "swiglu_linear")
    w = jnp.asarray(weight)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"swiglu_linear: weight must be floating point, got {w.dtype}")
    if a.ndim < 1:
        raise ValueError("swiglu_linear: gate and up must have rank >= 1 (their last axis meets weight's first)")
    if w.ndim != 2 or w.shape[0] != a.shape[-1]:
        raise ValueError(f"swiglu_linear: weight must be [F, O] with F = gate's last axis {a.shape[-1]}, "
                         f"got {w.shape}")
    (y,) = swiglu_linear_fwd(a, b, w)
    return y
