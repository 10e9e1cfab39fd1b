"""Softmax cross-entropy and fused linear cross-entropy: kernels vs references,
ignored labels, gradients in every mode, vmap, memory, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import fused_linear_cross_entropy, softmax_cross_entropy, softmax_cross_entropy_backward
from testutil import assert_close, hlo_text, platform

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [(4, 7), (3, 1025), (1, 1), (0, 5)]


def _inputs(n, c, dtype=jnp.float32, seed=0):
    kx, kl = jax.random.split(jax.random.PRNGKey(seed))
    logits = (3.0 * jax.random.normal(kx, (n, c), jnp.float32)).astype(dtype)
    labels = jax.random.randint(kl, (n,), 0, c, jnp.int32)
    return logits, labels


def _oracle(logits, labels):
    """Plain JAX in f32: logsumexp - picked, 0 for labels outside [0, C)."""
    lf = logits.astype(jnp.float32)
    ok = (labels >= 0) & (labels < lf.shape[1])
    picked = jnp.take_along_axis(lf, jnp.where(ok, labels, 0)[:, None], axis=1)[:, 0]
    return jnp.where(ok, jax.nn.logsumexp(lf, axis=1) - picked, 0.0)


def test_kernels_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_softmax_ce_fwd", "rlx_softmax_ce_bwd"} <= set(info["targets"])
    logits, labels = _inputs(4, 9)
    text = hlo_text(jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels))), logits)
    assert "rlx_softmax_ce_fwd" in text and "rlx_softmax_ce_bwd" in text
    assert "rlx_softmax_ce_bwd" in hlo_text(softmax_cross_entropy_backward, logits, labels, jnp.ones(4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_match_oracle(shape, dtype):
    logits, labels = _inputs(*shape, dtype=dtype)
    dloss = jax.random.normal(jax.random.PRNGKey(5), (shape[0],), jnp.float32).astype(dtype)
    loss = jax.jit(softmax_cross_entropy)(logits, labels)
    assert loss.dtype == dtype and loss.shape == (shape[0],)
    assert_close(loss, _oracle(logits, labels), dtype)
    want = jax.grad(lambda x: jnp.sum(_oracle(x, labels) * dloss.astype(jnp.float32)))(logits.astype(jnp.float32))
    got = jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels).astype(jnp.float32) * dloss))(logits)
    assert got.dtype == dtype
    assert_close(got, want, dtype)
    assert_close(jax.jit(softmax_cross_entropy_backward)(logits, labels, dloss), want, dtype)


def test_invalid_labels_are_ignored_and_never_read():
    logits, _ = _inputs(6, 5)
    labels = jnp.array([0, -100, 5, 2**30, -1, 4], jnp.int32)
    loss = softmax_cross_entropy(logits, labels)
    assert_close(loss, _oracle(logits, labels))
    assert np.all(np.asarray(loss)[[1, 2, 3, 4]] == 0)
    g = np.asarray(jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels)))(logits))
    assert np.all(g[[1, 2, 3, 4]] == 0) and np.all(np.isfinite(g))
    assert_close(g[[0, 5]].sum(axis=1), np.zeros(2))  # softmax - onehot sums to 0
    gb = np.asarray(softmax_cross_entropy_backward(logits, labels, jnp.ones(6)))
    assert_close(gb, g)


def test_float_labels_holding_integers():
    logits, labels = _inputs(5, 8)
    assert_close(softmax_cross_entropy(logits, labels.astype(jnp.float32)), softmax_cross_entropy(logits, labels))
    g = jax.grad(lambda x, l: jnp.sum(softmax_cross_entropy(x, l)), (0, 1))(logits, labels.astype(jnp.float32))
    assert_close(g[1], jnp.zeros(5))  # no gradient into labels


def test_check_grads_f64(x64):
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, 6), jnp.float64)
    labels = jnp.array([0, 5, -1, 2], jnp.int32)
    assert "rlx_softmax_ce_bwd" in hlo_text(jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels))), logits)
    check_grads(lambda x: softmax_cross_entropy(x, labels), (logits,), order=2, modes=("fwd", "rev"))
    d = jax.random.normal(jax.random.PRNGKey(2), (4,), jnp.float64)
    check_grads(lambda x, d: softmax_cross_entropy_backward(x, labels, d), (logits, d), order=2, modes=("fwd", "rev"))


def test_vmap():
    logits, labels = _inputs(6, 11)
    lb, yb = jnp.stack([logits, -logits]), jnp.stack([labels, labels[::-1]])
    assert_close(jax.vmap(softmax_cross_entropy)(lb, yb), jnp.stack([_oracle(logits, labels), _oracle(-logits, labels[::-1])]))
    g = jax.vmap(jax.grad(lambda x, y: jnp.sum(softmax_cross_entropy(x, y))))(lb, yb)
    gr = jax.vmap(jax.grad(lambda x, y: jnp.sum(_oracle(x, y))))(lb, yb)
    assert_close(g, gr)
    assert_close(jax.vmap(softmax_cross_entropy, in_axes=(0, None))(lb, labels)[1], _oracle(-logits, labels))


def test_errors():
    logits, labels = _inputs(3, 4)
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        softmax_cross_entropy(logits[0], labels[0])
    with pytest.raises(ValueError, match="labels must have shape"):
        softmax_cross_entropy(logits, labels[:2])
    with pytest.raises(TypeError, match="labels must be integers"):
        softmax_cross_entropy(logits, labels.astype(jnp.complex64))
    with pytest.raises(TypeError, match="floating"):
        softmax_cross_entropy(labels[:, None], labels)
    with pytest.raises(ValueError, match="at least one class"):
        softmax_cross_entropy(jnp.zeros((3, 0)), labels)
    with pytest.raises(ValueError, match="dloss"):
        softmax_cross_entropy_backward(logits, labels, jnp.ones(4))


# ---- fused linear + cross-entropy --------------------------------------------------------


def _linear_inputs(n, d, v, seed=0, dtype=jnp.float32):
    kh, kw, kl = jax.random.split(jax.random.PRNGKey(seed), 3)
    h = jax.random.normal(kh, (n, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)).astype(dtype)
    labels = jax.random.randint(kl, (n,), 0, v, jnp.int32)
    return h, w, labels


@pytest.mark.parametrize("chunk", [5, 64])
def test_fused_linear_matches_unfused(chunk):
    h, w, labels = _linear_inputs(9, 8, 23)
    labels = labels.at[3].set(-100)
    dloss = jax.random.normal(jax.random.PRNGKey(9), (9,))
    fused = lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, chunk_size=chunk) * dloss)
    plain = lambda h, w: jnp.sum(_oracle(h @ w, labels) * dloss)
    assert_close(fused_linear_cross_entropy(h, w, labels, chunk_size=chunk), _oracle(h @ w, labels))
    for got, want in zip(jax.grad(fused, (0, 1))(h, w), jax.grad(plain, (0, 1))(h, w)):
        assert_close(got, want)


def test_fused_linear_bf16():
    h, w, labels = _linear_inputs(8, 16, 40, dtype=jnp.bfloat16)
    got = fused_linear_cross_entropy(h, w, labels, chunk_size=16)
    assert got.dtype == jnp.bfloat16
    assert_close(got, _oracle(h.astype(jnp.float32) @ w.astype(jnp.float32), labels), jnp.bfloat16)


def test_fused_linear_check_grads_f64(x64):
    h, w, labels = _linear_inputs(4, 3, 7, dtype=jnp.float64)
    labels = labels.at[1].set(7)
    check_grads(
        lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=3), (h, w), order=2, modes=("fwd", "rev")
    )


def test_fused_linear_never_materialises_logits():
    """Compiled temp memory of value-and-grad: the fused version's scratch is about
    [N, chunk], the unfused one's is several [N, V] buffers."""
    n, d, v, chunk = 256, 32, 8192, 512
    h, w, labels = _linear_inputs(n, d, v)
    fused = jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, chunk_size=chunk)), (0, 1)))
    plain = jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(softmax_cross_entropy(h @ w, labels)), (0, 1)))
    mf = fused.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    mp = plain.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = n * v * 4
    assert mp >= logits_bytes
    assert mf < logits_bytes / 2, (mf, mp)


def test_fused_linear_errors():
    h, w, labels = _linear_inputs(3, 4, 5)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(h, w, labels, chunk_size=0)
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_linear_cross_entropy(h, w.T, labels, chunk_size=2)
    with pytest.raises(ValueError, match="labels must have shape"):
        fused_linear_cross_entropy(h, w, labels[:1], chunk_size=2)
