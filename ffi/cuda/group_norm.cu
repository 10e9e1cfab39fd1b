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
//             sum_n rstd[n,g] B[n,c], dbeta_c = sum_n A[n,c] (a fixed order over n); gn_dx,
//             elementwise -> dx.
//   scratch [S] f32, S >= 2 N C + 2 N G (sized by rlx_jax/vjp_rules/group_norm.py).
// Single-pass path (sm_90, the default where it applies): one thread-block CLUSTER of cs
// CTAs per block (n, g). The block's M values are cut into K * P segments (P segments per
// channel, each a contiguous run of one channel, so its gamma / beta are one value) and CTA
// `rank` of the cluster owns spc = K P / cs consecutive segments. It copies its segments of
// x (and dy) into shared memory ONCE (cp.async.bulk on one mbarrier), reduces them, and the
// CTAs exchange their partial sums through distributed shared memory; then each CTA writes its
// y / dx slice from shared memory. The exchange (gn_cluster_x): every CTA pushes its sums into
// every CTA's shared memory (st.async completing on the receiver's mbarrier) and each CTA adds
// the cs slots in rank order (the same bits everywhere; no atomics), with no cluster barrier or
// release fence on the way; the forward exchanges once (sum, M2 about the CTA's own mean,
// count: Chan's merge). A kernel that exchanged through cluster.sync and remote reads (two
// exchanges in the forward) measured 1.05-1.31x slower on an H200 at 32x512x64x64 G32. Bytes: x read once, y written (forward: the centred variance
// is a second pass over shared memory, not over HBM); x, dy read once, dx written (backward).
// Backward dx = dy da + (x - mu) db + dc with per-segment constants (3 operations an element; the
// unfactored formula, 7, was 1.06x slower for bf16). Backward per-channel sums A, B: the CTA
// holding a channel's first segment adds the channel's segment sums in segment order (pushed to it) and writes A[n,c], B[n,c] to the
// scratch; gn_param_grads then reduces over n as in the two-pass path.
// Size limit: a CTA's slice (spc segments of x, and of dy in the backward) must fit the
// per-CTA shared-memory budget (kClBudget, 32 KB: measured on an H200 faster than 64 KB for
// bf16 and level for f32) with cs <= 16 CTAs per cluster, i.e.
// M * sizeof(T) * (1 forward, 2 backward) <= 16 * budget (512 KiB: f32 groups
// up to 64 Ki values in the backward, 128 Ki in the forward); the spatial size S must be a
// multiple of 16 bytes (bulk copies), at most 16 segments per CTA, and the device must be
// able to schedule the cluster (cudaOccupancyMaxActiveClusters > 0). Anything else takes
// the two-pass path below.
// Measured and not taken (H200):
// a pipelined variant (persistent clusters looping over blocks, two shared-memory stages,
// the next block's copies in flight during the exchange and writes; one exchange in the
// forward) was 3-5% slower for f32/bf16 backward and f32 forward and 19% slower for the
// bf16 forward: 3 CTAs an SM instead of 5-6, and the cluster barrier's release fence still
// waits for the previous block's stores (membar stalls as before).
// Two-pass path: the forward reads x twice and writes y (1.5x the one-pass minimum); the
// backward reads x and dy twice and writes dx (5/3x): the block statistics are needed
// before any element of the block can be written, and such a block is too large to keep on
// chip.
#include <cooperative_groups.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/rms_norm_kernels.cuh"
#include "cuda/rowwise_common.cuh"
#include "group_norm_checks.h"

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

// dgamma_c = sum_n rstd[n, c / K] * B[n, c], dbeta_c = sum_n A[n, c]. A block takes 32
// channels (lane = channel: coalesced loads), warp w adds n = w, w + 8, ..., then the 8
// warp sums are added in warp order (fixed order: deterministic). (One thread a channel
// adding its N strided values in turn took 12 us at N 32, C 512 on an H200, latency-bound;
// this takes 2.7 us, ncu.)
template <typename T>
__global__ void __launch_bounds__(256)
gn_param_grads(const float* __restrict__ A, const float* __restrict__ B, const float* __restrict__ rstd,
               T* __restrict__ dgamma, T* __restrict__ dbeta, int64_t N, int64_t C, int64_t G, int64_t K) {
  __shared__ float buf[2][8][33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = int64_t(blockIdx.x) * 32 + lane;
  float dg = 0.f, db = 0.f;
  if (c < C) {
    const int64_t g = c / K;
#pragma unroll 4
    for (int64_t n = warp; n < N; n += 8) {
      dg += rstd[n * G + g] * B[n * C + c];
      db += A[n * C + c];
    }
  }
  buf[0][warp][lane] = dg;
  buf[1][warp][lane] = db;
  __syncthreads();
  if (warp == 0 && c < C) {
    float sg = 0.f, sb = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      sg += buf[0][w][lane];
      sb += buf[1][w][lane];
    }
    dgamma[c] = from_f32<T>(sg);
    dbeta[c] = from_f32<T>(sb);
  }
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

using group_norm::Layout;

unsigned flat_grid(int64_t n_vec, int sms) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n_vec, 256), int64_t(sms) * 8 * 4)));
}

template <typename T, typename F>
void with_vec(bool vector_ok, F&& f) {
  if (vector_ok) f(std::integral_constant<int, kVec16<T>>{});
  else f(std::integral_constant<int, 1>{});
}


// ---- single-pass path: plan and segments -------------------------------------------------------
constexpr int kClThreads = 256;
constexpr int kClMaxSegs = 16;      // segments per CTA at most
constexpr int kClMaxCluster = 16;   // non-portable above 8

struct ClPlan {
  int64_t S, K, M, G;
  int64_t seg;  // elements per segment (a multiple of the 16-byte vector); a channel's last may be shorter
  int cs;       // CTAs per cluster
  int P;        // segments per channel
  int spc;      // segments per CTA
};

// Segment s (local) of CTA `rank`: offset in the block, length, channel index k in the group.
struct Seg {
  int64_t off, len;
  int64_t k;
};
__device__ __forceinline__ Seg cl_seg(const ClPlan& p, int rank, int s) {
  const int64_t j = int64_t(rank) * p.spc + s;
  const int64_t k = j / p.P, q = j - k * p.P;
  const int64_t st = q * p.seg;
  const int64_t len = st < p.S ? (p.S - st < p.seg ? p.S - st : p.seg) : 0;
  return {k * p.S + st, len, k};
}

// f(v) for each of this thread's 16-byte vectors v (as f32) of the CTA's segments of one
// tensor's slice xs in shared memory (segment s at xs + s * seg).
template <typename T, typename F>
__device__ __forceinline__ void cta_vecs(const ClPlan& p, int rank, const T* xs, F&& f) {
  constexpr int VEC = kVec16<T>;
  for (int s = 0; s < p.spc; ++s) {
    const Seg sg = cl_seg(p, rank, s);
    const T* xv = xs + int64_t(s) * p.seg;
    for (int64_t v = int64_t(threadIdx.x) * VEC; v < sg.len; v += int64_t(kClThreads) * VEC) {
      float xe[VEC];
      load_vec_smem<T, VEC>(xv + v, xe);
      f(xe);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

// ---- single-pass path: one cluster per block (n, g), exchange by pushes ------------------------
// No cluster barrier on the critical path and no release fence: each CTA PUSHES its partial sums into every CTA's shared memory with
// st.async, which completes transaction bytes on the receiver's exchange mbarrier; every
// thread waits on its own CTA's mbarrier (acquire, cluster scope) and adds the cs slots in
// rank order (the same bits in every CTA: deterministic). Nobody reads another CTA's shared
// memory, so no CTA waits for the others before it exits; a CTA leaves only after every push
// addressed to it has landed (its mbarrier counts them). The one cluster barrier makes the
// exchange mbarriers' initialisation visible before any push: arrive.relaxed right after the
// initialisation (fence.mbarrier_init), wait just before the first push, i.e. after the bulk
// copies, by when every CTA of the cluster has long arrived.
// Backward: the per-segment sums (a, b) go through one warp-sum slot per (segment, warp) and
// one block barrier (not one per segment); warp 0 then forms the CTA's
// gamma-weighted share (a fixed xor tree over the segments) and pushes it. Channels split
// over CTAs (P > 1): the segment sums go to the CTA holding the channel's first segment,
// which adds them in segment order and writes A, B (P == 1: written at once).
// Forward: ONE exchange: a CTA pushes its sum, centred M2 about its own
// mean and count; M2 = sum_q M2_q + n_q (mean_q - mean)^2 (Chan et al.), q in rank order.
constexpr int kXHeader = 2048;

struct XHeader {
  uint64_t bar;                 // bulk copies
  uint64_t xbar;                // exchange: the pushes addressed to this CTA
  float4 slot[kClMaxCluster];   // from CTA q (bwd: gamma-weighted sums; fwd: sum, M2, count)
  float2 seg[2 * kClMaxSegs];   // bwd, P > 1: segment sums of the channels starting here
  float gm[kClMaxSegs];         // gamma (and beta) of each segment's channel
  float bt[kClMaxSegs];
  float cnt;                    // fwd: this CTA's element count
  union {
    float2 wred[kClMaxSegs][kClThreads / 32];  // bwd: warp sums per segment
    float red[128];                            // fwd: group_sum slots
  };
};
static_assert(sizeof(XHeader) <= kXHeader, "exchange header too large");

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
// Shared::cluster address of `p` (this CTA's shared memory) in CTA `rank`.
__device__ __forceinline__ uint32_t mapa_rank(const void* p, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
  return r;
}
// 8 / 16 bytes into another CTA's shared memory, completing as transactions on its mbarrier.
__device__ __forceinline__ void st_async2(uint32_t dst, float a, float b, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(dst),
               "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void st_async4(uint32_t dst, float a, float b, float c, float d, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   dst),
               "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(__float_as_uint(c)), "r"(__float_as_uint(d)),
               "r"(bar)
               : "memory");
}
// mbar_wait with acquire at cluster scope (the data came from other CTAs' st.async).
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
#endif

// CTAs an SM: 6 (shared memory allows 6 of 34 KB at the 32 KB budget). The f32 backward needs
// 48 registers on its own (5 CTAs an SM); held to 40 for 6 it was 1-4 % faster in all 5 rounds of
// an A/B (ncu 189 vs 198 us, 86 % DRAM). The others take 39-40 registers.
constexpr int kXMinBlocks = 6;

template <typename T, bool BWD>
__global__ void __launch_bounds__(kClThreads, kXMinBlocks)
gn_cluster_x(const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ gamma,
             const T* __restrict__ beta, const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
             T* __restrict__ out, float* __restrict__ mean_out, float* __restrict__ rstd_out, float* __restrict__ A,
             float* __restrict__ B, float eps, ClPlan p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  namespace cg = cooperative_groups;
  constexpr int VEC = kVec16<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  XHeader* h = reinterpret_cast<XHeader*>(smem_raw);
  T* xs = reinterpret_cast<T*>(smem_raw + kXHeader);
  T* ds = xs + int64_t(p.spc) * p.seg;
  const int rank = int(cg::this_cluster().block_rank());
  const int64_t blk = blockIdx.x / p.cs;  // n * G + g
  const int64_t base = blk * p.M;
  const int64_t c0 = (blk % p.G) * p.K;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  if (tid == 0) {
    mbar_init(&h->bar, 1);
    mbar_init(&h->xbar, 1);
    mbar_init_fence();
  }
  __syncthreads();
  cluster_arrive_relaxed();  // this CTA's xbar is initialised (waited for before the first push)
  if (tid == 0) {
    uint32_t bytes = 0;
    for (int s = 0; s < p.spc; ++s) bytes += uint32_t(cl_seg(p, rank, s).len * int64_t(sizeof(T)));
    h->cnt = float(bytes / uint32_t(sizeof(T)));
    mbar_arrive_expect_tx(&h->bar, bytes * (BWD ? 2u : 1u));
    for (int s = 0; s < p.spc; ++s) {
      const Seg sg = cl_seg(p, rank, s);
      if (sg.len == 0) continue;
      const uint32_t nb = uint32_t(sg.len * int64_t(sizeof(T)));
      bulk_load(xs + int64_t(s) * p.seg, x + base + sg.off, nb, &h->bar);
      if constexpr (BWD) bulk_load(ds + int64_t(s) * p.seg, dy + base + sg.off, nb, &h->bar);
    }
  }
  if (tid >= 32 && tid < 32 + p.spc) {  // read after the block barrier below
    const int s = tid - 32;
    const int64_t c = c0 + cl_seg(p, rank, s).k;
    h->gm[s] = to_f32(gamma[c]);
    if constexpr (!BWD) h->bt[s] = to_f32(beta[c]);
  }
  float mu = 0.f, rs = 0.f;
  if constexpr (BWD) {
    mu = mean_in[blk];
    rs = rstd_in[blk];
  }
  mbar_wait(&h->bar, 0);

  if constexpr (BWD) {
    for (int s = 0; s < p.spc; ++s) {
      const Seg sg = cl_seg(p, rank, s);
      const T* xv = xs + int64_t(s) * p.seg;
      const T* dv = ds + int64_t(s) * p.seg;
      float a = 0.f, b = 0.f;
      for (int64_t v = int64_t(tid) * VEC; v < sg.len; v += int64_t(kClThreads) * VEC) {
        float xe[VEC], de[VEC];
        load_vec_smem<T, VEC>(xv + v, xe);
        load_vec_smem<T, VEC>(dv + v, de);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          a += de[i];
          b += de[i] * (xe[i] - mu);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
      }
      if (lane == 0) h->wred[s][warp] = make_float2(a, b);
    }
    __syncthreads();
    cluster_wait_acquire();  // every CTA's xbar initialised (all arrived at the start)
    if (warp == 0) {
      float pa = 0.f, pb = 0.f;  // segment `lane`'s sums, warps in order
      if (lane < p.spc) {
#pragma unroll
        for (int w = 0; w < kClThreads / 32; ++w) {
          const float2 v = h->wred[lane][w];
          pa += v.x;
          pb += v.y;
        }
      }
      float lu = lane < p.spc ? h->gm[lane] * pa : 0.f, lb = lane < p.spc ? h->gm[lane] * pb : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {  // fixed xor tree: the same bits in every lane
        lu += __shfl_xor_sync(0xffffffffu, lu, o);
        lb += __shfl_xor_sync(0xffffffffu, lb, o);
      }
      // lane 0, which arrives on xbar below, writes this CTA's own slot (every lane has the sums)
      if (lane == 0) h->slot[rank] = make_float4(lu, lb, 0.f, 0.f);
      if (lane < p.cs && lane != rank) st_async2(mapa_rank(&h->slot[rank], lane), lu, lb, mapa_rank(&h->xbar, lane));
      uint32_t extra = 0;  // bytes of segment sums pushed to this CTA by later CTAs
      if (lane < p.spc) {
        const int j = rank * p.spc + lane;
        if (p.P == 1) {
          const int64_t row = blk * p.K + j;  // n * C + c
          A[row] = pa;
          B[row] = pb;
        } else {
          const int first = j - j % p.P, owner = first / p.spc, idx = j - owner * p.spc;
          if (owner == rank) h->seg[idx] = make_float2(pa, pb);
          else st_async2(mapa_rank(&h->seg[idx], owner), pa, pb, mapa_rank(&h->xbar, owner));
          if (j == first) {  // this channel's segments held by later CTAs push to here
            const int rem = first + p.P - (rank + 1) * p.spc;
            if (rem > 0) extra = uint32_t(rem) * 8u;
          }
        }
      }
      const uint32_t expect = uint32_t(p.cs - 1) * 8u + __reduce_add_sync(0xffffffffu, extra);
      __syncwarp();
      if (lane == 0) mbar_arrive_expect_tx(&h->xbar, expect);
    }
    mbar_wait_cluster(&h->xbar, 0);
    float su = 0.f, sb = 0.f;
    for (int q = 0; q < p.cs; ++q) {  // rank order: the same bits in every CTA
      const float2 v = *reinterpret_cast<const float2*>(&h->slot[q]);
      su += v.x;
      sb += v.y;
    }
    const float ca = su / float(p.M), cb = rs * sb / float(p.M);
    if (p.P > 1 && warp == 0 && lane < p.spc) {
      const int j = rank * p.spc + lane;
      if (j % p.P == 0) {
        float sa = 0.f, sbb = 0.f;
        for (int i = 0; i < p.P; ++i) {
          const float2 v = h->seg[lane + i];
          sa += v.x;
          sbb += v.y;
        }
        const int64_t row = blk * p.K + j / p.P;
        A[row] = sa;
        B[row] = sbb;
      }
    }
    for (int s = 0; s < p.spc; ++s) {
      const Seg sg = cl_seg(p, rank, s);
      const float gm = h->gm[s];
      // dx = rs (dy gm - ca - (x - mu) rs cb) = dy da + (x - mu) db + dc with the segment's
      // constants da = rs gm, db = -rs^2 cb, dc = -rs ca: one subtraction and two FMAs an
      // element (the 16-bit kernels issue about as many instructions as they move bytes)
      const float da = rs * gm, db = -rs * rs * cb, dc = -rs * ca;
      const T* xv = xs + int64_t(s) * p.seg;
      const T* dv = ds + int64_t(s) * p.seg;
      T* o = out + base + sg.off;
#pragma unroll 1
      for (int64_t v = int64_t(tid) * VEC; v < sg.len; v += int64_t(kClThreads) * VEC) {
        float xe[VEC], de[VEC], r[VEC];
        load_vec_smem<T, VEC>(xv + v, xe);
        load_vec_smem<T, VEC>(dv + v, de);
#pragma unroll
        for (int i = 0; i < VEC; ++i) r[i] = fmaf(de[i], da, fmaf(xe[i] - mu, db, dc));
        store_vec<T, VEC>(o + v, r);
      }
    }
  } else {
    float a = 0.f;
    cta_vecs(p, rank, xs, [&](const float (&xe)[VEC]) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) a += xe[i];
    });
    a = group_sum(a, kClThreads, h->red, 0);
    const float nq = h->cnt;  // written before the barrier in group_sum
    const float mq = nq > 0.f ? a / nq : 0.f;
    float b = 0.f;
    cta_vecs(p, rank, xs, [&](const float (&xe)[VEC]) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = xe[i] - mq;
        b += d * d;
      }
    });
    b = group_sum(b, kClThreads, h->red, 1);
    cluster_wait_acquire();
    if (warp == 0) {
      if (lane == 0) h->slot[rank] = make_float4(a, b, nq, 0.f);  // own slot: lane 0 arrives below
      if (lane < p.cs && lane != rank)
        st_async4(mapa_rank(&h->slot[rank], lane), a, b, nq, 0.f, mapa_rank(&h->xbar, lane));
      __syncwarp();
      if (lane == 0) mbar_arrive_expect_tx(&h->xbar, uint32_t(p.cs - 1) * 16u);
    }
    mbar_wait_cluster(&h->xbar, 0);
    float tot = 0.f;
    for (int q = 0; q < p.cs; ++q) tot += h->slot[q].x;
    mu = tot / float(p.M);
    float m2 = 0.f;
    for (int q = 0; q < p.cs; ++q) {
      const float4 v = h->slot[q];
      const float d = v.z > 0.f ? v.x / v.z - mu : 0.f;
      m2 += v.y + v.z * d * d;
    }
    rs = rsqrtf(m2 / float(p.M) + eps);
    if (tid == 0 && rank == 0) {
      mean_out[blk] = mu;
      rstd_out[blk] = rs;
    }
    for (int s = 0; s < p.spc; ++s) {
      const Seg sg = cl_seg(p, rank, s);
      const float ga = h->gm[s] * rs, be = h->bt[s];
      const T* xv = xs + int64_t(s) * p.seg;
      T* o = out + base + sg.off;
      for (int64_t v = int64_t(tid) * VEC; v < sg.len; v += int64_t(kClThreads) * VEC) {
        float xe[VEC], r[VEC];
        load_vec_smem<T, VEC>(xv + v, xe);
#pragma unroll
        for (int i = 0; i < VEC; ++i) r[i] = (xe[i] - mu) * ga + be;
        store_vec<T, VEC>(o + v, r);
      }
    }
  }
#endif
}

// Per-CTA shared-memory budget of the single-pass path in bytes.
constexpr int64_t kClBudget = int64_t(32) << 10;

inline int64_t gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// The smallest cluster (1, 2, 4, 8, 16 CTAs) whose per-CTA slice fits the budget.
inline bool cluster_plan(const Layout& L, int64_t esz, int tensors, ClPlan& p) {
  const int64_t budget = kClBudget;
  const int64_t vec = 16 / esz;
  if (L.s % vec != 0 || L.m == 0) return false;
  for (int cs = 1; cs <= kClMaxCluster; cs *= 2) {
    const int64_t P = cs / gcd64(L.k, cs);
    const int64_t spc = L.k * P / cs;
    if (spc > kClMaxSegs) continue;
    const int64_t seg = rw::ceil_div(rw::ceil_div(L.s, P), vec) * vec;
    const int64_t bytes = int64_t(tensors) * spc * seg * esz;
    if (bytes > budget || bytes + kXHeader > (int64_t(227) << 10)) continue;
    if (L.n * L.groups * cs >= (int64_t(1) << 31)) return false;
    p = ClPlan{L.s, L.k, L.m, L.groups, seg, cs, int(P), int(spc)};
    return true;
  }
  return false;
}

inline size_t cluster_smem(const ClPlan& p, int64_t esz, int tensors) {
  return size_t(kXHeader) + size_t(tensors) * size_t(p.spc) * size_t(p.seg) * size_t(esz);
}

// Launch configuration of a cluster kernel; `ok` false when the device cannot run it
// (pre-sm_90, or no cluster of this size and shared memory can be scheduled), cached per
// (device, kernel, cluster size, shared memory).
template <typename Kernel>
cudaError_t cluster_config(Kernel kernel, int cs, size_t smem, unsigned grid, cudaStream_t stream,
                           cudaLaunchConfig_t& cfg, cudaLaunchAttribute& attr, bool& ok) {
  DeviceInfo dev;
  cudaError_t e = device_info(&dev);
  if (e != cudaSuccess) return e;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(cs);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg = cudaLaunchConfig_t{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kClThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  using Key = std::tuple<int, const void*, int, size_t>;
  static std::mutex mu;
  static std::map<Key, bool> cache;
  const Key key{dev.device, reinterpret_cast<const void*>(kernel), cs, smem};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) {
    ok = it->second;
    return cudaSuccess;
  }
  ok = false;
  int major = 0;
  if ((e = device_cc_major(dev.device, &major)) != cudaSuccess) return e;
  if (major >= 9) {
    size_t max_smem = 0;
    if ((e = allow_max_smem(dev.device, kernel, &max_smem)) != cudaSuccess) return e;
    if (smem <= max_smem) {
      if (cs > 8 && (e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1)) !=
                        cudaSuccess)
        return e;
      int clusters = 0;
      if ((e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg)) != cudaSuccess) return e;
      ok = clusters > 0;
    }
  }
  cache[key] = ok;
  return cudaSuccess;
}

// Runs the single-pass kernel when the layout allows (ran = true), else leaves ran false.
template <typename T, bool BWD>
ffi::Error try_cluster(cudaStream_t stream, const Layout& L, bool aligned, const T* x, const T* dy, const T* gamma,
                       const T* beta, const float* mean_in, const float* rstd_in, T* out, float* mean_out,
                       float* rstd_out, float* A, float* B, float eps, bool& ran) {
  ran = false;
  constexpr int tensors = BWD ? 2 : 1;
  ClPlan p;
  if (!aligned || !cluster_plan(L, int64_t(sizeof(T)), tensors, p)) return ffi::Error::Success();
  auto kernel = gn_cluster_x<T, BWD>;
  const size_t smem = cluster_smem(p, int64_t(sizeof(T)), tensors);
  const unsigned grid = unsigned(L.n * L.groups * p.cs);
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr;
  bool ok = false;
  if (cudaError_t e = cluster_config(kernel, p.cs, smem, grid, stream, cfg, attr, ok); e != cudaSuccess)
    return cuda_error("group_norm (cuda) cluster setup", e);
  if (!ok) return ffi::Error::Success();
  if (cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, x, dy, gamma, beta, mean_in, rstd_in, out, mean_out, rstd_out,
                                         A, B, eps, p);
      e != cudaSuccess)
    return cuda_error("group_norm (cuda) cluster launch", e);
  ran = true;
  return ffi::Error::Success();
}

template <typename T>
ffi::Error launch_fwd(cudaStream_t stream, const Layout& L, const T* x, const T* gamma, const T* beta, T* y,
                      float* mean, float* rstd, float eps) {
  bool ran = false;
  if (auto e = try_cluster<T, false>(stream, L, aligned16(x) && aligned16(y), x, nullptr, gamma, beta, nullptr, nullptr,
                                     y, mean, rstd, nullptr, nullptr, eps, ran);
      e.failure() || ran)
    return e.failure() ? e : check_launch("group_norm forward (cuda) launch");
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
  bool ran = false;
  if (auto e = try_cluster<T, true>(stream, L, aligned16(x) && aligned16(dy) && aligned16(dx), x, dy, gamma, nullptr,
                                    mean, rstd, dx, nullptr, nullptr, A, B, 0.f, ran);
      e.failure())
    return e;
  if (ran) {
    gn_param_grads<T><<<unsigned(ceil_div(L.c, 32)), 256, 0, stream>>>(A, B, rstd, dgamma, dbeta, L.n, L.c,
                                                                       L.groups, L.k);
    return check_launch("group_norm backward (cuda) launch");
  }
  const bool stream_x = 2 * rows * L.s * int64_t(sizeof(T)) > (int64_t(32) << 20);
  with_vec<T>(aligned16(x) && aligned16(dy) && L.s % kVec16<T> == 0, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const Geom gm = row_geom(rows, ceil_div(L.s, VEC), kUnroll, kMaxThreads, sms);
    gn_row_sums<T, VEC, true><<<unsigned(gm.grid), gm.threads, 0, stream>>>(x, dy, mean, A, B, 0.f, rows, L.s, L.k,
                                                                            gm.tpr, stream_x);
  });
  gn_block_coefs<T><<<unsigned(ceil_div(blocks, 256)), 256, 0, stream>>>(gamma, A, B, rstd, ca, cb, blocks, L.groups,
                                                                         L.k, L.m);
  gn_param_grads<T><<<unsigned(ceil_div(L.c, 32)), 256, 0, stream>>>(A, B, rstd, dgamma, dbeta, L.n, L.c, L.groups,
                                                                     L.k);
  with_vec<T>(aligned16(x) && aligned16(dy) && aligned16(dx) && L.s % kVec16<T> == 0, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const int64_t n_vec = rows * L.s / VEC;
    gn_dx<T, VEC><<<flat_grid(n_vec, sms), 256, 0, stream>>>(x, dy, gamma, mean, rstd, ca, cb, dx, n_vec, L.s, L.c,
                                                             L.k);
  });
  return check_launch("group_norm backward (cuda) launch");
}

// Eps: the attribute's type, float (ABI v1) or double (v2, whose f64 eps the CPU's f64 kernels use).
template <typename Eps>
ffi::Error GroupNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, int64_t num_groups, Eps eps_attr) {
  const float eps = float(eps_attr);  // the CUDA kernels take no f64 input: f32 arithmetic
  Layout L;
  if (auto e = group_norm::check_fwd(Backend::kCuda, x, gamma, beta, *y, *mean, *rstd, num_groups, eps, L);
      e.failure())
    return e;
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
  if (auto e = group_norm::check_bwd(Backend::kCuda, x, gamma, mean, rstd, dy, *dx, *dgamma, *dbeta,
                                     num_groups, L);
      e.failure())
    return e;
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
// v1 takes eps as f32, v2 as f64 (the CPU's f64 kernels normalise with the exact eps)
#define RLX_GROUP_NORM_FWD_BINDING(EPS)            \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()    \
      .Arg<ffi::AnyBuffer>() /* x [N, C, ...] */   \
      .Arg<ffi::AnyBuffer>() /* gamma [C] */       \
      .Arg<ffi::AnyBuffer>() /* beta [C] */        \
      .Ret<ffi::AnyBuffer>() /* y */               \
      .Ret<ffi::AnyBuffer>() /* mean [N, G] */     \
      .Ret<ffi::AnyBuffer>() /* rstd [N, G] */     \
      .Attr<int64_t>("num_groups")                 \
      .Attr<EPS>("eps")
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGroupNormFwdCuda, GroupNormFwdImpl<float>, RLX_GROUP_NORM_FWD_BINDING(float),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGroupNormFwdCudaV2, GroupNormFwdImpl<double>, RLX_GROUP_NORM_FWD_BINDING(double),
                              {ffi::Traits::kCmdBufferCompatible});
#undef RLX_GROUP_NORM_FWD_BINDING
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
RLX_CUDA_REGISTER_HANDLER("rlx_group_norm_fwd_v2", RlxGroupNormFwdCudaV2);
RLX_CUDA_REGISTER_HANDLER("rlx_group_norm_bwd", RlxGroupNormBwdCuda);

}  // namespace cuda
}  // namespace rlx
