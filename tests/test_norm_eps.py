"""The norms' eps reaches their kernels exactly: an f64 call normalises with its own eps,
not with float32(eps), and the f32-eps ABI (version 1) of those targets stays callable for
functions serialized before the change.

Each case takes eps = 0.1 (not an f32 value: float32(0.1) = 0.10000000149) and inputs whose
statistic is of eps's order, so the f32 rounding moves y by about 1e-9 relative, far
outside the 1e-13 these checks allow. The oracles are NumPy in f64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax.ops import batch_norm_inference, group_norm, layer_norm, rms_norm

from testutil import hlo_text, platform

EPS = 0.1
EPS32 = float(np.float32(EPS))
F64 = jnp.float64

pytestmark = pytest.mark.skipif(platform() != "cpu", reason="f64 kernels are CPU kernels")


def _rms_oracle(x, g, b, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g + b


def _layer_oracle(x, g, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps) * g + b


def _group_oracle(x, g, b, eps, groups):
    n, c = x.shape[:2]
    xg = x.reshape(n, groups, -1)
    mu = xg.mean(axis=-1, keepdims=True)
    y = ((xg - mu) / np.sqrt(((xg - mu) ** 2).mean(axis=-1, keepdims=True) + eps)).reshape(x.shape)
    bcast = (1, c) + (1,) * (x.ndim - 2)
    return y * g.reshape(bcast) + b.reshape(bcast)


def _batch_dx_oracle(g, var, dy, eps):
    """d/dx of sum(dy * batch_norm_inference(x)) = dy * gamma / sqrt(var + eps) per channel."""
    bcast = (1, -1) + (1,) * (dy.ndim - 2)
    return dy * (g / np.sqrt(var + eps)).reshape(bcast)


def _data(seed, *shapes):
    r = np.random.default_rng(seed)
    return [0.3 * r.normal(size=s) for s in shapes]


def _check(got, want, off_by_f32_eps):
    """got matches the exact-eps oracle; the float32(eps) oracle is far from it, so the
    check would fail if the kernel used float32(eps)."""
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-14)
    assert np.max(np.abs(off_by_f32_eps - want)) > 1e-10


def test_f64_rms_norm_and_layer_norm_use_the_exact_eps(x64):
    x, g, b = _data(0, (6, 33), (33,), (33,))
    for op, oracle, target in ((rms_norm, _rms_oracle, "rlx_rms_norm_fwd_v2"),
                               (layer_norm, _layer_oracle, "rlx_layer_norm_fwd_v2")):
        fn = lambda x, g, b, op=op: op(x, g, b, eps=EPS)  # noqa: E731
        args = [jnp.asarray(a, F64) for a in (x, g, b)]
        assert target in hlo_text(fn, *args), f"{target} not in the lowered HLO"
        _check(jax.jit(fn)(*args), oracle(x, g, b, EPS), oracle(x, g, b, EPS32))


def test_f64_group_norm_uses_the_exact_eps(x64):
    x, g, b = _data(1, (2, 6, 5, 3), (6,), (6,))
    fn = lambda x, g, b: group_norm(x, g, b, num_groups=3, eps=EPS)  # noqa: E731
    args = [jnp.asarray(a, F64) for a in (x, g, b)]
    assert "rlx_group_norm_fwd_v2" in hlo_text(fn, *args)
    _check(jax.jit(fn)(*args), _group_oracle(x, g, b, EPS, 3), _group_oracle(x, g, b, EPS32, 3))


def test_f64_batch_norm_inference_gradient_uses_the_exact_eps(x64):
    x, g, b, m, dy = _data(2, (3, 4, 5), (4,), (4,), (4,), (3, 4, 5))
    var = np.full(4, 0.05) + np.arange(4) * 0.01  # var of eps's order
    args = [jnp.asarray(a, F64) for a in (x, g, b, m, var)]

    def dx(x, g, b, m, v):
        return jax.vjp(lambda x: batch_norm_inference(x, g, b, m, v, eps=EPS), x)[1](jnp.asarray(dy, F64))[0]

    assert "rlx_batch_norm_inference_bwd_v2" in hlo_text(dx, *args)
    _check(jax.jit(dx)(*args), _batch_dx_oracle(g, var, dy, EPS), _batch_dx_oracle(g, var, dy, EPS32))


def _stat(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.float64 if dtype == jnp.float64 else jnp.float32)


def _v1_and_v2(kernel, out, args, **attrs):
    """The kernel's outputs from its version-1 target (eps an f32 attribute) and from its
    version-2 target (eps f64), on the same operands."""
    v1 = jax.ffi.ffi_call(f"{kernel}_v1", out)(*args, **attrs, eps=np.float32(EPS))
    v2 = jax.ffi.ffi_call(f"{kernel}_v2", out)(*args, **attrs, eps=np.float64(EPS))
    return v1, v2


def _fwd_calls(dtype):
    """(kernel, outputs, operands, extra attributes, f64 oracle of output 0 at eps) per
    forward kernel that takes eps."""
    x, g, b = _data(3, (5, 24), (24,), (24,))
    xn, gn, bn = _data(4, (2, 6, 4), (6,), (6,))
    like = lambda a: jax.ShapeDtypeStruct(a.shape, dtype)  # noqa: E731
    return [
        ("rlx_rms_norm_fwd", (like(x), _stat((5,), dtype)), (x, g, b), {}, lambda e: _rms_oracle(x, g, b, e)),
        ("rlx_layer_norm_fwd", (like(x), _stat((5,), dtype), _stat((5,), dtype)), (x, g, b), {},
         lambda e: _layer_oracle(x, g, b, e)),
        ("rlx_group_norm_fwd", (like(xn), _stat((2, 3), dtype), _stat((2, 3), dtype)), (xn, gn, bn),
         {"num_groups": np.int64(3)}, lambda e: _group_oracle(xn, gn, bn, e, 3)),
    ]


def test_version_1_targets_stay_registered_and_take_an_f32_eps(x64):
    targets = set(rlx_jax.kernel_info()["cpu"]["targets"])
    for kernel in ("rlx_rms_norm_fwd", "rlx_layer_norm_fwd", "rlx_group_norm_fwd", "rlx_batch_norm_inference_bwd"):
        assert {f"{kernel}_v1", f"{kernel}_v2"} <= targets, kernel
    for kernel, out, args, attrs, oracle in _fwd_calls(jnp.float64):
        v1, v2 = _v1_and_v2(kernel, out, [jnp.asarray(a, F64) for a in args], **attrs)
        # version 1 keeps its f32 eps (what a function serialized against it computed)
        np.testing.assert_allclose(np.asarray(v1[0]), oracle(EPS32), rtol=1e-13, atol=1e-14, err_msg=kernel)
        np.testing.assert_allclose(np.asarray(v2[0]), oracle(EPS), rtol=1e-13, atol=1e-14, err_msg=kernel)
    for kernel, out, args, attrs, _ in _fwd_calls(jnp.float32):
        v1, v2 = _v1_and_v2(kernel, out, [jnp.asarray(a, jnp.float32) for a in args], **attrs)
        for a, c in zip(v1, v2):  # f32 inputs: both versions compute with float32(eps), bit for bit
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=kernel)
    x, g, m, dy = (jnp.asarray(a, F64) for a in _data(5, (3, 4, 5), (4,), (4,), (3, 4, 5)))
    var = jnp.asarray(np.full(4, 0.05), F64)
    p = jax.ShapeDtypeStruct((4,), F64)
    v1, v2 = _v1_and_v2("rlx_batch_norm_inference_bwd", (jax.ShapeDtypeStruct(x.shape, F64), p, p),
                        (x, g, m, var, dy))
    np.testing.assert_allclose(np.asarray(v1[0]), _batch_dx_oracle(g, var, dy, EPS32), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(v2[0]), _batch_dx_oracle(g, var, dy, EPS), rtol=1e-13)
