// Operand checks shared by the normalisation families (layer_norm, rms_norm, group_norm,
// batch_norm) on both builds: the CPU handlers (ffi/cpu) and the CUDA handlers (ffi/cuda)
// include these, so an operand is validated by one function with one message. Plain C++17,
// host side of both builds.
#pragma once

#include <string>

#include "host_common.h"

namespace rlx {
namespace norm {

// A per-channel or per-column parameter p (gamma, beta, their gradients; batch norm's mean
// and var): shape [size] where size is the length of x's `axis`, and x's dtype.
inline ffi::Error check_param_vector(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& p,
                                     const char* what, int64_t size, const char* axis) {
  auto d = p.dimensions();
  if (d.size() != 1 || d[0] != size)
    return invalid(std::string(op) + ": " + what + " must have shape [" + std::to_string(size) + "] (the " +
                   axis + " of x)");
  if (p.element_type() != x.element_type())
    return invalid(std::string(op) + ": " + what + " dtype " + dtype_name(p.element_type()) +
                   " differs from x dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

// b has x's shape and dtype; `message` is the error otherwise.
inline ffi::Error check_like_x(const ffi::AnyBuffer& x, const ffi::AnyBuffer& b, const std::string& message) {
  if (!same_dims(x, b) || b.element_type() != x.element_type()) return invalid(message);
  return ffi::Error::Success();
}

// A norm over the last axis of x ([R.., W]): x has rank >= 1 and p is a [W] vector of x's dtype.
inline ffi::Error check_row_param(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& p,
                                  const char* what) {
  if (x.dimensions().size() < 1) return invalid(std::string(op) + ": x must have rank >= 1");
  return check_param_vector(op, x, p, what, rows_view(x).width, "last axis");
}

// The backward operands of a norm over the last axis: gamma, dy, dx, dgamma, dbeta against x.
inline ffi::Error check_row_norm_bwd(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                                     const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dgamma,
                                     const ffi::AnyBuffer& dbeta) {
  const std::string bwd = std::string(op) + " backward: ";
  if (auto e = check_row_param(op, x, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_like_x(x, dy, bwd + "dy must match x in shape and dtype"); e.failure()) return e;
  if (auto e = check_like_x(x, dx, bwd + "dx must match x"); e.failure()) return e;
  if (auto e = check_row_param(op, x, dgamma, "dgamma"); e.failure()) return e;
  return check_row_param(op, x, dbeta, "dbeta");
}

inline ffi::Error check_eps(const char* op, double eps) {
  if (!(eps >= 0.0)) return invalid(std::string(op) + ": eps must be >= 0");
  return ffi::Error::Success();
}

}  // namespace norm
}  // namespace rlx
