// XLA FFI handler for the gather backward (scatter-add) on CUDA: target rlx_gather_bwd
// (the CPU kernel is ffi/cpu/gather.cc; the maths is in rlx_jax/vjp_rules/gather.py).
//
// CUDA contract (differs from the CPU one: the sort is done by XLA before the call):
//   dy [O, K, T] (f32, bf16, f16), keys [K] i32, order [K] i32
//     -> d_table [O, V, T], starts [S] i32 with S >= V + 1 (scratch: XLA allocates it)
//   where (keys, order) = a STABLE sort of the flat indices with their positions
//   (keys[s] = idx[order[s]], non-decreasing; equal keys in increasing position), so
//   the positions k that hit table row v are order[s] for s in the run of keys == v,
//   in increasing k. Keys outside [0, V) belong to no row's run (they sort before row
//   0's or after row V - 1's), so they add nothing, as on CPU.
//   d_table[o, v, :] = sum over that run of dy[o, k, :], added in increasing k with f32
//   accumulation: the same sums in the same order as the CPU kernel, and no atomics:
//   every table row is owned by one group of threads and written exactly once (zeros
//   when no index hits it).
//
// Two kernels: (1) starts[v] = first s with keys[s] >= v for v in [0, V] (one
// thread per v, a binary search each), so row v's run is
// [starts[v], starts[v + 1]); (2) a group of `tpr` threads (a power of two <= 256) per
// table row (o, v), each thread a strided set of VEC-element column chunks (16-byte
// vectors when T is a multiple of VEC and the buffers are aligned). Nothing is
// allocated; zero-sized operands return at once.
#include <limits>

#include "cuda/common.cuh"
#include "gather_checks.h"

namespace rlx {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// First s in [0, k) with keys[s] >= target (k when none).
__device__ __forceinline__ int64_t lower_bound(const int32_t* __restrict__ keys, int64_t k, int64_t target) {
  int64_t lo = 0, hi = k;
  while (lo < hi) {
    const int64_t mid = lo + ((hi - lo) >> 1);
    if (int64_t(__ldg(keys + mid)) < target) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) run_starts_kernel(const int32_t* __restrict__ keys, int64_t k,
                                                              int64_t v_dim, int32_t* __restrict__ starts) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v <= v_dim; v += step)
    starts[v] = int32_t(lower_bound(keys, k, v));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) gather_bwd_kernel(const T* __restrict__ dy,
                                                              const int32_t* __restrict__ starts,
                                                              const int32_t* __restrict__ order,
                                                              T* __restrict__ out, int64_t o_dim, int64_t k,
                                                              int64_t v_dim, int64_t t, int tpr) {
  const int64_t rows = o_dim * v_dim;
  const int64_t chunks = t / VEC;
  const int groups = kThreads / tpr;
  const int lane = threadIdx.x % tpr;
  for (int64_t row = int64_t(blockIdx.x) * groups + threadIdx.x / tpr; row < rows;
       row += int64_t(gridDim.x) * groups) {
    const int64_t o = row / v_dim, v = row - o * v_dim;
    const int64_t s0 = __ldg(starts + v), s1 = __ldg(starts + v + 1);
    T* dst = out + row * t;
    const T* base = dy + o * k * t;
    for (int64_t c = lane; c < chunks; c += tpr) {
      float acc[VEC];
      if (s0 == s1) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.f;  // +0: no index hits this row
      } else {
        // positions are clamped into [0, K) so a malformed order cannot read out of bounds
        const T* col = base + c * VEC;
        int64_t pos = __ldg(order + s0);
        pos = pos < 0 ? 0 : (pos >= k ? k - 1 : pos);
        load_vec<T, VEC>(col + pos * t, acc);
#pragma unroll 4
        for (int64_t s = s0 + 1; s < s1; ++s) {
          pos = __ldg(order + s);
          pos = pos < 0 ? 0 : (pos >= k ? k - 1 : pos);
          float val[VEC];
          load_vec<T, VEC>(col + pos * t, val);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += val[i];
        }
      }
      store_vec<T, VEC>(dst + c * VEC, acc);
    }
  }
}

// Threads per table row: the next power of two of the chunk count, at most kThreads.
int threads_per_row(int64_t chunks) {
  int tpr = 1;
  while (tpr < kThreads && tpr < chunks) tpr <<= 1;
  return tpr;
}

template <typename T, int VEC>
ffi::Error launch(cudaStream_t stream, const T* dy, const int32_t* keys, const int32_t* order, int32_t* starts,
                  T* out, int64_t o_dim, int64_t k, int64_t v_dim, int64_t t) {
  DeviceInfo info;
  if (cudaError_t e = device_info(&info); e != cudaSuccess) return cuda_error("gather backward: device query", e);
  const int64_t cap = int64_t(info.sms) * 64;
  const int64_t sblocks = std::min<int64_t>((v_dim + 1 + kThreads - 1) / kThreads, cap);
  run_starts_kernel<<<unsigned(sblocks), kThreads, 0, stream>>>(keys, k, v_dim, starts);
  const int tpr = threads_per_row(t / VEC);
  const int64_t groups = kThreads / tpr;
  const int64_t rows = o_dim * v_dim;
  const int64_t blocks = std::min<int64_t>((rows + groups - 1) / groups, cap);
  gather_bwd_kernel<T, VEC><<<unsigned(blocks), kThreads, 0, stream>>>(dy, starts, order, out, o_dim, k, v_dim, t,
                                                                       tpr);
  return check_launch("gather backward (cuda) launch");
}

ffi::Error GatherBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer keys, ffi::AnyBuffer order,
                         ffi::Result<ffi::AnyBuffer> d_table, ffi::Result<ffi::AnyBuffer> starts) {
  gather::Shape sh{};
  if (auto e = gather::check_dy_and_d_table(dy, *d_table, sh); e.failure()) return e;
  if (auto e = gather::check_index_vector(keys, sh, " (cuda): sorted indices"); e.failure()) return e;
  if (auto e = gather::check_index_vector(order, sh, " (cuda): the sort order"); e.failure()) return e;
  const int64_t o_dim = sh.o, k = sh.k, t = sh.t, v_dim = sh.v;
  if (k > int64_t(std::numeric_limits<int32_t>::max()))
    return invalid("gather backward (cuda): more than 2^31 - 1 indices");
  if (starts->element_type() != ffi::DataType::S32 || int64_t(starts->element_count()) < v_dim + 1)
    return invalid("gather backward (cuda): scratch must be i32 with at least V + 1 (" + std::to_string(v_dim + 1) +
                   ") elements");
  if (o_dim == 0 || v_dim == 0 || t == 0) return gather::check_empty_table(sh);
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    const T* src = static_cast<const T*>(dy.untyped_data());
    T* dst = static_cast<T*>(d_table->untyped_data());
    const int32_t* kp = static_cast<const int32_t*>(keys.untyped_data());
    const int32_t* op = static_cast<const int32_t*>(order.untyped_data());
    int32_t* sp = static_cast<int32_t*>(starts->untyped_data());
    if (t % V == 0 && aligned16(src) && aligned16(dst))
      result = launch<T, V>(stream, src, kp, op, sp, dst, o_dim, k, v_dim, t);
    else
      result = launch<T, 1>(stream, src, kp, op, sp, dst, o_dim, k, v_dim, t);
  });
  if (!ok) return invalid("gather backward (cuda): unsupported dtype " + dtype_name(dy.element_type()));
  return result;
}

}  // namespace

// Command-buffer compatible: two kernel launches on XLA's stream, its shape from the
// buffer shapes and the device.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGatherBwdCuda, GatherBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // dy [O, K, T]
                                  .Arg<ffi::AnyBuffer>()   // keys [K] i32 (sorted indices)
                                  .Arg<ffi::AnyBuffer>()   // order [K] i32 (stable sort permutation)
                                  .Ret<ffi::AnyBuffer>()   // d_table [O, V, T]
                                  .Ret<ffi::AnyBuffer>(),  // starts [>= V + 1] i32 (scratch)
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_gather_bwd", RlxGatherBwdCuda);

}  // namespace cuda
}  // namespace rlx
