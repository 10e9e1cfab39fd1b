"""Run in a subprocess with 8 host CPU devices (tests/test_parallel_strategies.py): one GPT
training step (loss and parameter gradients) under the sharding strategies DP, DP x TP,
DP x SP, FSDP and CP, written once with rlx_jax.ops and once in plain JAX. Each is
compared with the single-device result, and the collectives of its compiled HLO are
counted. Prints one JSON line per strategy."""

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
from rlx_jax.parallel import collective_lines, context_parallel_attention, count_collectives  # noqa: E402
from rlx_jax.parallel import zigzag_permutation  # noqa: E402
from rlx_jax.vjp_rules import attention as _attention  # noqa: E402

# attention lowers to XLA's code on the CPU at small sizes; these checks are about the kernels
_attention.CPU_KERNEL_MIN_SCORE_BYTES = 0

B, S, D, H, HKV, HD, F, V = 8, 16, 32, 4, 2, 8, 64, 64




def init_params(seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[0]))
    g = lambda n: jnp.asarray(1.0 + 0.1 * rng.standard_normal(n).astype(np.float32))
    return {"embed": w(V, D) * 4.0, "ln1": g(D), "wq": w(D, H * HD), "wk": w(D, HKV * HD), "wv": w(D, HKV * HD),
            "wo": w(H * HD, D), "ln2": g(D), "wg": w(D, F), "wu": w(D, F), "wd": w(F, D), "lnf": g(D),
            "wout": w(D, V)}


def rope_tables(positions):
    inv = 10000.0 ** (-np.arange(0, HD, 2) / HD)
    ang = np.asarray(positions)[:, None] * inv[None]
    return jnp.asarray(np.cos(ang).astype(np.float32)), jnp.asarray(np.sin(ang).astype(np.float32))


# ---- the two implementations of the step's ops --------------------------------------


def plain_rms_norm(x, g, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g


def plain_rope(x, cos, sin):
    """NeoX RoPE of x [B, S, H * HD] (two rotating halves per head)."""
    b, s, w = x.shape
    x = x.reshape(b, s, w // HD, HD)
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    c, t = cos[None, :, None], sin[None, :, None]
    return jnp.concatenate([x1 * c - x2 * t, x2 * c + x1 * t], axis=-1).reshape(b, s, w)


def plain_attention(q, k, v, positions):
    """Causal GQA attention, q [B, S, H, HD], k, v [B, S, HKV, HD]; query i sees key j when
    positions[j] <= positions[i] (positions: the tokens' places in the sequence)."""
    g = H // HKV
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
    pos = jnp.asarray(positions)
    s = jnp.where(pos[None, :] <= pos[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def plain_cross_entropy(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[:, None], axis=1)[:, 0]


def gpt_loss(params, tokens, labels, cos, sin, *, fused, attention):
    """Mean next-token cross-entropy of a 1-layer GPT: embedding -> RMSNorm -> q, k, v ->
    RoPE -> causal GQA attention -> out proj (+res) -> RMSNorm -> SwiGLU (+res) -> RMSNorm
    -> logits [B*S, V] -> cross-entropy."""
    norm = ops.rms_norm if fused else plain_rms_norm
    rope = (lambda x: ops.rope(x, cos, sin, head_dim=HD)) if fused else (lambda x: plain_rope(x, cos, sin))
    b, s = tokens.shape
    x = jnp.take(params["embed"], tokens, axis=0)
    h = norm(x, params["ln1"])
    q = rope(h @ params["wq"]).reshape(b, s, H, HD)
    k = rope(h @ params["wk"]).reshape(b, s, HKV, HD)
    v = (h @ params["wv"]).reshape(b, s, HKV, HD)
    x = x + attention(q, k, v).reshape(b, s, H * HD) @ params["wo"]
    h = norm(x, params["ln2"])
    x = x + (jax.nn.silu(h @ params["wg"]) * (h @ params["wu"])) @ params["wd"]
    logits = (norm(x, params["lnf"]) @ params["wout"]).reshape(b * s, V)
    ce = ops.softmax_cross_entropy if fused else plain_cross_entropy
    return jnp.mean(ce(logits, labels.reshape(-1)))


# ---- strategies: mesh, parameter specs, input spec, attention ------------------------------

TP = {"wq": P(None, "model"), "wk": P(None, "model"), "wv": P(None, "model"), "wo": P("model", None),
      "wg": P(None, "model"), "wu": P(None, "model"), "wd": P("model", None), "wout": P(None, "model")}


def strategy(name):
    """(mesh, {param: spec}, tokens spec, cp axis or None)."""
    devs = np.array(jax.devices())
    if name == "dp":
        return Mesh(devs, ("data",)), {}, P("data"), None
    if name == "dp_tp":
        return Mesh(devs.reshape(4, 2), ("data", "model")), TP, P("data"), None
    if name == "dp_sp":
        return Mesh(devs.reshape(4, 2), ("data", "seq")), {}, P("data", "seq"), None
    if name == "fsdp":  # every parameter split along its first axis, gathered for its matmul
        return Mesh(devs, ("data",)), {k: P("data") for k in init_params()}, P("data"), None
    if name == "cp":
        return Mesh(devs.reshape(2, 4), ("data", "cp")), {}, P("data", "cp"), "cp"
    raise ValueError(name)


def run(name, fused, want):
    mesh, pspecs, tspec, cp = strategy(name)
    params = init_params()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (B, S)).astype(np.int32)
    labels = rng.integers(0, V, (B, S)).astype(np.int32)
    positions = np.arange(S)
    if cp:  # the sequence in zig-zag order end to end: tokens, labels and RoPE positions
        positions = zigzag_permutation(S, mesh.shape[cp])
        tokens, labels = tokens[:, positions], labels[:, positions]
    cos, sin = rope_tables(positions)
    if fused and cp:
        attention = lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh, axis_name=cp, mask_kind="causal",
                                                               batch_axis="data", zigzag=True)
    elif fused:
        attention = lambda q, k, v: ops.attention(q, k, v, mask_kind="causal")
    else:
        attention = lambda q, k, v: plain_attention(q, k, v, positions)
    loss = lambda p, t, l: gpt_loss(p, t, l, cos, sin, fused=fused, attention=attention)
    shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    placed_params = {k: shard(v, pspecs.get(k, P())) for k, v in params.items()}
    args = (placed_params, shard(tokens, tspec), shard(labels, tspec))
    step = jax.jit(jax.value_and_grad(loss))
    got = step(*args)
    hlo = step.lower(*args).compile().as_text()
    err = max(float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(b))), 1.0)
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    kernels = sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', hlo)))
    gathers = [line[:200] for line in collective_lines(hlo, "all-gather")]
    return {"max_err": err, "collectives": count_collectives(hlo), "kernels": kernels, "all_gathers": gathers}


def single_device(fused):
    params = init_params()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (B, S)).astype(np.int32)
    labels = rng.integers(0, V, (B, S)).astype(np.int32)
    cos, sin = rope_tables(np.arange(S))
    attention = ((lambda q, k, v: ops.attention(q, k, v, mask_kind="causal")) if fused
                 else (lambda q, k, v: plain_attention(q, k, v, np.arange(S))))
    loss = lambda p: gpt_loss(p, tokens, labels, cos, sin, fused=fused, attention=attention)
    return jax.jit(jax.value_and_grad(loss))(params)


STRATEGIES = ("dp", "dp_tp", "dp_sp", "fsdp", "cp")

if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")
    names = sys.argv[1:] or STRATEGIES
    want = {fused: single_device(fused) for fused in (True, False)}
    ref_gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(want[True]),
                                                                 jax.tree.leaves(want[False])))
    print(json.dumps({"strategy": "single_device", "rlx_vs_plain": ref_gap}), flush=True)
    for name in names:
        row = {"strategy": name}
        for fused, key in ((True, "rlx"), (False, "plain")):
            try:
                row[key] = run(name, fused, want[fused])
            except Exception as e:  # reported, and failed, by the test
                row[key] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
