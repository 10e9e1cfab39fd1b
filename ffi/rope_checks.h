// Operand checks of rlx_rope_fwd / rlx_rope_bwd / rlx_rope_split / rlx_rope_merge, shared by the
// CPU (ffi/cpu/rope.cc) and CUDA (ffi/cuda/rope.cu) handlers. Plain C++17 (host side of both builds).
//
//   x, y: [B, S, W] of one floating dtype, W = heads * head_dim; cos, sin: [S, T] of x's
//   dtype with T >= n_rot / 2; head_dim > 0; n_rot even in [0, head_dim].
//   split / merge: x [B, S, W] (the packed row) and parts [B, S, W_p] of x's dtype, each W_p a
//   multiple of head_dim, sum W_p = W; rotate_mask's bits above the part count are zero.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

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

// The most parts a split or merge takes (the CUDA kernel's part table is a launch argument).
constexpr int kMaxParts = 8;

// A call's parts: the packed row's width, each part's width (one part of width W for rope),
// which parts rotate, and the table.
struct PartsShape {
  int64_t batch, seq, width, table_width, head_dim, n_rot;
  std::vector<int64_t> widths;
  int64_t rotate_mask;
};

inline PartsShape single_part(const Shape& s, int64_t head_dim, int64_t n_rot) {
  return {s.batch, s.seq, s.width, s.table_width, head_dim, n_rot, {s.width}, 1};
}

// Checks the packed x [B, S, W] (cos / sin as in `check`) against the parts [B, S, W_p].
inline ffi::Error check_parts(const ffi::AnyBuffer& x, const ffi::AnyBuffer& cos, const ffi::AnyBuffer& sin,
                              const std::vector<ffi::AnyBuffer>& parts, int64_t head_dim, int64_t n_rot,
                              int64_t rotate_mask, PartsShape& shape) {
  Shape sh{};
  if (auto e = check(x, cos, sin, x, head_dim, n_rot, sh); e.failure()) return e;
  const int64_t count = int64_t(parts.size());
  if (count < 1 || count > kMaxParts)
    return invalid("rope_split / rope_merge: need 1 to " + std::to_string(kMaxParts) + " parts, got " + std::to_string(count));
  if (rotate_mask < 0 || (rotate_mask >> count) != 0)
    return invalid("rope_split / rope_merge: rotate_mask " + std::to_string(rotate_mask) + " has bits beyond the " +
                   std::to_string(count) + " parts");
  std::vector<int64_t> widths;
  int64_t total = 0;
  for (int64_t p = 0; p < count; ++p) {
    auto d = parts[size_t(p)].dimensions();
    if (d.size() != 3 || d[0] != sh.batch || d[1] != sh.seq || d[2] % head_dim != 0 ||
        parts[size_t(p)].element_type() != x.element_type())
      return invalid("rope_split / rope_merge: part " + std::to_string(p) + " must be [batch, seq, heads_p * head_dim] of x's dtype");
    widths.push_back(d[2]);
    total += d[2];
  }
  if (total != sh.width)
    return invalid("rope_split / rope_merge: the parts' widths sum to " + std::to_string(total) + ", x's last axis is " +
                   std::to_string(sh.width));
  shape = {sh.batch, sh.seq, sh.width, sh.table_width, head_dim, n_rot, widths, rotate_mask};
  return ffi::Error::Success();
}

// The variadic parts of a split (its results) or a merge (its operands), checked against the
// packed x by `check_parts`; `data` gets each part's device / host pointer.
template <typename Remaining>
inline ffi::Error gather_parts(const Remaining& remaining, const ffi::AnyBuffer& x, const ffi::AnyBuffer& cos,
                               const ffi::AnyBuffer& sin, int64_t head_dim, int64_t n_rot, int64_t rotate_mask,
                               PartsShape& shape, std::vector<void*>& data) {
  std::vector<ffi::AnyBuffer> parts;
  for (size_t i = 0; i < remaining.size(); ++i) {
    auto part = remaining.template get<ffi::AnyBuffer>(i);
    if (part.has_error()) return part.error();
    if constexpr (std::is_same_v<Remaining, ffi::RemainingRets>) {
      parts.push_back(**part);  // a result: ErrorOr<Result<AnyBuffer>>
    } else {
      parts.push_back(*part);
    }
  }
  if (auto e = check_parts(x, cos, sin, parts, head_dim, n_rot, rotate_mask, shape); e.failure()) return e;
  data.clear();
  for (auto& b : parts) data.push_back(b.untyped_data());
  return ffi::Error::Success();
}

}  // namespace rope
}  // namespace rlx
