// XLA FFI handlers for LayerNorm over the last axis on CUDA: targets rlx_layer_norm_fwd
// and rlx_layer_norm_bwd, with the operands and semantics of the CPU handlers
// (ffi/cpu/layer_norm.cc) plus a scratch result on the backward.
//
//   x: [R.., W], gamma, beta: [W]
//   mean = sum_j x_j / W,  rstd = 1 / sqrt(sum_j (x_j - mean)^2 / W + eps)   (f32 [R..])
//   xhat_j = (x_j - mean) * rstd,  y_j = xhat_j * gamma_j + beta_j
// Backward, u_j = dy_j * gamma_j:
//   dx_j = rstd * (u_j - sum_i u_i / W - xhat_j * sum_i u_i xhat_i / W)
//   dgamma_j = sum_rows dy_j xhat_j      dbeta_j = sum_rows dy_j
//
// rlx_layer_norm_fwd: x, gamma, beta (one dtype: f32, bf16, f16), attr eps -> y, mean, rstd.
// rlx_layer_norm_bwd: x, gamma, mean, rstd (f32), dy -> dx, dgamma, dbeta, scratch [S] f32
//   with S >= 2 R + 2 W (sized by rlx_jax/vjp_rules/layer_norm.py): per-block partial
//   sums of dgamma/dbeta [P][2][W], then the wide-row path's two row sums [2][R].
//
// The work layout is RMSNorm's (rms_norm_kernels.cuh: RowPlan, column_plan, the
// persistent grid, reduce_partials): a row group holds a row in registers (16-byte
// vector loads), so rows up to 8192 wide are one pass: the forward reads x once (mean,
// then the centred variance from the registers: two fixed-order group reductions) and
// writes y; the backward reads x and dy once and writes dx, keeping each thread's
// columns' dgamma/dbeta sums in registers across its rows; one partial row per block,
// added by reduce_partials in a fixed order (no atomics: deterministic). Wider rows are
// split into column slabs and take their row statistics from ln_row_stats, which reads
// the row once more (the documented slower path).
#include <cstdlib>

#include "cuda/rms_norm_kernels.cuh"
#include "cuda/rowwise_common.cuh"

namespace rlx {
namespace cuda {
namespace ln {

using rms::kSmemRed;
using rms::max_threads_for;
using rms::RowPlan;

template <typename T, int VEC, int NV, bool PF>
__global__ void __launch_bounds__(max_threads_for(NV * VEC, PF))
ln_fwd_rows(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, T* __restrict__ y,
            float* __restrict__ mean, float* __restrict__ rstd, float eps, RowPlan pl) {
  extern __shared__ float smem[];
  float* red = smem;
  const int tpr = pl.tpr;
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const int64_t p = blockIdx.x / pl.slabs;
  const int64_t s = blockIdx.x - p * pl.slabs;
  const int64_t W = pl.width;
  const int64_t r0 = pl.rows * p / pl.parts, r1 = pl.rows * (p + 1) / pl.parts;
  const int64_t c0 = s * pl.slab_cols;
  const int64_t c1 = min(W, c0 + pl.slab_cols);
  const bool one_pass = pl.slabs == 1;

  int64_t col[NV];
  bool ok[NV];
  float gm[NV][VEC], bt[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    col[k] = c0 + int64_t(t + k * tpr) * VEC;
    ok[k] = col[k] < c1;
    if (ok[k]) {
      load_vec_cached<T, VEC>(gamma + col[k], gm[k]);
      load_vec_cached<T, VEC>(beta + col[k], bt[k]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) gm[k][i] = bt[k][i] = 0.f;
    }
  }

  const int64_t n_iter = (r1 - r0 + gpb - 1) / gpb;
  float xa[NV][VEC], xb[NV][VEC];
  float mu_a = 0.f, mu_b = 0.f, rs_a = 0.f, rs_b = 0.f;
  auto load_row = [&](int64_t it, float (&xr)[NV][VEC], float& mu, float& rs) {
    const int64_t r = r0 + it * gpb + g;
    const bool rv = r < r1;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (rv && ok[k]) {
        load_vec<T, VEC>(x + r * W + col[k], xr[k]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) xr[k][i] = 0.f;
      }
    }
    mu = (rv && !one_pass) ? mean[r] : 0.f;
    rs = (rv && !one_pass) ? rstd[r] : 0.f;
  };

  if (PF && n_iter > 0) load_row(0, xa, mu_a, rs_a);
  for (int64_t it = 0; it < n_iter; ++it) {
    if (!PF) {
      load_row(it, xa, mu_a, rs_a);
    } else if (it + 1 < n_iter) {
      load_row(it + 1, xb, mu_b, rs_b);
    }
    const int64_t r = r0 + it * gpb + g;
    const bool rv = r < r1;
    float mu = mu_a, rs = rs_a;
    if (one_pass) {
      float sx = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) sx += xa[k][i];
      mu = group_sum(sx, tpr, red, 0) / float(W);
      float q = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (!ok[k]) continue;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = xa[k][i] - mu;
          q += d * d;
        }
      }
      q = group_sum(q, tpr, red, 1);
      rs = rsqrtf(q / float(W) + eps);
      if (rv && t == 0) {
        mean[r] = mu;
        rstd[r] = rs;
      }
    }
    if (rv) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (!ok[k]) continue;
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = (xa[k][i] - mu) * rs * gm[k][i] + bt[k][i];
        store_vec<T, VEC>(y + r * W + col[k], o);
      }
    }
    if (PF) {
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) xa[k][i] = xb[k][i];
      mu_a = mu_b;
      rs_a = rs_b;
    }
  }
}

// sums: the slabbed path's per-row sum(u) [rows] then sum(u * xhat) [rows].
template <typename T, int VEC, int NV, bool PF>
__global__ void __launch_bounds__(max_threads_for(NV * VEC, PF))
ln_bwd_rows(const T* __restrict__ x, const T* __restrict__ gamma, const float* __restrict__ mean,
            const float* __restrict__ rstd, const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ partial,
            const float* __restrict__ sums, RowPlan pl) {
  extern __shared__ float smem[];
  float* red = smem;
  const int tpr = pl.tpr;
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x - g * tpr;
  const int64_t p = blockIdx.x / pl.slabs;
  const int64_t s = blockIdx.x - p * pl.slabs;
  const int64_t W = pl.width;
  const int64_t R = pl.rows;
  const int64_t r0 = pl.rows * p / pl.parts, r1 = pl.rows * (p + 1) / pl.parts;
  const int64_t c0 = s * pl.slab_cols;
  const int64_t c1 = min(W, c0 + pl.slab_cols);
  const bool one_pass = pl.slabs == 1;

  int64_t col[NV];
  bool ok[NV];
  float gm[NV][VEC], ag[NV][VEC], ab[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    col[k] = c0 + int64_t(t + k * tpr) * VEC;
    ok[k] = col[k] < c1;
    if (ok[k]) {
      load_vec_cached<T, VEC>(gamma + col[k], gm[k]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) gm[k][i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) ag[k][i] = ab[k][i] = 0.f;
  }

  const int64_t n_iter = (r1 - r0 + gpb - 1) / gpb;
  float xa[NV][VEC], da[NV][VEC], xb[NV][VEC], db[NV][VEC];
  float4 st_a = make_float4(0.f, 0.f, 0.f, 0.f), st_b = st_a;  // mean, rstd, sum u, sum u*xhat

  auto load_row = [&](int64_t it, float (&xr)[NV][VEC], float (&dr)[NV][VEC], float4& st) {
    const int64_t r = r0 + it * gpb + g;
    const bool rv = r < r1;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (rv && ok[k]) {
        load_vec<T, VEC>(x + r * W + col[k], xr[k]);
        load_vec<T, VEC>(dy + r * W + col[k], dr[k]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) xr[k][i] = dr[k][i] = 0.f;
      }
    }
    st.x = rv ? mean[r] : 0.f;
    st.y = rv ? rstd[r] : 0.f;
    st.z = (rv && !one_pass) ? sums[r] : 0.f;
    st.w = (rv && !one_pass) ? sums[R + r] : 0.f;
  };

  if (PF && n_iter > 0) load_row(0, xa, da, st_a);
  for (int64_t it = 0; it < n_iter; ++it) {
    if (!PF) {
      load_row(it, xa, da, st_a);
    } else if (it + 1 < n_iter) {
      load_row(it + 1, xb, db, st_b);
    }
    const int64_t r = r0 + it * gpb + g;
    const bool rv = r < r1;
    const float mu = st_a.x, rs = st_a.y;
    float su = st_a.z, sux = st_a.w;
    if (one_pass) {
      float pu = 0.f, pux = 0.f;
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float u = da[k][i] * gm[k][i];
          pu += u;
          pux += u * (xa[k][i] - mu);
        }
      const float2 v = group_sum2(pu, pux, tpr, red, int(it & 1));
      su = v.x;
      sux = v.y * rs;
    }
    if (rv) {
      const float a = su / float(W), b = sux / float(W);
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (!ok[k]) continue;
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float xh = (xa[k][i] - mu) * rs;
          o[i] = rs * (da[k][i] * gm[k][i] - a - xh * b);
          ag[k][i] += da[k][i] * xh;
          ab[k][i] += da[k][i];
        }
        store_vec<T, VEC>(dx + r * W + col[k], o);
      }
    }
    if (PF) {
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          xa[k][i] = xb[k][i];
          da[k][i] = db[k][i];
        }
      st_a = st_b;
    }
  }

  float* pg = partial + p * 2 * W;
  float* pb = pg + W;
  if (gpb == 1) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!ok[k]) continue;
      store_f32<VEC>(pg + col[k], ag[k]);
      store_f32<VEC>(pb + col[k], ab[k]);
    }
    return;
  }
  // several row groups per block: add the groups' sums in group order, one partial row
  float* buf = smem + kSmemRed;  // [2][slab_cols]
  const int64_t sc = pl.slab_cols;
  for (int gg = 0; gg < gpb; ++gg) {
    if (g == gg) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (!ok[k]) continue;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int64_t lc = col[k] - c0 + i;
          buf[lc] = gg == 0 ? ag[k][i] : buf[lc] + ag[k][i];
          buf[sc + lc] = gg == 0 ? ab[k][i] : buf[sc + lc] + ab[k][i];
        }
      }
    }
    __syncthreads();
  }
  for (int64_t j = threadIdx.x; j < c1 - c0; j += blockDim.x) {
    pg[c0 + j] = buf[j];
    pb[c0 + j] = buf[sc + j];
  }
}

// ---- sm_90 staged backward: rows of x and dy staged through shared memory ------------------
// RMSNorm's bwd_rows_tma structure (rms_norm_kernels.cuh): one row group per block; thread 0
// keeps pl.stages rows of x and dy in flight by cp.async.bulk, each stage completing on its
// mbarrier; threads read their columns from shared memory into registers, and the row
// reduction's barrier tells thread 0 that the stage may be refilled. Bytes in flight then
// no longer depend on registers (what the 16-bit register path lacks).
template <typename T, int NV>
__global__ void __launch_bounds__(max_threads_for(NV * kVec16<T>, false))
ln_bwd_rows_tma(const T* __restrict__ x, const T* __restrict__ gamma, const float* __restrict__ mean,
                const float* __restrict__ rstd, const T* __restrict__ dy, T* __restrict__ dx,
                float* __restrict__ partial, RowPlan pl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  constexpr int VEC = kVec16<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  float* red = reinterpret_cast<float*>(smem_raw);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem_raw + 512);
  unsigned char* stages = smem_raw + rms::kTmaHeader;
  const int S = pl.stages;
  const int tpr = blockDim.x;
  const int t = threadIdx.x;
  const int64_t p = blockIdx.x;
  const int64_t W = pl.width;
  const int64_t r0 = pl.rows * p / pl.parts, r1 = pl.rows * (p + 1) / pl.parts;
  const int64_t n = r1 - r0;
  const uint32_t row_bytes = uint32_t(W * int64_t(sizeof(T)));

  int64_t col[NV];
  bool ok[NV];
  float gm[NV][VEC], ag[NV][VEC], ab[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    col[k] = int64_t(t + k * tpr) * VEC;
    ok[k] = col[k] < W;
    if (ok[k]) {
      load_vec_cached<T, VEC>(gamma + col[k], gm[k]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) gm[k][i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) ag[k][i] = ab[k][i] = 0.f;
  }

  if (t == 0) {
    for (int q = 0; q < S; ++q) mbar_init(&bar[q], 1);
    mbar_init_fence();
  }
  __syncthreads();
  auto issue = [&](int64_t i) {
    const int q = int(i % S);
    unsigned char* xs = stages + size_t(q) * 2 * row_bytes;
    mbar_arrive_expect_tx(&bar[q], 2 * row_bytes);
    bulk_load(xs, x + (r0 + i) * W, row_bytes, &bar[q]);
    bulk_load(xs + row_bytes, dy + (r0 + i) * W, row_bytes, &bar[q]);
  };
  if (t == 0)
    for (int64_t i = 0; i < n && i < S; ++i) issue(i);

  for (int64_t i = 0; i < n; ++i) {
    const int q = int(i % S);
    const int64_t r = r0 + i;
    const float mu = mean[r], rs = rstd[r];
    mbar_wait(&bar[q], uint32_t((i / S) & 1));
    const T* xs = reinterpret_cast<const T*>(stages + size_t(q) * 2 * row_bytes);
    const T* ds = xs + W;
    float xa[NV][VEC], da[NV][VEC];
    float pu = 0.f, pux = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (ok[k]) {
        rms::load_vec_smem<T, VEC>(xs + col[k], xa[k]);
        rms::load_vec_smem<T, VEC>(ds + col[k], da[k]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) xa[k][e] = da[k][e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float u = da[k][e] * gm[k][e];
        pu += u;
        pux += u * (xa[k][e] - mu);
      }
    }
    const float2 v = group_sum2(pu, pux, tpr, red, int(i & 1));  // its barrier: stage q is read
    if (t == 0 && i + S < n) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(i + S);
    }
    const float a = v.x / float(W), b = v.y * rs / float(W);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!ok[k]) continue;
      float o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float xh = (xa[k][e] - mu) * rs;
        o[e] = rs * (da[k][e] * gm[k][e] - a - xh * b);
        ag[k][e] += da[k][e] * xh;
        ab[k][e] += da[k][e];
      }
      store_vec<T, VEC>(dx + r * W + col[k], o);
    }
  }
  float* pg = partial + p * 2 * W;
  float* pb = pg + W;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (!ok[k]) continue;
    store_f32<VEC>(pg + col[k], ag[k]);
    store_f32<VEC>(pb + col[k], ab[k]);
  }
#endif
}

// Row statistics of the slabbed (wide-row) path, one block per row (grid-stride).
// Forward: mean, rstd from sums shifted by the row's first element (x0):
//   mean = x0 + S1 / W, var = S2 / W - (S1 / W)^2 with S1 = sum (x - x0), S2 = sum (x - x0)^2.
// Backward: sums[r] = sum u, sums[R + r] = sum u * xhat.
template <typename T, int VEC, bool BWD>
__global__ void __launch_bounds__(512)
ln_row_stats(const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ gamma, float* __restrict__ mean,
             float* __restrict__ rstd, float* __restrict__ sums, float eps, int64_t rows, int64_t W) {
  __shared__ float red[kSmemRed];
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * W;
    float a = 0.f, b = 0.f;
    const float x0 = BWD ? mean[r] : to_f32(xr[0]);
    const float rs = BWD ? rstd[r] : 0.f;
#pragma unroll 4
    for (int64_t j = int64_t(threadIdx.x) * VEC; j < W; j += int64_t(blockDim.x) * VEC) {
      float xv[VEC];
      load_vec_cached<T, VEC>(xr + j, xv);
      if constexpr (BWD) {
        float dv[VEC], gv[VEC];
        load_vec_cached<T, VEC>(dy + r * W + j, dv);
        load_vec_cached<T, VEC>(gamma + j, gv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float u = dv[i] * gv[i];
          a += u;
          b += u * (xv[i] - x0);
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
    const float2 v = group_sum2(a, b, blockDim.x, red, parity);
    parity ^= 1;
    if (threadIdx.x == 0) {
      if constexpr (BWD) {
        sums[r] = v.x;
        sums[rows + r] = v.y * rs;
      } else {
        const float m1 = v.x / float(W);
        const float var = fmaxf(v.y / float(W) - m1 * m1, 0.f);
        mean[r] = x0 + m1;
        rstd[r] = rsqrtf(var + eps);
      }
    }
  }
}

// The staged backward is on by default where it applies; RLX_LAYER_NORM_CUDA_STAGED=0 turns
// it off (the register path everywhere), read once per process.
inline rms::Tuning staged_tuning() {
  static const int tma = [] {
    const char* v = std::getenv("RLX_LAYER_NORM_CUDA_STAGED");
    return (v != nullptr && v[0] == '0') ? 0 : -1;
  }();
  rms::Tuning tu;
  tu.tma = tma;
  return tu;
}

// Fills n floats with value (grid-stride).
__global__ void fill_f32(float* __restrict__ p, int64_t n, float value) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

template <typename T>
ffi::Error launch_fwd(cudaStream_t stream, const T* x, const T* gamma, const T* beta, T* y, float* mean, float* rstd,
                      float eps, int64_t rows, int64_t W) {
  const bool aligned = aligned16(x) && aligned16(gamma) && aligned16(beta) && aligned16(y);
  RowPlan pl = rms::column_plan<T>(rows, W, aligned, {});
  cudaError_t err = cudaSuccess;
  const bool ok = rms::with_variant<T>(pl, [&](auto vec, auto nv, auto pf) {
    constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
    constexpr bool PF = decltype(pf)::value;
    auto kernel = ln_fwd_rows<T, VEC, NV, PF>;
    err = rms::set_parts(pl, kernel, rows);
    if (err != cudaSuccess) return;
    if (pl.slabs > 1)
      ln_row_stats<T, VEC, false><<<rms::stats_grid(rows), 512, 0, stream>>>(x, nullptr, nullptr, mean, rstd, nullptr,
                                                                             eps, rows, W);
    kernel<<<unsigned(pl.parts * pl.slabs), pl.threads, rms::smem_bytes(pl), stream>>>(x, gamma, beta, y, mean, rstd,
                                                                                      eps, pl);
  });
  if (!ok) return ffi::Error::Internal("layer_norm (cuda): no kernel variant for this plan");
  if (err != cudaSuccess) return cuda_error("layer_norm forward (cuda) setup", err);
  return check_launch("layer_norm forward (cuda) launch");
}

template <typename T>
ffi::Error launch_bwd(cudaStream_t stream, const T* x, const T* gamma, const float* mean, const float* rstd,
                      const T* dy, T* dx, T* dgamma, T* dbeta, float* scratch, int64_t scratch_len, int64_t rows,
                      int64_t W) {
  const int64_t max_parts = (scratch_len - 2 * rows) / (2 * W);
  float* partial = scratch;
  float* sums = scratch + max_parts * 2 * W;
  int64_t parts = 0;
  if (rows > 0) {
    const bool aligned =
        aligned16(x) && aligned16(gamma) && aligned16(dy) && aligned16(dx) && aligned16(scratch);
    const rms::Tuning tu = staged_tuning();
    RowPlan pl = rms::column_plan<T>(rows, W, aligned, tu);
    cudaError_t err = cudaSuccess;
    const bool ok = rms::with_variant<T>(pl, [&](auto vec, auto nv, auto pf) {
      constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
      constexpr bool PF = decltype(pf)::value;
      if constexpr (VEC != 1) {
        // sm_90, one pass, rows of at least 2 KB (RMSNorm's measured threshold): staged
        auto staged = ln_bwd_rows_tma<T, NV>;
        if (rms::plan_staged(pl, staged, W * int64_t(sizeof(T)), 2 * W * int64_t(sizeof(T)), 2, tu)) {
          err = rms::set_parts(pl, staged, max_parts);
          if (err != cudaSuccess) return;
          staged<<<unsigned(pl.parts), pl.threads, rms::smem_bytes(pl), stream>>>(x, gamma, mean, rstd, dy, dx,
                                                                                 partial, pl);
          return;
        }
      }
      auto kernel = ln_bwd_rows<T, VEC, NV, PF>;
      err = rms::set_parts(pl, kernel, max_parts);
      if (err != cudaSuccess) return;
      if (pl.slabs > 1)
        ln_row_stats<T, VEC, true><<<rms::stats_grid(rows), 512, 0, stream>>>(
            x, dy, gamma, const_cast<float*>(mean), const_cast<float*>(rstd), sums, 0.f, rows, W);
      kernel<<<unsigned(pl.parts * pl.slabs), pl.threads, rms::smem_bytes(pl), stream>>>(x, gamma, mean, rstd, dy, dx,
                                                                                        partial, sums, pl);
    });
    if (!ok) return ffi::Error::Internal("layer_norm backward (cuda): no kernel variant for this plan");
    if (err != cudaSuccess) return cuda_error("layer_norm backward (cuda) setup", err);
    parts = pl.parts;
  }
  rms::reduce_partials<T><<<unsigned(rw::ceil_div(2 * W, 32)), 256, 0, stream>>>(partial, parts, W, dgamma, dbeta);
  return check_launch("layer_norm backward (cuda) launch");
}

}  // namespace ln

namespace {

using rw::invalid;
using rw::rows_view;
using rw::same_dims;

ffi::Error check_param(const ffi::AnyBuffer& x, const ffi::AnyBuffer& p, const char* what) {
  if (x.dimensions().size() < 1) return invalid("layer_norm: x must have rank >= 1");
  const int64_t width = rows_view(x).width;
  auto d = p.dimensions();
  if (d.size() != 1 || d[0] != width)
    return invalid(std::string("layer_norm: ") + what + " must have shape [" + std::to_string(width) +
                   "] (the last axis of x)");
  if (p.element_type() != x.element_type())
    return invalid(std::string("layer_norm: ") + what + " dtype " + dtype_name(p.element_type()) +
                   " differs from x dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error check_stat(const ffi::AnyBuffer& s, int64_t rows, const char* what) {
  if (s.element_type() != ffi::DataType::F32)
    return invalid(std::string("layer_norm (cuda): ") + what + " must be f32, got " + dtype_name(s.element_type()));
  if (int64_t(s.element_count()) != rows)
    return invalid(std::string("layer_norm: ") + what + " must have one value per row of x");
  return ffi::Error::Success();
}

ffi::Error LayerNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, float eps) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (auto e = check_param(x, beta, "beta"); e.failure()) return e;
  if (!same_dims(x, *y) || y->element_type() != x.element_type()) return invalid("layer_norm: output y must match x");
  if (!(eps >= 0.0f)) return invalid("layer_norm: eps must be >= 0");
  const auto v = rows_view(x);
  if (auto e = check_stat(*mean, v.rows, "mean"); e.failure()) return e;
  if (auto e = check_stat(*rstd, v.rows, "rstd"); e.failure()) return e;
  if (v.rows == 0) return ffi::Error::Success();
  if (v.width == 0) {  // empty rows: statistics are 0/0, as in the reference and the CPU kernel
    const unsigned grid = unsigned(std::min<int64_t>(rw::ceil_div(v.rows, 256), 1024));
    ln::fill_f32<<<grid, 256, 0, stream>>>(static_cast<float*>(mean->untyped_data()), v.rows, NAN);
    ln::fill_f32<<<grid, 256, 0, stream>>>(static_cast<float*>(rstd->untyped_data()), v.rows, NAN);
    return check_launch("layer_norm forward (cuda) launch");
  }
  ffi::Error result = ffi::Error::Success();
  const bool ok = rw::dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = ln::launch_fwd<T>(stream, static_cast<const T*>(x.untyped_data()),
                               static_cast<const T*>(gamma.untyped_data()), static_cast<const T*>(beta.untyped_data()),
                               static_cast<T*>(y->untyped_data()), static_cast<float*>(mean->untyped_data()),
                               static_cast<float*>(rstd->untyped_data()), eps, v.rows, v.width);
  });
  if (!ok) return invalid("layer_norm (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

ffi::Error LayerNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer mean,
                            ffi::AnyBuffer rstd, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dgamma, ffi::Result<ffi::AnyBuffer> dbeta,
                            ffi::Result<ffi::AnyBuffer> scratch) {
  if (auto e = check_param(x, gamma, "gamma"); e.failure()) return e;
  if (!same_dims(x, dy) || dy.element_type() != x.element_type())
    return invalid("layer_norm backward: dy must match x in shape and dtype");
  if (!same_dims(x, *dx) || dx->element_type() != x.element_type())
    return invalid("layer_norm backward: dx must match x");
  if (auto e = check_param(x, *dgamma, "dgamma"); e.failure()) return e;
  if (auto e = check_param(x, *dbeta, "dbeta"); e.failure()) return e;
  const auto v = rows_view(x);
  if (auto e = check_stat(mean, v.rows, "mean"); e.failure()) return e;
  if (auto e = check_stat(rstd, v.rows, "rstd"); e.failure()) return e;
  if (v.width == 0) return ffi::Error::Success();
  const int64_t scratch_len = int64_t(scratch->element_count());
  if (scratch->element_type() != ffi::DataType::F32 || scratch_len < 2 * v.rows + 2 * v.width)
    return invalid("layer_norm backward (cuda): scratch must be f32 with at least 2 * rows + 2 * width (" +
                   std::to_string(2 * v.rows + 2 * v.width) + ") elements, got " + std::to_string(scratch_len));
  ffi::Error result = ffi::Error::Success();
  const bool ok = rw::dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = ln::launch_bwd<T>(
        stream, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(gamma.untyped_data()),
        static_cast<const float*>(mean.untyped_data()), static_cast<const float*>(rstd.untyped_data()),
        static_cast<const T*>(dy.untyped_data()), static_cast<T*>(dx->untyped_data()),
        static_cast<T*>(dgamma->untyped_data()), static_cast<T*>(dbeta->untyped_data()),
        static_cast<float*>(scratch->untyped_data()), scratch_len, v.rows, v.width);
  });
  if (!ok) return invalid("layer_norm backward (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

}  // namespace

// Command-buffer compatible: kernels on XLA's stream only, launch shapes from the
// buffer shapes and the device.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormFwdCuda, LayerNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // beta
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // mean
                                  .Ret<ffi::AnyBuffer>()  // rstd
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormBwdCuda, LayerNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // gamma
                                  .Arg<ffi::AnyBuffer>()   // mean
                                  .Arg<ffi::AnyBuffer>()   // rstd
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Ret<ffi::AnyBuffer>()   // dgamma
                                  .Ret<ffi::AnyBuffer>()   // dbeta
                                  .Ret<ffi::AnyBuffer>(),  // scratch
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_layer_norm_fwd", RlxLayerNormFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_layer_norm_bwd", RlxLayerNormBwdCuda);

}  // namespace cuda
}  // namespace rlx
