"""Softmax cross-entropy with integer class labels, and its fused linear form.

``softmax_cross_entropy(logits [N, C], labels [N]) -> loss [N]``:

    lse_n  = log sum_j exp(logits_nj)
    loss_n = lse_n - logits_n,labels_n
    dlogits_nj = (softmax(logits_n)_j - [j == labels_n]) * dloss_n

Labels are integers; RLX encodes them as f32, so float labels holding integers are
accepted (rounded to the nearest integer). **Invalid labels**: a label outside
``[0, C)`` (for example PyTorch's ignore index -100) marks a row that takes no part in
the loss: its loss is 0 and its logits get a zero gradient. The kernels compare each
label with C before indexing, so no label ever reads out of bounds.

Primitives (lowering to the FFI kernels where registered, else to their references;
the leading axes of logits are rows, so vmap stays on the kernels):
- ``ce_fwd``: (logits, labels) -> (loss, lse); lse is f32 (f64 for f64 logits);
- ``ce_tangent``: (logits, labels, lse, t_logits) -> t_loss = sum(p * t) - t[label],
  linear in t_logits; its transpose is the backward;
- ``ce_bwd``: (logits, labels, lse, dloss) -> dlogits, one read of the logits and one
  write of dlogits; ``lse`` must be the logits' logsumexp. With ``recompute_lse=True``
  (the RLX SoftmaxCrossEntropyBackward op, which has no saved statistics) the kernel
  ignores ``lse`` and computes it from each row while the row is in cache, so it is
  still one pass over the logits. **On the CPU the kernel always recomputes** and is
  not given ``lse``: a gradient then depends on the logits only, and when nothing
  reads the loss XLA drops the forward kernel (one read of the logits and one write
  of dlogits in all, as XLA's own fused autodiff). CUDA passes the saved ``lse``.

``fused_linear_cross_entropy(hidden [N, D], weight [D, V], labels [N], *, chunk_size)``
is ``softmax_cross_entropy(hidden @ weight, labels)`` without ever materialising the
[N, V] logits: the vocabulary is processed in chunks of ``chunk_size`` columns with an
online logsumexp (running max and rescaled sum), and the backward recomputes each
chunk's logits to accumulate d hidden (carried) and d weight (one [D, chunk] block per
chunk). It is plain JAX (``lax.scan`` over chunks; XLA's matmuls do the work) behind
the same forward / tangent / backward primitive triple, so every mode works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import FusedPrimitive, RowPartition, instantiate, rowwise_batching


def _acc(dtype):
    """Arithmetic / statistics type: f32 for f32/bf16/f16, f64 for f64."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _label_parts(labels, classes):
    """(valid mask, safe index) for integer labels: invalid labels index column 0
    but are masked out everywhere they are used."""
    ok = (labels >= 0) & (labels < classes)
    return ok, jnp.where(ok, labels, 0)


# ---- references (the test oracle and the fallback) ----------------------------------


def reference_softmax_cross_entropy(logits, labels):
    """Over the last axis in f32 (f64); returns (loss [rows], lse [rows])."""
    acc = _acc(logits.dtype)
    lf = logits.astype(acc)
    m = lax.stop_gradient(jnp.max(lf, axis=-1))
    lse = m + jnp.log(jnp.sum(jnp.exp(lf - m[..., None]), axis=-1))
    ok, idx = _label_parts(labels, logits.shape[-1])
    picked = jnp.take_along_axis(lf, idx[..., None], axis=-1)[..., 0]
    loss = jnp.where(ok, lse - picked, 0)
    return loss.astype(logits.dtype), lse


def _softmax_minus_onehot(logits, labels, lse, dloss, dlse=None):
    """(p - onehot) * dloss (+ p * dlse) with p = exp(logits - lse); rows with an
    invalid label take no part (zero)."""
    acc = lse.dtype
    ok, idx = _label_parts(labels, logits.shape[-1])
    p = jnp.exp(logits.astype(acc) - lse[..., None])
    onehot = jnp.arange(logits.shape[-1]) == idx[..., None]
    g = jnp.where(ok, dloss.astype(acc), 0)[..., None]
    out = p * g - jnp.where(onehot, g, 0)
    if dlse is not None:
        out = out + p * dlse.astype(acc)[..., None]
    return out


def reference_softmax_cross_entropy_bwd(logits, labels, lse, dloss, *, recompute_lse=False):
    """dlogits = (softmax - onehot) * dloss; returns (dlogits,)."""
    if recompute_lse:
        _, lse = reference_softmax_cross_entropy(logits, labels)
    return (_softmax_minus_onehot(logits, labels, lse, dloss).astype(logits.dtype),)


def reference_softmax_cross_entropy_tangent(logits, labels, lse, t_logits):
    """t_loss = sum_j p_j t_j - t_label (0 for invalid labels); returns (t_loss,)."""
    acc = lse.dtype
    ok, idx = _label_parts(labels, logits.shape[-1])
    p = jnp.exp(logits.astype(acc) - lse[..., None])
    tf = t_logits.astype(acc)
    picked = jnp.take_along_axis(tf, idx[..., None], axis=-1)[..., 0]
    t = jnp.where(ok, jnp.sum(p * tf, axis=-1) - picked, 0)
    return (t.astype(logits.dtype),)


# ---- kernels ---------------------------------------------------------------------------


def _kernel_fwd(logits, labels):
    rows = logits.shape[:-1]
    out = (jax.ShapeDtypeStruct(rows, logits.dtype), jax.ShapeDtypeStruct(rows, _acc(logits.dtype)))
    return jax.ffi.ffi_call(ffi_target("rlx_softmax_ce_fwd"), out)(logits, labels)


def _kernel_bwd(logits, labels, lse, dloss, *, recompute_lse=False):
    out = (jax.ShapeDtypeStruct(logits.shape, logits.dtype),)
    return jax.ffi.ffi_call(ffi_target("rlx_softmax_ce_bwd"), out)(
        logits, labels, lse, dloss, recompute_lse=np.bool_(recompute_lse)
    )


def _kernel_bwd_cpu(logits, labels, lse, dloss, *, recompute_lse=False):
    """CPU: the kernel always recomputes lse from each row (``recompute_lse=True``: a
    max pass over the row in cache, no extra exp) and the lse operand is a zero
    placeholder, so the call does not depend on the forward kernel. When nothing reads
    the loss (``jax.grad`` of a loss), XLA then removes the forward kernel and the
    gradient reads the logits once and writes dlogits once, instead of reading the
    logits twice. Same result as the given lse whenever it is the logits' logsumexp,
    which it is for every caller (the transpose passes ``ce_fwd``'s)."""
    del lse
    placeholder = jnp.zeros(labels.shape, _acc(logits.dtype))
    return _kernel_bwd(logits, labels, placeholder, dloss, recompute_lse=True)


def _kernel_fwd_cuda(logits, labels):
    """CUDA: the same call (lse f32); f64 (which the CUDA kernels do not take) lowers
    the reference."""
    if logits.dtype == jnp.float64:
        return reference_softmax_cross_entropy(logits, labels)
    return _kernel_fwd(logits, labels)


def _kernel_bwd_cuda(logits, labels, lse, dloss, *, recompute_lse=False):
    if logits.dtype == jnp.float64:
        return reference_softmax_cross_entropy_bwd(logits, labels, lse, dloss, recompute_lse=recompute_lse)
    return _kernel_bwd(logits, labels, lse, dloss, recompute_lse=recompute_lse)


def _kernel_ok(logits, labels, *rest, **params):
    return (
        logits.ndim >= 1
        and logits.dtype in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
        and labels.dtype == jnp.int32
        and labels.shape == logits.shape[:-1]
        and all(a.shape == labels.shape for a in rest)
    )


# Under SPMD sharding the rows split across devices (the class axis stays whole).
ce_fwd = FusedPrimitive(
    "rlx_softmax_ce_fwd",
    reference_softmax_cross_entropy,
    target="rlx_softmax_ce_fwd",
    kernel={"cpu": _kernel_fwd, "cuda": _kernel_fwd_cuda},
    kernel_ok=_kernel_ok,
    partition=RowPartition(row_args=(0,), stat_args=(1,), row_outputs=(), stat_outputs=(0, 1)),
)
ce_tangent = FusedPrimitive("rlx_softmax_ce_tangent", reference_softmax_cross_entropy_tangent)
ce_bwd = FusedPrimitive(
    "rlx_softmax_ce_bwd",
    reference_softmax_cross_entropy_bwd,
    target="rlx_softmax_ce_bwd",
    kernel={"cpu": _kernel_bwd_cpu, "cuda": _kernel_bwd_cuda},
    kernel_ok=_kernel_ok,
    partition=RowPartition(row_args=(0,), stat_args=(1, 2, 3), row_outputs=(0,)),
)


# ---- differentiation rules -------------------------------------------------------------


@ce_fwd.def_jvp
def _fwd_jvp(primals, tangents):
    logits, labels = primals
    t_logits = instantiate(tangents, primals)[0]
    loss, lse = ce_fwd(logits, labels)
    (t_loss,) = ce_tangent(logits, labels, lse, t_logits)
    # d lse = sum(p * t): needed when lse itself is differentiated (second order)
    p = jnp.exp(logits.astype(lse.dtype) - lse[..., None])
    t_lse = jnp.sum(p * t_logits.astype(lse.dtype), axis=-1)
    return (loss, lse), (t_loss, t_lse)


@ce_tangent.def_transpose
def _tangent_transpose(cts, logits, labels, lse, t_logits):
    for residual in (logits, lse):
        if ad.is_undefined_primal(residual):
            raise ValueError("softmax cross-entropy tangent is linear in t_logits only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None, None, ad.Zero(t_logits.aval)]
    (dlogits,) = ce_bwd(logits, labels, lse, ct.astype(logits.dtype), recompute_lse=False)
    return [None, None, None, dlogits.astype(t_logits.aval.dtype)]


ce_fwd.def_batching(rowwise_batching(ce_fwd, row_args=(0, 1)))
ce_bwd.def_batching(rowwise_batching(ce_bwd, row_args=(0, 1, 2, 3)))


# ---- public functions ------------------------------------------------------------------


def _labels_int32(labels, rows, who):
    labels = jnp.asarray(labels)
    if labels.shape != (rows,):
        raise ValueError(f"{who}: labels must have shape ({rows},), got {labels.shape}")
    if jnp.issubdtype(labels.dtype, jnp.integer):
        return labels.astype(jnp.int32)
    if jnp.issubdtype(labels.dtype, jnp.floating):
        # RLX's f32-encoded class ids; no gradient flows into labels
        return jnp.round(lax.stop_gradient(labels)).astype(jnp.int32)
    raise TypeError(f"{who}: labels must be integers (or floats holding integers), got {labels.dtype}")


def _check_logits(logits, who):
    logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{who}: logits must be floating point, got {logits.dtype}")
    if logits.ndim != 2:
        raise ValueError(f"{who}: logits must be [N, C], got shape {logits.shape}")
    if logits.shape[1] == 0:
        raise ValueError(f"{who}: logits need at least one class (C = 0)")
    return logits


def softmax_cross_entropy(logits, labels):
    """Per-row loss ``logsumexp(logits[n]) - logits[n, labels[n]]``.

    logits: [N, C] floating; labels: [N] integers (or floats holding integers, as RLX
    encodes them). Returns loss [N] in the logits' dtype (f32 arithmetic for
    bf16/f16). Rows whose label is outside [0, C) get loss 0 and zero gradient.
    Reverse mode runs the fused backward kernel ``rlx_softmax_ce_bwd`` with the
    logsumexp saved by the forward kernel.
    """
    logits = _check_logits(logits, "softmax_cross_entropy")
    labels = _labels_int32(labels, logits.shape[0], "softmax_cross_entropy")
    loss, _ = ce_fwd(logits, labels)
    return loss


def softmax_cross_entropy_backward(logits, labels, dloss):
    """The RLX op SoftmaxCrossEntropyBackward: ``dlogits = (softmax(logits) - onehot(labels))
    * dloss[:, None]`` from one pass over the logits (the kernel computes each row's
    logsumexp while the row is in cache). Same label rules as the forward."""
    logits = _check_logits(logits, "softmax_cross_entropy_backward")
    labels = _labels_int32(labels, logits.shape[0], "softmax_cross_entropy_backward")
    dloss = jnp.asarray(dloss)
    if dloss.shape != (logits.shape[0],):
        raise ValueError(
            f"softmax_cross_entropy_backward: dloss must have shape ({logits.shape[0]},), got {dloss.shape}"
        )
    lse = jnp.zeros((logits.shape[0],), _acc(logits.dtype))  # ignored: recomputed per row
    (dlogits,) = ce_bwd(logits, labels, lse, dloss.astype(logits.dtype), recompute_lse=True)
    return dlogits


# ---- fused linear + cross-entropy --------------------------------------------------------


def _n_chunks(vocab, chunk_size):
    return -(-vocab // chunk_size)


def _chunk(hidden, weight, k, chunk_size, acc):
    """Chunk k of the vocabulary, read in place (no padded copy of the weight): columns
    [start, start + chunk) with start = min(k * chunk, V - chunk), so the last chunk may
    overlap the one before; ``fresh`` marks the columns no earlier chunk has covered.
    Returns (w_chunk, logits in ``acc`` with stale columns at -inf, column ids, fresh)."""
    vocab = weight.shape[1]
    start = jnp.minimum(k * chunk_size, vocab - chunk_size)
    wc = lax.dynamic_slice_in_dim(weight, start, chunk_size, axis=1)
    cols = start + jnp.arange(chunk_size)
    fresh = cols >= k * chunk_size
    z = jnp.dot(hidden, wc, preferred_element_type=acc).astype(acc)
    return wc, jnp.where(fresh, z, -jnp.inf), cols, fresh


def reference_fused_linear_cross_entropy(hidden, weight, labels, *, chunk_size):
    """Chunked forward with an online logsumexp; returns (loss [N], lse [N])."""
    acc = _acc(hidden.dtype)
    vocab = weight.shape[1]
    ok, idx = _label_parts(labels, vocab)
    rows = hidden.shape[0]

    def step(carry, k):
        m, s, picked = carry
        _, z, cols, fresh = _chunk(hidden, weight, k, chunk_size, acc)
        m_new = jnp.maximum(m, lax.stop_gradient(jnp.max(z, axis=1)))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        hit = fresh & (cols == idx[:, None])
        picked = picked + jnp.sum(jnp.where(hit, z, 0), axis=1)
        return (m_new, s, picked), None

    init = (jnp.full((rows,), -jnp.inf, acc), jnp.zeros((rows,), acc), jnp.zeros((rows,), acc))
    (m, s, picked), _ = lax.scan(step, init, jnp.arange(_n_chunks(vocab, chunk_size)))
    lse = m + jnp.log(s)
    loss = jnp.where(ok, lse - picked, 0)
    return loss.astype(hidden.dtype), lse


def reference_fused_linear_cross_entropy_tangent(hidden, weight, labels, lse, t_hidden, t_weight, *, chunk_size):
    """(t_loss, t_lse) for tangents of hidden and weight, chunk by chunk:
    with tz = t_hidden @ W_c + hidden @ t_W_c, t_lse = sum p * tz, t_loss = t_lse - tz[label]."""
    acc = lse.dtype
    vocab = weight.shape[1]
    ok, idx = _label_parts(labels, vocab)

    def step(carry, k):
        t_lse, t_picked = carry
        wc, z, cols, fresh = _chunk(hidden, weight, k, chunk_size, acc)
        twc = lax.dynamic_slice_in_dim(t_weight, cols[0], chunk_size, axis=1)
        p = jnp.exp(z - lse[:, None])
        tz = jnp.dot(t_hidden, wc, preferred_element_type=acc) + jnp.dot(hidden, twc, preferred_element_type=acc)
        tz = jnp.where(fresh, tz.astype(acc), 0)
        t_lse = t_lse + jnp.sum(p * tz, axis=1)
        t_picked = t_picked + jnp.sum(jnp.where(cols == idx[:, None], tz, 0), axis=1)
        return (t_lse, t_picked), None

    zeros = jnp.zeros(lse.shape, acc)
    (t_lse, t_picked), _ = lax.scan(step, (zeros, zeros), jnp.arange(_n_chunks(vocab, chunk_size)))
    t_loss = jnp.where(ok, t_lse - t_picked, 0)
    return t_loss.astype(hidden.dtype), t_lse


def reference_fused_linear_cross_entropy_bwd(hidden, weight, labels, lse, dloss, dlse, *, chunk_size):
    """(d hidden, d weight) for cotangents (dloss, dlse): per chunk, g = p * (dloss + dlse)
    - onehot * dloss; d hidden += g @ W_c^T and d W[:, chunk] += hidden^T @ g, both
    carried (d weight is updated in place, one [D, chunk] block per step)."""
    acc = lse.dtype
    vocab = weight.shape[1]
    ok, idx = _label_parts(labels, vocab)
    g_loss = jnp.where(ok, dloss.astype(acc), 0)
    g_lse = dlse.astype(acc)

    def step(carry, k):
        dh, dw = carry
        wc, z, cols, fresh = _chunk(hidden, weight, k, chunk_size, acc)
        p = jnp.exp(z - lse[:, None])  # 0 on stale columns
        hit = fresh & (cols == idx[:, None])
        g = (p * (g_loss + g_lse)[:, None] - jnp.where(hit, g_loss[:, None], 0)).astype(hidden.dtype)
        dh = dh + jnp.dot(g, wc.T, preferred_element_type=acc)
        dwc = jnp.dot(hidden.T, g, preferred_element_type=acc).astype(weight.dtype)
        block = lax.dynamic_slice_in_dim(dw, cols[0], chunk_size, axis=1)
        dw = lax.dynamic_update_slice_in_dim(dw, block + dwc, cols[0], axis=1)
        return (dh, dw), None

    init = (jnp.zeros(hidden.shape, acc), jnp.zeros(weight.shape, weight.dtype))
    (dh, dw), _ = lax.scan(step, init, jnp.arange(_n_chunks(vocab, chunk_size)))
    return dh.astype(hidden.dtype), dw


flce_fwd = FusedPrimitive("rlx_fused_linear_ce_fwd", reference_fused_linear_cross_entropy)
flce_tangent = FusedPrimitive("rlx_fused_linear_ce_tangent", reference_fused_linear_cross_entropy_tangent)
flce_bwd = FusedPrimitive("rlx_fused_linear_ce_bwd", reference_fused_linear_cross_entropy_bwd)


@flce_fwd.def_jvp
def _flce_jvp(primals, tangents, *, chunk_size):
    hidden, weight, labels = primals
    th, tw, _ = instantiate(tangents, primals)
    loss, lse = flce_fwd(hidden, weight, labels, chunk_size=chunk_size)
    t_loss, t_lse = flce_tangent(hidden, weight, labels, lse, th, tw, chunk_size=chunk_size)
    return (loss, lse), (t_loss, t_lse)


@flce_tangent.def_transpose
def _flce_tangent_transpose(cts, hidden, weight, labels, lse, th, tw, *, chunk_size):
    for residual in (hidden, weight, lse):
        if ad.is_undefined_primal(residual):
            raise ValueError("fused linear cross-entropy tangent is linear in (t_hidden, t_weight) only")
    ct_loss, ct_lse = cts
    if type(ct_loss) is ad.Zero and type(ct_lse) is ad.Zero:
        return [None] * 4 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (th, tw)]
    ct_loss = jnp.zeros(lse.shape, hidden.dtype) if type(ct_loss) is ad.Zero else ct_loss
    ct_lse = jnp.zeros(lse.shape, lse.dtype) if type(ct_lse) is ad.Zero else ct_lse
    dh, dw = flce_bwd(hidden, weight, labels, lse, ct_loss, ct_lse, chunk_size=chunk_size)
    return [None] * 4 + [d if ad.is_undefined_primal(t) else None for d, t in ((dh, th), (dw, tw))]


def fused_linear_cross_entropy(hidden, weight, labels, *, chunk_size: int = 4096):
    """``softmax_cross_entropy(hidden @ weight, labels)`` without the [N, V] logits.

    hidden: [N, D]; weight: [D, V] (same floating dtype); labels: [N] (integers or
    floats holding integers; outside [0, V) -> loss 0, no gradient). The vocabulary is
    processed ``chunk_size`` columns at a time, so the largest intermediate is
    [N, chunk_size]. Returns loss [N]. Differentiable in hidden and weight in every mode.
    """
    who = "fused_linear_cross_entropy"
    hidden, weight = jnp.asarray(hidden), jnp.asarray(weight)
    if not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise TypeError(f"{who}: hidden must be floating point, got {hidden.dtype}")
    if hidden.ndim != 2 or weight.ndim != 2:
        raise ValueError(f"{who}: hidden must be [N, D] and weight [D, V], got {hidden.shape} and {weight.shape}")
    if weight.shape[0] != hidden.shape[1]:
        raise ValueError(f"{who}: weight must have shape ({hidden.shape[1]}, V), got {weight.shape}")
    if weight.shape[1] == 0:
        raise ValueError(f"{who}: weight needs at least one vocabulary column (V = 0)")
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0:
        raise ValueError(f"{who}: chunk_size must be a positive int, got {chunk_size!r}")
    labels = _labels_int32(labels, hidden.shape[0], who)
    chunk_size = int(min(chunk_size, weight.shape[1]))
    loss, _ = flce_fwd(hidden, weight.astype(hidden.dtype), labels, chunk_size=chunk_size)
    return loss
