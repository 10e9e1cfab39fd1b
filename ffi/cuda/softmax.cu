// XLA FFI handlers for softmax over the last axis on CUDA: targets rlx_softmax_fwd and
// rlx_softmax_bwd, with the operands and semantics of the CPU handlers (ffi/cpu/softmax.cc).
//
//   rlx_softmax_fwd: x [R.., W] -> y = exp(x - max(x)) / sum(exp(x - max(x)))
//   rlx_softmax_bwd: y, dy [R.., W] -> dx = y * (dy - sum(dy * y))
//   rlx_softmax_bwd_x: x, dy [R.., W] -> the same dx with y = softmax(x) recomputed in
//     the row pass (a pullback keeps x, not y: the forward need not write y)
// One dtype for all operands (f32, bf16, f16), f32 arithmetic.
//
// Work layout (rowwise_common.cuh): a group of tpr threads per row; the row is walked in
// chunks of tpr * NV vectors of 16 bytes that a thread keeps in registers. The forward
// keeps a running (max, rescaled sum) per thread over the chunks, reduces them over the
// group (max, then sum: fixed order), then writes the chunks in reverse order: the last
// chunk is still in registers, so rows of one chunk (up to 8192 f32 / 16384 16-bit
// elements per 512-thread block in the forward, half that in the backwards) are read once from memory; wider rows re-read the
// earlier chunks, which the first pass left in L2 (default-cached loads).
// The backward does the same with the row dot product sum(dy * y).
// The backward from x keeps, per thread, a running max m, s = sum exp(x - m) and
// d = sum exp(x - m) dy (both rescaled when m grows), reduces max, then s and d over the
// group, and writes dx = exp(x - M) / S * (dy - D / S) chunk by chunk in reverse order.
// Rows of one chunk (a separate instantiation, picked by the launcher) take the group
// max first instead, so each element is exponentiated once and kept in registers.

#include "cuda/rowwise_common.cuh"
#include "softmax_checks.h"

namespace rlx {
namespace cuda {
namespace {

using namespace rw;

constexpr int kMaxThreads = 512;

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kMaxThreads, 2)
softmax_fwd_k(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t W, int tpr) {
  __shared__ float red[64];
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr, t = threadIdx.x - g * tpr;
  const int64_t chunk = int64_t(tpr) * NV * VEC;
  const int64_t nch = (W + chunk - 1) / chunk;
  const bool one = nch == 1;
  int ph = 0;
  for (int64_t rb = blockIdx.x; rb * gpb < rows; rb += gridDim.x) {
    const int64_t r = rb * gpb + g;
    const bool rv = r < rows;
    const T* xr = x + (rv ? r : 0) * W;
    float v[NV][VEC];
    float m = -INFINITY, s = 0.f;
    for (int64_t c = 0; c < nch; ++c) {
      load_chunk<T, VEC, NV>(xr, c * chunk, tpr, t, W, rv, one, -INFINITY, v);
      online_max_sumexp<NV, VEC>(v, m, s);
    }
    float M;
    const float inv = 1.f / group_sumexp(m, s, tpr, red, ph, M);
    if (!rv) continue;
    T* yr = y + r * W;
    for (int64_t c = nch - 1; c >= 0; --c) {
      if (c != nch - 1) load_chunk<T, VEC, NV>(xr, c * chunk, tpr, t, W, true, true, -INFINITY, v);
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t col = c * chunk + int64_t(t + k * tpr) * VEC;
        if (col >= W) continue;
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = fast_exp(v[k][i] - M) * inv;
        store_vec<T, VEC>(yr + col, o);
      }
    }
  }
}

// ONE (picked by the launcher, as for softmax_bwd_x_k): every row fits one chunk, so the
// chunk loops have one trip and the loads stream (ld.global.cs) at compile time.
template <typename T, int VEC, int NV, bool ONE = false>
__global__ void __launch_bounds__(kMaxThreads, 2)
softmax_bwd_k(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, int64_t rows, int64_t W,
              int tpr) {
  __shared__ float red[64];
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr, t = threadIdx.x - g * tpr;
  const int64_t chunk = int64_t(tpr) * NV * VEC;
  const int64_t nch = ONE ? 1 : (W + chunk - 1) / chunk;
  const bool one = ONE || nch == 1;
  int ph = 0;
  for (int64_t rb = blockIdx.x; rb * gpb < rows; rb += gridDim.x) {
    const int64_t r = rb * gpb + g;
    const bool rv = r < rows;
    const int64_t off = (rv ? r : 0) * W;
    float a[NV][VEC], b[NV][VEC];
    float dot = 0.f;
    for (int64_t c = 0; c < nch; ++c) {
      load_chunk<T, VEC, NV>(y + off, c * chunk, tpr, t, W, rv, one, 0.f, a);
      load_chunk<T, VEC, NV>(dy + off, c * chunk, tpr, t, W, rv, one, 0.f, b);
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot += a[k][i] * b[k][i];
    }
    dot = group_sum(dot, tpr, red, ph);
    ph ^= 1;
    if (!rv) continue;
    for (int64_t c = nch - 1; c >= 0; --c) {
      if (c != nch - 1) {
        load_chunk<T, VEC, NV>(y + off, c * chunk, tpr, t, W, true, true, 0.f, a);
        load_chunk<T, VEC, NV>(dy + off, c * chunk, tpr, t, W, true, true, 0.f, b);
      }
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t col = c * chunk + int64_t(t + k * tpr) * VEC;
        if (col >= W) continue;
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = a[k][i] * (b[k][i] - dot);
        store_vec<T, VEC>(dx + off + col, o);
      }
    }
  }
}

// ONE: every row fits one chunk (W <= tpr * NV * VEC), decided by the launcher.
template <typename T, int VEC, int NV, bool ONE>
__global__ void __launch_bounds__(kMaxThreads, 2)
softmax_bwd_x_k(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx, int64_t rows, int64_t W,
                int tpr) {
  __shared__ float red[64];
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr, t = threadIdx.x - g * tpr;
  [[maybe_unused]] const int64_t chunk = int64_t(tpr) * NV * VEC;
  [[maybe_unused]] const int64_t nch = (W + chunk - 1) / chunk;
  int ph = 0;
  for (int64_t rb = blockIdx.x; rb * gpb < rows; rb += gridDim.x) {
    const int64_t r = rb * gpb + g;
    const bool rv = r < rows;
    const int64_t off = (rv ? r : 0) * W;
    float a[NV][VEC], b[NV][VEC];  // x (then exp(x - M)), dy
    float M, inv, dot;
    if constexpr (ONE) {
      load_chunk<T, VEC, NV>(x + off, 0, tpr, t, W, rv, true, -INFINITY, a);
      load_chunk<T, VEC, NV>(dy + off, 0, tpr, t, W, rv, true, 0.f, b);
      M = group_max(chunk_max<NV, VEC>(a), tpr, red, ph);
      ph ^= 1;
      float s = 0.f, d = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          // padding (x = -inf) gives exp(-inf) = 0; a row of -inf gives NaN, as the reference
          a[k][i] = fast_exp(a[k][i] - M);
          s += a[k][i];
          d += a[k][i] * b[k][i];
        }
      const float S = group_sum(s, tpr, red, ph);
      ph ^= 1;
      const float D = group_sum(d, tpr, red, ph);
      ph ^= 1;
      inv = 1.f / S;
      dot = D * inv;
      if (!rv) continue;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t col = int64_t(t + k * tpr) * VEC;
        if (col >= W) continue;
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = a[k][i] * inv * (b[k][i] - dot);
        store_vec<T, VEC>(dx + off + col, o);
      }
    } else {
      float m = -INFINITY, s = 0.f, d = 0.f;
      for (int64_t c = 0; c < nch; ++c) {
        load_chunk<T, VEC, NV>(x + off, c * chunk, tpr, t, W, rv, false, -INFINITY, a);
        load_chunk<T, VEC, NV>(dy + off, c * chunk, tpr, t, W, rv, false, 0.f, b);
        const float cm = chunk_max<NV, VEC>(a);
        if (cm > m) {
          const float f = fast_exp(m - cm);  // 0 while m is -inf
          s *= f;
          d *= f;
          m = cm;
        }
        if (m != -INFINITY) {
#pragma unroll
          for (int k = 0; k < NV; ++k)
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              const float e = fast_exp(a[k][i] - m);
              s += e;
              d += e * b[k][i];
            }
        }
      }
      M = group_max(m, tpr, red, ph);
      ph ^= 1;
      const float f = m == -INFINITY ? 0.f : fast_exp(m - M);
      const float S = group_sum(s * f, tpr, red, ph);
      ph ^= 1;
      const float D = group_sum(d * f, tpr, red, ph);
      ph ^= 1;
      inv = 1.f / S;
      dot = D * inv;
      if (!rv) continue;
      for (int64_t c = nch - 1; c >= 0; --c) {
        if (c != nch - 1) {
          load_chunk<T, VEC, NV>(x + off, c * chunk, tpr, t, W, true, true, -INFINITY, a);
          load_chunk<T, VEC, NV>(dy + off, c * chunk, tpr, t, W, true, true, 0.f, b);
        }
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const int64_t col = c * chunk + int64_t(t + k * tpr) * VEC;
          if (col >= W) continue;
          float o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) o[i] = fast_exp(a[k][i] - M) * inv * (b[k][i] - dot);
          store_vec<T, VEC>(dx + off + col, o);
        }
      }
    }
  }
}

enum class Kind { kFwd, kBwd, kBwdX };

// Elements per thread per chunk: 16 in the forward (one array), 8 in the backwards (two),
// doubled for 16-bit types on the 16-byte vector path (same bytes in flight as f32:
// 2-byte rows of 4096 then take 256 threads a row, each with two 16-byte vectors of y and
// of dy, instead of 512 threads with one; faster in an H200 A/B than the same element counts for
// every dtype, and than the general chunk loop for one-chunk rows of the backward from y).
template <typename T, Kind K>
ffi::Error launch(cudaStream_t stream, const T* a, const T* b, T* out, int64_t rows, int64_t W) {
  constexpr bool BWD = K != Kind::kFwd;
  constexpr int v16 = kVec16<T>;
  constexpr int kElems = BWD ? 8 : 16;
  const bool aligned = aligned16(a) && aligned16(out) && (!BWD || aligned16(b));
  const int sms = num_sms();
  auto go = [&](auto vec_c, auto elems_c) {
    constexpr int VEC = decltype(vec_c)::value;
    constexpr int NV = decltype(elems_c)::value / VEC;
    const Geom gm = row_geom(rows, ceil_div(W, VEC), NV, kMaxThreads, sms);
    if constexpr (K == Kind::kBwdX) {
      if (W <= int64_t(gm.tpr) * NV * VEC)
        softmax_bwd_x_k<T, VEC, NV, true><<<unsigned(gm.grid), gm.threads, 0, stream>>>(a, b, out, rows, W, gm.tpr);
      else
        softmax_bwd_x_k<T, VEC, NV, false><<<unsigned(gm.grid), gm.threads, 0, stream>>>(a, b, out, rows, W, gm.tpr);
    } else if constexpr (K == Kind::kBwd) {
      if (W <= int64_t(gm.tpr) * NV * VEC)
        softmax_bwd_k<T, VEC, NV, true><<<unsigned(gm.grid), gm.threads, 0, stream>>>(a, b, out, rows, W, gm.tpr);
      else
        softmax_bwd_k<T, VEC, NV><<<unsigned(gm.grid), gm.threads, 0, stream>>>(a, b, out, rows, W, gm.tpr);
    }
    else
      softmax_fwd_k<T, VEC, NV><<<unsigned(gm.grid), gm.threads, 0, stream>>>(a, out, rows, W, gm.tpr);
  };
  if (aligned && W % v16 == 0) {
    go(std::integral_constant<int, v16>{}, std::integral_constant<int, sizeof(T) == 2 ? kElems * 2 : kElems>{});
  } else {
    go(std::integral_constant<int, 1>{}, std::integral_constant<int, kElems>{});
  }
  return check_launch(BWD ? "softmax backward (cuda) launch" : "softmax (cuda) launch");
}

ffi::Error SoftmaxFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (auto e = softmax::check_fwd(x, *y); e.failure()) return e;
  const RowsView v = rows_view(x);
  if (v.rows == 0 || v.width == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = launch<T, Kind::kFwd>(stream, static_cast<const T*>(x.untyped_data()), nullptr,
                              static_cast<T*>(y->untyped_data()), v.rows, v.width);
  });
  if (!ok) return invalid("softmax (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

// rlx_softmax_bwd (a = y) and rlx_softmax_bwd_x (a = x): a, dy -> dx, one dtype.
template <Kind K>
ffi::Error softmax_bwd_impl(cudaStream_t stream, const ffi::AnyBuffer& a, const ffi::AnyBuffer& dy,
                            ffi::Result<ffi::AnyBuffer> dx, const char* a_name) {
  if (auto e = softmax::check_bwd(a, a_name, dy, *dx); e.failure()) return e;
  const RowsView v = rows_view(a);
  if (v.rows == 0 || v.width == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(a.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = launch<T, K>(stream, static_cast<const T*>(a.untyped_data()), static_cast<const T*>(dy.untyped_data()),
                          static_cast<T*>(dx->untyped_data()), v.rows, v.width);
  });
  if (!ok) return invalid("softmax backward (cuda): unsupported dtype " + dtype_name(a.element_type()));
  return result;
}

ffi::Error SoftmaxBwdImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx) {
  return softmax_bwd_impl<Kind::kBwd>(stream, y, dy, dx, "y");
}

ffi::Error SoftmaxBwdXImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx) {
  return softmax_bwd_impl<Kind::kBwdX>(stream, x, dy, dx, "x");
}

}  // namespace

// Command-buffer compatible: kernels on XLA's stream only, launch shapes from the
// buffer shapes and the device.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxFwdCuda, SoftmaxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>(),  // y
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxBwdCuda, SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // y
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Ret<ffi::AnyBuffer>(),  // dx
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxBwdXCuda, SoftmaxBwdXImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Ret<ffi::AnyBuffer>(),  // dx
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_softmax_fwd", RlxSoftmaxFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_softmax_bwd", RlxSoftmaxBwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_softmax_bwd_x", RlxSoftmaxBwdXCuda);

}  // namespace cuda
}  // namespace rlx
