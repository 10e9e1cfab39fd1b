"""Segment ids and sinks on the GPU: sinks run over the CUDA kernels' (out, lse) and their
backward's lse cotangent (dlse), segment ids run in plain XLA ops (no kernel call);
values and gradients against the dense oracle of tests/test_attention_segments.py."""

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
    assert ("rlx_attention_fwd" in hlo) != segments
