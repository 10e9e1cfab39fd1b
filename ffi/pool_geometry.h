// 2-D pooling geometry shared by the CPU (ffi/cpu/pool.cc) and CUDA (ffi/cuda/pool.cu)
// handlers: host-side shape checks and the covering-window range. Plain C++ (no CUDA, no
// x86 intrinsics), so both builds include it (-I ffi).
//
// x [P..., H, W] (every leading index is a plane), window (kh, kw), stride (sh, sw),
// padding (ph, pw) on both sides: Ho = (H + 2 ph - kh) / sh + 1 (Wo likewise); window
// (i, j) covers rows i*sh - ph + [0, kh) and columns j*sw - pw + [0, kw).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "host_common.h"
#include "xla/ffi/api/ffi.h"

namespace rlx {
namespace pool {
namespace ffi = xla::ffi;

struct Geom {
  int64_t kh, kw, sh, sw, ph, pw;
};

#ifdef __CUDACC__
#define RLX_POOL_HD __host__ __device__
#else
#define RLX_POOL_HD
#endif

// Whether v replaces the running maximum `best` of a max-pool window scanned in row-major
// order: v is larger, or v is the window's first NaN. So a window holding a NaN gives NaN
// (as XLA's max and jnp.max do) and its argmax, where the gradient goes, is the first NaN
// (as jnp.argmax's); among equal maxima the first wins. No fast-math flag of either build
// folds the `v != v` tests away.
template <typename A>
RLX_POOL_HD inline bool beats_max(A v, A best) {
  return v > best || (v != v && best == best);
}

// Adds the six window-geometry attributes every pooling handler takes to an FFI binding, in
// the order of the handlers' parameters: kh, kw, sh, sw, ph, pw.
template <typename Binding>
auto bind_geometry(Binding&& b) {
  return std::forward<Binding>(b)
      .template Attr<int64_t>("kh")
      .template Attr<int64_t>("kw")
      .template Attr<int64_t>("sh")
      .template Attr<int64_t>("sw")
      .template Attr<int64_t>("ph")
      .template Attr<int64_t>("pw");
}

// The buffer seen as `planes` planes of h x w (the last two axes).
struct PlaneView {
  int64_t planes, h, w;
};

inline PlaneView plane_view(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  int64_t planes = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) planes *= d[i];
  return {planes, d[d.size() - 2], d[d.size() - 1]};
}

// Pooled length of one axis.
inline int64_t pooled(int64_t n, int64_t k, int64_t s, int64_t p) { return (n + 2 * p - k) / s + 1; }

inline ffi::Error check_geom(const char* who, const Geom& g) {
  if (g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1 || g.ph < 0 || g.pw < 0)
    return ffi::Error::InvalidArgument(std::string(who) + ": kernel and stride must be >= 1, padding >= 0");
  return ffi::Error::Success();
}

// `in` [P..., H, W] and `out` [P..., Ho, Wo]: same planes, (Ho, Wo) the pooled size of (H, W).
inline ffi::Error check_pair(const char* who, const ffi::AnyBuffer& in, const ffi::AnyBuffer& out, const Geom& g) {
  auto di = in.dimensions(), dout = out.dimensions();
  if (di.size() < 2 || dout.size() != di.size())
    return ffi::Error::InvalidArgument(std::string(who) + ": operands must have equal rank >= 2 ([..., H, W])");
  for (size_t i = 0; i + 2 < di.size(); ++i)
    if (di[i] != dout[i]) return ffi::Error::InvalidArgument(std::string(who) + ": leading (plane) dims differ");
  const int64_t h = di[di.size() - 2], w = di[di.size() - 1];
  if (h + 2 * g.ph < g.kh || w + 2 * g.pw < g.kw)
    return ffi::Error::InvalidArgument(std::string(who) + ": kernel larger than the padded input");
  if (dout[di.size() - 2] != pooled(h, g.kh, g.sh, g.ph) || dout[di.size() - 1] != pooled(w, g.kw, g.sw, g.pw))
    return ffi::Error::InvalidArgument(std::string(who) + ": pooled dims do not match the window geometry");
  return ffi::Error::Success();
}

// A pooled operand pair as the handlers use it: the input-side buffer seen as planes of
// h x w, and the pooled extents (Ho, Wo).
struct PoolShape {
  PlaneView v;
  int64_t ho, wo;
};

inline PoolShape pool_shape(const ffi::AnyBuffer& in, const ffi::AnyBuffer& out) {
  auto d = out.dimensions();
  return {plane_view(in), d[d.size() - 2], d[d.size() - 1]};
}

// The saved argmax's encoding: window-local int8 a = (h - i*sh + ph) * kw + (w - j*sw + pw)
// (padding positions counted) where the window has at most 127 positions, else the i32 flat
// in-plane index h * W + w; -1 for a window with no element above -inf either way. The
// Python side (argmax_dtype in rlx_jax/vjp_rules/pool.py) makes the same choice.
inline bool local_argmax(const Geom& g) { return g.kh <= 127 && g.kw <= 127 && g.kh * g.kw <= 127; }

inline ffi::DataType argmax_type(const Geom& g) { return local_argmax(g) ? ffi::DataType::S8 : ffi::DataType::S32; }

inline ffi::Error check_argmax(const char* who, const ffi::AnyBuffer& argmax, const ffi::AnyBuffer& pooled,
                               const Geom& g) {
  if (argmax.element_type() != argmax_type(g) || !same_dims(pooled, argmax))
    return ffi::Error::InvalidArgument(std::string(who) + (local_argmax(g) ? ": argmax must be i8 (kh * kw <= 127)"
                                                                           : ": argmax must be i32 (kh * kw > 127)") +
                                       " shaped like the pooled output");
  return ffi::Error::Success();
}

// rlx_max_pool2d_fwd's operands (CPU and CUDA): x [P..., H, W] -> y [P..., Ho, Wo] of x's
// dtype and the argmax shaped like y (i8 or i32 by the geometry, see local_argmax); flat
// in-plane indices must fit an i32.
inline ffi::Error check_max_fwd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, const ffi::AnyBuffer& argmax,
                                const Geom& g, PoolShape* s) {
  if (auto e = check_geom("max_pool2d", g); e.failure()) return e;
  if (auto e = check_pair("max_pool2d", x, y, g); e.failure()) return e;
  if (y.element_type() != x.element_type()) return ffi::Error::InvalidArgument("max_pool2d: y dtype must match x");
  if (auto e = check_argmax("max_pool2d", argmax, y, g); e.failure()) return e;
  *s = pool_shape(x, y);
  if (s->v.h * s->v.w > int64_t(INT32_MAX))
    return ffi::Error::InvalidArgument("max_pool2d: a plane of more than 2^31 - 1 elements does not fit an i32 argmax");
  return ffi::Error::Success();
}

// rlx_max_pool2d_bwd's operands (CPU and CUDA): dy [P..., Ho, Wo], argmax shaped like dy
// (i8 or i32 by the geometry) -> dx [P..., H, W] of dy's dtype, (Ho, Wo) the pooled size
// of (H, W).
inline ffi::Error check_max_bwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& argmax, const ffi::AnyBuffer& dx,
                                const Geom& g, PoolShape* s) {
  if (auto e = check_geom("max_pool2d backward", g); e.failure()) return e;
  if (auto e = check_pair("max_pool2d backward", dx, dy, g); e.failure()) return e;
  if (auto e = check_argmax("max_pool2d backward", argmax, dy, g); e.failure()) return e;
  if (dx.element_type() != dy.element_type())
    return ffi::Error::InvalidArgument("max_pool2d backward: dx dtype must match dy");
  *s = pool_shape(dx, dy);
  if (s->v.h * s->v.w > int64_t(INT32_MAX))
    return ffi::Error::InvalidArgument(
        "max_pool2d backward: a plane of more than 2^31 - 1 elements does not fit an i32 argmax");
  return ffi::Error::Success();
}

// rlx_avg_pool2d_bwd's operands (CPU and CUDA): dy [P..., Ho, Wo] -> dx [P..., H, W] of dy's
// dtype, (Ho, Wo) the pooled size of (H, W).
inline ffi::Error check_avg_bwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dx, const Geom& g, PoolShape* s) {
  if (auto e = check_geom("avg_pool2d backward", g); e.failure()) return e;
  if (auto e = check_pair("avg_pool2d backward", dx, dy, g); e.failure()) return e;
  if (dx.element_type() != dy.element_type())
    return ffi::Error::InvalidArgument("avg_pool2d backward: dx dtype must match dy");
  *s = pool_shape(dx, dy);
  return ffi::Error::Success();
}

// Outputs whose windows cover input coordinate n along one axis: [lo, hi) within [0, out)
// (hi == lo when none). Window i covers i*s - p + [0, k): i*s <= n + p and
// i*s >= n + p - k + 1.
inline void covering(int64_t n, int64_t k, int64_t s, int64_t p, int64_t out, int64_t* lo, int64_t* hi) {
  const int64_t top = n + p, bottom = top - k + 1;
  const int64_t first = bottom <= 0 ? 0 : (bottom + s - 1) / s;
  const int64_t last = top < 0 ? -1 : top / s;
  *lo = first;
  *hi = last + 1 < out ? last + 1 : out;
  if (*hi < *lo) *hi = *lo;
}

}  // namespace pool
}  // namespace rlx
