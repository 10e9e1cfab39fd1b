// Attention forward on Hopper warpgroup MMA (wgmma, sm_90a only), bf16 / f16, head dims 64 and
// 128, no key mask, no bias, no softcap, scale > 0, mask kind none or causal: the PLAIN cases of
// the mma.sync forward (attention_mma.cuh), which keeps every other case and is the fallback
// when the loaded image has no sm_90a code (wgmma_available, attention_launch_impl.cuh) or
// RLX_ATTENTION_CUDA_WGMMA=0.
//
// Block = NWG warpgroups (128 threads each) over 64 * NWG query rows; warpgroup w owns rows
// [64 w, 64 w + 64) of the tile, warp i of it 16 rows. Keys in tiles of BC rows, K and V double
// buffered. Shared tiles are in the canonical 128-byte-swizzle K-major layout of wgmma: a tile of
// R rows x D columns is stored as D / 64 column halves [R][64] (128-byte rows), the 16-byte
// chunk c of row r at chunk position c ^ (r & 7), 8-row atoms of 1024 bytes (1024-byte aligned:
// the hardware swizzle acts on address bits 4-6 with bits 7-9). Filled with cp.async (16 bytes,
// zero-filled past the sequence end), then fence.proxy.async before the barrier so the async
// proxy (wgmma) sees the data.
//   S = Q K^T: wgmma m64n<BC>k16, A = Q (shared, K-major descriptor), B = K tile (K-major),
//       D / 16 k-steps; the k-step advances the start address by 32 bytes inside the 128-byte
//       swizzle row (the hardware applies the XOR to the final address).
//   online softmax on the f32 accumulator (per thread: rows g and g + 8 of the warp's 16, the
//       mma.sync m16n8 C layout repeated along N), as the PLAIN mma.sync forward: raw max,
//       p = ex2(fma(s, c2, -mu)).
//   O += P V: wgmma m64n<D>k16 with A = P (registers, bf16 / f16: the C layout of two adjacent
//       n8 blocks is the A fragment of one k16 step) and B = V tile, MN-major (transpose bit),
//       BC / 16 k-steps of 16 keys (2048 bytes each); the D / 64 column halves are LBO apart.
// Each wgmma batch is committed and waited (wait_group 0) before its accumulator is read: the
// overlap of MMA and softmax comes from the other warpgroups of the block and SM. The launcher
// uses 2 warpgroups x 128 keys at both head dims where RLX_ATTENTION_CUDA_WGMMA=2 (attention_launch_impl.cuh; the
// default at both head dims is the warp-specialised kernel of attention_wgmma_ws.cuh). Measured and dropped
// (H200; the code is in commit 2f89835): 3 warpgroups x
// 64 keys (D 64) and 2 x 64 (D 128), and a software-pipelined kernel that issued S_j = Q K_j^T and
// O += P_{j-1} V_{j-1} together and ran the softmax of S_j while the P V product ran (wait_group
// 1), V one step behind K: slower than this kernel at D 128 (B4 S4096 forward 1.22 / 1.07x the
// mma.sync forward against 1.34 / 1.28x, none / causal) and no faster than mma.sync at D 64.
#pragma once

#include <cstdint>

#include "cuda/attention_mma.cuh"

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

// Shared memory of wgmma_fwd_kernel: Q [64 NWG x D], K and V double buffered [2][BC x D], plus
// 1024 bytes to align the swizzle atoms.
template <int D, int BC, int NWG>
constexpr size_t wg_fwd_smem() { return size_t(2) * D * (64 * NWG + 4 * BC) + 1024; }

// Forward, PLAIN (scale > 0, no softcap / bias / key mask), mask kind none or causal (a.kind 0 / 1).
// Grid and outputs as mma_fwd_kernel: block = (64 NWG-row query tile, head, batch) in fwd_tile's
// order (hc heads per chunk), heaviest (causal) tiles first; out and lse (log2-scaled max converted back with ln 2).
template <typename T, int D, int BC, int NWG>
__global__ void __launch_bounds__(NWG * 128, 1)
    wgmma_fwd_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     T* __restrict__ out, float* __restrict__ lse, int hc) {
#if RLX_ATTN_WGMMA
  static_assert(D % 64 == 0 && BC % 16 == 0 && (BC == 64 || BC == 128), "wgmma_fwd_kernel: tile shapes");
  constexpr int BM = 64 * NWG, NT = 128 * NWG;
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t pad = (1024u - (smem_addr(wg_smem) & 1023u)) & 1023u;
  T* Qs = reinterpret_cast<T*>(wg_smem + pad);  // [D / 64][BM][64]
  T* Ks = Qs + BM * D;                            // [2][D / 64][BC][64]
  T* Vs = Ks + 2 * BC * D;                        // [2][D / 64][BC][64]
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t nqt = (a.Sq + BM - 1) / BM;
  int64_t qt, blk;
  fwd_tile(blockIdx.x, nqt, a.B * a.H, hc, &qt, &blk);  // heaviest (causal) tiles first
  const int64_t h = blk % a.H, b = blk / a.H, hk = h / a.group;
  const int64_t q0 = qt * BM;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  const T* qb = q + (b * a.Sq * a.H + h) * D;
  const T* kb = k + (b * a.Sk * a.Hkv + hk) * D;
  const T* vb = v + (b * a.Sk * a.Hkv + hk) * D;
  int64_t kbeg, kend;
  key_range(a, q0, min(a.Sq - 1, q0 + BM - 1), &kbeg, &kend, BC);
  wg_load_tile<T, D, BM, NT>(Qs, qb, q_rs, q0, a.Sq);
  if (kbeg < kend) {
    wg_load_tile<T, D, BC, NT>(Ks, kb, kv_rs, kbeg, a.Sk);
    wg_load_tile<T, D, BC, NT>(Vs, vb, kv_rs, kbeg, a.Sk);
  }
  cp_async_commit();
  const int64_t r0 = q0 + 64 * wg;       // this warpgroup's rows [r0, r0 + 64)
  const int64_t wrow0 = r0 + 16 * warp;  // this warp's; thread rows wrow0 + 8 r + g
  // the warpgroup's rows see no key at or past wg_kend (causal); rows past Sq compute nothing
  int64_t wg_kend = kend;
  if (a.kind != 0) wg_kend = min(a.Sk, min(a.Sq - 1, r0 + 63) + a.off + 1);
  if (r0 >= a.Sq) wg_kend = kbeg;
  const float c2 = a.scale * kLog2e;  // raw score -> log2 units
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[D / 8][4];
  zero(o);
  const uint64_t qd = wg_desc(smem_addr(Qs) + uint32_t(wg * 64 * 128), 16, 1024);  // this warpgroup's 64 rows
  int buf = 0;
  for (int64_t k0 = kbeg; k0 < kend; k0 += BC) {
    cp_async_wait_all();
    fence_proxy_async();  // this thread's cp.async data -> the async proxy (wgmma)
    __syncthreads();      // every thread's tile landed; every warpgroup done with buf ^ 1
    if (k0 + BC < kend) {
      wg_load_tile<T, D, BC, NT>(Ks + (buf ^ 1) * BC * D, kb, kv_rs, k0 + BC, a.Sk);
      wg_load_tile<T, D, BC, NT>(Vs + (buf ^ 1) * BC * D, vb, kv_rs, k0 + BC, a.Sk);
    }
    cp_async_commit();
    if (k0 < wg_kend) {  // warpgroup-uniform
      float s[BC / 8][4];
      const uint64_t kd = wg_desc(smem_addr(Ks + buf * BC * D), 16, 1024);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        // k-step kk: column half kk / 4 (its own [rows][64] block), 16 columns = 32 bytes in
        wgmma_ss<T, BC>(s, qd, kd, uint64_t(((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4),
                        uint64_t(((kk >> 2) * BC * 128 + (kk & 3) * 32) >> 4), kk > 0);
      }
      wg_commit();
      wg_wait0();
      wg_fence_regs(s);
      const bool need = tile_needs_mask(a, wrow0, k0, 16, BC);  // warp-uniform
      float mx[2] = {-INFINITY, -INFINITY};
      if (!need) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
      } else {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t i = wrow0 + (e >> 1) * 8 + g, j = k0 + nt * 8 + 2 * tq + (e & 1);
            const float x = i < a.Sq && j < a.Sk && kind_visible(a, i, j) ? s[nt][e] : -INFINITY;
            s[nt][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
          }
      }
      float mu[2], alpha[2];
      online_max_step(mx, c2, m, mu, alpha);
      float ls[2] = {0.f, 0.f};
      uint32_t p[BC / 16][4];
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        float pe[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pe[e] = ex2(fmaf(s[nt][e], c2, -mu[e >> 1]));
          ls[e >> 1] += pe[e];
        }
        pack_a_n8<T>(p, nt, pe);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + ls[r];
      scale_rows(o, alpha);
      // V: MN-major (keys are the K dimension), 8-key groups 1024 bytes apart (SBO), the D / 64
      // column halves BC * 128 bytes apart (LBO); k-step kk = keys [16 kk, 16 kk + 16)
      const uint64_t vd = wg_desc(smem_addr(Vs + buf * BC * D), BC * 128, 1024);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) wgmma_rs<T, D>(o, p[kk], vd, uint64_t(kk * 16 * 128 >> 4), 1);
      wg_commit();
      wg_wait0();
      wg_fence_regs(o);
    }
    buf ^= 1;
  }
  cp_async_wait_all();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    const int64_t i = wrow0 + r * 8 + g;
    if (i >= a.Sq) continue;
    const bool live = !(lr <= 0.f);  // NaN rows are live: NaN out and lse, as the CPU kernel
    const float inv = live ? 1.f / lr : 0.f;
    T* orow = out + ((b * a.Sq + i) * a.H + h) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
      *reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * tq) = pack2<T>(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
    if (tq == 0) lse[(b * a.H + h) * a.Sq + i] = live ? m[r] * kLn2 + logf(lr) : -INFINITY;
  }
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
