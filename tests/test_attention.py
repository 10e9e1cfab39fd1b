"""Attention end to end: the flash kernels vs an independent dense oracle (written here,
not the module's reference), gradients in every mode (second order in f64), every mask
kind with and without scale and softcap, GQA, Sq != Sk, odd lengths, fully masked rows,
zero-sized inputs, vmap, errors, determinism and O(S) memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import attention, attention_backward, attention_rlx
from rlx_jax.vjp_rules import attention as A
from rlx_jax.vjp_rules._primitive import fused_ops

from attention_reference import dense_attention
from testutil import assert_close, hlo_text, platform


# ---- inputs -----------------------------------------------------------------------------------


def _inputs(b, sq, sk, h, hkv, d, dtype=jnp.float32, seed=0):
    """q, k, v, mask (70% kept), bias, dy: random, as jax arrays (NumPy RNG: no compiles)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, std=1.0):
        return jnp.asarray((std * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    q, k, v = normal(b, sq, h, d), normal(b, sk, hkv, d), normal(b, sk, hkv, d)
    mask = jnp.asarray((rng.uniform(size=(b, sk)) > 0.3).astype(np.float32))
    bias = normal(b, h, sq, sk, std=0.5)
    dy = normal(b, sq, h, d)
    return q, k, v, mask, bias, dy


def _value_and_vjp(fn):
    """jit(args, dy -> (fn(*args), vjp(dy))): one compile, no eager op-by-op dispatch."""

    @jax.jit
    def run(args, dy):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(dy)

    return run


# (B, Sq, Sk, H, Hkv, D): odd lengths, Sq != Sk both ways, GQA, MQA, multi-tile shapes
SHAPES = [
    (2, 5, 7, 4, 2, 3),
    (1, 9, 4, 2, 2, 5),
    (2, 70, 131, 4, 1, 16),
    (1, 129, 129, 2, 2, 64),
]
# every mask kind (plus key mask and bias), with and without scale and softcap
OPTIONS = [
    dict(),
    dict(scale=0.37, softcap=1.5),
    dict(mask_kind="causal"),
    dict(mask_kind="causal", scale=0.5, softcap=2.0),
    dict(mask_kind="sliding", window=3),
    dict(mask_kind="sliding", window=0, softcap=1.0),
    dict(use_mask=True),
    dict(use_mask=True, scale=0.25, softcap=3.0),
    dict(use_bias=True),
    dict(use_bias=True, use_mask=True, mask_kind="causal", scale=0.3, softcap=1.2),
]


def _kwargs(opts, mask, bias):
    kw = {k: v for k, v in opts.items() if not k.startswith("use_")}
    if opts.get("use_mask"):
        kw["mask"] = mask
    if opts.get("use_bias"):
        kw["bias"] = bias
    return kw


def _oid(opts):
    return "-".join(f"{k}={v}" for k, v in opts.items()) or "plain"


# ---- kernel is really used -------------------------------------------------------------------


def test_compiled_kernels_are_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_attention_fwd_v1", "rlx_attention_bwd_v1"} <= set(info["targets"])
    q, k, v, mask, bias, _ = _inputs(1, 8, 8, 2, 1, 4)
    fwd = hlo_text(lambda q, k, v: attention(q, k, v, mask_kind="causal"), q, k, v)
    assert "rlx_attention_fwd" in fwd
    grad = hlo_text(jax.grad(lambda q, k, v, b: jnp.sum(attention(q, k, v, bias=b, mask=mask) ** 2),
                             (0, 1, 2, 3)), q, k, v, bias)
    assert "rlx_attention_fwd" in grad and "rlx_attention_bwd" in grad


def test_cudnn_forward_switch_and_no_route_off_cuda():
    """RLX_ATTENTION_CUDNN_FORWARD=0 (read at import) turns the CUDA forward's cuDNN route
    off; the route never serves a call off CUDA (here: no GPU device to route to)."""
    import os
    import subprocess
    import sys

    code = "from rlx_jax.vjp_rules import attention as A; print(A.CUDNN_FORWARD)"
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, RLX_ATTENTION_CUDNN_FORWARD=value, JAX_PLATFORMS="cpu")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == want, r.stderr[-2000:]
    if platform() == "cpu":
        q = jax.ShapeDtypeStruct((1, 128, 4, 128), jnp.bfloat16)
        params = dict(kind="causal", window=0, scale=0.1, softcap=0.0, has_mask=False, has_bias=False,
                      has_segments=False, has_sinks=False)
        assert A._cudnn_forward((q, q, q), params) is None


# ---- forward and reverse mode in f32 ----------------------------------------------------------


# every option on the odd shape; a spread of options on the others; the full product is slow
CASES = (
    [(SHAPES[0], o) for o in OPTIONS]
    + [(SHAPES[1], OPTIONS[i]) for i in (2, 5, 6)]
    + [(SHAPES[2], OPTIONS[i]) for i in (0, 3, 4, 9)]
    + [(SHAPES[3], OPTIONS[3])]
    # 16 (batch, kv head) pairs: the backward's one-chunk path (fewer pairs split the keys)
    + [((4, 20, 130, 4, 4, 8), OPTIONS[9])]
)
CASES += [pytest.param(s, o, marks=pytest.mark.slow) for s in SHAPES for o in OPTIONS if (s, o) not in CASES]


@pytest.mark.parametrize("shape,opts", CASES, ids=lambda x: str(x) if isinstance(x, tuple) else _oid(x))
def test_forward_and_gradients_match_oracle(shape, opts):
    q, k, v, mask, bias, dy = _inputs(*shape)
    kw = _kwargs(opts, mask, bias)
    diff = {"q": q, "k": k, "v": v}
    if "bias" in kw:
        diff["bias"] = kw.pop("bias")

    def ours(d):
        return attention(d["q"], d["k"], d["v"], bias=d.get("bias"), **kw)

    def oracle(d):
        return dense_attention(d["q"], d["k"], d["v"], bias=d.get("bias"), **kw)

    got, (g,) = _value_and_vjp(ours)((diff,), dy)
    want, (w,) = _value_and_vjp(oracle)((diff,), dy)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, jnp.float32)
    for name in diff:
        assert_close(g[name], w[name], jnp.float32)


@pytest.mark.parametrize("opts", [OPTIONS[1], OPTIONS[5], OPTIONS[9]], ids=_oid)
def test_forward_mode_matches_oracle(opts):
    q, k, v, mask, bias, _ = _inputs(2, 6, 9, 4, 2, 8, seed=3)
    kw = _kwargs(opts, mask, bias)
    tq, tk, tv, _, tb, _ = _inputs(2, 6, 9, 4, 2, 8, seed=4)
    primals, tangents = (q, k, v), (tq, tk, tv)
    if "bias" in kw:
        primals, tangents = primals + (kw.pop("bias"),), tangents + (tb,)

    def call(fn):
        g = lambda *a: fn(*a[:3], bias=a[3] if len(a) > 3 else None, **kw)  # noqa: E731
        return jax.jit(lambda p, t: jax.jvp(g, p, t))(primals, tangents)

    (y, ty), (yw, tyw) = call(attention), call(dense_attention)
    assert_close(y, yw, jnp.float32)
    assert_close(ty, tyw, jnp.float32)


def test_lse_and_its_cotangent_in_the_backward_kernel():
    """The backward primitive's dlse input (second-order terms) and the lse output,
    kernel vs the module's reference, at the primitive level."""
    q, k, v, mask, bias, dy = _inputs(2, 33, 47, 4, 2, 8, seed=5)
    params, mask, bias, _ = A._check_options(q, k, (2,), "sliding", 9, mask, bias, 0.4, 2.5, "bottom_right", "test")
    extras = [mask, bias]
    out, lse = jax.jit(lambda *a: A.attention_fwd(*a, **params))(q, k, v, *extras)
    out_r, lse_r = jax.jit(lambda *a: A.reference_attention(*a, **params))(q, k, v, *extras)
    assert_close(out, out_r, jnp.float32)
    finite = np.isfinite(np.asarray(lse_r))
    assert (np.isfinite(np.asarray(lse)) == finite).all()
    assert_close(jnp.where(finite, lse, 0), jnp.where(finite, lse_r, 0), jnp.float32)
    dlse = jnp.asarray(np.random.default_rng(9).standard_normal(lse.shape).astype(np.float32))
    got = jax.jit(lambda *a: A.attention_bwd(*a, **params))(q, k, v, out_r, lse_r, dy, dlse, *extras)
    want = jax.jit(lambda *a: A.reference_attention_bwd(*a, **params))(q, k, v, out_r, lse_r, dy, dlse, *extras)
    assert len(got) == 4
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32)


# ---- second order in f64 --------------------------------------------------------------------


GRAD_CASES = [
    pytest.param((1, 3, 4, 2, 1, 3), dict(), marks=pytest.mark.slow),
    pytest.param((1, 4, 4, 2, 2, 3), dict(mask_kind="causal", scale=0.7, softcap=1.3), marks=pytest.mark.slow),
    pytest.param((2, 3, 5, 2, 1, 2), dict(mask_kind="sliding", window=1, softcap=0.9), marks=pytest.mark.slow),
    ((2, 4, 3, 2, 2, 3), dict(use_mask=True, use_bias=True, scale=0.6, softcap=2.0)),
]


@pytest.mark.parametrize("shape,opts", GRAD_CASES, ids=lambda x: str(x) if isinstance(x, tuple) else _oid(x))
def test_check_grads_order2_f64(x64, shape, opts):
    q, k, v, mask, bias, _ = _inputs(*shape, dtype=jnp.float64, seed=7)
    mask = mask.at[:, 0].set(1.0)  # keep every row live: smooth at the test point
    kw = _kwargs(opts, mask, bias)
    if "bias" in kw:
        b = kw.pop("bias")
        f = lambda q, k, v, b: attention(q, k, v, bias=b, **kw)  # noqa: E731
        args = (q, k, v, b)
    else:
        f = lambda q, k, v: attention(q, k, v, **kw)  # noqa: E731
        args = (q, k, v)
    assert "rlx_attention_bwd" in hlo_text(jax.grad(lambda *a: jnp.sum(f(*a) ** 2)), *args)
    check_grads(f, args, order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_f64_matches_oracle(x64):
    q, k, v, mask, bias, dy = _inputs(2, 21, 35, 4, 2, 7, dtype=jnp.float64)
    kw = dict(mask_kind="causal", mask=mask, softcap=1.7, scale=0.45)
    got, grads = _value_and_vjp(lambda q, k, v, b: attention(q, k, v, bias=b, **kw))((q, k, v, bias), dy)
    want, grads_w = _value_and_vjp(lambda q, k, v, b: dense_attention(q, k, v, bias=b, **kw))((q, k, v, bias), dy)
    assert got.dtype == jnp.float64
    assert_close(got, want, jnp.float64)
    for g, w in zip(grads, grads_w):
        assert_close(g, w, jnp.float64)


# ---- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_f32_oracle(dtype):
    q, k, v, mask, bias, dy = _inputs(2, 37, 50, 4, 2, 16, dtype=dtype)
    kw = dict(mask_kind="causal", mask=mask, softcap=2.0)

    def f(fn):
        return lambda q, k, v, b: fn(q, k, v, bias=b, **kw)

    got, grads = _value_and_vjp(f(attention))((q, k, v, bias), dy)
    up = tuple(x.astype(jnp.float32) for x in (q, k, v, bias))
    want, grads_w = _value_and_vjp(f(dense_attention))(up, dy.astype(jnp.float32))
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    for g, w in zip(grads, grads_w):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


# ---- edge cases -----------------------------------------------------------------------------


def test_fully_masked_rows_give_zeros_not_nan():
    q, k, v, mask, bias, dy = _inputs(2, 6, 6, 2, 1, 4)
    mask = mask.at[1].set(0.0)  # batch 1 sees no key at all
    for kw in (dict(mask=mask), dict(mask=mask, softcap=1.0, bias=bias)):
        out, (dq, dk, dv) = _value_and_vjp(lambda q, k, v: attention(q, k, v, **kw))((q, k, v), dy)
        for x in (out, dq, dk, dv):
            assert np.isfinite(np.asarray(x)).all()
        assert not np.asarray(out[1]).any() and not np.asarray(dq[1]).any()
        assert not np.asarray(dk[1]).any() and not np.asarray(dv[1]).any()
        assert_close(out[0], jax.jit(lambda q, k, v: dense_attention(q, k, v, **kw))(q, k, v)[0], jnp.float32)
    # a bias gradient through fully masked rows is zero too
    gb = jax.jit(jax.grad(lambda b: jnp.sum(attention(q, k, v, mask=mask, bias=b) * dy)))(bias)
    assert np.isfinite(np.asarray(gb)).all() and not np.asarray(gb[1]).any()


@pytest.mark.parametrize("shape", [(0, 4, 4, 2, 1, 8), (2, 0, 5, 2, 2, 8), (2, 3, 0, 2, 2, 8)], ids=str)
def test_zero_sized_inputs(shape):
    q, k, v, mask, bias, dy = _inputs(*shape)
    out, (dq, dk, dv) = _value_and_vjp(lambda q, k, v: attention(q, k, v, mask_kind="causal"))((q, k, v), dy)
    assert out.shape == q.shape
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for x in (out, dq, dk, dv):  # no keys: zero output and gradients
        assert not np.asarray(x).any()


def test_vmap_over_extra_batch_axis():
    q, k, v, mask, bias, dy = _inputs(3, 7, 9, 4, 2, 8)
    kw = dict(mask_kind="sliding", window=4, softcap=1.5)
    f = lambda q, k, v, m, b: attention(q[None], k[None], v[None], mask=m[None], bias=b[None], **kw)[0]  # noqa: E731
    got = jax.jit(jax.vmap(f))(q, k, v, mask, bias)
    want = jax.jit(lambda *a: dense_attention(*a[:3], mask=a[3], bias=a[4], **kw))(q, k, v, mask, bias)
    assert_close(got, want, jnp.float32)
    # per-example gradients with k, v shared (unbatched) across the vmapped axis; the
    # oracle is plain JAX, so JAX's own batching of it is independent of our rules
    oracle = lambda q, k, v: dense_attention(q[None], k[None], v[None], mask=mask[:1], bias=bias[:1], **kw)  # noqa: E731
    per_example = lambda fn: jax.jit(jax.vmap(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), (0, 1, 2)),  # noqa: E731
                                              in_axes=(0, None, None)))
    g = per_example(lambda q, k, v: f(q, k, v, mask[0], bias[0]))(q, k[0], v[0])
    w = per_example(oracle)(q, k[0], v[0])
    assert "rlx_attention_bwd" in hlo_text(per_example(lambda q, k, v: f(q, k, v, mask[0], bias[0])), q, k[0], v[0])
    for a, b in zip(g, w):
        assert_close(a, b, jnp.float32)


def test_backward_is_deterministic():
    q, k, v, mask, bias, dy = _inputs(2, 130, 140, 4, 2, 32)
    f = jax.jit(lambda *a: attention_backward(*a, mask=mask, bias=bias, mask_kind="causal", softcap=2.0))
    first = [np.asarray(x) for x in f(q, k, v, dy)]
    for _ in range(2):
        for a, b in zip(first, f(q, k, v, dy)):
            assert np.array_equal(a, np.asarray(b))


# ---- the RLX-facing wrappers --------------------------------------------------------------------


def test_attention_backward_equals_vjp():
    q, k, v, mask, bias, dy = _inputs(2, 11, 13, 4, 2, 8)
    kw = dict(mask_kind="causal", scale=0.3, softcap=1.4)
    got = jax.jit(lambda *a: attention_backward(*a, mask, bias, **kw))(q, k, v, dy)
    _, want = _value_and_vjp(lambda q, k, v: dense_attention(q, k, v, mask=mask, bias=bias, **kw))((q, k, v), dy)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32)
    assert "rlx_attention_bwd" in hlo_text(lambda *a: attention_backward(*a, **kw), q, k, v, dy)


def test_attention_rlx_layout():
    q, k, v, mask, _, _ = _inputs(2, 6, 8, 4, 2, 8)
    flat = lambda x: x.reshape(*x.shape[:2], -1)  # noqa: E731
    got = jax.jit(lambda q, k, v: attention_rlx(q, k, v, num_heads=4, head_dim=8, mask=mask,
                                                mask_kind="causal"))(flat(q), flat(k), flat(v))
    assert got.shape == (2, 6, 32)
    want = jax.jit(lambda q, k, v: flat(dense_attention(q, k, v, mask=mask, mask_kind="causal")))(q, k, v)
    assert_close(got, want, jnp.float32)
    got2 = jax.jit(lambda q, k, v: attention_rlx(q, k, v, num_heads=4, head_dim=8))(flat(q)[0], flat(k)[0], flat(v)[0])
    assert got2.shape == (6, 32)
    assert_close(got2, jax.jit(lambda q, k, v: flat(dense_attention(q, k, v))[0])(q, k, v), jnp.float32)


def test_reference_path_agrees_with_kernel_path():
    """With fused ops off (plain XLA autodiff of the module's reference) the values and
    gradients are the kernel's."""
    q, k, v, mask, bias, dy = _inputs(1, 9, 12, 2, 1, 4)
    f = lambda q, k, v: jnp.sum(attention(q, k, v, mask=mask, mask_kind="sliding", window=2, softcap=1.1) * dy)  # noqa: E731
    g_kernel = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    with fused_ops(False):
        g_ref = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    for a, b in zip(g_kernel, g_ref):
        assert_close(a, b, jnp.float32)


# ---- memory -----------------------------------------------------------------------------------


def test_gradient_memory_is_linear_in_sequence_length():
    """The compiled gradient's scratch memory stays far below one S x S score matrix
    (XLA's autodiff of the reference needs several)."""
    b, s, h, d = 1, 512, 2, 32
    x = jnp.ones((b, s, h, d), jnp.float32)
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, mask_kind="causal") ** 2)  # noqa: E731
    ours = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile().memory_analysis()
    with fused_ops(False):
        xla = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile().memory_analysis()
    scores = b * h * s * s * 4
    assert ours.temp_size_in_bytes < scores / 4
    assert xla.temp_size_in_bytes > scores


# ---- errors -------------------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors():
    q, k, v, mask, bias, _ = _inputs(1, 4, 5, 4, 2, 8)
    with pytest.raises(ValueError, match="mask_kind"):
        attention(q, k, v, mask_kind="diagonal")
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, mask_kind="sliding")
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, mask_kind="causal", window=3)
    with pytest.raises(ValueError, match="softcap"):
        attention(q, k, v, softcap=0.0)
    with pytest.raises(ValueError, match="mask"):
        attention(q, k, v, mask=mask[:, :3])
    with pytest.raises(ValueError, match="bias"):
        attention(q, k, v, bias=bias[:, :1])
    with pytest.raises(ValueError, match="kv heads"):
        attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(ValueError, match=r"q must have shape \[\.\.\., S, H, D\]"):
        attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match="leading"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="v"):
        attention(q, k, v[:, :4])
    with pytest.raises(TypeError, match="share a dtype"):
        attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match="k must be floating"):
        attention(q, k.astype(jnp.int32), v)
    with pytest.raises(ValueError, match="dy"):
        attention_backward(q, k, v, q[:, :2])
    with pytest.raises(ValueError, match="heads"):
        attention_rlx(q.reshape(1, 4, 32), k.reshape(1, 5, 16), v.reshape(1, 5, 16), num_heads=2, head_dim=8)


def test_kernel_rejects_bad_buffers_with_an_error():
    """Shapes the Python side would never pass reach the handler's validation, which
    returns an error (a Python exception), not a crash."""
    q, k, v, _, _, _ = _inputs(1, 4, 5, 4, 2, 8)
    attrs = A._attrs("none", 0, 0.5, 0.0, False, False)
    empty_mask, empty_bias = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)
    bad_lse = jax.ShapeDtypeStruct((1, 4, 3), jnp.float32)  # Sq is 4
    call = jax.ffi.ffi_call("rlx_attention_fwd_v1", (jax.ShapeDtypeStruct(q.shape, q.dtype), bad_lse))
    with pytest.raises(Exception, match="lse"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(q, k, v, empty_mask, empty_bias))
    good_lse = jax.ShapeDtypeStruct((1, 4, 4), jnp.float32)
    call = jax.ffi.ffi_call("rlx_attention_fwd_v1", (jax.ShapeDtypeStruct(q.shape, q.dtype), good_lse))
    with pytest.raises(Exception, match="kv heads"):
        k3 = jnp.zeros((1, 5, 3, 8), jnp.float32)
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(q, k3, k3, empty_mask, empty_bias))


@pytest.mark.parametrize("mode", [None, "0", "1"])
@pytest.mark.parametrize("kind", ["none", "causal", "sliding"])
def test_cuda_backward_scratch_depends_on_shapes_only(monkeypatch, mode, kind):
    """The CUDA backward's scratch holds the fused kernel's f32 dQ accumulator wherever the
    fused kernel can serve the call (bf16 / f16, head dims 64 and 128, scale > 0, with or
    without a softcap or a key mask, no bias), whatever the kernel's debugging switch
    RLX_ATTENTION_CUDA_WGMMA says: the traced program must not depend on the environment
    (the kernel takes the fused path only where the scratch is large enough and the device
    serves it; the other backwards read the scratch's first B * H * Sq elements)."""
    if mode is None:
        monkeypatch.delenv("RLX_ATTENTION_CUDA_WGMMA", raising=False)
    else:
        monkeypatch.setenv("RLX_ATTENTION_CUDA_WGMMA", mode)
    fused = True
    q = jnp.zeros((2, 130, 4, 128), jnp.bfloat16)
    assert A._cuda_fused_bwd(q, kind, 0.1, 0.0, False, False) is fused
    assert A._cuda_fused_bwd(q[..., :64].astype(jnp.float16), kind, 0.1, 0.0, False, False) is fused
    for other in (q.astype(jnp.float32), q[..., :32], q[..., :96], jnp.zeros((2, 130, 4, 256), jnp.bfloat16)):
        assert not A._cuda_fused_bwd(other, kind, 0.1, 0.0, False, False)
    assert not A._cuda_fused_bwd(q, kind, 0.0, 0.0, False, False)  # scale 0: not a PLAIN case
    assert A._cuda_fused_bwd(q, kind, 0.1, 5.0, False, False) is fused  # softcap: the CAP kernels
    assert not A._cuda_fused_bwd(q, kind, 0.0, 5.0, False, False)  # softcap, scale 0
    assert A._cuda_fused_bwd(q, kind, 0.1, 0.0, True, False) is fused  # key mask: the MASK kernels
    assert A._cuda_fused_bwd(q, kind, 0.1, 5.0, True, False) is fused  # both
    assert not A._cuda_fused_bwd(q, kind, 0.1, 0.0, False, True)  # bias
    for fused in (True, False):
        # delta (B H Sq = 1040, a multiple of 4), dQacc B H Sq D, 3 query tiles of 64 a (batch, head), ticket,
        # the converters' tile counter
        assert A.cuda_bwd_scratch_size(2, 4, 130, 128, fused) == (1040 + 1040 * 128 + 8 * 3 + 2 if fused else 1040)
        # D 64: query tiles of 128 rows (65 rows: one tile, 129: two)
        assert A.cuda_bwd_scratch_size(1, 3, 65, 64, fused) == (196 + 195 * 64 + 3 * 1 + 2 if fused else 195)
        assert A.cuda_bwd_scratch_size(1, 3, 129, 64, fused) == (388 + 387 * 64 + 3 * 2 + 2 if fused else 387)
    # grouped-query heads: the head splits' tree after the counters (n - 1 nodes per (batch, kv head,
    # block of 128 keys): two uint32, then from the next multiple of 4 a 2 x 128 x D f32 partial each)
    assert [A.fused_bwd_splits(h, hkv) for h, hkv in ((4, 4), (4, 2), (8, 2), (16, 2), (12, 4), (6, 2))] == \
        [1, 2, 4, 4, 1, 1]
    base = 1040 + 1040 * 128 + 8 * 3 + 2  # B 2, H 4, Sq 130, D 128, as above
    assert A.cuda_bwd_scratch_size(2, 4, 130, 128, True, hkv=4, sk=300) == base  # no group: no split
    nodes = 2 * 1 * 3 * 3  # B 2, Hkv 1 (group 4: 4 splits, 3 nodes), 300 keys: 3 key blocks
    assert A.cuda_bwd_scratch_size(2, 4, 130, 128, True, hkv=1, sk=300) == \
        -(-(base + 2 * nodes) // 4) * 4 + nodes * 2 * 128 * 128
    assert A.cuda_bwd_scratch_size(2, 4, 130, 128, False, hkv=1, sk=300) == 1040  # not fused: delta only


# ---- the Python front: traced hyper-parameters, causal alignment, leading axes -------------


def test_traced_scale_values_and_gradient():
    """A traced scale (jit argument) gives the static-scale values; its gradient matches the
    oracle's (scale enters as q * scale)."""
    q, k, v, _, _, _ = _inputs(2, 7, 9, 4, 2, 8, seed=11)
    f = jax.jit(lambda q, k, v, sc: attention(q, k, v, mask_kind="causal", scale=sc, softcap=3.0))
    assert_close(f(q, k, v, 0.3), attention(q, k, v, mask_kind="causal", scale=0.3, softcap=3.0))
    assert_close(f(q, k, v, jnp.float32(0.3)), dense_attention(q, k, v, mask_kind="causal", scale=0.3, softcap=3.0))
    loss = lambda fn: (lambda q, sc: jnp.sum(jnp.sin(fn(q, k, v, mask_kind="causal", scale=sc, softcap=3.0))))
    got = jax.jit(jax.grad(loss(attention), argnums=(0, 1)))(q, 0.3)
    want = jax.grad(loss(dense_attention), argnums=(0, 1))(q, 0.3)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    assert "rlx_attention_bwd" in hlo_text(jax.grad(loss(attention), argnums=(0, 1)), q, 0.3)
    # attention_backward with a traced scale: dq carries the scale
    got = jax.jit(lambda q, sc: attention_backward(q, k, v, jnp.cos(q), scale=sc))(q, 0.7)
    _, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, scale=0.7), q, k, v)
    for g, w in zip(got, vjp(jnp.cos(q))):
        assert_close(g, w)


def test_traced_scale_vmapped_per_example():
    q, k, v, _, _, _ = _inputs(2, 5, 5, 2, 2, 8, seed=12)
    scales = jnp.array([0.2, 0.9])
    got = jax.vmap(lambda q, k, v, sc: attention(q[None], k[None], v[None], scale=sc)[0])(q, k, v, scales)
    for i in range(2):
        assert_close(got[i], dense_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale=float(scales[i]))[0])


def test_traced_softcap_and_bad_scale_errors_name_the_argument():
    q, k, v, _, _, _ = _inputs(1, 4, 4, 2, 2, 8)
    with pytest.raises(TypeError, match="softcap must be a static number"):
        jax.jit(lambda c: attention(q, k, v, softcap=c))(2.0)
    with pytest.raises(ValueError, match="scale must be a real scalar"):
        jax.jit(lambda sc: attention(q, k, v, scale=sc))(jnp.ones(2))
    with pytest.raises(ValueError, match="scale must be a real scalar"):
        attention(q, k, v, scale="big")
    with pytest.raises(TypeError, match="scale must be a real scalar"):
        attention(q, k, v, scale=1j)
    with pytest.raises(ValueError, match="causal_alignment"):
        attention(q, k, v, mask_kind="causal", causal_alignment="top-left")


@pytest.mark.parametrize("kind, window", [("causal", None), ("sliding", 1)])
def test_top_left_alignment_matches_jax_nn(kind, window):
    """Sq = 2, Sk = 6: the default (bottom-right) lets the last query see every key; top-left
    is jax.nn.dot_product_attention(is_causal=True)'s rule. Values and gradients (the keys no
    query sees get zero gradient), key mask and bias sliced with the keys."""
    q, k, v, mask, bias, dy = _inputs(2, 2, 6, 4, 2, 8, seed=13)
    got = attention(q, k, v, mask_kind=kind, window=window, causal_alignment="top_left")
    assert_close(got, dense_attention(q, k, v, mask_kind=kind, window=window, top_left=True))
    assert_close(attention(q, k, v, mask_kind=kind, window=window),
                 dense_attention(q, k, v, mask_kind=kind, window=window))
    if kind == "causal":
        assert_close(got, jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
        assert float(jnp.max(jnp.abs(got - attention(q, k, v, mask_kind="causal")))) > 1e-2
    opts = dict(mask_kind=kind, window=window, mask=mask, bias=bias)
    f = lambda fn, **kw: (lambda q, k, v, b: jnp.sum(fn(q, k, v, **dict(opts, bias=b), **kw) * dy))
    got_g = jax.jit(jax.grad(f(attention, causal_alignment="top_left"), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want_g = jax.grad(f(dense_attention, top_left=True), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, w in zip(got_g, want_g):
        assert_close(g, w)
    assert not np.asarray(got_g[1][:, 2:]).any()  # keys 2..5 are seen by no query
    got_b = attention_backward(q, k, v, dy, mask, bias, mask_kind=kind, window=window, causal_alignment="top_left")
    for g, w in zip(got_b, want_g[:3]):
        assert_close(g, w)


@pytest.mark.parametrize("lead", [(), (2, 3), (1, 2, 1)])
def test_leading_batch_axes(lead):
    """[..., S, H, D] with zero or several leading axes: as the flattened rank-4 call, key
    mask and bias carrying the same leading axes."""
    b = int(np.prod(lead)) if lead else 1
    q, k, v, mask, bias, dy = _inputs(b, 5, 7, 4, 2, 8, seed=14)
    shape = lambda x: x.reshape(*lead, *x.shape[1:])
    got = attention(shape(q), shape(k), shape(v), mask_kind="causal", mask=shape(mask), bias=shape(bias))
    assert got.shape == (*lead, 5, 4, 8)
    assert_close(got.reshape(q.shape), dense_attention(q, k, v, mask_kind="causal", mask=mask, bias=bias))
    grads = attention_backward(shape(q), shape(k), shape(v), shape(dy), mask_kind="causal")
    want = attention_backward(q, k, v, dy, mask_kind="causal")
    for g, w in zip(grads, want):
        assert g.shape == (*lead, *w.shape[1:])
        assert_close(g.reshape(w.shape), w)


def test_f32_routes_to_xla_on_cuda_below_the_score_size_threshold(x64):
    """On CUDA bf16 / f16 take the kernels at every size; f32 lowers to the pure-JAX
    reference (XLA's TF32 matmuls beat the f32 SIMT kernel) until its [B, H, Sq, Sk] f32
    scores reach CUDA_F32_KERNEL_MIN_SCORE_BYTES, where the kernel's O(S) memory serves; f64
    always lowers to the reference. Shapes only: nothing is allocated."""
    s = jax.ShapeDtypeStruct
    small, long_q = (1, 4, 2, 64), (1, 16384, 4, 64)  # 128 B of scores; 16384^2 x 4 x 4 B = 4 GiB
    assert A._cuda_ok(s(small, jnp.bfloat16), s(small, jnp.bfloat16))
    assert A._cuda_ok(s(small, jnp.float16), s(small, jnp.float16))
    assert not A._cuda_ok(s(small, jnp.float32), s(small, jnp.float32))
    assert A._cuda_ok(s(long_q, jnp.float32), s(long_q, jnp.float32))
    assert not A._cuda_ok(s(long_q, jnp.float64), s(long_q, jnp.float64))
    assert not A._cuda_ok(s((1, 4, 2, 512), jnp.bfloat16), s((1, 4, 2, 512), jnp.bfloat16))
    # the threshold itself: scores of exactly that many bytes take the kernel, one key fewer does not
    h, sq = 2, 1024
    sk = A.CUDA_F32_KERNEL_MIN_SCORE_BYTES // (4 * h * sq)
    assert A._cuda_ok(s((1, sq, h, 64), jnp.float32), s((1, sk, h, 64), jnp.float32))
    assert not A._cuda_ok(s((1, sq, h, 64), jnp.float32), s((1, sk - 1, h, 64), jnp.float32))
    # symbolic shapes (jax.export): f32 stays XLA's, bf16 the kernel's
    (b,) = jax.export.symbolic_shape("b")
    assert not A._cuda_ok(s((b, 16384, 4, 64), jnp.float32), s((b, 16384, 4, 64), jnp.float32))
    assert A._cuda_ok(s((b, 4, 2, 64), jnp.bfloat16), s((b, 4, 2, 64), jnp.bfloat16))


def test_cpu_routes_to_xla_below_the_score_size_threshold(monkeypatch):
    """Below CPU_KERNEL_MIN_SCORE_BYTES of [B, H, Sq, Sk] f32 scores the CPU lowering is XLA's
    attention (faster there); at or above it, the kernel (O(S) memory). Lowered only."""
    from rlx_jax.vjp_rules import attention as A

    monkeypatch.setattr(A, "CPU_KERNEL_MIN_SCORE_BYTES", 1 << 30)

    def lowered(s):
        spec = jax.ShapeDtypeStruct((1, s, 1, 16), jnp.float32)
        loss = lambda q, k, v: jnp.sum(attention(q, k, v, mask_kind="causal"))
        return jax.jit(jax.grad(loss, (0, 1, 2))).lower(spec, spec, spec).as_text()

    small, large = lowered(256), lowered(16384)  # 256 KiB and 1 GiB of scores
    assert "rlx_attention" not in small
    assert "rlx_attention_fwd" in large and "rlx_attention_bwd" in large


def _shifted_reference(q, k, v, bias, vis, scale):
    """softmax(scale q.k + bias - m) v with m each row's largest visible bias where it is
    beyond 1024 in magnitude (else 0): the op's rule for a bias masking a whole row with a
    huge finite value. Plain JAX, f64, dense; rows with no visible key are 0."""
    g = q.shape[2] // k.shape[2]
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    m = jnp.max(jnp.where(vis, bias, -jnp.inf), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m) & (jnp.abs(m) > 1024.0), m, 0.0))
    s = jnp.where(vis, scale * jnp.einsum("bqhd,bkhd->bhqk", q, kk) + (bias - m), -jnp.inf)
    p = jnp.exp(s - jnp.max(jnp.where(vis, s, -1e300), axis=-1, keepdims=True))
    p = jnp.where(vis, p, 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-300)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv)


@pytest.mark.parametrize("fill", [-1e9, float(np.finfo(np.float32).min), 3e6], ids=["minus_1e9", "f32_min", "plus_3e6"])
@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "cpu_kernel"])
def test_bias_masking_every_visible_key_of_a_row(x64, monkeypatch, fill, kernel):
    """A bias holding a huge finite value on every visible key of some rows (padding queries
    masked through the bias, a left-padded row under a causal mask): the log-sum-exp of
    such a row used to lose log(Sk) beside the bias, and its backward sent wrong dq and wrong
    dk, dv to every key. Values and gradients now match the dense reference in which the
    row's largest visible bias is subtracted, and the gradients match central differences
    of the op's own forward."""
    if kernel:
        monkeypatch.setattr(A, "CPU_KERNEL_MIN_SCORE_BYTES", 0)
    b, s, h, hkv, d = 2, 6, 4, 2, 8
    q, k, v, _, _, dy = (x.astype(jnp.float64) for x in _inputs(b, s, s, h, hkv, d, seed=3))
    masked = np.zeros((b, h, s, s), bool)
    masked[0, :, 4:, :] = True                 # batch 0: queries 4, 5 are padding (every key masked)
    masked[1, :, :, :2] = True                 # batch 1: keys 0, 1 are left padding; under causal,
    bias = jnp.where(jnp.asarray(masked), fill, 0.25 * jnp.asarray(                 # queries 0, 1 see only them
        np.random.default_rng(4).standard_normal((b, h, s, s))))
    scale = 1.0 / np.sqrt(d)
    vis = jnp.tril(jnp.ones((s, s), bool))[None, None]

    def op(q, k, v):
        return attention(q, k, v, mask_kind="causal", bias=bias)
    want_fn = lambda q, k, v: _shifted_reference(q, k, v, bias, vis, scale)  # noqa: E731
    got, got_vjp = _value_and_vjp(op)((q, k, v), dy)
    want, want_vjp = _value_and_vjp(want_fn)((q, k, v), dy)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    for name, a, w in zip("qkv", got_vjp, want_vjp):
        assert np.all(np.isfinite(np.asarray(a))), name
        np.testing.assert_allclose(a, w, rtol=1e-9, atol=1e-9, err_msg=f"d{name}")
    check_grads(op, (q, k, v), order=1, modes=("rev",), eps=1e-4, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_f32_bias_masking_rows_with_half_precision_qkv(dtype):
    """An f32 bias of -1e9 on whole rows with f16 / bf16 q, k, v: the row is shifted in f32
    before the bias is rounded to q's dtype (rounded first, -1e9 is -inf in f16 and the row
    came out 0). Values and gradients follow the f32 call within the dtype's rounding."""
    b, s, h, d = 1, 5, 2, 8
    q, k, v, _, _, dy = _inputs(b, s, s, h, h, d, seed=9)
    bias = jnp.zeros((b, h, s, s), jnp.float32).at[:, :, 1, :].set(-1e9)  # query 1 is padding
    op = lambda q, k, v: attention(q, k, v, bias=bias)  # noqa: E731
    want, want_vjp = _value_and_vjp(op)((q, k, v), dy)
    got, got_vjp = _value_and_vjp(op)(tuple(x.astype(dtype) for x in (q, k, v)), dy.astype(dtype))
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    assert float(jnp.max(jnp.abs(want[:, 1]))) > 0.1  # the padding row is a softmax, not 0
    for a, w in zip((got, *got_vjp), (want, *want_vjp)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w), rtol=tol, atol=tol)
