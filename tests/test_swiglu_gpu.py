"""SwiGLU on the GPU: the CUDA kernels rlx_swiglu_bwd and rlx_swiglu_bwd_product (the same
backward writing the product h too; ffi/cuda/swiglu.cu) against a NumPy float64 oracle, and
swiglu_linear's backward. Skipped where JAX sees no GPU.

Shapes cover the 16-byte vector path (8 bf16 / f16 or 4 f32 a load) over a Llama MLP's
[16384, 5632], the scalar tail after the last whole vector (flat lengths not a multiple
of 8), tiny and zero-sized buffers, and operands cut out of larger arrays at odd offsets
(the scalar path when a buffer is not 16-byte aligned); infinities, determinism, vmap,
f64 (the reference) and the handler's own operand checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import gpu, requires_gpu
from testutil import check_relative_close, check_swiglu_bwd_over_every_bit_pattern, check_swiglu_close, numpy_swiglu
from rlx_jax.ops import swiglu, swiglu_backward, swiglu_linear
from rlx_jax.vjp_rules.swiglu import swiglu_bwd, swiglu_bwd_product

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# per-element error allowed, relative to |value| plus the same fraction of max |value|:
# one rounding to the dtype after f32 arithmetic (__expf under fast math: a few ulp of f32)
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-10}


def _inputs(shape, dtype, seed=0):
    ka, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    dev = gpu()
    a = (3.0 * jax.random.normal(ka, shape, jnp.float32)).astype(dtype)
    b = jax.random.normal(kb, shape, jnp.float32).astype(dtype)
    dh = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return [jax.device_put(v, dev) for v in (a, b, dh)]


def _check(got, want, dtype, what):
    check_swiglu_close(got, want, dtype, RTOL[jnp.dtype(dtype).type], what, finite=True)


@jax.jit
def _vjp(a, b, dh):
    h, pullback = jax.vjp(swiglu, a, b)
    return (h, *pullback(dh))


def test_cuda_kernel_loaded_and_only_in_the_backward():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert "rlx_swiglu_bwd_v1" in info["targets"]
    a, b, dh = _inputs((8, 256), jnp.bfloat16)
    assert "rlx_swiglu_bwd" in _vjp.lower(a, b, dh).as_text()
    assert "custom_call" not in jax.jit(swiglu).lower(a, b).as_text()


SHAPES = [
    (16384, 5632),  # a Llama MLP's activations: the vector path at scale
    (3, 7, 33),  # 693 elements: 86 vectors of 8 and a tail of 5 (bf16 / f16), 173 of 4 and 1 (f32)
    (1001,),  # odd flat length
    (7,),  # shorter than one vector: the tail alone
    (1,),
    (),
    (0, 8),
    (4, 0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values_and_gradients_match_numpy(shape, dtype):
    a, b, dh = _inputs(shape, dtype, seed=len(shape))
    h, da, db = _vjp(a, b, dh)
    want_h, want_da, want_db = numpy_swiglu(a, b, dh)
    _check(h, want_h, dtype, "h")
    _check(da, want_da, dtype, "da")
    _check(db, want_db, dtype, "db")
    bda, bdb = jax.jit(swiglu_backward)(a, b, dh)
    _check(bda, want_da, dtype, "swiglu_backward da")
    _check(bdb, want_db, dtype, "swiglu_backward db")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_product_kernel_matches_numpy_and_the_plain_backward(shape, dtype):
    """rlx_swiglu_bwd_product: (da, db) bitwise those of rlx_swiglu_bwd, h the oracle's
    product, on the vector path, the tail and empty buffers."""
    a, b, dh = _inputs(shape, dtype, seed=len(shape) + 10)
    fn = jax.jit(lambda a, b, dh: swiglu_bwd_product(*(v.reshape(-1) for v in (a, b, dh))))
    assert "rlx_swiglu_bwd_product" in fn.lower(a, b, dh).as_text()
    da, db, h = (v.reshape(a.shape) for v in fn(a, b, dh))
    pda, pdb = jax.jit(lambda a, b, dh: swiglu_bwd(*(v.reshape(-1) for v in (a, b, dh))))(a, b, dh)
    np.testing.assert_array_equal(np.asarray(da), np.asarray(pda).reshape(a.shape))
    np.testing.assert_array_equal(np.asarray(db), np.asarray(pdb).reshape(a.shape))
    want_h, want_da, _ = numpy_swiglu(a, b, dh)
    _check(h, want_h, dtype, "h")
    _check(da, want_da, dtype, "da")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_product_kernel_at_odd_offsets(dtype):
    """The product kernel on operands sliced at an odd offset (the scalar path where XLA
    passes the slice in place)."""
    n, offset = 4099, 3
    a, b, dh = _inputs((n + 16,), dtype, seed=21)
    cut = lambda v: jax.lax.slice(v, (offset,), (offset + n,))  # noqa: E731
    da, db, h = jax.jit(lambda a, b, dh: swiglu_bwd_product(cut(a), cut(b), cut(dh)))(a, b, dh)
    want = numpy_swiglu(*(np.asarray(v.astype(jnp.float32))[offset:offset + n] for v in (a, b, dh)))
    for got, w, name in zip((h, da, db), want, ("h", "da", "db")):
        _check(got, w, dtype, name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_swiglu_linear_at_llama_shape(dtype):
    """swiglu_linear at a Llama MLP's [4096, 5632] -> 2048: the kernel in its backward, and
    values and gradients within the dtype's rounding of the f64 oracle (relative Frobenius
    error)."""
    dev = gpu()
    k = jax.random.split(jax.random.PRNGKey(22), 4)
    a = jax.device_put((2.0 * jax.random.normal(k[0], (4096, 5632))).astype(dtype), dev)
    b = jax.device_put(jax.random.normal(k[1], (4096, 5632)).astype(dtype), dev)
    w = jax.device_put((jax.random.normal(k[2], (5632, 2048)) / 75.0).astype(dtype), dev)
    dy = jax.device_put(jax.random.normal(k[3], (4096, 2048)).astype(dtype), dev)

    @jax.jit
    def vjp(a, b, w, dy):
        y, pull = jax.vjp(swiglu_linear, a, b, w)
        return (y, *pull(dy))

    assert "rlx_swiglu_bwd_product" in vjp.lower(a, b, w, dy).as_text()
    got = vjp(a, b, w, dy)
    A, B, W, DY = (np.asarray(v.astype(jnp.float32), np.float64) for v in (a, b, w, dy))
    h, da, db = numpy_swiglu(A, B, DY @ W.T)
    want = (h @ W, da, db, h.T @ DY)
    tol = 2.0**-6 if dtype == jnp.bfloat16 else 2e-3  # f32 matmuls run in TF32 at JAX's default precision
    for g, r, name in zip(got, want, ("y", "da", "db", "dw")):
        check_relative_close(g, r, dtype, tol, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("offset", [1, 3, 8])
def test_operands_cut_at_odd_offsets(offset, dtype):
    """Operands sliced out of larger flat arrays at element offsets inside the jitted
    function: where XLA hands the kernel such a slice in place (an address that is not
    16-byte aligned), the scalar path runs; where it copies the slice first, the vector
    path does. The values must hold either way."""
    n = 4099
    a, b, dh = _inputs((n + 16,), dtype, seed=offset)
    cut = lambda v: jax.lax.slice(v, (offset,), (offset + n,))  # noqa: E731
    da, db = jax.jit(lambda a, b, dh: swiglu_bwd(cut(a), cut(b), cut(dh)))(a, b, dh)
    _, want_da, want_db = numpy_swiglu(*(np.asarray(v.astype(jnp.float32))[offset:offset + n] for v in (a, b, dh)))
    _check(da, want_da, dtype, "da")
    _check(db, want_db, dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_infinite_and_large_gates_give_the_limits(dtype):
    """a = -inf: h = 0, da = 0, db = 0; a = +inf: da = dh b, h and db infinite; large
    finite |a| (f16's range allowing) finite and close to the oracle; in the vector body
    and in the tail (9 gates: one vector of 8 and one tail element for bf16 / f16)."""
    gates = np.array([-np.inf, np.inf, -100.0, 100.0, -30.0, 30.0, -1.0, 0.0, -np.inf])
    n = gates.size
    b = np.linspace(0.5, 1.5, n) * np.where(np.arange(n) % 2, -1.0, 1.0)
    dh = np.linspace(-1.25, 2.0, n)
    a, bj, dj = (jax.device_put(jnp.asarray(v, dtype), gpu()) for v in (gates, b, dh))
    h, da, db = _vjp(a, bj, dj)
    bf, df = (np.asarray(v.astype(jnp.float32), np.float64) for v in (bj, dj))
    with np.errstate(over="ignore", invalid="ignore"):
        want = list(numpy_swiglu(a, bj, dj))
    for i in (0, n - 1):  # -inf
        for w in want:
            w[i] = 0.0
    want[0][1], want[1][1], want[2][1] = np.inf * np.sign(bf[1]), df[1] * bf[1], np.inf * np.sign(df[1])
    for got, w, name in zip((h, da, db), want, ("h", "da", "db")):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        assert not np.isnan(got).any(), (name, got)
        np.testing.assert_array_equal(got[~np.isfinite(w)], w[~np.isfinite(w)], err_msg=name)
        fin = np.isfinite(w)
        np.testing.assert_allclose(got[fin], w[fin], rtol=2 * RTOL[jnp.dtype(dtype).type],
                                   atol=float(jnp.finfo(dtype).tiny), err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_16bit_conversions_over_every_bit_pattern(dtype):
    """At gate = 30, s = 1 and a s (1 - s) is below half an ulp of 1 in f32, so da = dh * up
    and db = 30 dh, exact f32 products rounded once: over all 2^16 bit patterns of dh (and
    7 more: a tail), the kernel's rounding must be NumPy's round to nearest even of the same
    products (NaN compared as NaN; bf16 subnormals, flushed under fast math, left out)."""
    check_swiglu_bwd_over_every_bit_pattern(dtype, lambda v: jax.device_put(jnp.asarray(v), gpu()))


def test_nan_propagates():
    a = jax.device_put(jnp.array([1.0, jnp.nan, -2.0, 0.5, 3.0, -1.0, 2.0, 0.0, jnp.nan], jnp.bfloat16), gpu())
    ones = jnp.ones_like(a)
    for v in _vjp(a, ones, ones):
        v = np.asarray(v.astype(jnp.float32))
        assert np.isnan(v[[1, 8]]).all() and np.isfinite(v[[0, 2, 3, 4, 5, 6, 7]]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_deterministic_bitwise(dtype):
    a, b, dh = _inputs((4096, 5632), dtype, seed=5)
    first = [np.asarray(v) for v in _vjp(a, b, dh)]
    for _ in range(3):
        for x, y in zip(first, _vjp(a, b, dh)):
            np.testing.assert_array_equal(x, np.asarray(y))


def test_vmap_keeps_kernel():
    a, b, dh = _inputs((3, 6, 40), jnp.bfloat16, seed=6)
    fn = jax.jit(jax.vmap(lambda a, b, dh: jax.vjp(swiglu, a, b)[1](dh), in_axes=(1, 1, 1), out_axes=1))
    assert "rlx_swiglu_bwd" in fn.lower(a, b, dh).as_text()
    da, db = fn(a, b, dh)
    _, want_da, want_db = numpy_swiglu(a, b, dh)
    _check(da, want_da, jnp.bfloat16, "vmap da")
    _check(db, want_db, jnp.bfloat16, "vmap db")


def test_f64_runs_the_reference(x64):
    a, b, dh = _inputs((5, 17), jnp.float64, seed=7)
    assert "rlx_swiglu_bwd" not in _vjp.lower(a, b, dh).as_text()
    h, da, db = _vjp(a, b, dh)
    for got, want in zip((h, da, db), numpy_swiglu(a, b, dh)):
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_handler_rejects_bad_operands():
    """The CUDA handler's own checks (the Python wrappers check first; a direct call
    reaches the handler)."""
    dev = gpu()
    x = jax.device_put(jnp.zeros((4, 8), jnp.float32), dev)

    def call(a, b, dh):
        out = (jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(a.shape, a.dtype))
        return jax.ffi.ffi_call("rlx_swiglu_bwd_v1", out)(a, b, dh)

    with pytest.raises(Exception, match="one shape"):
        jax.block_until_ready(jax.jit(call)(x, x, x[:3]))
    with pytest.raises(Exception, match="one dtype"):
        jax.block_until_ready(jax.jit(call)(x, x.astype(jnp.bfloat16), x))
    with pytest.raises(Exception, match="unsupported dtype"):
        xi = x.astype(jnp.int32)
        jax.block_until_ready(jax.jit(call)(xi, xi, xi))

    def call_product(a, b, dh, h_shape):
        out = (jax.ShapeDtypeStruct(a.shape, a.dtype),) * 2 + (jax.ShapeDtypeStruct(h_shape, a.dtype),)
        return jax.ffi.ffi_call("rlx_swiglu_bwd_product_v1", out)(a, b, dh)

    with pytest.raises(Exception, match="h has shape"):
        jax.block_until_ready(jax.jit(lambda a: call_product(a, a, a, (4, 7)))(x))
