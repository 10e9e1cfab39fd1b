"""``swiglu_linear`` (``swiglu(gate, up) @ weight``): values and gradients against a NumPy
float64 oracle, every autodiff mode, vmap, control flow, shared inputs, errors; the
backward keeps no copy of the product (its residuals are gate, up and weight) and runs
the kernel rlx_swiglu_bwd_product, which writes the product again. Runs on the default
backend (CPU here, GPU on a GPU machine). Sharded execution is in tests/sharding_check.py
(cases swiglu_linear_tp, swiglu_linear_rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import swiglu, swiglu_linear
from rlx_jax.vjp_rules._primitive import fused_ops
from testutil import check_relative_close, hlo_text, numpy_swiglu, platform

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (gate shape, O): a tail of 5 after the CPU kernel's 16-element blocks; rank 1; an empty
# leading axis; F = 0 (y is zeros, dW is [0, O]); three CPU kernel tasks (2 x 40001)
SHAPES = [((3, 7, 33), 5), ((9,), 4), ((0, 6), 3), ((4, 0), 3), ((2, 40001), 2)]
# relative Frobenius error allowed against the f64 oracle: a few roundings of the dtype
# (the product, the matmul's output, dh, the gradients)
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.0**-6, jnp.float16: 2.0**-8, jnp.float64: 1e-12}


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    """f32 matmuls in full f32 on every backend (on a GPU JAX's default precision runs them in
    TF32, whose rounding the tolerances here do not allow); tests/test_swiglu_gpu.py checks
    the default precision."""
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(shape, out, dtype, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    f = shape[-1]
    a = (3.0 * jax.random.normal(k[0], shape, jnp.float32)).astype(dtype)
    b = jax.random.normal(k[1], shape, jnp.float32).astype(dtype)
    w = (jax.random.normal(k[2], (f, out), jnp.float32) / np.sqrt(max(f, 1))).astype(dtype)
    dy = jax.random.normal(k[3], (*shape[:-1], out), jnp.float32).astype(dtype)
    return a, b, w, dy


def numpy_swiglu_linear(a, b, w, dy):
    """(y, da, db, dw) in float64."""
    w, dy = np.asarray(w, np.float64), np.asarray(dy, np.float64)
    h = numpy_swiglu(a, b)
    dh = dy @ w.T
    _, da, db = numpy_swiglu(a, b, dh)
    lead = tuple(range(h.ndim - 1))
    dw = np.tensordot(h, dy, axes=(lead, lead))
    return h @ w, da, db, dw


def _vjp(a, b, w, dy):
    y, pullback = jax.vjp(swiglu_linear, a, b, w)
    return (y, *pullback(dy))


def _close(got, want, dtype, what=""):
    check_relative_close(got, want, dtype, RTOL[jnp.dtype(dtype).type], what)


# ---- what the backward keeps and runs -------------------------------------------------


def test_residuals_are_the_inputs_not_the_product(capsys):
    """Reverse mode keeps gate, up and weight: nothing else the size of the product (the
    composition swiglu(a, b) @ w keeps the product too)."""
    a, b, w, _ = _inputs((4, 6, 32), 5, jnp.float32)
    print_saved_residuals(swiglu_linear, a, b, w)
    ours = capsys.readouterr().out.strip().splitlines()
    print_saved_residuals(lambda a, b, w: swiglu(a, b) @ w, a, b, w)
    composed = capsys.readouterr().out.strip().splitlines()
    assert sum("f32[4,6,32]" in line for line in ours) == 2, ours
    assert sum("f32[4,6,32]" in line for line in composed) == 3, composed
    assert len(ours) == 3, ours


def test_kernel_runs_in_reverse_mode_only():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert "rlx_swiglu_bwd_product_v1" in info["targets"]
    a, b, w, _ = _inputs((4, 8), 3, jnp.float32)
    loss = lambda a, b, w: jnp.sum(jnp.sin(swiglu_linear(a, b, w)))
    assert "rlx_swiglu_bwd_product" in hlo_text(jax.grad(loss, (0, 1, 2)), a, b, w)
    assert "custom_call" not in hlo_text(swiglu_linear, a, b, w)
    assert "custom_call" not in hlo_text(lambda *x: jax.jvp(swiglu_linear, x, x), a, b, w)
    with fused_ops(False):
        assert "custom_call" not in hlo_text(jax.grad(loss, (0, 1, 2)), a, b, w)


def test_mlp_backward_writes_dgate_and_dup_over_gate_and_up():
    """In an MLP's backward the kernel writes dgate over the gate product's buffer and dup
    over the up product's (output_to_operand_aliasing), and XLA needs no copy of either:
    the products are dead after the SwiGLU backward, so the step holds two [N, F] buffers
    fewer there."""
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    n, d, f = 64, 16, 48
    x = jax.random.normal(k[0], (n, d))
    wg, wu = (jax.random.normal(kk, (d, f)) for kk in k[1:3])
    wd = jax.random.normal(k[3], (f, d))
    loss = lambda x, wg, wu, wd: jnp.sum(jnp.sin(swiglu_linear(x @ wg, x @ wu, wd)))
    text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(x, wg, wu, wd).compile().as_text()
    calls = [line for line in text.splitlines() if "rlx_swiglu_bwd_product" in line and "custom-call(" in line]
    assert len(calls) == 1, calls
    assert "output_to_operand_aliasing={{0}: (0, {}), {1}: (1, {})}" in calls[0], calls[0]
    copies = [line for line in text.splitlines() if f"f32[{n},{f}]" in line and " copy(" in line]
    assert not copies, copies


def test_inputs_are_not_overwritten_by_the_in_place_backward():
    """gate and up passed straight to a compiled gradient (entry parameters, not donated)
    keep their values: XLA copies them before the kernel writes over its operands; and a
    gate that feeds another op after the SwiGLU backward reads its own values there."""
    a, b, w, dy = _inputs((5, 24), 7, jnp.float32, seed=4)
    a0, b0 = np.array(a), np.array(b)
    grads = jax.jit(jax.grad(lambda a, b, w: jnp.sum(swiglu_linear(a, b, w) * dy), (0, 1, 2)))(a, b, w)
    _, want_da, want_db, want_dw = numpy_swiglu_linear(a, b, w, dy)
    for got, want in zip(grads, (want_da, want_db, want_dw)):
        _close(got, want, jnp.float32)
    np.testing.assert_array_equal(np.asarray(a), a0)
    np.testing.assert_array_equal(np.asarray(b), b0)
    # the gate's second use multiplies dgate's cotangent path by the gate itself
    got = jax.jit(jax.grad(lambda a: jnp.sum(swiglu_linear(a, b, w) * dy) + jnp.sum(a * a)))(a)
    _close(got, want_da + 2 * np.asarray(a, np.float64), jnp.float32)


def test_fused_ops_off_gives_the_same_gradients():
    a, b, w, dy = _inputs((6, 10), 7, jnp.float32, seed=1)
    got = jax.jit(_vjp)(a, b, w, dy)
    with fused_ops(False):
        want = jax.jit(_vjp)(a, b, w, dy)
    for g, r in zip(got, want):
        _close(g, r, jnp.float32)


# ---- values against NumPy float64 ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape, out", SHAPES, ids=str)
def test_values_and_gradients_match_numpy(shape, out, dtype):
    a, b, w, dy = _inputs(shape, out, dtype, seed=sum(shape) + out)
    got = jax.jit(_vjp)(a, b, w, dy)
    want = numpy_swiglu_linear(a, b, w, dy)
    for g, r, name in zip(got, want, ("y", "da", "db", "dw")):
        _close(g, r, dtype, name)


def test_float64_values_and_gradients(x64):
    a, b, w, dy = _inputs((3, 7, 33), 5, jnp.float64, seed=3)
    if platform() == "cpu":  # f64 kernel on the CPU; CUDA lowers the reference for f64
        assert "rlx_swiglu_bwd_product" in hlo_text(_vjp, a, b, w, dy)
    for g, r, name in zip(jax.jit(_vjp)(a, b, w, dy), numpy_swiglu_linear(a, b, w, dy), ("y", "da", "db", "dw")):
        _close(g, r, jnp.float64, name)


def test_jvp_matches_numpy(x64):
    a, b, w, _ = _inputs((5, 12), 4, jnp.float64, seed=4)
    ta, tb, tw, _ = _inputs((5, 12), 4, jnp.float64, seed=5)
    y, ty = jax.jit(lambda *x: jax.jvp(swiglu_linear, x[:3], x[3:]))(a, b, w, ta, tb, tw)
    A, B = np.asarray(a), np.asarray(b)
    s = 1.0 / (1.0 + np.exp(-A))
    th = np.asarray(ta) * B * s * (1 + A * (1 - s)) + np.asarray(tb) * A * s
    _close(y, A * s * B @ np.asarray(w), jnp.float64)
    _close(ty, th @ np.asarray(w) + (A * s * B) @ np.asarray(tw), jnp.float64)


def test_check_grads_second_order_fwd_and_rev(x64):
    a, b, w, _ = _inputs((3, 4, 5), 3, jnp.float64, seed=6)
    check_grads(swiglu_linear, (a, b, w), order=2, modes=("fwd", "rev"))
    check_grads(lambda a, b, w: jnp.sum(jnp.sin(swiglu_linear(a, b, w))), (a, b, w), order=2, modes=("fwd", "rev"))


def test_hessian_against_the_composition(x64):
    a, b, w, _ = _inputs((2, 3), 2, jnp.float64, seed=7)
    f = lambda a, b, w: jnp.sum(jnp.tanh(swiglu_linear(a, b, w)))
    g = lambda a, b, w: jnp.sum(jnp.tanh((jax.nn.silu(a) * b) @ w))
    for hess in (jax.hessian, lambda f: jax.jacfwd(jax.grad(f, (0, 1, 2)), (0, 1, 2))):
        got, want = hess(f)(a, b, w), hess(g)(a, b, w)
        for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-10, atol=1e-12)


def test_mixed_dtypes_promote_and_gradients_keep_input_dtypes():
    a, b, w, _ = _inputs((4, 16), 3, jnp.float32, seed=8)
    a, w = a.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y = swiglu_linear(a, b, w)
    assert y.dtype == jnp.float32
    da, db, dw = jax.grad(lambda a, b, w: jnp.sum(swiglu_linear(a, b, w)), (0, 1, 2))(a, b, w)
    assert (da.dtype, db.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32, jnp.bfloat16)
    dy = jnp.ones(y.shape)
    want = numpy_swiglu_linear(a.astype(jnp.float32), b, w.astype(jnp.float32), dy)
    _close(y, want[0], jnp.float32)
    for g, r in zip((da, db, dw), want[1:]):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err <= 2.0**-6, err


# ---- vmap -------------------------------------------------------------------------------


def test_vmap_with_a_shared_weight_keeps_the_kernel():
    a, b, w, dy = _inputs((3, 5, 16), 4, jnp.float32, seed=9)
    vg = jax.vmap(_vjp, in_axes=(1, 1, None, 1))
    assert "rlx_swiglu_bwd_product" in hlo_text(vg, a, b, w, dy)
    y, da, db, dw = jax.jit(vg)(a, b, w, dy)
    for i in range(5):
        want = numpy_swiglu_linear(a[:, i], b[:, i], w, dy[:, i])
        for g, r in zip((y[i], da[i], db[i], dw[i]), want):
            _close(g, r, jnp.float32)


def test_vmap_with_a_batched_weight_and_an_unbatched_up():
    a, b, _, dy = _inputs((4, 6, 8), 3, jnp.float32, seed=10)
    w = jax.random.normal(jax.random.PRNGKey(11), (4, 8, 3))
    y, da, db, dw = jax.jit(jax.vmap(_vjp, in_axes=(0, None, 0, 0)))(a, b[0], w, dy)
    for i in range(4):
        want = numpy_swiglu_linear(a[i], b[0], w[i], dy[i])
        for g, r in zip((y[i], da[i], db[i], dw[i]), want):
            _close(g, r, jnp.float32)


def test_jacfwd_and_jacrev_agree(x64):
    a, b, w, _ = _inputs((2, 5), 3, jnp.float64, seed=12)
    for arg in range(3):
        fwd = jax.jacfwd(swiglu_linear, arg)(a, b, w)
        rev = jax.jacrev(swiglu_linear, arg)(a, b, w)
        np.testing.assert_allclose(np.asarray(fwd), np.asarray(rev), rtol=1e-12, atol=1e-12)


# ---- compositions: scan, remat, shared inputs ------------------------------------------


def _mlp_stack(down):
    """grad of a stack of residual SwiGLU MLP layers under lax.scan; ``down(a, b, w)`` is
    the SwiGLU and the down projection."""
    def loss(x, wg, wu, wd):
        def layer(h, w):
            g, u, d = w
            return h + down(h @ g, h @ u, d), None

        h, _ = jax.lax.scan(layer, x, (wg, wu, wd))
        return jnp.sum(jnp.sin(h))

    return jax.grad(loss, (0, 1, 2, 3))


def test_inside_scan(x64):
    k = jax.random.split(jax.random.PRNGKey(15), 4)
    x = jax.random.normal(k[0], (5, 8), jnp.float64)
    wg = jax.random.normal(k[1], (3, 8, 16), jnp.float64) / 3
    wu = jax.random.normal(k[2], (3, 8, 16), jnp.float64) / 3
    wd = jax.random.normal(k[3], (3, 16, 8), jnp.float64) / 4
    ours = _mlp_stack(swiglu_linear)
    assert "rlx_swiglu_bwd_product" in hlo_text(ours, *(t.astype(jnp.float32) for t in (x, wg, wu, wd)))
    want = _mlp_stack(lambda g, u, d: (jax.nn.silu(g) * u) @ d)(x, wg, wu, wd)
    for got, r in zip(jax.jit(ours)(x, wg, wu, wd), want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(r), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable], ids=["default", "nothing"])
def test_under_checkpoint(x64, policy):
    a, b, w, dy = _inputs((6, 7), 3, jnp.float64, seed=16)
    f = jax.checkpoint(lambda a, b, w: jnp.sin(swiglu_linear(a, b, w)), policy=policy)
    got = jax.jit(jax.grad(lambda a, b, w: jnp.sum(f(a, b, w) * dy), (0, 1, 2)))(a, b, w)
    y = numpy_swiglu_linear(a, b, w, dy)[0]
    want = numpy_swiglu_linear(a, b, w, np.asarray(dy) * np.cos(y))[1:]
    for g, r in zip(got, want):
        _close(g, r, jnp.float64)


def test_same_tensor_as_gate_and_up(x64):
    x, _, w, dy = _inputs((4, 9), 2, jnp.float64, seed=17)
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(swiglu_linear(x, x, w) * dy), (0, 1)))(x, w)
    _, da, db, dw = numpy_swiglu_linear(x, x, w, dy)
    _close(got[0], da + db, jnp.float64)
    _close(got[1], dw, jnp.float64)


def test_gate_and_weight_also_feed_other_ops(x64):
    """loss = sum(swiglu_linear(g, u, w) * dy) + sum(cos(g)) + sum(w^2): cotangents add up."""
    g, u, w, dy = _inputs((3, 11), 11, jnp.float64, seed=18)
    loss = lambda g, u, w: jnp.sum(swiglu_linear(g, u, w) * dy) + jnp.sum(jnp.cos(g)) + jnp.sum(w * w)
    dg, du, dw = jax.jit(jax.grad(loss, (0, 1, 2)))(g, u, w)
    _, da, db, dwant = numpy_swiglu_linear(g, u, w, dy)
    _close(dg, da - np.sin(np.asarray(g)), jnp.float64)
    _close(du, db, jnp.float64)
    _close(dw, dwant + 2 * np.asarray(w), jnp.float64)


@pytest.mark.parametrize("argnums", [(2,), (0,), (1, 2)], ids=str)
def test_some_inputs_differentiated(argnums):
    a, b, w, dy = _inputs((5, 6), 4, jnp.float32, seed=19)
    got = jax.jit(jax.grad(lambda a, b, w: jnp.sum(swiglu_linear(a, b, w) * dy), argnums))(a, b, w)
    want = numpy_swiglu_linear(a, b, w, dy)[1:]
    for g, i in zip(got, argnums):
        _close(g, want[i], jnp.float32)


def test_deterministic_bitwise():
    a, b, w, dy = _inputs((64, 96), 32, jnp.bfloat16, seed=20)
    f = jax.jit(_vjp)
    first = f(a, b, w, dy)
    for _ in range(2):
        for x, y in zip(first, f(a, b, w, dy)):
            assert np.array_equal(np.asarray(x.view(jnp.uint16)), np.asarray(y.view(jnp.uint16)))


# ---- errors -------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    a = jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"weight must be \[F, O\] with F = gate's last axis 4"):
        swiglu_linear(a, a, jnp.ones((5, 2)))
    with pytest.raises(ValueError, match=r"weight must be \[F, O\]"):
        swiglu_linear(a, a, jnp.ones(4))
    with pytest.raises(ValueError, match="same shape"):
        swiglu_linear(a, jnp.ones((3, 5)), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="rank >= 1"):
        swiglu_linear(jnp.ones(()), jnp.ones(()), jnp.ones((1, 2)))
    with pytest.raises(TypeError, match="weight must be floating"):
        swiglu_linear(a, a, jnp.ones((4, 2), jnp.int32))
    with pytest.raises(TypeError, match="gate must be floating"):
        swiglu_linear(jnp.ones((3, 4), jnp.int32), a, jnp.ones((4, 2)))


def test_product_kernel_gradients_are_bitwise_the_plain_kernels():
    """rlx_swiglu_bwd_product writes the (da, db) of rlx_swiglu_bwd bit for bit, and the
    forward's product within one rounding."""
    from rlx_jax.vjp_rules.swiglu import swiglu_bwd, swiglu_bwd_product

    for dtype in DTYPES:
        a, b, _, _ = _inputs((7, 45), 3, dtype, seed=23)
        dh = jax.random.normal(jax.random.PRNGKey(24), a.shape).astype(dtype)
        da, db, h = jax.jit(swiglu_bwd_product)(a, b, dh)
        pda, pdb = jax.jit(swiglu_bwd)(a, b, dh)
        np.testing.assert_array_equal(np.asarray(da), np.asarray(pda))
        np.testing.assert_array_equal(np.asarray(db), np.asarray(pdb))
        _close(h, numpy_swiglu(a, b), dtype, "h")


def test_handler_rejects_a_mis_shaped_product():
    x = jnp.zeros((4, 8), jnp.float32)
    out = (jax.ShapeDtypeStruct((4, 8), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((4, 7), jnp.float32),)
    call = jax.ffi.ffi_call("rlx_swiglu_bwd_product_v1", out)
    with pytest.raises(Exception, match="h has shape"):
        jax.block_until_ready(jax.jit(lambda x: call(x, x, x))(x))
