"""The two training tasks of ``rlx-jax train``: the character LM and digit classification."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlx_jax.lowering import to_jax
from rlx_jax.models import CNNConfig, MLPConfig, TransformerConfig, cnn, mlp, transformer_lm
from rlx_jax.train import data
from rlx_jax.train.loop import TrainConfig, run_steps


def train_lm(cfg: TrainConfig, model_cfg: TransformerConfig, corpus: data.CharCorpus | None = None) -> dict:
    corpus = corpus or data.stdlib_corpus()
    model = transformer_lm(model_cfg)
    graph = model.build(cfg.batch_size)
    forward = jax.jit(to_jax(graph))  # held-out loss in f32 on the master weights, whatever the step's precision
    s = model_cfg.seq_len

    def batch_fn(rng):
        tokens, labels = corpus.batch(rng, cfg.batch_size, s)
        return {"tokens": tokens, "labels": labels}

    def evaluate(params):
        rng = np.random.default_rng((cfg.seed, 10**9))  # the same held-out batches every time
        losses = [float(forward(params, {"tokens": t, "labels": l})[0])
                  for t, l in (corpus.batch(rng, cfg.batch_size, s, "heldout") for _ in range(cfg.eval_batches))]
        return {"heldout_loss": float(np.mean(losses))}

    record = run_steps(
        name="transformer_lm", graph=graph, model=model, cfg=cfg, batch_fn=batch_fn, evaluate=evaluate,
        tokens_per_step=cfg.batch_size * s,
        meta_extra={"config": vars(model_cfg) | {"num_params": model.num_params()},
                    "unigram_baseline": corpus.unigram_entropy(), "corpus": corpus.source},
    )
    prompt = data.decode(corpus.heldout[:s])
    record["sample_prompt"] = prompt
    record["sample"] = generate(model, record["params"], prompt, 240, seed=cfg.seed)
    return record


def generate(model, params, prompt: str, length: int, *, temperature: float = 0.8, seed: int = 0) -> str:
    """Sample ``length`` characters after ``prompt`` (at least seq_len characters are
    kept as context; causal attention lets the last position's logits be read from a
    full window)."""
    s = model.config.seq_len
    forward = jax.jit(to_jax(model.build(1)))
    ids = list(data.encode(prompt)[-s:])
    ids = [data.VOCAB.index(" ")] * (s - len(ids)) + ids
    rng = np.random.default_rng(seed)
    out = []
    dummy = np.zeros(s, np.float32)
    for _ in range(length):
        window = np.asarray(ids[-s:], np.int32)[None, :]
        logits = np.asarray(forward(params, {"tokens": window, "labels": dummy})[1][0, -1], np.float64)
        p = np.exp((logits - logits.max()) / temperature)
        nxt = int(rng.choice(len(p), p=p / p.sum()))
        ids.append(nxt)
        out.append(nxt)
    return data.decode(out)


def train_classifier(cfg: TrainConfig, kind: str = "cnn") -> dict:
    x_tr, y_tr, x_te, y_te = data.digits()
    if kind == "cnn":
        model = cnn(CNNConfig())
    elif kind == "mlp":
        model = mlp(MLPConfig())
        x_tr, x_te = x_tr.reshape(len(x_tr), -1), x_te.reshape(len(x_te), -1)
    else:
        raise ValueError(f"unknown classifier {kind!r} (cnn or mlp)")
    graph = model.build(cfg.batch_size)
    test_forward = jax.jit(to_jax(model.build(len(x_te))))

    def batch_fn(rng):
        idx = rng.integers(0, len(x_tr), size=cfg.batch_size)
        return {"x": x_tr[idx], "labels": y_tr[idx].astype(np.float32)}

    def evaluate(params):
        loss, logits = test_forward(params, {"x": x_te, "labels": y_te.astype(np.float32)})
        acc = float(jnp.mean(jnp.argmax(logits, axis=-1) == y_te))
        return {"test_loss": float(loss), "test_accuracy": acc}

    return run_steps(
        name=kind, graph=graph, model=model, cfg=cfg, batch_fn=batch_fn, evaluate=evaluate,
        tokens_per_step=cfg.batch_size,
        meta_extra={"config": vars(model.config) | {"num_params": model.num_params()}, "dataset": "sklearn digits"},
    )
