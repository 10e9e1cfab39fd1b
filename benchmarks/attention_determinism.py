"""Attention fwd+bwd against cuDNN with the determinism guarantee matched.

Our attention backward is deterministic (dq, dk, dv bitwise equal for equal inputs: each key
block's dQ partial is added in a fixed order, no float atomics; docs/RELIABILITY.md).
cuDNN's backward, as XLA calls it, is deterministic only when XLA is told to exclude
non-deterministic ops (``--xla_gpu_exclude_nondeterministic_ops=true``: XLA then sets the fMHA
backward's ``force_deterministic``); by default it may sum dQ with atomics. XLA reads its flags
once per process, so each setting runs in its own child process, and each child times ours and
cuDNN alternately on the same inputs (the ratio ours/cuDNN is always from one process).

Each child also checks bitwise repeatability: ``--repeats`` calls of the jitted fwd+bwd on the
same inputs, the number of distinct (dq, dk, dv) byte strings (1: deterministic in this run;
more than 1 proves non-determinism, 1 does not prove determinism).

    python3 -m benchmarks.attention_determinism --rounds 2 --reps 5

Rows: ``<case> | <setting> | ours TF/s | cuDNN TF/s | ours/cuDNN | distinct ours / cuDNN``, each time
the better of two alternating medians of ``--reps`` samples (benchmarks.harness.time_fn), bf16,
B4 S4096 H16 (``--batch``, ``--seq``, ``--heads``), D 128 and 64, mask none and causal; flops as
benchmarks.cases_attention (fwd+bwd = 3.5 x 4 B H S^2 D, halved when causal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

SETTINGS = {
    "default": "",
    "deterministic": "--xla_gpu_exclude_nondeterministic_ops=true",
}


def _child(kinds: list[str], dims: list[int], args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.attention_cli import heads_label
    from benchmarks.cases_attention import _fwd_bwd, _gpu_fns, attention_flops, gpu_inputs
    from benchmarks.harness import default_batch, time_fn

    dev = next(d for d in jax.devices() if d.platform == "gpu")
    batch = default_batch(dev)
    b, s, h = args.batch, args.seq, args.heads
    for d in dims:
        inputs = gpu_inputs(b, s, h, d, dev, args.kv_heads)
        for kind in kinds:
            ours, cudnn, _ = _gpu_fns(kind)
            fns = {"ours": jax.jit(_fwd_bwd(ours)), "cudnn": jax.jit(_fwd_bwd(cudnn))}
            distinct = {}
            for name, fn in fns.items():
                digests = set()
                for _ in range(args.repeats):
                    grads = jax.block_until_ready(fn(*inputs))
                    digest = hashlib.sha256()
                    for g in grads:
                        digest.update(np.asarray(g.astype(jnp.float32)).tobytes())
                    digests.add(digest.hexdigest())
                distinct[name] = len(digests)
            ms = {name: [] for name in fns}
            for _ in range(2):  # alternate: ours, cuDNN, ours, cuDNN
                for name, fn in fns.items():
                    ms[name].append(time_fn(fn, inputs, args.reps, batch=batch))
            flops = attention_flops(b, h, s, d, causal=kind == "causal", backward=True)
            row = {"case": f"fwd+bwd {kind} B{b} S{s} H{heads_label(args)} D{d}", "device": dev.device_kind,
                   "ours_ms": min(ms["ours"]), "cudnn_ms": min(ms["cudnn"]), "flops": flops,
                   "distinct_ours": distinct["ours"], "distinct_cudnn": distinct["cudnn"]}
            print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    # (imported here, not at the top: tests/test_benchmark_scripts.py loads this file by its path, without
    # the repository root on sys.path)
    from benchmarks.attention_cli import add_shape_args, shape_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the two settings")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=4, help="calls whose results are compared bitwise")
    add_shape_args(parser, head_dims="128,64")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds, dims = shape_args(parser, args)
    if args.rounds < 1 or args.reps < 1 or args.repeats < 1:
        parser.error("--rounds, --reps and --repeats must be >= 1")
    if args.child:
        _child(kinds, dims, args)
        return
    child_argv = [sys.executable, "-m", "benchmarks.attention_determinism", "--child"] + [
        f"--{name}={getattr(args, name.replace('-', '_'))}"
        for name in ("reps", "repeats", "batch", "seq", "heads", "head-dims", "kinds")]
    print(f"# cuDNN's backward with XLA's default flags ('default') and with {SETTINGS['deterministic']} "
          "('deterministic'); ours is the same kernel in both")
    head = (f"{'case':30s} {'setting':13s} {'ours TF/s':>9s} {'cuDNN TF/s':>10s} {'ours/cuDNN':>10s} "
            f"{'distinct ours/cuDNN':>19s}")
    print(head)
    print("-" * len(head))
    for _ in range(args.rounds):
        for setting, flag in SETTINGS.items():
            env = dict(os.environ)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
            proc = subprocess.run(child_argv, env=env, capture_output=True, text=True)
            rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
            if proc.returncode != 0 or not rows:
                print(f"# {setting}: child failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
                continue
            for r in rows:
                ours_tf, cudnn_tf = r["flops"] / r["ours_ms"] / 1e9, r["flops"] / r["cudnn_ms"] / 1e9
                print(f"{r['case']:30s} {setting:13s} {ours_tf:9.1f} {cudnn_tf:10.1f} "
                      f"{r['cudnn_ms'] / r['ours_ms']:10.2f} {r['distinct_ours']:>10d}/{r['distinct_cudnn']:<8d}",
                      flush=True)


if __name__ == "__main__":
    main()
