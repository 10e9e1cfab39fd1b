// 2-D pooling over the last two axes of x [P..., H, W] (every leading index is a plane),
// window (kh, kw), stride (sh, sw), padding (ph, pw) on both sides:
//   Ho = (H + 2 ph - kh) / sh + 1, window (i, j) covers rows i*sh - ph + [0, kh) and
//   columns j*sw - pw + [0, kw).
//
// rlx_max_pool2d_fwd: y = window max (padding is -inf) and argmax = flat in-plane index
//   h * W + w of the window's FIRST maximum in row-major window order (strictly greater
//   than every earlier value, starting from -inf), or -1 when nothing exceeds -inf.
// rlx_max_pool2d_bwd: dx[p, argmax[p, o]] += dy[p, o]; each task owns whole planes, so
//   there are no races, and a plane's sums are added in output order (deterministic).
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

template <typename T>
void max_fwd_typed(ffi::ThreadPool& pool, const T* x, T* y, int32_t* am, PlaneView v, const Geom& g,
                   int64_t ho, int64_t wo) {
  using A = typename Accum<T>::type;
  const int64_t tasks = plane_tasks(v.planes, v.h * v.w);
  parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t p0 = v.planes * t / tasks, p1 = v.planes * (t + 1) / tasks;
    for (int64_t p = p0; p < p1; ++p) {
      const T* xp = x + p * v.h * v.w;
      T* yp = y + p * ho * wo;
      int32_t* ap = am + p * ho * wo;
      for (int64_t i = 0; i < ho; ++i) {
        const int64_t r0 = std::max<int64_t>(i * g.sh - g.ph, 0);
        const int64_t r1 = std::min<int64_t>(i * g.sh - g.ph + g.kh, v.h);
        for (int64_t j = 0; j < wo; ++j) {
          const int64_t c0 = std::max<int64_t>(j * g.sw - g.pw, 0);
          const int64_t c1 = std::min<int64_t>(j * g.sw - g.pw + g.kw, v.w);
          A best = -std::numeric_limits<A>::infinity();
          int32_t arg = -1;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; ++c) {
              const A val = load<A>(xp[r * v.w + c]);
              if (val > best) { best = val; arg = int32_t(r * v.w + c); }
            }
          yp[i * wo + j] = arg >= 0 ? xp[arg] : store<T>(best);
          ap[i * wo + j] = arg;
        }
      }
    }
  });
}

template <typename T>
void max_bwd_typed(ffi::ThreadPool& pool, const T* dy, const int32_t* am, T* dx, PlaneView v,
                   int64_t n_out) {
  using A = typename Accum<T>::type;
  const int64_t hw = v.h * v.w;
  const int64_t tasks = plane_tasks(v.planes, hw);
  parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t p0 = v.planes * t / tasks, p1 = v.planes * (t + 1) / tasks;
    std::vector<A> acc(hw);
    for (int64_t p = p0; p < p1; ++p) {
      std::fill(acc.begin(), acc.end(), A(0));
      const T* dyp = dy + p * n_out;
      const int32_t* ap = am + p * n_out;
      for (int64_t o = 0; o < n_out; ++o) {
        const int32_t a = ap[o];
        if (a >= 0 && a < hw) acc[a] += load<A>(dyp[o]);
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
  PoolShape s;
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = pool::check_max_fwd(x, *y, *argmax, g, &s); e.failure()) return e;
  const PlaneView v = s.v;
  const int64_t ho = s.ho, wo = s.wo;
  if (v.planes == 0 || ho == 0 || wo == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    max_fwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
                     static_cast<int32_t*>(argmax->untyped_data()), v, g, ho, wo);
  });
  if (!ok) return invalid("max_pool2d: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error MaxPoolBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer argmax,
                          ffi::Result<ffi::AnyBuffer> dx) {
  if (argmax.element_type() != ffi::DataType::S32 || !same_dims(dy, argmax))
    return invalid("max_pool2d backward: argmax must be i32 shaped like dy");
  if (dx->element_type() != dy.element_type()) return invalid("max_pool2d backward: dx dtype must match dy");
  auto dd = dy.dimensions(), dxd = dx->dimensions();
  if (dd.size() < 2 || dxd.size() != dd.size())
    return invalid("max_pool2d backward: dy and dx must have equal rank >= 2");
  for (size_t i = 0; i + 2 < dd.size(); ++i)
    if (dd[i] != dxd[i]) return invalid("max_pool2d backward: leading (plane) dims differ");
  const PlaneView v = plane_view(*dx);
  const int64_t n_out = dd[dd.size() - 2] * dd[dd.size() - 1];
  if (v.planes == 0 || v.h * v.w == 0) return ffi::Error::Success();
  bool ok = dispatch_float(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    max_bwd_typed<T>(pool, static_cast<const T*>(dy.untyped_data()),
                     static_cast<const int32_t*>(argmax.untyped_data()), static_cast<T*>(dx->untyped_data()),
                     v, n_out);
  });
  if (!ok) return invalid("max_pool2d backward: unsupported dtype " + dtype_name(dy.element_type()));
  return ffi::Error::Success();
}

ffi::Error AvgPoolBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                          int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  PoolShape s;
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
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // argmax
                                  .Attr<int64_t>("kh")
                                  .Attr<int64_t>("kw")
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("ph")
                                  .Attr<int64_t>("pw"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxMaxPool2dBwd, MaxPoolBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // dy
                                  .Arg<ffi::AnyBuffer>()    // argmax
                                  .Ret<ffi::AnyBuffer>());  // dx

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAvgPool2dBwd, AvgPoolBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<int64_t>("kh")
                                  .Attr<int64_t>("kw")
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("ph")
                                  .Attr<int64_t>("pw"));

RLX_REGISTER_HANDLER("rlx_max_pool2d_fwd", RlxMaxPool2dFwd);
RLX_REGISTER_HANDLER("rlx_max_pool2d_bwd", RlxMaxPool2dBwd);
RLX_REGISTER_HANDLER("rlx_avg_pool2d_bwd", RlxAvgPool2dBwd);

}  // namespace rlx
