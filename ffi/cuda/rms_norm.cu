// XLA FFI handlers for RMSNorm on CUDA: targets rlx_rms_norm_fwd, rlx_rms_norm_bwd and
// rlx_add_rms_norm_bwd.
// The maths, the work layout and the wide-row path are described in rms_norm_kernels.cuh.
//
// rlx_rms_norm_fwd: x [R.., W], gamma [W], beta [W] (one dtype: f32, bf16, f16), attr eps
//   -> y (x's dtype and shape), rstd [R..] f32.
// rlx_rms_norm_bwd: x, gamma, rstd (f32), dy -> dx, dgamma [W], dbeta [W] (x's dtype),
//   scratch [S] f32 with S >= R + 2 W (the Python side sizes it; see
//   rlx_jax/vjp_rules/rms_norm.py): per-block partial sums of dgamma/dbeta and, for
//   very wide rows, the per-row dot products. XLA allocates it; nothing is allocated here.
// rlx_add_rms_norm_bwd: x, gamma, rstd, dy, dres -> as rlx_rms_norm_bwd, with dx including
//   dres (the gradient of add_rms_norm's sum output, added in f32 before dx is rounded).
// rlx_rms_norm_bwd_y / rlx_add_rms_norm_bwd_y: x, gamma, beta, dy[, dres], attr eps -> dx,
//   dgamma, dbeta, y (the forward's output), scratch [S] with S >= 2 R + 2 W: the backward
//   with rstd recomputed from x, writing y from the rows it reads (rms_norm_linear's
//   backward, which keeps no y from the forward, takes y for its weight gradients from it).
#include "cuda/rms_norm_kernels.cuh"
#include "cuda/rowwise_common.cuh"
#include "rms_norm_checks.h"

namespace rlx {
namespace cuda {
namespace {

using rw::rows_view;

// Eps: the attribute's type, float (ABI v1) or double (v2, whose f64 eps the CPU's f64 kernels use).
template <typename Eps>
ffi::Error RmsNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> rstd, Eps eps_attr) {
  const float eps = float(eps_attr);  // the CUDA kernels take no f64 input: f32 arithmetic
  if (auto e = rms_norm::check_fwd(Backend::kCuda, x, gamma, beta, *y, *rstd, eps); e.failure()) return e;
  const auto rv_ = rows_view(x);
  const int64_t rows = rv_.rows, width = rv_.width;
  if (rows == 0 || width == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = rms::launch_fwd<T>(stream, static_cast<const T*>(x.untyped_data()),
                                static_cast<const T*>(gamma.untyped_data()),
                                static_cast<const T*>(beta.untyped_data()), static_cast<T*>(y->untyped_data()),
                                static_cast<float*>(rstd->untyped_data()), eps, rows, width);
  });
  if (!ok) return invalid("rms_norm (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

// The scratch check and the dtype dispatch into rms::launch_bwd shared by both backward
// handlers. rstd null: rstd is recomputed from x with eps (then y and beta are given and y
// is written); else rstd is read and eps unused. dres: optional.
ffi::Error launch_bwd_checked(cudaStream_t stream, const char* who, const ffi::AnyBuffer& x,
                              const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* rstd, const ffi::AnyBuffer& dy,
                              const ffi::AnyBuffer* dres, ffi::AnyBuffer& dx, ffi::AnyBuffer& dgamma,
                              ffi::AnyBuffer& dbeta, ffi::AnyBuffer& scratch, float eps,
                              ffi::AnyBuffer* y = nullptr, const ffi::AnyBuffer* beta = nullptr) {
  const auto rv_ = rows_view(x);
  const int64_t rows = rv_.rows, width = rv_.width;
  if (width == 0) return ffi::Error::Success();
  const bool recompute = rstd == nullptr;
  const int64_t scratch_len = int64_t(scratch.element_count());
  const int64_t need = rms::bwd_scratch_tail(rows, recompute) + 2 * width;
  if (scratch.element_type() != ffi::DataType::F32 || scratch_len < need)
    return invalid(std::string(who) + ": scratch must be f32 with at least " +
                   (recompute ? "2 * rows" : "rows") + " + 2 * width (" + std::to_string(need) +
                   ") elements, got " + std::to_string(scratch_len));
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto in = [](const ffi::AnyBuffer* b) { return b ? static_cast<const T*>(b->untyped_data()) : nullptr; };
    result = rms::launch_bwd<T>(stream, static_cast<const T*>(x.untyped_data()),
                                static_cast<const T*>(gamma.untyped_data()),
                                rstd ? static_cast<const float*>(rstd->untyped_data()) : nullptr,
                                static_cast<const T*>(dy.untyped_data()), static_cast<T*>(dx.untyped_data()),
                                static_cast<T*>(dgamma.untyped_data()), static_cast<T*>(dbeta.untyped_data()),
                                static_cast<float*>(scratch.untyped_data()), scratch_len, rows, width, {}, nullptr,
                                recompute ? eps : -1.f, in(dres), y ? static_cast<T*>(y->untyped_data()) : nullptr,
                                in(beta));
  });
  if (!ok) return invalid(std::string(who) + ": unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

// The backward, with dres (add_rms_norm: the sum output's gradient, added to dx) or without.
ffi::Error RmsNormBwdCommon(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer rstd,
                            ffi::AnyBuffer dy, const ffi::AnyBuffer* dres, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                            ffi::Result<ffi::AnyBuffer> scratch) {
  const char* who = dres ? "add_rms_norm backward (cuda)" : "rms_norm backward (cuda)";
  if (auto e = dres ? rms_norm::check_add_bwd(Backend::kCuda, x, gamma, rstd, dy, *dres, *dx, *dgamma, *dbeta)
                    : rms_norm::check_bwd(Backend::kCuda, x, gamma, rstd, dy, *dx, *dgamma, *dbeta);
      e.failure())
    return e;
  return launch_bwd_checked(stream, who, x, gamma, &rstd, dy, dres, *dx, *dgamma, *dbeta, *scratch, -1.f);
}

// The backward writing y too (rstd recomputed from x), with dres or without.
ffi::Error RmsNormBwdYCommon(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                             ffi::AnyBuffer dy, const ffi::AnyBuffer* dres, ffi::Result<ffi::AnyBuffer> dx,
                             ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scratch, float eps) {
  const char* who = dres ? "add_rms_norm backward with y (cuda)" : "rms_norm backward with y (cuda)";
  if (auto e = rms_norm::check_bwd_y(x, gamma, beta, dy, dres, *dx, *dgamma, *dbeta, *y, eps); e.failure()) return e;
  return launch_bwd_checked(stream, who, x, gamma, nullptr, dy, dres, *dx, *dgamma, *dbeta, *scratch, eps, &*y,
                            &beta);
}

ffi::Error RmsNormBwdYImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                           ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                           ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> scratch, float eps) {
  return RmsNormBwdYCommon(stream, x, gamma, beta, dy, nullptr, dx, dgamma, dbeta, y, scratch, eps);
}

ffi::Error AddRmsNormBwdYImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                              ffi::AnyBuffer dy, ffi::AnyBuffer dres, ffi::Result<ffi::AnyBuffer> dx,
                              ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                              ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scratch, float eps) {
  return RmsNormBwdYCommon(stream, x, gamma, beta, dy, &dres, dx, dgamma, dbeta, y, scratch, eps);
}

ffi::Error RmsNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer rstd,
                          ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                          ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> scratch) {
  return RmsNormBwdCommon(stream, x, gamma, rstd, dy, nullptr, dx, dgamma, dbeta, scratch);
}

ffi::Error AddRmsNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer rstd,
                             ffi::AnyBuffer dy, ffi::AnyBuffer dres, ffi::Result<ffi::AnyBuffer> dx,
                             ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                             ffi::Result<ffi::AnyBuffer> scratch) {
  return RmsNormBwdCommon(stream, x, gamma, rstd, dy, &dres, dx, dgamma, dbeta, scratch);
}

}  // namespace

// Command-buffer compatible: the handlers only launch kernels on XLA's stream, with
// launch shapes that depend on the buffer shapes and the device alone.
// v1 takes eps as f32, v2 as f64 (the CPU's f64 kernels normalise with the exact eps)
#define RLX_RMS_NORM_FWD_BINDING(EPS)              \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()    \
      .Arg<ffi::AnyBuffer>() /* x */               \
      .Arg<ffi::AnyBuffer>() /* gamma */           \
      .Arg<ffi::AnyBuffer>() /* beta */            \
      .Ret<ffi::AnyBuffer>() /* y */               \
      .Ret<ffi::AnyBuffer>() /* rstd */            \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormFwdCuda, RmsNormFwdImpl<float>, RLX_RMS_NORM_FWD_BINDING(float),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormFwdCudaV2, RmsNormFwdImpl<double>, RLX_RMS_NORM_FWD_BINDING(double),
                              {ffi::Traits::kCmdBufferCompatible});
#undef RLX_RMS_NORM_FWD_BINDING

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormBwdCuda, RmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>(),  // scratch
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAddRmsNormBwdCuda, AddRmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x (the sum x + residual)
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // dres
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>(),  // scratch
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormBwdYCuda, RmsNormBwdYImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // scratch
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAddRmsNormBwdYCuda, AddRmsNormBwdYImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x (the sum x + residual)
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // dres
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // scratch
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_rms_norm_fwd", RlxRmsNormFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_rms_norm_fwd_v2", RlxRmsNormFwdCudaV2);
RLX_CUDA_REGISTER_HANDLER("rlx_rms_norm_bwd_y", RlxRmsNormBwdYCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_add_rms_norm_bwd_y", RlxAddRmsNormBwdYCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_rms_norm_bwd", RlxRmsNormBwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_add_rms_norm_bwd", RlxAddRmsNormBwdCuda);

}  // namespace cuda
}  // namespace rlx
