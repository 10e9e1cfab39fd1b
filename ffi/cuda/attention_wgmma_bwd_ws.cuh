// Warp-specialised wgmma dq kernel (sm_90a), bf16 / f16, head dim 128 (the template serves 64 too: it
// ran 6-9 % slower than the mma.sync dq causal there, so D 64 keeps that), the PLAIN cases (scale > 0,
// no softcap, bias or key mask), mask kind none or causal: the dq half of the two-kernel backward
// that runs where the fused kernel does not serve (attention_launch_impl.cuh). The structure of the
// forward (attention_wgmma_ws.cuh) applied to the dq loop, which streams K / V tiles past a resident
// Q / dO tile just as the forward streams K / V past Q. NST 4; measured 1.01x / 1.02x the backward of
// a 2-warpgroup dq kernel without the split (none / causal; a ring of 2 stages ran level).
//
// Block = 3 warpgroups (384 threads), one block per SM, persistent grid (attn_ws_grid):
//   warpgroup 0 (producer, setmaxnreg.dec to kWsDqProdRegs): per tile (fwd_tile's order, heaviest
//     causal tiles first) waits on the Q empty barrier, loads Q and dO [128 x D] with cp.async
//     (ws_load_tile: 128-byte swizzle, K-major, zero fill past Sq) and arrives on the Q full
//     barrier (cp.async.mbarrier.arrive.noinc, count 128), then streams the tile's key tiles of BC
//     = 64 keys through a ring of NST stages: K and V have their own full barriers (count 128), the
//     stage's empty barrier (count 8: one arrival per consumer warp) gates its reuse.
//   warpgroups 1, 2 (consumers, setmaxnreg.inc to kWsDqConsRegs): 64 query rows each:
//     S = Q_w K^T and dP = dO_w V^T (smem x smem), dS = P (dP - delta), dQ +=
//     dS K (A = dS from registers, B = K MN-major from the stage). The stage is released (empty
//     arrival) once dQ += dS K, its last reader, has completed.
//     Pipelined: tile j's S and dP are issued before tile j - 1's dQ += dS K, and tile j's dS is
//     formed while that product runs (as the forward's loop); the stage of tile j - 1 is released
//     after its dQ product. Keeping dQ's product in flight across the
//     next tile's barrier waits instead hits C7518 (wgmma serialised);
//     here, as in the forward, no non-wgmma instruction writes a register of an in-flight wgmma (dS
//     alternates between two buffers, the loop unrolled by two; S and dP are only read) and ptxas
//     reports no serialisation. ptxas: 168 registers at launch, 52 bytes of spill stores at D 128
//     (the consumer at 216 registers; 64 / 216 is the split without producer spills). H100, B4
//     S4096 H16 bf16, 3 alternating rounds against the loop that waits for each product (the same dq,
//     bitwise): fwd+bwd 1.02-1.04x (D 128 none and causal).
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

// Consumer loop, pipelined within each warpgroup (as the forward's): tile j's S and dP are issued
// before tile j - 1's dQ += dS K, and tile j's dS is formed while that product is in flight (dS
// alternates between two register buffers, the loop unrolled by two); the stage of tile j - 1 is
// released once its dQ product has completed, one step later than a loop waiting for each product
// (so NST >= 3).
template <typename T, int D, int NST>
__global__ void __launch_bounds__(384, 1)
    wgmma_dq_ws_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                       T* __restrict__ dq, int hc, int zig) {
#if RLX_ATTN_WGMMA
  static_assert(D % 64 == 0 && NST >= 3 && kWsDqKeys == kWgDqKeys, "wgmma_dq_ws_kernel: tile shapes");
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
    ws_produce<T, D, BM, BC, NST, true>(a, q, dout, k, v, Qs, Gs, Ks, Vs, ring, hc, zig != 0);
    return;
  }
  // ---- consumers ----
  ws_setmaxnreg_inc<kWsDqConsRegs>();
  const int cw = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  const float c2 = a.scale * kLog2e;  // raw score -> log2 units
  const uint64_t qd = wg_desc(smem_addr(Qs) + uint32_t(cw * 64 * 128), 16, 1024);  // this warpgroup's 64 rows
  const uint64_t gd = wg_desc(smem_addr(Gs) + uint32_t(cw * 64 * 128), 16, 1024);
  for (int64_t n = 0, t = ws_tile(0, zig != 0); t < ntiles; t = ws_tile(++n, zig != 0)) {
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
    ws_wait(qfull, qph);
    qph ^= 1;
    fence_proxy_async();
    int64_t k0 = kbeg;
    {
      // the key tiles this warpgroup computes are [kbeg, kstop) (a prefix of the block's)
      const int64_t kstop = min(kend, wg_kend);
      if (k0 < kstop) {
        float s[8][4], dp[8][4];
        uint32_t da0[4][4], da1[4][4];
        ws_wait(kfull + st, ph);
        ws_wait(vfull + st, ph);
        fence_proxy_async();  // the producer's cp.async data -> the async proxy (wgmma)
        ws_issue_qk<T, D, BC>(s, qd, Ks + st * BC * D);
        ws_issue_qk<T, D, BC>(dp, gd, Vs + st * BC * D);  // dP = dO V^T: V as S's K
        wg_wait0();
        wg_fence_regs(s);
        wg_fence_regs(dp);
        wg_dq_ds_tile<T>(a, s, dp, wrow0, k0, g, tq, c2, L, dl, da0);
        int pst = st;  // the ring stage of the tile whose dQ product is pending (its dS in dc below)
        ws_ring_next(st, ph, NST);
        k0 += BC;
        // one step: S and dP of tile k0 issued, then the pending tile's dQ += dS K; tile k0's dS
        // (into dn) while that product runs
        auto step = [&](auto& dc, auto& dn) {
          ws_wait(kfull + st, ph);
          ws_wait(vfull + st, ph);
          fence_proxy_async();
          ws_issue_qk<T, D, BC>(s, qd, Ks + st * BC * D);
          ws_issue_qk<T, D, BC>(dp, gd, Vs + st * BC * D);
          ws_issue_pv<T, D, BC>(dqa, dc, Ks + pst * BC * D);  // K MN-major: keys are the K dimension
          wg_wait<1>();  // S and dP of this tile (committed first) have completed
          wg_fence_regs(s);
          wg_fence_regs(dp);
          wg_dq_ds_tile<T>(a, s, dp, wrow0, k0, g, tq, c2, L, dl, dn);
          wg_wait0();  // the pending tile's dQ product
          wg_fence_regs(dqa);
          wg_fence_afrag(dc);
          __syncwarp();
          if (lane == 0) ws_arrive(empty + pst);
          pst = st;
          ws_ring_next(st, ph, NST);
          k0 += BC;
        };
        auto last = [&](auto& dc) {  // the last tile's dQ product, its dS in dc
          ws_issue_pv<T, D, BC>(dqa, dc, Ks + pst * BC * D);
          wg_wait0();
          wg_fence_regs(dqa);
          wg_fence_afrag(dc);
          __syncwarp();
          if (lane == 0) ws_arrive(empty + pst);
        };
        while (true) {
          if (k0 >= kstop) {
            last(da0);
            break;
          }
          step(da0, da1);
          if (k0 >= kstop) {
            last(da1);
            break;
          }
          step(da1, da0);
        }
      }
    }
    // the tiles past this warpgroup's last visible key: only paced with the ring (a skipped tile still
    // waits both full barriers and arrives on the empty one)
    for (; k0 < kend; k0 += BC) {
      ws_wait(kfull + st, ph);
      ws_wait(vfull + st, ph);
      __syncwarp();
      if (lane == 0) ws_arrive(empty + st);  // the stage's last reader (dQ += dS K) has completed
      ws_ring_next(st, ph, NST);
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
