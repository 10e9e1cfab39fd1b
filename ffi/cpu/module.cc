// nanobind module `rlx_jax._ffi_cpu`: hands the registered CPU FFI handlers to Python.
#include <nanobind/nanobind.h>

#include "cpu/common.h"

namespace nb = nanobind;

NB_MODULE(_ffi_cpu, m) {
  m.def("registrations", []() {
    nb::dict out;
    for (const auto& r : rlx::registry()) out[r.name] = nb::capsule(r.handler);
    return out;
  });
  m.attr("XLA_FFI_API_MAJOR") = XLA_FFI_API_MAJOR;
  m.attr("XLA_FFI_API_MINOR") = XLA_FFI_API_MINOR;
}
