"""Segment ids (packed documents) in the CPU attention kernel (``rlx_attention_segments_fwd``
/ ``_bwd``): values and gradients against the pure-JAX dense reference differentiated by
JAX itself (``fused_ops(False)``), f64 finite differences (first and second order),
forward mode, vmap, rows with no visible key, documents of length 1, key tiles that no
query tile meets being skipped, determinism, the routing threshold and the kernel's own
operand checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from rlx_jax.ops import attention
from rlx_jax.vjp_rules import attention as A
from rlx_jax.vjp_rules._primitive import fused_ops

from testutil import assert_same_bits_on_one_core_without_avx512, hlo_text

SEG_FWD, SEG_BWD = "rlx_attention_segments_fwd", "rlx_attention_segments_bwd"


@pytest.fixture(autouse=True)
def segment_kernel_at_every_size(monkeypatch):
    """The kernel at every size (the routing test restores the threshold itself)."""
    monkeypatch.setattr(A, "CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES", 0)


def close(got, want, rtol, atol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


def doc_ids(b, s, seed, *, max_len):
    """[B, S] int32 ids of consecutive documents of random lengths 1..max_len."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        lengths = rng.integers(1, max_len + 1, size=s)
        rows.append(np.repeat(np.arange(s), lengths)[:s])
    return jnp.asarray(np.array(rows, np.int32))


def normal(rng, shape, dtype, std=1.0):
    return jnp.asarray(std * rng.standard_normal(shape)).astype(dtype)


def inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return dict(q=normal(rng, (b, sq, h, d), dtype), k=normal(rng, (b, sk, hkv, d), dtype),
                v=normal(rng, (b, sk, hkv, d), dtype), dy=normal(rng, (b, sq, h, d), dtype),
                bias=normal(rng, (b, h, sq, sk), dtype, 0.5), sinks=normal(rng, (h,), dtype),
                mask=jnp.asarray((rng.uniform(size=(b, sk)) > 0.25).astype(np.float32)))


def value_and_grads(fn, diff, rest, dy, *, fused):
    """fn's value and vjp(dy) in the differentiable args ``diff`` (a dict), traced with the
    fused primitives (``fused``) or with the pure-JAX references that JAX differentiates."""

    def run(diff, dy):
        f = lambda d: fn(**d, **rest)
        y, vjp = jax.vjp(f, diff)
        return y, vjp(dy)[0]

    with fused_ops(fused):
        return jax.jit(run)(diff, dy)


def case(shape, opts, dtype, seed=0, *, max_len=40):
    """(diff, rest): the differentiable operands and the static / integer ones of one call."""
    b, sq, sk, h, hkv, d = shape
    x = inputs(*shape, dtype, seed)
    qs = doc_ids(b, sq, seed + 1, max_len=max_len)
    # bottom-right: the last Sq keys carry the queries' ids, earlier keys a document of their own
    ks = jnp.concatenate([jnp.full((b, sk - sq), -1, jnp.int32), qs], 1) if sk > sq else qs[:, :sk]
    diff = {"q": x["q"], "k": x["k"], "v": x["v"]}
    rest = {k: v for k, v in opts.items() if not k.startswith("use_")}
    rest.update(q_segment_ids=qs, kv_segment_ids=ks)
    if opts.get("use_bias"):
        diff["bias"] = x["bias"]
    if opts.get("use_sinks"):
        diff["sinks"] = x["sinks"]
    if opts.get("use_mask"):
        rest["mask"] = x["mask"]
    return diff, rest, x["dy"]


# (B, Sq, Sk, H, Hkv, D): several 64-row tiles, odd lengths, GQA, Sq != Sk both ways
SHAPES = [(2, 150, 150, 4, 2, 5), (1, 70, 131, 2, 1, 3), (1, 131, 97, 3, 3, 4)]
OPTIONS = {
    "causal": dict(mask_kind="causal"),
    "sliding-softcap": dict(mask_kind="sliding", window=9, softcap=1.5, scale=0.45),
    "none-mask-bias-sinks": dict(use_mask=True, use_bias=True, use_sinks=True),
    "causal-softcap-sinks-mask": dict(mask_kind="causal", softcap=2.0, use_sinks=True, use_mask=True),
}
_slow = pytest.mark.slow
CASES = [(0, "sliding-softcap"), (1, "none-mask-bias-sinks"), (2, "causal-softcap-sinks-mask"),
         pytest.param(0, "causal", marks=_slow), pytest.param(1, "causal", marks=_slow),
         pytest.param(2, "sliding-softcap", marks=_slow)]


def _case_id(i, o):
    return f"{SHAPES[i]}-{o}"


@pytest.mark.parametrize("shape_idx,opt", CASES, ids=[_case_id(*(c.values if hasattr(c, "values") else c))
                                                      for c in CASES])
def test_f64_values_and_gradients_match_the_reference(x64, shape_idx, opt):
    diff, rest, dy = case(SHAPES[shape_idx], OPTIONS[opt], jnp.float64, seed=shape_idx)
    fn = lambda q, k, v, **kw: attention(q, k, v, **kw)
    text = hlo_text(lambda d: jax.grad(lambda d: jnp.sum(fn(**d, **rest) * dy))(d), diff)
    assert SEG_FWD in text and SEG_BWD in text
    y, g = value_and_grads(fn, diff, rest, dy, fused=True)
    y_ref, g_ref = value_and_grads(fn, diff, rest, dy, fused=False)
    close(y, y_ref, rtol=1e-10, atol=1e-11)
    assert set(g) == set(g_ref)
    for name in g:
        close(g[name], g_ref[name], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), pytest.param(jnp.bfloat16, 3e-2, marks=_slow)],
                         ids=["f32", "bf16"])
def test_low_precision_runs_the_kernel_and_agrees(dtype, tol):
    diff, rest, dy = case((2, 130, 130, 4, 2, 16), dict(mask_kind="causal", use_sinks=True), dtype, seed=3)
    fn = lambda q, k, v, **kw: attention(q, k, v, **kw)
    y, g = value_and_grads(fn, diff, rest, dy, fused=True)
    as32 = {n: a.astype(jnp.float32) for n, a in diff.items()}
    y_ref, g_ref = value_and_grads(fn, as32, rest, dy.astype(jnp.float32), fused=False)
    assert y.dtype == dtype
    scale = lambda a: float(jnp.max(jnp.abs(a)))
    close(y, y_ref, rtol=0, atol=tol * scale(y_ref))
    for name in g:
        close(g[name], g_ref[name], rtol=0, atol=tol * scale(g_ref[name]))


def test_documents_of_length_one_and_rows_with_no_visible_key(x64):
    """Every document of length 1 (out_i = v_i under causal or no mask); query ids missing
    from the keys and a key mask hiding a whole document: output 0 and zero, finite
    gradients for those rows, as the reference."""
    b, s, h, d = 1, 140, 2, 3
    x = inputs(b, s, s, h, 1, d, jnp.float64, seed=5)
    ones = jnp.arange(s, dtype=jnp.int32)[None]
    y = attention(x["q"], x["k"], x["v"], q_segment_ids=ones, kv_segment_ids=ones)
    close(y, jnp.broadcast_to(x["v"], y.shape), rtol=1e-13, atol=1e-13)

    qs = doc_ids(b, s, 8, max_len=30)
    ks = jnp.where(qs % 3 == 1, 1000, qs)            # documents 1, 4, 7, ... have no keys
    mask = jnp.where(qs == 2, 0.0, 1.0).astype(jnp.float32)  # document 2's keys all hidden
    rest = dict(mask_kind="causal", mask=mask, q_segment_ids=qs, kv_segment_ids=ks)
    diff = {"q": x["q"], "k": x["k"], "v": x["v"], "sinks": x["sinks"]}
    fn = lambda q, k, v, **kw: attention(q, k, v, **kw)
    y, g = value_and_grads(fn, diff, rest, x["dy"], fused=True)
    y_ref, g_ref = value_and_grads(fn, diff, rest, x["dy"], fused=False)
    dead = np.asarray((qs % 3 == 1) | (qs == 2))[0]
    assert dead.any() and (~dead).any()
    assert np.all(np.asarray(y)[0, dead] == 0)
    assert np.all(np.asarray(g["q"])[0, dead] == 0)
    for name in g:
        assert np.all(np.isfinite(np.asarray(g[name])))
        close(g[name], g_ref[name], rtol=1e-9, atol=1e-10)
    close(y, y_ref, rtol=1e-10, atol=1e-11)


def test_key_tiles_no_query_tile_meets_are_skipped(x64):
    """Keys 64..127 (one kernel tile) carry a segment id no query has, and NaN in k and v.
    Any work on that tile would spread the NaN (0 * NaN in P v and in dout . v); skipped,
    the values and gradients equal the reference's with those keys zeroed, and their own
    gradients are 0. Query tile 1 (id 1) meets no key tile either: its rows are 0."""
    b, s, h, d = 1, 192, 2, 4
    x = inputs(b, s, s, h, 2, d, jnp.float64, seed=6)
    qs = jnp.asarray(np.repeat([0, 1, 2], 64)[None], jnp.int32)
    ks = jnp.asarray(np.repeat([0, 7, 2], 64)[None], jnp.int32)
    poisoned = jnp.zeros(s, bool).at[64:128].set(True)[None, :, None, None]
    k_nan, v_nan = (jnp.where(poisoned, jnp.nan, x[n]) for n in ("k", "v"))
    k_zero, v_zero = (jnp.where(poisoned, 0.0, x[n]) for n in ("k", "v"))
    rest = dict(mask_kind="causal", q_segment_ids=qs, kv_segment_ids=ks)
    fn = lambda q, k, v, **kw: attention(q, k, v, **kw)
    y, g = value_and_grads(fn, {"q": x["q"], "k": k_nan, "v": v_nan}, rest, x["dy"], fused=True)
    y_ref, g_ref = value_and_grads(fn, {"q": x["q"], "k": k_zero, "v": v_zero}, rest, x["dy"], fused=False)
    assert np.all(np.isfinite(np.asarray(y))) and all(np.all(np.isfinite(np.asarray(a))) for a in g.values())
    close(y, y_ref, rtol=1e-10, atol=1e-11)
    for name in g:
        close(g[name], g_ref[name], rtol=1e-9, atol=1e-10)
    assert np.all(np.asarray(g["k"])[0, 64:128] == 0) and np.all(np.asarray(g["v"])[0, 64:128] == 0)
    assert np.all(np.asarray(y)[0, 64:128] == 0)


@pytest.mark.parametrize("opts,order,modes", [
    pytest.param(dict(mask_kind="causal", softcap=1.3), 2, ("rev",), marks=_slow),
    (dict(mask_kind="sliding", window=4), 1, ("fwd", "rev")),
], ids=["causal-softcap-order2", "sliding-fwd-rev"])
def test_f64_check_grads_through_the_kernel(x64, opts, order, modes):
    diff, rest, _ = case((1, 70, 70, 2, 1, 3), opts, jnp.float64, seed=9, max_len=30)
    names = list(diff)

    @jax.jit
    def f(*args):
        return attention(**dict(zip(names, args)), **rest)

    assert SEG_FWD in f.lower(*diff.values()).as_text()
    check_grads(f, list(diff.values()), order=order, modes=modes, atol=1e-6, rtol=1e-6)


def test_jvp_and_vmap_keep_the_kernel(x64):
    diff, rest, dy = case((2, 80, 80, 2, 2, 3), dict(mask_kind="causal", use_sinks=True), jnp.float64, seed=11)
    tangents = {n: 0.3 * a + 0.1 for n, a in diff.items()}
    fn = lambda d: attention(**d, **rest)
    outs = []
    for fused in (True, False):
        with fused_ops(fused):
            outs.append(jax.jit(lambda p, t: jax.jvp(fn, (p,), (t,)))(diff, tangents))
    close(outs[0][1], outs[1][1], rtol=1e-9, atol=1e-10)
    # vmap over a leading axis of q, k, v and the segment ids: folded into the kernel's batch
    qs2 = jnp.stack([rest["q_segment_ids"], doc_ids(2, 80, 12, max_len=20)])
    q2, k2, v2 = (jnp.stack([diff[n], -diff[n]]) for n in ("q", "k", "v"))
    g = lambda q, k, v, ids: attention(q, k, v, mask_kind="causal", q_segment_ids=ids, kv_segment_ids=ids)
    assert SEG_FWD in hlo_text(jax.vmap(g), q2, k2, v2, qs2)
    got = jax.jit(jax.vmap(g))(q2, k2, v2, qs2)
    for i in range(2):
        with fused_ops(False):
            close(got[i], jax.jit(g)(q2[i], k2[i], v2[i], qs2[i]), rtol=1e-10, atol=1e-11)


def test_f32_gradients_are_deterministic():
    """Two runs give the same bits (one (batch, kv head) pair: the backward splits the keys
    into chunks whose dq partial sums are added in a fixed order)."""
    diff, rest, dy = case((1, 300, 300, 2, 1, 8), dict(mask_kind="causal"), jnp.float32, seed=13, max_len=90)
    f = jax.jit(jax.grad(lambda d: jnp.sum(attention(**d, **rest) * dy)))
    first, second = f(diff), f(diff)
    for name in first:
        assert np.array_equal(np.asarray(first[name]), np.asarray(second[name]))


def _gradient_digest() -> str:
    """SHA-256 of the f32 kernel's output and gradients on a packed batch (the kernel at
    every size, also in a fresh process)."""
    import hashlib

    A.CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES = 0
    diff, rest, dy = case((2, 200, 200, 4, 2, 8), dict(mask_kind="causal", softcap=3.0), jnp.float32, seed=17,
                          max_len=70)
    y, g = jax.jit(jax.value_and_grad(lambda d: jnp.sum(attention(**d, **rest) * dy)))(diff)
    h = hashlib.sha256(np.asarray(y).tobytes())
    for name in sorted(g):
        h.update(np.asarray(g[name]).tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_bits_do_not_depend_on_threads_or_simd_width():
    assert_same_bits_on_one_core_without_avx512(_gradient_digest)


def test_routing_threshold(monkeypatch):
    """Below CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES of [B, H, Sq, Sk] f32 scores the reference
    (plain XLA ops), from there the kernel."""
    diff, rest, _ = case((1, 64, 64, 2, 1, 4), dict(mask_kind="causal"), jnp.float32)
    # a new function per lowering: jit caches by function, and the threshold is read when lowering
    grad = lambda: lambda d: jax.grad(lambda d: jnp.sum(attention(**d, **rest)))(d)
    score_bytes = 1 * 2 * 64 * 64 * 4
    monkeypatch.setattr(A, "CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES", score_bytes + 1)
    assert "rlx_attention" not in hlo_text(grad(), diff)
    monkeypatch.setattr(A, "CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES", score_bytes)
    text = hlo_text(grad(), diff)
    assert SEG_FWD in text and SEG_BWD in text


def test_kernel_rejects_bad_segment_operands():
    q = jnp.zeros((1, 4, 2, 3), jnp.float32)
    k = jnp.zeros((1, 5, 1, 3), jnp.float32)
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 4), jnp.float32))
    call = jax.ffi.ffi_call(f"{SEG_FWD}_v1", out)
    attrs = dict(scale=np.float64(1.0), softcap=np.float64(0.0), mask_kind=np.int64(0), window=np.int64(0),
                 has_mask=np.int64(0), has_bias=np.int64(0))
    dummies = (jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32))
    good_q, good_k = jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 5), jnp.int32)
    jax.block_until_ready(call(q, k, k, *dummies, good_q, good_k, **attrs))
    with pytest.raises(Exception, match="q_segment_ids must be int32"):
        jax.block_until_ready(call(q, k, k, *dummies, good_q.astype(jnp.float32), good_k, **attrs))
    with pytest.raises(Exception, match="kv_segment_ids must be int32"):
        jax.block_until_ready(call(q, k, k, *dummies, good_q, good_q, **attrs))
