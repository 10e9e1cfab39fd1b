"""Packed documents on the CPU: attention with segment ids, the kernel (which skips the
(query tile, key tile) pairs whose segment-id ranges do not meet) against the pure-JAX
reference (dense [B, H, Sq, Sk] scores), and plain causal attention over the same batch
(the kernel and XLA's code), all f32, loss + gradients of q, k, v, causal.

Each row of the packed batch holds documents whose lengths are drawn from a lognormal
distribution (sigma 1, mean ``--mean-doc``; long-tailed), cut at the sequence end. The
variants are timed in interleaved rounds (one call of each per round, after warm-up) and
the median per variant is reported, so a drift of the shared machine hits all alike.
``visible`` is the fraction of the causal (query, key) pairs that stay visible within
the documents; ``ref/kernel`` > 1 means the kernel is faster.

    python -m benchmarks.attention_segments_cpu --seqs 512,1024,2048,4096
"""

from __future__ import annotations

import argparse
import statistics
import time


def packed_segment_ids(batch: int, seq: int, mean_doc: float, seed: int):
    """[batch, seq] int32 ids of consecutive documents with lognormal lengths (>= 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(mean_doc) - sigma ** 2 / 2
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < seq:
            ids += [doc] * max(1, int(round(rng.lognormal(mu, sigma))))
            doc += 1
        rows.append(ids[:seq])
    return np.asarray(rows, np.int32)


def visible_fraction(ids) -> float:
    """Causal pairs (j <= i) inside one document over all causal pairs."""
    import numpy as np

    total = seen = 0
    for row in ids:
        _, counts = np.unique(row, return_counts=True)
        seen += int(np.sum(counts * (counts + 1) // 2))
        total += len(row) * (len(row) + 1) // 2
    return seen / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqs", default="512,1024,2048,4096", help="sequence lengths, comma-separated")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mean-doc", type=float, default=256.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]

    import jax
    import jax.numpy as jnp
    import numpy as np

    from rlx_jax.ops import attention
    from rlx_jax.vjp_rules import attention as routing

    def compiled(fn, segments: bool, kernel: bool, *xs):
        """fn's loss + gradients, lowered and compiled under the routing it is named for
        (the thresholds are read when the program is lowered)."""
        saved = routing.CPU_KERNEL_MIN_SCORE_BYTES, routing.CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES
        big = 1 << 62
        routing.CPU_KERNEL_MIN_SCORE_BYTES = 0 if kernel else big
        routing.CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES = 0 if kernel else big
        try:
            grad = jax.jit(jax.value_and_grad(lambda q, k, v, ids: jnp.sum(fn(q, k, v, ids) * q), (0, 1, 2)))
            return grad.lower(*xs).compile()
        finally:
            routing.CPU_KERNEL_MIN_SCORE_BYTES, routing.CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES = saved

    packed = lambda q, k, v, ids: attention(q, k, v, mask_kind="causal", q_segment_ids=ids, kv_segment_ids=ids)
    causal = lambda q, k, v, ids: attention(q, k, v, mask_kind="causal")
    print(f"# B {args.batch}, H {args.heads} / {args.kv_heads}, D {args.head_dim}, f32, causal, loss + grads; "
          f"lognormal documents of mean {args.mean_doc:g}; median of {args.rounds} interleaved rounds (ms)")
    header = (f"{'S':>6} {'visible':>8} {'seg kernel':>11} {'seg ref':>9} {'causal kernel':>14} "
              f"{'causal XLA':>11} {'ref/kernel':>11} {'causal kernel/seg kernel':>25}")
    print(header)
    print("-" * len(header))
    for seq in seqs:
        rng = np.random.default_rng(seq)
        shape_q = (args.batch, seq, args.heads, args.head_dim)
        shape_k = (args.batch, seq, args.kv_heads, args.head_dim)
        q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shape_q, shape_k, shape_k))
        ids_np = packed_segment_ids(args.batch, seq, args.mean_doc, seed=seq)
        ids = jnp.asarray(ids_np)
        xs = (q, k, v, ids)
        variants = {
            "seg kernel": compiled(packed, True, True, *xs),
            "seg ref": compiled(packed, True, False, *xs),
            "causal kernel": compiled(causal, False, True, *xs),
            "causal XLA": compiled(causal, False, False, *xs),
        }
        for fn in variants.values():
            jax.block_until_ready(fn(*xs))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*xs))
                times[name].append((time.perf_counter() - t0) * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(f"{seq:>6} {visible_fraction(ids_np):>8.3f} {ms['seg kernel']:>11.1f} {ms['seg ref']:>9.1f} "
              f"{ms['causal kernel']:>14.1f} {ms['causal XLA']:>11.1f} {ms['seg ref'] / ms['seg kernel']:>11.2f} "
              f"{ms['causal kernel'] / ms['seg kernel']:>25.2f}", flush=True)


if __name__ == "__main__":
    main()
