"""SwiGLU (``silu(gate) * up``): values and gradients against a NumPy float64 oracle,
every autodiff mode, vmap, control flow, infinities, errors; the backward runs the
fused kernel rlx_swiglu_bwd and the forward stays XLA's. Runs on the default backend
(CPU here, GPU on a GPU machine; tests/test_swiglu_gpu.py covers the CUDA kernel's
paths). Sharded execution is in tests/sharding_check.py (cases swiglu, swiglu_mixed_specs,
swiglu_mlp)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import swiglu, swiglu_backward
from rlx_jax.vjp_rules._primitive import fused_ops
from testutil import check_swiglu_bwd_over_every_bit_pattern, check_swiglu_close, hlo_text, numpy_swiglu, platform

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (3, 7, 33): 693 elements, a tail of 5 after the CPU kernel's 16-element blocks;
# (2, 40001): three CPU tasks of up to 2^15 elements, a tail of 2 in the last; (0, 5),
# (5, 0, 3): empty
SHAPES = [(3, 7, 33), (1,), (), (0, 5), (5, 0, 3), (2, 40001)]
# per-element error allowed, relative to |value| plus the same fraction of max |value|:
# one rounding to the dtype after f32 arithmetic (f64 for f64)
RTOL = {jnp.float32: 4e-6, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-10, jnp.float64: 1e-13}


def _inputs(shape, dtype, seed=0, scale=3.0):
    ka, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    a = (scale * jax.random.normal(ka, shape, jnp.float32)).astype(dtype)
    b = jax.random.normal(kb, shape, jnp.float32).astype(dtype)
    dh = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return a, b, dh


def _check(got, want, dtype, what=""):
    check_swiglu_close(got, want, dtype, RTOL[jnp.dtype(dtype).type], what)


def _vjp(a, b, dh):
    h, pullback = jax.vjp(swiglu, a, b)
    return (h, *pullback(dh))


# ---- the kernel runs in reverse mode, the forward stays XLA's ---------------------


def test_kernel_is_registered_and_runs_in_reverse_mode_only():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert "rlx_swiglu_bwd_v1" in info["targets"]
    a, b, _ = _inputs((4, 8), jnp.float32)
    loss = lambda a, b: jnp.sum(jnp.sin(swiglu(a, b)))
    grad_text = hlo_text(jax.grad(loss, (0, 1)), a, b)
    assert "rlx_swiglu_bwd" in grad_text
    # the forward alone, and forward mode, are plain XLA ops (no custom call: they fuse
    # with their neighbours)
    assert "custom_call" not in hlo_text(swiglu, a, b)
    assert "custom_call" not in hlo_text(lambda a, b: jax.jvp(swiglu, (a, b), (b, a)), a, b)
    with fused_ops(False):
        plain = hlo_text(jax.grad(loss, (0, 1)), a, b)
    assert "rlx_swiglu" not in plain and "custom_call" not in plain


def test_backward_runs_in_place_and_leaves_its_callers_arrays_alone():
    """rlx_swiglu_bwd writes dgate over gate's buffer and dup over up's; arrays passed in
    (compiled gradient, eager swiglu_backward) keep their values, XLA copying them first."""
    a, b, dh = _inputs((4, 40), jnp.float32, seed=2)
    text = hlo_text(jax.grad(lambda a, b: jnp.sum(swiglu(a, b) * dh), (0, 1)), a, b)
    call = [line for line in text.splitlines() if "rlx_swiglu_bwd" in line and "custom_call" in line]
    assert len(call) == 1 and "output_operand_aliases" in call[0], call
    a0, b0, d0 = np.array(a), np.array(b), np.array(dh)
    _, want_da, want_db = numpy_swiglu(a, b, dh)
    for got in (jax.jit(jax.grad(lambda a, b: jnp.sum(swiglu(a, b) * dh), (0, 1)))(a, b), swiglu_backward(a, b, dh)):
        _check(got[0], want_da, jnp.float32)
        _check(got[1], want_db, jnp.float32)
        for arr, before in ((a, a0), (b, b0), (dh, d0)):
            np.testing.assert_array_equal(np.asarray(arr), before)


def test_fused_ops_off_gives_the_same_gradients():
    a, b, dh = _inputs((6, 10), jnp.float32, seed=1)
    got = jax.jit(_vjp)(a, b, dh)
    with fused_ops(False):
        want = jax.jit(_vjp)(a, b, dh)
    for g, w in zip(got, want):
        _check(g, w, jnp.float32)


# ---- values against NumPy float64 ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values_and_gradients_match_numpy(shape, dtype):
    a, b, dh = _inputs(shape, dtype, seed=sum(shape) + 2)
    h, da, db = jax.jit(_vjp)(a, b, dh)
    want_h, want_da, want_db = numpy_swiglu(a.astype(jnp.float32), b.astype(jnp.float32), dh.astype(jnp.float32))
    _check(h, want_h, dtype, "h")
    _check(da, want_da, dtype, "da")
    _check(db, want_db, dtype, "db")
    bda, bdb = jax.jit(swiglu_backward)(a, b, dh)
    _check(bda, want_da, dtype, "swiglu_backward da")
    _check(bdb, want_db, dtype, "swiglu_backward db")


@pytest.mark.parametrize("shape", [(3, 7, 33), (), (0, 5)], ids=str)
def test_float64_values_and_gradients(x64, shape):
    a, b, dh = _inputs(shape, jnp.float64, seed=3)
    if platform() == "cpu":  # f64 kernel on the CPU; CUDA lowers the reference for f64
        assert "rlx_swiglu_bwd" in hlo_text(_vjp, a, b, dh)
    h, da, db = jax.jit(_vjp)(a, b, dh)
    want = numpy_swiglu(a, b, dh)
    for got, w, name in zip((h, da, db), want, ("h", "da", "db")):
        _check(got, w, jnp.float64, name)


def test_jvp_matches_numpy():
    a, b, ta = _inputs((5, 12), jnp.float32, seed=4)
    tb = jax.random.normal(jax.random.PRNGKey(9), a.shape)
    h, th = jax.jit(lambda a, b, ta, tb: jax.jvp(swiglu, (a, b), (ta, tb)))(a, b, ta, tb)
    A, B = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = 1.0 / (1.0 + np.exp(-A))
    want = np.asarray(ta) * B * s * (1 + A * (1 - s)) + np.asarray(tb) * A * s
    _check(h, numpy_swiglu(a, b), jnp.float32)
    _check(th, want, jnp.float32)


def test_check_grads_second_order_fwd_and_rev(x64):
    a, b, _ = _inputs((3, 4, 5), jnp.float64, seed=5, scale=2.0)
    check_grads(swiglu, (a, b), order=2, modes=("fwd", "rev"))
    check_grads(lambda a, b: jnp.sum(jnp.sin(swiglu(a, b))), (a, b), order=2, modes=("fwd", "rev"))


def test_hessian_matches_numpy(x64):
    """d^2/da^2 of sum(swiglu(a, b)) is diagonal: b s' (2 + a (1 - 2 s)), s' = s (1 - s)."""
    a, b, _ = _inputs((7,), jnp.float64, seed=6)
    f = lambda a: jnp.sum(swiglu(a, b))
    A, B = np.asarray(a), np.asarray(b)
    s = 1.0 / (1.0 + np.exp(-A))
    want = np.diag(B * s * (1 - s) * (2 + A * (1 - 2 * s)))
    for hess in (jax.hessian(f), jax.jacfwd(jax.grad(f)), jax.jacrev(jax.grad(f))):
        np.testing.assert_allclose(np.asarray(hess(a)), want, rtol=1e-12, atol=1e-12)


def test_swiglu_backward_matches_vjp_of_plain_jax():
    a, b, dh = _inputs((4, 9, 3), jnp.float32, seed=7)
    want = jax.vjp(lambda a, b: jax.nn.silu(a) * b, a, b)[1](dh)
    got = swiglu_backward(a, b, dh)
    for g, w in zip(got, want):
        _check(g, w, jnp.float32)


def test_mixed_dtypes_promote_and_gradients_keep_input_dtypes():
    a, b, dh = _inputs((3, 8), jnp.bfloat16, seed=8)
    b32 = b.astype(jnp.float32)
    h = swiglu(a, b32)
    assert h.dtype == jnp.float32
    _check(h, numpy_swiglu(a.astype(jnp.float32), b32), jnp.float32)
    da, db = jax.grad(lambda a, b: jnp.sum(swiglu(a, b) * dh.astype(jnp.float32)), (0, 1))(a, b32)
    assert da.dtype == jnp.bfloat16 and db.dtype == jnp.float32
    _, want_da, want_db = numpy_swiglu(a.astype(jnp.float32), b32, dh.astype(jnp.float32))
    _check(da, want_da, jnp.bfloat16)
    _check(db, want_db, jnp.float32)
    bda, bdb = swiglu_backward(a, b32, dh)
    assert bda.dtype == jnp.bfloat16 and bdb.dtype == jnp.float32


# ---- vmap ----------------------------------------------------------------------------


def test_vmap_of_grad_batched_gate_only():
    a, _, dh = _inputs((4, 3, 6), jnp.float32, seed=10)
    b = jax.random.normal(jax.random.PRNGKey(11), (3, 6))
    loss = lambda a, b, dh: jnp.sum(swiglu(a, b) * dh)
    fn = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None, 0))
    assert "rlx_swiglu_bwd" in hlo_text(fn, a, b, dh)
    da, db = jax.jit(fn)(a, b, dh)
    _, want_da, want_db = numpy_swiglu(a, np.broadcast_to(b, a.shape), dh)
    _check(da, want_da, jnp.float32)
    _check(db, want_db, jnp.float32)  # per example: [4, 3, 6]


def test_vmap_of_grad_both_batched_other_axes():
    a = 3.0 * jax.random.normal(jax.random.PRNGKey(12), (3, 5, 6))  # batch axis 1
    b = jax.random.normal(jax.random.PRNGKey(13), (3, 6, 5))  # batch axis 2
    loss = lambda a, b: jnp.sum(jnp.tanh(swiglu(a, b)))
    fn = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(1, 2), out_axes=(1, 2))
    assert "rlx_swiglu_bwd" in hlo_text(fn, a, b)
    da, db = jax.jit(fn)(a, b)
    bt = np.moveaxis(np.asarray(b, np.float64), 2, 1)  # b laid out like a
    h = numpy_swiglu(a, bt)
    dh = 1.0 - np.tanh(h) ** 2
    _, want_da, want_db = numpy_swiglu(a, bt, dh)
    _check(da, want_da, jnp.float32)
    _check(db, np.moveaxis(want_db, 1, 2), jnp.float32)


def test_grad_of_vmap_and_vmap_of_forward():
    a, b, dh = _inputs((4, 3, 6), jnp.float32, seed=14)
    _check(jax.vmap(swiglu, in_axes=(1, 1), out_axes=1)(a, b), numpy_swiglu(a, b), jnp.float32)
    loss = lambda a, b: jnp.sum(jax.vmap(swiglu)(a, b) * dh)
    fn = jax.grad(loss, (0, 1))
    assert "rlx_swiglu_bwd" in hlo_text(fn, a, b)
    for got, want in zip(jax.jit(fn)(a, b), numpy_swiglu(a, b, dh)[1:]):
        _check(got, want, jnp.float32)


# ---- compositions: scan, remat, shared inputs -----------------------------------------


def test_inside_scan(x64):
    """A stack of SwiGLU MLP layers under lax.scan: gradients equal plain JAX's (f64)."""
    k = jax.random.split(jax.random.PRNGKey(15), 4)
    x = jax.random.normal(k[0], (5, 8), jnp.float64)
    wg = jax.random.normal(k[1], (3, 8, 16), jnp.float64) / 3
    wu = jax.random.normal(k[2], (3, 8, 16), jnp.float64) / 3
    wd = jax.random.normal(k[3], (3, 16, 8), jnp.float64) / 4

    def net(act):
        def loss(x, wg, wu, wd):
            def layer(h, w):
                g, u, d = w
                return h + act(h @ g, h @ u) @ d, None

            h, _ = jax.lax.scan(layer, x, (wg, wu, wd))
            return jnp.sum(jnp.sin(h))

        return jax.grad(loss, (0, 1, 2, 3))

    ours = net(swiglu)
    # the kernel in the scan body (checked in f32: CUDA has no f64 kernel, f64 runs the reference there)
    assert "rlx_swiglu_bwd" in hlo_text(ours, *(a.astype(jnp.float32) for a in (x, wg, wu, wd)))
    want = net(lambda g, u: jax.nn.silu(g) * u)(x, wg, wu, wd)
    for got, w in zip(jax.jit(ours)(x, wg, wu, wd), want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable], ids=["default", "nothing"])
def test_under_checkpoint(x64, policy):
    a, b, dh = _inputs((6, 7), jnp.float64, seed=16)
    f = jax.checkpoint(lambda a, b: jnp.sin(swiglu(a, b)), policy=policy)
    loss = lambda a, b: jnp.sum(f(a, b) * dh)
    # the kernel under remat (checked in f32: CUDA runs the reference for f64)
    f32 = lambda a, b: jnp.sum(f(a, b) * dh.astype(jnp.float32))
    assert "rlx_swiglu_bwd" in hlo_text(jax.grad(f32, (0, 1)), a.astype(jnp.float32), b.astype(jnp.float32))
    got = jax.jit(jax.grad(loss, (0, 1)))(a, b)
    h = numpy_swiglu(a, b)
    _, want_da, want_db = numpy_swiglu(a, b, np.asarray(dh) * np.cos(h))
    _check(got[0], want_da, jnp.float64)
    _check(got[1], want_db, jnp.float64)


def test_same_tensor_as_gate_and_up(x64):
    """swiglu(x, x) = x^2 s: d/dx = da + db."""
    x, _, dh = _inputs((4, 9), jnp.float64, seed=17)
    got = jax.jit(jax.grad(lambda x: jnp.sum(swiglu(x, x) * dh)))(x)
    _, da, db = numpy_swiglu(x, x, dh)
    _check(got, da + db, jnp.float64)


def test_gate_also_feeds_another_op(x64):
    """loss = sum(swiglu(g, u) * g + cos(g)): the gate's cotangents add up."""
    g, u, _ = _inputs((3, 11), jnp.float64, seed=18)
    dg, du = jax.jit(jax.grad(lambda g, u: jnp.sum(swiglu(g, u) * g + jnp.cos(g)), (0, 1)))(g, u)
    G = np.asarray(g)
    h, da, db = numpy_swiglu(g, u, G)  # the upstream gradient of swiglu is g itself
    _check(dg, da + h - np.sin(G), jnp.float64)
    _check(du, db, jnp.float64)


def test_only_one_input_differentiated():
    a, b, dh = _inputs((5, 6), jnp.float32, seed=19)
    loss = lambda a, b: jnp.sum(swiglu(a, b) * dh)
    _, want_da, want_db = numpy_swiglu(a, b, dh)
    _check(jax.jit(jax.grad(loss, 0))(a, b), want_da, jnp.float32)
    _check(jax.jit(jax.grad(loss, 1))(a, b), want_db, jnp.float32)


# ---- infinities and large gates -----------------------------------------------------

GATES = [-np.inf, np.inf, -100.0, 100.0, -30.0, 30.0, -1.0, 0.0, 2.0]


def _limits(b, dh):
    """(h, da, db) at the gates above for up = b and dh: the limits at +-inf (a s -> 0 at
    -inf; a s (1 - s) -> 0 at both ends), NumPy float64 elsewhere."""
    a = np.array(GATES)
    with np.errstate(over="ignore", invalid="ignore"):
        h, da, db = numpy_swiglu(a, b, dh)
    h[0], da[0], db[0] = 0.0, 0.0, 0.0
    h[1], da[1], db[1] = np.inf * np.sign(b[1]), dh[1] * b[1], np.inf * np.sign(dh[1])
    return h, da, db


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_infinite_and_large_gates_give_the_limits(dtype):
    n = len(GATES)
    b = np.linspace(0.5, 1.5, n) * np.where(np.arange(n) % 2, -1.0, 1.0)
    dh = np.linspace(-1.25, 2.0, n)
    b, dh = (np.asarray(jnp.asarray(v, dtype).astype(jnp.float32), np.float64) for v in (b, dh))
    a = jnp.asarray(GATES, dtype)
    h, da, db = jax.jit(_vjp)(a, jnp.asarray(b, dtype), jnp.asarray(dh, dtype))
    want = _limits(b, dh)
    for got, w, name in zip((h, da, db), want, ("h", "da", "db")):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        assert not np.isnan(got).any(), (name, got)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(w), err_msg=name)
        fin = np.isfinite(w)
        # underflow to 0 (or a subnormal) where the value is below the dtype's smallest normal
        np.testing.assert_allclose(got[fin], w[fin], rtol=RTOL[jnp.dtype(dtype).type] * 2,
                                   atol=float(jnp.finfo(dtype).tiny), err_msg=name)
        np.testing.assert_array_equal(got[~fin], w[~fin], err_msg=name)
    # the fused backward called directly agrees
    for got, w in zip(swiglu_backward(a, jnp.asarray(b, dtype), jnp.asarray(dh, dtype)), (da, db)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_infinite_gates_give_the_limits_in_every_mode(fused):
    """Reverse mode, forward mode in a or b alone, and under fused_ops(False) (JAX
    differentiating the reference): the limits at a = +-inf, not NaN. Forward mode in a
    alone leaves b's tangent a symbolic zero, which adds nothing even where a s = inf."""
    n = len(GATES)
    a = jnp.asarray(GATES, jnp.float32)
    b = jnp.asarray(np.linspace(0.5, 1.5, n) * np.where(np.arange(n) % 2, -1.0, 1.0), jnp.float32)
    dh = jnp.asarray(np.linspace(-1.25, 2.0, n), jnp.float32)
    _, da, db = _limits(np.asarray(b, np.float64), np.asarray(dh, np.float64))
    with fused_ops(fused):
        got_a, got_b = jax.grad(lambda a, b: jnp.sum(swiglu(a, b) * dh), (0, 1))(a, b)
        ta = jax.jvp(lambda a: swiglu(a, b), (a,), (dh,))[1]
        tb = jax.jvp(lambda u: swiglu(a, u), (b,), (dh,))[1]
    for got, want, name in ((got_a, da, "da"), (got_b, db, "db"), (ta, da, "jvp in a"), (tb, db, "jvp in b")):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any(), (name, got)
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-30, err_msg=name)
        np.testing.assert_array_equal(got[~fin], want[~fin], err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_16bit_conversions_over_every_bit_pattern(dtype):
    """At gate = 30, s = 1 and a s (1 - s) is below half an ulp of 1 in f32, so da = dh * up
    and db = 30 dh, exact f32 products rounded once to the dtype. Over all 2^16 bit
    patterns of dh (zeros, subnormals, normals, values whose products overflow, infinities,
    NaN; 7 more at the end for a tail block), the kernel's loads and its round to nearest
    even must give NumPy's rounding of the same products. up = 1 + one ulp makes rounding
    ties and carries; bf16 subnormals (f32 subnormals, which a kernel may flush) are
    left out."""
    check_swiglu_bwd_over_every_bit_pattern(dtype, jnp.asarray)


def test_nan_propagates():
    a = jnp.array([1.0, jnp.nan, -2.0])
    h, da, db = _vjp(a, jnp.ones(3), jnp.ones(3))
    for v in (h, da, db):
        v = np.asarray(v)
        assert np.isnan(v[1]) and np.isfinite(v[[0, 2]]).all()


# ---- errors, determinism --------------------------------------------------------------


def test_mismatched_shapes_name_both():
    with pytest.raises(ValueError, match=r"swiglu: gate \(3, 4\) and up \(3, 5\) must have the same shape"):
        swiglu(jnp.ones((3, 4)), jnp.ones((3, 5)))
    with pytest.raises(ValueError, match=r"gate \(4,\) and up \(1, 4\)"):
        swiglu(jnp.ones(4), jnp.ones((1, 4)))  # no broadcasting
    with pytest.raises(ValueError, match=r"swiglu_backward: dh shape \(3,\) differs from gate shape \(4,\)"):
        swiglu_backward(jnp.ones(4), jnp.ones(4), jnp.ones(3))


@pytest.mark.parametrize("args, name", [((jnp.ones(3, jnp.int32), jnp.ones(3)), "gate"),
                                        ((jnp.ones(3), jnp.ones(3, jnp.int32)), "up"),
                                        ((jnp.ones(3), jnp.ones(3, bool)), "up"),
                                        ((jnp.ones(3, jnp.complex64), jnp.ones(3)), "gate")])
def test_non_float_dtypes_raise_type_error(args, name):
    with pytest.raises(TypeError, match=f"swiglu: {name} must be floating point"):
        swiglu(*args)
    with pytest.raises(TypeError, match=f"swiglu_backward: {name} must be floating point"):
        swiglu_backward(*args, jnp.ones(3))
    with pytest.raises(TypeError, match="swiglu_backward: dh must be floating point"):
        swiglu_backward(jnp.ones(3), jnp.ones(3), jnp.ones(3, jnp.int32))


def test_deterministic_bitwise():
    a, b, dh = _inputs((300, 1000), jnp.float32, seed=20)
    f = jax.jit(_vjp)
    first = [np.asarray(v) for v in f(a, b, dh)]
    for _ in range(3):
        for x, y in zip(first, f(a, b, dh)):
            np.testing.assert_array_equal(x, np.asarray(y))
