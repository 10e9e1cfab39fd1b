"""rlx_jax.nn against flax.nnx's own modules: same constructor arguments give the same
parameters (names, shapes, values), and the same parameters give the same outputs and
gradients (inputs and parameters), under jit, with grouped-query attention, masks,
causal attention (flax's top-left alignment), RoPE and mixed dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from rlx_jax import nn as rnn, ops as rops  # noqa: E402

from testutil import hlo_text  # noqa: E402


@pytest.fixture(autouse=True)
def _full_f32_products():
    """The f32 comparisons against flax are at 2e-5: on a GPU, JAX's default precision would
    run both sides' products in TF32, each rounding its own way (errors near 1e-3)."""
    with jax.default_matmul_precision("highest"):
        yield


def _assert_kernel_runs(target, fn, x):
    """The module's gradient goes through the fused kernel ``target``: checked on the CPU,
    where the kernels serve these small f32 shapes; on a GPU, f32 attention runs XLA's code
    by design (``CUDA_KERNEL_DTYPES`` in rlx_jax/vjp_rules/attention.py)."""
    if jax.default_backend() == "cpu":
        assert target in hlo_text(fn, x)


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _perturb(model, seed):
    """Replaces every parameter by a random one (so ones/zeros inits prove nothing)."""
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    new = [(l + 0.3 * jax.random.normal(k, l.shape, jnp.float32).astype(l.dtype)) for l, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(tree, new))


def _value_and_grads(model, *inputs, **call_kw):
    """loss = sum(sin(model(*inputs)) * w): (output, d inputs, d params), in one jit."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def run(params, *xs):
        return nnx.merge(graphdef, params, rest)(*xs, **call_kw)

    w = _rand(jax.eval_shape(run, params, *inputs).shape, 99, jnp.float32)

    def loss(params, *xs):
        out = run(params, *xs)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)) * w), out

    (_, out), d = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(1 + len(inputs))), has_aux=True))(
        params, *inputs)
    return out, d[1:], d[0]


def _same_params(a, b):
    sa, sb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype, (x.dtype, y.dtype)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if tol >= 1e-3:  # 16-bit: rounding differs elementwise, compare the error's norm (with an
            # O(1)-per-element floor: a gradient that is zero in exact arithmetic is rounding noise)
            bound = tol * max(np.linalg.norm(y), 0.5 * np.sqrt(y.size))
            assert np.linalg.norm(x - y) <= bound, (np.linalg.norm(x - y), bound)
        else:
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def _compare(ours, theirs, inputs, tol=2e-5, **call_kw):
    _same_params(ours, theirs)
    _perturb(ours, 1)
    _perturb(theirs, 1)
    o, dx, dp = _value_and_grads(ours, *inputs, **call_kw)
    t, tx, tp = _value_and_grads(theirs, *inputs, **call_kw)
    assert o.shape == t.shape and o.dtype == t.dtype
    _close(o, t, tol)
    _close(dx, tx, tol)
    _close(dp, tp, tol)


# ---- norms ---------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, pytest.param({"use_scale": False}, marks=pytest.mark.slow),
                                {"epsilon": 1e-2}])
def test_rms_norm_matches_flax(kw):
    make = lambda cls: cls(12, rngs=nnx.Rngs(0), **kw)
    _compare(make(rnn.RMSNorm), make(nnx.RMSNorm), (_rand((3, 5, 12), 0),))
    _assert_kernel_runs("rlx_rms_norm_bwd", jax.grad(lambda x: jnp.sum(make(rnn.RMSNorm)(x))), _rand((3, 12), 2))


@pytest.mark.parametrize("kw", [{}, {"use_bias": False}, pytest.param({"use_scale": False}, marks=pytest.mark.slow),
                                pytest.param({"epsilon": 1e-3}, marks=pytest.mark.slow)])
def test_layer_norm_matches_flax(kw):
    make = lambda cls: cls(7, rngs=nnx.Rngs(0), **kw)
    _compare(make(rnn.LayerNorm), make(nnx.LayerNorm), (3.0 + _rand((4, 7), 0),))
    _assert_kernel_runs("rlx_layer_norm_bwd", jax.grad(lambda x: jnp.sum(make(rnn.LayerNorm)(x))), _rand((3, 7), 2))


@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_norm_dtype_promotion_as_flax(cls):
    x = _rand((4, 16), 0, jnp.bfloat16)
    for kw in ({}, {"dtype": jnp.bfloat16}):
        ours = getattr(rnn, cls)(16, rngs=nnx.Rngs(0), **kw)
        theirs = getattr(nnx, cls)(16, rngs=nnx.Rngs(0), **kw)
        _compare(ours, theirs, (x,), tol=2e-2)
    # bf16 input, f32 scale: f32 result, as flax
    assert getattr(rnn, cls)(16, rngs=nnx.Rngs(0))(x).dtype == jnp.float32


def test_norm_other_axes_and_masks_keep_flax_semantics():
    x = _rand((3, 6, 5), 0)
    ours = rnn.LayerNorm(6, reduction_axes=(1,), feature_axes=(1,), rngs=nnx.Rngs(0))
    theirs = nnx.LayerNorm(6, reduction_axes=(1,), feature_axes=(1,), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6)
    mask = jnp.arange(5) < 3
    ours, theirs = rnn.RMSNorm(5, rngs=nnx.Rngs(0)), nnx.RMSNorm(5, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), rtol=1e-6)


# ---- attention ---------------------------------------------------------------------------


def _mha(cls, **kw):
    base = dict(num_heads=4, in_features=16, qkv_features=32, decode=False, rngs=nnx.Rngs(0))
    base.update(kw)
    return cls(**base)


@pytest.mark.parametrize("kw", [{"num_kv_heads": 2},
                                pytest.param({}, marks=pytest.mark.slow),
                                pytest.param({"num_kv_heads": 1, "use_bias": False}, marks=pytest.mark.slow),
                                pytest.param({"out_features": 10, "normalize_qk": True}, marks=pytest.mark.slow)])
def test_self_attention_matches_flax(kw):
    x = _rand((2, 6, 16), 0)
    _compare(_mha(rnn.MultiHeadAttention, **kw), _mha(nnx.MultiHeadAttention, **kw), (x,))


@pytest.mark.slow
def test_causal_is_top_left_as_flax_also_for_cross_attention():
    xq, xkv = _rand((2, 3, 16), 0), _rand((2, 7, 16), 1)
    ours, theirs = _mha(rnn.MultiHeadAttention, num_kv_heads=2), _mha(nnx.MultiHeadAttention, num_kv_heads=2)
    _compare(ours, theirs, (xq, xkv), is_causal=True)
    x = _rand((2, 5, 16), 2)
    _assert_kernel_runs("rlx_attention_bwd", jax.grad(lambda x: jnp.sum(ours(x, is_causal=True))), x)


def test_boolean_mask_and_top_left_causal_match_flax():
    """Cross-attention (Sq = 4 < Sk = 6) with a random mask and flax's is_causal."""
    xq, xkv = _rand((2, 4, 16), 0), _rand((2, 6, 16), 1)
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.6, (2, 1, 4, 6))
    mask = mask.at[:, :, :, 0].set(True)  # every query sees a key
    ours, theirs = _mha(rnn.MultiHeadAttention, num_kv_heads=2), _mha(nnx.MultiHeadAttention, num_kv_heads=2)
    _compare(ours, theirs, (xq, xkv), mask=mask, is_causal=True)
    x = _rand((2, 5, 16), 2)
    _assert_kernel_runs("rlx_attention_bwd", jax.grad(lambda x: jnp.sum(ours(x, is_causal=True))), x)


@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2}], ids=["mha", "gqa"])
def test_rows_with_every_key_masked_match_flax(kw):
    """Padding queries (every key masked): flax averages the values there, constant in q
    and k; the gradients must be flax's too, not the kernel's from a log-sum-exp that
    loses log(Sk) beside the dtype's most negative value."""
    x = _rand((2, 5, 16), 4)
    mask = jnp.ones((2, 1, 5, 5), bool).at[0, :, 3:].set(False).at[1, :, :, 2:].set(False)
    mask = mask.at[1, :, 1, :].set(False)
    ours, theirs = _mha(rnn.MultiHeadAttention, **kw), _mha(nnx.MultiHeadAttention, **kw)
    # gradients of magnitude ~30 in f32: 1e-4 absolute (a wrong row is off by 10 and more)
    _compare(ours, theirs, (x,), tol=1e-4, mask=mask)
    _compare(ours, theirs, (x,), tol=1e-4, mask=mask, is_causal=True)


def _neox_rope(x, theta, n_rot):
    """Independent RoPE: rotate the first n_rot dims of each head as two halves."""
    s, d = x.shape[-3], x.shape[-1]
    half = n_rot // 2
    freq = theta ** (-np.arange(half) * 2.0 / n_rot)
    ang = np.arange(s)[:, None] * freq[None, :]
    c, sn = jnp.asarray(np.cos(ang), x.dtype)[:, None, :], jnp.asarray(np.sin(ang), x.dtype)[:, None, :]
    a, b, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return jnp.concatenate([a * c - b * sn, b * c + a * sn, rest], axis=-1)


@pytest.mark.parametrize("rope_dims", [4, pytest.param(None, marks=pytest.mark.slow)])
def test_rope_matches_flax_with_rope_applied_to_q_and_k(rope_dims):
    theta = 500.0

    def roped(q, k, v, **kw):
        n = q.shape[-1] if rope_dims is None else rope_dims
        return nnx.dot_product_attention(_neox_rope(q, theta, n), _neox_rope(k, theta, n), v, **kw)

    x = _rand((2, 6, 16), 0)
    ours = _mha(rnn.MultiHeadAttention, num_kv_heads=2, rope_theta=theta, rope_dims=rope_dims)
    theirs = _mha(nnx.MultiHeadAttention, num_kv_heads=2, attention_fn=roped)
    _compare(ours, theirs, (x,), is_causal=True)


@pytest.mark.slow
def test_attention_bf16_matches_flax():
    x = _rand((2, 8, 16), 0, jnp.bfloat16)
    kw = dict(num_kv_heads=2, dtype=jnp.bfloat16)
    _compare(_mha(rnn.MultiHeadAttention, **kw), _mha(nnx.MultiHeadAttention, **kw), (x,), tol=5e-2,
             is_causal=True)


def test_attention_errors_name_the_argument():
    with pytest.raises(TypeError, match="attention_fn"):
        _mha(rnn.MultiHeadAttention, attention_fn=nnx.dot_product_attention)
    with pytest.raises(ValueError, match="rope_dims"):
        _mha(rnn.MultiHeadAttention, rope_theta=1e4, rope_dims=3)
    m = _mha(rnn.MultiHeadAttention, dropout_rate=0.1)
    with pytest.raises(NotImplementedError, match="dropout_rate"):
        m(_rand((1, 3, 16), 0), deterministic=False)
    np.testing.assert_allclose(m(_rand((1, 3, 16), 0), deterministic=True),
                               _mha(nnx.MultiHeadAttention, dropout_rate=0.1)(_rand((1, 3, 16), 0),
                                                                              deterministic=True), rtol=2e-5,
                               atol=2e-6)
    with pytest.raises(NotImplementedError, match="decode"):
        _mha(rnn.MultiHeadAttention, rope_theta=1e4, decode=True)(_rand((1, 1, 16), 0))


# ---- cross-entropy ---------------------------------------------------------------------------


def test_cross_entropy_matches_optax_on_any_leading_shape():
    logits, labels = _rand((2, 3, 11), 0), jax.random.randint(jax.random.PRNGKey(1), (2, 3), 0, 11)
    f = lambda z: rnn.softmax_cross_entropy_with_integer_labels(z, labels)
    g = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels)
    np.testing.assert_allclose(f(logits), g(logits), rtol=1e-5)
    w = _rand((2, 3), 5)
    np.testing.assert_allclose(jax.grad(lambda z: jnp.sum(f(z) * w))(logits),
                               jax.grad(lambda z: jnp.sum(g(z) * w))(logits), rtol=1e-5, atol=1e-6)
    _assert_kernel_runs("rlx_softmax_ce_bwd", jax.grad(lambda z: jnp.sum(f(z))), logits)
    assert rnn.softmax_cross_entropy_with_integer_labels(jnp.zeros((0, 4)), jnp.zeros((0,), jnp.int32)).shape == (0,)
    with pytest.raises(TypeError, match="labels"):
        rnn.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.float32))


def test_fused_linear_cross_entropy_matches_linear_then_optax():
    hidden, labels = _rand((2, 5, 8), 0), jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 13)
    ours = rnn.FusedLinearCrossEntropy(8, 13, chunk_size=5, rngs=nnx.Rngs(0))
    lin = nnx.Linear(8, 13, use_bias=False, rngs=nnx.Rngs(0))
    _same_params(ours, lin)

    class Ref(nnx.Module):
        def __init__(self, lin):
            self.lin = lin

        def __call__(self, h, y):
            return optax.softmax_cross_entropy_with_integer_labels(self.lin(h), y)

    got = ours(hidden, labels)
    want = Ref(lin)(hidden, labels)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    gd, gp = jax.grad(lambda h, m: jnp.sum(m(h, labels) ** 2), argnums=(0, 1))(hidden, ours)
    rd, rp = jax.grad(lambda h, m: jnp.sum(m(h, labels) ** 2), argnums=(0, 1))(hidden, Ref(lin))
    np.testing.assert_allclose(gd, rd, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gp.kernel[...], rp.lin.kernel[...], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="hidden must be"):
        ours(hidden[..., :4], labels)
    # logits_dtype reaches the op: bf16 logits blocks give the op's bf16-logits loss
    narrow = rnn.FusedLinearCrossEntropy(8, 13, chunk_size=5, logits_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    want = rops.fused_linear_cross_entropy(hidden.reshape(10, 8), narrow.kernel[...], labels.reshape(-1),
                                           chunk_size=5, logits_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(narrow(hidden, labels), want.reshape(2, 5))
    assert not np.array_equal(narrow(hidden, labels), got)


def test_rope_attention_exports_with_a_symbolic_sequence_length():
    """MultiHeadAttention(rope_theta=...) under jax.export with symbolic (batch, sequence):
    its RoPE tables are built for the sequence length the call brings, and the exported
    function gives the module's values at two lengths."""
    from jax import export

    m = rnn.MultiHeadAttention(4, 16, num_kv_heads=2, decode=False, rope_theta=10000.0, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    f = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, is_causal=True))
    b, s = export.symbolic_shape("b, s")
    exported = export.export(f)(state, jax.ShapeDtypeStruct((b, s, 16), jnp.float32))
    for shape in ((2, 5, 16), (1, 12, 16)):
        x = _rand(shape, seed=shape[1])
        np.testing.assert_allclose(exported.call(state, x), f(state, x), rtol=1e-5, atol=1e-6)
