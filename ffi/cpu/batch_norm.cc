// BatchNorm in inference mode (running statistics are inputs), fused backward.
//
//   x, dy: [N, C, S...] (channel axis 1, S the product of the trailing axes);
//   gamma, mean, var: [C];  rstd_c = 1 / sqrt(var_c + eps)
//   y = (x - mean_c) * rstd_c * gamma_c + beta_c
// Backward:
//   dx       = dy * gamma_c * rstd_c
//   dgamma_c = rstd_c * sum_{n, s} dy * (x - mean_c)        dbeta_c = sum_{n, s} dy
// One read of x and dy. With S > 1 each (n, c) plane is a task unit writing its own two
// partial sums; with S == 1 ([N, C] inputs) row chunks accumulate [C] partial vectors.
// The partials are then added over samples / chunks in order (deterministic). Sums are
// the vectorised fixed-order ones of norm_rows.h; bf16/f16 rows go through f32 scratch.
// (The gradients for mean and var follow from dgamma and dbeta on the Python side.)
#include <cmath>

#include "cpu/common.h"
#include "cpu/norm_rows.h"
#include "batch_norm_checks.h"

namespace rlx {
namespace {

template <typename T>
void batch_norm_inference_bwd_typed(ffi::ThreadPool& pool, const T* x, const T* gamma,
                                    const T* mean_in, const T* var_in, const T* dy, T* dx,
                                    T* dgamma, T* dbeta, int64_t n, int64_t c, int64_t s,
                                    double eps) {
  using A = typename Accum<T>::type;
  std::vector<A> mean(c), rstd(c), scale(c);
  for (int64_t j = 0; j < c; ++j) {
    mean[j] = load<A>(mean_in[j]);
    rstd[j] = A(1) / std::sqrt(load<A>(var_in[j]) + A(eps));
    scale[j] = load<A>(gamma[j]) * rstd[j];
  }
  const A* __restrict m = mean.data();
  const A* __restrict sc = scale.data();
  int64_t parts;  // partial sums, laid out [parts, C]
  std::vector<A> pd, pb;
  if (s > 1) {
    parts = n;
    pd.resize(static_cast<size_t>(n * c));
    pb.resize(static_cast<size_t>(n * c));
    const int64_t planes = n * c;
    const int64_t chunks = row_chunks(planes, s);
    parallel_for(pool, chunks, [&](int64_t t) {
      norm::Rows<T, A> buf(s, 3);
      const int64_t p0 = planes * t / chunks, p1 = planes * (t + 1) / chunks;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t ch = p % c;
        const A* __restrict xp = buf.in(x + p * s, 0);
        const A* __restrict dyp = buf.in(dy + p * s, 1);
        A* __restrict dxp = buf.out(dx + p * s, 2);
        const A k = sc[ch];
        norm::dy_sums<A>(xp, dyp, nullptr, m[ch], s, pb[p], pd[p]);
#pragma omp simd
        for (int64_t j = 0; j < s; ++j) dxp[j] = dyp[j] * k;
        buf.commit(dx + p * s, 2);
      }
    });
  } else {
    const int64_t chunks = row_chunks(n, c);
    parts = chunks;
    pd.assign(static_cast<size_t>(chunks * c), A(0));
    pb.assign(static_cast<size_t>(chunks * c), A(0));
    parallel_for(pool, chunks, [&](int64_t t) {
      A* __restrict pdt = pd.data() + t * c;
      A* __restrict pbt = pb.data() + t * c;
      norm::Rows<T, A> buf(c, 3);
      const int64_t r0 = n * t / chunks, r1 = n * (t + 1) / chunks;
      for (int64_t r = r0; r < r1; ++r) {
        const A* __restrict xr = buf.in(x + r * c, 0);
        const A* __restrict dyr = buf.in(dy + r * c, 1);
        A* __restrict dxr = buf.out(dx + r * c, 2);
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) {
          dxr[j] = dyr[j] * sc[j];
          pbt[j] += dyr[j];
          pdt[j] += dyr[j] * (xr[j] - m[j]);
        }
        buf.commit(dx + r * c, 2);
      }
    });
  }
  // channel blocks in parallel, partials added in order
  const int64_t col_tasks = std::max<int64_t>(1, std::min<int64_t>(c / 256, 64));
  parallel_for(pool, col_tasks, [&](int64_t t) {
    const int64_t j0 = c * t / col_tasks, j1 = c * (t + 1) / col_tasks;
    for (int64_t j = j0; j < j1; ++j) {
      A sd = 0, sb = 0;
      for (int64_t i = 0; i < parts; ++i) { sd += pd[i * c + j]; sb += pb[i * c + j]; }
      dgamma[j] = store<T>(sd * rstd[j]);
      dbeta[j] = store<T>(sb);
    }
  });
}

// Eps: the attribute's type, float (ABI v1) or double (v2: an f64 input's eps exactly).
template <typename Eps>
ffi::Error BatchNormInferenceBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                                     ffi::AnyBuffer mean, ffi::AnyBuffer var, ffi::AnyBuffer dy,
                                     ffi::Result<ffi::AnyBuffer> dx,
                                     ffi::Result<ffi::AnyBuffer> dgamma,
                                     ffi::Result<ffi::AnyBuffer> dbeta, Eps eps) {
  auto d = x.dimensions();
  if (auto e = bn::check_inference_bwd(x, gamma, mean, var, dy, *dx, *dgamma, *dbeta, eps); e.failure()) return e;
  const int64_t n = d[0], c = d[1];
  int64_t s = 1;
  for (size_t i = 2; i < d.size(); ++i) s *= d[i];
  if (c == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    T* dg = static_cast<T*>(dgamma->untyped_data());
    T* db = static_cast<T*>(dbeta->untyped_data());
    if (n == 0 || s == 0) {  // nothing to sum: parameter gradients are zero
      for (int64_t j = 0; j < c; ++j) { dg[j] = store<T>(0.0f); db[j] = store<T>(0.0f); }
      return;
    }
    batch_norm_inference_bwd_typed<T>(
        pool, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(gamma.untyped_data()),
        static_cast<const T*>(mean.untyped_data()), static_cast<const T*>(var.untyped_data()),
        static_cast<const T*>(dy.untyped_data()), static_cast<T*>(dx->untyped_data()), dg, db, n, c,
        s, eps);
  });
  if (!ok)
    return invalid("batch_norm_inference backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

}  // namespace

// v1 takes eps as f32, v2 as f64 (which an f64 input needs to normalise with its exact eps)
#define RLX_BATCH_NORM_INFERENCE_BWD_BINDING(EPS)  \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::AnyBuffer>() /* x [N, C, ...] */   \
      .Arg<ffi::AnyBuffer>() /* gamma [C] */       \
      .Arg<ffi::AnyBuffer>() /* mean [C] */        \
      .Arg<ffi::AnyBuffer>() /* var [C] */         \
      .Arg<ffi::AnyBuffer>() /* dy */              \
      .Ret<ffi::AnyBuffer>() /* dx */              \
      .Ret<ffi::AnyBuffer>() /* dgamma */          \
      .Ret<ffi::AnyBuffer>() /* dbeta */           \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxBatchNormInferenceBwd, BatchNormInferenceBwdImpl<float>,
                              RLX_BATCH_NORM_INFERENCE_BWD_BINDING(float));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxBatchNormInferenceBwdV2, BatchNormInferenceBwdImpl<double>,
                              RLX_BATCH_NORM_INFERENCE_BWD_BINDING(double));
#undef RLX_BATCH_NORM_INFERENCE_BWD_BINDING

RLX_REGISTER_HANDLER("rlx_batch_norm_inference_bwd", RlxBatchNormInferenceBwd);
RLX_REGISTER_HANDLER("rlx_batch_norm_inference_bwd_v2", RlxBatchNormInferenceBwdV2);

}  // namespace rlx
