"""Context parallelism: attention with the sequence axis sharded over a mesh axis (ring
attention).

The sequence of length S is cut into 2n chunks of c = S / (2n) positions for a mesh axis
of n devices; device r holds chunks r and 2n-1-r ("zig-zag" order), so that under a
causal mask every device sees the same number of visible (query chunk, key chunk)
pairs. The K / V shards travel around the ring (``ppermute`` to the next device) n - 1
times; at each step a device runs the fused attention kernel on its two query chunks
against the two key chunks it holds, and merges the partial results by their
log-sum-exp: for partials (o_a, l_a) and (o_b, l_b) of one query row,

    l = log(exp(l_a) + exp(l_b)),   o = exp(l_a - l) o_a + exp(l_b - l) o_b,

which is exact (an empty partial has l = -inf and weight 0). The backward rings again:
with the merged output O and lse L saved, the fused backward of each block pair, fed O
and L, yields that block's exact share of dq, dk and dv (P_ij = exp(s_ij - L_i), delta_i
= dout_i . O_i); dk and dv accumulate in buffers that travel with K / V and arrive back
at their owner after the n-th rotation. Every sum runs in a fixed order (the ring order),
so results are deterministic.

Block visibility. With global positions i (query) and j (key) and d = (qchunk - kchunk) c,
a block pair is, per mask kind:

- "none": fully visible;
- "causal": hidden (d < 0, skipped), the causal kernel (d = 0), fully visible (d > 0);
- "sliding" (keys i - w <= j <= i): hidden (d < 0, or every row's window ends before the
  block: d - w >= c), the sliding kernel (d = 0), fully visible (d + c - 1 <= w), else
  partially visible: the kernel takes no position offset, so such blocks pass an
  additive bias [B, H, c, c] (0 where j_loc >= i_loc + d - w, -inf elsewhere).

The chunk index of a device is only known at run time (``axis_index``), so each block
pair picks its case by ``lax.switch``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import Mesh, PartitionSpec as P

from rlx_jax.vjp_rules._args import is_int
from rlx_jax.vjp_rules.attention import _acc_dtype, _check_options, _check_qkv, attention, attention_bwd, attention_fwd

__all__ = ["context_parallel_attention", "zigzag_permutation", "zigzag_inverse"]

_SKIP, _FULL, _DIAG, _PARTIAL = 0, 1, 2, 3


def zigzag_permutation(seq_len: int, n: int) -> np.ndarray:
    """Indices ``perm`` [S] with ``x[:, perm]`` in zig-zag order for ``n`` devices: the
    sequence is cut into 2n chunks and shard r (positions r*2c ... (r+1)*2c - 1 of the
    permuted axis) holds chunks r and 2n-1-r. ``seq_len`` >= 0 (an empty sequence has the
    empty permutation) and divisible by 2n; ``n`` >= 1."""
    who = "zigzag_permutation"
    for name, value in (("seq_len", seq_len), ("n", n)):
        if not is_int(value):  # True as a size is a mistake, not a 1
            raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__} {value!r}")
    seq_len, n = int(seq_len), int(n)
    if n < 1:
        raise ValueError(f"{who}: n must be >= 1, got {n}")
    if seq_len < 0:
        raise ValueError(f"{who}: seq_len must be >= 0, got {seq_len}")
    if seq_len % (2 * n):
        raise ValueError(f"{who}: seq_len {seq_len} must be divisible by 2 * n = {2 * n}")
    c = seq_len // (2 * n)
    chunks = np.arange(seq_len).reshape(2 * n, c)
    order = [x for r in range(n) for x in (r, 2 * n - 1 - r)]
    return chunks[order].reshape(-1)


def zigzag_inverse(seq_len: int, n: int) -> np.ndarray:
    """The inverse of ``zigzag_permutation``: ``y[:, zigzag_inverse(S, n)]`` restores natural
    order."""
    return np.argsort(zigzag_permutation(seq_len, n))


# ---- per-block plan ----------------------------------------------------------------------


def _block_case(d_chunks, c, kind, window):
    """Traced int32 case (_SKIP / _FULL / _DIAG / _PARTIAL) of a block pair whose query
    chunk is ``d_chunks`` chunks after its key chunk."""
    if kind == "none":
        return jnp.int32(_FULL)
    d = d_chunks * c
    if kind == "causal":
        return jnp.where(d_chunks < 0, _SKIP, jnp.where(d_chunks == 0, _DIAG, _FULL)).astype(jnp.int32)
    hidden = (d_chunks < 0) | (d - window >= c)
    full = d + c - 1 <= window
    case = jnp.where(hidden, _SKIP, jnp.where(d_chunks == 0, _DIAG, jnp.where(full, _FULL, _PARTIAL)))
    return case.astype(jnp.int32)


def _partial_bias(d_chunks, c, window, shape, dtype):
    """[B, H, c, c] additive bias of a partially visible sliding block: 0 where key j_loc is
    inside the window of query i_loc (j_loc >= i_loc + d - w), -inf elsewhere."""
    i = jnp.arange(c)[:, None]
    j = jnp.arange(c)[None, :]
    ok = j >= i + d_chunks * c - window
    bias = jnp.where(ok, 0.0, -jnp.inf).astype(dtype)
    return jnp.broadcast_to(bias, shape)


def _kernel_params(params, kind):
    """The attention primitive's static params for one block case's kernel call."""
    p = dict(params)
    p["kind"] = kind
    p["window"] = params["window"] if kind == "sliding" else 0
    return p


def _block_fwd(q, k, v, d_chunks, params, c):
    """(out [B, c, H, D] acc dtype, lse [B, H, c]) of query chunk q against key chunk k, v."""
    kind, window = params["kind"], params["window"]
    acc = _acc_dtype(q.dtype)
    b, _, h, _ = q.shape

    def skip(q, k, v, d):
        return jnp.zeros(q.shape, acc), jnp.full((b, h, c), -jnp.inf, acc)

    def full(q, k, v, d):
        o, l = attention_fwd(q, k, v, **_kernel_params(params, "none"))
        return o.astype(acc), l

    def diag(q, k, v, d):
        o, l = attention_fwd(q, k, v, **_kernel_params(params, kind))
        return o.astype(acc), l

    def partial(q, k, v, d):
        bias = _partial_bias(d, c, window, (b, h, c, c), q.dtype)
        o, l = attention_fwd(q, k, v, bias, **dict(_kernel_params(params, "none"), has_bias=True))
        return o.astype(acc), l

    if kind == "none":
        return full(q, k, v, d_chunks)
    branches = [skip, full, diag] + ([partial] if kind == "sliding" else [])
    return jax.lax.switch(_block_case(d_chunks, c, kind, window), branches, q, k, v, d_chunks)


def _block_bwd(q, k, v, out, lse, dout, d_chunks, params, c):
    """(dq, dk, dv) in the accumulation dtype: the block pair's share of the gradients, from
    the merged out / lse of the query rows."""
    kind, window = params["kind"], params["window"]
    acc = _acc_dtype(q.dtype)
    b, _, h, _ = q.shape
    dlse = jnp.zeros(lse.shape, lse.dtype)

    def cast(gs):
        return tuple(g.astype(acc) for g in gs[:3])

    def skip(q, k, v, d):
        return jnp.zeros(q.shape, acc), jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc)

    def full(q, k, v, d):
        return cast(attention_bwd(q, k, v, out, lse, dout, dlse, **_kernel_params(params, "none")))

    def diag(q, k, v, d):
        return cast(attention_bwd(q, k, v, out, lse, dout, dlse, **_kernel_params(params, kind)))

    def partial(q, k, v, d):
        bias = _partial_bias(d, c, window, (b, h, c, c), q.dtype)
        p = dict(_kernel_params(params, "none"), has_bias=True)
        return cast(attention_bwd(q, k, v, out, lse, dout, dlse, bias, **p))

    if kind == "none":
        return full(q, k, v, d_chunks)
    branches = [skip, full, diag] + ([partial] if kind == "sliding" else [])
    return jax.lax.switch(_block_case(d_chunks, c, kind, window), branches, q, k, v, d_chunks)


def _merge(o_a, l_a, o_b, l_b):
    """Log-sum-exp merge of two partial attentions of the same query rows; o [B, c, H, D],
    l [B, H, c]. Rows empty in both stay (0, -inf)."""
    l = jnp.logaddexp(l_a, l_b)
    safe = jnp.where(jnp.isfinite(l), l, 0.0)
    w_a = jnp.where(jnp.isfinite(l_a), jnp.exp(l_a - safe), 0.0)
    w_b = jnp.where(jnp.isfinite(l_b), jnp.exp(l_b - safe), 0.0)
    t = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # [B, H, c] -> [B, c, H, 1]
    return o_a * t(w_a) + o_b * t(w_b), l


# ---- the ring --------------------------------------------------------------------------


def _halves(x):
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def _ring_perm(n):
    return [(i, (i + 1) % n) for i in range(n)]


def _chunk_ids(r, n):
    return (r, 2 * n - 1 - r)


def _ring_forward(q, k, v, *, axis, n, params):
    """Local shards q [B, 2c, H, D], k, v [B, 2c, Hkv, D] (zig-zag chunks) -> (out [B, 2c, H, D]
    in q's dtype, lse [B, H, 2c])."""
    r = jax.lax.axis_index(axis)
    c = q.shape[1] // 2
    acc = _acc_dtype(q.dtype)
    qs = _halves(q)
    qid = _chunk_ids(r, n)
    b, _, h, _ = q.shape

    def compute(t, k, v, state):
        src = (r - t) % n
        kid = _chunk_ids(src, n)
        ks, vs = _halves(k), _halves(v)
        state = list(state)
        for a in range(2):
            o, l = state[a]
            for bb in range(2):  # fixed order: the two key chunks of the step, in ring order
                ob, lb = _block_fwd(qs[a], ks[bb], vs[bb], qid[a] - kid[bb], params, c)
                o, l = _merge(o, l, ob, lb)
            state[a] = (o, l)
        return tuple(state)

    empty = (jnp.zeros(qs[0].shape, acc), jnp.full((b, h, c), -jnp.inf, acc))
    state = (empty, empty)

    def step(t, carry):
        k, v, state = carry
        k_next, v_next = jax.lax.ppermute((k, v), axis, _ring_perm(n))  # sent while computing
        return k_next, v_next, compute(t, k, v, state)

    k, v, state = jax.lax.fori_loop(0, n - 1, step, (k, v, state))
    state = compute(n - 1, k, v, state)
    out = jnp.concatenate([state[0][0], state[1][0]], axis=1).astype(q.dtype)
    lse = jnp.concatenate([state[0][1], state[1][1]], axis=2)
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, *, axis, n, params):
    """(dq, dk, dv) of the local shards; dk / dv travel with K / V and return home."""
    r = jax.lax.axis_index(axis)
    c = q.shape[1] // 2
    acc = _acc_dtype(q.dtype)
    qs, outs, douts = _halves(q), _halves(out), _halves(dout)
    lses = (lse[:, :, :c], lse[:, :, c:])
    qid = _chunk_ids(r, n)
    perm = _ring_perm(n)

    def compute(t, k, v, dk, dv, dq):
        src = (r - t) % n
        kid = _chunk_ids(src, n)
        ks, vs = _halves(k), _halves(v)
        dq, dk, dv = list(dq), list(_halves(dk)), list(_halves(dv))
        for a in range(2):
            for bb in range(2):
                gq, gk, gv = _block_bwd(qs[a], ks[bb], vs[bb], outs[a], lses[a], douts[a],
                                        qid[a] - kid[bb], params, c)
                dq[a] = dq[a] + gq
                dk[bb] = dk[bb] + gk
                dv[bb] = dv[bb] + gv
        return jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1), tuple(dq)

    dq = (jnp.zeros(qs[0].shape, acc), jnp.zeros(qs[1].shape, acc))
    dk = jnp.zeros(k.shape, acc)
    dv = jnp.zeros(v.shape, acc)

    def step(t, carry):
        k, v, dk, dv, dq = carry
        k_next, v_next = jax.lax.ppermute((k, v), axis, perm)
        dk, dv, dq = compute(t, k, v, dk, dv, dq)
        dk, dv = jax.lax.ppermute((dk, dv), axis, perm)
        return k_next, v_next, dk, dv, dq

    k, v, dk, dv, dq = jax.lax.fori_loop(0, n - 1, step, (k, v, dk, dv, dq))
    dk, dv, dq = compute(n - 1, k, v, dk, dv, dq)
    dk, dv = jax.lax.ppermute((dk, dv), axis, perm)  # the n-th rotation brings them home
    dq = jnp.concatenate(dq, axis=1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring_attention(q, k, v, axis, n, params):
    return _ring_forward(q, k, v, axis=axis, n=n, params=dict(params))[0]


def _ring_attention_fwd(q, k, v, axis, n, params):
    out, lse = _ring_forward(q, k, v, axis=axis, n=n, params=dict(params))
    return out, (q, k, v, out, lse)


def _ring_attention_bwd(axis, n, params, res, dout):
    q, k, v, out, lse = res
    return _ring_backward(q, k, v, out, lse, dout, axis=axis, n=n, params=dict(params))


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


# ---- forward mode ----------------------------------------------------------------------
# The ring's derivative is a custom_vjp (its backward rings again with the fused backward
# kernels), and JAX cannot push a tangent through a custom_vjp. Left alone, jax.jvp fails
# inside JAX: with "unhashable type: 'Unhashable'" when shard_map runs eagerly (it wraps
# the custom_vjp's tangent in a jit keyed on its unhashable backward), or with a message
# naming no function when the program is compiled. So q, k and v pass through an identity
# whose tangent goes through ``_forward_mode_p``, a linear primitive that raises an error
# naming this function when it is evaluated or compiled. Reverse mode only transposes that
# tangent (to the identity), so the primitive never runs there.

_REVERSE_ONLY = ("context_parallel_attention: forward-mode differentiation (jax.jvp, jax.jacfwd, the "
                 "function jax.linearize returns) is not supported, only reverse mode (jax.grad, jax.vjp, "
                 "and forward or reverse mode over them, as jax.hessian); rlx_jax.ops.attention supports "
                 "both")


def _raise_forward_mode(*args, **kwargs):
    raise TypeError(_REVERSE_ONLY)


_forward_mode_p = Primitive("rlx_context_parallel_forward_mode")
_forward_mode_p.def_impl(_raise_forward_mode)
_forward_mode_p.def_abstract_eval(lambda t: t)
mlir.register_lowering(_forward_mode_p, _raise_forward_mode)
ad.deflinear2(_forward_mode_p, lambda ct, t: [ct])
batching.primitive_batchers[_forward_mode_p] = lambda args, dims: (_forward_mode_p.bind(*args), dims[0])


@jax.custom_jvp
def _reverse_mode_only(q, k, v):
    return q, k, v


@functools.partial(_reverse_mode_only.defjvp, symbolic_zeros=True)
def _reverse_mode_only_jvp(primals, tangents):
    # a symbolic zero stays one: binding the primitive on it would put it on the known side
    # of a linearization, where it runs (a grad with respect to q only)
    return primals, tuple(t if type(t) is SymbolicZero else _forward_mode_p.bind(t) for t in tangents)


# ---- argument checks -------------------------------------------------------------------


def _split_axes(value, param, mesh, axis_name, who) -> tuple:
    """The mesh axes (a tuple of names) that ``batch_axis`` / ``head_axis`` ``value`` splits
    over, checked against the mesh: shard_map's own errors about them name neither
    parameter."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{who}: {param} must be None, a mesh axis name or a tuple of them, got {value!r}")
    for a in names:
        if a not in mesh.shape:
            raise ValueError(f"{who}: {param} {a!r} is not an axis of the mesh {dict(mesh.shape)}")
        if a == axis_name:
            raise ValueError(f"{who}: {param} {a!r} is the sequence axis (axis_name): a mesh axis splits "
                             f"one array axis only")
    if len(set(names)) != len(names):
        raise ValueError(f"{who}: {param} {value!r} names a mesh axis twice")
    return tuple(names)


def _check_split(names, param, dim, what, mesh, who):
    """``dim`` (the size of the array axis ``what``) must split evenly over the mesh axes
    ``names`` of ``param``."""
    devices = math.prod(int(mesh.shape[a]) for a in names)
    if dim % devices:
        label = names[0] if len(names) == 1 else names
        raise ValueError(f"{who}: {param} {label!r} spans {devices} devices, which must divide {what} = {dim}")


# ---- public entry ----------------------------------------------------------------------


def context_parallel_attention(q, k, v, *, mesh: Mesh, axis_name: str, mask_kind: str = "none",
                               window: int | None = None, scale: float | None = None,
                               softcap: float | None = None, batch_axis=None, head_axis=None,
                               zigzag: bool = False):
    """``rlx_jax.ops.attention`` with the sequence axis sharded over ``axis_name`` of ``mesh``
    (ring attention, forward and backward).

    q: [B, S, H, D]; k, v: [B, S, Hkv, D] (self-attention: one sequence length; Hkv divides
    H); mask_kind "none" | "causal" | "sliding" (``window`` w: keys i - w ... i); scale
    (default 1/sqrt(D)) and softcap as in ``attention``. S must be divisible by 2n for a
    mesh axis of n devices. ``batch_axis`` / ``head_axis``: optional further mesh axes
    (or tuples of axes) the batch / heads are split over: axes of ``mesh`` other than
    ``axis_name`` and each other's, whose sizes (their product, for a tuple) divide B /
    Hkv (so H too).

    ``zigzag=False`` (default): q, k, v and the result are in natural sequence order; the
    function permutes them into zig-zag order and back (a collective each way when the
    sequence is sharded). ``zigzag=True``: they already are in zig-zag order
    (``x[:, zigzag_permutation(S, n)]``), as a model that keeps its activations (and RoPE
    positions) in that order passes them: no reordering.

    On a mesh axis of one device this is exactly the plain fused kernel. Returns
    [B, S, H, D] in q's dtype; differentiable in reverse mode (the backward rings too).
    Forward mode (``jax.jvp``, ``jax.jacfwd``) raises ``TypeError`` on an axis of more than
    one device: the ring's derivative is defined for reverse mode only.
    """
    who = "context_parallel_attention"
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(axis_name, str):
        raise TypeError(f"{who}: axis_name must be the name of one mesh axis, got {axis_name!r}")
    if axis_name not in mesh.shape:
        raise ValueError(f"{who}: axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    if jnp.ndim(q) != 4:
        raise ValueError(f"{who}: q must be [B, S, H, D], got shape {jnp.shape(q)}")
    q, k, v, lead = _check_qkv(q, k, v, who)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"{who}: q and k must share the sequence length (self-attention), "
                         f"got {q.shape[1]} and {k.shape[1]}")
    # self-attention (Sq = Sk): both causal alignments agree
    params, _, _, traced_scale = _check_options(q, k, lead, mask_kind, window, None, None, scale, softcap,
                                                "bottom_right", who)
    if traced_scale is not None:
        raise TypeError(f"{who}: scale must be a static number under context parallelism, got a traced value")
    batch_axes = _split_axes(batch_axis, "batch_axis", mesh, axis_name, who)
    head_axes = _split_axes(head_axis, "head_axis", mesh, axis_name, who)
    shared = sorted(set(batch_axes) & set(head_axes))
    if shared:
        raise ValueError(f"{who}: batch_axis and head_axis both name mesh axis {shared[0]!r}: a mesh axis "
                         f"splits one array axis only")
    _check_split(batch_axes, "batch_axis", q.shape[0], "the batch B", mesh, who)
    # k and v carry Hkv heads, and H = G * Hkv: a split of Hkv is a split of H too
    _check_split(head_axes, "head_axis", k.shape[2], "the kv heads Hkv", mesh, who)
    n = int(mesh.shape[axis_name])
    s = q.shape[1]
    if n == 1:  # nothing to ring: the plain kernel (zig-zag order of one device is natural)
        return attention(q, k, v, mask_kind=mask_kind, window=window, scale=scale, softcap=softcap)
    if s % (2 * n):
        raise ValueError(f"{who}: sequence length {s} must be divisible by 2 * {n} (two chunks per "
                         f"device of mesh axis {axis_name!r})")
    if mask_kind == "sliding":
        params["window"] = min(int(window), s)
    q, k, v = _reverse_mode_only(q, k, v)
    if not zigzag:
        perm = zigzag_permutation(s, n)
        q, k, v = (jnp.take(x, perm, axis=1) for x in (q, k, v))
    entry = lambda names: None if not names else names[0] if len(names) == 1 else names
    spec = P(entry(batch_axes), axis_name, entry(head_axes), None)
    body = lambda q, k, v: _ring_attention(q, k, v, axis_name, n, tuple(sorted(params.items())))
    out = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
    if not zigzag:
        out = jnp.take(out, zigzag_inverse(s, n), axis=1)
    return out
