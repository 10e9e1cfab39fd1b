"""One training step of a Llama-style decoder, plain JAX against rlx_jax's fused ops.

The model is written the way JAX users write one: plain functions over a dict of
parameters (token embedding, L x [RMSNorm -> q, k, v -> NeoX RoPE -> grouped-query causal
attention -> output projection (+ residual); RMSNorm -> SwiGLU MLP (+ residual)], final
RMSNorm, linear head + mean softmax cross-entropy). Each variant picks, per op, the plain
JAX form or the rlx_jax one; ``jax.jit(jax.value_and_grad(loss))`` is compiled once per
variant and the variants are timed in interleaved rounds (the median over rounds), so a
drift of the machine hits every variant alike.

Variants:
  plain-xla        plain JAX, attention ``jax.nn.dot_product_attention(implementation="xla")``
  plain-cudnn      the same with ``implementation="cudnn"`` (GPU only)
  rlx              rlx_jax.ops: gather (embedding), add_rms_norm (each residual add with the
                   RMSNorm after it), one q / k / v product over the packed weights split and
                   rotated by rope_split, attention, swiglu, fused_linear_cross_entropy
                   (mean reduction, logits blocks in the model's dtype as the plain head's
                   ``h @ w``; softmax and loss in f32 in both)
  rlx-lean         rlx with the ops whose backward recomputes an activation instead of
                   keeping it: add_rms_norm_linear / rms_norm_linear (the norm with the
                   projections that read it) and swiglu_linear (the SwiGLU with the down
                   projection); less memory, some time
  rlx-own-attn-fwd, rlx-lean-own-attn-fwd
                   rlx and rlx-lean with our attention forward kernel where ops.attention
                   runs cuDNN's forward (plain bf16 / f16 calls on an sm_90 GPU; see
                   docs/API.md): what that route gains the step
  rlx-lean-norm    rlx with add_rms_norm_linear / rms_norm_linear only
  rlx-lean-mlp     rlx with swiglu_linear only
  rlx-separate-add rlx with the residual adds written apart from ``rms_norm`` (x = x + b;
                   rms_norm(x)), as before add_rms_norm
  rlx-plain-mlp    rlx with the plain ``silu(a) * b``
  rlx-f32-logits   rlx with the fused head's logits blocks kept in f32 (more precise than the
                   plain head; the same as rlx for an f32 model)
  rlx-plain-ce     rlx with the plain logits + cross-entropy head
  rlx-xla-rows     rlx with the plain RMSNorm, residual adds and RoPE (XLA fuses them into
                   their neighbours; q, k and v as three products, as the plain model writes them)
  rlx-<base>-attn  rlx with the best plain attention (cudnn on the GPU, xla elsewhere)
  +<op>            the best plain baseline (cudnn on the GPU, xla elsewhere) with one op
                   swapped for rlx_jax's (embed, norm (add_rms_norm), rope, attn, loss, mlp)
  train-fused / train-nofused
                   the RLX-graph transformer of ``rlx-jax train`` (its full update step:
                   loss, gradients and the AdamW update), fused kernels and ``--no-fused``

Columns: ms/step (median; steps dispatched back to back as a training loop runs them,
one wait per round), "sync ms" and "sync speedup" (each step waited for before the next
is dispatched, so every step also pays the host's dispatch: a loop that reads its loss
every step), tokens/s, MFU (model FLOPs = 6 * N * tokens + causal attention
FLOPs 6 * L * H * head_dim * S * tokens, N = parameters outside the embedding table, over
the device's peak; n/a on the CPU), compiled temp memory (``memory_analysis()``), peak
device memory (``memory_stats()`` running maximum; n/a where the backend keeps none), loss
and gradient agreement with the reference variant (plain-xla; the train rows against
train-nofused), and determinism (gradients bitwise identical over 3 calls). The
"round range" column is the spread of the speedup taken within each round (the reference
and the row timed back to back, min-max over rounds): how far the machine's noise moves
the ratio. On the CPU the table adds the same by CPU time ("cpu ms", "cpu speedup", "cpu
range"): on a machine shared with other work, wall time measures the sharing as much as
the step, CPU time mostly the step.

``--power-seconds S`` (GPUs with nvidia-smi) adds a power phase after the timing rounds:
each variant runs its steps back to back for S seconds, the variants in turn for
``--power-rounds`` rounds, while nvidia-smi samples the board every 100 ms (the first
second of a phase left out, while the clocks settle): its mean power ("W"), SM clock ("SM
MHz"), share of samples with the power cap active ("cap"), energy per step ("J/step":
the phase's mean power times its time per step) and the reference's energy per step over
the row's ("J ratio"). On an H200 the step runs at the board's 700 W limit, where the
clocks follow the power drawn: a step's time then tracks its energy.

    python benchmarks/e2e_step.py --preset cpu
    python benchmarks/e2e_step.py --preset llama-v32k --json out.json
    python benchmarks/e2e_step.py --preset llama-v32k --deterministic-xla
    python benchmarks/e2e_step.py --preset tiny --quick     # the CI check: agreement only
    python benchmarks/e2e_step.py --preset llama-v32k --processes 3
    python benchmarks/e2e_step.py --preset llama-v32k --variants rlx-lean --head-chunk 8192
    python benchmarks/e2e_step.py --preset llama-v32k --variants plain-cudnn,rlx-lean --power-seconds 5

``--processes N`` runs the whole measurement in N fresh processes one after the other and
ends with each variant's speedup in every process and their median, and its temp memory in
every process. One process compiles each variant once, and a compile's choices are part of
that run's noise: on a GPU XLA's autotuner can pick other kernels for the same products in
another compile (moving a step's kernel total by a few percent, and with the schedule that
follows, the temp memory), which interleaved rounds in one process cannot average out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import statistics
import sys
import time

DET_FLAG = "--xla_gpu_deterministic_ops=true"

PRESETS = {
    "llama-v32k": dict(layers=4, width=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632, vocab=32000,
                       batch=8, seq=2048, dtype="bfloat16"),
    "llama-v128k": dict(layers=2, width=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632, vocab=128256,
                        batch=4, seq=4096, dtype="bfloat16"),
    "llama3-8b-2l": dict(layers=2, width=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256,
                         batch=2, seq=4096, dtype="bfloat16"),
    "cpu": dict(layers=2, width=256, heads=8, kv_heads=2, head_dim=32, ffn=704, vocab=8192,
                batch=8, seq=256, dtype="float32"),
    "tiny": dict(layers=2, width=64, heads=4, kv_heads=2, head_dim=16, ffn=176, vocab=512,
                 batch=2, seq=32, dtype="float32"),
}

#: the RLX-graph transformer of ``rlx-jax train`` timed beside the step: its CPU defaults
#: on CPU-sized presets, the GPU configuration (6 layers, width 768, 12 heads) elsewhere
TRAIN_CONFIGS = {
    "small": dict(layers=2, width=128, heads=4, seq=64, batch=16),
    "tiny": dict(layers=1, width=32, heads=2, seq=16, batch=2),
    "gpu": dict(layers=6, width=768, heads=12, seq=512, batch=32),
}

#: dense peak TFLOP/s by (device kind substring, dtype)
PEAK_TFLOPS = {("H200", "bfloat16"): 989.0, ("H100", "bfloat16"): 989.0,
               ("H200", "float32"): 494.7, ("H100", "float32"): 494.7}

OPS = ("embed", "norm", "rope", "attn", "loss", "mlp")


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    batch: int
    seq: int
    dtype: str
    eps: float = 1e-5
    rope_base: float = 10000.0
    head_chunk: int | None = None  # rows per block of the fused head (None: the op's choice)

    def __post_init__(self):
        for name in ("layers", "width", "heads", "kv_heads", "head_dim", "ffn", "vocab", "batch", "seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive (got {getattr(self, name)})")
        if self.head_chunk is not None and self.head_chunk <= 0:
            raise ValueError(f"--head-chunk must be positive (got {self.head_chunk})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads {self.kv_heads} must divide --heads {self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"--head-dim {self.head_dim} must be even for RoPE")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclasses.dataclass(frozen=True)
class Variant:
    """Which implementation each op uses: embed "take" | "rlx"; norm "jax" | "rlx" (rms_norm
    after a separate residual add) | "rlx-add" (add_rms_norm) | "rlx-linear"
    (add_rms_norm_linear with the projections that read the norm); rope "jax" | "rlx" (ops.rope on
    q and k) | "rlx-split" (q, k, v from one product over the packed weights, split by
    ops.rope_split); mlp (the
    SwiGLU and the down projection) "jax" | "rlx" (ops.swiglu, then the matmul) | "rlx-linear"
    (ops.swiglu_linear); loss "jax" | "rlx" | "rlx-f32" (logits blocks in f32); attn "xla" |
    "cudnn" | "rlx" | "rlx-own-fwd" (ops.attention with our forward kernel where the op would
    run cuDNN's forward: ``rlx_jax.vjp_rules.attention.CUDNN_FORWARD`` off while it compiles)."""

    name: str
    embed: str = "take"
    norm: str = "jax"
    rope: str = "jax"
    attn: str = "xla"
    loss: str = "jax"
    mlp: str = "jax"


# ---- the model ---------------------------------------------------------------------------------


def param_shapes(s: Shape) -> dict:
    shapes = {"embed": (s.vocab, s.width), "final_norm": (s.width,), "head": (s.width, s.vocab)}
    for i in range(s.layers):
        shapes |= {f"l{i}.attn_norm": (s.width,), f"l{i}.wq": (s.width, s.heads * s.head_dim),
                   f"l{i}.wk": (s.width, s.kv_heads * s.head_dim), f"l{i}.wv": (s.width, s.kv_heads * s.head_dim),
                   f"l{i}.wo": (s.heads * s.head_dim, s.width), f"l{i}.mlp_norm": (s.width,),
                   f"l{i}.w_gate": (s.width, s.ffn), f"l{i}.w_up": (s.width, s.ffn), f"l{i}.w_down": (s.ffn, s.width)}
    return shapes


def init_params(s: Shape, key) -> dict:
    """Norm gains 1, the embedding N(0, 0.02), matrices N(0, 1 / fan_in); all in s.dtype."""
    import jax
    import jax.numpy as jnp

    shapes = param_shapes(s)
    params = {}
    for k, name in zip(jax.random.split(key, len(shapes)), sorted(shapes)):
        shape = shapes[name]
        if len(shape) == 1:
            params[name] = jnp.ones(shape, s.dtype)
        else:
            std = 0.02 if name == "embed" else 1.0 / math.sqrt(shape[0])
            params[name] = (std * jax.random.normal(k, shape, jnp.float32)).astype(s.dtype)
    return params


def model_flops(s: Shape) -> float:
    """6 N tokens (N without the embedding table, whose lookup multiplies nothing) plus
    causal attention: QK^T and PV are 4 S^2 H D per sequence forward, half of it masked,
    times 3 for forward + backward."""
    n = sum(math.prod(v) for k, v in param_shapes(s).items() if k != "embed")
    return 6.0 * n * s.tokens + 6.0 * s.layers * s.heads * s.head_dim * s.seq * s.tokens


def _jax_rms_norm(x, gamma, eps):
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * gamma.astype(jnp.float32)).astype(x.dtype)


def _jax_rope(x, cos, sin):
    """NeoX halves on x [B, S, H, D], tables [S, D / 2]."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    c, t = cos[:, None, :], sin[:, None, :]
    a, b = x32[..., :half], x32[..., half:]
    return jnp.concatenate([a * c - b * t, b * c + a * t], axis=-1).astype(x.dtype)


def _rlx_rope(x, cos, sin):
    """rlx_jax.ops.rope on [B, S, H, D] where it takes that layout (``head_dim=None``),
    else on the merged [B, S, H * D] view (a free reshape)."""
    from rlx_jax.ops import rope

    head_dim = inspect.signature(rope).parameters["head_dim"]
    if head_dim.default is None:
        return rope(x, cos, sin)
    b, s, h, d = x.shape
    return rope(x.reshape(b, s, h * d), cos, sin, head_dim=d).reshape(b, s, h, d)


def _jax_loss(h, w, labels):
    """mean softmax cross-entropy of logits h @ w, softmax in f32."""
    import jax
    import jax.numpy as jnp

    logits = jnp.dot(h, w).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(lse - picked)


def _rlx_loss(h, w, labels, f32_logits=False, chunk=None):
    """fused_linear_cross_entropy, reduced in the op where it takes ``reduction``, its
    logits blocks in h's dtype (as the plain head's ``h @ w``) where it takes
    ``logits_dtype``, unless ``f32_logits``; ``chunk`` rows per block (None: the op's
    default)."""
    import jax.numpy as jnp
    from rlx_jax.ops import fused_linear_cross_entropy as flce

    params = inspect.signature(flce).parameters
    kw = {"logits_dtype": h.dtype} if "logits_dtype" in params and not f32_logits else {}
    if chunk is not None:
        kw["chunk_size"] = chunk
    if "reduction" in params:
        return flce(h, w, labels, reduction="mean", **kw).astype(jnp.float32)
    return jnp.mean(flce(h, w, labels, **kw).astype(jnp.float32))


def make_loss(s: Shape, v: Variant):
    """loss(params, tokens [B, S] i32, labels [B * S] i32) -> f32 scalar."""
    import jax
    import jax.numpy as jnp
    import rlx_jax.ops as rops

    from rlx_jax.models.transformer import rope_tables

    cos_np, sin_np = rope_tables(s.seq, s.head_dim, s.rope_base)

    def norm(x, g):
        return rops.rms_norm(x, g, eps=s.eps) if v.norm != "jax" else _jax_rms_norm(x, g, s.eps)

    def add_norm(x, branch, g):
        """The residual stream after adding ``branch`` (None: nothing to add), and its norm."""
        if branch is None:
            return x, norm(x, g)
        if v.norm in ("rlx-add", "rlx-linear"):
            return rops.add_rms_norm(x, branch, g, eps=s.eps)
        x = x + branch
        return x, norm(x, g)

    def norm_proj(x, branch, g, ws):
        """The residual stream after adding ``branch`` (None: nothing to add) and its norm's
        products with each weight in ``ws``."""
        if v.norm == "rlx-linear":
            if branch is None:
                return x, rops.rms_norm_linear(x, g, ws, eps=s.eps)
            return rops.add_rms_norm_linear(x, branch, g, ws, eps=s.eps)
        x, h = add_norm(x, branch, g)
        return x, tuple(h @ w for w in ws)

    def rotate(x, cos, sin):
        return _rlx_rope(x, cos, sin) if v.rope == "rlx" else _jax_rope(x, cos, sin)

    def attend(q, k, vv):
        if v.attn in ("rlx", "rlx-own-fwd"):
            return rops.attention(q, k, vv, mask_kind="causal")
        return jax.nn.dot_product_attention(q, k, vv, is_causal=True, implementation=v.attn)

    def mlp_down(a, b, w):
        """The SwiGLU of gate a and up b, then the down projection w."""
        if v.mlp == "rlx-linear":
            return rops.swiglu_linear(a, b, w)
        return (rops.swiglu(a, b) if v.mlp == "rlx" else jax.nn.silu(a) * b) @ w

    def loss(params, tokens, labels):
        cos, sin = jnp.asarray(cos_np), jnp.asarray(sin_np)
        if v.embed == "rlx":
            x = rops.gather(params["embed"], tokens, axis=0)
        else:
            x = jnp.take(params["embed"], tokens, axis=0)
        b, t = tokens.shape
        branch = None  # the last block's output, not yet added to the residual stream x
        for i in range(s.layers):
            p = lambda n: params[f"l{i}.{n}"]
            if v.rope == "rlx-split":
                # one product over the packed weights, split into q, k, v by the RoPE kernel
                wqkv = jnp.concatenate([p("wq"), p("wk"), p("wv")], axis=1)
                x, (qkv,) = norm_proj(x, branch, p("attn_norm"), (wqkv,))
                q, k, vv = rops.rope_split(qkv.reshape(b, t, s.heads + 2 * s.kv_heads, s.head_dim), cos, sin,
                                           (s.heads, s.kv_heads, s.kv_heads), rotate=(True, True, False))
            else:
                x, (q, k, vv) = norm_proj(x, branch, p("attn_norm"), (p("wq"), p("wk"), p("wv")))
                q = q.reshape(b, t, s.heads, s.head_dim)
                k = k.reshape(b, t, s.kv_heads, s.head_dim)
                vv = vv.reshape(b, t, s.kv_heads, s.head_dim)
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            attn_out = attend(q, k, vv).reshape(b, t, s.heads * s.head_dim) @ p("wo")
            x, (gate, up) = norm_proj(x, attn_out, p("mlp_norm"), (p("w_gate"), p("w_up")))
            branch = mlp_down(gate, up, p("w_down"))
        _, h = add_norm(x, branch, params["final_norm"])
        h = h.reshape(b * t, s.width)
        if v.loss == "jax":
            return _jax_loss(h, params["head"], labels)
        return _rlx_loss(h, params["head"], labels, f32_logits=v.loss == "rlx-f32", chunk=s.head_chunk)

    return loss


def variants(platform: str) -> list[Variant]:
    base = "cudnn" if platform == "gpu" else "xla"
    out = [Variant("plain-xla")]
    if platform == "gpu":
        out.append(Variant("plain-cudnn", attn="cudnn"))
    rlx = Variant("rlx", embed="rlx", norm="rlx-add", rope="rlx-split", attn="rlx", loss="rlx", mlp="rlx")
    out.append(rlx)
    out.append(dataclasses.replace(rlx, name="rlx-lean", norm="rlx-linear", mlp="rlx-linear"))
    out.append(dataclasses.replace(rlx, name="rlx-own-attn-fwd", attn="rlx-own-fwd"))
    out.append(dataclasses.replace(rlx, name="rlx-lean-own-attn-fwd", norm="rlx-linear", mlp="rlx-linear",
                                   attn="rlx-own-fwd"))
    out.append(dataclasses.replace(rlx, name="rlx-lean-norm", norm="rlx-linear"))
    out.append(dataclasses.replace(rlx, name="rlx-lean-mlp", mlp="rlx-linear"))
    out.append(dataclasses.replace(rlx, name="rlx-separate-add", norm="rlx"))
    out.append(dataclasses.replace(rlx, name="rlx-plain-mlp", mlp="jax"))
    out.append(dataclasses.replace(rlx, name="rlx-f32-logits", loss="rlx-f32"))
    out.append(dataclasses.replace(rlx, name="rlx-plain-ce", loss="jax"))
    out.append(dataclasses.replace(rlx, name="rlx-xla-rows", norm="jax", rope="jax"))
    out.append(dataclasses.replace(rlx, name=f"rlx-{base}-attn", attn=base))
    for op in OPS:
        out.append(dataclasses.replace(Variant(f"plain-{base}+{op}", attn=base),
                                       **{op: "rlx-add" if op == "norm" else "rlx"}))
    return out


# ---- measurement ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Runner:
    """A compiled step plus what the table reports about it."""

    name: str
    launch: object  # () -> outputs, dispatched without waiting for them
    grads: object  # () -> (loss, grads pytree) on host
    tokens: int
    flops: float
    temp_bytes: int | None
    row: dict = dataclasses.field(default_factory=dict)
    hlo: object = None  # () -> the compiled step's optimized HLO text, where known

    def step(self):
        """One step, waited for."""
        import jax

        return jax.block_until_ready(self.launch())


def _temp_bytes(compiled) -> int | None:
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # some backends keep no memory analysis
        return None


def _peak_bytes(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def step_runner(s: Shape, v: Variant, params, tokens, labels) -> Runner:
    import jax

    from rlx_jax.vjp_rules import attention as attention_rules

    fn = jax.jit(jax.value_and_grad(make_loss(s, v)))
    route = attention_rules.CUDNN_FORWARD
    attention_rules.CUDNN_FORWARD = route and v.attn != "rlx-own-fwd"  # read as attention lowers
    try:
        compiled = fn.lower(params, tokens, labels).compile()
    finally:
        attention_rules.CUDNN_FORWARD = route

    def launch():
        return compiled(params, tokens, labels)

    def grads():
        loss, g = jax.block_until_ready(launch())
        return float(loss), jax.device_get(g)

    return Runner(v.name, launch, grads, s.tokens, model_flops(s), _temp_bytes(compiled), hlo=compiled.as_text)


def train_runners(cfg: dict, precision: str) -> list[Runner]:
    """The ``rlx-jax train`` transformer's update step, fused and --no-fused, on fixed
    inputs, computing in ``precision`` ("f32" or "bf16", f32 master weights); ``grads``
    gives the loss and parameter gradients of the same graph in that precision."""
    import jax
    import numpy as np
    from rlx_jax.lowering import to_jax
    from rlx_jax.models import TransformerConfig, transformer_lm
    from rlx_jax.train.loop import TrainConfig, compute_dtype_map, make_optimizer, make_step
    from rlx_jax.vjp_rules._primitive import fused_ops

    mc = TransformerConfig(seq_len=cfg["seq"], layers=cfg["layers"], width=cfg["width"], heads=cfg["heads"])
    model = transformer_lm(mc)
    graph = model.build(cfg["batch"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, mc.vocab_size, size=(cfg["batch"], mc.seq_len)).astype(np.int32)
    labels = rng.integers(0, mc.vocab_size, size=cfg["batch"] * mc.seq_len).astype(np.float32)
    inputs = {"tokens": tokens, "labels": labels}
    n = model.num_params() - mc.vocab_size * mc.width
    tok = cfg["batch"] * mc.seq_len
    flops = 6.0 * n * tok + 6.0 * mc.layers * mc.heads * mc.head_dim * mc.seq_len * tok
    out = []
    for fused in (True, False):
        tc = TrainConfig(steps=1000, batch_size=cfg["batch"], fused=fused)
        optimizer = make_optimizer(tc)
        params = model.init(jax.random.PRNGKey(0))
        opt_state = optimizer.init(params)
        compiled = make_step(graph, optimizer, fused, precision=precision)
        state = {"params": params, "opt": opt_state}

        def launch(compiled=compiled, state=state):
            # the update is applied to a fixed state: each call is the same step
            return compiled(state["params"], state["opt"], inputs)

        fn = to_jax(graph, dtype_map=compute_dtype_map(precision))
        with fused_ops(fused):
            loss = lambda p: fn(p, inputs)[0].astype(np.float32)
            vg = jax.jit(jax.value_and_grad(loss)).lower(params).compile()

        def grads(vg=vg, params=params):
            loss, g = vg(params)
            return float(loss), jax.device_get(g)

        name = "train-fused" if fused else "train-nofused"
        out.append(Runner(name, launch, grads, tok, flops, _temp_bytes(compiled)))
    return out


def _tree_norm(tree) -> float:
    import numpy as np

    return math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in tree_leaves(tree)))


def tree_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def agreement(got, want) -> dict:
    """Loss relative difference, gradient-norm relative difference, and the relative L2
    error of the whole gradient (||g - g_ref|| / ||g_ref||)."""
    import numpy as np

    (loss, g), (loss_ref, g_ref) = got, want
    diff = [np.asarray(a, np.float64) - np.asarray(b, np.float64) for a, b in zip(tree_leaves(g), tree_leaves(g_ref))]
    norm, norm_ref = _tree_norm(g), _tree_norm(g_ref)
    return {"loss": loss, "loss_rel_diff": abs(loss - loss_ref) / max(abs(loss_ref), 1e-30),
            "grad_norm": norm, "grad_norm_rel_diff": abs(norm - norm_ref) / max(norm_ref, 1e-30),
            "grad_rel_err": _tree_norm(diff) / max(norm_ref, 1e-30)}


def deterministic(runner: Runner, calls: int = 3) -> bool:
    """Gradients bitwise identical over ``calls`` calls."""
    import numpy as np

    first = [np.asarray(x) for x in tree_leaves(runner.grads()[1])]
    for _ in range(calls - 1):
        again = [np.asarray(x) for x in tree_leaves(runner.grads()[1])]
        if not all(a.tobytes() == b.tobytes() for a, b in zip(first, again)):
            return False
    return True


def time_rounds(runners: list[Runner], rounds: int, reps: int) -> None:
    """Each round runs every runner in turn, twice: ``reps`` steps dispatched back to back
    with one wait at the end, as a training loop runs them (the host queues step i + 1
    while the device runs step i), then ``reps`` steps each waited for before the next is
    dispatched ("sync": every step also pays the host's dispatch and wake-up). ms/step is
    the median over rounds of each round's mean, by the wall clock and, for the
    back-to-back steps, by this process's CPU time (all its threads: the work a step does,
    which other processes on the machine barely move). Round i starts at runner i mod n,
    so no runner always follows the same one (the GPU's clock after a heavy neighbour
    would otherwise bias one variant)."""
    import jax

    for r in runners:
        r.step()  # warm
    per = {r.name: [] for r in runners}
    per_sync = {r.name: [] for r in runners}
    per_cpu = {r.name: [] for r in runners}
    for i in range(rounds):
        shift = i % max(len(runners), 1)
        for r in runners[shift:] + runners[:shift]:
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready([r.launch() for _ in range(reps)])
            per[r.name].append((time.perf_counter() - t0) / reps)
            per_cpu[r.name].append((time.process_time() - c0) / reps)
            t0 = time.perf_counter()
            for _ in range(reps):
                r.step()
            per_sync[r.name].append((time.perf_counter() - t0) / reps)
    for r in runners:
        for key, times in (("ms", per), ("sync_ms", per_sync), ("cpu_ms", per_cpu)):
            r.row[key] = 1e3 * statistics.median(times[r.name])
            r.row[f"{key}_rounds"] = [1e3 * t for t in times[r.name]]


def round_speedups(ref_rounds, rounds) -> list[float] | None:
    """Per-round speedups ref / row (each round times both back to back); None without
    the reference."""
    if not ref_rounds:
        return None
    return [a / b for a, b in zip(ref_rounds, rounds)]


@functools.cache
def _gpu_power():
    """benchmarks/gpu_power.py, loaded once by its path (this file also runs without the repository
    root on sys.path)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_power.py")
    spec = importlib.util.spec_from_file_location("_e2e_step_gpu_power", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def power_rounds(runners: list[Runner], rounds: int, seconds: float, sampler, idle: float = 1.0) -> None:
    """The power phase: ``rounds`` rounds, each running every runner's steps back to back
    for ``seconds`` (10 dispatched, then a wait, until the time is up), the runners in turn
    from a different one each round, ``idle`` seconds apart, under ``sampler`` (a
    ``gpu_power.PowerSampler``, entered here). Sets each runner's row "watts", "mhz",
    "cap_share" (means over its phases' samples, each phase's first second left out),
    "power_ms" (its time per step over the phases) and "joules" (J per step: mean power
    times power_ms); none of them where no phase of the runner got a sample."""
    import jax

    summarize = _gpu_power().summarize
    phases = {r.name: [] for r in runners}
    with sampler:
        for i in range(rounds):
            shift = i % max(len(runners), 1)
            for r in runners[shift:] + runners[:shift]:
                time.sleep(idle)
                t0, steps = time.time(), 0
                while time.time() - t0 < seconds:
                    jax.block_until_ready([r.launch() for _ in range(10)])
                    steps += 10
                phases[r.name].append((t0, time.time(), steps))
    for r in runners:
        got = [(summarize(sampler.samples, t0, t1), t1 - t0, steps) for t0, t1, steps in phases[r.name]]
        got = [(g, dt, n) for g, dt, n in got if g is not None]
        if not got:
            continue
        weight = sum(g["samples"] for g, _, _ in got)
        for key in ("watts", "mhz", "cap_share"):
            r.row[key] = sum(g[key] * g["samples"] for g, _, _ in got) / weight
        r.row["power_ms"] = 1e3 * sum(dt for _, dt, _ in got) / sum(n for _, _, n in got)
        r.row["joules"] = r.row["watts"] * r.row["power_ms"] / 1e3


# ---- the run -----------------------------------------------------------------------------------------


def _fmt(x, spec, na="n/a"):
    return na if x is None else format(x, spec)


def _speedup(x) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


def _range(spread) -> str:
    return f"{min(spread):.2f}-{max(spread):.2f}" if spread else "n/a"


def _ratio(row, key):
    """The row's speedup by the clock ``key`` ("ms", "sync_ms", "cpu_ms"): its reference's
    time over its own; None where either is missing (or the row is None)."""
    return row[f"ref_{key}"] / row[key] if row and row.get(f"ref_{key}") and row.get(key) else None


def format_table(rows: list[dict], header: str, cpu_clock: bool = False, power: bool = False) -> str:
    """One line per row; ``cpu_clock`` adds the CPU-time columns after the wall-time ones,
    ``power`` the power phase's (n/a for a row without samples)."""
    cols = ["variant", "ms/step", "speedup", "round range", "sync ms", "sync speedup"]
    cols += ["cpu ms", "cpu speedup", "cpu range"] if cpu_clock else []
    cols += ["W", "SM MHz", "cap", "J/step", "J ratio"] if power else []
    cols += ["tokens/s", "MFU", "temp GiB", "peak GiB", "loss", "loss rel", "gnorm rel", "grad err", "determ."]
    lines = [header, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} |" + " |" * (len(cols) - 2))
            continue
        cells = [r["variant"], f"{r['ms']:.2f}", _speedup(_ratio(r, "ms")), _range(r.get("speedup_rounds")),
                 f"{r['sync_ms']:.2f}", _speedup(_ratio(r, "sync_ms"))]
        if cpu_clock:
            cells += [f"{r['cpu_ms']:.2f}", _speedup(_ratio(r, "cpu_ms")), _range(r.get("cpu_speedup_rounds"))]
        if power:
            cells += [_fmt(r.get("watts"), ".0f"), _fmt(r.get("mhz"), ".0f"), _fmt(r.get("cap_share"), ".0%"),
                      _fmt(r.get("joules"), ".2f"), _speedup(_ratio(r, "joules"))]
        cells += [f"{r['tokens_per_s']:,.0f}", _fmt(r.get("mfu"), ".1%"),
                 _fmt(None if r.get("temp_bytes") is None else r["temp_bytes"] / 2**30, ".3f"),
                 _fmt(None if r.get("peak_bytes") is None else r["peak_bytes"] / 2**30, ".2f"),
                 f"{r['loss']:.5f}", f"{r['loss_rel_diff']:.1e}", f"{r['grad_norm_rel_diff']:.1e}",
                 f"{r['grad_rel_err']:.1e}", "yes" if r["deterministic"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for name in ("layers", "width", "heads", "kv-heads", "head-dim", "ffn", "vocab", "batch", "seq"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--head-chunk", type=int, default=None,
                   help="rows per block of the rlx variants' fused head (default: the op's choice)")
    p.add_argument("--variants", default=None,
                   help="comma-separated variant names to run (default all; the reference always runs)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; quick 0)")
    p.add_argument("--reps", type=int, default=None, help="steps per variant per round (default 10 on GPUs, 3 elsewhere)")
    p.add_argument("--train", choices=["auto", "none", *sorted(TRAIN_CONFIGS)], default="auto",
                   help="the rlx-jax train transformer rows: auto = small on CPU presets, gpu otherwise")
    p.add_argument("--train-precision", choices=["f32", "bf16"], default=None,
                   help="rlx-jax train rows' --precision (default as that command: bf16 on gpu, f32 on cpu)")
    p.add_argument("--quick", action="store_true",
                   help="no timing: compile, check agreement and determinism, fail on disagreement")
    p.add_argument("--deterministic-xla", action="store_true",
                   help=f"run with XLA_FLAGS {DET_FLAG} (re-executes itself with the flag set)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default by device)")
    p.add_argument("--power-seconds", type=float, default=0.0,
                   help="a power phase of this many seconds a variant a round after the timing (GPU; 0: none)")
    p.add_argument("--power-rounds", type=int, default=2, help="rounds of the power phase")
    p.add_argument("--processes", type=int, default=1,
                   help="run the measurement in this many fresh processes (each its own compiles) and summarise")
    p.add_argument("--json", metavar="PATH", default=None)
    a = p.parse_args(argv)
    if a.processes < 1:
        p.error("--processes must be >= 1")
    if a.processes > 1 and (a.quick or a.rounds == 0):
        p.error("--processes compares timed runs: not with --quick or --rounds 0")
    if a.power_seconds < 0 or a.power_rounds < 1:
        p.error("--power-seconds must be >= 0 and --power-rounds >= 1")
    if 0 < a.power_seconds < 2:
        p.error("--power-seconds must be at least 2 (a phase's first second is left out)")
    fields = dict(PRESETS[a.preset])
    for name in ("layers", "width", "heads", "kv_heads", "head_dim", "ffn", "vocab", "batch", "seq", "dtype",
                 "head_chunk"):
        if getattr(a, name) is not None:
            fields[name] = getattr(a, name)
    if a.width is not None and a.head_dim is None and a.heads is not None:
        fields["head_dim"] = fields["width"] // fields["heads"]
    a.shape = Shape(**fields)
    return a


def _tolerances(dtype: str) -> dict:
    if dtype == "float32":
        return {"loss_rel_diff": 1e-4, "grad_norm_rel_diff": 1e-3, "grad_rel_err": 5e-3}
    return {"loss_rel_diff": 2e-2, "grad_norm_rel_diff": 5e-2, "grad_rel_err": 1e-1}


def _without_option(argv, name):
    """argv without ``name`` and its value (``name V`` or ``name=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def process_summary(runs: list[list[dict]]) -> list[dict]:
    """Per variant over the processes' JSON rows (one list a process): its speedup in each
    process (that process's reference time over its own; None where it did not run), the
    median of those speedups and of its ms/step, the median of its sync speedups and of its
    J ratios (the power phase's; None without one), and its compiled temp memory in each process (each compile's own: XLA's autotuner and scheduler
    may choose differently in each, and the temp memory with them)."""
    names = list(dict.fromkeys(r["variant"] for rows in runs for r in rows if "error" not in r))
    out = []

    def median(xs):
        got = [x for x in xs if x is not None]
        return statistics.median(got) if got else None

    for name in names:
        rows = [next((r for r in rows if r["variant"] == name and "error" not in r), None) for rows in runs]
        speedups = [_ratio(r, "ms") for r in rows]
        out.append({"variant": name, "speedups": speedups, "speedup_median": median(speedups),
                    "ms_median": median([r and r.get("ms") for r in rows]),
                    "sync_speedup_median": median([_ratio(r, "sync_ms") for r in rows]),
                    "joule_ratio_median": median([_ratio(r, "joules") for r in rows]),
                    "temp_bytes": [r and r.get("temp_bytes") for r in rows]})
    return out


def format_process_summary(summary: list[dict], processes: int) -> str:
    lines = [f"across {processes} processes (each its own compiles; speedup: that process's reference over the row)",
             "| variant | ms/step (median) | speedup (median) | speedup in each process | sync speedup (median) "
             "| J ratio (median) | temp GiB in each process |",
             "|---|---|---|---|---|---|---|"]
    for row in summary:
        each = " ".join(_speedup(x) for x in row["speedups"])
        temps = " ".join(_fmt(None if t is None else t / 2**30, ".3f") for t in row.get("temp_bytes", []))
        lines.append(f"| {row['variant']} | {_fmt(row['ms_median'], '.2f')} | {_speedup(row['speedup_median'])} | "
                     f"{each} | {_speedup(row.get('sync_speedup_median'))} | "
                     f"{_speedup(row.get('joule_ratio_median'))} | {temps} |")
    return "\n".join(lines)


def run_processes(argv, processes: int, json_path) -> int:
    """The measurement of ``argv`` in ``processes`` fresh processes, one after the other (each
    prints its own table), then the summary; the JSON holds every process's and the summary."""
    import subprocess
    import tempfile

    child_argv = _without_option(_without_option(argv, "--processes"), "--json")
    runs, rc = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            out = os.path.join(tmp, f"run{i}.json")
            print(f"# process {i + 1} of {processes}", flush=True)
            code = subprocess.call([sys.executable, os.path.abspath(__file__), *child_argv, "--json", out])
            rc = rc or code
            if not os.path.exists(out):
                raise SystemExit(f"process {i + 1} wrote no results (exit status {code})")
            with open(out, encoding="utf-8") as f:
                runs.append(json.load(f))
    summary = process_summary([run["rows"] for run in runs])
    print(format_process_summary(summary, processes))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"processes": runs, "summary": summary}, f, indent=1)
    return rc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.processes > 1:
        return run_processes(argv, a.processes, a.json)
    if a.deterministic_xla and DET_FLAG not in os.environ.get("XLA_FLAGS", ""):
        if "jax" in sys.modules:
            raise SystemExit(f"--deterministic-xla: jax is already imported; set XLA_FLAGS={DET_FLAG} instead")
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + DET_FLAG).strip())
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)
    import jax
    import numpy as np

    s = a.shape
    device = jax.devices()[0]
    platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    det_xla = DET_FLAG in os.environ.get("XLA_FLAGS", "")
    quick = a.quick
    rounds = a.rounds if a.rounds is not None else (0 if quick else 5)
    # GPU steps take tens of ms: 10-step bursts (about half a second a variant) keep the
    # launch latency and clock changes between bursts out of a round's ratio, where 3-step
    # bursts spread the llama-v32k rounds over 0.98-1.18x; CPU steps are long enough at 3
    reps = a.reps or (10 if platform == "gpu" else 3)
    peak = a.peak_tflops
    if peak is None and platform == "gpu":
        peak = next((v for (kind, dt), v in PEAK_TFLOPS.items() if kind in device.device_kind and dt == s.dtype), None)

    chosen = variants(platform)
    if a.variants:
        wanted = set(a.variants.split(","))
        unknown = wanted - {v.name for v in chosen}
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {[v.name for v in chosen]}")
        chosen = [v for v in chosen if v.name in wanted or v.name == "plain-xla"]

    key = jax.random.PRNGKey(0)
    params = init_params(s, key)
    rng = np.random.default_rng(0)
    tokens = jax.numpy.asarray(rng.integers(0, s.vocab, size=(s.batch, s.seq)), jax.numpy.int32)
    labels = jax.numpy.asarray(rng.integers(0, s.vocab, size=s.tokens), jax.numpy.int32)

    runners, failed = [], []
    for v in chosen:
        try:
            runners.append(step_runner(s, v, params, tokens, labels))
        except Exception as exc:  # a variant the backend cannot compile (cuDNN under the flag, say)
            failed.append({"variant": v.name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
    train_kind = a.train
    if train_kind == "auto":
        train_kind = "small" if platform == "cpu" and a.preset != "tiny" else ("tiny" if a.preset == "tiny" else "gpu")
    train_precision = a.train_precision or ("bf16" if platform == "gpu" else "f32")
    train = [] if train_kind == "none" else train_runners(TRAIN_CONFIGS[train_kind], train_precision)

    # agreement, determinism, then memory (ascending temp memory so the running peak is
    # each variant's own as far as possible); a variant that fails to run is reported
    ref = next((r for r in runners if r.name == "plain-xla"), None)
    want = ref.grads() if ref else None
    want_t = train[1].grads() if train else None

    def check(r):
        reference = want_t if r.name.startswith("train-") else want
        r.row.update(agreement(r.grads(), reference) if reference else {})
        r.row["deterministic"] = deterministic(r)

    for group in (runners, train):
        for r in list(group):
            try:
                check(r)
            except Exception as exc:
                failed.append({"variant": r.name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
                group.remove(r)
    everything = runners + train
    for r in sorted(everything, key=lambda r: r.temp_bytes or 0):
        r.step()
        r.row["peak_bytes"] = _peak_bytes(device)
    if rounds:
        time_rounds(runners, rounds, reps)
        if train:
            time_rounds(train, rounds, reps)
    power = False
    if rounds and a.power_seconds:
        gp = _gpu_power()
        fields = gp.smi_fields() if platform == "gpu" else None
        if fields is None:
            print("--power-seconds: nvidia-smi reports no power samples here; no power phase", file=sys.stderr)
        else:
            for group in (runners, train):
                if group:
                    power_rounds(group, a.power_rounds, a.power_seconds, gp.PowerSampler(fields, gp.smi_index(device)))
            power = True
    rows = []
    for r in everything:
        row = {"variant": r.name, "temp_bytes": r.temp_bytes, **r.row}
        is_train = r.name.startswith("train-")
        row["compute_dtype"] = ("bfloat16" if train_precision == "bf16" else "float32") if is_train else s.dtype
        if rounds:
            row["tokens_per_s"] = r.tokens / (row["ms"] / 1e3)
            row["mfu"] = r.flops / (row["ms"] / 1e3) / (peak * 1e12) if peak else None
        rows.append(row)
    if rounds:
        ms = {row["variant"]: row["ms"] for row in rows}
        base = ms.get("plain-cudnn", ms.get("plain-xla"))
        per_round = {row["variant"]: row["ms_rounds"] for row in rows}
        sync_ms = {row["variant"]: row["sync_ms"] for row in rows}
        cpu_ms = {row["variant"]: row["cpu_ms"] for row in rows}
        cpu_round = {row["variant"]: row["cpu_ms_rounds"] for row in rows}
        joules = {row["variant"]: row.get("joules") for row in rows}
        base_name = "plain-cudnn" if "plain-cudnn" in ms else "plain-xla"
        for row in rows:
            ref = "train-nofused" if row["variant"].startswith("train-") else base_name
            row["ref_ms"] = ms.get(ref)
            row["speedup_rounds"] = round_speedups(per_round.get(ref), row["ms_rounds"])
            row["ref_sync_ms"] = sync_ms.get(ref)
            row["ref_cpu_ms"] = cpu_ms.get(ref)
            row["cpu_speedup_rounds"] = round_speedups(cpu_round.get(ref), row["cpu_ms_rounds"])
            row["ref_joules"] = joules.get(ref)
    rows += failed

    header = (f"e2e step, preset {a.preset}: {s.layers} layers, width {s.width}, {s.heads}/{s.kv_heads} heads x "
              f"{s.head_dim}, ffn {s.ffn}, vocab {s.vocab}, batch {s.batch} x seq {s.seq}, {s.dtype}"
              f"{f', fused head blocks of {s.head_chunk} rows' if s.head_chunk else ''}; "
              f"{device.platform} ({device.device_kind}), jax {jax.__version__}"
              f"{', ' + DET_FLAG if det_xla else ''}; {rounds} rounds x {reps} steps"
              + (f"; power phase: {a.power_rounds} rounds x {a.power_seconds:g} s" if power else "")
              + (f"; train rows: rlx-jax train transformer {TRAIN_CONFIGS[train_kind]}, {train_precision}"
                 if train else ""))
    if rounds:
        print(format_table(rows, header, cpu_clock=platform == "cpu", power=power))
        print("(speedup: the best plain step's time (plain-cudnn where it ran, else plain-xla) over the row's; "
              "the train rows: train-nofused's over the row's)")
    else:
        print(header)
        for row in rows:
            print({k: row.get(k) for k in ("variant", "loss", "loss_rel_diff", "grad_norm_rel_diff",
                                             "grad_rel_err", "deterministic", "temp_bytes", "error")})
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"preset": a.preset, "shape": dataclasses.asdict(s), "device": device.device_kind,
                       "platform": device.platform, "jax": jax.__version__, "deterministic_xla": det_xla,
                       "rounds": rounds, "reps": reps, "rows": rows}, f, indent=1)
    bad = [r["variant"] for r in rows if "error" not in r and not _agrees(r)]
    if failed and quick:
        bad += [r["variant"] for r in failed]
    if bad:
        print(f"disagreement with the reference: {bad}", file=sys.stderr)
        return 1
    return 0


def _agrees(row: dict) -> bool:
    tol = _tolerances(row["compute_dtype"])
    return all(row.get(k, 0.0) <= v for k, v in tol.items())


if __name__ == "__main__":
    sys.exit(main())
