"""pyrlx as a client: code written for RLX's Python binding behaves the same after
``import rlx_jax as rlx`` (device names and aliases, precision spellings, consuming
compile, float32 / (1,) run outputs, flat parameter buffers, grad's keyword names,
RLX's Gather shape rule), and the examples of pyrlx's README and guides, re-written for
the CPU device, run."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx

RNG = np.random.default_rng(39)

# Every device string pyrlx parses (names and aliases) -> the pyrlx cargo feature that
# builds it, for the devices rlx_jax has no backend for.
NO_BACKEND = {
    "metal": "metal", "mtl": "metal", "mlx": "mlx", "ane": "ane", "neural-engine": "ane",
    "rocm": "rocm", "hip": "rocm", "amd": "rocm", "wgpu": "gpu", "vulkan": "gpu",
    "vk": "gpu", "opengl": "gpu", "gl": "gpu", "directx": "gpu", "dx12": "gpu",
    "d3d12": "gpu", "webgpu": "gpu",
}
JAX_BACKED = {"cpu": "cpu", "cuda": "cuda", "nvidia": "cuda", "gpu": "cuda", "tpu": "tpu"}


def _jax_has(platform):
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def mlp_graph(name="mlp"):
    g = rlx.Graph(name)
    x = g.input("x", [2, 4], "f32")
    w = g.param("w", [4, 3], "f32")
    b = g.param("b", [3], "f32")
    g.set_outputs([g.gelu(g.add(g.matmul(x, w), b))])
    return g


def gelu(v):
    return np.asarray(jax.nn.gelu(jnp.asarray(v, jnp.float32), approximate=False))


# ---- devices ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NO_BACKEND))
def test_backends_rlx_jax_lacks_are_recognised_and_unavailable(name):
    for spelling in (name, name.upper(), f"  {name} "):
        assert rlx.is_available(spelling) is False
    with pytest.raises(RuntimeError, match=f"--features {NO_BACKEND[name]}`") as e:
        rlx.Session(device=name)
    assert "available here: ['cpu'" in str(e.value)


@pytest.mark.parametrize("name", sorted(JAX_BACKED))
def test_jax_backed_devices_follow_jax(name):
    present = _jax_has(JAX_BACKED[name])
    assert rlx.is_available(name) is present
    if present:
        s = rlx.Session(name)
        assert s.device == JAX_BACKED[name]
    else:
        with pytest.raises(RuntimeError, match=f"--features {JAX_BACKED[name]}`"):
            rlx.Session(name)


def test_unknown_device_names_raise_value_error_naming_the_device():
    for bad in ("abacus", "", "cuda0"):
        with pytest.raises(ValueError, match="unknown device"):
            rlx.is_available(bad)
        with pytest.raises(ValueError, match="unknown device"):
            rlx.Session(bad)
    with pytest.raises(TypeError, match="device"):
        rlx.is_available(3)


def test_available_devices_is_what_sessions_accept():
    devs = rlx.available_devices()
    assert devs[0] == "cpu"
    for d in devs:
        assert rlx.is_available(d) and rlx.Session(d).device == d


# ---- precision -------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling, canonical", [
    ("f32", "f32"), ("float32", "f32"), ("float", "f32"), ("F32", "f32"),
    ("f16", "f16"), ("float16", "f16"), ("half", "f16"),
    ("bf16", "bf16"), ("bfloat16", "bf16"), (" BFloat16 ", "bf16"),
])
def test_precision_spellings(spelling, canonical):
    s = rlx.Session("cpu", precision=spelling)
    assert s.precision == canonical and f"precision={canonical}" in repr(s)


def test_half_precision_runs_in_half_and_returns_f32():
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    ref = gelu(x @ w + b)
    for prec, tol in (("half", 5e-3), ("float16", 5e-3), ("float", 1e-5)):
        c = rlx.Session("cpu", prec).compile(mlp_graph())
        c.set_param("w", w)
        c.set_param("b", b)
        (y,) = c.run({"x": x})
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, ref, rtol=tol, atol=tol)
        if prec != "float":
            assert not np.allclose(y, ref, rtol=1e-6, atol=1e-7)  # really computed in f16


def test_bad_precision_names_the_argument():
    for bad in ("f8", "double", "", None):
        with pytest.raises(ValueError, match="precision"):
            rlx.Session("cpu", bad)


# ---- compile consumes the graph -------------------------------------------------------------

def test_compile_consumes_the_graph():
    g = mlp_graph()
    sess = rlx.Session("cpu")
    c = sess.compile(g)
    with pytest.raises(RuntimeError, match="already consumed"):
        sess.compile(g)
    with pytest.raises(RuntimeError, match="already consumed"):
        rlx.Session("cpu", "bf16").compile(g)  # any session
    # a copy compiles; to_jax and autodiff still read the consumed graph
    c2 = sess.compile(g.copy())
    fn = rlx.to_jax(g)
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    for cg in (c, c2):
        cg.set_param("w", w)
        cg.set_param("b", b)
        np.testing.assert_allclose(cg.run({"x": x})[0], gelu(x @ w + b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fn({"w": w, "b": b}, {"x": x})[0], gelu(x @ w + b), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="rlx_jax.Graph"):
        sess.compile("not a graph")


def test_compiled_graph_does_not_see_later_edits_of_its_graph():
    g = rlx.Graph("edit")
    x = g.input("x", [3], "f32")
    g.set_outputs([g.exp(x)])
    c = rlx.Session().compile(g)
    g.set_outputs([g.neg(x)])  # rlx_jax graphs stay editable; the compiled one is a snapshot
    xv = np.array([0.5, -1.0, 2.0], np.float32)
    np.testing.assert_allclose(c.run({"x": xv})[0], np.exp(xv), rtol=1e-6)


# ---- exports and keyword names ---------------------------------------------------------------

def test_compiled_graph_is_exported():
    c = rlx.Session().compile(mlp_graph())
    assert isinstance(c, rlx.CompiledGraph)
    assert "CompiledGraph" in rlx.__all__ and "CompiledGraph" in dir(rlx)


def test_grad_takes_pyrlx_keywords(x64):
    n = 3
    g = rlx.Graph("solve")
    a = g.param("A", [n, n], "f64")
    b = g.input("b", [n], "f64")
    loss = g.reduce(g.dense_solve(a, b, [n], "f64"), "sum", [0], False)
    g.set_outputs([loss])
    A = np.eye(n) * 3 + RNG.standard_normal((n, n)) * 0.3
    bv = RNG.standard_normal(n)
    db_ref = np.linalg.solve(A.T, np.ones(n))
    dA_ref = -np.outer(db_ref, np.linalg.solve(A, bv))
    for bwd in (rlx.grad(graph=g, wrt=[a, b]), rlx.grad(g, wrt=["A", "b"]), rlx.grad(g, [a, b])):
        c = rlx.Session("cpu").compile(bwd)
        c.set_param_typed("A", A.tobytes(), "f64")
        outs = c.run_typed({"b": (bv.tobytes(), "f64"), "d_output": (np.ones(1).tobytes(), "f64")})
        _, dA, db = (np.frombuffer(raw, np.float64) for raw, _ in outs)
        np.testing.assert_allclose(db, db_ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dA.reshape(n, n), dA_ref, rtol=1e-10, atol=1e-12)
    # jvp / vmap keyword names are pyrlx's too
    jg = rlx.jvp(graph=g, tangent_for=["b"])
    vg = rlx.vmap(graph=g, batched_input_names=["b"], batch_size=2)
    assert len(jg.outputs) == 2 and vg.shape_of(vg.outputs[0])[0] == [2]


# ---- run outputs -----------------------------------------------------------------------------

def _typed_graph():
    g = rlx.Graph("typed")
    x = g.input("x", [3], "f32")
    d = g.input("d", [3], "f64")
    s = g.sum(x, [0], False)                       # rank 0
    lt = g.compare("lt", x, g.neg(x))              # bool
    i = g.cast(x, "i32")                           # int32
    g.set_outputs([s, lt, i, d, g.mul(d, d)])
    return g


def test_run_returns_float32_and_rank0_as_shape_1():
    xv = np.array([1.5, -2.25, 0.5], np.float32)
    dv = np.array([1 + 1e-12, 2.0, -3.0])
    c = rlx.Session().compile(_typed_graph())
    outs = c.run({"x": xv, "d": dv})
    assert [o.dtype for o in outs] == [np.float32] * 5
    assert [o.shape for o in outs] == [(1,), (3,), (3,), (3,), (3,)]
    np.testing.assert_allclose(outs[0], [xv.sum()], rtol=1e-6)
    np.testing.assert_array_equal(outs[1], (xv < -xv).astype(np.float32))
    np.testing.assert_array_equal(outs[2], xv.astype(np.int32).astype(np.float32))
    np.testing.assert_array_equal(outs[3], dv.astype(np.float32))
    flat = c.run_flat({"x": xv, "d": dv})
    assert [o.shape for o in flat] == [(1,), (3,), (3,), (3,), (3,)]
    assert all(o.dtype == np.float32 for o in flat)
    # run_typed keeps the declared dtypes, lossless; to_jax keeps JAX's shapes
    typed = c.run_typed({"x": (xv.tobytes(), "f32"), "d": (dv.tobytes(), "f64")})
    assert [dt for _, dt in typed] == ["f32", "bool", "i32", "f64", "f64"]
    np.testing.assert_array_equal(np.frombuffer(typed[3][0], np.float64), dv)
    with jax.enable_x64(True):
        fn_out = rlx.to_jax(_typed_graph())({}, {"x": xv, "d": dv})
    assert fn_out[0].shape == () and fn_out[1].dtype == jnp.bool_


def test_zero_sized_outputs_keep_their_shape():
    g = rlx.Graph("z")
    x = g.input("x", [0, 3], "f32")
    g.set_outputs([g.relu(x)])
    (y,) = rlx.Session().compile(g).run({"x": np.zeros((0, 3), np.float32)})
    assert y.shape == (0, 3) and y.dtype == np.float32


# ---- flat buffers ----------------------------------------------------------------------------

def test_set_param_and_inputs_take_any_buffer_of_the_right_size():
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    ref = gelu(x @ w + b)
    for w_buf in (w, w.reshape(-1), w.reshape(3, 4), w.reshape(2, 6), w.reshape(1, 12, 1), list(w.reshape(-1))):
        c = rlx.Session().compile(mlp_graph())
        c.set_param("w", w_buf)
        c.set_param("b", b.reshape(1, 3))
        np.testing.assert_allclose(c.run({"x": x.reshape(8)})[0], ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c.run({"x": x.reshape(4, 2)})[0], ref, rtol=1e-5, atol=1e-6)
    c = rlx.Session().compile(mlp_graph())
    with pytest.raises(ValueError, match=r"set_param\('w'\)"):
        c.set_param("w", np.ones(11, np.float32))
    with pytest.raises(ValueError, match=r"set_param\('w'\)"):
        c.set_param("w", np.ones((4, 4), np.float32))
    c.set_param("w", w)
    c.set_param("b", b)
    with pytest.raises(ValueError, match="'x'"):
        c.run({"x": np.ones(9, np.float32)})


# ---- Gather: RLX's shape rule ----------------------------------------------------------------

def _gather_graph(table_shape, idx_shape, axis, take=False, dtype="f32"):
    g = rlx.Graph("ga")
    t = g.param("t", list(table_shape), dtype)
    i = g.input("i", list(idx_shape), "i32")
    out = (g.take if take else g.gather)(t, i, axis)
    g.set_outputs([out])
    return g, out


@pytest.mark.parametrize("table_shape, idx_shape, axis, want", [
    ((10, 4), (3,), 0, [3, 4]),
    ((10, 4), (2, 3), 0, [2, 3, 4]),
    ((2, 5, 3), (4,), 1, [4, 3]),            # np.take would give [2, 4, 3]
    ((2, 4), (4, 3), 1, [4, 3]),
    ((2, 3, 5, 6), (2, 2), 2, [2, 2, 6]),
    ((1, 7, 2), (5,), -2, [5, 2]),
])
def test_gather_shape_is_rlx_and_values_read_the_first_lead_slice(table_shape, idx_shape, axis, want):
    g, out = _gather_graph(table_shape, idx_shape, axis)
    assert g.shape_of(out) == (want, "f32")
    a = axis % len(table_shape)
    table = RNG.standard_normal(table_shape).astype(np.float32)
    idx = RNG.integers(0, table_shape[a], idx_shape).astype(np.int32)
    idx.reshape(-1)[:2] = idx.reshape(-1)[0]  # a repeated index
    ref = np.take(table[(0,) * a], idx, axis=0)
    (y,) = rlx.to_jax(g)({"t": table}, {"i": idx})
    np.testing.assert_array_equal(np.asarray(y), ref)
    c = rlx.Session().compile(g)
    c.set_param("t", table)
    np.testing.assert_array_equal(c.run({"i": idx})[0], ref)
    # take is np.take along the same axis
    gt, o2 = _gather_graph(table_shape, idx_shape, axis, take=True)
    assert gt.shape_of(o2)[0] == list(np.take(table, idx, axis=a).shape)
    (z,) = rlx.to_jax(gt)({"t": table}, {"i": idx})
    np.testing.assert_array_equal(np.asarray(z), np.take(table, idx, axis=a))


def test_gather_with_a_zero_sized_lead_dim_gives_zeros():
    g, out = _gather_graph((0, 4, 3), (2,), 1)
    assert g.shape_of(out) == ([2, 3], "f32")
    (y,) = rlx.to_jax(g)({"t": np.zeros((0, 4, 3), np.float32)}, {"i": np.array([1, 3], np.int32)})
    np.testing.assert_array_equal(np.asarray(y), np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("take", [False, True])
def test_gather_axis1_graph_gradient_matches_jax_and_finite_differences(x64, take):
    ts, ishape, axis = (2, 5, 3), (2, 3), 1
    g = rlx.Graph("ga_grad")
    t = g.param("t", list(ts), "f64")
    i = g.input("i", list(ishape), "i32")
    y = (g.take if take else g.gather)(t, i, axis)
    wgt = g.input("wgt", g.shape_of(y)[0], "f64")
    loss = g.sum(g.mul(g.sin(y), wgt), list(range(len(g.shape_of(y)[0]))), False)
    g.set_outputs([loss])
    table = RNG.standard_normal(ts)
    idx = np.array([[4, 0, 4], [1, 1, 3]], np.int32)
    wv = RNG.standard_normal(g.shape_of(y)[0])
    f = rlx.to_jax(g)
    ref = jax.grad(lambda tv: f({"t": tv}, {"i": idx, "wgt": wv})[0])(table)
    gg = rlx.grad_with_loss(g, ["t"])
    _, dt = rlx.to_jax(gg)({"t": table}, {"i": idx, "wgt": wv, "d_output": np.float64(1.0)})
    np.testing.assert_allclose(np.asarray(dt), np.asarray(ref), rtol=1e-12, atol=1e-12)
    h = 1e-6
    fd = np.zeros(ts)
    for k in np.ndindex(ts):
        e = np.zeros(ts)
        e[k] = h
        fd[k] = (f({"t": table + e}, {"i": idx, "wgt": wv})[0] - f({"t": table - e}, {"i": idx, "wgt": wv})[0]) / (2 * h)
    np.testing.assert_allclose(np.asarray(dt), fd, rtol=1e-6, atol=1e-8)
    if not take:
        assert np.all(np.asarray(dt)[1] == 0)  # the second lead slice is never read


@pytest.mark.parametrize("layout", ["gather", "take"])
def test_gather_backward_accepts_both_dy_layouts(layout):
    ts, axis = (3, 5, 2), 1
    idx = np.array([[4, 0], [4, 2]], np.int32)
    dy_shape = (2, 2, 2) if layout == "gather" else (3, 2, 2, 2)
    dyv = RNG.standard_normal(dy_shape).astype(np.float32)
    g = rlx.Graph("gb")
    dy = g.input("dy", list(dy_shape), "f32")
    i = g.input("i", [2, 2], "i32")
    d_table = g.gather_backward(dy, i, list(ts), axis)
    g.set_outputs([d_table])
    (got,) = rlx.to_jax(g)({}, {"dy": dyv, "i": idx})
    ref = np.zeros(ts, np.float32)
    full = dyv[None] if layout == "gather" else dyv  # gather layout: lead slice 0 only
    for o in range(full.shape[0]):
        for k in np.ndindex(idx.shape):
            ref[o, idx[k]] += full[(o, *k)]
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-6)
    # its VJP (a gather of the cotangent) returns dy's layout
    wv = RNG.standard_normal(ts).astype(np.float32)
    g2 = rlx.Graph("gb2")
    dy2 = g2.param("dy", list(dy_shape), "f32")
    i2 = g2.input("i", [2, 2], "i32")
    w2 = g2.input("w", list(ts), "f32")
    g2.set_outputs([g2.sum(g2.mul(g2.gather_backward(dy2, i2, list(ts), axis), w2), [0, 1, 2], False)])
    gg = rlx.grad_with_loss(g2, ["dy"])
    _, ddy = rlx.to_jax(gg)({"dy": dyv}, {"i": idx, "w": wv, "d_output": np.float32(1.0)})
    want = np.take(wv, idx, axis=1) if layout == "take" else np.take(wv[0], idx, axis=0)
    np.testing.assert_allclose(np.asarray(ddy), want, rtol=1e-6, atol=1e-6)


def test_gather_bad_dy_layout_is_rejected():
    g = rlx.Graph("gb_bad")
    dy = g.input("dy", [2, 2, 2, 2, 2], "f32")
    i = g.input("i", [2, 2], "i32")
    with pytest.raises(rlx.GraphError, match="matches neither"):
        g.gather_backward(dy, i, [3, 5, 2], 1)


def test_gather_axis1_under_jit_and_vmap_of_the_lowered_graph():
    g, _ = _gather_graph((1, 6, 4), (3,), 1)
    f = rlx.to_jax(g)
    tables = RNG.standard_normal((5, 1, 6, 4)).astype(np.float32)
    idx = np.array([5, 0, 5], np.int32)
    out = jax.jit(jax.vmap(lambda t: f({"t": t}, {"i": idx})[0]))(tables)
    np.testing.assert_array_equal(np.asarray(out), tables[:, 0][:, idx])


def test_graph_vmap_of_an_embedding_lookup_over_the_table():
    g = rlx.Graph("emb")
    t = g.input("t", [6, 4], "f32")
    i = g.input("i", [3], "i32")
    g.set_outputs([g.gather(t, i, 0)])
    vg = rlx.vmap(g, ["t"], 5)
    tables = RNG.standard_normal((5, 6, 4)).astype(np.float32)
    idx = np.array([5, 0, 5], np.int32)
    (out,) = rlx.to_jax(vg)({}, {"t": tables, "i": idx})
    np.testing.assert_array_equal(np.asarray(out), tables[:, idx])


# ---- pyrlx's README and guides, re-written for the CPU device --------------------------------

def test_readme_quickstart_hello_graph_with_python_lists():
    g = rlx.Graph("hello")
    x = g.input("x", (1, 4), "f32")
    w = g.param("w", (4, 2), "f32")
    y = g.matmul(x, w)
    g.set_outputs([y])
    compiled = rlx.Session("cpu").compile(g)
    compiled.set_param("w", [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])  # flat list
    out = compiled.run({"x": [1.0, 2.0, 3.0, 4.0]})
    np.testing.assert_allclose(out[0], np.array([[1, 2, 3, 4]], np.float32) @ np.array(
        [[1, 0], [0, 1], [1, 0], [0, 1]], np.float32))
    assert out[0].shape == (1, 2) and out[0].dtype == np.float32


def test_quickstart_confirm_what_shipped():
    assert "cpu" in rlx.available_devices()
    assert rlx.is_available("cuda") is _jax_has("cuda")
    assert rlx.is_available("metal") is False


def test_quickstart_build_compile_run_and_switch_backends():
    def make_graph():
        g = rlx.Graph("mlp")
        x = g.input("x", [128, 768], "f32")
        w = g.param("w", [768, 768], "f32")
        b = g.param("b", [768], "f32")
        g.set_outputs([g.gelu(g.add(g.matmul(x, w), b))])  # shapes inferred
        return g

    rng = np.random.default_rng(0)
    w = rng.standard_normal((768, 768)).astype(np.float32) / 768 ** 0.5
    b = np.zeros(768, dtype=np.float32)
    xv = rng.standard_normal((128, 768)).astype(np.float32)
    g = make_graph()
    compiled = rlx.Session(device="cpu").compile(g)  # consumes g
    compiled.set_param("w", w)
    compiled.set_param("b", b)
    [y] = compiled.run({"x": xv})
    assert y.shape == (128, 768)
    np.testing.assert_allclose(y, gelu(xv.astype(np.float64) @ w + b), rtol=2e-4, atol=2e-4)
    with pytest.raises(RuntimeError):
        rlx.Session(device="cpu").compile(g)
    means = {}
    for dev in rlx.available_devices():  # the parity loop of "Switch backends"
        c = rlx.Session(device=dev).compile(make_graph())
        c.set_param("w", w)
        c.set_param("b", b)
        [yd] = c.run({"x": xv})
        means[dev] = float(yd.mean())
        np.testing.assert_allclose(yd, y, rtol=1e-2, atol=1e-2)  # TF32 on GPUs
    assert "cpu" in means


def test_backends_guide_contract():
    with pytest.raises(RuntimeError, match="--features metal"):
        rlx.Session(device="metal")
    assert rlx.Session(precision="f16").precision == "f16"
    # aliases: each alias is unavailable exactly when its target is
    for alias, target in {"nvidia": "cuda", "amd": "rocm", "hip": "rocm", "wgpu": "wgpu",
                          "vk": "vulkan", "dx12": "directx", "d3d12": "directx",
                          "mtl": "metal"}.items():
        assert rlx.is_available(alias) is rlx.is_available(target)
    before = rlx.available_devices()
    rlx.Session("cpu")
    assert rlx.available_devices() == before  # the registry is per process, stable


def test_jacfwd_helper_on_a_session_compiled_jvp_graph(x64):
    n = 3
    g = rlx.Graph("jac_inverse")
    a = g.input("A", [n, n], "f64")
    b = g.input("b", [n], "f64")
    g.set_outputs([g.dense_solve(a, b, [n], "f64")])
    compiled = rlx.Session(device="cpu").compile(rlx.jvp(g, [b]))
    A = np.eye(n) * 2 + RNG.standard_normal((n, n)) * 0.2
    (jac,) = rlx.jacfwd(compiled, primals={"A": A, "b": RNG.standard_normal(n)}, wrt_name="b",
                        wrt_shape=(n,), dtype="f64")
    assert jac.shape == (n, n)
    np.testing.assert_allclose(jac, np.linalg.inv(A), rtol=1e-10, atol=1e-12)
