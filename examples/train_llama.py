"""Train a small Llama-style decoder, written in plain JAX, with rlx_jax's fused ops.

    python examples/train_llama.py                  # 400 steps (a few minutes on 2 CPU cores)
    python examples/train_llama.py --lean           # the ops that keep fewer activations
    RLX_JAX_QUICK=1 python examples/train_llama.py  # 60 steps of a smaller model

The model is a function of a dict of arrays, as a JAX user writes one: token embedding,
pre-norm blocks (RMSNorm, grouped-query causal attention with RoPE, a SwiGLU MLP) and an
output projection with the mean cross-entropy. Each piece is an ``rlx_jax.ops`` call:

- ``gather`` for the embedding (a race-free backward: the step is bitwise reproducible);
- ``add_rms_norm``: the residual add and the norm after it, one backward kernel for both;
- q, k and v from one product over packed weights, split and rotated by ``rope_split``;
- ``attention`` (causal, 8 query heads on 2 kv heads);
- ``swiglu`` (one backward kernel) before the down projection;
- ``fused_linear_cross_entropy``: the head without the [tokens, vocab] logits.

``--lean`` takes ``add_rms_norm_linear`` / ``rms_norm_linear`` (a norm with the products
that read it) and ``swiglu_linear`` (the SwiGLU with the down projection) instead: their
backward writes the norm's output and the SwiGLU product again rather than keeping them
(docs/PERFORMANCE.md measures both on an H200: about a third of a layer's kept activations
for 0.5-1 % of the step).

Training: AdamW (optax) on f32 master weights; the step computes in bf16 on GPUs and in
f32 on the CPU (``--dtype``). The data are the characters of Python's standard library
(``rlx_jax.train.data``). The script asserts that the held-out loss ends below the unigram
baseline, the loss of a model that ignores context.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlx_jax import ops
from rlx_jax.models.transformer import rope_tables
from rlx_jax.train import data
from rlx_jax.train.loop import TrainConfig, make_optimizer

QUICK = os.environ.get("RLX_JAX_QUICK") == "1"


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 2 if QUICK else 4
    width: int = 64 if QUICK else 128
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 176 if QUICK else 352
    seq: int = 64 if QUICK else 128
    batch: int = 16 if QUICK else 32
    steps: int = 60 if QUICK else 400
    lr: float = 3e-3
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def init_params(cfg: Config, vocab: int, key) -> dict:
    """f32 master weights: normal(0, 1 / sqrt(fan_in)) matrices, unit norm scales."""
    hd = cfg.head_dim
    shapes = {"embed": (vocab, cfg.width), "final_norm": (cfg.width,), "head": (cfg.width, vocab)}
    for i in range(cfg.layers):
        shapes |= {f"l{i}.attn_norm": (cfg.width,), f"l{i}.mlp_norm": (cfg.width,),
                   f"l{i}.wqkv": (cfg.width, (cfg.heads + 2 * cfg.kv_heads) * hd),
                   f"l{i}.wo": (cfg.heads * hd, cfg.width), f"l{i}.w_gate": (cfg.width, cfg.ffn),
                   f"l{i}.w_up": (cfg.width, cfg.ffn), f"l{i}.w_down": (cfg.ffn, cfg.width)}
    keys = dict(zip(sorted(shapes), jax.random.split(key, len(shapes))))
    return {name: (jnp.ones(shape) if len(shape) == 1 else
                   jax.random.normal(keys[name], shape) / math.sqrt(shape[0] if name != "embed" else 1.0))
            for name, shape in shapes.items()}


def make_loss(cfg: Config, lean: bool, dtype):
    """loss(params, tokens [B, S] int32, labels [B * S] int32) -> mean cross-entropy (f32),
    computed in ``dtype`` from the f32 master weights."""
    cos, sin = (jnp.asarray(t) for t in rope_tables(cfg.seq, cfg.head_dim, 10000.0))
    hd, eps = cfg.head_dim, cfg.eps

    def norm_proj(x, branch, gamma, w):
        """The residual stream after adding ``branch`` (None: nothing to add) and its norm
        times each weight of ``w``."""
        if lean:
            if branch is None:
                return x, ops.rms_norm_linear(x, gamma, w, eps=eps)
            return ops.add_rms_norm_linear(x, branch, gamma, w, eps=eps)
        x, y = (x, ops.rms_norm(x, gamma, eps=eps)) if branch is None else ops.add_rms_norm(x, branch, gamma, eps=eps)
        return x, tuple(y @ wi for wi in w) if isinstance(w, tuple) else y @ w

    def mlp(gate, up, w_down):
        return ops.swiglu_linear(gate, up, w_down) if lean else ops.swiglu(gate, up) @ w_down

    def loss(params, tokens, labels):
        p = jax.tree.map(lambda a: a.astype(dtype), params)
        b, s = tokens.shape
        x = ops.gather(p["embed"], tokens, axis=0)  # [B, S, D]
        branch = None  # the last block's output, not yet added to the stream x
        for i in range(cfg.layers):
            x, qkv = norm_proj(x, branch, p[f"l{i}.attn_norm"], p[f"l{i}.wqkv"])
            q, k, v = ops.rope_split(qkv.reshape(b, s, cfg.heads + 2 * cfg.kv_heads, hd), cos, sin,
                                     (cfg.heads, cfg.kv_heads, cfg.kv_heads), rotate=(True, True, False))
            attn = ops.attention(q, k, v, mask_kind="causal").reshape(b, s, cfg.heads * hd)
            x, (gate, up) = norm_proj(x, attn @ p[f"l{i}.wo"], p[f"l{i}.mlp_norm"],
                                      (p[f"l{i}.w_gate"], p[f"l{i}.w_up"]))
            branch = mlp(gate, up, p[f"l{i}.w_down"])
        _, h = ops.add_rms_norm(x, branch, p["final_norm"], eps=eps)
        logits_dtype = dtype if dtype == jnp.bfloat16 else None  # bf16 blocks, as a bf16 h @ w
        return ops.fused_linear_cross_entropy(h.reshape(b * s, cfg.width), p["head"], labels, reduction="mean",
                                              logits_dtype=logits_dtype)  # a reduced loss comes back in f32

    return loss


def make_step(loss, optimizer):
    @jax.jit
    def step(params, opt_state, tokens, labels):
        value, grads = jax.value_and_grad(loss)(params, tokens, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def heldout_loss(loss, params, corpus, cfg: Config, batches: int = 8) -> float:
    rng = np.random.default_rng(1)
    fn = jax.jit(loss)
    values = []
    for _ in range(batches):
        tokens, labels = corpus.batch(rng, cfg.batch, cfg.seq, split="heldout")
        values.append(float(fn(params, tokens, labels.astype(np.int32))))
    return float(np.mean(values))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lean", action="store_true", help="the ops that keep fewer activations")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="compute dtype (default: bfloat16 on GPUs, float32 elsewhere)")
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args(argv)
    cfg = Config() if a.steps is None else dataclasses.replace(Config(), steps=a.steps)
    if cfg.steps < 1:
        ap.error("--steps must be positive")
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(a.dtype or ("bfloat16" if gpu else "float32"))

    corpus = data.stdlib_corpus(max_chars=300_000 if QUICK else 3_000_000)
    vocab = len(data.VOCAB)
    params = init_params(cfg, vocab, jax.random.PRNGKey(0))
    # rlx-jax train's optimiser: AdamW, gradients clipped to norm 1, a linear warm-up over a tenth
    # of the run, then cosine decay to lr / 10 (a decay that stays positive for any step count)
    optimizer = make_optimizer(TrainConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.steps // 10, weight_decay=0.01,
                                           clip=1.0))
    opt_state = optimizer.init(params)
    loss = make_loss(cfg, a.lean, dtype)
    step = make_step(loss, optimizer)

    print(f"{cfg.layers} layers, width {cfg.width}, {cfg.heads} / {cfg.kv_heads} heads, seq {cfg.seq}, "
          f"batch {cfg.batch}, {dtype.name} compute, {'lean' if a.lean else 'default'} ops, "
          f"{jax.devices()[0].device_kind}")
    rng = np.random.default_rng(0)
    tokens_per_step = cfg.batch * cfg.seq
    t0, timed_steps, value = None, 0, None
    for i in range(cfg.steps):
        tokens, labels = corpus.batch(rng, cfg.batch, cfg.seq)
        params, opt_state, value = step(params, opt_state, tokens, labels.astype(np.int32))
        if i == 0:
            jax.block_until_ready(value)  # the first step compiles: time the others
            t0 = time.perf_counter()
        else:
            timed_steps += 1
        if i % max(1, cfg.steps // 10) == 0 or i == cfg.steps - 1:
            value = float(value)  # waits for the step (dispatch is asynchronous)
            rate = (f"{timed_steps * tokens_per_step / (time.perf_counter() - t0):,.0f} tokens/s" if timed_steps
                    else "(compiled)")
            print(f"step {i:5d}  loss {value:.4f}  {rate}")
    heldout, unigram = heldout_loss(loss, params, corpus, cfg), corpus.unigram_entropy()
    print(f"held-out loss {heldout:.4f} nats/char (unigram baseline {unigram:.4f})")
    if not heldout < unigram:
        raise SystemExit(f"held-out loss {heldout:.4f} did not fall below the unigram baseline {unigram:.4f}")
    return {"train_loss": float(value), "heldout_loss": heldout, "unigram": unigram}


if __name__ == "__main__":
    main()
