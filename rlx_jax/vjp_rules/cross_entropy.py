"""Softmax cross-entropy with integer class labels.

``softmax_cross_entropy(logits [..., V], labels [...], *, ignore_index=-100) -> loss [...]``:

    lse_n  = log sum_j exp(logits_nj)
    loss_n = lse_n - logits_n,labels_n
    dlogits_nj = (softmax(logits_n)_j - [j == labels_n]) * dloss_n

Labels are integer arrays (float labels raise ``TypeError``). A row whose label equals
``ignore_index`` has loss 0 and a zero gradient; any other label outside ``[0, V)`` gives
that row a NaN loss (as optax) and a zero gradient. The kernels never index with an
out-of-range label: they see -1 for ignored and bad rows (``kernel_labels``) and treat
any label outside ``[0, V)`` as "no part in the loss"; the NaN is added in JAX.

Primitives (lowering to the FFI kernels where registered, else to their references;
the leading axes of logits are rows, so vmap stays on the kernels):
- ``ce_fwd``: (logits, labels) -> (loss, lse); lse is f32 (f64 for f64 logits);
- ``ce_tangent``: (logits, labels, lse, t_logits) -> t_loss = sum(p * t) - t[label],
  linear in t_logits; its transpose is the backward;
- ``ce_loss_grad``: (logits, labels, scale) -> (loss, lse, dlogits) for the fused linear
  cross-entropy's logits blocks: the forward's statistics (f32 / f64) and the gradient of
  sum(scale * loss) in a chosen dtype (``grad_dtype``), from one read of the logits (the
  backward kernel's recomputing pass that also writes lse and loss);
- ``ce_bwd``: (logits, labels, lse, dloss) -> dlogits, one read of the logits and one
  write of dlogits; ``lse`` must be the logits' logsumexp. With ``recompute_lse=True``
  (the RLX SoftmaxCrossEntropyBackward op, which has no saved statistics) the kernel
  ignores ``lse`` and computes it from each row while the row is in cache, so it is
  still one pass over the logits. **On the CPU the kernel always recomputes** and is
  not given ``lse``: a gradient then depends on the logits only, and when nothing
  reads the loss XLA drops the forward kernel (one read of the logits and one write
  of dlogits in all, as XLA's own fused autodiff). CUDA passes the saved ``lse``.

Sharding: rows split any way; when the class axis V is sharded too, ``ce_fwd`` and
``ce_bwd`` run vocabulary-parallel (``_vocab_parallel``): per shard the local max,
sum of exponentials and picked logit, combined by a pmax and one psum of [2, rows];
the backward is elementwise on each shard given the combined lse. Nothing of size
[N, V] is gathered.

``fused_linear_cross_entropy`` lives in ``linear_cross_entropy`` and is re-exported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import FusedPrimitive, instantiate, rowwise_batching
from rlx_jax.vjp_rules._vocab_parallel import (
    VocabPartition, acc_dtype as _acc, block_lse_and_picked, check_ignore_index, check_labels, kernel_labels,
    nan_where, shard_index,
)


def _label_parts(labels, classes):
    """(valid mask, safe index) for integer labels: invalid labels index column 0
    but are masked out everywhere they are used."""
    ok = (labels >= 0) & (labels < classes)
    return ok, jnp.where(ok, labels, 0)


# ---- references (the test oracle and the fallback) ----------------------------------


def _loss_and_lse(logits, labels):
    """(loss, lse) [rows] over the last axis, both in f32 (f64)."""
    acc = _acc(logits.dtype)
    lf = logits.astype(acc)
    m = lax.stop_gradient(jnp.max(lf, axis=-1))
    lse = m + jnp.log(jnp.sum(jnp.exp(lf - m[..., None]), axis=-1))
    ok, idx = _label_parts(labels, logits.shape[-1])
    picked = jnp.take_along_axis(lf, idx[..., None], axis=-1)[..., 0]
    return jnp.where(ok, lse - picked, 0), lse


def reference_softmax_cross_entropy(logits, labels):
    """Over the last axis in f32 (f64); returns (loss [rows] in the logits' dtype, lse [rows])."""
    loss, lse = _loss_and_lse(logits, labels)
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


def reference_loss_grad(logits, labels, scale, *, grad_dtype):
    """One pass for a loss of rows scaled by ``scale`` [rows] (f32 / f64, 0 for rows that
    take no part): (loss, lse) in f32 (f64) as the forward, and dlogits = (softmax -
    onehot) * scale in ``grad_dtype``."""
    loss, lse = _loss_and_lse(logits, labels)
    return loss, lse, _softmax_minus_onehot(logits, labels, lse, scale).astype(grad_dtype)


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


def _kernel_loss_grad(logits, labels, scale, *, grad_dtype, in_place=False):
    """``in_place``: dlogits takes the logits' buffer where the dtypes agree (XLA copies
    the logits first if anything else still reads them)."""
    rows, acc = labels.shape, _acc(logits.dtype)
    out = (jax.ShapeDtypeStruct(rows, acc), jax.ShapeDtypeStruct(rows, acc),
           jax.ShapeDtypeStruct(logits.shape, grad_dtype))
    aliases = {0: 2} if in_place and jnp.dtype(grad_dtype) == logits.dtype else {}
    return jax.ffi.ffi_call(ffi_target("rlx_softmax_ce_loss_grad"), out,
                            input_output_aliases=aliases)(logits, labels, scale)


def _kernel_loss_grad_cuda(logits, labels, scale, *, grad_dtype):
    """CUDA writes dlogits over the logits (each row is read, or the part of it a thread
    writes, before any of its gradient is written): the fused linear cross-entropy's block
    then holds one [rows, V] buffer, not two."""
    if logits.dtype == jnp.float64:
        return reference_loss_grad(logits, labels, scale, grad_dtype=grad_dtype)
    return _kernel_loss_grad(logits, labels, scale, grad_dtype=grad_dtype, in_place=True)


def _loss_grad_kernel_ok(logits, labels, scale, *, grad_dtype):
    """f64 goes with f64 only; the scale is in the statistics' dtype."""
    wide = logits.dtype == jnp.float64
    return (_kernel_ok(logits, labels, scale) and scale.dtype == _acc(logits.dtype)
            and (jnp.dtype(grad_dtype) == jnp.float64) == wide
            and jnp.dtype(grad_dtype) in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16))


def _kernel_ok(logits, labels, *rest, **params):
    return (
        logits.ndim >= 1
        and logits.dtype in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
        and labels.dtype == jnp.int32
        and labels.shape == logits.shape[:-1]
        and all(a.shape == labels.shape for a in rest)
    )


# ---- vocabulary-parallel partition -------------------------------------------------------


def _ce_factors(avals_in, avals_out, **params):
    """logits [rows..., v]; labels and every other operand / result [rows...], except
    ce_bwd's dlogits [rows..., v]."""
    rows = tuple(f"r{i}" for i in range(len(avals_in[0].shape) - 1))
    f_in = [rows + ("v",)] + [rows] * (len(avals_in) - 1)
    f_out = [rows + ("v",) if len(a.shape) == len(rows) + 1 else rows for a in avals_out]
    return f_in, f_out


def _local_columns(logits, labels, vocab_axes, sizes, vocab_total):
    """(logits in f32/f64, labels relative to this shard's first column, global label ok)."""
    offset = shard_index(vocab_axes, sizes) * logits.shape[-1]
    ok = (labels >= 0) & (labels < vocab_total)
    return logits.astype(_acc(logits.dtype)), labels - offset, ok


def _ce_fwd_local(fn, vocab_axes, row_axes, sizes, vocab_total, **params):
    """Per shard: the kernel when the classes are whole, else the vocab-parallel combine."""
    if not vocab_axes:
        return fn

    def body(logits, labels):
        z, local, ok = _local_columns(logits, labels, vocab_axes, sizes, vocab_total)
        lse, picked = block_lse_and_picked(z, local, vocab_axes)
        return jnp.where(ok, lse - picked, 0).astype(logits.dtype), lse

    return body


def _ce_bwd_local(fn, vocab_axes, row_axes, sizes, vocab_total, *, recompute_lse=False):
    """Per shard: the kernel when the classes are whole, else (p - onehot) * dloss on the
    shard's columns with the global lse (recomputed by the combine when not given)."""
    if not vocab_axes:
        return fn

    def body(logits, labels, lse, dloss):
        z, local, ok = _local_columns(logits, labels, vocab_axes, sizes, vocab_total)
        if recompute_lse:
            lse, _ = block_lse_and_picked(z, local, vocab_axes)
        g = jnp.where(ok, dloss.astype(z.dtype), 0)[..., None]
        hit = jnp.arange(z.shape[-1]) == local[..., None]
        p = jnp.exp(z - lse[..., None])
        return ((p * g - jnp.where(hit, g, 0)).astype(logits.dtype),)

    return body


# Under SPMD sharding the rows split any way; a sharded class axis runs vocab-parallel.
ce_fwd = FusedPrimitive(
    "rlx_softmax_ce_fwd",
    reference_softmax_cross_entropy,
    target="rlx_softmax_ce_fwd",
    kernel={"cpu": _kernel_fwd, "cuda": _kernel_fwd_cuda},
    kernel_ok=_kernel_ok,
    partition=VocabPartition(_ce_factors, _ce_fwd_local, vocab_operand=0, vocab_dim=-1),
)
ce_tangent = FusedPrimitive("rlx_softmax_ce_tangent", reference_softmax_cross_entropy_tangent)
ce_bwd = FusedPrimitive(
    "rlx_softmax_ce_bwd",
    reference_softmax_cross_entropy_bwd,
    target="rlx_softmax_ce_bwd",
    kernel={"cpu": _kernel_bwd_cpu, "cuda": _kernel_bwd_cuda},
    kernel_ok=_kernel_ok,
    partition=VocabPartition(_ce_factors, _ce_bwd_local, vocab_operand=0, vocab_dim=-1),
)


# The fused linear cross-entropy's logits blocks (its own rules differentiate them; this one
# is never differentiated), rows unsplit.
ce_loss_grad = FusedPrimitive(
    "rlx_softmax_ce_loss_grad",
    reference_loss_grad,
    target="rlx_softmax_ce_loss_grad",
    kernel={"cpu": _kernel_loss_grad, "cuda": _kernel_loss_grad_cuda},
    kernel_ok=_loss_grad_kernel_ok,
)
ce_loss_grad.def_batching(rowwise_batching(ce_loss_grad, row_args=(0, 1, 2)))


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


def _check_logits(logits, who):
    logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{who}: logits must be floating point, got {logits.dtype}")
    if logits.ndim < 1:
        raise ValueError(f"{who}: logits must be [..., V] with at least one axis, got a scalar")
    if logits.shape[-1] == 0:
        raise ValueError(f"{who}: logits need at least one class (V = 0)")
    return logits


def softmax_cross_entropy(logits, labels, *, ignore_index: int = -100):
    """Per-row loss ``logsumexp(logits[..., :]) - logits[..., labels]``.

    logits: [..., V] floating; labels: [...] integers (float labels raise TypeError:
    convert them explicitly). Returns loss [...] in the logits' dtype, computed in f32
    (f64 for f64 logits). A row whose label equals ``ignore_index`` (default -100, as
    PyTorch) has loss 0 and a zero gradient; any other label outside ``[0, V)`` gives
    a NaN loss for that row (as optax) and a zero gradient for its logits.
    Reverse mode runs the fused backward kernel ``rlx_softmax_ce_bwd``; a sharded V
    axis runs vocabulary-parallel (one pmax and one psum of [2, rows], no gather).
    """
    who = "softmax_cross_entropy"
    logits = _check_logits(logits, who)
    labels = check_labels(labels, logits.shape[:-1], who)
    labels, bad = kernel_labels(labels, logits.shape[-1], check_ignore_index(ignore_index, who))
    loss, _ = ce_fwd(logits, labels)
    return nan_where(bad, loss)


def softmax_cross_entropy_backward(logits, labels, dloss, *, ignore_index: int = -100):
    """The RLX op SoftmaxCrossEntropyBackward: ``dlogits = (softmax(logits) - onehot(labels))
    * dloss[..., None]`` from one pass over the logits (the kernel computes each row's
    logsumexp while the row is in cache). Rows labelled ``ignore_index`` get zeros;
    rows with any other label outside ``[0, V)`` get NaN (as their forward loss)."""
    who = "softmax_cross_entropy_backward"
    logits = _check_logits(logits, who)
    labels = check_labels(labels, logits.shape[:-1], who)
    labels, bad = kernel_labels(labels, logits.shape[-1], check_ignore_index(ignore_index, who))
    dloss = jnp.asarray(dloss)
    if dloss.shape != logits.shape[:-1]:
        raise ValueError(f"{who}: dloss must have shape {logits.shape[:-1]}, got {dloss.shape}")
    lse = jnp.zeros(labels.shape, _acc(logits.dtype))  # ignored: recomputed per row
    (dlogits,) = ce_bwd(logits, labels, lse, dloss.astype(logits.dtype), recompute_lse=True)
    return nan_where(bad[..., None], dlogits)


from rlx_jax.vjp_rules.linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402,F401  (public re-export)
