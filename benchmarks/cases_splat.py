"""Gaussian splatting render forward + backward: ours (fused C++/CUDA kernels) vs XLA's
autodiff of the pure-JAX reference (dense tile-by-tile compositing, checkpointed).

Sizes: on CPU 2000 Gaussians at 96x96 (seconds on a 2-core machine); the issue's case,
100k Gaussians at 512x512, runs on GPU by default and on CPU with RLX_SPLAT_BENCH_LARGE=1
(the XLA reference then needs minutes). Floor: read the scene and dy, write the image
and the scene gradients.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Case
from rlx_jax.ops import gaussian_splat_render, gaussian_splat_render_meta
from rlx_jax.vjp_rules.gaussian_splat import RENDER_DEFAULTS, reference_render

K = 4  # SH coefficients per Gaussian (band 1)


def make_scene(key, n: int, k: int = K, spread: float = 1.5):
    ks = jax.random.split(key, 6)
    pos = jax.random.uniform(ks[0], (n, 3), jnp.float32, -spread, spread) * jnp.asarray([1.0, 1.0, 0.5])
    scales = jnp.log(jax.random.uniform(ks[1], (n, 3), jnp.float32, 0.4, 1.6) * spread / np.cbrt(n) * 1.5)
    rot = jax.random.normal(ks[2], (n, 4), jnp.float32)
    op = jax.random.normal(ks[3], (n,), jnp.float32)
    col = jax.random.uniform(ks[4], (n, 3), jnp.float32)
    sh = 0.1 * jax.random.normal(ks[5], (n, k, 3), jnp.float32)
    return pos, scales, rot, op, col, sh


def _case(n: int, size: int) -> Case:
    meta = gaussian_splat_render_meta([0.0, 0.0, -5.0], [0, 0, 0], [0, 1, 0], 40.0, 0.1, 100.0, [0.0, 0.0, 0.0],
                                      width=size, height=size)
    params = dict(RENDER_DEFAULTS, width=size, height=size, max_list_entries=max(1 << 20, 64 * n))

    def make(key):
        k1, k2 = jax.random.split(key)
        return (*make_scene(k1, n), jax.random.normal(k2, (size * size * 4,), jnp.float32))

    def ours(*args):
        *scene, dy = args
        img, vjp = jax.vjp(lambda *s: gaussian_splat_render(*s, meta, **params), *scene)
        return (img, *vjp(dy))

    def xla(*args):
        *scene, dy = args
        # full f32 matmuls in the reference (XLA's GPU default is TF32-like, which moves
        # the projected centres by ~1e-3 and fails the harness's ours-vs-XLA check)
        with jax.default_matmul_precision("highest"):
            img, vjp = jax.vjp(lambda *s: reference_render(*s, meta, **params)[0], *scene)
            return (img, *vjp(dy))

    scene_floats = n * (14 + 3 * K)
    return Case(name=f"splat_fwd+bwd f32 {n} gaussians {size}x{size}", make=make, ours=ours, xla=xla,
                floor_bytes=4 * (2 * scene_floats + 2 * size * size * 4))


def cases(device_kind: str) -> list[Case]:
    large = device_kind == "gpu" or os.environ.get("RLX_SPLAT_BENCH_LARGE") == "1"
    out = [_case(2000, 96)]
    if large:
        out.append(_case(100_000, 512))
    return out
