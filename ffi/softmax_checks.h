// Operand checks of rlx_softmax_fwd, rlx_softmax_bwd and rlx_softmax_bwd_x, shared by the
// CPU (ffi/cpu/softmax.cc) and CUDA (ffi/cuda/softmax.cu) handlers. Plain C++17 (host side
// of both builds).
//
//   forward:  x, y: [R.., W] of one floating dtype.
//   backward: a (y for rlx_softmax_bwd, x for rlx_softmax_bwd_x), dy, dx: [R.., W] of one
//             floating dtype.
#pragma once

#include <string>

#include "host_common.h"

namespace rlx {
namespace softmax {

inline ffi::Error check_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  if (x.dimensions().size() < 1) return invalid("softmax: x must have rank >= 1");
  if (!same_dims(x, y) || y.element_type() != x.element_type())
    return invalid("softmax: output y must match x in shape and dtype (" + dtype_name(x.element_type()) + ")");
  return ffi::Error::Success();
}

// a_name: "y" or "x", the name of `a` in the messages.
inline ffi::Error check_bwd(const ffi::AnyBuffer& a, const char* a_name, const ffi::AnyBuffer& dy,
                            const ffi::AnyBuffer& dx) {
  const std::string what = "softmax backward: ";
  if (a.dimensions().size() < 1) return invalid(what + a_name + " must have rank >= 1");
  const std::string like = std::string(" in shape and dtype (") + dtype_name(a.element_type()) + ")";
  if (!same_dims(a, dy) || dy.element_type() != a.element_type())
    return invalid(what + "dy must match " + a_name + like);
  if (!same_dims(a, dx) || dx.element_type() != a.element_type())
    return invalid(what + "dx must match " + a_name + like);
  return ffi::Error::Success();
}

}  // namespace softmax
}  // namespace rlx
