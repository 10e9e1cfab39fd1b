"""Softmax cross-entropy on the GPU: the CUDA kernels (rlx_softmax_ce_fwd /
rlx_softmax_ce_bwd on platform CUDA) against the f32 reference on random data, with
invalid labels (ignored rows) mixed in. Skipped where JAX sees no GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import assert_close, gpu, requires_gpu
from rlx_jax.ops import softmax_cross_entropy, softmax_cross_entropy_backward
from rlx_jax.vjp_rules.cross_entropy import (
    ce_bwd,
    ce_fwd,
    reference_softmax_cross_entropy,
    reference_softmax_cross_entropy_bwd,
)

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


_gpu = gpu


def _inputs(n, c, dtype, seed):
    kx, kl, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    logits = (3.0 * jax.random.normal(kx, (n, c), jnp.float32)).astype(dtype)
    labels = jax.random.randint(kl, (n,), 0, max(c, 1), jnp.int32)
    if n >= 4:  # invalid labels: ignored rows (loss 0, zero gradient)
        labels = labels.at[1].set(-100).at[3].set(c)
    dloss = jax.random.normal(kd, (n,), jnp.float32).astype(dtype)
    return [jax.device_put(a, _gpu()) for a in (logits, labels, dloss)]


def _close(got, want, dtype, what, scale=None):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what, scale=scale, min_scale=1e-30)


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_softmax_ce_fwd_v1", "rlx_softmax_ce_bwd_v1"} <= set(info["targets"])
    logits, labels, _ = _inputs(8, 256, jnp.float32, 0)
    fn = jax.jit(lambda x, y: jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, y)))(x))
    text = fn.lower(logits, labels).as_text()
    assert "rlx_softmax_ce_fwd" in text and "rlx_softmax_ce_bwd" in text


SHAPES = [(1, 1), (37, 5), (64, 64), (33, 999), (257, 1024), (16, 8192), (9, 12288), (8, 32000), (4, 65536),
          (0, 100)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_f32_reference(shape, dtype):
    logits, labels, dloss = _inputs(*shape, dtype, seed=sum(shape) % 1000)
    loss, lse = jax.jit(ce_fwd)(logits, labels)
    loss_ref, lse_ref = jax.jit(reference_softmax_cross_entropy)(logits.astype(jnp.float32), labels)
    assert loss.dtype == dtype and lse.dtype == jnp.float32
    _close(lse, lse_ref, jnp.float32, "lse", scale=max(float(jnp.max(jnp.abs(lse_ref), initial=1.0)), 1.0))
    _close(loss, loss_ref, dtype, "loss", scale=max(float(jnp.max(jnp.abs(loss_ref), initial=1.0)), 1.0))
    if shape[0] >= 4:
        assert float(loss[1]) == 0.0 and float(loss[3]) == 0.0
    for recompute in (False, True):
        (dl,) = jax.jit(lambda *a: ce_bwd(*a, recompute_lse=recompute))(logits, labels, lse_ref, dloss)
        (dl_ref,) = jax.jit(reference_softmax_cross_entropy_bwd)(logits.astype(jnp.float32), labels, lse_ref,
                                                                  dloss.astype(jnp.float32))
        assert dl.dtype == dtype
        _close(dl, dl_ref, dtype, f"dlogits (recompute_lse={recompute})")
        if shape[0] >= 4:
            assert not np.any(np.asarray(dl[1], np.float32)) and not np.any(np.asarray(dl[3], np.float32))


def test_grad_and_rlx_backward_op():
    logits, labels, dloss = _inputs(48, 3000, jnp.float32, seed=6)
    got = jax.jit(lambda x, y: jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, y) * dloss))(x))(logits, labels)
    want = jax.grad(lambda x: jnp.sum(reference_softmax_cross_entropy(x, labels)[0] * dloss))(logits)
    _close(got, want, jnp.float32, "grad")
    got2 = jax.jit(softmax_cross_entropy_backward)(logits, labels, dloss)
    # row 3's label is V (out of range, not the ignore index): NaN row; row 1 (-100): zeros
    assert np.all(np.isnan(np.asarray(got2[3]))) and not np.any(np.asarray(got2[1]))
    keep = np.arange(48) != 3
    _close(got2[keep], want[keep], jnp.float32, "softmax_cross_entropy_backward")
    loss = np.asarray(jax.jit(softmax_cross_entropy)(logits, labels))
    assert loss[1] == 0 and np.isnan(loss[3])


def test_fused_linear_cross_entropy_on_gpu():
    """fused_linear_cross_entropy (XLA matmuls, row blocks) on the GPU, bf16 and f32,
    every reduction, against the unfused f32 reference. Matmuls at full f32 precision
    (JAX's default runs f32 dots in TF32 on the GPU, rounding the blocked and the unfused
    products differently)."""
    from rlx_jax.ops import fused_linear_cross_entropy
    with jax.default_matmul_precision("highest"):
        _check_fused_linear_on_gpu(fused_linear_cross_entropy)


def _check_fused_linear_on_gpu(fused_linear_cross_entropy):
    for dtype in (jnp.float32, jnp.bfloat16):
        kh, kw, kl = jax.random.split(jax.random.PRNGKey(3), 3)
        h = jax.device_put(jax.random.normal(kh, (300, 64), jnp.float32).astype(dtype), _gpu())
        w = jax.device_put((jax.random.normal(kw, (64, 5000), jnp.float32) / 8).astype(dtype), _gpu())
        y = jax.random.randint(kl, (300,), 0, 5000, jnp.int32).at[7].set(-100)
        hf, wf = h.astype(jnp.float32), w.astype(jnp.float32)
        ref = jnp.where(y == -100, 0.0, reference_softmax_cross_entropy(hf @ wf, jnp.where(y == -100, -1, y))[0])
        for red, want in (("none", ref), ("sum", jnp.sum(ref)), ("mean", jnp.sum(ref) / 299)):
            got = jax.jit(lambda h, w: fused_linear_cross_entropy(h, w, y, reduction=red, chunk_size=64))(h, w)
            _close(got, want, dtype, f"fused linear {red}", scale=max(float(jnp.max(jnp.abs(want))), 1.0))
        g = jax.jit(jax.grad(lambda h, w: fused_linear_cross_entropy(h, w, y, reduction="mean"), (0, 1)))(h, w)
        gw = jax.grad(lambda h, w: jnp.sum(jnp.where(y == -100, 0.0, reference_softmax_cross_entropy(
            h @ w, jnp.where(y == -100, -1, y))[0])) / 299, (0, 1))(hf, wf)
        for a, b, name in zip(g, gw, ("d hidden", "d weight")):
            _close(a, b, dtype, name, scale=max(float(jnp.max(jnp.abs(b))), 1e-6))


def _forward_row_kernel_and_kernels_off(loss, h, w):
    """(value and gradients of ``loss`` jitted, the same with every kernel off), after checking
    that the compiled step calls the forward row kernel and not the backward one."""
    from rlx_jax.vjp_rules._primitive import fused_ops

    vg = jax.jit(jax.value_and_grad(loss, (0, 1)))
    text = vg.lower(h, w).compile().as_text()
    assert "rlx_softmax_ce_fwd" in text and "rlx_softmax_ce_bwd" not in text
    with fused_ops(False):
        want = jax.jit(jax.value_and_grad(loss, (0, 1)))(h, w)
    return vg(h, w), want


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_blocks_use_the_forward_row_kernel(reduction):
    """On CUDA each row block's (loss, lse) comes from the forward row kernel (one read of
    the f32 logits block) and its logit gradient from XLA's fusion: the compiled step
    calls rlx_softmax_ce_fwd and not rlx_softmax_ce_bwd, and gives the loss and gradients
    of the same op with every kernel off (f32, full-precision matmuls, 3 row blocks with a
    ragged last one)."""
    from rlx_jax.ops import fused_linear_cross_entropy

    kh, kw, kl = jax.random.split(jax.random.PRNGKey(11), 3)
    h = jax.device_put(jax.random.normal(kh, (150, 48), jnp.float32), _gpu())
    w = jax.device_put(jax.random.normal(kw, (48, 3001), jnp.float32) / 7, _gpu())
    y = jax.random.randint(kl, (150,), 0, 3001, jnp.int32).at[5].set(-100)

    def loss(h, w):
        out = fused_linear_cross_entropy(h, w, y, reduction=reduction, chunk_size=64)
        return jnp.sum(out * jnp.linspace(0.5, 1.5, out.size).reshape(out.shape))

    with jax.default_matmul_precision("highest"):
        got, want = _forward_row_kernel_and_kernels_off(loss, h, w)
    for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("loss", "d hidden", "d weight")):
        _close(a, b, jnp.float32, name, scale=max(float(jnp.max(jnp.abs(b))), 1e-6))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_bf16_logits_blocks(reduction):
    """logits_dtype=bf16 on bf16 inputs (the blocks' matmuls write bf16 logits): the forward
    row kernel reads them (rlx_softmax_ce_fwd in the compiled step); loss and gradients are
    within bf16 tolerance of the same op with every kernel off (the same rounded logits) and
    of the f32 oracle."""
    from rlx_jax.ops import fused_linear_cross_entropy

    kh, kw, kl = jax.random.split(jax.random.PRNGKey(12), 3)
    h = jax.device_put(jax.random.normal(kh, (150, 64), jnp.float32).astype(jnp.bfloat16), _gpu())
    w = jax.device_put((jax.random.normal(kw, (64, 3001), jnp.float32) / 4).astype(jnp.bfloat16), _gpu())
    y = jax.random.randint(kl, (150,), 0, 3001, jnp.int32).at[5].set(-100)
    wt = jnp.linspace(0.5, 1.5, 150)

    def loss(h, w):
        out = fused_linear_cross_entropy(h, w, y, reduction=reduction, chunk_size=64, logits_dtype=jnp.bfloat16)
        return jnp.sum(out.astype(jnp.float32) * (wt if reduction == "none" else 1.0))

    got, same = _forward_row_kernel_and_kernels_off(loss, h, w)
    hf, wf = h.astype(jnp.float32), w.astype(jnp.float32)

    def oracle(h, w):
        z = jnp.dot(h, w, precision="highest")
        rows = jnp.where(y == -100, 0.0, reference_softmax_cross_entropy(z, jnp.where(y == -100, -1, y))[0])
        return jnp.sum(rows * wt) if reduction == "none" else jnp.sum(rows) / 149

    want = jax.value_and_grad(oracle, (0, 1))(hf, wf)
    for a, b, c, name in zip(jax.tree.leaves(got), jax.tree.leaves(same), jax.tree.leaves(want),
                             ("loss", "d hidden", "d weight")):
        scale = max(float(jnp.max(jnp.abs(c))), 1e-6)
        _close(a, b, jnp.bfloat16, name + " vs kernels off", scale=scale)
        _close(a, c, jnp.bfloat16, name + " vs f32 oracle", scale=scale)


def test_extreme_logits():
    logits = jnp.array([[1e30, 0.0, -1e30, 5.0], [-jnp.inf, 0.0, 1.0, -jnp.inf], [88.0, 89.0, 90.0, -100.0]],
                       jnp.float32)
    labels = jnp.array([0, 2, 1], jnp.int32)
    loss, lse = jax.jit(ce_fwd)(jax.device_put(logits, _gpu()), labels)
    loss_ref, lse_ref = reference_softmax_cross_entropy(logits, labels)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_ref), rtol=1e-5, atol=1e-6)


def test_bad_labels_dtype_is_an_error_not_a_crash():
    logits, _, _ = _inputs(4, 64, jnp.float32, seed=1)
    out = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))
    call = jax.ffi.ffi_call("rlx_softmax_ce_fwd_v1", out)
    with pytest.raises(Exception, match="int32"):
        jax.block_until_ready(jax.jit(call)(logits, jnp.zeros((4,), jnp.float32)))
