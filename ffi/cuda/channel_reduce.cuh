// Elementwise backward passes with per-channel parameters and per-channel sums, shared by
// the fake-quantization (quantize.cu) and BatchNormInference (batch_norm.cu) kernels.
//
// View: x, dy, dx as [G, O, C, I] (row r = (g, o, c) of width I); the channel of an
// element is k = g * C + c (G * C channels). An Op gives, per channel, its parameters
// (Op::param), per element dx = f(x, dy, param) and NS values to add up per channel
// (Op::apply), and turns the channel sums into outputs (Op::finish).
//
// Two work layouts, picked from the view alone (plan(); the Python side sizes the
// scratch output with the same formula: cuda_scratch_per_sum in the vjp_rules modules):
// - row layout (I >= kRowMinWidth): a warp per segment of at most kSegment elements of
//   one row (one channel: its parameters are loaded once); the warp's sums go to
//   partial[s][r * segs + seg] (shuffle-xor reduction, fixed order);
// - column layout (I < kRowMinWidth, e.g. channel last with I == 1): the (g, o) rows of
//   width W = C * I are split into `chunks` chunks of `rpc` rows; a block of
//   tx * ty threads takes a tile of tx * VEC columns of one chunk, thread (x, y) walks
//   rows y, y + ty, ... of the chunk, and the ty partial column sums are added in y order
//   through shared memory into partial[s][(chunk * G + g) * W + column]; tx <= 64, so a
//   wide row gives ty = 4. Ops without sums (NS == 0) need no scratch and take chunks of
//   kMinChunkRows rows (more blocks).
// A second kernel adds each channel's partials in a fixed order (strided per thread, then
// in thread order), so results are bitwise reproducible: no atomics anywhere.
// Everything is f32 arithmetic; the kernels allocate nothing and only launch on the
// stream they are given.
#pragma once

#include <algorithm>

#include "cuda/rowwise_common.cuh"

namespace rlx {
namespace cuda {
namespace chan {

constexpr int64_t kRowMinWidth = 32;   // I >= this: row layout
constexpr int64_t kSegment = 4096;     // elements of one warp task in the row layout
constexpr int64_t kMinChunkRows = 16;  // column layout: rows per chunk at least ...
constexpr int64_t kMaxChunks = 256;    // ... and at most this many chunks
constexpr int kThreads = 256;
constexpr int kMaxTx = 64;             // column layout: threads across the columns at most

struct View {
  int64_t g, o, c, i;
  int64_t elements() const { return g * o * c * i; }
  int64_t channels() const { return g * c; }
};

struct Plan {
  bool row;
  int64_t segs;         // row layout: segments per row
  int64_t rpc, chunks;  // column layout: rows per chunk, number of chunks
  int64_t per_sum;      // scratch floats per summed quantity
};

inline Plan make_plan(const View& v) {
  Plan p{};
  if (v.i >= kRowMinWidth) {
    p.row = true;
    p.segs = rw::ceil_div(v.i, kSegment);
    p.per_sum = v.g * v.o * v.c * p.segs;
  } else {
    p.row = false;
    p.rpc = std::max(kMinChunkRows, rw::ceil_div(v.o, kMaxChunks));
    p.chunks = rw::ceil_div(v.o, p.rpc);
    p.per_sum = p.chunks * v.g * v.c * v.i;
  }
  return p;
}

template <class Op, int VEC>
__global__ void __launch_bounds__(kThreads) row_kernel(Op op, View v, int64_t segs, float* __restrict__ partial,
                                                       int64_t per_sum) {
  using T = typename Op::T;
  constexpr int NS = Op::NS;
  const int lane = threadIdx.x & 31;
  const int64_t tasks = v.g * v.o * v.c * segs;
  const int64_t stride = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t t = int64_t(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5); t < tasks; t += stride) {
    const int64_t r = segs == 1 ? t : t / segs;
    const int64_t seg = t - r * segs;
    const int64_t ch = (r / (v.o * v.c)) * v.c + r % v.c;
    const typename Op::Param p = op.param(ch);
    const int64_t j1 = std::min(v.i, (seg + 1) * kSegment);
    const int64_t base = r * v.i;
    float acc[NS > 0 ? NS : 1] = {};
    int64_t j = seg * kSegment + lane * VEC;
    // four vectors of x and dy in flight per thread, then their dx
    for (; j + 3 * 32 * VEC < j1; j += 4 * 32 * VEC) {
      float xv[4][VEC], dyv[4][VEC];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        load_vec<T, VEC>(op.x + base + j + u * 32 * VEC, xv[u]);
        load_vec<T, VEC>(op.dy + base + j + u * 32 * VEC, dyv[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float dxv[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) dxv[k] = op.apply(xv[u][k], dyv[u][k], p, acc);
        store_vec<T, VEC>(op.dx + base + j + u * 32 * VEC, dxv);
      }
    }
    for (; j < j1; j += 32 * VEC) {
      float xv[VEC], dyv[VEC], dxv[VEC];
      load_vec<T, VEC>(op.x + base + j, xv);
      load_vec<T, VEC>(op.dy + base + j, dyv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) dxv[k] = op.apply(xv[k], dyv[k], p, acc);
      store_vec<T, VEC>(op.dx + base + j, dxv);
    }
    if constexpr (NS > 0) {
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        float a = acc[s];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
        if (lane == 0) partial[s * per_sum + t] = a;
      }
    }
  }
}

// Rows of a chunk are taken 4 at a time (loads of 4 rows in flight per thread).
template <class Op, int VEC>
__global__ void __launch_bounds__(kThreads) col_kernel(Op op, View v, int64_t rpc, int64_t chunks, int tx,
                                                       int64_t col_tiles, float* __restrict__ partial,
                                                       int64_t per_sum) {
  using T = typename Op::T;
  constexpr int NS = Op::NS;
  __shared__ float red[NS > 0 ? NS * kThreads * VEC : 1];
  const int x = threadIdx.x % tx, y = threadIdx.x / tx, ty = kThreads / tx;
  const int64_t w = v.c * v.i;
  int64_t b = blockIdx.x;
  const int64_t tile = b % col_tiles;
  b /= col_tiles;
  const int64_t k = b % chunks;
  const int64_t g = b / chunks;
  const int64_t col = (tile * tx + x) * VEC;
  const bool active = col < w;  // VEC > 1 only when VEC divides w
  typename Op::Param p[VEC];
  float acc[NS > 0 ? NS : 1][VEC] = {};
  if (active) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) p[e] = op.param(g * v.c + (col + e) / v.i);
    const int64_t o0 = k * rpc, o1 = std::min(v.o, o0 + rpc);
    int64_t o = o0 + y;
    for (; o + 3 * ty < o1; o += 4 * ty) {
      float xv[4][VEC], dyv[4][VEC];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t at = (g * v.o + o + u * ty) * w + col;
        load_vec<T, VEC>(op.x + at, xv[u]);
        load_vec<T, VEC>(op.dy + at, dyv[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float dxv[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float a[NS > 0 ? NS : 1] = {};
          dxv[e] = op.apply(xv[u][e], dyv[u][e], p[e], a);
          if constexpr (NS > 0) {
#pragma unroll
            for (int s = 0; s < NS; ++s) acc[s][e] += a[s];
          }
        }
        store_vec<T, VEC>(op.dx + (g * v.o + o + u * ty) * w + col, dxv);
      }
    }
    for (; o < o1; o += ty) {
      const int64_t at = (g * v.o + o) * w + col;
      float xv[VEC], dyv[VEC], dxv[VEC];
      load_vec<T, VEC>(op.x + at, xv);
      load_vec<T, VEC>(op.dy + at, dyv);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float a[NS > 0 ? NS : 1] = {};
        dxv[e] = op.apply(xv[e], dyv[e], p[e], a);
        if constexpr (NS > 0) {
#pragma unroll
          for (int s = 0; s < NS; ++s) acc[s][e] += a[s];
        }
      }
      store_vec<T, VEC>(op.dx + at, dxv);
    }
  }
  if constexpr (NS > 0) {
#pragma unroll
    for (int s = 0; s < NS; ++s)
#pragma unroll
      for (int e = 0; e < VEC; ++e) red[(s * kThreads + threadIdx.x) * VEC + e] = acc[s][e];
    __syncthreads();
    if (y == 0 && active) {
#pragma unroll
      for (int s = 0; s < NS; ++s)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float sum = 0.f;
          for (int yy = 0; yy < ty; ++yy) sum += red[(s * kThreads + yy * tx + x) * VEC + e];
          partial[s * per_sum + (k * v.g + g) * w + col + e] = sum;
        }
    }
  }
}

// Channel sums from the partials, in a fixed order. A block holds `lanes` consecutive
// channels c of one g (lanes = 32 when C >= 32, else 1) and kThreads / lanes groups;
// group q adds the terms q, q + groups, ... of its channel, then thread q == 0 adds the
// groups' sums in group order and calls op.finish(channel, sums).
// Terms of channel (g, c): row layout: (o, seg) at ((g O + o) C + c) segs + seg;
// column layout: (chunk, i) at (chunk G + g) W + c I + i.
template <class Op>
__global__ void __launch_bounds__(kThreads) channel_sum_kernel(Op op, View v, Plan plan, int lanes, int64_t c_tiles,
                                                               const float* __restrict__ partial) {
  constexpr int NS = Op::NS;
  __shared__ float red[NS * kThreads];
  const int lane = threadIdx.x % lanes, q = threadIdx.x / lanes, groups = kThreads / lanes;
  const int64_t g = blockIdx.x / c_tiles, c = (blockIdx.x % c_tiles) * lanes + lane;
  float acc[NS] = {};
  if (c < v.c) {
    const int64_t terms = plan.row ? v.o * plan.segs : plan.chunks * v.i;
    for (int64_t t = q; t < terms; t += groups) {
      int64_t at;
      if (plan.row) {
        const int64_t o = plan.segs == 1 ? t : t / plan.segs;
        at = ((g * v.o + o) * v.c + c) * plan.segs + (t - o * plan.segs);
      } else {
        const int64_t kk = v.i == 1 ? t : t / v.i;
        at = (kk * v.g + g) * v.c * v.i + c * v.i + (t - kk * v.i);
      }
#pragma unroll
      for (int s = 0; s < NS; ++s) acc[s] += partial[s * plan.per_sum + at];
    }
  }
#pragma unroll
  for (int s = 0; s < NS; ++s) red[s * kThreads + threadIdx.x] = acc[s];
  __syncthreads();
  if (q == 0 && c < v.c) {
    float sums[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      float sum = 0.f;
      for (int qq = 0; qq < groups; ++qq) sum += red[s * kThreads + qq * lanes + lane];
      sums[s] = sum;
    }
    op.finish(g * v.c + c, sums);
  }
}

// Checks the f32 scratch result of a pass that sums `ns` quantities per channel: at least
// max(1, ns * per_sum) floats (the Python side sizes it with the same formula).
inline ffi::Error check_scratch(const char* who, const View& v, int ns, const ffi::AnyBuffer& scratch) {
  const int64_t need = std::max<int64_t>(1, ns * make_plan(v).per_sum);
  if (scratch.element_type() != ffi::DataType::F32 || int64_t(scratch.element_count()) < need)
    return invalid(std::string(who) + " (cuda): scratch must be f32 with at least " + std::to_string(need) +
                   " elements, got " + std::to_string(scratch.element_count()));
  return ffi::Error::Success();
}

// Launches the pass (and, for NS > 0, the channel sums) on `stream`. `partial` holds
// at least NS * plan.per_sum floats (unused when NS == 0). With no elements the channel
// sums are zero (op.finish still runs for every channel).
template <class Op, int VEC>
ffi::Error launch_vec(cudaStream_t stream, const Op& op, const View& v, const Plan& plan, float* partial,
                      const char* who) {
  if (v.elements() > 0) {
    if (plan.row) {
      DeviceInfo dev;
      if (cudaError_t e = device_info(&dev); e != cudaSuccess) return cuda_error(who, e);
      const int64_t tasks = v.g * v.o * v.c * plan.segs;
      const int64_t blocks = std::min<int64_t>(rw::ceil_div(tasks, kThreads / 32), int64_t(dev.sms) * 16);
      row_kernel<Op, VEC><<<unsigned(blocks), kThreads, 0, stream>>>(op, v, plan.segs, partial, plan.per_sum);
    } else {
      const int64_t w = v.c * v.i;
      const int64_t cols = rw::ceil_div(w, VEC);
      // at most 64 threads across the columns, so that wide rows still give ty = 4 rows
      // per block (a block covers 1 KiB of a row: coalesced) and 4x the blocks
      const int tx = int(std::min<int64_t>(kMaxTx, rw::pow2_ceil(cols)));
      const int64_t col_tiles = rw::ceil_div(cols, tx);
      const int64_t blocks = col_tiles * plan.chunks * v.g;
      if (blocks >= (int64_t(1) << 31)) return ffi::Error::InvalidArgument(std::string(who) + ": tensor too large");
      col_kernel<Op, VEC><<<unsigned(blocks), kThreads, 0, stream>>>(op, v, plan.rpc, plan.chunks, tx, col_tiles,
                                                                     partial, plan.per_sum);
    }
  }
  if constexpr (Op::NS > 0) {
    if (v.channels() > 0) {
      const int lanes = v.c >= 32 ? 32 : 1;
      const int64_t c_tiles = rw::ceil_div(v.c, lanes);
      const int64_t blocks = c_tiles * v.g;
      if (blocks >= (int64_t(1) << 31)) return ffi::Error::InvalidArgument(std::string(who) + ": too many channels");
      View vs = v;
      Plan ps = plan;
      if (v.elements() == 0) {  // no terms: every sum is zero
        vs.o = 0;
        vs.i = 0;
        ps.chunks = 0;
      }
      channel_sum_kernel<Op><<<unsigned(blocks), kThreads, 0, stream>>>(op, vs, ps, lanes, c_tiles, partial);
    }
  }
  return check_launch(who);
}

// 16-byte vectors where the layout and the pointers allow, else scalar accesses.
template <class Op>
ffi::Error launch(cudaStream_t stream, const Op& op, const View& v, float* partial, const char* who) {
  using T = typename Op::T;
  constexpr int V = kVec16<T>;
  Plan plan = make_plan(v);
  if (Op::NS == 0 && !plan.row) {  // no sums, no scratch: short chunks, many blocks
    plan.rpc = kMinChunkRows;
    plan.chunks = rw::ceil_div(v.o, plan.rpc);
    plan.per_sum = 0;
  }
  const int64_t unit = plan.row ? v.i : v.c * v.i;
  const bool vec = unit % V == 0 && aligned16(op.x) && aligned16(op.dy) && aligned16(op.dx);
  return vec ? launch_vec<Op, V>(stream, op, v, plan, partial, who)
             : launch_vec<Op, 1>(stream, op, v, plan, partial, who);
}

}  // namespace chan
}  // namespace cuda
}  // namespace rlx
