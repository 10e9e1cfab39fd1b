// Operand checks of rlx_fake_quantize_bwd and rlx_fake_quantize_lsq_bwd, shared by the CPU
// (ffi/cpu/quantize.cc) and CUDA (ffi/cuda/quantize.cu) handlers. Plain C++17 (host side of
// both builds).
//
//   x, dy, dx: [G, O, C, I] of one floating dtype; scale, dscale: [G, C] of stat_dtype
//   (host_common.h); q_max >= 1; the STE code is 0..3.
#pragma once

#include <string>

#include "host_common.h"

namespace rlx {
namespace quantize {

struct Shape {
  int64_t g, o, c, i;  // G, O, C, I
};

inline ffi::Error check_x_scale(Backend b, const char* who, const ffi::AnyBuffer& x, const ffi::AnyBuffer& s,
                                Shape& shape) {
  auto dx = x.dimensions(), ds = s.dimensions();
  if (dx.size() != 4) return invalid(std::string(who) + ": x must be [G, O, C, I]");
  if (ds.size() != 2 || ds[0] != dx[0] || ds[1] != dx[2])
    return invalid(std::string(who) + ": scale must be [G, C] for x [G, O, C, I]");
  if (s.element_type() != stat_dtype(b, x.element_type()))
    return invalid(backend_op(b, who) + ": scale must be " + stat_dtype_rule(b));
  shape = {dx[0], dx[1], dx[2], dx[3]};
  return ffi::Error::Success();
}

inline ffi::Error check_dy_dx(const char* who, const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                              const ffi::AnyBuffer& dx) {
  if (!same_dims(x, dy) || dy.element_type() != x.element_type() || !same_dims(x, dx) ||
      dx.element_type() != x.element_type())
    return invalid(std::string(who) + ": dy and dx must match x in shape and dtype");
  return ffi::Error::Success();
}

// rlx_fake_quantize_bwd: x, scale, dy -> dx.
inline ffi::Error check_ste_bwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& s, const ffi::AnyBuffer& dy,
                                const ffi::AnyBuffer& dx, float q_max, int64_t ste, Shape& shape) {
  const char* who = "fake_quantize backward";
  if (auto e = check_x_scale(b, who, x, s, shape); e.failure()) return e;
  if (auto e = check_dy_dx(who, x, dy, dx); e.failure()) return e;
  if (ste < 0 || ste > 3) return invalid("fake_quantize backward: ste code must be 0..3");
  if (!(q_max >= 1.0f)) return invalid("fake_quantize backward: q_max must be >= 1");
  return ffi::Error::Success();
}

// rlx_fake_quantize_lsq_bwd: x, scale, dy -> dx, dscale.
inline ffi::Error check_lsq_bwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& s, const ffi::AnyBuffer& dy,
                                const ffi::AnyBuffer& dx, const ffi::AnyBuffer& ds, float q_max, Shape& shape) {
  const char* who = "fake_quantize_lsq backward";
  if (auto e = check_x_scale(b, who, x, s, shape); e.failure()) return e;
  if (auto e = check_dy_dx(who, x, dy, dx); e.failure()) return e;
  if (!same_dims(s, ds) || ds.element_type() != s.element_type())
    return invalid("fake_quantize_lsq backward: dscale must match scale");
  if (!(q_max >= 1.0f)) return invalid("fake_quantize_lsq backward: q_max must be >= 1");
  return ffi::Error::Success();
}

}  // namespace quantize
}  // namespace rlx
