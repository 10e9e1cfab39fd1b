"""Elementwise rules vs NumPy: Activation, Binary (broadcast), Compare, Where, Cast,
Conjugate, StopGradient, ElementwiseRegion, ReluBackward, ActivationBackward."""

import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx
from rlx_jax.ir import OP_CLASSES

RNG = np.random.default_rng(1)
_erf = np.vectorize(math.erf)

NP_ACT = {
    "gelu": lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    "gelu_approx": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "tanh": np.tanh,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "neg": np.negative,
    "abs": np.abs,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "atan": np.arctan,
    "round": lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5),  # Rust f32::round
}
POSITIVE = {"log", "sqrt", "rsqrt"}


def run(g, **inputs):
    return [np.asarray(o) for o in rlx.to_jax(g)({}, inputs)]


@pytest.mark.parametrize("kind", sorted(NP_ACT))
def test_activation_matches_numpy_on_odd_shape(kind):
    x = RNG.standard_normal((3, 5, 7)).astype(np.float32) * 2
    if kind in POSITIVE:
        x = np.abs(x) + 0.1
    if kind == "round":
        x[0, 0, :3] = [0.5, 1.5, -2.5]
    g = rlx.Graph("act")
    i = g.input("x", list(x.shape), "f32")
    g.set_outputs([g.activation(kind, i)])
    (y,) = run(g, x=x)
    np.testing.assert_allclose(y, NP_ACT[kind](x.astype(np.float64)), rtol=2e-5, atol=2e-6)


def test_round_gradient_is_straight_through():
    g = rlx.Graph("r")
    i = g.input("x", [4], "f32")
    g.set_outputs([g.sum(g.round(i), [0])])
    f = rlx.to_jax(g)
    gr = jax.grad(lambda x: f({}, {"x": x})[0])(jnp.array([0.2, 1.7, -3.4, 2.5]))
    np.testing.assert_array_equal(gr, np.ones(4))


NP_BIN = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum, "pow": np.power}


@pytest.mark.parametrize("op", sorted(NP_BIN))
def test_binary_broadcasts_like_numpy(op):
    a = RNG.standard_normal((4, 1, 5)).astype(np.float32)
    b = RNG.standard_normal((3, 1)).astype(np.float32)
    if op == "pow":
        a = np.abs(a) + 0.5
    g = rlx.Graph("bin")
    ia = g.input("a", list(a.shape), "f32")
    ib = g.input("b", list(b.shape), "f32")
    g.set_outputs([g.binary(op, ia, ib)])
    (y,) = run(g, a=a, b=b)
    assert y.shape == (4, 3, 5)
    np.testing.assert_allclose(y, NP_BIN[op](a, b), rtol=1e-5, atol=1e-6)


def test_integer_div_truncates_toward_zero():
    g = rlx.Graph("idiv")
    ia = g.input("a", [4], "i32")
    ib = g.input("b", [4], "i32")
    g.set_outputs([g.div(ia, ib)])
    (y,) = run(g, a=np.array([7, -7, 7, -7], np.int32), b=np.array([2, 2, -2, -2], np.int32))
    np.testing.assert_array_equal(y, [3, -3, -3, 3])


@pytest.mark.parametrize("kind,np_fn", [("relu", lambda x: np.maximum(x, 0)), ("neg", np.negative),
                                        ("abs", np.abs), ("round", lambda x: x)])
@pytest.mark.parametrize("dtype", ["i32", "i8"])
def test_integer_activations_the_ir_allows(kind, np_fn, dtype):
    """Relu, Neg, Abs and Round are defined on integers (the IR accepts them): exact,
    wrapping as the dtype does (-(-128) is -128 in i8)."""
    npd = {"i32": np.int32, "i8": np.int8}[dtype]
    x = np.array([-128, -3, -1, 0, 2, 127], npd)
    g = rlx.Graph("iact")
    g.set_outputs([g.activation(kind, g.input("x", [6], dtype))])
    (y,) = run(g, x=x)
    assert y.dtype == npd
    np.testing.assert_array_equal(y, np_fn(x))


@pytest.mark.parametrize("dtype", ["i32", "i64", "u8"])
def test_integer_pow_truncates_toward_zero_for_negative_exponents(dtype, request):
    """a ** b of integers is trunc(a^b): 1 / a^|b| for b < 0 is 0 but for a = +-1."""
    if dtype == "i64":
        request.getfixturevalue("x64")
    signed = dtype != "u8"
    a = np.array([5, 2, 1, -1, -1, 3, 0, 2, -3, 7], np.int64)
    b = np.array([-1, -1, -1, -1, -2, -3, -2, 10, 3, 0], np.int64)
    if not signed:
        a, b = np.abs(a), np.abs(b)
    want = np.array([int(np.trunc(float(x) ** float(y))) if (x, y) != (0, -2) else 0 for x, y in zip(a, b)])
    g = rlx.Graph("ipow")
    ia, ib = g.input("a", [10], dtype), g.input("b", [10], dtype)
    g.set_outputs([g.binary("pow", ia, ib)])
    npd = {"i32": np.int32, "i64": np.int64, "u8": np.uint8}[dtype]
    (y,) = run(g, a=a.astype(npd), b=b.astype(npd))
    np.testing.assert_array_equal(y, want.astype(npd))


NP_CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
          "gt": np.greater, "ge": np.greater_equal}


@pytest.mark.parametrize("op", sorted(NP_CMP))
def test_compare_gives_bool_with_broadcast(op):
    a = RNG.integers(0, 3, (2, 5)).astype(np.float32)
    b = RNG.integers(0, 3, (5,)).astype(np.float32)
    g = rlx.Graph("cmp")
    ia = g.input("a", [2, 5], "f32")
    ib = g.input("b", [5], "f32")
    g.set_outputs([g.compare(op, ia, ib)])
    (y,) = run(g, a=a, b=b)
    assert y.dtype == np.bool_
    np.testing.assert_array_equal(y, NP_CMP[op](a, b))


def test_where_with_bool_and_numeric_condition():
    c = RNG.standard_normal((3, 4)) > 0
    a = RNG.standard_normal((3, 4)).astype(np.float32)
    b = RNG.standard_normal((4,)).astype(np.float32)
    g = rlx.Graph("w")
    ic = g.input("c", [3, 4], "bool")
    ia = g.input("a", [3, 4], "f32")
    ib = g.input("b", [4], "f32")
    fc = g.cast(ic, "f32")
    g.set_outputs([g.where_(ic, ia, ib), g.where_(fc, ia, ib)])
    y1, y2 = run(g, c=c, a=a, b=b)
    np.testing.assert_array_equal(y1, np.where(c, a, b))
    np.testing.assert_array_equal(y2, np.where(c, a, b))


def test_cast_truncates_and_converts():
    x = np.array([-2.7, -0.5, 0.0, 1.9, 3.5], np.float32)
    g = rlx.Graph("cast")
    i = g.input("x", [5], "f32")
    g.set_outputs([g.cast(i, "i32"), g.cast(g.gt_(i, g.scalar(0.0)), "f32"), g.cast(i, "c64")])
    yi, yb, yc = run(g, x=x)
    np.testing.assert_array_equal(yi, [-2, 0, 0, 1, 3])
    assert yi.dtype == np.int32
    np.testing.assert_array_equal(yb, (x > 0).astype(np.float32))
    np.testing.assert_array_equal(yc, x.astype(np.complex64))


def test_conjugate_and_stop_gradient():
    z = (RNG.standard_normal(3) + 1j * RNG.standard_normal(3)).astype(np.complex64)
    g = rlx.Graph("cj")
    i = g.input("z", [3], "c64")
    g.set_outputs([g.conjugate(i)])
    np.testing.assert_array_equal(run(g, z=z)[0], np.conj(z))

    g = rlx.Graph("sg")
    i = g.input("x", [3], "f32")
    g.set_outputs([g.sum(g.mul(g.stop_gradient(i), i), [0])])
    f = rlx.to_jax(g)
    x = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(jax.grad(lambda x: f({}, {"x": x})[0])(x), x)


def test_elementwise_region_chain():
    from rlx_jax.ir.op import ChainOperand, ChainStep

    a = RNG.standard_normal((2, 3)).astype(np.float32)
    b = RNG.standard_normal((3,)).astype(np.float32)
    chain = [
        ChainStep("Binary", "Mul", (ChainOperand("Input", 0), ChainOperand("Input", 1))),
        ChainStep("Activation", "Tanh", (ChainOperand("Step", 0),)),
        ChainStep("Compare", "Gt", (ChainOperand("Step", 1), ChainOperand("Input", 1))),
        ChainStep("Where", None, (ChainOperand("Step", 2), ChainOperand("Step", 1),
                                  ChainOperand("Input", 0))),
    ]
    g = rlx.Graph("region")
    ia = g.input("a", [2, 3], "f32")
    ib = g.input("b", [3], "f32")
    g.set_outputs([g.elementwise_region([ia, ib], chain, [2, 3], "f32")])
    (y,) = run(g, a=a, b=b)
    t = np.tanh(a * b)
    np.testing.assert_allclose(y, np.where(t > b, t, a), rtol=1e-6)


def _backward_graph(op_name, x, **attrs):
    cls = OP_CLASSES[op_name]
    g = rlx.Graph("bwd")
    ix = g.input("x", list(x.shape), "f32")
    idy = g.input("dy", list(x.shape), "f32")
    g.set_outputs([g.add(cls(**attrs), [ix, idy])])
    return g


def test_relu_backward():
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    x[0, 0] = 0.0
    dy = RNG.standard_normal((3, 5)).astype(np.float32)
    (dx,) = run(_backward_graph("ReluBackward", x), x=x, dy=dy)
    np.testing.assert_array_equal(dx, np.where(x > 0, dy, 0))


ACTIVATION_KINDS = ["Gelu", "GeluApprox", "Silu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Rsqrt", "Neg", "Abs",
                    "Sin", "Cos", "Tan", "Atan", "Relu", "Round"]


@pytest.mark.parametrize("kind", ACTIVATION_KINDS)
def test_activation_backward_matches_autodiff_of_numpy_forms(kind):
    # inputs of the test's own seed (the module's RNG state depends on which tests ran
    # before in the same worker)
    rng = np.random.default_rng(ACTIVATION_KINDS.index(kind))
    x = rng.standard_normal((4, 3)).astype(np.float32)
    if kind in ("Log", "Sqrt", "Rsqrt"):
        x = np.abs(x) + 0.2
    if kind == "Tan":
        # away from the poles at +-pi/2, where the central difference's error (about
        # (h / (pi/2 - |x|))^2 of the slope) exceeds the tolerance (a draw near pi/2 was
        # 4.7 % off)
        x = np.clip(x, -1.2, 1.2)
    dy = rng.standard_normal((4, 3)).astype(np.float32)
    (dx,) = run(_backward_graph("ActivationBackward", x, kind=kind), x=x, dy=dy)
    name = {"GeluApprox": "gelu_approx"}.get(kind, kind.lower())
    f = NP_ACT[name]
    h = 1e-3
    xd = x.astype(np.float64)
    num = (f(xd + h) - f(xd - h)) / (2 * h) if kind not in ("Round",) else np.ones_like(xd)
    np.testing.assert_allclose(dx, num * dy, rtol=2e-3, atol=2e-3)


def test_elementwise_region_flat_modulo_broadcast():
    from rlx_jax.ir.op import ChainOperand, ChainStep

    a = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    b = RNG.standard_normal((12,)).astype(np.float32)  # tiles the output by flat modulo
    chain = [ChainStep("Binary", "Add", (ChainOperand("Input", 0), ChainOperand("Input", 1)))]
    g = rlx.Graph("region")
    ia = g.input("a", [2, 3, 4], "f32")
    ib = g.input("b", [12], "f32")
    g.set_outputs([g.elementwise_region([ia, ib], chain, [2, 3, 4], "f32")])
    (y,) = run(g, a=a, b=b)
    np.testing.assert_allclose(y, a + np.tile(b, 2).reshape(2, 3, 4), rtol=1e-6)


def test_elementwise_region_reads_input_modulus_and_scalar_inputs():
    """RLX's kernels read input i at gid % input_modulus[i] and a scalar-marked input at
    element 0, whatever numpy broadcasting would do with the shapes."""
    from rlx_jax.ir.op import ChainOperand, ChainStep

    add = [ChainStep("Binary", "Add", (ChainOperand("Input", 0), ChainOperand("Input", 1)))]
    g = rlx.Graph("modulus")
    x, y = g.input("x", [2, 1], "f32"), g.input("y", [2, 2], "f32")
    g.set_outputs([g.elementwise_region([x, y], add, [2, 2], "f32", input_modulus=[2] + [0] * 15)])
    xv, yv = np.array([[10.0], [20.0]], np.float32), RNG.standard_normal((2, 2)).astype(np.float32)
    (out,) = run(g, x=xv, y=yv)
    np.testing.assert_allclose(out, np.array([[10.0, 20.0], [10.0, 20.0]]) + yv, rtol=1e-6)  # numpy: [[10,10],[20,20]]

    g = rlx.Graph("scalar")
    x, y = g.input("x", [3], "f32"), g.input("y", [3], "f32")
    mul = [ChainStep("Binary", "Mul", (ChainOperand("Input", 0), ChainOperand("Input", 1)))]
    g.set_outputs([g.elementwise_region([x, y], mul, [3], "f32", scalar_input_mask=0b10)])
    (out,) = run(g, x=np.array([1.0, 2.0, 3.0], np.float32), y=np.array([5.0, 6.0, 7.0], np.float32))
    np.testing.assert_allclose(out, [5.0, 10.0, 15.0])


@pytest.mark.parametrize("x_shape,modulus,mask", [([2, 1], 2, 0), ([3], 0, 0b01), ([5], 3, 0)],
                         ids=["modulus_2", "scalar", "modulus_3_of_5"])
def test_elementwise_region_gradients_follow_the_modulus_and_scalar_reads(x_shape, modulus, mask):
    """grad_with_loss of a region reads its inputs as the lowering does: against jax.grad."""
    from rlx_jax.ir.op import ChainOperand, ChainStep

    chain = [ChainStep("Binary", "Mul", (ChainOperand("Input", 0), ChainOperand("Input", 1))),
             ChainStep("Activation", "Tanh", (ChainOperand("Step", 0),))]
    g = rlx.Graph("region_grad")
    x, y = g.param("x", x_shape, "f32"), g.param("y", [2, 2], "f32")
    r = g.elementwise_region([x, y], chain, [2, 2], "f32", scalar_input_mask=mask,
                             input_modulus=[modulus] + [0] * 15)
    g.set_outputs([g.sum(g.mul(r, r), [0, 1])])
    p = {"x": RNG.standard_normal(x_shape).astype(np.float32), "y": RNG.standard_normal((2, 2)).astype(np.float32)}
    f = rlx.to_jax(g)
    want = jax.grad(lambda p: f(p, {})[0])(p)
    got = rlx.to_jax(rlx.grad_with_loss(g, ["x", "y"]))(p, {"d_output": np.float32(1)})
    np.testing.assert_allclose(got[1], want["x"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want["y"], rtol=1e-5, atol=1e-6)
