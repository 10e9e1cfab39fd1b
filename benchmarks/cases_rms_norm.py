"""RMSNorm: ours vs XLA's autodiff of the reference, two cases per size.

- ``rms_norm_fwd+bwd``: what a training step runs, y and (dx, dgamma) from x and dy.
  Floor: forward reads x and writes y, backward reads x and dy and writes dx: 5 N H
  elements (gamma, dgamma, dbeta are O(H)).
- ``rms_norm_bwd_only``: the backward given the saved rstd. Floor: 3 N H elements.
- ``add_rms_norm_fwd+bwd``: the residual add + RMSNorm of a pre-norm block, (s, y) from
  (x, residual) and the gradients from (ds, dy), against XLA's autodiff of ``x + r`` and
  the reference norm. Floor: forward reads x and r and writes s and y, backward reads s,
  dy and ds and writes dx (the residual's gradient is the same array): 8 N H elements.
- ``add_rms_norm_fwd`` / ``add_rms_norm_bwd_only``: the two halves of that case apart, as a
  step runs them (floors 4 N H each; the backward's reads s, dy, ds and writes dx).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from rlx_jax.ops import add_rms_norm, rms_norm
from rlx_jax.vjp_rules.rms_norm import reference_rms_norm

EPS = 1e-6


def _case(n: int, h: int, dtype) -> Case:
    def make(key):
        kx, kg, kd = jax.random.split(key, 3)
        x = jax.random.normal(kx, (n, h), jnp.float32).astype(dtype)
        g = (1.0 + 0.1 * jax.random.normal(kg, (h,), jnp.float32)).astype(dtype)
        dy = jax.random.normal(kd, (n, h), jnp.float32).astype(dtype)
        return x, g, dy

    def ours(x, g, dy):
        y, vjp = jax.vjp(lambda x, g: rms_norm(x, g, eps=EPS), x, g)
        return (y, *vjp(dy))

    def xla(x, g, dy):
        beta = jnp.zeros_like(g)
        y, vjp = jax.vjp(lambda x, g: reference_rms_norm(x, g, beta, eps=EPS)[0], x, g)
        return (y, *vjp(dy))

    itemsize = jnp.dtype(dtype).itemsize
    return Case(
        name=f"rms_norm_fwd+bwd {jnp.dtype(dtype).name} {n}x{h}",
        make=make,
        ours=ours,
        xla=xla,
        floor_bytes=5 * n * h * itemsize,
    )


def _bwd_only_case(n: int, h: int, dtype) -> Case:
    """The backward kernel alone, given the saved rstd (what a training step's backward
    runs: the forward's y is needed by the next layer anyway), vs XLA's fusion of the
    same maths (reference_rms_norm_bwd) on the same inputs. Floor: x, dy read, dx written,
    rstd read."""
    from rlx_jax.vjp_rules.rms_norm import reference_rms_norm_bwd, rms_norm_bwd

    def make(key):
        kx, kg, kd = jax.random.split(key, 3)
        x = jax.random.normal(kx, (n, h), jnp.float32).astype(dtype)
        g = (1.0 + 0.1 * jax.random.normal(kg, (h,), jnp.float32)).astype(dtype)
        dy = jax.random.normal(kd, (n, h), jnp.float32).astype(dtype)
        rstd = reference_rms_norm(x, g, jnp.zeros_like(g), eps=EPS)[1]
        return x, g, rstd, dy

    itemsize = jnp.dtype(dtype).itemsize
    return Case(
        name=f"rms_norm_bwd_only {jnp.dtype(dtype).name} {n}x{h}",
        make=make,
        ours=lambda x, g, r, dy: rms_norm_bwd(x, g, r, dy, eps=EPS),
        xla=lambda x, g, r, dy: reference_rms_norm_bwd(x, g, r, dy, eps=EPS),
        floor_bytes=3 * n * h * itemsize + 4 * n,
    )


def _add_inputs(key, n: int, h: int, dtype):
    """(x, r, gamma, ds, dy) of an add_rms_norm case: x, r and the two cotangents [n, h]."""
    kx, kr, kg, ks, kd = jax.random.split(key, 5)
    x, r, ds, dy = (jax.random.normal(k, (n, h), jnp.float32).astype(dtype) for k in (kx, kr, ks, kd))
    g = (1.0 + 0.1 * jax.random.normal(kg, (h,), jnp.float32)).astype(dtype)
    return x, r, g, ds, dy


def _add_fused(x, r, g):
    return add_rms_norm(x, r, g, eps=EPS)


def _add_plain(x, r, g):
    """XLA's path: the add, then the reference norm (no beta)."""
    s = x + r
    return s, reference_rms_norm(s, g, jnp.zeros_like(g), eps=EPS)[0]


def _add_case(n: int, h: int, dtype) -> Case:
    def fwd_bwd(f):
        def run(x, r, g, ds, dy):
            out, vjp = jax.vjp(f, x, r, g)
            return (*out, *vjp((ds, dy)))
        return run

    itemsize = jnp.dtype(dtype).itemsize
    return Case(
        name=f"add_rms_norm_fwd+bwd {jnp.dtype(dtype).name} {n}x{h}",
        make=lambda key: _add_inputs(key, n, h, dtype),
        ours=fwd_bwd(_add_fused),
        xla=fwd_bwd(_add_plain),
        floor_bytes=8 * n * h * itemsize,
    )


def _add_part_case(n: int, h: int, dtype, part: str) -> Case:
    """add_rms_norm's forward alone ("fwd": (s, y) from x, r) or its backward alone
    ("bwd": the gradients from each path's own forward residuals, computed beforehand).
    In a training step the backward runs far from the forward, so XLA cannot fuse the two
    as it does in the one-program fwd+bwd case; these are the step's two halves."""
    itemsize = jnp.dtype(dtype).itemsize
    if part == "fwd":
        return Case(name=f"add_rms_norm_fwd {jnp.dtype(dtype).name} {n}x{h}",
                    make=lambda key: _add_inputs(key, n, h, dtype)[:3], ours=_add_fused, xla=_add_plain,
                    floor_bytes=4 * n * h * itemsize)

    def make(key):
        x, r, g, ds, dy = _add_inputs(key, n, h, dtype)
        # the vjp closures hold each path's residuals (s and rstd, or what XLA keeps)
        vjps = [jax.jit(lambda x, r, g, f=f: jax.vjp(f, x, r, g)[1])(x, r, g) for f in (_add_fused, _add_plain)]
        return (*vjps, ds, dy)

    return Case(name=f"add_rms_norm_bwd_only {jnp.dtype(dtype).name} {n}x{h}", make=make,
                ours=lambda vo, vx, ds, dy: vo((ds, dy)), xla=lambda vo, vx, ds, dy: vx((ds, dy)),
                floor_bytes=4 * n * h * itemsize)


def cases(device_kind: str) -> list[Case]:
    if device_kind == "gpu":
        return [
            _case(32768, 4096, jnp.float32),
            _case(32768, 4096, jnp.bfloat16),
            _bwd_only_case(32768, 4096, jnp.float32),
            _bwd_only_case(32768, 4096, jnp.bfloat16),
            _add_case(16384, 2048, jnp.bfloat16),
            _add_case(16384, 2048, jnp.float32),
            *(_add_part_case(16384, 2048, dtype, part) for part in ("fwd", "bwd")
              for dtype in (jnp.bfloat16, jnp.float32)),
        ]
    return [_case(8192, 1024, jnp.float32), _case(8192, 1024, jnp.bfloat16),
            _bwd_only_case(8192, 1024, jnp.float32), _bwd_only_case(8192, 1024, jnp.bfloat16),
            _add_case(8192, 1024, jnp.float32), _add_part_case(8192, 1024, jnp.float32, "fwd"),
            _add_part_case(8192, 1024, jnp.float32, "bwd")]
