"""Fused linear + softmax cross-entropy: ``loss = CE(hidden @ weight, labels)`` without
the [N, V] logits.

Shapes: hidden [N, D] (the public function flattens [..., D]), weight [D, V], labels
[N] int32 where any label outside [0, V) takes no part (the public function maps
``ignore_index`` and bad labels to -1 and adds NaN for the bad ones, see
``_vocab_parallel``).

**Chunking over rows.** Rows are processed ``chunk_size`` at a time; each row block
sees the whole vocabulary, so its logits block z = h_b W [n_b, V] gives the exact lse
at once and the logit gradient follows in the same step:

    lse_b = logsumexp(z, axis=1)            p = exp(z - lse_b)
    g_b   = (p - onehot(labels_b)) * s      (s: per-row cotangent scale)
    dh_b  = g_b W^T                         dW += h_b^T g_b

Three vocabulary-sized matmuls per row block (z, dh_b, dW), the least any backward
needs; chunking the vocabulary instead needs the global lse before any logit gradient
and so a fourth (the logits twice). Live memory: one [n_b, V] f32 block and the f32
dW accumulator [D, V].

**Reductions.** ``reduction="mean"`` / ``"sum"`` (``flce_reduced``): the forward pass
computes the scalar loss *and* d hidden, d weight of that scalar (s = 1 / N_valid or 1)
and returns them as residuals; the JVP is t_loss = <dh, t_h> + <dW, t_W>, so reverse
mode only scales the saved gradients by the scalar cotangent: three vocabulary-sized
matmuls in all, where the unfused path (logits, then their two gradient matmuls) also
has three but keeps [N, V] logits. Second order differentiates through ``flce_hvp``
(t_dh, t_dW = H (t_h, t_W), the Hessian of the reduced loss, by JAX on the plain
row-chunked loss; the Hessian is symmetric so the primitive is its own transpose).
``reduction="none"`` (``flce_fwd`` / ``flce_tangent`` / ``flce_bwd``): per-row cotangents
are known only in the backward, so the backward recomputes each block's logits (four
vocabulary-sized matmuls in all).

**Row kernels** (``row_kernels``, the cross-entropy kernels a lowering runs each block's
softmax through; without a vocabulary split). The reduced losses take (loss, g) from
``ce_loss_grad``, one kernel per block that reads each row of z once from memory: a
running max and sum of exponentials gives the row's lse and loss, then g = (p - onehot)
* s is written in hidden's dtype while the row may still be in cache (the CPU keeps the
row's exponentials in an f32 row buffer; CUDA walks the row back, its last chunk from
registers and the others re-read). XLA's path reads z twice on CUDA (the lse reductions,
then the gradient fusion) and about five times on the CPU. The "none" forward takes
(loss, lse) from the forward kernel (``ce_fwd``, one read of z). On the CPU a block
narrower than f32 (``logits_dtype``) keeps XLA's gradient, which fuses the rounding of
the f32 product. Same maths; other platforms and vocabulary-split shards keep the XLA
block.

**Sharding.** Every primitive but the tangents lowers through ``VocabPartition``: rows
split any way (data parallel), weight's V axis split over mesh axes M runs
vocabulary-parallel: per row block one pmax and one psum of [2, n_b] for the lse and
the picked logit, a psum over M of dh_b [n_b, D] (the column-parallel linear's own
all-reduce), dW local to the shard (summed over the row axes at the end). No [N, V]
array or slice is gathered.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch
from jax.interpreters import ad, mlir

from rlx_jax.vjp_rules._primitive import FusedPrimitive, instantiate, sequential_batching, static_shape
from rlx_jax.vjp_rules._vocab_parallel import (
    VocabPartition, acc_dtype, block_lse_and_picked, check_ignore_index, check_labels, kernel_labels, nan_if,
    nan_where, shard_index,
)

REDUCTIONS = ("none", "mean", "sum")


def default_chunk_size(rows: int, dim: int, vocab: int, platform: str | None = None, logit_bytes: int = 4) -> int:
    """Rows per block, a power of two. On CPUs a logits block of about 2 M elements
    (8 MiB f32, cache-sized work per matmul). On GPUs a block of about 256 MiB as its
    matmul writes it (``logit_bytes`` a logit: 4 for f32 blocks, 2 for bf16 ones), but
    never fewer than 2048 rows: every block adds its h_b^T g to the f32 d weight
    accumulator, reading and writing [D, V] f32, so small blocks turn the backward into
    weight traffic. Measured on an H200 (N 16384, D 2048, bf16, loss + gradients against
    logits + log_softmax in XLA, ``benchmarks.cases_cross_entropy``, 7 interleaved rounds):
    at V 128256, 256-row blocks ran at 0.54x and 2048-row blocks at 1.01x in 2 GiB of temp
    memory (XLA: 15.7 GiB); at V 32000 with f32 blocks, 4096 rows ran at 1.10x in 0.25x
    XLA's temp memory (1016 of 4000 MB) and 2048 rows at 1.08x in 0.13x (508 MB), so f32
    blocks take 2048 rows there; bf16 blocks (``logits_dtype=jnp.bfloat16``) 4096 rows,
    1.15x in 0.13x. In the Llama step of ``benchmarks/e2e_step.py --preset llama-v32k``
    (V 32000, bf16 blocks, lean ops), 4096-row blocks took 0.13 ms (0.3 %) more than
    8192-row ones in 0.59 GiB less temp memory (3.16 against 3.75 GiB): the head runs while
    every layer's kept activations are live, so its block sets the step's peak."""
    platform = platform or jax.default_backend()
    cpu = platform == "cpu"
    target = max(1, ((1 << 21) if cpu else (1 << 28) // max(int(logit_bytes), 1)) // max(vocab, 1))
    block = max(1 << max(4, int(math.log2(target))), 16 if cpu else 2048)
    if not static_shape((rows,)):  # a symbolic row count (jax.export): the blocks are padded to it
        return int(block)
    return int(max(1, min(block, max(rows, 1))))


def block_logit_bytes(dtype, logits_dtype) -> int:
    """Bytes a logit takes in a block as ``_logits`` forms it from operands of ``dtype``:
    the accumulation dtype's (f32, f64) when the block is written in it or rounded down to
    a narrower ``logits_dtype`` afterwards, else ``logits_dtype``'s (bf16 from bf16)."""
    if logits_dtype is None or np.dtype(logits_dtype).itemsize < np.dtype(dtype).itemsize:
        return np.dtype(acc_dtype(dtype)).itemsize
    return np.dtype(logits_dtype).itemsize


# ---- row blocks ------------------------------------------------------------------------


def _blocks(x, n_b, fill=0):
    """[N, ...] -> [ceil(N / n_b), n_b, ...], padding rows with ``fill``."""
    n = x.shape[0]
    count = -(-n // n_b)
    x = jnp.pad(x, [(0, count * n_b - n)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return x.reshape(count, n_b, *x.shape[1:])


def _unblock(x, n):
    return x.reshape(-1, *x.shape[2:])[:n]


def _block_rows(n, chunk_size):
    return max(1, min(int(chunk_size), n)) if static_shape((n,)) else max(1, int(chunk_size))


def _logits(hb, weight, logits_dtype):
    """A logits block hb @ weight [n_b, V], accumulated in f32 (f64) by the matmul and
    written in ``logits_dtype`` (None: the accumulation dtype). The matmul writes the
    narrow dtype itself only from operands no wider than it (bf16 from bf16); wider
    operands (f32 with bf16 logits, f64 with f32) give the accumulation-dtype product,
    rounded afterwards by ``_round_to``, as documented."""
    acc = acc_dtype(hb.dtype)
    if logits_dtype is None:
        return jnp.dot(hb, weight, preferred_element_type=acc)
    if np.dtype(logits_dtype).itemsize < jnp.result_type(hb.dtype, weight.dtype).itemsize:
        return _round_to(jnp.dot(hb, weight, preferred_element_type=acc), logits_dtype)
    return jnp.dot(hb, weight, preferred_element_type=logits_dtype)


def _round_to(z, dtype):
    """z rounded to ``dtype`` (to nearest even; values below its normal range go to 0).
    The rounding is a reduce_precision before the cast, not the cast alone: XLA (on GPUs,
    where it allows excess precision by default) may drop a narrowing cast that a widening
    one follows, so a block recomputed in the backward (``.astype(f32)`` of the rounded
    logits) met its unrounded product while the forward's lse came from the rounded block:
    gradients of f32 inputs with bf16 logits were off by about 1 % of their scale on an
    H200. reduce_precision is never removed."""
    fi = jnp.finfo(dtype)
    return lax.reduce_precision(z, exponent_bits=fi.nexp, mantissa_bits=fi.nmant).astype(dtype)


def _local_labels(labels, w, vocab_axes, sizes, vocab_total):
    """(labels relative to this shard's first column, row ok over the whole vocabulary)."""
    offset = shard_index(vocab_axes, sizes) * w.shape[1] if vocab_axes else 0
    total = w.shape[1] if vocab_total is None else vocab_total
    return labels - offset, (labels >= 0) & (labels < total)


def _logit_grad(z, lse, local, scale):
    """(p - onehot) * scale[:, None] for a logits block z (rows with scale 0 take no part)."""
    hit = jnp.arange(z.shape[-1]) == local[:, None]
    p = jnp.exp(z - lse[:, None])
    return p * scale[:, None] - jnp.where(hit, scale[:, None], 0)


def _psum(x, axes):
    return lax.psum(x, axes) if axes else x


def _block_loss_and_lse(z, local, vocab_axes, row_kernels):
    """(lse - z[label] [n_b], lse [n_b]), both f32 (f64), for a logits block z. With "fwd"
    in ``row_kernels`` (no vocabulary split) it runs the softmax cross-entropy primitive,
    whose kernel reads each row of z once; the loss of a row whose label is outside
    [0, V) is 0 there (callers mask such rows). The kernel returns the loss in z's dtype,
    so for narrower logits (bf16) the loss is lse - z[label] in f32 here: a gather of one
    value per row, not a rounding of the loss to bf16."""
    if "fwd" in row_kernels and not vocab_axes:
        from rlx_jax.vjp_rules.cross_entropy import ce_fwd

        loss, lse = ce_fwd(z, local)
        if loss.dtype == lse.dtype:
            return loss, lse
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, z.shape[-1] - 1)[:, None], axis=-1)[:, 0]
        return lse - picked.astype(lse.dtype), lse
    lse, picked = block_lse_and_picked(z, local, vocab_axes)
    return lse - picked, lse


def _block_loss_and_grad(z, local, scale, grad_dtype, vocab_axes, row_kernels):
    """(lse - z[label] [n_b], g = (p - onehot) * scale[:, None] [n_b, V] in ``grad_dtype``)
    for a logits block z. With "loss_grad" in ``row_kernels`` (no vocabulary split) both
    come from the one-pass kernel (``ce_loss_grad``: z read once from memory, g written
    in ``grad_dtype``, the scale in f32 / f64), for a z narrower than f32 only with
    "narrow" too; rows with a label outside [0, V) have scale 0."""
    stat = acc_dtype(z.dtype)
    if "loss_grad" in row_kernels and not vocab_axes and ("narrow" in row_kernels or z.dtype == stat):
        from rlx_jax.vjp_rules.cross_entropy import ce_loss_grad

        loss, _, g = ce_loss_grad(z, local, scale.astype(stat), grad_dtype=np.dtype(grad_dtype))
        return loss, g
    loss, lse = _block_loss_and_lse(z, local, vocab_axes, row_kernels)
    return loss, _logit_grad(z, lse, local, scale).astype(grad_dtype)


def _hidden_t(hidden, row_kernels) -> bool:
    """Whether the d weight product takes hidden's blocks transposed beforehand: with
    "hidden_t" in ``row_kernels``, for f32 hidden (the case measured; XLA:CPU's fast
    products take f32, and bf16 ones through f32 copies that cost memory)."""
    return "hidden_t" in row_kernels and hidden.dtype == jnp.float32


def _hidden_blocks(hidden, n_b, row_kernels):
    """(row blocks of hidden [count, n_b, D], the blocks the d weight product h_b^T g takes).
    With ``_hidden_t`` the second are the blocks transposed beforehand ([count, D, n_b], one
    copy of hidden outside the loop), so that the product contracts its left operand's last
    axis: XLA:CPU sends a product contracting both operands' leading axis to its generic
    dot, which ran the whole op (N 2048, D 256, V 8192, f32, loss + gradients) 1.26x slower
    than its XNNPACK path (9 rounds, CPU time). Else the row blocks themselves (transposed
    inside the product; cuBLAS takes either layout)."""
    blocks = _blocks(hidden, n_b)
    return blocks, jnp.swapaxes(blocks, 1, 2) if _hidden_t(hidden, row_kernels) else blocks


def _hidden_grad(g, weight, dtype, acc, vocab_axes, row_kernels):
    """dh_b = g W^T [n_b, D] in hidden's ``dtype``, accumulated in f32 (f64). With "narrow"
    in ``row_kernels`` and no vocabulary split the matmul writes its own output dtype (bf16
    for bf16 operands, accumulated in f32 inside cuBLAS): the same values as an f32 product
    rounded afterwards, without the [n_b, D] f32 buffer and the conversion pass (on the CPU
    a bf16 product is XLA's f32 one rounded, through f32 copies of its operands, so it
    keeps the f32 product). Vocabulary-parallel, the shards' partial products are summed
    in f32 (f64) before the rounding."""
    if "narrow" in row_kernels and not vocab_axes:
        return jnp.dot(g, weight.T).astype(dtype)
    return _psum(jnp.dot(g, weight.T, preferred_element_type=acc), vocab_axes).astype(dtype)


def _weight_grad(hb_w, g, acc, transposed):
    """h_b^T g [D, V] (f32 / f64) from the second of ``_hidden_blocks``' pair."""
    return jnp.dot(hb_w if transposed else hb_w.T, g, preferred_element_type=acc)


def _over_blocks(block, xs):
    """(sums, ys) of ``block`` over the row blocks of ``xs`` (a tuple of [count, ...]
    arrays): ``block`` takes one block's slices and returns (terms, y), terms a pytree of
    accumulator terms (h_b^T g, ...), summed block 0 first, then 1, 2, ..., and y its
    per-block outputs, stacked [count, ...].

    Block 0 runs before the loop and its terms start the sums; a ``lax.scan`` adds blocks
    1, 2, ... (no loop for one block). Starting from zeros costs a pass of its own over
    every accumulator, and d weight's is a [D, V] f32 buffer: on an H200 (D 2048, V 32000,
    4 row blocks) a separate 78 us kernel writing 262 MB. The sums are the same (0 + t_0
    is t_0, but for a -0 term, which stays -0). The loop indexes the whole of ``xs`` and
    writes its ys into one [count, ...] buffer that holds block 0's y already, as
    ``lax.scan`` does with its own xs and ys: a slice xs[1:] and a concatenation of y_0
    with the loop's stack would each copy [N, D]. That buffer starts as y_0 padded with
    zeros (a pass writing [N, D], 41 us at N 16384, D 2048, bf16 on an H200). Writing the
    ys over hidden's blocks instead removes the pass, but where hidden is kept for another
    op's backward (a norm that saves its output) XLA copies hidden before the loop, and on
    an H200 the lean step's temp memory rose from 3.02 to 3.87 GiB (llama-v32k).

    Two blocks keep the loop over both from zero sums: XLA drops a loop of one trip, and
    the straight-line code it leaves took more memory than the loop. On an H200 (N 8192,
    D 2048, V 32000, bf16 logits) the reduced loss's block 1 wrote its h_1^T g_1 to a
    [D, V] f32 buffer of its own, added to block 0's afterwards instead of accumulated in
    place by the matmul: 820 MB of temp memory against 558 MB (an optimization barrier
    before or after the loop changed nothing); on the CPU the scheduler ran the two
    blocks' products side by side (1.6x). No block (N = 0): zero sums, an empty stack."""
    count = xs[0].shape[0]

    def add(sums, x):
        terms, y = block(x)
        return jax.tree.map(jnp.add, sums, terms), y

    # a symbolic count (jax.export) takes the plain scan too: its peeled first block needs a
    # loop over 1..count, which a symbolic bound does not give lax.scan
    if not static_shape((count,)) or count in (0, 2):
        terms, _ = jax.eval_shape(block, tuple(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs))
        return lax.scan(add, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), terms), xs)

    def at(i):
        return tuple(lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs)

    sums, y = block(at(0))
    if count == 1:
        return sums, jax.tree.map(lambda a: a[None], y)

    def step(carry, i):
        sums, ys = carry
        sums, y = add(sums, at(i))
        return (sums, jax.tree.map(lambda buf, a: lax.dynamic_update_index_in_dim(buf, a, i, 0), ys, y)), None

    ys = jax.tree.map(lambda a: lax.dynamic_update_index_in_dim(jnp.zeros((count, *a.shape), a.dtype), a, 0, 0), y)
    (sums, ys), _ = lax.scan(step, (sums, ys), jnp.arange(1, count))
    return sums, ys


# ---- reduction "none": forward, tangent, backward -------------------------------------


def reference_forward(hidden, weight, labels, *, chunk_size, logits_dtype=None, vocab_axes=(), row_axes=(),
                      sizes=None, vocab_total=None, row_kernels=()):
    """Row-chunked forward: (loss [N] in hidden's dtype, lse [N] f32 / f64).
    ``row_kernels`` with "fwd": each block's (loss, lse) from the softmax cross-entropy
    primitive."""
    acc = acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    n_b = _block_rows(n, chunk_size)
    local, ok = _local_labels(labels, weight, vocab_axes, sizes, vocab_total)

    def step(_, xs):
        hb, lb = xs
        z = _logits(hb, weight, logits_dtype)
        row_loss, lse = _block_loss_and_lse(z, lb, vocab_axes, row_kernels)
        return None, (lse, row_loss)

    _, (lse, row_loss) = lax.scan(step, None, (_blocks(hidden, n_b), _blocks(local, n_b, -1)))
    lse, row_loss = _unblock(lse, n), _unblock(row_loss, n)
    return jnp.where(ok, row_loss, 0).astype(hidden.dtype), lse


def reference_tangent(hidden, weight, labels, lse, t_hidden, t_weight, *, chunk_size, logits_dtype=None):
    """(t_loss, t_lse): per block tz = t_h W + h t_W, t_lse = sum p tz, t_loss = t_lse - tz[label]
    (p from the logits rounded to ``logits_dtype`` as the forward's; tz accumulated in the
    inputs' accumulation dtype, then in lse's: f32 for f64 inputs with f32 logits, whose
    products stay f64, since cuBLAS takes no f64 product written in f32)."""
    acc, mm = lse.dtype, acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    n_b = _block_rows(n, chunk_size)
    ok = (labels >= 0) & (labels < weight.shape[1])

    def step(_, xs):
        hb, thb, lb, lseb = xs
        z = _logits(hb, weight, logits_dtype).astype(acc)
        tz = (jnp.dot(thb, weight, preferred_element_type=mm) + jnp.dot(hb, t_weight, preferred_element_type=mm))
        tz = tz.astype(acc)
        p = jnp.exp(z - lseb[:, None])
        hit = jnp.arange(z.shape[-1]) == lb[:, None]
        return None, (jnp.sum(p * tz, axis=1), jnp.sum(jnp.where(hit, tz, 0), axis=1))

    xs = (_blocks(hidden, n_b), _blocks(t_hidden, n_b), _blocks(labels, n_b, -1), _blocks(lse, n_b))
    _, (t_lse, t_picked) = lax.scan(step, None, xs)
    t_lse, t_picked = _unblock(t_lse, n), _unblock(t_picked, n)
    return jnp.where(ok, t_lse - t_picked, 0).astype(hidden.dtype), t_lse


def reference_backward(hidden, weight, labels, lse, dloss, dlse, *, chunk_size, logits_dtype=None, vocab_axes=(),
                       row_axes=(), sizes=None, vocab_total=None, row_kernels=()):
    """(d hidden, d weight) for per-row cotangents (dloss, dlse), recomputing each block's
    logits: g = p (dloss + dlse) - onehot dloss; dh_b = g W^T; dW += h_b^T g (the
    blocks of ``_hidden_blocks``). The softmax in lse's dtype, the products accumulated in
    the inputs' (f64 for f64 inputs with f32 logits: cuBLAS takes no f64 product written
    in f32)."""
    acc, mm = lse.dtype, acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    n_b = _block_rows(n, chunk_size)
    local, ok = _local_labels(labels, weight, vocab_axes, sizes, vocab_total)
    g_loss = jnp.where(ok, dloss.astype(acc), 0)
    g_lse = dlse.astype(acc)

    def block(xs):
        hb, hb_w, lb, lseb, glb, gsb = xs
        z = _logits(hb, weight, logits_dtype).astype(acc)
        hit = jnp.arange(z.shape[-1]) == lb[:, None]
        p = jnp.exp(z - lseb[:, None])
        g = (p * (glb + gsb)[:, None] - jnp.where(hit, glb[:, None], 0)).astype(hidden.dtype)
        dh = _hidden_grad(g, weight, hidden.dtype, mm, vocab_axes, row_kernels)
        return _weight_grad(hb_w, g, mm, _hidden_t(hidden, row_kernels)), dh

    xs = (*_hidden_blocks(hidden, n_b, row_kernels), _blocks(local, n_b, -1), _blocks(lse, n_b),
          _blocks(g_loss, n_b), _blocks(g_lse, n_b))
    # dW starts from block 0's h_0^T g_0, not from a zero [D, V] buffer (``_over_blocks``)
    dw, dh = _over_blocks(block, xs)
    return _unblock(dh, n), _psum(dw, row_axes).astype(weight.dtype)


# ---- reductions "mean" / "sum": loss and gradients in one pass ---------------------------


def reference_reduced(hidden, weight, labels, *, chunk_size, mean, logits_dtype=None, vocab_axes=(), row_axes=(),
                      sizes=None, vocab_total=None, row_kernels=()):
    """(loss [1], d hidden [N, D], d weight [D, V]) of the summed (or mean over rows with
    a label in [0, V); 0 when there are none) loss, in one pass over row blocks.
    ``row_kernels``: with "loss_grad" each block's softmax, loss and logit gradient run
    through the one-pass cross-entropy kernel (``_block_loss_and_grad``); the blocks
    of ``_hidden_blocks``."""
    acc = acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    n_b = _block_rows(n, chunk_size)
    local, ok = _local_labels(labels, weight, vocab_axes, sizes, vocab_total)
    if mean:
        count = _psum(jnp.sum(ok.astype(acc)), row_axes)
        scale = 1 / jnp.maximum(count, 1)
    else:
        scale = jnp.asarray(1, acc)
    row_scale = jnp.where(ok, scale, 0).astype(acc)

    def block(xs):
        hb, hb_w, lb, sb = xs
        z = _logits(hb, weight, logits_dtype)
        row_loss, g = _block_loss_and_grad(z, lb, sb, hidden.dtype, vocab_axes, row_kernels)
        dh = _hidden_grad(g, weight, hidden.dtype, acc, vocab_axes, row_kernels)
        dw = _weight_grad(hb_w, g, acc, _hidden_t(hidden, row_kernels))
        return (dw, jnp.sum(jnp.where(sb != 0, row_loss * sb, 0))), dh

    xs = (*_hidden_blocks(hidden, n_b, row_kernels), _blocks(local, n_b, -1), _blocks(row_scale, n_b))
    # dW and the total start from block 0's h_0^T g_0 and loss, not from a zero [D, V]
    # buffer: that zero fill is a full pass over [D, V] f32 (``_over_blocks``)
    (dw, total), dh = _over_blocks(block, xs)
    total, dw = _psum(total, row_axes), _psum(dw, row_axes)
    # the total stays in the accumulation dtype: rounded to bf16 a loss near 10 would move in
    # steps of 1/16, and an f16 sum over many rows overflows (65504)
    return total.reshape(1), _unblock(dh, n), dw.astype(weight.dtype)


def _reduced_loss(hidden, weight, labels, *, chunk_size, mean, logits_dtype=None):
    """The reduced loss as plain JAX (row-chunked forward), for the Hessian."""
    loss, _ = reference_forward(hidden, weight, labels, chunk_size=chunk_size, logits_dtype=logits_dtype)
    acc = acc_dtype(hidden.dtype)
    ok = (labels >= 0) & (labels < weight.shape[1])
    total = jnp.sum(loss.astype(acc))
    return total / jnp.maximum(jnp.sum(ok.astype(acc)), 1) if mean else total


def reference_hvp(hidden, weight, labels, t_hidden, t_weight, *, chunk_size, mean, logits_dtype=None):
    """(t_dh, t_dW) = Hessian of the reduced loss times (t_hidden, t_weight)."""
    grad = jax.grad(partial(_reduced_loss, labels=labels, chunk_size=chunk_size, mean=mean,
                            logits_dtype=logits_dtype), (0, 1))
    _, (t_dh, t_dw) = jax.jvp(grad, (hidden, weight), (t_hidden, t_weight))
    return t_dh.astype(hidden.dtype), t_dw.astype(weight.dtype)


# ---- primitives ------------------------------------------------------------------------


_ROW_STAT, _HIDDEN, _WEIGHT, _TOTAL = ("r0",), ("r0", "d"), ("d", "v"), ("one",)


def _factors_for(outputs):
    """Factors of hidden (r0, d), weight (d, v), row operands (r0) and the given outputs."""
    def factors(avals_in, avals_out, **params):
        return [_HIDDEN, _WEIGHT] + [_ROW_STAT] * (len(avals_in) - 2), list(outputs)
    return factors


def _local(reference):
    def build(fn, vocab_axes, row_axes, sizes, vocab_total, **params):
        if not vocab_axes and not row_axes:
            return fn
        return partial(reference, vocab_axes=vocab_axes, row_axes=row_axes, sizes=sizes, vocab_total=vocab_total,
                       **params)
    return build


def _may_be_partitioned(ctx) -> bool:
    """False when the program is compiled for one device (no SPMD partitioning can
    split it): the reference is then lowered as is, without a custom_partitioning call."""
    axis_context = ctx.module_context.axis_context
    return getattr(axis_context, "num_devices", 2) != 1


#: how each platform's lowering runs a row block: the cross-entropy row kernels its softmax
#: runs through ("fwd", "loss_grad"); "narrow": the one-pass kernel takes logits blocks
#: narrower than f32 too (not on the CPU, where a bf16 block is XLA's f32 product rounded, a
#: rounding XLA fuses into its own gradient: the kernel would need the product and the
#: rounded block both in memory), and each block's d hidden written by its matmul in
#: hidden's dtype (``_hidden_grad``); "hidden_t": ``_hidden_t``.
ROW_KERNELS = {"cpu": ("fwd", "loss_grad", "hidden_t"), "cuda": ("fwd", "loss_grad", "narrow")}


def _partitioned(prim: FusedPrimitive, outputs, row_kernels=False):
    """Lower ``prim`` (on every platform) through a ``VocabPartition`` of its reference;
    with ``row_kernels`` the reference gets each platform's ``ROW_KERNELS``."""
    part = VocabPartition(_factors_for(outputs), _local(prim.reference), vocab_operand=1, vocab_dim=1)

    def lowering(extra):
        def lower(ctx, *args, **params):
            fn = partial(prim.reference, **params, **extra)
            if _may_be_partitioned(ctx):
                fn = part.wrap(fn, ctx.avals_in, ctx.avals_out, params)
            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
        return lower

    mlir.register_lowering(prim.p, lowering({}))
    if row_kernels:
        for platform, kernels in ROW_KERNELS.items():
            mlir.register_lowering(prim.p, lowering({"row_kernels": kernels}), platform=platform)
    dispatch.prim_requires_devices_during_lowering.add(prim.p)
    return prim


flce_fwd = _partitioned(FusedPrimitive("rlx_fused_linear_ce_fwd", reference_forward), (_ROW_STAT, _ROW_STAT),
                        row_kernels=True)
flce_tangent = FusedPrimitive("rlx_fused_linear_ce_tangent", reference_tangent)
flce_bwd = _partitioned(FusedPrimitive("rlx_fused_linear_ce_bwd", reference_backward), (_HIDDEN, _WEIGHT),
                        row_kernels=True)
flce_reduced = _partitioned(FusedPrimitive("rlx_fused_linear_ce_reduced", reference_reduced),
                            (_TOTAL, _HIDDEN, _WEIGHT), row_kernels=True)
flce_hvp = FusedPrimitive("rlx_fused_linear_ce_hvp", reference_hvp)
# Under vmap each element runs the primitive in turn (its kernels, one logits block live at a
# time); the tangent and Hessian-vector primitives keep vmap of their references.
for _prim in (flce_fwd, flce_bwd, flce_reduced):
    _prim.def_batching(sequential_batching(_prim))


@flce_fwd.def_jvp
def _fwd_jvp(primals, tangents, **params):
    hidden, weight, labels = primals
    th, tw, _ = instantiate(tangents, primals)
    loss, lse = flce_fwd(hidden, weight, labels, **params)
    t_loss, t_lse = flce_tangent(hidden, weight, labels, lse, th, tw, **params)
    return (loss, lse), (t_loss, t_lse)


@flce_tangent.def_transpose
def _tangent_transpose(cts, hidden, weight, labels, lse, th, tw, **params):
    for residual in (hidden, weight, lse):
        if ad.is_undefined_primal(residual):
            raise ValueError("fused linear cross-entropy tangent is linear in (t_hidden, t_weight) only")
    ct_loss, ct_lse = cts
    if type(ct_loss) is ad.Zero and type(ct_lse) is ad.Zero:
        return [None] * 4 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (th, tw)]
    ct_loss = jnp.zeros(lse.shape, hidden.dtype) if type(ct_loss) is ad.Zero else ct_loss
    ct_lse = jnp.zeros(lse.shape, lse.dtype) if type(ct_lse) is ad.Zero else ct_lse
    dh, dw = flce_bwd(hidden, weight, labels, lse, ct_loss, ct_lse, **params)
    return [None] * 4 + [d if ad.is_undefined_primal(t) else None for d, t in ((dh, th), (dw, tw))]


@flce_reduced.def_jvp
def _reduced_jvp(primals, tangents, **params):
    """t_loss = <dh, t_h> + <dW, t_W> from the saved gradients (its transpose scales them
    by the cotangent); the gradients' own tangents come from ``flce_hvp``."""
    hidden, weight, labels = primals
    th, tw, _ = tangents
    loss, dh, dw = flce_reduced(hidden, weight, labels, **params)
    acc = acc_dtype(hidden.dtype)
    t_loss = jnp.zeros((), acc)
    for grad, t in ((dh, th), (dw, tw)):
        if type(t) is not ad.Zero:
            t_loss = t_loss + jnp.sum(grad.astype(acc) * t.astype(acc))
    if type(th) is ad.Zero and type(tw) is ad.Zero:
        return (loss, dh, dw), (jnp.zeros_like(loss), jnp.zeros_like(dh), jnp.zeros_like(dw))
    th, tw = instantiate((th, tw), (hidden, weight))
    t_dh, t_dw = flce_hvp(hidden, weight, labels, th, tw, **params)
    return (loss, dh, dw), (t_loss.astype(loss.dtype).reshape(1), t_dh, t_dw)


@flce_hvp.def_transpose
def _hvp_transpose(cts, hidden, weight, labels, th, tw, **params):
    """The Hessian is symmetric: the transpose of v -> H v is itself."""
    for residual in (hidden, weight):
        if ad.is_undefined_primal(residual):
            raise ValueError("fused linear cross-entropy hvp is linear in (t_hidden, t_weight) only")
    ct_dh, ct_dw = cts
    if type(ct_dh) is ad.Zero and type(ct_dw) is ad.Zero:
        return [None] * 3 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in (th, tw)]
    ct_dh = jnp.zeros(hidden.shape, hidden.dtype) if type(ct_dh) is ad.Zero else ct_dh
    ct_dw = jnp.zeros(weight.shape, weight.dtype) if type(ct_dw) is ad.Zero else ct_dw
    dh, dw = flce_hvp(hidden, weight, labels, ct_dh, ct_dw, **params)
    return [None] * 3 + [d if ad.is_undefined_primal(t) else None for d, t in ((dh, th), (dw, tw))]


# ---- public function -------------------------------------------------------------------


def _check_logits_dtype(logits_dtype, dtype, who):
    """The primitives' ``logits_dtype`` parameter: None for the accumulation dtype of
    ``dtype`` (f32 / f64), else a floating np.dtype no wider than it."""
    if logits_dtype is None:
        return None
    try:
        want = np.dtype(jnp.dtype(logits_dtype))
    except TypeError as e:
        raise TypeError(f"{who}: logits_dtype must be a floating dtype or None, got {logits_dtype!r}") from e
    acc = np.dtype(acc_dtype(dtype))
    if not jnp.issubdtype(want, jnp.floating) or want.itemsize > acc.itemsize:
        raise TypeError(f"{who}: logits_dtype must be a floating dtype no wider than the {acc.name} the matmul "
                        f"accumulates in, got {want.name}")
    return None if want == acc else want


def fused_linear_cross_entropy(hidden, weight, labels, *, reduction: str = "none", ignore_index: int = -100,
                               chunk_size: int | None = None, logits_dtype=None):
    """``softmax_cross_entropy(hidden @ weight, labels)`` without the [..., V] logits.

    hidden: [..., D]; weight: [D, V]; labels: [...] integers (float labels raise
    TypeError). hidden and weight are promoted to a common dtype as ``jnp.dot`` does
    (bf16 hidden with an f32 weight computes in f32; nothing is silently narrowed); the
    logits, softmax and loss are computed in f32 (f64 for f64); per-row losses
    (``reduction="none"``) are returned in the promoted dtype, a reduced loss in f32 (f64
    for f64), the dtype it is summed in. Rows labelled ``ignore_index`` (default -100) have loss 0 and no
    gradient; any other label outside ``[0, V)`` gives that row a NaN loss (so a reduced
    loss is NaN) and a zero gradient (a reduced loss's gradients are those with that row
    ignored).

    reduction: "none" -> loss [...]; "sum" -> scalar sum; "mean" -> scalar mean over the
    rows not ignored (0, with zero gradients, when every row is ignored). With "sum" /
    "mean" the forward pass also computes d hidden and d weight, chunk by chunk, and the
    backward pass only scales them by the cotangent (three vocabulary-sized matmuls in
    all; a cotangent XLA knows to be 1 costs no pass); with "none" the backward recomputes
    the logits (four).

    chunk_size: rows per block (the largest intermediate is [chunk_size, V] logits);
    None picks ``default_chunk_size`` for the platform, the shape and the block's dtype.
    A symbolic row count (``jax.export``) pads the rows to whole blocks of that size.

    logits_dtype: the dtype each logits block is written in by its matmul (which
    accumulates in f32 either way). None (default): f32 (f64 for f64), the most precise.
    A narrower float, typically the input's ``jnp.bfloat16``, rounds the logits as the
    unfused ``hidden @ weight`` in that dtype does; the softmax, loss and gradients are
    still computed in f32 from the rounded values (inputs wider than the logits: the
    f32 / f64 product rounded to nearest even, logits below the narrow dtype's normal
    range becoming 0). Each block's logits then take half the memory and half the memory
    traffic (written by the matmul, read by the block's softmax).
    """
    who = "fused_linear_cross_entropy"
    hidden, weight = jnp.asarray(hidden), jnp.asarray(weight)
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {x.dtype}")
    if hidden.ndim < 1:
        raise ValueError(f"{who}: hidden must be [..., D], got a scalar")
    if weight.ndim != 2 or weight.shape[0] != hidden.shape[-1]:
        raise ValueError(f"{who}: weight must be [D={hidden.shape[-1]}, V], got shape {weight.shape}")
    if weight.shape[1] == 0:
        raise ValueError(f"{who}: weight needs at least one vocabulary column (V = 0)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{who}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0
    ):
        raise ValueError(f"{who}: chunk_size must be a positive int or None, got {chunk_size!r}")
    lead, dim, vocab = hidden.shape[:-1], hidden.shape[-1], weight.shape[1]
    labels = check_labels(labels, lead, who).reshape(-1)
    labels, bad = kernel_labels(labels, vocab, check_ignore_index(ignore_index, who))
    dtype = jnp.promote_types(hidden.dtype, weight.dtype)
    logits_dtype = _check_logits_dtype(logits_dtype, dtype, who)
    h2 = hidden.reshape(-1, dim).astype(dtype)
    w = weight.astype(dtype)
    rows = h2.shape[0]
    chunk = (int(chunk_size) if chunk_size is not None
             else default_chunk_size(rows, dim, vocab, logit_bytes=block_logit_bytes(dtype, logits_dtype)))
    chunk = _block_rows(rows, chunk)
    if reduction == "none":
        loss, _ = flce_fwd(h2, w, labels, chunk_size=chunk, logits_dtype=logits_dtype)
        return nan_where(bad, loss).reshape(lead)
    loss, _, _ = flce_reduced(h2, w, labels, chunk_size=chunk, mean=reduction == "mean", logits_dtype=logits_dtype)
    return nan_if(jnp.any(bad), loss[0])
