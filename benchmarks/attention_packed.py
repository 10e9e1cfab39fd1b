"""Packed documents on the GPU: attention fwd+bwd of a batch of packed documents (segment
ids), against the plain causal kernel and against the same batch run as causal attention
with a dense additive bias that hides the cross-document pairs (what a user without segment
ids passes), plus the cost of attention sinks.

    python3 -m benchmarks.attention_packed --reps 5 --rounds 2

Each row's time is the best of ``--rounds`` alternating medians of ``--reps`` samples
(benchmarks.harness.time_fn), all variants timed in every round. TF/s count the work a
variant must do: the plain causal kernel's is the causal pairs' (benchmarks.cases_attention:
fwd+bwd = 3.5 x 4 B H S^2 D / 2), the packed variants' only the visible pairs' (a query and a
key of the same document, key at or before the query). "vs causal": the packed kernel's
visible TF/s over the plain causal kernel's TF/s. "speedup": the dense-bias variant's time
over the row's. "tile ceiling": the "vs causal" the kernels' tile sizes allow on this layout
(``tile_ceiling``; ``--tile-ceiling`` prints it alone, without a GPU). Documents: lengths
drawn from a log-normal distribution (sigma 1, scaled to mean ``--mean-doc``, draw
``--seed``), packed back to back, the last one cut at the sequence end; bf16, B4 S8192 H16
D128 by default. The packed kernel's values and gradients are checked against the dense
bias variant's before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def packed_segment_ids(b: int, s: int, mean: float, seed: int = 0, layout: str = "lognormal") -> np.ndarray:
    """[B, S] int32 ids of documents with log-normal lengths (sigma 1, mean ``mean``, at least 1);
    layout "one": one document a row (the plain causal work through the segment-id kernel),
    "tokens": every token its own document (only the diagonal tiles hold visible pairs)."""
    if layout == "one":
        return np.zeros((b, s), np.int32)
    if layout == "tokens":
        return np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - 0.5  # E[exp(N(mu, 1))] = exp(mu + 1/2)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < s:
            ids += [doc] * max(1, int(rng.lognormal(mu, 1.0)))
            doc += 1
        rows.append(ids[:s])
    return np.array(rows, np.int32)


def visible_pairs(ids: np.ndarray) -> int:
    """Causal pairs (key at or before the query) inside one document, summed over the batch."""
    total = 0
    for row in ids:
        _, counts = np.unique(row, return_counts=True)
        total += int((counts * (counts + 1) // 2).sum())
    return total


def tiles_with_visible_pairs(ids: np.ndarray, rows: int, keys: int) -> int:
    """The (query tile of ``rows``, key tile of ``keys``) pairs that hold at least one visible
    pair (same document, key at or before the query), summed over the batch: the tiles the
    segment kernels compute for ids that do not decrease along a row (a tile outside a query
    tile's id hull, or past its causal end, holds none; every tile inside holds one). Query
    tile [q0, q1) sees the keys from the start of its first row's document to min(the end of
    its last row's document, q1)."""
    total = 0
    for row in ids:
        s = row.size
        first = np.searchsorted(row, row, side="left")  # start of each token's document
        for q0 in range(0, s, rows):
            q1 = min(q0 + rows, s)
            k0, k1 = first[q0], q1  # keys up to the last row (sorted ids: its document ends later)
            total += (k1 + keys - 1) // keys - k0 // keys
    return total


def tile_ceiling(ids: np.ndarray, rows: int, keys: int) -> float:
    """The most "vs causal" a kernel of (rows x keys) tiles can reach on these documents if each
    tile it computes runs at the plain causal kernel's speed: (visible pairs / pairs in the
    computed tiles) over the same ratio of the causal kernel on one document a row."""
    one = np.zeros_like(ids)
    packed = visible_pairs(ids) / tiles_with_visible_pairs(ids, rows, keys)
    causal = visible_pairs(one) / tiles_with_visible_pairs(one, rows, keys)
    return packed / causal


#: the CUDA kernels' tiles with segment ids: the forward's query tile x key tile, and the fused
#: backward's query tile x key block (ffi/cuda/attention_fused_bwd.cuh, fused_rows: 64 at D 128)
FWD_TILE, BWD_TILE = (128, 128), (64, 128)


def ceiling_line(ids: np.ndarray) -> str:
    fwd, bwd = tile_ceiling(ids, *FWD_TILE), tile_ceiling(ids, *BWD_TILE)
    return (f"tile ceiling (each computed tile at the causal kernel's speed): {fwd:.2f}x the causal kernel "
            f"forward ({FWD_TILE[0]} x {FWD_TILE[1]} tiles), {bwd:.2f}x backward ({BWD_TILE[0]} x {BWD_TILE[1]})")


def main() -> None:
    # the GPU side's imports here: the id helpers above are loaded on their own by the CPU tests
    import jax
    import jax.numpy as jnp

    from benchmarks.cases_attention import _fwd_bwd, attention_flops, gpu_inputs
    from benchmarks.harness import default_batch, time_fn
    from rlx_jax.ops import attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mean-doc", type=float, default=1024.0)
    ap.add_argument("--seed", type=int, default=0, help="the document lengths' random draw")
    ap.add_argument("--layout", choices=("lognormal", "one", "tokens"), default="lognormal",
                    help="document lengths: log-normal (default), one document a row, one a token")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--tile-ceiling", action="store_true",
                    help="print only the layout's tile ceiling (no GPU needed) and exit")
    args = ap.parse_args()
    if args.tile_ceiling:
        print(ceiling_line(packed_segment_ids(args.batch, args.seq, args.mean_doc, args.seed, args.layout)))
        return

    dev = next(d for d in jax.devices() if d.platform == "gpu")
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    q, k, v, dy = gpu_inputs(b, s, h, d, dev)
    ids_np = packed_segment_ids(b, s, args.mean_doc, args.seed, args.layout)
    ids = jax.device_put(jnp.asarray(ids_np), dev)
    sinks = jax.device_put(jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32), dev)
    # the dense bias: 0 inside a document, a large negative number across (exp underflows to 0)
    bias = jnp.where(ids[:, None, :, None] == ids[:, None, None, :], 0.0, -30000.0).astype(q.dtype)
    bias = jax.device_put(jnp.broadcast_to(bias, (b, h, s, s)), dev)

    # every array is an argument of the jitted step (closed over, the 8.6 GB bias would be
    # baked into the program as a constant)
    variants = {
        "causal kernel (no documents)": (lambda q, k, v, ids, sinks, bias: attention(q, k, v, mask_kind="causal"),
                                         None),
        "packed: segment ids": (lambda q, k, v, ids, sinks, bias: attention(
            q, k, v, mask_kind="causal", q_segment_ids=ids, kv_segment_ids=ids), "visible"),
        "packed: segment ids + sinks": (lambda q, k, v, ids, sinks, bias: attention(
            q, k, v, mask_kind="causal", q_segment_ids=ids, kv_segment_ids=ids, sinks=sinks), "visible"),
        "packed: causal + dense bias": (lambda q, k, v, ids, sinks, bias: attention(
            q, k, v, mask_kind="causal", bias=bias), "visible"),
    }

    def fwd_bwd(fn):
        def run(q, k, v, dy, ids, sinks, bias):
            return _fwd_bwd(lambda q, k, v: fn(q, k, v, ids, sinks, bias))(q, k, v, dy)

        return jax.jit(run)

    def fwd(fn):
        return jax.jit(lambda q, k, v, dy, ids, sinks, bias: fn(q, k, v, ids, sinks, bias))

    fns = {name: fwd_bwd(fn) for name, (fn, _) in variants.items()}
    fwd_fns = {name: fwd(fn) for name, (fn, _) in variants.items()}
    call_args = (q, k, v, dy, ids, sinks, bias)

    # correctness first: the segment kernel against the dense-bias kernel
    got, want = fns["packed: segment ids"](*call_args), fns["packed: causal + dense bias"](*call_args)
    errs = [float(jnp.linalg.norm((x - y).astype(jnp.float32)) / jnp.linalg.norm(y.astype(jnp.float32)))
            for x, y in zip(got, want)]
    print(f"segment ids vs dense bias, relative error of dq, dk, dv: {', '.join(f'{e:.1e}' for e in errs)}")
    assert max(errs) < 2e-2, errs

    batch = default_batch(dev)
    best = {name: float("inf") for name in fns}
    best_fwd = dict(best)
    for _ in range(args.rounds):
        for name in fns:
            best[name] = min(best[name], time_fn(fns[name], call_args, args.reps, batch=batch))
            best_fwd[name] = min(best_fwd[name], time_fn(fwd_fns[name], call_args, args.reps, batch=batch))
    vis = visible_pairs(ids_np)
    causal_pairs = b * s * (s + 1) // 2
    full_flops = attention_flops(b, h, s, d, causal=True, backward=True)
    flops = {None: full_flops, "visible": full_flops * vis / causal_pairs}
    lengths = np.concatenate([np.unique(r, return_counts=True)[1] for r in ids_np])
    print(f"packed attention fwd+bwd, bf16 B{b} S{s} H{h} D{d}, {jax.devices()[0].device_kind}, jax "
          f"{jax.__version__}; {lengths.size} documents, mean length {lengths.mean():.0f} (median "
          f"{statistics.median(lengths.tolist()):.0f}, max {lengths.max()}); visible pairs "
          f"{100 * vis / causal_pairs:.1f}% of the causal ones; best of {args.rounds} rounds x {args.reps} reps")
    print("| variant | fwd+bwd ms | TF/s (work counted) | vs causal | speedup vs dense bias | fwd ms | fwd vs causal |")
    print("|---|---|---|---|---|---|---|")
    causal_tf = full_flops / best["causal kernel (no documents)"] / 1e9
    dense = best["packed: causal + dense bias"]
    rows = []
    for name, (_, work) in variants.items():
        tf = flops[work] / best[name] / 1e9
        # the forward alone: visible TF/s over the causal kernel's, as for fwd+bwd
        fwd_vs = flops[work] / best_fwd[name] / (full_flops / best_fwd["causal kernel (no documents)"])
        rows.append(dict(variant=name, ms=best[name], tflops=tf, vs_causal=tf / causal_tf,
                         speedup_vs_dense_bias=dense / best[name], fwd_ms=best_fwd[name], fwd_vs_causal=fwd_vs))
        print(f"| {name} | {best[name]:.3f} | {tf:.0f} | {tf / causal_tf:.2f}x | {dense / best[name]:.2f}x "
              f"| {best_fwd[name]:.3f} | {fwd_vs:.2f}x |")
    sink_cost = best["packed: segment ids + sinks"] / best["packed: segment ids"] - 1
    print(f"sinks cost {100 * sink_cost:+.1f}% over the segment-id kernel without them")
    print(ceiling_line(ids_np))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, sinks_cost=sink_cost, visible_fraction=vis / causal_pairs), f, indent=1)


if __name__ == "__main__":
    main()
