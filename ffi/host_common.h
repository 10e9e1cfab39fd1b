// Host-side helpers shared by the CPU handlers (ffi/cpu/common.h) and the CUDA handlers
// (ffi/cuda/common.cuh): dtype names for error messages, shape equality, the rows x width
// view of a buffer, the InvalidArgument error every handler returns for bad operands, and
// the test of the environment switches that select kernel variants for A/B timing. Plain C++ (no CUDA, no x86
// intrinsics), so both builds include it (-I ffi), as do the family headers shared by both
// builds (the ffi/<family>_checks.h operand checks, ffi/pool_geometry.h).
#pragma once

#include <algorithm>
#include <cstdint>
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

// Which build a handler belongs to, where the two accept different operands: the CPU
// handlers keep f64 statistics (a norm's mean and rstd, a log-sum-exp) for f64 inputs; the
// CUDA handlers (f32, bf16 and f16 kernels) keep f32 statistics.
enum class Backend { kCpu, kCuda };

inline ffi::DataType stat_dtype(Backend b, ffi::DataType input) {
  return b == Backend::kCpu && input == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}
// The rule of stat_dtype as the error messages state it; `input` names the input operand.
inline std::string stat_dtype_rule(Backend b, const char* input = "x") {
  return b == Backend::kCpu ? std::string("f32 (f64 for f64 ") + input + ")" : std::string("f32");
}
// The message prefix of a check whose rule depends on the build: "op" or "op (cuda)".
inline std::string backend_op(Backend b, const char* op) {
  return b == Backend::kCpu ? std::string(op) : std::string(op) + " (cuda)";
}

// Rows x width view of a buffer [R.., W]: rows = prod(R..), width = W (all leading axes are
// rows, the last is the width); a scalar is one row of one element.
struct RowsView {
  int64_t rows;
  int64_t width;
};
inline RowsView rows_view(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  if (d.size() == 0) return {1, 1};
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) rows *= d[i];
  return {rows, d.back()};
}

// Whether environment variable `name` is set and its value starts with `c` (the A/B switches:
// RLX_<FAMILY>_CUDA_<VARIANT>=0 or 1). Callers read it once per process into a static.
inline bool env_starts_with(const char* name, char c) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == c;
}

}  // namespace rlx
