"""SwiGLU: ``h = silu(gate) * up = gate * sigmoid(gate) * up``, elementwise (the gate of
a Llama MLP, ``swiglu(x @ w_gate, x @ w_up) @ w_down``).

Shapes: gate a, up b, h and the gradients all share one shape (any rank) and dtype.
With s = sigmoid(a):

    h  = a s b
    da = dh b s (1 + a (1 - s)) = dh b (s + a s (1 - s))
    db = dh a s

computed in f32 (f64 for f64) and rounded once to the input dtype. At a = +-inf the
products a s and a s (1 - s) take their limits (a s -> 0 at -inf; a s (1 - s) -> 0 at
both ends), so an infinite gate gives h = 0 (-inf) or +-inf (+inf) and the finite da of
the limit (0 at -inf, dh b at +inf), not the NaN of inf * 0. The sigmoid is evaluated as
s = 1 / (1 + e) for a >= 0 and e / (1 + e) for a < 0 with e = exp(-|a|), which also
gives 1 - s without cancellation.

Why only the backward is a kernel:

- the forward stays XLA's: one elementwise fusion, already at memory bandwidth, and a
  custom call would stop XLA fusing it with its neighbours (casts, the elementwise ops
  of the surrounding code). ``swiglu_fwd`` is a primitive with no kernel: it lowers to
  its reference, so XLA fuses it like any other elementwise op;
- the backward is one kernel (``rlx_swiglu_bwd``) reading a, b and dh and writing da
  and db, five tensor passes (the floor). XLA's autodiff of the same maths runs it as
  two fusions that read a and dh twice.

Primitives:
- ``swiglu_fwd``: (a, b) -> (h,), XLA's fusion everywhere;
- ``swiglu_tangent``: (a, b, ta, tb) -> (th,) with th = ta b (s + a s (1 - s)) + tb a s,
  linear in (ta, tb); its transpose is the backward;
- ``swiglu_bwd``: (a, b, dh) -> (da, db), the FFI kernel where registered;
- ``swiglu_bwd_product``: (a, b, dh) -> (da, db, h), the same kernel writing the
  forward's product h as well (``rlx_swiglu_bwd_product``: one more write, no more
  reads), for ``swiglu_linear``'s backward, whose weight gradient needs h.
Everything is elementwise: under vmap the batch axis moves to the front of every
operand and the same primitives run; under SPMD sharding the kernel runs shard-local
over every axis.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import FusedPrimitive, Partition, instantiate, rowwise_batching


def _acc(dtype):
    """Arithmetic dtype: f32, or f64 for f64 inputs."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# ---- references (the test oracle and the fallback) ----------------------------------


def _gate_terms(a):
    """(s, a s, a s (1 - s)) of a in its arithmetic dtype, with the limits at a = +-inf.

    e = exp(-|a|) is in (0, 1] (0 at |a| = inf); the branch a >= 0 keeps the derivative
    of -|a| at a = 0 one-sided, so differentiating this function is exact there too."""
    pos = a >= 0
    e = jnp.exp(jnp.where(pos, -a, a))
    r = 1.0 / (1.0 + e)
    s = jnp.where(pos, r, e * r)
    one_minus_s = jnp.where(pos, e * r, r)
    silu = jnp.where(a == -jnp.inf, 0.0, a * s)
    slope = jnp.where(jnp.isinf(a), 0.0, silu * one_minus_s)
    return s, silu, slope


@jax.custom_jvp
def _swiglu_value(a, b):
    af = a.astype(_acc(a.dtype))
    silu = jnp.where(af == -jnp.inf, 0.0, af * jax.nn.sigmoid(af))
    return (silu * b.astype(af.dtype)).astype(a.dtype)


@partial(_swiglu_value.defjvp, symbolic_zeros=True)
def _swiglu_value_jvp(primals, tangents):
    """The op's derivative with its limits at a = +-inf (JAX's derivative of the select
    above is NaN there: inf * 0), for ``fused_ops(False)``, where JAX differentiates the
    reference; a tangent that is a symbolic zero adds no term (0 * inf would be NaN)."""
    a, b = primals
    ta, tb = tangents
    acc = _acc(a.dtype)
    s, silu, slope = _gate_terms(a.astype(acc))
    th = jnp.zeros(a.shape, acc)
    if type(ta) is not SymbolicZero:
        th = th + ta.astype(acc) * (b.astype(acc) * (s + slope))
    if type(tb) is not SymbolicZero:
        th = th + tb.astype(acc) * silu
    return _swiglu_value(a, b), th.astype(a.dtype)


def reference_swiglu(a, b):
    """h = a sigmoid(a) b; returns (h,). The forward the step runs: XLA's logistic and one
    select for a = -inf (where a s is 0, not -inf * 0), the fewest operations that give the
    limits. At [16384, 5632] bf16 on an H200, XLA's fusion of it takes 149 us, of the
    branchy ``_gate_terms`` form 158 us, of ``jax.nn.silu(a) * b`` (NaN at a = -inf) 140 us.
    Differentiated by JAX (``fused_ops(False)``), its derivative is the op's, limits
    included."""
    return (_swiglu_value(a, b),)


def reference_swiglu_tangent(a, b, ta, tb):
    """th = ta b (s + a s (1 - s)) + tb a s; returns (th,). A zero tangent adds no term
    even against an infinite factor (b, or a s at a = +inf), as JAX skips a symbolic zero
    tangent: the forward mode of ``swiglu(a, b)`` in a alone is finite at a = +inf. The
    primitive's transpose is the backward kernel, so this need not be linear to JAX."""
    acc = _acc(a.dtype)
    s, silu, slope = _gate_terms(a.astype(acc))
    taf, tbf = ta.astype(acc), tb.astype(acc)
    th = (jnp.where(taf == 0, 0.0, taf * b.astype(acc) * (s + slope)) + jnp.where(tbf == 0, 0.0, tbf * silu))
    return (th.astype(a.dtype),)


def reference_swiglu_bwd(a, b, dh):
    """da = dh b (s + a s (1 - s)), db = dh a s; returns (da, db)."""
    acc = _acc(a.dtype)
    s, silu, slope = _gate_terms(a.astype(acc))
    dhf = dh.astype(acc)
    da = dhf * b.astype(acc) * (s + slope)
    db = dhf * silu
    return da.astype(a.dtype), db.astype(a.dtype)


def reference_swiglu_bwd_product(a, b, dh):
    """(da, db) of ``reference_swiglu_bwd`` and h = a s b, each rounded once from f32
    (f64); returns (da, db, h)."""
    acc = _acc(a.dtype)
    _, silu, _ = _gate_terms(a.astype(acc))
    h = (silu * b.astype(acc)).astype(a.dtype)
    return (*reference_swiglu_bwd(a, b, dh), h)


# ---- kernel ----------------------------------------------------------------------------


# da is written over a and db over b (input_output_aliases): each element of a and b is
# read before its gradients are written, by the same thread (CUDA) or the same vector block
# (CPU), so the kernels are safe in place. In a training step a and b are the matmul
# outputs kept for this backward and dead after it; in place, the backward of a Llama MLP
# at [16384, 5632] bf16 holds two [.., F] buffers fewer (352 MiB) at its peak. Where a or
# b is still read afterwards (or is a parameter of the compiled function), XLA copies it
# first.
_IN_PLACE = {0: 0, 1: 1}


def _backward_kernel(target, results):
    """The FFI call of a backward target with ``results`` outputs shaped like a (da, db, and
    for ``rlx_swiglu_bwd_product`` the product h); the kernel reads its operands as flat
    arrays of one shape and dtype."""

    def call(a, b, dh):
        out = (jax.ShapeDtypeStruct(a.shape, a.dtype),) * results
        return jax.ffi.ffi_call(ffi_target(target), out, input_output_aliases=_IN_PLACE)(a, b, dh)

    return call


_kernel_bwd = _backward_kernel("rlx_swiglu_bwd", 2)
_kernel_bwd_product = _backward_kernel("rlx_swiglu_bwd_product", 3)


def _elementwise_factors(avals_in, avals_out, **params):
    """Every operand and result has the same axes: one factor per axis, all shared, and all
    shardable (the FFN axis of tensor parallelism included; axes past the 64th stay whole)."""
    axes = tuple(f"e{i}" for i in range(avals_in[0].ndim))
    return [axes] * len(avals_in), [axes] * len(avals_out)


swiglu_fwd = FusedPrimitive("rlx_swiglu_fwd", reference_swiglu)
swiglu_tangent = FusedPrimitive("rlx_swiglu_tangent", reference_swiglu_tangent)
_ELEMENTWISE = Partition(_elementwise_factors, shardable=[f"e{i}" for i in range(64)])
swiglu_bwd = FusedPrimitive("rlx_swiglu_bwd", reference_swiglu_bwd, target="rlx_swiglu_bwd", kernel=_kernel_bwd,
                            partition=_ELEMENTWISE)
swiglu_bwd_product = FusedPrimitive("rlx_swiglu_bwd_product", reference_swiglu_bwd_product,
                                    target="rlx_swiglu_bwd_product", kernel=_kernel_bwd_product,
                                    partition=_ELEMENTWISE)


# ---- differentiation rules -------------------------------------------------------------


@swiglu_fwd.def_jvp
def _fwd_jvp(primals, tangents):
    a, b = primals
    ta, tb = instantiate(tangents, primals)
    (h,) = swiglu_fwd(a, b)
    (th,) = swiglu_tangent(a, b, ta, tb)
    return (h,), (th,)


@swiglu_tangent.def_transpose
def _tangent_transpose(cts, a, b, ta, tb):
    if ad.is_undefined_primal(a) or ad.is_undefined_primal(b):
        raise ValueError("swiglu tangent is linear in (ta, tb) only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None] + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (ta, tb)]
    da, db = swiglu_bwd(a, b, ct)
    return [None, None] + [d if ad.is_undefined_primal(t) else None for d, t in zip((da, db), (ta, tb))]


# Elementwise primitives: any axis is a "row", so the rows-of-the-last-axis batching rule
# (batch axis to the front of every operand, unbatched operands broadcast) keeps each
# primitive, the kernel included, under vmap.
swiglu_fwd.def_batching(rowwise_batching(swiglu_fwd, row_args=(0, 1)))
swiglu_tangent.def_batching(rowwise_batching(swiglu_tangent, row_args=(0, 1, 2, 3)))
swiglu_bwd.def_batching(rowwise_batching(swiglu_bwd, row_args=(0, 1, 2)))
swiglu_bwd_product.def_batching(rowwise_batching(swiglu_bwd_product, row_args=(0, 1, 2)))


# ---- public functions ------------------------------------------------------------------


def _prepare(gate, up, who):
    """gate and up, checked (floating, one shape) and cast to their promoted dtype
    (``jnp.result_type``)."""
    gate, up = jnp.asarray(gate), jnp.asarray(up)
    for name, v in (("gate", gate), ("up", up)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {v.dtype}")
    if gate.shape != up.shape:
        raise ValueError(f"{who}: gate {gate.shape} and up {up.shape} must have the same shape")
    dtype = jnp.result_type(gate.dtype, up.dtype)
    return gate.astype(dtype), up.astype(dtype)


def _at_least_1d(*xs):
    """The primitives take rank >= 1 (a scalar is one element): 0-d operands as [1]."""
    return [x.reshape(1) if x.ndim == 0 else x for x in xs]


def swiglu(gate, up):
    """``silu(gate) * up = gate * sigmoid(gate) * up``, elementwise.

    gate, up: one shape (any rank, 0-d included), floating dtypes (promoted with
    ``jnp.result_type``); the result has that shape and dtype. Arithmetic in f32 (f64 for
    f64). The forward is XLA's elementwise fusion (no kernel: it fuses with its
    neighbours); reverse mode runs the fused backward kernel ``rlx_swiglu_bwd`` (dgate
    and dup in one pass). Differentiable in every mode; under SPMD sharding the kernel
    runs shard-local over every axis.
    """
    a, b = _prepare(gate, up, "swiglu")
    (h,) = swiglu_fwd(*_at_least_1d(a, b))
    return h.reshape(a.shape)


def swiglu_backward(gate, up, dh):
    """The fused backward of ``swiglu``: returns (dgate, dup) for upstream gradient dh
    (shaped like gate), dgate = dh * up * s * (1 + gate * (1 - s)), dup = dh * gate * s
    with s = sigmoid(gate); computed in the promoted dtype, returned in the dtypes of gate
    and up."""
    a, b = _prepare(gate, up, "swiglu_backward")
    dh = jnp.asarray(dh)
    if not jnp.issubdtype(dh.dtype, jnp.floating):
        raise TypeError(f"swiglu_backward: dh must be floating point, got {dh.dtype}")
    if dh.shape != a.shape:
        raise ValueError(f"swiglu_backward: dh shape {dh.shape} differs from gate shape {a.shape}")
    da, db = swiglu_bwd(*_at_least_1d(a, b, dh.astype(a.dtype)))
    gate_dtype, up_dtype = jnp.asarray(gate).dtype, jnp.asarray(up).dtype
    return da.reshape(a.shape).astype(gate_dtype), db.reshape(a.shape).astype(up_dtype)
