// Fake-quantization backward kernels. x, dy, dx: [G, O, C, I] (rows r = (g, o, c) of
// width I), scales s: [G, C] in f32 (f64 for f64 x), q = 2^(bits-1) - 1, z = x / s.
//
// rlx_fake_quantize_bwd (straight-through estimators, RLX SteKind; ste code):
//   1 clipped identity  dx = dy * [|x| <= q s]
//   2 tanh              dx = dy * (1 - tanh(z)^2)
//   3 hard tanh         dx = dy * max(0, 1 - |x / (q s)|)
//   0 identity          dx = dy
// rlx_fake_quantize_lsq_bwd (LSQ, s_eff = max(s, 1e-12), z = x / s_eff), one pass:
//   dx = dy * [|z| <= q]
//   ds[g, c] = sum over rows of channel (g, c) of dy * psi(z),
//   psi(z) = round(z) - z inside (round half away from zero), sign(z) q outside.
// ds is reduced deterministically: each row's sum (or, channel last, each row chunk's
// per-column partial sums) has its own slot, then the slots are added in a fixed order.
#include <cmath>

#include "cpu/common.h"
#include "quantize_checks.h"

namespace rlx {
namespace {

struct QuantView {
  int64_t g, o, c, i;
  int64_t rows() const { return g * o * c; }
  int64_t scale_index(int64_t r) const { return (r / (o * c)) * c + r % c; }
};

// round half away from zero of |z| <= q + 1 <= 2^15 (vectorisable: a 32-bit integer
// conversion, which SSE2 has for f32 and f64; a 64-bit one would stay scalar)
template <typename A>
inline A round_small(A z) {
  const A t = A(int32_t(z));
  const A d = z - t;
  return t + (d >= A(0.5) ? A(1) : A(0)) - (d <= A(-0.5) ? A(1) : A(0));
}

// STE factor of one element (z = x / s, bound = q s); STE code as in the header.
template <int STE, typename A>
inline A ste_factor(A x, A s, A bound) {
  if (STE == 1) return std::fabs(x) <= bound ? A(1) : A(0);
  if (STE == 2) {
    const A th = std::tanh(x / s);
    return A(1) - th * th;
  }
  const A att = A(1) - std::fabs(x / bound);
  return att > A(0) ? att : A(0);
}

// Rows of the kernels' loops: with I > 1 a row is one (g, o, c) with one scale; with the
// channel axis last (I == 1) a row is one (g, o) and the scale varies along it.
struct RowPlan {
  bool channel_last;
  int64_t rows, width;
};

inline RowPlan row_plan(const QuantView& v) {
  if (v.i == 1 && v.c > 1) return {true, v.g * v.o, v.c};
  return {false, v.rows(), v.i};
}

template <int STE, typename T>
void ste_bwd_typed(ffi::ThreadPool& pool, const T* x, const void* s_in, const T* dy, T* dx, QuantView v,
                   float q) {
  using A = typename Accum<T>::type;
  const A* s = static_cast<const A*>(s_in);
  const RowPlan plan = row_plan(v);
  const int64_t w = plan.width;
  const int64_t tasks = row_chunks(plan.rows, w, 1024);
  parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t r0 = plan.rows * t / tasks, r1 = plan.rows * (t + 1) / tasks;
    std::vector<A> srow(plan.channel_last ? w : 0), brow(plan.channel_last ? w : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * w;
      const T* dyr = dy + r * w;
      T* dxr = dx + r * w;
      if (STE == 0) {
        std::memcpy(dxr, dyr, sizeof(T) * w);
      } else if (plan.channel_last) {
        const A* sr = s + (r / v.o) * v.c;
        for (int64_t j = 0; j < w; ++j) { srow[j] = sr[j]; brow[j] = A(q) * sr[j]; }
        for (int64_t j = 0; j < w; ++j)
          dxr[j] = store<T>(load<A>(dyr[j]) * ste_factor<STE>(load<A>(xr[j]), srow[j], brow[j]));
      } else {
        const A sc = s[v.scale_index(r)];
        const A bound = A(q) * sc;
        for (int64_t j = 0; j < w; ++j)
          dxr[j] = store<T>(load<A>(dyr[j]) * ste_factor<STE>(load<A>(xr[j]), sc, bound));
      }
    }
  });
}

// One LSQ element: writes dx, returns psi(z) * dy.
template <typename T, typename A>
inline A lsq_element(const T& xv, const T& dyv, T& dxv, A sc, A qa) {
  const A z = load<A>(xv) / sc;
  const A g = load<A>(dyv);
  const bool inside = std::fabs(z) <= qa;
  const A zc = std::min(std::max(z, -qa - A(1)), qa + A(1));
  const A psi = inside ? round_small(zc) - z : (z > A(0) ? qa : -qa);
  dxv = store<T>(inside ? g : A(0));
  return psi * g;
}

template <typename T>
void lsq_bwd_typed(ffi::ThreadPool& pool, const T* x, const void* s_in, const T* dy, T* dx, void* ds_out,
                   QuantView v, float q) {
  using A = typename Accum<T>::type;
  const A* s = static_cast<const A*>(s_in);
  A* ds = static_cast<A*>(ds_out);
  const RowPlan plan = row_plan(v);
  const int64_t w = plan.width, n_scales = v.g * v.c;
  const int64_t tasks = row_chunks(plan.rows, w, 256);
  const A qa = A(q);
  // One scale per row: each row's sum goes to its own slot. Channel last: each task keeps
  // per-column partial sums.
  std::vector<A> row_sum(plan.channel_last ? 0 : plan.rows);
  std::vector<A> partial(plan.channel_last ? static_cast<size_t>(tasks) * n_scales : 0, A(0));
  parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t r0 = plan.rows * t / tasks, r1 = plan.rows * (t + 1) / tasks;
    std::vector<A> s_eff(plan.channel_last ? w : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * w;
      const T* dyr = dy + r * w;
      T* dxr = dx + r * w;
      if (plan.channel_last) {
        const int64_t g0 = (r / v.o) * v.c;
        for (int64_t j = 0; j < w; ++j) s_eff[j] = std::max(s[g0 + j], A(1e-12));
        A* pr = partial.data() + t * n_scales + g0;
        for (int64_t j = 0; j < w; ++j) pr[j] += lsq_element(xr[j], dyr[j], dxr[j], s_eff[j], qa);
        continue;
      }
      const A sc = std::max(s[v.scale_index(r)], A(1e-12));
      A acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < w; ++j) acc += lsq_element(xr[j], dyr[j], dxr[j], sc, qa);
      row_sum[r] = acc;
    }
  });
  // fixed-order reductions: rows in order, or task partials in task order
  for (int64_t k = 0; k < n_scales; ++k) ds[k] = A(0);
  if (plan.channel_last) {
    for (int64_t t = 0; t < tasks; ++t) {
      const A* pt = partial.data() + t * n_scales;
      for (int64_t k = 0; k < n_scales; ++k) ds[k] += pt[k];
    }
  } else {
    for (int64_t r = 0; r < plan.rows; ++r) ds[v.scale_index(r)] += row_sum[r];
  }
}

ffi::Error FakeQuantizeBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::AnyBuffer dy,
                               ffi::Result<ffi::AnyBuffer> dx, float q_max, int64_t ste) {
  quantize::Shape sh{};
  if (auto e = quantize::check_ste_bwd(Backend::kCpu, x, s, dy, *dx, q_max, ste, sh); e.failure()) return e;
  const QuantView v{sh.g, sh.o, sh.c, sh.i};
  if (v.rows() == 0 || v.i == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    switch (ste) {
      case 0: ste_bwd_typed<0, T>(pool, xp, s.untyped_data(), dyp, dxp, v, q_max); break;
      case 1: ste_bwd_typed<1, T>(pool, xp, s.untyped_data(), dyp, dxp, v, q_max); break;
      case 2: ste_bwd_typed<2, T>(pool, xp, s.untyped_data(), dyp, dxp, v, q_max); break;
      default: ste_bwd_typed<3, T>(pool, xp, s.untyped_data(), dyp, dxp, v, q_max); break;
    }
  });
  if (!ok) return invalid("fake_quantize backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error LsqBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::AnyBuffer dy,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> ds, float q_max) {
  quantize::Shape sh{};
  if (auto e = quantize::check_lsq_bwd(Backend::kCpu, x, s, dy, *dx, *ds, q_max, sh); e.failure()) return e;
  const QuantView v{sh.g, sh.o, sh.c, sh.i};
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = typename Accum<T>::type;
    if (v.rows() == 0 || v.i == 0) {  // nothing to sum: dscale is zero
      A* d = static_cast<A*>(ds->untyped_data());
      for (int64_t k = 0; k < v.g * v.c; ++k) d[k] = A(0);
      return;
    }
    lsq_bwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()), s.untyped_data(),
                     static_cast<const T*>(dy.untyped_data()), static_cast<T*>(dx->untyped_data()),
                     ds->untyped_data(), v, q_max);
  });
  if (!ok) return invalid("fake_quantize_lsq backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxFakeQuantizeBwd, FakeQuantizeBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [G, O, C, I]
                                  .Arg<ffi::AnyBuffer>()  // scale [G, C]
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<float>("q_max")
                                  .Attr<int64_t>("ste"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxFakeQuantizeLsqBwd, LsqBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [G, O, C, I]
                                  .Arg<ffi::AnyBuffer>()  // scale [G, C]
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dscale [G, C]
                                  .Attr<float>("q_max"));

RLX_REGISTER_HANDLER("rlx_fake_quantize_bwd", RlxFakeQuantizeBwd);
RLX_REGISTER_HANDLER("rlx_fake_quantize_lsq_bwd", RlxFakeQuantizeLsqBwd);

}  // namespace rlx
