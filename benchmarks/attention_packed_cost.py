"""Where the segment-id attention kernels' time goes on packed documents: the forward and
forward+backward of the CUDA kernels over document layouts of the same batch, each with the
key tiles the forward computes and how many of them a document boundary crosses.

    python3 -m benchmarks.attention_packed_cost --reps 5

Layouts (B4 S8192 by default): one document a row (the causal work through the segment
kernels), log-normal lengths of mean ``--mean-doc`` (benchmarks.attention_packed's), the same
documents with their boundaries moved to the next multiple of 128 tokens (no boundary inside a
tile), documents of exactly ``--mean-doc`` tokens starting on a tile edge and the same shifted
by 64 tokens (every boundary inside a tile), one a token. Per layout: the key tiles the
forward computes (128 x 128 tiles inside each query tile's id hull and its causal range, as
the kernels take them from ``segment_tile_info``; a fraction of the causal kernel's), the
share of them that a document boundary crosses (some warp's rows or the tile's keys hold two
ids: the per-score id test runs there), and the forward's time per computed key tile and
multiprocessor (fwd ms x SMs / (heads x key tiles)) and per query tile. Reference rows without ids: the plain
causal kernel (long key ranges) and sliding windows of 0 and 1023 keys (one and about eight
key tiles a query tile: the cost of a query tile with few key tiles, ids or not). Timing:
benchmarks.harness.time_fn, best of ``--rounds``.
"""

from __future__ import annotations

import argparse

import numpy as np

TILE = 128  # query rows and keys of a forward tile (D 128)
WARP_ROWS = 16  # query rows of a consumer warp: the per-score id test is decided per warp


def snapped(ids: np.ndarray, tile: int = TILE) -> np.ndarray:
    """The documents of ``ids`` with every boundary moved to the next tile edge: token i
    takes the id of the first token of its tile (documents shorter than a tile merge)."""
    return np.repeat(ids[:, ::tile], tile, axis=1)[:, : ids.shape[1]].copy()


def regular(b: int, s: int, length: int, shift: int = 0) -> np.ndarray:
    """Documents of ``length`` tokens, the first ``length - shift`` long (shift < length)."""
    return np.broadcast_to((np.arange(s, dtype=np.int32) + shift) // length, (b, s)).astype(np.int32)


def forward_tiles(ids: np.ndarray, qinfo: np.ndarray, granule: int, tile: int = TILE) -> tuple[int, int]:
    """(key tiles the causal forward computes, those a document boundary crosses) over the
    batch for self-attention on ``ids`` [B, S] with the kernels' query granule table
    ``qinfo`` [B, S / granule, 4]: query tile [q0, q0 + tile) computes key tiles from the
    tile of its granules' hull start to its last row (seg_key_range); a key tile is crossed
    when the keys or some warp's query rows hold more than one id."""
    b, s = ids.shape
    computed = crossed = 0
    per = tile // granule
    for r in range(b):
        row = ids[r]
        for q0 in range(0, s, tile):
            info = qinfo[r, q0 // granule: min(qinfo.shape[1], q0 // granule + per)]
            info = info[info[:, 2] < info[:, 3]]
            if info.size == 0:
                continue
            kbeg = int(info[:, 2].min()) * granule // tile * tile
            kend = min(min(s, q0 + tile), int(info[:, 3].max()) * granule)
            rows = row[q0: q0 + tile]
            warps = [rows[w: w + WARP_ROWS] for w in range(0, rows.size, WARP_ROWS)]
            for k0 in range(kbeg, kend, tile):
                keys = row[k0: k0 + tile]
                computed += 1
                crossed += any(not ((w == w[0]).all() and (keys == w[0]).all()) for w in warps)
    return computed, crossed


def window_tiles(b: int, s: int, window: int, tile: int = TILE) -> int:
    """Key tiles of a sliding-window forward: query tile [q0, q0 + tile) from the tile of key
    q0 - window to its diagonal tile."""
    return b * sum(q0 // tile - max(0, q0 - window) // tile + 1 for q0 in range(0, s, tile))


def layouts(b: int, s: int, mean_doc: int) -> dict[str, np.ndarray]:
    from benchmarks.attention_packed import packed_segment_ids

    lognormal = packed_segment_ids(b, s, mean_doc)
    return {
        "one a row": packed_segment_ids(b, s, mean_doc, layout="one"),
        f"log-normal, mean {mean_doc}": lognormal,
        "the same, boundaries on tile edges": snapped(lognormal),
        f"{mean_doc} each, on tile edges": regular(b, s, mean_doc),
        f"{mean_doc} each, shifted by 64": regular(b, s, mean_doc, 64),
        "one a token": packed_segment_ids(b, s, mean_doc, layout="tokens"),
    }


def main() -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.cases_attention import _fwd_bwd, gpu_inputs
    from benchmarks.harness import default_batch, time_fn
    from rlx_jax.ops import attention
    from rlx_jax.vjp_rules.attention_segments import SEGMENT_GRANULE, segment_tile_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--mean-doc", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    dev = next(d for d in jax.devices() if d.platform == "gpu")
    b, s, h = args.batch, args.seq, args.heads
    q, k, v, dy = gpu_inputs(b, s, h, 128, dev)
    sms = getattr(dev, "core_count", None) or 132

    def jitted(fn):  # fn(q, k, v, ids) -> (forward, fwd+bwd), both taking the ids
        return (jax.jit(fn),
                jax.jit(lambda q, k, v, dy, i: _fwd_bwd(lambda q, k, v: fn(q, k, v, i))(q, k, v, dy)))

    seg = jitted(lambda q, k, v, i: attention(q, k, v, mask_kind="causal", q_segment_ids=i, kv_segment_ids=i))
    batch = default_batch(dev)
    causal_tiles = b * (s // TILE) * (s // TILE + 1) // 2
    # name -> (ids or None, (forward, fwd+bwd), key tiles of a case without ids)
    cases = {"causal kernel (no ids)": (None, jitted(lambda q, k, v, i: attention(q, k, v, mask_kind="causal")),
                                        causal_tiles)}
    for w in (0, 1023):
        cases[f"sliding window {w} (no ids)"] = (
            None, jitted(lambda q, k, v, i, w=w: attention(q, k, v, mask_kind="sliding", window=w)),
            window_tiles(b, s, w))
    cases.update({name: (ids, seg, None) for name, ids in layouts(b, s, args.mean_doc).items()})
    best = {name: [float("inf"), float("inf")] for name in cases}
    placed = {name: jax.device_put(jnp.asarray(ids if ids is not None else np.zeros((b, s), np.int32)), dev)
              for name, (ids, _, _) in cases.items()}
    for _ in range(args.rounds):
        for name, (_, (fwd, fb), _) in cases.items():
            best[name][0] = min(best[name][0], time_fn(fwd, (q, k, v, placed[name]), args.reps, batch=batch))
            best[name][1] = min(best[name][1], time_fn(fb, (q, k, v, dy, placed[name]), args.reps, batch=batch))

    print(f"segment-id attention, bf16 B{b} S{s} H{h} D128 causal, {dev.device_kind}, jax {jax.__version__}, "
          f"{sms} SMs; best of {args.rounds} rounds x {args.reps} reps")
    print("| layout | documents | key tiles (of causal) | crossed by a boundary | fwd ms | us / key tile / SM "
          "| us / query tile / SM | fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (ids, _, fixed_tiles) in cases.items():
        if ids is None:
            tiles, crossed, docs = fixed_tiles, 0, b
        else:
            qinfo = np.asarray(segment_tile_info(jnp.asarray(ids), jnp.asarray(ids))[0])
            tiles, crossed = forward_tiles(ids, qinfo, SEGMENT_GRANULE)
            docs = sum(np.unique(r).size for r in ids)
        per_tile = best[name][0] * 1e3 * sms / (h * tiles) if tiles else float("nan")
        per_query_tile = best[name][0] * 1e3 * sms / (h * b * (s // TILE))
        print(f"| {name} | {docs} | {tiles} ({tiles / causal_tiles:.3f}) | {100 * crossed / max(tiles, 1):.0f} % "
              f"| {best[name][0]:.3f} | {per_tile:.2f} | {per_query_tile:.2f} | {best[name][1]:.3f} |")


if __name__ == "__main__":
    main()
