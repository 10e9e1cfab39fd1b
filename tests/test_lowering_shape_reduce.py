"""Shape ops (Reshape, Transpose, Narrow, Concat, Expand, ResizeNearest2x) and
reductions (Reduce, Softmax, TopK, Sample) vs NumPy."""

import numpy as np
import pytest

import jax

import rlx_jax as rlx

RNG = np.random.default_rng(3)


def run(g, **inputs):
    return [np.asarray(o) for o in rlx.to_jax(g)({}, inputs)]


def _one(shape, build, x=None, dtype="f32"):
    x = RNG.standard_normal(shape).astype(np.float32) if x is None else x
    g = rlx.Graph("one")
    i = g.input("x", list(shape), dtype)
    g.set_outputs([build(g, i)])
    return run(g, x=x)[0], x


def test_reshape_transpose_narrow():
    y, x = _one((2, 3, 5), lambda g, i: g.reshape(i, [5, 6]))
    np.testing.assert_array_equal(y, x.reshape(5, 6))
    y, x = _one((2, 3, 5), lambda g, i: g.transpose(i, [2, 0, 1]))
    np.testing.assert_array_equal(y, x.transpose(2, 0, 1))
    y, x = _one((2, 7, 5), lambda g, i: g.narrow(i, 1, 2, 4))
    np.testing.assert_array_equal(y, x[:, 2:6])


def test_reshape_with_dynamic_dim():
    g = rlx.Graph("dyn")
    i = g.input("x", ["batch", 3, 4], "f32")
    g.set_outputs([g.reshape(i, [-1, 12])])
    f = rlx.to_jax(g)
    for n in (1, 5):
        x = RNG.standard_normal((n, 3, 4)).astype(np.float32)
        np.testing.assert_array_equal(f({}, {"x": x})[0], x.reshape(n, 12))


@pytest.mark.parametrize("target", [[-1], [-1, 2], [3, -1]])
def test_reshape_of_a_dynamic_dim_into_a_multiple_of_it(target):
    """RLX's rule declares the -1 as the input's dynamic dim ([batch, 3, 4] -> [-1] reads
    [batch]) although it holds 12 * batch elements; the lowering reshapes by the element
    count, so the values are numpy's."""
    g = rlx.Graph("dyn")
    i = g.input("x", ["batch", 3, 4], "f32")
    g.set_outputs([g.reshape(i, target)])
    f = rlx.to_jax(g)
    for n in (1, 5):
        x = RNG.standard_normal((n, 3, 4)).astype(np.float32)
        np.testing.assert_array_equal(f({}, {"x": x})[0], x.reshape(target))


def test_concat_and_expand():
    a = RNG.standard_normal((2, 3)).astype(np.float32)
    b = RNG.standard_normal((2, 5)).astype(np.float32)
    g = rlx.Graph("cat")
    ia = g.input("a", [2, 3], "f32")
    ib = g.input("b", [2, 5], "f32")
    g.set_outputs([g.concat([ia, ib, ia], 1)])
    np.testing.assert_array_equal(run(g, a=a, b=b)[0], np.concatenate([a, b, a], 1))
    y, x = _one((3, 1), lambda g, i: g.expand(i, [2, 3, 4]))
    np.testing.assert_array_equal(y, np.broadcast_to(x, (2, 3, 4)))


def test_expand_keeps_dynamic_dim():
    g = rlx.Graph("exp")
    i = g.input("x", ["batch", 1], "f32")
    g.set_outputs([g.expand(i, ["batch", 4])])
    x = RNG.standard_normal((3, 1)).astype(np.float32)
    np.testing.assert_array_equal(rlx.to_jax(g)({}, {"x": x})[0], np.broadcast_to(x, (3, 4)))


def test_resize_nearest_2x():
    y, x = _one((1, 2, 3, 5), lambda g, i: g.resize_nearest_2x(i))
    np.testing.assert_array_equal(y, x.repeat(2, axis=2).repeat(2, axis=3))


NP_RED = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


@pytest.mark.parametrize("op", sorted(NP_RED))
@pytest.mark.parametrize("keep", [False, True])
def test_reduce(op, keep):
    y, x = _one((3, 4, 5), lambda g, i: g.reduce(i, op, [0, -1], keep))
    np.testing.assert_allclose(y, NP_RED[op](x, axis=(0, 2), keepdims=keep), rtol=1e-5, atol=1e-6)


def test_softmax_any_axis():
    y, x = _one((3, 4, 5), lambda g, i: g.softmax(i, 1))
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=1e-5)


def test_topk_f32_indices_ties_to_smaller_index():
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, -1.0, 5.0, 5.0, 4.0]], np.float32)
    y, _ = _one(x.shape, lambda g, i: g.top_k(i, 3), x=x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, [[1, 2, 4], [2, 3, 4]])
    # random odd shape vs a stable argsort
    x = RNG.standard_normal((2, 3, 7)).astype(np.float32)
    y, _ = _one(x.shape, lambda g, i: g.top_k(i, 4), x=x)
    np.testing.assert_array_equal(y, np.argsort(-x, axis=-1, kind="stable")[..., :4])


def _sample_graph(top_k, top_p, temperature, seed, rows=4, v=6):
    g = rlx.Graph("s")
    i = g.input("x", [rows, v], "f32")
    g.set_outputs([g.sample(i, top_k, top_p, temperature, seed, [rows], "f32")])
    return rlx.to_jax(g)


def test_sample_deterministic_per_seed_and_respects_filters():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    f1, f2 = _sample_graph(0, 1.0, 1.0, 7), _sample_graph(0, 1.0, 1.0, 7)
    a = np.asarray(f1({}, {"x": x})[0])
    np.testing.assert_array_equal(a, np.asarray(f2({}, {"x": x})[0]))
    assert a.shape == (4,) and np.all((a >= 0) & (a < 6)) and np.all(a == np.round(a))
    # top_k = 1 is greedy
    y = np.asarray(_sample_graph(1, 1.0, 1.0, 3)({}, {"x": x})[0])
    np.testing.assert_array_equal(y, x.argmax(-1))
    # a tiny top_p keeps only the most likely token
    y = np.asarray(_sample_graph(0, 1e-6, 1.0, 5)({}, {"x": x})[0])
    np.testing.assert_array_equal(y, x.argmax(-1))


def test_sample_distribution_follows_filtered_softmax():
    rows = 4000
    p = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    logits = np.tile(np.log(p), (rows, 1))
    # plain: frequencies follow softmax(logits)
    y = np.asarray(_sample_graph(0, 1.0, 1.0, 11, rows, 4)({}, {"x": logits})[0]).astype(int)
    np.testing.assert_allclose(np.bincount(y, minlength=4) / rows, p, atol=0.03)
    # top_k = 2: only the two most likely, renormalised
    y = np.asarray(_sample_graph(2, 1.0, 1.0, 12, rows, 4)({}, {"x": logits})[0]).astype(int)
    np.testing.assert_allclose(np.bincount(y, minlength=4) / rows, [0, 0, 3 / 7, 4 / 7], atol=0.03)
    # top_p = 0.65: the smallest descending prefix reaching 0.65 is {0.4, 0.3}
    y = np.asarray(_sample_graph(0, 0.65, 1.0, 13, rows, 4)({}, {"x": logits})[0]).astype(int)
    np.testing.assert_allclose(np.bincount(y, minlength=4) / rows, [0, 0, 3 / 7, 4 / 7], atol=0.03)
    # temperature 0.5 sharpens: p^2 renormalised
    y = np.asarray(_sample_graph(0, 1.0, 0.5, 14, rows, 4)({}, {"x": logits})[0]).astype(int)
    np.testing.assert_allclose(np.bincount(y, minlength=4) / rows, p**2 / np.sum(p**2), atol=0.03)


def test_rng_ops_are_deterministic_per_seed_with_the_right_moments():
    def build(seed):
        g = rlx.Graph("rng")
        g.set_outputs([g.rng_normal([20000], "f32", seed, 1.5, 2.0),
                       g.rng_uniform([20000], "f32", seed, -1.0, 3.0)])
        return rlx.to_jax(g)

    n1, u1 = build(3)({}, {})
    n2, u2 = build(3)({}, {})
    n3, _ = build(4)({}, {})
    np.testing.assert_array_equal(n1, n2)
    np.testing.assert_array_equal(u1, u2)
    assert not np.array_equal(n1, n3)
    assert abs(float(np.mean(n1)) - 1.5) < 0.05 and abs(float(np.std(n1)) - 2.0) < 0.05
    assert float(np.min(u1)) >= -1.0 and float(np.max(u1)) < 3.0
    assert abs(float(np.mean(u1)) - 1.0) < 0.05


def test_bf16_dtype_map_keeps_unread_sum_and_mean_outputs_in_f32():
    """Under a bf16 dtype_map, Sum / Mean outputs that no node reads (a loss) accumulate and
    return in their declared f32: the f32 mean of the bf16 rows, not that mean rounded to
    bf16. A Mean another node reads, and a Max output, stay bf16."""
    import jax.numpy as jnp
    import ml_dtypes

    bf16 = np.dtype(jnp.bfloat16)
    to_bf16 = lambda dt: bf16 if np.dtype(dt) == np.float32 else np.dtype(dt)
    g = rlx.Graph("loss")
    i = g.input("x", [37, 5], "f32")
    rows = g.exp(i)                                 # [37, 5], computed in bf16
    loss = g.mean(g.sum(rows, [1]), [0])            # the unread output: f32
    total = g.sum(rows, [0, 1])                     # unread, Sum: f32
    inner = g.mean(rows, [0])                       # read by the next node: bf16
    g.set_outputs([loss, total, g.add(inner, inner), g.reduce(rows, "max", [0], False)])
    x = RNG.standard_normal((37, 5)).astype(np.float32)
    out = rlx.to_jax(g, dtype_map=to_bf16)({}, {"x": x})
    assert [o.dtype for o in out] == [np.float32, np.float32, bf16, bf16]
    # the reference: the rows as the bf16 graph computes them, reduced in f64
    r = np.exp(x.astype(ml_dtypes.bfloat16).astype(np.float32)).astype(ml_dtypes.bfloat16)
    row_sums = r.astype(np.float32).sum(axis=1).astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(float(out[0]), row_sums.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(out[1]), r.astype(np.float64).sum(), rtol=1e-6)
    # the bf16 rounding the kept outputs avoid is far larger than their error
    assert abs(float(row_sums.mean().astype(ml_dtypes.bfloat16)) - row_sums.mean()) > 1e-4 * row_sums.mean()
