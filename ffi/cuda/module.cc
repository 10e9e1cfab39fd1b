// nanobind module `rlx_jax._ffi_cuda`: hands the registered CUDA FFI handlers to Python.
#include <nanobind/nanobind.h>

#include <string>

#include "cuda/common.cuh"

namespace nb = nanobind;

// Every FFI target is registered with XLA under a versioned, ABI-stable name
// `<kernel>_v<N>`: N pins the handler's operands, results and attributes, so a model
// serialized with jax.export keeps calling a handler with the ABI it was exported
// against. A handler registered under a bare kernel name is version 1; a changed ABI
// is registered as a new handler under an explicit `<kernel>_v2` name (and so on)
// beside the older ones, which stay registered while they are supported.
namespace {

bool has_version_suffix(const std::string& name) {
  const auto pos = name.rfind("_v");
  if (pos == std::string::npos || pos + 2 >= name.size()) return false;
  for (auto i = pos + 2; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  return true;
}

std::string versioned_name(const char* name) {
  std::string s(name);
  return has_version_suffix(s) ? s : s + "_v1";
}

}  // namespace

NB_MODULE(_ffi_cuda, m) {
  m.def("registrations", []() {
    nb::dict out;
    for (const auto& r : rlx::cuda::registry()) out[versioned_name(r.name).c_str()] = nb::capsule(r.handler);
    return out;
  });
  m.attr("XLA_FFI_API_MAJOR") = XLA_FFI_API_MAJOR;
  m.attr("XLA_FFI_API_MINOR") = XLA_FFI_API_MINOR;
}
