// Attention on CUDA: shared definitions and the generic (SIMT, f32 arithmetic) kernels.
//
// The generic kernels serve every case the tensor-core path (attention_mma.cuh) does not:
// f32 inputs, head dims other than 64 / 128 (up to kGenMaxD), devices below sm_80. Masks,
// scale, softcap, key mask and bias are runtime parameters (struct AttnArgs), never
// template parameters: instantiations are one per dtype.
//
// Work layout (one warp per row, lanes over keys or queries):
//   fwd:   one warp per query row; keys in chunks of 32 staged in shared memory (f32, odd
//          row stride: conflict-free when a lane reads its own row); lane l scores key
//          chunk+l, then an online softmax; the output row is spread over the lanes
//          (d = lane + 32 t).
//   delta: delta_i = sum_d dout_id out_id - dlse_i (f32 scratch [B, H, Sq]).
//   dq:    one warp per query row, as fwd; recomputes P from lse, writes dq and dbias.
//   dkdv:  one warp per key row (kv head): loops over the heads of its group and the
//          queries in chunks of 32 staged in shared memory; lane l takes query chunk+l.
// Every output element is written by exactly one thread: deterministic, no atomics.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/common.cuh"

namespace rlx {
namespace cuda {
namespace attn {

constexpr int kGenMaxD = 256;           // head dims served by the generic kernels
constexpr int kGenPer = kGenMaxD / 32;  // row elements per lane
constexpr int kGenWarps = 4;            // warps (rows) per block
constexpr int kGenChunk = 32;           // keys (queries) staged per chunk

// Everything a kernel needs about the call, by value.
struct AttnArgs {
  int64_t B, Sq, Sk, H, Hkv, D;
  int64_t group;   // H / Hkv
  int64_t off;     // max(Sk - Sq, 0): bottom-right alignment
  int kind;        // 0 none, 1 causal, 2 sliding
  int64_t window;  // sliding window
  float scale, softcap;  // softcap 0: off
  const float* mask;     // [B, Sk] or null
  // segment ids (attention_segments.cuh), all null without: qseg [B, Sq], kseg [B, Sk] int32;
  // qinfo [B, ceil(Sq / 64)], kinfo [B, ceil(Sk / 64)]: per granule (min id, max id, hull begin, end)
  const int* qseg;
  const int* kseg;
  const int4* qinfo;
  const int4* kinfo;
  // the forward's tile order with segment ids, or null: [B * ceil(Sq / 128)] int32, the (batch,
  // query tile) pairs b * nqt + qt, heaviest first (ws_fwd_tile, attention_wgmma_ws.cuh)
  const int* qorder;
  // attention sinks, or null: [B, H] f32, one logit per (batch, query head) that joins every row's
  // softmax denominator with no value (row_finish)
  const float* sinks;
};

// The end of a query row of the forward: its output scale `inv` (out = acc * inv) and its lse,
// from the online softmax's running max m (natural-log units) and sum l = sum_j exp(s_j - m) over
// the row's visible scores. Without a sink: inv = 1 / l, lse = m + log l; a row that saw no key
// (l = 0) gets inv = 0 and lse = -inf, and a NaN row (l NaN) stays NaN. With sink logit z (`sink`,
// a pointer to it, null without): the denominator is sum_j exp(s_j) + exp(z), taken about
// mm = max(m, z) so that neither exponent overflows:
//   den = l exp(m - mm) + exp(z - mm),  inv = exp(m - mm) / den,  lse = mm + log den;
// a row that saw no key gets inv = 0 and lse = z (the sink alone).
__device__ __forceinline__ void row_finish(float m, float l, const float* sink, float* inv, float* lse) {
  const bool live = !(l <= 0.f);  // NaN rows are live: NaN out and lse, as the CPU kernel
  if (sink == nullptr) {
    *inv = live ? 1.f / l : 0.f;
    *lse = live ? m + logf(l) : -INFINITY;
    return;
  }
  const float z = __ldg(sink);
  if (!live) {
    *inv = 0.f;
    *lse = z;
    return;
  }
  const float mm = fmaxf(m, z), e = expf(m - mm), den = l * e + expf(z - mm);
  *inv = e / den;
  *lse = mm + logf(den);
}

// The row's sink logit (row_finish), or null without sinks.
__device__ __forceinline__ const float* row_sink(const AttnArgs& a, int64_t b, int64_t h) {
  return a.sinks == nullptr ? nullptr : a.sinks + b * a.H + h;
}

// Query i sees key j (j < Sk assumed) under the mask kind.
__device__ __forceinline__ bool kind_visible(const AttnArgs& a, int64_t i, int64_t j) {
  if (a.kind == 0) return true;
  const int64_t pos = i + a.off;
  if (j > pos) return false;
  return a.kind == 1 || j >= pos - a.window;
}

__device__ __forceinline__ bool visible(const AttnArgs& a, int64_t b, int64_t i, int64_t j) {
  if (j >= a.Sk || !kind_visible(a, i, j)) return false;
  return a.mask == nullptr || a.mask[b * a.Sk + j] >= 0.5f;
}

// Score transform: r = scale * dot; softcap c * tanh(r / c); th = tanh(r / c) (0 without).
__device__ __forceinline__ float cap_score(float r, float softcap, float* th) {
  if (softcap > 0.f) {
    const float t = tanhf(r / softcap);
    *th = t;
    return softcap * t;
  }
  *th = 0.f;
  return r;
}

// Maximum that propagates NaN (fmaxf drops it): a NaN score gives a NaN row (out, lse and the
// gradients), as the reference and the CPU kernel (ffi/cpu/attention.cc, nan_max) do, instead of
// a row that looks as if it had no visible key.
__device__ __forceinline__ float nan_max(float a, float b) { return a != a ? a : (b > a || b != b ? b : a); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Odd row stride (in floats) for staged rows of length D.
__host__ __device__ __forceinline__ int gen_stride(int64_t D) { return int(D | 1); }

// Shared memory of the generic kernels: two staged chunks [kGenChunk][stride] plus, per
// warp, two rows of D floats, plus per-chunk scalars.
__host__ __device__ __forceinline__ size_t gen_smem_bytes(int64_t D) {
  return sizeof(float) * (size_t(2) * kGenChunk * gen_stride(D) + size_t(2) * kGenWarps * D +
                          2 * kGenChunk);
}

// Stages rows [r0, r0 + n) of x (row r at x + r * row_stride, D elements) as f32 into
// dst[kGenChunk][ld]; rows past n are zero.
template <typename T>
__device__ __forceinline__ void stage_rows(float* dst, int ld, const T* __restrict__ x, int64_t row_stride,
                                           int64_t r0, int64_t n, int64_t D) {
  const int64_t total = int64_t(kGenChunk) * D;
  for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
    const int64_t r = e / D, d = e - r * D;
    dst[r * ld + d] = (r0 + r < n) ? to_f32(x[(r0 + r) * row_stride + d]) : 0.f;
  }
}

// ---- forward ---------------------------------------------------------------------------
// Grid: ceil(Sq / kGenWarps) * H * B blocks (x), kGenWarps warps. Block (qb, h, b).
template <typename T>
__global__ void __launch_bounds__(kGenWarps * 32)
    gen_fwd_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float smem[];
  const int ld = gen_stride(a.D);
  float* Ks = smem;
  float* Vs = Ks + kGenChunk * ld;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qrow = Vs + kGenChunk * ld + warp * a.D;
  const int64_t nqb = (a.Sq + kGenWarps - 1) / kGenWarps;
  int64_t blk = blockIdx.x;
  const int64_t qb = blk % nqb;
  blk /= nqb;
  const int64_t h = blk % a.H, b = blk / a.H;
  const int64_t hk = h / a.group;
  const int64_t i = qb * kGenWarps + warp;
  const bool row_ok = i < a.Sq;
  const int64_t kv_rs = a.Hkv * a.D;
  if (row_ok)
    for (int64_t d = lane; d < a.D; d += 32) qrow[d] = to_f32(q[((b * a.Sq + i) * a.H + h) * a.D + d]);
  // keys this block needs: up to the last visible position of its last row
  const int64_t last_i = min(a.Sq - 1, qb * kGenWarps + kGenWarps - 1);
  int64_t kend = a.Sk;
  if (a.kind != 0) kend = min(a.Sk, last_i + a.off + 1);
  int64_t kbeg = 0;
  if (a.kind == 2) kbeg = max(int64_t(0), qb * kGenWarps + a.off - a.window);
  kbeg = kbeg / kGenChunk * kGenChunk;
  float m = -INFINITY, l = 0.f, acc[kGenPer];
#pragma unroll
  for (int t = 0; t < kGenPer; ++t) acc[t] = 0.f;
  const T* kb = k + (b * a.Sk * a.Hkv + hk) * a.D;
  const T* vb = v + (b * a.Sk * a.Hkv + hk) * a.D;
  for (int64_t j0 = kbeg; j0 < kend; j0 += kGenChunk) {
    __syncthreads();
    stage_rows(Ks, ld, kb, kv_rs, j0, a.Sk, a.D);
    stage_rows(Vs, ld, vb, kv_rs, j0, a.Sk, a.D);
    __syncthreads();
    if (!row_ok) continue;
    const int64_t j = j0 + lane;
    float s = -INFINITY;
    if (visible(a, b, i, j)) {
      float dot = 0.f;
      const float* kr = Ks + lane * ld;
      for (int64_t d = 0; d < a.D; ++d) dot = fmaf(qrow[d], kr[d], dot);
      float th;
      s = cap_score(dot * a.scale, a.softcap, &th);
      if (bias) s += to_f32(bias[((b * a.H + h) * a.Sq + i) * a.Sk + j]);
    }
    const float mc = warp_max(s);
    const float mn = nan_max(m, mc);
    if (mn == -INFINITY) continue;  // nothing visible yet
    const float alpha = __expf(m - mn);  // m = -inf: 0
    const float p = __expf(s - mn);
    l = l * alpha + warp_sum(p);
#pragma unroll
    for (int t = 0; t < kGenPer; ++t) acc[t] *= alpha;
    for (int jj = 0; jj < kGenChunk; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      if (pj == 0.f) continue;  // uniform across the warp
      const float* vr = Vs + jj * ld;
#pragma unroll
      for (int t = 0; t < kGenPer; ++t) {
        const int64_t d = lane + 32 * t;
        if (d < a.D) acc[t] = fmaf(pj, vr[d], acc[t]);
      }
    }
    m = mn;
  }
  if (!row_ok) return;
  float inv, row_lse;
  row_finish(m, l, row_sink(a, b, h), &inv, &row_lse);
  T* orow = out + ((b * a.Sq + i) * a.H + h) * a.D;
#pragma unroll
  for (int t = 0; t < kGenPer; ++t) {
    const int64_t d = lane + 32 * t;
    if (d < a.D) orow[d] = from_f32<T>(acc[t] * inv);
  }
  if (lane == 0) lse[(b * a.H + h) * a.Sq + i] = row_lse;
}

// ---- backward pre-pass: delta = rowsum(dout * out) - dlse --------------------------------
// A group of L lanes per row (L a power of two, 1..32, chosen by the launcher, delta_lanes), the
// rows taken in delta's [B, H, Sq] order so the groups of a warp write consecutive delta elements
// and read consecutive dlse ones; a row of out / dout is D contiguous elements of [B, Sq, H, D],
// read in 16-byte vectors (VEC elements: D a multiple of VEC, 16-byte aligned buffers) or else one
// element at a time. Each lane sums its vectors, then the group adds its lanes' sums (xor
// shuffles): a fixed order, so delta is deterministic. (H100, B4 S4096 H16 D128 bf16: one warp a
// row, 2-byte loads, writes H apart, took 70 us, 1.9 TB/s; vectors take it to 50 us.)
template <typename T, int VEC>
__global__ void __launch_bounds__(256)
    delta_kernel(int64_t rows, int64_t Sq, int64_t H, int D, int L, const T* __restrict__ out,
                 const T* __restrict__ dout, const float* __restrict__ dlse, float* __restrict__ delta) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / L;  // [B, H, Sq] row
  const int lane = threadIdx.x & 31, sub = lane & (L - 1);
  if (r >= rows) return;  // whole groups: L divides 32 and the block size
  const int64_t i = r % Sq, bh = r / Sq, h = bh % H, b = bh / H;
  const int64_t at = ((b * Sq + i) * H + h) * D;
  const T* o = out + at;
  const T* g = dout + at;
  float s = 0.f;
  for (int c = sub; c < D / VEC; c += L) {
    float ov[VEC], gv[VEC];
    load_vec<T, VEC>(o + c * VEC, ov);
    load_vec<T, VEC>(g + c * VEC, gv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) s = fmaf(ov[e], gv[e], s);
  }
  const unsigned group = L == 32 ? 0xffffffffu : ((1u << L) - 1u) << (lane & ~(L - 1));
  for (int m = L / 2; m > 0; m >>= 1) s += __shfl_xor_sync(group, s, m);
  if (sub == 0) delta[r] = s - dlse[r];
}

// The lanes a row of delta_kernel: the power of two (at most 32) covering the row's D / VEC vectors.
inline int delta_lanes(int64_t D, int vec) {
  int L = 1;
  while (L < 32 && L * vec < D) L *= 2;
  return L;
}

// P_ij from the score and the row's lse (lse = -inf: dead row, P = 0).
__device__ __forceinline__ float prob(float s, float lse) {
  return (lse == -INFINITY || s == -INFINITY) ? 0.f : __expf(s - lse);
}

// ---- dq (and dbias) ----------------------------------------------------------------------
// Grid and shared memory as gen_fwd_kernel; the second per-warp row holds dout.
template <typename T>
__global__ void __launch_bounds__(kGenWarps * 32)
    gen_dq_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                  const T* __restrict__ bias, T* __restrict__ dq, T* __restrict__ dbias) {
  extern __shared__ float smem[];
  const int ld = gen_stride(a.D);
  float* Ks = smem;
  float* Vs = Ks + kGenChunk * ld;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qrow = Vs + kGenChunk * ld + warp * a.D;
  float* grow = Vs + kGenChunk * ld + (kGenWarps + warp) * a.D;
  const int64_t nqb = (a.Sq + kGenWarps - 1) / kGenWarps;
  int64_t blk = blockIdx.x;
  const int64_t qb = blk % nqb;
  blk /= nqb;
  const int64_t h = blk % a.H, b = blk / a.H;
  const int64_t hk = h / a.group;
  const int64_t i = qb * kGenWarps + warp;
  const bool row_ok = i < a.Sq;
  const int64_t kv_rs = a.Hkv * a.D;
  float L = -INFINITY, dl = 0.f;
  if (row_ok) {
    const int64_t at = ((b * a.Sq + i) * a.H + h) * a.D;
    for (int64_t d = lane; d < a.D; d += 32) {
      qrow[d] = to_f32(q[at + d]);
      grow[d] = to_f32(dout[at + d]);
    }
    L = lse[(b * a.H + h) * a.Sq + i];
    dl = delta[(b * a.H + h) * a.Sq + i];
  }
  const int64_t bias_row = ((b * a.H + h) * a.Sq + i) * a.Sk;
  // dbias must be written everywhere (zeros where hidden); the key range is not clipped then
  const int64_t last_i = min(a.Sq - 1, qb * kGenWarps + kGenWarps - 1);
  int64_t kend = a.Sk, kbeg = 0;
  if (!dbias) {
    if (a.kind != 0) kend = min(a.Sk, last_i + a.off + 1);
    if (a.kind == 2) kbeg = max(int64_t(0), qb * kGenWarps + a.off - a.window);
    kbeg = kbeg / kGenChunk * kGenChunk;
  }
  float acc[kGenPer];
#pragma unroll
  for (int t = 0; t < kGenPer; ++t) acc[t] = 0.f;
  const T* kb = k + (b * a.Sk * a.Hkv + hk) * a.D;
  const T* vb = v + (b * a.Sk * a.Hkv + hk) * a.D;
  for (int64_t j0 = kbeg; j0 < kend; j0 += kGenChunk) {
    __syncthreads();
    stage_rows(Ks, ld, kb, kv_rs, j0, a.Sk, a.D);
    stage_rows(Vs, ld, vb, kv_rs, j0, a.Sk, a.D);
    __syncthreads();
    if (!row_ok) continue;
    const int64_t j = j0 + lane;
    float ds = 0.f, dr = 0.f;
    if (L != -INFINITY && visible(a, b, i, j)) {
      float dot = 0.f, dp = 0.f;
      const float* kr = Ks + lane * ld;
      const float* vr = Vs + lane * ld;
      for (int64_t d = 0; d < a.D; ++d) {
        dot = fmaf(qrow[d], kr[d], dot);
        dp = fmaf(grow[d], vr[d], dp);
      }
      float th;
      float s = cap_score(dot * a.scale, a.softcap, &th);
      if (bias) s += to_f32(bias[bias_row + j]);
      const float p = prob(s, L);
      ds = p * (dp - dl);
      dr = a.softcap > 0.f ? ds * (1.f - th * th) : ds;
    }
    if (dbias && j < a.Sk) dbias[bias_row + j] = from_f32<T>(ds);
    for (int jj = 0; jj < kGenChunk; ++jj) {
      const float w = __shfl_sync(0xffffffffu, dr, jj);
      if (w == 0.f) continue;
      const float* kr = Ks + jj * ld;
#pragma unroll
      for (int t = 0; t < kGenPer; ++t) {
        const int64_t d = lane + 32 * t;
        if (d < a.D) acc[t] = fmaf(w, kr[d], acc[t]);
      }
    }
  }
  if (!row_ok) return;
  T* dqr = dq + ((b * a.Sq + i) * a.H + h) * a.D;
#pragma unroll
  for (int t = 0; t < kGenPer; ++t) {
    const int64_t d = lane + 32 * t;
    if (d < a.D) dqr[d] = from_f32<T>(acc[t] * a.scale);
  }
}

// ---- dk, dv --------------------------------------------------------------------------------
// Grid: ceil(Sk / kGenWarps) * Hkv * B blocks; warp w owns key row j = kb * kGenWarps + w of
// kv head hk and loops over the heads of the group and the query chunks.
template <typename T>
__global__ void __launch_bounds__(kGenWarps * 32)
    gen_dkdv_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                    const T* __restrict__ bias, T* __restrict__ dk, T* __restrict__ dv) {
  extern __shared__ float smem[];
  const int ld = gen_stride(a.D);
  float* Qs = smem;
  float* Gs = Qs + kGenChunk * ld;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* krow = Gs + kGenChunk * ld + warp * a.D;
  float* vrow = Gs + kGenChunk * ld + (kGenWarps + warp) * a.D;
  float* Ls = Gs + kGenChunk * ld + 2 * kGenWarps * a.D;
  float* Dl = Ls + kGenChunk;
  const int64_t nkb = (a.Sk + kGenWarps - 1) / kGenWarps;
  int64_t blk = blockIdx.x;
  const int64_t kb = blk % nkb;
  blk /= nkb;
  const int64_t hk = blk % a.Hkv, b = blk / a.Hkv;
  const int64_t j = kb * kGenWarps + warp;
  const bool row_ok = j < a.Sk;
  const bool key_on = row_ok && (a.mask == nullptr || a.mask[b * a.Sk + j] >= 0.5f);
  const int64_t q_rs = a.H * a.D;
  if (row_ok) {
    const int64_t at = ((b * a.Sk + j) * a.Hkv + hk) * a.D;
    for (int64_t d = lane; d < a.D; d += 32) {
      krow[d] = to_f32(k[at + d]);
      vrow[d] = to_f32(v[at + d]);
    }
  }
  // queries that can see this block's keys: pos_i = i + off >= j (causal, sliding);
  // sliding also pos_i <= j + w
  const int64_t j_first = kb * kGenWarps, j_last = min(a.Sk - 1, j_first + kGenWarps - 1);
  int64_t qbeg = 0, qend = a.Sq;
  if (a.kind != 0) qbeg = max(int64_t(0), j_first - a.off);
  if (a.kind == 2) qend = min(a.Sq, j_last + a.window - a.off + 1);
  qbeg = qbeg / kGenChunk * kGenChunk;
  float ak[kGenPer], av[kGenPer];
#pragma unroll
  for (int t = 0; t < kGenPer; ++t) ak[t] = av[t] = 0.f;
  for (int64_t g = 0; g < a.group; ++g) {
    const int64_t h = hk * a.group + g;
    const T* qb_ = q + (b * a.Sq * a.H + h) * a.D;
    const T* gb_ = dout + (b * a.Sq * a.H + h) * a.D;
    const float* lse_h = lse + (b * a.H + h) * a.Sq;
    const float* del_h = delta + (b * a.H + h) * a.Sq;
    for (int64_t i0 = qbeg; i0 < qend; i0 += kGenChunk) {
      __syncthreads();
      stage_rows(Qs, ld, qb_, q_rs, i0, a.Sq, a.D);
      stage_rows(Gs, ld, gb_, q_rs, i0, a.Sq, a.D);
      if (threadIdx.x < kGenChunk) {
        const int64_t i = i0 + threadIdx.x;
        Ls[threadIdx.x] = i < a.Sq ? lse_h[i] : -INFINITY;
        Dl[threadIdx.x] = i < a.Sq ? del_h[i] : 0.f;
      }
      __syncthreads();
      if (!key_on) continue;
      const int64_t i = i0 + lane;
      float p = 0.f, dr = 0.f;
      const float L = Ls[lane];
      if (i < a.Sq && L != -INFINITY && kind_visible(a, i, j)) {
        float dot = 0.f, dp = 0.f;
        const float* qr = Qs + lane * ld;
        const float* gr = Gs + lane * ld;
        for (int64_t d = 0; d < a.D; ++d) {
          dot = fmaf(qr[d], krow[d], dot);
          dp = fmaf(gr[d], vrow[d], dp);
        }
        float th;
        float s = cap_score(dot * a.scale, a.softcap, &th);
        if (bias) s += to_f32(bias[((b * a.H + h) * a.Sq + i) * a.Sk + j]);
        p = prob(s, L);
        const float ds = p * (dp - Dl[lane]);
        dr = a.softcap > 0.f ? ds * (1.f - th * th) : ds;
      }
      for (int ii = 0; ii < kGenChunk; ++ii) {
        const float pi = __shfl_sync(0xffffffffu, p, ii);
        const float wi = __shfl_sync(0xffffffffu, dr, ii);
        if (pi == 0.f && wi == 0.f) continue;
        const float* qr = Qs + ii * ld;
        const float* gr = Gs + ii * ld;
#pragma unroll
        for (int t = 0; t < kGenPer; ++t) {
          const int64_t d = lane + 32 * t;
          if (d < a.D) {
            av[t] = fmaf(pi, gr[d], av[t]);
            ak[t] = fmaf(wi, qr[d], ak[t]);
          }
        }
      }
    }
  }
  if (!row_ok) return;
  const int64_t at = ((b * a.Sk + j) * a.Hkv + hk) * a.D;
#pragma unroll
  for (int t = 0; t < kGenPer; ++t) {
    const int64_t d = lane + 32 * t;
    if (d < a.D) {
      dk[at + d] = from_f32<T>(ak[t] * a.scale);
      dv[at + d] = from_f32<T>(av[t]);
    }
  }
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
