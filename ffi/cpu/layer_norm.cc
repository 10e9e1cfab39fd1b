// LayerNorm over the last axis, forward (saving mean and rstd) and fused backward.
//
//   x: [R, H] (any leading axes flattened into R rows), gamma, beta: [H]
//   mean = sum_j x_j / H,  rstd = 1 / sqrt(sum_j (x_j - mean)^2 / H + eps)
//   xhat_j = (x_j - mean) * rstd,   y_j = xhat_j * gamma_j + beta_j
// mean and rstd are saved per row (f32, or f64 for f64 inputs).
// Backward, with u_j = dy_j * gamma_j:
//   dx_j     = rstd * (u_j - mean_i(u_i) - xhat_j * mean_i(u_i * xhat_i))
//   dgamma_j = sum_rows dy_j * xhat_j          dbeta_j = sum_rows dy_j
// One read of x and dy per row: the two row sums are taken in a first sweep and dx in a
// second one while the row is still in L1. dgamma and dbeta are reduced in two passes:
// each row chunk writes its own partial sums, then the partials are added in chunk
// order, so the result does not depend on the thread count (deterministic).
//
// Row sums are the lane-parallel ones of norm_rows.h (vectorised, fixed order); bf16
// and f16 rows are converted to f32 in per-task scratch first.
#include <cmath>
#include <limits>

#include "cpu/common.h"
#include "cpu/norm_rows.h"

namespace rlx {
namespace {

template <typename T, typename A>
std::vector<A> to_accum(const T* p, int64_t n) {
  std::vector<A> out(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) out[j] = load<A>(p[j]);
  return out;
}

template <typename T>
void layer_norm_fwd_typed(ffi::ThreadPool& pool, const T* x, const T* gamma_in, const T* beta_in,
                          T* y, void* mean_out, void* rstd_out, int64_t rows, int64_t width,
                          float eps) {
  using A = typename Accum<T>::type;
  A* mean = static_cast<A*>(mean_out);
  A* rstd = static_cast<A*>(rstd_out);
  const std::vector<A> gv = to_accum<T, A>(gamma_in, width), bv = to_accum<T, A>(beta_in, width);
  const A* __restrict g = gv.data();
  const A* __restrict b = bv.data();
  const A inv_w = A(1) / A(width);
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    norm::Rows<T, A> buf(width, 2);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const A* __restrict xr = buf.in(x + r * width, 0);
      A* __restrict yr = buf.out(y + r * width, 1);
      const A mu = norm::sum(xr, width) * inv_w;
      const A inv = A(1) / std::sqrt(norm::sq_dev(xr, mu, width) * inv_w + A(eps));
      mean[r] = mu;
      rstd[r] = inv;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) yr[j] = (xr[j] - mu) * inv * g[j] + b[j];
      buf.commit(y + r * width, 1);
    }
  });
}

template <typename T>
void layer_norm_bwd_typed(ffi::ThreadPool& pool, const T* x, const T* gamma_in,
                          const void* mean_in, const void* rstd_in, const T* dy, T* dx,
                          T* dgamma, T* dbeta, int64_t rows, int64_t width) {
  using A = typename Accum<T>::type;
  const A* mean = static_cast<const A*>(mean_in);
  const A* rstd = static_cast<const A*>(rstd_in);
  const std::vector<A> gv = to_accum<T, A>(gamma_in, width);
  const A* __restrict g = gv.data();
  const A inv_w = A(1) / A(width);
  const int64_t chunks = row_chunks(rows, width);
  // partial[c][0][:] = dgamma partial, partial[c][1][:] = dbeta partial of chunk c
  std::vector<A> partial(static_cast<size_t>(chunks) * 2 * width, A(0));
  parallel_for(pool, chunks, [&](int64_t c) {
    A* __restrict pg = partial.data() + c * 2 * width;
    A* __restrict pb = pg + width;
    norm::Rows<T, A> buf(width, 3);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const A* __restrict xr = buf.in(x + r * width, 0);
      const A* __restrict dyr = buf.in(dy + r * width, 1);
      A* __restrict dxr = buf.out(dx + r * width, 2);
      const A mu = mean[r], inv = rstd[r];
      A su, sux;  // sum u, sum u * (x - mean) with u = dy * gamma
      norm::dy_sums(xr, dyr, g, mu, width, su, sux);
      const A c1 = su * inv_w;         // mean(u)
      const A c2 = sux * inv * inv_w;  // mean(u * xhat)
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const A xh = (xr[j] - mu) * inv;
        dxr[j] = inv * (dyr[j] * g[j] - c1 - xh * c2);
        pg[j] += dyr[j] * xh;
        pb[j] += dyr[j];
      }
      buf.commit(dx + r * width, 2);
    }
  });
  // second pass: column blocks in parallel, chunks added in order
  const int64_t col_tasks = std::max<int64_t>(1, std::min<int64_t>(width / 256, 64));
  parallel_for(pool, col_tasks, [&](int64_t t) {
    const int64_t j0 = width * t / col_tasks, j1 = width * (t + 1) / col_tasks, n = j1 - j0;
    std::vector<A> sg(partial.begin() + j0, partial.begin() + j1);
    std::vector<A> sb(partial.begin() + width + j0, partial.begin() + width + j1);
    A* __restrict sgp = sg.data();
    A* __restrict sbp = sb.data();
    for (int64_t c = 1; c < chunks; ++c) {
      const A* __restrict pg = partial.data() + c * 2 * width + j0;
      const A* __restrict pb = pg + width;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) { sgp[j] += pg[j]; sbp[j] += pb[j]; }
    }
    for (int64_t j = 0; j < n; ++j) {
      dgamma[j0 + j] = store<T>(sgp[j]);
      dbeta[j0 + j] = store<T>(sbp[j]);
    }
  });
}

ffi::Error check_param(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  auto d = p.dimensions();
  if (x.dimensions().size() < 1) return invalid("layer_norm: x must have rank >= 1");
  const int64_t width = rows_view(x).width;
  if (d.size() != 1 || d[0] != width)
    return invalid(std::string("layer_norm: ") + what + " must have shape [" +
                   std::to_string(width) + "] (the last axis of x)");
  if (p.element_type() != x.element_type())
    return invalid(std::string("layer_norm: ") + what + " dtype " + dtype_name(p.element_type()) +
                   " differs from x dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::DataType stat_type(ffi::DataType t) {
  return t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

ffi::Error check_stat(const ffi::AnyBuffer& x, ffi::DataType t, int64_t n, const char* what) {
  if (t != stat_type(x.element_type()))
    return invalid(std::string("layer_norm: ") + what + " must be f32 (f64 for f64 x), got " +
                   dtype_name(t));
  if (n != rows_view(x).rows)
    return invalid(std::string("layer_norm: ") + what + " must have one value per row of x");
  return ffi::Error::Success();
}

ffi::Error LayerNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                            ffi::AnyBuffer beta, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                            float eps) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_param(x, beta, "beta"); e.failure()) return e;
  if (!same_dims(x, *y) || y->element_type() != x.element_type())
    return invalid("layer_norm: output y must match x");
  if (auto e = check_stat(x, mean->element_type(), mean->element_count(), "mean"); e.failure())
    return e;
  if (auto e = check_stat(x, rstd->element_type(), rstd->element_count(), "rstd"); e.failure())
    return e;
  if (!(eps >= 0.0f)) return invalid("layer_norm: eps must be >= 0");
  auto [rows, width] = rows_view(x);
  if (rows == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = typename Accum<T>::type;
    if (width == 0) {  // empty rows: statistics are 0/0, as in the reference
      std::fill_n(static_cast<A*>(mean->untyped_data()), rows, std::numeric_limits<A>::quiet_NaN());
      std::fill_n(static_cast<A*>(rstd->untyped_data()), rows, std::numeric_limits<A>::quiet_NaN());
      return;
    }
    layer_norm_fwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                            static_cast<const T*>(gamma.untyped_data()),
                            static_cast<const T*>(beta.untyped_data()),
                            static_cast<T*>(y->untyped_data()), mean->untyped_data(),
                            rstd->untyped_data(), rows, width, eps);
  });
  if (!ok) return invalid("layer_norm: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error LayerNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                            ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer dy,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                            ffi::Result<ffi::AnyBuffer> dbeta) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (!same_dims(x, dy) || dy.element_type() != x.element_type())
    return invalid("layer_norm backward: dy must match x in shape and dtype");
  if (!same_dims(x, *dx) || dx->element_type() != x.element_type())
    return invalid("layer_norm backward: dx must match x");
  if (auto e = check_param(x, *dgamma, "dgamma"); e.failure()) return e;
  if (auto e = check_param(x, *dbeta, "dbeta"); e.failure()) return e;
  if (auto e = check_stat(x, mean.element_type(), mean.element_count(), "mean"); e.failure())
    return e;
  if (auto e = check_stat(x, rstd.element_type(), rstd.element_count(), "rstd"); e.failure())
    return e;
  auto [rows, width] = rows_view(x);
  if (width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    T* dg = static_cast<T*>(dgamma->untyped_data());
    T* db = static_cast<T*>(dbeta->untyped_data());
    if (rows == 0) {  // no rows: parameter gradients are zero
      for (int64_t j = 0; j < width; ++j) { dg[j] = store<T>(0.0f); db[j] = store<T>(0.0f); }
      return;
    }
    layer_norm_bwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                            static_cast<const T*>(gamma.untyped_data()), mean.untyped_data(),
                            rstd.untyped_data(), static_cast<const T*>(dy.untyped_data()),
                            static_cast<T*>(dx->untyped_data()), dg, db, rows, width);
  });
  if (!ok) return invalid("layer_norm backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormFwd, LayerNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // mean
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormBwd, LayerNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // mean
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>());  // dbeta

RLX_REGISTER_HANDLER("rlx_layer_norm_fwd", RlxLayerNormFwd);
RLX_REGISTER_HANDLER("rlx_layer_norm_bwd", RlxLayerNormBwd);

}  // namespace rlx
