// Operand checks of rlx_rope_fwd / rlx_rope_bwd, shared by the CPU (ffi/cpu/rope.cc) and CUDA
// (ffi/cuda/rope.cu) handlers. Plain C++17 (host side of both builds).
//
//   x, y: [B, S, W] of one floating dtype, W = heads * head_dim; cos, sin: [S, T] of x's
//   dtype with T >= n_rot / 2; head_dim > 0; n_rot even in [0, head_dim].
#pragma once

#include <string>

#include "host_common.h"

namespace rlx {
namespace rope {

struct Shape {
  int64_t batch, seq, width, table_width;  // B, S, W, T
};

inline ffi::Error check(const ffi::AnyBuffer& x, const ffi::AnyBuffer& cos, const ffi::AnyBuffer& sin,
                        const ffi::AnyBuffer& y, int64_t head_dim, int64_t n_rot, Shape& shape) {
  auto dx = x.dimensions(), dc = cos.dimensions();
  if (dx.size() != 3) return invalid("rope: x must be [batch, seq, heads * head_dim]");
  if (head_dim <= 0 || n_rot < 0 || n_rot > head_dim || n_rot % 2 != 0)
    return invalid("rope: need head_dim > 0 and an even n_rot in [0, head_dim], got head_dim=" +
                   std::to_string(head_dim) + " n_rot=" + std::to_string(n_rot));
  const int64_t seq = dx[1], width = dx[2];
  if (width % head_dim != 0)
    return invalid("rope: the last axis of x (" + std::to_string(width) + ") must be a multiple of head_dim (" +
                   std::to_string(head_dim) + ")");
  if (dc.size() != 2 || dc[0] != seq || dc[1] < n_rot / 2)
    return invalid("rope: cos must be [seq=" + std::to_string(seq) + ", >= n_rot/2=" + std::to_string(n_rot / 2) +
                   "]");
  if (!same_dims(cos, sin)) return invalid("rope: sin must have the shape of cos");
  if (cos.element_type() != x.element_type() || sin.element_type() != x.element_type())
    return invalid("rope: cos and sin must have x's dtype " + dtype_name(x.element_type()));
  if (!same_dims(x, y) || y.element_type() != x.element_type()) return invalid("rope: output must match x");
  shape = {dx[0], seq, width, dc[1]};
  return ffi::Error::Success();
}

}  // namespace rope
}  // namespace rlx
