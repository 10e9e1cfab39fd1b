"""Types, the Graph contract, text form, the Custom registry, and pyrlx compatibility."""

import numpy as np
import pytest

import rlx_jax as rlx
import rlx_jax.ir as ir
from rlx_jax.ir import DType, Dynamic, Graph, Shape


# -- dtypes -------------------------------------------------------------------

def test_dtype_names_and_numpy():
    assert len(DType) == 12
    assert DType.F32.value == "F32" and DType.F32.short == "f32"
    for d in DType:
        assert DType.from_any(d.short) is d and DType.from_any(d.value) is d
        assert DType.from_any(d.to_numpy()) is d
        assert d.to_numpy().itemsize == d.size_bytes
    assert DType.from_any(np.float32) is DType.F32
    assert DType.from_any("bfloat16") is DType.BF16
    assert DType.from_any(np.dtype("complex64")) is DType.C64
    with pytest.raises(TypeError, match="got None"):  # np.dtype(None) would be float64
        DType.from_any(None)


def test_dtype_jax_round_trip():
    import jax.numpy as jnp

    assert DType.from_any(jnp.bfloat16) is DType.BF16
    assert DType.from_any(jnp.float16) is DType.F16
    assert DType.BF16.to_jax() == jnp.bfloat16
    assert DType.I32.to_jax() == jnp.int32


def test_dtype_errors():
    with pytest.raises(ValueError):
        DType.from_any("f128")
    with pytest.raises(TypeError):
        DType.from_any(np.dtype("complex128"))


# -- dims / shapes ---------------------------------------------------------------

def test_well_known_symbols():
    assert Dynamic.named("batch").symbol == ir.BATCH == 0
    assert Dynamic.named("seq").symbol == ir.SEQ == 1
    assert Dynamic.named("rows").symbol == ir.ROWS == 2
    assert Dynamic.named("past_seq").symbol == ir.PAST_SEQ == 3
    a, b = Dynamic.named("core_test_width"), Dynamic.named("core_test_width")
    assert a == b and a.symbol >= 4 and Dynamic(a.symbol).name == "core_test_width"
    assert Dynamic(0) == Dynamic(0, "other-name")


def test_shape_basics():
    s = Shape.of([2, "batch", 3], "f16")
    assert s.rank == 3 and not s.is_static and s.numel() is None
    assert s.py_dims() == [2, "batch", 3] and str(s) == "[2, batch, 3] f16"
    assert Shape.of([2, 3], DType.F32).numel() == 6


# -- the Graph contract ---------------------------------------------------------------

def test_graph_add_contract():
    g = Graph("contract")
    x = g.add(ir.Input(name="x"), [], Shape.of([2, 3], "f32"), name="x")
    w = g.add(ir.Param(name="w"), (), Shape.of([3, 4], "f32"), "w")
    y = g.add(ir.MatMul(), [x, w])
    z = g.add(op=ir.Activation(kind="silu"), inputs=[y], name="act")
    assert (x, w, y, z) == (0, 1, 2, 3)
    assert g.shape_of(z) == ([2, 4], "f32")
    n = g.node(z)
    assert n.id == 3 and n.inputs == (2,) and n.name == "act" and n.op == ir.Activation(ir.ActivationKind.Silu)
    assert g.outputs == [] and len(g.nodes) == 4
    assert ir.OP_CLASSES["LayerNorm"] is ir.LayerNorm
    assert ir.LayerNorm(axis=-1, eps=1e-5).axis == -1
    assert ir.ActivationKind.Gelu == "Gelu"


def test_graph_add_node_is_the_one_append():
    g = Graph("append")
    x = g.add_node(ir.Input(name="x"), (), Shape.of([2, "batch"], "f32"), name="x")
    w = g.add_node(ir.Param(name="w"), shape=Shape.of(["batch", 5], "f32"))
    y = g.add_node(ir.MatMul(), [x, np.int64(w)], origin={"file": "m.py", "line": 3})
    assert (x, w, y) == (0, 1, 2)
    assert g.shape_of(y) == ([2, 5], "f32")  # inferred by MatMul's shape rule
    assert g.node(y).inputs == (0, 1) and type(g.node(y).inputs[1]) is int
    assert g.node(y).origin == {"file": "m.py", "line": 3}
    assert g.leaf_id("x") == x and g.leaf_id("w") == w
    # a builder and add_node make the same node
    h = Graph("append")
    hx = h.input("x", [2, "batch"])
    hw = h.param("w", ["batch", 5])
    assert h.node(h.matmul(hx, hw)).shape == g.node(y).shape
    assert not hasattr(Graph, "_add_node")
    n = len(g.nodes)
    with pytest.raises(ir.GraphError, match=r"node %3 MatMul"):  # declared shape disagrees
        g.add_node(ir.MatMul(), (x, w), Shape.of([2, 6], "f32"))
    with pytest.raises(ir.GraphError, match=r"node %3 Input.*duplicate input/param name 'x'"):
        g.add_node(ir.Input(name="x"), (), Shape.of([1], "f32"))
    with pytest.raises(ir.GraphError, match=r"node %3 .*inputs must be node ids"):
        g.add_node(ir.Activation(kind="silu"), ("x",))
    with pytest.raises(ir.GraphError, match=r"op must be an rlx_jax.ir.Op"):
        g.add_node("MatMul", (x, w))
    assert len(g.nodes) == n  # a rejected node is not appended


def test_ops_are_frozen_and_hashable():
    op = ir.LayerNorm(axis=-1, eps=1e-5)
    with pytest.raises(Exception):
        op.eps = 2.0
    assert hash(op) == hash(ir.LayerNorm(axis=-1, eps=1e-5))
    assert not isinstance(ir.RmsNorm(axis=-1, eps=1e-5), ir.LayerNorm)


def test_inputs_params_by_name():
    g = Graph("n")
    g.input("a", [1], "f32")
    g.param("b", [1], "f32")
    assert g.inputs_by_name() == {"a": 0} and g.params_by_name() == {"b": 1}


def test_body_is_copied_when_stored():
    g = Graph("g")
    init = g.input("init", [3], "f32")
    body = Graph("body")
    c = body.input("carry", [3], "f32")
    body.set_outputs([body.relu(c)])
    s = g.scan(init, body, 2)
    body.exp(c)
    assert len(g.node(s).op.body) == 2


# -- text form -------------------------------------------------------------------------

def test_text_form():
    g = Graph("mlp")
    x = g.input("x", ["batch", 4], "f32")
    w = g.param("w", [4, 2], "f32")
    y = g.matmul(x, w)
    body = Graph("step")
    c = body.input("carry", ["batch", 2], "f32")
    body.set_outputs([body.tanh(c)])
    s = g.scan(y, body, 3)
    g.set_outputs([s])
    text = str(g)
    lines = text.splitlines()
    assert lines[0] == "graph 'mlp' (4 nodes, outputs [%3])"
    assert "%2 = MatMul (%0, %1) -> [batch, 2] f32" in text
    assert "%3 = Scan(body=<graph 'step': 2 nodes>, length=3" in text
    body_lines = [l for l in lines if "Activation(kind=Tanh)" in l]
    assert body_lines and body_lines[0].startswith(" " * 10)
    assert repr(g) == "<rlx_jax.Graph 'mlp' nodes=4 outputs=[3]>"
    assert len(g) == 4


# -- registry --------------------------------------------------------------------------

def test_register_op_stores_callables():
    def rule(ins, attrs):
        return Shape(ins[0].dims[:-1], ins[0].dtype)

    def lowering(args, attrs, ctx):
        return args[0].sum(-1)

    def vjp(graph, node, d):
        return [None]

    d = rlx.register_op("test_core_rowsum", rule, lowering, vjp)
    assert ir.get_custom_op("test_core_rowsum") is d
    assert d.lowering is lowering and d.lower is lowering and d.vjp is vjp and d.jvp is None
    g = Graph("c")
    x = g.input("x", [3, 5], "f32")
    y = g.custom("test_core_rowsum", [x], b"abc")
    assert g.shape_of(y) == ([3], "f32")
    assert g.node(y).op.attrs == b"abc" and g.node(y).op.num_inputs == 1
    with pytest.raises(TypeError):
        rlx.register_op("test_core_bad", rule, lowering="nope")


# -- pyrlx compatibility: only pyrlx names and positional order -------------------------------

def test_pyrlx_only_graph():
    g = rlx.Graph("pyrlx_mlp")
    x = g.input("x", [2, 4, 8], "f32")
    w1 = g.param("w1", [8, 16], "f32")
    b1 = g.param("b1", [16], "f32")
    h = g.matmul(x, w1)
    h = g.add(h, b1)
    h = g.gelu(h)
    h = g.activation("silu", h)
    w2 = g.param("w2", [16, 8], "f32")
    h = g.matmul_with_shape(h, w2, [2, 4, 8], "f32")
    gamma, beta = g.param("gamma", [8], "f32"), g.param("beta", [8], "f32")
    h = g.layer_norm(h, gamma, beta)
    h = g.rms_norm(h, gamma, beta, 1e-6)
    cos, sin = g.input("cos", [4, 2], "f32"), g.input("sin", [4, 2], "f32")
    h = g.rope(h, cos, sin, 4)
    mask = g.input("mask", [2, 4], "f32")
    a = g.attention(h, h, h, mask, 2, 4)
    a2 = g.attention_kind(h, h, h, 2, 4, "causal")
    s = g.binary("+", a, a2)
    s = g.sub(s, g.mul(a, a2))
    s = g.div(s, g.exp(g.neg(g.tanh(g.sqrt(g.relu(s))))))
    c = g.compare("gt", s, a)
    s = g.where_(c, s, a)
    s = g.where_(g.lt_(s, a), s, g.where_(g.eq_(s, a), a, s))
    r = g.reshape(s, [8, 8])
    t = g.transpose(r, [1, 0])
    n = g.narrow(t, 0, 0, 4)
    cat = g.concat([n, n], 0)
    sm = g.softmax(cat)
    cs = g.cumsum(sm, 1)
    red = g.reduce(cs, "max", [1])
    tot = g.sum(cs, [0, 1], False)
    mn = g.mean(cs, [1], True)
    emb = g.param("emb", [10, 8], "f32")
    ids = g.input("ids", [3], "i32")
    gat = g.gather(emb, ids, 0)
    casted = g.cast(gat, "f16")
    tok = g.sample(cs, 5, 0.9, 0.8, 7, [8])
    fb = g.fused_matmul_bias_act(r, w1, b1, [8, 16], "f32", "gelu")
    lo = g.lora_matmul(r, g.param("lw", [8, 8], "f32"), g.param("la", [8, 2], "f32"),
                       g.param("lb", [2, 8], "f32"), 0.5, [8, 8], "f32")
    A, B = g.input("A", [3, 3], "f64"), g.input("B", [3], "f64")
    sol = g.dense_solve(A, B, [3], "f64")
    A3, B3 = g.input("A3", [2, 3, 3], "f64"), g.input("B3", [2, 3], "f64")
    bsol = g.batched_dense_solve(A3, B3, [2, 3], "f64")
    sig = g.input("sig", [2, 8], "f32")
    re, im = g.fft_real(sig)
    hr, hi = g.rfft(sig)
    back = g.irfft(hr, hi, 8)
    p = g.psd(re, im)
    pr = g.psd_real(sig)
    ff = g.fft(g.input("blk", [2, 16], "f32"))
    ffn = g.fft_norm(ff, True, "ortho")
    fq, rq = g.fftfreq(8), g.rfftfreq(8)
    fwd = rlx.Graph("fwd")
    fx = fwd.input("x", [8], "f32")
    fwd.set_outputs([fwd.tanh(fx)])
    cf = g.custom_fn([g.reshape(red, [8])], fwd)
    g.set_outputs([tot, mn, casted, tok, fb, lo, sol, bsol, back, p, pr, ffn, fq, rq, cf])
    assert g.shape_of(tot) == ([], "f32")
    assert g.shape_of(mn) == ([8, 1], "f32")
    assert g.shape_of(casted) == ([3, 8], "f16")
    assert g.shape_of(tok) == ([8], "i32")
    assert g.shape_of(back) == ([2, 8], "f32")
    assert g.shape_of(cf) == ([8], "f32")
    assert len(g) > 60 and repr(g).startswith("<rlx_jax.Graph 'pyrlx_mlp'")
    g.verify()
    assert rlx.Graph.from_json(g.to_json()) == g


def test_numpy_ids_and_named_reshape():
    g = Graph("np")
    x = g.input("x", ["batch", 3, 4], "f32")
    y = g.reshape(x, ["batch", 12])
    assert g.shape_of(np.int64(y)) == (["batch", 12], "f32")
    assert g.node(y).op.new_shape == (-1, 12)
    z = g.transpose(np.int32(y), np.array([1, 0]))
    g.set_outputs(np.array([y, z]))
    assert g.outputs == [1, 2] and all(type(o) is int for o in g.outputs)


def test_pyrlx_keyword_names():
    g = rlx.Graph("kw")
    x = g.input(name="x", shape=[2, 3], dtype="f32")
    w = g.param(name="w", shape=[3, 4], dtype="f32")
    y = g.matmul(lhs=x, rhs=w)
    s = g.add(a=y, b=y)
    t = g.binary(op="mul", lhs=s, rhs=y)
    u = g.activation(kind="relu", input=t)
    r = g.reduce(input=u, op="sum", axes=[1], keep_dim=True)
    n = g.narrow(x=u, axis=1, start=0, length=2)
    g.set_outputs(outputs=[r, n])
    assert g.shape_of(id=r) == ([2, 1], "f32") and g.shape_of(n) == ([2, 2], "f32")
    with pytest.raises(TypeError):
        g.add(x)
