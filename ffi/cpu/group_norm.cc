// GroupNorm on NCHW (any trailing spatial rank), forward (saving mean and rstd per
// (sample, group)) and fused backward.
//
//   x: [N, C, S...] with S the product of the trailing axes; gamma, beta: [C];
//   G groups of K = C / G adjacent channels, so block (n, g) is the contiguous run of
//   M = K * S values x[n, g*K : (g+1)*K, ...].
//   mean, rstd per block (f32, or f64 for f64 inputs: [N, G]);
//   xhat = (x - mean) * rstd,  y[n, c, s] = xhat * gamma[c] + beta[c].
// Backward, with u = dy * gamma[c] and means over the block:
//   dx       = rstd * (u - mean(u) - xhat * mean(u * xhat))
//   dgamma_c = sum_{n, s} dy * xhat              dbeta_c = sum_{n, s} dy
// One read of x and dy per block: a first sweep takes, per channel, sum dy and
// sum dy * (x - mean) (which give both the block means and the parameter partials),
// a second computes dx while the block is still in cache. Each block writes its own
// parameter partials [N, C]; they are then added over n in order (deterministic).
// Sums are the vectorised fixed-order ones of norm_rows.h; bf16/f16 blocks are
// converted to f32 in per-task scratch first.
#include <cmath>
#include <limits>

#include "cpu/common.h"
#include "cpu/norm_rows.h"
#include "group_norm_checks.h"

namespace rlx {
namespace {

using group_norm::Layout;

template <typename T>
void group_norm_fwd_typed(ffi::ThreadPool& pool, const Layout& L, const T* x, const T* gamma,
                          const T* beta, T* y, void* mean_out, void* rstd_out, double eps) {
  using A = typename Accum<T>::type;
  A* mean = static_cast<A*>(mean_out);
  A* rstd = static_cast<A*>(rstd_out);
  const int64_t blocks = L.n * L.groups;
  const int64_t chunks = row_chunks(blocks, L.m);
  const A inv_m = A(1) / A(L.m);
  parallel_for(pool, chunks, [&](int64_t t) {
    norm::Rows<T, A> buf(L.m, 2);
    const int64_t b0 = blocks * t / chunks, b1 = blocks * (t + 1) / chunks;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const A* xb = buf.in(x + blk * L.m, 0);
      A* yb = buf.out(y + blk * L.m, 1);
      const A mu = norm::sum(xb, L.m) * inv_m;
      const A inv = A(1) / std::sqrt(norm::sq_dev(xb, mu, L.m) * inv_m + A(eps));
      mean[blk] = mu;
      rstd[blk] = inv;
      const int64_t c0 = (blk % L.groups) * L.k;
      for (int64_t ci = 0; ci < L.k; ++ci) {
        const A scale = inv * load<A>(gamma[c0 + ci]), shift = load<A>(beta[c0 + ci]);
        const A* __restrict xc = xb + ci * L.s;
        A* __restrict yc = yb + ci * L.s;
#pragma omp simd
        for (int64_t j = 0; j < L.s; ++j) yc[j] = (xc[j] - mu) * scale + shift;
      }
      buf.commit(y + blk * L.m, 1);
    }
  });
}

template <typename T>
void group_norm_bwd_typed(ffi::ThreadPool& pool, const Layout& L, const T* x, const T* gamma,
                          const void* mean_in, const void* rstd_in, const T* dy, T* dx,
                          T* dgamma, T* dbeta) {
  using A = typename Accum<T>::type;
  const A* mean = static_cast<const A*>(mean_in);
  const A* rstd = static_cast<const A*>(rstd_in);
  const int64_t blocks = L.n * L.groups;
  const int64_t chunks = row_chunks(blocks, L.m);
  const A inv_m = A(1) / A(L.m);
  // per (n, c): pg = sum_s dy * xhat, pb = sum_s dy
  std::vector<A> pg(static_cast<size_t>(L.n * L.c)), pb(static_cast<size_t>(L.n * L.c));
  parallel_for(pool, chunks, [&](int64_t t) {
    norm::Rows<T, A> buf(L.m, 3);
    const int64_t b0 = blocks * t / chunks, b1 = blocks * (t + 1) / chunks;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const A* xb = buf.in(x + blk * L.m, 0);
      const A* dyb = buf.in(dy + blk * L.m, 1);
      A* dxb = buf.out(dx + blk * L.m, 2);
      const A mu = mean[blk], inv = rstd[blk];
      const int64_t c0 = (blk % L.groups) * L.k;
      A* pgb = pg.data() + blk * L.k;  // block (n, g) owns entries n*C + g*K ...
      A* pbb = pb.data() + blk * L.k;
      A su = 0, sux = 0;  // sum u, sum u * (x - mean) over the block, u = dy * gamma
      for (int64_t ci = 0; ci < L.k; ++ci) {
        A sdy, sdx;
        norm::dy_sums<A>(xb + ci * L.s, dyb + ci * L.s, nullptr, mu, L.s, sdy, sdx);
        const A g = load<A>(gamma[c0 + ci]);
        su += g * sdy;
        sux += g * sdx;
        pgb[ci] = sdx * inv;
        pbb[ci] = sdy;
      }
      const A c1 = su * inv_m, c2 = sux * inv * inv_m;
      for (int64_t ci = 0; ci < L.k; ++ci) {
        const A g = load<A>(gamma[c0 + ci]);
        const A* __restrict xc = xb + ci * L.s;
        const A* __restrict dyc = dyb + ci * L.s;
        A* __restrict dxc = dxb + ci * L.s;
#pragma omp simd
        for (int64_t j = 0; j < L.s; ++j) dxc[j] = inv * (dyc[j] * g - c1 - (xc[j] - mu) * inv * c2);
      }
      buf.commit(dx + blk * L.m, 2);
    }
  });
  // parameter gradients: channel blocks in parallel, samples added in order
  const int64_t col_tasks = std::max<int64_t>(1, std::min<int64_t>(L.c / 256, 64));
  parallel_for(pool, col_tasks, [&](int64_t t) {
    const int64_t j0 = L.c * t / col_tasks, j1 = L.c * (t + 1) / col_tasks;
    for (int64_t j = j0; j < j1; ++j) {
      A sg = 0, sb = 0;
      for (int64_t i = 0; i < L.n; ++i) { sg += pg[i * L.c + j]; sb += pb[i * L.c + j]; }
      dgamma[j] = store<T>(sg);
      dbeta[j] = store<T>(sb);
    }
  });
}

// Eps: the attribute's type, float (ABI v1) or double (v2: an f64 input's eps exactly).
template <typename Eps>
ffi::Error GroupNormFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                            ffi::AnyBuffer beta, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                            int64_t num_groups, Eps eps) {
  Layout L;
  if (auto e = group_norm::check_fwd(Backend::kCpu, x, gamma, beta, *y, *mean, *rstd, num_groups, eps, L);
      e.failure())
    return e;
  if (L.n * L.groups == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = typename Accum<T>::type;
    if (L.m == 0) {  // empty groups: statistics are 0/0, as in the reference
      const A nan = std::numeric_limits<A>::quiet_NaN();
      std::fill_n(static_cast<A*>(mean->untyped_data()), L.n * L.groups, nan);
      std::fill_n(static_cast<A*>(rstd->untyped_data()), L.n * L.groups, nan);
      return;
    }
    group_norm_fwd_typed<T>(pool, L, static_cast<const T*>(x.untyped_data()),
                            static_cast<const T*>(gamma.untyped_data()),
                            static_cast<const T*>(beta.untyped_data()),
                            static_cast<T*>(y->untyped_data()), mean->untyped_data(),
                            rstd->untyped_data(), eps);
  });
  if (!ok) return invalid("group_norm: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error GroupNormBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                            ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::AnyBuffer dy,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                            ffi::Result<ffi::AnyBuffer> dbeta, int64_t num_groups) {
  Layout L;
  if (auto e = group_norm::check_bwd(Backend::kCpu, x, gamma, mean, rstd, dy, *dx, *dgamma, *dbeta,
                                     num_groups, L);
      e.failure())
    return e;
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    T* dg = static_cast<T*>(dgamma->untyped_data());
    T* db = static_cast<T*>(dbeta->untyped_data());
    if (L.n == 0 || L.m == 0) {  // nothing to sum: parameter gradients are zero
      for (int64_t j = 0; j < L.c; ++j) { dg[j] = store<T>(0.0f); db[j] = store<T>(0.0f); }
      return;
    }
    group_norm_bwd_typed<T>(pool, L, static_cast<const T*>(x.untyped_data()),
                            static_cast<const T*>(gamma.untyped_data()), mean.untyped_data(),
                            rstd.untyped_data(), static_cast<const T*>(dy.untyped_data()),
                            static_cast<T*>(dx->untyped_data()), dg, db);
  });
  if (!ok) return invalid("group_norm backward: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

}  // namespace

// v1 takes eps as f32, v2 as f64 (which an f64 input needs to normalise with its exact eps)
#define RLX_GROUP_NORM_FWD_BINDING(EPS)            \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::AnyBuffer>() /* x [N, C, ...] */   \
      .Arg<ffi::AnyBuffer>() /* gamma [C] */       \
      .Arg<ffi::AnyBuffer>() /* beta [C] */        \
      .Ret<ffi::AnyBuffer>() /* y */               \
      .Ret<ffi::AnyBuffer>() /* mean [N, G] */     \
      .Ret<ffi::AnyBuffer>() /* rstd [N, G] */     \
      .Attr<int64_t>("num_groups")                 \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGroupNormFwd, GroupNormFwdImpl<float>, RLX_GROUP_NORM_FWD_BINDING(float));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGroupNormFwdV2, GroupNormFwdImpl<double>, RLX_GROUP_NORM_FWD_BINDING(double));
#undef RLX_GROUP_NORM_FWD_BINDING

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGroupNormBwd, GroupNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // mean
                                  .Arg<ffi::AnyBuffer>()  // rstd
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // dbeta
                                  .Attr<int64_t>("num_groups"));

RLX_REGISTER_HANDLER("rlx_group_norm_fwd", RlxGroupNormFwd);
RLX_REGISTER_HANDLER("rlx_group_norm_fwd_v2", RlxGroupNormFwdV2);
RLX_REGISTER_HANDLER("rlx_group_norm_bwd", RlxGroupNormBwd);

}  // namespace rlx
