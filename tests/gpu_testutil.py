"""What the GPU test files share: the skip marker (no GPU visible to JAX), the GPU
device, and the error measure they compare kernels with references by."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to JAX: the CUDA kernels cannot run here")


def gpu():
    """The first GPU device."""
    return next(d for d in jax.devices() if d.platform == "gpu")


def as_f32(*arrays):
    return [a.astype(jnp.float32) for a in arrays]


def assert_close(got, want, tol: float, what: str, *, scale=None, min_scale: float = 1.0):
    """max |got - want| <= tol * scale, with scale = max(max |want|, min_scale) unless
    given; shapes must agree and got must be finite (an unwritten output shows as
    garbage or NaN)."""
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if got.size == 0:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite values (unwritten output?)"
    scale = scale if scale is not None else max(float(np.max(np.abs(want))), min_scale)
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale, f"{what}: max abs err {err:.3g} > {tol:.1g} * {scale:.3g}"
