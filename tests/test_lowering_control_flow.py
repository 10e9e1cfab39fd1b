"""Scan (trajectory, broadcast inputs, xs, checkpointing), ScanBackward(Xs), If, While,
CustomFn and Custom vs NumPy loops / jax references."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx

RNG = np.random.default_rng(6)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def step_body(shape):
    """body(c, b, x) = tanh(c * b + x)"""
    g = rlx.Graph("body")
    c = g.input("c", list(shape), "f32")
    b = g.input("b", list(shape), "f32")
    x = g.input("x", list(shape), "f32")
    g.set_outputs([g.tanh(g.add(g.mul(c, b), x))])
    return g


def scan_graph(shape, length, save=False, k=0):
    g = rlx.Graph("scan")
    init = g.input("init", list(shape), "f32")
    b = g.param("b", list(shape), "f32")
    xs = g.input("xs", [length, *shape], "f32")
    y = g.scan(init, step_body(shape), length, bcasts=[b], xs=[xs], save_trajectory=save,
               num_checkpoints=k)
    g.set_outputs([y])
    return g


def np_scan(init, b, xs):
    c, traj = init, []
    for x in xs:
        c = np.tanh(c * b + x)
        traj.append(c)
    return c, np.stack(traj)


@pytest.mark.parametrize("k", [0, 3])
def test_scan_final_and_trajectory(k):
    shape, length = (3, 5), 7
    init, b, xs = f32(*shape), f32(*shape), f32(length, *shape)
    final, traj = np_scan(init, b, xs)
    (y,) = rlx.to_jax(scan_graph(shape, length, False, k))({"b": b}, {"init": init, "xs": xs})
    np.testing.assert_allclose(y, final, rtol=1e-5, atol=1e-6)
    (t,) = rlx.to_jax(scan_graph(shape, length, True, k))({"b": b}, {"init": init, "xs": xs})
    rows = [i * length // k for i in range(k)] if k else list(range(length))
    np.testing.assert_allclose(t, traj[rows], rtol=1e-5, atol=1e-6)


def _loss_fn(graph):
    f = rlx.to_jax(graph)

    def loss(b, init, xs):
        return jnp.sum(f({"b": b}, {"init": init, "xs": xs})[0] ** 2)

    return loss


def test_checkpointed_scan_gradient_equals_plain_and_uses_less_memory():
    shape, length = (64, 64), 256
    init, b, xs = f32(*shape), f32(*shape) * 0.5, f32(length, *shape)
    plain = jax.jit(jax.grad(_loss_fn(scan_graph(shape, length, False, 0)), argnums=(0, 1, 2)))
    ckpt = jax.jit(jax.grad(_loss_fn(scan_graph(shape, length, False, 16)), argnums=(0, 1, 2)))
    for a, c in zip(plain(b, init, xs), ckpt(b, init, xs)):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)

    def temp_bytes(fn):
        return fn.lower(b, init, xs).compile().memory_analysis().temp_size_in_bytes

    mp, mc = temp_bytes(plain), temp_bytes(ckpt)
    carry = 64 * 64 * 4
    assert mc < mp / 3, (mp, mc)
    # O(K + L/K) carries: well below the L carries the plain scan keeps
    assert mc < (16 + length // 16 + 16) * carry * 2, (mc, carry)


def test_checkpointed_trajectory_gradient_equals_plain():
    shape, length = (4,), 10
    init, b, xs = f32(*shape), f32(*shape), f32(length, *shape)
    rows = [i * length // 4 for i in range(4)]
    f_plain = rlx.to_jax(scan_graph(shape, length, True, 0))
    f_ck = rlx.to_jax(scan_graph(shape, length, True, 4))

    def l_plain(b, xs):
        return jnp.sum(f_plain({"b": b}, {"init": init, "xs": xs})[0][np.array(rows)] ** 2)

    def l_ck(b, xs):
        return jnp.sum(f_ck({"b": b}, {"init": init, "xs": xs})[0] ** 2)

    for a, c in zip(jax.grad(l_plain, (0, 1))(b, xs), jax.grad(l_ck, (0, 1))(b, xs)):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def _vjp_body(shape):
    """body_vjp of body(c, x) = c * x + c: inputs c, x, d_output -> (dc, dx)."""
    g = rlx.Graph("body_vjp")
    c = g.input("c", list(shape), "f32")
    x = g.input("x", list(shape), "f32")
    d = g.input("d_output", list(shape), "f32")
    one = g.constant(np.ones(shape, np.float32))
    g.set_outputs([g.mul(d, g.add(x, one)), g.mul(d, c)])
    return g


def _fwd_body(shape):
    g = rlx.Graph("fwd")
    c = g.input("c", list(shape), "f32")
    x = g.input("x", list(shape), "f32")
    g.set_outputs([g.add(g.mul(c, x), c)])
    return g


@pytest.mark.parametrize("mode", ["all_rows", "recompute"])
def test_scan_backward_and_xs_match_jax_grad(mode):
    shape, length = (3,), 6
    init, xs = f32(*shape), f32(length, *shape) * 0.5

    def fwd(init, xs):
        def step(c, x):
            n = c * x + c
            return n, n
        return jax.lax.scan(step, init, xs)[1]

    traj = np.asarray(fwd(init, xs))
    up = f32(length, *shape)
    d_init, d_xs = jax.vjp(fwd, init, xs)[1](jnp.asarray(up))

    g = rlx.Graph("sb")
    i0 = g.input("init", list(shape), "f32")
    it = g.input("traj", [length, *shape], "f32")
    iu = g.input("up", [length, *shape], "f32")
    ix = g.input("xs", [length, *shape], "f32")
    if mode == "all_rows":
        kw = dict(num_checkpoints=0, forward_body=None)
        traj_in = traj
    else:  # checkpointed: the carries are recomputed from init with forward_body
        kw = dict(num_checkpoints=2, forward_body=_fwd_body(shape))
        traj_in = np.full_like(traj, np.nan)[:length]
    di = g.scan_backward(i0, it, iu, [ix], _vjp_body(shape), length, True, **kw)
    dx = g.scan_backward_xs(i0, it, iu, [ix], _vjp_body(shape), length, True, 0, **kw)
    g.set_outputs([di, dx])
    got_i, got_x = rlx.to_jax(g)({}, {"init": init, "traj": traj_in, "up": up, "xs": xs})
    np.testing.assert_allclose(got_i, d_init, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_x, d_xs, rtol=1e-5, atol=1e-6)


def test_scan_backward_checkpoint_rows_upstream():
    # RLX's checkpointed layout: trajectory/upstream with K rows floor(t * L / K)
    from rlx_jax.lowering.control_flow import _scan_backward_all
    from rlx_jax.lowering.registry import LoweringContext
    from rlx_jax.ir import OP_CLASSES

    shape, length, k = (3,), 6, 2
    init, xs = f32(*shape), f32(length, *shape) * 0.5
    rows = [t * length // k for t in range(k)]

    def fwd(init, xs):
        return jax.lax.scan(lambda c, x: (c * x + c, c * x + c), init, xs)[1]

    up_k = f32(k, *shape)
    up_full = np.zeros((length, *shape), np.float32)
    up_full[rows] = up_k
    d_init, d_xs = jax.vjp(fwd, init, xs)[1](jnp.asarray(up_full))
    op = OP_CLASSES["ScanBackward"](body_vjp=_vjp_body(shape), length=length, save_trajectory=True,
                                    num_xs=1, num_checkpoints=k, forward_body=_fwd_body(shape))
    traj_k = np.asarray(fwd(init, xs))[rows]
    di, dxs = _scan_backward_all(op, [init, traj_k, up_k, xs], LoweringContext())
    np.testing.assert_allclose(di, d_init, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dxs[0], d_xs, rtol=1e-5, atol=1e-6)


def _branch(fn_name):
    g = rlx.Graph(fn_name)
    x = g.input("x", [3], "f32")
    y = g.input("y", [3], "f32")
    g.set_outputs([g.mul(x, y) if fn_name == "then" else g.sub(x, y)])
    return g


def test_if_picks_branch_and_differentiates():
    g = rlx.Graph("if")
    p = g.input("p", [1], "bool")
    x = g.input("x", [3], "f32")
    y = g.input("y", [3], "f32")
    g.set_outputs([g.if_(p, _branch("then"), _branch("else"), [x, y])])
    f = rlx.to_jax(g)
    x0, y0 = f32(3), f32(3)
    np.testing.assert_allclose(f({}, {"p": np.array([True]), "x": x0, "y": y0})[0], x0 * y0, rtol=1e-6)
    np.testing.assert_allclose(f({}, {"p": np.array([False]), "x": x0, "y": y0})[0], x0 - y0, rtol=1e-6)
    gr = jax.grad(lambda x: jnp.sum(f({}, {"p": np.array([True]), "x": x, "y": y0})[0]))(x0)
    np.testing.assert_allclose(gr, y0, rtol=1e-6)


def _while_graph(max_iterations):
    cond = rlx.Graph("cond")
    x = cond.input("x", [2], "f32")
    n = cond.input("n", [], "f32")
    cond.set_outputs([cond.lt_(cond.sum(x, [0]), cond.scalar(50.0))])
    body = rlx.Graph("body")
    x = body.input("x", [2], "f32")
    n = body.input("n", [], "f32")
    body.set_outputs([body.mul(x, body.scalar(2.0)), body.add(n, body.scalar(1.0))])
    g = rlx.Graph("while")
    x0 = g.input("x", [2], "f32")
    n0 = g.input("n", [], "f32")
    g.set_outputs([g.while_([x0, n0], cond, body, max_iterations)])
    return g


@pytest.mark.parametrize("max_iterations", [None, 20, 3])
def test_while_loop_semantics(max_iterations):
    f = rlx.to_jax(_while_graph(max_iterations))
    x0 = np.array([1.0, 2.0], np.float32)
    x, n = x0.copy(), 0
    while x.sum() < 50 and (max_iterations is None or n < max_iterations):
        x, n = x * 2, n + 1
    np.testing.assert_allclose(f({}, {"x": x0, "n": np.float32(0)})[0], x)


def test_bounded_while_is_reverse_differentiable():
    f = rlx.to_jax(_while_graph(10))
    gr = jax.grad(lambda x: jnp.sum(f({}, {"x": x, "n": np.float32(0)})[0]))(jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(gr, [32.0, 32.0])  # 1+2 -> 96 after 5 doublings


def _square_body():
    g = rlx.Graph("fwd")
    x = g.input("x", [3], "f32")
    g.set_outputs([g.mul(x, x)])
    return g


def test_custom_fn_uses_vjp_and_jvp_bodies():
    vjp = rlx.Graph("vjp")
    x = vjp.input("x", [3], "f32")
    y = vjp.input("primal_output", [3], "f32")
    d = vjp.input("d_output", [3], "f32")
    vjp.set_outputs([vjp.mul(d, vjp.add(y, vjp.scalar(1.0)))])  # deliberately not 2x
    jvp = rlx.Graph("jvp")
    x = jvp.input("x", [3], "f32")
    t = jvp.input("tangent_0", [3], "f32")
    jvp.set_outputs([jvp.mul(t, jvp.scalar(7.0))])

    for kind in ("plain", "vjp", "jvp"):
        g = rlx.Graph("cf")
        xi = g.input("x", [3], "f32")
        g.set_outputs([g.custom_fn([xi], _square_body(), vjp if kind == "vjp" else None,
                                   jvp if kind == "jvp" else None)])
        f = rlx.to_jax(g)
        x0 = np.array([1.0, 2.0, -3.0], np.float32)
        np.testing.assert_allclose(f({}, {"x": x0})[0], x0 * x0)
        gr = jax.grad(lambda x: jnp.sum(f({}, {"x": x})[0]))(x0)
        want = {"plain": 2 * x0, "vjp": x0 * x0 + 1, "jvp": np.full(3, 7.0)}[kind]
        np.testing.assert_allclose(gr, want, rtol=1e-6)
        if kind != "vjp":
            _, tan = jax.jvp(lambda x: f({}, {"x": x})[0], (x0,), (np.ones(3, np.float32),))
            np.testing.assert_allclose(tan, {"plain": 2 * x0, "jvp": np.full(3, 7.0)}[kind])


def test_custom_op_through_registry():
    from rlx_jax.ir import register_op
    from rlx_jax.ir.registry import unregister_op

    register_op("lowering_test_axpy", lambda shapes, attrs: shapes[0],
                lowering=lambda args, attrs, ctx: args[0] * float(attrs.decode()) + args[1])
    try:
        g = rlx.Graph("custom")
        a = g.input("a", [4], "f32")
        b = g.input("b", [4], "f32")
        g.set_outputs([g.custom("lowering_test_axpy", [a, b], b"3")])
        a0, b0 = f32(4), f32(4)
        np.testing.assert_allclose(rlx.to_jax(g)({}, {"a": a0, "b": b0})[0], 3 * a0 + b0, rtol=1e-6)
    finally:
        unregister_op("lowering_test_axpy")


def test_custom_op_without_lowering_is_a_clear_error():
    from rlx_jax.ir import register_op
    from rlx_jax.ir.registry import unregister_op

    register_op("lowering_test_nolower", lambda shapes, attrs: shapes[0])
    try:
        g = rlx.Graph("custom")
        a = g.input("a", [4], "f32")
        g.set_outputs([g.custom("lowering_test_nolower", [a])])
        with pytest.raises(NotImplementedError, match="lowering_test_nolower"):
            rlx.to_jax(g)({}, {"a": f32(4)})
    finally:
        unregister_op("lowering_test_nolower")
