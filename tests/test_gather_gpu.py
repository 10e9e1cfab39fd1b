"""Gather / embedding backward on the GPU: the CUDA kernel rlx_gather_bwd (a segment
reduction over XLA's stable sort of the indices, no atomics) against the pure-JAX
references in f32 on the GPU, and bit for bit against the CPU kernel (the same sums in
the same order). Skipped where JAX sees no GPU.

Cases: embedding tables (axis 0), gathers along a middle axis (several outer rows
sharing the sort), row widths that are and are not multiples of the 16-byte vector,
one-element rows, heavy repeats (every index equal), negative and out-of-range indices
(clamped as on CPU), empty index arrays, zero-width tables, vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import as_f32, assert_close, gpu, requires_gpu
from rlx_jax.ops import gather, gather_backward, scatter_add
from rlx_jax.vjp_rules.gather import gather_bwd, reference_gather, reference_gather_bwd

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _put(*arrays):
    dev = gpu()
    return [jax.device_put(a, dev) for a in arrays]


def _normal(shape, dtype, seed):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _idx(shape, lo, hi, seed):
    return jax.random.randint(jax.random.PRNGKey(seed + 500), shape, lo, hi, jnp.int32)


def _close(got, want, dtype, what):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what)


def _want_d_table(dy, idx, axis, table_shape):
    """f32 gradient of the reference gather (XLA's own scatter-add)."""
    spec = jnp.zeros(table_shape, jnp.float32)
    return jax.vjp(lambda t: _ref_gather(t, idx, axis), spec)[1](dy.astype(jnp.float32))[0]


def _ref_gather(table, indices, axis):
    v = table.shape[axis]
    return jnp.take(table, jnp.clip(indices, 0, v - 1), axis=axis, mode="clip")


def test_cuda_target_registered_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert "rlx_gather_bwd_v1" in info["targets"]
    table, idx = _put(_normal((50, 16), jnp.float32, 0), _idx((20,), 0, 50, 0))
    text = jax.jit(jax.grad(lambda t: jnp.sum(gather(t, idx) ** 2))).lower(table).as_text()
    assert "rlx_gather_bwd" in text, "rlx_gather_bwd not in the lowered HLO on GPU (silent fallback)"
    assert "sort" in text  # the CUDA call takes XLA's stable sort of the indices


# (table shape, axis, indices shape, index range)
CASES = [
    ((37, 64), 0, (100,), (0, 37)),
    ((1000, 1024), 0, (8, 333), (0, 1000)),  # embedding: 16-byte vectors, 256 threads a row
    ((301, 33), 0, (517,), (0, 301)),  # odd width: scalar path
    ((5000, 1), 0, (4099,), (0, 5000)),  # one-element rows: one thread a row
    ((7, 13, 6), 1, (40,), (0, 13)),  # middle axis: 7 outer rows share the sort
    ((3, 9, 5, 8), 1, (2, 11), (-4, 14)),  # negative and out-of-range indices clamp
    ((64, 24), 0, (3000,), (5, 6)),  # every index the same row: one long run
]


def _cid(c):
    shape, axis, ishape, (lo, hi) = c
    return f"{'x'.join(map(str, shape))}-ax{axis}-i{'x'.join(map(str, ishape))}-r{lo}_{hi}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_gradient_matches_reference(case, dtype):
    shape, axis, ishape, (lo, hi) = case
    table = _normal(shape, dtype, seed=len(shape) + shape[0])
    idx = _idx(ishape, lo, hi, seed=shape[-1])
    out_shape = shape[:axis] + ishape + shape[axis + 1 :]
    dy = _normal(out_shape, dtype, seed=3)
    table, idx, dy = _put(table, idx, dy)
    y, pull = jax.vjp(lambda t: gather(t, idx, axis=axis, mode="clip"), table)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray(_ref_gather(table, idx, axis).astype(jnp.float32)))
    (d_table,) = jax.jit(pull)(dy)
    d2 = jax.jit(lambda dy: gather_backward(dy, idx, axis=axis, table_shape=shape))(dy)
    want = _want_d_table(dy, idx, axis, shape)
    assert d_table.dtype == dtype and d_table.shape == shape
    _close(d_table, want, dtype, "d_table (vjp)")
    _close(d2, want, dtype, "d_table (gather_backward)")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_same_bits_as_cpu_kernel(dtype):
    """The CUDA segment sums add the same dy rows in the same order (increasing
    position, f32) as the CPU kernel's buckets, so the results agree bit for bit."""
    shape, k = (97, 40), 2000
    dy, idx = _normal((k, shape[1]), dtype, 12), _idx((k,), -3, 100, 12)
    (got,) = _put(dy)
    (idx_g,) = _put(idx)
    g = jax.jit(lambda d, i: gather_backward(d, i, axis=0, table_shape=shape))
    on_gpu = g(got, idx_g)
    cpu = jax.devices("cpu")[0]
    if not rlx_jax._kernels.has_kernel("cpu", "rlx_gather_bwd_v1"):
        pytest.skip("CPU kernel not built")
    on_cpu = g(jax.device_put(dy, cpu), jax.device_put(idx, cpu))
    np.testing.assert_array_equal(np.asarray(on_gpu).view(np.uint8), np.asarray(on_cpu).view(np.uint8))


def test_gather_bwd_sanitizer_small():
    """Small case with repeats, clamped indices and untouched rows (memcheck)."""
    dy, idx = _put(_normal((2, 9, 5), jnp.float32, 1), jnp.array([3, -1, 3, 8, 0, 3, 7, 9, 100], jnp.int32))
    (got,) = jax.jit(lambda d, i: gather_bwd(d, i, num_rows=8))(dy, idx)
    (want,) = reference_gather_bwd(dy, idx, num_rows=8)
    _close(got, want, jnp.float32, "d_table")
    np.testing.assert_array_equal(np.asarray(got)[:, [1, 2, 4, 5, 6]], 0)


def test_scatter_add_sanitizer_small_bf16():
    upd, idx = _put(_normal((6, 3, 4), jnp.bfloat16, 2), jnp.array([1, 0, 1, 1, 4, 2], jnp.int32))
    got = jax.jit(lambda u: scatter_add(u, idx, 5))(upd)
    want = _want_d_table(upd, idx, 0, (5, 3, 4))
    _close(got, want, jnp.bfloat16, "scatter_add")


def test_zero_sized():
    table, empty = _put(_normal((6, 3), jnp.float32, 0), jnp.zeros((0,), jnp.int32))
    d = jax.jit(jax.grad(lambda t: jnp.sum(gather(t, empty))))(table)
    np.testing.assert_array_equal(np.asarray(d), np.zeros((6, 3)))  # K = 0: every row written as 0
    (wide0,) = _put(_normal((6, 0), jnp.float32, 0))
    (idx,) = _put(jnp.array([1, 2], jnp.int32))
    assert jax.jit(jax.grad(lambda t: jnp.sum(gather(t, idx))))(wide0).shape == (6, 0)
    (t0,) = _put(_normal((0, 4, 3), jnp.float32, 0))
    assert jax.jit(jax.grad(lambda t: jnp.sum(gather(t, idx, axis=1))))(t0).shape == (0, 4, 3)


def test_vmap_keeps_kernel():
    tables, idx = _put(_normal((3, 9, 4), jnp.float32, 4), jnp.array([8, 1, 1, 0, 8], jnp.int32))
    grad = jax.grad(lambda t: jnp.sum(jnp.sin(gather(t, idx))))
    f = jax.jit(jax.vmap(grad))
    assert "rlx_gather_bwd" in f.lower(tables).as_text()
    want = jax.vmap(jax.grad(lambda t: jnp.sum(jnp.sin(_ref_gather(t, idx, 0)))))(tables)
    _close(f(tables), want, jnp.float32, "vmap grad")


def test_vmap_over_token_ids_keeps_the_reproducible_kernel():
    """vmap over batched indices (several batches' token ids; per-example gradients): the
    scatter-add is still the kernel (batched indices folded into blocks of rows), so the
    table gradient is bitwise the same from call to call, and matches the reference."""
    table, ids = _put(_normal((50, 96), jnp.float32, 9), _idx((4, 3000), 0, 50, 9))
    loss = lambda t, i: jnp.sum(jnp.sin(gather(t, i)))  # noqa: E731
    ref = lambda t, i: jnp.sum(jnp.sin(_ref_gather(t, i, 0)))  # noqa: E731
    summed = jax.jit(jax.grad(lambda t: jnp.sum(jax.vmap(loss, (None, 0))(t, ids))))
    per_example = jax.jit(lambda t: jax.vmap(jax.grad(loss), (None, 0))(t, ids))
    for f, want in ((summed, jax.grad(lambda t: jnp.sum(jax.vmap(ref, (None, 0))(t, ids)))(table)),
                    (per_example, jax.vmap(jax.grad(ref), (None, 0))(table, ids))):
        assert "rlx_gather_bwd" in f.lower(table).as_text()
        got = [np.asarray(f(table)) for _ in range(3)]
        assert all(np.array_equal(got[0], g) for g in got[1:])
        _close(got[0], want, jnp.float32, "vmapped gradient")


def test_second_order():
    """Forward-over-reverse through the kernel's transposes (gather <-> scatter-add)."""
    table, idx = _put(_normal((11, 6), jnp.float32, 6), jnp.array([3, 3, 0, 10, 5, 3], jnp.int32))
    v = jnp.ones_like(table)
    f = lambda t: jnp.sum(jnp.sin(gather(t, idx)) * gather(t, idx))
    fr = lambda t: jnp.sum(jnp.sin(_ref_gather(t, idx, 0)) * _ref_gather(t, idx, 0))
    got = jax.jit(lambda t: jax.jvp(jax.grad(f), (t,), (v,))[1])(table)
    want = jax.jvp(jax.grad(fr), (table,), (v,))[1]
    _close(got, want, jnp.float32, "hvp")


def test_repeated_runs_bitwise_identical():
    dy, idx = _put(_normal((20000, 96), jnp.float32, 8), _idx((20000,), 0, 50, 8))
    f = jax.jit(lambda d: gather_backward(d, idx, axis=0, table_shape=(50, 96)))
    first = np.asarray(f(dy))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(dy)), first)


def test_bad_operands_raise():
    d_table = jax.ShapeDtypeStruct((1, 5, 3), jnp.float32)
    call = jax.ffi.ffi_call("rlx_gather_bwd_v1", (d_table, jax.ShapeDtypeStruct((6,), jnp.int32)))
    dy, keys, order = _put(jnp.ones((1, 2, 3)), jnp.array([0, 1, 2], jnp.int32), jnp.array([0, 1], jnp.int32))
    with pytest.raises(Exception, match="K = dy.shape"):
        jax.block_until_ready(jax.jit(call)(dy, keys, order))
    short = jax.ffi.ffi_call("rlx_gather_bwd_v1", (d_table, jax.ShapeDtypeStruct((5,), jnp.int32)))  # needs V + 1
    with pytest.raises(Exception, match="scratch"):
        jax.block_until_ready(jax.jit(short)(dy, keys[:2], order))
