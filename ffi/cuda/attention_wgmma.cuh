// Hopper warpgroup MMA (wgmma, sm_90a only) building blocks of the attention kernels
// (attention_wgmma_ws.cuh, attention_wgmma_bwd.cuh, attention_fused_bwd*.cuh): the probe that tells
// whether the loaded image carries sm_90a code, shared-memory descriptors, fences, the m64nNk16
// products (A from shared memory or registers), online-softmax steps and the tile loader.
//
// Shared tiles are in the canonical 128-byte-swizzle K-major layout of wgmma: a tile of R rows x D
// columns is stored as D / 64 column halves [R][64] (128-byte rows), the 16-byte chunk c of row r at
// chunk position c ^ (r & 7), 8-row atoms of 1024 bytes (1024-byte aligned: the hardware swizzle
// acts on address bits 4-6 with bits 7-9). Filled with cp.async (16 bytes, zero-filled past the
// sequence end), then fence.proxy.async before the barrier so the async proxy (wgmma) sees the
// data. The k-step of a K-major operand advances the start address by 32 bytes inside the 128-byte
// swizzle row (the hardware applies the XOR to the final address); an MN-major operand (V in
// O += P V) sets the transpose bit, its D / 64 column halves LBO apart. With A = P from registers
// (bf16 / f16), the C layout of two adjacent n8 blocks is the A fragment of one k16 step.
// Measured and dropped (H200; the code is in commit 2f89835): a forward of 2 (or 3) warpgroups
// without a producer / consumer split, 1.30x slower than the warp-specialised kernel at D 128 and
// no faster than mma.sync at D 64, and a software-pipelined variant of it.
#pragma once

#include <cstdint>

#include "cuda/attention_mma.cuh"
#include "cuda/attention_segments.cuh"

namespace rlx {
namespace cuda {
namespace attn {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RLX_ATTN_WGMMA 1
#else
#define RLX_ATTN_WGMMA 0
#endif

// Which image is loaded: the probe's static shared array is 2048 bytes in the sm_90a pass (the
// one with wgmma code) and 1024 bytes otherwise; the host reads it with cudaFuncGetAttributes
// (no launch, so it is safe during stream capture).
constexpr int kWgmmaProbeSmem = 2048;
static __global__ void wgmma_probe_kernel(int* out) {
#if RLX_ATTN_WGMMA
  __shared__ int marker[kWgmmaProbeSmem / 4];
#else
  __shared__ int marker[kWgmmaProbeSmem / 8];
#endif
  constexpr int n = int(sizeof(marker) / sizeof(int));
  for (int i = threadIdx.x; i < n; i += blockDim.x) marker[i] = i;
  __syncthreads();
  if (out != nullptr && threadIdx.x == 0) out[0] = marker[n - 1] + 1 == n ? (RLX_ATTN_WGMMA ? 1 : 0) : -1;
}

// Which scores a tile hides (warp-uniform; the forward's ws_softmax_tile and the backward's
// bwd_probs / bwd_dscores): none, those a positional test hides (sequence end, causal diagonal,
// window edge, and the key mask with them), or, on a tile no position mask crosses, those the key mask
// alone hides (a key-bit test: cheaper than the positional one).
enum TileHide : int { kHideNone = 0, kHidePos = 1, kHideKeys = 2 };

// The positional test as bits. A thread's scores of one fragment row sit in the columns
// 8 nt + 2 tq + e (e < 2) of the tile, bit 2 nt + e of a 32-bit word; the columns below b form a
// prefix of those bits, of 2 (x / 8) + min(x % 8, 2) bits for x = b - 2 tq (8 nt + e < x). The kernels
// build each row's word once per masked tile (the column ranges of its causal diagonal, window edge and
// sequence end, ANDed with the key mask's and the segment ids' bits) and then test one bit a score,
// instead of recomputing the range tests for every score: on packed documents a third of the
// forward's tiles are masked, and there the per-score tests were most of its instructions.
__device__ __forceinline__ uint32_t frag_cols_below(int64_t b, int tq) {
  const int64_t x = b - 2 * tq;
  if (x <= 0) return 0u;
  const int64_t n = 2 * (x >> 3) + ((x & 7) < 2 ? (x & 7) : 2);
  return n >= 32 ? ~0u : (1u << n) - 1u;
}

// wgmma shared-memory matrix descriptor: start address >> 4 (bits 0-13), leading-dimension byte
// offset >> 4 (16-29), stride-dimension byte offset >> 4 (32-45), base offset 0 (49-51: the
// atoms are 1024-byte aligned), swizzle mode 1 = 128 bytes (62-63).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr & 0x3FFFFu) >> 4) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wg_fence() {
#if RLX_ATTN_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if RLX_ATTN_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_wait0() {
#if RLX_ATTN_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}
// waits until at most N committed wgmma groups of this warpgroup are pending
template <int N>
__device__ __forceinline__ void wg_wait() {
#if RLX_ATTN_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// shared memory written through the generic proxy (cp.async, st.shared) -> visible to wgmma
__device__ __forceinline__ void fence_proxy_async() {
#if RLX_ATTN_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// One online-softmax max step per thread row r < 2 (rows g, g + 8 of the warp's 16): mx = the
// tile's raw row max of this thread's scores, taken to log2 units (c2 = scale log2 e > 0 keeps
// the order) and over the row's 4 threads; m = the running max (updated); mu = the exponent offset
// for this tile's P (0 while the row has seen only -inf); alpha = 2^(m_old - mu), the factor for
// O and l.
__device__ __forceinline__ void online_max_step(float (&mx)[2], float c2, float (&m)[2], float (&mu)[2],
                                                float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] *= c2;
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mn = fmaxf(m[r], mx[r]);
    mu[r] = mn == -INFINITY ? 0.f : mn;
    alpha[r] = ex2(m[r] - mu[r]);
    m[r] = mn;
  }
}
// O *= alpha per row of the online softmax: o[nt][0..1] belong to the thread's row g, o[nt][2..3]
// to row g + 8 (the m64 accumulator layout)
template <int N>
__device__ __forceinline__ void scale_rows(float (&o)[N][4], const float (&alpha)[2]) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt) {
    o[nt][0] *= alpha[0];
    o[nt][1] *= alpha[0];
    o[nt][2] *= alpha[1];
    o[nt][3] *= alpha[1];
  }
}
// keeps the compiler from moving accumulator reads / writes across the asynchronous MMA
template <int N>
__device__ __forceinline__ void wg_fence_regs(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// n8 block nt of a thread's f32 accumulator pair of rows (x[0..1]: row g, x[2..3]: row g + 8) as half of
// the A fragment of k-step nt / 2 (T = bf16 / f16): its registers (row g, row g + 8) of keys 2 tq..
// (nt even) or 2 tq + 8.. (nt odd)
template <typename T, int K>
__device__ __forceinline__ void pack_a_n8(uint32_t (&frag)[K][4], int nt, const float (&x)[4]) {
  frag[nt >> 1][(nt & 1) * 2 + 0] = pack2<T>(x[0], x[1]);
  frag[nt >> 1][(nt & 1) * 2 + 1] = pack2<T>(x[2], x[3]);
}

// keeps register A fragments live and unmoved until this point (after the wait that completes the
// wgmma reading them: the compiler does not know the MMA reads them asynchronously)
template <int N>
__device__ __forceinline__ void wg_fence_afrag(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

// D[64 x N] (+)= A B: ss = A and B from shared memory (descriptors, K-major, no transpose);
// rs = A from registers (the m16n8k16 A fragment of the warp's 16 rows), B from shared memory
// MN-major (transpose bit). scale_d 0: D = A B (the accumulator's old value ignored).
// The descriptors are da + aoff, db + boff (offsets in 16-byte units, added inside the asm
// statement: one base descriptor per operand stays in registers, not one per k-step).
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, uint64_t aoff, uint64_t boff,
                                         int scale_d);
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db, uint64_t boff,
                                         int scale_d);

template <>
__device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 64>(float (&d)[8][4], uint64_t da, uint64_t db, uint64_t aoff, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\n"
      "add.s64 da, %32, %34;\nadd.s64 db, %33, %35;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_ss<__half, 64>(float (&d)[8][4], uint64_t da, uint64_t db, uint64_t aoff, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\n"
      "add.s64 da, %32, %34;\nadd.s64 db, %33, %35;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 128>(float (&d)[16][4], uint64_t da, uint64_t db, uint64_t aoff, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %68, 0;\n"
      "add.s64 da, %64, %66;\nadd.s64 db, %65, %67;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_ss<__half, 128>(float (&d)[16][4], uint64_t da, uint64_t db, uint64_t aoff, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %68, 0;\n"
      "add.s64 da, %64, %66;\nadd.s64 db, %65, %67;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %38, 0;\n"
      "add.s64 db, %36, %37;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, db, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "l"(boff), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<__half, 64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %38, 0;\n"
      "add.s64 db, %36, %37;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, db, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "l"(boff), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %70, 0;\n"
      "add.s64 db, %68, %69;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "l"(boff), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<__half, 128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, uint64_t boff, int scale_d) {
#if RLX_ATTN_WGMMA
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %70, 0;\n"
      "add.s64 db, %68, %69;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "l"(boff), "r"(scale_d));
#endif
}

// Rows [r0, r0 + ROWS) of x (row r at x + r * rs, D elements) -> dst in the wgmma layout
// [D / 64][ROWS][64] (128-byte rows, chunk c of a row at c ^ (r & 7)); rows >= n zero-filled.
// NT threads: thread t copies chunk t % (D / 8) of rows t / (D / 8) + pass * (NT / (D / 8)); rows
// per pass are a multiple of 8, so the thread's swizzled position is the same in every pass.
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void wg_load_tile(T* dst, const T* __restrict__ x, int64_t rs, int64_t r0, int64_t n) {
  constexpr int kChunks = D / 8;
  static_assert(NT % kChunks == 0, "wg_load_tile: whole rows per pass");
  constexpr int kStep = NT / kChunks;
  static_assert(kStep % 8 == 0, "wg_load_tile: the swizzle repeats every 8 rows");
  constexpr int kPasses = (ROWS + kStep - 1) / kStep;
  const int r = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
  const int64_t left = n - r0 - r;  // this thread's rows it * kStep < left exist
  const T* src = x + (r0 + r) * rs + c * 8;
  T* d = dst + (c >> 3) * ROWS * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3);
#pragma unroll
  for (int it = 0; it < kPasses; ++it) {
    if (ROWS % kStep == 0 || r + it * kStep < ROWS) {
      const bool ok = it * kStep < left;
      cp_async16(d + it * kStep * 64, ok ? src + it * kStep * rs : x, ok);
    }
  }
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
