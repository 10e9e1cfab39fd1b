"""``rms_norm_linear`` and ``add_rms_norm_linear`` (RMSNorm, optionally after the residual
add, then one or more matmuls): values and gradients against a NumPy float64 oracle,
every autodiff mode, vmap, control flow, shared inputs, errors; the backward keeps no
copy of the normalised input (its residuals are x or s, the parameters and the weights)
and recomputes it with the norm's forward kernel. Runs on the default backend. Sharded
execution is in tests/sharding_check.py (cases rms_norm_linear_tp, add_rms_norm_linear_rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.test_util import check_grads

from rlx_jax.ops import add_rms_norm, add_rms_norm_linear, rms_norm, rms_norm_linear
from rlx_jax.vjp_rules._primitive import fused_ops
from testutil import as_f64, check_relative_close, hlo_text

EPS = 1e-5
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (x shape, output widths of the weights): a row width off the kernels' vector widths; rank
# 1; no rows; one weight; outputs wider than the row (dy from products added one by one,
# the others' from one product of the concatenated weights)
SHAPES = [((3, 7, 33), (5, 3)), ((9,), (4, 4, 2)), ((0, 6), (3,)), ((2, 5, 64), (16,)), ((4, 6), (9, 7))]
# relative Frobenius error allowed against the f64 oracle: a few roundings of the dtype
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.0**-6, jnp.float16: 2.0**-8, jnp.float64: 1e-12}


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    """f32 matmuls in full f32 on every backend (a GPU's default precision is TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(shape, outs, dtype, seed=0, beta=True):
    k = jax.random.split(jax.random.PRNGKey(seed), 6 + 2 * len(outs))
    h = shape[-1]
    x = jax.random.normal(k[0], shape, jnp.float32).astype(dtype)
    r = jax.random.normal(k[1], shape, jnp.float32).astype(dtype)
    g = (1.0 + 0.5 * jax.random.normal(k[2], (h,), jnp.float32)).astype(dtype)
    b = (0.5 * jax.random.normal(k[3], (h,), jnp.float32)).astype(dtype) if beta else None
    ds = jax.random.normal(k[4], shape, jnp.float32).astype(dtype)
    ws = tuple((jax.random.normal(k[6 + i], (h, o), jnp.float32) / np.sqrt(h)).astype(dtype)
               for i, o in enumerate(outs))
    douts = tuple(jax.random.normal(k[6 + len(outs) + i], (*shape[:-1], o), jnp.float32).astype(dtype)
                  for i, o in enumerate(outs))
    return x, r, g, b, ws, ds, douts


def numpy_norm_linear(x, r, g, b, ws, ds, douts):
    """float64 (s, outs, dx, dg, db, dws) of s = x + r (r None: s = x), y = s / rms(s) g + b,
    out_i = y W_i, for the loss <s, ds> + sum_i <out_i, dout_i> (ds None: 0)."""
    s = as_f64(x) + (0.0 if r is None else as_f64(r))
    g = as_f64(g)
    b = 0.0 if b is None else as_f64(b)
    ws, douts = [as_f64(w) for w in ws], [as_f64(d) for d in douts]
    inv = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
    y = s * inv * g + b
    dy = sum(d @ w.T for w, d in zip(ws, douts))
    u = dy * g
    dx = inv * u - s * inv**3 * np.sum(u * s, axis=-1, keepdims=True) / s.shape[-1]
    if ds is not None:
        dx = dx + as_f64(ds)
    lead = tuple(range(s.ndim - 1))
    dws = [np.tensordot(y, d, axes=(lead, lead)) for d in douts]
    return s, [y @ w for w in ws], dx, np.sum(dy * s * inv, axis=lead), np.sum(dy, axis=lead), dws


def _close(got, want, dtype, what=""):
    check_relative_close(got, want, dtype, RTOL[jnp.dtype(dtype).type], what)


def _vjp_plain(x, g, b, ws, douts):
    """outs and (dx, dg, db, dws) of rms_norm_linear."""
    outs, pull = jax.vjp(lambda x, g, b, ws: rms_norm_linear(x, g, ws, b, eps=EPS), x, g, b, ws)
    return outs, pull(tuple(douts))


def _vjp_add(x, r, g, b, ws, ds, douts):
    """(s, outs) and (dx, dr, dg, db, dws) of add_rms_norm_linear."""
    fn = lambda x, r, g, b, ws: add_rms_norm_linear(x, r, g, ws, b, eps=EPS)  # noqa: E731
    out, pull = jax.vjp(fn, x, r, g, b, ws)
    return out, pull((ds, tuple(douts)))


# ---- what the backward keeps and runs -------------------------------------------------


def _residual_lines(capsys, fn, *args):
    print_saved_residuals(fn, *args)
    return capsys.readouterr().out.strip().splitlines()


def test_residuals_are_the_inputs_not_the_normalised_x(capsys):
    x, r, g, _, ws, _, _ = _inputs((4, 6, 32), (16, 8), jnp.float32)
    big = "f32[4,6,32]"
    ours = _residual_lines(capsys, lambda x, g, ws: rms_norm_linear(x, g, ws), x, g, ws)
    composed = _residual_lines(capsys, lambda x, g, ws: [rms_norm(x, g) @ w for w in ws], x, g, ws)
    assert sum(big in line for line in ours) == 1, ours  # x only
    assert sum(big in line for line in composed) >= 2, composed  # x and y (listed once per matmul)
    ours = _residual_lines(capsys, lambda x, r, g, ws: add_rms_norm_linear(x, r, g, ws), x, r, g, ws)
    composed = _residual_lines(capsys, lambda x, r, g, ws: (lambda s, y: (s, [y @ w for w in ws]))(
        *add_rms_norm(x, r, g)), x, r, g, ws)
    assert sum(big in line for line in ours) == 1, ours  # s only
    assert sum(big in line for line in composed) >= 2, composed  # s and y


def test_kernels_in_the_backward():
    x, r, g, _, ws, _, _ = _inputs((4, 8, 32), (16, 8), jnp.float32)
    loss = lambda x, g, ws: sum(jnp.sum(jnp.sin(o)) for o in rms_norm_linear(x, g, ws))  # noqa: E731
    text = hlo_text(jax.grad(loss, (0, 1, 2)), x, g, ws)
    # the forward's norm and its recomputation in the backward, then the fused backward
    assert text.count("rlx_rms_norm_fwd") == 2 and "rlx_rms_norm_bwd" in text, text.count("rlx_rms_norm_fwd")
    add_loss = lambda x, r, g, ws: (lambda s, o: jnp.sum(jnp.cos(s)) + jnp.sum(jnp.sin(o[0])))(  # noqa: E731
        *add_rms_norm_linear(x, r, g, ws))
    text = hlo_text(jax.grad(add_loss, (0, 1, 2, 3)), x, r, g, ws)
    assert text.count("rlx_rms_norm_fwd") == 2 and "rlx_add_rms_norm_bwd" in text
    with fused_ops(False):
        assert "rlx_" not in hlo_text(jax.grad(loss, (0, 1, 2)), x, g, ws)


def test_fused_ops_off_gives_the_same_gradients():
    x, r, g, b, ws, ds, douts = _inputs((6, 10), (7, 3), jnp.float32, seed=1)
    got = jax.jit(_vjp_add)(x, r, g, b, ws, ds, douts)
    with fused_ops(False):
        want = jax.jit(_vjp_add)(x, r, g, b, ws, ds, douts)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(a, w, jnp.float32)


# ---- values against NumPy float64 ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape, outs", SHAPES, ids=str)
def test_values_and_gradients_match_numpy(shape, outs, dtype):
    x, r, g, b, ws, ds, douts = _inputs(shape, outs, dtype, seed=sum(shape) + len(outs))
    got_outs, (dx, dg, db, dws) = jax.jit(_vjp_plain)(x, g, b, ws, douts)
    _, w_outs, w_dx, w_dg, w_db, w_dws = numpy_norm_linear(x, None, g, b, ws, None, douts)
    for name, a, w in [("dx", dx, w_dx), ("dg", dg, w_dg), ("db", db, w_db),
                       *zip(("out",) * len(ws), got_outs, w_outs), *zip(("dw",) * len(ws), dws, w_dws)]:
        _close(a, w, dtype, name)
    (s, got_outs), (dx, dr, dg, db, dws) = jax.jit(_vjp_add)(x, r, g, b, ws, ds, douts)
    w_s, w_outs, w_dx, w_dg, w_db, w_dws = numpy_norm_linear(x, r, g, b, ws, ds, douts)
    for name, a, w in [("s", s, w_s), ("dx", dx, w_dx), ("dr", dr, w_dx), ("dg", dg, w_dg), ("db", db, w_db),
                       *zip(("out",) * len(ws), got_outs, w_outs), *zip(("dw",) * len(ws), dws, w_dws)]:
        _close(a, w, dtype, name)


def test_single_weight_returns_an_array_and_beta_is_optional():
    x, r, g, _, ws, ds, douts = _inputs((5, 12), (4,), jnp.float32, seed=2, beta=False)
    out = rms_norm_linear(x, g, ws[0], eps=EPS)
    assert isinstance(out, jax.Array) and out.shape == (5, 4)
    s, out = add_rms_norm_linear(x, r, g, ws[0], eps=EPS)
    assert isinstance(out, jax.Array)
    w = numpy_norm_linear(x, r, g, None, ws, ds, douts)
    _close(s, w[0], jnp.float32)
    _close(out, w[1][0], jnp.float32)
    dx, dw = jax.grad(lambda x, w: jnp.sum(rms_norm_linear(x, g, w, eps=EPS) * douts[0]), (0, 1))(x, ws[0])
    w = numpy_norm_linear(x, None, g, None, ws, None, douts)
    _close(dx, w[2], jnp.float32)
    _close(dw, w[5][0], jnp.float32)


def test_float64_check_grads_second_order(x64):
    x, r, g, b, ws, _, _ = _inputs((3, 4, 6), (3, 2), jnp.float64, seed=3)
    check_grads(lambda x, g, b, w0, w1: rms_norm_linear(x, g, (w0, w1), b, eps=EPS), (x, g, b, *ws),
                order=2, modes=("fwd", "rev"))
    check_grads(lambda x, r, g, b, w0, w1: add_rms_norm_linear(x, r, g, (w0, w1), b, eps=EPS), (x, r, g, b, *ws),
                order=2, modes=("fwd", "rev"))


def test_jvp_matches_numpy_finite_differences(x64):
    x, r, g, b, ws, _, _ = _inputs((4, 9), (3,), jnp.float64, seed=4)
    tx, tr, tg, tb, tws, _, _ = _inputs((4, 9), (3,), jnp.float64, seed=5)
    fn = lambda x, r, g, b, w: add_rms_norm_linear(x, r, g, w, b, eps=EPS)  # noqa: E731
    primals, tangents = (x, r, g, b, ws[0]), (tx, tr, tg, tb, tws[0])
    (s, out), (ts, tout) = jax.jit(lambda p, t: jax.jvp(fn, p, t))(primals, tangents)
    e = 1e-6
    plus = numpy_norm_linear(*(np.asarray(p) + e * np.asarray(t) for p, t in zip(primals[:4], tangents[:4])),
                             [np.asarray(ws[0]) + e * np.asarray(tws[0])], None, [np.zeros((4, 3))])
    minus = numpy_norm_linear(*(np.asarray(p) - e * np.asarray(t) for p, t in zip(primals[:4], tangents[:4])),
                              [np.asarray(ws[0]) - e * np.asarray(tws[0])], None, [np.zeros((4, 3))])
    np.testing.assert_allclose(np.asarray(ts), (plus[0] - minus[0]) / (2 * e), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(np.asarray(tout), (plus[1][0] - minus[1][0]) / (2 * e), rtol=1e-6, atol=1e-8)


def test_hessian_against_the_composition(x64):
    x, r, g, _, ws, _, _ = _inputs((2, 4), (2,), jnp.float64, seed=6)
    f = lambda x, g, w: jnp.sum(jnp.tanh(add_rms_norm_linear(x, r, g, w, eps=EPS)[1]))  # noqa: E731
    h = lambda x, g, w: jnp.sum(jnp.tanh(add_rms_norm(x, r, g, eps=EPS)[1] @ w))  # noqa: E731
    for hess in (jax.hessian, lambda f: jax.jacrev(jax.grad(f, (0, 1, 2)), (0, 1, 2))):
        got, want = hess(f)(x, g, ws[0]), hess(h)(x, g, ws[0])
        for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-9, atol=1e-11)


def test_mixed_dtypes_promote_and_gradients_keep_input_dtypes():
    x, r, g, _, ws, _, _ = _inputs((4, 16), (3,), jnp.float32, seed=7)
    xb, wb = x.astype(jnp.bfloat16), ws[0].astype(jnp.bfloat16)
    s, out = add_rms_norm_linear(xb, r, g, wb, eps=EPS)
    assert s.dtype == jnp.float32 and out.dtype == jnp.float32
    grads = jax.grad(lambda x, r, g, w: jnp.sum(add_rms_norm_linear(x, r, g, w, eps=EPS)[1]), (0, 1, 2, 3))(
        xb, r, g, wb)
    assert [d.dtype for d in grads] == [jnp.bfloat16, jnp.float32, jnp.float32, jnp.bfloat16]


# ---- partial use of the outputs ----------------------------------------------------------


def test_only_the_sum_or_only_some_projections_used():
    x, r, g, b, ws, ds, douts = _inputs((5, 12), (4, 3), jnp.float32, seed=8)
    fn = lambda x, r, g, b, w0, w1: add_rms_norm_linear(x, r, g, (w0, w1), b, eps=EPS)  # noqa: E731
    only_s = jax.grad(lambda *a: jnp.sum(fn(*a)[0] * ds), (0, 1, 2, 3, 4, 5))(x, r, g, b, *ws)
    np.testing.assert_allclose(np.asarray(only_s[0]), np.asarray(ds))
    np.testing.assert_allclose(np.asarray(only_s[1]), np.asarray(ds))
    for d in only_s[2:]:
        assert not np.asarray(d).any()
    second = jax.grad(lambda *a: jnp.sum(fn(*a)[1][1] * douts[1]), (0, 2, 4, 5))(x, r, g, b, *ws)
    want = numpy_norm_linear(x, r, g, b, ws, None, [jnp.zeros_like(douts[0]), douts[1]])
    _close(second[0], want[2], jnp.float32)
    _close(second[1], want[3], jnp.float32)
    assert not np.asarray(second[2]).any()
    _close(second[3], want[5][1], jnp.float32)


@pytest.mark.parametrize("argnums", [(3,), (0,), (1, 2)], ids=str)
def test_some_inputs_differentiated(argnums):
    x, _, g, b, ws, _, douts = _inputs((5, 6), (4,), jnp.float32, seed=9)
    loss = lambda x, g, b, w: jnp.sum(rms_norm_linear(x, g, w, b, eps=EPS) * douts[0])  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums))(x, g, b, ws[0])
    _, _, dx, dg, db, dws = numpy_norm_linear(x, None, g, b, ws, None, douts)
    want = (dx, dg, db, dws[0])
    for a, i in zip(got, argnums):
        _close(a, want[i], jnp.float32)


# ---- vmap ----------------------------------------------------------------------------------


def test_vmap_with_shared_parameters_keeps_the_kernels():
    x, r, g, b, ws, ds, douts = _inputs((3, 5, 16), (4, 2), jnp.float32, seed=10)
    fn = jax.vmap(_vjp_add, in_axes=(1, 1, None, None, None, 1, 1))
    text = hlo_text(fn, x, r, g, b, ws, ds, douts)
    assert "rlx_rms_norm_fwd" in text and "rlx_add_rms_norm_bwd" in text
    (s, outs), (dx, dr, dg, db, dws) = jax.jit(fn)(x, r, g, b, ws, ds, douts)
    for i in range(5):
        w = numpy_norm_linear(x[:, i], r[:, i], g, b, ws, ds[:, i], [d[:, i] for d in douts])
        _close(s[i], w[0], jnp.float32)
        _close(dx[i], w[2], jnp.float32)
        _close(dg[i], w[3], jnp.float32)
        for a, ww in zip(dws, w[5]):
            _close(a[i], ww, jnp.float32)


def test_vmap_with_batched_weights():
    x, _, g, b, _, _, _ = _inputs((4, 6, 8), (3,), jnp.float32, seed=11)
    w = jax.random.normal(jax.random.PRNGKey(12), (4, 8, 3))
    dout = jax.random.normal(jax.random.PRNGKey(13), (4, 6, 3))
    outs, (dx, dg, db, dws) = jax.jit(jax.vmap(_vjp_plain, in_axes=(0, None, None, 0, 0)))(x, g, b, (w,), (dout,))
    for i in range(4):
        want = numpy_norm_linear(x[i], None, g, b, [w[i]], None, [dout[i]])
        _close(outs[0][i], want[1][0], jnp.float32)
        _close(dx[i], want[2], jnp.float32)
        _close(dws[0][i], want[5][0], jnp.float32)


def test_jacfwd_and_jacrev_agree(x64):
    x, r, g, b, ws, _, _ = _inputs((2, 5), (3,), jnp.float64, seed=14)
    fn = lambda x, g, w: add_rms_norm_linear(x, r, g, w, b, eps=EPS)[1]  # noqa: E731
    for arg in range(3):
        fwd = jax.jacfwd(fn, arg)(x, g, ws[0])
        rev = jax.jacrev(fn, arg)(x, g, ws[0])
        np.testing.assert_allclose(np.asarray(fwd), np.asarray(rev), rtol=1e-12, atol=1e-12)


# ---- compositions: a decoder stack under scan and remat ------------------------------------


def _stack(ours):
    """grad of a scanned stack of pre-norm blocks: s, (a, b) = add_norm_linear(s, branch,
    g, (wa, wb)); branch = tanh(a) * b @ wo, the stream carried through s."""
    def loss(x, g, wa, wb, wo):
        def block(carry, p):
            s, branch = carry
            g, wa, wb, wo = p
            if ours:
                s, (a, b) = add_rms_norm_linear(s, branch, g, (wa, wb), eps=EPS)
            else:
                s, y = add_rms_norm(s, branch, g, eps=EPS)
                a, b = y @ wa, y @ wb
            return (s, (jnp.tanh(a) * b) @ wo), None

        (s, branch), _ = jax.lax.scan(block, (x, jnp.zeros_like(x)), (g, wa, wb, wo))
        return jnp.sum(jnp.sin(s + branch))

    return jax.grad(loss, (0, 1, 2, 3, 4))


def test_inside_scan(x64):
    k = jax.random.split(jax.random.PRNGKey(15), 5)
    x = jax.random.normal(k[0], (5, 8), jnp.float64)
    g = 1 + 0.1 * jax.random.normal(k[1], (3, 8), jnp.float64)
    wa, wb = (jax.random.normal(kk, (3, 8, 6), jnp.float64) / 3 for kk in k[2:4])
    wo = jax.random.normal(k[4], (3, 6, 8), jnp.float64) / 3
    args = (x, g, wa, wb, wo)
    assert "rlx_add_rms_norm_bwd" in hlo_text(_stack(True), *(a.astype(jnp.float32) for a in args))
    for got, want in zip(jax.jit(_stack(True))(*args), _stack(False)(*args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable], ids=["default", "nothing"])
def test_under_checkpoint(x64, policy):
    x, r, g, b, ws, ds, douts = _inputs((6, 7), (3,), jnp.float64, seed=16)
    f = jax.checkpoint(lambda x, r, g, w: add_rms_norm_linear(x, r, g, w, b, eps=EPS), policy=policy)
    loss = lambda x, r, g, w: (lambda s, o: jnp.sum(s * ds) + jnp.sum(o * douts[0]))(*f(x, r, g, w))  # noqa: E731
    dx, dr, dg, dw = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(x, r, g, ws[0])
    _, _, w_dx, w_dg, _, w_dws = numpy_norm_linear(x, r, g, b, ws, ds, douts)
    for a, w in ((dx, w_dx), (dr, w_dx), (dg, w_dg), (dw, w_dws[0])):
        _close(a, w, jnp.float64)


def test_same_tensor_as_x_and_residual(x64):
    x, _, g, b, ws, ds, douts = _inputs((4, 9), (2,), jnp.float64, seed=17)
    loss = lambda x, w: (lambda s, o: jnp.sum(s * ds) + jnp.sum(o * douts[0]))(  # noqa: E731
        *add_rms_norm_linear(x, x, g, w, b, eps=EPS))
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, ws[0])
    _, _, w_dx, _, _, w_dws = numpy_norm_linear(x, x, g, b, ws, ds, douts)
    _close(dx, 2 * w_dx, jnp.float64)
    _close(dw, w_dws[0], jnp.float64)


def test_deterministic_bitwise():
    x, r, g, b, ws, ds, douts = _inputs((64, 96), (32, 16), jnp.bfloat16, seed=18)
    f = jax.jit(_vjp_add)
    first = jax.tree.leaves(f(x, r, g, b, ws, ds, douts))
    for _ in range(2):
        for a, c in zip(first, jax.tree.leaves(f(x, r, g, b, ws, ds, douts))):
            assert np.array_equal(np.asarray(a.view(jnp.uint16)), np.asarray(c.view(jnp.uint16)))


# ---- errors -------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    x, g = jnp.ones((3, 4)), jnp.ones(4)
    with pytest.raises(ValueError, match=r"weights\[1\] must be \[H, O\] with H = x's last axis 4"):
        rms_norm_linear(x, g, (jnp.ones((4, 2)), jnp.ones((5, 2))))
    with pytest.raises(ValueError, match="non-empty"):
        rms_norm_linear(x, g, ())
    with pytest.raises(TypeError, match=r"weights\[0\] must be floating"):
        rms_norm_linear(x, g, jnp.ones((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="gamma must have shape"):
        rms_norm_linear(x, jnp.ones(3), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm_linear(x, jnp.ones((3, 5)), g, jnp.ones((4, 2)))
    with pytest.raises(TypeError, match="eps must be a static number"):
        jax.jit(lambda e: rms_norm_linear(x, g, jnp.ones((4, 2)), eps=e))(1e-5)
