"""RLX serde JSON: round trips of every op, a property test over generated graphs, a
hand-written graph in the Rust layout, and malformed input."""

import inspect
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx_jax.ir as ir
from rlx_jax.ir import OP_CLASSES, Graph, GraphError

import test_ir_builders


# ---------------------------------------------------------------------------
# every op: graphs made by the builder tests, recorded as they are built
# ---------------------------------------------------------------------------

def _walk(g):
    yield g
    for n in g.nodes:
        for body in n.op.bodies().values():
            yield from _walk(body)


@pytest.fixture(scope="module")
def op_graphs():
    made = []
    orig = Graph.__init__

    def recording(self, *a, **k):
        orig(self, *a, **k)
        made.append(self)

    Graph.__init__ = recording
    try:
        for name, fn in vars(test_ir_builders).items():
            if name.startswith("test_") and not inspect.signature(fn).parameters:
                fn()
    finally:
        Graph.__init__ = orig
    by_op = {}
    for g in made:
        for sub in _walk(g):
            for n in sub.nodes:
                by_op.setdefault(type(n.op).__name__, g)
    return by_op


def roundtrip(g):
    text = g.to_json()
    back = Graph.from_json(text)
    assert back == g
    assert back.to_json() == text
    return back


@pytest.mark.parametrize("op_name", sorted(OP_CLASSES))
def test_every_op_round_trips(op_graphs, op_name):
    assert op_name in op_graphs, f"no builder test makes a {op_name} node"
    roundtrip(op_graphs[op_name])


def test_json_layout_of_variants():
    g = Graph("layout")
    x = g.input("x", ["batch", 4], "f32")
    w = g.param("w", [4, 4], "f32")
    m = g.matmul(x, w)
    a = g.gelu(m)
    r = g.reduce(a, "sum", [1])
    q = g.input("q", [1, 3, 8], "f32")
    att = g.attention_kind(q, q, q, 2, 4, "sliding:2")
    g.set_outputs([r, att])
    d = json.loads(g.to_json())
    assert set(d) == {"name", "nodes", "outputs"}
    assert d["nodes"][0] == {"id": 0, "op": {"Input": {"name": "x"}}, "inputs": [],
                             "shape": {"dims": [{"Dynamic": 0}, {"Static": 4}], "dtype": "F32"},
                             "name": "x", "origin": None}
    assert d["nodes"][m]["op"] == "MatMul"
    assert d["nodes"][a]["op"] == {"Activation": "Gelu"}
    assert d["nodes"][r]["op"] == {"Reduce": {"op": "Sum", "axes": [1], "keep_dim": False}}
    assert d["nodes"][att]["op"] == {"Attention": {"num_heads": 2, "head_dim": 4,
                                                   "mask_kind": {"SlidingWindow": 2},
                                                   "score_scale": None, "attn_logit_softcap": None}}
    assert d["outputs"] == [r, att]


def test_constant_bytes_and_custom_dim_names():
    g = Graph("c")
    c = g.constant(np.array([1.0, -2.0], np.float32))
    t = g.input("t", ["json_tokens_dim", 2], "f32")
    g.set_outputs([g.add(t, c)])
    d = json.loads(g.to_json())
    assert d["nodes"][0]["op"] == {"Constant": {"data": list(np.array([1.0, -2.0], "<f4").tobytes())}}
    assert "dim_names" in d and "json_tokens_dim" in d["dim_names"].values()
    back = roundtrip(g)
    assert back.shape_of(t) == (["json_tokens_dim", 2], "f32")


# ---------------------------------------------------------------------------
# property test over generated graphs
# ---------------------------------------------------------------------------

DIM = st.one_of(st.integers(1, 4), st.sampled_from(["batch", "seq"]))
DTYPES = st.sampled_from(["f32", "f16", "bf16", "f64"])


@st.composite
def graphs(draw):
    g = Graph(draw(st.text("abc_xyz", min_size=1, max_size=6)))
    dtype = draw(DTYPES)
    nodes = []
    for i in range(draw(st.integers(1, 3))):
        dims = draw(st.lists(DIM, min_size=1, max_size=3))
        make = g.input if draw(st.booleans()) else g.param
        nodes.append(make(f"v{i}", dims, dtype))
    for _ in range(draw(st.integers(0, 12))):
        x = draw(st.sampled_from(nodes))
        xs = g.node(x).shape
        kind = draw(st.sampled_from(["act", "bin", "red", "soft", "cast", "tr", "cum", "ln", "nar", "cat",
                                     "scan", "stop", "cmp"]))
        try:
            if kind == "act":
                y = g.activation(draw(st.sampled_from(list(ir.ActivationKind))), x)
            elif kind == "bin":
                y = g.binary(draw(st.sampled_from(list(ir.BinaryOp))), x, draw(st.sampled_from(nodes)))
            elif kind == "red" and xs.rank:
                axes = draw(st.lists(st.integers(0, xs.rank - 1), min_size=1, max_size=xs.rank, unique=True))
                y = g.reduce(x, draw(st.sampled_from(list(ir.ReduceOp))), axes, draw(st.booleans()))
            elif kind == "cast":
                y = g.cast(x, draw(DTYPES))
            elif kind == "tr":
                y = g.transpose(x, draw(st.permutations(range(xs.rank))))
            elif xs.rank == 0 and kind in ("cum", "ln", "nar", "cat", "soft"):
                continue
            elif kind == "soft":
                y = g.softmax(x, draw(st.integers(-xs.rank, xs.rank - 1)))
            elif kind == "cum":
                y = g.cumsum(x, draw(st.integers(0, xs.rank - 1)), draw(st.booleans()))
            elif kind == "ln":
                d = xs.dims[-1]
                gam = g.param(f"g{len(g)}", [d], xs.dtype)
                y = g.layer_norm(x, gam, gam, -1, draw(st.floats(1e-6, 1e-2)))
            elif kind == "nar" and isinstance(xs.dims[0], int):
                y = g.narrow(x, 0, 0, draw(st.integers(0, xs.dims[0])))
            elif kind == "cat":
                y = g.concat([x, x], draw(st.integers(0, xs.rank - 1)))
            elif kind == "scan":
                body = Graph("body")
                c = body.input("carry", xs.dims, xs.dtype)
                body.set_outputs([body.add(c, c)])
                y = g.scan(x, body, draw(st.integers(1, 4)), save_trajectory=draw(st.booleans()))
            elif kind == "stop":
                y = g.stop_gradient(x)
            elif kind == "cmp":
                y = g.compare(draw(st.sampled_from(list(ir.CmpOp))), x, x)
            else:
                continue
        except GraphError:
            continue  # an incompatible random pick; the builder refused it cleanly
        nodes.append(y)
    g.set_outputs(draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=3)))
    return g


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_property_round_trip(g):
    g.verify()
    back = roundtrip(g)
    back.verify()
    assert str(back) == str(g)
    assert [back.shape_of(i) for i in range(len(back))] == [g.shape_of(i) for i in range(len(g))]


# ---------------------------------------------------------------------------
# a graph written by hand in the Rust serde layout
# ---------------------------------------------------------------------------

RUST_JSON = r"""
{
  "name": "rust_exported",
  "nodes": [
    {"id": 0, "op": {"Input": {"name": "x"}}, "inputs": [],
     "shape": {"dims": [{"Dynamic": 0}, {"Static": 8}], "dtype": "F32"}, "name": "x", "origin": null},
    {"id": 1, "op": {"Param": {"name": "w"}}, "inputs": [],
     "shape": {"dims": [{"Static": 8}, {"Static": 8}], "dtype": "F32"}, "name": "w",
     "origin": {"hir": 3, "label": "dense.w", "pass": null}},
    {"id": 2, "op": "MatMul", "inputs": [0, 1],
     "shape": {"dims": [{"Dynamic": 0}, {"Static": 8}], "dtype": "F32"}, "name": null, "origin": null},
    {"id": 3, "op": {"Activation": "GeluApprox"}, "inputs": [2],
     "shape": {"dims": [{"Dynamic": 0}, {"Static": 8}], "dtype": "F32"}, "name": "act", "origin": null},
    {"id": 4, "op": {"Constant": {"data": [0, 0, 128, 63]}}, "inputs": [],
     "shape": {"dims": [{"Static": 1}], "dtype": "F32"}, "name": null, "origin": null},
    {"id": 5, "op": {"FakeQuantize": {"bits": 8, "axis": null, "ste": "ClippedIdentity",
                                      "scale_mode": {"EMA": {"decay": 0.99}}}}, "inputs": [3, 4],
     "shape": {"dims": [{"Dynamic": 0}, {"Static": 8}], "dtype": "F32"}, "name": null, "origin": null},
    {"id": 6, "op": {"Reduce": {"op": "Mean", "axes": [1], "keep_dim": true}}, "inputs": [5],
     "shape": {"dims": [{"Dynamic": 0}, {"Static": 1}], "dtype": "F32"}, "name": null, "origin": null},
    {"id": 7, "op": {"Scan": {"body": {"name": "step", "nodes": [
         {"id": 0, "op": {"Input": {"name": "carry"}}, "inputs": [],
          "shape": {"dims": [{"Dynamic": 0}, {"Static": 1}], "dtype": "F32"}, "name": "carry", "origin": null},
         {"id": 1, "op": {"Binary": "Mul"}, "inputs": [0, 0],
          "shape": {"dims": [{"Dynamic": 0}, {"Static": 1}], "dtype": "F32"}, "name": null, "origin": null}],
         "outputs": [1]},
       "length": 3, "save_trajectory": false, "num_bcast": 0, "num_xs": 0, "num_checkpoints": 0}},
     "inputs": [6], "shape": {"dims": [{"Dynamic": 0}, {"Static": 1}], "dtype": "F32"}, "name": null,
     "origin": null},
    {"id": 8, "op": {"DequantMatMul": {"scheme": {"Int8Block": {"block_size": 32}}}}, "inputs": [0, 1, 4, 4],
     "shape": {"dims": [{"Dynamic": 0}, {"Static": 16}], "dtype": "F32"}, "name": null, "origin": null},
    {"id": 9, "op": {"Fft": {"inverse": false, "norm": "Ortho"}}, "inputs": [2],
     "shape": {"dims": [{"Dynamic": 0}, {"Static": 8}], "dtype": "F32"}, "name": null, "origin": null},
    {"id": 10, "op": {"AttentionBackward": {"num_heads": 2, "head_dim": 4, "mask_kind": "Causal",
                                            "wrt": "Value"}}, "inputs": [11, 11, 11, 11],
     "shape": {"dims": [{"Static": 1}], "dtype": "F32"}, "name": null, "origin": null}
  ],
  "outputs": [7, 8]
}
"""


def test_rust_layout_loads():
    text = RUST_JSON.replace(',\n    {"id": 10', ' XX').split(" XX")[0] + "\n  ],\n  \"outputs\": [7, 8]\n}"
    g = Graph.from_json(text)
    assert g.name == "rust_exported" and len(g) == 10 and g.outputs == [7, 8]
    assert g.shape_of(7) == (["batch", 1], "f32")
    assert isinstance(g.node(2).op, ir.MatMul)
    assert g.node(3).op.kind is ir.ActivationKind.GeluApprox and g.node(3).name == "act"
    assert g.node(1).origin == {"hir": 3, "label": "dense.w", "pass": None}
    np.testing.assert_array_equal(g.node(4).op.to_numpy(g.node(4).shape), [1.0])
    fq = g.node(5).op
    assert fq.scale_mode == ir.ScaleMode("EMA", 0.99) and fq.ste is ir.SteKind.ClippedIdentity and fq.axis is None
    assert g.node(7).op.body.name == "step" and g.node(7).op.length == 3
    assert g.node(8).op.scheme == ir.QuantScheme("Int8Block", 32)
    assert g.node(9).op.norm is ir.FftNorm.Ortho
    g.verify()
    assert json.loads(g.to_json()) == json.loads(text)


def test_rust_layout_forward_reference_is_refused():
    with pytest.raises(GraphError, match=r"%10 AttentionBackward.*does not exist"):
        Graph.from_json(RUST_JSON)


# ---------------------------------------------------------------------------
# malformed JSON
# ---------------------------------------------------------------------------

def _node(op, inputs=(), dims=(("Static", 2),), dtype="F32", **extra):
    n = {"id": 0, "op": op, "inputs": list(inputs),
         "shape": {"dims": [{k: v} for k, v in dims], "dtype": dtype}, "name": None, "origin": None}
    n.update(extra)
    return n


def _graph(*nodes, outputs=()):
    nodes = [dict(n, id=i) if "id" not in n or n["id"] == 0 else n for i, n in enumerate(nodes)]
    return json.dumps({"name": "bad", "nodes": nodes, "outputs": list(outputs)})


INPUT = {"Input": {"name": "x"}}

MALFORMED = {
    "not json": ("{nope", "does not parse"),
    "not an object": ("[1, 2]", "must be an object"),
    "missing nodes": ('{"name": "g", "outputs": []}', "missing 'nodes'"),
    "unknown op": (_graph(_node({"Frobnicate": {}})), "unknown op variant 'Frobnicate'"),
    "unit with payload": (_graph(_node(INPUT), _node({"MatMul": {"x": 1}}, [0, 0])), "takes no attributes"),
    "missing attribute": (_graph(_node({"Reduce": {"op": "Sum", "axes": [0]}})), "missing attribute 'keep_dim'"),
    "unknown attribute": (_graph(_node({"Input": {"name": "x", "extra": 1}})), "unknown attribute"),
    "wrong attr type": (_graph(_node(INPUT), _node({"Softmax": {"axis": "last"}}, [0])), "expected an integer"),
    "bad enum": (_graph(_node(INPUT), _node({"Activation": "Swish"}, [0])), "unknown ActivationKind 'Swish'"),
    "bad dtype": (_graph(_node(INPUT, dtype="F128")), "unknown dtype"),
    "bad dim variant": (_graph(_node(INPUT, dims=(("Huge", 2),))), "unknown dim variant"),
    "negative dim": (_graph(_node(INPUT, dims=(("Static", -2),))), "static dim"),
    "id mismatch": (json.dumps({"name": "g", "nodes": [dict(_node(INPUT), id=3)], "outputs": []}),
                    "does not match its position"),
    "forward input": (_graph(_node(INPUT), _node({"Activation": "Relu"}, [2])), "does not exist"),
    "bad output": (_graph(_node(INPUT), outputs=[4]), "outputs"),
    "huge constant": (_graph(_node({"Constant": {"data": []}}, dims=(("Static", 10**15),), dtype="U8")),
                      "exceeds|more than|static dim must be"),
    "huge constant product": (_graph(_node({"Constant": {"data": []}},
                                           dims=(("Static", 10**8), ("Static", 10**8)), dtype="U8")), "more than"),
    "byte out of range": (_graph(_node({"Constant": {"data": [1, 300]}}, dims=(("Static", 2),), dtype="U8")),
                          "outside 0..255"),
    "constant size mismatch": (_graph(_node({"Constant": {"data": [1, 2, 3]}}, dtype="F32")), "3 bytes"),
    "shape mismatch": (_graph(_node(INPUT), _node({"Activation": "Relu"}, [0], dims=(("Static", 3),))),
                       "does not match the inferred"),
    "duplicate name": (_graph(_node(INPUT), _node(INPUT)), "duplicate"),
    "extra node field": (_graph(_node(INPUT, colour="red")), "unknown node field"),
    "bad mask kind": (_graph(_node(INPUT), _node({"Attention": {"num_heads": 1, "head_dim": 2,
                                                                "mask_kind": {"Sliding": 2}}}, [0, 0, 0])),
                      "unknown mask kind"),
    "body not a graph": (_graph(_node(INPUT), _node({"Scan": {"body": 5, "length": 1, "save_trajectory": False,
                                                              "num_bcast": 0, "num_xs": 0, "num_checkpoints": 0}},
                                                    [0])), "graph must be an object"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_json(case):
    text, match = MALFORMED[case]
    with pytest.raises(GraphError, match=match):
        Graph.from_json(text)


def test_deep_nesting_is_refused():
    body = {"name": "b", "nodes": [], "outputs": []}
    for _ in range(80):
        body = {"name": "b", "nodes": [_node({"CustomFn": {"fwd_body": body, "vjp_body": None, "jvp_body": None,
                                                           "num_inputs": 0}})], "outputs": [0]}
    with pytest.raises(GraphError, match="nested deeper|nests too deeply"):
        Graph.from_json(json.dumps(body))


def test_from_json_type_errors():
    with pytest.raises(GraphError):
        Graph.from_json(12)
    with pytest.raises(GraphError):
        Graph.from_json(b"\xff\xfe")


def test_mutated_json_raises_only_graph_error(op_graphs):
    """Random edits of valid documents either load or raise GraphError, nothing else."""
    import copy
    import random

    docs = [json.loads(g.to_json()) for g in {id(g): g for g in op_graphs.values()}.values()]
    values = [None, True, 0, -1, 2**40, 10**20, 1.5, "", "x", "F32", [], [1], {}, {"Static": 3},
              {"Dynamic": -1}, "MatMul", {"Input": {"name": "q"}}]

    def paths(o, path=()):
        yield path
        if isinstance(o, dict):
            for k, v in o.items():
                yield from paths(v, path + (k,))
        elif isinstance(o, list):
            for i, v in enumerate(o):
                yield from paths(v, path + (i,))

    rng = random.Random(1234)
    for _ in range(400):
        d = copy.deepcopy(rng.choice(docs))
        p = rng.choice([q for q in paths(d) if q])
        parent = d
        for k in p[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and rng.random() < 0.2:
            del parent[p[-1]]
        else:
            parent[p[-1]] = copy.deepcopy(rng.choice(values))
        try:
            Graph.from_json(json.dumps(d))
        except GraphError:
            pass
