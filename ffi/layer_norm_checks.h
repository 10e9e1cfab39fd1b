// Operand checks of rlx_layer_norm_fwd / rlx_layer_norm_bwd, shared by the CPU
// (ffi/cpu/layer_norm.cc) and CUDA (ffi/cuda/layer_norm.cu) handlers. Plain C++17 (host side
// of both builds).
//
//   x, y, dy, dx: [R.., W] of one floating dtype; gamma, beta, dgamma, dbeta: [W] of x's
//   dtype; mean, rstd: one value per row (R = prod(R..) values) of stat_dtype
//   (host_common.h); eps >= 0.
#pragma once

#include <string>

#include "norm_checks.h"

namespace rlx {
namespace layer_norm {

inline ffi::Error check_param(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  return norm::check_row_param("layer_norm", x, p, what);
}

inline ffi::Error check_stat(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& s, const char* what) {
  if (s.element_type() != stat_dtype(b, x.element_type()))
    return invalid(backend_op(b, "layer_norm") + ": " + what + " must be " + stat_dtype_rule(b) +
                   ", got " + dtype_name(s.element_type()));
  if (int64_t(s.element_count()) != rows_view(x).rows)
    return invalid(std::string("layer_norm: ") + what + " must have one value per row of x");
  return ffi::Error::Success();
}

inline ffi::Error check_fwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                            const ffi::AnyBuffer& beta, const ffi::AnyBuffer& y, const ffi::AnyBuffer& mean,
                            const ffi::AnyBuffer& rstd, double eps) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_param(x, beta, "beta"); e.failure()) return e;
  if (auto e = norm::check_like_x(x, y, "layer_norm: output y must match x"); e.failure()) return e;
  if (auto e = check_stat(b, x, mean, "mean"); e.failure()) return e;
  if (auto e = check_stat(b, x, rstd, "rstd"); e.failure()) return e;
  return norm::check_eps("layer_norm", eps);
}

inline ffi::Error check_bwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                            const ffi::AnyBuffer& mean, const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dy,
                            const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dgamma, const ffi::AnyBuffer& dbeta) {
  if (auto e = norm::check_row_norm_bwd("layer_norm", x, gamma, dy, dx, dgamma, dbeta); e.failure()) return e;
  if (auto e = check_stat(b, x, mean, "mean"); e.failure()) return e;
  return check_stat(b, x, rstd, "rstd");
}

}  // namespace layer_norm
}  // namespace rlx
