// RMSNorm over the last axis, forward and fused backward.
//
//   x: [R, H] (any leading axes flattened into R rows), gamma, beta: [H]
//   r   = 1 / sqrt(mean_j x_j^2 + eps)                    (saved, f32 / f64: [R])
//   y_j = x_j * r * gamma_j + beta_j
// Backward, with u_j = dy_j * gamma_j:
//   dx_j     = r * u_j - x_j * r^3 * (sum_i u_i x_i) / H
//   dgamma_j = sum_rows dy_j * x_j * r        dbeta_j = sum_rows dy_j
// dgamma and dbeta are reduced in two passes: each row chunk writes its own partial
// sums, then the partials are added in chunk order (deterministic).
#include <cmath>

#include "cpu/common.h"

namespace rlx {
namespace {

template <typename T>
void rms_norm_fwd_typed(ffi::ThreadPool& pool, const T* x, const T* gamma, const T* beta,
                        T* y, void* rstd_out, int64_t rows, int64_t width, float eps) {
  using A = typename Accum<T>::type;
  A* rstd = static_cast<A*>(rstd_out);
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * width;
      T* yr = y + r * width;
      A ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < width; ++j) { A v = load<A>(xr[j]); ss += v * v; }
      A inv = A(1) / std::sqrt(ss / A(width) + A(eps));
      rstd[r] = inv;
      for (int64_t j = 0; j < width; ++j)
        yr[j] = store<T>(load<A>(xr[j]) * inv * load<A>(gamma[j]) + load<A>(beta[j]));
    }
  });
}

template <typename T>
void rms_norm_bwd_typed(ffi::ThreadPool& pool, const T* x, const T* gamma, const void* rstd_in,
                        const T* dy, T* dx, T* dgamma, T* dbeta, int64_t rows, int64_t width) {
  using A = typename Accum<T>::type;
  const A* rstd = static_cast<const A*>(rstd_in);
  const int64_t chunks = row_chunks(rows, width);
  // partial[c][0][:] = dgamma partial, partial[c][1][:] = dbeta partial of chunk c
  std::vector<A> partial(static_cast<size_t>(chunks) * 2 * width, A(0));
  std::vector<A> g(width);
  for (int64_t j = 0; j < width; ++j) g[j] = load<A>(gamma[j]);
  parallel_for(pool, chunks, [&](int64_t c) {
    A* pg = partial.data() + c * 2 * width;
    A* pb = pg + width;
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * width;
      const T* dyr = dy + r * width;
      T* dxr = dx + r * width;
      const A inv = rstd[r];
      A dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < width; ++j) dot += load<A>(dyr[j]) * g[j] * load<A>(xr[j]);
      const A coef = inv * inv * inv * dot / A(width);
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const A xv = load<A>(xr[j]), dyv = load<A>(dyr[j]);
        dxr[j] = store<T>(inv * dyv * g[j] - coef * xv);
        pg[j] += dyv * xv * inv;
        pb[j] += dyv;
      }
    }
  });
  // second pass: columns in parallel, chunks added in order
  const int64_t col_tasks = std::max<int64_t>(1, std::min<int64_t>(width / 256, 64));
  parallel_for(pool, col_tasks, [&](int64_t t) {
    const int64_t j0 = width * t / col_tasks, j1 = width * (t + 1) / col_tasks;
    for (int64_t j = j0; j < j1; ++j) {
      A sg = 0, sb = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        sg += partial[c * 2 * width + j];
        sb += partial[c * 2 * width + width + j];
      }
      dgamma[j] = store<T>(sg);
      dbeta[j] = store<T>(sb);
    }
  });
}

ffi::Error check_params(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  auto d = p.dimensions();
  int64_t width = rows_view(x).width;
  if (x.dimensions().size() < 1) return invalid("rms_norm: x must have rank >= 1");
  if (d.size() != 1 || d[0] != width)
    return invalid(std::string("rms_norm: ") + what + " must have shape [" +
                   std::to_string(width) + "] (the last axis of x)");
  if (p.element_type() != x.element_type())
    return invalid(std::string("rms_norm: ") + what + " dtype " + dtype_name(p.element_type()) +
                   " differs from x dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::DataType stat_type(ffi::DataType t) {
  return t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

ffi::Error RmsNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          ffi::AnyBuffer beta, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  if (auto e = check_params(x, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_params(x, beta, "beta"); e.failure()) return e;
  if (!same_dims(x, *y) || y->element_type() != x.element_type())
    return invalid("rms_norm: output y must match x");
  if (rstd->element_type() != stat_type(x.element_type()))
    return invalid("rms_norm: rstd must be f32 (f64 for f64 inputs)");
  if (!(eps >= 0.0f)) return invalid("rms_norm: eps must be >= 0");
  auto [rows, width] = rows_view(x);
  if (rstd->element_count() != rows) return invalid("rms_norm: rstd must have one value per row");
  if (rows == 0 || width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_norm_fwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                          static_cast<const T*>(gamma.untyped_data()),
                          static_cast<const T*>(beta.untyped_data()),
                          static_cast<T*>(y->untyped_data()), rstd->untyped_data(), rows, width,
                          eps);
  });
  if (!ok) return invalid("rms_norm: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error RmsNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          ffi::AnyBuffer rstd, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta) {
  if (auto e = check_params(x, gamma, "gamma"); e.failure()) return e;
  if (!same_dims(x, dy) || dy.element_type() != x.element_type())
    return invalid("rms_norm backward: dy must match x in shape and dtype");
  if (!same_dims(x, *dx) || dx->element_type() != x.element_type())
    return invalid("rms_norm backward: dx must match x");
  if (auto e = check_params(x, *dgamma, "dgamma"); e.failure()) return e;
  if (auto e = check_params(x, *dbeta, "dbeta"); e.failure()) return e;
  auto [rows, width] = rows_view(x);
  if (rstd.element_type() != stat_type(x.element_type()) || rstd.element_count() != rows)
    return invalid("rms_norm backward: rstd must be f32 (f64 for f64 x) with one value per row");
  if (width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    T* dg = static_cast<T*>(dgamma->untyped_data());
    T* db = static_cast<T*>(dbeta->untyped_data());
    if (rows == 0) {  // no rows: parameter gradients are zero
      for (int64_t j = 0; j < width; ++j) { dg[j] = store<T>(0.0f); db[j] = store<T>(0.0f); }
      return;
    }
    rms_norm_bwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                          static_cast<const T*>(gamma.untyped_data()), rstd.untyped_data(),
                          static_cast<const T*>(dy.untyped_data()),
                          static_cast<T*>(dx->untyped_data()), dg, db, rows, width);
  });
  if (!ok) return invalid("rms_norm backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormFwd, RmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormBwd, RmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>());  // dbeta

RLX_REGISTER_HANDLER("rlx_rms_norm_fwd", RlxRmsNormFwd);
RLX_REGISTER_HANDLER("rlx_rms_norm_bwd", RlxRmsNormBwd);

}  // namespace rlx
