// Versioned FFI target names, shared by the CPU and CUDA nanobind modules.
//
// Every FFI target is registered with XLA under a versioned, ABI-stable name
// `<kernel>_v<N>`: N pins the handler's operands, results and attributes, so a model
// serialized with jax.export keeps calling a handler with the ABI it was exported
// against. A handler registered under a bare kernel name is version 1; a changed ABI
// is registered as a new handler under an explicit `<kernel>_v2` name (and so on)
// beside the older ones, which stay registered while they are supported.
#pragma once

#include <string>

namespace rlx {

inline bool has_version_suffix(const std::string& name) {
  const auto pos = name.rfind("_v");
  if (pos == std::string::npos || pos + 2 >= name.size()) return false;
  for (auto i = pos + 2; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  return true;
}

inline std::string versioned_target_name(const char* name) {
  std::string s(name);
  return has_version_suffix(s) ? s : s + "_v1";
}

}  // namespace rlx
