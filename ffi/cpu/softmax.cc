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
// f32 / bf16 / f16 rows run in f32 with the vectorised exp of rowwise.h;
// f64 rows in f64 with std::exp.
#include <cmath>
#include <vector>

#include "cpu/common.h"
#include "cpu/rowwise.h"

namespace rlx {
namespace {

template <typename T>
void softmax_fwd_typed(ffi::ThreadPool& pool, const T* x, T* y, int64_t rows, int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    std::vector<float> in_buf(std::is_same<T, float>::value ? 0 : width);
    std::vector<float> out_buf(std::is_same<T, float>::value ? 0 : width);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
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
    const bool f32 = std::is_same<T, float>::value;
    std::vector<float> y_buf(f32 ? 0 : width), dy_buf(f32 ? 0 : width), out_buf(f32 ? 0 : width);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
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

// bf16 <-> f32 rows, compiled with the row clones so that they vectorise with AVX2 (the
// generic load/store of common.h are compiled for the baseline ISA only). Same values
// as load<float> / store<bf16> (exact widening; round to nearest even, NaN kept quiet).
RLX_ROW_CLONES static void bf16_row_to_f32(const bf16* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = to_f32(src[j]);
}
RLX_ROW_CLONES static void f32_row_to_bf16(const float* src, bf16* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = from_f32_bf16(src[j]);
}

// f32 views of an input row / rounding of a result row for the backward from x.
template <typename T>
const float* bwd_x_in(const T* src, float* scratch, int64_t n) { return row_as_f32<T>(src, scratch, n); }
template <>
const float* bwd_x_in<bf16>(const bf16* src, float* scratch, int64_t n) {
  bf16_row_to_f32(src, scratch, n);
  return scratch;
}
template <typename T>
void bwd_x_out(const float* src, T* dst, int64_t n) { store_row<T>(src, dst, n); }
template <>
void bwd_x_out<bf16>(const float* src, bf16* dst, int64_t n) { f32_row_to_bf16(src, dst, n); }

template <typename T>
void softmax_bwd_x_typed(ffi::ThreadPool& pool, const T* x, const T* dy, T* dx, int64_t rows,
                         int64_t width) {
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t c) {
    const bool f32 = std::is_same<T, float>::value;
    std::vector<float> x_buf(f32 ? 0 : width), dy_buf(f32 ? 0 : width), out_buf(f32 ? 0 : width);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = bwd_x_in<T>(x + r * width, x_buf.data(), width);
      const float* dyr = bwd_x_in<T>(dy + r * width, dy_buf.data(), width);
      float* er = out_row_f32<T>(dx + r * width, out_buf.data());  // e, then dx
      const float m = row_max(xr, width);
      const float inv = 1.0f / exp_shift_sum(xr, m, er, width);
      const float dot = row_dot(er, dyr, width) * inv;
      softmax_bwd_x_finish(er, dyr, inv, dot, width);
      bwd_x_out<T>(er, dx + r * width, width);
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

ffi::Error check_like(const ffi::AnyBuffer& ref, const ffi::AnyBuffer& b, const char* what) {
  if (!same_dims(ref, b) || b.element_type() != ref.element_type())
    return invalid(std::string("softmax: ") + what + " must match x in shape and dtype (" +
                   dtype_name(ref.element_type()) + ")");
  return ffi::Error::Success();
}

ffi::Error SoftmaxFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (x.dimensions().size() < 1) return invalid("softmax: x must have rank >= 1");
  if (auto e = check_like(x, *y, "output y"); e.failure()) return e;
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
  if (y.dimensions().size() < 1) return invalid("softmax backward: y must have rank >= 1");
  if (auto e = check_like(y, dy, "dy"); e.failure()) return e;
  if (auto e = check_like(y, *dx, "output dx"); e.failure()) return e;
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
  if (x.dimensions().size() < 1) return invalid("softmax backward: x must have rank >= 1");
  if (auto e = check_like(x, dy, "dy"); e.failure()) return e;
  if (auto e = check_like(x, *dx, "output dx"); e.failure()) return e;
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
