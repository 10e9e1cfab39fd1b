"""NeoX rotary position embedding (RLX's ``Rope{head_dim, n_rot}``).

Layouts (the same memory; the public functions take either):

- heads-split, ``head_dim=None``: x [..., S, H, D]; head_dim = D = x.shape[-1];
- merged (RLX's), ``head_dim`` an int: x [..., S, H * head_dim].

In both, S is the sequence position s and leading axes are batch. cos, sin: [S, T]
tables indexed by position, shared by all heads and batch entries, with T >= n_rot / 2.
Only the first n_rot / 2 columns are read: T = n_rot / 2 is the compact form, T =
head_dim / 2 is RLX's own table width. In each head, with half = n_rot / 2, i < half,
c = cos[s, i], t = sin[s, i]:

      y[i]        = x[i] * c - x[half + i] * t
      y[half + i] = x[half + i] * c + x[i] * t
      y[j]        = x[j]        for n_rot <= j < head_dim (pass-through)

i.e. the first n_rot dims rotate as two halves (NeoX / GPT-NeoX style, not the
interleaved GPT-J pairs); the rest pass through.

RoPE is linear in x with an orthogonal map, so its transpose (the backward, RLX's
``RopeBackward``) is the same rotation with sin negated: ``dx = rope(dy, cos, -sin)``.
Gradients also flow into cos and sin (RLX's backward op gives dx only; JAX users may
differentiate tables): ``d y[i] = x[i] dc - x[half+i] dt``, ``d y[half+i] = x[half+i] dc
+ x[i] dt``.

``rope_split`` reads a packed x [B, S, H_1 + ... + H_k, D] (a fused q / k / v projection's
output) into its k parts [B, S, H_p, D], rotating the parts flagged in ``rotate`` and copying
the others, in one pass: slicing the packed product for ``rope`` costs a copy of every part,
and the backward's concatenation of the parts' gradients for the projection's products another
(about 0.17 ms a layer of a 16384-token Llama step at width 2048 on an H200). Its transpose,
``rope_merge``, writes the parts' gradients (rotated back by -theta) into one packed
gradient, the operand those products take.

Primitives: ``rope_fwd`` (x, cos, sin) -> y and ``rope_bwd`` (dy, cos, sin) -> dx on
x [B, S, H, D], each linear in its first operand and the transpose of the other, each
lowering to its FFI kernel (``rlx_rope_fwd`` / ``rlx_rope_bwd``) where registered. The
kernels read [B, S, H * D], a reshape of the same memory (no transpose). Under SPMD
sharding the primitives split over batch, sequence (the tables split with it) and whole
heads: a merged axis sharded on head boundaries stays sharded. ``rope_split_fwd`` (x, cos,
sin) -> (*parts) and ``rope_merge`` (*parts, cos, sin) -> (x,) (targets ``rlx_rope_split`` /
``rlx_rope_merge``) are each other's transposes; they split over batch and sequence only (a
part's heads sit at a fixed offset of the packed row, so a head-sharded packed axis is
gathered).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, Partition, instantiate


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# ---- references (the test oracle and the fallback) ----------------------------------


def _rotate(x, cos, sin, *, n_rot, sign, passthrough=True):
    """The NeoX rotation of x [..., S, H, D] by tables [S, >= n_rot/2], sin scaled by
    ``sign``; with passthrough=False the unrotated dims are zero (the table tangent)."""
    acc = _acc(x.dtype)
    half = n_rot // 2
    xh = x.astype(acc)
    c = cos[:, :half].astype(acc)[:, None, :]  # [S, 1, half]
    t = sign * sin[:, :half].astype(acc)[:, None, :]
    a, b, rest = xh[..., :half], xh[..., half:n_rot], xh[..., n_rot:]
    ya, yb = a * c - b * t, b * c + a * t
    rest = rest if passthrough else jnp.zeros_like(rest)
    return jnp.concatenate([ya, yb, rest], axis=-1).astype(x.dtype)


def reference_rope(x, cos, sin, *, n_rot):
    """y = rope(x) for x [B, S, H, D]; returns (y,)."""
    return (_rotate(x, cos, sin, n_rot=n_rot, sign=1.0),)


def reference_rope_bwd(dy, cos, sin, *, n_rot):
    """dx = rope(dy) with sin negated; returns (dx,)."""
    return (_rotate(dy, cos, sin, n_rot=n_rot, sign=-1.0),)


# ---- kernels ---------------------------------------------------------------------------


def _kernel(target):
    def call(x, cos, sin, *, n_rot):
        # the kernel reads [B, S, H * D]: the same memory as x [B, S, H, D]
        b, s, h, d = x.shape
        out = (jax.ShapeDtypeStruct((b, s, h * d), x.dtype),)
        (y,) = jax.ffi.ffi_call(ffi_target(target), out)(x.reshape(b, s, h * d), cos, sin, head_dim=np.int64(d),
                                             n_rot=np.int64(n_rot))
        return (y.reshape(x.shape),)

    return call


def _kernel_ok(x, cos, sin, **params):
    return (
        x.ndim == 4
        and x.shape[3] > 0
        and x.dtype in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
        and cos.dtype == x.dtype
        and sin.dtype == x.dtype
        and cos.ndim == 2
        and cos.shape == sin.shape
    )


# SPMD: x / y are (batch, seq, heads, head dim), cos / sin (seq, table): batch, sequence (the
# tables split with it) and heads may split across devices; each head's D values stay whole.
_PARTITION = Partition(lambda avals_in, avals_out, **params: ([("b", "s", "h", "d"), ("s", "t"), ("s", "t")],
                                                             [("b", "s", "h", "d")]),
                       shardable=["b", "s", "h"])
rope_fwd = FusedPrimitive(
    "rlx_rope_fwd", reference_rope, target="rlx_rope_fwd", kernel=_kernel("rlx_rope_fwd"), kernel_ok=_kernel_ok,
    partition=_PARTITION,
)
rope_bwd = FusedPrimitive(
    "rlx_rope_bwd", reference_rope_bwd, target="rlx_rope_bwd", kernel=_kernel("rlx_rope_bwd"), kernel_ok=_kernel_ok,
    partition=_PARTITION,
)

_SIGN = {rope_fwd: 1.0, rope_bwd: -1.0}
_TRANSPOSE = {rope_fwd: rope_bwd, rope_bwd: rope_fwd}


# ---- differentiation rules -------------------------------------------------------------


def _make_jvp(prim):
    sign = _SIGN[prim]

    def jvp(primals, tangents, *, n_rot):
        x, cos, sin = primals
        tx, tc, ts = tangents
        (y,) = prim(x, cos, sin, n_rot=n_rot)
        parts = []
        if type(tx) is not ad.Zero:
            parts.append(prim(tx, cos, sin, n_rot=n_rot)[0])
        if type(tc) is not ad.Zero or type(ts) is not ad.Zero:
            tc = jnp.zeros_like(cos) if type(tc) is ad.Zero else tc
            ts = jnp.zeros_like(sin) if type(ts) is ad.Zero else ts
            parts.append(_rotate(x, tc, ts, n_rot=n_rot, sign=sign, passthrough=False))
        if not parts:
            return (y,), (jnp.zeros_like(y),)
        return (y,), (parts[0] if len(parts) == 1 else parts[0] + parts[1],)

    return jvp


def _make_transpose(prim):
    other = _TRANSPOSE[prim]

    def transpose(cts, x, cos, sin, *, n_rot):
        if ad.is_undefined_primal(cos) or ad.is_undefined_primal(sin):
            raise ValueError("rope is linear in x only (cos and sin must be known)")
        (ct,) = cts
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval), None, None]
        (dx,) = other(ct, cos, sin, n_rot=n_rot)
        return [dx, None, None]

    return transpose


for _prim in (rope_fwd, rope_bwd):
    _prim.def_jvp(_make_jvp(_prim))
    _prim.def_transpose(_make_transpose(_prim))


# ---- rope_split / rope_merge --------------------------------------------------------------
#: the most parts one split takes (the CUDA kernel's part table, ffi/rope_checks.h kMaxParts)
MAX_SPLIT_PARTS = 8


def _part_slices(heads):
    """[(start, stop)] of each part's heads in the packed axis."""
    out, start = [], 0
    for h in heads:
        out.append((start, start + h))
        start += h
    return out


def reference_rope_split(x, cos, sin, *, heads, rotate, n_rot):
    """The parts of x [B, S, sum(heads), D]: part p is heads [start_p, start_p + heads[p]),
    rotated by +theta where rotate[p], else unchanged."""
    parts = []
    for (a, b), rot in zip(_part_slices(heads), rotate):
        part = x[:, :, a:b]
        parts.append(_rotate(part, cos, sin, n_rot=n_rot, sign=1.0) if rot else part)
    return tuple(parts)


def reference_rope_merge(*args, heads, rotate, n_rot):
    """(x,): the parts (args[:-2]) rotated by -theta where rotate[p], concatenated along
    heads; the transpose of ``reference_rope_split``."""
    parts, (cos, sin) = args[:-2], args[-2:]
    return (jnp.concatenate([_rotate(p, cos, sin, n_rot=n_rot, sign=-1.0) if rot else p
                             for p, rot in zip(parts, rotate)], axis=2),)


def _rotate_mask(rotate):
    return np.int64(sum(1 << i for i, rot in enumerate(rotate) if rot))


def _split_kernel(x, cos, sin, *, heads, rotate, n_rot):
    # the kernels read and write [B, S, H * D]: the same memory as [B, S, H, D]
    b, s, ht, d = x.shape
    outs = tuple(jax.ShapeDtypeStruct((b, s, h * d), x.dtype) for h in heads)
    parts = jax.ffi.ffi_call(ffi_target("rlx_rope_split"), outs)(
        x.reshape(b, s, ht * d), cos, sin, head_dim=np.int64(d), n_rot=np.int64(n_rot), rotate_mask=_rotate_mask(rotate))
    return tuple(p.reshape(b, s, h, d) for p, h in zip(parts, heads))


def _merge_kernel(*args, heads, rotate, n_rot):
    parts, (cos, sin) = args[:-2], args[-2:]
    b, s, _, d = parts[0].shape
    out = (jax.ShapeDtypeStruct((b, s, sum(heads) * d), parts[0].dtype),)
    (x,) = jax.ffi.ffi_call(ffi_target("rlx_rope_merge"), out)(
        cos, sin, *(p.reshape(b, s, h * d) for p, h in zip(parts, heads)), head_dim=np.int64(d), n_rot=np.int64(n_rot),
        rotate_mask=_rotate_mask(rotate))
    return (x.reshape(b, s, sum(heads), d),)


def _split_kernel_ok(x, cos, sin, **params):
    return _kernel_ok(x, cos, sin) and len(params["heads"]) <= MAX_SPLIT_PARTS


def _merge_kernel_ok(*avals, **params):
    parts, (cos, sin) = avals[:-2], avals[-2:]
    return (all(_kernel_ok(p, cos, sin) and p.dtype == parts[0].dtype for p in parts)
            and len(params["heads"]) <= MAX_SPLIT_PARTS)


def _split_factors(avals_in, avals_out, *, heads, **params):
    parts = [("b", "s", f"h{i}", "d") for i in range(len(heads))]
    return [("b", "s", "h", "d"), ("s", "t"), ("s", "t")], parts


def _merge_factors(avals_in, avals_out, *, heads, **params):
    parts = [("b", "s", f"h{i}", "d") for i in range(len(heads))]
    return [*parts, ("s", "t"), ("s", "t")], [("b", "s", "h", "d")]


rope_split_fwd = FusedPrimitive(
    "rlx_rope_split", reference_rope_split, target="rlx_rope_split", kernel=_split_kernel,
    kernel_ok=_split_kernel_ok, partition=Partition(_split_factors, shardable=["b", "s"]),
)
rope_merge = FusedPrimitive(
    "rlx_rope_merge", reference_rope_merge, target="rlx_rope_merge", kernel=_merge_kernel,
    kernel_ok=_merge_kernel_ok, partition=Partition(_merge_factors, shardable=["b", "s"]),
)


def _table_tangents(tc, ts, cos, sin):
    """(tc, ts) with symbolic zeros made explicit, or None when both are zero."""
    if type(tc) is ad.Zero and type(ts) is ad.Zero:
        return None
    return (jnp.zeros_like(cos) if type(tc) is ad.Zero else tc, jnp.zeros_like(sin) if type(ts) is ad.Zero else ts)


@rope_split_fwd.def_jvp
def _split_jvp(primals, tangents, *, heads, rotate, n_rot):
    x, cos, sin = primals
    tx, tc, ts = tangents
    params = dict(heads=heads, rotate=rotate, n_rot=n_rot)
    parts = rope_split_fwd(x, cos, sin, **params)
    if type(tx) is ad.Zero:
        t_parts = [jnp.zeros_like(p) for p in parts]
    else:
        t_parts = list(rope_split_fwd(tx, cos, sin, **params))
    tables = _table_tangents(tc, ts, cos, sin)
    if tables is not None:
        for i, ((a, b), rot) in enumerate(zip(_part_slices(heads), rotate)):
            if rot:
                t_parts[i] = t_parts[i] + _rotate(x[:, :, a:b], *tables, n_rot=n_rot, sign=1.0, passthrough=False)
    return parts, t_parts


@rope_merge.def_jvp
def _merge_jvp(primals, tangents, *, heads, rotate, n_rot):
    parts, (cos, sin) = primals[:-2], primals[-2:]
    t_parts, (tc, ts) = tangents[:-2], tangents[-2:]
    params = dict(heads=heads, rotate=rotate, n_rot=n_rot)
    (x,) = rope_merge(*parts, cos, sin, **params)
    if all(type(t) is ad.Zero for t in t_parts):
        tx = jnp.zeros_like(x)
    else:
        (tx,) = rope_merge(*instantiate(t_parts, parts), cos, sin, **params)
    tables = _table_tangents(tc, ts, cos, sin)
    if tables is not None:
        tx = tx + jnp.concatenate([_rotate(p, *tables, n_rot=n_rot, sign=-1.0, passthrough=False) if rot
                                   else jnp.zeros_like(p) for p, rot in zip(parts, rotate)], axis=2)
    return (x,), (tx,)


@rope_split_fwd.def_transpose
def _split_transpose(cts, x, cos, sin, *, heads, rotate, n_rot):
    if ad.is_undefined_primal(cos) or ad.is_undefined_primal(sin):
        raise ValueError("rope_split is linear in x only (cos and sin must be known)")
    if all(type(ct) is ad.Zero for ct in cts):
        return [ad.Zero(x.aval), None, None]
    shapes = [(*x.aval.shape[:2], h, x.aval.shape[3]) for h in heads]
    cts = [jnp.zeros(shape, x.aval.dtype) if type(ct) is ad.Zero else ct for ct, shape in zip(cts, shapes)]
    (dx,) = rope_merge(*cts, cos, sin, heads=heads, rotate=rotate, n_rot=n_rot)
    return [dx, None, None]


@rope_merge.def_transpose
def _merge_transpose(cts, *args, heads, rotate, n_rot):
    parts, (cos, sin) = args[:-2], args[-2:]
    if ad.is_undefined_primal(cos) or ad.is_undefined_primal(sin):
        raise ValueError("rope_merge is linear in its parts only (cos and sin must be known)")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [ad.Zero(p.aval) if ad.is_undefined_primal(p) else None for p in parts] + [None, None]
    d_parts = rope_split_fwd(ct, cos, sin, heads=heads, rotate=rotate, n_rot=n_rot)
    return [d if ad.is_undefined_primal(p) else None for d, p in zip(d_parts, parts)] + [None, None]


def _rows_batched(prim):
    """Batching for a kernel whose operands are [B, S, ...] row operands followed by the
    tables cos, sin (every primitive here): the batch axis joins B (unbatched row operands
    broadcast); batched tables fall back to vmap of the reference."""

    def batch(args, dims, **params):
        if dims[-1] is not NOT_MAPPED or dims[-2] is not NOT_MAPPED:
            return prim._reference_batch(args, dims, **params)
        rows = range(len(args) - 2)
        size = next(args[i].shape[dims[i]] for i in rows if dims[i] is not NOT_MAPPED)
        moved = list(args)
        for i in rows:
            a = args[i] if dims[i] is not NOT_MAPPED else jnp.broadcast_to(args[i], (size, *args[i].shape))
            a = jnp.moveaxis(a, dims[i] if dims[i] is not NOT_MAPPED else 0, 0)  # [size, B, S, ...]
            batch = a.shape[1]
            moved[i] = a.reshape(size * batch, *a.shape[2:])
        outs = prim(*moved, **params)
        return [o.reshape(size, batch, *o.shape[1:]) for o in outs], [0] * len(outs)

    return batch


for _prim in (rope_fwd, rope_bwd, rope_split_fwd, rope_merge):
    _prim.def_batching(_rows_batched(_prim))


# ---- public functions ------------------------------------------------------------------


def _prepare(x, cos, sin, head_dim, n_rot, who):
    """x as [B, S, H, D] (leading axes flattened into B), the tables in x's dtype, n_rot,
    and the shape to give the result back in."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must be floating point, got {x.dtype}")
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    if head_dim is None:
        if x.ndim < 3:
            raise ValueError(f"{who}: x must be [..., S, H, D] (rank >= 3) when head_dim is None; for the "
                             f"merged layout [..., S, H * head_dim] pass head_dim, got shape {x.shape}")
        layout = "[..., S, H, D]"
        s, h, d = x.shape[-3:]
    else:
        if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim <= 0:
            raise ValueError(f"{who}: head_dim must be a positive int (or None for x [..., S, H, D]), "
                             f"got {head_dim!r}")
        if x.ndim < 2:
            raise ValueError(f"{who}: x must be [..., S, H * head_dim] (rank >= 2), got shape {x.shape}")
        layout = "[..., S, H * head_dim]"
        s, w = x.shape[-2:]
        d = int(head_dim)
        if w % d:
            raise ValueError(f"{who}: the last axis of x ({w}) must be a multiple of head_dim ({d})")
        h = w // d
        if x.ndim >= 3 and cos.ndim == 2 and cos.shape[0] != s and cos.shape[0] == x.shape[-3]:
            raise ValueError(
                f"{who}: with head_dim={d}, x {x.shape} is read as the merged layout [..., S={s}, H * head_dim="
                f"{w}], but cos has {cos.shape[0]} positions, x.shape[-3]: for x laid out [..., S, H, D], "
                f"drop head_dim (head_dim=None takes D = x.shape[-1])")
    n_rot = d if n_rot is None else n_rot
    if isinstance(n_rot, bool) or not isinstance(n_rot, (int, np.integer)) or not 0 <= n_rot <= d or n_rot % 2:
        raise ValueError(f"{who}: n_rot must be an even int in [0, head_dim={d}], got {n_rot!r}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.ndim != 2 or t.shape[0] != s or t.shape[1] < n_rot // 2:
            raise ValueError(f"{who}: {name} must be [S={s}, T] with T >= n_rot/2={n_rot // 2} "
                             f"(x is {x.shape}, read as {layout}), got {t.shape}")
    if cos.shape != sin.shape:
        raise ValueError(f"{who}: cos {cos.shape} and sin {sin.shape} must have the same shape")
    lead = x.shape[:-3] if head_dim is None else x.shape[:-2]
    x4 = x.reshape(math.prod(lead), s, h, d)
    return x4, cos.astype(x.dtype), sin.astype(x.dtype), int(n_rot), x.shape


def rope(x, cos, sin, *, head_dim: int | None = None, n_rot: int | None = None):
    """NeoX RoPE of x with tables cos, sin [S, T >= n_rot/2].

    x: [..., S, H, D] when ``head_dim`` is None (head_dim = D), or RLX's merged layout
    [..., S, H * head_dim] when ``head_dim`` is an int (the same memory: both run the same
    kernel, no transpose). The first ``n_rot`` (default head_dim) dims of each head rotate
    as two halves; the rest pass through (module docstring for the exact formula).
    cos/sin are cast to x's dtype; arithmetic is f32 (f64 for f64). Differentiable in x,
    cos and sin in every mode; reverse mode in x runs the kernel ``rlx_rope_bwd``. Under
    SPMD sharding it runs shard-local over batch, sequence (shard cos/sin like S) and
    whole heads. Returns x's shape and dtype.
    """
    x4, cos, sin, n_rot, shape = _prepare(x, cos, sin, head_dim, n_rot, "rope")
    (y,) = rope_fwd(x4, cos, sin, n_rot=n_rot)
    return y.reshape(shape)


def rope_backward(dy, cos, sin, *, head_dim: int | None = None, n_rot: int | None = None):
    """The RLX op RopeBackward: ``dx = rope(dy, cos, -sin)`` (same layouts as ``rope``)."""
    dy4, cos, sin, n_rot, shape = _prepare(dy, cos, sin, head_dim, n_rot, "rope_backward")
    (dx,) = rope_bwd(dy4, cos, sin, n_rot=n_rot)
    return dx.reshape(shape)


def rope_split(x, cos, sin, heads, *, rotate=None, head_dim: int | None = None, n_rot: int | None = None):
    """Split x along its heads into parts of ``heads[p]`` heads each, applying NeoX RoPE
    (``rope``'s rotation, tables cos, sin [S, T >= n_rot/2]) to the parts flagged in
    ``rotate``; the others are copied unchanged. One pass over x, where slicing it and
    calling ``rope`` on the slices copies every part first.

    x: [..., S, H, D] (``head_dim=None``) or the merged [..., S, H * head_dim], with H =
    sum(heads): the packed output of one query / key / value projection, say. ``heads``: a
    sequence of 1 to 8 positive head counts; ``rotate``: one bool per part (default: every
    part rotates). Returns a tuple with one array per part in x's layout ([..., S, heads[p],
    D] or [..., S, heads[p] * head_dim]) and dtype. A grouped-query block::

        qkv = x @ jnp.concatenate([wq, wk, wv], axis=1)     # [B, S, (H + 2 Hkv) * D]
        q, k, v = rope_split(qkv, cos, sin, (H, Hkv, Hkv), rotate=(True, True, False),
                             head_dim=D)

    Differentiable in x, cos and sin in every mode; reverse mode in x writes the parts'
    gradients into one packed gradient in one kernel (``rlx_rope_merge``), the operand the
    projection's products take, instead of concatenating them. Under SPMD sharding it runs
    shard-local over batch and sequence (a head-sharded x is gathered: a part's heads sit at
    a fixed offset of the packed axis).
    """
    x4, cos, sin, n_rot, shape = _prepare(x, cos, sin, head_dim, n_rot, "rope_split")
    total = x4.shape[2]
    if isinstance(heads, (int, np.integer)) or not hasattr(heads, "__len__"):
        raise TypeError(f"rope_split: heads must be a sequence of head counts, got {heads!r}")
    if not 1 <= len(heads) <= MAX_SPLIT_PARTS or any(
            isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h <= 0 for h in heads):
        raise ValueError(f"rope_split: heads must be 1 to {MAX_SPLIT_PARTS} positive ints, got {heads!r}")
    heads = tuple(int(h) for h in heads)
    if sum(heads) != total:
        raise ValueError(f"rope_split: heads {heads} sum to {sum(heads)}, but x {shape} has {total} heads")
    rotate = (True,) * len(heads) if rotate is None else rotate
    if len(rotate) != len(heads) or any(not isinstance(r, (bool, np.bool_)) for r in rotate):
        raise ValueError(f"rope_split: rotate must be one bool per part ({len(heads)}), got {rotate!r}")
    rotate = tuple(bool(r) for r in rotate)
    parts = rope_split_fwd(x4, cos, sin, heads=heads, rotate=rotate, n_rot=n_rot)
    _, s, _, d = x4.shape
    if head_dim is None:
        return tuple(p.reshape(*shape[:-3], s, h, d) for p, h in zip(parts, heads))
    return tuple(p.reshape(*shape[:-2], s, h * d) for p, h in zip(parts, heads))
