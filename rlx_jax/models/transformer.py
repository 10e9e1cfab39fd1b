"""A decoder-only transformer LM as an RLX graph.

tokens [B, S] (i32) -> embedding gather -> L x [RMSNorm -> q,k,v -> NeoX RoPE -> causal
attention -> out proj (+residual); RMSNorm -> SwiGLU MLP (+residual)] -> RMSNorm ->
logits [B, S, V]; loss = mean softmax cross-entropy against labels [B*S] (next tokens,
f32-encoded ids).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlx_jax.ir import Graph
from rlx_jax.models.base import Model, ParamRecorder, dense, mean_cross_entropy


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 96
    seq_len: int = 64
    layers: int = 2
    width: int = 128
    heads: int = 4
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be divisible by heads {self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [seq_len, head_dim/2]: angle(pos, i) = pos * base^(-2i/head_dim)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def transformer_lm(config: TransformerConfig = TransformerConfig()) -> Model:
    shapes: dict = {}
    c = config

    def build(batch: int) -> Graph:
        g = Graph("transformer_lm")
        p = ParamRecorder(g, shapes)
        d, s, hd = c.width, c.seq_len, c.head_dim
        tokens = g.input("tokens", [batch, s], "i32")
        labels = g.input("labels", [batch * s], "f32")
        cos_t, sin_t = rope_tables(s, hd, c.rope_base)
        cos, sin = g.constant(cos_t, name="rope_cos"), g.constant(sin_t, name="rope_sin")

        def norm(x, name):
            return g.rms_norm(x, p(f"{name}.gamma", (d,), "ones"), p(f"{name}.beta", (d,), "zeros"), c.eps)

        x = g.gather(p("embed", (c.vocab_size, d), "normal:0.02"), tokens, 0)  # [B, S, D]
        for i in range(c.layers):
            h = norm(x, f"layer{i}.attn_norm")
            q = g.rope(dense(g, p, h, f"layer{i}.q", d, d, bias=False), cos, sin, hd)
            k = g.rope(dense(g, p, h, f"layer{i}.k", d, d, bias=False), cos, sin, hd)
            v = dense(g, p, h, f"layer{i}.v", d, d, bias=False)
            a = g.attention_kind(q, k, v, c.heads, hd, "causal")
            x = g.add(x, dense(g, p, a, f"layer{i}.o", d, d, bias=False))
            h = norm(x, f"layer{i}.mlp_norm")
            f = d * c.mlp_ratio
            gate = dense(g, p, h, f"layer{i}.gate", d, f, bias=False)
            up = dense(g, p, h, f"layer{i}.up", d, f, bias=False)
            x = g.add(x, dense(g, p, g.mul(g.silu(gate), up), f"layer{i}.down", f, d, bias=False))
        logits = dense(g, p, norm(x, "final_norm"), "head", d, c.vocab_size, bias=False)  # [B, S, V]
        flat = g.reshape(logits, [batch * s, c.vocab_size])
        g.set_outputs([mean_cross_entropy(g, flat, labels), logits])
        return g

    build(1)
    return Model("transformer_lm", config, build, shapes)
