// Operand checks of rlx_group_norm_fwd / rlx_group_norm_bwd and the layout they imply,
// shared by the CPU (ffi/cpu/group_norm.cc) and CUDA (ffi/cuda/group_norm.cu) handlers. Plain
// C++17 (host side of both builds).
//
//   x, y, dy, dx: [N, C, S...] of one floating dtype (S = product of the trailing axes);
//   gamma, beta, dgamma, dbeta: [C] of x's dtype; G = num_groups >= 1 divides C; mean, rstd:
//   N * G values of stat_dtype (host_common.h); eps >= 0.
#pragma once

#include <string>

#include "norm_checks.h"

namespace rlx {
namespace group_norm {

// Block (n, g) is the contiguous run of m = k * s values x[n, g*k:(g+1)*k, ...].
struct Layout {
  int64_t n, c, s, groups, k, m;  // batch, channels, spatial, groups, channels/group, block
};

// Validates x [N, C, ...] against num_groups; fills the layout.
inline ffi::Error check_x(const ffi::AnyBuffer& x, int64_t num_groups, Layout& L) {
  auto d = x.dimensions();
  if (d.size() < 2) return invalid("group_norm: x must have rank >= 2 ([N, C, ...])");
  L.n = d[0];
  L.c = d[1];
  L.s = 1;
  for (size_t i = 2; i < d.size(); ++i) L.s *= d[i];
  if (num_groups < 1) return invalid("group_norm: num_groups must be >= 1");
  if (L.c % num_groups != 0)
    return invalid("group_norm: channels " + std::to_string(L.c) + " not divisible by num_groups " +
                   std::to_string(num_groups));
  L.groups = num_groups;
  L.k = L.c / num_groups;
  L.m = L.k * L.s;
  return ffi::Error::Success();
}

inline ffi::Error check_param(const ffi::AnyBuffer& x, const Layout& L, const ffi::AnyBuffer& p, const char* what) {
  return norm::check_param_vector("group_norm", x, p, what, L.c, "channel axis");
}

inline ffi::Error check_stat(Backend b, const ffi::AnyBuffer& x, const Layout& L, const ffi::AnyBuffer& s,
                             const char* what) {
  if (s.element_type() != stat_dtype(b, x.element_type()) || int64_t(s.element_count()) != L.n * L.groups)
    return invalid(backend_op(b, "group_norm") + ": " + what + " must be " + stat_dtype_rule(b) +
                   " with one value per (sample, group)");
  return ffi::Error::Success();
}

inline ffi::Error check_fwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                            const ffi::AnyBuffer& beta, const ffi::AnyBuffer& y, const ffi::AnyBuffer& mean,
                            const ffi::AnyBuffer& rstd, int64_t num_groups, double eps, Layout& L) {
  if (auto e = check_x(x, num_groups, L); e.failure()) return e;
  if (auto e = check_param(x, L, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_param(x, L, beta, "beta"); e.failure()) return e;
  if (auto e = norm::check_like_x(x, y, "group_norm: output y must match x"); e.failure()) return e;
  if (auto e = check_stat(b, x, L, mean, "mean"); e.failure()) return e;
  if (auto e = check_stat(b, x, L, rstd, "rstd"); e.failure()) return e;
  return norm::check_eps("group_norm", eps);
}

inline ffi::Error check_bwd(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                            const ffi::AnyBuffer& mean, const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dy,
                            const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dgamma, const ffi::AnyBuffer& dbeta,
                            int64_t num_groups, Layout& L) {
  if (auto e = check_x(x, num_groups, L); e.failure()) return e;
  if (auto e = check_param(x, L, gamma, "gamma"); e.failure()) return e;
  if (auto e = norm::check_like_x(x, dy, "group_norm backward: dy must match x in shape and dtype"); e.failure())
    return e;
  if (auto e = norm::check_like_x(x, dx, "group_norm backward: dx must match x"); e.failure()) return e;
  if (auto e = check_param(x, L, dgamma, "dgamma"); e.failure()) return e;
  if (auto e = check_param(x, L, dbeta, "dbeta"); e.failure()) return e;
  if (auto e = check_stat(b, x, L, mean, "mean"); e.failure()) return e;
  return check_stat(b, x, L, rstd, "rstd");
}

}  // namespace group_norm
}  // namespace rlx
