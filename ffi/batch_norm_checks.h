// Operand checks of rlx_batch_norm_inference_bwd, shared by the CPU (ffi/cpu/batch_norm.cc)
// and CUDA (ffi/cuda/batch_norm.cu) handlers. Plain C++ (host side of both builds).
//
//   x, dy, dx: [N, C, ...] of one floating dtype; gamma, mean, var, dgamma, dbeta: [C] of
//   the same dtype; eps >= 0.
#pragma once

#include <string>

#include "host_common.h"

namespace rlx {
namespace bn {

inline ffi::Error check_channel(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
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

inline ffi::Error check_inference_bwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                                      const ffi::AnyBuffer& mean, const ffi::AnyBuffer& var,
                                      const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx,
                                      const ffi::AnyBuffer& dgamma, const ffi::AnyBuffer& dbeta, float eps) {
  if (x.dimensions().size() < 2)
    return invalid("batch_norm_inference backward: x must have rank >= 2 ([N, C, ...])");
  const ffi::AnyBuffer* params[] = {&gamma, &mean, &var, &dgamma, &dbeta};
  const char* names[] = {"gamma", "mean", "var", "dgamma", "dbeta"};
  for (int i = 0; i < 5; ++i)
    if (auto e = check_channel(x, *params[i], names[i]); e.failure()) return e;
  if (!same_dims(x, dy) || dy.element_type() != x.element_type())
    return invalid("batch_norm_inference backward: dy must match x in shape and dtype");
  if (!same_dims(x, dx) || dx.element_type() != x.element_type())
    return invalid("batch_norm_inference backward: dx must match x");
  if (!(eps >= 0.0f)) return invalid("batch_norm_inference backward: eps must be >= 0");
  return ffi::Error::Success();
}

}  // namespace bn
}  // namespace rlx
