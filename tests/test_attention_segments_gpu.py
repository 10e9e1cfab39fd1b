"""Segment ids and sinks on the GPU: the CUDA kernels apply the sinks in their forward's
epilogue (the wgmma kernels at bf16 D 64 / 128, the mma.sync kernel with a bias, the generic
kernel in f32), and the backward runs on that (out, lse); segment ids run the Hopper kernels' segment forms at bf16
/ f16 (head dims 64, 128) and plain XLA ops in f32; values and gradients against the dense
oracle of tests/test_attention_segments.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx_jax.ops import attention

from gpu_testutil import as_f32, assert_close, gpu, requires_gpu
from attention_reference import dense_attention as dense_oracle
from test_attention_segments import packed_ids

pytestmark = requires_gpu


def _inputs(b, s, h, hkv, d, dtype, seed=0):
    r = np.random.default_rng(seed)
    put = lambda *shape: jax.device_put(jnp.asarray(r.standard_normal(shape), jnp.float32).astype(dtype), gpu())
    return put(b, s, h, d), put(b, s, hkv, d), put(b, s, hkv, d), put(h), put(b, s, h, d)


# head dims 64 and 128 in bf16 take the wgmma kernels (forward and fused backward); f32 the generic ones
@pytest.mark.parametrize("dtype,d,kind", [(jnp.bfloat16, 64, "causal"), (jnp.bfloat16, 128, "none"),
                                          (jnp.float32, 32, "sliding")], ids=str)
@pytest.mark.parametrize("segments", [False, True], ids=["sinks", "sinks+segments"])
def test_sinks_and_segments_on_gpu_match_oracle(dtype, d, kind, segments, monkeypatch):
    # f32 attention runs XLA's code on CUDA by default; route it to the generic f32 kernel here
    from rlx_jax.vjp_rules import attention as attention_rules

    monkeypatch.setattr(attention_rules, "CUDA_KERNEL_DTYPES", (*attention_rules.CUDA_KERNEL_DTYPES, jnp.float32))
    b, s, h, hkv = 2, 193, 4, 2
    q, k, v, sinks, dy = _inputs(b, s, h, hkv, d, dtype)
    kw = dict(mask_kind=kind, window=17 if kind == "sliding" else None)
    if segments:
        ids = jax.device_put(packed_ids(b, s, 3, max_len=40), gpu())
        kw.update(q_segment_ids=ids, kv_segment_ids=ids)

    def run(fn):
        @jax.jit
        def go(q, k, v, s, dy):
            y, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, sinks=s, **kw), q, k, v, s)
            return y, vjp(dy)

        return go(q, k, v, sinks, dy)

    # f32 dots in full f32, not TF32, on both sides: the oracle's, and the XLA ops that serve
    # segment ids on CUDA (they follow JAX's matmul precision, TF32 by default)
    with jax.default_matmul_precision("highest"):
        y, grads = run(attention)
        y_ref, grads_ref = run(lambda q, k, v, **kw: dense_oracle(*as_f32(q, k, v), **kw).astype(q.dtype))
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    assert_close(y, y_ref, tol, "out")
    for name, g, gr in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        assert_close(g, gr, 4 * tol, name)
    hlo = jax.jit(lambda q, k, v: attention(q, k, v, sinks=sinks, **kw)).lower(q, k, v).as_text()
    # segment ids: the Hopper kernels' segment target at bf16 (D 64, 128), the reference in f32
    assert ("rlx_attention_fwd" in hlo) != segments
    assert ("rlx_attention_segments_fwd" in hlo) == (segments and dtype == jnp.bfloat16)


@pytest.mark.parametrize("sink_scale", [1.0, 40.0], ids=["sinks", "large-sinks"])
def test_sinks_with_a_bias_on_gpu_match_oracle(sink_scale):
    """A bias takes the mma.sync kernel (bf16, D 64): its epilogue applies the sinks too; sinks
    far above the scores (the sink takes nearly all of a row) do not overflow."""
    b, s, h, hkv, d = 2, 161, 4, 2, 64
    q, k, v, sinks, dy = _inputs(b, s, h, hkv, d, jnp.bfloat16, seed=3)
    sinks = sinks * sink_scale
    bias = jax.device_put(0.5 * jax.random.normal(jax.random.key(1), (b, h, s, s), jnp.float32), gpu())
    bias = bias.astype(jnp.bfloat16)

    def run(fn):
        @jax.jit
        def go(q, k, v, sn, bb, dy):
            y, vjp = jax.vjp(lambda q, k, v, sn, bb: fn(q, k, v, sinks=sn, bias=bb, mask_kind="causal"),
                             q, k, v, sn, bb)
            return y, vjp(dy)

        return go(q, k, v, sinks, bias, dy)

    with jax.default_matmul_precision("highest"):
        y, grads = run(attention)
        y_ref, grads_ref = run(lambda q, k, v, **kw: dense_oracle(*as_f32(q, k, v), **kw).astype(q.dtype))
    assert_close(y, y_ref, 2e-2, "out")
    for name, g, gr in zip(("dq", "dk", "dv", "dsinks", "dbias"), grads, grads_ref):
        assert_close(g, gr, 8e-2, name)  # finite too
    hlo = jax.jit(lambda q: attention(q, k, v, sinks=sinks, bias=bias, mask_kind="causal")).lower(q).as_text()
    assert "rlx_attention_fwd" in hlo


def _ids(layout, b, s, seed):
    """[B, S] int32 ids: "packed" documents of lengths 1..300 (non-decreasing, a new layout
    per batch row), "long" documents of 200..700 tokens (tiles inside one document take the
    kernels' unmasked path), "random" ids from {0, 1, 2} in no order (the tile hull covers
    everything: only the per-score test hides)."""
    r = np.random.default_rng(seed)
    if layout == "random":
        return jnp.asarray(r.integers(0, 3, size=(b, s)), jnp.int32)
    lo, hi = (1, 300) if layout == "packed" else (200, 700)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < s:
            ids += [doc] * int(r.integers(lo, hi + 1))
            doc += 1
        rows.append(ids[:s])
    return jnp.asarray(np.array(rows, np.int32))


# (D, mask kind, softcap, key mask, layout, Sq, Sk, H, Hkv): head dims 64 and 128 (the fused
# backward's two tile heights), every mask form, GQA, odd lengths, Sq != Sk
SEGMENT_CASES = [
    (64, "causal", None, False, "packed", 1000, 1000, 4, 2),
    (128, "causal", None, False, "packed", 1000, 1000, 4, 2),
    (128, "none", None, False, "packed", 777, 777, 2, 2),
    (64, "none", None, True, "long", 901, 901, 4, 1),
    (128, "sliding", None, False, "long", 1100, 1100, 2, 1),
    (64, "sliding", 20.0, False, "packed", 700, 700, 4, 4),
    (128, "causal", 30.0, True, "packed", 640, 640, 4, 2),
    (64, "causal", None, False, "random", 333, 333, 2, 1),
    (128, "none", None, False, "random", 300, 529, 4, 2),
    (64, "causal", None, False, "long", 450, 1200, 2, 2),
]


@pytest.mark.parametrize("d,kind,softcap,key_mask,layout,sq,sk,h,hkv", SEGMENT_CASES, ids=str)
def test_segment_kernels_match_oracle(d, kind, softcap, key_mask, layout, sq, sk, h, hkv):
    """The Hopper kernels' segment forms (forward, fused backward) against the dense f32 oracle:
    values and gradients, and bitwise the same gradients on a second call (deterministic)."""
    from rlx_jax.vjp_rules.attention import cuda_segments_served

    b, dtype = 2, jnp.bfloat16
    r = np.random.default_rng(d + sq + sk)
    put = lambda *shape: jax.device_put(jnp.asarray(r.standard_normal(shape), jnp.float32).astype(dtype), gpu())
    q, k, v, dy = put(b, sq, h, d), put(b, sk, hkv, d), put(b, sk, hkv, d), put(b, sq, h, d)
    if not cuda_segments_served(q, k, has_bias=False, scale=1.0):
        pytest.skip("the segment kernels need a compute capability 9.0 GPU")
    qid = _ids(layout, b, sq, 1)
    # kv ids: the same documents over the longer sequence (Sq != Sk: queries are the last Sq
    # positions, bottom-right aligned)
    kid = _ids(layout, b, sk, 1) if sq == sk else jnp.concatenate(
        [jnp.full((b, sk - sq), -1, jnp.int32), qid], axis=1) if sk > sq else _ids(layout, b, sk, 2)
    kw = dict(mask_kind=kind, window=150 if kind == "sliding" else None, softcap=softcap,
              q_segment_ids=qid, kv_segment_ids=kid)
    if key_mask:
        kw["mask"] = jnp.asarray(r.uniform(size=(b, sk)) > 0.2, jnp.float32)

    def run(fn):
        @jax.jit
        def go(q, k, v, dy):
            y, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
            return y, vjp(dy)

        return go(q, k, v, dy)

    hlo = jax.jit(lambda q, k, v: attention(q, k, v, **kw)).lower(q, k, v).as_text()
    assert "rlx_attention_segments_fwd" in hlo
    y, grads = run(attention)
    y2, grads2 = run(attention)
    with jax.default_matmul_precision("highest"):
        y_ref, grads_ref = run(lambda q, k, v, **kw: dense_oracle(*as_f32(q, k, v), **kw).astype(q.dtype))
    assert_close(y, y_ref, 2e-2, "out")
    for name, g, gr, g2 in zip(("dq", "dk", "dv"), grads, grads_ref, grads2):
        assert_close(g, gr, 4e-2, name)
        assert np.array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(g2.astype(jnp.float32))), name
    # rows whose document has no key (Sq != Sk with other ids) are exactly 0
    vis = np.asarray(qid)[:, :, None] == np.asarray(kid)[:, None, :]
    dead = ~vis.any(-1)
    if dead.any():
        assert not np.asarray(y.astype(jnp.float32))[dead].any()
