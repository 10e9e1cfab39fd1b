"""Data-parallel scaling of the transformer training step (issue: beyond one device).

    python -m benchmarks.data_parallel --devices 1 2 [--width 1024 --layers 4 --seq-len 512 --batch-per-device 16]

For each device count N, compiles the rlx_jax training step with the batch split over N
devices (per-device batch fixed: weak scaling) and times the median step; prints
tokens/s, the speed-up over one device and the scaling efficiency, and whether the
compiled step contains any all-gather (there should be none: parameters are replicated,
activations stay split, the fused kernels run per shard and gradients are all-reduced).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import numpy as np


def measure(n: int, args) -> dict:
    from rlx_jax.models import TransformerConfig, transformer_lm
    from rlx_jax.train.loop import TrainConfig, batch_sharding, data_mesh, make_optimizer, make_step

    cfg = TransformerConfig(vocab_size=256, seq_len=args.seq_len, layers=args.layers, width=args.width,
                            heads=args.heads)
    model = transformer_lm(cfg)
    batch = args.batch_per_device * n
    graph = model.build(batch)
    optimizer = make_optimizer(TrainConfig(steps=100))
    mesh = data_mesh(n) if n > 1 else None
    step = make_step(graph, optimizer, True, mesh)
    hlo = step.as_text()
    params = model.init(jax.random.PRNGKey(0))
    opt_state = optimizer.init(params)
    if mesh is not None:
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        params, opt_state = jax.device_put((params, opt_state), rep)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, batch * cfg.seq_len).astype(np.float32)
    inputs = {"tokens": tokens, "labels": labels}
    inputs = jax.device_put(inputs, batch_sharding(mesh)) if mesh is not None else jax.device_put(inputs)
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, inputs)
    jax.block_until_ready(loss)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, inputs)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"devices": n, "batch": batch, "step_ms": t * 1e3, "tokens_per_s": batch * cfg.seq_len / t,
            "all_gathers": len(re.findall(r"= \S+ all-gather\(", hlo)),
            "all_reduces": len(re.findall(r"= \S+ all-reduce\(", hlo)), "loss": float(loss)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-per-device", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind} x{len(jax.devices())}, jax {jax.__version__}", flush=True)
    rows = [measure(n, args) for n in args.devices]
    base = rows[0]["tokens_per_s"] / rows[0]["devices"]
    print(f"{'devices':>8} {'batch':>6} {'step ms':>9} {'tokens/s':>12} {'speed-up':>9} {'efficiency':>10} {'all-gathers':>11}")
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["efficiency"] = r["tokens_per_s"] / (base * r["devices"])
        print(f"{r['devices']:>8} {r['batch']:>6} {r['step_ms']:>9.2f} {r['tokens_per_s']:>12,.0f} "
              f"{r['speedup']:>9.2f} {r['efficiency']:>10.2f} {r['all_gathers']:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
