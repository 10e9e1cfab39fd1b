"""Small JAX program running the CUDA RMSNorm kernels through XLA, for compute-sanitizer:
    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck python3 ffi/cuda/tools/sanitize_rms_norm.py
(the platform allocator gives every buffer its own cudaMalloc, so out-of-bounds accesses
are not hidden inside XLA's memory pool)."""

import jax
import jax.numpy as jnp
import numpy as np

import rlx_jax
from rlx_jax.ops import rms_norm

assert rlx_jax.kernel_info()["cuda"]["loaded"], rlx_jax.kernel_info()["cuda"]
f = jax.jit(lambda x, g, b, dy: jax.vjp(rms_norm, x, g, b)[1](dy))
for shape in [(37, 64), (5, 999), (33, 4096), (3, 12288), (0, 256)]:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        k = jax.random.split(jax.random.PRNGKey(shape[-1]), 3)
        x = jax.random.normal(k[0], shape, jnp.float32).astype(dtype)
        g = jax.random.normal(k[1], shape[-1:], jnp.float32).astype(dtype)
        dy = jax.random.normal(k[2], shape, jnp.float32).astype(dtype)
        y = jax.jit(rms_norm)(x, g, g)
        dx, dg, db = f(x, g, g, dy)
        for a in (y, dx, dg, db):
            assert np.isfinite(np.asarray(a, np.float32)).all(), (shape, dtype)
        print("ok", shape, jnp.dtype(dtype).name, flush=True)
print("sanitize script done")
