// RMSNorm CUDA kernels and their launch plans (included by rms_norm.cu, and by the
// stand-alone timing harness ffi/cuda/tools/rms_norm_sweep.cu), and the row machinery
// that LayerNorm's kernels (layer_norm.cu) share: the one-pass kernel bodies are written
// once over a maths policy (see "row machinery" below).
//
//   x: [R, W] rows, gamma, beta: [W]
//   r   = 1 / sqrt(mean_j x_j^2 + eps)                          (rstd, f32 [R])
//   y_j = x_j * r * gamma_j + beta_j
// Backward, u_j = dy_j * gamma_j:
//   dx_j     = r * u_j - x_j * r^3 * (sum_i u_i x_i) / W
//   dgamma_j = sum_rows dy_j * x_j * r        dbeta_j = sum_rows dy_j
//
// Work layout. A row is handled by a group of `tpr` threads; thread t of the group
// owns the NV vectors of VEC elements at columns (t + k * tpr) * VEC, k < NV, so its
// loads are 16 bytes wide and coalesced across the group. The grid is `parts` row
// chunks (blocks) times `slabs` column slabs; `parts` is the number of blocks that
// are resident at once (a persistent grid), so every block streams through a
// contiguous range of rows. In the backward, each thread keeps its columns' dgamma and
// dbeta sums in registers across its rows; each block writes them once as an f32
// partial row partial[p][2][W], and a second small kernel adds the partials in a fixed
// order (no atomics: bitwise deterministic on a given device).
//
// Rows up to 8192 wide are done in one pass (one read of x and dy, one write of dx).
// Wider rows are split into column slabs handled by different blocks; the per-row
// statistic (rstd forward, sum u*x backward) then comes from a separate statistics
// kernel that reads the row once more: 1.5x (forward) and 5/3x (backward) the bytes
// of the one-pass kernels. That is the documented slower path for very wide rows.
#pragma once

#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/rowwise_common.cuh"

namespace rlx {
namespace cuda {
namespace rms {

struct RowPlan {
  int64_t rows = 0, width = 0;
  int64_t parts = 1;      // row chunks (blocks along the rows)
  int64_t slabs = 1;      // column slabs (blocks along the columns)
  int64_t slab_cols = 0;  // columns per slab (a multiple of vec)
  int vec = 1;            // elements per vector (1, or 16 bytes' worth)
  int nv = 1;             // vectors per thread per row
  int tpr = 32;           // threads per row group
  int threads = 256;      // threads per block
  bool prefetch = true;   // load row i+1 while reducing row i
  int stages = 0;         // > 0: rows staged through shared memory by bulk copies (sm_90)
  int64_t stage_bytes = 0;
  float eps = -1.f;       // backward: >= 0: recompute rstd from x with this eps (rstd unused)
};

// Upper bound on the threads of a block for NV vectors of VEC elements per thread
// (doubled row registers when prefetching): leaves each thread enough registers for
// x, dy, gamma and two accumulators per element without spilling.
constexpr int max_threads_for(int elems, bool pf) {
  const int e = pf ? 2 * elems : elems;
  return e <= 8 ? 1024 : (e <= 16 ? 512 : (e <= 32 ? 256 : 128));
}

constexpr int kSmemRed = 128;  // floats: two parity slots of 2 x 32 warp sums

// ---- row machinery shared with LayerNorm (layer_norm.cu) ----------------------------------
// The one-pass kernels are written once, in fwd_rows_body, bwd_rows_body and
// bwd_rows_tma_body, over a maths policy `Op` (RMSNorm's below, LayerNorm's in
// layer_norm.cu). The bodies own the work layout: the block's rows and column slab, the
// columns and parameters of a thread, the row loads (prefetched or not), the reductions'
// parity, the dgamma/dbeta sums and the block's partial row. The policy owns the maths:
//   Stat                      per-row statistics (loaded or reduced)
//   saved(r, rv, one_pass)    the statistics a row starts with (saved ones, or zeros)
// forward:
//   row(x, ok, W, tpr, red, it, rv, t, r)   one pass: reduce the row, return its Stat
//                                           (thread t == 0 of a valid row stores it)
//   y(st, x, g, b)            an output element
// backward:
//   Acc, acc(a, st, x, dy, g)  a thread's partial row sums, per element
//   reduce(a, st, W, tpr, red, parity)  group reduction into st (one pass; a barrier)
//   coef(st, W)               row coefficients, then dx(c, x, dy, g, o, ag): the dx
//                             element and the dgamma sum (the dbeta sum is dy's)

// Thread t's columns col[k] = c0 + (t + k * tpr) * VEC (ok[k]: below c1) and gamma
// (and, with BETA, beta) at them; 0 where !ok.
template <typename T, int VEC, int NV, bool BETA = false>
__device__ __forceinline__ void row_columns(int64_t c0, int64_t c1, int t, int tpr, const T* __restrict__ gamma,
                                            int64_t (&col)[NV], bool (&ok)[NV], float (&gm)[NV][VEC],
                                            const T* __restrict__ beta = nullptr, float (*bt)[VEC] = nullptr) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    col[k] = c0 + int64_t(t + k * tpr) * VEC;
    ok[k] = col[k] < c1;
    if (ok[k]) {
      load_vec_cached<T, VEC>(gamma + col[k], gm[k]);
      if constexpr (BETA) load_vec_cached<T, VEC>(beta + col[k], bt[k]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        gm[k][i] = 0.f;
        if constexpr (BETA) bt[k][i] = 0.f;
      }
    }
  }
}

// Row r of a (row length W) at the thread's columns; 0 where the row is invalid (rv
// false) or the column is not the thread's. With a2 (the backward's dy), the same
// columns of a second array into v2, each vector next to v's.
template <typename T, int VEC, int NV, bool TWO = false>
__device__ __forceinline__ void load_row_vecs(const T* __restrict__ a, int64_t r, int64_t W, const int64_t (&col)[NV],
                                              const bool (&ok)[NV], bool rv, float (&v)[NV][VEC],
                                              const T* __restrict__ a2 = nullptr, float (*v2)[VEC] = nullptr) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (rv && ok[k]) {
      load_vec<T, VEC>(a + r * W + col[k], v[k]);
      if constexpr (TWO) load_vec<T, VEC>(a2 + r * W + col[k], v2[k]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v[k][i] = 0.f;
        if constexpr (TWO) v2[k][i] = 0.f;
      }
    }
  }
}

// The block's dgamma/dbeta partial row: partial[p][0][c0:c1] = dgamma sums, [p][1] =
// dbeta sums. One row group per block (gpb == 1): each thread stores its columns.
// Several (narrow rows): the groups' sums are added in group order through shared
// memory (buf: [2][slab_cols] floats), then written once.
template <int VEC, int NV>
__device__ __forceinline__ void write_partials(const float (&ag)[NV][VEC], const float (&ab)[NV][VEC],
                                               const int64_t (&col)[NV], const bool (&ok)[NV],
                                               float* __restrict__ partial, int64_t p, int64_t W, int gpb, int g,
                                               int64_t c0, int64_t c1, int64_t sc, float* buf) {
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

// A block's share of a plan (register kernels): row chunk [r0, r1) (chunk p), column slab
// [c0, c1), and the thread's row group g (gpb groups of tpr threads a block) and place t
// in it; one_pass: the row is not split into slabs.
struct BlockRows {
  int tpr, gpb, g, t;
  int64_t p, W, r0, r1, c0, c1;
  bool one_pass;
  __device__ __forceinline__ explicit BlockRows(const RowPlan& pl) {
    tpr = pl.tpr;
    gpb = blockDim.x / tpr;
    g = threadIdx.x / tpr;
    t = threadIdx.x - g * tpr;
    p = blockIdx.x / pl.slabs;
    const int64_t s = blockIdx.x - p * pl.slabs;
    W = pl.width;
    r0 = pl.rows * p / pl.parts;
    r1 = pl.rows * (p + 1) / pl.parts;
    c0 = s * pl.slab_cols;
    c1 = min(W, c0 + pl.slab_cols);
    one_pass = pl.slabs == 1;
  }
};

// The fused residual add of the backward (add_rms_norm): dx_j += dres_j, the gradient the
// residual stream carries past the norm, added in f32 before dx is rounded once. dres null:
// the plain norm backward.
template <typename T, int VEC>
__device__ __forceinline__ void add_residual_grad(const T* __restrict__ dres, int64_t at, float (&o)[VEC]) {
  if (dres == nullptr) return;
  float d[VEC];
  load_vec<T, VEC>(dres + at, d);
#pragma unroll
  for (int i = 0; i < VEC; ++i) o[i] += d[i];
}

// ---- backward: one pass over rows -------------------------------------------------------
template <typename T, int VEC, int NV, bool PF, typename Op>
__device__ __forceinline__ void bwd_rows_body(const T* __restrict__ x, const T* __restrict__ gamma,
                                              const T* __restrict__ dy, T* __restrict__ dx,
                                              float* __restrict__ partial, const RowPlan& pl, const Op& op,
                                              const T* __restrict__ dres = nullptr) {
  using Stat = typename Op::Stat;
  extern __shared__ float smem[];
  float* red = smem;
  const BlockRows blk(pl);

  int64_t col[NV];
  bool ok[NV];
  float gm[NV][VEC], ag[NV][VEC], ab[NV][VEC];
  row_columns<T, VEC, NV>(blk.c0, blk.c1, blk.t, blk.tpr, gamma, col, ok, gm);
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) ag[k][i] = ab[k][i] = 0.f;

  const int64_t n_iter = (blk.r1 - blk.r0 + blk.gpb - 1) / blk.gpb;
  float xa[NV][VEC], da[NV][VEC], xb[NV][VEC], db[NV][VEC];
  Stat st_a{}, st_b{};

  auto load_row = [&](int64_t it, float (&xr)[NV][VEC], float (&dr)[NV][VEC], Stat& st) {
    const int64_t r = blk.r0 + it * blk.gpb + blk.g;
    const bool rv = r < blk.r1;
    load_row_vecs<T, VEC, NV, true>(x, r, blk.W, col, ok, rv, xr, dy, dr);
    st = op.saved(r, rv, blk.one_pass);
  };

  if (PF && n_iter > 0) load_row(0, xa, da, st_a);
  for (int64_t it = 0; it < n_iter; ++it) {
    if (!PF) {
      load_row(it, xa, da, st_a);
    } else if (it + 1 < n_iter) {
      load_row(it + 1, xb, db, st_b);
    }
    const int64_t r = blk.r0 + it * blk.gpb + blk.g;
    const bool rv = r < blk.r1;
    Stat st = st_a;
    if (blk.one_pass) {
      typename Op::Acc acc{};
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) op.acc(acc, st, xa[k][i], da[k][i], gm[k][i]);
      op.reduce(acc, st, blk.W, blk.tpr, red, int(it & 1));
    }
    if (rv) {
      const auto c = op.coef(st, blk.W);
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (!ok[k]) continue;
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          op.dx(c, xa[k][i], da[k][i], gm[k][i], o[i], ag[k][i]);
          ab[k][i] += da[k][i];
        }
        add_residual_grad<T, VEC>(dres, r * blk.W + col[k], o);
        store_vec<T, VEC>(dx + r * blk.W + col[k], o);
      }
    }
    if (PF) {
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) { xa[k][i] = xb[k][i]; da[k][i] = db[k][i]; }
      st_a = st_b;
    }
  }
  write_partials<VEC, NV>(ag, ab, col, ok, partial, blk.p, blk.W, blk.gpb, blk.g, blk.c0, blk.c1, pl.slab_cols,
                          smem + kSmemRed);
}

// ---- forward: one pass over rows ----------------------------------------------------------
template <typename T, int VEC, int NV, bool PF, typename Op>
__device__ __forceinline__ void fwd_rows_body(const T* __restrict__ x, const T* __restrict__ gamma,
                                              const T* __restrict__ beta, T* __restrict__ y, const RowPlan& pl,
                                              const Op& op) {
  using Stat = typename Op::Stat;
  extern __shared__ float smem[];
  float* red = smem;
  const BlockRows blk(pl);

  int64_t col[NV];
  bool ok[NV];
  float gm[NV][VEC], bt[NV][VEC];
  row_columns<T, VEC, NV, true>(blk.c0, blk.c1, blk.t, blk.tpr, gamma, col, ok, gm, beta, bt);

  const int64_t n_iter = (blk.r1 - blk.r0 + blk.gpb - 1) / blk.gpb;
  float xa[NV][VEC], xb[NV][VEC];
  Stat st_a{}, st_b{};
  auto load_row = [&](int64_t it, float (&xr)[NV][VEC], Stat& st) {
    const int64_t r = blk.r0 + it * blk.gpb + blk.g;
    const bool rv = r < blk.r1;
    load_row_vecs<T, VEC, NV>(x, r, blk.W, col, ok, rv, xr);
    st = op.saved(r, rv, blk.one_pass);
  };

  if (PF && n_iter > 0) load_row(0, xa, st_a);
  for (int64_t it = 0; it < n_iter; ++it) {
    if (!PF) {
      load_row(it, xa, st_a);
    } else if (it + 1 < n_iter) {
      load_row(it + 1, xb, st_b);
    }
    const int64_t r = blk.r0 + it * blk.gpb + blk.g;
    const bool rv = r < blk.r1;
    Stat st = st_a;
    if (blk.one_pass) st = op.row(xa, ok, blk.W, blk.tpr, red, it, rv, blk.t, r);
    if (rv) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (!ok[k]) continue;
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = op.y(st, xa[k][i], gm[k][i], bt[k][i]);
        store_vec<T, VEC>(y + r * blk.W + col[k], o);
      }
    }
    if (PF) {
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) xa[k][i] = xb[k][i];
      st_a = st_b;
    }
  }
}

// ---- RMSNorm's maths --------------------------------------------------------------------------
struct RmsFwd {
  float* __restrict__ rstd;
  float eps;
  struct Stat { float rs; };
  __device__ __forceinline__ Stat saved(int64_t r, bool rv, bool one_pass) const {
    return {(rv && !one_pass) ? rstd[r] : 0.f};
  }
  template <int NV, int VEC>
  __device__ __forceinline__ Stat row(const float (&x)[NV][VEC], const bool (&)[NV], int64_t W, int tpr, float* red,
                                      int64_t it, bool rv, int t, int64_t r) const {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int i = 0; i < VEC; ++i) ss += x[k][i] * x[k][i];
    ss = group_sum(ss, tpr, red, int(it & 1));
    const float rs = rsqrtf(ss / float(W) + eps);
    if (rv && t == 0) rstd[r] = rs;
    return {rs};
  }
  __device__ __forceinline__ float y(const Stat& st, float x, float g, float b) const { return x * st.rs * g + b; }
};

// MODE 0: rstd saved; 1: recomputed from x with eps; -1: a run-time choice, `rc` (the
// register kernel: one pass and eps >= 0).
template <int MODE>
struct RmsBwd {
  const float* __restrict__ rstd;
  const float* __restrict__ dot_in;  // the slabbed path's sum u x per row
  float eps;
  bool rc;
  struct Stat { float dot, rs; };
  struct Acc { float part, ss; };
  __device__ __forceinline__ bool recompute(bool one_pass) const {
    return MODE < 0 ? rc : (one_pass && MODE == 1);
  }
  __device__ __forceinline__ Stat saved(int64_t r, bool rv, bool one_pass) const {
    Stat st;
    const bool slab = rv && !one_pass;
    st.rs = (rv && !recompute(one_pass)) ? rstd[r] : 0.f;
    st.dot = slab ? dot_in[r] : 0.f;
    return st;
  }
  __device__ __forceinline__ void acc(Acc& a, const Stat&, float x, float d, float g) const {
    a.part += d * g * x;
    if constexpr (MODE != 0) a.ss += x * x;
  }
  __device__ __forceinline__ void reduce(const Acc& a, Stat& st, int64_t W, int tpr, float* red, int parity) const {
    if (recompute(true)) {
      const float2 v = group_sum2(a.part, a.ss, tpr, red, parity);
      st.dot = v.x;
      st.rs = rsqrtf(v.y / float(W) + eps);
    } else {
      st.dot = group_sum(a.part, tpr, red, parity);
    }
  }
  struct Coef { float rs, coef; };
  __device__ __forceinline__ Coef coef(const Stat& st, int64_t W) const {
    return {st.rs, st.rs * st.rs * st.rs * st.dot / float(W)};
  }
  __device__ __forceinline__ void dx(const Coef& c, float x, float d, float g, float& o, float& ag) const {
    o = c.rs * d * g - c.coef * x;
    ag += d * x * c.rs;
  }
};

template <typename T, int VEC, int NV, bool PF>
__global__ void __launch_bounds__(max_threads_for(NV * VEC, PF))
bwd_rows(const T* __restrict__ x, const T* __restrict__ gamma, const float* __restrict__ rstd,
         const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ partial,
         const float* __restrict__ dot_in, RowPlan pl, const T* __restrict__ dres) {
  const bool recompute = pl.slabs == 1 && pl.eps >= 0.f;  // rstd from x (one pass only)
  bwd_rows_body<T, VEC, NV, PF>(x, gamma, dy, dx, partial, pl, RmsBwd<-1>{rstd, dot_in, pl.eps, recompute},
                                dres);
}

template <typename T, int VEC, int NV, bool PF>
__global__ void __launch_bounds__(max_threads_for(NV * VEC, PF))
fwd_rows(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
         T* __restrict__ y, float* __restrict__ rstd, float eps, RowPlan pl) {
  fwd_rows_body<T, VEC, NV, PF>(x, gamma, beta, y, pl, RmsFwd{rstd, eps});
}

// ---- per-row statistics for the slabbed (very wide row) path ---------------------------------
// One block per row (grid-stride over rows): each thread folds its vectors of row r (x,
// and in the backward dy and gamma) into the policy's accumulator, the block reduces it
// and thread 0 stores the row's statistics. The policy (RmsStats below, LnStats in
// layer_norm.cu) gives kBwd, kStream (x and dy by streaming loads, else cached),
// begin(xr, r) (per-row constants), Acc, add(acc, row, x[, dy, g]), reduce(acc, red,
// parity) (a barrier) and store(r, row, v, W).
template <typename T, int VEC, bool STREAM>
__device__ __forceinline__ void load_vec_policy(const T* __restrict__ p, float (&v)[VEC]) {
  if constexpr (STREAM) load_vec<T, VEC>(p, v);
  else load_vec_cached<T, VEC>(p, v);
}

template <typename T, int VEC, typename Op>
__device__ __forceinline__ void row_stats_body(const T* __restrict__ x, const T* __restrict__ dy,
                                               const T* __restrict__ gamma, int64_t rows, int64_t W, const Op& op) {
  __shared__ float red[kSmemRed];
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * W;
    const auto row = op.begin(xr, r);
    typename Op::Acc acc{};
#pragma unroll 4
    for (int64_t j = int64_t(threadIdx.x) * VEC; j < W; j += int64_t(blockDim.x) * VEC) {
      float xv[VEC];
      load_vec_policy<T, VEC, Op::kStream>(xr + j, xv);
      if constexpr (Op::kBwd) {
        float dv[VEC], gv[VEC];
        load_vec_policy<T, VEC, Op::kStream>(dy + r * W + j, dv);
        load_vec_cached<T, VEC>(gamma + j, gv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) op.add(acc, row, xv[i], dv[i], gv[i]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) op.add(acc, row, xv[i]);
      }
    }
    const auto v = op.reduce(acc, red, parity);
    parity ^= 1;
    if (threadIdx.x == 0) op.store(r, row, v, W);
  }
}

// RMSNorm: BWD: out[r] = sum_j dy_j * gamma_j * x_j; else out[r] = rsqrt(mean_j x_j^2 + eps).
template <bool BWD>
struct RmsStats {
  float* __restrict__ out;
  float eps;
  static constexpr bool kBwd = BWD, kStream = true;
  struct Row {};
  using Acc = float;
  template <typename T>
  __device__ __forceinline__ Row begin(const T*, int64_t) const { return {}; }
  __device__ __forceinline__ void add(float& a, Row, float x) const { a += x * x; }
  __device__ __forceinline__ void add(float& a, Row, float x, float d, float g) const { a += d * g * x; }
  __device__ __forceinline__ float reduce(float a, float* red, int parity) const {
    return group_sum(a, blockDim.x, red, parity);
  }
  __device__ __forceinline__ void store(int64_t r, Row, float v, int64_t W) const {
    out[r] = BWD ? v : rsqrtf(v / float(W) + eps);
  }
};

template <typename T, int VEC, bool BWD>
__global__ void __launch_bounds__(512)
row_stats(const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ gamma,
          float* __restrict__ out, float eps, int64_t rows, int64_t W) {
  row_stats_body<T, VEC>(x, dy, gamma, rows, W, RmsStats<BWD>{out, eps});
}

// ---- second pass of the backward: dgamma, dbeta from the partial rows -------------------------
// Column j of [2W] (dgamma then dbeta) is summed over parts by 8 warps (warp w takes
// parts w, w + 8, ...), then the 8 warp sums are added in warp order: fixed order.
// parts == 0 (no rows) writes zeros.
template <typename T>
__global__ void __launch_bounds__(256)
reduce_partials(const float* __restrict__ partial, int64_t parts, int64_t W, T* __restrict__ dgamma,
                T* __restrict__ dbeta) {
  __shared__ float buf[8][33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t j = int64_t(blockIdx.x) * 32 + lane;
  const int64_t n = 2 * W;
  float s = 0.f;
  if (j < n) {
#pragma unroll 4
    for (int64_t q = warp; q < parts; q += 8) s += partial[q * n + j];
  }
  buf[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && j < n) {
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) tot += buf[w][lane];
    if (j < W) dgamma[j] = from_f32<T>(tot);
    else dbeta[j - W] = from_f32<T>(tot);
  }
}

// ---- sm_90 path: rows staged through shared memory by bulk asynchronous copies --------------
// One row group per block (tpr == blockDim.x > 32). Thread 0 keeps `stages` rows in
// flight: each stage holds one row of x (and of dy in the backward), copied by
// cp.async.bulk and completing on the stage's mbarrier. Bytes in flight then no longer
// depend on registers: 2-4 stages of 8-32 KB per block. Threads read their columns from
// shared memory (16-byte accesses, consecutive per thread: no bank conflicts), and the
// row reduction's barrier tells thread 0 that the stage may be refilled.

// A block of the staged path (rw::StagedRows: shared memory layout, the block's rows
// [r0, r1), n of them, as chunk p of pl.parts), with thread t of the block's one row group
// (tpr == blockDim.x) and a row's bytes; init_barriers: the pl.stages stages' mbarriers.
struct StagedBlock : rw::StagedRows {
  int S, tpr, t;
  int64_t p, W, r1;
  uint32_t row_bytes;
  __device__ __forceinline__ StagedBlock(unsigned char* smem_raw, const RowPlan& pl, int64_t elem_bytes)
      : rw::StagedRows(smem_raw, pl.rows, pl.parts),
        S(pl.stages),
        tpr(blockDim.x),
        t(threadIdx.x),
        p(blockIdx.x),
        W(pl.width),
        r1(r0 + n),
        row_bytes(uint32_t(pl.width * elem_bytes)) {}
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  __device__ __forceinline__ void init_barriers() const { rw::StagedRows::init_barriers(S); }
#endif
};

// Backward of the staged path, over a maths policy (see bwd_rows_body): thread 0 keeps
// pl.stages rows of x and dy in flight (one stage: the row of x, then of dy). YOUT (RMSNorm
// only): the forward's output y = x rstd gamma + beta is written too, from the row of x
// already in registers (one more store, where running the forward again reads x again).
template <typename T, int NV, typename Op, bool YOUT = false>
__device__ __forceinline__ void bwd_rows_tma_body(const T* __restrict__ x, const T* __restrict__ gamma,
                                                  const T* __restrict__ dy, T* __restrict__ dx,
                                                  float* __restrict__ partial, const RowPlan& pl, const Op& op,
                                                  const T* __restrict__ dres = nullptr, T* __restrict__ yout = nullptr,
                                                  const T* __restrict__ beta = nullptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  using Stat = typename Op::Stat;
  constexpr int VEC = kVec16<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const StagedBlock sb(smem_raw, pl, int64_t(sizeof(T)));

  int64_t col[NV];
  bool ok[NV];
  float gm[NV][VEC], ag[NV][VEC], ab[NV][VEC];
  row_columns<T, VEC, NV>(0, sb.W, sb.t, sb.tpr, gamma, col, ok, gm);
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) ag[k][i] = ab[k][i] = 0.f;

  sb.init_barriers();
  auto issue = [&](int64_t i) {
    const int q = int(i % sb.S);
    unsigned char* xs = sb.stages + size_t(q) * 2 * sb.row_bytes;
    mbar_arrive_expect_tx(&sb.bar[q], 2 * sb.row_bytes);
    bulk_load(xs, x + (sb.r0 + i) * sb.W, sb.row_bytes, &sb.bar[q]);
    bulk_load(xs + sb.row_bytes, dy + (sb.r0 + i) * sb.W, sb.row_bytes, &sb.bar[q]);
  };
  if (sb.t == 0)
    for (int64_t i = 0; i < sb.n && i < sb.S; ++i) issue(i);

  for (int64_t i = 0; i < sb.n; ++i) {
    const int q = int(i % sb.S);
    const int64_t r = sb.r0 + i;
    Stat st = op.saved(r, true, true);
    mbar_wait(&sb.bar[q], uint32_t((i / sb.S) & 1));
    const T* xs = reinterpret_cast<const T*>(sb.stages + size_t(q) * 2 * sb.row_bytes);
    const T* ds = xs + sb.W;
    float xa[NV][VEC], da[NV][VEC];
    typename Op::Acc acc{};
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (ok[k]) {
        load_vec_smem<T, VEC>(xs + col[k], xa[k]);
        load_vec_smem<T, VEC>(ds + col[k], da[k]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) xa[k][e] = da[k][e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) op.acc(acc, st, xa[k][e], da[k][e], gm[k][e]);
    }
    op.reduce(acc, st, sb.W, sb.tpr, sb.red, int(i & 1));  // its barrier: stage q is read
    if (sb.t == 0 && i + sb.S < sb.n) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(i + sb.S);
    }
    const auto c = op.coef(st, sb.W);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!ok[k]) continue;
      float o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        op.dx(c, xa[k][e], da[k][e], gm[k][e], o[e], ag[k][e]);
        ab[k][e] += da[k][e];
      }
      add_residual_grad<T, VEC>(dres, r * sb.W + col[k], o);
      store_vec<T, VEC>(dx + r * sb.W + col[k], o);
      if constexpr (YOUT) {
        // beta re-read from cache each row rather than held: the kernel is at its 64
        // registers, and holding it spilled
        float yv[VEC];
        load_vec_cached<T, VEC>(beta + col[k], yv);
#pragma unroll
        for (int e = 0; e < VEC; ++e) yv[e] = xa[k][e] * c.rs * gm[k][e] + yv[e];  // as RmsFwd::y
        store_vec<T, VEC>(yout + r * sb.W + col[k], yv);
      }
    }
  }
  write_partials<VEC, NV>(ag, ab, col, ok, partial, sb.p, sb.W, 1, 0, 0, sb.W, sb.W, nullptr);
#endif
}

template <typename T, int NV, bool RC, bool YOUT = false>
__global__ void __launch_bounds__(max_threads_for(NV * kVec16<T>, false))
bwd_rows_tma(const T* __restrict__ x, const T* __restrict__ gamma, const float* __restrict__ rstd,
             const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ partial, RowPlan pl,
             const T* __restrict__ dres, T* __restrict__ yout, const T* __restrict__ beta) {
  // RC: rstd recomputed from x (pl.eps); a template flag: registers. YOUT: y written too.
  bwd_rows_tma_body<T, NV, RmsBwd<RC ? 1 : 0>, YOUT>(x, gamma, dy, dx, partial, pl,
                                                      RmsBwd<RC ? 1 : 0>{rstd, nullptr, pl.eps, RC}, dres, yout, beta);
}

// Forward of the staged path, over a maths policy (see fwd_rows_body: op.row reduces the
// row and stores its statistics, op.y gives an output element): thread 0 keeps pl.stages
// rows of x in flight; a stage is refilled once the row's reductions (their barriers) are
// past, i.e. every thread has its columns of the row in registers.
template <typename T, int NV, typename Op>
__device__ __forceinline__ void fwd_rows_tma_body(const T* __restrict__ x, const T* __restrict__ gamma,
                                                  const T* __restrict__ beta, T* __restrict__ y, const RowPlan& pl,
                                                  const Op& op) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  constexpr int VEC = kVec16<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const StagedBlock sb(smem_raw, pl, int64_t(sizeof(T)));

  int64_t col[NV];
  bool ok[NV];
  float gm[NV][VEC], bt[NV][VEC];
  row_columns<T, VEC, NV, true>(0, sb.W, sb.t, sb.tpr, gamma, col, ok, gm, beta, bt);
  sb.init_barriers();
  auto issue = [&](int64_t i) {
    const int q = int(i % sb.S);
    mbar_arrive_expect_tx(&sb.bar[q], sb.row_bytes);
    bulk_load(sb.stages + size_t(q) * sb.row_bytes, x + (sb.r0 + i) * sb.W, sb.row_bytes, &sb.bar[q]);
  };
  if (sb.t == 0)
    for (int64_t i = 0; i < sb.n && i < sb.S; ++i) issue(i);

  for (int64_t i = 0; i < sb.n; ++i) {
    const int q = int(i % sb.S);
    const int64_t r = sb.r0 + i;
    mbar_wait(&sb.bar[q], uint32_t((i / sb.S) & 1));
    const T* xs = reinterpret_cast<const T*>(sb.stages + size_t(q) * sb.row_bytes);
    float xa[NV][VEC];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (ok[k]) {
        load_vec_smem<T, VEC>(xs + col[k], xa[k]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) xa[k][e] = 0.f;
      }
    }
    const auto st = op.row(xa, ok, sb.W, sb.tpr, sb.red, i, true, sb.t, r);  // barrier: stage q is read
    if (sb.t == 0 && i + sb.S < sb.n) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(i + sb.S);
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!ok[k]) continue;
      float o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] = op.y(st, xa[k][e], gm[k][e], bt[k][e]);
      store_vec<T, VEC>(y + r * sb.W + col[k], o);
    }
  }
#endif
}

template <typename T, int NV>
__global__ void __launch_bounds__(max_threads_for(NV * kVec16<T>, false))
fwd_rows_tma(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
             T* __restrict__ y, float* __restrict__ rstd, float eps, RowPlan pl) {
  fwd_rows_tma_body<T, NV>(x, gamma, beta, y, pl, RmsFwd{rstd, eps});
}

// ---- plans and launches --------------------------------------------------------------------
struct Tuning {
  int nv = 0;        // 0: default
  int prefetch = -1; // -1: default
  int tma = -1;      // -1: default (rows >= kTmaMinRowBytes), 0: off, 1: wherever possible
  int stages = 0;    // 0: default
};

// Shared-memory budget per block of the staged path: two blocks fit on one SM.
constexpr int64_t kTmaBudget = 110 * 1024;

using rw::ceil_div;
using rw::pow2_ceil;

// Column layout of a plan (everything but `parts`).
template <typename T>
RowPlan column_plan(int64_t rows, int64_t W, bool aligned, Tuning tu) {
  RowPlan pl;
  pl.rows = rows;
  pl.width = W;
  constexpr int v16 = kVec16<T>;
  pl.vec = (aligned && W % v16 == 0) ? v16 : 1;
  const int64_t nvec = W / pl.vec;
  int nv = pl.vec == 1 ? 4 : std::max(1, 8 / pl.vec);
#ifdef RLX_RMS_ALL_VARIANTS
  if (pl.vec != 1 && tu.nv > 0) nv = std::min(tu.nv, std::max(1, 16 / pl.vec));
#endif
  pl.nv = nv;
  // Prefetch by default for f32 only: for 16-bit types it costs occupancy and was slower
  // at every width measured (bf16 131072x1024: 1.85x the copy floor against 1.15x staged).
  pl.prefetch = pl.vec != 1 && (tu.prefetch < 0 ? sizeof(T) == 4 : tu.prefetch != 0);
  int64_t need = ceil_div(nvec, nv);
  // Prefetching halves the block size the registers allow; rows that would then need
  // the slabbed path are done without it.
  if (pl.prefetch && need > max_threads_for(nv * pl.vec, true)) pl.prefetch = false;
  const int tmax = max_threads_for(nv * pl.vec, pl.prefetch);
  pl.slabs = 1;
  if (need > tmax) {
    pl.slabs = ceil_div(need, tmax);
    need = ceil_div(need, pl.slabs);
  }
  if (need <= 32) {
    pl.tpr = pow2_ceil(need);
    pl.threads = 256;
  } else {
    pl.tpr = int(ceil_div(need, 32) * 32);
    pl.threads = pl.tpr;
  }
  pl.slab_cols = pl.slabs == 1 ? W : int64_t(pl.tpr) * nv * pl.vec;
  return pl;
}

inline size_t smem_bytes(const RowPlan& pl) {
  if (pl.stages > 0) return size_t(rw::kStagedHeader) + size_t(pl.stages) * size_t(pl.stage_bytes);
  size_t n = kSmemRed;
  if (pl.threads / pl.tpr > 1) n += 2 * size_t(pl.slab_cols);
  return n * sizeof(float);
}

// Calls f(integral_constant VEC, integral_constant NV, bool_constant PF) for the
// instantiated variant matching the plan; returns false if none.
template <typename T, typename F>
bool with_variant(const RowPlan& pl, F&& f) {
  using std::bool_constant;
  using std::integral_constant;
  constexpr int v16 = kVec16<T>;
  if (pl.vec == 1) {
    f(integral_constant<int, 1>{}, integral_constant<int, 4>{}, bool_constant<false>{});
    return true;
  }
  if (pl.vec != v16) return false;
  auto go = [&](auto nv) {
    if constexpr (decltype(nv)::value * v16 > 16) return;  // not instantiated: too many registers
    else if (pl.prefetch) f(integral_constant<int, v16>{}, nv, bool_constant<true>{});
    else f(integral_constant<int, v16>{}, nv, bool_constant<false>{});
  };
#ifdef RLX_RMS_ALL_VARIANTS
  // every vectors-per-thread count (the timing harness's sweeps)
  switch (pl.nv) {
    case 1: go(integral_constant<int, 1>{}); return true;
    case 2: go(integral_constant<int, 2>{}); return true;
    case 4:
      if (4 * v16 > 16) return false;
      go(integral_constant<int, 4>{});
      return true;
    default: return false;
  }
#else
  // the module instantiates the default only (8 elements a thread: f32 2 vectors, 16-bit 1)
  constexpr int kDefaultNv = 8 / v16 > 1 ? 8 / v16 : 1;
  if (pl.nv != kDefaultNv) return false;
  go(integral_constant<int, kDefaultNv>{});
  return true;
#endif
}

// Sets pl.parts: resident blocks (a persistent grid), at most max_parts and rows.
template <typename Kernel>
cudaError_t set_parts(RowPlan& pl, Kernel kernel, int64_t max_parts) {
  DeviceInfo dev;
  cudaError_t e = device_info(&dev);
  if (e != cudaSuccess) return e;
  int per_sm = 1;
  e = blocks_per_sm(dev.device, kernel, pl.threads, smem_bytes(pl), &per_sm);
  if (e != cudaSuccess) return e;
  const int64_t resident = int64_t(per_sm) * dev.sms;
  int64_t parts = std::max<int64_t>(1, resident / pl.slabs);
  parts = std::min({parts, max_parts, pl.rows});
  pl.parts = std::max<int64_t>(parts, 1);
  return cudaSuccess;
}

// Whether the staged (bulk copy) path applies: sm_90+, one pass, 16-byte vectors, one row
// group per block; sets stages and stage_bytes, and raises the kernel's shared-memory limit.
// By default only rows of at least kTmaMinRowBytes take it (measured on an H200 at 2, 4,
// 8, 16 and 32 KB rows: bf16 gains 10-20% from 2 KB up, f32 gains 1% at 2 KB, ties at
// 4 KB and gains 4-10% from 8 KB; shorter rows were not measured).
constexpr int64_t kTmaMinRowBytes = 2048;

template <typename Kernel>
bool plan_staged(RowPlan& pl, Kernel kernel, int64_t row_bytes, int64_t bytes_per_row_stage, int default_stages,
                 Tuning tu) {
  if (tu.tma == 0 || pl.slabs != 1 || pl.vec == 1 || pl.tpr <= 32 || pl.threads != pl.tpr) return false;
  if (tu.tma < 0 && row_bytes < kTmaMinRowBytes) return false;
  DeviceInfo dev;
  int major = 0;
  if (device_info(&dev) != cudaSuccess || device_cc_major(dev.device, &major) != cudaSuccess || major < 9)
    return false;
  size_t max_smem = 0;
  if (allow_max_smem(dev.device, kernel, &max_smem) != cudaSuccess) return false;
  int stages = tu.stages > 0 ? tu.stages
                             : int(std::min<int64_t>(default_stages, (kTmaBudget - rw::kStagedHeader) / bytes_per_row_stage));
  stages = std::max(2, std::min(stages, 8));
  while (stages > 1 && size_t(rw::kStagedHeader) + size_t(stages) * size_t(bytes_per_row_stage) > max_smem) --stages;
  if (stages < 2) return false;
  pl.stages = stages;
  pl.stage_bytes = bytes_per_row_stage;
  return true;
}

inline int stats_grid(int64_t rows) {
  DeviceInfo dev;
  if (device_info(&dev) != cudaSuccess) dev.sms = 132;
  return int(std::min<int64_t>(rows, int64_t(dev.sms) * 4));
}

// Forward over rows x W. rows > 0 and W > 0.
template <typename T>
ffi::Error launch_fwd(cudaStream_t stream, const T* x, const T* gamma, const T* beta, T* y,
                      float* rstd, float eps, int64_t rows, int64_t W, Tuning tu = {},
                      RowPlan* plan_out = nullptr) {
  const bool aligned = aligned16(x) && aligned16(gamma) && aligned16(beta) && aligned16(y);
  RowPlan pl = column_plan<T>(rows, W, aligned, tu);
  cudaError_t err = cudaSuccess;
  bool ok = with_variant<T>(pl, [&](auto vec, auto nv, auto pf) {
    constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
    constexpr bool PF = decltype(pf)::value;
    if constexpr (VEC != 1) {
      auto staged = fwd_rows_tma<T, NV>;
      if (plan_staged(pl, staged, W * int64_t(sizeof(T)), W * int64_t(sizeof(T)), 3, tu)) {
        err = set_parts(pl, staged, rows);
        if (err != cudaSuccess) return;
        staged<<<unsigned(pl.parts), pl.threads, smem_bytes(pl), stream>>>(x, gamma, beta, y, rstd, eps, pl);
        return;
      }
    }
    auto kernel = fwd_rows<T, VEC, NV, PF>;
    err = set_parts(pl, kernel, rows);
    if (err != cudaSuccess) return;
    if (pl.slabs > 1)
      row_stats<T, VEC, false><<<stats_grid(rows), 512, 0, stream>>>(x, nullptr, nullptr, rstd, eps, rows, W);
    kernel<<<unsigned(pl.parts * pl.slabs), pl.threads, smem_bytes(pl), stream>>>(x, gamma, beta, y, rstd,
                                                                                eps, pl);
  });
  if (!ok) return ffi::Error::Internal("rms_norm (cuda): no kernel variant for this plan");
  if (err != cudaSuccess) return cuda_error("rms_norm forward (cuda) setup", err);
  if (plan_out) *plan_out = pl;
  return check_launch("rms_norm forward (cuda) launch");
}

// Scratch layout of the backward: partial [max_parts][2][W] f32, then dot [rows] f32,
// then (recomputing rstd) rstd [rows] f32.
inline int64_t bwd_scratch_tail(int64_t rows, bool recompute) { return recompute ? 2 * rows : rows; }
inline int64_t bwd_max_parts(int64_t scratch_len, int64_t rows, int64_t W, bool recompute = false) {
  return W > 0 ? (scratch_len - bwd_scratch_tail(rows, recompute)) / (2 * W) : 0;
}

// Backward over rows x W (rows >= 0, W > 0); scratch holds scratch_len f32 with
// scratch_len >= tail + 2 W (tail: bwd_scratch_tail). recompute_eps >= 0: rstd is
// recomputed from x (the rstd argument is not read and may be null). dres (optional, shaped
// like x): a gradient added to dx (the residual stream's, in add_rms_norm's backward).
// yout (optional, shaped like x; needs recompute_eps >= 0 and beta): the forward's y as
// well, written by the staged kernel from the rows it holds; where the plan is not staged,
// the forward kernels run after the backward (their rstd in the scratch's tail).
template <typename T>
ffi::Error launch_bwd(cudaStream_t stream, const T* x, const T* gamma, const float* rstd, const T* dy,
                      T* dx, T* dgamma, T* dbeta, float* scratch, int64_t scratch_len, int64_t rows,
                      int64_t W, Tuning tu = {}, RowPlan* plan_out = nullptr, float recompute_eps = -1.f,
                      const T* dres = nullptr, T* yout = nullptr, const T* beta = nullptr) {
  const bool recompute = recompute_eps >= 0.f;
  if (yout != nullptr && (!recompute || beta == nullptr))
    return ffi::Error::Internal("rms_norm backward (cuda): y output needs rstd recomputed and beta");
  bool y_written = false;
  const int64_t max_parts = bwd_max_parts(scratch_len, rows, W, recompute);
  float* partial = scratch;
  float* dot = scratch + max_parts * 2 * W;
  float* rstd_tmp = dot + rows;
  int64_t parts = 0;
  if (rows > 0) {
    const bool aligned = aligned16(x) && aligned16(gamma) && aligned16(dy) && aligned16(dx) &&
                         aligned16(scratch) && (dres == nullptr || aligned16(dres)) &&
                         (yout == nullptr || (aligned16(yout) && aligned16(beta)));
    RowPlan pl = column_plan<T>(rows, W, aligned, tu);
    pl.eps = recompute_eps;
    cudaError_t err = cudaSuccess;
    bool ok = with_variant<T>(pl, [&](auto vec, auto nv, auto pf) {
      constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
      constexpr bool PF = decltype(pf)::value;
      if constexpr (VEC != 1) {
        auto staged = yout ? bwd_rows_tma<T, NV, true, true>
                           : recompute ? bwd_rows_tma<T, NV, true> : bwd_rows_tma<T, NV, false>;
        if (plan_staged(pl, staged, W * int64_t(sizeof(T)), 2 * W * int64_t(sizeof(T)), 2, tu)) {
          err = set_parts(pl, staged, max_parts);
          if (err != cudaSuccess) return;
          staged<<<unsigned(pl.parts), pl.threads, smem_bytes(pl), stream>>>(x, gamma, rstd, dy, dx, partial, pl,
                                                                             dres, yout, beta);
          y_written = yout != nullptr;
          return;
        }
      }
      auto kernel = bwd_rows<T, VEC, NV, PF>;
      err = set_parts(pl, kernel, max_parts);
      if (err != cudaSuccess) return;
      const float* rstd_used = rstd;
      if (pl.slabs > 1) {
        row_stats<T, VEC, true><<<stats_grid(rows), 512, 0, stream>>>(x, dy, gamma, dot, 0.f, rows, W);
        if (recompute) {
          row_stats<T, VEC, false><<<stats_grid(rows), 512, 0, stream>>>(x, nullptr, nullptr, rstd_tmp,
                                                                          recompute_eps, rows, W);
          rstd_used = rstd_tmp;
        }
      }
      kernel<<<unsigned(pl.parts * pl.slabs), pl.threads, smem_bytes(pl), stream>>>(
          x, gamma, rstd_used, dy, dx, partial, dot, pl, dres);
    });
    if (!ok) return ffi::Error::Internal("rms_norm backward (cuda): no kernel variant for this plan");
    if (err != cudaSuccess) return cuda_error("rms_norm backward (cuda) setup", err);
    parts = pl.parts;
    if (plan_out) *plan_out = pl;
  }
  reduce_partials<T><<<unsigned(ceil_div(2 * W, 32)), 256, 0, stream>>>(partial, parts, W, dgamma, dbeta);
  if (yout != nullptr && !y_written && rows > 0) {
    if (auto e = check_launch("rms_norm backward (cuda) launch"); e.failure()) return e;
    return launch_fwd<T>(stream, x, gamma, beta, yout, rstd_tmp, recompute_eps, rows, W);
  }
  return check_launch("rms_norm backward (cuda) launch");
}

}  // namespace rms
}  // namespace cuda
}  // namespace rlx
