// 2-D pooling over the last two axes of x [P..., H, W] (every leading index is a plane),
// window (kh, kw), stride (sh, sw), padding (ph, pw) on both sides:
//   Ho = (H + 2 ph - kh) / sh + 1, window (i, j) covers rows i*sh - ph + [0, kh) and
//   columns j*sw - pw + [0, kw).
//
// rlx_max_pool2d_fwd: y = window max (padding is -inf) and argmax = the window's FIRST
//   maximum in row-major window order (strictly greater than every earlier value,
//   starting from -inf), or -1 when nothing exceeds -inf. The index is window-local int8
//   (r - i*sh + ph) * kw + (c - j*sw + pw) where kh * kw <= 127, else the i32 flat
//   in-plane index r * W + c (pool::local_argmax).
// rlx_max_pool2d_bwd: dy, argmax and the geometry attrs (kh kw sh sw ph pw, as the
//   forward): dx[p, flat(argmax[p, o])] += dy[p, o]; each task owns whole planes, so
//   there are no races, and a plane's sums are added in output order (deterministic). An
//   index outside its window or plane (never written by the forward) passes no gradient.
// rlx_avg_pool2d_bwd: dx[h, w] = sum over the windows covering (h, w) of dy / (kh kw)
//   (RLX Pool{Mean}: count_include_pad); each dx element is written once, gathered from
//   the rectangle of outputs whose windows cover it.
#include <cmath>
#include <limits>

#include "cpu/common.h"
#include "pool_geometry.h"

namespace rlx {
namespace {

using pool::covering;
using pool::Geom;
using pool::plane_view;
using pool::PlaneView;
using pool::PoolShape;

// Plane tasks: enough to spread over the pool, few enough to keep per-task work large.
int64_t plane_tasks(int64_t planes, int64_t plane_size) {
  return row_chunks(planes, plane_size, 1024);
}

// I = int8_t: window-local index; I = int32_t: flat in-plane index.
template <typename T, typename I>
void max_fwd_typed(ffi::ThreadPool& pool, const T* x, T* y, I* am, PlaneView v, const Geom& g, int64_t ho,
                   int64_t wo) {
  using A = typename Accum<T>::type;
  constexpr bool kLocal = sizeof(I) == 1;
  const int64_t tasks = plane_tasks(v.planes, v.h * v.w);
  parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t p0 = v.planes * t / tasks, p1 = v.planes * (t + 1) / tasks;
    for (int64_t p = p0; p < p1; ++p) {
      const T* xp = x + p * v.h * v.w;
      T* yp = y + p * ho * wo;
      I* ap = am + p * ho * wo;
      for (int64_t i = 0; i < ho; ++i) {
        const int64_t rs = i * g.sh - g.ph;
        const int64_t r0 = std::max<int64_t>(rs, 0);
        const int64_t r1 = std::min<int64_t>(rs + g.kh, v.h);
        for (int64_t j = 0; j < wo; ++j) {
          const int64_t cs = j * g.sw - g.pw;
          const int64_t c0 = std::max<int64_t>(cs, 0);
          const int64_t c1 = std::min<int64_t>(cs + g.kw, v.w);
          A best = -std::numeric_limits<A>::infinity();
          // the index as it is saved: flat r * W + c, or local (r - rs) * kw + (c - cs);
          // y is the maximum itself (load / store of T through A are exact)
          int32_t arg = -1;
          for (int64_t r = r0; r < r1; ++r) {
            const T* row = xp + r * v.w;
            const int32_t base = int32_t(kLocal ? (r - rs) * g.kw - cs : r * v.w);
            for (int64_t c = c0; c < c1; ++c) {
              const A val = load<A>(row[c]);
              if (pool::beats_max(val, best)) { best = val; arg = base + int32_t(c); }
            }
          }
          yp[i * wo + j] = store<T>(best);
          ap[i * wo + j] = I(arg);
        }
      }
    }
  });
}

template <typename T, typename I>
void max_bwd_typed(ffi::ThreadPool& pool, const T* dy, const I* am, T* dx, PlaneView v, const Geom& g,
                   int64_t ho, int64_t wo) {
  using A = typename Accum<T>::type;
  constexpr bool kLocal = sizeof(I) == 1;
  const int64_t hw = v.h * v.w, n_out = ho * wo, win = g.kh * g.kw;
  // the window row and column of each local index and its offset in the plane from the
  // window's top-left element (no division per output)
  int wrow[128] = {}, wcol[128] = {};
  int64_t woff[128] = {};
  if (kLocal)
    for (int64_t a = 0; a < win && a < 128; ++a) {
      wrow[a] = int(a / g.kw);
      wcol[a] = int(a % g.kw);
      woff[a] = wrow[a] * v.w + wcol[a];
    }
  const int64_t tasks = plane_tasks(v.planes, hw);
  parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t p0 = v.planes * t / tasks, p1 = v.planes * (t + 1) / tasks;
    std::vector<A> acc(hw);
    for (int64_t p = p0; p < p1; ++p) {
      std::fill(acc.begin(), acc.end(), A(0));
      const T* dyp = dy + p * n_out;
      const I* ap = am + p * n_out;
      if constexpr (kLocal) {
        for (int64_t i = 0; i < ho; ++i) {
          const int64_t rs = i * g.sh - g.ph;
          const bool rows_in = rs >= 0 && rs + g.kh <= v.h;
          for (int64_t j = 0; j < wo; ++j) {
            const int a = ap[i * wo + j];
            if (unsigned(a) >= unsigned(win)) continue;
            const int64_t cs = j * g.sw - g.pw;
            if (rows_in && cs >= 0 && cs + g.kw <= v.w) {  // the window lies in the plane
              acc[rs * v.w + cs + woff[a]] += load<A>(dyp[i * wo + j]);
              continue;
            }
            const int64_t r = rs + wrow[a], c = cs + wcol[a];
            if (r < 0 || r >= v.h || c < 0 || c >= v.w) continue;  // in the padding: never saved
            acc[r * v.w + c] += load<A>(dyp[i * wo + j]);
          }
        }
      } else {
        for (int64_t o = 0; o < n_out; ++o) {
          const int64_t a = ap[o];
          if (a >= 0 && a < hw) acc[a] += load<A>(dyp[o]);
        }
      }
      T* dxp = dx + p * hw;
      for (int64_t k = 0; k < hw; ++k) dxp[k] = store<T>(acc[k]);
    }
  });
}

template <typename T>
void avg_bwd_typed(ffi::ThreadPool& pool, const T* dy, T* dx, PlaneView v, const Geom& g,
                   int64_t ho, int64_t wo) {
  using A = typename Accum<T>::type;
  const A inv = A(1) / A(g.kh * g.kw);
  std::vector<int64_t> rlo(v.h), rhi(v.h), clo(v.w), chi(v.w);
  for (int64_t r = 0; r < v.h; ++r) covering(r, g.kh, g.sh, g.ph, ho, &rlo[r], &rhi[r]);
  for (int64_t c = 0; c < v.w; ++c) covering(c, g.kw, g.sw, g.pw, wo, &clo[c], &chi[c]);
  const int64_t tasks = plane_tasks(v.planes, v.h * v.w);
  parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t p0 = v.planes * t / tasks, p1 = v.planes * (t + 1) / tasks;
    // colsum[i][c] = sum_{j covering c} dy[i, j]: the row-direction pass, then columns.
    std::vector<A> colsum(ho * v.w);
    for (int64_t p = p0; p < p1; ++p) {
      const T* dyp = dy + p * ho * wo;
      T* dxp = dx + p * v.h * v.w;
      for (int64_t i = 0; i < ho; ++i) {
        const T* dyr = dyp + i * wo;
        A* cs = colsum.data() + i * v.w;
        for (int64_t c = 0; c < v.w; ++c) {
          A s = 0;
          for (int64_t j = clo[c]; j < chi[c]; ++j) s += load<A>(dyr[j]);
          cs[c] = s;
        }
      }
      for (int64_t r = 0; r < v.h; ++r) {
        T* dxr = dxp + r * v.w;
        if (rlo[r] == rhi[r]) {
          for (int64_t c = 0; c < v.w; ++c) dxr[c] = store<T>(A(0));
          continue;
        }
        const A* first = colsum.data() + rlo[r] * v.w;
        if (rhi[r] - rlo[r] == 1) {
          for (int64_t c = 0; c < v.w; ++c) dxr[c] = store<T>(first[c] * inv);
          continue;
        }
        for (int64_t c = 0; c < v.w; ++c) {
          A s = 0;
          for (int64_t i = rlo[r]; i < rhi[r]; ++i) s += colsum[i * v.w + c];
          dxr[c] = store<T>(s * inv);
        }
      }
    }
  });
}

ffi::Error MaxPoolFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> argmax, int64_t kh, int64_t kw, int64_t sh,
                          int64_t sw, int64_t ph, int64_t pw) {
  PoolShape s{};
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = pool::check_max_fwd(x, *y, *argmax, g, &s); e.failure()) return e;
  const PlaneView v = s.v;
  const int64_t ho = s.ho, wo = s.wo;
  if (v.planes == 0 || ho == 0 || wo == 0) return ffi::Error::Success();
  const bool local = pool::local_argmax(g);
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    T* yp = static_cast<T*>(y->untyped_data());
    if (local)
      max_fwd_typed<T, int8_t>(pool, xp, yp, static_cast<int8_t*>(argmax->untyped_data()), v, g, ho, wo);
    else
      max_fwd_typed<T, int32_t>(pool, xp, yp, static_cast<int32_t*>(argmax->untyped_data()), v, g, ho, wo);
  });
  if (!ok) return invalid("max_pool2d: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error MaxPoolBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer argmax,
                          ffi::Result<ffi::AnyBuffer> dx, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                          int64_t ph, int64_t pw) {
  PoolShape s{};
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = pool::check_max_bwd(dy, argmax, *dx, g, &s); e.failure()) return e;
  const PlaneView v = s.v;
  if (v.planes == 0 || v.h * v.w == 0) return ffi::Error::Success();
  const bool local = pool::local_argmax(g);
  bool ok = dispatch_float(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    if (local)
      max_bwd_typed<T, int8_t>(pool, dyp, static_cast<const int8_t*>(argmax.untyped_data()), dxp, v, g, s.ho, s.wo);
    else
      max_bwd_typed<T, int32_t>(pool, dyp, static_cast<const int32_t*>(argmax.untyped_data()), dxp, v, g, s.ho,
                                s.wo);
  });
  if (!ok) return invalid("max_pool2d backward: unsupported dtype " + dtype_name(dy.element_type()));
  return ffi::Error::Success();
}

ffi::Error AvgPoolBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                          int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  PoolShape s{};
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = pool::check_avg_bwd(dy, *dx, g, &s); e.failure()) return e;
  const PlaneView v = s.v;
  const int64_t ho = s.ho, wo = s.wo;
  if (v.planes == 0 || v.h * v.w == 0) return ffi::Error::Success();
  bool ok = dispatch_float(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    avg_bwd_typed<T>(pool, static_cast<const T*>(dy.untyped_data()), static_cast<T*>(dx->untyped_data()),
                     v, g, ho, wo);
  });
  if (!ok) return invalid("avg_pool2d backward: unsupported dtype " + dtype_name(dy.element_type()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxMaxPool2dFwd, MaxPoolFwdImpl,
                              pool::bind_geometry(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // argmax
                              ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxMaxPool2dBwd, MaxPoolBwdImpl,
                              pool::bind_geometry(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // argmax
                                  .Ret<ffi::AnyBuffer>()  // dx
                              ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAvgPool2dBwd, AvgPoolBwdImpl,
                              pool::bind_geometry(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                              ));

RLX_REGISTER_HANDLER("rlx_max_pool2d_fwd", RlxMaxPool2dFwd);
RLX_REGISTER_HANDLER("rlx_max_pool2d_bwd", RlxMaxPool2dBwd);
RLX_REGISTER_HANDLER("rlx_avg_pool2d_bwd", RlxAvgPool2dBwd);

}  // namespace rlx
