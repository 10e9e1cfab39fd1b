"""Softmax cross-entropy and fused linear cross-entropy against an independent
optax-style oracle (log_softmax + take_along_axis): ranks 1-3, odd shapes, ignored and
out-of-range labels, gradients in every mode (check_grads order 2, hessian, vmap, scan,
remat), compositions, memory, errors; vocabulary-parallel sharding on 8 CPU devices
(subprocess); on the CPU, the gradient without the forward kernel, both lse paths of
the backward kernel, the fused linear cross-entropy's one-pass block kernel, and the same bits from the AVX2 and AVX-512 row bodies and from
one or several threads."""

from __future__ import annotations

import hashlib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import fused_linear_cross_entropy, softmax_cross_entropy, softmax_cross_entropy_backward
from rlx_jax.vjp_rules import cross_entropy as ce_rules
from testutil import assert_close, hlo_text, host_device_rows, platform, assert_same_bits_on_one_core_without_avx512

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# widths around the kernels' 16-element blocks: tail only, one whole block, blocks + tail
SHAPES = [(4, 7), (2, 16), (3, 1025), (5, 4099), (1, 1), (0, 5)]


def _inputs(n, c, dtype=jnp.float32, seed=0):
    kx, kl = jax.random.split(jax.random.PRNGKey(seed))
    logits = (3.0 * jax.random.normal(kx, (n, c), jnp.float32)).astype(dtype)
    labels = jax.random.randint(kl, (n,), 0, c, jnp.int32)
    return logits, labels


def _oracle(logits, labels, ignore_index=-100):
    """optax-style plain JAX over the last axis in f32 (f64 under x64): -log_softmax at
    the label; 0 for ignore_index, NaN for any other label outside [0, V)."""
    lf = logits.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    v = lf.shape[-1]
    ok = (labels >= 0) & (labels < v) & (labels != ignore_index)
    logp = jax.nn.log_softmax(lf, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(ok, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(ok, -picked, jnp.where(labels == ignore_index, 0.0, jnp.nan))


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


@pytest.mark.parametrize("shape", [(7,), (1,), (2, 3, 11), (3, 0, 4)])
def test_any_rank(shape):
    """logits [..., V], labels [...]: rank 1 (one row, scalar label), rank 3, zero rows."""
    r = np.random.default_rng(1)
    logits = jnp.asarray(2 * r.normal(size=shape), jnp.float32)
    labels = jnp.asarray(r.integers(0, shape[-1], shape[:-1]), jnp.int32)
    loss = softmax_cross_entropy(logits, labels)
    assert loss.shape == shape[:-1]
    assert_close(loss, _oracle(logits, labels))
    w = jnp.asarray(r.normal(size=shape[:-1]), jnp.float32)
    got = jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels) * w))(logits)
    assert_close(got, jax.grad(lambda x: jnp.sum(_oracle(x, labels) * w))(logits))
    assert_close(softmax_cross_entropy_backward(logits, labels, w), got)


def test_ignore_index_and_out_of_range_labels():
    """ignore_index: loss 0, zero gradient; any other label outside [0, V): NaN loss
    (as optax), zero gradient; the backward op gives NaN rows for those."""
    logits, _ = _inputs(6, 5)
    labels = jnp.array([0, -100, 5, 2**30, -1, 4], jnp.int32)
    loss = np.asarray(softmax_cross_entropy(logits, labels))
    assert loss[1] == 0 and np.all(np.isnan(loss[[2, 3, 4]]))
    assert_close(loss[[0, 5]], _oracle(logits, labels)[jnp.array([0, 5])])
    g = np.asarray(jax.grad(lambda x: jnp.sum(jnp.where(jnp.isnan(softmax_cross_entropy(x, labels)), 0,
                                                        softmax_cross_entropy(x, labels))))(logits))
    assert np.all(g[[1, 2, 3, 4]] == 0) and np.all(np.isfinite(g))
    assert_close(g[[0, 5]].sum(axis=1), np.zeros(2))  # softmax - onehot sums to 0
    gb = np.asarray(softmax_cross_entropy_backward(logits, labels, jnp.ones(6)))
    assert np.all(gb[1] == 0) and np.all(np.isnan(gb[[2, 3, 4]]))
    assert_close(gb[[0, 5]], g[[0, 5]])
    # an ignore_index inside [0, V) ignores that class; -100 is then out of range
    loss3 = np.asarray(softmax_cross_entropy(logits, jnp.array([3, -100, 0, 3, 1, 2]), ignore_index=3))
    assert loss3[0] == 0 and loss3[3] == 0 and np.isnan(loss3[1])
    assert_close(loss3[[2, 4, 5]], _oracle(logits, jnp.array([0, 0, 0, 0, 1, 2]))[jnp.array([2, 4, 5])])


def test_wide_integer_labels_saturate_instead_of_wrapping(x64):
    """int64 / uint32 labels past int32's range are outside [0, V): NaN rows, never a
    class or ignore_index reached by wrapping (2**32 + 1 -> 1, uint32 2**32 - 100 -> -100)."""
    logits, _ = _inputs(4, 5)
    for labels in (jnp.array([1, 2**32 + 1, -(2**32) - 100, 4], jnp.int64),
                   jnp.array([1, 2**32 - 99, 2**32 - 100, 4], jnp.uint32)):
        loss = np.asarray(softmax_cross_entropy(logits, labels))
        assert np.all(np.isnan(loss[[1, 2]])), (labels.dtype, loss)
        assert_close(loss[[0, 3]], _oracle(logits, jnp.array([1, 0, 0, 4]))[jnp.array([0, 3])], jnp.float32)
        h, w = logits[:, :3], jnp.asarray(np.random.RandomState(1).randn(3, 5), logits.dtype)
        fused = np.asarray(fused_linear_cross_entropy(h, w, labels))
        assert np.all(np.isnan(fused[[1, 2]])) and np.all(np.isfinite(fused[[0, 3]])), (labels.dtype, fused)


def test_float_labels_rejected():
    logits, labels = _inputs(5, 8)
    for fn in (lambda l: softmax_cross_entropy(logits, l), lambda l: softmax_cross_entropy_backward(logits, l, jnp.ones(5))):
        with pytest.raises(TypeError, match="labels must be an integer array"):
            fn(labels.astype(jnp.float32))


def test_check_grads_f64(x64):
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, 6), jnp.float64)
    labels = jnp.array([0, 5, -100, 2], jnp.int32)
    if platform() == "cpu":  # the CUDA kernels take no f64: there f64 lowers the reference
        assert "rlx_softmax_ce_bwd" in hlo_text(jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels))), logits)
    check_grads(jax.jit(lambda x: softmax_cross_entropy(x, labels)), (logits,), order=2, modes=("fwd", "rev"))
    d = jax.random.normal(jax.random.PRNGKey(2), (4,), jnp.float64)
    check_grads(jax.jit(lambda x, d: softmax_cross_entropy_backward(x, labels, d)), (logits, d), order=2,
                modes=("fwd", "rev"))
    assert_close(jax.jit(jax.hessian(lambda x: jnp.sum(softmax_cross_entropy(x, labels))))(logits),
                 jax.hessian(lambda x: jnp.sum(_oracle(x, labels)))(logits))


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
    with pytest.raises(ValueError, match="scalar"):
        softmax_cross_entropy(logits[0, 0], labels[0])
    with pytest.raises(ValueError, match="labels must have shape"):
        softmax_cross_entropy(logits, labels[:2])
    with pytest.raises(TypeError, match="labels must be an integer array"):
        softmax_cross_entropy(logits, labels.astype(jnp.complex64))
    with pytest.raises(TypeError, match="logits must be floating"):
        softmax_cross_entropy(labels[:, None], labels)
    with pytest.raises(ValueError, match="at least one class"):
        softmax_cross_entropy(jnp.zeros((3, 0)), labels)
    with pytest.raises(ValueError, match="dloss"):
        softmax_cross_entropy_backward(logits, labels, jnp.ones(4))
    with pytest.raises(TypeError, match="ignore_index"):
        softmax_cross_entropy(logits, labels, ignore_index=-1.5)
    for outside in (2**32, 2**32 + 2, -(2**31) - 1):  # would wrap onto a class as int32
        with pytest.raises(ValueError, match="ignore_index must be in int32's range"):
            softmax_cross_entropy(logits, labels, ignore_index=outside)
        with pytest.raises(ValueError, match="ignore_index must be in int32's range"):
            fused_linear_cross_entropy(jnp.ones((3, 2)), jnp.ones((2, 5)), labels, ignore_index=outside)


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


def _loss_grad_against_numpy(dtype, grad_dtype, n, c, seed):
    """ce_loss_grad (the fused linear cross-entropy's one-pass block kernel) on logits of
    ``dtype`` with per-row scales and a bad label or two, against NumPy f64 on the same
    (rounded) logits: loss and lse in the statistics' dtype, dlogits in ``grad_dtype``;
    the kernel is in the compiled program (when there are rows)."""
    logits, labels = _inputs(n, c, dtype=dtype, seed=seed)
    if n >= 3:
        labels = labels.at[0].set(-1).at[2].set(c)
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    scale = jnp.linspace(0.25, 2.0, n, dtype=acc)
    call = jax.jit(lambda z, y, s: ce_rules.ce_loss_grad(z, y, s, grad_dtype=np.dtype(grad_dtype)))
    if n:  # (XLA folds a call on no rows away)
        assert "rlx_softmax_ce_loss_grad" in call.lower(logits, labels, scale).compile().as_text()
    loss, lse, g = call(logits, labels, scale)
    assert (loss.dtype, lse.dtype, g.dtype) == (acc, acc, grad_dtype)
    z, y, sc = np.asarray(logits, np.float64), np.asarray(labels), np.asarray(scale, np.float64)
    m = z.max(axis=1, keepdims=True) if c else np.zeros((n, 1))
    want_lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    ok = (y >= 0) & (y < c)
    idx = np.where(ok, y, 0)
    want_loss = np.where(ok, want_lse - z[np.arange(n), idx], 0) if c else np.zeros(n)
    want_g = (np.exp(z - want_lse[:, None]) - (np.arange(c) == idx[:, None])) * (ok * sc)[:, None]
    rtol = {jnp.float64: 1e-12, jnp.float32: 2e-5}.get(grad_dtype, 1e-2)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=2e-6 if acc == jnp.float32 else 1e-12)
    np.testing.assert_allclose(np.asarray(loss, np.float64), want_loss, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(g, np.float64), want_g, rtol=rtol, atol=rtol * 2.0 / max(c, 1))
    assert not np.any(np.asarray(g)[~ok]), "rows with a label outside [0, V) get a zero gradient"


LOSS_GRAD_DTYPES = [(jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float16),
                    (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float16)]


@cpu_only
@pytest.mark.parametrize("dtype, grad_dtype", LOSS_GRAD_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n, c", [(5, 1043), (37, 7), (1, 1), (3, 4099), (0, 11)])
def test_cpu_loss_grad_kernel(dtype, grad_dtype, n, c):
    _loss_grad_against_numpy(dtype, grad_dtype, n, c, seed=n + c)


@cpu_only
def test_cpu_loss_grad_kernel_f64(x64):
    _loss_grad_against_numpy(jnp.float64, jnp.float64, 6, 517, seed=2)


def test_loss_grad_vmap_and_kernels_off():
    """Batched by vmap (rows of every example through one call) and with every kernel off
    (the reference): the same values."""
    from rlx_jax.vjp_rules._primitive import fused_ops

    logits, labels = _inputs(12, 301, seed=7)
    logits, labels = logits.reshape(3, 4, 301), labels.reshape(3, 4).at[1, 2].set(-1)
    scale = jnp.linspace(0.5, 1.5, 12).reshape(3, 4)
    f = jax.jit(jax.vmap(lambda z, y, s: ce_rules.ce_loss_grad(z, y, s, grad_dtype=np.dtype(jnp.float32))))
    got = f(logits, labels, scale)
    with fused_ops(False):
        want = [ce_rules.reference_loss_grad(z, y, s, grad_dtype=np.dtype(jnp.float32))
                for z, y, s in zip(logits, labels, scale)]
    for i, leaf in enumerate(got):
        assert_close(leaf, jnp.stack([w[i] for w in want]), jnp.float32)


def test_loss_grad_kernel_refuses_bad_operands():
    """The handler's checks: a scale not in the statistics' dtype, a dlogits of another shape."""
    logits, labels = _inputs(4, 33)
    rows = (4,)
    bad_scale = jax.ffi.ffi_call("rlx_softmax_ce_loss_grad_v1", (
        jax.ShapeDtypeStruct(rows, jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
        jax.ShapeDtypeStruct((4, 33), jnp.float32)))
    with pytest.raises(Exception, match="scale, loss and lse"):
        jax.block_until_ready(jax.jit(bad_scale)(logits, labels, jnp.ones(rows, jnp.bfloat16)))
    bad_grad = jax.ffi.ffi_call("rlx_softmax_ce_loss_grad_v1", (
        jax.ShapeDtypeStruct(rows, jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
        jax.ShapeDtypeStruct((4, 32), jnp.float32)))
    with pytest.raises(Exception, match="dlogits must have the logits' shape"):
        jax.block_until_ready(jax.jit(bad_grad)(logits, labels, jnp.ones(rows, jnp.float32)))


def _ce_digest() -> str:
    """sha256 of the CPU kernels' loss, gradient (backward alone) and value-and-grad on
    rows wider than many 16-element blocks, f32 and bf16 (run here and in a subprocess)."""
    h = hashlib.sha256()
    for dtype in (jnp.float32, jnp.bfloat16):
        r = np.random.default_rng(0)
        x = jnp.asarray(3 * r.normal(size=(64, 4099)), dtype)
        y = jnp.asarray(r.integers(-1, 4099, 64), jnp.int32).at[::7].set(-100)
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

REDUCE = {"none": lambda x: x, "sum": jnp.sum, "mean": None}


def _linear_inputs(n, d, v, seed=0, dtype=jnp.float32, lead=None):
    kh, kw, kl = jax.random.split(jax.random.PRNGKey(seed), 3)
    lead = (n,) if lead is None else lead
    h = jax.random.normal(kh, (*lead, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)).astype(dtype)
    labels = jax.random.randint(kl, lead, 0, v, jnp.int32)
    return h, w, labels


def _linear_oracle(h, w, labels, reduction, ignore_index=-100, logits_dtype=None):
    """Unfused: the oracle on h @ w (in f32 / f64), then the reduction; the mean is over
    rows not ignored, 0 when there are none. ``logits_dtype``: the logits rounded to it
    with an identity derivative (a cast's would round the cotangent too, which the fused
    op does not: its logit gradient stays f32 up to the input's dtype)."""
    acc = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    z = jnp.dot(h.astype(acc), w.astype(acc), precision="highest")
    if logits_dtype is not None:
        z = z + jax.lax.stop_gradient(z.astype(logits_dtype).astype(acc) - z)
    loss = _oracle(z, labels, ignore_index)
    if reduction == "mean":
        return jnp.sum(loss) / jnp.maximum(jnp.sum(labels != ignore_index), 1)
    return REDUCE[reduction](loss)


def _weights(shape, reduction):
    return jnp.cos(jnp.arange(int(np.prod(shape)), dtype=jnp.float32)).reshape(shape) if reduction == "none" else 1.0


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("chunk", [4, None])
def test_fused_linear_matches_oracle(reduction, chunk):
    """N = 9 rows (not a multiple of the chunk), V = 23, an ignored row."""
    h, w, labels = _linear_inputs(9, 8, 23)
    labels = labels.at[3].set(-100)
    wt = _weights((9,), reduction)
    fused = lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, reduction=reduction, chunk_size=chunk) * wt)
    plain = lambda h, w: jnp.sum(_linear_oracle(h, w, labels, reduction) * wt)
    got = jax.jit(lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction=reduction, chunk_size=chunk))(h, w)
    assert got.shape == ((9,) if reduction == "none" else ())
    assert_close(got, _linear_oracle(h, w, labels, reduction))
    for g, want in zip(jax.jit(jax.grad(fused, (0, 1)))(h, w), jax.grad(plain, (0, 1))(h, w)):
        assert_close(g, want)


@pytest.mark.parametrize("n, chunk", [(16, 4), (10, 4), (8, 4), (10, 10), (10, 64), (0, 4)],
                         ids=["4 blocks", "3 blocks, padded", "2 blocks", "1 block", "1 block, chunk > N", "no rows"])
def test_fused_linear_row_blocks(n, chunk):
    """d weight and the total start from the first row block's terms, computed before the
    loop over the others (no loop for one block; two blocks loop from zeros): "mean" loss
    + gradients, and "none"'s backward (which starts d weight the same way), over several
    blocks, exactly one, and no rows (loss 0, zero d weight), against the oracle."""
    h, w, labels = _linear_inputs(n, 8, 23, seed=4)
    if n:
        labels = labels.at[1].set(-100)
    for red in ("mean", "none"):
        wt = _weights((n,), red)
        fused = lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, reduction=red, chunk_size=chunk) * wt)
        got = jax.jit(jax.value_and_grad(fused, (0, 1)))(h, w)
        want = jax.value_and_grad(lambda h, w: jnp.sum(_linear_oracle(h, w, labels, red) * wt), (0, 1))(h, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(a, b)
        if not n:
            assert float(got[0]) == 0 and got[1][0].shape == (0, 8) and not np.any(np.asarray(got[1][1]))


@pytest.mark.parametrize("reduction, lead", [("none", ()), ("mean", (1,)), ("none", (2, 3, 5)), ("mean", (2, 3, 5))])
def test_fused_linear_ranks(reduction, lead):
    """hidden [..., D], labels [...]: a single row (rank 1), one row, rank 4."""
    h, w, labels = _linear_inputs(0, 6, 13, seed=2, lead=lead)
    got = fused_linear_cross_entropy(h, w, labels, reduction=reduction, chunk_size=4)
    assert got.shape == (lead if reduction == "none" else ())
    assert_close(got, _linear_oracle(h, w, labels, reduction))
    wt = _weights(lead, reduction)
    g = jax.jit(jax.grad(lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, reduction=reduction) * wt),
                         (0, 1)))(h, w)
    want = jax.grad(lambda h, w: jnp.sum(_linear_oracle(h, w, labels, reduction) * wt), (0, 1))(h, w)
    for a, b in zip(g, want):
        assert_close(a, b)


def test_fused_linear_edge_cases():
    """V = 1; zero rows; every row ignored (mean 0 with zero gradients); an
    out-of-range label (NaN loss, zero gradient for that row)."""
    h, w, labels = _linear_inputs(5, 4, 1)
    assert_close(fused_linear_cross_entropy(h, w, labels), jnp.zeros(5))
    h0, w0, l0 = _linear_inputs(0, 4, 7)
    assert fused_linear_cross_entropy(h0, w0, l0).shape == (0,)
    for red in ("mean", "sum"):
        assert float(fused_linear_cross_entropy(h0, w0, l0, reduction=red)) == 0
    h, w, labels = _linear_inputs(6, 4, 7)
    ignored = jnp.full((6,), -100)
    for red in ("mean", "sum"):
        v, (gh, gw) = jax.value_and_grad(
            lambda h, w: fused_linear_cross_entropy(h, w, ignored, reduction=red), (0, 1))(h, w)
        assert float(v) == 0 and not np.any(np.asarray(gh)) and not np.any(np.asarray(gw))
    bad = labels.at[2].set(7)
    none = np.asarray(fused_linear_cross_entropy(h, w, bad))
    assert np.isnan(none[2]) and np.all(np.isfinite(np.delete(none, 2)))
    assert np.isnan(float(fused_linear_cross_entropy(h, w, bad, reduction="mean")))
    gh = jax.grad(lambda h: jnp.nansum(fused_linear_cross_entropy(h, w, bad)))(h)
    assert np.all(np.asarray(gh)[2] == 0) and np.all(np.isfinite(np.asarray(gh)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_reduced_bad_label_poisons_the_loss_not_the_gradients(reduction):
    """A label outside [0, V) (not the ignore index) makes a reduced loss NaN; the
    gradients are those of the loss with that row ignored (the mean over the other rows):
    finite, that row's zero."""
    h, w, labels = _linear_inputs(9, 6, 11, seed=3)
    bad, ignored = labels.at[4].set(11), labels.at[4].set(-100)
    f = lambda h, w, y: fused_linear_cross_entropy(h, w, y, reduction=reduction, chunk_size=4)  # noqa: E731
    loss, grads = jax.value_and_grad(f, (0, 1))(h, w, bad)
    want = jax.grad(f, (0, 1))(h, w, ignored)
    assert np.isnan(float(loss))
    for got, ref in zip(grads, want):
        assert np.all(np.isfinite(np.asarray(got)))
        assert_close(got, ref)
    assert not np.any(np.asarray(grads[0])[4])


def test_fused_linear_reduced_gradients_take_no_scaling_pass():
    """A reduced loss differentiated as it is: its gradients, formed in the forward pass,
    reach the compiled gradient program unscaled. The cotangent that scales them is then 1
    whatever the labels (a traced argument here), so XLA drops the multiply: no [N, D] or
    [D, V] product is left in the program (the row blocks are [4, D] and [4, V])."""
    n, d, v = 24, 8, 40
    h, w, labels = _linear_inputs(n, d, v, seed=5, dtype=jnp.bfloat16)
    f = lambda h, w, y: fused_linear_cross_entropy(h, w, y, reduction="mean", chunk_size=4).astype(jnp.float32)  # noqa: E731
    text = jax.jit(jax.value_and_grad(f, (0, 1))).lower(h, w, labels).compile().as_text()
    scaled = [line for line in text.splitlines()
              if re.search(rf"\[({n},{d}|{d},{v})\]\S* multiply\(", line)]
    assert not scaled, scaled


def test_fused_linear_bf16_and_mixed_precision():
    """bf16 within bf16 tolerance of the f32 oracle (per-row losses in bf16, the
    reduced loss in f32); bf16 hidden with an f32 weight is computed in f32 (promotion as
    jnp.dot), each gradient in its input's dtype."""
    h, w, labels = _linear_inputs(8, 16, 40, dtype=jnp.bfloat16)
    for red in ("none", "mean"):
        got = fused_linear_cross_entropy(h, w, labels, reduction=red, chunk_size=3)
        assert got.dtype == (jnp.bfloat16 if red == "none" else jnp.float32)
        assert_close(got, _linear_oracle(h, w, labels, red), jnp.bfloat16)
        gh, gw = jax.grad(lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, reduction=red)
                                               .astype(jnp.float32)), (0, 1))(h, w)
        want = jax.grad(lambda h, w: jnp.sum(_linear_oracle(h, w, labels, red)), (0, 1))(
            h.astype(jnp.float32), w.astype(jnp.float32))
        assert gh.dtype == gw.dtype == jnp.bfloat16
        assert_close(gh, want[0], jnp.bfloat16)
        assert_close(gw, want[1], jnp.bfloat16)
    w32 = w.astype(jnp.float32) * 1.001
    got = fused_linear_cross_entropy(h, w32, labels, reduction="mean")
    assert got.dtype == jnp.float32
    assert_close(got, _linear_oracle(h.astype(jnp.float32), w32, labels, "mean"))
    gh, gw = jax.grad(lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction="mean"), (0, 1))(h, w32)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.float32


@pytest.mark.parametrize("reduction", [pytest.param("none", marks=pytest.mark.slow), "mean"])
def test_fused_linear_check_grads_f64(x64, reduction):
    """First and second order in both modes (jitted: each derivative compiles once), and
    the Hessian (forward over reverse) against the oracle's."""
    h, w, labels = _linear_inputs(5, 3, 7, dtype=jnp.float64)
    labels = labels.at[1].set(-100)
    f = jax.jit(lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction=reduction, chunk_size=2))
    check_grads(f, (h, w), order=2, modes=("fwd", "rev"))
    hess = jax.jit(jax.hessian(lambda h, w: jnp.sum(f(h, w)), (0, 1)))(h, w)
    want = jax.hessian(lambda h, w: jnp.sum(_linear_oracle(h, w, labels, reduction)), (0, 1))(h, w)
    for a, b in zip(jax.tree.leaves(hess), jax.tree.leaves(want)):
        assert_close(a, b)


def test_fused_linear_compositions():
    """One hidden feeding two losses (mean over one weight, none over another); the loss
    inside vmap, and inside scan with remat, against the oracle."""
    h, w, labels = _linear_inputs(7, 5, 11, seed=3)
    w2 = jnp.flip(w, axis=1) * 0.5

    def both(loss):
        return lambda h, w, w2: loss(h, w, labels, "mean") + jnp.sum(jnp.sin(loss(h, w2, labels[::-1], "none")))

    ours = lambda h, w, l, r: fused_linear_cross_entropy(h, w, l, reduction=r, chunk_size=3)
    got = jax.jit(jax.value_and_grad(both(ours), (0, 1, 2)))(h, w, w2)
    want = jax.value_and_grad(both(_linear_oracle), (0, 1, 2))(h, w, w2)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b)

    hb, lb = jnp.stack([h, -h]), jnp.stack([labels, labels[::-1]])
    for red in ("none", "mean"):
        f = lambda h, w, l: jnp.sum(fused_linear_cross_entropy(h, w, l, reduction=red, chunk_size=2))
        o = lambda h, w, l: jnp.sum(_linear_oracle(h, w, l, red))
        for a, b in zip(jax.jit(jax.vmap(jax.grad(f, (0, 1)), (0, None, 0)))(hb, w, lb),
                        jax.vmap(jax.grad(o, (0, 1)), (0, None, 0))(hb, w, lb)):
            assert_close(a, b)

        def scanned(loss):
            return lambda w: jax.lax.scan(lambda c, xs: (c + loss(xs[0], w, xs[1]), None), 0.0, (hb, lb))[0]

        got = jax.jit(jax.value_and_grad(scanned(jax.checkpoint(f))))(w)
        for a, b in zip(got, jax.value_and_grad(scanned(o))(w)):
            assert_close(a, b)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_fused_linear_vmap_runs_the_primitive_per_element(reduction):
    """Under vmap the fused primitives run once per element (lax.map), not as vmap of the
    reference: the CPU's row kernels stay in the program. Loss and gradients against the
    oracle with the weight shared and batched, the hidden's batch axis not first, and an
    empty batch."""
    h, w, labels = _linear_inputs(7, 5, 11, seed=4)
    hb = jnp.stack([h, -h, 0.5 * h], axis=1)  # [7, 3, 5]: the batch at axis 1
    lb = jnp.stack([labels, labels[::-1], jnp.roll(labels, 2)])
    wb = jnp.stack([w, 2 * w, -w])
    kernel = "rlx_softmax_ce_fwd_v1" if reduction == "none" else "rlx_softmax_ce_loss_grad_v1"

    def total(loss, in_axes):
        return lambda h, w, l: jnp.sum(jnp.sin(jax.vmap(loss, in_axes)(h, w, l)))  # noqa: E741

    ours = lambda h, w, l: fused_linear_cross_entropy(h, w, l, reduction=reduction, chunk_size=3)  # noqa: E731,E741
    oracle = lambda h, w, l: _linear_oracle(h, w, l, reduction)  # noqa: E731,E741
    for in_axes, args in (((1, None, 0), (hb, w, lb)), ((1, 0, 0), (hb, wb, lb)),
                          ((1, None, 0), (hb[:, :0], w, lb[:0]))):
        fn = jax.value_and_grad(total(ours, in_axes), (0, 1))
        got = jax.jit(fn)(*args)
        want = jax.value_and_grad(total(oracle, in_axes), (0, 1))(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(a, b)
        assert "rlx_fused_linear_ce_" in str(jax.make_jaxpr(fn)(*args))
        if platform() == "cpu" and args[2].shape[0]:  # (a map over no element lowers to nothing)
            assert kernel in hlo_text(fn, *args)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("chunk", [4, None])
def test_fused_linear_narrow_logits(reduction, chunk):
    """logits_dtype=bf16 on f32 inputs: loss and gradients (f32, so the rounding shows)
    match the oracle on bf16-rounded logits, and differ from the f32-logits result by
    more than they differ from that oracle (the option takes effect). Under f32 matmul
    precision: a GPU's default (TF32) gradient products lie outside f32's tolerance."""
    with jax.default_matmul_precision("highest"):
        _check_narrow_logits(reduction, chunk)


def _check_narrow_logits(reduction, chunk):
    h, w, labels = _linear_inputs(11, 8, 37, seed=5)
    # Logits of a few units (bf16 rounding moves them by about 1e-2) from dyadic inputs: h
    # in steps of 1/8, w of 1/64, so every product and partial sum of h @ w is exact in f32
    # (and in TF32 or bf16 operands) and each logit rounds to bf16 the same way whatever
    # the matmul's algorithm or summation order (with the unrounded inputs one logit lies
    # 9 f32 ulps from a bf16 rounding boundary).
    h, w = jnp.round(h * 32) / 8, jnp.round(w * 64) / 64
    labels = labels.at[2].set(-100)
    wt = _weights((11,), reduction)

    def fused(dtype):
        return lambda h, w: jnp.sum(fused_linear_cross_entropy(
            h, w, labels, reduction=reduction, chunk_size=chunk, logits_dtype=dtype) * wt)

    oracle = lambda h, w: jnp.sum(_linear_oracle(h, w, labels, reduction, logits_dtype=jnp.bfloat16) * wt)
    got = jax.jit(jax.value_and_grad(fused(jnp.bfloat16), (0, 1)))(h, w)
    want = jax.value_and_grad(oracle, (0, 1))(h, w)
    wide = jax.jit(jax.value_and_grad(fused(None), (0, 1)))(h, w)
    for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(wide)):
        assert a.dtype == jnp.float32
        assert_close(a, b)
        assert float(jnp.max(jnp.abs(c - b))) > 10 * float(jnp.max(jnp.abs(a - b))) + 1e-6
    # forward mode: the tangent of the rounded logits is the tangent of the product
    t = (jnp.cos(h), jnp.sin(w))
    got_t = jax.jvp(fused("bfloat16"), (h, w), t)[1]
    assert_close(got_t, jax.jvp(oracle, (h, w), t)[1])
    if reduction == "mean" and chunk == 4:  # under vmap (a batch of hidden, one weight)
        hb = jnp.stack([h, -0.5 * h])
        got_v = jax.jit(jax.vmap(jax.grad(fused(jnp.bfloat16), (0, 1)), (0, None)))(hb, w)
        for a, b in zip(got_v, jax.vmap(jax.grad(oracle, (0, 1)), (0, None))(hb, w)):
            assert_close(a, b)


def test_fused_linear_narrow_logits_hessian_f64(x64):
    """f64 inputs with f32 logits: the Hessian (forward over reverse, through the hvp
    primitive) against the oracle that rounds its logits to f32, within f32's tolerance
    (the hvp differentiates through the f32 logits, so its cotangents are f32 there)."""
    h, w, labels = _linear_inputs(5, 3, 7, dtype=jnp.float64, seed=6)
    for red in ("mean", "none"):
        f = lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, reduction=red, chunk_size=2,
                                                            logits_dtype=jnp.float32))
        hessian = jax.jit(jax.hessian(f, (0, 1)))
        got = hessian(h, w)
        want = jax.hessian(lambda h, w: jnp.sum(_linear_oracle(h, w, labels, red, logits_dtype=jnp.float32)), (0, 1))(h, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == jnp.float64
            assert_close(a, b, jnp.float32)
        # every product keeps its f64 operands' accumulation: cuBLAS has no f64 product
        # written in f32 (the GPU failed to run one)
        narrowed = re.findall(r"dot_general[^\n]*\(tensor<[^>]*xf64>, tensor<[^>]*xf64>\) -> tensor<[^>]*xf32>",
                              hessian.lower(h, w).as_text())
        assert not narrowed, narrowed[:2]


def test_fused_linear_narrow_logits_never_need_more_memory():
    """bf16 logits blocks on bf16 inputs need no more temp memory than f32 blocks on the
    CPU, whose bf16 block is an f32 product rounded (the one-pass kernel writes the f32
    block's gradient in bf16 straight away, so the two are equal here). The GPU, whose
    matmul writes the bf16 block itself, saves half the block: test_cross_entropy_gpu."""
    n, d, v = 256, 32, 4096
    h, w, labels = _linear_inputs(n, d, v, dtype=jnp.bfloat16)

    def temp(dtype):
        f = jax.jit(jax.value_and_grad(lambda h, w: fused_linear_cross_entropy(
            h, w, labels, reduction="mean", chunk_size=128, logits_dtype=dtype).astype(jnp.float32), (0, 1)))
        return f.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    wide, narrow = temp(None), temp(jnp.bfloat16)
    assert narrow <= wide, (narrow, wide)


def _count_dots(fn, *args):
    return len(re.findall(r" dot\(", jax.jit(fn).lower(*args).compile().as_text()))


def test_fused_linear_reduced_backward_only_scales():
    """mean / sum: the forward pass computes the gradients, so loss + gradients compile
    to three vocabulary-sized matmuls (logits, d hidden, d weight of each row block);
    "none" recomputes the logits in the backward (four). The pass that computes the
    gradients is in the program twice, for the first row block (before the loop) and in
    the loop over the others. The compiled temp memory of the reduced loss + gradients
    stays well under one [N, V] f32 logits array."""
    n, d, v = 256, 32, 4096
    h, w, labels = _linear_inputs(n, d, v)
    for red, fwd, grad in (("mean", 0, 3), ("sum", 0, 3), ("none", 1, 3)):
        loss = lambda h, w: jnp.sum(fused_linear_cross_entropy(h, w, labels, reduction=red, chunk_size=32))
        assert _count_dots(jax.value_and_grad(loss, (0, 1)), h, w) == fwd + 2 * grad, red
    fused = jax.jit(jax.value_and_grad(
        lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction="mean", chunk_size=32), (0, 1)))
    plain = jax.jit(jax.value_and_grad(lambda h, w: jnp.mean(softmax_cross_entropy(h @ w, labels)), (0, 1)))
    mf = fused.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    mp = plain.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = n * v * 4
    assert mp >= logits_bytes
    assert mf < logits_bytes / 2, (mf, mp)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_fused_linear_reduced_loss_keeps_its_f32_sum(dtype):
    """A reduced loss comes back in f32, the dtype it is summed in, for narrow inputs:
    rounded to bf16 a mean loss near 8 would move in steps of 1/32, and an f16 sum over
    8192 rows of about 8.3 each (68,000) would overflow f16 (65504) to inf. Per-row losses
    stay in the inputs' dtype. The values match the f32 oracle on the same (rounded)
    inputs to f32 precision, not to the narrow dtype's; the gradients keep the inputs'
    dtypes and take the f32 loss's cotangent."""
    n, d, v = 8192, 16, 4096
    h, w, labels = _linear_inputs(n, d, v, dtype=dtype)
    h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
    for red in ("mean", "sum"):
        loss = fused_linear_cross_entropy(h, w, labels, reduction=red, chunk_size=2048)
        want = _linear_oracle(h32, w32, labels, red)
        assert loss.dtype == jnp.float32 and loss.shape == (), (red, loss.dtype)
        assert np.isfinite(float(loss)) and float(want) > 8.0 * (n if red == "sum" else 1)
        np.testing.assert_allclose(float(loss), float(want), rtol=2e-5)
        dh, dw = jax.grad(lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction=red, chunk_size=2048),
                          (0, 1))(h, w)
        gh, gw = jax.grad(lambda h, w: _linear_oracle(h, w, labels, red), (0, 1))(h32, w32)
        assert (dh.dtype, dw.dtype) == (dtype, dtype)
        assert_close(dh, gh, dtype)
        assert_close(dw, gw, dtype)
    assert fused_linear_cross_entropy(h, w, labels, chunk_size=2048).dtype == dtype


def test_fused_linear_default_chunk():
    from rlx_jax.vjp_rules.linear_cross_entropy import default_chunk_size
    assert default_chunk_size(2048, 256, 8192, "cpu") == 256
    # GPUs: about 256 MiB of logits per block as written (power of two), at least 2048
    # rows, at most the rows there are
    assert default_chunk_size(16384, 2048, 32000, "cuda") == 2048  # f32 blocks
    assert default_chunk_size(16384, 2048, 32000, "cuda", logit_bytes=2) == 4096  # bf16 blocks
    assert default_chunk_size(16384, 2048, 128256, "cuda") == 2048
    assert default_chunk_size(16384, 2048, 128256, "cuda", logit_bytes=2) == 2048
    assert default_chunk_size(65536, 4096, 262144, "cuda") == 2048
    assert default_chunk_size(1 << 20, 2048, 1000, "cuda") == 1 << 16
    assert default_chunk_size(1 << 20, 2048, 1000, "cuda", logit_bytes=2) == 1 << 17
    assert default_chunk_size(1000, 2048, 128256, "cuda") == 1000
    assert default_chunk_size(3, 8, 10, "cpu") == 3
    # the CPU counts logits, whatever their width
    assert default_chunk_size(2048, 256, 8192, "cpu", logit_bytes=2) == 256


def test_fused_linear_block_logit_bytes():
    """The bytes a logit takes as ``_logits`` writes a block: the accumulation dtype's
    unless the matmul writes the (no wider) logits dtype itself."""
    from rlx_jax.vjp_rules.linear_cross_entropy import block_logit_bytes
    assert block_logit_bytes(jnp.bfloat16, None) == 4
    assert block_logit_bytes(jnp.bfloat16, jnp.bfloat16) == 2
    assert block_logit_bytes(jnp.float16, np.dtype(jnp.float16)) == 2
    assert block_logit_bytes(jnp.float32, None) == 4
    assert block_logit_bytes(jnp.float32, jnp.bfloat16) == 4  # f32 product, rounded afterwards
    assert block_logit_bytes(jnp.float64, None) == 8
    assert block_logit_bytes(jnp.float64, np.dtype(jnp.float32)) == 8


@pytest.mark.parametrize("logits_dtype, want", [(None, 4), (jnp.bfloat16, 2)])
def test_fused_linear_default_chunk_sees_block_dtype(monkeypatch, logits_dtype, want):
    """The public op sizes its default blocks by the bytes its logits blocks take."""
    from rlx_jax.vjp_rules import linear_cross_entropy as flce_rules
    seen = []
    real = flce_rules.default_chunk_size

    def spy(*args, **kwargs):
        seen.append(kwargs.get("logit_bytes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flce_rules, "default_chunk_size", spy)
    h = jnp.ones((6, 4), jnp.bfloat16)
    w = jnp.ones((4, 10), jnp.bfloat16)
    fused_linear_cross_entropy(h, w, jnp.zeros(6, jnp.int32), reduction="mean", logits_dtype=logits_dtype)
    assert seen == [want]


def test_fused_linear_errors():
    h, w, labels = _linear_inputs(3, 4, 5)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(h, w, labels, chunk_size=0)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_cross_entropy(h, w.T, labels)
    with pytest.raises(ValueError, match="labels must have shape"):
        fused_linear_cross_entropy(h, w, labels[:1])
    with pytest.raises(TypeError, match="labels must be an integer array"):
        fused_linear_cross_entropy(h, w, labels.astype(jnp.float32))
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(h, w, labels, reduction="avg")
    with pytest.raises(TypeError, match="weight must be floating"):
        fused_linear_cross_entropy(h, jnp.ones((4, 5), jnp.int32), labels)
    for bad in (jnp.float64, jnp.int32, "not a dtype"):
        with pytest.raises(TypeError, match="logits_dtype"):
            fused_linear_cross_entropy(h, w, labels, logits_dtype=bad)
    # the accumulation dtype itself is the default, not an error
    assert_close(fused_linear_cross_entropy(h, w, labels, logits_dtype=jnp.float32),
                 fused_linear_cross_entropy(h, w, labels))


# ---- vocabulary-parallel sharding (8 CPU devices, subprocess) ---------------------------

SHARDING_CHECK = pathlib.Path(__file__).with_name("cross_entropy_sharding_check.py")
QUICK_SHARDING = ["softmax_ce_vocab_and_rows", "linear_ce_mean", "linear_ce_none", "linear_ce_mean_bf16_logits",
                  "linear_ce_rows_and_vocab_same_axis"]


def _run_sharding_check(cases):
    rows = list(host_device_rows(SHARDING_CHECK, *cases, platform="cpu").values())
    for r in rows:
        assert "error" not in r, r
        assert r["max_err"] < 1e-5, r
        assert r["finite"], r
        # vocab-parallel: all-reduces of row statistics only, never a gathered [N, V]
        assert r["vocab_gathers"] == [], r
        if r["op"] != "linear_ce_rows_and_vocab_same_axis":  # that one gathers [N, D] rows
            assert r["all_gathers"] == [], r
        assert r["all_reduces"] >= 1, r
    return rows


def test_vocab_parallel_sharding_quick():
    assert len(_run_sharding_check(QUICK_SHARDING)) == len(QUICK_SHARDING)


@pytest.mark.slow
def test_vocab_parallel_sharding_all_cases():
    assert len(_run_sharding_check([])) >= 9
