"""Training loops for the model graphs: the transformer LM on characters and the
classifiers (CNN / MLP) on digits.

One step = ``jax.value_and_grad`` of ``to_jax(graph)``'s loss output (fused backward
kernels through the ops' custom rules; with ``fused=False`` JAX differentiates the
pure-JAX references instead, the plain-XLA baseline) followed by an optax AdamW update.
With ``precision="bf16"`` the graph computes in bfloat16 (every f32 parameter, input,
constant and intermediate is cast to bf16; the fused kernels keep f32 statistics) while
the parameters the optimiser updates and its state stay f32 (master weights): the
gradients arrive in f32 through the casts' transposes; the loss, a Mean output, is taken
in f32 over the bf16 per-row losses (``to_jax`` keeps such outputs). bfloat16 keeps
f32's exponent range, so no loss scaling is needed.
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
    precision: str = "f32"  # compute dtype of the step: "f32" or "bf16" (f32 master weights)
    mesh: str | None = None  # e.g. "data=2,model=2": data x tensor parallel (rlx_jax.parallel.mesh)


PRECISIONS = ("f32", "bf16")


def compute_dtype_map(precision: str):
    """``to_jax``'s dtype_map for a step precision: None for "f32"; for "bf16", f32 -> bf16
    (other dtypes unchanged). f32-encoded label ids stay exact in bf16 up to 256, which
    covers the character vocabulary (96) and the digit classes (10)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "f32":
        return None
    low = np.dtype(jnp.bfloat16)
    return lambda dt: low if np.dtype(dt) == np.float32 else np.dtype(dt)


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
    from rlx_jax.parallel.mesh import batch_spec

    return None if mesh is None else jax.sharding.NamedSharding(mesh, batch_spec(mesh))


def make_step(graph, optimizer, fused: bool, mesh=None, config=None, precision: str = "f32") -> Callable:
    """A compiled (params, opt_state, inputs) -> (params, opt_state, loss) update; the graph
    runs in ``precision`` (``compute_dtype_map``), params and optimiser state stay f32 and
    the loss comes back f32.

    With a mesh, the inputs are split along their batch axis over its "data" axis and
    the parameters and optimiser state are replicated: data parallelism, where the
    fused kernels run on each shard and the parameter gradients are all-reduced. A mesh
    with a "model" axis also splits the parameters (and their optimiser state) as
    ``rlx_jax.parallel.mesh.param_specs`` says for the model of ``config``: tensor
    parallelism."""
    import optax

    fn = to_jax(graph, dtype_map=compute_dtype_map(precision))

    def loss_fn(params, inputs):
        return fn(params, inputs)[0].astype(jnp.float32)

    def step(params, opt_state, inputs):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, inputs = _abstract_step_args(graph, optimizer)
    jitted = jax.jit(step)
    if mesh is not None:
        from rlx_jax.parallel.mesh import param_shardings, state_shardings

        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        p_sh = param_shardings(params, mesh, config)
        s_sh = state_shardings(opt_state, params, p_sh, mesh)
        place = lambda tree, sh: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
        params, opt_state = place(params, p_sh), place(opt_state, s_sh)
        inputs = place(inputs, jax.tree.map(lambda _: batch_sharding(mesh), inputs))
        jitted = jax.jit(step, out_shardings=(p_sh, s_sh, replicated))
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
    # what a resumed run must share with the one that wrote the checkpoint to continue it
    # exactly: the model, the data and the whole schedule (its length and rates too)
    run_key = json.loads(json.dumps({
        "model": name, "config": meta_extra.get("config"), "batch_size": cfg.batch_size, "seed": cfg.seed,
        "steps": cfg.steps, "lr": cfg.lr, "warmup": cfg.warmup, "weight_decay": cfg.weight_decay, "clip": cfg.clip,
        "precision": cfg.precision}))
    if ckpt is not None and checkpoint.exists(ckpt):
        (params, opt_state), meta = checkpoint.load(ckpt, (params, opt_state))
        stored = meta.get("run") or {}
        # a checkpoint of an older version records fewer keys: those it has must agree
        if not stored or any(stored[k] != run_key.get(k) for k in stored):
            diff = {k: (stored[k], run_key.get(k)) for k in sorted(stored) if stored[k] != run_key.get(k)}
            raise ValueError(f"checkpoint {ckpt} belongs to a different run (saved vs now: {diff or stored}); "
                             "resume with the settings that wrote it, or use a new --checkpoint")
        start, history, evals = meta["step"], meta["history"], meta["evals"]
        params = jax.tree.map(jnp.asarray, params)
        opt_state = jax.tree.map(jnp.asarray, opt_state)
    elif ckpt is not None:
        checkpoint.check_target(ckpt)  # before training, not after it
    mesh = data_mesh(cfg.devices)
    if cfg.mesh:
        from rlx_jax.parallel.mesh import parse_mesh

        mesh = parse_mesh(cfg.mesh, allowed=("data", "model"))
    if mesh is not None:
        from rlx_jax.parallel.mesh import param_shardings, state_shardings

        data = int(mesh.shape.get("data", 1))
        if cfg.batch_size % data:
            raise ValueError(f"batch size {cfg.batch_size} must be divisible by the data axis ({data} devices)")
        p_sh = param_shardings(params, mesh, model.config)
        params, opt_state = jax.device_put((params, opt_state), (p_sh, state_shardings(opt_state, params, p_sh, mesh)))
    t_compile = time.perf_counter()
    step_fn = make_step(graph, optimizer, cfg.fused, mesh, model.config, cfg.precision)
    compile_s = time.perf_counter() - t_compile

    def save(step):
        if ckpt is not None:
            checkpoint.save(ckpt, (params, opt_state),
                            {"run": run_key, "step": step, "history": history, "evals": evals})

    progress = Progress(cfg.steps, start, cfg.progress, f"train {name}{'' if cfg.fused else ' (no fused)'}")

    def eval_due(done):  # an evaluation follows the step that completes ``done`` steps
        return done % cfg.eval_every == 0 or done == cfg.steps

    def run_eval(done):
        result = evaluate(params)
        evals.append({"step": done, **result})
        progress.write(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))

    step = start
    t0, timed_tokens, interrupted = None, 0, False
    try:
        # A checkpoint saved on an interrupt during the evaluation after its last step records
        # that step (its parameters are already updated) but not the evaluation: it runs here,
        # before the next step, so the resumed run has the evals an uninterrupted one has.
        if start > 0 and eval_due(start) and not (evals and evals[-1]["step"] == start):
            run_eval(start)
        for step in range(start, cfg.steps):
            inputs = batch_fn(np.random.default_rng((cfg.seed, step)))
            if mesh is not None:
                inputs = jax.device_put(inputs, batch_sharding(mesh))
            new_params, new_opt_state, loss = step_fn(params, opt_state, inputs)
            # float() waits for the (asynchronously dispatched) step, where a Ctrl-C most often
            # lands: the new state replaces the old one only together with the step's history
            # entry, so an interrupt never saves updated parameters under the previous step count
            loss = float(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}")
            params, opt_state, history = new_params, new_opt_state, history + [{"step": step, "loss": loss}]
            if t0 is None:  # the first step includes dispatch warm-up: time from the second on
                t0 = time.perf_counter()
            else:
                timed_tokens += tokens_per_step
            rate = timed_tokens / max(time.perf_counter() - t0, 1e-9)
            progress.update(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
            if eval_due(step + 1):
                run_eval(step + 1)
            if ckpt is not None and (step + 1) % cfg.checkpoint_every == 0:
                save(step + 1)
        step = max(start, cfg.steps)
    except KeyboardInterrupt:
        interrupted = True
        step = len(history)  # steps completed; a missing evaluation of the last one is redone on resume
        progress.write(f"interrupted at step {step}; saving" + (f" to {ckpt}" if ckpt else " nothing (no --checkpoint)"))
    finally:
        progress.close()
    save(step)
    elapsed = (time.perf_counter() - t0) if t0 else 0.0
    return {
        "model": name,
        "fused": cfg.fused,
        "precision": cfg.precision,
        "lr": cfg.lr,
        "steps_done": step,
        "interrupted": interrupted,
        "compile_s": compile_s,
        "devices": cfg.devices,
        "mesh": cfg.mesh,
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
