// Warp-specialised wgmma dq kernel (sm_90a), bf16 / f16, head dim 128, the cases of wgmma_dq_kernel
// (attention_wgmma_bwd.cuh: PLAIN, mask kind none or causal). Engineer F's structure of the forward
// (attention_wgmma_ws.cuh) applied to the dq loop, which streams K / V tiles past a resident Q / dO
// tile just as the forward streams K / V past Q. The default at D 128 (RLX_ATTENTION_CUDA_WGMMA_BWD
// unset or 8, NST 4; attention.cu); run 14 of benchmarks/results/attention_bwd_h200_2026-11-22.txt has
// the A/B (1.01x / 1.02x the 2-warpgroup dq's backward, none / causal; a ring of 2 stages ran level).
//
// Block = 3 warpgroups (384 threads), one block per SM, persistent grid (attn_ws_grid):
//   warpgroup 0 (producer, setmaxnreg.dec to kWsDqProdRegs): per tile (fwd_tile's order, heaviest
//     causal tiles first) waits on the Q empty barrier, loads Q and dO [128 x D] with cp.async
//     (ws_load_tile: 128-byte swizzle, K-major, zero fill past Sq) and arrives on the Q full
//     barrier (cp.async.mbarrier.arrive.noinc, count 128), then streams the tile's key tiles of BC
//     = 64 keys through a ring of NST stages: K and V have their own full barriers (count 128), the
//     stage's empty barrier (count 8: one arrival per consumer warp) gates its reuse.
//   warpgroups 1, 2 (consumers, setmaxnreg.inc to kWsDqConsRegs): 64 query rows each, the loop body
//     of wgmma_dq_kernel: S = Q_w K^T and dP = dO_w V^T (smem x smem), dS = P (dP - delta), dQ +=
//     dS K (A = dS from registers, B = K MN-major from the stage). The stage is released (empty
//     arrival) once dQ += dS K, its last reader, has completed.
//     dQ += dS K is waited (wait_group 0) before the stage is released (lane 0 of each warp) and
//     the next key tile starts; the other consumer warpgroup's products fill the tensor pipe
//     meanwhile. (Tried: keeping dQ += dS K of tile t in flight across the next tile's barrier
//     waits and S / dP issue: ptxas -v reported C7518 (wgmma serialised by a compiler-inserted wait
//     in a divergent path; the per-thread mbarrier spin loop or the lane-0 arrival, not isolated),
//     also with the arrival moved after wait_group 0, so that variant was dropped before any GPU run.)
//   No CTA-wide barrier after the prologue; barrier phases as in attention_wgmma_ws.cuh (consumers
//   wait full barriers with the ring's parity, the producer empty ones with the opposite bit). A
//   consumer warpgroup that skips a key tile (causal: past its last row) still waits on both full
//   barriers and arrives on the empty one.
// dq = scale * dQ, written by the consumers; no atomics (each tile's rows are written once).
#pragma once

#include <cstdint>

#include "cuda/attention_wgmma_bwd.cuh"
#include "cuda/attention_wgmma_ws.cuh"

namespace rlx {
namespace cuda {
namespace attn {

constexpr int kWsDqKeys = 64;
// Register split (setmaxnreg): the forward's 56 / 224 spilled 24 bytes in this producer (two tiles'
// pointers, Q and dO, per query tile); 64 / 216 compiles without spills in both warpgroups
// (128 * 64 + 256 * 216 = 63488 <= 384 * 168 at launch).
constexpr int kWsDqProdRegs = 64, kWsDqConsRegs = 216;

// Shared memory: Q and dO [128 x D], K and V [NST][64 x D], 1024 bytes to align the swizzle atoms,
// then the barriers (K full, V full, empty per stage; Q full, Q empty).
template <int D, int NST>
constexpr size_t wg_dq_ws_smem() {
  return size_t(2) * D * (2 * 128 + 2 * NST * kWsDqKeys) + 1024 + 8 * (3 * NST + 2);
}

template <typename T, int D, int NST>
__global__ void __launch_bounds__(384, 1)
    wgmma_dq_ws_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                       T* __restrict__ dq, int hc) {
#if RLX_ATTN_WGMMA
  static_assert(D % 64 == 0 && NST >= 2, "wgmma_dq_ws_kernel: tile shapes");
  constexpr int BM = 128, BC = kWsDqKeys;
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t pad = (1024u - (smem_addr(wg_smem) & 1023u)) & 1023u;
  T* Qs = reinterpret_cast<T*>(wg_smem + pad);  // [D / 64][BM][64]
  T* Gs = Qs + BM * D;                            // dO, [D / 64][BM][64]
  T* Ks = Gs + BM * D;                            // [NST][D / 64][BC][64]
  T* Vs = Ks + NST * BC * D;                      // [NST][D / 64][BC][64]
  const WsRing ring = ws_ring_init<NST>(Vs + NST * BC * D);
  uint64_t *kfull = ring.kfull, *vfull = ring.vfull, *empty = ring.empty, *qfull = ring.qfull, *qempty = ring.qempty;
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  const int64_t nqt = (a.Sq + BM - 1) / BM, nbh = a.B * a.H, ntiles = nqt * nbh;
  int st = 0;
  uint32_t ph = 0, qph = 0;
  if (wg == 0) {
    ws_setmaxnreg_dec<kWsDqProdRegs>();
    ws_produce<T, D, BM, BC, NST, true>(a, q, dout, k, v, Qs, Gs, Ks, Vs, ring, hc);
    return;
  }
  // ---- consumers ----
  ws_setmaxnreg_inc<kWsDqConsRegs>();
  const int cw = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  const float c2 = a.scale * kLog2e;  // raw score -> log2 units
  const uint64_t qd = wg_desc(smem_addr(Qs) + uint32_t(cw * 64 * 128), 16, 1024);  // this warpgroup's 64 rows
  const uint64_t gd = wg_desc(smem_addr(Gs) + uint32_t(cw * 64 * 128), 16, 1024);
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    int64_t qt, bh;
    fwd_tile(t, nqt, nbh, hc, &qt, &bh);
    const int64_t h = bh % a.H, b = bh / a.H, q0 = qt * BM;
    int64_t kbeg, kend;
    key_range(a, q0, min(a.Sq - 1, q0 + BM - 1), &kbeg, &kend, BC);
    const int64_t r0 = q0 + 64 * cw;       // this warpgroup's rows [r0, r0 + 64)
    const int64_t wrow0 = r0 + 16 * warp;  // this warp's; thread rows wrow0 + 8 r + g
    int64_t wg_kend = kend;                // the warpgroup's rows see no key at or past it (causal)
    if (a.kind != 0) wg_kend = min(a.Sk, min(a.Sq - 1, r0 + 63) + a.off + 1);
    if (r0 >= a.Sq) wg_kend = kbeg;
    float L[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = wrow0 + 8 * r + g;
      L[r] = INFINITY;
      dl[r] = 0.f;
      if (i < a.Sq) {
        L[r] = lse[(b * a.H + h) * a.Sq + i];
        if (L[r] == -INFINITY) L[r] = INFINITY;  // dead row: P = 0
        dl[r] = delta[(b * a.H + h) * a.Sq + i];
      }
      L[r] *= kLog2e;
    }
    float dqa[D / 8][4];
    zero(dqa);
    uint32_t da[4][4];  // dS as the A fragments of dQ += dS K
    ws_wait(qfull, qph);
    qph ^= 1;
    fence_proxy_async();
    for (int64_t k0 = kbeg; k0 < kend; k0 += BC) {
      ws_wait(kfull + st, ph);
      ws_wait(vfull + st, ph);
      if (k0 < wg_kend) {     // warpgroup-uniform
        fence_proxy_async();  // the producer's cp.async data -> the async proxy (wgmma)
        const uint32_t kaddr = smem_addr(Ks + st * BC * D), vaddr = smem_addr(Vs + st * BC * D);
        float s[8][4], dp[8][4];
        const uint64_t kd = wg_desc(kaddr, 16, 1024), vd = wg_desc(vaddr, 16, 1024);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)  // k-step kk: column half kk / 4, 16 columns = 32 bytes in
          wgmma_ss<T, 64>(s, qd, kd, uint64_t(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4),
                          uint64_t(((kk >> 2) * BC * 128 + (kk & 3) * 32) >> 4), kk > 0);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          wgmma_ss<T, 64>(dp, gd, vd, uint64_t(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4),
                          uint64_t(((kk >> 2) * BC * 128 + (kk & 3) * 32) >> 4), kk > 0);
        wg_commit();
        wg_wait0();
        wg_fence_regs(s);
        wg_fence_regs(dp);
        const bool need = tile_needs_mask(a, wrow0, k0, 16, BC);  // warp-uniform
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
          // n8 block nt is half of the A fragment of k-step nt / 2 (keys 16 (nt / 2) ..)
          da[nt >> 1][(nt & 1) * 2 + 0] = pack2<T>(de[0], de[1]);
          da[nt >> 1][(nt & 1) * 2 + 1] = pack2<T>(de[2], de[3]);
        }
        // K as MN-major B (keys are the K dimension): 8-key groups 1024 bytes apart (SBO), the D / 64
        // column halves BC * 128 bytes apart (LBO); k-step kk = keys [16 kk, 16 kk + 16)
        const uint64_t kdt = wg_desc(kaddr, BC * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) wgmma_rs<T, D>(dqa, da[kk], kdt, uint64_t(kk * 16 * 128 >> 4), 1);
        wg_commit();
        wg_wait0();
        wg_fence_regs(dqa);
        wg_fence_afrag(da);
      }
      __syncwarp();
      if (lane == 0) ws_arrive(empty + st);  // the stage's last reader (dQ += dS K) has completed
      if (++st == NST) {
        st = 0;
        ph ^= 1;
      }
    }
    // every S / dP of this tile has completed (wait_group 0 above): Q and dO may be overwritten
    __syncwarp();
    if (lane == 0) ws_arrive(qempty);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = wrow0 + 8 * r + g;
      if (i >= a.Sq) continue;
      T* dqr = dq + ((b * a.Sq + i) * a.H + h) * D;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        *reinterpret_cast<uint32_t*>(dqr + nt * 8 + 2 * tq) =
            pack2<T>(dqa[nt][2 * r] * a.scale, dqa[nt][2 * r + 1] * a.scale);
    }
  }
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
