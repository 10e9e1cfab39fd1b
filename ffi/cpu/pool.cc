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

namespace rlx {
namespace {

struct Geom {
  int64_t kh, kw, sh, sw, ph, pw;
};

struct PlaneView {
  int64_t planes, h, w;
};

PlaneView plane_view(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  int64_t planes = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) planes *= d[i];
  return {planes, d[d.size() - 2], d[d.size() - 1]};
}

int64_t pooled(int64_t n, int64_t k, int64_t s, int64_t p) { return (n + 2 * p - k) / s + 1; }

ffi::Error check_geom(const char* who, const Geom& g) {
  if (g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1 || g.ph < 0 || g.pw < 0)
    return invalid(std::string(who) + ": kernel and stride must be >= 1, padding >= 0");
  return ffi::Error::Success();
}

// Checks that `in` [P..., H, W] and `out` [P..., Ho, Wo] agree on the planes and that
// (Ho, Wo) is the pooled size of (H, W).
ffi::Error check_pair(const char* who, const ffi::AnyBuffer& in, const ffi::AnyBuffer& out,
                      const Geom& g) {
  auto di = in.dimensions(), dout = out.dimensions();
  if (di.size() < 2 || dout.size() != di.size())
    return invalid(std::string(who) + ": operands must have equal rank >= 2 ([..., H, W])");
  for (size_t i = 0; i + 2 < di.size(); ++i)
    if (di[i] != dout[i]) return invalid(std::string(who) + ": leading (plane) dims differ");
  const int64_t h = di[di.size() - 2], w = di[di.size() - 1];
  if (h + 2 * g.ph < g.kh || w + 2 * g.pw < g.kw)
    return invalid(std::string(who) + ": kernel larger than the padded input");
  if (dout[di.size() - 2] != pooled(h, g.kh, g.sh, g.ph) ||
      dout[di.size() - 1] != pooled(w, g.kw, g.sw, g.pw))
    return invalid(std::string(who) + ": pooled dims do not match the window geometry");
  return ffi::Error::Success();
}

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

// Outputs whose windows cover input coordinate `n` along one axis: [lo, hi) clipped to
// [0, out). Window i covers i*s - p + [0, k): i*s <= n + p and i*s > n + p - k.
inline void covering(int64_t n, int64_t k, int64_t s, int64_t p, int64_t out, int64_t* lo,
                     int64_t* hi) {
  const int64_t top = n + p;  // i*s <= top
  const int64_t bottom = top - k + 1;  // i*s >= bottom
  int64_t first = bottom <= 0 ? 0 : (bottom + s - 1) / s;
  int64_t last = top < 0 ? -1 : top / s;
  *lo = std::max<int64_t>(first, 0);
  *hi = std::min<int64_t>(last + 1, out);
  if (*hi < *lo) *hi = *lo;
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
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = check_geom("max_pool2d", g); e.failure()) return e;
  if (auto e = check_pair("max_pool2d", x, *y, g); e.failure()) return e;
  if (y->element_type() != x.element_type()) return invalid("max_pool2d: y dtype must match x");
  if (argmax->element_type() != ffi::DataType::S32 || !same_dims(*y, *argmax))
    return invalid("max_pool2d: argmax must be i32 shaped like y");
  const PlaneView v = plane_view(x);
  auto dy = y->dimensions();
  const int64_t ho = dy[dy.size() - 2], wo = dy[dy.size() - 1];
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
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = check_geom("avg_pool2d backward", g); e.failure()) return e;
  if (auto e = check_pair("avg_pool2d backward", *dx, dy, g); e.failure()) return e;
  if (dx->element_type() != dy.element_type()) return invalid("avg_pool2d backward: dx dtype must match dy");
  const PlaneView v = plane_view(*dx);
  auto dd = dy.dimensions();
  const int64_t ho = dd[dd.size() - 2], wo = dd[dd.size() - 1];
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
