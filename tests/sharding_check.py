"""Run in a subprocess with 8 host CPU devices (tests/test_sharding.py): every fused op
under a sharded ``jit`` must (1) give the single-device values and gradients and
(2) compile without an all-gather of its operands. Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from rlx_jax import ops  # noqa: E402
from rlx_jax.vjp_rules._primitive import fused_ops  # noqa: E402
from rlx_jax.vjp_rules import attention as _attention  # noqa: E402

# attention lowers to XLA's code on the CPU at small sizes; these checks are about the kernels
_attention.CPU_KERNEL_MIN_SCORE_BYTES = 0

MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
rng = np.random.default_rng(0)
_ANGLES = np.arange(12)[:, None] * 0.1 * np.arange(1, 5)
COS, SIN = np.cos(_ANGLES).astype(np.float32), np.sin(_ANGLES).astype(np.float32)  # [S=12, 4]


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# name -> (function of the differentiable args, args, partition specs for the args, diff argnums)
CASES = {
    "rms_norm": (lambda x, g: ops.rms_norm(x, g), (randn(8, 6, 32), randn(32)), (P("data", "model"), P()), (0, 1)),
    # both outputs used: the backward kernel sums the gradient of s into dx
    "add_rms_norm": (lambda x, r, g: (lambda s, y: 0.5 * s + y)(*ops.add_rms_norm(x, r, g)),
                     (randn(8, 6, 32), randn(8, 6, 32), randn(32)), (P("data", "model"), P("data", "model"), P()),
                     (0, 1, 2)),
    # x on its batch axis, the residual on its sequence axis, over one mesh axis: one of the
    # two row factors keeps the mesh axis (the other operand is resharded)
    "add_rms_norm_mixed_specs": (lambda x, r, g: (lambda s, y: 0.5 * s + y)(*ops.add_rms_norm(x, r, g)),
                                 (randn(8, 8, 32), randn(8, 8, 32), randn(32)),
                                 (P("data", None), P(None, "data"), P()), (0, 1, 2)),
    "layer_norm": (lambda x, g, b: ops.layer_norm(x, g, b), (randn(8, 6, 32), randn(32), randn(32)),
                   (P("data", "model"), P(), P()), (0, 1, 2)),
    "group_norm": (lambda x, g, b: ops.group_norm(x, g, b, num_groups=4), (randn(8, 8, 5, 5), randn(8), randn(8)),
                   (P("data"), P(), P()), (0, 1, 2)),
    "softmax": (lambda x: ops.softmax(x, axis=-1), (randn(8, 6, 16),), (P("data", "model"),), (0,)),
    "softmax_cross_entropy": (lambda l: ops.softmax_cross_entropy(l, jnp.arange(16) % 10),
                              (randn(16, 10),), (P("data"),), (0,)),
    # rope: the merged layout with the sequence split, then shard cos/sin like S
    "rope": (lambda x: ops.rope(x, COS, SIN, head_dim=8), (randn(8, 12, 16),), (P("data", "model"),), (0,)),
    # [B, S, H, D] with heads split (tensor parallelism)
    "rope_heads": (lambda x: ops.rope(x, COS, SIN, n_rot=6), (randn(8, 12, 4, 8),),
                   (P("data", None, "model"),), (0,)),
    # merged [B, S, H * D] split on head boundaries (2 heads of 8 per shard)
    "rope_merged_heads": (lambda x: ops.rope(x, COS, SIN, head_dim=8), (randn(8, 12, 32),),
                          (P("data", None, "model"),), (0,)),
    # sequence parallelism: S split, the tables passed sharded the same way
    "rope_seq": (lambda x, c, s: ops.rope(x, c, s), (randn(8, 12, 4, 8), COS, SIN),
                 (P("data", "model"), P("model"), P("model")), (0,)),
    # rope_split: batch and sequence split (a part's heads sit at fixed offsets of the packed
    # axis, so heads stay whole); its gradient is rlx_rope_merge, split the same way
    "rope_split": (lambda x: jnp.concatenate([p * (i + 1) for i, p in enumerate(
                       ops.rope_split(x, COS, SIN, (4, 1, 1), rotate=(True, True, False)))], axis=2),
                   (randn(8, 12, 6, 8),), (P("data", "model"),), (0,)),
    "rope_split_merged": (lambda x: jnp.concatenate(ops.rope_split(x, COS, SIN, (2, 2), rotate=(False, True),
                                                                   head_dim=8), axis=-1),
                          (randn(8, 12, 32),), (P("data"),), (0,)),
    # cumsum flattens the axes before the scanned one into one: split only the first of them
    # (two split leading axes do not flatten without communication)
    "cumsum": (lambda x: ops.cumsum(x, axis=1), (randn(8, 6, 16),), (P("data", None, "model"),), (0,)),
    # batch and heads split
    "attention": (lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"),
                  (randn(8, 12, 4, 8), randn(8, 12, 4, 8), randn(8, 12, 4, 8)),
                  (P("data", None, "model"), P("data", None, "model"), P("data", None, "model")), (0, 1, 2)),
    # grouped kv heads (H = 4 = 2 kv heads x 2): batch and kv-head groups split
    "attention_gqa": (lambda q, k, v, bias: ops.attention(q, k, v, bias=bias, softcap=5.0),
                      (randn(8, 12, 4, 8), randn(8, 12, 2, 8), randn(8, 12, 2, 8), randn(8, 4, 12, 12)),
                      (P("data", None, "model"), P("data", None, "model"), P("data", None, "model"),
                       P("data", "model")), (0, 1, 2, 3)),
    "attention_gqa_causal": (lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"),
                             (randn(8, 12, 8, 8), randn(8, 12, 2, 8), randn(8, 12, 2, 8)),
                             (P("data", None, "model"), P("data", None, "model"), P("data", None, "model")),
                             (0, 1, 2)),
    # the query heads split over a mesh axis that does not divide the kv heads (H = 4 = 2 kv
    # heads x 2, data = 4): the heads are gathered and the kernel runs on whole heads
    "attention_gqa_heads_indivisible": (lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"),
                                        (randn(8, 12, 4, 8), randn(8, 12, 2, 8), randn(8, 12, 2, 8)),
                                        (P("model", None, "data"), P("model"), P("model")), (0, 1, 2)),
    # operands whose sharding no PartitionSpec of the mesh names: a reshape of a dim split
    # 4 ways into [2, n] leaves 2 devices on each new dim (Shardy's sub-axes); the kernels
    # get them resharded. k / v projections of 2 kv heads under 4-way tensor parallelism:
    "rope_kv_heads_sub_axes": (lambda x: ops.rope(x.reshape(8, 12, 2, 8), COS, SIN),
                               (randn(8, 12, 16),), (P("model", None, "data"),), (0,)),
    "attention_kv_heads_sub_axes": (lambda q, k, v: ops.attention(q, k.reshape(8, 12, 2, 8),
                                                                  v.reshape(8, 12, 2, 8), mask_kind="causal"),
                                    (randn(8, 12, 4, 8), randn(8, 12, 16), randn(8, 12, 16)),
                                    (P("model", None, "data"), P("model", None, "data"),
                                     P("model", None, "data")), (0, 1, 2)),
    "rms_norm_sub_axes": (lambda x, g: ops.rms_norm(x.reshape(8, 6, 2, 16), g), (randn(8, 6, 32), randn(16)),
                          (P(None, None, "data"), P()), (0, 1)),
    # multi-query (one kv head): query heads split, k / v whole, their gradients summed
    "attention_mqa": (lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"),
                      (randn(8, 12, 4, 8), randn(8, 12, 1, 8), randn(8, 12, 1, 8)),
                      (P("data", None, "model"), P("data"), P("data")), (0, 1, 2)),
    "gather": (lambda t, idx: ops.gather(t, idx, axis=0),
               (randn(20, 16), rng.integers(0, 20, (8, 6)).astype(np.int32)), (P(), P("data")), (0,)),
    "max_pool2d": (lambda x: ops.max_pool2d(x, kernel_size=(2, 2), stride=(2, 2)), (randn(8, 4, 6, 6),),
                   (P("data", "model"),), (0,)),
    # elementwise: every axis may split, the last (FFN) axis included
    "swiglu": (lambda a, b: ops.swiglu(a, b), (randn(8, 6, 32), randn(8, 6, 32)),
               (P("data", None, "model"), P("data", None, "model")), (0, 1)),
    # one mesh axis over gate's rows and up's columns: it can split one of the two only
    "swiglu_mixed_specs": (lambda a, b: ops.swiglu(a, b), (randn(8, 8), randn(8, 8)),
                           (P("data", None), P(None, "data")), (0, 1)),
    # a Llama MLP under data x tensor parallelism: gate / up projections split over their
    # output (FFN) axis, the down projection over its input axis
    "swiglu_mlp": (lambda h, wg, wu, wd: ops.swiglu(h @ wg, h @ wu) @ wd,
                   (randn(8, 6, 16), randn(16, 32) / 4, randn(16, 32) / 4, randn(32, 16) / 6),
                   (P("data"), P(None, "model"), P(None, "model"), P("model", None)), (0, 1, 2, 3)),
    # the same MLP with swiglu_linear: the product is recomputed shard-local over the FFN axis
    "swiglu_linear_tp": (lambda h, wg, wu, wd: ops.swiglu_linear(h @ wg, h @ wu, wd),
                         (randn(8, 6, 16), randn(16, 32) / 4, randn(16, 32) / 4, randn(32, 16) / 6),
                         (P("data"), P(None, "model"), P(None, "model"), P("model", None)), (0, 1, 2, 3)),
    # a block's q / k / v projections under data x tensor parallelism: rows over data, the
    # weights split over their output axis (column-parallel)
    "rms_norm_linear_tp": (lambda x, g, wq, wk: (lambda q, k: jnp.concatenate([q, k], -1))(
                               *ops.rms_norm_linear(x, g, (wq, wk))),
                           (randn(8, 6, 32), randn(32), randn(32, 16) / 6, randn(32, 8) / 6),
                           (P("data"), P(), P(None, "model"), P(None, "model")), (0, 1, 2, 3)),
    # the residual add too, rows over both mesh axes, the weights replicated (summed gradients)
    "add_rms_norm_linear_rows": (lambda x, r, g, w: (lambda s, o: 0.5 * jnp.sum(s, -1, keepdims=True) + o)(
                                     *ops.add_rms_norm_linear(x, r, g, w)),
                                 (randn(8, 6, 32), randn(8, 6, 32), randn(32), randn(32, 8) / 6),
                                 (P("data", "model"), P("data", "model"), P(), P()), (0, 1, 2, 3)),
    # rows over both mesh axes, the weight replicated: its gradient is summed over the shards
    "swiglu_linear_rows": (lambda a, b, w: ops.swiglu_linear(a, b, w),
                           (randn(8, 6, 32), randn(8, 6, 32), randn(32, 8) / 6),
                           (P("data", "model"), P("data", "model"), P()), (0, 1, 2)),
}


def _gathers(hlo):
    return [line.strip()[:160] for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]


def _compiled(fn, args, specs, fused=True):
    """The sharded jit of fn on args placed by specs: (outputs, compiled HLO text); traced
    with the fused ops on, or off (their pure-JAX maths: the plain JAX baseline)."""
    placed = [jax.device_put(a, NamedSharding(MESH, s)) for a, s in zip(args, specs)]
    with fused_ops(fused):
        jitted = jax.jit(fn)
        out = jitted(*placed)
        hlo = jitted.lower(*placed).compile().as_text()
    return out, hlo


def _rel_err(got, want):
    """Largest error relative to each result's largest magnitude: the shards' partial sums
    are added in another order than one device adds them."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return max(float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(b))), 1.0) for a, b in pairs)


def check(name):
    fn, args, specs, argnums = CASES[name]
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))
    grad = jax.value_and_grad(loss, argnums)
    want = jax.jit(grad)(*args)
    got, hlo = _compiled(grad, args, specs)
    _, plain_hlo = _compiled(grad, args, specs, fused=False)
    kernels = sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', hlo)))
    return {"op": name, "max_err": _rel_err(got, want), "all_gathers": _gathers(hlo),
            "plain_all_gathers": len(_gathers(plain_hlo)), "kernels": kernels}


# ---- a small GPT step under data x tensor parallelism -----------------------------------

GPT = dict(vocab=64, width=32, heads=4, kv_heads=2, head_dim=8, ffn=64, seq=12, batch=8, layers=2)


def _gpt_params():
    c = GPT
    hd, w = c["head_dim"], c["width"]
    layer = lambda: dict(
        norm1=1.0 + 0.1 * randn(w), wq=randn(w, c["heads"] * hd) / 6, wk=randn(w, c["kv_heads"] * hd) / 6,
        wv=randn(w, c["kv_heads"] * hd) / 6, wo=randn(c["heads"] * hd, w) / 6, norm2=1.0 + 0.1 * randn(w),
        w1=randn(w, c["ffn"]) / 6, w3=randn(w, c["ffn"]) / 6, w2=randn(c["ffn"], w) / 8)
    return dict(embed=randn(c["vocab"], w), layers=[layer() for _ in range(c["layers"])],
                norm=1.0 + 0.1 * randn(w), unembed=randn(w, c["vocab"]) / 6)


def _gpt_specs(params):
    """Megatron tensor parallelism over "model": q / k / v and the MLP's up projections split
    over their output axis (whole heads, FFN columns), wo and w2 over their input axis, the
    unembedding over the vocabulary; norms and the embedding replicated."""
    split_out, split_in = P(None, "model"), P("model", None)
    layer = dict(norm1=P(), wq=split_out, wk=split_out, wv=split_out, wo=split_in, norm2=P(),
                 w1=split_out, w3=split_out, w2=split_in)
    return dict(embed=P(), layers=[layer] * len(params["layers"]), norm=P(), unembed=split_out)


def _gpt_loss(params, tokens, labels):
    """rms_norm -> q, k, v -> rope [B, S, H, D] -> causal GQA attention -> wo; rms_norm ->
    SwiGLU; final rms_norm, logits, optax-style cross-entropy (plain JAX)."""
    c = GPT
    b, s = tokens.shape
    hd = c["head_dim"]
    ang = np.arange(s)[:, None] / 10000.0 ** (np.arange(hd // 2) / (hd // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    x = params["embed"][tokens]
    for p in params["layers"]:
        h = ops.rms_norm(x, p["norm1"])
        q = (h @ p["wq"]).reshape(b, s, c["heads"], hd)
        k = (h @ p["wk"]).reshape(b, s, c["kv_heads"], hd)
        v = (h @ p["wv"]).reshape(b, s, c["kv_heads"], hd)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        o = ops.attention(q, k, v, mask_kind="causal")
        x = x + o.reshape(b, s, c["heads"] * hd) @ p["wo"]
        h = ops.rms_norm(x, p["norm2"])
        x = x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
    logits = ops.rms_norm(x, params["norm"]) @ params["unembed"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def check_gpt_step():
    """Loss and gradients of the GPT under DP (batch over "data") x TP ("model"): equal to
    one device, and no more all-gathers than the same step in plain JAX."""
    params = _gpt_params()
    tokens = rng.integers(0, GPT["vocab"], (GPT["batch"], GPT["seq"])).astype(np.int32)
    labels = np.roll(tokens, -1, axis=1)
    step = jax.value_and_grad(_gpt_loss)
    want = jax.jit(step)(params, tokens, labels)
    specs = (_gpt_specs(params), P("data"), P("data"))
    leaves, tree = jax.tree.flatten((params, tokens, labels))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    flat = lambda *a: step(*jax.tree.unflatten(tree, a))
    got, hlo = _compiled(flat, leaves, spec_leaves)
    _, plain_hlo = _compiled(flat, leaves, spec_leaves, fused=False)
    kernels = sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', hlo)))
    return {"op": "gpt_step", "max_err": _rel_err(got, want), "all_gathers": _gathers(hlo),
            "plain_all_gathers": len(_gathers(plain_hlo)), "kernels": kernels}


def check_train_step():
    """The data-parallel transformer step: batch split over 8 devices."""
    from rlx_jax.models import TransformerConfig, transformer_lm
    from rlx_jax.train.loop import TrainConfig, data_mesh, make_optimizer, make_step

    model = transformer_lm(TransformerConfig(seq_len=16, layers=1, width=32, heads=2))
    step = make_step(model.build(16), make_optimizer(TrainConfig(steps=10)), True, data_mesh(8))
    hlo = step.as_text()
    kernels = sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', hlo)))
    return {"op": "train_step", "max_err": 0.0, "all_gathers": _gathers(hlo), "plain_all_gathers": 0,
            "kernels": kernels}


CHECKS = {"train_step": check_train_step, "gpt_step": check_gpt_step}


if __name__ == "__main__":
    for name in (sys.argv[1:] or [*CASES, *CHECKS]):
        try:
            print(json.dumps(CHECKS[name]() if name in CHECKS else check(name)), flush=True)
        except Exception as exc:  # reported, the test fails on it
            print(json.dumps({"op": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
