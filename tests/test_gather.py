"""gather / gather_backward / scatter_add: np.take semantics on every axis, the
out-of-range modes ("fill" default, "clip", "promise_in_bounds") against jnp.take, the race-free scatter-add kernel vs NumPy, gradients in every
mode, vmap, zero-sized inputs, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import gather, gather_backward, scatter_add

from testutil import assert_close, hlo_text, platform

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _table(shape, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def np_scatter(dy, idx, axis, table_shape):
    """NumPy oracle: d_table[.., clip(idx), ..] += dy, in f64."""
    out = np.zeros(table_shape, np.float64)
    idx = np.clip(np.asarray(idx), 0, table_shape[axis] - 1)
    moved = np.moveaxis(out, axis, 0)
    dy = np.asarray(dy, np.float64)
    dy = np.moveaxis(dy.reshape(table_shape[:axis] + (idx.size,) + table_shape[axis + 1 :]), axis, 0)
    np.add.at(moved, idx.reshape(-1), dy)
    return out


def test_kernel_registered_and_used():
    info = rlx_jax.kernel_info()["cpu"]
    assert info["loaded"], info["error"]
    assert "rlx_gather_bwd_v1" in info["targets"]
    t, idx = _table((10, 4)), jnp.array([1, 3, 3])
    assert "rlx_gather_bwd" in hlo_text(jax.grad(lambda t: jnp.sum(gather(t, idx) ** 2)), t)
    assert "rlx_gather_bwd" in hlo_text(lambda u: scatter_add(u, idx, 10), jnp.ones((3, 4)))


@pytest.mark.parametrize(
    "shape,axis,idx_shape",
    [((50, 8), 0, (7,)), ((50, 8), 0, (3, 4)), ((4, 9, 5), 1, (6,)), ((3, 4, 11), -1, (2, 5)), ((13,), 0, (20,))],
)
def test_forward_is_np_take_and_backward_is_scatter_add(shape, axis, idx_shape):
    table = _table(shape)
    n = shape[axis]
    idx = jax.random.randint(jax.random.PRNGKey(1), idx_shape, 0, n)  # repeats likely
    out = jax.jit(lambda t, i: gather(t, i, axis=axis))(table, idx)
    np.testing.assert_array_equal(out, np.take(np.asarray(table), np.asarray(idx), axis=axis))
    dy = _table(out.shape, seed=2)
    (d_table,) = jax.vjp(lambda t: gather(t, idx, axis=axis), table)[1](dy)
    assert_close(d_table, np_scatter(dy, idx, axis % len(shape), shape))
    direct = gather_backward(dy, idx, axis=axis, table_shape=shape)
    np.testing.assert_array_equal(direct, d_table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(dtype):
    table = _table((64, 33), dtype)
    idx = jnp.array([5, 0, 5, 63, 5, 7, 0])
    out = gather(table, idx)
    assert out.dtype == dtype
    dy = _table(out.shape, dtype, seed=3)
    d_table = jax.vjp(lambda t: gather(t, idx), table)[1](dy)[0]
    assert d_table.dtype == dtype
    assert_close(d_table, np_scatter(dy.astype(jnp.float32), idx, 0, table.shape), dtype)


def test_f64(x64):
    table = _table((20, 3), jnp.float64)
    idx = jnp.array([[1, 2], [2, 19]])
    d = jax.grad(lambda t: jnp.sum(jnp.sin(gather(t, idx))))(table)
    assert d.dtype == jnp.float64
    if platform() == "cpu":  # the CUDA kernels take no f64: XLA's scatter-add there
        assert "rlx_gather_bwd" in hlo_text(jax.grad(lambda t: jnp.sum(jnp.sin(gather(t, idx)))), table)
    want = np_scatter(np.cos(np.asarray(table)[np.asarray(idx)]), idx, 0, table.shape)
    assert_close(d, want, jnp.float64)


def test_out_of_range_indices_clamp_in_forward_and_backward():
    table = _table((5, 2))
    idx = jnp.array([-3, 0, 4, 5, 100])
    out = gather(table, idx, mode="clip")
    np.testing.assert_array_equal(out, np.asarray(table)[[0, 0, 4, 4, 4]])
    d = jax.grad(lambda t: jnp.sum(gather(t, idx, mode="clip")))(table)
    np.testing.assert_array_equal(d[:, 0], [2.0, 0.0, 0.0, 0.0, 3.0])
    np.testing.assert_array_equal(scatter_add(jnp.ones((5, 2)), idx, 5)[:, 1], [2.0, 0, 0, 0, 3.0])
    big = jnp.array([2**31 - 1, -(2**31)], jnp.int32)
    np.testing.assert_array_equal(gather(table, big, mode="clip"), np.asarray(table)[[4, 0]])


def test_scatter_add_is_rlx_scatter_add():
    upd = _table((6, 2, 3))
    idx = jnp.array([3, 1, 3, 0, 3, 1])
    out = scatter_add(upd, idx, (4, 2, 3))
    assert out.shape == (4, 2, 3)
    assert_close(out, np_scatter(upd, idx, 0, (4, 2, 3)))
    np.testing.assert_array_equal(scatter_add(upd, idx, 4), out)
    # its gradient is the gather of the upstream gradient
    dy = _table((4, 2, 3), seed=5)
    (d_upd,) = jax.vjp(lambda u: scatter_add(u, idx, 4), upd)[1](dy)
    np.testing.assert_array_equal(d_upd, np.asarray(dy)[np.asarray(idx)])


def test_complex_scatter_and_gather_gradient_keep_the_imaginary_part():
    r = np.random.default_rng(3)
    upd = jnp.asarray(r.normal(size=(5, 3)) + 1j * r.normal(size=(5, 3)), jnp.complex64)
    idx = jnp.array([2, 0, 2, 3, 2])
    want = np.zeros((4, 3), np.complex64)
    np.add.at(want, np.asarray(idx), np.asarray(upd))
    np.testing.assert_allclose(scatter_add(upd, idx, 4), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gather_backward(upd, idx, axis=0, table_shape=(4, 3)), want, rtol=1e-6, atol=1e-6)
    # reverse mode of a complex gather: the cotangent's imaginary part reaches the table
    (dt,) = jax.vjp(lambda t: gather(t, idx, axis=0), jnp.zeros((4, 3), jnp.complex64))[1](upd)
    np.testing.assert_allclose(dt, want, rtol=1e-6, atol=1e-6)


def test_deterministic_and_ordered_sum():
    # many repeats of one row: the kernel sums in index order, the same on every run
    dy = _table((4096, 16), seed=7)
    idx = jnp.zeros((4096,), jnp.int32).at[::3].set(2)
    f = jax.jit(lambda d: gather_backward(d, idx, axis=0, table_shape=(3, 16)))
    a, b = f(dy), f(dy)
    np.testing.assert_array_equal(a, b)
    assert_close(a, np_scatter(dy, idx, 0, (3, 16)))
    np.testing.assert_array_equal(a[1], np.zeros(16))


def test_check_grads_f64(x64):
    table = _table((7, 3, 2), jnp.float64)
    idx = jnp.array([[6, 0], [2, 2]])
    for axis in (0, 1):
        n = table.shape[axis]
        check_grads(lambda t: gather(t, idx % n, axis=axis), (table,), order=2, modes=("fwd", "rev"))
    dy = _table((2, 2, 3, 2), jnp.float64)
    check_grads(lambda d: gather_backward(d, idx, axis=0, table_shape=(7, 3, 2)), (dy,), order=2,
                modes=("fwd", "rev"))
    # through a nonlinearity: second derivatives reach both kernels' transposes
    check_grads(lambda t: jnp.sin(gather(t, idx)) * gather(t, idx), (table,), order=2, modes=("fwd", "rev"))


def test_vmap():
    tables = _table((3, 9, 4))
    idx = jnp.array([8, 1, 1])
    grad = jax.grad(lambda t: jnp.sum(gather(t, idx) ** 2))
    assert_close(jax.vmap(grad)(tables), jnp.stack([grad(t) for t in tables]))
    assert "rlx_gather_bwd" in hlo_text(jax.vmap(grad), tables)
    # batched indices too
    idxs = jnp.array([[0, 1], [8, 8], [3, 0]])
    got = jax.vmap(lambda t, i: gather(t, i, axis=0))(tables, idxs)
    np.testing.assert_array_equal(got, np.stack([np.asarray(t)[np.asarray(i)] for t, i in zip(tables, idxs)]))
    dy = _table((3, 2, 4), seed=9)
    got = jax.vmap(lambda d, i: gather_backward(d, i, axis=0, table_shape=(9, 4)))(dy, idxs)
    want = np.stack([np_scatter(d, i, 0, (9, 4)) for d, i in zip(dy, idxs)])
    assert_close(got, want)


def _np_fill_gather(t, i, axis, fill):
    """NumPy oracle of gather's "fill" mode: np.take, the fill where i is outside [0, V)."""
    t, i = np.asarray(t, np.float64), np.asarray(i)
    v = t.shape[axis]
    out = np.take(t, np.clip(i, 0, v - 1), axis=axis)
    bad = (i < 0) | (i >= v)
    shape = [1] * t.ndim
    shape[axis:axis + 1] = list(i.shape)
    return np.where(bad.reshape(shape), fill, out)


# (table shape, table's vmap axis or None, indices [Bv, K] laid out with the batch at axis
# idx_axis, gather axis): a shared table; a batched table at axis 0 and inside; the batch
# axis of the indices last; a gather axis with leading and trailing dims; out-of-range
# indices (fill); an empty batch and empty indices
BATCHED_INDEX_CASES = [
    ((9, 4), None, 0, 0),
    ((3, 9, 4), 0, 0, 0),
    ((9, 3, 4), 1, 1, 0),
    ((2, 9, 5), None, 1, 1),
    ((3, 2, 9, 5), 0, 0, 1),
    ((0, 9, 4), 0, 0, 0),
]


@pytest.mark.parametrize("case", BATCHED_INDEX_CASES, ids=lambda c: f"{c}")
def test_vmap_over_indices_keeps_the_kernels(case):
    """vmap with the indices batched (token ids of several batches, per-example gradients)
    runs gather's primitives, forward and race-free backward, not vmap of the reference:
    values, the summed table gradient, and per-example gradients against NumPy."""
    shape, t_axis, i_axis, axis = case
    bv = shape[t_axis] if t_axis is not None else 3
    one = tuple(d for n, d in enumerate(shape) if n != t_axis)
    table = _table(shape, seed=5)
    v = one[axis]
    k = 0 if bv == 0 else 4
    rng = np.random.default_rng(7)
    idx = rng.integers(-2, v + 2, size=(bv, k)).astype(np.int32)  # out of range both ways: the fill
    idx_in = jnp.asarray(np.moveaxis(idx, 0, i_axis))
    per = [np.take(np.asarray(table), b, axis=t_axis) if t_axis is not None else np.asarray(table) for b in range(bv)]

    f = lambda t, i: gather(t, i, axis=axis, fill_value=0.5)  # noqa: E731
    vf = jax.vmap(f, in_axes=(t_axis, i_axis))
    got = vf(table, idx_in)
    want = np.stack([_np_fill_gather(per[b], idx[b], axis, 0.5) for b in range(bv)]) if bv else np.zeros((0,))
    assert_close(got.reshape(want.shape) if bv == 0 else got, want)
    assert "rlx_gather_fwd" in str(jax.make_jaxpr(vf)(table, idx_in))

    # the table gradient of the summed, vmapped loss, and per-example gradients
    w = _table((bv,) + one[:axis] + (k,) + one[axis + 1:], seed=8)
    loss = lambda t, i, w: jnp.sum(jnp.sin(f(t, i)) * w)  # noqa: E731
    summed = jax.grad(lambda t: jnp.sum(jax.vmap(loss, in_axes=(t_axis, i_axis, 0))(t, idx_in, w)))
    per_example = jax.vmap(jax.grad(loss), in_axes=(t_axis, i_axis, 0))

    def np_grad(b):
        tb, ib = per[b], np.clip(idx[b], 0, v - 1)
        keep = (idx[b] >= 0) & (idx[b] < v)
        shape_k = [1] * tb.ndim
        shape_k[axis] = k
        dy = np.cos(np.take(tb.astype(np.float64), ib, axis=axis)) * np.asarray(w[b], np.float64) * keep.reshape(shape_k)
        return np_scatter(dy, ib, axis, tb.shape)

    grads = [np_grad(b) for b in range(bv)]
    if bv:
        assert_close(per_example(table, idx_in, w), np.stack(grads))  # vmap's out_axes 0
        want_summed = np.moveaxis(np.stack(grads), 0, t_axis) if t_axis is not None else np.sum(grads, axis=0)
        assert_close(summed(table), want_summed)
    jaxpr = str(jax.make_jaxpr(per_example)(table, idx_in, w))
    assert "rlx_gather_bwd" in jaxpr and "rlx_gather_fwd" in jaxpr
    assert "rlx_gather_bwd" in str(jax.make_jaxpr(summed)(table))


def test_zero_sized():
    table = _table((6, 0))
    idx = jnp.array([1, 2])
    assert gather(table, idx).shape == (2, 0)
    assert jax.grad(lambda t: jnp.sum(gather(t, idx)))(table).shape == (6, 0)
    table = _table((6, 3))
    empty = jnp.zeros((0,), jnp.int32)
    assert gather(table, empty).shape == (0, 3)
    d = jax.grad(lambda t: jnp.sum(gather(t, empty)))(table)
    np.testing.assert_array_equal(d, np.zeros((6, 3)))
    assert gather(jnp.zeros((0, 3)), empty).shape == (0, 3)


def test_integer_table_gathers_without_gradient():
    table = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)
    np.testing.assert_array_equal(gather(table, jnp.array([3, 0])), [[9, 10, 11], [0, 1, 2]])


def test_errors():
    table = _table((4, 3))
    with pytest.raises(TypeError, match="indices must be an integer"):
        gather(table, jnp.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="axis 2 out of range"):
        gather(table, jnp.array([0]), axis=2)
    with pytest.raises(ValueError, match="size 0"):
        gather(jnp.zeros((0, 3)), jnp.array([0]), mode="clip")
    with pytest.raises(ValueError, match="at least one axis"):
        gather(jnp.float32(1.0), jnp.array([0]))
    with pytest.raises(ValueError, match="dy must have shape"):
        gather_backward(jnp.zeros((2, 4)), jnp.array([0, 1]), axis=0, table_shape=(4, 3))
    with pytest.raises(ValueError, match="must start with the indices shape"):
        scatter_add(jnp.zeros((3, 2)), jnp.array([0, 1]), 4)
    with pytest.raises(ValueError, match="out_shape"):
        scatter_add(jnp.zeros((2, 2)), jnp.array([0, 1]), (4, 3))


def test_kernel_rejects_inconsistent_buffers():
    """The CPU handler's operands (dy, idx) on the CPU device: the CUDA handler of the same
    name takes other operands (dy, sorted keys, order; tests/test_gather_gpu.py)."""
    cpu = jax.devices("cpu")[0]
    call = jax.ffi.ffi_call("rlx_gather_bwd_v1", jax.ShapeDtypeStruct((1, 5, 3), jnp.float32))
    dy, idx = (jax.device_put(x, cpu) for x in (jnp.ones((1, 2, 3)), jnp.array([0, 1, 2], jnp.int32)))
    with pytest.raises(Exception, match="K = dy.shape"):
        jax.block_until_ready(jax.jit(call)(dy, idx))


# ---- mode ("fill" default, "clip", "promise_in_bounds"), as jnp.take -------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_default_mode_fills_out_of_range_with_nan_like_jnp_take(axis):
    table = _table((4, 5, 3))
    n = table.shape[axis]
    idx = jnp.array([[n - 2, 0, n - 1], [n, 2, 10**6]])
    got = gather(table, idx, axis=axis)
    want = jnp.take(table, idx, axis=axis, mode="fill")
    np.testing.assert_array_equal(got, want)  # NaN compares equal to NaN here
    assert np.isnan(np.asarray(got)).sum() == 2 * table.size // n
    # negative indices never wrap (jnp.take's "fill" wraps -V..-1): they are out of range
    neg = gather(table, jnp.array([-1, 1]), axis=axis)
    assert np.isnan(np.asarray(jnp.take(neg, 0, axis=axis))).all()
    np.testing.assert_array_equal(jnp.take(neg, 1, axis=axis), jnp.take(table, 1, axis=axis))


def test_fill_gradient_skips_filled_positions_and_uses_the_kernel():
    table = _table((6, 3))
    idx = jnp.array([5, -2, 1, 6, 1, 3])
    dy = _table((6, 3), seed=1)
    want = np.zeros((6, 3))
    for k, i in enumerate(np.asarray(idx)):
        if 0 <= i < 6:
            want[i] += np.asarray(dy)[k]
    for fill in (None, 7.0):
        d = jax.grad(lambda t: jnp.sum(jnp.nan_to_num(gather(t, idx, fill_value=fill)) * dy))(table)
        assert_close(d, want, jnp.float32)
    # same as XLA's gradient of jnp.take's fill mode (on indices where its wrapping plays no part)
    pos = jnp.array([5, 9, 1, 6, 1, 3])
    ref = jax.grad(lambda t: jnp.sum(jnp.take(t, pos, axis=0, mode="fill", fill_value=0.0) * dy))(table)
    assert_close(jax.grad(lambda t: jnp.sum(gather(t, pos, fill_value=0.0) * dy))(table), ref, jnp.float32)
    if rlx_jax._kernels.has_kernel("cpu", "rlx_gather_bwd"):
        assert "rlx_gather_bwd" in hlo_text(jax.grad(lambda t: jnp.sum(gather(t, idx, fill_value=0.0) * dy)), table)
    # deterministic: the same bits on repeated runs
    g = jax.jit(jax.grad(lambda t: jnp.sum(gather(t, idx, fill_value=0.0) * dy)))
    np.testing.assert_array_equal(g(table), g(table))


def test_fill_value_and_integer_defaults():
    table = _table((3, 2))
    got = gather(table, jnp.array([0, 3]), fill_value=-1.5)
    np.testing.assert_array_equal(got, np.stack([np.asarray(table)[0], [-1.5, -1.5]]))
    ints = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)
    np.testing.assert_array_equal(gather(ints, jnp.array([3, 1])),
                                  jnp.take(ints, jnp.array([3, 1]), axis=0, mode="fill"))
    np.testing.assert_array_equal(gather(ints, jnp.array([-1]))[0], [np.iinfo(np.int32).min] * 2)
    uints = jnp.arange(3, dtype=jnp.uint8)
    np.testing.assert_array_equal(gather(uints, jnp.array([5, 2])), [255, 2])
    # an empty gathered axis: every index is out of range, so every read is the fill
    got = gather(jnp.zeros((0, 3)), jnp.array([0, 2]))
    assert got.shape == (2, 3) and np.isnan(np.asarray(got)).all()


def test_clip_and_promise_in_bounds_agree_in_range_and_compose_under_jit_vmap():
    table = _table((7, 4))
    idx = jnp.array([[6, 0], [3, 3]])
    want = np.asarray(table)[np.asarray(idx)]
    for mode in ("fill", "clip", "promise_in_bounds"):
        np.testing.assert_array_equal(jax.jit(lambda t, i: gather(t, i, mode=mode))(table, idx), want)
        g = jax.grad(lambda t: jnp.sum(jnp.sin(gather(t, idx, mode=mode))))(table)
        assert_close(g, jax.grad(lambda t: jnp.sum(jnp.sin(t[idx])))(table), jnp.float64)
    tables = _table((3, 7, 4))
    got = jax.vmap(lambda t: gather(t, jnp.array([1, 9]), mode="fill", fill_value=0.0))(tables)
    np.testing.assert_array_equal(got[:, 0], tables[:, 1])
    np.testing.assert_array_equal(got[:, 1], np.zeros((3, 4)))


def test_mode_errors_name_the_argument():
    table = _table((4, 3))
    with pytest.raises(TypeError, match="indices"):
        gather(table, jnp.array([0.0, 1.0]), mode="clip")
    with pytest.raises(TypeError, match="indices"):
        gather(table, jnp.array([True, False]))
    with pytest.raises(ValueError, match="mode must be one of"):
        gather(table, jnp.array([0]), mode="wrap")
    with pytest.raises(ValueError, match="fill_value"):
        gather(table, jnp.array([0]), mode="clip", fill_value=0.0)


def test_primitives_drop_out_of_range_indices():
    """The primitives read zeros at, and scatter nothing from, indices outside [0, V)
    (the public functions decide clamping or filling before them); the kernel, the XLA
    reference and a NumPy loop agree, with repeats, negatives and indices past V."""
    from rlx_jax.vjp_rules.gather import gather_bwd, gather_fwd, reference_gather_bwd

    idx = jnp.array([3, -1, 3, 8, 0, 3, 7, 9, 100, -7], jnp.int32)
    dy = _table((2, idx.size, 5), seed=4)
    want = np.zeros((2, 8, 5))
    for k, i in enumerate(np.asarray(idx)):
        if 0 <= i < 8:
            want[:, i] += np.asarray(dy)[:, k]
    (got,) = jax.jit(lambda d: gather_bwd(d, idx, num_rows=8))(dy)
    assert_close(got, want, jnp.float32)
    assert_close(reference_gather_bwd(dy, idx, num_rows=8)[0], want, jnp.float32)
    table = _table((2, 8, 5), seed=5)
    (read,) = jax.jit(lambda t: gather_fwd(t, idx))(table)
    out_of_range = (np.asarray(idx) < 0) | (np.asarray(idx) >= 8)
    np.testing.assert_array_equal(np.asarray(read)[:, out_of_range], 0)
    np.testing.assert_array_equal(np.asarray(read)[:, ~out_of_range],
                                  np.asarray(table)[:, np.asarray(idx)[~out_of_range]])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fill_mode_reads_rows_bit_exactly(dtype):
    """The fill is added to the zero the primitive reads out of range, and -0.0 to an
    in-range read: rows come back bit for bit, signed zeros and inf included, NaN as NaN
    (bit for bit on the CPU; a GPU's add returns its canonical NaN); the filled positions
    hold the fill; the gradient flows only to rows that were read."""
    table = jnp.array([[-0.0, 0.0, np.nan], [np.inf, -np.inf, 1.5], [-2.0, 3.0, -0.0]], dtype)
    idx = jnp.array([[2, 0], [5, 1], [-1, 0]])
    got = np.asarray(jax.jit(lambda t: gather(t, idx, fill_value=-4.0))(table))
    want = np.asarray(table)[np.clip(np.asarray(idx), 0, 2)]
    inside = (np.asarray(idx) >= 0) & (np.asarray(idx) < 3)
    read = np.broadcast_to(inside[..., None], want.shape)
    nan = np.isnan(want.astype(np.float32)) & (platform() != "cpu")
    np.testing.assert_array_equal(got[read & ~nan].view(np.uint8), want[read & ~nan].view(np.uint8))
    assert np.isnan(got[read & nan].astype(np.float32)).all()
    np.testing.assert_array_equal(got[~inside].astype(np.float32), -4.0)
    dy = _table((3, 2, 3), dtype, seed=6)
    d = jax.grad(lambda t: jnp.sum((gather(t, idx, fill_value=-4.0) * dy).astype(jnp.float32)))(table)
    want_d = np_scatter(np.where(inside[..., None], np.asarray(dy, np.float64), 0), np.asarray(idx), 0, (3, 3))
    assert_close(d, want_d, dtype)
