// SwiGLU backward: targets rlx_swiglu_bwd and rlx_swiglu_bwd_product.
//
//   a (gate), b (up), dh -> da, db (rlx_swiglu_bwd), or -> da, db, h with h = a s b the
//   forward's product recomputed (rlx_swiglu_bwd_product: the backward of swiglu_linear,
//   whose weight gradient h^T dy needs h). Buffers of one shape and dtype, read as flat
//   arrays of n elements (elementwise). With e = exp(-|a|) and s = sigmoid(a) taken as
//   1 / (1 + e) for a >= 0 and e / (1 + e) for a < 0 (1 - s is then the other of the two,
//   without cancellation):
//     da = dh b (s + a s (1 - s))      (= dh b s (1 + a (1 - s)))
//     db = dh a s
//   At a = +-inf the products take their limits: a s = 0 at -inf, a s (1 - s) = 0 at both
//   ends (an infinite gate gives da = 0 or dh b, never the NaN of inf * 0).
// f32 arithmetic for f32 / bf16 / f16 in blocks of 16 elements (two 8-lane vectors; exp
// from rowwise.h; compiled for AVX2 and the baseline ISA), f64 for f64; one rounding to
// the output dtype. Each element is written once with the same operations whatever the
// split into tasks: deterministic. In place: da may be a's buffer and db b's (the Python
// side aliases them); every element of a and b is read before its gradients are written.
#include <cmath>

#include "cpu/common.h"
#include "cpu/rowwise.h"
#include "swiglu_checks.h"

namespace rlx {
namespace {

// da, db and the product h of 8 lanes (the formulas above).
RLX_ROW_INLINE void swiglu_grad8(const v8f& a, const v8f& b, const v8f& dh, v8f& da, v8f& db, v8f& h) {
  const v8f zero = v8_splat(0.0f), one = v8_splat(1.0f), ninf = v8_splat(-INFINITY);
  const auto pos = a >= zero;
  const v8f m = pos ? -a : a;      // -|a|
  const v8f e = vexp8(m);          // in (0, 1]; 0 at |a| = inf
  const v8f r = one / (one + e);
  const v8f er = e * r;
  const v8f s = pos ? r : er;      // sigmoid(a)
  const v8f c = pos ? er : r;      // 1 - sigmoid(a)
  const v8f silu = a == ninf ? zero : a * s;
  const v8f slope = m == ninf ? zero : silu * c;
  da = dh * b * (s + slope);
  db = dh * silu;
  h = silu * b;
}

// f16 <-> f32 on 8 lanes of 32-bit words (f16 bits in the low half) with integer vector
// operations and no branches, bit for bit the scalar to_f32 / from_f32_f16 of common.h.
RLX_ROW_INLINE v8f f16_bits_to_f32(const v8u& u) {
  const v8u em = u & 0x7fffu;  // exponent and mantissa
  const v8u exp = em & 0x7c00u;
  // normal: the exponent rebiased from 15 to 127 (+112); inf / nan: exponent 31 -> 255 (+112 more)
  v8u bits = (em << 13) + (112u << 23);
  bits = exp == 0x7c00u ? bits + (112u << 23) : bits;
  // zero / subnormal: mantissa * 2^-24, exact
  const v8f small = __builtin_convertvector(em, v8f) * 5.9604644775390625e-8f;
  v8u small_bits;
  std::memcpy(&small_bits, &small, sizeof small_bits);
  bits = (exp == 0u ? small_bits : bits) | ((u & 0x8000u) << 16);
  v8f v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Round to nearest even; NaN -> quiet NaN (0x7e00), |v| >= 65520 -> inf. f16 bits in the
// low half of each word.
RLX_ROW_INLINE v8u f32_to_f16_bits(const v8f& v) {
  v8u u;
  std::memcpy(&u, &v, sizeof u);
  const v8u a = u & 0x7fffffffu;
  // normal results (|v| >= 2^-14): rebias the exponent (-112) and drop 13 mantissa bits,
  // adding 0xfff plus the kept lowest bit first (ties to even; a carry may bump the exponent)
  const v8u normal = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // subnormal results: |v| * 2^24 rounded to an integer by adding and removing 2^23
  v8f mag;
  std::memcpy(&mag, &a, sizeof mag);
  const v8f big = v8_splat(8388608.0f);
  const v8u sub = __builtin_convertvector((mag * 16777216.0f + big) - big, v8u);
  v8u h = a < 0x38800000u ? sub : normal;
  h = a >= 0x477ff000u ? 0x7c00u : h;
  h = a > 0x7f800000u ? 0x7e00u : h;
  return h | ((u >> 16) & 0x8000u);
}

// A block of 16 elements as two 8-lane f32 vectors (lo, hi), and back. Which element sits
// in which lane does not matter (elementwise): bf16 and f16 blocks are read as eight
// 32-bit words whose low halves (the even elements) go to lo and high halves (the odd
// ones) to hi, so no lane shuffles are needed. bf16: the exact shift up, round to
// nearest even down (bf16_round_bits, rowwise.h).
template <typename T>
struct Block16;
template <>
struct Block16<float> {
  static RLX_ROW_INLINE void load(const float* p, v8f& lo, v8f& hi) {
    lo = v8_load(p);
    hi = v8_load(p + 8);
  }
  static RLX_ROW_INLINE void store(float* p, const v8f& lo, const v8f& hi) {
    v8_store(p, lo);
    v8_store(p + 8, hi);
  }
};
template <>
struct Block16<bf16> {
  static RLX_ROW_INLINE void load(const bf16* p, v8f& lo, v8f& hi) {
    v8u w;
    std::memcpy(&w, p, sizeof w);
    const v8u even = w << 16, odd = w & 0xffff0000u;
    std::memcpy(&lo, &even, sizeof lo);
    std::memcpy(&hi, &odd, sizeof hi);
  }
  static RLX_ROW_INLINE void store(bf16* p, const v8f& lo, const v8f& hi) {
    v8u even, odd;
    std::memcpy(&even, &lo, sizeof even);
    std::memcpy(&odd, &hi, sizeof odd);
    const v8u w = bf16_round_bits(even) | (bf16_round_bits(odd) << 16);
    std::memcpy(p, &w, sizeof w);
  }
};
template <>
struct Block16<f16> {
  static RLX_ROW_INLINE void load(const f16* p, v8f& lo, v8f& hi) {
    v8u w;
    std::memcpy(&w, p, sizeof w);
    lo = f16_bits_to_f32(w & 0xffffu);
    hi = f16_bits_to_f32(w >> 16);
  }
  static RLX_ROW_INLINE void store(f16* p, const v8f& lo, const v8f& hi) {
    const v8u w = f32_to_f16_bits(lo) | (f32_to_f16_bits(hi) << 16);
    std::memcpy(p, &w, sizeof w);
  }
};

// One block of 16 elements at a, b, dh -> da, db, and h unless it is null.
template <typename T>
RLX_ROW_INLINE void swiglu_bwd_block(const T* a, const T* b, const T* dh, T* da, T* db, T* h) {
  v8f a0, a1, b0, b1, d0, d1, ga0, ga1, gb0, gb1, h0, h1;
  Block16<T>::load(a, a0, a1);
  Block16<T>::load(b, b0, b1);
  Block16<T>::load(dh, d0, d1);
  swiglu_grad8(a0, b0, d0, ga0, gb0, h0);
  swiglu_grad8(a1, b1, d1, ga1, gb1, h1);
  Block16<T>::store(da, ga0, ga1);
  Block16<T>::store(db, gb0, gb1);
  if (h != nullptr) Block16<T>::store(h, h0, h1);
}

// n elements: blocks of 16, then the tail (n mod 16) as one more block on zero-padded
// copies, so every element sees the same vector operations. h: null, or the product's
// output.
template <typename T>
RLX_ROW_INLINE void swiglu_bwd_span(const T* a, const T* b, const T* dh, T* da, T* db, T* h, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) swiglu_bwd_block(a + j, b + j, dh + j, da + j, db + j, h ? h + j : nullptr);
  const int64_t m = n - j;
  if (m == 0) return;
  T pa[16], pb[16], pd[16], oa[16], ob[16], oh[16];
  std::memset(pa, 0, sizeof pa);
  std::memset(pb, 0, sizeof pb);
  std::memset(pd, 0, sizeof pd);
  std::memcpy(pa, a + j, size_t(m) * sizeof(T));
  std::memcpy(pb, b + j, size_t(m) * sizeof(T));
  std::memcpy(pd, dh + j, size_t(m) * sizeof(T));
  swiglu_bwd_block(pa, pb, pd, oa, ob, oh);
  std::memcpy(da + j, oa, size_t(m) * sizeof(T));
  std::memcpy(db + j, ob, size_t(m) * sizeof(T));
  if (h != nullptr) std::memcpy(h + j, oh, size_t(m) * sizeof(T));
}

RLX_ROW_CLONES static void swiglu_bwd_f32(const float* a, const float* b, const float* dh, float* da, float* db,
                                          float* h, int64_t n) {
  swiglu_bwd_span(a, b, dh, da, db, h, n);
}
RLX_ROW_CLONES static void swiglu_bwd_bf16(const bf16* a, const bf16* b, const bf16* dh, bf16* da, bf16* db,
                                           bf16* h, int64_t n) {
  swiglu_bwd_span(a, b, dh, da, db, h, n);
}
RLX_ROW_CLONES static void swiglu_bwd_f16(const f16* a, const f16* b, const f16* dh, f16* da, f16* db, f16* h,
                                          int64_t n) {
  swiglu_bwd_span(a, b, dh, da, db, h, n);
}

// f64: the same formulas in double, one element at a time.
static void swiglu_bwd_f64(const double* a, const double* b, const double* dh, double* da, double* db, double* h,
                           int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const double x = a[j];
    const bool pos = x >= 0.0;
    const double e = std::exp(pos ? -x : x);
    const double r = 1.0 / (1.0 + e), er = e * r;
    const double s = pos ? r : er, c = pos ? er : r;
    const double silu = x == -INFINITY ? 0.0 : x * s;
    const double slope = std::isinf(x) ? 0.0 : silu * c;
    const double bj = b[j], g = dh[j];  // read before da / db are written: they may be a / b
    da[j] = g * bj * (s + slope);
    db[j] = g * silu;
    if (h != nullptr) h[j] = silu * bj;
  }
}

inline void swiglu_bwd_run(const float* a, const float* b, const float* dh, float* da, float* db, float* h,
                           int64_t n) {
  swiglu_bwd_f32(a, b, dh, da, db, h, n);
}
inline void swiglu_bwd_run(const bf16* a, const bf16* b, const bf16* dh, bf16* da, bf16* db, bf16* h, int64_t n) {
  swiglu_bwd_bf16(a, b, dh, da, db, h, n);
}
inline void swiglu_bwd_run(const f16* a, const f16* b, const f16* dh, f16* da, f16* db, f16* h, int64_t n) {
  swiglu_bwd_f16(a, b, dh, da, db, h, n);
}
inline void swiglu_bwd_run(const double* a, const double* b, const double* dh, double* da, double* db, double* h,
                           int64_t n) {
  swiglu_bwd_f64(a, b, dh, da, db, h, n);
}

// Elements per task: a multiple of 16, so only the last task has a tail; the split depends
// on n alone.
constexpr int64_t kTaskElements = int64_t(1) << 15;

// h: the product's result buffer (rlx_swiglu_bwd_product) or null (rlx_swiglu_bwd).
ffi::Error run_bwd(ffi::ThreadPool& pool, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& dh,
                   ffi::AnyBuffer& da, ffi::AnyBuffer& db, ffi::AnyBuffer* h) {
  int64_t n = 0;
  if (auto e = swiglu::check(a, b, dh, da, db, h, n); e.failure()) return e;
  if (n == 0) return ffi::Error::Success();
  bool ok = dispatch_float(a.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* pa = static_cast<const T*>(a.untyped_data());
    const T* pb = static_cast<const T*>(b.untyped_data());
    const T* pd = static_cast<const T*>(dh.untyped_data());
    T* oa = static_cast<T*>(da.untyped_data());
    T* ob = static_cast<T*>(db.untyped_data());
    T* oh = h ? static_cast<T*>(h->untyped_data()) : nullptr;
    const int64_t tasks = (n + kTaskElements - 1) / kTaskElements;
    parallel_for(pool, tasks, [&](int64_t t) {
      const int64_t j = t * kTaskElements, m = std::min(kTaskElements, n - j);
      swiglu_bwd_run(pa + j, pb + j, pd + j, oa + j, ob + j, oh ? oh + j : nullptr, m);
    });
  });
  if (!ok) return invalid("swiglu_bwd: unsupported dtype " + dtype_name(a.element_type()) + " (f32, f64, bf16, f16)");
  return ffi::Error::Success();
}

ffi::Error SwigluBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer dh,
                         ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db) {
  return run_bwd(pool, a, b, dh, *da, *db, nullptr);
}

ffi::Error SwigluBwdProductImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer dh,
                                ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db,
                                ffi::Result<ffi::AnyBuffer> h) {
  return run_bwd(pool, a, b, dh, *da, *db, &*h);
}

}  // namespace

// (a, b, dh) -> (da, db)
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSwigluBwd, SwigluBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // a (gate)
                                  .Arg<ffi::AnyBuffer>()   // b (up)
                                  .Arg<ffi::AnyBuffer>()   // dh
                                  .Ret<ffi::AnyBuffer>()   // da
                                  .Ret<ffi::AnyBuffer>());  // db

RLX_REGISTER_HANDLER("rlx_swiglu_bwd", RlxSwigluBwd);

// (a, b, dh) -> (da, db, h)
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSwigluBwdProduct, SwigluBwdProductImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // a (gate)
                                  .Arg<ffi::AnyBuffer>()   // b (up)
                                  .Arg<ffi::AnyBuffer>()   // dh
                                  .Ret<ffi::AnyBuffer>()   // da
                                  .Ret<ffi::AnyBuffer>()   // db
                                  .Ret<ffi::AnyBuffer>());  // h = a s b

RLX_REGISTER_HANDLER("rlx_swiglu_bwd_product", RlxSwigluBwdProduct);

}  // namespace rlx
