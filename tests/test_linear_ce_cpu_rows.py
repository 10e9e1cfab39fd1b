"""fused_linear_cross_entropy on the CPU: each row block's softmax runs through the
softmax cross-entropy row kernels (the reduced pass through the one-pass loss-and-gradient
kernel, the "none" forward through the forward kernel); same loss
and gradients as the XLA block (kernels off) and as the unfused logits + cross-entropy
in f64."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx_jax.ops import fused_linear_cross_entropy
from rlx_jax.vjp_rules._primitive import fused_ops

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU lowering")


def _inputs(n, d, v, seed):
    kh, kw, kl = jax.random.split(jax.random.PRNGKey(seed), 3)
    h = jax.random.normal(kh, (n, d), jnp.float32)
    w = jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)
    labels = jax.random.randint(kl, (n,), 0, v, jnp.int32)
    return h, w, labels.at[::5].set(-100)  # every fifth row ignored


def _unfused_f64(h, w, labels, reduction):
    """loss and (d h, d w) of logits h @ w and softmax cross-entropy, in NumPy f64."""
    h, w, labels = np.asarray(h, np.float64), np.asarray(w, np.float64), np.asarray(labels)
    z = h @ w
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    ok = (labels >= 0) & (labels < w.shape[1])
    idx = np.where(ok, labels, 0)
    rows = np.where(ok, lse - z[np.arange(len(z)), idx], 0)
    scale = 1 / max(ok.sum(), 1) if reduction == "mean" else 1.0
    g = (np.exp(z - lse[:, None]) - np.eye(w.shape[1])[idx]) * (ok * scale)[:, None]
    return rows.sum() * scale, g @ w.T, h.T @ g


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n, d, v, chunk", [(37, 9, 53, 8), (64, 16, 300, 64), (5, 3, 7, None)])
def test_reduced_rows_kernels_match(reduction, n, d, v, chunk):
    h, w, labels = _inputs(n, d, v, seed=n + v)
    f = lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction=reduction, chunk_size=chunk)
    vg = jax.jit(jax.value_and_grad(f, (0, 1)))
    text = vg.lower(h, w).compile().as_text()
    assert "rlx_softmax_ce_loss_grad" in text and "rlx_softmax_ce_bwd" not in text
    loss, (dh, dw) = vg(h, w)
    with fused_ops(False):
        xla = jax.jit(jax.value_and_grad(f, (0, 1)))
        assert "rlx_softmax_ce" not in xla.lower(h, w).compile().as_text()
        loss_x, (dh_x, dw_x) = xla(h, w)
    want_loss, want_dh, want_dw = _unfused_f64(h, w, labels, reduction)
    for got, ref, want in ((loss, loss_x, want_loss), (dh, dh_x, want_dh), (dw, dw_x, want_dw)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5)


def test_reduced_rows_kernels_zero_rows_and_all_ignored():
    """No rows: loss 0 and empty d hidden; every row ignored: mean 0, zero gradients."""
    h, w, _ = _inputs(4, 6, 11, seed=1)
    f = jax.jit(jax.value_and_grad(lambda h, w, l: fused_linear_cross_entropy(h, w, l, reduction="mean"), (0, 1)))
    loss, (dh, dw) = f(h[:0], w, jnp.zeros((0,), jnp.int32))
    assert float(loss) == 0.0 and dh.shape == (0, 6) and not np.any(np.asarray(dw))
    loss, (dh, dw) = f(h, w, jnp.full((4,), -100, jnp.int32))
    assert float(loss) == 0.0 and not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


def test_reduced_rows_kernels_under_vmap_and_scan():
    """A batch of heads under vmap, and the loss inside lax.scan (the kernel inside a
    while loop body), against the per-example loop."""
    h, w, labels = _inputs(24, 8, 40, seed=3)
    f = lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=16)
    ws = jnp.stack([w, 2 * w, -w])
    got = jax.jit(jax.vmap(jax.grad(f, 1), (None, 0)))(h, ws)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), _unfused_f64(h, ws[i], labels, "sum")[2], rtol=1e-4, atol=1e-5)
    _, total = jax.lax.scan(lambda c, wi: (c, jax.grad(f, 1)(h, wi)), 0.0, ws)
    np.testing.assert_allclose(np.asarray(total), np.asarray(got), rtol=2e-5, atol=2e-6)


def test_none_forward_rows_kernel_matches():
    """reduction="none": the forward's (loss, lse) from the row kernel; the per-row
    losses and their gradient under a non-uniform cotangent (the backward recomputes
    from that lse) against the f64 oracle and the XLA block."""
    h, w, labels = _inputs(29, 7, 41, seed=5)
    weights = jnp.linspace(0.5, 2.0, 29)
    f = lambda h, w: jnp.sum(weights * fused_linear_cross_entropy(h, w, labels, chunk_size=8))
    rows = jax.jit(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=8))
    assert "rlx_softmax_ce_fwd" in rows.lower(h, w).compile().as_text()
    got_rows, (dh, dw) = rows(h, w), jax.jit(jax.grad(f, (0, 1)))(h, w)
    with fused_ops(False):
        xla_rows, (dh_x, dw_x) = rows(h, w), jax.jit(jax.grad(f, (0, 1)))(h, w)
    np.testing.assert_allclose(np.asarray(got_rows), np.asarray(xla_rows), rtol=2e-5, atol=2e-6)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    ok = np.asarray(labels) >= 0
    want = np.where(ok, lse - z[np.arange(29), np.where(ok, labels, 0)], 0)
    np.testing.assert_allclose(np.asarray(got_rows, np.float64), want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got_rows)[::5] == 0)
    for got, ref in ((dh, dh_x), (dw, dw_x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_weight_gradient_product_takes_transposed_blocks(reduction):
    """f32 on the CPU: the d weight product takes hidden's blocks transposed beforehand, so
    every product of the compiled loss + gradients contracts its left operand's last axis
    (the layout XLA:CPU runs through its XNNPACK path, not its generic dot), in the reduced
    pass and in the "none" backward; the values are those of the tests above."""
    h, w, labels = _inputs(64, 16, 300, seed=9)
    f = lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, reduction=reduction, chunk_size=16))
    text = jax.jit(jax.value_and_grad(f, (0, 1))).lower(h, w).compile().as_text()
    dims = re.findall(r" dot\(.*?lhs_contracting_dims=\{(\d+)\}", text)
    assert len(dims) >= 3 and set(dims) == {"1"}, dims
