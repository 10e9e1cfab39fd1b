// Operand checks of the rlx_cumsum targets, shared by the CPU (ffi/cpu/cumsum.cc) and CUDA
// (ffi/cuda/cumsum.cu) handlers. Plain C++17 (host side of both builds).
//
//   x, y: [outer, len, inner] of one floating dtype; the scan runs along len.
#pragma once

#include "host_common.h"

namespace rlx {
namespace cumsum {

inline ffi::Error check(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  if (x.dimensions().size() != 3) return invalid("cumsum: x must be [outer, len, inner]");
  if (!same_dims(x, y) || y.element_type() != x.element_type())
    return invalid("cumsum: output must match x in shape and dtype");
  return ffi::Error::Success();
}

}  // namespace cumsum
}  // namespace rlx
