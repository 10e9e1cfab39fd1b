// Operand checks of rlx_swiglu_bwd and rlx_swiglu_bwd_product, shared by the CPU
// (ffi/cpu/swiglu.cc) and CUDA (ffi/cuda/swiglu.cu) handlers. Plain C++17 (host side of
// both builds).
//
//   operands a (gate), b (up), dh; results da, db, and for rlx_swiglu_bwd_product also h
//   (the forward's product, recomputed): buffers of one shape (any rank, read as flat
//   arrays of n elements) and one floating dtype. Which floating dtypes a build takes is
//   its handler's dispatch.
#pragma once

#include <string>
#include <utility>

#include "host_common.h"

namespace rlx {
namespace swiglu {

inline std::string dims_text(const ffi::AnyBuffer& x) {
  std::string s = "[";
  auto d = x.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// On success, n = the element count of every buffer. h: the product result of
// rlx_swiglu_bwd_product, nullptr for rlx_swiglu_bwd.
inline ffi::Error check(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& dh,
                        const ffi::AnyBuffer& da, const ffi::AnyBuffer& db, const ffi::AnyBuffer* h, int64_t& n) {
  const std::pair<const char*, const ffi::AnyBuffer*> others[] = {{"b (up)", &b}, {"dh", &dh}, {"da", &da},
                                                                   {"db", &db}, {"h", h}};
  for (const auto& [name, buf] : others) {
    if (buf == nullptr) continue;
    if (!same_dims(a, *buf))
      return invalid(std::string("swiglu_bwd: ") + name + " has shape " + dims_text(*buf) +
                     ", a (gate) has shape " + dims_text(a) + ": all buffers must have one shape");
    if (buf->element_type() != a.element_type())
      return invalid(std::string("swiglu_bwd: ") + name + " has dtype " + dtype_name(buf->element_type()) +
                     ", a (gate) has dtype " + dtype_name(a.element_type()) + ": all buffers must have one dtype");
  }
  n = static_cast<int64_t>(a.element_count());
  return ffi::Error::Success();
}

}  // namespace swiglu
}  // namespace rlx
