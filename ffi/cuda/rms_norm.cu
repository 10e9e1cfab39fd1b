// XLA FFI handlers for RMSNorm on CUDA: targets rlx_rms_norm_fwd and rlx_rms_norm_bwd.
// The maths, the work layout and the wide-row path are described in rms_norm_kernels.cuh.
//
// rlx_rms_norm_fwd: x [R.., W], gamma [W], beta [W] (one dtype: f32, bf16, f16), attr eps
//   -> y (x's dtype and shape), rstd [R..] f32.
// rlx_rms_norm_bwd: x, gamma, rstd (f32), dy -> dx, dgamma [W], dbeta [W] (x's dtype),
//   scratch [S] f32 with S >= R + 2 W (the Python side sizes it; see
//   rlx_jax/vjp_rules/rms_norm.py): per-block partial sums of dgamma/dbeta and, for
//   very wide rows, the per-row dot products. XLA allocates it; nothing is allocated here.
#include "cuda/rms_norm_kernels.cuh"
#include "cuda/rowwise_common.cuh"

namespace rlx {
namespace cuda {
namespace {

using rw::rows_view;

ffi::Error check_param(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  return rw::check_row_param(x, p, "rms_norm", what);
}

// The operands both backward handlers share: gamma, dy, dx, dgamma, dbeta against x.
ffi::Error check_bwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& dy,
                     const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dgamma, const ffi::AnyBuffer& dbeta) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (!same_dims(x, dy) || dy.element_type() != x.element_type())
    return invalid("rms_norm backward: dy must match x in shape and dtype");
  if (!same_dims(x, dx) || dx.element_type() != x.element_type())
    return invalid("rms_norm backward: dx must match x");
  if (auto e = check_param(x, dgamma, "dgamma"); e.failure()) return e;
  return check_param(x, dbeta, "dbeta");
}

ffi::Error RmsNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_param(x, beta, "beta"); e.failure()) return e;
  if (!same_dims(x, *y) || y->element_type() != x.element_type())
    return invalid("rms_norm: output y must match x");
  if (rstd->element_type() != ffi::DataType::F32) return invalid("rms_norm (cuda): rstd must be f32");
  if (!(eps >= 0.0f)) return invalid("rms_norm: eps must be >= 0");
  const auto rv_ = rows_view(x);
  const int64_t rows = rv_.rows, width = rv_.width;
  if (int64_t(rstd->element_count()) != rows) return invalid("rms_norm: rstd must have one value per row");
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

ffi::Error RmsNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer rstd,
                          ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                          ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> scratch) {
  if (auto e = check_bwd(x, gamma, dy, *dx, *dgamma, *dbeta); e.failure()) return e;
  const auto rv_ = rows_view(x);
  const int64_t rows = rv_.rows, width = rv_.width;
  if (rstd.element_type() != ffi::DataType::F32 || int64_t(rstd.element_count()) != rows)
    return invalid("rms_norm backward (cuda): rstd must be f32 with one value per row");
  if (width == 0) return ffi::Error::Success();
  const int64_t scratch_len = int64_t(scratch->element_count());
  if (scratch->element_type() != ffi::DataType::F32 || scratch_len < rows + 2 * width)
    return invalid("rms_norm backward (cuda): scratch must be f32 with at least rows + 2 * width (" +
                   std::to_string(rows + 2 * width) + ") elements, got " + std::to_string(scratch_len));
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = rms::launch_bwd<T>(stream, static_cast<const T*>(x.untyped_data()),
                                static_cast<const T*>(gamma.untyped_data()),
                                static_cast<const float*>(rstd.untyped_data()),
                                static_cast<const T*>(dy.untyped_data()), static_cast<T*>(dx->untyped_data()),
                                static_cast<T*>(dgamma->untyped_data()), static_cast<T*>(dbeta->untyped_data()),
                                static_cast<float*>(scratch->untyped_data()), scratch_len, rows, width);
  });
  if (!ok) return invalid("rms_norm backward (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

}  // namespace

// Command-buffer compatible: the handlers only launch kernels on XLA's stream, with
// launch shapes that depend on the buffer shapes and the device alone.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormFwdCuda, RmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

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

RLX_CUDA_REGISTER_HANDLER("rlx_rms_norm_fwd", RlxRmsNormFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_rms_norm_bwd", RlxRmsNormBwdCuda);

}  // namespace cuda
}  // namespace rlx
