// Operand checks of rlx_batch_norm_inference_bwd, shared by the CPU (ffi/cpu/batch_norm.cc)
// and CUDA (ffi/cuda/batch_norm.cu) handlers. Plain C++ (host side of both builds).
//
//   x, dy, dx: [N, C, ...] of one floating dtype; gamma, mean, var, dgamma, dbeta: [C] of
//   the same dtype; eps >= 0.
#pragma once

#include "norm_checks.h"

namespace rlx {
namespace bn {

inline ffi::Error check_channel(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  return norm::check_param_vector("batch_norm_inference backward", x, p, what, x.dimensions()[1], "channel axis");
}

inline ffi::Error check_inference_bwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                                      const ffi::AnyBuffer& mean, const ffi::AnyBuffer& var,
                                      const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx,
                                      const ffi::AnyBuffer& dgamma, const ffi::AnyBuffer& dbeta, double eps) {
  if (x.dimensions().size() < 2)
    return invalid("batch_norm_inference backward: x must have rank >= 2 ([N, C, ...])");
  const ffi::AnyBuffer* params[] = {&gamma, &mean, &var, &dgamma, &dbeta};
  const char* names[] = {"gamma", "mean", "var", "dgamma", "dbeta"};
  for (int i = 0; i < 5; ++i)
    if (auto e = check_channel(x, *params[i], names[i]); e.failure()) return e;
  if (auto e = norm::check_like_x(x, dy, "batch_norm_inference backward: dy must match x in shape and dtype");
      e.failure())
    return e;
  if (auto e = norm::check_like_x(x, dx, "batch_norm_inference backward: dx must match x"); e.failure()) return e;
  return norm::check_eps("batch_norm_inference backward", eps);
}

}  // namespace bn
}  // namespace rlx
