// XLA FFI handlers for GroupNorm on NCHW (any trailing spatial rank) on CUDA: targets
// rlx_group_norm_fwd and rlx_group_norm_bwd, with the operands, attributes and
// semantics of the CPU handlers (ffi/cpu/group_norm.cc) plus a scratch result on the
// backward.
//
//   x: [N, C, S...] (S = product of the trailing axes), gamma, beta: [C], G groups of
//   K = C / G channels: block (n, g) is the contiguous run of M = K * S values
//   x[n, g*K:(g+1)*K, ...]; mean, rstd: f32 [N, G]; xhat = (x - mean) * rstd,
//   y[n, c, s] = xhat * gamma[c] + beta[c].
// Backward, u = dy * gamma[c], means over the block:
//   dx = rstd * (u - mean(u) - xhat * mean(u * xhat))
//   dgamma_c = sum_{n,s} dy * xhat      dbeta_c = sum_{n,s} dy
//
// Kernels (all deterministic: fixed-order sums, no atomics):
//   forward:  gn_row_sums over the N*G blocks -> mean, rstd (sums shifted by the block's
//             first element); gn_apply, elementwise -> y.
//   backward: gn_row_sums over the N*C channel rows -> A[n,c] = sum_s dy,
//             B[n,c] = sum_s dy * (x - mean[n,g]); gn_block_coefs -> per (n, g)
//             mean(u) and mean(u * xhat) (from gamma, A, B); gn_param_grads -> dgamma_c =
//             sum_n rstd[n,g] B[n,c], dbeta_c = sum_n A[n,c] (n in order); gn_dx,
//             elementwise -> dx.
//   scratch [S] f32, S >= 2 N C + 2 N G (sized by rlx_jax/vjp_rules/group_norm.py).
// Bytes: the forward reads x twice and writes y (1.5x the one-pass minimum); the
// backward reads x and dy twice and writes dx (5/3x): the block statistics are needed
// before any element of the block can be written, and a block (K * S values) is in
// general too large to keep on chip. That is the documented cost of this family.
#include "cuda/rowwise_common.cuh"

namespace rlx {
namespace cuda {
namespace {

using namespace rw;

constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;

// Row sums over `rows` rows of width W, a group of tpr threads per row.
// !BWD: out_a[r] = mean, out_b[r] = rstd of the row (shifted sums, x0 = first element).
// BWD:  out_a[r] = sum dy, out_b[r] = sum dy * (x - mean[r / K]).
template <typename T, int VEC, bool BWD>
__global__ void __launch_bounds__(kMaxThreads)
gn_row_sums(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ mean,
            float* __restrict__ out_a, float* __restrict__ out_b, float eps, int64_t rows, int64_t W, int64_t K,
            int tpr, bool stream) {
  __shared__ float red[128];
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr, t = threadIdx.x - g * tpr;
  int ph = 0;
  for (int64_t rb = blockIdx.x; rb * gpb < rows; rb += gridDim.x) {
    const int64_t r = rb * gpb + g;
    const bool rv = r < rows;
    float a = 0.f, b = 0.f, x0 = 0.f;
    if (rv) {
      const T* xr = x + r * W;
      x0 = BWD ? mean[r / K] : to_f32(xr[0]);
#pragma unroll kUnroll
      for (int64_t j = int64_t(t) * VEC; j < W; j += int64_t(tpr) * VEC) {
        float xv[VEC];
        load_vec_rw<T, VEC>(xr + j, xv, stream);
        if constexpr (BWD) {
          float dv[VEC];
          load_vec_rw<T, VEC>(dy + r * W + j, dv, stream);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            a += dv[i];
            b += dv[i] * (xv[i] - x0);
          }
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float d = xv[i] - x0;
            a += d;
            b += d * d;
          }
        }
      }
    }
    const float2 v = group_sum2(a, b, tpr, red, ph);
    ph ^= 1;
    if (rv && t == 0) {
      if constexpr (BWD) {
        out_a[r] = v.x;
        out_b[r] = v.y;
      } else {
        const float m1 = v.x / float(W);
        const float var = fmaxf(v.y / float(W) - m1 * m1, 0.f);
        out_a[r] = x0 + m1;
        out_b[r] = rsqrtf(var + eps);
      }
    }
  }
}

// (row, channel, block) of element e of an [N*C, S] view: 32-bit divisions where the
// values fit (a 64-bit division per vector costs more than the vector's memory time).
struct Where { int64_t c, blk; };
__device__ __forceinline__ Where where(int64_t e, int64_t S, int64_t C, int64_t K, bool small) {
  if (small) {
    const uint32_t row = uint32_t(e) / uint32_t(S);
    return {int64_t(row % uint32_t(C)), int64_t(row / uint32_t(K))};
  }
  const int64_t row = e / S;
  return {row % C, row / K};
}

// y = (x - mean[n,g]) * rstd[n,g] * gamma[c] + beta[c] over N*C rows of S values; a vector
// never crosses a row (S % VEC == 0).
template <typename T, int VEC>
__global__ void __launch_bounds__(256)
gn_apply(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
         const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ y, int64_t n_vec, int64_t S,
         int64_t C, int64_t K) {
  const bool small = n_vec * VEC < (int64_t(1) << 32);
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vec; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = v * VEC;
    const Where w = where(e, S, C, K, small);  // row n * C + c; block n * G + c / K
    const int64_t c = w.c, blk = w.blk;
    const float mu = __ldg(mean + blk), rs = __ldg(rstd + blk);
    const float ga = to_f32(__ldg(gamma + c)) * rs, be = to_f32(__ldg(beta + c));
    float xv[VEC], o[VEC];
    load_vec<T, VEC>(x + e, xv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = (xv[i] - mu) * ga + be;
    store_vec<T, VEC>(y + e, o);
  }
}

// Per block (n, g): coef_a = mean(u) = sum_c gamma_c A[n,c] / M,
// coef_b = mean(u * xhat) = rstd * sum_c gamma_c B[n,c] / M.
template <typename T>
__global__ void __launch_bounds__(256)
gn_block_coefs(const T* __restrict__ gamma, const float* __restrict__ A, const float* __restrict__ B,
               const float* __restrict__ rstd, float* __restrict__ coef_a, float* __restrict__ coef_b, int64_t blocks,
               int64_t G, int64_t K, int64_t M) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  const int64_t n = b / G, g = b - n * G;
  float su = 0.f, sb = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t c = g * K + k;
    const float gm = to_f32(gamma[c]);
    su += gm * A[n * G * K + c];
    sb += gm * B[n * G * K + c];
  }
  coef_a[b] = su / float(M);
  coef_b[b] = rstd[b] * sb / float(M);
}

// dgamma_c = sum_n rstd[n, c / K] * B[n, c], dbeta_c = sum_n A[n, c], n in order.
template <typename T>
__global__ void __launch_bounds__(256)
gn_param_grads(const float* __restrict__ A, const float* __restrict__ B, const float* __restrict__ rstd,
               T* __restrict__ dgamma, T* __restrict__ dbeta, int64_t N, int64_t C, int64_t G, int64_t K) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float dg = 0.f, db = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    dg += rstd[n * G + c / K] * B[n * C + c];
    db += A[n * C + c];
  }
  dgamma[c] = from_f32<T>(dg);
  dbeta[c] = from_f32<T>(db);
}

// dx = rstd * (dy * gamma[c] - coef_a - xhat * coef_b) over N*C rows of S values.
template <typename T, int VEC>
__global__ void __launch_bounds__(256)
gn_dx(const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ gamma, const float* __restrict__ mean,
      const float* __restrict__ rstd, const float* __restrict__ coef_a, const float* __restrict__ coef_b,
      T* __restrict__ dx, int64_t n_vec, int64_t S, int64_t C, int64_t K) {
  const bool small = n_vec * VEC < (int64_t(1) << 32);
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vec; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = v * VEC;
    const Where w = where(e, S, C, K, small);
    const int64_t c = w.c, blk = w.blk;
    const float mu = __ldg(mean + blk), rs = __ldg(rstd + blk);
    const float ca = __ldg(coef_a + blk), cb = __ldg(coef_b + blk);
    const float gm = to_f32(__ldg(gamma + c));
    float xv[VEC], dv[VEC], o[VEC];
    load_vec<T, VEC>(x + e, xv);
    load_vec<T, VEC>(dy + e, dv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = rs * (dv[i] * gm - ca - (xv[i] - mu) * rs * cb);
    store_vec<T, VEC>(dx + e, o);
  }
}

template <typename T>
__global__ void fill_k(T* __restrict__ p, int64_t n, float value) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = from_f32<T>(value);
}

struct Layout {
  int64_t n, c, s, groups, k, m;
};

unsigned flat_grid(int64_t n_vec, int sms) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n_vec, 256), int64_t(sms) * 8 * 4)));
}

template <typename T, typename F>
void with_vec(bool vector_ok, F&& f) {
  if (vector_ok) f(std::integral_constant<int, kVec16<T>>{});
  else f(std::integral_constant<int, 1>{});
}

template <typename T>
ffi::Error launch_fwd(cudaStream_t stream, const Layout& L, const T* x, const T* gamma, const T* beta, T* y,
                      float* mean, float* rstd, float eps) {
  const int sms = num_sms();
  const int64_t blocks = L.n * L.groups;
  // a large tensor is re-read by gn_apply from memory anyway: stream it; a small one
  // (under ~32 MB) is kept in L2 for the second read
  const bool stream_x = L.n * L.c * L.s * int64_t(sizeof(T)) > (int64_t(32) << 20);
  with_vec<T>(aligned16(x) && L.m % kVec16<T> == 0, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const Geom gm = row_geom(blocks, ceil_div(L.m, VEC), kUnroll, kMaxThreads, sms);
    gn_row_sums<T, VEC, false><<<unsigned(gm.grid), gm.threads, 0, stream>>>(
        x, nullptr, nullptr, mean, rstd, eps, blocks, L.m, 1, gm.tpr, stream_x);
  });
  with_vec<T>(aligned16(x) && aligned16(y) && L.s % kVec16<T> == 0, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const int64_t n_vec = L.n * L.c * L.s / VEC;
    gn_apply<T, VEC><<<flat_grid(n_vec, sms), 256, 0, stream>>>(x, gamma, beta, mean, rstd, y, n_vec, L.s, L.c, L.k);
  });
  return check_launch("group_norm forward (cuda) launch");
}

template <typename T>
ffi::Error launch_bwd(cudaStream_t stream, const Layout& L, const T* x, const T* gamma, const float* mean,
                      const float* rstd, const T* dy, T* dx, T* dgamma, T* dbeta, float* scratch) {
  const int sms = num_sms();
  const int64_t rows = L.n * L.c, blocks = L.n * L.groups;
  float* A = scratch;
  float* B = A + rows;
  float* ca = B + rows;
  float* cb = ca + blocks;
  const bool stream_x = 2 * rows * L.s * int64_t(sizeof(T)) > (int64_t(32) << 20);
  with_vec<T>(aligned16(x) && aligned16(dy) && L.s % kVec16<T> == 0, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const Geom gm = row_geom(rows, ceil_div(L.s, VEC), kUnroll, kMaxThreads, sms);
    gn_row_sums<T, VEC, true><<<unsigned(gm.grid), gm.threads, 0, stream>>>(x, dy, mean, A, B, 0.f, rows, L.s, L.k,
                                                                            gm.tpr, stream_x);
  });
  gn_block_coefs<T><<<unsigned(ceil_div(blocks, 256)), 256, 0, stream>>>(gamma, A, B, rstd, ca, cb, blocks, L.groups,
                                                                         L.k, L.m);
  gn_param_grads<T><<<unsigned(ceil_div(L.c, 256)), 256, 0, stream>>>(A, B, rstd, dgamma, dbeta, L.n, L.c, L.groups,
                                                                      L.k);
  with_vec<T>(aligned16(x) && aligned16(dy) && aligned16(dx) && L.s % kVec16<T> == 0, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const int64_t n_vec = rows * L.s / VEC;
    gn_dx<T, VEC><<<flat_grid(n_vec, sms), 256, 0, stream>>>(x, dy, gamma, mean, rstd, ca, cb, dx, n_vec, L.s, L.c,
                                                             L.k);
  });
  return check_launch("group_norm backward (cuda) launch");
}

ffi::Error check_x(const ffi::AnyBuffer& x, int64_t num_groups, Layout& L) {
  auto d = x.dimensions();
  if (d.size() < 2) return invalid("group_norm: x must have rank >= 2 ([N, C, ...])");
  L.n = d[0];
  L.c = d[1];
  L.s = 1;
  for (size_t i = 2; i < d.size(); ++i) L.s *= d[i];
  if (num_groups < 1) return invalid("group_norm: num_groups must be >= 1");
  if (L.c % num_groups != 0)
    return invalid("group_norm: channels " + std::to_string(L.c) + " not divisible by num_groups " +
                   std::to_string(num_groups));
  L.groups = num_groups;
  L.k = L.c / num_groups;
  L.m = L.k * L.s;
  return ffi::Error::Success();
}

ffi::Error check_param(const ffi::AnyBuffer& x, const Layout& L, const ffi::AnyBuffer& p, const char* what) {
  auto d = p.dimensions();
  if (d.size() != 1 || d[0] != L.c)
    return invalid(std::string("group_norm: ") + what + " must have shape [" + std::to_string(L.c) +
                   "] (the channel axis of x)");
  if (p.element_type() != x.element_type())
    return invalid(std::string("group_norm: ") + what + " dtype " + dtype_name(p.element_type()) +
                   " differs from x dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error check_stat(const Layout& L, const ffi::AnyBuffer& s, const char* what) {
  if (s.element_type() != ffi::DataType::F32 || int64_t(s.element_count()) != L.n * L.groups)
    return invalid(std::string("group_norm (cuda): ") + what + " must be f32 with one value per (sample, group)");
  return ffi::Error::Success();
}

ffi::Error GroupNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, int64_t num_groups, float eps) {
  Layout L;
  if (auto e = check_x(x, num_groups, L); e.failure()) return e;
  if (auto e = check_param(x, L, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_param(x, L, beta, "beta"); e.failure()) return e;
  if (!same_dims(x, *y) || y->element_type() != x.element_type()) return invalid("group_norm: output y must match x");
  if (auto e = check_stat(L, *mean, "mean"); e.failure()) return e;
  if (auto e = check_stat(L, *rstd, "rstd"); e.failure()) return e;
  if (!(eps >= 0.0f)) return invalid("group_norm: eps must be >= 0");
  const int64_t blocks = L.n * L.groups;
  if (blocks == 0) return ffi::Error::Success();
  if (L.m == 0) {  // empty groups: statistics are 0/0, as in the reference
    const unsigned grid = unsigned(std::min<int64_t>(ceil_div(blocks, 256), 1024));
    fill_k<float><<<grid, 256, 0, stream>>>(static_cast<float*>(mean->untyped_data()), blocks, NAN);
    fill_k<float><<<grid, 256, 0, stream>>>(static_cast<float*>(rstd->untyped_data()), blocks, NAN);
    return check_launch("group_norm forward (cuda) launch");
  }
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = launch_fwd<T>(stream, L, static_cast<const T*>(x.untyped_data()),
                           static_cast<const T*>(gamma.untyped_data()), static_cast<const T*>(beta.untyped_data()),
                           static_cast<T*>(y->untyped_data()), static_cast<float*>(mean->untyped_data()),
                           static_cast<float*>(rstd->untyped_data()), eps);
  });
  if (!ok) return invalid("group_norm (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

ffi::Error GroupNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer mean,
                            ffi::AnyBuffer rstd, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                            ffi::Result<ffi::AnyBuffer> scratch, int64_t num_groups) {
  Layout L;
  if (auto e = check_x(x, num_groups, L); e.failure()) return e;
  if (auto e = check_param(x, L, gamma, "gamma"); e.failure()) return e;
  if (!same_dims(x, dy) || dy.element_type() != x.element_type())
    return invalid("group_norm backward: dy must match x in shape and dtype");
  if (!same_dims(x, *dx) || dx->element_type() != x.element_type())
    return invalid("group_norm backward: dx must match x");
  if (auto e = check_param(x, L, *dgamma, "dgamma"); e.failure()) return e;
  if (auto e = check_param(x, L, *dbeta, "dbeta"); e.failure()) return e;
  if (auto e = check_stat(L, mean, "mean"); e.failure()) return e;
  if (auto e = check_stat(L, rstd, "rstd"); e.failure()) return e;
  const int64_t need = 2 * L.n * L.c + 2 * L.n * L.groups;
  if (scratch->element_type() != ffi::DataType::F32 || int64_t(scratch->element_count()) < need)
    return invalid("group_norm backward (cuda): scratch must be f32 with at least 2 N C + 2 N G (" +
                   std::to_string(need) + ") elements, got " + std::to_string(scratch->element_count()));
  if (L.c == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    T* dg = static_cast<T*>(dgamma->untyped_data());
    T* db = static_cast<T*>(dbeta->untyped_data());
    if (L.n == 0 || L.m == 0) {  // nothing to sum: parameter gradients are zero
      const unsigned grid = unsigned(std::min<int64_t>(ceil_div(L.c, 256), 1024));
      fill_k<T><<<grid, 256, 0, stream>>>(dg, L.c, 0.f);
      fill_k<T><<<grid, 256, 0, stream>>>(db, L.c, 0.f);
      result = check_launch("group_norm backward (cuda) launch");
      return;
    }
    result = launch_bwd<T>(stream, L, static_cast<const T*>(x.untyped_data()),
                           static_cast<const T*>(gamma.untyped_data()), static_cast<const float*>(mean.untyped_data()),
                           static_cast<const float*>(rstd.untyped_data()), static_cast<const T*>(dy.untyped_data()),
                           static_cast<T*>(dx->untyped_data()), dg, db, static_cast<float*>(scratch->untyped_data()));
  });
  if (!ok) return invalid("group_norm backward (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

}  // namespace

// Command-buffer compatible: kernels on XLA's stream only, launch shapes from the
// buffer shapes and the device.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGroupNormFwdCuda, GroupNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [N, C, ...]
                                  .Arg<ffi::AnyBuffer>()  // gamma [C]
                                  .Arg<ffi::AnyBuffer>()  // beta [C]
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // mean [N, G]
                                  .Ret<ffi::AnyBuffer>()  // rstd [N, G]
                                  .Attr<int64_t>("num_groups")
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGroupNormBwdCuda, GroupNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // mean
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Ret<ffi::AnyBuffer>()  // scratch (f32)
                                  .Attr<int64_t>("num_groups"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_group_norm_fwd", RlxGroupNormFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_group_norm_bwd", RlxGroupNormBwdCuda);

}  // namespace cuda
}  // namespace rlx
