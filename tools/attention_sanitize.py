"""One attention call on the GPU, small enough for compute-sanitizer:

    compute-sanitizer --tool memcheck python3 tools/attention_sanitize.py D DTYPE KIND PHASE [MASK [EXTRA]]

D: head dim; DTYPE: bfloat16 | float16 | float32 (f32 runs the generic f32 kernel, which the op
otherwise leaves to XLA on CUDA: rlx_jax.vjp_rules.attention.CUDA_KERNEL_DTYPES); KIND: none | causal | sliding;
PHASE: fwd (forward only) | bwd (forward and the fused backward); MASK: 1 adds a key mask;
EXTRA: softcap | bias (the general score path of the mma.sync kernels; without either they run
their PLAIN specialisation. On sm_90a a softcap, a key mask or mask kind sliding without a bias
runs the wgmma kernels' CAP / MASK forms instead) | segments (packed documents of 1-40 tokens:
the wgmma kernels' segment forms, their tile order and skipped tiles; sm_90a, bf16 / f16, D 64 / 128).
Prints a checksum so runs can be compared; the correctness checks live in the GPU tests.
RLX_ATTN_SANITIZE_S (default 96): the sequence length (e.g. 300: 3 key blocks of 128 and 5 query
tiles of 64, so the fused backward's ordered dQ adds have several contributors per tile).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rlx_jax.ops import attention
from rlx_jax.vjp_rules import attention as attention_rules


def main(d: int, dtype: str, kind: str, phase: str, mask: bool, extra: str = "") -> None:
    attention_rules.CUDNN_FORWARD = False  # our forward kernel, also where cuDNN's would serve
    if jnp.dtype(dtype) == jnp.float32 and jnp.float32 not in attention_rules.CUDA_KERNEL_DTYPES:
        attention_rules.CUDA_KERNEL_DTYPES = attention_rules.CUDA_KERNEL_DTYPES + (jnp.float32,)
    b, s, h = 1, int(os.environ.get("RLX_ATTN_SANITIZE_S", "96")), 2
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v, dy = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype) for kk in keys[:4])
    m = (jnp.arange(s)[None, :] % 7 != 3).astype(jnp.float32) if mask else None
    opts = dict(mask_kind=kind, window=17 if kind == "sliding" else None, mask=m)
    if extra == "softcap":
        opts["softcap"] = 5.0
    elif extra == "bias":
        opts["bias"] = (0.5 * jax.random.normal(keys[4], (b, h, s, s), jnp.float32)).astype(dtype)
    elif extra == "segments":
        ids = jnp.cumsum(jax.random.uniform(keys[4], (b, s)) < 0.05, axis=1).astype(jnp.int32)
        opts.update(q_segment_ids=ids, kv_segment_ids=ids)
    elif extra:
        raise SystemExit(f"EXTRA must be softcap, bias or segments, got {extra!r}")
    if phase == "fwd":
        out = jax.jit(lambda q, k, v: attention(q, k, v, **opts))(q, k, v)
        print("fwd checksum", float(jnp.sum(out.astype(jnp.float32))))
        return
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, **opts).astype(jnp.float32) * dy.astype(jnp.float32))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    print("bwd checksums", [float(np.sum(np.asarray(g, np.float32))) for g in grads])


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], len(sys.argv) > 5 and sys.argv[5] == "1",
         sys.argv[6] if len(sys.argv) > 6 else "")
