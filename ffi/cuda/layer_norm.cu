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
// The work layout and its code are RMSNorm's (rms_norm_kernels.cuh: RowPlan, column_plan,
// the persistent grid, the one-pass kernel bodies fwd_rows_body / bwd_rows_body /
// fwd_rows_tma_body / bwd_rows_tma_body, reduce_partials); this file holds LayerNorm's
// maths (LnFwdT, LnBwdT),
// its row statistics (LnStats) and its handlers. A row group holds a row in registers (16-byte
// vector loads), so rows up to 8192 wide are one pass: the forward reads x once (mean,
// then the centred variance from the registers: two fixed-order group reductions) and
// writes y; the backward reads x and dy once and writes dx, keeping each thread's
// columns' dgamma/dbeta sums in registers across its rows; one partial row per block,
// added by reduce_partials in a fixed order (no atomics: deterministic). Wider rows are
// split into column slabs and take their row statistics from ln_row_stats (LnStats on
// rms::row_stats_body), which reads the row once more (the documented slower path).
// On sm_90 16-bit rows of at least 2 KB take the staged forward (rows bulk-copied into shared
// memory, 3 in flight a block, two 16-byte vectors a thread; see launch_fwd): ncu, H200,
// bf16 32768x4096: the register kernel 243.7 us at 43.9% of DRAM bandwidth (one vector a
// thread in flight, two block reductions a row), staged one vector a thread 173.7 us at 61.5%.
// Why bf16 rows were slower than RMSNorm's on the same machinery (H200, ncu, 32768x4096 bf16,
// staged kernel, 512 threads a row, 64 registers: 2 blocks = 50% occupancy for both):
// LayerNorm 240.6 us at 68.9% of DRAM bandwidth, SM throughput 71.7%, one instruction per
// 9.9 warp cycles (~3 of 4 issue slots busy); RMSNorm 210.5 us at 78.7%. Issue-bound, not
// memory-bound: 8 bf16 values a thread a row, and LayerNorm's two-value row reduction had
// every thread read and add all 2 x 16 warp sums (64 instructions a thread a row, as many
// as the row's arithmetic). The staged kernel now adds them lane-parallel
// (rw::group_sum2_tree): bf16 bwd through JAX 0.498 -> 0.430 ms in one run (H200).
#include <cstdlib>

#include "cuda/rms_norm_kernels.cuh"
#include "cuda/rowwise_common.cuh"
#include "layer_norm_checks.h"

namespace rlx {
namespace cuda {
namespace ln {

using rms::kSmemRed;
using rms::max_threads_for;
using rms::RowPlan;

// ---- LayerNorm's maths over RMSNorm's row machinery (rms_norm_kernels.cuh: fwd_rows_body,
// bwd_rows_body, bwd_rows_tma_body own the layout, the loads, the reductions' barriers and
// the dgamma/dbeta partial rows) ------------------------------------------------------------
// Sum of v over the block's one row group of tpr == blockDim.x > 32 threads (tpr <= 32: as
// group_sum): warp sums to red[parity][warp] (one barrier), then lane w of every warp takes
// warp w's sum and a 5-level xor tree adds them (2 instructions a level instead of one
// shared load and add per warp in every thread). Every thread gets the same bits, fixed for
// a given tpr (another order than group_sum's).
__device__ __forceinline__ float group_sum_tree(float v, int tpr, float* red, int parity) {
  if (tpr <= 32) return group_sum(v, tpr, red, parity);
  const float* slot = warp_sum_to_slot(v, red, parity);
  const int lane = threadIdx.x & 31;
  v = lane < (tpr >> 5) ? slot[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// TREE: the row's two sums by group_sum_tree (the staged forward), else group_sum (the
// register forward).
template <bool TREE>
struct LnFwdT {
  float* __restrict__ mean;
  float* __restrict__ rstd;
  float eps;
  struct Stat { float mu, rs; };
  __device__ __forceinline__ Stat saved(int64_t r, bool rv, bool one_pass) const {
    Stat st;
    st.mu = (rv && !one_pass) ? mean[r] : 0.f;
    st.rs = (rv && !one_pass) ? rstd[r] : 0.f;
    return st;
  }
  __device__ __forceinline__ static float sum(float v, int tpr, float* red, int parity) {
    return TREE ? group_sum_tree(v, tpr, red, parity) : group_sum(v, tpr, red, parity);
  }
  // mean, then the centred variance from the registers: two fixed-order group sums
  // (parity slots 0 and 1)
  template <int NV, int VEC>
  __device__ __forceinline__ Stat row(const float (&x)[NV][VEC], const bool (&ok)[NV], int64_t W, int tpr, float* red,
                                      int64_t, bool rv, int t, int64_t r) const {
    float sx = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int i = 0; i < VEC; ++i) sx += x[k][i];
    const float mu = sum(sx, tpr, red, 0) / float(W);
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!ok[k]) continue;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = x[k][i] - mu;
        q += d * d;
      }
    }
    q = sum(q, tpr, red, 1);
    const float rs = rsqrtf(q / float(W) + eps);
    if (rv && t == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    return {mu, rs};
  }
  __device__ __forceinline__ float y(const Stat& st, float x, float g, float b) const {
    return (x - st.mu) * st.rs * g + b;
  }
};
using LnFwd = LnFwdT<false>;

// sums: the slabbed path's per-row sum(u) [R] then sum(u * xhat) [R]. TREE: the row's two
// sums by rw::group_sum2_tree (lane-parallel add of the warp sums; see rowwise_common.cuh),
// else by group_sum2 (every thread adds every warp's sums).
template <bool TREE>
struct LnBwdT {
  const float* __restrict__ mean;
  const float* __restrict__ rstd;
  const float* __restrict__ sums;
  int64_t R;
  struct Stat { float mu, rs, su, sux; };  // sum u, sum u * xhat
  struct Acc { float pu, pux; };
  __device__ __forceinline__ Stat saved(int64_t r, bool rv, bool one_pass) const {
    Stat st;
    st.mu = rv ? mean[r] : 0.f;
    st.rs = rv ? rstd[r] : 0.f;
    st.su = (rv && !one_pass) ? sums[r] : 0.f;
    st.sux = (rv && !one_pass) ? sums[R + r] : 0.f;
    return st;
  }
  __device__ __forceinline__ void acc(Acc& a, const Stat& st, float x, float d, float g) const {
    const float u = d * g;
    a.pu += u;
    a.pux += u * (x - st.mu);
  }
  __device__ __forceinline__ void reduce(const Acc& a, Stat& st, int64_t, int tpr, float* red, int parity) const {
    const float2 v = TREE ? rw::group_sum2_tree(a.pu, a.pux, tpr, red, parity) : group_sum2(a.pu, a.pux, tpr, red, parity);
    st.su = v.x;
    st.sux = v.y * st.rs;
  }
  struct Coef { float mu, rs, a, b; };
  __device__ __forceinline__ Coef coef(const Stat& st, int64_t W) const {
    return {st.mu, st.rs, st.su / float(W), st.sux / float(W)};
  }
  __device__ __forceinline__ void dx(const Coef& c, float x, float d, float g, float& o, float& ag) const {
    const float xh = (x - c.mu) * c.rs;
    o = c.rs * (d * g - c.a - xh * c.b);
    ag += d * xh;
  }
};

template <typename T, int VEC, int NV, bool PF>
__global__ void __launch_bounds__(max_threads_for(NV * VEC, PF))
ln_fwd_rows(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, T* __restrict__ y,
            float* __restrict__ mean, float* __restrict__ rstd, float eps, RowPlan pl) {
  rms::fwd_rows_body<T, VEC, NV, PF>(x, gamma, beta, y, pl, LnFwd{mean, rstd, eps});
}

// sm_90 staged forward (rms::fwd_rows_tma_body): thread 0 keeps pl.stages rows of x in flight
// by cp.async.bulk (the register kernel has one 16-byte vector a thread in flight for 16-bit
// rows), the row's two sums by group_sum_tree.
template <typename T, int NV>
__global__ void __launch_bounds__(max_threads_for(NV * kVec16<T>, false), 1)
ln_fwd_rows_tma(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, T* __restrict__ y,
                float* __restrict__ mean, float* __restrict__ rstd, float eps, RowPlan pl) {
  rms::fwd_rows_tma_body<T, NV>(x, gamma, beta, y, pl, LnFwdT<true>{mean, rstd, eps});
}

// Forward: 16-bit rows staged with two 16-byte vectors a thread (half the threads a row, so
// half the reductions' and barriers' instructions a row element) and group_sum_tree; f32 rows
// on the register kernel. Rows the staged path does not take (under 2 KB, wider than one
// pass, no sm_90): the register kernel. Measured on an H200, bf16 32768x4096 (3 rounds of
// alternating processes each): staged two vectors 0.166 ms, staged one vector (tree) 0.185,
// the same capped at 64 registers (4 blocks an SM, spills) 0.172, staged with group_sum
// slower than the tree, register kernel 0.265; f32: staged (tree) and register kernel within
// 1 %, so f32 keeps the register kernel.
// The staged forward's plan for 16-bit rows: two vectors a thread (NV 2) where that leaves more than one
// warp a row; false (keep pl) otherwise.
template <typename T>
bool two_vectors_a_thread(RowPlan& pl) {
  if (sizeof(T) != 2 || pl.vec != kVec16<T> || pl.slabs != 1 || pl.nv != 1) return false;
  const int64_t tpr = rw::ceil_div(rw::ceil_div(pl.width / pl.vec, 2), 32) * 32;
  if (tpr <= 32) return false;
  pl.nv = 2;
  pl.tpr = pl.threads = int(tpr);
  return true;
}

// The register kernel keeps group_sum2: its one-row-per-block cases (16-bit rows under 2 KB,
// the wide-row slabs) were not measured with the tree.
using LnBwd = LnBwdT<false>;

template <typename T, int VEC, int NV, bool PF>
__global__ void __launch_bounds__(max_threads_for(NV * VEC, PF))
ln_bwd_rows(const T* __restrict__ x, const T* __restrict__ gamma, const float* __restrict__ mean,
            const float* __restrict__ rstd, const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ partial,
            const float* __restrict__ sums, RowPlan pl) {
  rms::bwd_rows_body<T, VEC, NV, PF>(x, gamma, dy, dx, partial, pl, LnBwd{mean, rstd, sums, pl.rows});
}

// sm_90 staged backward (rms::bwd_rows_tma_body): thread 0 keeps pl.stages rows of x and dy
// in flight by cp.async.bulk; bytes in flight then no longer depend on registers (what
// the 16-bit register path lacks). The row's two sums by rw::group_sum2_tree (LnBwdT).
template <typename T, int NV>
__global__ void __launch_bounds__(max_threads_for(NV * kVec16<T>, false))
ln_bwd_rows_tma(const T* __restrict__ x, const T* __restrict__ gamma, const float* __restrict__ mean,
                const float* __restrict__ rstd, const T* __restrict__ dy, T* __restrict__ dx,
                float* __restrict__ partial, RowPlan pl) {
  rms::bwd_rows_tma_body<T, NV>(x, gamma, dy, dx, partial, pl, LnBwdT<true>{mean, rstd, nullptr, pl.rows});
}

// Row statistics of the slabbed (wide-row) path (rms::row_stats_body: one block per row,
// grid-stride; x, dy and gamma through the read-only cache).
// Forward: mean, rstd from sums shifted by the row's first element (x0):
//   mean = x0 + S1 / W, var = S2 / W - (S1 / W)^2 with S1 = sum (x - x0), S2 = sum (x - x0)^2.
// Backward: sums[r] = sum u, sums[R + r] = sum u * xhat.
template <bool BWD>
struct LnStats {
  float* __restrict__ mean;
  float* __restrict__ rstd;
  float* __restrict__ sums;
  float eps;
  int64_t rows;
  static constexpr bool kBwd = BWD, kStream = false;
  struct Row { float x0, rs; };  // the shift (the mean in the backward), rstd
  struct Acc { float a, b; };
  template <typename T>
  __device__ __forceinline__ Row begin(const T* xr, int64_t r) const {
    return {BWD ? mean[r] : to_f32(xr[0]), BWD ? rstd[r] : 0.f};
  }
  __device__ __forceinline__ void add(Acc& acc, const Row& row, float x) const {
    const float d = x - row.x0;
    acc.a += d;
    acc.b += d * d;
  }
  __device__ __forceinline__ void add(Acc& acc, const Row& row, float x, float dy, float g) const {
    const float u = dy * g;
    acc.a += u;
    acc.b += u * (x - row.x0);
  }
  __device__ __forceinline__ float2 reduce(const Acc& acc, float* red, int parity) const {
    return group_sum2(acc.a, acc.b, blockDim.x, red, parity);
  }
  __device__ __forceinline__ void store(int64_t r, const Row& row, float2 v, int64_t W) const {
    if constexpr (BWD) {
      sums[r] = v.x;
      sums[rows + r] = v.y * row.rs;
    } else {
      const float m1 = v.x / float(W);
      const float var = fmaxf(v.y / float(W) - m1 * m1, 0.f);
      mean[r] = row.x0 + m1;
      rstd[r] = rsqrtf(var + eps);
    }
  }
};

template <typename T, int VEC, bool BWD>
__global__ void __launch_bounds__(512)
ln_row_stats(const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ gamma, float* __restrict__ mean,
             float* __restrict__ rstd, float* __restrict__ sums, float eps, int64_t rows, int64_t W) {
  rms::row_stats_body<T, VEC>(x, dy, gamma, rows, W, LnStats<BWD>{mean, rstd, sums, eps, rows});
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
  if constexpr (sizeof(T) == 2) {
    RowPlan p2 = pl;
    if (two_vectors_a_thread<T>(p2)) {
      auto staged = ln_fwd_rows_tma<T, 2>;
      if (rms::plan_staged(p2, staged, W * int64_t(sizeof(T)), W * int64_t(sizeof(T)), 3, rms::Tuning{})) {
        err = rms::set_parts(p2, staged, rows);
        if (err != cudaSuccess) return cuda_error("layer_norm forward (cuda) setup", err);
        staged<<<unsigned(p2.parts), p2.threads, rms::smem_bytes(p2), stream>>>(x, gamma, beta, y, mean, rstd, eps,
                                                                               p2);
        return check_launch("layer_norm forward (cuda) launch");
      }
    }
  }
  const bool ok = rms::with_variant<T>(pl, [&](auto vec, auto nv, auto pf) {
    constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
    constexpr bool PF = decltype(pf)::value;
    if constexpr (VEC != 1) {
      // 16-bit rows on sm_90, one pass, rows of at least 2 KB (RMSNorm's threshold), 3 stages as
      // RMSNorm's
      auto staged = ln_fwd_rows_tma<T, NV>;
      rms::Tuning tu;
      tu.tma = sizeof(T) == 4 ? 0 : -1;
      if (rms::plan_staged(pl, staged, W * int64_t(sizeof(T)), W * int64_t(sizeof(T)), 3, tu)) {
        err = rms::set_parts(pl, staged, rows);
        if (err != cudaSuccess) return;
        staged<<<unsigned(pl.parts), pl.threads, rms::smem_bytes(pl), stream>>>(x, gamma, beta, y, mean, rstd, eps,
                                                                               pl);
        return;
      }
    }
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
    const rms::Tuning tu{};
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

using rw::rows_view;

// Eps: the attribute's type, float (ABI v1) or double (v2, whose f64 eps the CPU's f64 kernels use).
template <typename Eps>
ffi::Error LayerNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, Eps eps_attr) {
  const float eps = float(eps_attr);  // the CUDA kernels take no f64 input: f32 arithmetic
  if (auto e = layer_norm::check_fwd(Backend::kCuda, x, gamma, beta, *y, *mean, *rstd, eps); e.failure())
    return e;
  const auto v = rows_view(x);
  if (v.rows == 0) return ffi::Error::Success();
  if (v.width == 0) {  // empty rows: statistics are 0/0, as in the reference and the CPU kernel
    const unsigned grid = unsigned(std::min<int64_t>(rw::ceil_div(v.rows, 256), 1024));
    ln::fill_f32<<<grid, 256, 0, stream>>>(static_cast<float*>(mean->untyped_data()), v.rows, NAN);
    ln::fill_f32<<<grid, 256, 0, stream>>>(static_cast<float*>(rstd->untyped_data()), v.rows, NAN);
    return check_launch("layer_norm forward (cuda) launch");
  }
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(x.element_type(), [&](auto tag) {
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
  if (auto e = layer_norm::check_bwd(Backend::kCuda, x, gamma, mean, rstd, dy, *dx, *dgamma, *dbeta);
      e.failure())
    return e;
  const auto v = rows_view(x);
  if (v.width == 0) return ffi::Error::Success();
  const int64_t scratch_len = int64_t(scratch->element_count());
  if (scratch->element_type() != ffi::DataType::F32 || scratch_len < 2 * v.rows + 2 * v.width)
    return invalid("layer_norm backward (cuda): scratch must be f32 with at least 2 * rows + 2 * width (" +
                   std::to_string(2 * v.rows + 2 * v.width) + ") elements, got " + std::to_string(scratch_len));
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(x.element_type(), [&](auto tag) {
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
// v1 takes eps as f32, v2 as f64 (the CPU's f64 kernels normalise with the exact eps)
#define RLX_LAYER_NORM_FWD_BINDING(EPS)            \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()    \
      .Arg<ffi::AnyBuffer>() /* x */               \
      .Arg<ffi::AnyBuffer>() /* gamma */           \
      .Arg<ffi::AnyBuffer>() /* beta */            \
      .Ret<ffi::AnyBuffer>() /* y */               \
      .Ret<ffi::AnyBuffer>() /* mean */            \
      .Ret<ffi::AnyBuffer>() /* rstd */            \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormFwdCuda, LayerNormFwdImpl<float>, RLX_LAYER_NORM_FWD_BINDING(float),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxLayerNormFwdCudaV2, LayerNormFwdImpl<double>, RLX_LAYER_NORM_FWD_BINDING(double),
                              {ffi::Traits::kCmdBufferCompatible});
#undef RLX_LAYER_NORM_FWD_BINDING
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
RLX_CUDA_REGISTER_HANDLER("rlx_layer_norm_fwd_v2", RlxLayerNormFwdCudaV2);
RLX_CUDA_REGISTER_HANDLER("rlx_layer_norm_bwd", RlxLayerNormBwdCuda);

}  // namespace cuda
}  // namespace rlx
