"""Softmax cross-entropy on the GPU: the CUDA kernels (rlx_softmax_ce_fwd /
rlx_softmax_ce_bwd / rlx_softmax_ce_loss_grad on platform CUDA) against the f32 reference
on random data, with invalid labels (ignored rows) mixed in. Skipped where JAX sees no
GPU."""

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
    ce_loss_grad,
    reference_loss_grad,
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
    assert {"rlx_softmax_ce_fwd_v1", "rlx_softmax_ce_bwd_v1", "rlx_softmax_ce_loss_grad_v1"} <= set(info["targets"])
    logits, labels, _ = _inputs(8, 256, jnp.float32, 0)
    fn = jax.jit(lambda x, y: jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, y)))(x))
    text = fn.lower(logits, labels).as_text()
    assert "rlx_softmax_ce_fwd" in text and "rlx_softmax_ce_bwd" in text


# On sm_90, (300, 16384) and (531, 32000) (loss_grad below) take the staged kernel with
# several rows a block, so its stages are refilled; (4, 65536) and (150, 128256) are too wide
# for it and take the row-group kernel.
SHAPES = [(1, 1), (37, 5), (64, 64), (33, 999), (257, 1024), (16, 8192), (9, 12288), (8, 32000), (4, 65536),
          (300, 16384), (0, 100)]


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


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_fused_linear_f32_inputs_with_bf16_logits(reduction):
    """f32 inputs with bf16 logits in 4-row blocks against NumPy on the bf16-rounded
    logits. The block that the "none" backward recomputes must be rounded as the
    forward's: XLA on a GPU drops a narrowing cast that a widening one follows (rounded by
    the cast alone, the gradients here were about 1 % off). Dyadic
    inputs (h in steps of 1/8, w of 1/64) make every logit exact in f32, so each rounds to
    bf16 the same way on every path."""
    from rlx_jax.ops import fused_linear_cross_entropy
    rng = np.random.default_rng(5)
    h = np.round(rng.normal(size=(11, 8)) * 32) / 8
    w = np.round(rng.normal(size=(8, 37)) * 22) / 64
    labels = rng.integers(0, 37, 11).astype(np.int32)
    labels[2] = -100
    keep = labels != -100
    wt = np.cos(np.arange(11)) if reduction == "none" else np.full(11, 1 / keep.sum())
    # NumPy: loss = sum over kept rows r of wt_r (lse_r - z_r[label_r]), z rounded to bf16;
    # g = wt_r (softmax(z_r) - onehot), d hidden = g w^T, d weight = h^T g
    z = np.asarray(jnp.asarray(h @ w, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    top = z.max(axis=1)
    lse = np.log(np.sum(np.exp(z - top[:, None]), axis=1)) + top
    rows = np.arange(11)
    want_loss = np.sum(np.where(keep, wt * (lse - z[rows, np.where(keep, labels, 0)]), 0))
    g = np.exp(z - lse[:, None])
    g[rows[keep], labels[keep]] -= 1
    g *= np.where(keep, wt, 0)[:, None]

    def loss(h, w):
        out = fused_linear_cross_entropy(h, w, jnp.asarray(labels), reduction=reduction, chunk_size=4,
                                         logits_dtype=jnp.bfloat16)
        return jnp.sum(out * jnp.asarray(wt, jnp.float32)) if reduction == "none" else out

    hg, wg = (jax.device_put(jnp.asarray(a, jnp.float32), _gpu()) for a in (h, w))
    with jax.default_matmul_precision("highest"):  # f32 products, not TF32, in the gradients
        got = jax.jit(jax.value_and_grad(loss, (0, 1)))(hg, wg)
    for a, b, name in zip(jax.tree.leaves(got), (want_loss, g @ w.T, h.T @ g), ("loss", "d hidden", "d weight")):
        _close(a, b, jnp.float32, name, scale=max(float(np.max(np.abs(b))), 1.0))


# (logits dtype, dlogits dtype) pairs of the one-pass block kernel
LOSS_GRAD_DTYPES = [(jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.bfloat16),
                    (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float16), (jnp.float32, jnp.float16)]


@pytest.mark.parametrize("dtype, grad_dtype", LOSS_GRAD_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 1), (37, 5), (33, 999), (257, 1024), (8, 32000), (531, 32000), (700, 8200),
                                   (3, 128256), (150, 128256), (0, 100)],
                         ids=lambda s: "x".join(map(str, s)))
def test_loss_grad_kernel_matches_reference(dtype, grad_dtype, shape):
    """rlx_softmax_ce_loss_grad (the fused linear cross-entropy's block: loss, lse and
    (softmax - onehot) * scale from one read of the logits) against the reference in f32 on
    the same logits: the scalar path (odd widths), the 16-byte path, rows of several chunks
    walked back from L2 (V 32000, 128256), and rows with bad labels (zero gradient)."""
    n, c = shape
    logits, labels, _ = _inputs(n, c, dtype, seed=n + c)
    scale = jax.device_put(jnp.linspace(0.25, 2.0, n, dtype=jnp.float32), _gpu())
    call = jax.jit(lambda z, y, s: ce_loss_grad(z, y, s, grad_dtype=np.dtype(grad_dtype)))
    if n:  # (XLA folds a call on no rows away)
        assert "rlx_softmax_ce_loss_grad" in call.lower(logits, labels, scale).compile().as_text()
    loss, lse, g = call(logits, labels, scale)
    want = reference_loss_grad(logits.astype(jnp.float32), labels, scale, grad_dtype=np.dtype(jnp.float32))
    assert (loss.dtype, lse.dtype, g.dtype) == (jnp.float32, jnp.float32, grad_dtype)
    _close(lse, want[1], jnp.float32, "lse", scale=max(float(jnp.max(jnp.abs(want[1]), initial=0)), 1.0))
    _close(loss, want[0], jnp.float32, "loss", scale=max(float(jnp.max(jnp.abs(want[0]), initial=0)), 1.0))
    _close(g, want[2], grad_dtype, "dlogits", scale=max(float(jnp.max(jnp.abs(want[2]), initial=0)), 1e-6))
    if n >= 4:
        assert not np.any(np.asarray(g.astype(jnp.float32))[[1, 3]]), "ignored rows: zero gradient"


def _row_kernels_and_kernels_off(loss, h, w, reduction):
    """(value and gradients of ``loss`` jitted, the same with every kernel off), after checking
    the row kernels the compiled step calls: the one-pass loss-and-gradient kernel for a
    reduced loss, the forward kernel for "none"; never the backward kernel."""
    from rlx_jax.vjp_rules._primitive import fused_ops

    vg = jax.jit(jax.value_and_grad(loss, (0, 1)))
    text = vg.lower(h, w).compile().as_text()
    want_kernel = "rlx_softmax_ce_fwd" if reduction == "none" else "rlx_softmax_ce_loss_grad"
    assert want_kernel in text and "rlx_softmax_ce_bwd" not in text
    with fused_ops(False):
        want = jax.jit(jax.value_and_grad(loss, (0, 1)))(h, w)
    return vg(h, w), want


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_blocks_use_the_row_kernels(reduction):
    """On CUDA a reduced loss takes each row block's loss and logit gradient from the
    one-pass kernel (the f32 logits block read once, the gradient written in hidden's
    dtype) and "none" its (loss, lse) from the forward kernel; loss and gradients as the
    same op with every kernel off (f32, full-precision matmuls, 3 row blocks with a ragged
    last one)."""
    from rlx_jax.ops import fused_linear_cross_entropy

    kh, kw, kl = jax.random.split(jax.random.PRNGKey(11), 3)
    h = jax.device_put(jax.random.normal(kh, (150, 48), jnp.float32), _gpu())
    w = jax.device_put(jax.random.normal(kw, (48, 3001), jnp.float32) / 7, _gpu())
    y = jax.random.randint(kl, (150,), 0, 3001, jnp.int32).at[5].set(-100)

    def loss(h, w):
        out = fused_linear_cross_entropy(h, w, y, reduction=reduction, chunk_size=64)
        return jnp.sum(out * jnp.linspace(0.5, 1.5, out.size).reshape(out.shape))

    with jax.default_matmul_precision("highest"):
        got, want = _row_kernels_and_kernels_off(loss, h, w, reduction)
    for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("loss", "d hidden", "d weight")):
        _close(a, b, jnp.float32, name, scale=max(float(jnp.max(jnp.abs(b))), 1e-6))


@pytest.mark.parametrize("logits_dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_bf16_model_blocks(reduction, logits_dtype):
    """bf16 inputs with bf16 logits blocks (the matmuls write bf16 logits) and with f32 ones
    (the block kernel reads f32 and writes the bf16 gradient): the row kernels of
    _row_kernels_and_kernels_off; loss and gradients within bf16 tolerance of the same op
    with every kernel off (the same rounded logits) and of the f32 oracle."""
    from rlx_jax.ops import fused_linear_cross_entropy

    kh, kw, kl = jax.random.split(jax.random.PRNGKey(12), 3)
    h = jax.device_put(jax.random.normal(kh, (150, 64), jnp.float32).astype(jnp.bfloat16), _gpu())
    w = jax.device_put((jax.random.normal(kw, (64, 3001), jnp.float32) / 4).astype(jnp.bfloat16), _gpu())
    y = jax.random.randint(kl, (150,), 0, 3001, jnp.int32).at[5].set(-100)
    wt = jnp.linspace(0.5, 1.5, 150)

    def loss(h, w):
        out = fused_linear_cross_entropy(h, w, y, reduction=reduction, chunk_size=64, logits_dtype=logits_dtype)
        return jnp.sum(out.astype(jnp.float32) * (wt if reduction == "none" else 1.0))

    got, same = _row_kernels_and_kernels_off(loss, h, w, reduction)
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


def test_fused_linear_bf16_logits_halve_the_block():
    """On the GPU bf16 logits blocks (written by the matmul) take half the f32 block's
    memory: the compiled loss + gradients need at least a fifth of an f32 block less temp
    memory, on a shape whose [chunk, V] blocks are the largest intermediates (compiled only)."""
    from rlx_jax.ops import fused_linear_cross_entropy

    n, d, v, chunk = 4096, 64, 32000, 2048
    kh, kw, kl = jax.random.split(jax.random.PRNGKey(13), 3)
    h = jax.device_put(jax.random.normal(kh, (n, d), jnp.float32).astype(jnp.bfloat16), _gpu())
    w = jax.device_put((jax.random.normal(kw, (d, v), jnp.float32) / 8).astype(jnp.bfloat16), _gpu())
    y = jax.random.randint(kl, (n,), 0, v, jnp.int32)

    def temp(dtype):
        f = jax.jit(jax.value_and_grad(lambda h, w: fused_linear_cross_entropy(
            h, w, y, reduction="mean", chunk_size=chunk, logits_dtype=dtype).astype(jnp.float32), (0, 1)))
        return f.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    wide, narrow = temp(None), temp(jnp.bfloat16)
    assert narrow <= wide - chunk * v * 4 // 5, (narrow, wide)


def test_block_gradient_takes_the_logits_buffer():
    """On CUDA the block kernel writes its gradient over the logits where the dtypes agree:
    the compiled loss_grad call aliases its dlogits output to the logits operand (where the
    logits are a parameter XLA copies them first), and the fused linear head's loss +
    gradients hold one bf16 [chunk, V] block, not two (compiled temp memory under 1.5 blocks;
    the [D, V] and [N, D] f32 accumulators are a small part here)."""
    from rlx_jax.ops import fused_linear_cross_entropy

    logits, labels, _ = _inputs(64, 4096, jnp.bfloat16, seed=3)
    scale = jax.device_put(jnp.ones((64,), jnp.float32), _gpu())
    hlo = jax.jit(lambda z, y, s: ce_loss_grad(z, y, s, grad_dtype=np.dtype(jnp.bfloat16))).lower(
        logits, labels, scale).compile().as_text()
    calls = [line for line in hlo.splitlines() if "rlx_softmax_ce_loss_grad" in line and "custom-call" in line]
    assert calls and all("output_to_operand_aliasing" in line for line in calls), calls

    n, d, v, chunk = 4096, 64, 32000, 2048
    kh, kw, kl = jax.random.split(jax.random.PRNGKey(14), 3)
    h = jax.device_put(jax.random.normal(kh, (n, d), jnp.float32).astype(jnp.bfloat16), _gpu())
    w = jax.device_put((jax.random.normal(kw, (d, v), jnp.float32) / 8).astype(jnp.bfloat16), _gpu())
    y = jax.random.randint(kl, (n,), 0, v, jnp.int32)
    f = jax.jit(jax.value_and_grad(lambda h, w: fused_linear_cross_entropy(
        h, w, y, reduction="mean", chunk_size=chunk, logits_dtype=jnp.bfloat16).astype(jnp.float32), (0, 1)))
    temp = f.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    block = chunk * v * 2
    assert temp < 1.5 * block, (temp, block)


def test_extreme_logits():
    logits = jnp.array([[1e30, 0.0, -1e30, 5.0], [-jnp.inf, 0.0, 1.0, -jnp.inf], [88.0, 89.0, 90.0, -100.0]],
                       jnp.float32)
    labels = jnp.array([0, 2, 1], jnp.int32)
    loss, lse = jax.jit(ce_fwd)(jax.device_put(logits, _gpu()), labels)
    loss_ref, lse_ref = reference_softmax_cross_entropy(logits, labels)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("c", [16384, 40000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_loss_grad_extreme_rows_in_wide_blocks(dtype, c):
    """400 rows of 16384 columns (on sm_90 the staged kernel, several rows a block) or 40000
    (bf16: too wide for it, the row-group kernel) holding -inf entries, one huge logit, a row
    of all -inf but its label, and constant rows: lse, loss and gradient as the f32 reference,
    finite wherever the reference is."""
    n = 400
    logits, labels, _ = _inputs(n, c, jnp.float32, seed=7)
    logits = logits.at[5, ::3].set(-jnp.inf).at[6, 100].set(1e4).at[7, :].set(0.0)
    logits = logits.at[8, :].set(-jnp.inf).at[8, labels[8]].set(2.0).at[9, :].set(-50.0)
    logits = logits.astype(dtype)
    scale = jax.device_put(jnp.linspace(-1.0, 1.5, n, dtype=jnp.float32), _gpu())
    loss, lse, g = jax.jit(lambda z, y, s: ce_loss_grad(z, y, s, grad_dtype=np.dtype(jnp.float32)))(logits, labels,
                                                                                                   scale)
    want = reference_loss_grad(logits.astype(jnp.float32), labels, scale, grad_dtype=np.dtype(jnp.float32))
    for got, ref, what in zip((loss, lse, g), want, ("loss", "lse", "dlogits")):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert np.array_equal(np.isfinite(got), np.isfinite(ref)), what
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-5 * max(1.0, float(np.max(np.abs(ref[fin])))),
                                   err_msg=what)
    assert float(loss[8]) == pytest.approx(0.0, abs=1e-6) and float(lse[7]) == pytest.approx(np.log(c), rel=1e-5)


def test_bad_labels_dtype_is_an_error_not_a_crash():
    logits, _, _ = _inputs(4, 64, jnp.float32, seed=1)
    out = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))
    call = jax.ffi.ffi_call("rlx_softmax_ce_fwd_v1", out)
    with pytest.raises(Exception, match="int32"):
        jax.block_until_ready(jax.jit(call)(logits, jnp.zeros((4,), jnp.float32)))
