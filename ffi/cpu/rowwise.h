// Row helpers of the softmax-type kernels (softmax, softmax cross-entropy): f32 views
// of bf16/f16 rows, a vectorised float exp and the row loops built on it. Written
// with GCC/Clang vector extensions (8 float lanes): each row loop is compiled twice,
// for x86-64-v3 (AVX2 + FMA) and for the baseline ISA (two SSE halves per vector),
// and the clone is picked at load time by CPU features (an "arch=haswell" clone
// would be picked by CPU model, i.e. never on newer CPUs), so the module stays
// portable. Summation order is fixed (8 lanes, then the lanes in
// order), so results are deterministic on a given ISA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/common.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors stay inside always-inlined helpers

namespace rlx {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define RLX_ROW_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))

inline __attribute__((always_inline)) v8f v8_load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline __attribute__((always_inline)) void v8_store(float* p, const v8f& v) { std::memcpy(p, &v, sizeof v); }
inline __attribute__((always_inline)) v8f v8_splat(float s) { return v8f{s, s, s, s, s, s, s, s}; }
inline __attribute__((always_inline)) float v8_hsum(const v8f& v) {
  float s = 0.0f;
  for (int k = 0; k < 8; ++k) s += v[k];
  return s;
}
inline __attribute__((always_inline)) float v8_hmax(const v8f& v) {
  float m = v[0];
  for (int k = 1; k < 8; ++k) m = v[k] > m ? v[k] : m;
  return m;
}

// exp(x), 8 lanes: Cody-Waite reduction x = n ln2 + r with |r| <= ln2/2, a degree-6
// polynomial for e^r (Cephes coefficients; max relative error about 1e-7 against
// double exp) and 2^n built from exponent bits. x < -87.33 (including -inf) gives
// exactly 0; x is clamped at 88 so finite x gives a finite result; NaN propagates.
inline __attribute__((always_inline)) v8f vexp8(const v8f& x) {
  const v8f lo = v8_splat(-87.3365447505531f), hi = v8_splat(88.0f);
  v8f xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  const v8f magic = v8_splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8f n = (xc * 1.44269504088896341f + magic) - magic;
  v8f r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v8f p = v8_splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &e, sizeof scale);
  v8f v = p * scale;
  return x < lo ? v8_splat(0.0f) : v;
}

// Scalar exp with the same formula (row tails).
inline float vexp1(float x) {
  v8f v = vexp8(v8_splat(x));
  return v[0];
}

// max_j x[j] (-inf for n == 0).
[[maybe_unused]] RLX_ROW_CLONES static float row_max(const float* x, int64_t n) {
  v8f a = v8_splat(-INFINITY), b = a;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    v8f u = v8_load(x + j), w = v8_load(x + j + 8);
    a = u > a ? u : a;
    b = w > b ? w : b;
  }
  a = b > a ? b : a;
  float m = v8_hmax(a);
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// sum_j exp(x[j] - shift); when out != nullptr also out[j] = exp(x[j] - shift).
[[maybe_unused]] RLX_ROW_CLONES static float exp_shift_sum(const float* x, float shift, float* out, int64_t n) {
  v8f acc = v8_splat(0.0f);
  const v8f sh = v8_splat(shift);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f e = vexp8(v8_load(x + j) - sh);
    if (out) v8_store(out + j, e);
    acc += e;
  }
  float s = v8_hsum(acc);
  for (; j < n; ++j) {
    float e = vexp1(x[j] - shift);
    if (out) out[j] = e;
    s += e;
  }
  return s;
}

// out[j] = exp(x[j] - shift) * scale
[[maybe_unused]] RLX_ROW_CLONES static void exp_shift_scale(const float* x, float shift, float scale, float* out,
                                           int64_t n) {
  const v8f sh = v8_splat(shift), sc = v8_splat(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) v8_store(out + j, vexp8(v8_load(x + j) - sh) * sc);
  for (; j < n; ++j) out[j] = vexp1(x[j] - shift) * scale;
}

// out[j] *= scale
[[maybe_unused]] RLX_ROW_CLONES static void scale_row(float* out, float scale, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] *= scale;
}

// sum_j a[j] * b[j]
[[maybe_unused]] RLX_ROW_CLONES static float row_dot(const float* a, const float* b, int64_t n) {
  v8f acc = v8_splat(0.0f), acc2 = acc;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    acc += v8_load(a + j) * v8_load(b + j);
    acc2 += v8_load(a + j + 8) * v8_load(b + j + 8);
  }
  float s = v8_hsum(acc + acc2);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// out[j] = y[j] * (dy[j] - dot)   (softmax backward)
[[maybe_unused]] RLX_ROW_CLONES static void softmax_bwd_row(const float* y, const float* dy, float dot, float* out,
                                           int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = y[j] * (dy[j] - dot);
}

// ---- f32 views of rows -------------------------------------------------------
// f32 rows are used in place; bf16/f16 rows are converted into a scratch row.
template <typename T>
inline const float* row_as_f32(const T* src, float* scratch, int64_t n) {
  for (int64_t j = 0; j < n; ++j) scratch[j] = load<float>(src[j]);
  return scratch;
}
template <>
inline const float* row_as_f32<float>(const float* src, float*, int64_t) { return src; }

// Where a row result is computed: in place for f32, else in a scratch row that
// store_row then rounds into the output.
template <typename T>
inline float* out_row_f32(T*, float* scratch) { return scratch; }
template <>
inline float* out_row_f32<float>(float* dst, float*) { return dst; }

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = store<T>(src[j]);
}
template <>
inline void store_row<float>(const float*, float*, int64_t) {}

}  // namespace rlx
