// Softmax over the last axis, forward and backward.
//
//   x, y, dy, dx: [R, W] (leading axes flattened into R rows)
//   forward:   m = max_j x_j,  s = sum_j exp(x_j - m),  y_j = exp(x_j - m) / s
//   backward:  dx_j = y_j * (dy_j - sum_i dy_i y_i)
// The backward reads y and dy once and writes dx (the softmax Jacobian is
// symmetric, so the same kernel is also the forward-mode tangent map).
//   backward from x (target rlx_softmax_bwd_x): (x, dy) -> dx with y recomputed per
//   row: e_j = exp(x_j - m), s = sum_j e_j, dot = sum_j e_j dy_j / s,
//   dx_j = e_j / s * (dy_j - dot). A pullback then keeps x, not y, as its residual, so
//   the forward need not write y when nothing else reads it. The row is walked four
//   times (max, exp and sum into the dx row, dot, final scale), from cache.
// f32 and bf16 rows run as 16-element blocks (ld16 / st16 of rowwise.h: bf16 widened by
// an integer shift, rounded to nearest even on the way out), in a body of 16-lane
// vectors on AVX-512 CPUs and of two 8-lane halves in the row clones elsewhere, picked
// by cpu_has_x86_64_v4(). A row's sums (exp sum, dot) have 16 lanes, lane k holding
// the elements j = 16 i + k, added in lane order; the last n mod 16 elements run as one
// more block padded with neutral values (x: -inf, so exp gives 0; dy, y: 0), so every
// element sees the same vector operations in both bodies and the AVX-512 and AVX2
// machines give the same bits. bf16 rows are read straight from the input in each pass
// (no widened copy); only the exp values of a bf16 row go through f32 scratch.
// f16 rows run in f32 through converted scratch rows with the 8-lane helpers of
// rowwise.h; f64 rows in f64 with std::exp.
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/common.h"
#include "cpu/rowwise.h"
#include "softmax_checks.h"

namespace rlx {
namespace {

// ---- f32 / bf16 rows in 16-element blocks (V = v16f or P16, see rowwise.h) -------------
// (tails: ld16_pad / st16_part of rowwise.h)
RLX_ROW_INLINE v16f vexp16(const v16f& x) { return vexp_lanes<v16f, v16i>(x); }
RLX_ROW_INLINE P16 vexp16(const P16& x) { return {vexp8(x.lo), vexp8(x.hi)}; }

// max_j x_j (-inf for an all-NaN row: NaN never wins the comparison, as in row_max)
template <typename V, typename T>
RLX_ROW_INLINE float max_body(const T* x, int64_t n) {
  V a = splat16<V>(-INFINITY), b = a;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    a = max16(a, ld16<V>(x + j));
    b = max16(b, ld16<V>(x + j + 16));
  }
  if (j + 16 <= n) {
    a = max16(a, ld16<V>(x + j));
    j += 16;
  }
  if (j < n) b = max16(b, ld16_pad<V>(x + j, n - j, -INFINITY));
  a = max16(a, b);
  float m = lane16(a, 0);
  for (int k = 1; k < 16; ++k) m = lane16(a, k) > m ? lane16(a, k) : m;
  return m;
}

// e_j = exp(x_j - m); returns sum_j e_j. When dy != nullptr also *dot = sum_j e_j dy_j.
template <typename V, typename T>
RLX_ROW_INLINE float exp_body(const T* x, const T* dy, float m, float* e, int64_t n, float* dot) {
  const V sh = splat16<V>(m);
  V s = splat16<V>(0.0f), d = s;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const V v = vexp16(ld16<V>(x + j) - sh);
    st16(e + j, v);
    s += v;
    if (dy) d += v * ld16<V>(dy + j);
  }
  if (j < n) {
    const V v = vexp16(ld16_pad<V>(x + j, n - j, -INFINITY) - sh);
    st16_part(e + j, v, n - j);
    s += v;
    if (dy) d += v * ld16_pad<V>(dy + j, n - j, 0.0f);
  }
  if (dy) *dot = hsum16(d);
  return hsum16(s);
}

// y_j = T(e_j * inv)
template <typename V, typename T>
RLX_ROW_INLINE void scale_body(const float* e, float inv, T* y, int64_t n) {
  const V vi = splat16<V>(inv);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) st16(y + j, ld16<V>(e + j) * vi);
  if (j < n) st16_part(y + j, ld16_pad<V>(e + j, n - j, 0.0f) * vi, n - j);
}

// Rows [r0, r1) of the forward; scratch: n floats (bf16 rows' exp values).
template <typename V, typename T>
RLX_ROW_INLINE void fwd_rows_body(const T* x, T* y, float* scratch, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    float* er;
    if constexpr (std::is_same<T, float>::value) er = yr;
    else er = scratch;
    const float m = max_body<V>(xr, n);
    const float s = exp_body<V, T>(xr, nullptr, m, er, n, nullptr);
    scale_body<V>(er, 1.0f / s, yr, n);
  }
}

// Rows [r0, r1) of the backward from y: dx_j = y_j (dy_j - sum_i y_i dy_i).
template <typename V, typename T>
RLX_ROW_INLINE void bwd_rows_body(const T* y, const T* dy, T* dx, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* yr = y + r * n;
    const T* dyr = dy + r * n;
    T* dxr = dx + r * n;
    V a0 = splat16<V>(0.0f), a1 = a0;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      a0 += ld16<V>(yr + j) * ld16<V>(dyr + j);
      a1 += ld16<V>(yr + j + 16) * ld16<V>(dyr + j + 16);
    }
    if (j + 16 <= n) {
      a0 += ld16<V>(yr + j) * ld16<V>(dyr + j);
      j += 16;
    }
    if (j < n) a1 += ld16_pad<V>(yr + j, n - j, 0.0f) * ld16_pad<V>(dyr + j, n - j, 0.0f);
    const V dot = splat16<V>(hsum16(a0 + a1));
    for (j = 0; j + 16 <= n; j += 16) st16(dxr + j, ld16<V>(yr + j) * (ld16<V>(dyr + j) - dot));
    if (j < n)
      st16_part(dxr + j, ld16_pad<V>(yr + j, n - j, 0.0f) * (ld16_pad<V>(dyr + j, n - j, 0.0f) - dot), n - j);
  }
}

// Rows [r0, r1) of the backward from x: e_j = exp(x_j - m), s = sum e, dot = sum e dy / s,
// dx_j = e_j / s (dy_j - dot). scratch: n floats (the e of a bf16 row; f32 rows use dx).
template <typename V, typename T>
RLX_ROW_INLINE void bwd_x_rows_body(const T* x, const T* dy, T* dx, float* scratch, int64_t r0, int64_t r1,
                                    int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    const T* dyr = dy + r * n;
    T* dxr = dx + r * n;
    float* er;
    if constexpr (std::is_same<T, float>::value) er = dxr;
    else er = scratch;
    const float m = max_body<V>(xr, n);
    float d = 0.0f;
    const float inv = 1.0f / exp_body<V, T>(xr, dyr, m, er, n, &d);
    const float dot = d * inv;
    const V vi = splat16<V>(inv), vd = splat16<V>(dot);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) st16(dxr + j, ld16<V>(er + j) * vi * (ld16<V>(dyr + j) - vd));
    if (j < n)
      st16_part(dxr + j, ld16_pad<V>(er + j, n - j, 0.0f) * vi * (ld16_pad<V>(dyr + j, n - j, 0.0f) - vd),
                n - j);
  }
}

#define RLX_SOFTMAX_ROWS(T)                                                                          \
  RLX_ROW_V4 void fwd_rows_v16(const T* x, T* y, float* s, int64_t r0, int64_t r1, int64_t n) {      \
    fwd_rows_body<v16f>(x, y, s, r0, r1, n);                                                          \
  }                                                                                                  \
  RLX_ROW_CLONES void fwd_rows_v8(const T* x, T* y, float* s, int64_t r0, int64_t r1, int64_t n) {   \
    fwd_rows_body<P16>(x, y, s, r0, r1, n);                                                           \
  }                                                                                                  \
  RLX_ROW_V4 void bwd_rows_v16(const T* y, const T* dy, T* dx, int64_t r0, int64_t r1, int64_t n) {  \
    bwd_rows_body<v16f>(y, dy, dx, r0, r1, n);                                                        \
  }                                                                                                  \
  RLX_ROW_CLONES void bwd_rows_v8(const T* y, const T* dy, T* dx, int64_t r0, int64_t r1,            \
                                  int64_t n) {                                                       \
    bwd_rows_body<P16>(y, dy, dx, r0, r1, n);                                                         \
  }                                                                                                  \
  RLX_ROW_V4 void bwd_x_rows_v16(const T* x, const T* dy, T* dx, float* s, int64_t r0, int64_t r1,   \
                                 int64_t n) {                                                        \
    bwd_x_rows_body<v16f>(x, dy, dx, s, r0, r1, n);                                                   \
  }                                                                                                  \
  RLX_ROW_CLONES void bwd_x_rows_v8(const T* x, const T* dy, T* dx, float* s, int64_t r0,           \
                                    int64_t r1, int64_t n) {                                         \
    bwd_x_rows_body<P16>(x, dy, dx, s, r0, r1, n);                                                    \
  }
RLX_SOFTMAX_ROWS(float)
RLX_SOFTMAX_ROWS(bf16)
#undef RLX_SOFTMAX_ROWS

// Whether T's rows take the 16-element blocks above (f32, bf16).
template <typename T>
constexpr bool kBlockRows = std::is_same<T, float>::value || std::is_same<T, bf16>::value;

template <typename T>
void softmax_fwd_typed(ffi::ThreadPool& pool, const T* x, T* y, int64_t rows, int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    if constexpr (kBlockRows<T>) {
      std::vector<float> scratch(std::is_same<T, float>::value ? 0 : width);
      if (cpu_has_x86_64_v4()) fwd_rows_v16(x, y, scratch.data(), r0, r1, width);
      else fwd_rows_v8(x, y, scratch.data(), r0, r1, width);
      return;
    }
    std::vector<float> in_buf(width), out_buf(width);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = row_as_f32<T>(x + r * width, in_buf.data(), width);
      float* yr = out_row_f32<T>(y + r * width, out_buf.data());
      const float m = row_max(xr, width);
      const float s = exp_shift_sum(xr, m, yr, width);
      scale_row(yr, 1.0f / s, width);
      store_row<T>(yr, y + r * width, width);
    }
  });
}

template <>
void softmax_fwd_typed<double>(ffi::ThreadPool& pool, const double* x, double* y, int64_t rows,
                               int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const double* xr = x + r * width;
      double* yr = y + r * width;
      double m = -INFINITY;
      for (int64_t j = 0; j < width; ++j) m = xr[j] > m ? xr[j] : m;
      double s = 0;
      for (int64_t j = 0; j < width; ++j) { yr[j] = std::exp(xr[j] - m); s += yr[j]; }
      const double inv = 1.0 / s;
      for (int64_t j = 0; j < width; ++j) yr[j] *= inv;
    }
  });
}

template <typename T>
void softmax_bwd_typed(ffi::ThreadPool& pool, const T* y, const T* dy, T* dx, int64_t rows,
                       int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    if constexpr (kBlockRows<T>) {
      if (cpu_has_x86_64_v4()) bwd_rows_v16(y, dy, dx, r0, r1, width);
      else bwd_rows_v8(y, dy, dx, r0, r1, width);
      return;
    }
    std::vector<float> y_buf(width), dy_buf(width), out_buf(width);
    for (int64_t r = r0; r < r1; ++r) {
      const float* yr = row_as_f32<T>(y + r * width, y_buf.data(), width);
      const float* dyr = row_as_f32<T>(dy + r * width, dy_buf.data(), width);
      float* dxr = out_row_f32<T>(dx + r * width, out_buf.data());
      softmax_bwd_row(yr, dyr, row_dot(yr, dyr, width), dxr, width);
      store_row<T>(dxr, dx + r * width, width);
    }
  });
}

template <>
void softmax_bwd_typed<double>(ffi::ThreadPool& pool, const double* y, const double* dy,
                               double* dx, int64_t rows, int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const double *yr = y + r * width, *dyr = dy + r * width;
      double dot = 0;
      for (int64_t j = 0; j < width; ++j) dot += yr[j] * dyr[j];
      for (int64_t j = 0; j < width; ++j) dx[r * width + j] = yr[j] * (dyr[j] - dot);
    }
  });
}

// e[j] = e[j] * inv * (dy[j] - dot), in place (the last pass of the backward from x).
RLX_ROW_CLONES static void softmax_bwd_x_finish(float* e, const float* dy, float inv, float dot, int64_t n) {
  for (int64_t j = 0; j < n; ++j) e[j] = e[j] * inv * (dy[j] - dot);
}

template <typename T>
void softmax_bwd_x_typed(ffi::ThreadPool& pool, const T* x, const T* dy, T* dx, int64_t rows,
                         int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    if constexpr (kBlockRows<T>) {
      std::vector<float> scratch(std::is_same<T, float>::value ? 0 : width);
      if (cpu_has_x86_64_v4()) bwd_x_rows_v16(x, dy, dx, scratch.data(), r0, r1, width);
      else bwd_x_rows_v8(x, dy, dx, scratch.data(), r0, r1, width);
      return;
    }
    std::vector<float> x_buf(width), dy_buf(width), out_buf(width);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = row_as_f32<T>(x + r * width, x_buf.data(), width);
      const float* dyr = row_as_f32<T>(dy + r * width, dy_buf.data(), width);
      float* er = out_row_f32<T>(dx + r * width, out_buf.data());  // e, then dx
      const float m = row_max(xr, width);
      const float inv = 1.0f / exp_shift_sum(xr, m, er, width);
      const float dot = row_dot(er, dyr, width) * inv;
      softmax_bwd_x_finish(er, dyr, inv, dot, width);
      store_row<T>(er, dx + r * width, width);
    }
  });
}

template <>
void softmax_bwd_x_typed<double>(ffi::ThreadPool& pool, const double* x, const double* dy,
                                 double* dx, int64_t rows, int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const double *xr = x + r * width, *dyr = dy + r * width;
      double* er = dx + r * width;
      double m = -INFINITY;
      for (int64_t j = 0; j < width; ++j) m = xr[j] > m ? xr[j] : m;
      double s = 0, d = 0;
      for (int64_t j = 0; j < width; ++j) {
        er[j] = std::exp(xr[j] - m);
        s += er[j];
        d += er[j] * dyr[j];
      }
      const double inv = 1.0 / s, dot = d * inv;
      for (int64_t j = 0; j < width; ++j) er[j] = er[j] * inv * (dyr[j] - dot);
    }
  });
}

ffi::Error SoftmaxFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (auto e = softmax::check_fwd(x, *y); e.failure()) return e;
  auto [rows, width] = rows_view(x);
  if (rows == 0 || width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    softmax_fwd_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                         static_cast<T*>(y->untyped_data()), rows, width);
  });
  if (!ok) return invalid("softmax: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error SoftmaxBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer y, ffi::AnyBuffer dy,
                          ffi::Result<ffi::AnyBuffer> dx) {
  if (auto e = softmax::check_bwd(y, "y", dy, *dx); e.failure()) return e;
  auto [rows, width] = rows_view(y);
  if (rows == 0 || width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(y.element_type(), [&](auto tag) {
    using T = decltype(tag);
    softmax_bwd_typed<T>(pool, static_cast<const T*>(y.untyped_data()),
                         static_cast<const T*>(dy.untyped_data()),
                         static_cast<T*>(dx->untyped_data()), rows, width);
  });
  if (!ok) return invalid("softmax backward: unsupported dtype " + dtype_name(y.element_type()));
  return ffi::Error::Success();
}

ffi::Error SoftmaxBwdXImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                           ffi::Result<ffi::AnyBuffer> dx) {
  if (auto e = softmax::check_bwd(x, "x", dy, *dx); e.failure()) return e;
  auto [rows, width] = rows_view(x);
  if (rows == 0 || width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    softmax_bwd_x_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                           static_cast<const T*>(dy.untyped_data()),
                           static_cast<T*>(dx->untyped_data()), rows, width);
  });
  if (!ok) return invalid("softmax backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxFwd, SoftmaxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxBwd, SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // y
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Ret<ffi::AnyBuffer>());  // dx

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxBwdX, SoftmaxBwdXImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Ret<ffi::AnyBuffer>());  // dx

RLX_REGISTER_HANDLER("rlx_softmax_fwd", RlxSoftmaxFwd);
RLX_REGISTER_HANDLER("rlx_softmax_bwd", RlxSoftmaxBwd);
RLX_REGISTER_HANDLER("rlx_softmax_bwd_x", RlxSoftmaxBwdX);

}  // namespace rlx
