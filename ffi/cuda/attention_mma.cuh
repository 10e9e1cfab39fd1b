// Attention on tensor cores (sm_80+, mma.sync m16n8k16, bf16 / f16 in, f32 accumulation),
// FlashAttention-2 style, for head dims 64 and 128. Mask kind, scale, softcap and bias are
// runtime parameters (AttnArgs, attention_generic.cuh); two template flags pick the score code:
// MASK (a key mask is given; without one the kernels carry no mask bits or flags) and PLAIN (no
// softcap and no bias; the forward also needs scale > 0). Each kernel is instantiated per
// (dtype, head dim, MASK, PLAIN); the forward's pipeline is fixed per head dim and MASK
// (attention_launch_impl.cuh). In every kernel a tile that needs no per-element masking (warp- or
// block-uniform test) runs a score loop of its own: PLAIN fwd max + fma + ex2 per score, PLAIN
// bwd fma + ex2 + the dS product, softcap-only (general kernels, no bias) tanh + fma + ex2; the
// index tests (mask kind, sequence ends) run only on the tiles that need them.
//
// Tiles: 64 query rows x 64 keys per step, 4 warps of 16 rows each (128 threads). Tiles go
// global -> shared with cp.async (16-byte, zero-filled past the sequence end), double
// buffered; operands go shared -> registers with ldmatrix (.trans for the operands that are
// stored [k][n]). Shared tiles are either XOR-swizzled unpadded rows or rows padded by 8
// elements (16 bytes), per kernel (fwd_swizzle / bwd_swizzle below); in both the 8 row addresses
// of one ldmatrix phase fall in distinct bank groups.
//
// Fragment layout of m16n8k16 (g = lane / 4, t = lane % 4): A regs (row g, cols 2t..2t+1),
// (row g+8, cols 2t..), (row g, cols 2t+8..), (row g+8, cols 2t+8..); B regs (k 2t..2t+1,
// col g), (k 2t+8.., col g); C (row g, cols 2t, 2t+1), (row g+8, cols 2t, 2t+1). A C tile
// of two adjacent 8-column blocks is, packed to 16-bit pairs, the A fragment of the next
// product (P -> P V, dS -> dS K, ...), so probabilities never leave registers.
//
//   fwd:  block = (64-query tile, head, batch); loops over key tiles with an online softmax;
//         writes out and lse. Fully hidden key tiles (causal / sliding) are skipped.
//   dkdv: block = (64-key tile, kv head, batch); warp w owns 16 keys and loops over the
//         query heads of the group and the query tiles: S^T = K Q^T, dP^T = V dO^T,
//         P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dR^T Q.
//         No atomics: each block owns its dk / dv rows. It also writes dbias (then it visits
//         every query tile, so hidden entries get their zeros).
//   dq:   block = (64-query tile, head, batch); loops over key tiles: S = Q K^T, dP = dO V^T,
//         dQ += dR K. Deterministic (no atomics), at the price of recomputing S and dP.
// The masking work (per-element visibility) runs only on tiles that need it: partial tiles,
// the causal / sliding diagonal bands, and key tiles where the key mask hides some keys (the
// mask is read once per tile into ballot bits; tiles with no kept key are skipped).
// The forward's pipeline is per head dim (attention_launch_impl.cuh): without a key mask, double buffered
// at D 64 and staggered (one K and one V buffer, see mma_fwd_kernel) at D 128; with a key
// mask staggered at both. dq and dkdv double buffer as described above.
// NaN: a NaN score gives p = NaN (ex2 of NaN), so the row's l, output, lse (forward) and its
// dq / dk / dv contributions (backward) are NaN, as the CPU kernel; the row max uses fmaxf.
#pragma once

#include <type_traits>

#include "cuda/attention_generic.cuh"

namespace rlx {
namespace cuda {
namespace attn {

constexpr int kBQ = 64, kBK = 64, kMmaThreads = 128;

// Shared tile layout (SW). true: unpadded rows of D elements, the 16-byte chunk c of row r stored
// at chunk position (c & ~7) + ((c & 7) ^ (r & 7)) (XOR swizzle). false: rows padded to D + 8
// elements, chunks in order. Both put the 8 row addresses of an ldmatrix phase in 8 distinct
// 16-byte bank groups, but with the padded rows the 8 chunks that a quarter-warp stores with
// cp.async straddle two 128-byte shared lines, and the copy then fetched 1.5x the ideal global
// sectors and ran 1.6x (D 64) / 2.0x (D 128) slower in a copy-only microbenchmark (H200); swizzled rows are 128-byte aligned, so the
// quarter-warp fills one aligned line. The layout is chosen per kernel by measurement:
// swizzled for the forward and the D 128 backward; padded for the D 64 backward (swizzled, B4
// fwd+bwd moved +0.6 / -1.2 % (none / causal) while the forward alone gained 6-10 %: the D 64
// backward lost it) and for the D 128 forward with a key mask (swizzled: 1.2 % slower on the
// general score path, 4 % on the PLAIN one; ptxas spills 40 / 8 B there at the 3-block register
// cap, none padded). The padded kernels run the code they had before (the !SW branches).
constexpr bool fwd_swizzle(int d, bool mask) { return !(d == 128 && mask); }
constexpr bool bwd_swizzle(int d) { return d == 128; }

template <int D, bool SW>
constexpr int mma_lds() { return SW ? D : D + 8; }  // shared row stride (elements)

// Shared memory bytes of each kernel (elements are 2 bytes).
// nbuf: K / V buffers (2: double buffered; 1: the staggered pipeline of mma_fwd_kernel).
constexpr size_t mma_fwd_smem(int d, bool sw, int mt, int nk, int nbuf) {
  return size_t(2) * (sw ? d : d + 8) * (64 * mt + 2 * nbuf * nk);
}
template <int D>
constexpr size_t mma_dkdv_smem() {
  return size_t(2) * mma_lds<D, bwd_swizzle(D)>() * (2 * kBK + 4 * kBQ) + sizeof(float) * 4 * kBQ;
}
template <int D>
constexpr size_t mma_dq_smem() { return size_t(2) * mma_lds<D, bwd_swizzle(D)>() * (2 * kBQ + 4 * kBK); }

// Swizzled ldmatrix addressing: a lane reads row r (r % 8 fixed by the lane, the tile offsets
// being multiples of 8 rows) at the chunk c0 + b, with c0 even (a compile-time constant after
// unrolling) and b (0 / 1) fixed by the lane. The lane's base address (lane_base: its row, and its
// chunk position for c0 = 0) stays in one register; the chunk c0 adds the byte offset chunk_off
// and XORs the address with chunk_x (bits 4-6 only: the 16-byte chunk inside the row's 128-byte
// line, which is why the tiles are 128-byte aligned in shared memory). The padded layout keeps
// the pointer arithmetic it had before (the !SW branches below).
template <int D>
__device__ __forceinline__ uint32_t lane_base(const void* tile, int row, int b) {
  return smem_addr(tile) + uint32_t(row * D + (((row & 7) ^ b) << 3)) * 2u;
}
__device__ __forceinline__ uint32_t chunk_x(int c0) { return uint32_t(c0 & 7) << 4; }
__device__ __forceinline__ uint32_t chunk_off(int c0) { return uint32_t(c0 & ~7) << 4; }

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define RLX_ATTN_MMA 1
#else
#define RLX_ATTN_MMA 0
#endif

// ---- PTX wrappers ----------------------------------------------------------------------------
// cp.async of 16 bytes to the shared-memory byte address dst (src-size 16 or, with valid false, 0:
// zero fill)
__device__ __forceinline__ void cp_async16_to(uint32_t dst, const void* src) {
#if RLX_ATTN_MMA
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void cp_async16_to(uint32_t dst, const void* src, bool valid) {
#if RLX_ATTN_MMA
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
#endif
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16_to(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async_commit() {
#if RLX_ATTN_MMA
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if RLX_ATTN_MMA
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
#if RLX_ATTN_MMA
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
#if RLX_ATTN_MMA
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}

// ldmatrix (.trans if TRANS) at the shared address (base ^ x) + off (swizzled tiles). The XOR sits
// inside the asm statement so that the compiler does not hoist one address per (operand, k-chunk)
// out of the tile loop (registers: a first version with plain C++ XORs spilled 60 B in the PLAIN
// D 128 forward and 80 B in dkdv D 128, against 20 and 8 B this way); x == 0 is base + offset.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4_x(uint32_t (&r)[4], uint32_t base, uint32_t x, uint32_t off) {
#if RLX_ATTN_MMA
  if (x == 0) {
    if constexpr (TRANS)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(base + off));
    else
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(base + off));
  } else {
    if constexpr (TRANS)
      asm volatile("{\n .reg .b32 t;\n xor.b32 t, %4, %5;\n add.u32 t, t, %6;\n"
                   " ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [t];\n}"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(base), "r"(x), "r"(off));
    else
      asm volatile("{\n .reg .b32 t;\n xor.b32 t, %4, %5;\n add.u32 t, t, %6;\n"
                   " ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [t];\n}"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(base), "r"(x), "r"(off));
  }
#endif
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if RLX_ATTN_MMA
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  }
  return r;
}

// 2^x (ex2.approx; 2^-inf = 0). Scores are carried in log2 units (scale * log2 e folded into
// the score multiplier) so each probability costs one add or fma and one ex2.
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Key mask of one key tile as bits: lane l of every warp reads keys k0 + 32 w + l (w < W) into
// mv (prefetched one tile ahead), and mask_bits turns them into W words (bit l of word w: key
// k0 + 32 w + l is kept; keys >= Sk are not). Every warp computes the same words, so a tile
// with no kept key is skipped by the whole block at once.
template <int W>
__device__ __forceinline__ void mask_load(float (&mv)[W], const float* mrow, int64_t k0, int64_t sk, int lane) {
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const int64_t j = k0 + 32 * w + lane;
    mv[w] = j < sk ? mrow[j] : 0.f;
  }
}
template <int W>
__device__ __forceinline__ void mask_bits(uint32_t (&bits)[W], const float (&mv)[W], bool* all_on, bool* none) {
  bool all = true, any = false;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    bits[w] = __ballot_sync(0xffffffffu, mv[w] >= 0.5f);
    all = all && bits[w] == 0xffffffffu;
    any = any || bits[w] != 0u;
  }
  *all_on = all;
  *none = !any;
}

// rows [r0, r0 + ROWS) of x (row r at x + r * rs, D elements) -> dst[ROWS][LDS] in the layout SW;
// rows >= n zero. Thread t copies the 16-byte chunk t % (D / 8) of rows t / (D / 8) + it * (128 /
// (D / 8)): a fixed trip count, unrolled, with one base address per thread (no per-chunk division
// or 64-bit index arithmetic); rows per pass are a multiple of 8, so the thread's swizzled chunk
// position is the same in every pass.
template <typename T, int D, bool SW, int ROWS = 64>
__device__ __forceinline__ void load_tile(T* dst, const T* __restrict__ x, int64_t rs, int64_t r0, int64_t n) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int LDS = mma_lds<D, SW>();
  static_assert(kMmaThreads % kChunks == 0 && (ROWS * kChunks) % kMmaThreads == 0, "load_tile: whole passes");
  constexpr int kStep = kMmaThreads / kChunks;  // rows per pass
  static_assert(kStep % 8 == 0, "load_tile: the swizzle repeats every 8 rows");
  constexpr int kPasses = ROWS / kStep;
  const int r = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
  const int col = c * 8;
  const int64_t left = n - r0 - r;  // this thread's rows it * kStep < left exist
  const T* src = x + (r0 + r) * rs + col;
  T* d = dst + r * LDS + (SW ? ((c & ~7) + ((c & 7) ^ (r & 7))) * 8 : col);
#pragma unroll
  for (int it = 0; it < kPasses; ++it) {
    const bool ok = it * kStep < left;
    cp_async16(d + it * kStep * LDS, ok ? src + it * kStep * rs : x, ok);
  }
}

// C[16 MT x 64] (+)= A[16 MT x D] B^T, A rows at `a` (row stride LDS, the warp's 16 MT rows),
// B rows (64 of them, [n][k] storage) at `bm`: the S = Q K^T shape. Each B fragment loaded
// from shared memory feeds MT products.
template <typename T, int D, bool SW, int MT, int NK = kBK>
__device__ __forceinline__ void mma_abt_m(float (&c)[MT][NK / 8][4], const T* a, const T* bm, int lane) {
  if constexpr (SW) {
    constexpr uint32_t RB = 2 * D;  // row bytes
    const uint32_t ab = lane_base<D>(a, lane & 15, lane >> 4);
    const uint32_t bb = lane_base<D>(bm, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4_x<false>(af[mt], ab, chunk_x(2 * kc), mt * 16 * RB + chunk_off(2 * kc));
#pragma unroll
      for (int np = 0; np < NK / 16; ++np) {
        uint32_t bf[4];
        ldsm_x4_x<false>(bf, bb, chunk_x(2 * kc), np * 16 * RB + chunk_off(2 * kc));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(c[mt][2 * np], af[mt], bf[0], bf[1]);
          mma16816<T>(c[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  } else {
    constexpr int LDS = mma_lds<D, false>();
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4(af[mt], a + (mt * 16 + (lane & 15)) * LDS + kc * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < NK / 16; ++np) {
        uint32_t bf[4];
        ldsm_x4(bf, bm + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kc * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(c[mt][2 * np], af[mt], bf[0], bf[1]);
          mma16816<T>(c[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  }
}

// O[16 MT x D] += P[16 MT x 64] V, P given as C fragments (converted to A fragments here), V
// rows (64 of them, [k][n] storage) at `vm`: the P V shape.
template <typename T, int D, bool SW, int MT, int NK = kBK>
__device__ __forceinline__ void mma_pv_m(float (&o)[MT][D / 8][4], const float (&p)[MT][NK / 8][4], const T* vm,
                                         int lane) {
  constexpr int LDS = mma_lds<D, SW>();
  constexpr uint32_t RB = 2 * LDS;  // row bytes
  const uint32_t vb = SW ? lane_base<D>(vm, (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4) : 0u;
#pragma unroll
  for (int kk = 0; kk < NK / 16; ++kk) {
    uint32_t pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      pa[mt][0] = pack2<T>(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      pa[mt][1] = pack2<T>(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      pa[mt][2] = pack2<T>(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      pa[mt][3] = pack2<T>(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t bf[4];
      if constexpr (SW)
        ldsm_x4_x<true>(bf, vb, chunk_x(2 * dp), kk * 16 * RB + chunk_off(2 * dp));
      else
        ldsm_x4_t(bf, vm + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dp * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<T>(o[mt][2 * dp], pa[mt], bf[0], bf[1]);
        mma16816<T>(o[mt][2 * dp + 1], pa[mt], bf[2], bf[3]);
      }
    }
  }
}

template <typename T, int D, bool SW>
__device__ __forceinline__ void mma_abt(float (&c)[8][4], const T* a, const T* bm, int lane) {
  mma_abt_m<T, D, SW, 1>(*reinterpret_cast<float(*)[1][8][4]>(&c), a, bm, lane);
}
template <typename T, int D, bool SW>
__device__ __forceinline__ void mma_pv(float (&o)[D / 8][4], const float (&p)[8][4], const T* vm, int lane) {
  mma_pv_m<T, D, SW, 1>(*reinterpret_cast<float(*)[1][D / 8][4]>(&o), *reinterpret_cast<const float(*)[1][8][4]>(&p),
                    vm, lane);
}

// The A fragments of S = A B^T for the warp's 16 rows at `a` (all D / 16 k-chunks), to hold in
// registers across a loop whose A operand does not change (dkdv: K, V; dq: Q, dO).
template <typename T, int D, bool SW>
__device__ __forceinline__ void load_afrag(uint32_t (&af)[D / 16][4], const T* a, int lane) {
  if constexpr (SW) {
    const uint32_t ab = lane_base<D>(a, lane & 15, lane >> 4);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) ldsm_x4_x<false>(af[kc], ab, chunk_x(2 * kc), chunk_off(2 * kc));
  } else {
    constexpr int LDS = mma_lds<D, false>();
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) ldsm_x4(af[kc], a + (lane & 15) * LDS + kc * 16 + (lane >> 4) * 8);
  }
}
// mma_abt (C[16 x 64] (+)= A B^T) with the A fragments from registers when REG (af as
// load_afrag left them; `a` unused), else from shared memory at `a` (af unused): REG saves one
// of the five ldmatrix of each k-chunk.
template <bool REG, typename T, int D, bool SW>
__device__ __forceinline__ void mma_abt_x(float (&c)[8][4], const uint32_t (&af)[REG ? D / 16 : 1][4], const T* a,
                                          const T* bm, int lane) {
  if constexpr (REG) {
    constexpr int LDS = mma_lds<D, SW>();
    constexpr uint32_t RB = 2 * LDS;  // row bytes
    const uint32_t bb = SW ? lane_base<D>(bm, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1) : 0u;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bf[4];
        if constexpr (SW)
          ldsm_x4_x<false>(bf, bb, chunk_x(2 * kc), np * 16 * RB + chunk_off(2 * kc));
        else
          ldsm_x4(bf, bm + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kc * 16 + ((lane >> 3) & 1) * 8);
        mma16816<T>(c[2 * np], af[kc], bf[0], bf[1]);
        mma16816<T>(c[2 * np + 1], af[kc], bf[2], bf[3]);
      }
    }
  } else {
    mma_abt<T, D, SW>(c, a, bm, lane);
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}

// Does the (query tile q0, key tile k0) block need per-element masking for the mask kind or
// the sequence end? (rows: the query rows [q0, q0 + rows) the caller masks.) The key mask is
// handled by each kernel from its bits (kept keys of the tile), not here.
__device__ __forceinline__ bool tile_needs_mask(const AttnArgs& a, int64_t q0, int64_t k0, int64_t rows = kBQ,
                                                int64_t cols = kBK) {
  if (k0 + cols > a.Sk) return true;
  if (a.kind >= 1 && k0 + cols - 1 > q0 + a.off) return true;
  if (a.kind == 2 && k0 < q0 + rows - 1 + a.off - a.window) return true;
  return false;
}

// Key tiles [kbeg, kend) (kbeg a multiple of kBK) that query rows [q0, q_last] can see. (Host too:
// the launcher's model of the persistent grid's balance, attn_ws_zig.)
__host__ __device__ __forceinline__ void key_range(const AttnArgs& a, int64_t q0, int64_t q_last, int64_t* kbeg,
                                                   int64_t* kend, int64_t tile = kBK) {
  int64_t e = a.Sk, s = 0;
  if (a.kind != 0) e = min(a.Sk, q_last + a.off + 1);
  if (a.kind == 2) s = max(int64_t(0), q0 + a.off - a.window);
  *kbeg = s / tile * tile;
  *kend = e;
}

// ---- forward ---------------------------------------------------------------------------------
// Forward block (or persistent-grid tile) index t -> query tile qt and row bh = b * H + h of the
// [B * H] heads. The tiles are numbered in chunks of hc consecutive heads (hc * nqt tiles each,
// the last chunk may hold fewer heads); inside a chunk the query tile is the slow index, heaviest
// (causal: the last query tiles see the most keys) first across the chunk's heads, so the hardware
// block scheduler (or the persistent grid's stride) starts the longest tiles first and ends on the
// shortest (longest-processing-time-first), while the heads in flight stay few enough that their
// K / V stay in L2. The launchers use hc = 1 (one head's tiles after another's, heaviest first).
// (Host too: the launcher's model of the persistent grid's balance, attn_ws_zig.)
__host__ __device__ __forceinline__ void fwd_tile(int64_t t, int64_t nqt, int64_t nbh, int64_t hc, int64_t* qt,
                                                  int64_t* bh) {
  const int64_t per = hc * nqt;
  const int64_t c = t / per, i = t - c * per;
  const int64_t n = hc < nbh - c * hc ? hc : nbh - c * hc;  // heads in this chunk
  const int64_t j = i / n;
  *qt = nqt - 1 - j;
  *bh = c * hc + (i - j * n);
}

// Template: MT m-tiles of 16 rows per warp (block rows 16 MT * 4; warp w owns rows
// [16 MT w, 16 MT (w + 1))), NK keys per step. The launcher uses NK = 64 and MT = 1, except for
// the PLAIN D 64 kernel without a key mask: MT = 2 (measured faster there; see attention_launch_impl.cuh).
// STAGGER false: K and V double buffered (both tiles of step t + 1 load during step t).
// STAGGER true: one K and one V buffer (less shared memory: more blocks per SM); V of step t
// loads while S = Q K^T and the softmax run, K of step t + 1 while O += P V runs.
// MINB: minimum blocks per SM for __launch_bounds__ (caps the registers; 1: no cap).
// MASK: a key mask is given (a.mask != nullptr): per key tile, mask bits and a skip of tiles
// with no kept key; false compiles all of that out.
// PLAIN: no softcap, no bias and scale > 0 (the launcher's test): scores stay raw until the row
// max, which is scaled once (c2 > 0 keeps the order); p = ex2(fma(s, c2, -mu)).
// Scores are carried in log2 units: m (row max) and the exponents are log2-scaled; lse is
// converted back (ln) at the end.

template <typename T, int D, int MT, int NK, bool STAGGER, int MINB, bool MASK, bool PLAIN>
__global__ void __launch_bounds__(kMmaThreads, MINB)
    mma_fwd_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ lse, int hc) {
#if RLX_ATTN_MMA
  static_assert(NK % 32 == 0, "NK: whole mask words");
  constexpr bool SW = fwd_swizzle(D, MASK);
  constexpr int LDS = mma_lds<D, SW>();
  constexpr int kFwdBQ = 16 * MT * (kMmaThreads / 32);
  constexpr int NBUF = STAGGER ? 1 : 2;
  constexpr int W = NK / 32;
  extern __shared__ __align__(128) uint4 smem_u4[];
  T* Qs = reinterpret_cast<T*>(smem_u4);
  T* Ks = Qs + kFwdBQ * LDS;  // [NBUF][NK * LDS]
  T* Vs = Ks + NBUF * NK * LDS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int64_t nqt = (a.Sq + kFwdBQ - 1) / kFwdBQ;
  int64_t qt, blk;
  fwd_tile(blockIdx.x, nqt, a.B * a.H, hc, &qt, &blk);  // heaviest (causal) tiles first
  const int64_t h = blk % a.H, b = blk / a.H, hk = h / a.group;
  const int64_t q0 = qt * kFwdBQ;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  const T* qb = q + (b * a.Sq * a.H + h) * D;
  const T* kb = k + (b * a.Sk * a.Hkv + hk) * D;
  const T* vb = v + (b * a.Sk * a.Hkv + hk) * D;
  const float* mrow = MASK ? a.mask + b * a.Sk : nullptr;
  int64_t kbeg, kend;
  key_range(a, q0, min(a.Sq - 1, q0 + kFwdBQ - 1), &kbeg, &kend, NK);
#pragma unroll
  for (int part = 0; part < MT; ++part) load_tile<T, D, SW, 64>(Qs + part * 64 * LDS, qb, q_rs, q0 + part * 64, a.Sq);
  if (kbeg < kend) {
    load_tile<T, D, SW, NK>(Ks, kb, kv_rs, kbeg, a.Sk);
    if (!STAGGER) load_tile<T, D, SW, NK>(Vs, vb, kv_rs, kbeg, a.Sk);
  }
  cp_async_commit();
  float mv[MASK ? W : 1];
  if constexpr (MASK) {
    if (kbeg < kend) mask_load(mv, mrow, kbeg, a.Sk, lane);
  }
  const int64_t wrow0 = q0 + warp * 16 * MT;  // this warp's rows; thread rows wrow0 + 16 mt + 8 r + g
  const float c2 = a.scale * kLog2e;          // raw score -> log2 units (no softcap)
  const float cap2 = a.softcap * kLog2e;
  const float inv_cap = a.softcap > 0.f ? 1.f / a.softcap : 0.f;
  const float sc_cap = a.scale * inv_cap;  // raw score -> tanh argument
  float m[MT][2], l[MT][2];
  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
    zero(o[mt]);
  }
  int buf = 0;
  for (int64_t k0 = kbeg; k0 < kend; k0 += NK) {
    cp_async_wait_all();
    __syncthreads();
    // MASK false (no key mask): no bits, no skipping; the compiler sees constants
    uint32_t bits[MASK ? W : 1];
    bool all_on = true, none = false;
    if constexpr (MASK) {
      mask_bits(bits, mv, &all_on, &none);
      if (k0 + NK < kend) mask_load(mv, mrow, k0 + NK, a.Sk, lane);
    }
    if constexpr (STAGGER) {
      if (!none) load_tile<T, D, SW, NK>(Vs, vb, kv_rs, k0, a.Sk);
    } else if (k0 + NK < kend) {
      load_tile<T, D, SW, NK>(Ks + (buf ^ 1) * NK * LDS, kb, kv_rs, k0 + NK, a.Sk);
      load_tile<T, D, SW, NK>(Vs + (buf ^ 1) * NK * LDS, vb, kv_rs, k0 + NK, a.Sk);
    }
    cp_async_commit();
    float s[MT][NK / 8][4];
    if (!none) {  // block-uniform: no kept key in this tile, nothing to add
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) zero(s[mt]);
      mma_abt_m<T, D, SW, MT, NK>(s, Qs + warp * 16 * MT * LDS, Ks + buf * NK * LDS, lane);
      const bool kneed = tile_needs_mask(a, wrow0, k0, 16 * MT, NK);
      const bool need = kneed || !all_on;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx[2] = {-INFINITY, -INFINITY};
        // PLAIN (launched only for scale > 0): scores stay raw, the max is taken raw and scaled
        // once (c2 > 0 keeps the order), p = ex2(fma(s, c2, -mu)): max + fma + ex2 per score.
        if (PLAIN && !need) {  // warp-uniform: no masking in this tile
#pragma unroll
          for (int nt = 0; nt < NK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][nt][e]);
        } else if (PLAIN) {  // masked tile without softcap / bias
#pragma unroll
          for (int nt = 0; nt < NK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int jl = nt * 8 + 2 * tq + (e & 1);
              const int64_t i = wrow0 + mt * 16 + (e >> 1) * 8 + g, j = k0 + jl;
              bool vis;
              if constexpr (MASK)
                vis = ((bits[nt >> 2] >> (jl & 31)) & 1u) &&
                      (!kneed || (i < a.Sq && j < a.Sk && kind_visible(a, i, j)));
              else
                vis = i < a.Sq && j < a.Sk && kind_visible(a, i, j);
              const float x = vis ? s[mt][nt][e] : -INFINITY;
              s[mt][nt][e] = x;
              mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        } else if (!need && bias == nullptr && a.softcap > 0.f) {  // unmasked tile, softcap only
#pragma unroll
          for (int nt = 0; nt < NK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float x = cap2 * tanhf(s[mt][nt][e] * sc_cap);
              s[mt][nt][e] = x;
              mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        } else {
#pragma unroll
        for (int nt = 0; nt < NK / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int jl = nt * 8 + 2 * tq + (e & 1);
            const int64_t i = wrow0 + mt * 16 + (e >> 1) * 8 + g, j = k0 + jl;
            bool vis = true;
            if constexpr (MASK) {
              if (need)
                vis = ((bits[nt >> 2] >> (jl & 31)) & 1u) &&
                      (!kneed || (i < a.Sq && j < a.Sk && kind_visible(a, i, j)));
            } else {
              if (need) vis = i < a.Sq && j < a.Sk && kind_visible(a, i, j);
            }
            float x;
            if (!vis) {
              x = -INFINITY;
            } else {
              x = a.softcap > 0.f ? cap2 * tanhf(s[mt][nt][e] * a.scale * inv_cap) : s[mt][nt][e] * c2;
              if (bias != nullptr && i < a.Sq) x = fmaf(to_f32(bias[((b * a.H + h) * a.Sq + i) * a.Sk + j]), kLog2e, x);
            }
            s[mt][nt][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
          }
        }
        float mu[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (PLAIN) mx[r] *= c2;  // raw max -> log2 units
          // fmaxf drops NaN scores from the max, but such a score still gives p = ex2(NaN) =
          // NaN below, so l, the output row and lse come out NaN (the CPU kernel's result).
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          const float mn = fmaxf(m[mt][r], mx[r]);
          mu[r] = mn == -INFINITY ? 0.f : mn;
          alpha[r] = ex2(m[mt][r] - mu[r]);
          m[mt][r] = mn;
        }
        float ls[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < NK / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float p = PLAIN ? ex2(fmaf(s[mt][nt][e], c2, -mu[e >> 1])) : ex2(s[mt][nt][e] - mu[e >> 1]);
            s[mt][nt][e] = p;
            ls[e >> 1] += p;
          }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[mt][r] = l[mt][r] * alpha[r] + ls[r];
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
          o[mt][nt][0] *= alpha[0];
          o[mt][nt][1] *= alpha[0];
          o[mt][nt][2] *= alpha[1];
          o[mt][nt][3] *= alpha[1];
        }
      }
    }
    if constexpr (STAGGER) {
      cp_async_wait_all();  // V of this step
      __syncthreads();      // and every warp is done reading K
      if (k0 + NK < kend) load_tile<T, D, SW, NK>(Ks, kb, kv_rs, k0 + NK, a.Sk);
      cp_async_commit();
    }
    if (!none) mma_pv_m<T, D, SW, MT, NK>(o, s, Vs + buf * NK * LDS, lane);
    if constexpr (!STAGGER) buf ^= 1;
  }
  cp_async_wait_all();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[mt][r];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int64_t i = wrow0 + mt * 16 + r * 8 + g;
      if (i >= a.Sq) continue;
      float inv, row_lse;
      row_finish(m[mt][r] * kLn2, lr, row_sink(a, b, h), &inv, &row_lse);
      T* orow = out + ((b * a.Sq + i) * a.H + h) * D;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        *reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * tq) =
            pack2<T>(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv);
      if (tq == 0) lse[(b * a.H + h) * a.Sq + i] = row_lse;
    }
#endif
}

// ---- backward: dk, dv (and dbias) ------------------------------------------------------------
// dK (times the score scale) and dV of a thread's two key rows j0 and j0 + 8 (the C fragments of the
// m16n8 / m64nD products: columns 8 nt + 2 tq (+ 1)) into dk / dv [B, Sk, Hkv, D] as T; kv_b = (b Sk)
// Hkv + hk, the (batch, kv head)'s first row. Rows at or past Sk are not written. J: the row index
// type of the caller (int: the key rows are summed in 32 bits, as the wgmma kernels always did).
template <typename T, int D, typename J>
__device__ __forceinline__ void store_dk_dv(const AttnArgs& a, const float (&dka)[D / 8][4],
                                            const float (&dva)[D / 8][4], T* __restrict__ dk, T* __restrict__ dv,
                                            int64_t kv_b, J j0, int tq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = j0 + 8 * r;
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
}

// MASK: a key mask is given (a.mask != nullptr); false compiles the key-mask logic out.
// AR: how many of the warp's loop-invariant A operands stay in registers (0: none, K and V
// read from shared memory in every step; 1: K; 2: K and V), loaded once before the loop.
template <typename T, int D, bool MASK, bool PLAIN, int AR = 0>
__global__ void __launch_bounds__(kMmaThreads)
    mma_dkdv_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                    const T* __restrict__ bias, T* __restrict__ dk, T* __restrict__ dv, T* __restrict__ dbias) {
#if RLX_ATTN_MMA
  constexpr bool SW = bwd_swizzle(D);
  constexpr int LDS = mma_lds<D, SW>();
  extern __shared__ __align__(128) uint4 smem_u4[];
  T* Ks = reinterpret_cast<T*>(smem_u4);
  T* Vs = Ks + kBK * LDS;
  T* Qs = Vs + kBK * LDS;   // [2][kBQ * LDS]
  T* Gs = Qs + 2 * kBQ * LDS;  // dout, [2][kBQ * LDS]
  float* Ls = reinterpret_cast<float*>(Gs + 2 * kBQ * LDS);  // [2][kBQ]
  float* Dl = Ls + 2 * kBQ;                                  // [2][kBQ]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int64_t nkt = (a.Sk + kBK - 1) / kBK;
  int64_t blk = blockIdx.x;
  const int64_t kt = blk % nkt;
  blk /= nkt;
  const int64_t hk = blk % a.Hkv, b = blk / a.Hkv;
  const int64_t k0 = kt * kBK;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  const int64_t j_row0 = k0 + warp * 16 + g;  // this thread's keys: j_row0, j_row0 + 8
  const float c2 = a.scale * kLog2e;           // raw score -> log2 units (PLAIN)
  const float cap2 = a.softcap * kLog2e, sc_cap = a.softcap > 0.f ? a.scale / a.softcap : 0.f;
  bool kok[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = j_row0 + 8 * r;
    kok[r] = j < a.Sk && (!MASK || a.mask[b * a.Sk + j] >= 0.5f);
  }
  // Keys of this warp all kept (no per-element key masking) / none kept (nothing to add).
  // Without a key mask the tile test (partial last tile) covers both.
  bool w_all = true, w_skip = false;
  if constexpr (MASK) {
    w_all = __all_sync(0xffffffffu, kok[0] && kok[1]);
    w_skip = !__any_sync(0xffffffffu, kok[0] || kok[1]) && dbias == nullptr;
  }
  if (MASK && dbias == nullptr && !__syncthreads_or(kok[0] || kok[1])) {
    // no key of this tile is kept: dk = dv = 0, nothing to load
    const int64_t kv_b = (b * a.Sk) * a.Hkv + hk;
    for (int c = threadIdx.x; c < kBK * (D / 8); c += kMmaThreads) {
      const int64_t j = k0 + c / (D / 8);
      if (j >= a.Sk) continue;
      const uint4 z = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(dk + (kv_b + j * a.Hkv) * D + (c % (D / 8)) * 8) = z;
      *reinterpret_cast<uint4*>(dv + (kv_b + j * a.Hkv) * D + (c % (D / 8)) * 8) = z;
    }
    return;
  }
  load_tile<T, D, SW>(Ks, k + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  load_tile<T, D, SW>(Vs, v + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  // query tiles that see these keys (all of them when dbias must be written everywhere)
  int64_t qbeg = 0, qend = a.Sq;
  if (dbias == nullptr) {
    if (a.kind != 0) qbeg = max(int64_t(0), k0 - a.off);
    if (a.kind == 2) qend = min(a.Sq, min(a.Sk, k0 + kBK) - 1 + a.window - a.off + 1);
  }
  qbeg = qbeg / kBQ * kBQ;
  const int64_t nq = qend > qbeg ? (qend - qbeg + kBQ - 1) / kBQ : 0;
  const int64_t iters = nq * a.group;
  auto stage = [&](int64_t it, int bf) {
    const int64_t h = hk * a.group + it / nq, i0 = qbeg + (it % nq) * kBQ;
    load_tile<T, D, SW>(Qs + bf * kBQ * LDS, q + (b * a.Sq * a.H + h) * D, q_rs, i0, a.Sq);
    load_tile<T, D, SW>(Gs + bf * kBQ * LDS, dout + (b * a.Sq * a.H + h) * D, q_rs, i0, a.Sq);
    if (threadIdx.x < kBQ) {
      const int64_t i = i0 + threadIdx.x;
      float L = INFINITY, dl = 0.f;
      if (i < a.Sq) {
        L = lse[(b * a.H + h) * a.Sq + i];
        if (L == -INFINITY) L = INFINITY;  // dead row: P = 0
        dl = delta[(b * a.H + h) * a.Sq + i];
      }
      Ls[bf * kBQ + threadIdx.x] = L * kLog2e;  // log2 units
      Dl[bf * kBQ + threadIdx.x] = dl;
    }
  };
  if (iters > 0) stage(0, 0);
  cp_async_commit();
  uint32_t kf[AR >= 1 ? D / 16 : 1][4], vf[AR >= 2 ? D / 16 : 1][4];
  if constexpr (AR >= 1) {
    cp_async_wait_all();
    __syncthreads();
    load_afrag<T, D, SW>(kf, Ks + warp * 16 * LDS, lane);
    if constexpr (AR >= 2) load_afrag<T, D, SW>(vf, Vs + warp * 16 * LDS, lane);
  }
  float dka[D / 8][4], dva[D / 8][4];
  zero(dka);
  zero(dva);
  int buf = 0;
  for (int64_t it = 0; it < iters; ++it, buf ^= 1) {
    const int64_t h = hk * a.group + it / nq, i0 = qbeg + (it % nq) * kBQ;
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < iters) stage(it + 1, buf ^ 1);
    cp_async_commit();
    const T* Qb = Qs + buf * kBQ * LDS;
    const T* Gb = Gs + buf * kBQ * LDS;
    const float* Lb = Ls + buf * kBQ;
    const float* Db = Dl + buf * kBQ;
    if constexpr (MASK) {
      if (w_skip) continue;  // warp-uniform; the block's syncs are at the loop top only
    }
    float st[8][4], dpt[8][4];
    zero(st);
    zero(dpt);
    mma_abt_x<(AR >= 1), T, D, SW>(st, kf, Ks + warp * 16 * LDS, Qb, lane);
    mma_abt_x<(AR >= 2), T, D, SW>(dpt, vf, Vs + warp * 16 * LDS, Gb, lane);
    const bool tneed = tile_needs_mask(a, i0, k0);
    const bool need = (MASK && !w_all) || tneed;
    if (PLAIN && !need) {  // warp-uniform: no masking, no softcap, no bias
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ic = nt * 8 + 2 * tq + (e & 1);
          const float p = ex2(fmaf(st[nt][e], c2, -Lb[ic]));
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - Db[ic]);
        }
    } else if (PLAIN) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int ic = nt * 8 + 2 * tq + (e & 1);
          const int64_t i = i0 + ic, j = j_row0 + 8 * r;
          // tile inside the sequences and the mask kind: only the key mask (kok) hides scores
          const bool vis = kok[r] && (!tneed || (i < a.Sq && kind_visible(a, i, j)));
          const float p = vis ? ex2(fmaf(st[nt][e], c2, -Lb[ic])) : 0.f;
          st[nt][e] = p;
          dpt[nt][e] = vis ? p * (dpt[nt][e] - Db[ic]) : 0.f;
        }
    } else if (!need && bias == nullptr && a.softcap > 0.f) {  // unmasked tile, softcap only
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ic = nt * 8 + 2 * tq + (e & 1);
          const float th = tanhf(st[nt][e] * sc_cap);
          const float p = ex2(fmaf(th, cap2, -Lb[ic]));
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - Db[ic]) * (1.f - th * th);
        }
    } else {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int ic = nt * 8 + 2 * tq + (e & 1);
        const int64_t i = i0 + ic, j = j_row0 + 8 * r;
        float th;
        float x = cap_score(st[nt][e] * a.scale, a.softcap, &th);
        bool vis = true;
        if (need) vis = kok[r] && i < a.Sq && kind_visible(a, i, j);
        float p = 0.f, ds = 0.f;
        if (vis) {
          if (bias != nullptr && i < a.Sq && j < a.Sk) x += to_f32(bias[((b * a.H + h) * a.Sq + i) * a.Sk + j]);
          p = ex2(fmaf(x, kLog2e, -Lb[ic]));
          ds = p * (dpt[nt][e] - Db[ic]);
        }
        if (dbias != nullptr && i < a.Sq && j < a.Sk) dbias[((b * a.H + h) * a.Sq + i) * a.Sk + j] = from_f32<T>(ds);
        st[nt][e] = p;
        dpt[nt][e] = a.softcap > 0.f ? ds * (1.f - th * th) : ds;
      }
    }
    mma_pv<T, D, SW>(dva, st, Gb, lane);
    mma_pv<T, D, SW>(dka, dpt, Qb, lane);
  }
  cp_async_wait_all();
  store_dk_dv<T, D>(a, dka, dva, dk, dv, (b * a.Sk) * a.Hkv + hk, j_row0, tq);
#endif
}

// ---- backward: dq ----------------------------------------------------------------------------
// MASK: as mma_dkdv_kernel. AR: as mma_dkdv_kernel, for Q (1) and Q and dO (2). D 64 with AR > 0
// asks for 3 blocks per SM (168 registers, as the AR = 0 kernels reach without a cap); AR = 0
// keeps minBlocks 0 (no .minnctapersm): with minBlocks 1 ptxas (nvcc 13, sm_90) gave the D 64
// AR = 0 kernels 212 / 234 registers instead of 168, i.e. 2 blocks per SM.
template <typename T, int D, bool MASK, bool PLAIN, int AR = 0>
__global__ void __launch_bounds__(kMmaThreads, (D == 64 && AR > 0) ? 3 : 0)
    mma_dq_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                  const T* __restrict__ bias, T* __restrict__ dq) {
#if RLX_ATTN_MMA
  constexpr bool SW = bwd_swizzle(D);
  constexpr int LDS = mma_lds<D, SW>();
  extern __shared__ __align__(128) uint4 smem_u4[];
  T* Qs = reinterpret_cast<T*>(smem_u4);
  T* Gs = Qs + kBQ * LDS;
  T* Ks = Gs + kBQ * LDS;  // [2][kBK * LDS]
  T* Vs = Ks + 2 * kBK * LDS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int64_t nqt = (a.Sq + kBQ - 1) / kBQ;
  int64_t blk = blockIdx.x;
  const int64_t qt = nqt - 1 - blk % nqt;
  blk /= nqt;
  const int64_t h = blk % a.H, b = blk / a.H, hk = h / a.group;
  const int64_t q0 = qt * kBQ;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  const T* kb = k + (b * a.Sk * a.Hkv + hk) * D;
  const T* vb = v + (b * a.Sk * a.Hkv + hk) * D;
  int64_t kbeg, kend;
  key_range(a, q0, min(a.Sq - 1, q0 + kBQ - 1), &kbeg, &kend);
  load_tile<T, D, SW>(Qs, q + (b * a.Sq * a.H + h) * D, q_rs, q0, a.Sq);
  load_tile<T, D, SW>(Gs, dout + (b * a.Sq * a.H + h) * D, q_rs, q0, a.Sq);
  if (kbeg < kend) {
    load_tile<T, D, SW>(Ks, kb, kv_rs, kbeg, a.Sk);
    load_tile<T, D, SW>(Vs, vb, kv_rs, kbeg, a.Sk);
  }
  cp_async_commit();
  const float* mrow = MASK ? a.mask + b * a.Sk : nullptr;
  float mv[MASK ? kBK / 32 : 1];
  if constexpr (MASK) {
    if (kbeg < kend) mask_load(mv, mrow, kbeg, a.Sk, lane);
  }
  uint32_t qf[AR >= 1 ? D / 16 : 1][4], gf[AR >= 2 ? D / 16 : 1][4];
  if constexpr (AR >= 1) {
    cp_async_wait_all();
    __syncthreads();
    load_afrag<T, D, SW>(qf, Qs + warp * 16 * LDS, lane);
    if constexpr (AR >= 2) load_afrag<T, D, SW>(gf, Gs + warp * 16 * LDS, lane);
  }
  const int64_t row0 = q0 + warp * 16 + g;
  const float c2 = a.scale * kLog2e;  // raw score -> log2 units (PLAIN)
  const float cap2 = a.softcap * kLog2e, sc_cap = a.softcap > 0.f ? a.scale / a.softcap : 0.f;
  float L[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = row0 + 8 * r;
    L[r] = INFINITY;
    dl[r] = 0.f;
    if (i < a.Sq) {
      L[r] = lse[(b * a.H + h) * a.Sq + i];
      if (L[r] == -INFINITY) L[r] = INFINITY;
      dl[r] = delta[(b * a.H + h) * a.Sq + i];
    }
    L[r] *= kLog2e;  // log2 units
  }
  float dqa[D / 8][4];
  zero(dqa);
  int buf = 0;
  for (int64_t k0 = kbeg; k0 < kend; k0 += kBK, buf ^= 1) {
    cp_async_wait_all();
    __syncthreads();
    uint32_t bits[MASK ? kBK / 32 : 1];
    bool all_on = true, none = false;
    if constexpr (MASK) {
      mask_bits(bits, mv, &all_on, &none);
      if (k0 + kBK < kend) mask_load(mv, mrow, k0 + kBK, a.Sk, lane);
    }
    if (k0 + kBK < kend) {
      load_tile<T, D, SW>(Ks + (buf ^ 1) * kBK * LDS, kb, kv_rs, k0 + kBK, a.Sk);
      load_tile<T, D, SW>(Vs + (buf ^ 1) * kBK * LDS, vb, kv_rs, k0 + kBK, a.Sk);
    }
    cp_async_commit();
    if (none) continue;  // block-uniform: no kept key in this tile
    const T* Kb = Ks + buf * kBK * LDS;
    const T* Vb = Vs + buf * kBK * LDS;
    float s[8][4], dp[8][4];
    zero(s);
    zero(dp);
    mma_abt_x<(AR >= 1), T, D, SW>(s, qf, Qs + warp * 16 * LDS, Kb, lane);
    mma_abt_x<(AR >= 2), T, D, SW>(dp, gf, Gs + warp * 16 * LDS, Vb, lane);
    const bool kneed = tile_needs_mask(a, q0, k0);
    const bool need = kneed || !all_on;
    if (PLAIN && !need) {  // block-uniform: no masking, no softcap, no bias
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float p = ex2(fmaf(s[nt][e], c2, -L[r]));
          s[nt][e] = p * (dp[nt][e] - dl[r]);
        }
    } else if (PLAIN) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int jl = nt * 8 + 2 * tq + (e & 1);
          const int64_t i = row0 + 8 * r, j = k0 + jl;
          bool vis;
          if constexpr (MASK)
            vis = ((bits[nt >> 2] >> (jl & 31)) & 1u) && (!kneed || (i < a.Sq && j < a.Sk && kind_visible(a, i, j)));
          else
            vis = i < a.Sq && j < a.Sk && kind_visible(a, i, j);
          const float p = vis ? ex2(fmaf(s[nt][e], c2, -L[r])) : 0.f;
          s[nt][e] = vis ? p * (dp[nt][e] - dl[r]) : 0.f;
        }
    } else if (!need && bias == nullptr && a.softcap > 0.f) {  // unmasked tile, softcap only
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float th = tanhf(s[nt][e] * sc_cap);
          const float p = ex2(fmaf(th, cap2, -L[r]));
          s[nt][e] = p * (dp[nt][e] - dl[r]) * (1.f - th * th);
        }
    } else {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int jl = nt * 8 + 2 * tq + (e & 1);
        const int64_t i = row0 + 8 * r, j = k0 + jl;
        float th;
        float x = cap_score(s[nt][e] * a.scale, a.softcap, &th);
        float ds = 0.f;
        bool vis = true;
        if constexpr (MASK) {
          if (need)
            vis = ((bits[nt >> 2] >> (jl & 31)) & 1u) && (!kneed || (i < a.Sq && j < a.Sk && kind_visible(a, i, j)));
        } else {
          if (need) vis = i < a.Sq && j < a.Sk && kind_visible(a, i, j);
        }
        if (vis) {
          if (bias != nullptr && i < a.Sq) x += to_f32(bias[((b * a.H + h) * a.Sq + i) * a.Sk + j]);
          const float p = ex2(fmaf(x, kLog2e, -L[r]));
          ds = p * (dp[nt][e] - dl[r]);
        }
        s[nt][e] = a.softcap > 0.f ? ds * (1.f - th * th) : ds;
      }
    }
    mma_pv<T, D, SW>(dqa, s, Kb, lane);
  }
  cp_async_wait_all();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = row0 + 8 * r;
    if (i >= a.Sq) continue;
    T* dqr = dq + ((b * a.Sq + i) * a.H + h) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
      *reinterpret_cast<uint32_t*>(dqr + nt * 8 + 2 * tq) =
          pack2<T>(dqa[nt][2 * r] * a.scale, dqa[nt][2 * r + 1] * a.scale);
  }
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
