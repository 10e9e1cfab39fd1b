"""BatchNorm (inference mode) backward on the GPU: the CUDA kernel
rlx_batch_norm_inference_bwd (dx, and dgamma / dbeta as deterministic two-stage channel
sums) against the f32 reference, on random data. Skipped where JAX sees no GPU.

Shapes cover both work layouts of ffi/cuda/channel_reduce.cuh: planes of S >= 32
elements (row layout; vectorised or scalar, several segments per plane) and S < 32
([N, C] and small spatial sizes: column layout), odd sizes and zero-sized inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import assert_close, gpu, requires_gpu
from rlx_jax.ops import batch_norm_inference
from rlx_jax.vjp_rules.batch_norm import (
    batch_norm_inference_backward,
    batch_norm_inference_bwd,
    cuda_bwd_scratch_size,
    reference_batch_norm_inference,
    reference_batch_norm_inference_bwd,
)

pytestmark = requires_gpu

EPS = 1e-5
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 1e-3}

SHAPES = [
    (8, 16, 7, 7),  # S = 49: scalar row path
    (4, 32, 64),  # S = 64: vectorised row path
    (3, 5, 9001),  # three segments per plane, odd tail
    (33, 999),  # S = 1, odd width: scalar column path
    (300, 1024),  # S = 1, vectorised, several sample chunks
    (37, 6, 5),  # S = 5: column layout with a small trailing axis
    (0, 8, 4, 4),  # no samples: zero parameter gradients
    (4, 0, 3),  # no channels
    (4, 6, 0),  # empty planes
]


def _ids(v):
    return "x".join(map(str, v))


def _inputs(shape, dtype, seed):
    kx, kg, km, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 5)
    c = shape[1]
    dev = gpu()
    x = (0.5 + 2.0 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    g = (1.0 + 0.3 * jax.random.normal(kg, (c,), jnp.float32)).astype(dtype)
    m = (0.5 + 0.2 * jax.random.normal(km, (c,), jnp.float32)).astype(dtype)
    v = jnp.exp(0.5 * jax.random.normal(kv, (c,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return [jax.device_put(a, dev) for a in (x, g, m, v, dy)]


def _f32(*a):
    return [t.astype(jnp.float32) for t in a]


def _check(x, g, m, v, dy, got, dtype):
    dx, dg, db = got
    want = reference_batch_norm_inference_bwd(*_f32(x, g, m, v, dy), eps=EPS)
    tol = TOL[jnp.dtype(dtype).type]
    assert dx.dtype == dtype and dg.dtype == dtype and db.dtype == dtype
    assert_close(dx, want[0], tol, "dx")
    # channel sums: f32 sums in another order, then rounded to the dtype; the error is
    # measured against the sums of the terms' magnitudes
    xf, gf, mf, vf, dyf = _f32(x, g, m, v, dy)
    axes = (0, *range(2, x.ndim))
    bshape = (1, -1) + (1,) * (x.ndim - 2)
    rstd = jax.lax.rsqrt(vf + EPS)
    mag_g = float(jnp.max(rstd * jnp.sum(jnp.abs(dyf * (xf - mf.reshape(bshape))), axis=axes), initial=1.0))
    mag_b = float(jnp.max(jnp.sum(jnp.abs(dyf), axis=axes), initial=1.0))
    assert_close(dg, want[1], max(tol, 2e-6), "dgamma", scale=max(mag_g, 1.0))
    assert_close(db, want[2], max(tol, 2e-6), "dbeta", scale=max(mag_b, 1.0))


def test_cuda_target_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_batch_norm_inference_bwd_v1", "rlx_batch_norm_inference_bwd_v2"} <= set(info["targets"])
    x, g, m, v, dy = _inputs((4, 8, 6, 6), jnp.float32, 0)
    f = jax.jit(lambda *a: jax.vjp(lambda *p: batch_norm_inference(*p, eps=EPS), *a)[1](dy))
    text = f.lower(x, g, jnp.zeros_like(g), m, v).as_text()
    assert "rlx_batch_norm_inference_bwd" in text
    assert f"tensor<{cuda_bwd_scratch_size(x.shape)}xf32>" in text  # the CUDA call's scratch


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_backward_matches_f32_reference(shape, dtype):
    x, g, m, v, dy = _inputs(shape, dtype, seed=sum(shape))
    got = jax.jit(lambda *a: batch_norm_inference_bwd(*a, eps=EPS))(x, g, m, v, dy)
    _check(x, g, m, v, dy, got, dtype)
    if 0 in shape[:1] + shape[2:] and shape[1] > 0:
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), 0)
        np.testing.assert_array_equal(np.asarray(got[2], np.float32), 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(6, 12, 9, 7), (50, 40)], ids=_ids)
def test_grads_of_all_inputs_through_public_op(shape, dtype):
    x, g, m, v, dy = _inputs(shape, dtype, seed=5)
    b = jnp.zeros_like(g)
    f = jax.jit(lambda x, g, b, m, v, dy: jax.vjp(lambda *p: batch_norm_inference(*p, eps=EPS), x, g, b, m, v)[1](dy))
    got = f(x, g, b, m, v, dy)
    ref = lambda *p: reference_batch_norm_inference(*p, eps=EPS)[0]  # noqa: E731
    want = jax.vjp(ref, *_f32(x, g, b, m, v))[1](dy.astype(jnp.float32))
    tol = max(TOL[jnp.dtype(dtype).type], 1e-5)
    for a, w, what in zip(got, want, ("dx", "dgamma", "dbeta", "dmean", "dvar")):
        assert_close(a, w, tol, what, min_scale=10.0 if what != "dx" else 1.0)
    assert "rlx_batch_norm_inference_bwd" in f.lower(x, g, b, m, v, dy).as_text()
    w = jax.jit(lambda *a: batch_norm_inference_backward(*a, eps=EPS))(x, g, m, v, dy)
    for a, c in zip(w, got[:3]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_vmap_of_grad():
    x, g, m, v, dy = _inputs((12, 8, 5), jnp.float32, seed=3)
    x, dy = x.reshape(3, 4, 8, 5), dy.reshape(3, 4, 8, 5)  # 3 examples of [4, 8, 5]
    b = jnp.zeros_like(g)
    f = jax.vmap(lambda x, dy: jax.vjp(lambda x, g: batch_norm_inference(x, g, b, m, v, eps=EPS), x, g)[1](dy))
    dx, dg = jax.jit(f)(x, dy)
    for i in range(3):
        want = reference_batch_norm_inference_bwd(x[i], g, m, v, dy[i], eps=EPS)
        assert_close(dx[i], want[0], 1e-6, "dx")
        assert_close(dg[i], want[1], 1e-5, "dgamma", min_scale=10.0)


@pytest.mark.parametrize("shape", [(64, 256, 28, 28), (20000, 512)], ids=_ids)
def test_backward_bitwise_deterministic(shape):
    x, g, m, v, dy = _inputs(shape, jnp.float32, seed=9)
    f = jax.jit(lambda *a: batch_norm_inference_bwd(*a, eps=EPS))
    first = [np.asarray(a) for a in f(x, g, m, v, dy)]
    for _ in range(2):
        for a, b in zip(first, f(x, g, m, v, dy)):
            np.testing.assert_array_equal(a, np.asarray(b))


def _call(x, g, m, v, dy, scratch_len):
    p = jax.ShapeDtypeStruct(g.shape, g.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p, jax.ShapeDtypeStruct((scratch_len,), jnp.float32))
    return jax.ffi.ffi_call("rlx_batch_norm_inference_bwd_v1", out)(x, g, m, v, dy, eps=np.float32(EPS))[:3]


def test_bad_operands_are_errors():
    x, g, m, v, dy = _inputs((4, 8, 6, 6), jnp.float32, seed=1)
    with pytest.raises(Exception, match="scratch"):
        jax.block_until_ready(jax.jit(lambda *a: _call(*a, scratch_len=1))(x, g, m, v, dy))
    with pytest.raises(Exception, match="mean"):
        n = cuda_bwd_scratch_size(x.shape)
        jax.block_until_ready(jax.jit(lambda *a: _call(*a, scratch_len=n))(x, g, m[:3], v, dy))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(8, 16, 7, 7), (33, 40), (37, 6, 5)], ids=_ids)
def test_backward_sanitizer_small(shape, dtype):
    """Small cases for compute-sanitizer (tools/gpu_suite.sh runs -k sanitizer)."""
    x, g, m, v, dy = _inputs(shape, dtype, seed=2)
    got = jax.jit(lambda *a: _call(*a, scratch_len=cuda_bwd_scratch_size(x.shape)))(x, g, m, v, dy)
    _check(x, g, m, v, dy, got, dtype)
