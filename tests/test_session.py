"""pyrlx-style Session / CompiledGraph: build, compile, set_param, run, run_flat,
set_param_typed / run_typed (f64 stays f64), devices, errors."""

import logging

import numpy as np
import pytest

import jax

import rlx_jax as rlx

RNG = np.random.default_rng(11)


def mlp_graph():
    g = rlx.Graph("mlp")
    x = g.input("x", ["batch", 4], "f32")
    w = g.param("w", [4, 3], "f32")
    b = g.param("b", [3], "f32")
    y = g.relu(g.add(g.matmul(x, w), b))
    g.set_outputs([y, g.sum(y, [0, 1])])
    return g


@pytest.fixture
def compiled():
    c = rlx.Session("cpu").compile(mlp_graph())
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    c.set_param("w", w)
    c.set_param("b", b)
    return c, w, b


def test_session_properties_and_devices():
    s = rlx.Session(device="cpu", precision="f32")
    assert s.device == "cpu" and s.precision == "f32"
    assert "cpu" in repr(s)
    assert "cpu" in rlx.available_devices()
    assert rlx.is_available("cpu")
    assert rlx.is_available("metal") is False
    assert rlx.is_available("cuda") == bool([d for d in jax.devices() if d.platform == "gpu"])
    with pytest.raises(ValueError, match="unknown device"):
        rlx.is_available("abacus")
    with pytest.raises(ValueError, match="precision"):
        rlx.Session("cpu", "f8")
    if not rlx.is_available("cuda"):
        with pytest.raises(RuntimeError, match="not available"):
            rlx.Session("cuda")


def test_run_returns_numpy_outputs_at_any_batch(compiled):
    c, w, b = compiled
    for n in (2, 5):
        x = RNG.standard_normal((n, 4)).astype(np.float32)
        y, s = c.run({"x": x})
        assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (n, 3)
        ref = np.maximum(x @ w + b, 0)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s, ref.sum(), rtol=1e-5)
    flat = c.run_flat({"x": np.ones((2, 4), np.float32)})
    assert [f.shape for f in flat] == [(6,), (1,)]


def test_run_errors(compiled):
    c, _, _ = compiled
    with pytest.raises(ValueError, match="unexpected input 'z'"):
        c.run({"z": np.ones((2, 4), np.float32)})
    with pytest.raises(ValueError, match="'x'"):
        c.run({})
    with pytest.raises(ValueError, match="'x'.*shape"):
        c.run({"x": np.ones((2, 5), np.float32)})
    with pytest.raises(ValueError, match="no param 'nope'"):
        c.set_param("nope", np.ones(3, np.float32))
    with pytest.raises(ValueError, match="set_param\\('w'\\)"):
        c.set_param("w", np.ones((3, 5), np.float32))  # 15 elements cannot fill [4, 3]
    fresh = rlx.Session().compile(mlp_graph())
    with pytest.raises(ValueError, match="not set"):
        fresh.run({"x": np.ones((2, 4), np.float32)})


def _graph_compiles(run):
    """The XLA compilations of the graph's function (``jit(rlx_mlp)``) while ``run()`` runs,
    read from JAX's compile log. (The size of jit's C++ dispatch cache is not a measure of
    this: that cache is one LRU shared by every jitted function of the process, so in a
    long test run it can drop this function's entries.)"""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            run()
    finally:
        logger.removeHandler(handler)
    return [m for m in records if m.startswith("Compiling jit(rlx_mlp)")]


def test_run_is_jit_compiled_and_cached(compiled):
    c, _, _ = compiled
    x = np.ones((3, 4), np.float32)
    assert len(_graph_compiles(lambda: c.run({"x": x}))) == 1
    assert _graph_compiles(lambda: c.run({"x": x * 2})) == []  # same shapes: no recompile
    assert len(_graph_compiles(lambda: c.run({"x": np.ones((7, 4), np.float32)}))) == 1


def solve_graph(n):
    g = rlx.Graph("hello_resistor")
    a = g.input("A", [n, n], "f64")
    b = g.input("b", [n], "f64")
    x = g.dense_solve(a, b, [n], "f64")
    g.set_outputs([x, g.reduce(x, "sum", [0], False)])
    return g


def test_run_typed_f64_is_lossless():
    n = 3
    A = np.array([[4.0, -1.0, 0.0], [-1.0, 4.0, -1.0], [0.0, -1.0, 3.0]]) + 1e-9
    b = np.array([1.0, 2.0, 3.0 + 1e-12])
    c = rlx.Session("cpu").compile(solve_graph(n))
    outs = c.run_typed({"A": (A.tobytes(), "f64"), "b": (b.tobytes(), "f64")})
    (xb, xdt), (sb, sdt) = outs
    assert xdt == "f64" and sdt == "f64"
    x = np.frombuffer(xb, np.float64)
    np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(np.frombuffer(sb, np.float64)[0], np.linalg.solve(A, b).sum(), rtol=1e-14)
    assert not jax.config.jax_enable_x64  # the 64-bit scope did not leak
    with pytest.raises(TypeError, match="declares f64"):
        c.run_typed({"A": (A.astype(np.float32).tobytes(), "f32"), "b": (b.tobytes(), "f64")})
    with pytest.raises(ValueError, match="elements"):
        c.run_typed({"A": (A.tobytes()[:-8], "f64"), "b": (b.tobytes(), "f64")})


def test_set_param_typed_f64():
    g = rlx.Graph("p64")
    x = g.input("x", [2], "f64")
    w = g.param("w", [2], "f64")
    g.set_outputs([g.mul(x, w)])
    c = rlx.Session().compile(g)
    w0 = np.array([1 + 1e-12, 3.0])
    c.set_param_typed("w", w0.tobytes(), "f64")
    ((ob, dt),) = c.run_typed({"x": (np.array([2.0, 0.5]).tobytes(), "f64")})
    assert dt == "f64"
    np.testing.assert_array_equal(np.frombuffer(ob, np.float64), np.array([2.0, 0.5]) * w0)
    with pytest.raises(TypeError):
        c.set_param_typed("w", np.zeros(2, np.float32).tobytes(), "f32")


def test_run_typed_dynamic_dim_inferred_from_bytes(compiled):
    c, w, b = compiled
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    (yb, dt), _ = c.run_typed({"x": (x.tobytes(), "f32")})
    assert dt == "f32"
    np.testing.assert_allclose(np.frombuffer(yb, np.float32).reshape(5, 3), np.maximum(x @ w + b, 0),
                               rtol=1e-5, atol=1e-6)


def test_bf16_precision_computes_in_bf16_and_returns_f32():
    g = mlp_graph()
    c = rlx.Session("cpu", "bf16").compile(g)
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    c.set_param("w", w)
    c.set_param("b", b)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    y, _ = c.run({"x": x})
    assert y.dtype == np.float32
    ref = np.maximum(x @ w + b, 0)
    np.testing.assert_allclose(y, ref, rtol=5e-2, atol=5e-2)
    assert not np.allclose(y, ref, rtol=1e-6, atol=1e-7)  # it really ran in bf16


@pytest.mark.gpu
@pytest.mark.skipif(not rlx.is_available("cuda"), reason="no NVIDIA GPU here")
def test_cuda_session_runs_on_the_gpu():
    c = rlx.Session("cuda").compile(mlp_graph())
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    c.set_param("w", w)
    c.set_param("b", b)
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    y, _ = c.run({"x": x})
    assert c.device == "cuda"
    np.testing.assert_allclose(y, np.maximum(x @ w + b, 0), rtol=1e-2, atol=1e-2)  # TF32 matmuls


def test_flat_buffers_are_reshaped_like_pyrlx(compiled):
    c, w, b = compiled
    c.set_param("w", w.reshape(-1))  # pyrlx reads params as flat f32 buffers
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    y, _ = c.run({"x": x.reshape(-1)})  # the dynamic batch dim is inferred from the size
    np.testing.assert_allclose(y, np.maximum(x @ w + b, 0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="'x'"):
        c.run({"x": np.ones(7, np.float32)})


def test_set_param_after_a_run_takes_effect(compiled):
    c, w, b = compiled
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    y0, _ = c.run({"x": x})
    np.testing.assert_allclose(y0, np.maximum(x @ w + b, 0), rtol=1e-5, atol=1e-6)
    w2 = RNG.standard_normal((4, 3)).astype(np.float32)
    c.set_param("w", w2)
    y1, _ = c.run({"x": x})
    np.testing.assert_allclose(y1, np.maximum(x @ w2 + b, 0), rtol=1e-5, atol=1e-6)
    c.set_param_typed("b", np.zeros(3, np.float32).tobytes(), "f32")
    y2, _ = c.run({"x": x})
    np.testing.assert_allclose(y2, np.maximum(x @ w2, 0), rtol=1e-5, atol=1e-6)
