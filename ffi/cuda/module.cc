// nanobind module `rlx_jax._ffi_cuda`: hands the registered CUDA FFI handlers to Python,
// keyed by their versioned target names (target_name.h).
#include <nanobind/nanobind.h>

#include "cuda/common.cuh"
#include "target_name.h"

namespace nb = nanobind;

NB_MODULE(_ffi_cuda, m) {
  m.def("registrations", []() {
    nb::dict out;
    for (const auto& r : rlx::cuda::registry()) out[rlx::versioned_target_name(r.name).c_str()] = nb::capsule(r.handler);
    return out;
  });
  m.attr("XLA_FFI_API_MAJOR") = XLA_FFI_API_MAJOR;
  m.attr("XLA_FFI_API_MINOR") = XLA_FFI_API_MINOR;
}
