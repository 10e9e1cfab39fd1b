"""Shared pieces of the cross-entropy ops: label checks and the vocabulary-parallel
partition.

Label rules (``softmax_cross_entropy`` and ``fused_linear_cross_entropy``): labels are
integers; a row whose label equals ``ignore_index`` takes no part (loss 0, zero
gradient); any other label outside ``[0, V)`` gives that row a NaN loss (as optax) and
a zero gradient. The primitives themselves know one rule only, "a label outside
``[0, V)`` contributes nothing": ``kernel_labels`` maps ignored and bad labels to -1
and the public wrappers add the NaN for the bad ones.

Vocabulary parallelism (Megatron's vocab-parallel cross-entropy): when the V axis of
the logits (or of the unembedding weight) is sharded over mesh axes M, each shard
holds the columns ``[offset, offset + V / |M|)``; it computes its rows' local max,
sum of exponentials and picked logit (the label's column, when it is local), and the
shards combine them with a ``pmax`` and one ``psum`` of ``[2, rows]`` over M. No
``[N, V]`` array (or slice of one) is ever gathered.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

from rlx_jax.vjp_rules._primitive import Partition


def acc_dtype(dtype):
    """Arithmetic / statistics type: f32 for f32/bf16/f16, f64 for f64."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def check_labels(labels, shape, who: str):
    """``labels`` as int32 of ``shape``; float labels are rejected, never rounded."""
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"{who}: labels must be an integer array (class ids), got dtype {labels.dtype}; "
            "convert float-encoded ids explicitly, e.g. labels.astype(jnp.int32)"
        )
    if labels.shape != tuple(shape):
        raise ValueError(f"{who}: labels must have shape {tuple(shape)}, got {labels.shape}")
    return saturate_to_int32(labels)


def saturate_to_int32(ids):
    """Integer ``ids`` as int32, saturating rather than wrapping: an int64 / uint32 label
    past int32's range stays outside ``[0, V)`` (a NaN row) instead of wrapping onto a
    class or onto ``ignore_index`` (2**32 + 1 would read as class 1)."""
    info, i32 = jnp.iinfo(ids.dtype), jnp.iinfo(jnp.int32)
    if info.min < i32.min or info.max > i32.max:
        ids = jnp.clip(ids, max(int(info.min), int(i32.min)), int(i32.max))
    return ids.astype(jnp.int32)


def check_ignore_index(ignore_index, who: str) -> int:
    """ignore_index as an int in int32's range: the labels are compared with it as int32
    (``check_labels``), where a wider value would wrap (2**32 would ignore class 0)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, jnp.integer)):
        raise TypeError(f"{who}: ignore_index must be a Python int, got {ignore_index!r}")
    i32 = jnp.iinfo(jnp.int32)
    if not i32.min <= int(ignore_index) <= i32.max:
        raise ValueError(f"{who}: ignore_index must be in int32's range [{i32.min}, {i32.max}] (the labels are "
                         f"compared as int32), got {ignore_index}")
    return int(ignore_index)


def kernel_labels(labels, classes: int, ignore_index: int):
    """(labels for the primitives, bad-row mask): ignored and out-of-range labels -> -1
    (no part in the loss); ``bad`` marks the out-of-range labels that are not ignored."""
    in_range = (labels >= 0) & (labels < classes)
    ignored = labels == ignore_index
    bad = ~in_range & ~ignored
    return jnp.where(in_range & ~ignored, labels, -1), bad


def nan_where(bad, loss):
    """loss with NaN on the rows of ``bad`` (the gradient of those rows stays zero)."""
    return jnp.where(bad, jnp.asarray(jnp.nan, loss.dtype), loss)


def nan_if(bad, loss):
    """A reduced loss made NaN when the scalar flag ``bad`` is set, by adding NaN or 0:
    the cotangent passes the addition unchanged, where a select would make it depend on
    the data. A loss whose gradients are formed in the forward pass is scaled by that
    cotangent afterwards, and only a cotangent XLA knows to be 1 (a loss differentiated as
    it is) lets it drop those scaling passes."""
    return loss + jnp.where(bad, jnp.asarray(jnp.nan, loss.dtype), jnp.asarray(0, loss.dtype))


# ---- collectives over the vocabulary axes -----------------------------------------------


def shard_index(axes, sizes: dict):
    """Linear index of this shard over the mesh axes ``axes`` (major to minor)."""
    idx = jnp.int32(0)
    for ax in axes:
        idx = idx * sizes[ax] + lax.axis_index(ax).astype(jnp.int32)
    return idx


def block_lse_and_picked(z, local_labels, vocab_axes):
    """For logits z [n, V_local] and labels relative to this shard's first column: (lse [n],
    picked [n]) over the whole vocabulary in f32 (f64; narrower logits are widened as they
    are read), with one pmax and one psum of [2, n] when ``vocab_axes`` is non-empty.
    Labels outside the shard pick 0."""
    z = z.astype(acc_dtype(z.dtype))
    m = lax.stop_gradient(jnp.max(z, axis=-1))
    if vocab_axes:
        m = lax.pmax(m, vocab_axes)
    s = jnp.sum(jnp.exp(z - m[..., None]), axis=-1)
    cols = jnp.arange(z.shape[-1])
    picked = jnp.sum(jnp.where(cols == local_labels[..., None], z, 0), axis=-1)
    if vocab_axes:
        s, picked = lax.psum(jnp.stack([s, picked]), vocab_axes)
    return m + jnp.log(s), picked


# ---- the partition ----------------------------------------------------------------------


class VocabPartition(Partition):
    """A ``Partition`` whose factors may include the vocabulary ("v") besides rows.

    ``local(fn, vocab_axes, row_axes, sizes, vocab_total, **params)`` builds the per-shard body:
    ``fn`` is the single-device computation (a kernel call or a reference), the axes
    are the mesh axes the vocabulary and the rows are split over (empty when not
    split) and ``sizes`` maps mesh axis names to sizes. The body does its own
    collectives (the base class only knows sums over rows)."""

    #: the vocabulary keeps a mesh axis it shares with the rows: the rows ([rows, D]) are
    #: gathered, never the weight ([D, V]) into [rows, V] logits a shard
    priority = frozenset({"v"})

    def __init__(self, factors: Callable, local: Callable, vocab_operand: int, vocab_dim: int):
        super().__init__(factors, shardable=[f"r{i}" for i in range(32)] + ["v"])
        self.local = local
        self.vocab_operand, self.vocab_dim = vocab_operand, vocab_dim

    def _assign(self, mesh, arg_shapes, c_in) -> dict:
        """As the base class; a mesh axis carrying the vocabulary is taken off the other
        factors (rows sharded over the same axis as the vocabulary, as sequence
        parallelism leaves them, are gathered: [rows, D] activations, never [rows, V])."""
        assign = super()._assign(mesh, arg_shapes, c_in)
        vocab = set(assign.get("v", ()))
        for f in [f for f in assign if f != "v"]:
            kept = tuple(ax for ax in assign[f] if ax not in vocab)
            if kept:
                assign[f] = kept
            else:
                del assign[f]
        return assign

    def _local_body(self, fn: Callable, mesh, assign: dict, c_out, avals_in, params: dict) -> Callable:
        vocab_total = avals_in[self.vocab_operand].shape[self.vocab_dim]
        vocab_axes = tuple(assign.get("v", ()))
        row_axes = tuple(ax for f, axes in assign.items() if f != "v" for ax in axes)
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
        body = self.local(fn, vocab_axes, row_axes, sizes, vocab_total, **params)
        return lambda *xs: tuple(body(*xs))

