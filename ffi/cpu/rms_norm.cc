// RMSNorm over the last axis, forward and fused backward.
//
//   x: [R, H] (any leading axes flattened into R rows), gamma, beta: [H]
//   r   = 1 / sqrt(mean_j x_j^2 + eps)                    (saved, f32 / f64: [R])
//   y_j = x_j * r * gamma_j + beta_j
// Backward, with u_j = dy_j * gamma_j:
//   dx_j     = r * u_j - x_j * r^3 * (sum_i u_i x_i) / H  (+ dres_j: add_rms_norm's backward,
//              whose x is a sum x + residual and dres the sum's own gradient)
//   dgamma_j = sum_rows dy_j * x_j * r        dbeta_j = sum_rows dy_j
// dgamma and dbeta are reduced in two passes: each row chunk writes its own partial
// sums, then the partials are added in chunk order (deterministic).
//
// f32 and bf16 rows run through the 16-element blocks of rowwise.h (load16 / store16:
// bf16 <-> f32 by integer shifts, rounding to nearest even), in a body compiled for
// x86-64-v4 (one zmm per block) where the CPU has AVX-512 and otherwise in the row
// clones (x86-64-v3: two ymm halves; baseline: SSE2). Sums run on two 16-lane
// accumulators (element j to accumulator (j / 16) mod 2, lane j mod 16, over the
// 32-element blocks; a last full 16-block to the first, the zero-padded tail block to
// the second), then the accumulators are added and the lanes in order 0..15: a fixed
// order, and every element goes through the same vector operations, so the AVX-512 and
// AVX2 bodies give the same bits. f16 and f64 rows use the generic scalar loops.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu/common.h"
#include "cpu/rowwise.h"
#include "rms_norm_checks.h"

namespace rlx {
namespace {

// ---- vectorised rows (T = float or bf16; gamma, beta as f32; V: see rowwise.h) -----
// The last n mod 16 elements of a row run as one more block, zero-padded through a
// 16-element local copy, so that every element sees the same vector operations in
// both bodies (a scalar tail may be contracted into FMAs differently by the two ISAs):
// copy_padded of rowwise.h.

// sum_j x_j * x_j
template <typename V, typename T>
RLX_ROW_INLINE float sum_sq_body(const T* x, int64_t n) {
  V a0 = splat16<V>(0.0f), a1 = a0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const V u = ld16<V>(x + j), w = ld16<V>(x + j + 16);
    a0 += u * u;
    a1 += w * w;
  }
  if (j + 16 <= n) {
    const V u = ld16<V>(x + j);
    a0 += u * u;
    j += 16;
  }
  if (j < n) {
    T t[16];
    copy_padded(t, x + j, n - j);
    const V u = ld16<V>(t);
    a1 += u * u;
  }
  return hsum16(a0 + a1);
}

// sum_j dy_j * g_j * x_j
template <typename V, typename T>
RLX_ROW_INLINE float dot3_body(const T* dy, const float* g, const T* x, int64_t n) {
  V a0 = splat16<V>(0.0f), a1 = a0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    a0 += ld16<V>(dy + j) * ld16<V>(g + j) * ld16<V>(x + j);
    a1 += ld16<V>(dy + j + 16) * ld16<V>(g + j + 16) * ld16<V>(x + j + 16);
  }
  if (j + 16 <= n) {
    a0 += ld16<V>(dy + j) * ld16<V>(g + j) * ld16<V>(x + j);
    j += 16;
  }
  if (j < n) {
    T td[16], tx[16];
    float tg[16];
    copy_padded(td, dy + j, n - j);
    copy_padded(tg, g + j, n - j);
    copy_padded(tx, x + j, n - j);
    a1 += ld16<V>(td) * ld16<V>(tg) * ld16<V>(tx);
  }
  return hsum16(a0 + a1);
}

// y_j = x_j * inv * g_j + b_j for the 16 elements at x, g, b
template <typename V, typename T>
RLX_ROW_INLINE void fwd_block(const T* x, const float* g, const float* b, T* y, const V& vi) {
  st16(y, ld16<V>(x) * vi * ld16<V>(g) + ld16<V>(b));
}

// Rows [r0, r1): rstd[r] = 1 / sqrt(mean_j x_j^2 + eps), y_j = x_j * rstd * g_j + b_j.
template <typename V, typename T>
RLX_ROW_INLINE void fwd_rows_body(const T* x, const float* g, const float* b, T* y, float* rstd,
                                  int64_t r0, int64_t r1, int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    const float inv = 1.0f / std::sqrt(sum_sq_body<V>(xr, n) / float(n) + eps);
    rstd[r] = inv;
    const V vi = splat16<V>(inv);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) fwd_block(xr + j, g + j, b + j, yr + j, vi);
    if (j < n) {
      const int64_t m = n - j;
      T tx[16], ty[16];
      float tg[16], tb[16];
      copy_padded(tx, xr + j, m);
      copy_padded(tg, g + j, m);
      copy_padded(tb, b + j, m);
      fwd_block(tx, tg, tb, ty, vi);
      std::memcpy(yr + j, ty, static_cast<size_t>(m) * sizeof(T));
    }
  }
}

// dx = inv dy g - coef x (+ dres where dres is not null), pg += dy x inv, pb += dy for
// the 16 elements at the pointers
template <typename V, typename T>
RLX_ROW_INLINE void bwd_block(const T* x, const T* dy, const float* g, T* dx, float* pg, float* pb,
                              const V& vi, const V& vc, const T* dres) {
  const V xv = ld16<V>(x), dyv = ld16<V>(dy);
  // separate statements fix which product the compiler fuses into an FMA (the first),
  // so that the v16f and P16 bodies round alike
  const V u = vi * dyv * ld16<V>(g);
  const V w = vc * xv;
  if (dres) st16(dx, (u - w) + ld16<V>(dres));
  else st16(dx, u - w);
  st16(pg, ld16<V>(pg) + dyv * xv * vi);
  st16(pb, ld16<V>(pb) + dyv);
}

// Rows [r0, r1): dx_j = rstd dy_j g_j - x_j rstd^3 (sum_i dy_i g_i x_i) / n (+ dres_j),
// pg_j += dy_j x_j rstd, pb_j += dy_j.
template <typename V, typename T>
RLX_ROW_INLINE void bwd_rows_body(const T* x, const float* g, const float* rstd, const T* dy, T* dx,
                                  float* pg, float* pb, int64_t r0, int64_t r1, int64_t n, const T* dres) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    const T* dyr = dy + r * n;
    const T* drr = dres ? dres + r * n : nullptr;
    T* dxr = dx + r * n;
    const float inv = rstd[r];
    const float coef = inv * inv * inv * dot3_body<V>(dyr, g, xr, n) / float(n);
    const V vi = splat16<V>(inv), vc = splat16<V>(coef);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
      bwd_block(xr + j, dyr + j, g + j, dxr + j, pg + j, pb + j, vi, vc, drr ? drr + j : nullptr);
    if (j < n) {
      const int64_t m = n - j;
      T tx[16], tdy[16], tdx[16], tdr[16];
      float tg[16], tpg[16], tpb[16];
      copy_padded(tx, xr + j, m);
      copy_padded(tdy, dyr + j, m);
      if (drr) copy_padded(tdr, drr + j, m);
      copy_padded(tg, g + j, m);
      copy_padded(tpg, pg + j, m);
      copy_padded(tpb, pb + j, m);
      bwd_block(tx, tdy, tg, tdx, tpg, tpb, vi, vc, drr ? tdr : nullptr);
      std::memcpy(dxr + j, tdx, static_cast<size_t>(m) * sizeof(T));
      std::memcpy(pg + j, tpg, static_cast<size_t>(m) * sizeof(float));
      std::memcpy(pb + j, tpb, static_cast<size_t>(m) * sizeof(float));
    }
  }
}

#define RLX_RMS_ROWS(T)                                                                      \
  RLX_ROW_V4 void fwd_rows_v16(const T* x, const float* g, const float* b, T* y, float* rstd,   \
                           int64_t r0, int64_t r1, int64_t n, float eps) {                  \
    fwd_rows_body<v16f>(x, g, b, y, rstd, r0, r1, n, eps);                                   \
  }                                                                                          \
  RLX_ROW_CLONES void fwd_rows_v8(const T* x, const float* g, const float* b, T* y,          \
                                  float* rstd, int64_t r0, int64_t r1, int64_t n, float eps) { \
    fwd_rows_body<P16>(x, g, b, y, rstd, r0, r1, n, eps);                                    \
  }                                                                                          \
  RLX_ROW_V4 void bwd_rows_v16(const T* x, const float* g, const float* rstd, const T* dy, T* dx, \
                           float* pg, float* pb, int64_t r0, int64_t r1, int64_t n,          \
                           const T* dres) {                                                  \
    bwd_rows_body<v16f>(x, g, rstd, dy, dx, pg, pb, r0, r1, n, dres);                        \
  }                                                                                          \
  RLX_ROW_CLONES void bwd_rows_v8(const T* x, const float* g, const float* rstd, const T* dy, \
                                  T* dx, float* pg, float* pb, int64_t r0, int64_t r1,       \
                                  int64_t n, const T* dres) {                                \
    bwd_rows_body<P16>(x, g, rstd, dy, dx, pg, pb, r0, r1, n, dres);                         \
  }
RLX_RMS_ROWS(float)
RLX_RMS_ROWS(bf16)
#undef RLX_RMS_ROWS

template <typename T>
void fwd_rows(const T* x, const float* g, const float* b, T* y, float* rstd, int64_t r0,
              int64_t r1, int64_t n, float eps) {
  if (cpu_has_x86_64_v4()) fwd_rows_v16(x, g, b, y, rstd, r0, r1, n, eps);
  else fwd_rows_v8(x, g, b, y, rstd, r0, r1, n, eps);
}
template <typename T>
void bwd_rows(const T* x, const float* g, const float* rstd, const T* dy, T* dx, float* pg,
              float* pb, int64_t r0, int64_t r1, int64_t n, const T* dres) {
  if (cpu_has_x86_64_v4()) bwd_rows_v16(x, g, rstd, dy, dx, pg, pb, r0, r1, n, dres);
  else bwd_rows_v8(x, g, rstd, dy, dx, pg, pb, r0, r1, n, dres);
}

// Whether T's rows take the vectorised path above.
template <typename T>
constexpr bool kVecRows = std::is_same<T, bf16>::value || std::is_same<T, float>::value;

template <typename T>
void rms_norm_fwd_typed(ffi::ThreadPool& pool, const T* x, const T* gamma, const T* beta,
                        T* y, void* rstd_out, int64_t rows, int64_t width, double eps) {
  using A = typename Accum<T>::type;
  A* rstd = static_cast<A*>(rstd_out);
  const int64_t chunks = row_chunks(rows, width);
  if constexpr (kVecRows<T>) {
    std::vector<float> gb(2 * width);
    for (int64_t j = 0; j < width; ++j) {
      gb[j] = load<float>(gamma[j]);
      gb[width + j] = load<float>(beta[j]);
    }
    parallel_for(pool, chunks, [&](int64_t c) {
      fwd_rows<T>(x, gb.data(), gb.data() + width, y, rstd, rows * c / chunks,
                  rows * (c + 1) / chunks, width, float(eps));
    });
    return;
  }
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
                        const T* dy, const T* dres, T* dx, T* dgamma, T* dbeta, int64_t rows,
                        int64_t width) {
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
    if constexpr (kVecRows<T>) {
      bwd_rows<T>(x, g.data(), rstd, dy, dx, pg, pb, r0, r1, width, dres);
      return;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * width;
      const T* dyr = dy + r * width;
      const T* drr = dres ? dres + r * width : nullptr;
      T* dxr = dx + r * width;
      const A inv = rstd[r];
      A dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < width; ++j) dot += load<A>(dyr[j]) * g[j] * load<A>(xr[j]);
      const A coef = inv * inv * inv * dot / A(width);
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const A xv = load<A>(xr[j]), dyv = load<A>(dyr[j]);
        dxr[j] = store<T>(inv * dyv * g[j] - coef * xv + (drr ? load<A>(drr[j]) : A(0)));
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

// Eps: the attribute's type, float (ABI v1) or double (v2: an f64 input's eps exactly).
template <typename Eps>
ffi::Error RmsNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          ffi::AnyBuffer beta, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> rstd, Eps eps) {
  if (auto e = rms_norm::check_fwd(Backend::kCpu, x, gamma, beta, *y, *rstd, eps); e.failure()) return e;
  auto [rows, width] = rows_view(x);
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

// The backward, with dres (add_rms_norm: the sum output's gradient, added to dx) or without.
ffi::Error RmsNormBwdCommon(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                            ffi::AnyBuffer rstd, ffi::AnyBuffer dy, const ffi::AnyBuffer* dres,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                            ffi::Result<ffi::AnyBuffer> dbeta) {
  if (auto e = dres ? rms_norm::check_add_bwd(Backend::kCpu, x, gamma, rstd, dy, *dres, *dx, *dgamma, *dbeta)
                    : rms_norm::check_bwd(Backend::kCpu, x, gamma, rstd, dy, *dx, *dgamma, *dbeta);
      e.failure())
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
    rms_norm_bwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                          static_cast<const T*>(gamma.untyped_data()), rstd.untyped_data(),
                          static_cast<const T*>(dy.untyped_data()),
                          dres ? static_cast<const T*>(dres->untyped_data()) : nullptr,
                          static_cast<T*>(dx->untyped_data()), dg, db, rows, width);
  });
  if (!ok)
    return invalid(std::string(dres ? "add_rms_norm" : "rms_norm") + " backward: unsupported dtype " +
                   dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error RmsNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          ffi::AnyBuffer rstd, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta) {
  return RmsNormBwdCommon(pool, x, gamma, rstd, dy, nullptr, dx, dgamma, dbeta);
}

ffi::Error AddRmsNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                             ffi::AnyBuffer rstd, ffi::AnyBuffer dy, ffi::AnyBuffer dres,
                             ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                             ffi::Result<ffi::AnyBuffer> dbeta) {
  return RmsNormBwdCommon(pool, x, gamma, rstd, dy, &dres, dx, dgamma, dbeta);
}

}  // namespace

// v1 takes eps as f32, v2 as f64 (which an f64 input needs to normalise with its exact eps)
#define RLX_RMS_NORM_FWD_BINDING(EPS)              \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::AnyBuffer>() /* x */               \
      .Arg<ffi::AnyBuffer>() /* gamma */           \
      .Arg<ffi::AnyBuffer>() /* beta */            \
      .Ret<ffi::AnyBuffer>() /* y */               \
      .Ret<ffi::AnyBuffer>() /* rstd */            \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormFwd, RmsNormFwdImpl<float>, RLX_RMS_NORM_FWD_BINDING(float));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRmsNormFwdV2, RmsNormFwdImpl<double>, RLX_RMS_NORM_FWD_BINDING(double));
#undef RLX_RMS_NORM_FWD_BINDING

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAddRmsNormBwd, AddRmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x (the sum x + residual)
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // dres
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>());  // dbeta

RLX_REGISTER_HANDLER("rlx_rms_norm_fwd", RlxRmsNormFwd);
RLX_REGISTER_HANDLER("rlx_rms_norm_fwd_v2", RlxRmsNormFwdV2);
RLX_REGISTER_HANDLER("rlx_rms_norm_bwd", RlxRmsNormBwd);
RLX_REGISTER_HANDLER("rlx_add_rms_norm_bwd", RlxAddRmsNormBwd);

}  // namespace rlx
