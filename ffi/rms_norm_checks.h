// Operand checks of rlx_rms_norm_fwd / rlx_rms_norm_bwd / rlx_add_rms_norm_bwd, shared by
// the CPU (ffi/cpu/rms_norm.cc) and CUDA (ffi/cuda/rms_norm.cu) handlers. Plain C++17 (host
// side of both builds).
//
//   x, y, dy, dx, dres: [R.., W] of one floating dtype; gamma, beta, dgamma, dbeta: [W] of x's
//   dtype; rstd: one value per row (R = prod(R..) values) of stat_dtype (host_common.h);
//   eps >= 0.
#pragma once

#include <string>

#include "norm_checks.h"

namespace rlx {
namespace rms_norm {

inline ffi::Error check_param(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  return norm::check_row_param("rms_norm", x, p, what);
}

inline ffi::Error check_fwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                            const ffi::AnyBuffer& beta, const ffi::AnyBuffer& y, const ffi::AnyBuffer& rstd,
                            double eps) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_param(x, beta, "beta"); e.failure()) return e;
  if (auto e = norm::check_like_x(x, y, "rms_norm: output y must match x"); e.failure()) return e;
  if (rstd.element_type() != stat_dtype(b, x.element_type()))
    return invalid(backend_op(b, "rms_norm") + ": rstd must be " + stat_dtype_rule(b));
  if (auto e = norm::check_eps("rms_norm", eps); e.failure()) return e;
  if (int64_t(rstd.element_count()) != rows_view(x).rows)
    return invalid("rms_norm: rstd must have one value per row");
  return ffi::Error::Success();
}

inline ffi::Error check_bwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                            const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx,
                            const ffi::AnyBuffer& dgamma, const ffi::AnyBuffer& dbeta) {
  if (auto e = norm::check_row_norm_bwd("rms_norm", x, gamma, dy, dx, dgamma, dbeta); e.failure()) return e;
  if (rstd.element_type() != stat_dtype(b, x.element_type()) ||
      int64_t(rstd.element_count()) != rows_view(x).rows)
    return invalid(backend_op(b, "rms_norm backward") + ": rstd must be " + stat_dtype_rule(b) +
                   " with one value per row");
  return ffi::Error::Success();
}

// add_rms_norm's backward: the plain backward's operands plus dres, the residual stream's
// gradient (x's shape and dtype), which dx includes.
inline ffi::Error check_add_bwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                                const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dres,
                                const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dgamma,
                                const ffi::AnyBuffer& dbeta) {
  if (auto e = check_bwd(b, x, gamma, rstd, dy, dx, dgamma, dbeta); e.failure()) return e;
  return norm::check_like_x(x, dres, "add_rms_norm backward: dres must match x");
}

// The backward that also writes the forward's y (rlx_rms_norm_bwd_y / rlx_add_rms_norm_bwd_y,
// rstd recomputed from x with eps): x, gamma, beta, dy[, dres] -> dx, dgamma, dbeta, y.
inline ffi::Error check_bwd_y(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& beta,
                              const ffi::AnyBuffer& dy, const ffi::AnyBuffer* dres, const ffi::AnyBuffer& dx,
                              const ffi::AnyBuffer& dgamma, const ffi::AnyBuffer& dbeta, const ffi::AnyBuffer& y,
                              double eps) {
  if (auto e = norm::check_row_norm_bwd("rms_norm", x, gamma, dy, dx, dgamma, dbeta); e.failure()) return e;
  if (auto e = check_param(x, beta, "beta"); e.failure()) return e;
  if (auto e = norm::check_like_x(x, y, "rms_norm backward: output y must match x"); e.failure()) return e;
  if (dres)
    if (auto e = norm::check_like_x(x, *dres, "add_rms_norm backward: dres must match x"); e.failure()) return e;
  return norm::check_eps("rms_norm", eps);
}

}  // namespace rms_norm
}  // namespace rlx
