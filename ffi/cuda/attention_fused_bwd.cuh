// Fused attention backward on Hopper wgmma (sm_90a), bf16 / f16, head dim 128, the PLAIN cases of
// wgmma_dkdv_kernel (scale > 0, no softcap / bias / key mask, mask kind none or causal): one kernel
// computes dk, dv AND dq, so S and dP are formed once (5 S x S x D products instead of the 7 of
// wgmma_dkdv_kernel + wgmma_dq_kernel). Selected by RLX_ATTENTION_CUDA_WGMMA_BWD=6 (attention.cu).
//
// Block = 2 warpgroups over 128 keys of one kv head, exactly wgmma_dkdv_kernel's OVL schedule
// (attention_wgmma_bwd.cuh) for S^T, dP^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q; in addition, per
// query tile (64 rows of one query head) it forms the block's partial
//   dQ_tile = dS K_block   (64 queries x 128 keys x D): wgmma m64n64k16, 8 k-steps of 16 keys,
// warpgroup w computing the D columns [64 w, 64 w + 64). A = dS, read from shared memory where
// both warpgroups stored their dS^T rows (keys) as [128 keys][64 queries] in the 128-byte swizzle
// layout (queries contiguous: the A operand MN-major, transpose bit); B = the block's K tile,
// MN-major (transpose bit), as V in the forward's P V product.
//
// The partials of the key blocks of one kv head are summed in f32 in global scratch (dQacc [B, H,
// Sq, D]) in a FIXED order per query tile, so dq is bitwise reproducible: no float atomics.
//   - Work order: every block takes a ticket (integer atomicAdd on a zeroed counter) when it
//     starts; the ticket, not blockIdx, names its (key tile, kv head, batch), key tile fastest.
//   - Block kt visits its items (query head of the group, query tile) in a rotated order: item
//     (r_kt + m) mod iters at step m (r_kt = kt * iters / nkt without a mask: the key blocks of a head
//     start on different tiles instead of queueing behind each other; causal: r = 0, the blocks
//     already start on different tiles, their diagonals).
//   - The fixed add order of a tile: its contributors sorted by (step m at which they visit it, kt).
//     The contributor of rank r adds its partial once the tile's uint32 semaphore equals r, and then
//     sets it to r + 1; the adds are pipelined over the loop (item m's partial, 64 x 128 f32, waits
//     in shared memory from the end of iteration m):
//       iteration m + 1, after its first MMAs are issued: thread 0 spins on ld.acquire of the
//         semaphore until it equals r, barrier, cp.async (L2, 16 bytes) of the dQacc tile into a
//         staging copy (rank 0 loads nothing);
//       after iteration m + 1's middle barrier (the cp.async waited): every thread adds staging +
//         partial and stores the f32 tile (st.global.cg), or, the last contributor (r = count - 1),
//         writes dq = scale * sum in T (so no convert pass runs; one contributor writes dq directly);
//       after the top barrier of iteration m + 2 (or the end of the loop): thread 0 stores r + 1
//         with st.release.gpu (cumulative over the block's stores ordered by the barrier).
//     Tiles no key block visits (causal rows that see no key, Sk = 0) are zeroed by the launcher
//     (cudaMemsetAsync), as are the semaphores and the ticket counter.
//   - Deadlock freedom: an item (kt, m) waits only on items of the same (batch, kv head) that are
//     lexicographically smaller in (m, kt), and a block runs its own items in increasing m, so the
//     wait graph has no cycle; every waited-on item belongs to a block of the same (batch, kv head),
//     and those blocks hold consecutive tickets. Tickets are taken in start order, so the started
//     blocks are a prefix of the ticket order: every (batch, kv head) group wholly inside the
//     prefix completes, and at most one group is partly started. The launcher serves only grids
//     whose groups (nkt blocks) fit on the device at once (nkt <= SMs x resident blocks per SM), so
//     when the whole groups have finished, a partly started group's blocks leave room to start the
//     rest of it. Otherwise the launcher runs the two-kernel backward.
// Not the default: at B4 S4096 H16 D128 bf16 it is slower than the two-kernel backward (mode 5 /
// fused, median of 5 paired rounds: bwd 0.72 none, 0.64 causal; fwd+bwd 0.77 / 0.73; run 13 in
// benchmarks/results/attention_bwd_h200_2026-11-22.txt). Without the ordered adds (a diagnosis build,
// dq wrong, not kept) it ran 1.28x faster than the two kernels without a mask (0.95x causal): the 5
// products pay, the ordered f32 reduction through L2 (32 KB read + 32 KB written per block and query
// tile, its latency on the math warps' path) does not. ptxas (sm_90a, nvcc 13.0): 255 registers, 80
// bytes of spill stores, 1 block of 8 warps per SM, 216,080 bytes of shared memory.
#pragma once

#include <cstdint>

#include "cuda/attention_wgmma_bwd.cuh"

namespace rlx {
namespace cuda {
namespace attn {

// D[64 x 64] (+)= A B with A and B both from shared memory, both MN-major (transpose bits set).
template <typename T>
__device__ __forceinline__ void wgmma_ss_tt64(float (&d)[8][4], uint64_t da, uint64_t db, uint64_t aoff, uint64_t boff,
                                              int scale_d) {
#if RLX_ATTN_WGMMA
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\n"
        "add.s64 da, %32, %34;\nadd.s64 db, %33, %35;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, p, 1, "
        "1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
  } else {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\n"
        "add.s64 da, %32, %34;\nadd.s64 db, %33, %35;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, p, 1, "
        "1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
  }
#endif
}

__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Scratch of the fused backward, in f32 elements after delta (B * H * Sq, rounded up to 4):
// dQacc B * H * Sq * D, then B * H * nqt + 1 uint32 (the tile semaphores, the ticket counter).
inline int64_t fused_bwd_delta_pad(int64_t bhs) { return (bhs + 3) / 4 * 4; }
inline int64_t fused_bwd_scratch(int64_t B, int64_t H, int64_t Sq, int64_t D) {
  const int64_t nqt = (Sq + kWgBwdRows - 1) / kWgBwdRows;
  return fused_bwd_delta_pad(B * H * Sq) + B * H * Sq * D + B * H * nqt + 1;
}

// row stride (f32) of the staging copy of a dQacc tile: 128 + 4 (conflict-free fragment reads)
constexpr int kFusedStageLd = 132;

// Shared memory: wgmma_dkdv_kernel's, plus dS^T [128 keys][64 queries] T, the dQ partial of the
// previous tile (32 f32 a thread, 32 KB) and three ints.
template <int D>
constexpr size_t wg_fused_smem() {
  return wg_dkdv_smem<D>() + size_t(2) * kWgBwdKeys * kWgBwdRows + size_t(4) * 32 * kWgBwdThreads +
         size_t(4) * kWgBwdRows * kFusedStageLd + 16;
}

// barrier 1 over the block's 256 threads (they may arrive from different code: the warpgroups'
// live / dead branches)
__device__ __forceinline__ void fused_bar() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// The rotation start of key block kt (items of the block: iters).
__device__ __forceinline__ int fused_rot(int kt, int nkt, int iters, bool causal) {
  return causal ? 0 : int((int64_t(kt) * iters) / nkt);
}

template <typename T, int D>
__global__ void __launch_bounds__(kWgBwdThreads, 1)
    wgmma_fused_bwd_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                           T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dqacc,
                           uint32_t* __restrict__ sem, uint32_t* __restrict__ ticket) {
#if RLX_ATTN_WGMMA
  static_assert(D == 128, "wgmma_fused_bwd_kernel: head dim 128");
  constexpr int BK = kWgBwdKeys, BQ = kWgBwdRows, NT = kWgBwdThreads;
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t pad = (1024u - (smem_addr(wg_smem) & 1023u)) & 1023u;
  T* Ks = reinterpret_cast<T*>(wg_smem + pad);  // [D / 64][BK][64]
  T* Vs = Ks + BK * D;                            // [D / 64][BK][64]
  T* Qs = Vs + BK * D;                            // [2][D / 64][BQ][64]
  T* Gs = Qs + 2 * BQ * D;                        // dO, [2][D / 64][BQ][64]
  T* Ss = Gs + 2 * BQ * D;                        // dS^T [BK][BQ] (128-byte swizzle)
  float* Fs = reinterpret_cast<float*>(Ss + BK * BQ);  // dQ partial [8][256 threads][4]
  float* Ps = Fs + 32 * NT;                             // dQacc tile staging [BQ][kFusedStageLd]
  float* Ls = Ps + BQ * kFusedStageLd;                  // [2][BQ], log2 units
  float* Dl = Ls + 2 * BQ;                              // [2][BQ]
  int* Rc = reinterpret_cast<int*>(Dl + 2 * BQ);        // [0] = ticket, then rank, count
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  if (threadIdx.x == 0) Rc[0] = int(atomicAdd(ticket, 1u));
  __syncthreads();
  const int nkt = int((a.Sk + BK - 1) / BK);
  int64_t blk = Rc[0];
  const int kt = int(blk % nkt);
  blk /= nkt;
  const int64_t hk = blk % a.Hkv, b = blk / a.Hkv;
  const int64_t k0 = int64_t(kt) * BK;
  const int kw0 = int(k0) + 64 * wg;
  const int jw = kw0 + 16 * warp;
  const int off = int(a.off), sq = int(a.Sq), sk = int(a.Sk), grp = int(a.group);
  const bool causal = a.kind != 0;
  const int nqt = (sq + BQ - 1) / BQ;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  wg_load_tile<T, D, BK, NT>(Ks, k + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  wg_load_tile<T, D, BK, NT>(Vs, v + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  // query tiles of key block x: [qt0(x), nqt) (causal: from the tile of its first key on)
  auto qt0_of = [&](int x) { return causal ? max(0, x * BK - off) / BQ : 0; };
  const int qt0 = qt0_of(kt);
  const int nq = nqt > qt0 ? nqt - qt0 : 0;
  const int iters = nq * grp;
  const int rot = fused_rot(kt, nkt, iters, causal);
  // item of step m: (query head of the group, query tile)
  auto item = [&](int m, int* hl, int* t) {
    int idx = m + rot;
    if (idx >= iters) idx -= iters;
    *hl = idx / nq;
    *t = qt0 + idx % nq;
  };
  auto stage = [&](int m, int bf) {
    int hl, t;
    item(m, &hl, &t);
    const int64_t h = hk * a.group + hl, i0 = int64_t(t) * BQ;
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
  const float c2 = a.scale * kLog2e;
  float dka[D / 8][4], dva[D / 8][4];
  zero(dka);
  zero(dva);
  const uint64_t kdsc = wg_desc(smem_addr(Ks) + uint32_t(wg * 64 * 128), 16, 1024);
  const uint64_t vdsc = wg_desc(smem_addr(Vs) + uint32_t(wg * 64 * 128), 16, 1024);
  // dQ operands: dS^T (A, MN-major: 64 queries = one 128-byte row per key, 8-key groups 1024 bytes
  // apart) and this warpgroup's column half of K (B, MN-major, the same strides)
  const uint32_t saddr = smem_addr(Ss);
  const uint64_t sdt = wg_desc(saddr, BK * 128, 1024);
  const uint64_t kdq = wg_desc(smem_addr(Ks) + uint32_t(wg * BK * 128), BK * 128, 1024);
  const bool wg_live = kw0 < a.Sk;
  uint8_t* const srow = reinterpret_cast<uint8_t*>(Ss);
  // Ordered dQ adds, pipelined over the loop (item m's partial is in Fs from the end of iteration m):
  //   iteration m + 1, after the first MMAs are issued: acquire(m): thread 0 waits for the tile's
  //     semaphore to reach the rank, barrier, cp.async of the dQacc tile (L2) into Ps;
  //   after the middle barrier (cp.async waited): add_store(m): Ps + Fs -> dQacc (or dq, last);
  //   the top barrier of iteration m + 2: thread 0 releases the tile (st.release rank + 1).
  int p_rank = -1, p_count = 0, p_i0 = 0;  // the pending item (its partial in Fs)
  int64_t p_h = 0;
  uint32_t* p_sem = nullptr;
  uint32_t* r_sem = nullptr;  // the item to release at the next barrier, and its value
  uint32_t r_val = 0;
  auto acquire = [&]() {
    if (p_rank < 0) return;
    if (threadIdx.x == 0 && p_rank > 0)
      while (ld_acquire_u32(p_sem) != uint32_t(p_rank)) __nanosleep(32);
    if (p_rank > 0) {
      fused_bar();  // the predecessors' adds are visible (thread 0's acquire, then the barrier)
      const float* src = dqacc + ((b * a.H + p_h) * a.Sq + p_i0) * D;
#pragma unroll
      for (int c = 0; c < BQ * D / 4 / NT; ++c) {
        const int e = c * NT + threadIdx.x, row = e / (D / 4), col = (e % (D / 4)) * 4;
        const bool ok = p_i0 + row < sq;
        cp_async16(Ps + row * kFusedStageLd + col, ok ? src + int64_t(row) * D + col : src, ok);
      }
    }
    cp_async_commit();
  };
  auto add_store = [&]() {
    if (p_rank < 0) return;
    const bool last = p_rank == p_count - 1;
    float* accb = dqacc + ((b * a.H + p_h) * a.Sq) * D;
#pragma unroll 2
    for (int nt = 0; nt < 8; ++nt) {
      const float4 f = *reinterpret_cast<const float4*>(Fs + (nt * NT + threadIdx.x) * 4);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int ir = 16 * warp + g + 8 * r, i = p_i0 + ir;
        if (i >= sq) continue;
        const int col = 64 * wg + 2 * tq + nt * 8;
        float x0 = r ? f.z : f.x, x1 = r ? f.w : f.y;
        if (p_rank > 0) {
          const float2 o = *reinterpret_cast<const float2*>(Ps + ir * kFusedStageLd + col);
          x0 = o.x + x0;
          x1 = o.y + x1;
        }
        if (last)
          *reinterpret_cast<uint32_t*>(dq + ((b * a.Sq + i) * a.H + p_h) * D + col) =
              pack2<T>(x0 * a.scale, x1 * a.scale);
        else
          __stcg(reinterpret_cast<float2*>(accb + int64_t(i) * D + col), make_float2(x0, x1));
      }
    }
    if (!last) {
      r_sem = p_sem;
      r_val = uint32_t(p_rank + 1);
    }
  };
  // after a block-wide barrier that follows every thread's add_store stores (cumulative release)
  auto release = [&]() {
    if (r_sem != nullptr && threadIdx.x == 0) st_release_u32(r_sem, r_val);
    r_sem = nullptr;
  };
  int buf = 0;
  for (int m = 0; m < iters; ++m, buf ^= 1) {
    int hl, t;
    item(m, &hl, &t);
    const int i0 = t * BQ;
    const int64_t h = hk * a.group + hl;
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // tiles landed; both warpgroups done with buf ^ 1, Ss, Ps and Rc[1..2]
    release();
    if (m + 1 < iters) stage(m + 1, buf ^ 1);
    cp_async_commit();
    if (threadIdx.x < 32) {
      // rank of this block among the tile's contributors (ordered by (step, kt)) and their count
      int rank = 0, count = 0;
      for (int x0 = 0; x0 < nkt; x0 += 32) {
        const int x = x0 + lane;
        bool contrib = false, before = false;
        if (x < nkt) {
          const int xq0 = qt0_of(x);
          if (xq0 <= t) {
            contrib = true;
            const int xnq = nqt - xq0, xit = xnq * grp;
            int xm = hl * xnq + (t - xq0) - fused_rot(x, nkt, xit, causal);
            if (xm < 0) xm += xit;
            before = x != kt && (xm < m || (xm == m && x < kt));
          }
        }
        count += __popc(__ballot_sync(0xffffffffu, contrib));
        rank += __popc(__ballot_sync(0xffffffffu, before));
      }
      if (lane == 0) {
        Rc[1] = rank;
        Rc[2] = count;
      }
    }
    // warpgroup-uniform: does any query of the tile see a key of this warpgroup?
    const bool live = wg_live && !(causal && kw0 > i0 + BQ - 1 + off);
    if (live) {
      const uint32_t qaddr = smem_addr(Qs + buf * BQ * D), gaddr = smem_addr(Gs + buf * BQ * D);
      float st[8][4], dpt[8][4];
      const uint64_t qd = wg_desc(qaddr, 16, 1024), gd = wg_desc(gaddr, 16, 1024);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_ss<T, 64>(st, kdsc, qd, uint64_t(((kk >> 2) * BK * 128 + (kk & 3) * 32) >> 4),
                        uint64_t(((kk >> 2) * BQ * 128 + (kk & 3) * 32) >> 4), kk > 0);
      wg_commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_ss<T, 64>(dpt, vdsc, gd, uint64_t(((kk >> 2) * BK * 128 + (kk & 3) * 32) >> 4),
                        uint64_t(((kk >> 2) * BQ * 128 + (kk & 3) * 32) >> 4), kk > 0);
      wg_commit();
      acquire();
      const float* Lb = Ls + buf * BQ;
      const float* Db = Dl + buf * BQ;
      // warp-uniform: the causal diagonal or the end of the keys crosses this warp's 16 keys (dS^T
      // feeds dQ, so keys past Sk are masked too)
      const bool need = (causal && jw + 15 > i0 + off) || jw + 15 >= sk;
      const uint64_t gdt = wg_desc(gaddr, BQ * 128, 1024), qdt = wg_desc(qaddr, BQ * 128, 1024);
      uint32_t pa[4][4], da[4][4];
      wg_wait<1>();
      wg_fence_regs(st);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ic = nt * 8 + 2 * tq + (e & 1);
          const float p = ex2(fmaf(st[nt][e], c2, -Lb[ic]));
          const int j = jw + g + 8 * (e >> 1);
          const bool vis = !need || (j < sk && (!causal || j <= i0 + ic + off));
          st[nt][e] = vis ? p : 0.f;
        }
        pa[nt >> 1][(nt & 1) * 2 + 0] = pack2<T>(st[nt][0], st[nt][1]);
        pa[nt >> 1][(nt & 1) * 2 + 1] = pack2<T>(st[nt][2], st[nt][3]);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D>(dva, pa[kk], gdt, uint64_t(kk * 16 * 128 >> 4), 1);
      wg_commit();
      wg_wait<1>();
      wg_fence_regs(dpt);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        float de[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ic = nt * 8 + 2 * tq + (e & 1);
          const int j = jw + g + 8 * (e >> 1);
          const bool vis = !need || (j < sk && (!causal || j <= i0 + ic + off));
          de[e] = vis ? st[nt][e] * (dpt[nt][e] - Db[ic]) : 0.f;
        }
        da[nt >> 1][(nt & 1) * 2 + 0] = pack2<T>(de[0], de[1]);
        da[nt >> 1][(nt & 1) * 2 + 1] = pack2<T>(de[2], de[3]);
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D>(dka, da[kk], qdt, uint64_t(kk * 16 * 128 >> 4), 1);
      wg_commit();
      // dS^T rows of this thread (keys 64 wg + 16 warp + g (+ 8)) to shared memory: queries
      // nt * 8 + 2 tq, +1 are 4 bytes in 16-byte chunk nt, at chunk position nt ^ (row & 7)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = 64 * wg + 16 * warp + g + 8 * r;
          *reinterpret_cast<uint32_t*>(srow + row * 128 + ((nt ^ (row & 7)) << 4) + 4 * tq) =
              da[nt >> 1][(nt & 1) * 2 + r];
        }
      wg_wait0();
      wg_fence_regs(dva);
      wg_fence_regs(dka);
      wg_fence_afrag(pa);
      wg_fence_afrag(da);
    } else {
      acquire();
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = 64 * wg + 16 * warp + g + 8 * r;
          *reinterpret_cast<uint32_t*>(srow + row * 128 + ((nt ^ (row & 7)) << 4) + 4 * tq) = 0u;
        }
    }
    cp_async_wait_all();  // this thread's Ps copies (and the next Q / dO tiles)
    fence_proxy_async();  // dS^T (st.shared) -> the async proxy
    __syncthreads();      // both warpgroups' dS^T rows and Ps copies stored; Rc[1..2] written
    float dqa[8][4];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      wgmma_ss_tt64<T>(dqa, sdt, kdq, uint64_t(kk * 16 * 128 >> 4), uint64_t(kk * 16 * 128 >> 4), kk > 0);
    wg_commit();
    add_store();  // the previous item, while this tile's dQ product runs
    p_rank = Rc[1];
    p_count = Rc[2];
    p_i0 = i0;
    p_h = h;
    p_sem = sem + (b * a.H + h) * nqt + t;
    wg_wait0();
    wg_fence_regs(dqa);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
      *reinterpret_cast<float4*>(Fs + (nt * NT + threadIdx.x) * 4) =
          make_float4(dqa[nt][0], dqa[nt][1], dqa[nt][2], dqa[nt][3]);
  }
  // the last item: release the one before, then acquire, add, release
  __syncthreads();
  release();
  acquire();
  cp_async_wait_all();
  __syncthreads();
  add_store();
  __syncthreads();
  release();
  cp_async_wait_all();
  const int64_t kv_b = (b * a.Sk) * a.Hkv + hk;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = jw + g + 8 * r;
    if (j >= a.Sk) continue;
    T* dkr = dk + (kv_b + j * a.Hkv) * D;
    T* dvr = dv + (kv_b + j * a.Hkv) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      *reinterpret_cast<uint32_t*>(dkr + nt * 8 + 2 * tq) =
          pack2<T>(dka[nt][2 * r] * a.scale, dka[nt][2 * r + 1] * a.scale);
      *reinterpret_cast<uint32_t*>(dvr + nt * 8 + 2 * tq) = pack2<T>(dva[nt][2 * r], dva[nt][2 * r + 1]);
    }
  }
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
