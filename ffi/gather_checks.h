// Operand checks of rlx_gather_bwd (the scatter-add of dy rows into d_table), shared by the
// CPU (ffi/cpu/gather.cc) and CUDA (ffi/cuda/gather.cu) handlers. Plain C++17 (host side of
// both builds).
//
//   dy: [O, K, T]; d_table: [O, V, T] of dy's floating dtype; index vectors (the indices on
//   the CPU, the sorted indices and their sort order on CUDA): i32 [K].
#pragma once

#include <string>

#include "host_common.h"

namespace rlx {
namespace gather {

struct Shape {
  int64_t o, k, t, v;  // O, K, T, V
};

inline ffi::Error check_dy_and_d_table(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& d_table, Shape& shape) {
  auto dd = dy.dimensions(), dt = d_table.dimensions();
  if (dd.size() != 3 || dt.size() != 3) return invalid("gather backward: dy and d_table must be [O, K, T] / [O, V, T]");
  if (dt[0] != dd[0] || dt[2] != dd[2]) return invalid("gather backward: d_table must be [O, V, T] for dy [O, K, T]");
  if (d_table.element_type() != dy.element_type()) return invalid("gather backward: d_table dtype must match dy");
  shape = {dd[0], dd[1], dd[2], dt[1]};
  return ffi::Error::Success();
}

// An i32 [K] vector; `what` completes the message's subject: "gather backward<what> must be
// i32 [K] ...", e.g. ": indices".
inline ffi::Error check_index_vector(const ffi::AnyBuffer& idx, const Shape& shape, const std::string& what) {
  auto di = idx.dimensions();
  if (idx.element_type() != ffi::DataType::S32 || di.size() != 1 || di[0] != shape.k)
    return invalid("gather backward" + what + " must be i32 [K] with K = dy.shape[1]");
  return ffi::Error::Success();
}

// With nothing to write (O, V or T zero), the only error left: K > 0 indices into an empty
// axis V of a non-empty table.
inline ffi::Error check_empty_table(const Shape& shape) {
  if (shape.k > 0 && shape.v == 0 && shape.o * shape.t > 0) return invalid("gather backward: indices into an empty axis");
  return ffi::Error::Success();
}

}  // namespace gather
}  // namespace rlx
