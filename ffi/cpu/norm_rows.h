// Row primitives of the normalisation kernels (layer_norm.cc, group_norm.cc,
// batch_norm.cc): lane-parallel sums written with GCC/Clang vector extensions, and
// f32 views of bf16/f16 rows. bf16 rows are widened and rounded back in 16-element
// blocks (bf16_to_f32 / store_bf16 of rowwise.h: integer shift in, round to nearest
// even out, AVX-512 or AVX2 picked at run time), the same values as load / store.
//
// Sums run on two vector accumulators (8 f32 lanes, or 4 f64 lanes), element j going
// to lane j mod lanes, the tail to lanes 0, 1, ... in order, and the lanes are then
// added pairwise. The order is fixed by the data size alone, so results do not depend
// on threads, and the loops vectorise without -ffast-math (plain `acc += ...` loops do
// not: the compiler may not reorder float additions). Elementwise loops elsewhere are
// `#pragma omp simd` loops (the build passes -fopenmp-simd) with restrict pointers.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/common.h"
#include "cpu/rowwise.h"

namespace rlx {
namespace norm {

typedef float v4f __attribute__((vector_size(16)));
typedef double v2d __attribute__((vector_size(16)));

template <typename A> struct Vec;
template <> struct Vec<float> { using V = v4f; static constexpr int kWidth = 4; };
template <> struct Vec<double> { using V = v2d; static constexpr int kWidth = 2; };

template <typename A>
inline typename Vec<A>::V vload(const A* p) {
  typename Vec<A>::V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Adds the two accumulators' lanes and the tail lanes in a fixed order.
template <typename A>
inline A finish(const typename Vec<A>::V& a0, const typename Vec<A>::V& a1, const A* tail) {
  constexpr int W = Vec<A>::kWidth, L = 2 * W;
  A lanes[L];
  std::memcpy(lanes, &a0, sizeof a0);
  std::memcpy(lanes + W, &a1, sizeof a1);
  for (int k = 0; k < L; ++k) lanes[k] += tail[k];
  for (int w = L / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) lanes[k] += lanes[k + w];
  return lanes[0];
}

// sum_j x_j
template <typename A>
inline A sum(const A* __restrict x, int64_t n) {
  using V = typename Vec<A>::V;
  constexpr int W = Vec<A>::kWidth, L = 2 * W;
  V a0 = {}, a1 = {};
  int64_t j = 0;
  for (; j + L <= n; j += L) { a0 += vload(x + j); a1 += vload(x + j + W); }
  A tail[L] = {};
  for (int k = 0; j < n; ++j, ++k) tail[k] = x[j];
  return finish<A>(a0, a1, tail);
}

// sum_j (x_j - mu)^2
template <typename A>
inline A sq_dev(const A* __restrict x, A mu, int64_t n) {
  using V = typename Vec<A>::V;
  constexpr int W = Vec<A>::kWidth, L = 2 * W;
  V a0 = {}, a1 = {};
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const V d0 = vload(x + j) - mu, d1 = vload(x + j + W) - mu;
    a0 += d0 * d0;
    a1 += d1 * d1;
  }
  A tail[L] = {};
  for (int k = 0; j < n; ++j, ++k) tail[k] = (x[j] - mu) * (x[j] - mu);
  return finish<A>(a0, a1, tail);
}

// (sum_j u_j, sum_j u_j (x_j - mu)) with u_j = dy_j * g_j, or u_j = dy_j when g is null.
template <typename A>
inline void dy_sums(const A* __restrict x, const A* __restrict dy, const A* __restrict g, A mu,
                    int64_t n, A& s_u, A& s_ux) {
  using V = typename Vec<A>::V;
  constexpr int W = Vec<A>::kWidth, L = 2 * W;
  V a0 = {}, a1 = {}, b0 = {}, b1 = {};
  A ta[L] = {}, tb[L] = {};
  int64_t j = 0;
  if (g != nullptr) {
    for (; j + L <= n; j += L) {
      const V u0 = vload(dy + j) * vload(g + j), u1 = vload(dy + j + W) * vload(g + j + W);
      a0 += u0;
      a1 += u1;
      b0 += u0 * (vload(x + j) - mu);
      b1 += u1 * (vload(x + j + W) - mu);
    }
    for (int k = 0; j < n; ++j, ++k) { ta[k] = dy[j] * g[j]; tb[k] = ta[k] * (x[j] - mu); }
  } else {
    for (; j + L <= n; j += L) {
      const V u0 = vload(dy + j), u1 = vload(dy + j + W);
      a0 += u0;
      a1 += u1;
      b0 += u0 * (vload(x + j) - mu);
      b1 += u1 * (vload(x + j + W) - mu);
    }
    for (int k = 0; j < n; ++j, ++k) { ta[k] = dy[j]; tb[k] = ta[k] * (x[j] - mu); }
  }
  s_u = finish<A>(a0, a1, ta);
  s_ux = finish<A>(b0, b1, tb);
}

// Accumulation-type views of rows stored as T: for T == A the row itself, otherwise a
// converted copy in this object's scratch (one per task; `slot` picks the buffer).
template <typename T, typename A>
class Rows {
 public:
  Rows(int64_t width, int slots) : width_(width) {
    if (!std::is_same<T, A>::value) buf_.resize(static_cast<size_t>(width * slots));
  }
  const A* in(const T* row, int slot) {
    if constexpr (std::is_same<T, A>::value) {
      return row;
    } else {
      A* dst = buf_.data() + slot * width_;
      if constexpr (std::is_same<T, bf16>::value && std::is_same<A, float>::value) {
        bf16_to_f32(row, dst, width_);
        return dst;
      }
      A* __restrict d = dst;
#pragma omp simd
      for (int64_t j = 0; j < width_; ++j) d[j] = load<A>(row[j]);
      return dst;
    }
  }
  // Where to write an output row of A values; `commit` then stores it as T.
  A* out(T* row, int slot) {
    if constexpr (std::is_same<T, A>::value) {
      return row;
    } else {
      return buf_.data() + slot * width_;
    }
  }
  void commit(T* row, int slot) {
    if constexpr (!std::is_same<T, A>::value) {
      const A* src = buf_.data() + slot * width_;
      if constexpr (std::is_same<T, bf16>::value && std::is_same<A, float>::value) {
        store_bf16(src, row, width_);
        return;
      }
#pragma omp simd
      for (int64_t j = 0; j < width_; ++j) row[j] = store<T>(src[j]);
    }
  }

 private:
  int64_t width_;
  std::vector<A> buf_;
};

}  // namespace norm
}  // namespace rlx
