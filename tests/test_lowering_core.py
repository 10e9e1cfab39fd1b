"""to_jax: the contract of the lowered function (purity, transforms, dynamic dims,
input checks) and the rule registry."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx
from rlx_jax.lowering import lowering_rule, registered_ops
from rlx_jax.lowering.core import evaluate_graph


def _mlp():
    g = rlx.Graph("mlp")
    x = g.input("x", ["batch", 4], "f32")
    w = g.param("w", [4, 3], "f32")
    b = g.param("b", [3], "f32")
    h = g.add(g.matmul(x, w), b)
    y = g.tanh(h)
    loss = g.mean(g.mul(y, y), [0, 1], False)
    g.set_outputs([loss, y])
    return g


def _np_mlp(p, x):
    y = np.tanh(x @ p["w"] + p["b"])
    return np.mean(y * y), y


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal((4, 3)).astype(np.float32),
         "b": rng.standard_normal(3).astype(np.float32)}
    x = rng.standard_normal((5, 4)).astype(np.float32)
    return p, x


def test_outputs_follow_graph_outputs(data):
    p, x = data
    loss, y = rlx.to_jax(_mlp())(p, {"x": x})
    ref_loss, ref_y = _np_mlp(p, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)


def test_dynamic_batch_runs_at_any_size(data):
    p, _ = data
    f = jax.jit(rlx.to_jax(_mlp()))
    for n in (1, 3, 17):
        x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
        _, y = f(p, {"x": x})
        assert y.shape == (n, 3)
        np.testing.assert_allclose(y, _np_mlp(p, x)[1], rtol=1e-5, atol=1e-6)


def test_grad_jit_vmap(data):
    p, x = data
    f = rlx.to_jax(_mlp())

    def loss(p):
        return f(p, {"x": x})[0]

    g = jax.jit(jax.grad(loss))(p)

    def ref(p):
        y = jnp.tanh(x @ p["w"] + p["b"])
        return jnp.mean(y * y)

    g_ref = jax.grad(ref)(p)
    for k in p:
        np.testing.assert_allclose(g[k], g_ref[k], rtol=1e-5, atol=1e-6)
    # vmap over a stack of inputs (each a [batch, 4] array)
    xs = np.stack([x, 2 * x])
    ys = jax.vmap(lambda xi: f(p, {"x": xi})[1])(xs)
    np.testing.assert_allclose(ys[1], _np_mlp(p, 2 * x)[1], rtol=1e-5, atol=1e-6)


def test_hessian_and_jvp(data):
    p, x = data
    f = rlx.to_jax(_mlp())

    def loss_b(b):
        return f({"w": p["w"], "b": b}, {"x": x})[0]

    def ref(b):
        y = jnp.tanh(x @ p["w"] + b)
        return jnp.mean(y * y)

    np.testing.assert_allclose(jax.hessian(loss_b)(p["b"]), jax.hessian(ref)(p["b"]),
                               rtol=1e-4, atol=1e-6)
    t = jnp.ones(3)
    _, tan = jax.jvp(loss_b, (p["b"],), (t,))
    _, tan_ref = jax.jvp(ref, (p["b"],), (t,))
    np.testing.assert_allclose(tan, tan_ref, rtol=1e-5)


def test_missing_extra_and_misshaped_inputs(data):
    p, x = data
    f = rlx.to_jax(_mlp())
    with pytest.raises(ValueError, match="missing input.*'x'"):
        f(p, {})
    with pytest.raises(ValueError, match="unexpected input.*'y'"):
        f(p, {"x": x, "y": x})
    with pytest.raises(ValueError, match="missing param.*'b'"):
        f({"w": p["w"]}, {"x": x})
    with pytest.raises(ValueError, match="'x'.*expected shape"):
        f(p, {"x": np.zeros((5, 5), np.float32)})
    with pytest.raises(ValueError, match="'x'.*rank"):
        f(p, {"x": np.zeros((20,), np.float32)})
    with pytest.raises(TypeError, match="'x'"):
        f(p, {"x": np.zeros((5, 4), np.complex64)})
    with pytest.raises(TypeError):
        f(p, ["x"])


def test_inconsistent_dynamic_dim_is_reported():
    g = rlx.Graph("two")
    a = g.input("a", ["batch", 2], "f32")
    b = g.input("b", ["batch", 2], "f32")
    g.set_outputs([g.add(a, b)])
    f = rlx.to_jax(g)
    with pytest.raises(ValueError, match="batch"):
        f({}, {"a": np.zeros((3, 2), np.float32), "b": np.zeros((4, 2), np.float32)})


def test_integer_input_refuses_floats_and_accepts_ints():
    g = rlx.Graph("ints")
    a = g.input("a", [3], "i32")
    g.set_outputs([g.add(a, a)])
    f = rlx.to_jax(g)
    with pytest.raises(TypeError, match="'a'"):
        f({}, {"a": np.zeros(3, np.float32)})
    out = f({}, {"a": np.array([1, 2, 3], np.int64)})[0]
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out, [2, 4, 6])


def test_constant_decodes_little_endian_bytes():
    g = rlx.Graph("c")
    c = g.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
    x = g.input("x", [2, 3], "f32")
    g.set_outputs([g.add(c, x)])
    out = rlx.to_jax(g)({}, {"x": np.ones((2, 3), np.float32)})[0]
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3) + 1)


def test_op_without_rule_fails_at_to_jax_naming_the_node(monkeypatch):
    from rlx_jax.lowering import registry

    registry._load_rules()
    monkeypatch.delitem(registry._RULES, rlx.ir.Softmax)
    g = rlx.Graph("u")
    x = g.input("x", [2], "f32")
    g.set_outputs([g.softmax(x, -1)])
    with pytest.raises(NotImplementedError, match="%1 Softmax"):
        rlx.to_jax(g)


def test_registry_rejects_a_second_rule_for_an_op():
    assert "MatMul" in registered_ops()
    with pytest.raises(ValueError, match="already registered"):
        @lowering_rule(rlx.ir.MatMul)
        def _other(op, args, ctx):  # pragma: no cover - never runs
            return args[0]


def test_registry_is_keyed_by_op_class():
    from rlx_jax.lowering import get_rule, has_rule

    op = rlx.ir.LayerNorm(axis=-1, eps=1e-5)
    assert has_rule(op) and has_rule(rlx.ir.LayerNorm) and has_rule("LayerNorm")
    assert not has_rule("NoSuchOp") and not has_rule(rlx.ir.Input)
    assert get_rule(op) is get_rule(rlx.ir.LayerNorm(axis=0, eps=0.1))
    # a name is not a class: registering by string is refused, naming what was given
    with pytest.raises(TypeError, match="Op classes, got 'LayerNorm'"):
        lowering_rule("LayerNorm")
    with pytest.raises(TypeError, match="Op classes"):
        lowering_rule(int)


def test_evaluate_graph_binds_body_inputs_by_position_and_name():
    g = rlx.Graph("body")
    a = g.input("a", [2], "f32")
    d = g.input("d_output", [2], "f32")
    b = g.input("b", [2], "f32")
    g.set_outputs([g.sub(g.mul(a, d), b)])
    one, two, three = (np.full(2, v, np.float32) for v in (1, 2, 3))
    out = evaluate_graph(g, {}, [one, three], named={"d_output": two})[0]
    np.testing.assert_array_equal(out, [-1, -1])


# Ops the lowering stage itself does not lower, and why (another stage may add them):
NOT_LOWERED = {
    "GaussianSplatRender": "Gaussian splatting has an issue of its own",
    "GaussianSplatRenderBackward": "Gaussian splatting has an issue of its own",
    "GaussianSplatPrepare": "Gaussian splatting has an issue of its own",
    "GaussianSplatRasterize": "Gaussian splatting has an issue of its own",
}


def test_every_ir_op_has_a_lowering_rule_or_a_stated_reason():
    from rlx_jax.ir import OP_CLASSES

    leaves = {"Input", "Param", "Constant"}
    missing = sorted(set(OP_CLASSES) - set(registered_ops()) - leaves - set(NOT_LOWERED))
    assert not missing, f"IR ops without a lowering rule: {missing}"


def test_vmap_and_jit_through_families_and_scan():
    g = rlx.Graph("v")
    x = g.input("x", [4, 8], "f32")
    ga = g.param("g", [8], "f32")
    be = g.param("b", [8], "f32")
    h = g.layer_norm(x, ga, be, -1, 1e-5)
    a = g.attention_kind(h, h, h, 2, 4, "causal")
    body = rlx.Graph("body")
    c = body.input("c", [8], "f32")
    r = body.input("r", [8], "f32")
    body.set_outputs([body.tanh(body.add(c, r))])
    s = g.scan(g.reduce(a, "sum", [0]), body, 4, xs=[a])
    g.set_outputs([s])
    f = rlx.to_jax(g)
    rng = np.random.default_rng(3)
    p = {"g": np.ones(8, np.float32), "b": np.zeros(8, np.float32)}
    xs = rng.standard_normal((5, 4, 8)).astype(np.float32)
    batched = jax.jit(jax.vmap(lambda xi: f(p, {"x": xi})[0]))(xs)
    for i in range(5):
        np.testing.assert_allclose(batched[i], f(p, {"x": xs[i]})[0], rtol=1e-5, atol=1e-5)


def test_one_element_results_take_their_declared_rank():
    """verify() lets [] and [1] (any one-element shapes) stand for each other; the lowering
    reshapes such a result to the declared shape, so consumers and control flow agree."""
    from rlx_jax.ir import OP_CLASSES, Shape

    g = rlx.Graph("declared")
    x = g.input("x", [3])
    s = g.add_node(OP_CLASSES["Reduce"](op="Sum", axes=(0,), keep_dim=False), (x,), Shape((1, 1), "f32"))
    g.set_outputs([g.transpose(s, [1, 0])])
    (y,) = rlx.to_jax(g.verify())({}, {"x": np.arange(3, dtype=np.float32)})
    assert y.shape == (1, 1) and float(y[0, 0]) == 3.0

    then, other = rlx.Graph("then"), rlx.Graph("else")
    then.set_outputs([then.sum(then.input("a", [3]), [0])])          # []
    other.set_outputs([other.narrow(other.input("a", [3]), 0, 1, 1)])  # [1]
    for pred, want in ((True, 3.0), (False, 1.0)):
        g = rlx.Graph("if")
        g.set_outputs([g.if_(g.input("p", [1], "bool"), then, other, [g.input("x", [3])])])
        (y,) = rlx.to_jax(g.verify())({}, {"p": np.array([pred]), "x": np.arange(3, dtype=np.float32)})
        assert float(np.asarray(y).reshape(())) == want

    body = rlx.Graph("b")
    c = body.input("c", [])
    body.set_outputs([body.reshape(body.add(c, c), [1])])             # [1] for a [] carry
    g = rlx.Graph("scan")
    g.set_outputs([g.scan(g.input("x", []), body, 3)])
    (y,) = rlx.to_jax(g.verify())({}, {"x": np.float32(1)})
    assert float(np.asarray(y).reshape(())) == 8.0
