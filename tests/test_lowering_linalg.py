"""MatMul (broadcast batch dims), DotGeneral, DenseSolve / BatchedDenseSolve (f32, f64),
LoraMatMul, GroupedMatMul and ScatterAdd vs NumPy."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx

RNG = np.random.default_rng(2)


def run(g, **inputs):
    return [np.asarray(o) for o in rlx.to_jax(g)({}, inputs)]


def _graph_2(build, a, b, name="g"):
    g = rlx.Graph(name)
    ia = g.input("a", list(a.shape), a.dtype.name.replace("float", "f"))
    ib = g.input("b", list(b.shape), b.dtype.name.replace("float", "f"))
    g.set_outputs([build(g, ia, ib)])
    return run(g, a=a, b=b)[0]


@pytest.mark.parametrize("sa,sb", [((3, 5), (5, 7)), ((2, 1, 3, 5), (4, 5, 6)), ((3, 5), (2, 5, 4))])
def test_matmul_broadcast_batch(sa, sb):
    a = RNG.standard_normal(sa).astype(np.float32)
    b = RNG.standard_normal(sb).astype(np.float32)
    y = _graph_2(lambda g, x, w: g.matmul(x, w), a, b)
    np.testing.assert_allclose(y, np.matmul(a, b), rtol=1e-5, atol=1e-5)


def test_dot_general_batch_and_contracting():
    a = RNG.standard_normal((3, 4, 5)).astype(np.float32)   # [b, k, m]
    b = RNG.standard_normal((3, 4, 7)).astype(np.float32)   # [b, k, n]
    y = _graph_2(lambda g, x, w: g.dot_general(x, w, [1], [1], [0], [0]), a, b)
    np.testing.assert_allclose(y, np.einsum("bkm,bkn->bmn", a, b), rtol=1e-5, atol=1e-5)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("rhs", [(5,), (5, 3)])
def test_dense_solve(dtype, rhs, x64):
    npdt = np.float32 if dtype == "f32" else np.float64
    a = (RNG.standard_normal((5, 5)) + 5 * np.eye(5)).astype(npdt)
    b = RNG.standard_normal(rhs).astype(npdt)
    y = _graph_2(lambda g, x, w: g.dense_solve(x, w), a, b)
    assert y.dtype == npdt
    tol = 1e-5 if dtype == "f32" else 1e-12
    np.testing.assert_allclose(a @ y, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("rhs", [(3, 4), (3, 4, 2)])
def test_batched_dense_solve(dtype, rhs, x64):
    npdt = np.float32 if dtype == "f32" else np.float64
    a = (RNG.standard_normal((3, 4, 4)) + 4 * np.eye(4)).astype(npdt)
    b = RNG.standard_normal(rhs).astype(npdt)
    y = _graph_2(lambda g, x, w: g.batched_dense_solve(x, w), a, b)
    ref = np.stack([np.linalg.solve(a[i], b[i]) for i in range(3)])
    tol = 1e-4 if dtype == "f32" else 1e-11
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol)


def test_lora_matmul():
    x = RNG.standard_normal((2, 3, 6)).astype(np.float32)
    w = RNG.standard_normal((6, 5)).astype(np.float32)
    a = RNG.standard_normal((6, 2)).astype(np.float32)
    b = RNG.standard_normal((2, 5)).astype(np.float32)
    g = rlx.Graph("lora")
    ids = [g.input(n, list(v.shape), "f32") for n, v in zip("xwab", (x, w, a, b))]
    g.set_outputs([g.lora_matmul(*ids, 0.25)])
    (y,) = run(g, x=x, w=w, a=a, b=b)
    np.testing.assert_allclose(y, x @ w + 0.25 * (x @ a) @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("idx_dtype", ["f32", "i32"])
def test_grouped_matmul_matches_per_token_reference(idx_dtype):
    m, k, n, e = 11, 6, 5, 4
    x = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((e, k, n)).astype(np.float32)
    idx = RNG.integers(0, e, m)
    idx[:3] = 2  # an expert with several tokens; some experts may get none
    g = rlx.Graph("moe")
    ix = g.input("x", [m, k], "f32")
    iw = g.input("w", [e, k, n], "f32")
    ii = g.input("idx", [m], idx_dtype)
    g.set_outputs([g.grouped_matmul(ix, iw, ii)])
    f = rlx.to_jax(g)
    iv = idx.astype(np.float32 if idx_dtype == "f32" else np.int32)
    (y,) = f({}, {"x": x, "w": w, "idx": iv})
    ref = np.stack([x[i] @ w[idx[i]] for i in range(m)])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    # gradients w.r.t. x and w match the per-token formula
    def loss(x, w):
        return jnp.sum(f({}, {"x": x, "w": w, "idx": iv})[0] ** 2)

    def ref_loss(x, w):
        return jnp.sum(jnp.einsum("mk,mkn->mn", x, w[idx]) ** 2)

    gx, gw = jax.grad(loss, (0, 1))(x, w)
    rx, rw = jax.grad(ref_loss, (0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-4)


def test_grouped_matmul_does_not_gather_weights_per_token():
    m, k, n, e = 64, 8, 8, 4
    g = rlx.Graph("moe")
    ix = g.input("x", [m, k], "f32")
    iw = g.input("w", [e, k, n], "f32")
    ii = g.input("idx", [m], "i32")
    g.set_outputs([g.grouped_matmul(ix, iw, ii)])
    f = rlx.to_jax(g)
    jaxpr = str(jax.make_jaxpr(lambda x, w, i: f({}, {"x": x, "w": w, "idx": i}))(
        jnp.zeros((m, k)), jnp.zeros((e, k, n)), jnp.zeros(m, jnp.int32)))
    assert "ragged_dot" in jaxpr
    assert f"{m},{k},{n}" not in jaxpr.replace(" ", "")  # no [M, K, N] per-token weights


def test_scatter_add_of_integers():
    """Integer updates sum exactly in their dtype; indices past the last row clip to it,
    before the first to row 0, as the floating-point kernel's."""
    upd = np.arange(18, dtype=np.int32).reshape(6, 3) - 5
    idx = np.array([0, 2, 2, 9, -3, 2], np.int32)
    g = rlx.Graph("sai")
    g.set_outputs([g.scatter_add(g.input("u", [6, 3], "i32"), g.input("i", [6], "i32"), [5, 3])])
    (y,) = rlx.to_jax(g)({}, {"u": upd, "i": idx})
    assert y.dtype == np.int32
    ref = np.zeros((5, 3), np.int32)
    np.add.at(ref, np.clip(idx, 0, 4), upd)
    np.testing.assert_array_equal(np.asarray(y), ref)


def test_scatter_add_accumulates_duplicates():
    upd = RNG.standard_normal((6, 3)).astype(np.float32)
    idx = np.array([0, 2, 2, 4, 0, 2], np.float32)
    g = rlx.Graph("sa")
    iu = g.input("u", [6, 3], "f32")
    ii = g.input("i", [6], "f32")
    g.set_outputs([g.scatter_add(iu, ii, [5, 3])])
    (y,) = run(g, u=upd, i=idx)
    ref = np.zeros((5, 3), np.float32)
    np.add.at(ref, idx.astype(int), upd)
    np.testing.assert_allclose(y, ref, rtol=1e-6)
