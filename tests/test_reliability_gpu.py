"""Reliability on the GPU (issue 11): determinism of every CUDA kernel and 64-bit index
arithmetic on a tensor of more than 2^31 elements. Skipped where JAX sees no GPU or
the CUDA kernels are not built.

Determinism reuses the CPU suite's cases (tests/test_reliability_determinism.py): the
same computations, run on the default device (the GPU), must give bitwise-identical
values and gradients on repeated runs and after recompiling. A case whose kernels are
not registered on CUDA runs as XLA's own code and is skipped with that reason (XLA's
GPU reductions are not ours to promise)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
import test_reliability_determinism as det
from rlx_jax.ops import rms_norm
from rlx_jax.vjp_rules.rms_norm import reference_rms_norm, reference_rms_norm_bwd

from gpu_testutil import requires_gpu
from testutil import current_targets

pytestmark = requires_gpu


def _cuda_targets() -> set[str]:
    info = rlx_jax.kernel_info()["cuda"]
    if not info["loaded"]:
        pytest.skip(f"CUDA kernels not loaded: {info['error']}")
    return set(info["targets"])


def test_every_cuda_target_has_a_determinism_case():
    covered = {t for targets, *_ in det._cases().values() for t in targets}
    covered |= {t for targets in _CUDA_CASE_TARGETS.values() for t in targets}
    missing = current_targets(_cuda_targets()) - covered
    assert not missing, f"CUDA targets without a determinism case: {sorted(missing)}"


#: cases whose computation CUDA leaves to XLA by design, with the case that covers the kernels
_XLA_ON_CUDA = {
    "attention_segments": "segment ids at f32 and head dim 32 run the reference on CUDA "
                          "(cuda_segments_served); attention_segments_bf16 runs the segment kernels",
}


#: cases part of whose computation CUDA leaves to XLA by design: the targets it runs there
_CUDA_CASE_TARGETS = {
    "add_rms_norm": ("rlx_add_rms_norm_bwd_v1",),  # the forward is XLA's fused add + norm on CUDA
    # the backward's y from the norm's backward kernel, not from the forward kernel run again
    "rms_norm_linear": ("rlx_rms_norm_fwd_v2", "rlx_rms_norm_bwd_y_v1"),
    "add_rms_norm_linear": ("rlx_add_rms_norm_bwd_y_v1",),
}


@pytest.mark.parametrize("name", sorted(det._cases()))
def test_gpu_bitwise_identical_on_repeated_runs(name, monkeypatch):
    if name in _XLA_ON_CUDA:
        pytest.skip(_XLA_ON_CUDA[name])
    # the cases are f32, which attention leaves to XLA on CUDA: route it to the f32 kernel here
    from rlx_jax.vjp_rules import attention as attention_rules

    monkeypatch.setattr(attention_rules, "CUDA_KERNEL_DTYPES", (*attention_rules.CUDA_KERNEL_DTYPES, jnp.float32))
    targets, fn, args, argnums = det._cases()[name]
    targets = _CUDA_CASE_TARGETS.get(name, targets)
    cuda = _cuda_targets()
    if not targets or not set(targets) <= cuda:
        pytest.skip(f"{name}: no CUDA kernel for {sorted(set(targets) - cuda) or 'it'} (XLA's own code)")
    run = det._runner(fn, argnums)
    text = run.lower(*args).as_text()
    for t in targets:
        assert t in text, f"{t} not in the lowered HLO of {name} on GPU (silent fallback)"
    first = det._digest(run(*args))
    for _ in range(3):
        assert det._digest(run(*args)) == first, f"{name}: GPU results differ between runs"
    assert det._digest(det._runner(fn, argnums)(*args)) == first, f"{name}: GPU results differ after recompiling"


def _gpu_free_bytes() -> int:
    stats = next(d for d in jax.devices() if d.platform == "gpu").memory_stats() or {}
    return int(stats.get("bytes_limit", 0)) - int(stats.get("bytes_in_use", 0))


def test_rms_norm_over_two_to_the_31_elements():
    """x [R, 4096] bf16 with R * 4096 = 2^31 + 4096 elements: an int32 flat index wraps
    in the last row, so the last rows are compared with the reference computed on those
    rows alone (and the first rows, as a control). Forward, dx, and dgamma/dbeta, which
    sum over every row (checked against the f32 reference of the full sums)."""
    _cuda_targets()
    width, rows = 4096, (1 << 31) // 4096 + 1
    need = 7 * rows * width * 2  # x, dy, y, dx in bf16 + XLA temporaries
    if _gpu_free_bytes() < need:
        pytest.skip(f"needs ~{need / 2**30:.0f} GiB of free GPU memory")
    assert rows * width > 2**31
    dt = jnp.bfloat16
    # cheap deterministic data without a big f32 intermediate: a per-row and a per-column pattern
    row = jnp.arange(rows, dtype=jnp.float32)[:, None]
    col = jnp.arange(width, dtype=jnp.float32)[None, :]
    make_x = jax.jit(lambda: jnp.sin(0.37 * row + 0.11 * col).astype(dt))
    make_dy = jax.jit(lambda: jnp.cos(0.23 * row - 0.05 * col).astype(dt))
    x, dy = make_x(), make_dy()
    g = (1.0 + 0.1 * jnp.cos(jnp.arange(width, dtype=jnp.float32))).astype(dt)
    b = (0.01 * jnp.arange(width, dtype=jnp.float32) / width).astype(dt)

    def fwd_bwd(x, g, b, dy):
        y, pull = jax.vjp(lambda x, g, b: rms_norm(x, g, b), x, g, b)
        return (y,) + pull(dy)

    f = jax.jit(fwd_bwd)
    assert "rlx_rms_norm" in f.lower(x, g, b, dy).as_text()
    y, dx, dg, db = f(x, g, b, dy)
    del x
    f32 = lambda a: a.astype(jnp.float32)
    gf, bf = f32(g), f32(b)
    for sl in (slice(0, 4), slice(rows - 4, rows)):
        xs, dys = f32(make_x()[sl]), f32(dy[sl])
        want_y, rstd = reference_rms_norm(xs, gf, bf, eps=1e-6)
        want_dx = reference_rms_norm_bwd(xs, gf, rstd, dys, eps=1e-6)[0]
        np.testing.assert_allclose(np.asarray(f32(y[sl])), np.asarray(want_y), atol=3e-2, rtol=2e-2)
        np.testing.assert_allclose(np.asarray(f32(dx[sl])), np.asarray(want_dx), atol=3e-2, rtol=2e-2)
    # dgamma = sum_rows dy * x * rstd, dbeta = sum_rows dy: f32 references over all rows
    # (XLA fuses convert, multiply and reduce; nothing of the full size in f32 is kept)
    want_dg, want_db = jax.jit(lambda x, dy: (
        jnp.sum(f32(dy) * f32(x) * jax.lax.rsqrt(jnp.mean(f32(x) ** 2, axis=-1, keepdims=True) + 1e-6), axis=0),
        jnp.sum(f32(dy), axis=0)))(make_x(), dy)
    for got, want, what in ((dg, want_dg, "dgamma"), (db, want_db, "dbeta")):
        scale = float(jnp.max(jnp.abs(want))) + 1.0
        err = float(jnp.max(jnp.abs(f32(got) - want)))
        assert err <= 2e-2 * scale, f"{what}: max abs err {err:.3g} vs scale {scale:.3g}"
