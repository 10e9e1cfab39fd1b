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

ffi::Error check_channel(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  auto d = p.dimensions();
  const int64_t c = x.dimensions()[1];
  if (d.size() != 1 || d[0] != c)
    return invalid(std::string("batch_norm_inference backward: ") + what + " must have shape [" +
                   std::to_string(c) + "] (the channel axis of x)");
  if (p.element_type() != x.element_type())
    return invalid(std::string("batch_norm_inference backward: ") + what + " dtype " +
                   dtype_name(p.element_type()) + " differs from x dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error BatchNormInferenceBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                                     ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer dy,
                                     ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                                     ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> scratch,
                                     float eps) {
  const char* who = "batch_norm_inference backward";
  auto d = x.dimensions();
  if (d.size() < 2) return invalid("batch_norm_inference backward: x must have rank >= 2 ([N, C, ...])");
  const ffi::AnyBuffer* params[] = {&gamma, &mean, &var, &*dgamma, &*dbeta};
  const char* names[] = {"gamma", "mean", "var", "dgamma", "dbeta"};
  for (int i = 0; i < 5; ++i)
    if (auto e = check_channel(x, *params[i], names[i]); e.failure()) return e;
  if (!same_dims(x, dy) || dy.element_type() != x.element_type())
    return invalid("batch_norm_inference backward: dy must match x in shape and dtype");
  if (!same_dims(x, *dx) || dx->element_type() != x.element_type())
    return invalid("batch_norm_inference backward: dx must match x");
  if (!(eps >= 0.0f)) return invalid("batch_norm_inference backward: eps must be >= 0");
  int64_t s = 1;
  for (size_t i = 2; i < d.size(); ++i) s *= d[i];
  const chan::View v{1, d[0], d[1], s};
  const int64_t need = std::max<int64_t>(1, 2 * chan::make_plan(v).per_sum);
  if (scratch->element_type() != ffi::DataType::F32 || int64_t(scratch->element_count()) < need)
    return invalid("batch_norm_inference backward (cuda): scratch must be f32 with at least " +
                   std::to_string(need) + " elements, got " + std::to_string(scratch->element_count()));
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxBatchNormInferenceBwdCuda, BatchNormInferenceBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [N, C, ...]
                                  .Arg<ffi::AnyBuffer>()  // gamma [C]
                                  .Arg<ffi::AnyBuffer>()  // mean [C]
                                  .Arg<ffi::AnyBuffer>()  // var [C]
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>()  // scratch f32
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_batch_norm_inference_bwd", RlxBatchNormInferenceBwdCuda);

}  // namespace cuda
}  // namespace rlx
