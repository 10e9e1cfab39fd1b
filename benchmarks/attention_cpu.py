"""Attention on the CPU: ``rlx_jax.ops.attention`` against
``jax.nn.dot_product_attention(implementation="xla")``, forward and forward + backward
(value and gradients of sum(sin(out))), f32, causal, grouped-query heads. Variants run in
interleaved rounds and are timed by this process's CPU time (median over rounds), so a
machine shared with other work slows every variant alike.

    python -m benchmarks.attention_cpu                       # B8 S256 H8 / 2 D32 (the e2e CPU preset's layer)
    python -m benchmarks.attention_cpu --batch 2 --seq 1024 --heads 4 --kv-heads 4 --head-dim 64

At these sizes ``ops.attention`` lowers to its pure-JAX reference on the CPU (below
``CPU_KERNEL_MIN_SCORE_BYTES`` of scores); the rows compare that code with jax.nn's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def variants():
    """{name: fn(q, k, v) -> out} for ours and jax.nn's XLA path, causal."""
    import jax

    from rlx_jax.ops import attention

    return {
        "ours": lambda q, k, v: attention(q, k, v, mask_kind="causal"),
        "jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }


def compiled_steps(fns):
    """{(name, pass): jitted fn} for pass "fwd" (the output) and "fwd+bwd" (sum(sin(out))
    and its gradients in q, k, v)."""
    import jax
    import jax.numpy as jnp

    steps = {}
    for name, fn in fns.items():
        steps[(name, "fwd")] = jax.jit(fn)
        steps[(name, "fwd+bwd")] = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: jnp.sum(jnp.sin(fn(q, k, v))),
                                                              (0, 1, 2)))
    return steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    if min(a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, a.rounds) < 1 or a.heads % a.kv_heads:
        p.error("sizes and --rounds must be positive and --kv-heads must divide --heads")

    import jax
    import numpy as np

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (a.batch, a.seq, a.heads, a.head_dim))
    k = jax.random.normal(kk, (a.batch, a.seq, a.kv_heads, a.head_dim))
    v = jax.random.normal(kv, (a.batch, a.seq, a.kv_heads, a.head_dim))
    steps = compiled_steps(variants())
    outs = {key: jax.block_until_ready(f(q, k, v)) for key, f in steps.items()}
    for pass_ in ("fwd", "fwd+bwd"):
        got, want = (jax.tree.leaves(outs[(name, pass_)]) for name in ("ours", "jax.nn xla"))
        # relative to each result's largest magnitude (the loss is a sum over every output)
        err = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)) / max(float(np.max(np.abs(y))), 1.0)))
                  for x, y in zip(got, want))
        if not err < 1e-4:
            print(f"{pass_}: ours and jax.nn differ by {err:.2e} (relative)", file=sys.stderr)
            return 1
    times = {key: [] for key in steps}
    for _ in range(a.rounds):
        for key, f in steps.items():
            start = time.process_time()
            jax.block_until_ready(f(q, k, v))
            times[key].append(time.process_time() - start)
    print(f"# attention on the CPU ({jax.devices()[0].device_kind}), f32 causal, B{a.batch} S{a.seq} "
          f"H{a.heads} / {a.kv_heads} D{a.head_dim}; CPU ms, median of {a.rounds} interleaved rounds")
    for pass_ in ("fwd", "fwd+bwd"):
        ours, ref = (statistics.median(times[(n, pass_)]) * 1e3 for n in ("ours", "jax.nn xla"))
        print(f"{pass_:8s} ours {ours:8.1f} ms   jax.nn xla {ref:8.1f} ms   speed {ref / ours:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
