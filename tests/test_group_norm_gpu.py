"""GroupNorm on the GPU: the CUDA kernels (rlx_group_norm_fwd / rlx_group_norm_bwd on
platform CUDA) against the f32 reference on random data. Skipped where JAX sees no GPU.

Shapes cover the vector path (spatial size a multiple of 16 bytes), the scalar path
(odd spatial sizes), one channel per group and one group, no spatial axes, a large
image, and zero-sized batches / spatial axes.

The single-pass cluster path (group_norm.cu: one thread-block cluster per (n, g) block,
the block kept in shared memory) takes every case whose spatial size is a multiple of 16
bytes and whose block fits 16 CTAs' budget (32 KB each); CLUSTER_CASES sit around its
limits (clusters of 1..16 CTAs, channels split into segments across CTAs, blocks just over
the limit and far over it: the two-pass path's vector kernels); the odd spatial sizes of
CASES take the two-pass path's scalar kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import as_f32, assert_close, gpu, requires_gpu
from rlx_jax.ops import group_norm
from rlx_jax.vjp_rules.group_norm import (
    cuda_bwd_scratch_size,
    group_norm_backward,
    group_norm_bwd,
    group_norm_fwd,
    reference_group_norm,
    reference_group_norm_bwd,
)

pytestmark = requires_gpu

EPS = 1e-5
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 3e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


_gpu = gpu


def _inputs(shape, dtype, seed):
    kx, kg, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    c = shape[1]
    x = (0.7 + 1.5 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(kg, (c,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(kb, (c,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return [jax.device_put(a, _gpu()) for a in (x, g, b, dy)]


def _close(got, want, dtype, what):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what)


_f32 = as_f32


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_group_norm_fwd_v1", "rlx_group_norm_fwd_v2", "rlx_group_norm_bwd_v1"} <= set(info["targets"])
    x, g, b, dy = _inputs((2, 8, 4, 4), jnp.float32, 0)
    fn = jax.jit(lambda x, g, b, dy: jax.vjp(lambda *a: group_norm(*a, num_groups=4), x, g, b)[1](dy))
    text = fn.lower(x, g, b, dy).as_text()
    assert "rlx_group_norm_fwd" in text and "rlx_group_norm_bwd" in text
    assert f"tensor<{cuda_bwd_scratch_size(2, 8, 4)}xf32>" in text


CASES = [
    ((2, 8, 4, 4), 4),
    ((3, 6, 5, 7), 3),  # odd spatial size: scalar path
    ((4, 32, 16, 16), 32),  # one channel per group
    ((2, 16, 9, 9), 1),  # one group
    ((5, 12), 4),  # no spatial axes
    ((2, 64, 64, 64), 8),  # a larger image
    ((0, 8, 4, 4), 2),  # zero batch
    ((2, 8, 0, 4), 2),  # zero spatial size
]

# Around the cluster path's limits at the default 32 KB per CTA (f32 backward: 8 bytes a
# value, so M <= 4 Ki values is one CTA, 64 Ki values a cluster of 16 CTAs).
CLUSTER_CASES = [
    ((2, 6, 41, 100), 2),  # K = 3, S = 4100: f32 bwd 4 CTAs, channels split across them, short last segments
    ((1, 6, 64, 96), 2),  # K = 3, S = 6144: f32 fwd 4 CTAs, bwd 8 CTAs (P = 8 segments a channel)
    ((2, 4, 128, 128), 4),  # one channel a group, S = 16384: each channel split in 4 (f32 bwd)
    ((1, 4, 128, 128), 1),  # M = 65536: f32 bwd exactly 16 CTAs of 32 KB (the limit)
    ((1, 4, 256, 128), 1),  # M = 131072: f32 bwd over the limit (two-pass), f32 fwd and bf16 bwd at it
    ((1, 2, 256, 512), 1),  # M = 262144: over every limit but the 16-bit forward's
    ((3, 10, 8, 8), 5),  # K = 2, S = 64: one CTA a block
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,groups", CASES + CLUSTER_CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else f"G{c}")
def test_forward_and_backward_match_f32_reference(shape, groups, dtype):
    x, g, b, dy = _inputs(shape, dtype, seed=sum(shape) % 1000)
    y, mean, rstd = jax.jit(lambda *a: group_norm_fwd(*a, num_groups=groups, eps=EPS))(x, g, b)
    y_ref, mean_ref, rstd_ref = jax.jit(lambda *a: reference_group_norm(*a, num_groups=groups, eps=EPS))(
        *_f32(x, g, b))
    assert y.dtype == dtype and mean.dtype == jnp.float32
    _close(y, y_ref, dtype, "y")
    if x.size:
        _close(mean, mean_ref, jnp.float32, "mean")
        _close(rstd, rstd_ref, jnp.float32, "rstd")
    dx, dg, db = jax.jit(lambda *a: group_norm_bwd(*a, num_groups=groups, eps=EPS))(x, g, mean_ref, rstd_ref, dy)
    dx_ref, dg_ref, db_ref = jax.jit(lambda *a: reference_group_norm_bwd(*a, num_groups=groups, eps=EPS))(
        *_f32(x, g), mean_ref, rstd_ref, dy.astype(jnp.float32))
    assert dx.dtype == dtype and dg.dtype == dtype
    _close(dx, dx_ref, dtype, "dx")
    if x.size == 0:  # nothing summed: exact zeros
        np.testing.assert_array_equal(np.asarray(dg, np.float32), 0)
        np.testing.assert_array_equal(np.asarray(db, np.float32), 0)
    else:
        _close(dg, dg_ref, dtype, "dgamma")
        _close(db, db_ref, dtype, "dbeta")


def test_grad_through_custom_vjp_and_determinism():
    x, g, b, dy = _inputs((4, 64, 32, 32), jnp.float32, seed=5)
    f = jax.jit(lambda x, g, b, dy: jax.vjp(lambda *a: group_norm(*a, num_groups=16, eps=EPS), x, g, b)[1](dy))
    got = f(x, g, b, dy)
    want = jax.vjp(lambda *a: reference_group_norm(*a, num_groups=16, eps=EPS)[0], x, g, b)[1](dy)
    for a, w, what in zip(got, want, ("dx", "dgamma", "dbeta")):
        _close(a, w, jnp.float32, what)
    again = f(x, g, b, dy)
    for a, c in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_bad_scratch_is_an_error_not_a_crash():
    x, g, b, dy = _inputs((2, 8, 4, 4), jnp.float32, seed=4)
    mean, rstd = jnp.zeros((2, 4), jnp.float32), jnp.ones((2, 4), jnp.float32)
    p = jax.ShapeDtypeStruct(g.shape, g.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p, jax.ShapeDtypeStruct((3,), jnp.float32))
    call = jax.ffi.ffi_call("rlx_group_norm_bwd_v1", out)
    with pytest.raises(Exception, match="scratch"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, num_groups=np.int64(4)))(x, g, mean, rstd, dy))


def _grads_vs_reference(shape, groups, dtype, seed):
    """jax.vjp through the public op and through group_norm_backward vs the f32 reference."""
    x, g, b, dy = _inputs(shape, dtype, seed)
    ours = jax.jit(lambda x, g, b, dy: jax.vjp(lambda *a: group_norm(*a, num_groups=groups, eps=EPS), x, g, b)[1](dy))
    want = jax.jit(lambda x, g, b, dy: jax.vjp(
        lambda *a: reference_group_norm(*a, num_groups=groups, eps=EPS)[0], x, g, b)[1](dy))(*_f32(x, g, b, dy))
    for a, w, what in zip(ours(x, g, b, dy), want, ("dx", "dgamma", "dbeta")):
        _close(a, w, dtype, what)
    wrap = jax.jit(lambda x, g, b, dy: group_norm_backward(x, g, b, dy, num_groups=groups, eps=EPS))(x, g, b, dy)
    for a, w, what in zip(wrap, want, ("dx", "dgamma", "dbeta")):
        _close(a, w, dtype, "group_norm_backward " + what)
    text = jax.jit(lambda x, g, b, dy: group_norm_backward(x, g, b, dy, num_groups=groups, eps=EPS)).lower(
        x, g, b, dy).as_text()
    assert "rlx_group_norm_bwd" in text


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,groups", [((1, 6, 64, 96), 2), ((2, 8, 4, 4), 4), ((64, 64, 8, 8), 32)],
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else f"G{c}")
def test_cluster_sanitizer_small(shape, groups, dtype):
    """Small cluster-path cases (multi-CTA clusters with split channels, and one-CTA
    blocks), fwd and both gradient routes: the cases compute-sanitizer runs. 64x64x8x8 G32:
    2048 one-CTA clusters, more than an H200 holds at once (later clusters start as earlier
    ones leave)."""
    _grads_vs_reference(shape, groups, dtype, seed=11)


def test_forward_blocks_have_their_own_statistics():
    """Every (n, g) block with its own mean and scale (a statistic taken from another
    block fails), 768 blocks; y, mean, rstd and the gradients vs the f32 reference."""
    n, c, groups = 96, 32, 8
    x, g, b, dy = _inputs((n, c, 16, 16), jnp.float32, seed=17)
    blk = jnp.arange(n * groups, dtype=jnp.float32).reshape(n, groups)
    shift = jnp.repeat(jnp.sin(blk) * 30.0, c // groups, axis=1)[:, :, None, None]
    scale = jnp.repeat(1.0 + (blk % 7), c // groups, axis=1)[:, :, None, None]
    x = jax.device_put(x * scale + shift, _gpu())
    y, mean, rstd = jax.jit(lambda *a: group_norm_fwd(*a, num_groups=groups, eps=EPS))(x, g, b)
    y_ref, mean_ref, rstd_ref = reference_group_norm(x, g, b, num_groups=groups, eps=EPS)
    _close(y, y_ref, jnp.float32, "y")
    _close(mean, mean_ref, jnp.float32, "mean")
    _close(rstd / rstd_ref, jnp.ones_like(rstd_ref), jnp.float32, "rstd / rstd_ref")
    _grads_vs_reference((n, c, 16, 16), groups, jnp.float32, seed=17)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_vmap_over_a_batch_of_images(dtype):
    x, g, b, dy = _inputs((6, 6, 32, 32), dtype, seed=3)
    x5, dy5 = x.reshape(3, 2, 6, 32, 32), dy.reshape(3, 2, 6, 32, 32)

    def f(op):
        return jax.jit(lambda x, g, b, dy: jax.vjp(jax.vmap(lambda xi: op(xi, g, b)), x)[1](dy)[0])

    got = f(lambda xi, g, b: group_norm(xi, g, b, num_groups=3, eps=EPS))(x5, g, b, dy5)
    want = f(lambda xi, g, b: reference_group_norm(xi, g, b, num_groups=3, eps=EPS)[0])(*_f32(x5, g, b, dy5))
    _close(got, want, dtype, "vmap dx")


@pytest.mark.parametrize("shape,groups", [((2, 4, 128, 128), 1), ((2, 6, 41, 100), 2), ((3, 64, 32, 32), 4)],
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else f"G{c}")
def test_cluster_determinism(shape, groups):
    """Multi-CTA clusters (16 CTAs with each channel split in 4; 4 CTAs with channels split
    unevenly; 8 CTAs of two channels each): the exchanged sums are added in a fixed order, so
    two runs give the same bits (forward and backward, f32 and bf16)."""
    for dtype in (jnp.float32, jnp.bfloat16):
        x, g, b, dy = _inputs(shape, dtype, seed=23)

        def step(x, g, b, dy):
            y, vjp = jax.vjp(lambda *a: group_norm(*a, num_groups=groups, eps=EPS), x, g, b)
            return (y, *vjp(dy))

        f = jax.jit(step)

        def run():
            return [np.asarray(a.astype(jnp.float32)) for a in f(x, g, b, dy)]
        first, second = run(), run()
        for a, c in zip(first, second):
            np.testing.assert_array_equal(a, c)
