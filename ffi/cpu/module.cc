// nanobind module `rlx_jax._ffi_cpu`: hands the registered CPU FFI handlers to Python,
// keyed by their versioned target names (target_name.h).
#include <nanobind/nanobind.h>

#include "cpu/common.h"
#include "target_name.h"

namespace nb = nanobind;

NB_MODULE(_ffi_cpu, m) {
  m.def("registrations", []() {
    nb::dict out;
    for (const auto& r : rlx::registry()) out[rlx::versioned_target_name(r.name).c_str()] = nb::capsule(r.handler);
    return out;
  });
  m.attr("XLA_FFI_API_MAJOR") = XLA_FFI_API_MAJOR;
  m.attr("XLA_FFI_API_MINOR") = XLA_FFI_API_MINOR;
}
