// Shared helpers for the CUDA XLA FFI handlers: the handler registry that module.cc
// exposes to Python, and (in CUDA translation units only) element conversions,
// 16-byte vector loads/stores, group reductions, launch-error checks and a cached
// occupancy query.
//
// module.cc is compiled by the host C++ compiler without CUDA headers, so everything
// that needs the CUDA runtime sits under __CUDACC__.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "host_common.h"
#include "xla/ffi/api/ffi.h"

namespace rlx {
namespace cuda {
namespace ffi = xla::ffi;

// ---- registry -------------------------------------------------------------------
struct Registration { const char* name; void* handler; };
inline std::vector<Registration>& registry() {
  static std::vector<Registration> r;
  return r;
}
struct Registrar {
  Registrar(const char* name, void* handler) { registry().push_back({name, handler}); }
};
#define RLX_CUDA_REGISTER_HANDLER(target_name, symbol) \
  static ::rlx::cuda::Registrar rlx_cuda_registrar_##symbol(target_name, reinterpret_cast<void*>(symbol))

}  // namespace cuda
}  // namespace rlx

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

namespace rlx {
namespace cuda {

// ---- handler helpers (host side) ---------------------------------------------------
// Calls fn(T{}) with T the CUDA storage type of a floating dtype (f32, bf16, f16, and f64
// when WITH_F64); false for any other dtype. Most families take no f64 on CUDA: their
// Python side lowers the reference for it.
template <bool WITH_F64 = false, typename F>
bool dispatch(ffi::DataType dtype, F&& fn) {
  switch (dtype) {
    case ffi::DataType::F32: fn(float{}); return true;
    case ffi::DataType::BF16: fn(__nv_bfloat16{}); return true;
    case ffi::DataType::F16: fn(__half{}); return true;
    case ffi::DataType::F64:
      if constexpr (WITH_F64) {
        fn(double{});
        return true;
      }
      return false;
    default: return false;
  }
}

// ---- element conversions (f32 arithmetic) ----------------------------------------
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// Accumulator type of an element type: f32, except f64 for f64 data (the families that
// take f64 on CUDA, RoPE and cumsum, accumulate it in f64). to_acc / from_acc convert
// (round to nearest even on the way back to 16-bit types).
template <typename T>
using acc_t = std::conditional_t<std::is_same<T, double>::value, double, float>;
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> v) {
  if constexpr (std::is_same<T, double>::value) {
    return v;
  } else {
    return from_f32<T>(v);
  }
}

// Elements per 16-byte vector of T.
template <typename T> constexpr int kVec16 = 16 / int(sizeof(T));

// ---- vector loads and stores ---------------------------------------------------------
// VEC elements of T at p, converted to f32. When VEC * sizeof(T) == 16 this is one
// 16-byte load (p must then be 16-byte aligned); otherwise VEC scalar loads.
// Streaming loads (ld.global.cs): the data is read once, so it should not evict
// what other kernels keep in L2.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&v)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(p[i]);
  }
}

// Same, through the read-only cache with default caching (parameters re-read by
// every block: gamma, beta).
template <typename T, int VEC>
__device__ __forceinline__ void load_vec_cached(const T* __restrict__ p, float (&v)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(__ldg(p + i));
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&v)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) e[i] = from_f32<T>(v[i]);
    __stcs(reinterpret_cast<uint4*>(p), raw);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = from_f32<T>(v[i]);
  }
}

// VEC elements of T kept in their storage type, as one aligned access of VEC * sizeof(T)
// bytes (2..16). ld_pack's cache policy: kStream (ld.global.cs: read once, evict first),
// kL2 (ld.global.cg: default L2 caching, bypass L1: data re-read later by another pass),
// kReadOnly (ld.global.nc: tables re-read by many blocks). st_pack_stream: st.global.cs.
// The cache hints apply to 16-byte packs; narrower packs are plain accesses.
template <typename T, int VEC>
struct alignas(VEC * sizeof(T)) Pack {
  T v[VEC];
};
enum class Cache { kStream, kL2, kReadOnly };
template <typename T, int VEC, Cache C>
__device__ __forceinline__ Pack<T, VEC> ld_pack(const T* p) {
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    uint4 r;
    if constexpr (C == Cache::kStream) {
      r = __ldcs(q);
    } else if constexpr (C == Cache::kL2) {
      r = __ldcg(q);
    } else {
      r = __ldg(q);
    }
    return *reinterpret_cast<Pack<T, VEC>*>(&r);
  } else {
    return *reinterpret_cast<const Pack<T, VEC>*>(p);
  }
}
template <typename T, int VEC>
__device__ __forceinline__ void st_pack_stream(T* p, const Pack<T, VEC>& v) {
  if constexpr (VEC * sizeof(T) == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  } else {
    *reinterpret_cast<Pack<T, VEC>*>(p) = v;
  }
}

// f32 stores of VEC values (16-byte stores when VEC is a multiple of 4; p aligned).
template <int VEC>
__device__ __forceinline__ void store_f32(float* __restrict__ p, const float (&v)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4)
      *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = v[i];
  }
}

// ---- group reductions ---------------------------------------------------------------
// Warp sum of v (xor shuffles over the whole warp), which lane 0 writes to slot[warp] of
// red[parity]; then a block barrier. The first half of the block-wide sums (group_sum,
// ln::group_sum_tree).
__device__ __forceinline__ float* warp_sum_to_slot(float v, float* red, int parity) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  float* slot = red + parity * 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) slot[warp] = v;
  __syncthreads();
  return slot;
}

// Sum of v over a group of `tpr` threads. tpr <= 32: a power of two, groups are
// aligned lane ranges of one warp, reduced with xor shuffles (every lane gets the
// same bits: each level adds the same two values, a + b == b + a). tpr > 32: the
// whole block is one group of tpr == blockDim.x threads (a multiple of 32); warp sums
// go through red[parity][warp] and every thread adds them in warp order. Alternating
// `parity` between calls lets one __syncthreads per call suffice: a slot is written
// again only two calls later, after the next call's barrier. All threads of the
// block must call it (it may contain a barrier).
__device__ __forceinline__ float group_sum(float v, int tpr, float* red, int parity) {
  if (tpr <= 32) {
    for (int o = tpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  }
  const float* slot = warp_sum_to_slot(v, red, parity);
  const int nw = tpr >> 5;
  float s = 0.f;
  for (int w = 0; w < nw; ++w) s += slot[w];
  return s;
}

// One 16-byte vector of shared memory (16-byte aligned) as VEC floats.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec_smem(const T* p, float (&v)[VEC]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = to_f32(e[i]);
}

// ---- bulk asynchronous copies (sm_90: cp.async.bulk completing on an mbarrier) ----------
// Callers compile these only for __CUDA_ARCH__ >= 900 and launch them only on such devices.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialised mbarriers visible to the async proxy (then a __syncthreads).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` of transactions to come.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// Waits until the phase with parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Global -> shared copy of `bytes` (a multiple of 16; both addresses 16-byte aligned),
// completing as transactions on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif

// Warp sums of a and b (xor shuffles over the whole warp), which lane 0 writes to
// slot[warp] and slot[32 + warp]; then a block barrier. The first half of the block-wide
// two-value sums (group_sum2, rw::group_sum2_tree).
__device__ __forceinline__ float* warp_sums2_to_slots(float a, float b, float* red, int parity) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  float* slot = red + parity * 64;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    slot[warp] = a;
    slot[32 + warp] = b;
  }
  __syncthreads();
  return slot;
}

// Two sums at once, as group_sum (red then holds [2 parities][2 values][32 warps]).
__device__ __forceinline__ float2 group_sum2(float a, float b, int tpr, float* red, int parity) {
  if (tpr <= 32) {
    for (int o = tpr >> 1; o > 0; o >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    return make_float2(a, b);
  }
  const float* slot = warp_sums2_to_slots(a, b, red, parity);
  const int nw = tpr >> 5;
  float sa = 0.f, sb = 0.f;
  for (int w = 0; w < nw; ++w) {
    sa += slot[w];
    sb += slot[32 + w];
  }
  return make_float2(sa, sb);
}

// ---- host helpers ----------------------------------------------------------------------
inline ffi::Error cuda_error(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(e) + ": " +
                              cudaGetErrorString(e));
}

// Checks the launches just made on this thread.
inline ffi::Error check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(what, e);
  return ffi::Error::Success();
}

struct DeviceInfo { int device = 0; int sms = 1; };
inline cudaError_t device_info(DeviceInfo* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  out->device = dev;
  out->sms = std::max(sms, 1);
  return cudaSuccess;
}

// Resident blocks per multiprocessor of `kernel` at `threads` threads and `smem` bytes
// of dynamic shared memory, cached per (device, kernel, threads, smem).
template <typename Kernel>
inline cudaError_t blocks_per_sm(int device, Kernel kernel, int threads, size_t smem, int* out) {
  using Key = std::tuple<int, const void*, int, size_t>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  Key key{device, reinterpret_cast<const void*>(kernel), threads, smem};
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) { *out = it->second; return cudaSuccess; }
  }
  int n = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  if (e != cudaSuccess) return e;
  n = std::max(n, 1);
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  *out = n;
  return cudaSuccess;
}

// Compute capability major of the current device.
inline cudaError_t device_cc_major(int device, int* major) {
  return cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes`, once per (device, kernel). A
// refusal is cleared from the runtime's last error, so that later launch checks on this
// thread do not report it again.
template <typename Kernel>
inline cudaError_t allow_dyn_smem(Kernel kernel, size_t bytes) {
  using Key = std::pair<int, const void*>;
  static std::mutex mu;
  static std::map<Key, size_t> done;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const Key key{device, reinterpret_cast<const void*>(kernel)};
  std::lock_guard<std::mutex> lock(mu);
  auto it = done.find(key);
  if (it != done.end() && it->second >= bytes) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
  done[key] = bytes;
  return cudaSuccess;
}

// Raises a kernel's dynamic shared-memory limit to the most the device allows it, once per
// (device, kernel): the opt-in maximum per block less the kernel's own static shared memory
// (the driver refuses a dynamic limit that leaves no room for it). Returns that limit in
// *max_bytes.
template <typename Kernel>
inline cudaError_t allow_max_smem(int device, Kernel kernel, size_t* max_bytes) {
  using Key = std::pair<int, const void*>;
  static std::mutex mu;
  static std::map<Key, size_t> limits;
  const Key key{device, reinterpret_cast<const void*>(kernel)};
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = limits.find(key);
    if (it != limits.end()) { *max_bytes = it->second; return cudaSuccess; }
  }
  int optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  cudaFuncAttributes attr{};
  if ((e = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess) return e;
  const size_t limit = size_t(optin) > attr.sharedSizeBytes ? size_t(optin) - attr.sharedSizeBytes : 0;
  if ((e = allow_dyn_smem(kernel, limit)) != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  limits[key] = limit;
  *max_bytes = limit;
  return cudaSuccess;
}

inline bool aligned_to(const void* p, int bytes) { return (reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes)) == 0; }
inline bool aligned16(const void* p) { return aligned_to(p, 16); }

}  // namespace cuda
}  // namespace rlx
#endif  // __CUDACC__
