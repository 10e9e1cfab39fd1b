// XLA FFI handlers for 2-D pooling on CUDA: targets rlx_max_pool2d_fwd,
// rlx_max_pool2d_bwd and rlx_avg_pool2d_bwd (the CPU kernels in ffi/cpu/pool.cc define
// the maths; see rlx_jax/vjp_rules/pool.py). Geometry checks: ffi/pool_geometry.h.
//
// x [P..., H, W] (every leading index is a plane), window (kh, kw), stride (sh, sw),
// padding (ph, pw) on both sides; Ho = (H + 2 ph - kh) / sh + 1; window (i, j) covers
// rows i*sh - ph + [0, kh) and columns j*sw - pw + [0, kw).
//
// rlx_max_pool2d_fwd: x -> y, argmax, attrs kh kw sh sw ph pw (as on CPU):
//   y = window max (padding -inf), argmax = the FIRST maximum in row-major window order
//   (strictly greater than every earlier value, starting from -inf; NaN never wins), -1
//   when nothing exceeds -inf; y is then x[argmax] (or -inf). The argmax is window-local
//   int8 (r - i*sh + ph) * kw + (c - j*sw + pw) where kh * kw <= 127 (one byte per output
//   instead of four), else the i32 flat in-plane index r*W + c (pool::local_argmax).
//   Same comparisons as the CPU kernel, so the same bits.
// rlx_max_pool2d_bwd: dy, argmax -> dx, with the geometry attrs kh kw sh sw ph pw (as on
//   CPU). No scatter: each input element (h, w) walks the outputs whose windows cover
//   it in increasing output order and adds dy where the argmax points at it (local: equals
//   its place in that window; flat: equals h*W + w) (f32 accumulation, written once):
//   deterministic, no atomics, the same sums in the same order as the CPU kernel's scatter
//   for every argmax the forward produces (an argmax always lies in its own window; an
//   index outside its window, which the forward never writes, passes no gradient here).
// rlx_avg_pool2d_bwd: dy -> dx, attrs as on CPU: dx[h, w] = (sum over the covering
//   windows i of (sum over the covering windows j of dy[i, j])) * (1 / (kh kw)), the
//   CPU kernel's order of additions (count_include_pad), so f32 gives the same bits.
//
// Direct kernels (k3s2p1 and k2s2p0 windows on rows of whole 16-byte vectors, aligned
// buffers; int8 argmax): max forward and backward in every dtype, average backward in bf16 / f16; no
// shared memory, a thread walks 4 outputs (or the 8 input columns under them) down 4
// output rows of a plane, window loops unrolled at compile time (see "direct kernels"
// below).
//
// Tiled kernels (every other geometry whose staged rows fit in shared memory). A block owns a
// contiguous run of output rows (whole planes, or a band of rows of one plane); it first
// copies the contiguous run of input rows those outputs read (dy, argmax or x) into
// shared memory as f32 / i32 (4-, 8- or 16-byte loads, four per thread in flight), then:
// - avg backward and max forward are separable: a first pass reduces every staged row
//   over each output column's window columns (sum; first maximum with its column) into
//   shared memory, a second reduces those over each output row's window rows, reading
//   16-byte vectors of them where the output width is a multiple of 4;
// - max backward: a vector of outputs in one row walks the union of its columns' covering
//   windows once and tests each output's index against the staged argmax.
// Outputs are written with 16-byte stores (y and argmax 4 at a time). The per-row and
// per-column window ranges are computed once per block into shared tables. HBM traffic:
// each input byte read once (plus the halo rows a band shares with its neighbour, from
// L2), each output written once. The untiled v2 kernels (one thread per column walking
// 8 rows) were instruction-issue bound (ncu on the H200: 92% SM issue, 18% DRAM
// throughput for avg backward): loops with run-time trip counts per element; they remain
// the fallback for planes whose rows do not fit in 48 KB of shared memory.
//
// Every kernel runs on XLA's stream, allocates nothing and returns at once on
// zero-sized operands.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda/common.cuh"
#include "pool_geometry.h"

namespace rlx {
namespace cuda {
namespace {

using pool::check_geom;
using pool::check_pair;
using pool::Geom;
using pool::plane_view;
using pool::PlaneView;
using pool::PoolShape;

constexpr int kThreads = 256;

// ---- tiled kernels -----------------------------------------------------------------------

// Input range read by output coordinate n along one axis, [lo, lo + cnt):
// cover = true (backward): the windows covering input n, lo = ceil((n + p - k + 1) / s),
//   hi = floor((n + p) / s) + 1, clipped to [0, lim);
// cover = false (forward): the input window of output n, [n s - p, n s - p + k) clipped to
//   [0, lim).
// Both bounds only grow with n. lo may exceed lim when cnt == 0.
struct AxisMap {
  int k, s, p, lim;
  bool cover;
};

struct Span {
  int lo, hi;  // hi clipped to lim; empty when hi <= lo
};

__device__ __forceinline__ Span span_of(const AxisMap& m, int n) {
  if (m.cover) {
    const int top = n + m.p, bottom = top - m.k + 1;
    const int lo = bottom <= 0 ? 0 : (bottom + m.s - 1) / m.s;
    const int hi = top / m.s + 1;
    return {lo, hi < m.lim ? hi : m.lim};
  }
  const int64_t st = int64_t(n) * m.s - m.p;
  const int64_t lo = st > 0 ? st : 0, hi = st + m.k < m.lim ? st + m.k : m.lim;
  return {int(lo), int(hi)};
}

struct TileArgs {
  int64_t planes, units;
  int in_h, in_w, out_h, out_w;  // per plane: what a block stages / what it writes
  int pb;                        // > 0: pb whole planes per unit; 0: bands of rb rows
  int rb, bands;
  int rows_cap, stage_cap, in_rows_cap;  // shared memory capacities
  AxisMap rm, cm;
};

// What one unit (a block's share) covers, and the row table it fills:
// rowinfo[R] = {staged row of the first input row of output row R, input rows,
//               first input row (in-plane), output row (in-plane)}.
// colinfo[c] = {first input column, one past the last (clipped; empty when <= first)}.
struct Unit {
  int64_t in_base, out_base;  // flat element offsets of the staged input / written output
  int n_in, n_out, n_rows;    // staged elements, written elements, staged input rows
  int shift;                  // in_base % 4: stage index of input element e is shift + e
};

__device__ __forceinline__ Unit unit_setup(const TileArgs& a, int64_t u, int4* rowinfo) {
  Unit t;
  const int64_t in_plane = int64_t(a.in_h) * a.in_w, out_plane = int64_t(a.out_h) * a.out_w;
  int rows, base, r0;
  int64_t p0;
  if (a.pb > 0) {
    p0 = u * a.pb;
    const int np = int(a.planes - p0 < a.pb ? a.planes - p0 : a.pb);
    rows = np * a.out_h;
    base = 0;
    r0 = 0;
    t.in_base = p0 * in_plane;
    t.n_rows = np * a.in_h;
  } else {
    p0 = u / a.bands;
    const int b = int(u - p0 * a.bands);
    r0 = b * a.rb;
    const int r1 = r0 + a.rb < a.out_h ? r0 + a.rb : a.out_h;
    rows = r1 - r0;
    const Span first = span_of(a.rm, r0), last = span_of(a.rm, r1 - 1);
    base = first.lo < a.rm.lim ? first.lo : a.rm.lim;
    const int end = last.hi > base ? last.hi : base;
    t.in_base = p0 * in_plane + int64_t(base) * a.in_w;
    t.n_rows = end - base;
  }
  t.n_in = t.n_rows * a.in_w;
  t.out_base = p0 * out_plane + int64_t(r0) * a.out_w;
  t.n_out = rows * a.out_w;
  t.shift = int(t.in_base & 3);
  for (int R = threadIdx.x; R < rows; R += blockDim.x) {
    int pl = 0, r = r0 + R;
    if (a.pb > 0) {
      pl = R / a.out_h;
      r = R - pl * a.out_h;
    }
    const Span sp = span_of(a.rm, r);
    const int cnt = sp.hi > sp.lo ? sp.hi - sp.lo : 0;
    rowinfo[R] = make_int4(cnt > 0 ? pl * a.in_h + sp.lo - base : 0, cnt, sp.lo, r);
  }
  return t;
}

__device__ __forceinline__ void fill_colinfo(const TileArgs& a, int2* colinfo) {
  for (int c = threadIdx.x; c < a.out_w; c += blockDim.x) {
    const Span sp = span_of(a.cm, c);
    colinfo[c] = make_int2(sp.lo, sp.hi);
  }
}

// 4 elements of T: 16 bytes for f32 / i32, 8 for 16-bit types.
template <typename T> struct Vec4Raw;
template <> struct Vec4Raw<float> { using type = uint4; };
template <> struct Vec4Raw<int32_t> { using type = uint4; };
template <> struct Vec4Raw<int8_t> { using type = uint32_t; };
template <> struct Vec4Raw<__nv_bfloat16> { using type = uint2; };
template <> struct Vec4Raw<__half> { using type = uint2; };

__device__ __forceinline__ float stage_val(float v) { return v; }
__device__ __forceinline__ float stage_val(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float stage_val(__half v) { return __half2float(v); }
__device__ __forceinline__ int32_t stage_val(int32_t v) { return v; }
__device__ __forceinline__ int32_t stage_val(int8_t v) { return v; }

// Four argmax indices stored at once (p aligned to 4 of them): 16 bytes of i32 or 4 of i8.
__device__ __forceinline__ void store_arg4(int32_t* p, int32_t a, int32_t b, int32_t c, int32_t d) {
  *reinterpret_cast<int4*>(p) = make_int4(a, b, c, d);
}
__device__ __forceinline__ void store_arg4(int8_t* p, int32_t a, int32_t b, int32_t c, int32_t d) {
  *reinterpret_cast<uint32_t*>(p) =
      (uint32_t(a) & 0xffu) | (uint32_t(b) & 0xffu) << 8 | (uint32_t(c) & 0xffu) << 16 | (uint32_t(d) & 0xffu) << 24;
}

__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ void store4(int32_t* p, int32_t a, int32_t b, int32_t c, int32_t d) {
  *reinterpret_cast<int4*>(p) = make_int4(a, b, c, d);
}

// Copies src[0, n) (src = base + in_base, base 16-byte aligned) into dst[shift + e]
// (dst 16-byte aligned, shift = in_base % 4), as f32 (i32 stays i32): vectors of 4
// elements at the aligned positions, four vectors per thread in flight, one 16-byte
// shared store per vector (consecutive threads, consecutive addresses: no bank conflict);
// the unaligned head and tail element by element.
template <typename T, typename S>
__device__ __forceinline__ void stage_copy(const T* __restrict__ src, int n, int shift, S* dst) {
  using Raw = typename Vec4Raw<T>::type;
  const int head = min((4 - shift) & 3, n);
  const int nv = (n - head) >> 2;
  const int tail0 = head + nv * 4;
  const int nscalar = head + (n - tail0);
  for (int t = threadIdx.x; t < nscalar; t += blockDim.x) {
    const int e = t < head ? t : tail0 + (t - head);
    dst[shift + e] = stage_val(src[e]);
  }
  const Raw* vsrc = reinterpret_cast<const Raw*>(src + head);
  S* vdst = dst + shift + head;  // 16-byte aligned: shift + head is a multiple of 4
  const int step = blockDim.x;
  for (int v0 = threadIdx.x; v0 < nv; v0 += 4 * step) {
    Raw raw[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (v0 + q * step < nv) raw[q] = __ldcs(vsrc + v0 + q * step);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (v0 + q * step < nv) {
        const T* e = reinterpret_cast<const T*>(&raw[q]);
        store4(vdst + 4 * (v0 + q * step), stage_val(e[0]), stage_val(e[1]), stage_val(e[2]), stage_val(e[3]));
      }
  }
}

// VEC consecutive T (VEC * sizeof(T) in {4, 8, 16}, p aligned to it) from f32.
template <typename T, int VEC>
__device__ __forceinline__ void store_n(T* __restrict__ p, const float (&v)[VEC]) {
  constexpr int B = VEC * int(sizeof(T));
  static_assert(B == 4 || B == 8 || B == 16, "store_n: 4, 8 or 16 bytes");
  using Raw = typename std::conditional<B == 16, uint4, typename std::conditional<B == 8, uint2, uint32_t>::type>::type;
  Raw raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) e[i] = from_f32<T>(v[i]);
  *reinterpret_cast<Raw*>(p) = raw;
}

// Walks the unit's outputs [0, n_out) (flat, local; global offset out_base): first the
// unaligned head and tail one element each (elem(e, R, c)), then the VEC-aligned vectors
// (vec(e, R, c) computes VEC consecutive elements starting at output row R, column c;
// they lie in one row when c + VEC <= out_w).
template <int VEC, typename Elem, typename VecFn>
__device__ __forceinline__ void for_outputs(int64_t out_base, int n_out, int out_w, Elem&& elem, VecFn&& vec) {
  const int head = min(int((VEC - out_base % VEC) % VEC), n_out);
  const int nv = (n_out - head) / VEC;
  const int tail0 = head + nv * VEC;
  const int nscalar = head + (n_out - tail0);
  const unsigned uw = unsigned(out_w);
  for (int t = threadIdx.x; t < nscalar; t += blockDim.x) {
    const int e = t < head ? t : tail0 + (t - head);
    const int R = int(unsigned(e) / uw);
    elem(e, R, e - R * out_w);
  }
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    const int e = head + v * VEC;
    const int R = int(unsigned(e) / uw);
    vec(e, R, e - R * out_w);
  }
}

// Calls f(i, c) for every (staged row i < rows, output column c < out_w), threads along c.
template <typename F>
__device__ __forceinline__ void for_rows_cols(int rows, int out_w, F&& f) {
  const int step = blockDim.x;
  const int di = step / out_w, dc = step - di * out_w;
  int i = threadIdx.x / out_w, c = threadIdx.x - (threadIdx.x / out_w) * out_w;
  for (; i < rows;) {
    f(i, c);
    i += di;
    c += dc;
    if (c >= out_w) {
      c -= out_w;
      ++i;
    }
  }
}

struct SmemLayout {
  int4* rowinfo;
  int2* colinfo;
  float* stage;
  int32_t* stage2;  // max backward: argmax rows
  float* aux;       // avg backward: row sums [in_rows_cap][out_w]; max forward: row maxima
  int32_t* aux2;    // max forward: their columns
};

__device__ __forceinline__ SmemLayout smem_layout(const TileArgs& a, unsigned char* smem, int stages, int auxes) {
  SmemLayout l;
  l.rowinfo = reinterpret_cast<int4*>(smem);
  size_t off = size_t(a.rows_cap) * 16;
  l.colinfo = reinterpret_cast<int2*>(smem + off);
  off += (size_t(a.out_w) * 8 + 15) / 16 * 16;
  l.stage = reinterpret_cast<float*>(smem + off);
  off += size_t(a.stage_cap) * 4;
  l.stage2 = reinterpret_cast<int32_t*>(smem + off);
  if (stages > 1) off += size_t(a.stage_cap) * 4;
  const size_t aux = (size_t(a.in_rows_cap) * a.out_w * 4 + 15) / 16 * 16;
  l.aux = reinterpret_cast<float*>(smem + off);
  if (auxes > 0) off += aux;
  l.aux2 = reinterpret_cast<int32_t*>(smem + off);
  return l;
}

// avg pool backward, separable: stage dy rows; rs[i][c] = sum of dy[i, j] over the windows
// j covering column c (every staged row i); dx[r, c] = (sum of rs[i][c] over the windows i
// covering row r) * inv: the CPU kernel's order of additions. The second pass reads rs with
// 16-byte shared loads where a vector of outputs lies in one row at a multiple of 4.
template <typename T>
__global__ void __launch_bounds__(kThreads) avg_bwd_tiled(const T* __restrict__ dy, T* __restrict__ dx, TileArgs a,
                                                          float inv) {
  extern __shared__ __align__(16) unsigned char smem[];
  const SmemLayout sm = smem_layout(a, smem, 1, 1);
  constexpr int VEC = 16 / int(sizeof(T));
  fill_colinfo(a, sm.colinfo);
  const int in_w = a.in_w, out_w = a.out_w;
  const bool w4 = (out_w & 3) == 0;
  for (int64_t u = blockIdx.x; u < a.units; u += gridDim.x) {
    __syncthreads();  // the previous unit's readers are done with the tables and stage
    const Unit t = unit_setup(a, u, sm.rowinfo);
    stage_copy(dy + t.in_base, t.n_in, t.shift, sm.stage);
    __syncthreads();
    for_rows_cols(t.n_rows, out_w, [&](int i, int c) {
      const int2 ci = sm.colinfo[c];
      const float* q = sm.stage + t.shift + i * in_w;
      float s = 0.f;
      for (int j = ci.x; j < ci.y; ++j) s += q[j];
      sm.aux[i * out_w + c] = s;
    });
    __syncthreads();
    const float* rs = sm.aux;
    T* out = dx + t.out_base;
    auto one = [&](int R, int c) {
      const int4 ri = sm.rowinfo[R];
      const float* q = rs + ri.x * out_w + c;
      float s = 0.f;
      for (int i = 0; i < ri.y; ++i, q += out_w) s += *q;
      return s * inv;
    };
    for_outputs<VEC>(
        t.out_base, t.n_out, out_w, [&](int e, int R, int c) { out[e] = from_f32<T>(one(R, c)); },
        [&](int e, int R, int c) {
          float v[VEC];
          if (w4 && c + VEC <= out_w && (c & 3) == 0) {
            const int4 ri = sm.rowinfo[R];
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[k] = 0.f;
            const float* q = rs + ri.x * out_w + c;
            for (int i = 0; i < ri.y; ++i, q += out_w) {
#pragma unroll
              for (int k = 0; k < VEC; k += 4) {
                const float4 x4 = *reinterpret_cast<const float4*>(q + k);
                v[k] += x4.x;
                v[k + 1] += x4.y;
                v[k + 2] += x4.z;
                v[k + 3] += x4.w;
              }
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[k] *= inv;
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              v[k] = one(R, c);
              if (++c == out_w) {
                c = 0;
                ++R;
              }
            }
          }
          store_n<T, VEC>(out + e, v);
        });
  }
}

// max pool backward: stage dy (f32) and argmax (as i32) rows; each dx element (r, c) walks
// the covering outputs (i, j) in increasing order and adds dy where the argmax is (r, c):
// I = int32_t: argmax == r*W + c; I = int8_t (window-local): argmax == wr * kw + wc with
// wr = r - i*sh + ph, wc = c - j*sw + pw (the element's place in window (i, j)). A vector
// of outputs in one row walks the union of its columns' covering ranges once and tests
// each output's index against the argmax (an argmax lies in its own window, so a match is
// always a covering output; a local index matches column c + d only where c + d lies in
// the window, so a value pointing at another row of the window never matches).
template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) max_bwd_tiled(const T* __restrict__ dy, const I* __restrict__ am,
                                                          T* __restrict__ dx, TileArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const SmemLayout sm = smem_layout(a, smem, 2, 0);
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr bool kLocal = sizeof(I) == 1;
  fill_colinfo(a, sm.colinfo);
  const int in_w = a.in_w, out_w = a.out_w;
  const int kw = a.cm.k, sw = a.cm.s, pw = a.cm.p, sh = a.rm.s, ph = a.rm.p;
  for (int64_t u = blockIdx.x; u < a.units; u += gridDim.x) {
    __syncthreads();
    const Unit t = unit_setup(a, u, sm.rowinfo);
    stage_copy(dy + t.in_base, t.n_in, t.shift, sm.stage);
    stage_copy(am + t.in_base, t.n_in, t.shift, sm.stage2);
    __syncthreads();
    auto one = [&](int R, int c) {
      const int4 ri = sm.rowinfo[R];
      const int2 ci = sm.colinfo[c];
      const int off = t.shift + ri.x * in_w;
      const float* q = sm.stage + off;
      const int32_t* qa = sm.stage2 + off;
      float acc = 0.f;
      if constexpr (kLocal) {
        int wr = ri.w + ph - ri.z * sh;  // window row of dx row r in output row ri.z + i
        for (int i = 0; i < ri.y; ++i, q += in_w, qa += in_w, wr -= sh)
          for (int j = ci.x; j < ci.y; ++j)
            if (qa[j] == wr * kw + c + pw - j * sw) acc += q[j];
      } else {
        const int32_t me = ri.w * out_w + c;
        for (int i = 0; i < ri.y; ++i, q += in_w, qa += in_w)
          for (int j = ci.x; j < ci.y; ++j)
            if (qa[j] == me) acc += q[j];
      }
      return acc;
    };
    T* out = dx + t.out_base;
    for_outputs<VEC>(
        t.out_base, t.n_out, out_w, [&](int e, int R, int c) { out[e] = from_f32<T>(one(R, c)); },
        [&](int e, int R, int c) {
          float v[VEC];
          if (c + VEC <= out_w) {
            const int4 ri = sm.rowinfo[R];
            const int j0 = sm.colinfo[c].x, j1 = sm.colinfo[c + VEC - 1].y;
            const int off = t.shift + ri.x * in_w;
            const float* q = sm.stage + off;
            const int32_t* qa = sm.stage2 + off;
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[k] = 0.f;
            if constexpr (kLocal) {
              int wr = ri.w + ph - ri.z * sh;
              for (int i = 0; i < ri.y; ++i, q += in_w, qa += in_w, wr -= sh)
                for (int j = j0; j < j1; ++j) {
                  const int wc = c + pw - j * sw;  // window column of dx column c (may be outside)
                  const int d = qa[j] - (wr * kw + wc);
                  if (unsigned(d) < unsigned(VEC) && unsigned(wc + d) < unsigned(kw)) {
                    const float x = q[j];
#pragma unroll
                    for (int k = 0; k < VEC; ++k)
                      if (d == k) v[k] += x;
                  }
                }
            } else {
              const int32_t me = ri.w * out_w + c;
              for (int i = 0; i < ri.y; ++i, q += in_w, qa += in_w)
                for (int j = j0; j < j1; ++j) {
                  const unsigned d = unsigned(qa[j] - me);
                  if (d < unsigned(VEC)) {
                    const float x = q[j];
#pragma unroll
                    for (int k = 0; k < VEC; ++k)
                      if (d == unsigned(k)) v[k] += x;
                  }
                }
            }
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              v[k] = one(R, c);
              if (++c == out_w) {
                c = 0;
                ++R;
              }
            }
          }
          store_n<T, VEC>(out + e, v);
        });
  }
}

// max pool forward, separable: stage x rows (f32: exact for every T); per staged row i and
// output column j, the first maximum over the window's columns (value, column); then per
// output the first of those maxima over the window's rows, top to bottom, strictly
// greater replacing: the row-major first maximum of the window (NaN never wins; -1 when
// nothing exceeds -inf). y and argmax are written 4 at a time. I = int32_t: the flat
// in-plane index; I = int8_t: the window-local one (the row pass keeps the column inside
// the window, the column pass adds the window row times kw).
template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) max_fwd_tiled(const T* __restrict__ x, T* __restrict__ y,
                                                          I* __restrict__ am, TileArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const SmemLayout sm = smem_layout(a, smem, 1, 2);
  constexpr bool kLocal = sizeof(I) == 1;
  fill_colinfo(a, sm.colinfo);
  const int in_w = a.in_w, out_w = a.out_w;
  const bool w4 = (out_w & 3) == 0;
  // argmax of staged row (in-plane input row) rr for output row ro: rowbase(rr, ro) + column
  auto rowbase = [&](int rr, int ro) { return kLocal ? (rr - ro * a.rm.s + a.rm.p) * a.cm.k : rr * in_w; };
  for (int64_t u = blockIdx.x; u < a.units; u += gridDim.x) {
    __syncthreads();
    const Unit t = unit_setup(a, u, sm.rowinfo);
    stage_copy(x + t.in_base, t.n_in, t.shift, sm.stage);
    __syncthreads();
    for_rows_cols(t.n_rows, out_w, [&](int i, int c) {
      const int2 ci = sm.colinfo[c];
      const float* q = sm.stage + t.shift + i * in_w;
      float best = -INFINITY;
      int32_t col = -1;
      for (int j = ci.x; j < ci.y; ++j) {
        const float v = q[j];
        if (pool::beats_max(v, best)) {
          best = v;
          col = j;
        }
      }
      sm.aux[i * out_w + c] = best;
      sm.aux2[i * out_w + c] = kLocal && col >= 0 ? col - (c * a.cm.s - a.cm.p) : col;
    });
    __syncthreads();
    auto one = [&](int R, int c, float* best_out) {
      const int4 ri = sm.rowinfo[R];
      float best = -INFINITY;
      int32_t arg = -1;
      for (int i = 0; i < ri.y; ++i) {
        const int o = (ri.x + i) * out_w + c;
        const float v = sm.aux[o];
        if (pool::beats_max(v, best)) {
          best = v;
          arg = rowbase(ri.z + i, ri.w) + sm.aux2[o];
        }
      }
      *best_out = best;
      return arg;
    };
    T* yo = y + t.out_base;
    I* ao = am + t.out_base;
    for_outputs<4>(
        t.out_base, t.n_out, out_w,
        [&](int e, int R, int c) {
          float b;
          ao[e] = I(one(R, c, &b));
          yo[e] = from_f32<T>(b);
        },
        [&](int e, int R, int c) {
          float v[4];
          int32_t g[4];
          if (w4 && (c & 3) == 0) {  // then c + 4 <= out_w: one row
            const int4 ri = sm.rowinfo[R];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              v[k] = -INFINITY;
              g[k] = -1;
            }
            for (int i = 0; i < ri.y; ++i) {
              const int o = (ri.x + i) * out_w + c;
              const float4 b4 = *reinterpret_cast<const float4*>(sm.aux + o);
              const int4 c4 = *reinterpret_cast<const int4*>(sm.aux2 + o);
              const int rowoff = rowbase(ri.z + i, ri.w);
              const float bv[4] = {b4.x, b4.y, b4.z, b4.w};
              const int32_t cv[4] = {c4.x, c4.y, c4.z, c4.w};
#pragma unroll
              for (int k = 0; k < 4; ++k)
                if (bv[k] > v[k]) {
                  v[k] = bv[k];
                  g[k] = rowoff + cv[k];
                }
            }
          } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              g[k] = one(R, c, &v[k]);
              if (++c == out_w) {
                c = 0;
                ++R;
              }
            }
          }
          store_n<T, 4>(yo + e, v);
          store_arg4(ao + e, g[0], g[1], g[2], g[3]);
        });
  }
}

// Host plan of a tiled launch: whole planes per block where a plane's staged input fits
// the soft shared-memory budget (aiming at ~8K outputs per block), else bands of rows of
// one plane; `ok` false when one output row's input rows exceed 48 KB (untiled fallback).
struct TilePlan {
  TileArgs args;
  size_t smem;
  unsigned grid;
  bool ok;
};

constexpr size_t kSoftSmem = 28 * 1024;        // 8 blocks per SM (228 KB) where registers allow
constexpr size_t kHardSmem = 48 * 1024 - 64;   // below the 48 KB allowed without the opt-in attribute
constexpr int64_t kTargetOut = 8192;           // outputs per block

// Bytes of shared memory: `rows` output rows, `stage` staged input elements of `per` bytes
// (one or two staged arrays), `in_rows` staged rows times out_w of `aux` bytes (the
// separable passes' per-row results).
size_t smem_bytes(int64_t rows, int64_t stage, int64_t in_rows, int out_w, int per, int aux) {
  return size_t(rows) * 16 + (size_t(out_w) * 8 + 15) / 16 * 16 + size_t(stage + 4) * per +
         (aux > 0 ? (size_t(in_rows) * out_w * 4 + 15) / 16 * 16 * (aux / 4) : 0);
}

// in_rows(rb): the most input rows a band of rb consecutive output rows reads.
template <typename RowsFn>
TilePlan plan_tiles(int64_t planes, int in_h, int in_w, int out_h, int out_w, int per, int aux, AxisMap rm,
                    AxisMap cm, RowsFn in_rows) {
  TilePlan p{};
  TileArgs& a = p.args;
  a.planes = planes;
  a.in_h = in_h;
  a.in_w = in_w;
  a.out_h = out_h;
  a.out_w = out_w;
  a.rm = rm;
  a.cm = cm;
  const int64_t in_plane = int64_t(in_h) * in_w, out_plane = int64_t(out_h) * out_w;
  if (smem_bytes(out_h, in_plane, in_h, out_w, per, aux) <= kSoftSmem) {
    int64_t pb = std::min<int64_t>(std::max<int64_t>(1, kTargetOut / std::max<int64_t>(out_plane, 1)), planes);
    while (pb > 1 && smem_bytes(pb * out_h, pb * in_plane, pb * in_h, out_w, per, aux) > kSoftSmem) pb = pb * 7 / 8;
    a.pb = int(pb);
    a.units = (planes + pb - 1) / pb;
    a.rows_cap = int(pb * out_h);
    a.in_rows_cap = int(pb * in_h);
    a.stage_cap = int(pb * in_plane + 4);
  } else {
    int64_t rb = std::min<int64_t>(std::max<int64_t>(1, kTargetOut / out_w), out_h);
    auto cost = [&](int64_t r) { return smem_bytes(r, in_rows(r) * in_w, in_rows(r), out_w, per, aux); };
    while (rb > 1 && cost(rb) > kSoftSmem) rb = rb * 7 / 8;
    if (cost(rb) > kHardSmem) return p;  // ok = false
    const int64_t bands = (out_h + rb - 1) / rb;
    rb = (out_h + bands - 1) / bands;  // balanced bands (no larger than before)
    a.pb = 0;
    a.rb = int(rb);
    a.bands = int(bands);
    a.units = planes * bands;
    a.rows_cap = int(rb);
    a.in_rows_cap = int(in_rows(rb));
    a.stage_cap = int(in_rows(rb) * in_w + 4);
  }
  a.stage_cap = (a.stage_cap + 3) / 4 * 4;
  p.smem = smem_bytes(a.rows_cap, a.stage_cap - 4, a.in_rows_cap, out_w, per, aux);
  p.grid = unsigned(std::min<int64_t>(a.units, int64_t(1) << 30));
  p.ok = true;
  return p;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// ---- direct kernels (no shared memory) for the common CNN windows -----------------------
//
// K x K windows with stride 2 and padding P, (K, P) = (3, 1) (a ResNet stem's max pool) or
// (2, 0), on rows whose width is a multiple of a 16-byte vector. ncu of the tiled kernels on
// the H200 (128x64x112x112, k3s2p1): issue-bound, 77-85 % of issue slots busy, ALU the
// busiest pipe, DRAM 16-37 % of peak, 47-59 % occupancy (64 / 48 registers), 2-3-way shared
// bank conflicts; 60-280 instructions per element went to staging, index tables, run-time
// window loops and barriers. Here a thread owns V = 4 consecutive outputs of a row (forward)
// or the CW = 8 input columns under them (backwards) and walks RB output rows of one plane,
// reading its operands straight from global memory in 16-byte vectors (a neighbour's halo
// column from L1), every window loop unrolled at compile time: no shared memory, no
// barriers, no per-element index arithmetic. Same comparisons and the same order of
// additions as the tiled kernels (and the CPU kernels), so the same bits.

constexpr int floordiv_c(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
constexpr int ceildiv_c(int a, int b) { return -floordiv_c(-a, b); }

constexpr int kDirectRows = 4;  // output rows per thread (RB)

template <typename T, int K, int S, int P>
struct Direct {
  static constexpr int V = 4;                               // outputs per thread along a row
  static constexpr int CW = V * S;                          // the input columns under them
  static constexpr int LV = 16 / int(sizeof(T));            // elements per 16-byte vector
  static constexpr int LE = P;                              // forward: left halo columns
  static constexpr int RE = K - S - P > 0 ? K - S - P : 0;  // forward: right halo columns
  static constexpr int NL = LE + CW + RE;
  // backward: the output columns covering the CW input columns, [JL, JH] relative to V*cv;
  // the output rows covering RB*S input rows, [IL, IH] relative to RB*rb
  static constexpr int JL = ceildiv_c(P - K + 1, S), JH = floordiv_c(CW - 1 + P, S), NJ = JH - JL + 1;
  static constexpr int IL = JL, IH = floordiv_c(kDirectRows * S - 1 + P, S), NI = IH - IL + 1;
  static_assert(CW % LV == 0, "direct pool kernels: a thread's columns are whole 16-byte vectors");
  static_assert(P < K && JL <= 0 && JH >= V - 1, "direct pool kernels: window geometry");
};

// LV consecutive T from a 16-byte aligned address, as f32.
template <typename T, int LV>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float* out) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < LV; ++i) out[i] = to_f32(e[i]);
}

// Thread t -> (plane, row block, column vector); cv fastest, so a warp reads consecutive
// 16-byte vectors of a row.
struct DirectIdx {
  unsigned cv, rb, p;
};
__device__ __forceinline__ bool direct_idx(unsigned ncv, unsigned nrb, unsigned total, DirectIdx* d) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= total) return false;
  const unsigned rest = t / ncv;
  d->cv = t - rest * ncv;
  d->p = rest / nrb;
  d->rb = rest - d->p * nrb;
  return true;
}

// Max forward: per input row the first maximum over each output's window columns (value,
// column), then per output the first of those over the window rows, top to bottom; the
// K - S rows two consecutive outputs share are reduced once. The argmax is window-local
// (int8: K * K <= 9): window row * K + window column.
template <typename T, int K, int S, int P>
__global__ void __launch_bounds__(kThreads) max_fwd_direct(const T* __restrict__ x, T* __restrict__ y,
                                                           int8_t* __restrict__ am, int h, int w, int ho, int wo,
                                                           unsigned ncv, unsigned nrb, unsigned total) {
  using D = Direct<T, K, S, P>;
  constexpr int V = D::V, CW = D::CW, LV = D::LV, LE = D::LE, RE = D::RE, NL = D::NL, RB = kDirectRows;
  constexpr int KEEP = K > S ? K - S : 0;  // window rows shared with the previous output row
  DirectIdx d;
  if (!direct_idx(ncv, nrb, total, &d)) return;
  const T* xp = x + int64_t(d.p) * h * w;
  const int c0 = int(d.cv) * CW, j0 = int(d.cv) * V;
  float rv[K][V];
  int rc[K][V];
  auto reduce_row = [&](int r, float (&bv)[V], int (&bc)[V]) {
    float vals[NL];
    const bool rok = r >= 0 && r < h;
    const T* row = xp + int64_t(rok ? r : 0) * w;
#pragma unroll
    for (int q = 0; q < CW / LV; ++q) {
      if (rok && c0 + q * LV < w) {
        load_vec<T, LV>(row + c0 + q * LV, vals + LE + q * LV);
      } else {
#pragma unroll
        for (int e = 0; e < LV; ++e) vals[LE + q * LV + e] = -INFINITY;
      }
    }
#pragma unroll
    for (int e = 0; e < LE; ++e) {
      const int c = c0 - LE + e;
      vals[e] = rok && c >= 0 && c < w ? to_f32(row[c]) : -INFINITY;
    }
#pragma unroll
    for (int e = 0; e < RE; ++e) {
      const int c = c0 + CW + e;
      vals[LE + CW + e] = rok && c < w ? to_f32(row[c]) : -INFINITY;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float best = -INFINITY;
      int col = -1;
#pragma unroll
      for (int b = 0; b < K; ++b) {
        const int lc = k * S - P + b;
        const float v = vals[LE + lc];
        if (pool::beats_max(v, best)) {
          best = v;
          col = b;  // the window column
        }
      }
      bv[k] = best;
      bc[k] = col;
    }
  };
#pragma unroll
  for (int ii = 0; ii < RB; ++ii) {
    const int i = int(d.rb) * RB + ii;
    if (i >= ho) break;
    const int top = i * S - P;
    if (ii > 0) {
#pragma unroll
      for (int a = 0; a < KEEP; ++a)
#pragma unroll
        for (int k = 0; k < V; ++k) {
          rv[a][k] = rv[a + S][k];
          rc[a][k] = rc[a + S][k];
        }
    }
#pragma unroll
    for (int a = 0; a < K; ++a)
      if (ii == 0 || a >= KEEP) reduce_row(top + a, rv[a], rc[a]);
    float yv[V];
    int32_t ag[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float best = -INFINITY;
      int32_t arg = -1;
#pragma unroll
      for (int a = 0; a < K; ++a)
        if (pool::beats_max(rv[a][k], best)) {
          best = rv[a][k];
          arg = a * K + rc[a][k];
        }
      yv[k] = best;
      ag[k] = arg;
    }
    const int64_t o = (int64_t(d.p) * ho + i) * wo + j0;
    if ((wo & 3) == 0 && j0 + V <= wo) {
      store_n<T, V>(y + o, yv);
      store_arg4(am + o, ag[0], ag[1], ag[2], ag[3]);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (j0 + k < wo) {
          y[o + k] = from_f32<T>(yv[k]);
          am[o + k] = int8_t(ag[k]);
        }
    }
  }
}

// The outputs covering a backward thread's block of input: rows RB*rb + IL + [0, NI),
// columns V*cv + JL + [0, NJ); dy as f32 (0 outside the pooled plane) and, for max, the
// window-local int8 argmax as i32 (-1 outside). The thread's own V columns come as one vector where the pooled
// width is a multiple of 4 (aligned) and they lie inside it.
template <typename T, int K, int S, int P, bool ARG>
__device__ __forceinline__ void load_cover(const T* __restrict__ dyp, const int8_t* __restrict__ ap, int ho,
                                           int wo, const DirectIdx& d,
                                           float (&g)[Direct<T, K, S, P>::NI][Direct<T, K, S, P>::NJ],
                                           int32_t (&m)[Direct<T, K, S, P>::NI][Direct<T, K, S, P>::NJ]) {
  using D = Direct<T, K, S, P>;
  constexpr int V = D::V, NI = D::NI, NJ = D::NJ, JL = D::JL, IL = D::IL;
  const int jv = int(d.cv) * V;
  const bool vec = (wo & 3) == 0 && jv + V <= wo;
#pragma unroll
  for (int ii = 0; ii < NI; ++ii) {
    const int i = int(d.rb) * kDirectRows + IL + ii;
    const bool iok = i >= 0 && i < ho;
    const int64_t rowo = int64_t(iok ? i : 0) * wo;
    if (iok && vec) {
      using Raw = typename Vec4Raw<T>::type;
      const Raw raw = __ldg(reinterpret_cast<const Raw*>(dyp + rowo + jv));
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < V; ++k) g[ii][k - JL] = to_f32(e[k]);
      if (ARG) {
        const uint32_t a4 = __ldg(reinterpret_cast<const unsigned int*>(ap + rowo + jv));
#pragma unroll
        for (int k = 0; k < V; ++k) m[ii][k - JL] = int32_t(int8_t(uint8_t(a4 >> (8 * k))));
      }
    }
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      const int jr = JL + jj;
      if (iok && vec && jr >= 0 && jr < V) continue;
      const int j = jv + jr;
      const bool ok = iok && j >= 0 && j < wo;
      g[ii][jj] = ok ? to_f32(dyp[rowo + j]) : 0.f;
      if (ARG) m[ii][jj] = ok ? int32_t(__ldg(reinterpret_cast<const signed char*>(ap) + rowo + j)) : -1;
    }
  }
}

// Stores one input row's CW values (the vectors inside the row).
template <typename T, int CW, int LV>
__device__ __forceinline__ void store_row(T* __restrict__ p, int c0, int w, const float (&v)[CW]) {
#pragma unroll
  for (int q = 0; q < CW / LV; ++q)
    if (c0 + q * LV < w) {
      float part[LV];
#pragma unroll
      for (int e = 0; e < LV; ++e) part[e] = v[q * LV + e];
      store_n<T, LV>(p + c0 + q * LV, part);
    }
}

// Backward, MAX: dx[r, c] = sum of dy over the covering outputs, in increasing output
// order, whose argmax is (r, c) (the tiled kernel's and the CPU scatter's sums): the
// window-local argmax of output (ii, jj) equals a * K + b, a and b the window row and
// column that are (r, c), all compile-time constants here.
// Average (!MAX, launched for 16-bit types): dx[r, c] = (sum over the covering output rows
// of (sum over the covering output columns of dy)) * inv: the CPU kernel's order of
// additions (outputs outside the pooled plane add +0, which changes no sum).
template <typename T, int K, int S, int P, bool MAX>
__global__ void __launch_bounds__(kThreads) bwd_direct(const T* __restrict__ dy, const int8_t* __restrict__ am,
                                                       T* __restrict__ dx, int h, int w, int ho, int wo,
                                                       unsigned ncv, unsigned nrb, unsigned total, float inv) {
  using D = Direct<T, K, S, P>;
  constexpr int CW = D::CW, LV = D::LV, NI = D::NI, NJ = D::NJ, JL = D::JL, IL = D::IL, RB = kDirectRows;
  DirectIdx d;
  if (!direct_idx(ncv, nrb, total, &d)) return;
  const int64_t po = int64_t(d.p) * ho * wo;
  float g[NI][NJ];
  int32_t m[NI][NJ];
  load_cover<T, K, S, P, MAX>(dy + po, MAX ? am + po : nullptr, ho, wo, d, g, m);
  T* dxp = dx + int64_t(d.p) * h * w;
  const int c0 = int(d.cv) * CW, r0 = int(d.rb) * RB * S;
#pragma unroll
  for (int rr = 0; rr < RB * S; ++rr) {
    const int r = r0 + rr;
    if (r >= h) break;
    float out[CW];
    if constexpr (MAX) {
#pragma unroll
      for (int k = 0; k < CW; ++k) out[k] = 0.f;
#pragma unroll
      for (int ii = 0; ii < NI; ++ii) {
        const int a = rr - (IL + ii) * S + P;  // the window row of output row ii that is r
        if (a < 0 || a >= K) continue;
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          const int32_t mm = m[ii][jj];
#pragma unroll
          for (int b = 0; b < K; ++b) {
            const int lc = (JL + jj) * S - P + b;
            if (lc < 0 || lc >= CW) continue;
            if (mm == a * K + b) out[lc] += g[ii][jj];
          }
        }
      }
    } else {
#pragma unroll
      for (int lc = 0; lc < CW; ++lc) {
        float s = 0.f;
#pragma unroll
        for (int ii = 0; ii < NI; ++ii) {
          const int a = rr - (IL + ii) * S + P;
          if (a < 0 || a >= K) continue;
          float rs = 0.f;
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) {
            const int b = lc - (JL + jj) * S + P;  // the window column of output column jj that is lc
            if (b >= 0 && b < K) rs += g[ii][jj];
          }
          s += rs;
        }
        out[lc] = s * inv;
      }
    }
    store_row<T, CW, LV>(dxp + int64_t(r) * w, c0, w, out);
  }
}

// Host side of the direct kernels.
// 1: k3s2p1, 2: k2s2p0 (square windows and strides), else 0.
int direct_kind(const Geom& g) {
  if (g.kh != g.kw || g.sh != 2 || g.sw != 2 || g.ph != g.pw) return 0;
  if (g.kh == 3 && g.ph == 1) return 1;
  if (g.kh == 2 && g.ph == 0) return 2;
  return 0;
}

struct DirectGrid {
  unsigned ncv, nrb, total, blocks;
  bool ok;
};

// planes x ceil(rows / rows_per) x ceil(cols / cols_per) threads, in 32-bit indices.
DirectGrid direct_grid(int64_t planes, int64_t rows, int64_t rows_per, int64_t cols, int64_t cols_per) {
  DirectGrid g{};
  const int64_t ncv = (cols + cols_per - 1) / cols_per, nrb = (rows + rows_per - 1) / rows_per;
  const int64_t total = planes * ncv * nrb;
  if (total <= 0 || total > (int64_t(1) << 31) - kThreads) return g;
  g.ncv = unsigned(ncv);
  g.nrb = unsigned(nrb);
  g.total = unsigned(total);
  g.blocks = unsigned((total + kThreads - 1) / kThreads);
  g.ok = true;
  return g;
}

// The grid of a direct launch; ok only where the direct kernels apply: a direct geometry
// (dk != 0), aligned buffers, input rows of whole 16-byte vectors of T (w elements).
template <typename T>
DirectGrid direct_plan(int dk, bool aligned, int64_t w, int64_t planes, int64_t rows, int64_t rows_per, int64_t cols,
                       int64_t cols_per) {
  if (dk == 0 || !aligned || w % (16 / int64_t(sizeof(T))) != 0) return DirectGrid{};
  return direct_grid(planes, rows, rows_per, cols, cols_per);
}

// f(K, P) with the window and padding of direct kind dk as std::integral_constant.
template <typename F>
void with_direct_geom(int dk, F&& f) {
  if (dk == 1)
    f(std::integral_constant<int, 3>{}, std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, 2>{}, std::integral_constant<int, 0>{});
}

// ---- untiled fallback kernels ------------------------------------------------------------

// Outputs whose windows cover input coordinate n along one axis: [lo, hi) within
// [0, out), as the CPU kernel's covering(). Window i covers i*s - p + [0, k):
// i*s <= n + p and i*s >= n + p - k + 1. The unclipped bounds (first i with
// i*s >= n + p - k + 1, first i with i*s > n + p) only grow with n, so a thread walking
// down consecutive rows divides once and then steps them (Cover::advance).
struct Cover {
  int k, s, p, out;
  int first, past;  // unclipped: first covering window, one past the last
  __device__ __forceinline__ void init(int n) {
    const int top = n + p, bottom = top - k + 1;
    first = bottom <= 0 ? 0 : (bottom + s - 1) / s;
    past = top < 0 ? 0 : top / s + 1;
  }
  __device__ __forceinline__ void advance(int n) {  // n = previous n + 1
    const int top = n + p, bottom = top - k + 1;
    while (first * s < bottom) ++first;
    while (past * s <= top) ++past;
  }
  __device__ __forceinline__ int lo() const { return first; }
  __device__ __forceinline__ int hi() const {
    const int h = past < out ? past : out;
    return h < first ? first : h;
  }
};

// Work layout of the untiled kernels: blockDim (TX, TY) with TX * TY = 256 threads;
// thread x walks one column of one plane (grid.x tiles the columns), thread y takes
// kRows consecutive rows (grid.y tiles the rows), grid.z the planes (both y and z
// loop when the grid limit is reached). A warp covers 32 consecutive columns of one
// row: coalesced loads and stores. No per-element integer division.
constexpr int kRows = 8;

struct Launch {
  dim3 grid, block;
  int row_tiles;
};

Launch launch_for(int64_t planes, int64_t rows, int64_t cols) {
  const int tx = cols <= 32 ? 32 : (cols <= 64 ? 64 : 128);
  const int ty = kThreads / tx;
  const int64_t row_tiles = (rows + int64_t(ty) * kRows - 1) / (int64_t(ty) * kRows);
  Launch l;
  l.block = dim3(unsigned(tx), unsigned(ty), 1);
  l.grid = dim3(unsigned((cols + tx - 1) / tx), unsigned(std::min<int64_t>(row_tiles, 65535)),
                unsigned(std::min<int64_t>(planes, 65535)));
  l.row_tiles = int(row_tiles);
  return l;
}

struct Geom32 {
  int kh, kw, sh, sw, ph, pw;
};

// I = int32_t: flat in-plane argmax; I = int8_t: window-local.
template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) max_fwd_untiled(const T* __restrict__ x, T* __restrict__ y,
                                                           I* __restrict__ am, int64_t planes, int h, int w,
                                                           int ho, int wo, Geom32 g, int row_tiles) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= wo) return;  // no barriers below
  const int cs = j * g.sw - g.pw;
  const int c0 = cs > 0 ? cs : 0, c1 = cs + g.kw < w ? cs + g.kw : w;
  for (int64_t p = blockIdx.z; p < planes; p += gridDim.z) {
    const T* xp = x + p * int64_t(h) * w;
    T* yp = y + p * int64_t(ho) * wo;
    I* ap = am + p * int64_t(ho) * wo;
    for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
      const int i_begin = (rt * int(blockDim.y) + int(threadIdx.y)) * kRows;
      const int i_end = i_begin + kRows < ho ? i_begin + kRows : ho;
      for (int i = i_begin; i < i_end; ++i) {
        const int rs = i * g.sh - g.ph;
        const int r0 = rs > 0 ? rs : 0, r1 = rs + g.kh < h ? rs + g.kh : h;
        float best = -INFINITY;
        int64_t arg = -1;
        int loc = -1;
        for (int r = r0; r < r1; ++r) {
          const T* row = xp + int64_t(r) * w;
          for (int c = c0; c < c1; ++c) {
            const float v = to_f32(row[c]);
            if (pool::beats_max(v, best)) {
              best = v;
              arg = int64_t(r) * w + c;
              loc = (r - rs) * g.kw + (c - cs);
            }
          }
        }
        const int64_t o = int64_t(i) * wo + j;
        yp[o] = arg >= 0 ? xp[arg] : from_f32<T>(best);
        ap[o] = sizeof(I) == 1 ? I(loc) : I(arg);
      }
    }
  }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) max_bwd_untiled(const T* __restrict__ dy, const I* __restrict__ am,
                                                           T* __restrict__ dx, int64_t planes, int h, int w, int ho,
                                                           int wo, Geom32 g, int row_tiles) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= w) return;
  Cover cc{g.kw, g.sw, g.pw, wo};
  cc.init(c);
  const int j0 = cc.lo(), j1 = cc.hi();
  for (int64_t p = blockIdx.z; p < planes; p += gridDim.z) {
    const T* dyp = dy + p * int64_t(ho) * wo;
    const I* ap = am + p * int64_t(ho) * wo;
    T* dxp = dx + p * int64_t(h) * w;
    for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
      const int r_begin = (rt * int(blockDim.y) + int(threadIdx.y)) * kRows;
      const int r_end = r_begin + kRows < h ? r_begin + kRows : h;
      Cover rc{g.kh, g.sh, g.ph, ho};
      rc.init(r_begin);
      for (int r = r_begin; r < r_end; ++r) {
        if (r > r_begin) rc.advance(r);
        const int i0 = rc.lo(), i1 = rc.hi();
        float acc = 0.f;
        if constexpr (sizeof(I) == 1) {  // window-local: (r - i*sh + ph) * kw + (c - j*sw + pw)
          for (int i = i0; i < i1; ++i) {
            const int base = (r - i * g.sh + g.ph) * g.kw + c + g.pw;
            for (int j = j0; j < j1; ++j) {
              const int64_t o = int64_t(i) * wo + j;
              if (int(__ldg(ap + o)) == base - j * g.sw) acc += to_f32(dyp[o]);
            }
          }
        } else {
          const int32_t me = int32_t(int64_t(r) * w + c);
          for (int i = i0; i < i1; ++i)
            for (int j = j0; j < j1; ++j) {
              const int64_t o = int64_t(i) * wo + j;
              if (__ldg(ap + o) == me) acc += to_f32(dyp[o]);
            }
        }
        dxp[int64_t(r) * w + c] = from_f32<T>(acc);
      }
    }
  }
}


template <typename T>
__global__ void __launch_bounds__(kThreads) avg_bwd_untiled(const T* __restrict__ dy, T* __restrict__ dx,
                                                            int64_t planes, int h, int w, int ho, int wo, Geom32 g,
                                                            int row_tiles, float inv) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= w) return;
  Cover cc{g.kw, g.sw, g.pw, wo};
  cc.init(c);
  const int j0 = cc.lo(), j1 = cc.hi();
  for (int64_t p = blockIdx.z; p < planes; p += gridDim.z) {
    const T* dyp = dy + p * int64_t(ho) * wo;
    T* dxp = dx + p * int64_t(h) * w;
    for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
      const int r_begin = (rt * int(blockDim.y) + int(threadIdx.y)) * kRows;
      const int r_end = r_begin + kRows < h ? r_begin + kRows : h;
      Cover rc{g.kh, g.sh, g.ph, ho};
      rc.init(r_begin);
      for (int r = r_begin; r < r_end; ++r) {
        if (r > r_begin) rc.advance(r);
        float s = 0.f;
        for (int i = rc.lo(); i < rc.hi(); ++i) {
          float rs = 0.f;
          for (int j = j0; j < j1; ++j) rs += to_f32(dyp[int64_t(i) * wo + j]);
          s += rs;
        }
        dxp[int64_t(r) * w + c] = from_f32<T>(s * inv);
      }
    }
  }
}

// The kernels index within a plane with 32-bit coordinates: every extent, padded
// extent, window and stride must stay below 2^30 (sums of two stay below 2^31).
ffi::Error check_extents(const char* who, const PlaneView& v, int64_t ho, int64_t wo, const Geom& g) {
  const int64_t lim = int64_t(1) << 30;
  if (v.h + 2 * g.ph >= lim || v.w + 2 * g.pw >= lim || ho >= lim || wo >= lim || g.kh >= lim || g.kw >= lim ||
      g.sh >= lim || g.sw >= lim)
    return invalid(std::string(who) + " (cuda): plane extents, padding, window and stride must be below 2^30");
  return ffi::Error::Success();
}

Geom32 geom32(const Geom& g) {
  return {int(g.kh), int(g.kw), int(g.sh), int(g.sw), int(g.ph), int(g.pw)};
}

// Backward plans: output dx rows (in_h = ho dy rows staged), cover maps.
TilePlan plan_backward(const PlaneView& v, int64_t ho, int64_t wo, const Geom& g, int per, int aux) {
  const AxisMap rm{int(g.kh), int(g.sh), int(g.ph), int(ho), true};
  const AxisMap cm{int(g.kw), int(g.sw), int(g.pw), int(wo), true};
  return plan_tiles(v.planes, int(ho), int(wo), int(v.h), int(v.w), per, aux, rm, cm, [&](int64_t rb) {
    return std::min<int64_t>(ho, (rb + g.kh - 2) / g.sh + 1);
  });
}

ffi::Error MaxPoolFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> argmax, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                          int64_t ph, int64_t pw) {
  PoolShape s{};
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = pool::check_max_fwd(x, *y, *argmax, g, &s); e.failure()) return e;
  const PlaneView v = s.v;
  const int64_t ho = s.ho, wo = s.wo;
  if (v.planes == 0 || ho == 0 || wo == 0) return ffi::Error::Success();
  if (auto e = check_extents("max_pool2d", v, ho, wo, g); e.failure()) return e;
  const AxisMap rm{int(kh), int(sh), int(ph), int(v.h), false};
  const AxisMap cm{int(kw), int(sw), int(pw), int(v.w), false};
  const TilePlan plan = plan_tiles(v.planes, int(v.h), int(v.w), int(ho), int(wo), 4, 8, rm, cm, [&](int64_t rb) {
    return std::min<int64_t>(v.h, (rb - 1) * sh + kh);
  });
  const bool aligned = aligned16(x.untyped_data()) && aligned16(y->untyped_data()) &&
                       aligned16(argmax->untyped_data());
  const bool tiled = plan.ok && aligned;
  const int dk = direct_kind(g);
  const bool local = pool::local_argmax(g);  // the direct geometries (k <= 3) are always local
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    T* yp = static_cast<T*>(y->untyped_data());
    auto run = [&](auto* ap) {
      using I = std::remove_pointer_t<decltype(ap)>;
      const DirectGrid dg = direct_plan<T>(std::is_same_v<I, int8_t> ? dk : 0, aligned, v.w, v.planes, ho,
                                           kDirectRows, wo, Direct<T, 3, 2, 1>::V);
      if constexpr (std::is_same_v<I, int8_t>) {
        if (dg.ok) {
          with_direct_geom(dk, [&](auto K, auto P) {
            max_fwd_direct<T, decltype(K)::value, 2, decltype(P)::value><<<dg.blocks, kThreads, 0, stream>>>(
                xp, yp, ap, int(v.h), int(v.w), int(ho), int(wo), dg.ncv, dg.nrb, dg.total);
          });
          return;
        }
      }
      if (tiled) {
        max_fwd_tiled<T, I><<<plan.grid, kThreads, plan.smem, stream>>>(xp, yp, ap, plan.args);
      } else {
        const Launch l = launch_for(v.planes, ho, wo);
        max_fwd_untiled<T, I><<<l.grid, l.block, 0, stream>>>(xp, yp, ap, v.planes, int(v.h), int(v.w), int(ho),
                                                               int(wo), geom32(g), l.row_tiles);
      }
    };
    if (local)
      run(static_cast<int8_t*>(argmax->untyped_data()));
    else
      run(static_cast<int32_t*>(argmax->untyped_data()));
  });
  if (!ok) return invalid("max_pool2d (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return check_launch("max_pool2d (cuda) forward launch");
}

ffi::Error MaxPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer argmax,
                          ffi::Result<ffi::AnyBuffer> dx, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                          int64_t pw) {
  PoolShape s{};
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = pool::check_max_bwd(dy, argmax, *dx, g, &s); e.failure()) return e;
  const PlaneView v = s.v;
  const int64_t ho = s.ho, wo = s.wo;
  if (v.planes == 0 || v.h == 0 || v.w == 0) return ffi::Error::Success();
  if (auto e = check_extents("max_pool2d backward", v, ho, wo, g); e.failure()) return e;
  const TilePlan plan = plan_backward(v, ho, wo, g, 8, 0);
  const bool aligned = aligned16(dy.untyped_data()) && aligned16(argmax.untyped_data()) &&
                       aligned16(dx->untyped_data());
  const bool tiled = plan.ok && aligned;
  const int dk = direct_kind(g);
  const bool local = pool::local_argmax(g);
  bool ok = dispatch(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    auto run = [&](const auto* ap) {
      using I = std::remove_cv_t<std::remove_pointer_t<decltype(ap)>>;
      const DirectGrid dg = direct_plan<T>(std::is_same_v<I, int8_t> ? dk : 0, aligned, v.w, v.planes, v.h,
                                           kDirectRows * 2, v.w, Direct<T, 3, 2, 1>::CW);
      if constexpr (std::is_same_v<I, int8_t>) {
        if (dg.ok) {
          with_direct_geom(dk, [&](auto K, auto P) {
            bwd_direct<T, decltype(K)::value, 2, decltype(P)::value, true><<<dg.blocks, kThreads, 0, stream>>>(
                dyp, ap, dxp, int(v.h), int(v.w), int(ho), int(wo), dg.ncv, dg.nrb, dg.total, 0.f);
          });
          return;
        }
      }
      if (tiled) {
        max_bwd_tiled<T, I><<<plan.grid, kThreads, plan.smem, stream>>>(dyp, ap, dxp, plan.args);
      } else {
        const Launch l = launch_for(v.planes, v.h, v.w);
        max_bwd_untiled<T, I><<<l.grid, l.block, 0, stream>>>(dyp, ap, dxp, v.planes, int(v.h), int(v.w), int(ho),
                                                               int(wo), geom32(g), l.row_tiles);
      }
    };
    if (local)
      run(static_cast<const int8_t*>(argmax.untyped_data()));
    else
      run(static_cast<const int32_t*>(argmax.untyped_data()));
  });
  if (!ok) return invalid("max_pool2d backward (cuda): unsupported dtype " + dtype_name(dy.element_type()));
  return check_launch("max_pool2d (cuda) backward launch");
}

ffi::Error AvgPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, int64_t kh,
                          int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  PoolShape s{};
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = pool::check_avg_bwd(dy, *dx, g, &s); e.failure()) return e;
  const PlaneView v = s.v;
  const int64_t ho = s.ho, wo = s.wo;
  if (v.planes == 0 || v.h == 0 || v.w == 0) return ffi::Error::Success();
  if (auto e = check_extents("avg_pool2d backward", v, ho, wo, g); e.failure()) return e;
  const float inv = 1.0f / float(kh * kw);  // as the CPU kernel: A(1) / A(kh * kw)
  const TilePlan plan = plan_backward(v, ho, wo, g, 4, 4);
  const bool aligned = aligned16(dy.untyped_data()) && aligned16(dx->untyped_data());
  const bool tiled = plan.ok && aligned;
  const int dk = direct_kind(g);
  bool ok = dispatch(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    // the direct average backward for 16-bit types only: in f32 it did not beat the tiled
    // kernel in an H200 A/B
    if constexpr (sizeof(T) == 2) {
      const DirectGrid dg =
          direct_plan<T>(dk, aligned, v.w, v.planes, v.h, kDirectRows * 2, v.w, Direct<T, 3, 2, 1>::CW);
      if (dg.ok) {
        with_direct_geom(dk, [&](auto K, auto P) {
          bwd_direct<T, decltype(K)::value, 2, decltype(P)::value, false><<<dg.blocks, kThreads, 0, stream>>>(
              dyp, nullptr, dxp, int(v.h), int(v.w), int(ho), int(wo), dg.ncv, dg.nrb, dg.total, inv);
        });
        return;
      }
    }
    if (tiled) {
      avg_bwd_tiled<T><<<plan.grid, kThreads, plan.smem, stream>>>(dyp, dxp, plan.args, inv);
    } else {
      const Launch l = launch_for(v.planes, v.h, v.w);
      avg_bwd_untiled<T><<<l.grid, l.block, 0, stream>>>(dyp, dxp, v.planes, int(v.h), int(v.w), int(ho), int(wo),
                                                          geom32(g), l.row_tiles, inv);
    }
  });
  if (!ok) return invalid("avg_pool2d backward (cuda): unsupported dtype " + dtype_name(dy.element_type()));
  return check_launch("avg_pool2d (cuda) backward launch");
}

}  // namespace

// Command-buffer compatible: kernel launches on XLA's stream only, launch shapes from the
// buffer shapes and the geometry attributes.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxMaxPool2dFwdCuda, MaxPoolFwdImpl,
                              pool::bind_geometry(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // argmax
                              ),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxMaxPool2dBwdCuda, MaxPoolBwdImpl,
                              pool::bind_geometry(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // argmax
                                  .Ret<ffi::AnyBuffer>()  // dx
                              ),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAvgPool2dBwdCuda, AvgPoolBwdImpl,
                              pool::bind_geometry(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                              ),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_max_pool2d_fwd", RlxMaxPool2dFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_max_pool2d_bwd", RlxMaxPool2dBwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_avg_pool2d_bwd", RlxAvgPool2dBwdCuda);

}  // namespace cuda
}  // namespace rlx
