// The FFI bindings' building blocks shared by the attention handlers of the CPU
// (ffi/cpu/attention.cc) and CUDA (ffi/cuda/attention.cu) modules: every attention target takes
// AnyBuffer operands and results and the same six attributes. Plain C++17.
#pragma once

#include <cstdint>
#include <utility>

#include "host_common.h"

namespace rlx {
namespace attention {

// A Binding cannot be copied or moved from outside: each helper takes the chain so far by
// reference and returns the prvalue its last call makes.
template <int N, typename Binding>
auto operands(Binding&& b) {  // N (>= 1) more AnyBuffer operands
  if constexpr (N == 1) return std::move(b).template Arg<ffi::AnyBuffer>();
  else return operands<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
}

template <int N, typename Binding>
auto results(Binding&& b) {  // N (>= 1) more AnyBuffer results
  if constexpr (N == 1) return std::move(b).template Ret<ffi::AnyBuffer>();
  else return results<N - 1>(std::move(b).template Ret<ffi::AnyBuffer>());
}

template <typename Binding>
auto with_attrs(Binding&& b) {
  return std::move(b)
      .template Attr<double>("scale")
      .template Attr<double>("softcap")
      .template Attr<int64_t>("mask_kind")
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("has_mask")
      .template Attr<int64_t>("has_bias");
}

}  // namespace attention
}  // namespace rlx
