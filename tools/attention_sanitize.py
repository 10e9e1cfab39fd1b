"""One attention call on the GPU, small enough for compute-sanitizer:

    compute-sanitizer --tool memcheck python3 tools/attention_sanitize.py D DTYPE KIND PHASE [MASK]

D: head dim; DTYPE: bfloat16 | float16 | float32; KIND: none | causal | sliding;
PHASE: fwd (forward only) | bwd (forward and the fused backward); MASK: 1 adds a key mask.
Prints a checksum so runs can be compared; the correctness checks live in the GPU tests.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from rlx_jax.ops import attention


def main(d: int, dtype: str, kind: str, phase: str, mask: bool) -> None:
    b, s, h = 1, 96, 2
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, dy = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype) for kk in keys)
    m = (jnp.arange(s)[None, :] % 7 != 3).astype(jnp.float32) if mask else None
    opts = dict(mask_kind=kind, window=17 if kind == "sliding" else None, mask=m)
    if phase == "fwd":
        out = jax.jit(lambda q, k, v: attention(q, k, v, **opts))(q, k, v)
        print("fwd checksum", float(jnp.sum(out.astype(jnp.float32))))
        return
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, **opts).astype(jnp.float32) * dy.astype(jnp.float32))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    print("bwd checksums", [float(np.sum(np.asarray(g, np.float32))) for g in grads])


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], len(sys.argv) > 5 and sys.argv[5] == "1")
