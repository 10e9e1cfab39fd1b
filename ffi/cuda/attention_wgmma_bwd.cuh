// Attention backward on Hopper warpgroup MMA (wgmma, sm_90a only), bf16 / f16, head dims 64 and
// 128, the PLAIN cases (scale > 0, no softcap, bias or key mask), mask kind none or causal:
// wgmma_dkdv_kernel (dk, dv), the dk / dv half of the two-kernel backward that runs where the fused
// kernel does not serve (attention_launch_impl.cuh): at D 128 with OVL and the warp-specialised dq
// (attention_wgmma_bwd_ws.cuh), at D 64 without OVL and the mma.sync dq. Every other case keeps the
// mma.sync kernels (attention_mma.cuh), which are also the fallback when the loaded image has no
// sm_90a code (wgmma_available) or RLX_ATTENTION_CUDA_WGMMA=0. Shared with the fused kernels: the
// score / probability / dS helpers below. (A 2-warpgroup wgmma dq kernel measured slower than the
// warp-specialised one and was removed.)
//
// Block = 2 warpgroups (256 threads) over 128 keys of one kv head; warpgroup w owns keys
// [64 w, 64 w + 64) of the block, warp i of it 16 keys (the accumulator rows). K and V of the
// block are loaded once; the block loops over the query heads of its GQA group and the query tiles
// of 64 rows that see its keys (causal: from the tile of the block's first key on, bottom-right
// aligned as everywhere), Q and dO tiles double buffered by cp.async, lse (log2 units) and delta =
// rowsum(dO * O) - dlse of the tile's queries staged in shared memory. All tiles are in the
// 128-byte-swizzle K-major layout of attention_wgmma.cuh ([D / 64][rows][64], chunk c of row r at
// c ^ (r & 7)). Per warpgroup and query tile (the maths of mma_dkdv_kernel's PLAIN path):
//   S^T  = K_w Q^T    wgmma m64n64k16, A = K rows of the warpgroup (smem), B = Q (smem, K-major)
//   dP^T = V_w dO^T   wgmma m64n64k16, A = V rows, B = dO
//   P^T  = ex2(S^T * scale * log2 e - lse_q log2 e); dS^T = P^T (dP^T - delta_q) (causal: zero
//          where key > query + off, only in the warps the diagonal crosses)
//   dV  += P^T dO     wgmma m64n<D>k16, A = P^T from registers (the C fragment of two adjacent n8
//                     blocks is the A fragment of one k16 step, as P in the forward), B = dO
//                     MN-major (transpose bit: queries are the K dimension), 4 k-steps
//   dK  += dS^T Q     the same with dS^T and Q; dk = scale * dK at the end.
// Query rows past Sq load as zeros with lse = +inf (P = 0); keys past Sk only feed accumulator rows
// that are never written, so neither needs masking. No atomics: each block writes its own dk / dv
// rows once. OVL false: S^T and dP^T are one commit group, waited (wait_group 0) before P^T / dS^T
// are computed; dV and dK one group, waited before the next tile. OVL true: S^T and dP^T are two
// groups; after wait_group 1 (S^T) P^T is computed and dV += P^T dO issued, then wait_group 1
// (dP^T) and dS^T, dK, wait_group 0: dS^T is computed while dV runs. The register A fragments are
// kept live (wg_fence_afrag) until the wait that completes their MMA. The other warpgroup of the
// block (1 block of 8 warps per SM: registers) gives the rest of the overlap.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/attention_wgmma.cuh"

namespace rlx {
namespace cuda {
namespace attn {

constexpr int kWgBwdKeys = 128, kWgBwdRows = 64, kWgBwdThreads = 256;

// Shared memory of wgmma_dkdv_kernel: K and V [128 x D], Q and dO double buffered [2][BQ x D],
// lse and delta [2][BQ] f32 each, plus 1024 bytes to align the swizzle atoms (BQ query rows a tile:
// 64 here; the fused kernel's tiles, fused_rows, have 128 at D 64).
template <int D, int BQ = kWgBwdRows>
constexpr size_t wg_dkdv_smem() {
  return size_t(2) * D * (2 * kWgBwdKeys + 4 * BQ) + sizeof(float) * 4 * BQ + 1024;
}

// Which scores of a thread's S^T / dP^T fragment (m64n64 / m64n128 C fragment: keys jw + g and jw + g + 8 as
// rows, queries i0 + 8 nt + 2 tq (+ 1) as columns; element e of n8 block nt is key j0 + 8 (e >> 1),
// query column 8 nt + 2 tq + (e & 1)) a tile's mask hides: key j is seen by query i0 + c iff
// j < jend and lo <= j - c <= diag (causal: diag = i0 + off; a sliding window of win keys: lo =
// diag - win; jend = Sk where keys past it must give zeros) and the key mask keeps it (kept bit r:
// key j0 + 8 r; both set without a key mask) and, with segment ids, the ids match (seg: the
// item's SegTile, attention_segments.cuh; the default keeps every score and folds away).
struct BwdTileMask {
  int j0;              // this thread's first key, jw + g
  int jend;            // first hidden key (INT_MAX: none)
  int diag;            // i0 + off where causal, INT_MAX otherwise
  uint32_t kept = 3u;  // bit r: the key mask keeps key j0 + 8 r
  int lo = INT_MIN;    // i0 + off - win with a sliding window
  SegTile seg{};       // segment ids: bit 2 nt + (e & 1) of seg.bits[e >> 1]
  // The positional test as bits (frag_cols_below's layout): bit 2 nt + (e & 1) of w[e >> 1] says the
  // score of key j0 + 8 (e >> 1) and query column c = 8 nt + 2 tq + (e & 1) is visible: the key is
  // kept and below jend, and j - diag <= c < j - lo + 1, and the ids match.
  __device__ __forceinline__ void words(int tq, uint32_t (&w)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t j = j0 + 8 * r;
      w[r] = ((kept >> r) & 1u) && j < jend
                 ? frag_cols_below(j - lo + 1, tq) & ~frag_cols_below(j - diag, tq) & seg.bits[r]
                 : 0u;
    }
  }
  // the key mask alone (a tile no position mask crosses): the thread's key of score e
  __device__ __forceinline__ bool key_kept(int e) const { return ((kept >> (e >> 1)) & 1u) != 0u; }
};
// The backward's forms of TileHide (attention_wgmma.cuh; bwd_probs / bwd_dscores' HIDE): the
// positional test reads the words of BwdTileMask::words (sequence end, causal diagonal, window edge,
// key mask, ids; built once a tile), the key-only one BwdTileMask::key_kept (one predicate a key
// row). vw: the words, read with HIDE kHidePos only.
template <int HIDE>
__device__ __forceinline__ bool bwd_hidden(const BwdTileMask& m, const uint32_t (&vw)[2], int nt, int e) {
  if constexpr (HIDE == kHidePos) return ((vw[e >> 1] >> (2 * nt + (e & 1))) & 1u) == 0u;
  if constexpr (HIDE == kHideKeys) return !m.key_kept(e);
  return false;
}
// The key mask's bits of this thread's two keys j0, j0 + 8 (BwdTileMask::kept; mrow: the batch's
// mask row, keys at or past sk hidden), and whether any of the warp's keys is hidden (its tiles then
// all take the masked path).
__device__ __forceinline__ uint32_t bwd_kept_keys(const float* mrow, int j0, int sk, bool* warp_hides) {
  uint32_t kept = 0u;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = j0 + 8 * r;
    if (j < sk && mrow[j] >= 0.5f) kept |= 1u << r;
  }
  *warp_hides = __any_sync(0xffffffffu, kept != 3u);
  return kept;
}

// P^T = ex2(S^T c2 - L_q) over a thread's 8 x 4 scores, in place (0 where the tile's HIDE hides the
// score: TileHide), packed into the A fragments of dV += P^T dO: n8 blocks 2 kk and 2 kk + 1 are the
// fragment of k-step kk. The callers branch on a warp-uniform "the tile needs a mask" and take
// HIDE = kHideNone on every other tile: a per-score select there compiled (nvcc 13) into a path that
// tested every score of every causal tile, 1.25x the instructions per item of the unmasked run
// (ncu source counters).
// NQ: the query tile's n8 blocks (8: 64 queries, 16: the fused kernel's 128-query tiles at D 64).
// CAP (a softcap c > 0; the fused kernels only): the score in log2 units is c2 tanh(S^T carg) (c2 =
// c log2 e, carg = scale / c), and st keeps P^T (1 - tanh^2), the softcap's derivative folded in,
// so that bwd_dscores' P^T (dP^T - delta) is the gradient of the scaled raw score; pa still packs P^T.
// PACK false (not with CAP): st only, pa untouched (bwd_pack packs it later from st).
template <typename T, int HIDE, int NQ = 8, bool CAP = false, bool PACK = true>
__device__ __forceinline__ void bwd_probs(float (&st)[NQ][4], uint32_t (&pa)[NQ / 2][4], const float* Lb, float c2,
                                          int tq, const BwdTileMask& m, float carg = 0.f) {
  static_assert(PACK || !CAP, "bwd_probs: with a softcap st is not P^T: pa is packed here");
  uint32_t vw[2] = {~0u, ~0u};
  if constexpr (HIDE == kHidePos) m.words(tq, vw);
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt) {
    float pe[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float th = CAP ? tanhf(st[nt][e] * carg) : 0.f;
      const float p = ex2(fmaf(CAP ? th : st[nt][e], c2, -Lb[8 * nt + 2 * tq + (e & 1)]));
      pe[e] = bwd_hidden<HIDE>(m, vw, nt, e) ? 0.f : p;
      st[nt][e] = CAP ? pe[e] * (1.f - th * th) : pe[e];
    }
    if constexpr (PACK) pack_a_n8<T>(pa, nt, pe);
  }
}

// x (a thread's NQ x 4 scores, f32) packed into the A fragments of a k-step-kk product (n8 blocks 2 kk
// and 2 kk + 1)
template <typename T, int NQ>
__device__ __forceinline__ void bwd_pack(const float (&x)[NQ][4], uint32_t (&frag)[NQ / 2][4]) {
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt) pack_a_n8<T>(frag, nt, x[nt]);
}

// dS^T = P^T (dP^T - delta_q) from bwd_probs' P^T (0 where HIDE hides the score, whatever dP^T
// holds there), packed into the A fragments of dK += dS^T Q; PACK false: into dpt (f32, in place),
// da untouched.
template <typename T, int HIDE, int NQ = 8, bool PACK = true>
__device__ __forceinline__ void bwd_dscores(const float (&st)[NQ][4], float (&dpt)[NQ][4], uint32_t (&da)[NQ / 2][4],
                                            const float* Db, int tq, const BwdTileMask& m) {
  uint32_t vw[2] = {~0u, ~0u};
  if constexpr (HIDE == kHidePos) m.words(tq, vw);
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt) {
    float de[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float ds = st[nt][e] * (dpt[nt][e] - Db[8 * nt + 2 * tq + (e & 1)]);
      de[e] = bwd_hidden<HIDE>(m, vw, nt, e) ? 0.f : ds;
      if constexpr (!PACK) dpt[nt][e] = de[e];
    }
    if constexpr (PACK) pack_a_n8<T>(da, nt, de);
  }
}

// S^T = K_w Q^T and dP^T = V_w dO^T for a warpgroup's 64 keys and a BQ-query tile (smem x smem,
// K-major; k-step kk: column half kk / 4, 16 columns = 32 bytes in), issued as one commit group, or
// two (SPLIT: S^T first, so it can be waited for while dP^T runs). Not waited for. kdsc / vdsc: the
// warpgroup's K / V rows; qaddr / gaddr: the Q / dO tile.
template <typename T, int D, bool SPLIT, int BQ = kWgBwdRows>
__device__ __forceinline__ void bwd_issue_scores(float (&st)[BQ / 8][4], float (&dpt)[BQ / 8][4], uint64_t kdsc,
                                                 uint64_t vdsc, uint32_t qaddr, uint32_t gaddr) {
  constexpr int BK = kWgBwdKeys;
  const uint64_t qd = wg_desc(qaddr, 16, 1024), gd = wg_desc(gaddr, 16, 1024);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, BQ>(st, kdsc, qd, uint64_t(((kk >> 2) * BK * 128 + (kk & 3) * 32) >> 4),
                    uint64_t(((kk >> 2) * BQ * 128 + (kk & 3) * 32) >> 4), kk > 0);
  if constexpr (SPLIT) wg_commit();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, BQ>(dpt, vdsc, gd, uint64_t(((kk >> 2) * BK * 128 + (kk & 3) * 32) >> 4),
                    uint64_t(((kk >> 2) * BQ * 128 + (kk & 3) * 32) >> 4), kk > 0);
  wg_commit();
}

// The overlapped dV / dK step of one query tile (OVL; the fused kernel's too), once S^T and dP^T
// have been issued as two commit groups: waits for S^T, forms P^T (masked as the warp-uniform `hide`
// says: TileHide), issues dV += P^T dO and commits it, waits for dP^T, forms dS^T and issues
// dK += dS^T Q, which the caller commits. dO / Q come as the MN-major B descriptors gdt / qdt. pa
// and da are the products' A fragments: the caller keeps them live (wg_fence_afrag) up to the wait
// that completes the products. CAP, carg: bwd_probs'. KEYS: the key-only form exists (a key mask
// may be present: the fused kernels' MASK form); without it hide is kHideNone or kHidePos.
// LATE (not with CAP): dV's product is issued after dS^T is formed, both from f32 P^T / dS^T held
// in st / dpt and packed just before their products, instead of dV's issue before the dP^T wait with
// pa packed at once: 32 registers less at the peak (P^T f32, dP^T, pa, dV, dK: 224 at BQ 128, D 64),
// one warpgroup's dV product less overlapped with its own dS^T maths. The same values: bitwise the
// same products.
template <typename T, int D, int BQ = kWgBwdRows, bool CAP = false, bool KEYS = false, bool LATE = false>
__device__ __forceinline__ void bwd_dv_dk_products(float (&st)[BQ / 8][4], float (&dpt)[BQ / 8][4],
                                                   uint32_t (&pa)[BQ / 16][4], uint32_t (&da)[BQ / 16][4],
                                                   float (&dva)[D / 8][4], float (&dka)[D / 8][4], const float* Lb,
                                                   const float* Db, float c2, int tq, int hide,
                                                   const BwdTileMask& m, uint64_t gdt, uint64_t qdt,
                                                   float carg = 0.f) {
  constexpr int NQ = BQ / 8;
  static_assert(!(LATE && CAP), "bwd_dv_dk_products: LATE keeps P^T in st, which CAP scales");
  constexpr bool PACK = !LATE;
  wg_wait<1>();
  wg_fence_regs(st);
  if (hide == kHidePos)
    bwd_probs<T, kHidePos, NQ, CAP, PACK>(st, pa, Lb, c2, tq, m, carg);
  else if (KEYS && hide == kHideKeys)
    bwd_probs<T, kHideKeys, NQ, CAP, PACK>(st, pa, Lb, c2, tq, m, carg);
  else
    bwd_probs<T, kHideNone, NQ, CAP, PACK>(st, pa, Lb, c2, tq, m, carg);
  if constexpr (!LATE) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D>(dva, pa[kk], gdt, uint64_t(kk * 16 * 128 >> 4), 1);
    wg_commit();
  }
  wg_wait<LATE ? 0 : 1>();  // dP^T done (dV may still run)
  wg_fence_regs(dpt);
  if (hide == kHidePos)
    bwd_dscores<T, kHidePos, NQ, PACK>(st, dpt, da, Db, tq, m);
  else if (KEYS && hide == kHideKeys)
    bwd_dscores<T, kHideKeys, NQ, PACK>(st, dpt, da, Db, tq, m);
  else
    bwd_dscores<T, kHideNone, NQ, PACK>(st, dpt, da, Db, tq, m);
  if constexpr (LATE) {
    bwd_pack<T, NQ>(st, pa);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D>(dva, pa[kk], gdt, uint64_t(kk * 16 * 128 >> 4), 1);
    wg_commit();
    bwd_pack<T, NQ>(dpt, da);
  }
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D>(dka, da[kk], qdt, uint64_t(kk * 16 * 128 >> 4), 1);
}

// Grid: one block per (128-key tile, kv head, batch), key tiles in increasing order (causal: the
// heaviest first).
template <typename T, int D, bool OVL>
__global__ void __launch_bounds__(kWgBwdThreads, 1)
    wgmma_dkdv_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                      T* __restrict__ dk, T* __restrict__ dv) {
#if RLX_ATTN_WGMMA
  static_assert(D % 64 == 0, "wgmma_dkdv_kernel: head dim");
  constexpr int BK = kWgBwdKeys, BQ = kWgBwdRows, NT = kWgBwdThreads;
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t pad = (1024u - (smem_addr(wg_smem) & 1023u)) & 1023u;
  T* Ks = reinterpret_cast<T*>(wg_smem + pad);  // [D / 64][BK][64]
  T* Vs = Ks + BK * D;                            // [D / 64][BK][64]
  T* Qs = Vs + BK * D;                            // [2][D / 64][BQ][64]
  T* Gs = Qs + 2 * BQ * D;                        // dO, [2][D / 64][BQ][64]
  float* Ls = reinterpret_cast<float*>(Gs + 2 * BQ * D);  // [2][BQ], log2 units
  float* Dl = Ls + 2 * BQ;                                 // [2][BQ]
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t nkt = (a.Sk + BK - 1) / BK;
  int64_t blk = blockIdx.x;
  const int64_t kt = blk % nkt;
  blk /= nkt;
  const int64_t hk = blk % a.Hkv, b = blk / a.Hkv;
  const int64_t k0 = kt * BK;
  // 32-bit positions inside the sequences (the launcher serves Sq, Sk < 2^30 only)
  const int kw0 = int(k0) + 64 * wg;  // this warpgroup's keys [kw0, kw0 + 64)
  const int jw = kw0 + 16 * warp;     // this warp's; thread keys jw + g, jw + g + 8
  const int off = int(a.off), sq = int(a.Sq);
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  wg_load_tile<T, D, BK, NT>(Ks, k + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  wg_load_tile<T, D, BK, NT>(Vs, v + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  // query tiles that see these keys: causal, query i sees key j iff j <= i + off
  int qbeg = 0;
  if (a.kind != 0) qbeg = max(0, int(k0) - off);
  qbeg = qbeg / BQ * BQ;
  const int nq = sq > qbeg ? (sq - qbeg + BQ - 1) / BQ : 0;
  const int iters = nq * int(a.group);
  auto stage = [&](int it, int bf) {
    const int64_t h = hk * a.group + it / nq, i0 = qbeg + (it % nq) * BQ;
    wg_load_tile<T, D, BQ, NT>(Qs + bf * BQ * D, q + (b * a.Sq * a.H + h) * D, q_rs, i0, a.Sq);
    wg_load_tile<T, D, BQ, NT>(Gs + bf * BQ * D, dout + (b * a.Sq * a.H + h) * D, q_rs, i0, a.Sq);
    if (threadIdx.x < BQ) {
      const int64_t i = i0 + threadIdx.x;
      float L = INFINITY, dl = 0.f;
      if (i < a.Sq) {
        L = lse[(b * a.H + h) * a.Sq + i];
        if (L == -INFINITY) L = INFINITY;  // dead row: P = 0
        dl = delta[(b * a.H + h) * a.Sq + i];
      }
      Ls[bf * BQ + threadIdx.x] = L * kLog2e;
      Dl[bf * BQ + threadIdx.x] = dl;
    }
  };
  if (iters > 0) stage(0, 0);
  cp_async_commit();
  const float c2 = a.scale * kLog2e;  // raw score -> log2 units
  float dka[D / 8][4], dva[D / 8][4];
  zero(dka);
  zero(dva);
  // A operands: this warpgroup's 64 rows of K / V (the column halves BK * 128 bytes apart)
  const uint64_t kdsc = wg_desc(smem_addr(Ks) + uint32_t(wg * 64 * 128), 16, 1024);
  const uint64_t vdsc = wg_desc(smem_addr(Vs) + uint32_t(wg * 64 * 128), 16, 1024);
  const bool wg_live = kw0 < a.Sk;  // warpgroup-uniform
  int buf = 0;
  for (int it = 0, i0 = qbeg; it < iters; ++it, buf ^= 1, i0 = i0 + BQ < sq ? i0 + BQ : qbeg) {
    cp_async_wait_all();
    fence_proxy_async();  // this thread's cp.async data -> the async proxy (wgmma)
    __syncthreads();      // every thread's tiles landed; both warpgroups done with buf ^ 1
    if (it + 1 < iters) stage(it + 1, buf ^ 1);
    cp_async_commit();
    // warpgroup-uniform: no key of the warpgroup, or no query of the tile sees one (causal)
    if (!wg_live || (a.kind != 0 && kw0 > i0 + BQ - 1 + off)) continue;
    const uint32_t qaddr = smem_addr(Qs + buf * BQ * D), gaddr = smem_addr(Gs + buf * BQ * D);
    float st[8][4], dpt[8][4];
    bwd_issue_scores<T, D, OVL>(st, dpt, kdsc, vdsc, qaddr, gaddr);
    const float* Lb = Ls + buf * BQ;
    const float* Db = Dl + buf * BQ;
    // warp-uniform: the causal diagonal crosses this warp's 16 keys x the tile's 64 queries
    const bool need = a.kind != 0 && jw + 15 > i0 + off;
    // dO / Q as MN-major B: 8-query groups 1024 bytes apart (SBO), the D / 64 column halves
    // BQ * 128 bytes apart (LBO); k-step kk = queries [16 kk, 16 kk + 16)
    const uint64_t gdt = wg_desc(gaddr, BQ * 128, 1024), qdt = wg_desc(qaddr, BQ * 128, 1024);
    uint32_t pa[4][4], da[4][4];
    const BwdTileMask msk{jw + g, INT_MAX, i0 + off};
    if constexpr (OVL) {
      // S^T done (dP^T may still run): P^T, then dV += P^T dO issued while dS^T is computed
      const int hide = need ? kHidePos : kHideNone;
      bwd_dv_dk_products<T, D>(st, dpt, pa, da, dva, dka, Lb, Db, c2, tq, hide, msk, gdt, qdt);
    } else {
      wg_wait0();
      wg_fence_regs(st);
      wg_fence_regs(dpt);
      if (need) {
        bwd_probs<T, kHidePos>(st, pa, Lb, c2, tq, msk);
        bwd_dscores<T, kHidePos>(st, dpt, da, Db, tq, msk);
      } else {
        bwd_probs<T, kHideNone>(st, pa, Lb, c2, tq, msk);
        bwd_dscores<T, kHideNone>(st, dpt, da, Db, tq, msk);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D>(dva, pa[kk], gdt, uint64_t(kk * 16 * 128 >> 4), 1);
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D>(dka, da[kk], qdt, uint64_t(kk * 16 * 128 >> 4), 1);
    }
    wg_commit();
    wg_wait0();
    wg_fence_regs(dva);
    wg_fence_regs(dka);
    wg_fence_afrag(pa);  // dV (OVL: in flight until the wait above) read pa; dK da
    wg_fence_afrag(da);
  }
  cp_async_wait_all();
  store_dk_dv<T, D>(a, dka, dva, dk, dv, (b * a.Sk) * a.Hkv + hk, jw + g, tq);
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx

namespace rlx {
namespace cuda {
namespace attn {

constexpr int kWgDqRows = 128, kWgDqKeys = 64;

// One 64-key tile's dS for a consumer warpgroup of the dq kernel (wgmma_dq_ws_kernel) (this thread: rows wrow0 + 8 r + g, r < 2; keys k0 +
// 8 nt + 2 tq + (e & 1) of s[nt][e], dp[nt][e]): dS = P (dP - delta) with P = 2^(s c2 - L) (L =
// lse log2 e, c2 = scale log2 e), 0 where the tile needs a mask and the (row, key) is masked or out
// of bounds; packed as the A fragments of dQ += dS K (n8 block nt is half of k-step nt / 2's
// fragment: keys 16 (nt / 2) ..). s and dp are only read (the pipelined loop runs this while a
// dQ product is in flight: ptxas serialises the wgmma of a kernel whose non-wgmma instructions
// define registers of an in-flight wgmma, C7513).
template <typename T>
__device__ __forceinline__ void wg_dq_ds_tile(const AttnArgs& a, const float (&s)[8][4], const float (&dp)[8][4],
                                           int64_t wrow0, int64_t k0, int g, int tq, float c2, const float (&L)[2],
                                           const float (&dl)[2], uint32_t (&da)[4][4]) {
  const bool need = tile_needs_mask(a, wrow0, k0, 16, kWgDqKeys);  // warp-uniform
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float de[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      const float p = ex2(fmaf(s[nt][e], c2, -L[r]));
      de[e] = p * (dp[nt][e] - dl[r]);
      if (need) {
        const int64_t i = wrow0 + 8 * r + g, j = k0 + nt * 8 + 2 * tq + (e & 1);
        if (!(i < a.Sq && j < a.Sk && kind_visible(a, i, j))) de[e] = 0.f;
      }
    }
    pack_a_n8<T>(da, nt, de);
  }
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
