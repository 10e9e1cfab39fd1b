"""Command line: ``rlx-jax`` / ``python -m rlx_jax``.

    rlx-jax                       same as ``rlx-jax info``
    rlx-jax info                  devices, loaded kernels, and a fused-gradient self-check
    rlx-jax train                 train the character transformer LM (an RLX graph) on
                                  Python's standard library sources
    rlx-jax train --model cnn     train the CNN graph on scikit-learn's digits
    rlx-jax grad G.json --wrt W   write the gradient graph (RLX JSON) of a saved graph
    rlx-jax bench                 run the kernel benchmarks (from a source checkout)
    rlx-jax --version             the rlx_jax and jax versions

``train`` needs the ``[train]`` extra (optax; scikit-learn for the digits models); without
it, one line names the extra to install and the exit status is 2. tqdm and matplotlib
are optional at run time: without them there is no progress bar or no loss-curve PNG,
and a one-line note says so.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys


def cmd_info(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import rlx_jax
    from rlx_jax.ops import rms_norm
    from rlx_jax.vjp_rules.rms_norm import reference_rms_norm

    print(f"rlx_jax {rlx_jax.__version__}, jax {jax.__version__}")
    print("devices:", ", ".join(f"{d.platform}:{d.id} ({d.device_kind})" for d in jax.devices()))
    for platform, info in rlx_jax.kernel_info().items():
        state = "loaded" if info["loaded"] else "not loaded"
        print(f"kernels [{platform}]: {state}; targets: {', '.join(info['targets']) or '-'}")
        if info["error"]:
            print(f"  ({info['error']})")

    kx, kg = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (256, 512))
    g = 1.0 + 0.1 * jax.random.normal(kg, (512,))
    loss = lambda x, g: jnp.sum(jnp.sin(rms_norm(x, g)))
    loss_ref = lambda x, g: jnp.sum(jnp.sin(reference_rms_norm(x, g, jnp.zeros_like(g), eps=1e-6)[0]))
    grad = jax.jit(jax.grad(loss, (0, 1)))
    hlo = grad.lower(x, g).as_text()
    fused = "rlx_rms_norm_bwd" in hlo
    got = grad(x, g)
    want = jax.grad(loss_ref, (0, 1))(x, g)
    errs = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want)]
    print(
        f"rms_norm gradient [256x512 f32]: fused backward kernel {'used' if fused else 'NOT used (reference)'}; "
        f"max relative error vs reference: dx {errs[0]:.2e}, dgamma {errs[1]:.2e}"
    )
    ok = all(e < 1e-4 for e in errs)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def _select_device(name: str) -> None:
    import jax

    if name == "gpu":
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if not gpus:
            raise CliError("--device gpu: no GPU is visible to JAX (install rlx_jax[cuda13] on a CUDA machine)")
        jax.config.update("jax_default_device", gpus[0])
    elif name == "cpu":
        jax.config.update("jax_default_device", jax.devices("cpu")[0])


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _require_train_extra(model: str) -> None:
    """Raises CliError naming the extra when a module ``train`` cannot run without is missing."""
    needed = ["optax"] + (["sklearn"] if model in ("cnn", "mlp") else [])
    missing = [m for m in needed if not _importable(m)]
    if missing:
        names = {"sklearn": "scikit-learn"}
        raise CliError(f"`rlx-jax train` needs {', '.join(names.get(m, m) for m in missing)}: "
                       "pip install 'rlx_jax[train]'")


def cmd_train(args: argparse.Namespace) -> int:
    _require_train_extra(args.model)
    import jax

    if args.devices < 1:
        raise CliError(f"--devices must be positive (got {args.devices})")
    host_devices = args.devices
    if args.mesh and args.devices == 1:  # --mesh alone: as many host devices as the mesh has
        from rlx_jax.parallel.mesh import mesh_size

        host_devices = mesh_size(args.mesh)
    if args.device == "cpu" and host_devices > 1:
        # host "devices" must be requested before the CPU backend starts
        jax.config.update("jax_num_cpu_devices", host_devices)
    from rlx_jax.models import TransformerConfig
    from rlx_jax.train.loop import TrainConfig, write_outputs
    from rlx_jax.train.tasks import train_classifier, train_lm

    _select_device(args.device)
    for name in ("steps", "batch_size", "seq_len", "layers", "width", "heads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive (got {value})")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise CliError(f"--lr must be a positive finite number (got {args.lr})")
    if args.seed < 0:
        raise CliError(f"--seed must be >= 0 (got {args.seed})")
    _check_out(args)
    precision = args.precision or ("bf16" if args.device == "gpu" else "f32")
    progress = not args.no_progress
    if progress and not _importable("tqdm"):
        print("rlx-jax train: note: tqdm is not installed, so no progress bar (pip install 'rlx_jax[train]')")
        progress = False
    cfg = TrainConfig(fused=args.fused, seed=args.seed, checkpoint=args.checkpoint, out_dir=args.out,
                      progress=progress, devices=args.devices, precision=precision, mesh=args.mesh)
    if args.steps is not None:
        cfg.steps = args.steps
        cfg.eval_every = max(1, min(cfg.eval_every, args.steps))
    if args.lr is not None:
        cfg.lr = args.lr
    if args.model == "transformer":
        if args.batch_size:
            cfg.batch_size = args.batch_size
        mc = TransformerConfig(seq_len=args.seq_len or 64, layers=args.layers or 2, width=args.width or 128,
                               heads=args.heads or 4)
        print(f"rlx-jax train: transformer LM, {mc.layers} layers, width {mc.width}, {mc.heads} heads, "
              f"seq {mc.seq_len}, batch {cfg.batch_size}, {cfg.steps} steps, {cfg.devices} device(s), "
              f"{'fused kernels' if cfg.fused else 'plain XLA autodiff (--no-fused)'}, device {args.device}, "
              f"{cfg.precision} compute", flush=True)
        record = train_lm(cfg, mc)
    else:
        cfg.batch_size = args.batch_size or 64
        if args.steps is None:
            cfg.steps = 600
        cfg.lr = args.lr if args.lr is not None else 2e-3
        cfg.eval_every = min(200, cfg.steps)
        print(f"rlx-jax train: {args.model} on scikit-learn digits, batch {cfg.batch_size}, {cfg.steps} steps, "
              f"{'fused kernels' if cfg.fused else 'plain XLA autodiff (--no-fused)'}", flush=True)
        record = train_classifier(cfg, args.model)
    tag = f"{record['model']}{'' if cfg.fused else '_nofused'}"
    paths = write_outputs(record, cfg.out_dir, tag)
    last = record["evals"][-1] if record["evals"] else {}
    if record["interrupted"]:
        # the summary below is the last evaluation that ran, not one at the interrupt
        when = f"the last evaluation, at step {last['step']}" if last else "no evaluation"
        print(f"interrupted after {len(record['history'])} of {cfg.steps} steps: {when}")
    if "heldout_loss" in last:
        print(f"held-out loss {last['heldout_loss']:.3f} nats/char (unigram baseline "
              f"{record['unigram_baseline']:.3f}); {record['tokens_per_s'] or 0:,.0f} tokens/s")
    if "test_accuracy" in last:
        print(f"test accuracy {last['test_accuracy'] * 100:.2f}% (loss {last['test_loss']:.3f})")
    if record.get("sample") is not None:
        print("--- sample (prompt from held-out text, then generated) ---")
        print(record["sample_prompt"] + "\u2502" + record["sample"])
        print("---")
    if paths.get("plot"):
        print(f"log: {paths['log']}  loss curve: {paths['plot']}")
    else:
        print(f"log: {paths['log']}  (no loss-curve PNG: matplotlib is not installed; pip install 'rlx_jax[train]')")
    return 130 if record["interrupted"] else 0


def cmd_grad(args: argparse.Namespace) -> int:
    import rlx_jax
    from rlx_jax.ir import Graph

    try:
        text = open(args.graph, encoding="utf-8").read()
    except OSError as exc:
        raise CliError(f"cannot read {args.graph}: {exc.strerror}") from exc
    graph = Graph.from_json(text)
    options = rlx_jax.GradWithLossOptions.TRAINING if args.training else rlx_jax.GradWithLossOptions.STRICT
    grad_graph = rlx_jax.grad_with_loss(graph, list(args.wrt), options)
    out = grad_graph.to_json()
    if args.output in (None, "-"):
        print(out)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(out)
        print(f"wrote the gradient graph ({len(grad_graph)} nodes) to {args.output}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from benchmarks.run import main as bench_main
    except ImportError as exc:
        raise CliError("the benchmarks live in the source checkout: run `rlx-jax bench` from the "
                       "repository root (or `python -m benchmarks.run`)") from exc
    forwarded = list(args.bench_args)
    return bench_main(forwarded[1:] if forwarded[:1] == ["--"] else forwarded)


def _version_line() -> str:
    """``rlx-jax <version> (jax <version>)``, read without importing jax."""
    from importlib import metadata

    from rlx_jax import __version__

    try:
        jax_version = metadata.version("jax")
    except metadata.PackageNotFoundError:
        jax_version = "not installed"
    return f"rlx-jax {__version__} (jax {jax_version})"


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlx-jax", description="rlx_jax: the RLX gradient compiler on JAX/XLA")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command")
    p_info = sub.add_parser("info", help="devices, loaded kernels, and a fused-gradient self-check")
    p_info.set_defaults(func=cmd_info)

    p_train = sub.add_parser("train", help="train a model graph (default: the character transformer LM)")
    p_train.add_argument("--model", choices=["transformer", "cnn", "mlp"], default="transformer")
    p_train.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p_train.add_argument("--devices", type=int, default=1,
                         help="data parallel over N devices (on the CPU: N host devices)")
    p_train.add_argument("--mesh", default=None, metavar="SPEC",
                         help="device mesh, e.g. data=2,model=2: batch over data, heads / FFN / vocabulary "
                              "over model (on the CPU: that many host devices, or --devices N of them)")
    p_train.add_argument("--steps", type=int, default=None, help="default 400 (transformer), 600 (cnn/mlp)")
    p_train.add_argument("--batch-size", type=int, default=None, help="default 16 (transformer), 64 (cnn/mlp)")
    p_train.add_argument("--seq-len", type=int, default=None, help="transformer context length (default 64)")
    p_train.add_argument("--layers", type=int, default=None, help="transformer layers (default 2)")
    p_train.add_argument("--width", type=int, default=None, help="transformer width (default 128)")
    p_train.add_argument("--heads", type=int, default=None, help="transformer heads (default 4)")
    p_train.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p_train.add_argument("--seed", type=int, default=0)
    p_train.add_argument("--fused", dest="fused", action="store_true", default=True,
                         help="fused backward kernels (default)")
    p_train.add_argument("--no-fused", dest="fused", action="store_false",
                         help="plain XLA autodiff of the reference maths, for comparison")
    p_train.add_argument("--precision", choices=["f32", "bf16"], default=None,
                         help="compute dtype of the step; bf16 keeps f32 master weights and optimizer state "
                              "(default: bf16 on gpu, f32 on cpu)")
    p_train.add_argument("--checkpoint", metavar="DIR", default=None,
                         help="save here every 100 steps, on Ctrl-C and at the end; resume from it if present")
    p_train.add_argument("--out", metavar="DIR", default="rlx_jax_runs", help="where the JSON log and loss plot go")
    p_train.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_train.set_defaults(func=cmd_train)

    p_grad = sub.add_parser("grad", help="write the gradient graph of a saved RLX graph (JSON)")
    p_grad.add_argument("graph", help="an RLX graph in RLX serde JSON (saved by rlx_jax or Rust RLX)")
    p_grad.add_argument("--wrt", nargs="+", required=True, help="names of the params/inputs to differentiate")
    p_grad.add_argument("-o", "--output", default=None, help="output file (default: standard output)")
    p_grad.add_argument("--training", action="store_true", help="zero gradients for unreachable wrt (TRAINING)")
    p_grad.set_defaults(func=cmd_grad)

    p_bench = sub.add_parser("bench", help="run the kernel benchmarks (options as python -m benchmarks.run)")
    p_bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    p_bench.set_defaults(func=cmd_bench)
    return parser


def _check_out(args) -> None:
    """Refuse, before training, an --out that is a file or under one (the --checkpoint path
    the training loop checks before its first step)."""
    from rlx_jax.train.checkpoint import blocking_file

    blocked = blocking_file(args.out)
    if blocked is not None:
        raise CliError(f"--out {args.out}: {blocked} is a file, not a directory")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["info"])
    from rlx_jax.ir import GraphError

    try:
        return args.func(args)
    except CliError as exc:
        print(f"rlx-jax: error: {exc}", file=sys.stderr)
        return 2
    except (GraphError, ValueError, TypeError, OSError, FloatingPointError) as exc:
        print(f"rlx-jax {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
