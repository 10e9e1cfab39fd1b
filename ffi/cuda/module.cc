// nanobind module `rlx_jax._ffi_cuda`: hands the registered CUDA FFI handlers to Python.
#include <nanobind/nanobind.h>

#include "cuda/common.cuh"

namespace nb = nanobind;

NB_MODULE(_ffi_cuda, m) {
  m.def("registrations", []() {
    nb::dict out;
    for (const auto& r : rlx::cuda::registry()) out[r.name] = nb::capsule(r.handler);
    return out;
  });
  m.attr("XLA_FFI_API_MAJOR") = XLA_FFI_API_MAJOR;
  m.attr("XLA_FFI_API_MINOR") = XLA_FFI_API_MINOR;
}
