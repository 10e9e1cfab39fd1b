"""Softmax cross-entropy and fused linear cross-entropy: kernels vs references,
ignored labels, gradients in every mode, vmap, memory, errors; on the CPU, the
gradient without the forward kernel, both lse paths of the backward kernel, and the
same bits from the AVX2 and AVX-512 row bodies and from one or several threads."""

from __future__ import annotations

import hashlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import fused_linear_cross_entropy, softmax_cross_entropy, softmax_cross_entropy_backward
from rlx_jax.vjp_rules import cross_entropy as ce_rules
from testutil import assert_close, hlo_text, platform, assert_same_bits_on_one_core_without_avx512

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# widths around the kernels' 16-element blocks: tail only, one whole block, blocks + tail
SHAPES = [(4, 7), (2, 16), (3, 1025), (5, 4099), (1, 1), (0, 5)]


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
    assert {"rlx_softmax_ce_fwd_v1", "rlx_softmax_ce_bwd_v1"} <= set(info["targets"])
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


# ---- CPU kernel paths -------------------------------------------------------------------

cpu_only = pytest.mark.skipif(platform() != "cpu", reason="the CPU kernels' lowering")


def _compiled_targets(fn, *args):
    return sorted(re.findall(r'custom_call_target="([^"]+)"', jax.jit(fn).lower(*args).compile().as_text()))


@cpu_only
def test_cpu_gradient_needs_no_forward_kernel():
    """The CPU backward recomputes lse from each row, so when nothing reads the loss
    the compiled gradient holds the backward kernel alone (one read of the logits);
    value_and_grad keeps both kernels."""
    logits, labels = _inputs(8, 37)
    loss = lambda x: jnp.sum(softmax_cross_entropy(x, labels))
    assert _compiled_targets(jax.grad(loss), logits) == ["rlx_softmax_ce_bwd_v1"]
    assert _compiled_targets(jax.value_and_grad(loss), logits) == ["rlx_softmax_ce_bwd_v1", "rlx_softmax_ce_fwd_v1"]


def _bwd_both_paths(dtype):
    """The backward kernel called directly with a saved lse and with recompute_lse (lse
    operand then ignored: garbage is passed), against the reference."""
    logits, labels = _inputs(5, 1043, dtype=dtype, seed=3)
    labels = labels.at[2].set(-100)
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    dloss = jax.random.normal(jax.random.PRNGKey(4), (5,), acc).astype(dtype)
    lf = logits.astype(acc)
    _, lse = ce_rules.reference_softmax_cross_entropy(lf, labels)
    (want,) = ce_rules.reference_softmax_cross_entropy_bwd(lf, labels, lse, dloss.astype(acc))
    for recompute, lse_arg in ((False, lse), (True, jnp.full_like(lse, 123.0))):
        call = jax.jit(lambda *a: ce_rules._kernel_bwd(*a, recompute_lse=recompute))
        assert "rlx_softmax_ce_bwd" in call.lower(logits, labels, lse_arg, dloss).as_text()
        (got,) = call(logits, labels, lse_arg, dloss)
        assert got.dtype == dtype
        assert_close(got, want, dtype)
        assert np.all(np.asarray(got)[2] == 0)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_backward_kernel_saved_and_recomputed_lse(dtype):
    _bwd_both_paths(dtype)


@cpu_only
def test_cpu_backward_kernel_saved_and_recomputed_lse_f64(x64):
    _bwd_both_paths(jnp.float64)


def _ce_digest() -> str:
    """sha256 of the CPU kernels' loss, gradient (backward alone) and value-and-grad on
    rows wider than many 16-element blocks, f32 and bf16 (run here and in a subprocess)."""
    h = hashlib.sha256()
    for dtype in (jnp.float32, jnp.bfloat16):
        r = np.random.default_rng(0)
        x = jnp.asarray(3 * r.normal(size=(64, 4099)), dtype)
        y = jnp.asarray(r.integers(-1, 4099, 64), jnp.int32)
        w = jnp.sin(jnp.arange(64, dtype=jnp.float32))
        loss = lambda x: jnp.sum(softmax_cross_entropy(x, y).astype(jnp.float32) * w)
        for out in (jax.jit(softmax_cross_entropy)(x, y), jax.jit(jax.grad(loss))(x), jax.jit(jax.value_and_grad(loss))(x)):
            for leaf in jax.tree_util.tree_leaves(out):
                h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


@cpu_only
def test_cpu_same_bits_with_the_avx2_body_and_one_thread():
    """A fresh process pinned to one core (XLA's pool then has one thread) and forced
    onto the 8-lane row body (RLX_JAX_CPU_NO_AVX512) gives the same bits as this one
    (several threads; the 16-lane body where the CPU has AVX-512)."""
    assert_same_bits_on_one_core_without_avx512(_ce_digest)


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
