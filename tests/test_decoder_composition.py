"""A whole Llama-style decoder written with rlx_jax.ops, against the same decoder in plain
JAX, in the forms users train it in: layers in a Python loop, layers stacked and run by
``lax.scan``, the scanned layer under ``jax.checkpoint``, the loss vmapped over
independent batches, and per-example gradients (vmap of the gradient). Each op has its own tests under scan / remat / vmap; here they meet:
the embedding gather feeds add_rms_norm_linear, one q / k / v product split and rotated by
rope_split feeds grouped-query causal attention, swiglu_linear closes the MLP, and the
fused linear + cross-entropy head takes the last norm's output. Loss and every parameter's
gradient must agree with the plain model (f64: to rounding; f32: the ops' CPU kernels, to
a few f32 roundings through three layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax.ops as rops
from rlx_jax.models.transformer import rope_tables
from rlx_jax.vjp_rules import attention as _attention
from testutil import platform

# 3 layers, width 24, 4 query heads on 2 kv heads of 6, ffn 20, vocab 37, batch 2 x seq 11:
# sizes off every kernel's vector width, a sequence shorter than any attention tile
LAYERS, WIDTH, HEADS, KV, HD, FFN, VOCAB, B, S = 3, 24, 4, 2, 6, 20, 37, 2, 11
EPS = 1e-5
# the fused ops this model must run through (their primitives' names in the jaxpr)
FUSED = ("rlx_gather_fwd", "rlx_gather_bwd", "rlx_rms_norm_linear_fwd", "rlx_add_rms_norm_bwd", "rlx_rope_split",
         "rlx_rope_merge", "rlx_attention_fwd", "rlx_attention_bwd", "rlx_swiglu_linear_fwd", "rlx_swiglu_bwd_product",
         "rlx_fused_linear_ce_reduced")
# the kernels (FFI targets) those primitives lower to on the CPU at these sizes; attention's
# only when forced (``cpu_attention``)
KERNELS = ("rlx_gather_bwd_v1", "rlx_rms_norm_fwd_v2", "rlx_add_rms_norm_bwd_v1", "rlx_rope_split_v1",
           "rlx_rope_merge_v1", "rlx_swiglu_bwd_product_v1", "rlx_softmax_ce_loss_grad_v1")


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(params=["xla", "kernel"])
def cpu_attention(request, monkeypatch):
    """The CPU's attention path: XLA's code (what these sizes take outside the tests) or the
    CPU kernel; on other platforms the setting does nothing."""
    monkeypatch.setattr(_attention, "CPU_KERNEL_MIN_SCORE_BYTES", 0 if request.param == "kernel" else 1 << 62)
    return request.param


def init(dtype, seed=0):
    """Stacked layer parameters [LAYERS, ...] and the unstacked rest."""
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    n = lambda shape, scale: (scale * jax.random.normal(next(ks), shape, jnp.float64)).astype(dtype)  # noqa: E731
    qkv = (HEADS + 2 * KV) * HD
    layers = {
        "attn_norm": 1 + n((LAYERS, WIDTH), 0.1),
        "wqkv": n((LAYERS, WIDTH, qkv), WIDTH ** -0.5),
        "wo": n((LAYERS, HEADS * HD, WIDTH), (HEADS * HD) ** -0.5),
        "mlp_norm": 1 + n((LAYERS, WIDTH), 0.1),
        "w_gate": n((LAYERS, WIDTH, FFN), WIDTH ** -0.5),
        "w_up": n((LAYERS, WIDTH, FFN), WIDTH ** -0.5),
        "w_down": n((LAYERS, FFN, WIDTH), FFN ** -0.5),
    }
    rest = {"embed": n((VOCAB, WIDTH), 0.5), "final_norm": 1 + n((WIDTH,), 0.1),
            "head": n((WIDTH, VOCAB), WIDTH ** -0.5)}
    return {"layers": layers, **rest}


def data(seed=1, batch=B):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, VOCAB, size=(batch, S)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, VOCAB, size=(batch * S,)), jnp.int32)
    return tokens, labels


# ---- the plain model (the reference) -------------------------------------------------------


def _norm(x, g):
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
    return (y * g).astype(x.dtype)


def _rotate(x, cos, sin):
    """NeoX halves of x [B, S, H, D] with tables [S, D / 2]."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _attend(q, k, v):
    """Causal grouped-query attention, softmax over keys, q [B, S, H, D], k / v [B, S, KV, D]."""
    k, v = (jnp.repeat(t, HEADS // KV, axis=2) for t in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HD ** -0.5
    causal = jnp.tril(jnp.ones((S, S), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def plain_layer(p, x, branch, cos, sin):
    """One pre-norm block; the residual add of the previous block's output happens here."""
    b = x.shape[0]
    x = x + branch
    qkv = (_norm(x, p["attn_norm"]) @ p["wqkv"]).reshape(b, S, HEADS + 2 * KV, HD)
    q, k, v = jnp.split(qkv, [HEADS, HEADS + KV], axis=2)
    o = _attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v).reshape(b, S, HEADS * HD) @ p["wo"]
    x = x + o
    h = _norm(x, p["mlp_norm"])
    return x, (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def plain_head(params, x, branch, labels):
    h = _norm(x + branch, params["final_norm"]).reshape(-1, WIDTH)
    logits = h @ params["head"]
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0])


# ---- the same model through rlx_jax.ops ----------------------------------------------------


def rlx_layer(p, x, branch, cos, sin):
    x, (qkv,) = rops.add_rms_norm_linear(x, branch, p["attn_norm"], (p["wqkv"],), eps=EPS)
    qkv = qkv.reshape(x.shape[0], S, HEADS + 2 * KV, HD)
    q, k, v = rops.rope_split(qkv, cos, sin, (HEADS, KV, KV), rotate=(True, True, False))
    o = rops.attention(q, k, v, mask_kind="causal").reshape(x.shape[0], S, HEADS * HD) @ p["wo"]
    x, (gate, up) = rops.add_rms_norm_linear(x, o, p["mlp_norm"], (p["w_gate"], p["w_up"]), eps=EPS)
    return x, rops.swiglu_linear(gate, up, p["w_down"])


def rlx_head(params, x, branch, labels):
    _, h = rops.add_rms_norm(x, branch, params["final_norm"], eps=EPS)
    h = h.reshape(-1, WIDTH)
    return rops.fused_linear_cross_entropy(h, params["head"], labels, reduction="mean")


def make_loss(layer, head, embed, form):
    """loss(params, tokens, labels) with the layers run in ``form``: "loop", "scan" or
    "scan-remat" (each scanned layer under jax.checkpoint, saving nothing)."""

    def loss(params, tokens, labels):
        cos, sin = (jnp.asarray(t, params["embed"].dtype) for t in rope_tables(S, HD, 10000.0))
        x = embed(params["embed"], tokens)
        branch = jnp.zeros_like(x)
        stacked = params["layers"]
        body = lambda carry, p: (layer(p, *carry, cos, sin), None)  # noqa: E731
        if form == "loop":
            carry = (x, branch)
            for i in range(LAYERS):
                carry, _ = body(carry, jax.tree.map(lambda a: a[i], stacked))
        else:
            if form == "scan-remat":
                body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
            carry, _ = jax.lax.scan(body, (x, branch), stacked)
        x, branch = carry
        return head(params, x, branch, labels)

    return loss


PLAIN = dict(layer=plain_layer, head=plain_head, embed=lambda t, i: jnp.take(t, i, axis=0))
RLX = dict(layer=rlx_layer, head=rlx_head, embed=lambda t, i: rops.gather(t, i, axis=0))


def _check_lowering(fn, args, cpu_attention):
    """fn's jaxpr holds every fused primitive, forward and backward; on the CPU its
    lowering calls their kernels (attention's as ``cpu_attention`` says)."""
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    missing = [name for name in FUSED if name not in jaxpr]
    assert not missing, missing
    if platform() == "cpu":
        text = jax.jit(fn).lower(*args).as_text()
        missing = [name for name in KERNELS if name not in text]
        assert not missing, missing
        assert ("rlx_attention_fwd_v1" in text) == (cpu_attention == "kernel")


def _compare(got, want, rtol):
    (g_loss, g_grads), (w_loss, w_grads) = got, want
    np.testing.assert_allclose(float(g_loss), float(w_loss), rtol=rtol)
    flat_g, tree_g = jax.tree.flatten(g_grads)
    flat_w, tree_w = jax.tree.flatten(w_grads)
    assert tree_g == tree_w
    for path, a, b in zip(jax.tree_util.tree_flatten_with_path(g_grads)[0], flat_g, flat_w):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err < rtol, (jax.tree_util.keystr(path[0]), err)


@pytest.mark.parametrize("form", ["loop", "scan", "scan-remat"])
def test_decoder_gradients_match_plain_jax_f64(x64, cpu_attention, form):
    params, (tokens, labels) = init(jnp.float64), data()
    ours = jax.value_and_grad(make_loss(**RLX, form=form))
    _check_lowering(ours, (params, tokens, labels), cpu_attention)
    want = jax.value_and_grad(make_loss(**PLAIN, form="loop"))(params, tokens, labels)
    _compare(jax.jit(ours)(params, tokens, labels), want, rtol=1e-10)


def test_decoder_f32_kernels_scan_remat(x64, cpu_attention):
    """f32: the ops' f32 kernels, in the scanned, rematerialised form, against the plain
    model in f64."""
    params, (tokens, labels) = init(jnp.float32), data(seed=2)
    fn = jax.value_and_grad(make_loss(**RLX, form="scan-remat"))
    _check_lowering(fn, (params, tokens, labels), cpu_attention)
    ours = jax.jit(fn)(params, tokens, labels)
    assert ours[0].dtype == jnp.float32
    p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    want = jax.value_and_grad(make_loss(**PLAIN, form="loop"))(p64, tokens, labels)
    _compare(ours, want, rtol=2e-5)


def test_decoder_vmapped_over_batches(x64, cpu_attention):
    """vmap of the loss over two independent token batches (the per-batch losses and their
    summed gradient), the layers scanned."""
    params = init(jnp.float64, seed=3)
    (t0, l0), (t1, l1) = data(seed=4), data(seed=5)
    tokens, labels = jnp.stack([t0, t1]), jnp.stack([l0, l1])

    def total(loss):
        return lambda p, t, l: jnp.sum(jax.vmap(loss, in_axes=(None, 0, 0))(p, t, l))  # noqa: E741

    fn = jax.value_and_grad(total(make_loss(**RLX, form="scan")))
    _check_lowering(fn, (params, tokens, labels), cpu_attention)
    got = jax.jit(fn)(params, tokens, labels)
    want = jax.value_and_grad(total(make_loss(**PLAIN, form="loop")))(params, tokens, labels)
    _compare(got, want, rtol=1e-10)


def test_decoder_per_example_gradients(x64, cpu_attention):
    """vmap of the gradient (per-example gradients, as for clipping or influence): every
    backward primitive batched, the fused head's per-element gradients included."""
    params = init(jnp.float64, seed=6)
    (t0, l0), (t1, l1) = data(seed=7), data(seed=8)
    tokens, labels = jnp.stack([t0, t1]), jnp.stack([l0, l1])

    def per_example(loss):
        return jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, 0))

    fn = per_example(make_loss(**RLX, form="scan"))
    _check_lowering(fn, (params, tokens, labels), cpu_attention)
    got = jax.jit(fn)(params, tokens, labels)
    want = per_example(make_loss(**PLAIN, form="loop"))(params, tokens, labels)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-10)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12)

