// Warp-specialised attention forward on Hopper wgmma (sm_90a), bf16 / f16, head dims 64 and 128,
// scale > 0, no bias, mask kind none or causal and, in its CAP / MASK forms (ws_softmax_tile), with a
// softcap, a key mask and / or a sliding window (attention_launch_impl.cuh routes these cases here).
// Measured (H200): 1.30x the forward of a 2-warpgroup kernel without the producer / consumer split at
// D 128, 1.07x / 1.15x the mma.sync forward at D 64 (none / causal).
//
// Block = 3 warpgroups (384 threads), one block per SM:
//   warpgroup 0 (producer, setmaxnreg.dec to kWsProdRegs). With TMA one thread of it issues each tile
//     as TMA copies (tma.cuh), announced to the tile's full barrier (count 1) with its bytes, in the
//     same layout with the same zero fill, and the other 127 exit: 1.08-1.15x the forward (H100).
//     Without TMA (the driver refused a tensor map) it loads the 128-row Q tile and the K / V tiles of
//     BC keys with cp.async (16 bytes, zero-filled past the sequence end) into the 128-byte-swizzle
//     K-major layout of attention_wgmma.cuh (wg_load_tile), into a ring of NST stages. Each thread's
//     copies of a tile complete on the stage's full barrier through cp.async.mbarrier.arrive.noinc
//     (count 128: one arrival per producer thread, made when that thread's earlier cp.async have
//     landed); K and V have their own full barriers, so S = Q K^T starts before V has landed. The
//     producer waits on the stage's empty barrier before it overwrites the stage, and on the Q empty
//     barrier before the next tile's Q (the consumers arrive on it once their last S = Q K^T of the
//     tile has completed).
//   warpgroups 1, 2 (consumers, setmaxnreg.inc to kWsConsRegs): 64 query rows each: S = Q K^T (smem x
//     smem), online softmax in registers, O += P V with P from registers; each waits on the full
//     barriers (then, cp.async producer only, fence.proxy.async: the data, written through the
//     generic proxy, is read by wgmma through the async proxy), and after its P V product has
//     completed lane 0 of each warp arrives on the stage's empty barrier (count 8). No CTA-wide
//     barrier after the prologue.
//   Persistent grid: block i serves tiles i, G + i, 2 G + i, ... or i, 2 G - 1 - i, 2 G + i, ... (zig) of
//     fwd_tile's order (ws_tile, G = gridDim.x = min(tiles, SMs)); the launcher picks zig
//     (attn_ws_zig), or with segment ids takes their tile order with zig (ws_fwd_tile). The ring's
//     stage and phase continue across tiles, so the producer loads the next tile's K / V while the
//     consumers finish the previous one and write its output.
// Consumer loop: pipelined within each consumer warpgroup: tile j's S = Q K^T is issued, then tile
//   j - 1's O += P V, and tile j's softmax runs while that product is in flight (wait_group 1, then 0
//   before O is rescaled); the stage of tile j - 1 is released after its product, so the ring has 3
//   stages (the producer keeps a whole step per load). Against a loop that waits for each product in
//   turn (2 stages; the same arithmetic in the same order, bitwise the same outputs), H100, B4 S4096
//   H16 bf16: forward 1.06-1.08x (D 128 none), 1.05-1.06x (D 128 causal), 1.06-1.08x (D 64 none),
//   1.01-1.03x (D 64 causal).
// Barrier phases: a consumer waits on a full barrier with the ring's parity bit (first pass 0), the
// producer on an empty barrier with the opposite bit (the first pass returns at once: the phase
// before the first is complete). A consumer warpgroup that skips a key tile (causal: past its last
// row) still waits on the full barriers and arrives on the empty one, which keeps it at most one
// ring pass ahead and every phase's arrival count exact.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/attention_wgmma.cuh"
#include "cuda/tma.cuh"

namespace rlx {
namespace cuda {
namespace attn {

// The consumers hold O, S and two P buffers (D 128: 64 + 64 + 2 x 32 registers): the producer gives
// up registers. 128 * 24 + 256 * 240 = 64512 = 384 * 168.
constexpr int kWsProdRegs = 24, kWsConsRegs = 240;

__device__ __forceinline__ void ws_arrive(uint64_t* bar) {
#if RLX_ATTN_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// one arrival on `bar` once every cp.async this thread issued before has completed (the arrival
// is one of the count given to mbar_init: .noinc)
__device__ __forceinline__ void ws_cp_async_arrive(uint64_t* bar) {
#if RLX_ATTN_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void ws_wait(uint64_t* bar, uint32_t parity) {
#if RLX_ATTN_WGMMA
  mbar_wait(bar, parity);
#endif
}
// The two consumer warpgroups' turns: named barrier 1 + w is warpgroup w's turn (0 is
// __syncthreads; 256 threads: the warpgroup whose turn it is syncs, the other arrives). Immediate
// barrier ids (a register id makes ptxas reserve all 16).
__device__ __forceinline__ void ws_turn_wait(int cw) {
#if RLX_ATTN_WGMMA
  if (cw == 0)
    asm volatile("bar.sync 1, 256;" ::: "memory");
  else
    asm volatile("bar.sync 2, 256;" ::: "memory");
#endif
}
// pass the turn to the other warpgroup
__device__ __forceinline__ void ws_turn_pass(int cw) {
#if RLX_ATTN_WGMMA
  if (cw == 0)
    asm volatile("bar.arrive 2, 256;" ::: "memory");
  else
    asm volatile("bar.arrive 1, 256;" ::: "memory");
#endif
}
// The block's warpgroup index (threadIdx.x / 128), taken through a shuffle from lane 0 so the compiler
// knows it is warp-uniform and keeps what derives from it (wgmma descriptors, shared-memory bases) in
// uniform registers: the D 128 WS fused backward's consumer loop R2UR 48 -> 3, IMAD 151 -> 90 (sm_90a SASS). Every lane of the warp must be active.
__device__ __forceinline__ int ws_warpgroup() { return __shfl_sync(0xffffffffu, int(threadIdx.x >> 7), 0); }
template <int N>
__device__ __forceinline__ void ws_setmaxnreg_dec() {
#if RLX_ATTN_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void ws_setmaxnreg_inc() {
#if RLX_ATTN_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

// wg_load_tile for the producer warpgroup (128 threads) with few registers: the same layout and
// zero fill, one source pointer and one shared address advanced per pass (not one per pass).
template <typename T, int D, int ROWS>
__device__ __forceinline__ void ws_load_tile(T* dst, const T* __restrict__ x, int64_t rs, int64_t r0, int64_t n) {
#if RLX_ATTN_WGMMA
  constexpr int kChunks = D / 8, kStep = 128 / kChunks;
  static_assert(128 % kChunks == 0 && kStep % 8 == 0 && ROWS % kStep == 0, "ws_load_tile: whole passes");
  const int r = (threadIdx.x & 127) / kChunks, c = threadIdx.x % kChunks;
  int left = int(min(n - r0 - r, int64_t(1) << 30));  // this thread's row of pass `it` exists if it * kStep < left
  const T* src = x + (r0 + r) * rs + c * 8;
  uint32_t d = smem_addr(dst + (c >> 3) * ROWS * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3));
  const int64_t step = kStep * rs;
#pragma unroll 4
  for (int it = 0; it < ROWS / kStep; ++it) {
    const bool ok = left > 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(ok ? src : x), "r"(ok ? 16 : 0)
                 : "memory");
    src += step;
    d += kStep * 128;
    left -= kStep;
  }
#endif
}

// Tile of pass n of a persistent block (G = gridDim.x blocks, block i): n G + i, the plain stride,
// or with zig n G + i in even passes and n G + G - 1 - i in odd ones (boustrophedon). fwd_tile's
// order puts a head's heaviest causal tiles first, so with the plain stride a block whose index
// meets the same query tile in every pass keeps it. By the model of a tile's work = its key tiles
// + 1, causal, 64 heads, G = 132 SMs, the busiest block carries 1.12x the mean work at nqt = 32
// query tiles a head (S 4096) and 1.90x at nqt = 22 (S 2816), against 1.03x and 1.11x in
// boustrophedon passes; other shapes favour the plain stride (32 heads, nqt 32, G 114: 1.13x
// against 1.41x). The launcher picks by that model (attn_ws_zig, attention_launch_impl.cuh). A pass past the
// last tile ends the block's sequence: every later pass starts beyond it.
__device__ __forceinline__ int64_t ws_tile(int64_t n, bool zig) {
  const int64_t G = gridDim.x, i = blockIdx.x;
  return n * G + (zig && (n & 1) ? G - 1 - i : i);
}

// The forward's tile t as (query tile qt, batch x head bh): fwd_tile's order, or with a tile order
// (a.qorder, segment ids: the (batch, query tile) pairs b nqt + qt by descending work, computed in
// XLA by segment_tile_order) the pair at t / H with head t % H. A packed batch's query tiles differ
// in work by their documents' lengths; dealt heaviest first in boustrophedon passes (ws_tile's zig)
// the blocks' loads stay within about 1 % of their mean by the model of segment_tile_order, where
// fwd_tile's order leaves the busiest block 1.15-1.2x the mean on log-normal documents (B4 S8192,
// 132 SMs). Measured there with ncu, with the positional test as bits (ws_softmax_tile): the busiest
// multiprocessor's active cycles 1.06x the mean, against 1.29x before both. The order gives up the
// L2 reuse of a document's neighbouring query tiles (the log-normal forward reads 1.5 GB from DRAM)
// but not time: orders that keep neighbours together ran within the noise of it
// (docs/PERFORMANCE.md), the kernel being latency-bound there. An entry out of range is clamped
// (its outputs are then wrong, but no access leaves the arrays).
__device__ __forceinline__ void ws_fwd_tile(const AttnArgs& a, int64_t t, int64_t nqt, int64_t nbh, int64_t hc,
                                            int64_t* qt, int64_t* bh) {
  if (a.qorder == nullptr) {
    fwd_tile(t, nqt, nbh, hc, qt, bh);
    return;
  }
  const int64_t j = t / a.H, h = t - j * a.H;
  const int64_t p = min(max(int64_t(__ldg(a.qorder + j)), int64_t(0)), a.B * nqt - 1);
  const int64_t b = p / nqt;
  *qt = p - b * nqt;
  *bh = b * a.H + h;
}

// The ring's barriers, NST stages: K full, V full (count `fulls`: 128, one cp.async arrival per
// producer thread; 1 with TMA, the issuing thread's arrival with the bytes to expect), empty (count
// 8: lane 0 of each consumer warp); Q full (`fulls`) and Q empty (8). Laid out from `at` on (8-byte
// aligned), initialised by thread 0; the caller's __syncthreads publishes them.
struct WsRing {
  uint64_t *kfull, *vfull, *empty, *qfull, *qempty;
};
template <int NST>
__device__ __forceinline__ WsRing ws_ring_init(void* at, uint32_t fulls = 128) {
  WsRing r;
  r.kfull = reinterpret_cast<uint64_t*>(at);
  r.vfull = r.kfull + NST;
  r.empty = r.vfull + NST;
  r.qfull = r.empty + NST;
  r.qempty = r.qfull + 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NST; ++s) {
      mbar_init(r.kfull + s, fulls);
      mbar_init(r.vfull + s, fulls);
      mbar_init(r.empty + s, 8);
    }
    mbar_init(r.qfull, fulls);
    mbar_init(r.qempty, 8);
    mbar_init_fence();
  }
  return r;
}

// The producer warpgroup's whole loop (warpgroup 0 of the warp-specialised kernels): for each tile
// of this block (fwd_tile's order, BM query rows of one (batch, head)) it waits for the consumers
// to free Q, loads the tile's Q rows (and dO's into Gs with DO: the dq kernel), then streams
// the K / V tiles of BC keys of the tile's key range (key_range: causal stops at the last row)
// through the NST-stage ring, waiting on each stage's empty barrier before overwriting it.
// TMA (the forward only): one thread runs the loop and each tile is one TMA copy per 64 columns
// (tma.cuh: maps), announced to its full barrier (count 1) with the tile's bytes by tma_load_rows;
// otherwise the whole warpgroup copies with cp.async (count 128).
template <typename T, int D, int BM, int BC, int NST, bool DO, bool TMA = false>
__device__ __forceinline__ void ws_produce(const AttnArgs& a, const T* __restrict__ q, const T* __restrict__ dout,
                                           const T* __restrict__ k, const T* __restrict__ v, T* Qs, T* Gs, T* Ks,
                                           T* Vs, const WsRing& ring, int hc, bool zig,
                                           const TileMaps* maps = nullptr) {
  static_assert(!(TMA && DO), "ws_produce: TMA loads Q, K and V only");
  const int64_t nqt = (a.Sq + BM - 1) / BM, nbh = a.B * a.H, ntiles = nqt * nbh;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  int st = 0;
  uint32_t ph = 0, qph = 0;
  for (int64_t n = 0, t = ws_tile(0, zig); t < ntiles; t = ws_tile(++n, zig)) {
    int64_t qt, bh;
    ws_fwd_tile(a, t, nqt, nbh, hc, &qt, &bh);
    const int64_t h = bh % a.H, b = bh / a.H, hk = h / a.group, q0 = qt * BM;
    const T* kb = k + (b * a.Sk * a.Hkv + hk) * D;
    const T* vb = v + (b * a.Sk * a.Hkv + hk) * D;
    int64_t kbeg, kend;
    key_range(a, q0, min(a.Sq - 1, q0 + BM - 1), &kbeg, &kend, BC);
    seg_key_range(a, b, q0, BM, BC, &kbeg, &kend);  // segment ids: the tiles their ranges meet
    ws_wait(ring.qempty, qph ^ 1);
    qph ^= 1;
    if constexpr (TMA) {
      tma_load_rows<T, D, BM>(Qs, &maps->q, h, q0, b, ring.qfull);
    } else {
      ws_load_tile<T, D, BM>(Qs, q + (b * a.Sq * a.H + h) * D, q_rs, q0, a.Sq);
      if constexpr (DO) ws_load_tile<T, D, BM>(Gs, dout + (b * a.Sq * a.H + h) * D, q_rs, q0, a.Sq);
      ws_cp_async_arrive(ring.qfull);
    }
    for (int64_t k0 = kbeg; k0 < kend; k0 += BC) {
      ws_wait(ring.empty + st, ph ^ 1);
      if constexpr (TMA) {
        tma_load_rows<T, D, BC>(Ks + st * BC * D, &maps->k, hk, k0, b, ring.kfull + st);
        tma_load_rows<T, D, BC>(Vs + st * BC * D, &maps->v, hk, k0, b, ring.vfull + st);
      } else {
        ws_load_tile<T, D, BC>(Ks + st * BC * D, kb, kv_rs, k0, a.Sk);
        ws_cp_async_arrive(ring.kfull + st);
        ws_load_tile<T, D, BC>(Vs + st * BC * D, vb, kv_rs, k0, a.Sk);
        ws_cp_async_arrive(ring.vfull + st);
      }
      if (++st == NST) {
        st = 0;
        ph ^= 1;
      }
    }
  }
  if constexpr (!TMA) cp_async_wait_all();
}

// Shared memory: Q [128 x D], K and V [NST][BC x D], 1024 bytes to align the swizzle atoms, then
// the barriers (K full, V full, empty per stage; Q full, Q empty).
template <int D, int BC, int NST>
constexpr size_t wg_ws_smem() { return size_t(2) * D * (128 + 2 * NST * BC) + 1024 + 8 * (3 * NST + 2); }

// One key tile's online-softmax step for a consumer warpgroup (this thread: rows wrow0 + 8 r + g,
// r < 2, of the warp's 16; keys k0 + 8 nt + 2 tq + (e & 1) of s[nt][e]): masks s where the tile
// needs it (bounds; causal, the only mask kind here), takes the row max in log2 units (c2 = scale
// log2 e), updates the running max m and sum l, and writes P = 2^(s c2 - m) packed as the A
// fragments of the P V product. alpha = 2^(m_old - m_new): the factor by which O must be scaled
// before this tile's P V is added (l is already rescaled here).
// KEEP_S false: masked scores are stored back into s as -inf (the loop that waits for each product).
// KEEP_S true: s is only read (masked scores are -inf in the max and 0 in P, the same values): the
// pipelined loop runs this while a P V product is in flight, and ptxas serialises every wgmma of
// a kernel in which non-wgmma instructions define a wgmma's registers inside a pipeline stage
// (C7513); the P loop then has an unmasked and a masked copy, so unmasked tiles test no mask.
// CAP (a softcap c > 0): the score in log2 units is c log2 e tanh(s scale / c), taken as
// c2 tanh(s carg) (the caller's c2 = c log2 e, carg = scale / c). tanh is increasing, so the row's
// capped maximum is the cap of its raw maximum: the max pass stays on the raw scores and costs two
// tanh a thread, and s is still only read (one tanh and one ex2 a score, in the P loop).
// MASK (mask_level in attention_launch_impl.cuh: 1 a key mask, 2 mask kind sliding, a window with or
// without a key mask; the window's code is compiled at 2 only): with a key mask (a.mask), mv holds the
// tile's key mask values as mask_load reads them (lane l: keys k0 + 32 w + l), loaded by the caller
// ahead of the products' wait, and a tile with a hidden key is masked by its keys' bits (mask_bits:
// the same words in every lane); a window hides key k0 + dj from row wrow0 + di below
// dj = di + dg - window (tile_needs_mask sends the tiles its lower edge crosses to the masked path).
// A tile that only the key mask touches (no sequence end, causal diagonal or window edge crosses
// it: the common case of a key mask) takes a cheaper test than the positional one: the thread's 32
// keys 8 nt + 2 tq + (e & 1) are bits 8 (nt & 3) + (e & 1) of the words bits[nt / 4] >> 2 tq, so
// each score costs one constant-bit test and a select.
// MASK 3 (segment ids, a key mask and a window optional): sg (seg_tile) says whether the ids hide a
// score of the warp's rows in this tile (then the positional path, which also tests sg's bits).
template <typename T, int BC, bool KEEP_S, bool CAP = false, int MASK = 0, int W = 1>
__device__ __forceinline__ void ws_softmax_tile(const AttnArgs& a, float (&s)[BC / 8][4], int64_t wrow0, int64_t k0,
                                                int g, int tq, float c2, float carg, float (&m)[2], float (&l)[2],
                                                uint32_t (&p)[BC / 16][4], float (&alpha)[2], const float (&mv)[W],
                                                const SegTile& sg = SegTile{}) {
  static_assert(!MASK || W == BC / 32, "ws_softmax_tile: one mask word per 32 keys");
  // warp-uniform: a position mask (or, MASK 3, the segment ids) crosses the tile
  const bool need = tile_needs_mask(a, wrow0, k0, 16, BC) || (MASK == 3 && sg.need);
  bool keys = false;  // MASK, warp-uniform: the key mask hides a key of the tile
  uint32_t bits[W];
  if constexpr (MASK) {
    if (a.mask != nullptr) {
      bool all_on, none;
      mask_bits(bits, mv, &all_on, &none);
      keys = !all_on;
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) bits[w] = 0xffffffffu;
    }
  }
  // the key-only test (tiles with keys && !need): this thread's keys' bits at constant positions
  uint32_t kb[W] = {};
  auto key_kept = [&](int nt, int e) { return ((kb[nt >> 2] >> (8 * (nt & 3) + (e & 1))) & 1u) != 0u; };
  // The positional test (need): vis[r] holds the visibility of this thread's row wrow0 + 8 r + g in
  // the bits of frag_cols_below (score s[nt][e] at bit 2 nt + (e & 1) of vis[e >> 1]). Row
  // wrow0 + di exists if di < rl; it sees the keys k0 + dj with dj < cl (the sequence end), dj <= di + dg
  // (causal, sliding) and, MASK, the key mask's bit set, dj >= di + lo (MASK >= 2) and equal ids
  // (MASK 3).
  uint32_t vis[2] = {~0u, ~0u};
  auto visible = [&](int nt, int e) { return ((vis[e >> 1] >> (2 * nt + (e & 1))) & 1u) != 0u; };
  float mx[2] = {-INFINITY, -INFINITY};
  // the row maxima over the scores kept(nt, e) keeps (the others -inf, stored back into s unless KEEP_S)
  auto masked_max = [&](auto kept) {
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = kept(nt, e) ? s[nt][e] : -INFINITY;
        if constexpr (!KEEP_S) s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
  };
  if (!need && !keys) {
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
  } else if (MASK && !need) {
#pragma unroll
    for (int w = 0; w < W; ++w) kb[w] = bits[w] >> (2 * tq);
    masked_max(key_kept);
  } else {
    constexpr int64_t kBig = int64_t(1) << 40;  // past every column: no bound
    const int64_t rl = a.Sq - wrow0, cl = a.Sk - k0;
    const int64_t dg = a.kind != 0 ? wrow0 + a.off - k0 : kBig;
    const int64_t lo = MASK >= 2 && a.kind == 2 ? wrow0 + a.off - a.window - k0 : -kBig;
    uint32_t keys_w = ~0u;  // the key mask's bits in this thread's columns
    if constexpr (MASK) {
      if (keys) {
        keys_w = 0u;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) keys_w |= ((bits[nt >> 2] >> (8 * (nt & 3) + 2 * tq)) & 3u) << (2 * nt);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int di = 8 * r + g;
      uint32_t w = di < rl ? frag_cols_below(min(cl, di + dg + 1), tq) & keys_w : 0u;
      if constexpr (MASK >= 2) w &= ~frag_cols_below(di + lo, tq);
      if constexpr (MASK == 3) w &= sg.bits[r];
      vis[r] = w;
    }
    masked_max(visible);
  }
  if constexpr (CAP) {
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = mx[r] == -INFINITY ? -INFINITY : tanhf(mx[r] * carg);  // no key: stays -inf
  }
  float mu[2];
  online_max_step(mx, c2, m, mu, alpha);
  float ls[2] = {0.f, 0.f};
  // hide (TileHide): kHidePos the positional test (visible), kHideKeys the key-only one (key_kept)
  auto p_tile = [&](auto hide) {
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
      float pe[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = CAP ? tanhf(s[nt][e] * carg) : s[nt][e];
        bool hidden = false;
        if constexpr (decltype(hide)::value == kHidePos) hidden = !visible(nt, e);
        if constexpr (decltype(hide)::value == kHideKeys) hidden = !key_kept(nt, e);
        pe[e] = hidden ? 0.f : ex2(fmaf(x, c2, -mu[e >> 1]));
        ls[e >> 1] += pe[e];
      }
      pack_a_n8<T>(p, nt, pe);
    }
  };
  if ((KEEP_S || CAP) && need)  // CAP: a hidden score's -inf would map to tanh = -1, not to P = 0
    p_tile(std::integral_constant<int, kHidePos>{});
  else if (MASK && (KEEP_S || CAP) && keys)
    p_tile(std::integral_constant<int, kHideKeys>{});
  else
    p_tile(std::integral_constant<int, kHideNone>{});
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + ls[r];
}

// S = Q K^T for a consumer warpgroup's 64 rows and the BC keys of ring stage Kst (smem x smem,
// K-major, 128-byte swizzle), issued and committed as one wgmma group (not waited for).
template <typename T, int D, int BC>
__device__ __forceinline__ void ws_issue_qk(float (&s)[BC / 8][4], uint64_t qd, const T* Kst) {
  constexpr int BM = 128;
  const uint64_t kd = wg_desc(smem_addr(Kst), 16, 1024);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, BC>(s, qd, kd, uint64_t(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4),
                    uint64_t(((kk >> 2) * BC * 128 + (kk & 3) * 32) >> 4), kk > 0);
  wg_commit();
}

// O += P V for the BC keys of ring stage Vst (P from registers, V MN-major), issued and committed
// as one wgmma group (not waited for).
template <typename T, int D, int BC>
__device__ __forceinline__ void ws_issue_pv(float (&o)[D / 8][4], const uint32_t (&p)[BC / 16][4], const T* Vst) {
  const uint64_t vd = wg_desc(smem_addr(Vst), BC * 128, 1024);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) wgmma_rs<T, D>(o, p[kk], vd, uint64_t(kk * 16 * 128 >> 4), 1);
  wg_commit();
}

__device__ __forceinline__ void ws_ring_next(int& st, uint32_t& ph, int nst) {
  if (++st == nst) {
    st = 0;
    ph ^= 1;
  }
}

// Consumer loop, pipelined within each warpgroup: tile j's S = Q K^T is issued before tile j - 1's
// O += P V, and the softmax of tile j runs while that P V product is in flight; O is scaled by
// tile j's alpha once the product has completed (wait_group 0), before tile j's P V is issued in
// the next step. Per tile the tensor pipe then has the next product queued while the softmax runs.
// The ring stage of tile j - 1 is released once its P V product has completed.
// TMA: the producer is one thread issuing TMA copies (maps: Q, K, V; ws_produce), and the consumers
// skip the proxy fence after each full barrier (TMA writes through the async proxy already); the
// same tiles land in the same layout, so the outputs are bitwise those of the cp.async producer.
// CAP: a softcap c > 0 (ws_softmax_tile); the launcher takes CAP for a.softcap > 0 only.
// MASK 1: a key mask [B, Sk] (a.mask); 2: a sliding window (mask kind 2), a key mask optional
// (ws_softmax_tile); with a key mask each consumer warp loads a tile's mask values (4 per lane at BC
// 128) before it waits for the tile's products. 3: segment ids (attention_segments.cuh), a key mask
// and a window optional: the producer and the consumers take the same narrowed key range
// (seg_key_range), and each warp loads a tile's key ids with its mask values.
template <typename T, int D, int BC, int NST, bool TMA, bool CAP = false, int MASK = 0>
__global__ void __launch_bounds__(384, 1)
    wgmma_fwd_ws_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        T* __restrict__ out, float* __restrict__ lse, int hc, int zig,
                        const __grid_constant__ TileMaps maps) {
#if RLX_ATTN_WGMMA
  static_assert(D % 64 == 0 && (BC == 64 || BC == 128) && NST >= 3, "wgmma_fwd_ws_kernel: tile shapes");
  constexpr int BM = 128;
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t pad = (1024u - (smem_addr(wg_smem) & 1023u)) & 1023u;
  T* Qs = reinterpret_cast<T*>(wg_smem + pad);  // [D / 64][BM][64]
  T* Ks = Qs + BM * D;                            // [NST][D / 64][BC][64]
  T* Vs = Ks + NST * BC * D;                      // [NST][D / 64][BC][64]
  const WsRing ring = ws_ring_init<NST>(Vs + NST * BC * D, TMA ? 1 : 128);
  uint64_t *kfull = ring.kfull, *vfull = ring.vfull, *empty = ring.empty, *qfull = ring.qfull, *qempty = ring.qempty;
  __syncthreads();
  const int wg = ws_warpgroup();
  const int64_t nqt = (a.Sq + BM - 1) / BM, nbh = a.B * a.H, ntiles = nqt * nbh;
  int st = 0;
  uint32_t ph = 0, qph = 0;
  if (wg == 0) {
    ws_setmaxnreg_dec<kWsProdRegs>();
    if (!TMA || threadIdx.x == 0)
      ws_produce<T, D, BM, BC, NST, false, TMA>(a, q, nullptr, k, v, Qs, nullptr, Ks, Vs, ring, hc, zig != 0, &maps);
    return;
  }
  // after a full barrier: cp.async data (generic proxy) -> the async proxy that wgmma reads through
  auto landed = [] {
    if constexpr (!TMA) fence_proxy_async();
  };
  // ---- consumers ----
  ws_setmaxnreg_inc<kWsConsRegs>();
  const int cw = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  // raw score -> log2 units: s c2, or with CAP c2 tanh(s carg)
  const float c2 = CAP ? a.softcap * kLog2e : a.scale * kLog2e, carg = CAP ? a.scale / a.softcap : 0.f;
  const uint64_t qd = wg_desc(smem_addr(Qs) + uint32_t(cw * 64 * 128), 16, 1024);  // this warpgroup's 64 rows
  // kTurns (at D 64): on the key tiles both consumer warpgroups compute, they take turns to issue
  // their step's two products (named barrier 1 + w: warpgroup w's turn), so one's softmax runs while
  // the other's products keep the tensor pipe busy (FlashAttention-3's ping-pong). Warpgroup 1
  // passes the first turn; the turns continue across the block's query tiles (both warpgroups take
  // the same number a tile); the last pass is left unconsumed when the block exits (synccheck: 0
  // errors). H100, B4 S4096 H16 bf16, forward alone, 3 alternating rounds against the free-running
  // warpgroups: D 64 1.06-1.13x none, 1.04-1.06x
  // causal; D 128 0.96-1.00x none, 0.98-1.01x causal, so D 128 keeps them free-running.
  constexpr bool kTurns = D == 64;
  if (kTurns && cw == 1) ws_turn_pass(cw);
  for (int64_t n = 0, t = ws_tile(0, zig); t < ntiles; t = ws_tile(++n, zig)) {
    int64_t qt, bh;
    ws_fwd_tile(a, t, nqt, nbh, hc, &qt, &bh);
    const int64_t h = bh % a.H, b = bh / a.H, q0 = qt * BM;
    const float* mrow = MASK && a.mask != nullptr ? a.mask + b * a.Sk : nullptr;  // this batch's key mask
    constexpr int W = MASK ? BC / 32 : 1;
    float mv[W];  // MASK: the mask values of the tile whose softmax comes next (mask_load)
    const int64_t r0 = q0 + 64 * cw;       // this warpgroup's rows [r0, r0 + 64)
    const int64_t wrow0 = r0 + 16 * warp;  // this warp's; thread rows wrow0 + 8 r + g
    // MASK 3: the ids of this thread's rows, and of the keys of the tile whose softmax comes next
    // (lane l: keys k0 + 32 w + l, loaded with the key mask's values)
    constexpr int WS = MASK == 3 ? BC / 32 : 1;
    int kid[WS];
    SegRows srows{};
    if constexpr (MASK == 3) srows = seg_rows(a.qseg + b * a.Sq, a.Sq, wrow0 + g);
    auto load_mask = [&](int64_t kt0) {
      if constexpr (MASK)
        if (mrow != nullptr) mask_load(mv, mrow, kt0, a.Sk, lane);
      if constexpr (MASK == 3) seg_load(kid, a.kseg + b * a.Sk, kt0, a.Sk, srows.uni, lane);
    };
    // the segment test of the tile loaded last (the default, nothing hidden, without ids)
    auto seg_test = [&]() {
      SegTile t;
      if constexpr (MASK == 3) t = seg_tile<BC / 8>(srows, kid, tq);
      return t;
    };
    int64_t kbeg, kend;
    key_range(a, q0, min(a.Sq - 1, q0 + BM - 1), &kbeg, &kend, BC);
    seg_key_range(a, b, q0, BM, BC, &kbeg, &kend);  // as the producer's
    // the end of the keys seen by the 64 rows from rw (causal: by its last row; none past Sq)
    auto rows_key_end = [&](int64_t rw) {
      int64_t e = kend;
      if (a.kind != 0) e = min(a.Sk, min(a.Sq - 1, rw + 63) + a.off + 1);
      if (rw >= a.Sq) e = kbeg;
      return e;
    };
    const int64_t wg_kend = rows_key_end(r0);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[D / 8][4];
    zero(o);
    // O *= alpha (per row). At D 128 skipped when no row of the warp changed its max (every alpha is
    // then exactly 1: the same O, except that FTZ multiplication would have flushed denormal entries).
    // H100, forward alone, 3 alternating rounds:
    // D 128 1.00-1.035x none, 1.00-1.04x causal; D 64 (32 products a row instead of 64) 0.98-1.00x,
    // so D 64 always scales.
    auto rescale = [&](const float (&alpha)[2]) {
      if (D != 128 || __any_sync(0xffffffffu, (alpha[0] != 1.f) | (alpha[1] != 1.f))) scale_rows(o, alpha);
    };
    // This warp's arrival on Q's empty barrier, once a tile: as soon as the warpgroup's last
    // S = Q K^T of the tile has completed (its wait_group), not after the last P V and the output
    // stores, so the producer loads the next tile's Q, and that tile's first K / V behind it, while
    // this tile's last softmax, P V product and stores run. H200, forward alone, B8 S2048 H16 / 4
    // D128 bf16, two alternating rounds: causal 283.4 against 285.8 us, none level (466.9 against 466.0).
    auto free_q = [&] {
      __syncwarp();
      if (lane == 0) ws_arrive(qempty);
    };
    ws_wait(qfull, qph);
    qph ^= 1;
    landed();
    int64_t k0 = kbeg;
    {
      // the key tiles this warpgroup computes are [kbeg, kstop) (a prefix of the block's), pipelined.
      // P alternates between two register buffers (the loop is unrolled by two): copying the next
      // tile's P into the buffer of the product in flight made ptxas serialise every wgmma (C7513).
      const int64_t kstop = min(kend, wg_kend);
      // the key tiles both warpgroups compute: [kbeg, kboth) (causal: warpgroup 0's rows see fewer)
      int64_t kboth = kend;
      if constexpr (kTurns)
        for (int w = 0; w < 2; ++w) kboth = min(kboth, rows_key_end(q0 + 64 * w));
      if (k0 >= kstop) free_q();  // no key tile for this warpgroup: Q is not read
      if (k0 < kstop) {
        float s[BC / 8][4], alpha[2];
        uint32_t pa[BC / 16][4], pb[BC / 16][4];
        load_mask(k0);
        ws_wait(kfull + st, ph);
        landed();
        ws_issue_qk<T, D, BC>(s, qd, Ks + st * BC * D);
        const SegTile sg0 = seg_test();
        wg_wait0();
        wg_fence_regs(s);
        if (k0 + BC >= kstop) free_q();
        // O is 0: alpha unused
        ws_softmax_tile<T, BC, true, CAP, MASK>(a, s, wrow0, k0, g, tq, c2, carg, m, l, pa, alpha, mv, sg0);
        int pst = st;  // the ring stage of the tile whose P V is pending (its P in pc below)
        uint32_t pph = ph;
        ws_ring_next(st, ph, NST);
        k0 += BC;
        // one step: S of tile k0 issued, then the pending tile's P V; the softmax of tile k0 (its P
        // into pn) while that product runs; then O scaled by tile k0's alpha
        auto step = [&](auto& pc, auto& pn) {
          const bool turns = kTurns && k0 < kboth;  // warpgroup-uniform, the same steps in both
          load_mask(k0);
          ws_wait(kfull + st, ph);
          landed();
          if (turns) ws_turn_wait(cw);
          ws_issue_qk<T, D, BC>(s, qd, Ks + st * BC * D);
          ws_wait(vfull + pst, pph);
          landed();
          ws_issue_pv<T, D, BC>(o, pc, Vs + pst * BC * D);
          if (turns) ws_turn_pass(cw);
          const SegTile sg = seg_test();  // while the products run
          wg_wait<1>();  // S of this tile (committed first) has completed
          wg_fence_regs(s);
          if (k0 + BC >= kstop) free_q();
          ws_softmax_tile<T, BC, true, CAP, MASK>(a, s, wrow0, k0, g, tq, c2, carg, m, l, pn, alpha, mv, sg);
          wg_wait0();  // the pending tile's P V
          wg_fence_regs(o);
          wg_fence_afrag(pc);
          __syncwarp();
          if (lane == 0) ws_arrive(empty + pst);
          rescale(alpha);
          pst = st;
          pph = ph;
          ws_ring_next(st, ph, NST);
          k0 += BC;
        };
        // the last tile's P V, with its P in pc
        auto last = [&](auto& pc) {
          ws_wait(vfull + pst, pph);
          landed();
          ws_issue_pv<T, D, BC>(o, pc, Vs + pst * BC * D);
          wg_wait0();
          wg_fence_regs(o);
          wg_fence_afrag(pc);
          __syncwarp();
          if (lane == 0) ws_arrive(empty + pst);
        };
        while (true) {
          if (k0 >= kstop) {
            last(pa);
            break;
          }
          step(pa, pb);
          if (k0 >= kstop) {
            last(pb);
            break;
          }
          step(pb, pa);
        }
      }
    }
    // the key tiles past this warpgroup's last visible key: only paced with the ring (a skipped tile
    // still waits both full barriers and arrives on the empty one; see the header)
    for (; k0 < kend; k0 += BC) {
      ws_wait(kfull + st, ph);
      ws_wait(vfull + st, ph);
      __syncwarp();
      if (lane == 0) ws_arrive(empty + st);
      ws_ring_next(st, ph, NST);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[r];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int64_t i = wrow0 + r * 8 + g;
      if (i >= a.Sq) continue;
      float inv, row_lse;
      row_finish(m[r] * kLn2, lr, row_sink(a, b, h), &inv, &row_lse);
      T* orow = out + ((b * a.Sq + i) * a.H + h) * D;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        *reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * tq) = pack2<T>(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
      if (tq == 0) lse[(b * a.H + h) * a.Sq + i] = row_lse;
    }
  }
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
