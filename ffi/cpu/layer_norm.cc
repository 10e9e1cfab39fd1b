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
// f32 and bf16 rows run as 16-element blocks (ld16 / st16 of rowwise.h: bf16 widened by
// an integer shift, rounded to nearest even on the store), in an x86-64-v4 body (one
// zmm per block) or the row clones (two 8-lane halves), picked at run time. Row sums
// have 16 lanes, added in lane order; the last n mod 16 elements run as one more block
// padded with neutral values (x: the row mean, dy: 0), so the AVX-512 and AVX2 bodies
// give the same bits. f16 and f64 rows use the lane-parallel sums of norm_rows.h
// (f16 converted to f32 in per-task scratch first).
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/common.h"
#include "cpu/norm_rows.h"
#include "cpu/rowwise.h"
#include "layer_norm_checks.h"

namespace rlx {
namespace {

template <typename T, typename A>
std::vector<A> to_accum(const T* p, int64_t n) {
  std::vector<A> out(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) out[j] = load<A>(p[j]);
  return out;
}

// ---- f32 / bf16 rows in 16-element blocks (V = v16f or P16, see rowwise.h) -------------
// (tails: ld16_pad / st16_part / copy_padded of rowwise.h)

// y = ((x - mean) rstd) g + b for the 16 elements at x, g, b (the tail block runs it on
// padded copies: ld16_pad's lane-wise construction let the compilers fuse that block's
// FMA differently for v16f and P16, 1 ulp in y)
template <typename V, typename T>
RLX_ROW_INLINE void fwd_block(const T* x, const float* g, const float* b, T* y, const V& vm, const V& vi) {
  const V t = (ld16<V>(x) - vm) * vi;
  st16(y, t * ld16<V>(g) + ld16<V>(b));
}

// Rows [r0, r1): mean, rstd and y_j = ((x_j - mean) rstd) g_j + b_j.
template <typename V, typename T>
RLX_ROW_INLINE void fwd_rows_body(const T* x, const float* g, const float* b, T* y, float* mean,
                                  float* rstd, int64_t r0, int64_t r1, int64_t n, float eps) {
  const float inv_w = 1.0f / float(n);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    V a = splat16<V>(0.0f);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) a += ld16<V>(xr + j);
    if (j < n) a += ld16_pad<V>(xr + j, n - j, 0.0f);
    const float mu = hsum16(a) * inv_w;
    const V vm = splat16<V>(mu);
    V q = splat16<V>(0.0f);
    for (j = 0; j + 16 <= n; j += 16) {
      const V d = ld16<V>(xr + j) - vm;
      q += d * d;
    }
    if (j < n) {
      const V d = ld16_pad<V>(xr + j, n - j, mu) - vm;
      q += d * d;
    }
    const float inv = 1.0f / std::sqrt(hsum16(q) * inv_w + eps);
    mean[r] = mu;
    rstd[r] = inv;
    const V vi = splat16<V>(inv);
    for (j = 0; j + 16 <= n; j += 16) fwd_block(xr + j, g + j, b + j, yr + j, vm, vi);
    if (j < n) {  // the same block function on zero-padded local copies
      const int64_t m = n - j;
      T tx[16], ty[16];
      float tg[16], tb[16];
      copy_padded(tx, xr + j, m);
      copy_padded(tg, g + j, m);
      copy_padded(tb, b + j, m);
      fwd_block(tx, tg, tb, ty, vm, vi);
      std::memcpy(yr + j, ty, static_cast<size_t>(m) * sizeof(T));
    }
  }
}

// dx = rstd (dy g - c1 - xh c2), pg += dy xh, pb += dy with xh = (x - mean) rstd, for the 16
// lanes given (one statement per rounding, so that both bodies fuse the same products)
template <typename V>
RLX_ROW_INLINE V bwd_lanes(const V& xv, const V& dyv, const V& gv, V& pg, V& pb, const V& vm,
                           const V& vi, const V& c1, const V& c2) {
  const V xh = (xv - vm) * vi;
  const V u = dyv * gv;
  const V w = xh * c2;
  const V t = u - c1;
  pg = pg + dyv * xh;
  pb = pb + dyv;
  return vi * (t - w);
}

// Rows [r0, r1) of the backward; pg, pb: this chunk's dgamma / dbeta partials (f32, n).
template <typename V, typename T>
RLX_ROW_INLINE void bwd_rows_body(const T* x, const float* g, const float* mean, const float* rstd,
                                  const T* dy, T* dx, float* pg, float* pb, int64_t r0, int64_t r1,
                                  int64_t n) {
  const float inv_w = 1.0f / float(n);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    const T* dyr = dy + r * n;
    T* dxr = dx + r * n;
    const float mu = mean[r], inv = rstd[r];
    const V vm = splat16<V>(mu);
    V su = splat16<V>(0.0f), sux = su;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const V u = ld16<V>(dyr + j) * ld16<V>(g + j);
      const V d = ld16<V>(xr + j) - vm;
      su += u;
      sux += u * d;
    }
    if (j < n) {
      const int64_t m = n - j;
      const V u = ld16_pad<V>(dyr + j, m, 0.0f) * ld16_pad<V>(g + j, m, 0.0f);
      const V d = ld16_pad<V>(xr + j, m, mu) - vm;
      su += u;
      sux += u * d;
    }
    const V c1 = splat16<V>(hsum16(su) * inv_w);          // mean(u)
    const V c2 = splat16<V>(hsum16(sux) * inv * inv_w);   // mean(u * xhat)
    const V vi = splat16<V>(inv);
    for (j = 0; j + 16 <= n; j += 16) {
      V vg = ld16<V>(pg + j), vb = ld16<V>(pb + j);
      st16(dxr + j, bwd_lanes(ld16<V>(xr + j), ld16<V>(dyr + j), ld16<V>(g + j), vg, vb, vm, vi, c1, c2));
      st16(pg + j, vg);
      st16(pb + j, vb);
    }
    if (j < n) {
      const int64_t m = n - j;
      V vg = ld16_pad<V>(pg + j, m, 0.0f), vb = ld16_pad<V>(pb + j, m, 0.0f);
      const V d = bwd_lanes(ld16_pad<V>(xr + j, m, mu), ld16_pad<V>(dyr + j, m, 0.0f),
                            ld16_pad<V>(g + j, m, 0.0f), vg, vb, vm, vi, c1, c2);
      st16_part(dxr + j, d, m);
      st16_part(pg + j, vg, m);
      st16_part(pb + j, vb, m);
    }
  }
}

#define RLX_LN_ROWS(T)                                                                             \
  RLX_ROW_V4 void fwd_rows_v16(const T* x, const float* g, const float* b, T* y, float* mean,     \
                               float* rstd, int64_t r0, int64_t r1, int64_t n, float eps) {       \
    fwd_rows_body<v16f>(x, g, b, y, mean, rstd, r0, r1, n, eps);                                  \
  }                                                                                                \
  RLX_ROW_CLONES void fwd_rows_v8(const T* x, const float* g, const float* b, T* y, float* mean,  \
                                  float* rstd, int64_t r0, int64_t r1, int64_t n, float eps) {    \
    fwd_rows_body<P16>(x, g, b, y, mean, rstd, r0, r1, n, eps);                                   \
  }                                                                                                \
  RLX_ROW_V4 void bwd_rows_v16(const T* x, const float* g, const float* mean, const float* rstd,  \
                               const T* dy, T* dx, float* pg, float* pb, int64_t r0, int64_t r1, \
                               int64_t n) {                                                       \
    bwd_rows_body<v16f>(x, g, mean, rstd, dy, dx, pg, pb, r0, r1, n);                             \
  }                                                                                                \
  RLX_ROW_CLONES void bwd_rows_v8(const T* x, const float* g, const float* mean,                  \
                                  const float* rstd, const T* dy, T* dx, float* pg, float* pb,    \
                                  int64_t r0, int64_t r1, int64_t n) {                            \
    bwd_rows_body<P16>(x, g, mean, rstd, dy, dx, pg, pb, r0, r1, n);                              \
  }
RLX_LN_ROWS(float)
RLX_LN_ROWS(bf16)
#undef RLX_LN_ROWS

// Whether T's rows take the 16-element blocks above (f32, bf16).
template <typename T>
constexpr bool kBlockRows = std::is_same<T, float>::value || std::is_same<T, bf16>::value;

template <typename T>
void layer_norm_fwd_typed(ffi::ThreadPool& pool, const T* x, const T* gamma_in, const T* beta_in,
                          T* y, void* mean_out, void* rstd_out, int64_t rows, int64_t width,
                          double eps) {
  using A = typename Accum<T>::type;
  A* mean = static_cast<A*>(mean_out);
  A* rstd = static_cast<A*>(rstd_out);
  const std::vector<A> gv = to_accum<T, A>(gamma_in, width), bv = to_accum<T, A>(beta_in, width);
  const A* __restrict g = gv.data();
  const A* __restrict b = bv.data();
  const A inv_w = A(1) / A(width);
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    if constexpr (kBlockRows<T>) {
      if (cpu_has_x86_64_v4()) fwd_rows_v16(x, g, b, y, mean, rstd, r0, r1, width, float(eps));
      else fwd_rows_v8(x, g, b, y, mean, rstd, r0, r1, width, float(eps));
      return;
    }
    norm::Rows<T, A> buf(width, 2);
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
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    if constexpr (kBlockRows<T>) {
      if (cpu_has_x86_64_v4()) bwd_rows_v16(x, g, mean, rstd, dy, dx, pg, pb, r0, r1, width);
      else bwd_rows_v8(x, g, mean, rstd, dy, dx, pg, pb, r0, r1, width);
      return;
    }
    norm::Rows<T, A> buf(width, 3);
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

// Eps: the attribute's type, float (ABI v1) or double (v2: an f64 input's eps exactly).
template <typename Eps>
ffi::Error LayerNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                            ffi::AnyBuffer beta, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                            Eps eps) {
  if (auto e = layer_norm::check_fwd(Backend::kCpu, x, gamma, beta, *y, *mean, *rstd, eps); e.failure())
    return e;
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
  if (auto e = layer_norm::check_bwd(Backend::kCpu, x, gamma, mean, rstd, dy, *dx, *dgamma, *dbeta);
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
    layer_norm_bwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                            static_cast<const T*>(gamma.untyped_data()), mean.untyped_data(),
                            rstd.untyped_data(), static_cast<const T*>(dy.untyped_data()),
                            static_cast<T*>(dx->untyped_data()), dg, db, rows, width);
  });
  if (!ok) return invalid("layer_norm backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

}  // namespace

// v1 takes eps as f32, v2 as f64 (which an f64 input needs to normalise with its exact eps)
#define RLX_LAYER_NORM_FWD_BINDING(EPS)            \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::AnyBuffer>() /* x */               \
      .Arg<ffi::AnyBuffer>() /* gamma */           \
      .Arg<ffi::AnyBuffer>() /* beta */            \
      .Ret<ffi::AnyBuffer>() /* y */               \
      .Ret<ffi::AnyBuffer>() /* mean */            \
      .Ret<ffi::AnyBuffer>() /* rstd */            \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormFwd, LayerNormFwdImpl<float>, RLX_LAYER_NORM_FWD_BINDING(float));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormFwdV2, LayerNormFwdImpl<double>, RLX_LAYER_NORM_FWD_BINDING(double));
#undef RLX_LAYER_NORM_FWD_BINDING

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
RLX_REGISTER_HANDLER("rlx_layer_norm_fwd_v2", RlxLayerNormFwdV2);
RLX_REGISTER_HANDLER("rlx_layer_norm_bwd", RlxLayerNormBwd);

}  // namespace rlx
