// XLA FFI handler for BatchNorm (inference mode) backward on CUDA, same target and
// contract as ffi/cpu/batch_norm.cc plus a scratch result:
//
// rlx_batch_norm_inference_bwd: x [N, C, S...], gamma, mean, var [C], dy -> dx,
//   dgamma [C], dbeta [C] (all x's dtype: f32, bf16, f16), scratch [K] f32; attr eps.
//   rstd_c = 1 / sqrt(var_c + eps)
//   dx = dy * gamma_c * rstd_c
//   dgamma_c = rstd_c * sum_{n, s} dy * (x - mean_c)     dbeta_c = sum_{n, s} dy
// One read of x and dy, one write of dx. The channel sums are per-warp / per-chunk
// partial sums in the scratch result (K >= max(1, 2 * per_sum), per_sum of
// channel_reduce.cuh's plan for the view [1, N, C, S]; rlx_jax/vjp_rules/batch_norm.py:
// cuda_bwd_scratch_size), added per channel in a fixed order by a second kernel
// (deterministic, no atomics). XLA allocates the scratch; nothing is allocated here.
#include "batch_norm_checks.h"
#include "cuda/channel_reduce.cuh"

namespace rlx {
namespace cuda {
namespace {


template <typename TT>
struct BnOp {
  using T = TT;
  static constexpr int NS = 2;
  const T* __restrict__ x;
  const T* __restrict__ dy;
  T* __restrict__ dx;
  const T* __restrict__ gamma;
  const T* __restrict__ mean;
  const T* __restrict__ var;
  T* __restrict__ dgamma;
  T* __restrict__ dbeta;
  float eps;
  struct Param { float mean, scale; };
  __device__ __forceinline__ float rstd(int64_t c) const {
    return __fdiv_rn(1.f, __fsqrt_rn(to_f32(var[c]) + eps));
  }
  __device__ __forceinline__ Param param(int64_t c) const { return {to_f32(mean[c]), to_f32(gamma[c]) * rstd(c)}; }
  __device__ __forceinline__ float apply(float xv, float g, const Param& p, float* acc) const {
    acc[0] += g * (xv - p.mean);
    acc[1] += g;
    return g * p.scale;
  }
  __device__ __forceinline__ void finish(int64_t c, const float* sums) const {
    dgamma[c] = from_f32<T>(sums[0] * rstd(c));
    dbeta[c] = from_f32<T>(sums[1]);
  }
};

// Eps: the attribute's type, float (ABI v1) or double (v2, whose f64 eps the CPU's f64 kernels use).
template <typename Eps>
ffi::Error BatchNormInferenceBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                                     ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer dy,
                                     ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                                     ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> scratch,
                                     Eps eps_attr) {
  const float eps = float(eps_attr);  // the CUDA kernels take no f64 input: f32 arithmetic
  const char* who = "batch_norm_inference backward";
  auto d = x.dimensions();
  if (auto e = bn::check_inference_bwd(x, gamma, mean, var, dy, *dx, *dgamma, *dbeta, eps); e.failure()) return e;
  int64_t s = 1;
  for (size_t i = 2; i < d.size(); ++i) s *= d[i];
  const chan::View v{1, d[0], d[1], s};
  if (auto e = chan::check_scratch(who, v, BnOp<float>::NS, *scratch); e.failure()) return e;
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    BnOp<T> op{static_cast<const T*>(x.untyped_data()),     static_cast<const T*>(dy.untyped_data()),
               static_cast<T*>(dx->untyped_data()),         static_cast<const T*>(gamma.untyped_data()),
               static_cast<const T*>(mean.untyped_data()),  static_cast<const T*>(var.untyped_data()),
               static_cast<T*>(dgamma->untyped_data()),     static_cast<T*>(dbeta->untyped_data()),
               eps};
    result = chan::launch(stream, op, v, static_cast<float*>(scratch->untyped_data()), who);
  });
  if (!ok)
    return invalid("batch_norm_inference backward (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

}  // namespace

// Command-buffer compatible: kernels on XLA's stream only, launch shapes from the buffer
// shapes and the device alone.
// v1 takes eps as f32, v2 as f64 (the CPU's f64 kernels normalise with the exact eps)
#define RLX_BATCH_NORM_INFERENCE_BWD_BINDING(EPS)  \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()    \
      .Arg<ffi::AnyBuffer>() /* x [N, C, ...] */   \
      .Arg<ffi::AnyBuffer>() /* gamma [C] */       \
      .Arg<ffi::AnyBuffer>() /* mean [C] */        \
      .Arg<ffi::AnyBuffer>() /* var [C] */         \
      .Arg<ffi::AnyBuffer>() /* dy */              \
      .Ret<ffi::AnyBuffer>() /* dx */              \
      .Ret<ffi::AnyBuffer>() /* dgamma */          \
      .Ret<ffi::AnyBuffer>() /* dbeta */           \
      .Ret<ffi::AnyBuffer>() /* scratch f32 */     \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxBatchNormInferenceBwdCuda, BatchNormInferenceBwdImpl<float>,
                              RLX_BATCH_NORM_INFERENCE_BWD_BINDING(float), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxBatchNormInferenceBwdCudaV2, BatchNormInferenceBwdImpl<double>,
                              RLX_BATCH_NORM_INFERENCE_BWD_BINDING(double), {ffi::Traits::kCmdBufferCompatible});
#undef RLX_BATCH_NORM_INFERENCE_BWD_BINDING

RLX_CUDA_REGISTER_HANDLER("rlx_batch_norm_inference_bwd", RlxBatchNormInferenceBwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_batch_norm_inference_bwd_v2", RlxBatchNormInferenceBwdCudaV2);

}  // namespace cuda
}  // namespace rlx
