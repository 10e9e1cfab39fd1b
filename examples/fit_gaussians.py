"""Fit 2-D-ish 3-D Gaussians to a procedurally generated target image with optax.

    python examples/fit_gaussians.py            # 2500 Gaussians, 64x64, 300 steps
    RLX_JAX_QUICK=1 python examples/fit_gaussians.py   # 900 Gaussians, 40x40, 60 steps
    python examples/fit_gaussians.py --help     # --steps, --seed, --log-every, --psnr-target

The Gaussians start on a jittered grid in the plane z = 0, seen by a camera at z = -3 whose
field of view just covers [-1, 1]^2; every scene parameter (positions, log-scales,
quaternions, opacity logits, colours, SH band 0-1) is optimised with Adam on the RGB
mean squared error of ``rlx_jax.ops.gaussian_splat_render`` (fused kernels forward and
backward). The script checks that the PSNR rises above ``PSNR_TARGET`` dB (``--psnr-target``)
and exits with an error otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlx_jax.ops import gaussian_splat_render, gaussian_splat_render_meta

QUICK = os.environ.get("RLX_JAX_QUICK") == "1"
SIZE = 40 if QUICK else 64
GRID = 30 if QUICK else 50          # GRID^2 Gaussians
STEPS = 60 if QUICK else 300
PSNR_TARGET = 28.0 if QUICK else 35.0
K = 4                                # SH coefficients (bands 0 and 1)
FOV = 2 * math.degrees(math.atan(1 / 3))
META = gaussian_splat_render_meta([0, 0, -3], [0, 0, 0], [0, 1, 0], FOV, 0.1, 100.0, [0, 0, 0],
                                  width=SIZE, height=SIZE)
RENDER = dict(width=SIZE, height=SIZE, tile_size=16)


def target_image(size: int = SIZE) -> np.ndarray:
    """A smooth procedural picture: coloured rings, a diagonal gradient and a dark disc."""
    y, x = np.mgrid[0:size, 0:size] / (size - 1) * 2 - 1
    r = np.hypot(x - 0.2, y + 0.1)
    img = np.stack([0.5 + 0.45 * np.sin(6 * r), 0.5 + 0.4 * x * y + 0.1 * np.cos(4 * x),
                    0.5 + 0.45 * np.cos(5 * r + 1.0) * (1 - 0.5 * (y + 1) / 2)], -1)
    img[np.hypot(x + 0.45, y - 0.45) < 0.25] *= 0.2
    return np.clip(img, 0, 1).astype(np.float32)


def init_scene(key, grid: int = GRID):
    g = (np.arange(grid) + 0.5) / grid * 2 - 1
    xy = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
    n = xy.shape[0]
    k1, k2 = jax.random.split(key)
    pos = jnp.concatenate([jnp.asarray(xy, jnp.float32) + 0.3 / grid * jax.random.normal(k1, (n, 2)),
                           0.01 * jax.random.normal(k2, (n, 1))], 1)
    return {"positions": pos, "scales": jnp.full((n, 3), math.log(1.0 / grid), jnp.float32),
            "rotations": jnp.tile(jnp.asarray([0.0, 0.0, 0.0, 1.0], jnp.float32), (n, 1)),
            "opacities": jnp.zeros((n,), jnp.float32), "colors": jnp.full((n, 3), 0.5, jnp.float32),
            "sh_coeffs": jnp.zeros((n, K, 3), jnp.float32)}


def render(scene):
    img = gaussian_splat_render(scene["positions"], scene["scales"], scene["rotations"], scene["opacities"],
                                scene["colors"], scene["sh_coeffs"], META, **RENDER)
    return img.reshape(SIZE, SIZE, 4)


def psnr(mse):
    return -10.0 * jnp.log10(mse)


def fit(steps: int = STEPS, seed: int = 0, log_every: int = 20):
    target = jnp.asarray(target_image())
    scene = init_scene(jax.random.PRNGKey(seed))
    lrs = {"positions": 2e-3, "scales": 1e-2, "rotations": 1e-2, "opacities": 5e-2, "colors": 2e-2,
           "sh_coeffs": 1e-2}
    opt = optax.multi_transform({k: optax.adam(v) for k, v in lrs.items()}, {k: k for k in scene})
    state = opt.init(scene)

    def loss_fn(s):
        return jnp.mean((render(s)[..., :3] - target) ** 2)

    @jax.jit
    def step(s, st):
        loss, g = jax.value_and_grad(loss_fn)(s)
        upd, st = opt.update(g, st, s)
        return optax.apply_updates(s, upd), st, loss

    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        scene, state, loss = step(scene, state)
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:4d}  mse {losses[-1]:.5f}  psnr {float(psnr(loss)):.2f} dB  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    final = float(psnr(loss_fn(scene)))
    return scene, np.asarray(losses), final, np.asarray(target)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS, help=f"Adam steps (default {STEPS})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial jitter (default 0)")
    ap.add_argument("--log-every", type=int, default=20, help="print every N steps, 0: only the result (default 20)")
    ap.add_argument("--psnr-target", type=float, default=PSNR_TARGET,
                    help=f"the PSNR in dB the fit must exceed (default {PSNR_TARGET})")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be positive")
    if a.seed < 0:
        ap.error("--seed must be >= 0")
    if a.log_every < 0:
        ap.error("--log-every must be >= 0")
    print(f"fitting {GRID * GRID} Gaussians to a {SIZE}x{SIZE} target, {a.steps} steps")
    scene, losses, final, _ = fit(a.steps, a.seed, a.log_every)
    start = float(psnr(losses[0]))
    print(f"PSNR {start:.2f} dB -> {final:.2f} dB (target > {a.psnr_target} dB)")
    if not final > a.psnr_target:
        raise SystemExit(f"PSNR {final:.2f} dB did not reach {a.psnr_target} dB")
    return {"psnr": final, "losses": losses}


if __name__ == "__main__":
    main()
