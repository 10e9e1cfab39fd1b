// Row helpers of the softmax-type kernels (softmax, softmax cross-entropy): f32 views
// of bf16/f16 rows, a vectorised float exp and the row loops built on it. Written
// with GCC/Clang vector extensions (8 float lanes): each row loop is compiled twice,
// for x86-64-v3 (AVX2 + FMA) and for the baseline ISA (two SSE halves per vector),
// and the clone is picked at load time by CPU features (an "arch=haswell" clone
// would be picked by CPU model, i.e. never on newer CPUs), so the module stays
// portable. Summation order is fixed (8 lanes, then the lanes in
// order), so results are deterministic on a given ISA. exp_shift_sum16 (the
// cross-entropy rows) adds a body of 16-lane vectors for AVX-512 CPUs, picked at run
// time by CPU features, with the same values as its 8-lane body.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
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

// exp(x), lane-wise on a vector V of floats (I: the int32 vector of the same lanes):
// Cody-Waite reduction x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r
// (Cephes coefficients; max relative error about 1e-7 against double exp) and 2^n
// built from exponent bits. x < -87.33 (including -inf) gives exactly 0; x is clamped
// at 88 so finite x gives a finite result; NaN propagates. Every lane sees the same
// operations, so a lane's value does not depend on the vector width.
template <typename V, typename I>
inline __attribute__((always_inline)) V vexp_lanes(const V& x) {
  const V zero = V{} + 0.0f;
  const V lo = zero + -87.3365447505531f, hi = zero + 88.0f;
  V xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  const V magic = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  V n = (xc * 1.44269504088896341f + magic) - magic;
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I e = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  static_assert(sizeof scale == sizeof e, "float and int32 vectors of the same lanes");
  std::memcpy(&scale, &e, sizeof scale);
  V v = p * scale;
  return x < lo ? zero : v;
}

// exp(x), 8 lanes.
inline __attribute__((always_inline)) v8f vexp8(const v8f& x) { return vexp_lanes<v8f, v8i>(x); }

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

// ---- exp-sum over 16-float blocks, AVX-512 where the CPU has it ------------------
// exp_shift_sum16(x, shift, out, n): the same as exp_shift_sum (sum_j exp(x[j] - shift),
// out[j] = exp(x[j] - shift) when out != nullptr) but summed in 16 lanes: lane k holds
// the elements j = 16 i + k, the lanes are then added in order 0..15, the tail (n mod
// 16 elements) last, in order. On a CPU with AVX-512 (x86-64-v4: F, BW, CD, DQ, VL)
// one 16-lane vector per block; elsewhere two 8-lane halves in the row clones. Both
// bodies do the same operations in the same order (FMA on both), so AVX2 and AVX-512
// machines give bitwise the same values; only the baseline (SSE2, no FMA) clone
// rounds differently. The exp is the cost of the softmax-type rows (about 0.7 ns per
// element and core with 8 lanes), which the 16-lane body about halves.
// `next` (optional): the next row, of elements of next_elem bytes, prefetched into L2
// (one prefetch per 16 elements, at byte offset j * next_elem) while this row's exp
// runs from cache, so that the row after is read from memory during the exp work
// instead of in a separate, memory-bound pass of its own. Prefetches do not change
// any value.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// Tail elements one at a time through the 8-lane exp, inlined into each body (so every
// body evaluates it with its own FMA code, as its vector loop), added to s in order.
inline __attribute__((always_inline)) float exp_tail_sum(const float* x, float shift, float* out, int64_t n,
                                                         float s) {
  for (int64_t j = 0; j < n; ++j) {
    const float e = vexp8(v8_splat(x[j] - shift))[0];
    if (out) out[j] = e;
    s += e;
  }
  return s;
}

[[maybe_unused]] RLX_ROW_CLONES static float exp_shift_sum16_v8(const float* x, float shift, float* out,
                                                              int64_t n, const char* next, int64_t next_elem) {
  v8f lo = v8_splat(0.0f), hi = lo;  // lanes 0..7 and 8..15 of each 16-block
  const v8f sh = v8_splat(shift);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    if (next) __builtin_prefetch(next + j * next_elem, 0, 2);
    v8f e = vexp8(v8_load(x + j) - sh), f = vexp8(v8_load(x + j + 8) - sh);
    if (out) {
      v8_store(out + j, e);
      v8_store(out + j + 8, f);
    }
    lo += e;
    hi += f;
  }
  float s = 0.0f;
  for (int k = 0; k < 8; ++k) s += lo[k];
  for (int k = 0; k < 8; ++k) s += hi[k];
  return exp_tail_sum(x + j, shift, out ? out + j : nullptr, n - j, s);
}

[[maybe_unused]] __attribute__((target("arch=x86-64-v4"))) static float exp_shift_sum16_v16(
    const float* x, float shift, float* out, int64_t n, const char* next, int64_t next_elem) {
  v16f acc = v16f{} + 0.0f;
  const v16f sh = v16f{} + shift;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    if (next) __builtin_prefetch(next + j * next_elem, 0, 2);
    v16f v;
    std::memcpy(&v, x + j, sizeof v);
    v16f e = vexp_lanes<v16f, v16i>(v - sh);
    if (out) std::memcpy(out + j, &e, sizeof e);
    acc += e;
  }
  float s = 0.0f;
  for (int k = 0; k < 16; ++k) s += acc[k];
  return exp_tail_sum(x + j, shift, out ? out + j : nullptr, n - j, s);
}

// Whether the CPU (and the OS, which libgcc checks through XCR0) runs x86-64-v4 code.
// RLX_JAX_CPU_NO_AVX512=1 in the environment (read once) takes the 8-lane body instead:
// for comparing the two bodies on one machine (they give the same bits).
inline bool cpu_has_x86_64_v4() {
  static const bool yes = [] {
    const char* off = std::getenv("RLX_JAX_CPU_NO_AVX512");
    if (off && off[0] && off[0] != '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}

[[maybe_unused]] static float exp_shift_sum16(const float* x, float shift, float* out, int64_t n,
                                              const void* next = nullptr, int64_t next_elem = 4) {
  const char* nx = static_cast<const char*>(next);
  return cpu_has_x86_64_v4() ? exp_shift_sum16_v16(x, shift, out, n, nx, next_elem)
                             : exp_shift_sum16_v8(x, shift, out, n, nx, next_elem);
}

// ---- 16-element blocks of bf16 / f32 rows -----------------------------------------
// A block of 16 f32 lanes is a V: v16f (one zmm) in the bodies compiled for x86-64-v4,
// P16 (two v8f halves: two ymm in the x86-64-v3 clone, four xmm in the baseline clone)
// in the row clones. (A v16f in an AVX2 function is split by the compiler through the
// stack, 5x slower; P16 keeps the halves in registers.) ld16<V>(p): 16 consecutive
// elements as f32 (bf16: the bits shifted up by 16, exact); st16(p, v): stored as the
// row's type (bf16: round to nearest even, NaN stays a quiet NaN: the bits of
// from_f32_bf16 in common.h). The conversions are integer shifts and masks, a few
// instructions per 16 elements instead of a scalar conversion per element. Each row
// function built on them has a _v16 body (x86-64-v4, V = v16f) and a _v8 body (the row
// clones, V = P16) around one always-inlined template, and picks one by
// cpu_has_x86_64_v4() (RLX_JAX_CPU_NO_AVX512=1 takes the clones). Lane k of a block
// sees the same operations in both, and both contract a * b + c into one FMA, so the
// AVX-512 and AVX2 bodies give the same bits; the baseline clone (no FMA) rounds
// differently.
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

#define RLX_ROW_INLINE inline __attribute__((always_inline))
#define RLX_ROW_V4 __attribute__((target("arch=x86-64-v4")))

struct P16 { v8f lo, hi; };
RLX_ROW_INLINE P16 operator+(const P16& a, const P16& b) { return {a.lo + b.lo, a.hi + b.hi}; }
RLX_ROW_INLINE P16 operator-(const P16& a, const P16& b) { return {a.lo - b.lo, a.hi - b.hi}; }
RLX_ROW_INLINE P16 operator*(const P16& a, const P16& b) { return {a.lo * b.lo, a.hi * b.hi}; }
RLX_ROW_INLINE P16& operator+=(P16& a, const P16& b) { a = a + b; return a; }

template <typename V> RLX_ROW_INLINE V splat16(float s);
template <> RLX_ROW_INLINE v16f splat16<v16f>(float s) {  // (not v16f{} + s: 0 + -0 is +0)
  return v16f{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
}
template <> RLX_ROW_INLINE P16 splat16<P16>(float s) { return {v8_splat(s), v8_splat(s)}; }

template <typename V> RLX_ROW_INLINE V ld16(const float* p);
template <> RLX_ROW_INLINE v16f ld16<v16f>(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <> RLX_ROW_INLINE P16 ld16<P16>(const float* p) { return {v8_load(p), v8_load(p + 8)}; }

template <typename V> RLX_ROW_INLINE V ld16(const bf16* p);
template <> RLX_ROW_INLINE v16f ld16<v16f>(const bf16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  const v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
RLX_ROW_INLINE v8f bf16x8_to_f32(const bf16* p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
template <> RLX_ROW_INLINE P16 ld16<P16>(const bf16* p) { return {bf16x8_to_f32(p), bf16x8_to_f32(p + 8)}; }

RLX_ROW_INLINE void st16(float* p, const v16f& v) { std::memcpy(p, &v, sizeof v); }
RLX_ROW_INLINE void st16(float* p, const P16& v) {
  v8_store(p, v.lo);
  v8_store(p + 8, v.hi);
}
// round to nearest even, NaN -> quiet NaN (from_f32_bf16), lane-wise on uint32 bits
template <typename U>
RLX_ROW_INLINE U bf16_round_bits(const U& u) {
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const U quiet_nan = (u >> 16) | 0x40u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}
RLX_ROW_INLINE void st16(bf16* p, const v16f& v) {
  v16u u;
  std::memcpy(&u, &v, sizeof u);
  const v16h h = __builtin_convertvector(bf16_round_bits(u), v16h);
  std::memcpy(p, &h, sizeof h);
}
RLX_ROW_INLINE void f32x8_to_bf16(bf16* p, const v8f& v) {
  v8u u;
  std::memcpy(&u, &v, sizeof u);
  const v8h h = __builtin_convertvector(bf16_round_bits(u), v8h);
  std::memcpy(p, &h, sizeof h);
}
RLX_ROW_INLINE void st16(bf16* p, const P16& v) {
  f32x8_to_bf16(p, v.lo);
  f32x8_to_bf16(p + 8, v.hi);
}

RLX_ROW_INLINE v16f max16(const v16f& a, const v16f& b) { return b > a ? b : a; }
RLX_ROW_INLINE P16 max16(const P16& a, const P16& b) {
  return {b.lo > a.lo ? b.lo : a.lo, b.hi > a.hi ? b.hi : a.hi};
}
// Row tails: 16 elements at p (m <= 16 of them real) as f32 lanes, lanes m..15 set to
// `pad`; the first m lanes of v stored at p as T.
template <typename V, typename T>
RLX_ROW_INLINE V ld16_pad(const T* p, int64_t m, float pad) {
  float t[16];
  for (int64_t k = 0; k < 16; ++k) t[k] = k < m ? load<float>(p[k]) : pad;
  return ld16<V>(t);
}
template <typename V, typename T>
RLX_ROW_INLINE void st16_part(T* p, const V& v, int64_t m) {
  T t[16];
  st16(t, v);
  std::memcpy(p, t, static_cast<size_t>(m) * sizeof(T));
}
// The m < 16 elements at src copied into a 16-element block, zero-padded (row tails
// run as one more block on such copies: the same vector operations in every ISA body).
template <typename T>
RLX_ROW_INLINE void copy_padded(T* dst16, const T* src, int64_t m) {
  std::memset(dst16, 0, 16 * sizeof(T));
  std::memcpy(dst16, src, static_cast<size_t>(m) * sizeof(T));
}
RLX_ROW_INLINE float lane16(const v16f& v, int k) { return v[k]; }
RLX_ROW_INLINE float lane16(const P16& v, int k) { return k < 8 ? v.lo[k] : v.hi[k - 8]; }
// Lanes 0..15 added in order.
template <typename V>
RLX_ROW_INLINE float hsum16(const V& v) {
  float s = 0.0f;
  for (int k = 0; k < 16; ++k) s += lane16(v, k);
  return s;
}

// ---- bf16 rows of the cross-entropy kernels ---------------------------------------
// dst[j] = f32(src[j]) for j < n; returns max_j src[j] (-inf for n == 0; NaN never wins
// the comparison, as in row_max, so the value is row_max's).
template <typename V, typename T>
RLX_ROW_INLINE float to_f32_max_body(const T* src, float* dst, int64_t n) {
  V a = splat16<V>(-INFINITY), b = a;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const V u = ld16<V>(src + j), w = ld16<V>(src + j + 16);
    st16(dst + j, u);
    st16(dst + j + 16, w);
    a = max16(a, u);
    b = max16(b, w);
  }
  a = max16(a, b);
  float m = lane16(a, 0);
  for (int k = 1; k < 16; ++k) m = lane16(a, k) > m ? lane16(a, k) : m;
  for (; j < n; ++j) {
    const float v = load<float>(src[j]);
    dst[j] = v;
    m = v > m ? v : m;
  }
  return m;
}
// dst[j] = store<T>(src[j] * scale): one multiply and one rounding, the values of
// scale_row followed by store_row.
template <typename V, typename T>
RLX_ROW_INLINE void scale_store_body(const float* src, float scale, T* dst, int64_t n) {
  const V sc = splat16<V>(scale);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) st16(dst + j, ld16<V>(src + j) * sc);
  for (; j < n; ++j) {
    const float v = src[j] * scale;
    dst[j] = store<T>(v);
  }
}
// dst[j] = store<T>(src[j])
template <typename V, typename T>
RLX_ROW_INLINE void store_row_body(const float* src, T* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) st16(dst + j, ld16<V>(src + j));
  for (; j < n; ++j) dst[j] = store<T>(src[j]);
}

RLX_ROW_V4 static float bf16_to_f32_max_v16(const bf16* s, float* d, int64_t n) { return to_f32_max_body<v16f>(s, d, n); }
RLX_ROW_CLONES static float bf16_to_f32_max_v8(const bf16* s, float* d, int64_t n) { return to_f32_max_body<P16>(s, d, n); }
RLX_ROW_V4 static void scale_store_bf16_v16(const float* s, float c, bf16* d, int64_t n) { scale_store_body<v16f>(s, c, d, n); }
RLX_ROW_CLONES static void scale_store_bf16_v8(const float* s, float c, bf16* d, int64_t n) { scale_store_body<P16>(s, c, d, n); }
RLX_ROW_V4 static void store_bf16_v16(const float* s, bf16* d, int64_t n) { store_row_body<v16f>(s, d, n); }
RLX_ROW_CLONES static void store_bf16_v8(const float* s, bf16* d, int64_t n) { store_row_body<P16>(s, d, n); }

// dst[j] = f32(src[j]) (exact): the blocks' integer shift, the tail one at a time.
template <typename V, typename T>
RLX_ROW_INLINE void to_f32_body(const T* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) st16(dst + j, ld16<V>(src + j));
  for (; j < n; ++j) dst[j] = load<float>(src[j]);
}
RLX_ROW_V4 static void bf16_to_f32_v16(const bf16* s, float* d, int64_t n) { to_f32_body<v16f>(s, d, n); }
RLX_ROW_CLONES static void bf16_to_f32_v8(const bf16* s, float* d, int64_t n) { to_f32_body<P16>(s, d, n); }

// dst[j] = f32(src[j]) (exact; the values of load<float>).
[[maybe_unused]] static void bf16_to_f32(const bf16* src, float* dst, int64_t n) {
  if (cpu_has_x86_64_v4()) bf16_to_f32_v16(src, dst, n);
  else bf16_to_f32_v8(src, dst, n);
}
// dst[j] = f32(src[j]); returns max_j src[j] (what row_max of dst gives).
[[maybe_unused]] static float bf16_to_f32_max(const bf16* src, float* dst, int64_t n) {
  return cpu_has_x86_64_v4() ? bf16_to_f32_max_v16(src, dst, n) : bf16_to_f32_max_v8(src, dst, n);
}
// dst[j] = bf16(src[j] * scale), round to nearest even.
[[maybe_unused]] static void scale_store_bf16(const float* src, float scale, bf16* dst, int64_t n) {
  if (cpu_has_x86_64_v4()) scale_store_bf16_v16(src, scale, dst, n);
  else scale_store_bf16_v8(src, scale, dst, n);
}
// dst[j] = bf16(src[j]), round to nearest even.
[[maybe_unused]] static void store_bf16(const float* src, bf16* dst, int64_t n) {
  if (cpu_has_x86_64_v4()) store_bf16_v16(src, dst, n);
  else store_bf16_v8(src, dst, n);
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
