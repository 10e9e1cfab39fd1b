// Warp-specialised fused attention backward (sm_90a), bf16 / f16, head dim 128, and 64 without a
// softcap (the same products, P^T and dS^T formed before dV's product: LATE): the maths, the item
// schedule and the ordered dQ sums of wgmma_fused_bwd_kernel (attention_fused_bwd.cuh), with the
// loads and the sums taken off the math warps. Selection: attention_launch_impl.cuh.
//
// Why: in wgmma_fused_bwd_kernel every item costs the math warps two block-wide barriers (the Q / dO
// tiles landed, then the dS^T exchange), the cp.async issue of the next item's tiles, and, on warp
// 5, the wait on the tile semaphore and on the completion of the previous item's bulk add; ncu
// showed 0.41 warps an issued instruction stalled on barriers and 0.60 on long scoreboards.
//
// Block = 3 warpgroups (384 threads, one block per SM), over 128 keys of one kv head as before:
//   warpgroup 0 (producer, setmaxnreg.dec to fused_ws_prod_regs):
//     warp 0 (Q) and warp 2 (dO): per item m, wait for stage m & 1 to be free (its empty barrier),
//       copy the item's Q (dO) tile with cp.async into it and arrive on its full barrier once the
//       copies land (cp.async.mbarrier.arrive.noinc), then load the tile's lse (warp 0: log2 units,
//       dead rows +inf as before) or delta (warp 2) rows, store them into the stage and arrive
//       again (a plain arrival: release of those stores). Full barrier count: 2 x 64 arrivals.
//     warps 1 and 3 (the senders: warp 1 the items of partial buffer 0, m even, warp 3 those of buffer
//       1, m odd, so one item's wait for its sums does not hold up the next item's send; with one
//       sender the consumers waited for a buffer ~13 % of the samples at D 128): per
//       item m, the rank of the item among its tile's contributors
//       (FusedSchedule::rank, the whole warp); wait for the partial of item m (Ps[m & 1], its
//       full barrier, 8 arrivals: lane 0 of each consumer warp after the warp's stores, proxy
//       fences and a __syncwarp, as a TMA store follows its writers' fences and a barrier; an
//       arrival from every consumer thread ran 0.97-0.99x without a mask, level causal); lane 0
//       waits until the tile semaphore equals the rank, issues the one bulk copy (rank 0) / bulk add,
//       waits for the bulk op's reads of Ps (wait_group.read) and frees the buffer (its empty
//       barrier, one arrival), then waits for the sums to be performed and releases the tile
//       (st.release rank + 1). No consumer thread waits on a semaphore or a bulk op any more; they
//       only wait for the buffer, two items later.
//   warpgroups 1, 2 (consumers, setmaxnreg.inc to fused_ws_cons_regs), 64 keys each: per item, wait
//     for the stage, S^T / dP^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q (bwd_issue_scores /
//     bwd_dv_dk_products, as the fused kernel), dS^T rows into Ss[m & 1], a named barrier of the
//     256 consumer threads (the block's dS^T complete), dQ = dS K (D 128: this warpgroup's 64 columns
//     of the 64 rows; D 64: its 64 rows of the 128, all columns), waited with dV's and dK's products;
//     the stage freed (every consumer thread arrives: count 256, so each thread's lse / delta loads are
//     released before the producer overwrites them); the partial into Ps[m & 1] once the sender has
//     freed it (D 64: Ps[m & 1] is Ss[m & 1], fused_ws_partial_in_ds, so the consumers wait for the
//     sender before the dS^T stores instead).
//   The dS^T buffers alternate: a warpgroup writes Ss[m & 1] for item m + 2 only after passing the
//   named barrier of item m + 1, which the other warpgroup reaches after its dQ product of item m
//   (the last reader of Ss[m & 1]) has completed. So there is no block-wide barrier in the loop.
// Same products in the same order, the same f32 sums in the same rank order: dq, dk, dv are bitwise
// those of wgmma_fused_bwd_kernel (tested). Deadlock freedom: as the fused kernel's (items wait only
// on lexicographically smaller (step, key block) items of the same group; each sender takes its items
// in increasing step and releases an item's tile right after its own sums, whatever the other sender
// does; the consumers wait only on a sender two items back and on the producer).
#pragma once

#include <cstdint>

#include "cuda/attention_fused_bwd.cuh"
#include "cuda/attention_wgmma_ws.cuh"

namespace rlx {
namespace cuda {
namespace attn {

constexpr int kFusedWsThreads = 384;
// Register split (setmaxnreg): 128 P + 256 C = 64512 <= 384 * 168 at launch. D 128: P = 24, C = 240 (the
// consumers hold 128 dK / dV accumulators; at 232 ptxas spills and serialises their wgmmas). D 64: P = 56,
// C = 224 (the LATE consumers fit; at 24 the loader warps kept their addresses in local memory and re-read
// the thread index for every cp.async, and the consumers waited for the Q / dO stage ~15 % of their time:
// ncu source counters).
template <int D>
constexpr int fused_ws_prod_regs() { return D == 64 ? 56 : 24; }
template <int D>
constexpr int fused_ws_cons_regs() { return D == 64 ? 224 : 240; }
static_assert(128 * fused_ws_prod_regs<64>() + 256 * fused_ws_cons_regs<64>() <= 384 * 168 &&
                  128 * fused_ws_prod_regs<128>() + 256 * fused_ws_cons_regs<128>() <= 384 * 168,
              "wgmma_fused_bwd_ws_kernel: the register split");

// The dQ partial of an item in the buffer of its dS^T (D 64): there, with BQ = 128 query rows split by
// rows, warpgroup w's dQ product reads only dS^T block w (queries [64 w, 64 w + 64), all 128 keys,
// 16 KB) and its partial rows [64 w, 64 w + 64) x 64 columns f32 are the same 16 KB at the same
// offset. So each warpgroup overwrites its own block once its dQ product has completed, and the
// sender's bulk op reads the buffer (item m's partial) before any dS^T of item m + 2 is stored into
// it (the consumers wait for the buffer before the dS^T stores instead of before the partial's).
// Without it the D 64 kernel would need 232,528 bytes of shared memory (80 over the limit).
__host__ __device__ constexpr bool fused_ws_partial_in_ds(int64_t D) { return fused_rows(D) == 128; }

// Shared memory (BQ = fused_rows(D) query rows an item): K and V [D / 64][128][64], the Q / dO
// stages [2][D / 64][BQ][64] each, dS^T [2][BQ / 64][128][64], the dQ partials [2][BQ][D] f32 (D 128
// only: fused_ws_partial_in_ds), lse and delta [2][BQ] f32 each, the mbarriers (full, empty, partial
// full, partial empty: 2 each), the ticket, and 1024 bytes to align the swizzle atoms: D 128
// 231,504 bytes of the 232,448 an H100 block may take, D 64 166,992.
template <int D>
constexpr size_t wg_fused_ws_smem() {
  constexpr size_t BQ = fused_rows(D), BK = kWgBwdKeys;
  constexpr size_t partials = fused_ws_partial_in_ds(D) ? 0 : 2 * BQ * D;
  return 2 * (2 * BK * D + 2 * 2 * BQ * D + 2 * BK * BQ) + 4 * (partials + 2 * 2 * BQ) + 8 * 8 + 16 + 1024;
}
static_assert(wg_fused_ws_smem<128>() <= 232448 && wg_fused_ws_smem<64>() <= 232448,
              "wgmma_fused_bwd_ws_kernel: shared memory");
static_assert(!fused_ws_partial_in_ds(128) && 2 * kWgBwdKeys * fused_rows(64) == 4 * fused_rows(64) * 64,
              "wgmma_fused_bwd_ws_kernel: a D 64 dQ partial fills its dS^T buffer exactly");

// stmatrix .x4: four 8 x 8 b16 matrices into shared memory; lane l gives the address of row l % 8 of
// matrix l / 8 (16 contiguous bytes), and x[i] holds row lane / 4, columns 2 (lane % 4), +1 of matrix i
// (the layout of an mma accumulator / A fragment)
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&x)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(x[0]), "r"(x[1]),
               "r"(x[2]), "r"(x[3])
               : "memory");
}

// bulk groups of this thread: their reads of shared memory done (the source may be overwritten)
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// One warp's cp.async copy of a ROWS x D tile (rows r0 .. r0 + ROWS - 1 of x, row stride rs; rows at
// or past n zero-filled) into wg_load_tile's 128-byte swizzle layout (16-byte chunk c of row i at
// chunk c ^ (i & 7) of the row's 128 bytes): lane l copies chunk c = l % (D / 8) of row l / (D / 8)
// + kRows it in pass it (kRows = 32 / (D / 8) rows a pass). The row's low bits, and so the swizzle,
// repeat every kPeriod = 8 / kRows passes, and the rows of pass it + kPeriod are 8 rows (1024 bytes)
// further: each lane computes its kPeriod shared addresses once and adds a constant offset for the
// rest, so a whole tile (no row past n, the common case) costs a copy and a 64-bit add a chunk (the
// loop that recomputed the swizzle took ~13 instructions a chunk: 11 % of the D 128 backward's
// instructions, ncu source counters).
template <typename T, int D, int ROWS>
__device__ __forceinline__ void warp_load_tile(T* dst, const T* __restrict__ x, int64_t rs, int64_t r0, int64_t n,
                                               int lane) {
  constexpr int kChunks = D / 8, kRows = 32 / kChunks, kPeriod = 8 / kRows;
  static_assert(32 % kChunks == 0 && 8 % kRows == 0 && ROWS % 8 == 0, "warp_load_tile: whole row octets");
  const int c = lane % kChunks, r = lane / kChunks;
  const uint32_t col = smem_addr(dst + (c >> 3) * ROWS * 64);
  uint32_t sa[kPeriod];  // pass j's shared address (row r + kRows j < 8, its own low bits)
#pragma unroll
  for (int j = 0; j < kPeriod; ++j) {
    const int row = r + kRows * j;
    sa[j] = col + uint32_t(row * 128 + (((c & 7) ^ row) << 4));
  }
  const T* src = x + (r0 + r) * rs + c * 8;
  const int64_t step = kRows * rs;
  if (r0 + ROWS <= n) {
#pragma unroll
    for (int o = 0; o < ROWS / 8; ++o)
#pragma unroll
      for (int j = 0; j < kPeriod; ++j, src += step) cp_async16_to(sa[j] + uint32_t(1024 * o), src);
  } else {
    int left = int(min(n - r0 - r, int64_t(1) << 30));  // this lane's row of the pass exists if left > 0
#pragma unroll 1
    for (int o = 0; o < ROWS / 8; ++o)
#pragma unroll
      for (int j = 0; j < kPeriod; ++j, src += step, left -= kRows)
        cp_async16_to(sa[j] + uint32_t(1024 * o), left > 0 ? src : x, left > 0);
  }
}

// CAP: a softcap c > 0, MASK 1: a key mask, 2: a sliding window, 3: segment ids (all as
// wgmma_fused_bwd_kernel's).
template <typename T, int D, bool CAP = false, int MASK = 0>
__global__ void __launch_bounds__(kFusedWsThreads, 1)
    wgmma_fused_bwd_ws_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ dout, const float* __restrict__ lse,
                              const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                              float* __restrict__ dqacc, uint32_t* __restrict__ sem, uint32_t* __restrict__ ticket,
                              T* __restrict__ dq, FusedSplit fs) {
#if RLX_ATTN_WGMMA
  static_assert(D == 64 || D == 128, "wgmma_fused_bwd_ws_kernel: head dim 64 or 128");
  // (at D 64 LATE, below, cannot hold a softcap's P^T and P^T (1 - tanh^2): the launcher keeps D 64 with
  // a softcap on wgmma_fused_bwd_kernel)
  static_assert(D == 128 || !CAP, "wgmma_fused_bwd_ws_kernel: D 64 without a softcap");
  // dQ = dS K split over the consumer warpgroups by query rows (D 64, BQ 128: warpgroup w rows
  // [64 w, 64 w + 64), all D columns) or by columns (D 128, BQ 64: all rows, columns [64 w, 64 w + 64))
  constexpr int BK = kWgBwdKeys, BQ = fused_rows(D);
  constexpr bool ROWS = BQ == 128, ALIAS = fused_ws_partial_in_ds(D);
  constexpr int DH = ROWS ? D : D / 2;  // dQ columns of a consumer warpgroup
  // D 64 (S^T / dP^T m64n128, 128 registers) within the consumers' 240 registers: bwd_dv_dk_products' LATE
  constexpr bool kLate = D == 64;
  static_assert(DH == 64, "wgmma_fused_bwd_ws_kernel: dQ as m64n64 products (wgmma_ss_tt)");
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t pad = (1024u - (smem_addr(wg_smem) & 1023u)) & 1023u;
  T* Ks = reinterpret_cast<T*>(wg_smem + pad);  // [D / 64][BK][64]
  T* Vs = Ks + BK * D;                            // [D / 64][BK][64]
  T* Qs = Vs + BK * D;                            // [2][D / 64][BQ][64]
  T* Gs = Qs + 2 * BQ * D;                        // dO, [2][D / 64][BQ][64]
  T* Ss = Gs + 2 * BQ * D;                        // dS^T [2][BQ / 64][BK][64] (128-byte swizzle)
  // dQ partials [2][BQ][D], chunks permuted (ALIAS: in the dS^T buffers)
  float* Ps = reinterpret_cast<float*>(ALIAS ? Ss : Ss + 2 * BK * BQ);
  float* Ls = reinterpret_cast<float*>(Ss + 2 * BK * BQ) + (ALIAS ? 0 : 2 * BQ * D);  // [2][BQ], log2 units
  float* Dl = Ls + 2 * BQ;                                  // [2][BQ]
  uint64_t* full = reinterpret_cast<uint64_t*>(Dl + 2 * BQ);
  uint64_t* empty = full + 2;
  uint64_t* pfull = empty + 2;
  uint64_t* pempty = pfull + 2;
  int* Tk = reinterpret_cast<int*>(pempty + 2);
  if (threadIdx.x == 0) {
    Tk[0] = int(atomicAdd(ticket, 1u));
    for (int s = 0; s < 2; ++s) {
      mbar_init(full + s, 128);
      mbar_init(empty + s, 256);
      mbar_init(pfull + s, 8);
      mbar_init(pempty + s, 1);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int nkt = int((a.Sk + BK - 1) / BK);
  // grp: the query heads of this block (of its split of the kv head's group)
  const int sq = int(a.Sq), grp = int(a.group) / fs.n;
  const bool causal = a.kind != 0;
  const int nqt = (sq + BQ - 1) / BQ;
  // the sliding window (MASK 2 and 3 only; -1: none)
  const int win = MASK >= 2 && a.kind == 2 ? int(min(a.window, int64_t(1) << 30)) : -1;
  if (Tk[0] >= int64_t(nkt) * fs.n * a.Hkv * a.B) {  // a converter block (the header of attention_fused_bwd.cuh)
    fused_convert_tiles<T, D, BQ>(a, nkt, nqt, grp, causal, win, dqacc, sem, ticket + 1, dq);
    return;
  }
  int kt, sp;
  int64_t hk, b;
  fused_block(a, nkt, fs.n, Tk[0], &kt, &sp, &hk, &b);
  const int64_t h0 = hk * a.group + int64_t(sp) * grp;  // the block's first query head
  const int64_t k0 = int64_t(kt) * BK;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  // the block's K / V tiles, by all 384 threads
  wg_load_tile<T, D, BK, kFusedWsThreads>(Ks, k + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  wg_load_tile<T, D, BK, kFusedWsThreads>(Vs, v + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  cp_async_commit();
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();  // K and V landed (every thread's copies)
  const FusedSchedule<BQ> sch(kt, nkt, nqt, grp, int(a.off), causal, win, MASK == 3 ? fused_kinfo(a, b) : nullptr,
                              fused_key_granules(a));
  const int iters = sch.iters;
  const int wg = ws_warpgroup(), warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  if (wg == 0) {
    // ---- producer ----
    ws_setmaxnreg_dec<fused_ws_prod_regs<D>()>();
    if (warp == 0 || warp == 2) {  // the Q (warp 0) or dO (warp 2) tiles and their lse (delta) rows
      const bool isq = warp == 0;
      const T* x = isq ? q : dout;
      const float* row = isq ? lse : delta;
      T* tiles = isq ? Qs : Gs;
      float* vals = isq ? Ls : Dl;
      for (int m = 0; m < iters; ++m) {
        const int s = m & 1;
        ws_wait(empty + s, ((m >> 1) & 1) ^ 1);
        int hl, t;
        sch.item(m, &hl, &t);
        const int64_t h = h0 + hl, i0 = int64_t(t) * BQ;
        warp_load_tile<T, D, BQ>(tiles + s * BQ * D, x + (b * a.Sq * a.H + h) * D, q_rs, i0, a.Sq, lane);
        ws_cp_async_arrive(full + s);
#pragma unroll
        for (int r = 0; r < BQ / 32; ++r) {
          const int64_t i = i0 + 32 * r + lane;
          float val = isq ? INFINITY : 0.f;
          if (i < a.Sq) {
            val = row[(b * a.H + h) * a.Sq + i];
            if (isq && val == -INFINITY) val = INFINITY;  // dead row: P = 0
          }
          vals[s * BQ + 32 * r + lane] = isq ? val * kLog2e : val;
        }
        ws_arrive(full + s);
      }
    } else {  // the senders: warp 1 the even items (buffer 0), warp 3 the odd ones (buffer 1)
      for (int m = warp >> 1; m < iters; m += 2) {
        const int s = m & 1;
        int hl, t;
        sch.item(m, &hl, &t);
        const int rank = sch.rank(m, hl, t, lane);
        ws_wait(pfull + s, (m >> 1) & 1);
        if (lane == 0) {
          const int64_t h = h0 + hl, i0 = int64_t(t) * BQ;
          uint32_t* ts = sem + (b * a.H + h) * nqt + t;
          if (rank > 0)
            while (ld_acquire_u32(ts) != uint32_t(rank)) __nanosleep(32);
          fence_proxy_async_global();  // the acquired sums, then this thread's bulk add
          const uint32_t src = smem_addr(Ps + s * BQ * D), bytes = uint32_t(min(int64_t(BQ), a.Sq - i0) * D * 4);
          float* dst = dqacc + ((b * a.H + h) * a.Sq + i0) * D;
          if (rank == 0)
            bulk_store_f32(dst, src, bytes);
          else
            bulk_add_f32(dst, src, bytes);
          bulk_commit();
          bulk_wait_read_all();
          ws_arrive(pempty + s);  // Ps[s] read: the consumers may write it again
          bulk_wait_all();
          fence_proxy_async_global();
          st_release_u32(ts, uint32_t(rank + 1));
        }
        __syncwarp();
      }
    }
    cp_async_commit();
    cp_async_wait_all();  // the loaders' last copies (their arrivals are pending on them)
    return;
  }
  // ---- consumers ----
  ws_setmaxnreg_inc<fused_ws_cons_regs<D>()>();
  // consumer warpgroup cw: keys [k0 + 64 cw, k0 + 64 cw + 64); dQ rows [64 cw, 64 cw + 64) (ROWS) or
  // columns [DH cw, DH cw + DH)
  const int cw = wg - 1;
  const int g = lane >> 2, tq = lane & 3;
  const int jw = int(k0) + 64 * cw + 16 * warp;
  const int sk = int(a.Sk);
  // raw score -> log2 units: S c2, or with CAP c2 tanh(S carg)
  const float c2 = CAP ? a.softcap * kLog2e : a.scale * kLog2e, carg = CAP ? a.scale / a.softcap : 0.f;
  float dka[D / 8][4], dva[D / 8][4];
  zero(dka);
  zero(dva);
  bool warp_hides = false;  // MASK: a key of this warp's 16 is hidden by the key mask
  const uint32_t kept = MASK && a.mask != nullptr ? bwd_kept_keys(a.mask + b * a.Sk, jw + g, sk, &warp_hides) : 3u;
  // MASK 3: the ids of this thread's keys jw + g (+ 8), and of the item's queries (lane l: i0 + 32 w + l)
  constexpr int WQ = MASK == 3 ? BQ / 32 : 1;
  int qid[WQ];
  SegRows skeys{};
  if constexpr (MASK == 3) skeys = seg_rows(a.kseg + b * a.Sk, a.Sk, jw + g);
  const uint64_t kdsc = wg_desc(smem_addr(Ks) + uint32_t(cw * 64 * 128), 16, 1024);
  const uint64_t vdsc = wg_desc(smem_addr(Vs) + uint32_t(cw * 64 * 128), 16, 1024);
  // dQ = dS K, as in wgmma_fused_bwd_kernel: A = dS^T of the item's buffer (MN-major; ROWS: block cw,
  // this warpgroup's 64 queries, else all 64 queries), B = K (MN-major; ROWS: all 64 columns, else
  // the column half cw)
  const uint64_t kdq = wg_desc(smem_addr(Ks) + uint32_t(ROWS ? 0 : cw * BK * 128), BK * 128, 1024);
  const uint32_t sblk = ROWS ? uint32_t(cw * BK * 128) : 0u;  // byte offset of the dS^T block cw reads
  for (int m = 0; m < iters; ++m) {
    const int s = m & 1;
    int hl, t;
    sch.item(m, &hl, &t);
    const int i0 = t * BQ;
    if constexpr (MASK == 3) seg_load(qid, a.qseg + b * a.Sq, i0, a.Sq, skeys.uni, lane);
    ws_wait(full + s, (m >> 1) & 1);
    fence_proxy_async();  // the producer's cp.async data -> the async proxy (wgmma)
    uint32_t pa[BQ / 16][4], da[BQ / 16][4];
    const uint32_t qaddr = smem_addr(Qs + s * BQ * D), gaddr = smem_addr(Gs + s * BQ * D);
    float st[BQ / 8][4], dpt[BQ / 8][4];
    bwd_issue_scores<T, D, true, BQ>(st, dpt, kdsc, vdsc, qaddr, gaddr);
    SegTile sg;  // MASK 3: the ids' test of this item (while the products run)
    if constexpr (MASK == 3) sg = seg_tile<BQ / 8>(skeys, qid, tq);
    // warp-uniform: the causal diagonal, a window's lower edge or the end of the keys crosses this
    // warp's 16 keys, or the segment ids hide one of its scores (the positional test), or else the key
    // mask hides one of them (key-only: TileHide)
    const int diag = i0 + int(a.off);
    const bool pos = (causal && jw + 15 > diag) || jw + 15 >= sk || (win >= 0 && jw < diag + BQ - 1 - win) ||
                     (MASK == 3 && sg.need);
    const int hide = pos ? kHidePos : warp_hides ? kHideKeys : kHideNone;
    const uint64_t gdt = wg_desc(gaddr, BQ * 128, 1024), qdt = wg_desc(qaddr, BQ * 128, 1024);
    const BwdTileMask msk{jw + g, sk, causal ? diag : INT_MAX, kept, win >= 0 ? diag - win : INT_MIN, sg};
    bwd_dv_dk_products<T, D, BQ, CAP, MASK != 0, kLate>(st, dpt, pa, da, dva, dka, Ls + s * BQ, Dl + s * BQ, c2, tq,
                                                        hide, msk, gdt, qdt, carg);
    wg_commit();
    // ALIAS: Ss[s] holds item m - 2's partial until the sender has read it
    if constexpr (ALIAS) ws_wait(pempty + s, ((m >> 1) & 1) ^ 1);
    // dS^T rows (keys 64 cw + 16 warp + g (+ 8)) into Ss[s], 128-byte swizzle (queries nt * 8 + 2 tq,
    // +1: 4 bytes in 16-byte chunk nt % 8 of query block nt / 8, at chunk position (nt % 8) ^ (row & 7)),
    // by one stmatrix .x4 per pair of column blocks nt = 2 p, 2 p + 1 (matrix e of da[p]: nt = 2 p + e / 2,
    // key rows + 8 (e & 1); lane l addresses row l & 7 of matrix l >> 3): BQ / 16 instructions instead of
    // BQ / 4 four-byte stores (D 64 backward 1.02-1.04x; D 128, with the warp-uniform wg above,
    // median 1.02x)
    {
      const int e = lane >> 3, j = lane & 7;
      const uint32_t rowb = smem_addr(Ss + s * BK * BQ) + uint32_t((64 * cw + 16 * warp + 8 * (e & 1) + j) * 128);
#pragma unroll
      for (int p = 0; p < BQ / 16; ++p) {
        const int nt = 2 * p + (e >> 1);
        stmatrix_x4(rowb + uint32_t((nt >> 3) * BK * 128 + (((nt & 7) ^ j) << 4)), da[p]);
      }
    }
    fence_proxy_async();                            // dS^T (st.shared) -> the async proxy
    asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumer warpgroups' dS^T rows stored
    const uint64_t sdt = wg_desc(smem_addr(Ss + s * BK * BQ) + sblk, BK * 128, 1024);
    float dqa[DH / 8][4];
    fused_issue_dq<T>(dqa, sdt, kdq);
    wg_wait0();
    wg_fence_regs(dqa);
    wg_fence_regs(dva);  // and dV's and dK's products
    wg_fence_regs(dka);
    wg_fence_afrag(pa);
    wg_fence_afrag(da);
    // the stage's readers have completed: S^T, dP^T, dV, dK (wgmma) and this thread's lse / delta
    // loads (every thread arrives: a release of its own loads, which lane 0 alone would not order)
    ws_arrive(empty + s);
    // this thread's dQ rows (ROWS: 64 cw +) 16 warp + g (+ 8), columns (not ROWS: DH cw +) 2 tq + ...,
    // into Ps[s] once the sender has read item m - 2's partial out of it (ALIAS: waited for above;
    // the rows are dS^T block cw, whose only reader, this warpgroup's dQ product, has completed)
    if constexpr (!ALIAS) ws_wait(pempty + s, ((m >> 1) & 1) ^ 1);
    fused_store_partial<D, DH>(Ps + s * BQ * D, dqa, (ROWS ? 64 * cw : 0) + 16 * warp + g, ROWS ? 0 : DH * cw, g, tq);
    fence_proxy_async();  // Ps (st.shared) -> the async proxy (the bulk op)
    __syncwarp();         // the warp's stores and fences, then one arrival (lane 0)
    if (lane == 0) ws_arrive(pfull + s);
  }
  // the head splits' tree sum over the 256 consumer threads (named barrier 1, as in the loop)
  if (fs.n > 1 && !fused_split_sum<D>(dka, dva, fs, (b * a.Hkv + hk) * nkt + kt, sp, int(threadIdx.x) - 128, Tk + 1,
                                      [] { asm volatile("bar.sync 1, 256;" ::: "memory"); }))
    return;
  store_dk_dv<T, D>(a, dka, dva, dk, dv, (b * a.Sk) * a.Hkv + hk, jw + g, tq);
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
