"""Training loops for the model graphs: the transformer LM on characters and the
classifiers (CNN / MLP) on digits.

One step = ``jax.value_and_grad`` of ``to_jax(graph)``'s loss output (fused backward
kernels through the ops' custom rules; with ``fused=False`` JAX differentiates the
pure-JAX references instead, the plain-XLA baseline) followed by an optax AdamW update.
The batch of step t is drawn from ``np.random.default_rng((seed, t))``, so a run
resumed from a checkpoint continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlx_jax.lowering import to_jax
from rlx_jax.train import checkpoint, data
from rlx_jax.vjp_rules._primitive import fused_ops


@dataclasses.dataclass
class TrainConfig:
    steps: int = 400
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    fused: bool = True
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint: str | None = None
    checkpoint_every: int = 100
    out_dir: str = "rlx_jax_runs"
    progress: bool = True
    devices: int = 1  # data parallel over this many devices of the default backend


def make_optimizer(cfg: TrainConfig):
    import optax

    # linear warm-up (at most a tenth of the run), then cosine decay to lr/10
    warmup = max(1, min(cfg.warmup, cfg.steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * 0.1
    )
    return optax.chain(optax.clip_by_global_norm(cfg.clip), optax.adamw(schedule, weight_decay=cfg.weight_decay))


def data_mesh(devices: int):
    """A 1-D mesh named "data" over the first ``devices`` devices of the default backend,
    or None for one device."""
    if devices <= 1:
        return None
    available = jax.devices()
    if len(available) < devices:
        raise ValueError(f"--devices {devices}: only {len(available)} {available[0].platform} device(s) visible")
    return jax.sharding.Mesh(np.array(available[:devices]), ("data",))


def batch_sharding(mesh):
    """Inputs are split along their first (batch) axis over the mesh's "data" axis."""
    return None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def make_step(graph, optimizer, fused: bool, mesh=None) -> Callable:
    """A compiled (params, opt_state, inputs) -> (params, opt_state, loss) update.

    With a mesh, the inputs are split along their batch axis over its "data" axis and
    the parameters and optimiser state are replicated: data parallelism, where the
    fused kernels run on each shard and the parameter gradients are all-reduced."""
    import optax

    fn = to_jax(graph)

    def loss_fn(params, inputs):
        return fn(params, inputs)[0]

    def step(params, opt_state, inputs):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, inputs = _abstract_step_args(graph, optimizer)
    jitted = jax.jit(step)
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        split = batch_sharding(mesh)
        place = lambda tree, sh: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree)
        params, opt_state, inputs = place(params, replicated), place(opt_state, replicated), place(inputs, split)
        jitted = jax.jit(step, out_shardings=(replicated, replicated, replicated))
    with fused_ops(fused):  # traced now, under the chosen setting
        return jitted.lower(params, opt_state, inputs).compile()


def _abstract_step_args(graph, optimizer):
    params, inputs = {}, {}
    for node in graph.nodes:
        kind = type(node.op).__name__
        if kind in ("Param", "Input"):
            spec = jax.ShapeDtypeStruct(tuple(int(d) for d in node.shape.dims), node.shape.dtype.to_numpy())
            (params if kind == "Param" else inputs)[node.op.name] = spec
    opt_state = jax.eval_shape(optimizer.init, params)
    return params, opt_state, inputs


class Progress:
    """tqdm progress bar with loss and throughput, or nothing when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, **postfix):
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def write(self, text: str):
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_steps(*, name, graph, model, cfg: TrainConfig, batch_fn, evaluate, tokens_per_step, meta_extra) -> dict:
    """The shared loop: init or resume, train with progress, evaluate, checkpoint
    (also on Ctrl-C), return the run record."""
    optimizer = make_optimizer(cfg)
    params = model.init(jax.random.PRNGKey(cfg.seed))
    opt_state = optimizer.init(params)
    history, evals, start = [], [], 0
    ckpt = pathlib.Path(cfg.checkpoint) if cfg.checkpoint else None
    run_key = {"model": name, "config": meta_extra.get("config"), "batch_size": cfg.batch_size, "seed": cfg.seed}
    if ckpt is not None and checkpoint.exists(ckpt):
        (params, opt_state), meta = checkpoint.load(ckpt, (params, opt_state))
        if meta.get("run") != json.loads(json.dumps(run_key)):
            raise ValueError(f"checkpoint {ckpt} belongs to a different run: {meta.get('run')} != {run_key}")
        start, history, evals = meta["step"], meta["history"], meta["evals"]
        params = jax.tree.map(jnp.asarray, params)
        opt_state = jax.tree.map(jnp.asarray, opt_state)
    mesh = data_mesh(cfg.devices)
    if mesh is not None:
        if cfg.batch_size % cfg.devices:
            raise ValueError(f"batch size {cfg.batch_size} must be divisible by --devices {cfg.devices}")
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        params, opt_state = jax.device_put((params, opt_state), replicated)
    t_compile = time.perf_counter()
    step_fn = make_step(graph, optimizer, cfg.fused, mesh)
    compile_s = time.perf_counter() - t_compile

    def save(step):
        if ckpt is not None:
            checkpoint.save(ckpt, (params, opt_state),
                            {"run": run_key, "step": step, "history": history, "evals": evals})

    progress = Progress(cfg.steps, start, cfg.progress, f"train {name}{'' if cfg.fused else ' (no fused)'}")
    step = start
    t0, timed_tokens, interrupted = None, 0, False
    try:
        for step in range(start, cfg.steps):
            inputs = batch_fn(np.random.default_rng((cfg.seed, step)))
            if mesh is not None:
                inputs = jax.device_put(inputs, batch_sharding(mesh))
            params, opt_state, loss = step_fn(params, opt_state, inputs)
            loss = float(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}")
            history.append({"step": step, "loss": loss})
            if t0 is None:  # the first step includes dispatch warm-up: time from the second on
                t0 = time.perf_counter()
            else:
                timed_tokens += tokens_per_step
            rate = timed_tokens / max(time.perf_counter() - t0, 1e-9)
            progress.update(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                result = evaluate(params)
                evals.append({"step": step + 1, **result})
                progress.write(f"step {step + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
            if ckpt is not None and (step + 1) % cfg.checkpoint_every == 0:
                save(step + 1)
        step = cfg.steps
    except KeyboardInterrupt:
        interrupted = True
        step = len(history)  # steps completed
        progress.write(f"interrupted at step {step}; saving" + (f" to {ckpt}" if ckpt else " nothing (no --checkpoint)"))
    finally:
        progress.close()
    save(step)
    elapsed = (time.perf_counter() - t0) if t0 else 0.0
    return {
        "model": name,
        "fused": cfg.fused,
        "steps_done": step,
        "interrupted": interrupted,
        "compile_s": compile_s,
        "devices": cfg.devices,
        "tokens_per_s": timed_tokens / elapsed if elapsed > 0 else None,
        "history": history,
        "evals": evals,
        "params": params,
        **meta_extra,
    }


def write_outputs(record: dict, out_dir: str, tag: str) -> dict[str, str | None]:
    """JSON log and loss-curve PNG; returns their paths (``plot`` is None when
    matplotlib, an optional dependency, is not installed)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = {k: v for k, v in record.items() if k != "params"}
    paths = {"log": str(out / f"{tag}.json"), "plot": str(out / f"{tag}_loss.png")}
    pathlib.Path(paths["log"]).write_text(json.dumps(log, indent=1, default=float))
    try:
        import matplotlib
    except ImportError:
        paths["plot"] = None
        return paths

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [h["step"] for h in record["history"]]
    ax.plot(steps, [h["loss"] for h in record["history"]], label="train loss", lw=1)
    for key in ("heldout_loss", "test_loss"):
        pts = [(e["step"], e[key]) for e in record["evals"] if key in e]
        if pts:
            ax.plot(*zip(*pts), "o-", label=key.replace("_", " "))
    if record.get("unigram_baseline"):
        ax.axhline(record["unigram_baseline"], ls="--", c="gray", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"rlx_jax: {record['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=100)
    plt.close(fig)
    return paths
