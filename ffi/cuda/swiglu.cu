// XLA FFI handlers for the SwiGLU backward on CUDA: targets rlx_swiglu_bwd and
// rlx_swiglu_bwd_product, with the operands and semantics of the CPU handlers
// (ffi/cpu/swiglu.cc, rlx_jax/vjp_rules/swiglu.py):
//
//   a (gate), b (up), dh -> da, db (rlx_swiglu_bwd), or -> da, db, h with h = a s b the
//   forward's product recomputed (rlx_swiglu_bwd_product, for swiglu_linear's weight
//   gradient): buffers of one shape and dtype (f32, bf16, f16), read as flat arrays of n
//   elements. With e = exp(-|a|), s = sigmoid(a) = 1 / (1 + e)
//   for a >= 0 and e / (1 + e) for a < 0 (1 - s the other one):
//     da = dh b (s + a s (1 - s)),   db = dh a s
//   a s = 0 at a = -inf and a s (1 - s) = 0 at a = +-inf (the limits, not inf * 0).
//
// Work layout: thread i of the grid handles the VEC-element vectors i, i + G, i + 2G, ...
// (G = the grid's threads), VEC = 16 bytes of T (8 bf16 / f16, 4 f32) when all the buffers
// are 16-byte aligned, else 1; then the n mod VEC elements past the last whole vector, one
// per thread. The grid is a few resident blocks per SM, each striding over the array. Reads
// and writes stream (evict-first: every byte is touched once). f32 arithmetic; each output
// element is written by one thread with the same operations every run: deterministic.
// Nothing is allocated; the kernel runs on XLA's stream. In place: da may be a's buffer and
// db b's (the Python side aliases them); each thread reads an element's a and b before it
// writes that element's gradients, and no other thread touches the element.

#include <cmath>

#include "cuda/common.cuh"
#include "swiglu_checks.h"

namespace rlx {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // 2048 resident threads an SM (Hopper's limit)

// da, db and the product h = a s b of one element.
__device__ __forceinline__ void swiglu_grad(float a, float b, float dh, float& da, float& db, float& h) {
  const bool pos = a >= 0.f;
  const float e = __expf(pos ? -a : a);  // in (0, 1]; 0 at |a| = inf
  const float r = __frcp_rn(1.f + e);    // correctly rounded (fast math would approximate 1 / x)
  const float er = e * r;
  const float s = pos ? r : er;  // sigmoid(a)
  const float c = pos ? er : r;  // 1 - sigmoid(a)
  const float silu = a == -INFINITY ? 0.f : a * s;
  const float slope = isinf(a) ? 0.f : silu * c;
  da = dh * b * (s + slope);
  db = dh * silu;
  h = silu * b;
}

// PRODUCT: also write h (rlx_swiglu_bwd_product); else h is unused (null).
template <typename T, int VEC, bool PRODUCT>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_k(const T* a, const T* b, const T* __restrict__ dh, T* da,
                                                         T* db, T* __restrict__ h, int64_t n) {
  using P = Pack<T, VEC>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vecs = n / VEC;
  for (int64_t v = tid; v < vecs; v += stride) {
    const int64_t i = v * VEC;
    const P pa = ld_pack<T, VEC, Cache::kStream>(a + i);
    const P pb = ld_pack<T, VEC, Cache::kStream>(b + i);
    const P pd = ld_pack<T, VEC, Cache::kStream>(dh + i);
    P oa, ob, oh;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float ga, gb, gh;
      swiglu_grad(to_f32(pa.v[k]), to_f32(pb.v[k]), to_f32(pd.v[k]), ga, gb, gh);
      oa.v[k] = from_f32<T>(ga);
      ob.v[k] = from_f32<T>(gb);
      oh.v[k] = from_f32<T>(gh);
    }
    st_pack_stream<T, VEC>(da + i, oa);
    st_pack_stream<T, VEC>(db + i, ob);
    if constexpr (PRODUCT) st_pack_stream<T, VEC>(h + i, oh);
  }
  // the tail past the last whole vector (VEC > 1 only)
  for (int64_t i = vecs * VEC + tid; i < n; i += stride) {
    float ga, gb, gh;
    swiglu_grad(to_f32(a[i]), to_f32(b[i]), to_f32(dh[i]), ga, gb, gh);
    da[i] = from_f32<T>(ga);
    db[i] = from_f32<T>(gb);
    if constexpr (PRODUCT) h[i] = from_f32<T>(gh);
  }
}

template <typename T, int VEC>
ffi::Error launch_vec(cudaStream_t stream, const T* a, const T* b, const T* dh, T* da, T* db, T* h, int64_t n,
                      int sms) {
  const int64_t work = std::max<int64_t>(n / VEC, 1);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads,
                                                                int64_t(sms) * kBlocksPerSm));
  if (h != nullptr)
    swiglu_bwd_k<T, VEC, true><<<unsigned(blocks), kThreads, 0, stream>>>(a, b, dh, da, db, h, n);
  else
    swiglu_bwd_k<T, VEC, false><<<unsigned(blocks), kThreads, 0, stream>>>(a, b, dh, da, db, nullptr, n);
  return check_launch("swiglu_bwd (cuda): kernel launch");
}

template <typename T>
ffi::Error launch(cudaStream_t stream, const T* a, const T* b, const T* dh, T* da, T* db, T* h, int64_t n) {
  DeviceInfo info;
  if (cudaError_t e = device_info(&info); e != cudaSuccess) return cuda_error("swiglu_bwd (cuda): device query", e);
  if (aligned16(a) && aligned16(b) && aligned16(dh) && aligned16(da) && aligned16(db) && (!h || aligned16(h)))
    return launch_vec<T, kVec16<T>>(stream, a, b, dh, da, db, h, n, info.sms);
  return launch_vec<T, 1>(stream, a, b, dh, da, db, h, n, info.sms);
}

// Operands checked as on the CPU (swiglu_checks.h); f64 is not taken here (the Python
// side lowers the reference for it). h: the product's result buffer
// (rlx_swiglu_bwd_product) or null (rlx_swiglu_bwd).
ffi::Error run_bwd(cudaStream_t stream, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& dh,
                   ffi::AnyBuffer& da, ffi::AnyBuffer& db, ffi::AnyBuffer* h) {
  int64_t n = 0;
  if (auto e = swiglu::check(a, b, dh, da, db, h, n); e.failure()) return e;
  if (n == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(a.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = launch<T>(stream, static_cast<const T*>(a.untyped_data()), static_cast<const T*>(b.untyped_data()),
                       static_cast<const T*>(dh.untyped_data()), static_cast<T*>(da.untyped_data()),
                       static_cast<T*>(db.untyped_data()), h ? static_cast<T*>(h->untyped_data()) : nullptr, n);
  });
  if (!ok) return invalid("swiglu_bwd (cuda): unsupported dtype " + dtype_name(a.element_type()) + " (f32, bf16, f16)");
  return result;
}

ffi::Error SwigluBwdImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer dh,
                         ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db) {
  return run_bwd(stream, a, b, dh, *da, *db, nullptr);
}

ffi::Error SwigluBwdProductImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer dh,
                                ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db,
                                ffi::Result<ffi::AnyBuffer> h) {
  return run_bwd(stream, a, b, dh, *da, *db, &*h);
}

}  // namespace

// Command-buffer compatible: one launch on XLA's stream whose shape depends on the buffer
// size, its alignment and the device alone.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSwigluBwdCuda, SwigluBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // a (gate)
                                  .Arg<ffi::AnyBuffer>()   // b (up)
                                  .Arg<ffi::AnyBuffer>()   // dh
                                  .Ret<ffi::AnyBuffer>()   // da
                                  .Ret<ffi::AnyBuffer>(),  // db
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_swiglu_bwd", RlxSwigluBwdCuda);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSwigluBwdProductCuda, SwigluBwdProductImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // a (gate)
                                  .Arg<ffi::AnyBuffer>()   // b (up)
                                  .Arg<ffi::AnyBuffer>()   // dh
                                  .Ret<ffi::AnyBuffer>()   // da
                                  .Ret<ffi::AnyBuffer>()   // db
                                  .Ret<ffi::AnyBuffer>(),  // h = a s b
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_swiglu_bwd_product", RlxSwigluBwdProductCuda);

}  // namespace cuda
}  // namespace rlx
