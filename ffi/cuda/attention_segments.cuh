// Segment ids (packed documents) in the wgmma attention kernels: query i sees key j only where
// qseg[b, i] == kseg[b, j], on top of the mask kind, window and key mask. The kernels take the
// MASK form 3 (mask_level in attention_launch_impl.cuh) and read four more arrays (AttnArgs):
//   qseg [B, Sq], kseg [B, Sk] int32: the ids;
//   qinfo [B, ceil(Sq / 64)], kinfo [B, ceil(Sk / 64)] int4: per granule of 64 rows (keys), the
//     min and max id (x, y) and the granules of the other side whose id ranges meet them, as the
//     half-open range [z, w) (z >= w: none). The Python side computes them in XLA
//     (rlx_jax/vjp_rules/attention_segments.py, segment_tile_info).
// Tile skipping: a forward query tile computes only the key tiles inside the hull of its granules'
// ranges (seg_key_range), and a backward key block visits only the query tiles inside its hull
// (FusedSchedule). For ids that do not decrease along the sequence (packed documents) every tile
// outside the hull is hidden and every tile inside it holds a pair of equal ids, so a packed
// batch costs about its visible work; other orders are still exact (per-score test), with the hidden tiles
// inside the hull computed and masked.
// Per-score test: a warp whose rows all share one id u, on a tile whose columns all hold u, needs
// none (seg_tile's warp-uniform need, one compare a loaded id); else each thread gathers its
// columns' ids by shuffles into two 32-bit words (SegTile::bits), which the positional test of the
// kernels reads (bit 2 nt + (e & 1): column 8 nt + 2 tq + (e & 1) of the thread's row e >> 1).
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/attention_generic.cuh"

namespace rlx {
namespace cuda {
namespace attn {

constexpr int kSegGranule = 64;
// query rows of the forward's tiles, the unit of its tile order (AttnArgs::qorder)
constexpr int kSegOrderRows = 128;

// The per-score segment test of one tile for a thread: need (warp-uniform) false: no score is
// hidden by the ids; else bit 2 nt + (e & 1) of bits[r] says the thread's row r sees column
// 8 nt + 2 tq + (e & 1). The default (all kept) is what the kernels without ids pass: a constant
// the compiler folds away.
struct SegTile {
  bool need = false;
  uint32_t bits[2] = {~0u, ~0u};
  __device__ __forceinline__ bool kept(int nt, int e) const {
    return ((bits[e >> 1] >> (2 * nt + (e & 1))) & 1u) != 0u;
  }
};

// The ids of a thread's two rows r0, r0 + 8 (ids [n] of one batch), and whether all 32 lanes' rows
// share one id (`uni`, lane 0's first row). Rows at or past n take `uni`: the kernels hide them by
// position.
struct SegRows {
  int id[2];
  int uni;
  bool same;
};
__device__ __forceinline__ SegRows seg_rows(const int* __restrict__ ids, int64_t n, int64_t r0) {
  SegRows r;
  bool live[2];
  int v[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    live[i] = r0 + 8 * i < n;
    v[i] = live[i] ? ids[r0 + 8 * i] : 0;
  }
  r.uni = __shfl_sync(0xffffffffu, v[0], 0);  // lane 0's first row: the warp's first (dead: all are)
#pragma unroll
  for (int i = 0; i < 2; ++i) r.id[i] = live[i] ? v[i] : r.uni;
  r.same = __all_sync(0xffffffffu, r.id[0] == r.uni && r.id[1] == r.uni);
  return r;
}

// Lane l's ids of columns c0 + 32 w + l (w < W) of one batch's n, `fill` past n (those columns are
// hidden by position). Loaded ahead of the tile's products, as the key mask's values.
template <int W>
__device__ __forceinline__ void seg_load(int (&cv)[W], const int* __restrict__ ids, int64_t c0, int64_t n, int fill,
                                         int lane) {
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const int64_t j = c0 + 32 * w + lane;
    cv[w] = j < n ? ids[j] : fill;
  }
}

// The tile's SegTile for a thread (NT column blocks of 8: 32 / 4 W of them) from its rows (seg_rows)
// and the tile's column ids (seg_load, filled with rows.uni).
template <int NT, int W>
__device__ __forceinline__ SegTile seg_tile(const SegRows& rows, const int (&cv)[W], int tq) {
  static_assert(NT == 4 * W && NT <= 16, "seg_tile: 32 columns a word, 16 column blocks at most");
  bool ok = rows.same;
#pragma unroll
  for (int w = 0; w < W; ++w) ok = ok && cv[w] == rows.uni;
  SegTile t;
  t.need = !__all_sync(0xffffffffu, ok);
  if (t.need) {
    t.bits[0] = t.bits[1] = 0u;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int id = __shfl_sync(0xffffffffu, cv[nt >> 2], 8 * (nt & 3) + 2 * tq + e);
        t.bits[0] |= uint32_t(id == rows.id[0]) << (2 * nt + e);
        t.bits[1] |= uint32_t(id == rows.id[1]) << (2 * nt + e);
      }
  }
  return t;
}

// The granules [g0, g1) of `info` (one batch's row): the union of their hulls [z, w), in granules
// of the other side (z >= w: empty).
__device__ __forceinline__ void seg_hull(const int4* __restrict__ info, int64_t g0, int64_t g1, int* z, int* w) {
  int lo = INT_MAX, hi = INT_MIN;
  for (int64_t g = g0; g < g1; ++g) {
    const int4 v = __ldg(info + g);
    if (v.z < v.w) {
      lo = min(lo, v.z);
      hi = max(hi, v.w);
    }
  }
  *z = lo;
  *w = hi;
}

// Forward: narrows the key range [kbeg, kend) of query rows [q0, q0 + rows) of batch b to the hull
// of their granules (kbeg stays a multiple of `tile`); no ids: unchanged. Empty: kend <= kbeg.
__device__ __forceinline__ void seg_key_range(const AttnArgs& a, int64_t b, int64_t q0, int64_t rows, int64_t tile,
                                              int64_t* kbeg, int64_t* kend) {
  if (a.qinfo == nullptr) return;
  const int64_t nqg = (a.Sq + kSegGranule - 1) / kSegGranule;
  int z, w;
  seg_hull(a.qinfo + b * nqg, q0 / kSegGranule, min(nqg, (q0 + rows + kSegGranule - 1) / kSegGranule), &z, &w);
  if (z >= w) {
    *kend = *kbeg;
    return;
  }
  *kbeg = max(*kbeg, int64_t(z) * kSegGranule / tile * tile);
  *kend = min(*kend, int64_t(w) * kSegGranule);
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
