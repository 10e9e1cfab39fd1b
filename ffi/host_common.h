// Host-side helpers shared by the CPU handlers (ffi/cpu/common.h) and the CUDA handlers
// (ffi/cuda/common.cuh): dtype names for error messages, shape equality, and the
// InvalidArgument error every handler returns for bad operands, and the test of the
// environment switches that select kernel variants for A/B timing. Plain C++ (no CUDA, no x86
// intrinsics), so both builds include it (-I ffi), as do the family headers shared by both
// builds (ffi/batch_norm_checks.h, ffi/pool_geometry.h).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace rlx {
namespace ffi = xla::ffi;

inline std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::S32: return "i32";
    case ffi::DataType::S64: return "i64";
    default: return "dtype#" + std::to_string(static_cast<int>(t));
  }
}

inline bool same_dims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  return da.size() == db.size() && std::equal(da.begin(), da.end(), db.begin());
}

inline ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }

// Whether environment variable `name` is set and its value starts with `c` (the A/B switches:
// RLX_<FAMILY>_CUDA_<VARIANT>=0 or 1). Callers read it once per process into a static.
inline bool env_starts_with(const char* name, char c) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == c;
}

}  // namespace rlx
