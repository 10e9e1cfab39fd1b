"""Attention on the GPU: the CUDA kernels (rlx_attention_fwd / rlx_attention_bwd on platform
CUDA) against the float32 pure-JAX reference (highest matmul precision) on random data.
Skipped where JAX sees no GPU.

Cases cover both kernel paths: the tensor-core path (bf16 / f16, head dims 64 and 128: mma.sync,
and on sm_90a the wgmma kernels with their softcap / key-mask / window forms) and the generic path (f32, and bf16 / f16 with head dims 32, 96, 256), every mask kind with and
without scale and softcap, key mask, additive bias (with its gradient), GQA, odd lengths,
Sq != Sk both ways, fully masked rows, the dlse term of the backward, zero-sized inputs and
a bad scratch size."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax.ops import attention, attention_backward
from rlx_jax.vjp_rules import attention as A

from gpu_testutil import requires_gpu

pytestmark = requires_gpu

# relative error allowed: ||got - want||_2 / ||want||_2 (and max-abs / max|want| <= 4x that)
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 5e-3}


@pytest.fixture(autouse=True)
def _our_forward_kernel(monkeypatch):
    """These tests check our kernels: plain calls keep our forward rather than cuDNN's
    (``A.CUDNN_FORWARD``; that route has its own tests in test_attention_cudnn_forward_gpu.py)."""
    monkeypatch.setattr(A, "CUDNN_FORWARD", False)


def _gpu():
    return next(d for d in jax.devices() if d.platform == "gpu")


def _f32_on_kernel(monkeypatch, dtype):
    """f32 attention on CUDA lowers to XLA's code by default (``A.CUDA_KERNEL_DTYPES``); for an
    f32 case route it to the generic f32 kernel, so that the kernel is what gets checked."""
    if dtype == jnp.float32 and jnp.float32 not in A.CUDA_KERNEL_DTYPES:
        monkeypatch.setattr(A, "CUDA_KERNEL_DTYPES", A.CUDA_KERNEL_DTYPES + (jnp.float32,))


def _close(got, want, dtype, what):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if got.size == 0:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    tol = TOL[jnp.dtype(dtype).type]
    norm = max(float(np.linalg.norm(want)), 1e-6)
    rel = float(np.linalg.norm(got - want)) / norm
    peak = max(float(np.max(np.abs(want))), 1e-6)
    worst = float(np.max(np.abs(got - want))) / peak
    assert rel <= tol and worst <= 4 * tol, f"{what}: rel l2 err {rel:.3g}, rel max err {worst:.3g} (tol {tol:.1g})"


def _inputs(b, sq, sk, h, hkv, d, dtype, seed, *, mask=False, bias=False, dead_batch=False, mask_tiles=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    dev = _gpu()
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32).astype(dtype)
    dy = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32).astype(dtype)
    m = None
    if mask:
        m = (jax.random.uniform(ks[4], (b, sk)) > 0.3).astype(jnp.float32)
        if dead_batch and b > 1:
            m = m.at[1].set(0.0)  # every row of batch 1 sees no key
        if mask_tiles:  # whole 64-key tiles hidden (skipped) and kept (no per-key masking)
            m = m.at[0, 64:192].set(0.0).at[-1, :64].set(1.0)
    bb = None
    if bias:
        bb = (0.5 * jax.random.normal(ks[5], (b, h, sq, sk), jnp.float32)).astype(dtype)
    put = lambda x: None if x is None else jax.device_put(x, dev)
    return [put(x) for x in (q, k, v, dy, m, bb)]


def _params(d, kind, window, scale, softcap, mask, bias):
    return dict(kind=kind, window=window if kind == "sliding" else 0,
                scale=float(scale if scale is not None else d**-0.5), softcap=float(softcap or 0.0),
                has_mask=mask is not None, has_bias=bias is not None)


def _f32(x):
    return None if x is None else x.astype(jnp.float32)


def _check_case(b, sq, sk, h, hkv, d, dtype, kind="none", window=None, scale=None, softcap=None,
                mask=False, bias=False, dead_batch=False, dlse=False, seed=0, mask_tiles=False):
    q, k, v, dy, m, bb = _inputs(b, sq, sk, h, hkv, d, dtype, seed, mask=mask or mask_tiles, bias=bias,
                                 dead_batch=dead_batch, mask_tiles=mask_tiles)
    p = _params(d, kind, window, scale, softcap, m, bb)
    extras = [x for x in (m, bb) if x is not None]
    extras32 = [x for x in (m, _f32(bb)) if x is not None]
    dl = jax.random.normal(jax.random.PRNGKey(seed + 7), (b, h, sq), jnp.float32) if dlse else jnp.zeros((b, h, sq))

    def ours(q, k, v, dy, dl, *extras):  # forward, then the backward from the kernel's out / lse
        out, lse = A.attention_fwd(q, k, v, *extras, **p)
        dlm = jnp.where(jnp.isfinite(lse), dl, 0.0)
        return out, lse, A.attention_bwd(q, k, v, out, lse, dy, dlm, *extras, **p)

    def ref(q, k, v, dy, dl, out, *extras):  # f32 reference; its backward uses our out
        out_r, lse_r = A.reference_attention(q, k, v, *extras, **p)
        dlm = jnp.where(jnp.isfinite(lse_r), dl, 0.0)
        return out_r, lse_r, A.reference_attention_bwd(q, k, v, out, lse_r, dy, dlm, *extras, **p)

    with jax.default_matmul_precision("highest"):
        out, lse, grads = jax.jit(ours)(q, k, v, dy, dl, *extras)
        out_r, lse_r, grads_r = jax.jit(ref)(_f32(q), _f32(k), _f32(v), _f32(dy), dl, _f32(out), *extras32)
        _close(out, out_r, dtype, "out")
        lse, lse_r = np.asarray(lse), np.asarray(lse_r)
        assert (np.isneginf(lse) == np.isneginf(lse_r)).all(), "lse: -inf pattern differs"
        fin = np.isfinite(lse_r)
        _close(lse[fin], lse_r[fin], jnp.float32 if dtype == jnp.float32 else jnp.float16, "lse")
        names = ["dq", "dk", "dv", "dbias"]
        assert len(grads) == len(grads_r) == 3 + int(bias)
        for n, g, gr in zip(names, grads, grads_r):
            _close(g, gr, dtype, n)
        if dead_batch:
            assert not np.asarray(jnp.abs(out[1].astype(jnp.float32))).any(), "dead rows must give out = 0"
            assert np.isneginf(lse[1]).all()
            assert not np.asarray(jnp.abs(grads[0][1].astype(jnp.float32))).any(), "dead rows: dq = 0"


# ---- the tensor-core path (bf16 / f16, D 64 and 128) ----------------------------------------

MMA_CASES = [
    # b, sq, sk, h, hkv, d, dtype, options
    (2, 128, 128, 4, 4, 64, jnp.bfloat16, {}),
    (2, 128, 128, 4, 4, 128, jnp.bfloat16, {}),
    (1, 200, 200, 4, 2, 64, jnp.bfloat16, dict(kind="causal")),
    (1, 133, 77, 4, 1, 128, jnp.bfloat16, dict(kind="causal")),
    (1, 77, 190, 2, 2, 128, jnp.float16, dict(kind="causal")),
    # causal, Sq - Sk over a query tile (64 rows at D 128, 128 at D 64): whole tiles no key block
    # visits (the fused backward's converter blocks write their dq = 0), then rows that see no key
    # inside visited tiles
    (1, 300, 100, 2, 1, 128, jnp.bfloat16, dict(kind="causal")),
    (2, 400, 130, 2, 2, 64, jnp.float16, dict(kind="causal")),
    (1, 150, 150, 2, 1, 64, jnp.float16, dict(kind="sliding", window=40)),
    (2, 97, 161, 4, 2, 128, jnp.bfloat16, dict(kind="sliding", window=70)),
    (1, 130, 130, 2, 2, 64, jnp.bfloat16, dict(kind="none", scale=0.3, softcap=2.0)),
    (1, 130, 140, 4, 2, 128, jnp.float16, dict(kind="causal", scale=0.2, softcap=5.0)),
    (3, 70, 130, 2, 1, 64, jnp.bfloat16, dict(kind="none", mask=True, dead_batch=True)),
    (2, 99, 99, 2, 2, 128, jnp.bfloat16, dict(kind="causal", mask=True)),
    (2, 65, 129, 4, 2, 64, jnp.bfloat16, dict(kind="none", bias=True)),
    (1, 100, 100, 2, 1, 128, jnp.float16, dict(kind="sliding", window=17, bias=True, softcap=3.0, mask=True)),
    (1, 96, 96, 2, 2, 64, jnp.bfloat16, dict(kind="causal", dlse=True)),
    (2, 300, 300, 2, 2, 128, jnp.bfloat16, dict(kind="none", softcap=30.0, dlse=True)),
    # key mask with whole key tiles hidden (skipped by every kernel) and kept
    (2, 150, 260, 4, 2, 128, jnp.bfloat16, dict(kind="none", mask_tiles=True)),
    (2, 200, 230, 2, 1, 64, jnp.float16, dict(kind="causal", mask_tiles=True, softcap=10.0)),
    (2, 130, 200, 2, 2, 64, jnp.bfloat16, dict(kind="none", mask_tiles=True, bias=True)),
]


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: "-".join(map(str, c[:6])) + f"-{jnp.dtype(c[6]).name}-{c[7]}")
def test_tensor_core_path(case):
    *shape, dtype, opts = case
    _check_case(*shape, dtype, **opts)


# ---- the generic path (f32, other head dims) -----------------------------------------------

GENERIC_CASES = [
    (2, 37, 37, 4, 4, 64, jnp.float32, {}),
    (1, 45, 83, 4, 2, 32, jnp.float32, dict(kind="causal")),
    (1, 83, 45, 2, 1, 96, jnp.float32, dict(kind="causal", softcap=1.5, scale=0.5)),
    (2, 50, 50, 2, 2, 128, jnp.float32, dict(kind="sliding", window=9, mask=True, dead_batch=True)),
    (1, 40, 33, 2, 2, 256, jnp.float32, dict(kind="none", bias=True, dlse=True)),
    (1, 70, 70, 4, 2, 32, jnp.bfloat16, dict(kind="causal")),
    (1, 61, 90, 2, 1, 96, jnp.float16, dict(kind="sliding", window=25, softcap=4.0)),
    (1, 65, 65, 2, 2, 256, jnp.bfloat16, dict(kind="none", mask=True, bias=True)),
    (1, 33, 33, 2, 2, 40, jnp.float32, dict(kind="causal", dlse=True)),
]


@pytest.mark.parametrize("case", GENERIC_CASES, ids=lambda c: "-".join(map(str, c[:6])) + f"-{jnp.dtype(c[6]).name}-{c[7]}")
def test_generic_path(case, monkeypatch):
    *shape, dtype, opts = case
    _f32_on_kernel(monkeypatch, dtype)
    _check_case(*shape, dtype, **opts)


# ---- through the public ops -----------------------------------------------------------------


@pytest.mark.parametrize("dtype,d,kind", [(jnp.bfloat16, 128, "causal"), (jnp.bfloat16, 64, "sliding"),
                                          (jnp.float32, 64, "none"), (jnp.float16, 96, "causal")])
def test_grad_through_ops(dtype, d, kind, monkeypatch):
    _f32_on_kernel(monkeypatch, dtype)
    q, k, v, dy, m, _ = _inputs(2, 90, 110, 4, 2, d, dtype, 3, mask=True)
    window = 30 if kind == "sliding" else None
    opts = dict(mask_kind=kind, window=window, mask=m, scale=0.25, softcap=8.0)

    def loss(q, k, v):
        o = attention(q, k, v, **opts)
        return jnp.sum(o.astype(jnp.float32) * dy.astype(jnp.float32))

    with jax.default_matmul_precision("highest"):
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        p = _params(d, kind, window, 0.25, 8.0, m, None)

        def loss_ref(q, k, v):
            o = A.reference_attention(q, k, v, m, **p)[0]
            return jnp.sum(o * _f32(dy))

        gr = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(_f32(q), _f32(k), _f32(v))
        for n, a, b in zip(("dq", "dk", "dv"), g, gr):
            _close(a, b, dtype, n)
        # attention_backward (the RLX AttentionBackward ops) gives the same gradients
        g2 = jax.jit(lambda q, k, v, dy: attention_backward(q, k, v, dy, mask=m, **{
            x: opts[x] for x in ("mask_kind", "window", "scale", "softcap")}))(q, k, v, dy)
        for n, a, b in zip(("dq", "dk", "dv"), g2, gr):
            _close(a, b, dtype, n + " (attention_backward)")


# ---- NaN rows: as the CPU kernel (ffi/cpu/attention.cc) -------------------------------------


def _fwd_bwd(q, k, v, dy, p):
    out, lse = A.attention_fwd(q, k, v, **p)
    return out, lse, A.attention_bwd(q, k, v, out, lse, dy, jnp.zeros(lse.shape, jnp.float32), **p)


def _ref_fwd_bwd(q, k, v, dy, p):
    out, lse = A.reference_attention(q, k, v, **p)
    return out, lse, A.reference_attention_bwd(q, k, v, out, lse, dy, jnp.zeros(lse.shape, jnp.float32), **p)


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 64), (jnp.float16, 128), (jnp.float32, 32)])
def test_nan_row_propagates_as_cpu_kernel(dtype, d, monkeypatch):
    """A NaN in q row i of head 1 makes that row's scores NaN: out and lse of the row are NaN (not
    a row with no visible key: out 0, lse -inf), so are its dq row and the dk / dv of its kv
    head (every key is visible: mask kind none), exactly as the CPU kernel; everything else
    matches the reference computed with the NaN replaced by 0."""
    _f32_on_kernel(monkeypatch, dtype)
    b, s, h, hkv, row = 1, 90, 4, 2, 50
    q, k, v, dy, _, _ = _inputs(b, s, s, h, hkv, d, dtype, 11)
    q_nan = q.at[0, row, 1, 3].set(jnp.nan)
    p = _params(d, "none", None, None, None, None, None)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *a: _fwd_bwd(*a, p))(q_nan, k, v, dy)
        nan_out = np.zeros((b, s, h), bool)
        nan_out[0, row, 1] = True
        out, lse, dq, dk, dv = [np.asarray(jnp.asarray(x, jnp.float32)) for x in (got[0], got[1], *got[2])]
        assert (np.isnan(out).all(-1) == nan_out).all() and (np.isnan(out).any(-1) == nan_out).all(), "out NaN rows"
        assert (np.isnan(lse) == np.swapaxes(nan_out, 1, 2)).all(), "lse: NaN exactly at the NaN row"
        assert (np.isnan(dq).all(-1) == nan_out).all() and (np.isnan(dq).any(-1) == nan_out).all(), "dq NaN rows"
        for name, g in (("dk", dk), ("dv", dv)):
            assert np.isnan(g[:, :, 0]).all(), f"{name}: kv head 0 (read by the NaN row) must be NaN"
            assert np.isfinite(g[:, :, 1]).all(), f"{name}: kv head 1 must stay finite"
        # the CPU kernel gives the same NaN pattern (out, lse, grads)
        cpu = jax.devices("cpu")[0]
        on_cpu = [jax.device_put(x, cpu) for x in (q_nan, k, v, dy)]
        ref_cpu = jax.jit(lambda *a: _fwd_bwd(*a, p))(*on_cpu)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                              (ref_cpu[0], ref_cpu[1], *ref_cpu[2])):
            y = np.asarray(jnp.asarray(y, jnp.float32))
            assert (np.isnan(x) == np.isnan(y)).all(), f"{name}: NaN pattern differs from the CPU kernel"
        # the rest is the attention of the inputs without the NaN
        q0 = q.at[0, row, 1, 3].set(0)
        want = jax.jit(lambda *a: _ref_fwd_bwd(*a, p))(*[_f32(x) for x in (q0, k, v, dy)])
        fin = ~nan_out
        _close(out[fin], np.asarray(want[0])[fin], dtype, "out (finite rows)")
        fin_l = np.swapaxes(fin, 1, 2)
        _close(lse[fin_l], np.asarray(want[1])[fin_l], jnp.float32 if dtype == jnp.float32 else jnp.float16, "lse")
        _close(dq[fin], np.asarray(want[2][0])[fin], dtype, "dq (finite rows)")
        for name, g, w in (("dk", dk, want[2][1]), ("dv", dv, want[2][2])):
            _close(g[:, :, 1], np.asarray(w)[:, :, 1], dtype, name + " (kv head 1)")


def test_cuda_targets_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_attention_fwd_v1", "rlx_attention_bwd_v1"} <= set(info["targets"])
    q, k, v, dy, _, _ = _inputs(2, 64, 64, 4, 2, 64, jnp.bfloat16, 0)
    fn = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: attention(q, k, v, mask_kind="causal"), q, k, v)[1](dy))
    text = fn.lower(q, k, v).as_text()
    assert "rlx_attention_fwd" in text and "rlx_attention_bwd" in text
    # the CUDA backward carries its f32 scratch result, sized for the fused backward (bf16, D 64,
    # causal, no bias): delta (B * H * Sq), the dQ accumulator and the semaphores
    assert A._cuda_fused_bwd(q, "causal", 64 ** -0.5, 0.0, False, False)
    # and the head splits of its 2-head groups (a tree node per (batch, kv head, key block))
    assert f"tensor<{A.cuda_bwd_scratch_size(2, 4, 64, 64, True, hkv=2, sk=64)}xf32>" in text
    assert A.cuda_bwd_scratch_size(2, 4, 64, 64, True, hkv=2, sk=64) > A.cuda_bwd_scratch_size(2, 4, 64, 64, True)


def test_deterministic():
    q, k, v, dy, _, _ = _inputs(1, 257, 257, 4, 2, 128, jnp.bfloat16, 5)
    fn = jax.jit(lambda q, k, v, dy: attention_backward(q, k, v, dy, mask_kind="causal"))
    a = [np.asarray(x.astype(jnp.float32)) for x in fn(q, k, v, dy)]
    b = [np.asarray(x.astype(jnp.float32)) for x in fn(q, k, v, dy)]
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


# The fused backward's head splits (FusedSplit in ffi/cuda/attention_fused_bwd.cuh): groups of 2, 4
# and 8 query heads per kv head, whose key blocks split into 2, 4 and 4 blocks (the launcher's model
# picks the most splits the scratch allows at these small grids), in the warp-specialised kernel and
# (D 64 with a softcap) the other one, with every mask form; values against the f32 reference, and the
# tree's sums bitwise the same over calls.
@pytest.mark.parametrize("h, hkv", [(4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("d, opts", [
    (128, dict(kind="causal")), (128, dict(kind="none", mask=True)), (64, dict(kind="causal", dlse=True)),
    (64, dict(kind="none", softcap=5.0)), (128, dict(kind="sliding", window=90, softcap=20.0)),
])
def test_fused_backward_head_splits(h, hkv, d, opts):
    _check_case(2, 333, 333, h, hkv, d, jnp.bfloat16, seed=h + hkv + d, **opts)
    q, k, v, dy, m, _ = _inputs(2, 333, 333, h, hkv, d, jnp.bfloat16, 1, mask=opts.get("mask", False))
    kw = dict(mask_kind=opts["kind"], softcap=opts.get("softcap"), mask=m, window=opts.get("window"))
    fn = jax.jit(lambda q, k, v, dy: attention_backward(q, k, v, dy, **kw))
    first = [np.asarray(x.astype(jnp.float32)) for x in fn(q, k, v, dy)]
    for _ in range(2):
        for x, y in zip(first, fn(q, k, v, dy)):
            assert np.array_equal(x, np.asarray(y.astype(jnp.float32)))


@pytest.mark.parametrize("b,sq,sk,h,hkv", [(2, 0, 16, 2, 2), (2, 16, 0, 2, 1), (2, 0, 0, 2, 2), (0, 8, 8, 2, 2)])
@pytest.mark.parametrize("d", [64, 128, 32])
def test_zero_sized(b, sq, sk, h, hkv, d):
    dtype = jnp.bfloat16
    q = jnp.ones((b, sq, h, d), dtype)
    k = jnp.ones((b, sk, hkv, d), dtype)
    v = jnp.ones((b, sk, hkv, d), dtype)
    dy = jnp.ones((b, sq, h, d), dtype)
    q, k, v, dy = (jax.device_put(x, _gpu()) for x in (q, k, v, dy))
    out = jax.jit(lambda q, k, v: attention(q, k, v))(q, k, v)
    assert out.shape == q.shape
    assert not np.asarray(out.astype(jnp.float32)).any()  # no key: rows are 0
    dq, dk, dv = jax.jit(lambda *a: attention_backward(*a))(q, k, v, dy)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for g in (dq, dk, dv):
        assert not np.asarray(g.astype(jnp.float32)).any()


def test_bad_scratch_is_an_error():
    q, k, v, dy, _, _ = _inputs(1, 16, 16, 2, 2, 64, jnp.bfloat16, 1)
    p = _params(64, "none", None, None, None, None, None)
    out, lse = A.attention_fwd(q, k, v, **p)
    m, bb = A._dummies(q, None, None)
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(bb.shape, bb.dtype),
              jax.ShapeDtypeStruct((3,), jnp.float32))  # needs B * H * Sq = 32
    call = jax.ffi.ffi_call("rlx_attention_bwd_v1", shapes)
    attrs = A._attrs("none", 0, p["scale"], 0.0, False, False)
    with pytest.raises(Exception, match="scratch"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(q, k, v, out, lse, dy, jnp.zeros_like(lse), m, bb))


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_long_sequence(d):
    _check_case(1, 2048, 2048, 4, 2, d, jnp.bfloat16, kind="causal", softcap=20.0)


def test_long_f32_takes_the_kernel_and_keeps_memory_linear():
    """f32 on CUDA runs XLA's attention until its [B, H, Sq, Sk] f32 scores reach
    A.CUDA_F32_KERNEL_MIN_SCORE_BYTES (1 GiB here: B1 S8192 H4); from there the kernel, with no
    score matrix in the compiled gradient, and the same values as the reference."""
    b, s, h, d = 1, 8192, 4, 64
    assert b * h * s * s * 4 >= A.CUDA_F32_KERNEL_MIN_SCORE_BYTES
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q, k, v, dy = (jax.random.normal(kk, (b, s, h, d), jnp.float32) for kk in ks)
    with jax.default_matmul_precision("highest"):
        grads = jax.jit(lambda q, k, v, dy: jax.vjp(lambda *a: attention(*a, mask_kind="causal"), q, k, v)[1](dy))
        compiled = grads.lower(q, k, v, dy).compile()
        text = compiled.as_text()
        assert "rlx_attention_fwd" in text and "rlx_attention_bwd" in text
        assert compiled.memory_analysis().temp_size_in_bytes < b * h * s * s * 4 / 4
        got = grads(q, k, v, dy)
        out = jax.jit(lambda q, k, v: attention(q, k, v, mask_kind="causal"))(q, k, v)
        p = _params(d, "causal", None, None, None, None, None)
        out_r, _ = jax.jit(lambda q, k, v: A.reference_attention(q, k, v, **p))(q, k, v)
        want = jax.jit(lambda q, k, v, dy: jax.vjp(lambda *a: A.reference_attention(*a, **p)[0], q, k, v)[1](dy))(
            q, k, v, dy)
    _close(out, out_r, jnp.float32, "out")
    for n, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(g, w, jnp.float32, n)


# The default backward of the PLAIN cases at long sequences (on sm_90a the fused kernel: 16 key
# blocks and up to 16 ordered dQ adds a query tile; bottom-right causal with Sq != Sk, GQA).
@pytest.mark.slow
@pytest.mark.parametrize("d, kind, sq, sk, hkv, dtype", [
    (64, "none", 2048, 2048, 2, jnp.bfloat16), (64, "causal", 2048, 2048, 2, jnp.bfloat16),
    (128, "none", 2048, 2048, 2, jnp.bfloat16), (128, "causal", 2048, 2048, 2, jnp.bfloat16),
    (128, "causal", 1500, 2600, 1, jnp.float16), (64, "causal", 2600, 1500, 4, jnp.float16)])
def test_long_sequence_plain(d, kind, sq, sk, hkv, dtype):
    _check_case(1, sq, sk, 4, hkv, d, dtype, kind=kind, dlse=True, seed=d + sq)


# ---- kernel specialisations (ffi/cuda/attention_launch_impl.cuh) ----------------------------------------
# The tensor-core kernels are instantiated per head dim (64: fwd double buffered; 128: fwd
# staggered), MASK (a key mask is given) and PLAIN (no softcap and no bias: the unmasked tiles
# take a separate score loop). Each (D, MASK, PLAIN) kernel is hit here, with odd lengths
# (partial query / key tiles), GQA, Sq != Sk, and each mask kind; softcap and bias each alone
# reach the general (not PLAIN) kernels (on sm_90a a softcap, a key mask or a window without a bias
# takes the wgmma CAP / MASK kernels instead: WGMMA_CAP_CASES, WGMMA_MASK_CASES).

SPEC_CASES = [
    # d, key mask, variant, kind, dtype
    (64, False, "plain", "none", jnp.bfloat16),
    (64, False, "plain", "sliding", jnp.float16),
    (64, False, "softcap", "causal", jnp.bfloat16),
    (64, False, "bias", "none", jnp.bfloat16),
    (64, True, "plain", "causal", jnp.bfloat16),
    (64, True, "softcap", "none", jnp.float16),
    (64, True, "bias", "sliding", jnp.bfloat16),
    (128, False, "plain", "none", jnp.bfloat16),
    (128, False, "plain", "causal", jnp.bfloat16),
    (128, False, "softcap", "sliding", jnp.bfloat16),
    (128, False, "bias", "causal", jnp.float16),
    (128, True, "plain", "sliding", jnp.bfloat16),
    (128, True, "plain", "none", jnp.float16),
    (128, True, "softcap", "causal", jnp.bfloat16),
    (128, True, "bias", "none", jnp.bfloat16),
]


@pytest.mark.parametrize("d,mask,variant,kind,dtype", SPEC_CASES,
                         ids=lambda x: jnp.dtype(x).name if isinstance(x, type) else str(x))
def test_kernel_specialisations(d, mask, variant, kind, dtype):
    opts = dict(kind=kind, window=50, mask=mask, seed=5 + d)
    if variant == "softcap":
        opts["softcap"] = 7.0
    if variant == "bias":
        opts["bias"] = True
    _check_case(1, 141, 203, 4, 2, d, dtype, **opts)
    if variant == "plain" and kind == "none":  # and Sq > Sk (bottom-right alignment), negative scale
        _check_case(2, 203, 141, 2, 1, d, dtype, kind=kind, mask=mask, scale=-0.1, seed=9)


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 64), (jnp.float16, 128)])
def test_nan_row_with_key_mask(dtype, d):
    """The key-masked kernels (MASK template flag) propagate a NaN row as the CPU kernel does:
    same NaN pattern in out, lse and dq, and NaN dk / dv at the kept keys of the NaN row's kv
    head (keys 64..127 hidden: a skipped key tile); the rest matches the reference. (At hidden
    keys of that kv head the CPU kernel gives NaN dk / dv, the CUDA kernels' skipped tiles 0:
    not compared.)"""
    b, s, h, hkv, row = 1, 150, 4, 2, 70
    q, k, v, dy, m, _ = _inputs(b, s, s, h, hkv, d, dtype, 13, mask=True)
    m = m.at[0, 64:128].set(0.0)
    q_nan = q.at[0, row, 1, 5].set(jnp.nan)
    p = _params(d, "none", None, None, None, m, None)

    def f(q, k, v, dy, m):
        out, lse = A.attention_fwd(q, k, v, m, **p)
        return out, lse, A.attention_bwd(q, k, v, out, lse, dy, jnp.zeros(lse.shape, jnp.float32), m, **p)

    def fr(q, k, v, dy, m):
        out, lse = A.reference_attention(q, k, v, m, **p)
        return out, lse, A.reference_attention_bwd(q, k, v, out, lse, dy, jnp.zeros(lse.shape, jnp.float32), m, **p)

    with jax.default_matmul_precision("highest"):
        got = jax.jit(f)(q_nan, k, v, dy, m)
        got = [np.asarray(jnp.asarray(x, jnp.float32)) for x in (got[0], got[1], *got[2])]
        cpu = jax.devices("cpu")[0]
        ref_cpu = jax.jit(f)(*[jax.device_put(x, cpu) for x in (q_nan, k, v, dy, m)])
        ref_cpu = [np.asarray(jnp.asarray(x, jnp.float32)) for x in (ref_cpu[0], ref_cpu[1], *ref_cpu[2])]
        for name, x, y in zip(("out", "lse", "dq"), got, ref_cpu):
            assert np.isnan(x).any() and (np.isnan(x) == np.isnan(y)).all(), f"{name}: NaN pattern differs from CPU"
        out, lse, dq, dk, dv = got
        kept = np.asarray(m[0]) >= 0.5
        for name, g, y in (("dk", dk, ref_cpu[3]), ("dv", dv, ref_cpu[4])):
            assert np.isnan(g[0, kept, 0]).all() and np.isnan(y[0, kept, 0]).all(), f"{name}: kept keys of kv head 0"
        nan_out = np.zeros((b, s, h), bool)
        nan_out[0, row, 1] = True
        assert (np.isnan(out).all(-1) == nan_out).all() and (np.isnan(out).any(-1) == nan_out).all(), "out NaN rows"
        want = jax.jit(fr)(*[_f32(x) for x in (q.at[0, row, 1, 5].set(0), k, v, dy)], m)
        fin = ~nan_out
        _close(out[fin], np.asarray(want[0])[fin], dtype, "out (finite rows)")
        _close(dq[fin], np.asarray(want[2][0])[fin], dtype, "dq (finite rows)")
        for name, g, w in (("dk", dk, want[2][1]), ("dv", dv, want[2][2])):
            _close(g[:, :, 1], np.asarray(w)[:, :, 1], dtype, name + " (kv head 1)")
            assert not g[0, 64:128, 1].any(), f"{name}: hidden keys get 0"


# ---- the Hopper kernels (sm_90a; ffi/cuda/attention_launch_impl.cuh) -------------------------
# bf16 / f16, D 64 and 128, no bias, scale > 0: on a compute capability 9.0 device with the sm_90a
# image the forward runs the warp-specialised wgmma kernel (attention_wgmma_ws.cuh) and the backward
# the fused dk / dv / dq kernel (attention_fused_bwd_ws.cuh; attention_fused_bwd.cuh at D 64 with a
# softcap). RLX_ATTENTION_CUDA_WGMMA is read once per process, so each setting runs in a child
# process here: 1 makes a case the wgmma kernels serve an error where the loaded image has no sm_90a
# code (instead of a silent mma.sync fallback) and names each wgmma kernel on stderr at its first
# launch, so the children check the path taken, not only the values; 0 runs the mma.sync kernels
# (the path of a GPU without sm_90a code). Odd lengths (partial query tiles of 128 rows, partial
# key tiles of 64 / 128), GQA, Sq != Sk both ways (bottom-right causal), several query tiles per
# head, more query tiles than SMs (every block of the persistent grid loops over several tiles),
# dlse, an explicit scale, rows that see one key.
WGMMA_CASES = [
    # b, sq, sk, h, hkv, d, dtype, options
    (2, 128, 128, 4, 4, 64, jnp.bfloat16, {}),
    (1, 333, 250, 4, 2, 64, jnp.bfloat16, dict(kind="causal")),
    (1, 200, 461, 4, 1, 64, jnp.float16, dict(kind="causal", dlse=True)),
    (2, 97, 161, 4, 2, 64, jnp.float16, dict(kind="none", scale=0.3)),
    (1, 1, 77, 2, 2, 64, jnp.bfloat16, dict(kind="causal")),
    (2, 128, 128, 4, 4, 128, jnp.bfloat16, {}),
    (1, 133, 77, 4, 1, 128, jnp.bfloat16, dict(kind="causal")),
    (1, 77, 190, 2, 2, 128, jnp.float16, dict(kind="causal")),
    # causal, Sq - Sk over a query tile (64 rows at D 128, 128 at D 64): whole tiles no key block
    # visits (the fused backward's converter blocks write their dq = 0), then rows that see no key
    # inside visited tiles
    (1, 300, 100, 2, 1, 128, jnp.bfloat16, dict(kind="causal")),
    (2, 400, 130, 2, 2, 64, jnp.float16, dict(kind="causal")),
    (2, 300, 300, 2, 2, 128, jnp.bfloat16, dict(kind="none", dlse=True)),
    (1, 401, 129, 4, 2, 128, jnp.float16, dict(kind="none", scale=0.05)),
    (1, 520, 520, 2, 1, 128, jnp.bfloat16, dict(kind="causal", seed=3)),
    # for the wgmma dk / dv (128-key blocks of 2 x 64): Sq >> Sk and Sk >> Sq causal
    (1, 700, 64, 2, 1, 128, jnp.bfloat16, dict(kind="causal", seed=5)),
    (1, 64, 700, 2, 2, 128, jnp.float16, dict(kind="causal", dlse=True, seed=6)),
    # one query row against several key blocks (the fused backward: 3 contributors to one tile)
    (1, 1, 300, 2, 1, 128, jnp.bfloat16, dict(kind="causal", seed=7)),
    # 17 query tiles x 16 (batch, head) pairs = 272 tiles: more than the SMs of an H100 / H200 (132),
    # so each block of the persistent forward grid takes several tiles (in the causal pass order)
    (4, 2100, 2100, 4, 2, 128, jnp.bfloat16, dict(kind="causal", seed=8)),
]

# Softcap c * tanh(s / c) on the scaled score s: the CAP kernels (the warp-specialised forward, the
# fused backward; without the wgmma kernels the mma.sync ones). Small caps
# against large scores (tanh far from linear), a large cap, rows that see no key (causal, Sq > Sk:
# out 0, lse -inf, as without a cap), GQA, odd lengths, Sq != Sk both ways, dlse.
WGMMA_CAP_CASES = [
    (1, 130, 140, 2, 2, 64, jnp.bfloat16, dict(kind="causal", softcap=5.0, seed=4)),
    (2, 197, 261, 4, 2, 64, jnp.float16, dict(kind="none", softcap=1.5, scale=0.5, dlse=True, seed=8)),
    (1, 300, 77, 4, 1, 64, jnp.bfloat16, dict(kind="causal", softcap=2.0, scale=0.4, seed=9)),
    (2, 160, 300, 4, 2, 128, jnp.bfloat16, dict(kind="none", softcap=2.0, scale=0.3, seed=10)),
    (1, 333, 250, 4, 4, 128, jnp.float16, dict(kind="causal", softcap=30.0, dlse=True, seed=11)),
    (1, 260, 90, 2, 1, 128, jnp.bfloat16, dict(kind="causal", softcap=1.0, scale=0.6, seed=12)),
]

# Key mask [B, Sk] and / or a sliding window (without and with a softcap): the MASK kernels, served
# as the CAP ones (the warp-specialised forward's consumers read each tile's mask values; the fused
# backward reads its block's keys' once, and a window bounds its query tiles). Random masks, whole
# key tiles hidden and kept (mask_tiles), a batch whose rows see no key (dead_batch: out, lse -inf
# and gradients as without keys), windows of 1 (each row sees two keys; at 0, one key, dq and dk are
# exactly 0 and the relative check meaningless), 40-300 keys (one to several key blocks, Sq < Sk),
# GQA, odd lengths, Sq != Sk both ways, dlse; every mask kind at both head dims with and without a
# softcap.
WGMMA_MASK_CASES = [
    (3, 70, 130, 2, 1, 64, jnp.bfloat16, dict(kind="none", mask=True, dead_batch=True)),
    (2, 199, 333, 4, 2, 64, jnp.float16, dict(kind="causal", mask_tiles=True, dlse=True, seed=13)),
    (2, 150, 260, 4, 2, 128, jnp.bfloat16, dict(kind="none", mask_tiles=True, seed=14)),
    (2, 301, 280, 4, 4, 128, jnp.float16, dict(kind="causal", mask=True, dead_batch=True, seed=15)),
    (2, 140, 200, 2, 2, 64, jnp.bfloat16, dict(kind="none", mask=True, softcap=2.0, scale=0.4, seed=16)),
    (1, 260, 300, 4, 2, 128, jnp.bfloat16, dict(kind="none", mask_tiles=True, softcap=3.0, seed=17)),
    (2, 230, 200, 2, 1, 128, jnp.float16, dict(kind="causal", mask=True, softcap=5.0, dead_batch=True, seed=18)),
    (2, 300, 300, 4, 2, 128, jnp.bfloat16, dict(kind="sliding", window=70, seed=19)),
    (1, 333, 400, 4, 1, 64, jnp.float16, dict(kind="sliding", window=150, mask=True, dlse=True, seed=20)),
    (2, 260, 200, 2, 2, 128, jnp.bfloat16, dict(kind="sliding", window=40, softcap=4.0, seed=21)),
    (1, 700, 700, 2, 1, 64, jnp.bfloat16, dict(kind="sliding", window=1, seed=22)),
    (1, 520, 1100, 2, 2, 128, jnp.float16, dict(kind="sliding", window=300, seed=23)),
]

_WGMMA_CHILD = """
import sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
import test_attention_gpu as t
from rlx_jax.ops import attention
if "two_kernel_bwd" in sys.argv:
    # the backward's scratch without the fused kernel's room: the launcher takes the two-kernel
    # backward for the PLAIN cases (and the mma.sync one for a softcap, key mask or window)
    t.A._cuda_fused_bwd = lambda *args, **kwargs: False
for i, (*shape, dtype, opts) in enumerate(t.WGMMA_CASES):
    t._check_case(*shape, dtype, **opts)
    print("case", i, "ok", flush=True)
# through the public op: values and gradients (the backward reads the forward's out / lse)
for d, kind, dtype in ((64, "causal", jnp.bfloat16), (128, "none", jnp.float16)):
    q, k, v, dy, _, _ = t._inputs(2, 150, 170, 4, 2, d, dtype, 21)
    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, mask_kind=kind).astype(jnp.float32) * dy.astype(jnp.float32))
    p = t._params(d, kind, None, None, None, None, None)
    def loss_ref(q, k, v):
        return jnp.sum(t.A.reference_attention(q, k, v, **p)[0] * t._f32(dy))
    with jax.default_matmul_precision("highest"):
        o = jax.jit(lambda q, k, v: attention(q, k, v, mask_kind=kind))(q, k, v)
        t._close(o, t.A.reference_attention(t._f32(q), t._f32(k), t._f32(v), **p)[0], dtype, "out (ops)")
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        gr = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(t._f32(q), t._f32(k), t._f32(v))
        for n, a, b in zip(("dq", "dk", "dv"), g, gr):
            t._close(a, b, dtype, n + " (ops)")
# zero-sized: no key (rows 0, lse -inf), no query, no batch; without and with a softcap
for d in (64, 128):
    for b, sq, sk, h, hkv in ((2, 0, 16, 2, 2), (2, 16, 0, 2, 1), (0, 8, 8, 2, 2)):
        for cap in (None, 3.0):
            p = t._params(d, "causal", None, None, cap, None, None)
            q = jnp.ones((b, sq, h, d), jnp.bfloat16)
            k = jnp.ones((b, sk, hkv, d), jnp.bfloat16)
            out, lse = t.A.attention_fwd(q, k, k, **p)
            assert out.shape == q.shape and not np.asarray(out.astype(jnp.float32)).any()
            assert np.isneginf(np.asarray(lse)).all()
            # and the backward (the fused one's memset path: no key block, or no query tile)
            grads = t.A.attention_bwd(q, k, k, out, lse, jnp.ones_like(q), jnp.zeros(lse.shape, jnp.float32), **p)
            assert [x.shape for x in grads] == [q.shape, k.shape, k.shape]
            assert not any(np.asarray(x.astype(jnp.float32)).any() for x in grads)
for i, (*shape, dtype, opts) in enumerate(t.WGMMA_CAP_CASES):
    t._check_case(*shape, dtype, **opts)
    print("softcap case", i, "ok", flush=True)
for i, (*shape, dtype, opts) in enumerate(t.WGMMA_MASK_CASES):
    t._check_case(*shape, dtype, **opts)
    print("key mask case", i, "ok", flush=True)
print("child ok")
"""


# Each child's launch log (RLX_ATTENTION_CUDA_WGMMA=1): the warp-specialised forward at both head
# dims (" TMA": its producer loads with TMA; where the driver refuses a tensor map it takes cp.async
# and the line ends without it); by default the fused backward, warp-specialised (" WS") except at
# D 64 with a softcap; with the backward's scratch too small for the fused kernel ("two_kernel_bwd")
# the wgmma dk / dv kernel (OVL=1 at D 128: dS computed while dV's product runs; OVL=0 at D 64) and,
# at D 128, the warp-specialised dq (at D 64 the mma.sync dq, which logs nothing), for the PLAIN
# cases; the softcap / key-mask / window cases' backward then runs on mma.sync. The CAP, MASK and
# CAP MASK forms of each kernel are named by the line's end. "mma_sync" (RLX_ATTENTION_CUDA_WGMMA=0)
# runs every case on the mma.sync kernels; that setting logs nothing, so its child checks values only.
_FWD_WS = {"D=128 BC=128 NWG=3 WS NST=3 persistent PIPE TMA", "D=64 BC=128 NWG=3 WS NST=3 persistent PIPE TMA"}
_FUSED = {"D=64 BK=128 BQ=128 WS", "D=128 BK=128 BQ=64 WS"}
_DKDV = {"D=64 BK=128 NWG=2 OVL=0", "D=128 BK=128 NWG=2 OVL=1"}
_DQ_WS = "D=128 BM=128 BC=64 WS NST=4 persistent PIPE"
_FWD_TAG = "rlx attention forward: wgmma kernel "
_DKDV_TAG = "rlx attention backward: wgmma dkdv kernel "
_DQ_TAG = "rlx attention backward: wgmma dq kernel "
_FUSED_TAG = "rlx attention backward: wgmma fused dkdv+dq kernel "


def _launched(stderr, tag):
    return {ln.split(tag, 1)[1].strip() for ln in stderr.splitlines() if tag in ln}


def _run_child(code, setting, timeout):
    import subprocess
    import sys

    env = dict(os.environ, RLX_ATTENTION_CUDA_WGMMA="0" if setting == "mma_sync" else "1",
               RLX_ATTENTION_CUDNN_FORWARD="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code, setting], cwd=root, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and "child ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    return r


@pytest.mark.parametrize("setting", ["default", "mma_sync", "two_kernel_bwd"])
def test_wgmma_forward(setting):
    r = _run_child(_WGMMA_CHILD, setting, 400)
    flags = (" CAP", " MASK", " CAP MASK")
    if setting == "mma_sync":
        fwd, fused, dkdv, dq = set(), set(), set(), set()
    else:
        fwd = _FWD_WS | {ln + f for ln in _FWD_WS for f in flags}
        if setting == "default":
            fused = _FUSED | {(ln.replace(" WS", "") if ln.startswith("D=64") and "CAP" in f else ln) + f
                              for ln in _FUSED for f in flags}
            dkdv, dq = set(), set()
        else:
            fused, dkdv, dq = set(), _DKDV, {_DQ_WS}
    for which, want, tag in (("fwd", fwd, _FWD_TAG), ("dkdv", dkdv, _DKDV_TAG), ("dq", dq, _DQ_TAG),
                             ("fused", fused, _FUSED_TAG)):
        launched = _launched(r.stderr, tag)
        assert launched == want, (which, launched, want, r.stderr[-2000:])


# The persistent warp-specialised forward and dq kernels (grid min(tiles, SMs), each block looping
# over its tiles in the pass order attn_ws_zig picks) compute each tile the same way whichever block
# takes it: out, lse, dq, dk, dv must be bitwise equal from process to process and from run to run,
# on shapes with more tiles than SMs (272 query tiles at B 4, Sq 2100, H 4), causal and not, odd
# lengths, GQA, Sq != Sk both ways, on random inputs with a spread of scales (rows whose running max
# moves often). The backward here is the two-kernel one (the scratch without the fused kernel's room:
# the warp-specialised dq at D 128) for the PLAIN cases, mma.sync for the softcap / key-mask / window ones.
_WS_DET_CHILD = """
import hashlib, sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
import test_attention_gpu as t
t.A._cuda_fused_bwd = lambda *args, **kwargs: False
for (b, sq, sk, h, hkv, d, kind, cap, mask) in ((2, 1030, 1100, 4, 2, 128, "none", None, False),
                                                (1, 1100, 1100, 4, 4, 128, "causal", None, False),
                                                (1, 333, 700, 4, 1, 64, "causal", None, False),
                                                (2, 700, 260, 2, 2, 64, "none", None, False),
                                                (1, 77, 190, 2, 2, 128, "causal", None, False),
                                                (4, 2100, 2100, 4, 2, 128, "causal", None, False),
                                                (4, 2100, 1500, 4, 2, 64, "none", None, False),
                                                (1, 900, 1000, 4, 2, 128, "causal", 4.0, False),
                                                (2, 700, 520, 2, 1, 64, "none", 2.5, False),
                                                (2, 800, 900, 4, 2, 128, "none", None, True),
                                                (1, 600, 700, 2, 2, 64, "causal", 3.0, True),
                                                (1, 900, 900, 4, 2, 128, "sliding", None, False)):
    q, k, v, _, m, _ = t._inputs(b, sq, sk, h, hkv, d, jnp.bfloat16, 13, mask=mask)
    q = (q.astype(jnp.float32) * jnp.linspace(0.2, 4.0, sq)[None, :, None, None]).astype(jnp.bfloat16)
    p = t._params(d, kind, 200, None, cap, m, None)  # (the window: sliding only)
    ex = [m] if mask else []
    fwd = jax.jit(lambda q, k, v, *e: t.A.attention_fwd(q, k, v, *e, **p))
    bwd = jax.jit(lambda *x: t.A.attention_bwd(*x, **p))
    digests = []
    for _ in range(2):
        out, lse = fwd(q, k, v, *ex)
        dy = jax.random.normal(jax.random.PRNGKey(sq + d), out.shape, jnp.float32).astype(jnp.bfloat16)
        grads = bwd(q, k, v, out, lse, dy, jnp.zeros_like(lse), *ex)
        out32, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
        g32 = [np.asarray(x.astype(jnp.float32)) for x in grads]
        assert np.isfinite(out32).all() and np.isfinite(lse).all() and all(np.isfinite(x).all() for x in g32)
        assert all(np.abs(x).max() > 0 for x in g32)
        digests.append((hashlib.sha1(out32.tobytes() + lse.tobytes()).hexdigest(),
                        hashlib.sha1(b"".join(x.tobytes() for x in g32)).hexdigest()))
    assert digests[0] == digests[1], (b, sq, sk, d, kind, "differs between runs")
    print("hash", b, sq, sk, d, kind, *digests[0], flush=True)
print("child ok")
"""


def test_ws_persistent_grid_bitwise_equal():
    hashes = []
    for _ in range(2):  # two processes: the results must not depend on the block schedule of either
        r = _run_child(_WS_DET_CHILD, "two_kernel_bwd", 300)
        # the child's softcap / key-mask / window cases: softcap at both head dims, a key mask or a
        # window at D 128, both a key mask and a softcap at D 64
        d128, d64 = sorted(_FWD_WS)
        want = {d128, d64, d128 + " CAP", d64 + " CAP", d128 + " MASK", d64 + " CAP MASK"}
        assert _launched(r.stderr, _FWD_TAG) == want, r.stderr[-2000:]
        assert _launched(r.stderr, _DQ_TAG) == {_DQ_WS}, r.stderr[-2000:]
        assert _launched(r.stderr, _DKDV_TAG) == _DKDV, r.stderr[-2000:]
        assert not _launched(r.stderr, _FUSED_TAG), r.stderr[-2000:]
        hashes.append([ln for ln in r.stdout.splitlines() if ln.startswith("hash ")])
    assert len(hashes[0]) == 12 and hashes[0] == hashes[1], hashes


# The fused backward sums the key blocks' dQ partials in f32 global scratch in a fixed order per
# query tile (semaphores, no float atomics): dq, dk, dv must be bitwise identical from run to run and
# from process to process, on shapes with many key blocks per query tile (Sk 1100: 9 blocks; causal;
# GQA), at head dims 128 and 64 (where each warpgroup's dQ columns start inside the K tile's 128-byte
# swizzled rows), with a key mask, a sliding window and a softcap (at D 64 the kernel that is not
# warp-specialised), and still match the f32 reference.
_FUSED_DET_CHILD = """
import hashlib, sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
import test_attention_gpu as t
for (b, sq, sk, h, hkv, d, kind, cap, mask) in ((2, 1030, 1100, 4, 2, 128, "none", None, False),
                                                (1, 1100, 1100, 4, 4, 128, "causal", None, False),
                                                (2, 900, 1300, 4, 2, 64, "none", None, False),
                                                (1, 1100, 1000, 2, 1, 64, "causal", None, False),
                                                (1, 1100, 1100, 4, 2, 128, "causal", 3.0, False),
                                                (2, 1000, 1100, 4, 2, 128, "none", None, True),
                                                (1, 1100, 1100, 4, 2, 128, "sliding", None, False),
                                                (2, 1000, 1100, 4, 2, 64, "none", None, True),
                                                (1, 1100, 1100, 4, 2, 64, "sliding", None, False),
                                                (1, 1000, 1100, 4, 2, 64, "causal", 3.0, False)):
    q, k, v, dy, m, _ = t._inputs(b, sq, sk, h, hkv, d, jnp.bfloat16, 11, mask=mask)
    p = t._params(d, kind, 300, None, cap, m, None)  # (the window: sliding only)
    ex = [m] if mask else []
    out, lse = jax.jit(lambda q, k, v, *e: t.A.attention_fwd(q, k, v, *e, **p))(q, k, v, *ex)
    zl = jnp.zeros(lse.shape, jnp.float32)
    fb = jax.jit(lambda *x: t.A.attention_bwd(*x, **p))
    runs = [[np.asarray(x.astype(jnp.float32)) for x in fb(q, k, v, out, lse, dy, zl, *ex)] for _ in range(3)]
    for r in runs[1:]:
        for n, x, y in zip(("dq", "dk", "dv"), runs[0], r):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), (kind, n, "differs between runs")
    with jax.default_matmul_precision("highest"):
        f = [t._f32(x) for x in (q, k, v, dy)]
        gr = t.A.reference_attention_bwd(*f[:3], t._f32(out), lse, f[3], zl, *ex, **p)
    for n, x, y in zip(("dq", "dk", "dv"), runs[0], gr):
        t._close(jnp.asarray(x).astype(jnp.bfloat16), y, jnp.bfloat16, n + " (fused, " + kind + ")")
    print("hash", d, kind, cap, mask, hashlib.sha1(b"".join(x.tobytes() for x in runs[0])).hexdigest(), flush=True)
print("child ok")
"""


def test_wgmma_fused_backward_deterministic():
    hashes = []
    d128, d64 = "D=128 BK=128 BQ=64 WS", "D=64 BK=128 BQ=128"
    for _ in range(2):  # two processes: the order must not depend on the block schedule of either
        r = _run_child(_FUSED_DET_CHILD, "default", 300)
        assert _launched(r.stderr, _FUSED_TAG) == {d128, d128 + " CAP", d128 + " MASK", d64 + " WS",
                                                   d64 + " WS MASK", d64 + " CAP"}, r.stderr[-2000:]
        assert not _launched(r.stderr, _DKDV_TAG) and not _launched(r.stderr, _DQ_TAG), r.stderr[-2000:]
        hashes.append([ln for ln in r.stdout.splitlines() if ln.startswith("hash ")])
    assert len(hashes[0]) == 10 and hashes[0] == hashes[1], hashes
