// Shared pieces of the row-wise CUDA handlers (LayerNorm, GroupNorm, softmax, softmax
// cross-entropy): dtype dispatch, the max reduction that goes with common.cuh's group_sum,
// a fast exponential, row chunk loads and the running max / sum-exp of softmax and
// cross-entropy, and the launch geometry of "a group of tpr threads per row" kernels.
//
// Row-group layout (as in rms_norm_kernels.cuh): a block of `threads` threads holds
// threads / tpr row groups; thread t of a group owns the vectors of VEC elements at
// columns (t + k * tpr) * VEC. tpr is a power of two <= 32 (several rows per warp,
// reduced by shuffles) or equals the block size (one row per block, reduced through
// shared memory). Every loop that contains a reduction has a trip count that is
// uniform over the block, so the reductions' barriers are reached by all threads.
#pragma once

#include <cmath>
#include <string>

#include "cuda/common.cuh"

namespace rlx {
namespace cuda {
namespace rw {

using rlx::RowsView;
using rlx::rows_view;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// exp(x) through ex2: one MUFU op and a multiply (relative error a few 1e-7 for the
// arguments <= 0 the kernels use).
__device__ __forceinline__ float fast_exp(float x) { return exp2f(x * 1.4426950408889634f); }

// Max of v over a group of tpr threads; same contract as group_sum (red holds two
// parity slots of 32 floats; alternate `parity` between consecutive calls on red).
__device__ __forceinline__ float group_max(float v, int tpr, float* red, int parity) {
  if (tpr <= 32) {
    for (int o = tpr >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  float* slot = red + parity * 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) slot[warp] = v;
  __syncthreads();
  const int nw = tpr >> 5;
  float s = -INFINITY;
  for (int w = 0; w < nw; ++w) s = fmaxf(s, slot[w]);
  return s;
}

// Two sums over a group of tpr threads, as common.cuh's group_sum2 (same red layout and
// parity contract; every thread gets the same bits), but for tpr > 32 the warp sums are
// added by a lane-parallel xor tree (lane w takes warp w's sums: 2 shared loads and 5
// shuffle levels) instead of every thread reading and adding all 2 * tpr / 32 sums in
// turn (32 shared loads and adds a thread at 16 warps). Rows of a few vectors a thread
// (LayerNorm's staged backward: 8 bf16 values a thread) pay that per row. The sums'
// bits differ from group_sum2's (another order), and are fixed for a given tpr.
__device__ __forceinline__ float2 group_sum2_tree(float a, float b, int tpr, float* red, int parity) {
  if (tpr <= 32) return group_sum2(a, b, tpr, red, parity);
  const float* slot = warp_sums2_to_slots(a, b, red, parity);
  const int lane = threadIdx.x & 31;
  const bool in = lane < (tpr >> 5);
  a = in ? slot[lane] : 0.f;
  b = in ? slot[32 + lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  return make_float2(a, b);
}

// VEC elements at p as f32: one 16-byte load when VEC * sizeof(T) == 16. `stream`
// selects the evict-first load (data read once) over the default caching one (data
// read again soon, from L2).
template <typename T, int VEC>
__device__ __forceinline__ void load_vec_rw(const T* __restrict__ p, float (&v)[VEC], bool stream) {
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4 raw = stream ? __ldcs(reinterpret_cast<const uint4*>(p)) : __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(p[i]);
  }
}

// ---- row chunks (softmax, cross-entropy) ------------------------------------------------
// A row walked in chunks of tpr * NV vectors: thread t of the group holds the vectors at
// columns c0 + (t + k * tpr) * VEC, k < NV, of chunk c0. Columns past W, and every
// column of an invalid row (rv false), read as `fill` (-inf for logits: exp gives 0).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int64_t c0, int tpr, int t, int64_t W,
                                           bool rv, bool stream, float fill, float (&v)[NV][VEC]) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t col = c0 + int64_t(t + k * tpr) * VEC;
    if (rv && col < W) {
      load_vec_rw<T, VEC>(row + col, v[k], stream);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[k][i] = fill;
    }
  }
}

// Max of a thread's chunk.
template <int NV, int VEC>
__device__ __forceinline__ float chunk_max(const float (&v)[NV][VEC]) {
  float cm = -INFINITY;
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) cm = fmaxf(cm, v[k][i]);
  return cm;
}

// Running (max m, sum s of exp(v - m)) of one thread over its chunks: s is rescaled
// when m grows; nothing is added while m is -inf (a chunk of -inf only).
template <int NV, int VEC>
__device__ __forceinline__ void online_max_sumexp(const float (&v)[NV][VEC], float& m, float& s) {
  const float cm = chunk_max<NV, VEC>(v);
  if (cm > m) {
    s *= fast_exp(m - cm);
    m = cm;
  }
  if (m != -INFINITY) {
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int i = 0; i < VEC; ++i) s += fast_exp(v[k][i] - m);
  }
}

// The row's max M and sum S of exp(x - M) from the threads' running (m, s): group max,
// then group sum of s * exp(m - M) (fixed order). Two reductions: `ph` advances twice.
__device__ __forceinline__ float group_sumexp(float m, float s, int tpr, float* red, int& ph, float& M) {
  M = group_max(m, tpr, red, ph);
  ph ^= 1;
  const float S = group_sum(m == -INFINITY ? 0.f : s * fast_exp(m - M), tpr, red, ph);
  ph ^= 1;
  return S;
}

// Launch geometry of a row-group kernel over rows of `nvec` vectors, each thread
// taking `per_thread` vectors of a row per step.
struct Geom {
  int tpr = 32;
  int threads = 256;
  int64_t grid = 1;
};
inline Geom row_geom(int64_t rows, int64_t nvec, int per_thread, int max_threads, int sms) {
  Geom g;
  const int64_t need = ceil_div(std::max<int64_t>(nvec, 1), per_thread);
  if (need <= 32) {
    g.tpr = pow2_ceil(need);
    g.threads = 256;
  } else {
    g.tpr = int(std::min<int64_t>(ceil_div(need, 32) * 32, max_threads));
    g.threads = g.tpr;
  }
  const int64_t gpb = g.threads / g.tpr;
  const int64_t blocks = ceil_div(rows, gpb);
  // grid-stride beyond ~16 waves of 2048 threads per SM
  g.grid = std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * (2048 / g.threads) * 16));
  return g;
}

inline int num_sms() {
  DeviceInfo dev;
  if (device_info(&dev) != cudaSuccess) return 132;
  return dev.sms;
}

// ---- whole rows staged through shared memory (sm_90) -----------------------------------
// A persistent block keeps whole rows in flight in shared memory, each stage filled by bulk
// copies (cp.async.bulk) that complete on the stage's mbarrier: thread 0 issues them, and
// the row reduction's barrier tells it that every thread has read a stage, so it may refill
// it. Dynamic shared memory: kStagedHeader bytes (the reductions' red slots in the first
// 512, then one mbarrier per stage), then the stages. The block takes the contiguous run of
// rows [r0, r0 + n) of `rows` split evenly over the `parts` blocks of the grid. Used by the
// RMSNorm / LayerNorm staged kernels and the cross-entropy gradient's.
constexpr int kStagedHeader = 1024;
struct StagedRows {
  float* red;
  uint64_t* bar;
  unsigned char* stages;
  int64_t r0, n;
  __device__ __forceinline__ StagedRows(unsigned char* smem_raw, int64_t rows, int64_t parts)
      : red(reinterpret_cast<float*>(smem_raw)),
        bar(reinterpret_cast<uint64_t*>(smem_raw + 512)),
        stages(smem_raw + kStagedHeader),
        r0(rows * blockIdx.x / parts),
        n(rows * (blockIdx.x + 1) / parts - r0) {}
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  // Thread 0 initialises `count` stages' mbarriers (one arrival each), then a block barrier.
  __device__ __forceinline__ void init_barriers(int count) const {
    if (threadIdx.x == 0) {
      for (int q = 0; q < count; ++q) mbar_init(&bar[q], 1);
      mbar_init_fence();
    }
    __syncthreads();
  }
#endif
};

}  // namespace rw
}  // namespace cuda
}  // namespace rlx
