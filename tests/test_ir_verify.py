"""Verifier: each check rejects a bad graph with a GraphError naming the node."""

import dataclasses

import pytest

from rlx_jax.ir import (
    Attention, Binary, BinaryOp, Constant, DType, Graph, GraphError, MaskKind, MatMul, Shape,
)
from rlx_jax.ir import ops_norm


def names_node(exc, node_id, op, name=None):
    msg = str(exc.value)
    assert f"%{node_id} {op}" in msg, msg
    if name:
        assert repr(name) in msg, msg
    return msg


def tamper(g, idx, **changes):
    """Replace node ``idx`` behind the builder's back (to test Graph.verify)."""
    g.nodes[idx] = dataclasses.replace(g.nodes[idx], **changes)


def test_graph_error_is_value_error():
    import rlx_jax

    assert issubclass(rlx_jax.GraphError, ValueError)


def test_input_id_does_not_exist():
    g = Graph("g")
    x = g.input("x", [3], "f32")
    with pytest.raises(GraphError) as e:
        g.add(Binary(op=BinaryOp.Add), [x, 7], name="sum")
    assert "does not exist" in names_node(e, 1, "Binary", "sum")


def test_input_must_come_earlier():
    g = Graph("g")
    x = g.input("x", [3], "f32")
    y = g.relu(x)
    z = g.exp(y)
    tamper(g, y, inputs=(z,))
    with pytest.raises(GraphError) as e:
        g.verify()
    assert "before" in names_node(e, y, "Activation")


def test_arity():
    g = Graph("g")
    x = g.input("x", [3], "f32")
    with pytest.raises(GraphError) as e:
        g.add(Binary(op="add"), [x], name="half")
    assert "expects 2 input(s), got 1" in names_node(e, 1, "Binary", "half")


def test_arity_in_verify():
    g = Graph("g")
    x = g.input("x", [3], "f32")
    y = g.add(x, x)
    tamper(g, y, inputs=(x, x, x))
    with pytest.raises(GraphError) as e:
        g.verify()
    names_node(e, y, "Binary")


def test_broadcast_compatibility():
    g = Graph("g")
    a, b = g.input("a", [3, 4], "f32"), g.input("b", [5], "f32")
    with pytest.raises(GraphError) as e:
        g.add(a, b)
    assert "broadcast" in names_node(e, 2, "Binary")


def test_dtype_mismatch():
    g = Graph("g")
    a, b = g.input("a", [3], "f32"), g.input("b", [3], "f16")
    with pytest.raises(GraphError) as e:
        g.mul(a, b)
    assert "dtypes differ" in names_node(e, 2, "Binary")


def test_matmul_inner_dims():
    g = Graph("g")
    a, b = g.input("a", [2, 3], "f32"), g.input("b", [4, 5], "f32")
    with pytest.raises(GraphError) as e:
        g.add(MatMul(), [a, b], name="proj")
    assert "inner dimensions" in names_node(e, 2, "MatMul", "proj")


def test_conv_channel_and_group_divisibility():
    g = Graph("g")
    x = g.input("x", [1, 4, 8, 8], "f32")
    w = g.param("w", [6, 3, 3, 3], "f32")
    with pytest.raises(GraphError) as e:
        g.conv2d(x, w, [3, 3], [1, 1], [0, 0], [1, 1], 1)
    assert "input channels 4" in names_node(e, 2, "Conv")
    w2 = g.param("w2", [5, 2, 3, 3], "f32")
    with pytest.raises(GraphError) as e:
        g.conv2d(x, w2, [3, 3], [1, 1], [0, 0], [1, 1], 2)
    assert "not divisible by groups" in names_node(e, 3, "Conv")


def test_group_norm_divisibility():
    g = Graph("g")
    x = g.input("x", [1, 6, 2, 2], "f32")
    c, d = g.param("c", [6], "f32"), g.param("d", [6], "f32")
    with pytest.raises(GraphError) as e:
        g.group_norm(x, c, d, 4)
    assert "num_groups" in names_node(e, 3, "GroupNorm")


def test_norm_param_shapes():
    g = Graph("g")
    x = g.input("x", [2, 8], "f32")
    ga, be = g.param("g", [7], "f32"), g.param("b", [8], "f32")
    with pytest.raises(GraphError) as e:
        g.layer_norm(x, ga, be)
    assert "gamma must have shape [8]" in names_node(e, 3, "LayerNorm")
    with pytest.raises(GraphError) as e:
        g.rms_norm(x, be, ga)
    assert "beta" in names_node(e, 3, "RmsNorm")


def test_norm_param_shapes_in_verify():
    g = Graph("g")
    x = g.input("x", [2, 8], "f32")
    ga, be = g.param("g", [8], "f32"), g.param("b", [8], "f32")
    y = g.add(ops_norm.LayerNorm(axis=-1, eps=1e-5), [x, ga, be], name="ln1")
    tamper(g, ga, shape=Shape((9,), DType.F32))
    with pytest.raises(GraphError) as e:
        g.verify()
    names_node(e, y, "LayerNorm", "ln1")


def test_reshape_element_count():
    g = Graph("g")
    x = g.input("x", [2, 3], "f32")
    with pytest.raises(GraphError) as e:
        g.reshape(x, [4, 2])
    assert "element count" in names_node(e, 1, "Reshape")
    with pytest.raises(GraphError) as e:
        g.reshape(x, [-1, -1])
    names_node(e, 1, "Reshape")


def test_narrow_bounds():
    g = Graph("g")
    x = g.input("x", [2, 5], "f32")
    with pytest.raises(GraphError) as e:
        g.narrow(x, 1, 3, 3)
    assert "out of bounds" in names_node(e, 1, "Narrow")
    with pytest.raises(GraphError) as e:
        g.narrow(x, 2, 0, 1)
    names_node(e, 1, "Narrow")


def test_index_dtypes():
    g = Graph("g")
    t = g.param("t", [10, 4], "f32")
    b = g.input("b", [3], "bool")
    with pytest.raises(GraphError) as e:
        g.gather(t, b, 0)
    assert "integer dtype" in names_node(e, 2, "Gather")
    logits = g.input("logits", [3, 10], "f32")
    lab = g.input("lab", [3], "c64")
    with pytest.raises(GraphError) as e:
        g.softmax_cross_entropy_with_logits(logits, lab)
    names_node(e, 4, "SoftmaxCrossEntropyWithLogits")


def test_mask_shapes_per_kind():
    g = Graph("g")
    q, k = g.input("q", [2, 5, 8], "f32"), g.input("k", [2, 7, 8], "f32")
    bad = g.input("m", [2, 5], "f32")
    with pytest.raises(GraphError) as e:
        g.attention(q, k, k, bad, 2, 4)
    assert "Custom mask" in names_node(e, 3, "Attention")
    bias = g.input("bias", [2, 2, 5, 5], "f32")
    with pytest.raises(GraphError) as e:
        g.attention_opts(q, k, k, 2, 4, "bias", bias)
    assert "Bias mask" in names_node(e, 4, "Attention")
    # a Causal attention takes no mask input: arity 3
    with pytest.raises(GraphError) as e:
        g.add(Attention(num_heads=2, head_dim=4, mask_kind=MaskKind("Causal")), [q, k, k, bias], name="att")
    assert "expects 3" in names_node(e, 4, "Attention", "att")
    with pytest.raises(GraphError) as e:
        g.attention_kind(q, k, k, 2, 4, "sliding:x")
    names_node(e, 4, "Attention")


def test_attention_head_dims():
    g = Graph("g")
    q, k = g.input("q", [2, 5, 9], "f32"), g.input("k", [2, 7, 8], "f32")
    with pytest.raises(GraphError) as e:
        g.attention_kind(q, k, k, 2, 4, "none")
    assert "multiple of head_dim" in names_node(e, 2, "Attention")
    q12 = g.input("q12", [2, 5, 12], "f32")
    with pytest.raises(GraphError) as e:
        g.attention_kind(q12, k, k, 2, 4, "none")
    assert "num_heads*head_dim" in names_node(e, 3, "Attention")
    k3 = g.input("k3", [2, 7, 12], "f32")
    q16 = g.input("q16", [2, 5, 16], "f32")
    with pytest.raises(GraphError) as e:
        g.attention_kind(q16, k3, k3, 4, 4, "none")
    assert "does not divide" in names_node(e, 5, "Attention")


def test_nested_scan_body_signature():
    g = Graph("g")
    init = g.input("init", [3], "f32")
    body = Graph("body")
    c = body.input("carry", [4], "f32")
    body.set_outputs([body.relu(c)])
    with pytest.raises(GraphError) as e:
        g.scan(init, body, 5)
    assert "body input 0" in names_node(e, 1, "Scan")
    body2 = Graph("body2")
    c2 = body2.input("carry", [3], "f32")
    body2.set_outputs([body2.relu(c2), c2])
    with pytest.raises(GraphError) as e:
        g.scan(init, body2, 5)
    assert "2 output(s), expected 1" in names_node(e, 1, "Scan")


def test_nested_if_while_custom_fn_signatures():
    g = Graph("g")
    p, a = g.input("p", [], "bool"), g.input("a", [2], "f32")
    t, e_ = Graph("t"), Graph("e")
    t.set_outputs([t.relu(t.input("a", [2], "f32"))])
    e_.set_outputs([e_.sum(e_.input("a", [2], "f32"), [0])])
    with pytest.raises(GraphError) as e:
        g.if_(p, t, e_, [a])
    assert "branches disagree" in names_node(e, 2, "If")
    cond, body = Graph("c"), Graph("b")
    cond.set_outputs([cond.cast(cond.input("i", [2], "f32"), "c64")])   # any shape, but bool or real
    body.set_outputs([body.input("i", [2], "f32")])
    with pytest.raises(GraphError) as e:
        g.while_([a], cond, body)
    assert "bool or real" in names_node(e, 2, "While")
    fwd = Graph("fwd")
    fwd.set_outputs([fwd.input("x", [2], "f32")])
    with pytest.raises(GraphError) as e:
        g.custom_fn([a, a], fwd)
    assert "1 Input(s), expected 2" in names_node(e, 2, "CustomFn")


def test_body_fault_found_by_verify():
    g = Graph("g")
    init = g.input("init", [3], "f32")
    body = Graph("body")
    c = body.input("carry", [3], "f32")
    r = body.relu(c)
    body.set_outputs([r])
    s = g.scan(init, body, 4)
    inner = g.node(s).op.body
    inner.nodes[r] = dataclasses.replace(inner.nodes[r], inputs=(5,))
    with pytest.raises(GraphError) as e:
        g.verify()
    msg = names_node(e, s, "Scan")
    assert "in body 'body'" in msg and "%1 Activation" in msg


def test_duplicate_names():
    g = Graph("g")
    g.input("x", [3], "f32")
    with pytest.raises(GraphError) as e:
        g.param("x", [3], "f32")
    assert "duplicate" in names_node(e, 1, "Param", "x")


def test_duplicate_names_in_verify():
    g = Graph("g")
    g.input("x", [3], "f32")
    y = g.input("y", [3], "f32")
    tamper(g, y, op=dataclasses.replace(g.nodes[y].op, name="x"))
    with pytest.raises(GraphError) as e:
        g.verify()
    assert "duplicate" in names_node(e, y, "Input")


def test_declared_shape_mismatch():
    g = Graph("g")
    a, b = g.input("a", [2, 3], "f32"), g.input("b", [3, 4], "f32")
    with pytest.raises(GraphError) as e:
        g.matmul_with_shape(a, b, [2, 5], "f32")
    assert "does not match the inferred" in names_node(e, 2, "MatMul")
    y = g.matmul(a, b)
    tamper(g, y, shape=Shape((2, 4), DType.F16))
    with pytest.raises(GraphError) as e:
        g.verify()
    names_node(e, y, "MatMul")


def test_attribute_validation():
    g = Graph("g")
    x = g.input("x", [1, 4, 8], "f32")
    c = g.input("c", [4, 2], "f32")
    with pytest.raises(GraphError) as e:
        g.rope_n(x, c, c, 8, 3)
    assert "n_rot=3" in names_node(e, 2, "Rope")
    with pytest.raises(GraphError) as e:
        g.reduce(x, "median", [0])
    names_node(e, 2, "Reduce")
    with pytest.raises(GraphError) as e:
        g.narrow(x, 0, -1, 1)
    names_node(e, 2, "Narrow")


def test_constant_data_and_missing_shape():
    g = Graph("g")
    with pytest.raises(GraphError) as e:
        g.add(Constant(data=b"\x00" * 5), [], Shape((2,), DType.F32), name="c")
    assert "5 bytes" in names_node(e, 0, "Constant", "c")
    with pytest.raises(GraphError) as e:
        g.add(Constant(data=b""), [])
    assert "explicit output shape" in names_node(e, 0, "Constant")


def test_custom_unregistered_needs_shape():
    g = Graph("g")
    x = g.input("x", [3], "f32")
    with pytest.raises(GraphError) as e:
        g.custom("nobody_registered_this", [x])
    assert "not registered" in names_node(e, 1, "Custom")


def test_custom_shape_rule_rejects():
    import rlx_jax

    def rule(ins, attrs):
        raise ValueError("needs two inputs")

    rlx_jax.register_op("test_verify_rejecting", rule)
    g = Graph("g")
    x = g.input("x", [3], "f32")
    with pytest.raises(GraphError) as e:
        g.custom("test_verify_rejecting", [x])
    assert "needs two inputs" in names_node(e, 1, "Custom")


def test_outputs_must_exist():
    g = Graph("g")
    g.input("x", [3], "f32")
    with pytest.raises(GraphError):
        g.set_outputs([3])
    g.outputs = [9]
    with pytest.raises(GraphError, match="output %9"):
        g.verify()


def test_backward_shape_checks():
    g = Graph("g")
    x, dy = g.input("x", [2, 8], "f32"), g.input("dy", [2, 7], "f32")
    with pytest.raises(GraphError) as e:
        g.relu_backward(x, dy)
    names_node(e, 2, "ReluBackward")
    img = g.input("img", [1, 2, 8, 8], "f32")
    pdy = g.input("pdy", [1, 2, 3, 3], "f32")
    with pytest.raises(GraphError) as e:
        g.max_pool2d_backward(img, pdy, 2, 2)
    names_node(e, 4, "MaxPool2dBackward")
    w = g.param("w", [4, 2, 3, 3], "f32")
    cdy = g.input("cdy", [1, 4, 6, 6], "f32")
    with pytest.raises(GraphError) as e:
        g.conv2d_backward_input(cdy, w, [1, 2, 9, 9])
    names_node(e, 6, "Conv2dBackwardInput")


def test_builder_argument_errors_are_graph_errors():
    g = Graph("g")
    with pytest.raises(GraphError) as e:
        g.input("x", [3, -1], "f32")
    names_node(e, 0, "Input")
    with pytest.raises(GraphError) as e:
        g.input("x", [3], "f17")
    names_node(e, 0, "Input")
    with pytest.raises(GraphError):
        g.node(5)


def test_rlx_scalar_compatibility_and_rms_norm_flat_layout():
    """RLX's verifier accepts [] vs [1] for one-element results, and an RmsNorm node
    declaring the row-flattened layout of a rank-3 input."""
    from rlx_jax.ir import ReduceOp, RmsNorm
    from rlx_jax.ir.ops_reduce import Reduce

    g = Graph("g")
    x = g.input("x", [3], "f32")
    loss = g.add(Reduce(op=ReduceOp.Sum, axes=(0,), keep_dim=False), [x], Shape((1,), DType.F32))
    assert g.shape_of(loss) == ([1], "f32")
    h = g.input("h", [2, 5, 8], "f32")
    ga = g.param("g", [8], "f32")
    y = g.add(RmsNorm(axis=-1, eps=1e-6), [h, ga, ga], Shape((10, 8), DType.F32))
    assert g.shape_of(y) == ([10, 8], "f32")
    with pytest.raises(GraphError) as e:
        g.add(RmsNorm(axis=-1, eps=1e-6), [h, ga, ga], Shape((5, 16), DType.F32))
    names_node(e, 5, "RmsNorm")
    g.verify()


def test_scatter_add_shapes():
    g = Graph("g")
    upd, idx = g.input("u", [4, 5], "f32"), g.input("i", [3], "i32")
    with pytest.raises(GraphError) as e:
        g.scatter_add(upd, idx, [10, 5])
    assert "must start with the indices" in names_node(e, 2, "ScatterAdd")
    idx4 = g.input("i4", [4], "i32")
    with pytest.raises(GraphError) as e:
        g.scatter_add(upd, idx4, [10, 6])
    names_node(e, 3, "ScatterAdd")


def test_custom_fn_vjp_jvp_signatures():
    g = Graph("g")
    x = g.input("x", [4], "f32")
    fwd = Graph("fwd")
    fwd.set_outputs([fwd.tanh(fwd.input("x", [4], "f32"))])
    vjp = Graph("vjp")
    vjp.input("x", [3], "f32")
    d = vjp.input("d_output", [4], "f32")
    vjp.set_outputs([d])
    with pytest.raises(GraphError) as e:
        g.custom_fn([x], fwd, vjp)
    assert "primal input 0" in names_node(e, 1, "CustomFn")
    jvp = Graph("jvp")
    jvp.input("x", [4], "f32")
    t = jvp.input("tangent_1", [4], "f32")
    jvp.set_outputs([t])
    with pytest.raises(GraphError) as e:
        g.custom_fn([x], fwd, None, jvp)
    assert "tangent_0" in names_node(e, 1, "CustomFn")
