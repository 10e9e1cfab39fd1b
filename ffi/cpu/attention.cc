// Flash-style attention on the CPU: forward (saving only the logsumexp) and the fused
// backward (dq, dk, dv and, with a bias, dbias, from one pass).
//
//   q: [B, Sq, H, D]   k, v: [B, Sk, Hkv, D] with Hkv dividing H (head h reads kv head
//   h / (H / Hkv));   mask: [B, Sk] f32 (key j kept when mask >= 0.5);   bias: [B, H, Sq, Sk]
//   r_ij = scale * q_i . k_j
//   s_ij = softcap ? c * tanh(r_ij / c) : r_ij;   s_ij += bias_ij
//   s_ij = -inf where key j is not visible from query i (mask kind, key mask and, with
//   segment ids qseg [B, Sq] / kseg [B, Sk] int32, qseg_i != kseg_j)
//   P = softmax_j(s);  out_i = sum_j P_ij v_j;  lse_i = log sum_j exp(s_ij) (-inf: no key)
// Mask kinds, with off = max(Sk - Sq, 0) (bottom-right alignment as in RLX), pos = i + off:
//   0 none; 1 causal: j <= pos; 2 sliding(w): pos - w <= j <= pos.
// A row with no visible key gives out = 0 and lse = -inf, and zero gradients.
//
// Backward (dlse: an optional cotangent of lse, zero in plain reverse mode):
//   delta_i = sum_d dout_id out_id - dlse_i,   dP_ij = dout_i . v_j
//   dS_ij = P_ij (dP_ij - delta_i)             (= dbias_ij)
//   dR_ij = dS_ij * (1 - tanh^2(r_ij / c))     (softcap; dR = dS without)
//   dq_i = scale sum_j dR_ij k_j,  dk_j = scale sum_i dR_ij q_i,  dv_j = sum_i P_ij dout_i
// P is recomputed tile by tile from lse; nothing of size Sq x Sk is stored.
//
// Work split, deterministic: the forward runs one task per (batch, head, query tile); the
// backward one task per (batch, kv head), which owns dk/dv rows of that kv head and the dq
// rows of the heads reading it, each accumulated in a fixed order. With fewer than 16
// (batch, kv head) pairs the backward also splits the keys into chunks (a function of
// the shape, never of the thread count): each chunk owns its dk/dv rows and writes dq
// partial sums, which are then added in chunk order.
// Segment ids (packed documents): each (query tile, key tile) pair whose id ranges
// [min, max] do not meet is skipped before any of its work (forward and backward), so a
// packed batch of short documents costs about its visible work.
// f32/bf16/f16 accumulate in f32 through SIMD kernels (GCC vector extensions, cloned
// for AVX-512, AVX2+FMA and baseline x86-64, chosen at load time); f64 runs scalar code.
#include <cmath>
#include <limits>

#include "attention_bindings.h"
#include "attention_checks.h"
#include "cpu/common.h"

#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define RLX_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RLX_SIMD_CLONES
#endif
#define RLX_INLINE static inline __attribute__((always_inline))

namespace rlx {
namespace {

constexpr int64_t kTileQ = 64;   // query rows per tile
constexpr int64_t kTileK = 64;   // keys per tile
constexpr int64_t kPadN = 32;    // gemm column blocking (tiles padded to a multiple)
constexpr int64_t kPadM = 4;     // gemm row blocking

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- SIMD helpers (float, 16 lanes) ----------------------------------------------------
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int kLanes = 16;

RLX_INLINE vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
RLX_INLINE vi vloadi(const int32_t* p) { vi v; std::memcpy(&v, p, sizeof v); return v; }
RLX_INLINE void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
RLX_INLINE vf vsplat(float x) { return vf{} + x; }
RLX_INLINE vi viota(int32_t base) {
  return vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + base;
}
// Maxima that propagate NaN (a NaN score must give a NaN row, as the reference does,
// not look like a row with no visible key).
template <typename T>
RLX_INLINE T nan_max(T a, T b) {
  if (a != a) return a;
  if (b != b) return b;
  return b > a ? b : a;
}
RLX_INLINE float hmax(vf v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = nan_max(m, v[l]);
  return m;
}
RLX_INLINE float hsum(vf v) {  // fixed pairwise order
  float t[kLanes];
  std::memcpy(t, &v, sizeof v);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

// exp(x) for x <= ~88: round x / ln2 to n, exp(r) by a degree-6 Taylor polynomial on
// |r| <= ln2 / 2 (relative error ~1e-7), times 2^n built from the exponent bits.
// Inputs below -87 (and -inf) give exactly 0.
RLX_INLINE vf vexp(vf x) {
  const vf magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf xc = x < vsplat(-87.0f) ? vsplat(-87.0f) : x;
  vf t = xc * 1.44269504088896341f + magic;
  vf n = t - magic;
  vf r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = vsplat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi ni = (vi)t - (vi)magic;
  vf two_n = (vf)((ni + 127) << 23);
  vf y = p * two_n;
  return x < vsplat(-87.0f) ? vsplat(0.0f) : y;
}

// tanh(y): odd polynomial for |y| < 0.125, (1 - e) / (1 + e) with e = exp(-2|y|) above.
RLX_INLINE vf vtanh(vf y) {
  vf a = y < vsplat(0.0f) ? -y : y;
  vf e = vexp(-2.0f * a);
  vf big = (1.0f - e) / (1.0f + e);
  vf y2 = a * a;
  vf small = a * (1.0f + y2 * (-1.0f / 3.0f + y2 * (2.0f / 15.0f + y2 * (-17.0f / 315.0f))));
  vf t = a < vsplat(0.125f) ? small : big;
  return y < vsplat(0.0f) ? -t : t;
}

// ---- gemm: C[M, N] (+)= op(A) B with op(A) = A [M, K] or, transposed, A^T (A stored
// [K, M]); row-major; M % 4 == 0 and N % 32 == 0 (callers pad with zeros) --------------------
template <bool TransA>
RLX_INLINE void gemm_body(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
                          const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < M; i += 4) {
    for (int64_t j = 0; j < N; j += 32) {
      vf acc[4][2];
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h)
          acc[r][h] = accumulate ? vload(c + (i + r) * ldc + j + h * kLanes) : vsplat(0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const vf b0 = vload(b + k * ldb + j), b1 = vload(b + k * ldb + j + kLanes);
        for (int r = 0; r < 4; ++r) {
          const float av = TransA ? a[k * lda + i + r] : a[(i + r) * lda + k];
          acc[r][0] += av * b0;
          acc[r][1] += av * b1;
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) vstore(c + (i + r) * ldc + j + h * kLanes, acc[r][h]);
    }
  }
}

RLX_SIMD_CLONES
void gemm_nn_f32(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_body<false>(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}

RLX_SIMD_CLONES
void gemm_tn_f32(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_body<true>(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}

template <bool TransA>
void gemm_f64(int64_t M, int64_t N, int64_t K, const double* a, int64_t lda, const double* b,
              int64_t ldb, double* c, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < M; ++i) {
    double* ci = c + i * ldc;
    if (!accumulate)
      for (int64_t j = 0; j < N; ++j) ci[j] = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double av = TransA ? a[k * lda + i] : a[i * lda + k];
      const double* bk = b + k * ldb;
      for (int64_t j = 0; j < N; ++j) ci[j] += av * bk[j];
    }
  }
}

// C (+)= A B
inline void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_nn_f32(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}
inline void gemm(int64_t M, int64_t N, int64_t K, const double* a, int64_t lda, const double* b,
                 int64_t ldb, double* c, int64_t ldc, bool accumulate) {
  gemm_f64<false>(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}
// C (+)= A^T B, A stored [K, M]
inline void gemm_tn(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
                    int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_tn_f32(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}
inline void gemm_tn(int64_t M, int64_t N, int64_t K, const double* a, int64_t lda,
                    const double* b, int64_t ldb, double* c, int64_t ldc, bool accumulate) {
  gemm_f64<true>(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}

// ---- per-tile score transforms ------------------------------------------------------------
// A score tile is rows x ncols (ncols a multiple of 32, row stride ld) at query rows
// i0.. and keys j0..; keep[c] (>= 0.5: key kept; 0 on padding columns), lo[r] / hi[r]: the
// visible key range of row r; bias (nullable): the tile's additive bias, row stride ld;
// qseg (nullable): the rows' segment ids, kseg: the columns' (ncols of them, padded).
template <typename A>
struct Tile {
  int64_t rows, ncols, ld, j0;
  const A* keep;
  const int64_t* lo;
  const int64_t* hi;
  const A* bias;
  A softcap;  // 0: off
  const int32_t* qseg = nullptr;
  const int32_t* kseg = nullptr;
};

// Forward online-softmax step. S holds raw scores r (scaled). On return P holds
// exp(s - m_new) (0 where masked), m / l are updated, and alpha[r] = exp(m_old - m_new)
// is the factor the caller applies to the output accumulator.
RLX_SIMD_CLONES
void fwd_tile_f32(const Tile<float>& t, float* S, float* P, float* m, float* l, float* alpha) {
  const float inv_cap = t.softcap > 0 ? 1.0f / t.softcap : 0.0f;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < t.rows; ++r) {
    float* s = S + r * t.ld;
    float* p = P + r * t.ld;
    const int32_t lo = int32_t(std::max<int64_t>(t.lo[r] - t.j0, -1));
    const int32_t hi = int32_t(std::min<int64_t>(t.hi[r] - t.j0, t.ncols));
    vf vmax = vsplat(ninf);
    for (int64_t c = 0; c < t.ncols; c += kLanes) {
      vf x = vload(s + c);
      if (t.softcap > 0) x = t.softcap * vtanh(x * inv_cap);
      if (t.bias) x += vload(t.bias + r * t.ld + c);
      vi j = viota(int32_t(c));
      vi ok = (j >= lo) & (j <= hi) & (vload(t.keep + c) >= vsplat(0.5f));
      if (t.qseg) ok &= vloadi(t.kseg + c) == (vi{} + t.qseg[r]);
      x = ok ? x : vsplat(ninf);
      vstore(s + c, x);
      vmax = (x > vmax) | (x != x) ? x : vmax;
    }
    const float mt = nan_max(m[r], hmax(vmax));
    if (mt == ninf) {  // nothing visible yet in this row
      for (int64_t c = 0; c < t.ncols; ++c) p[c] = 0.0f;
      alpha[r] = 1.0f;
      continue;
    }
    vf vs = vsplat(0.0f);
    for (int64_t c = 0; c < t.ncols; c += kLanes) {
      vf e = vexp(vload(s + c) - mt);
      vstore(p + c, e);
      vs += e;
    }
    const float a = m[r] == ninf ? 0.0f : std::exp(m[r] - mt);
    alpha[r] = a;
    l[r] = l[r] * a + hsum(vs);
    m[r] = mt;
  }
}

void fwd_tile_f64(const Tile<double>& t, double* S, double* P, double* m, double* l,
                  double* alpha) {
  const double ninf = -std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < t.rows; ++r) {
    double* s = S + r * t.ld;
    double* p = P + r * t.ld;
    double mx = ninf;
    for (int64_t c = 0; c < t.ncols; ++c) {
      double x = s[c];
      if (t.softcap > 0) x = t.softcap * std::tanh(x / t.softcap);
      if (t.bias) x += t.bias[r * t.ld + c];
      const int64_t j = t.j0 + c;
      const bool ok = j >= t.lo[r] && j <= t.hi[r] && t.keep[c] >= 0.5 &&
                      (!t.qseg || t.qseg[r] == t.kseg[c]);
      s[c] = ok ? x : ninf;
      mx = nan_max(mx, s[c]);
    }
    const double mt = nan_max(m[r], mx);
    if (mt == ninf) {
      for (int64_t c = 0; c < t.ncols; ++c) p[c] = 0.0;
      alpha[r] = 1.0;
      continue;
    }
    double sum = 0.0;
    for (int64_t c = 0; c < t.ncols; ++c) {
      p[c] = s[c] == ninf ? 0.0 : std::exp(s[c] - mt);
      sum += p[c];
    }
    const double a = m[r] == ninf ? 0.0 : std::exp(m[r] - mt);
    alpha[r] = a;
    l[r] = l[r] * a + sum;
    m[r] = mt;
  }
}

// Backward tile: S holds raw scores r, dP = dout . v. Writes P (probabilities), dS
// (the gradient of s: dbias) into DB when DB is not null, and dR (the gradient of r) into S.
RLX_SIMD_CLONES
void bwd_tile_f32(const Tile<float>& t, const float* lse, const float* delta, float* S,
                  const float* dP, float* P, float* DB) {
  const float inv_cap = t.softcap > 0 ? 1.0f / t.softcap : 0.0f;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < t.rows; ++r) {
    float* s = S + r * t.ld;
    float* p = P + r * t.ld;
    const float* dp = dP + r * t.ld;
    if (lse[r] == ninf) {
      for (int64_t c = 0; c < t.ncols; ++c) { p[c] = 0.0f; s[c] = 0.0f; }
      if (DB)
        for (int64_t c = 0; c < t.ncols; ++c) DB[r * t.ld + c] = 0.0f;
      continue;
    }
    const int32_t lo = int32_t(std::max<int64_t>(t.lo[r] - t.j0, -1));
    const int32_t hi = int32_t(std::min<int64_t>(t.hi[r] - t.j0, t.ncols));
    const float lr = lse[r], dr = delta[r];
    for (int64_t c = 0; c < t.ncols; c += kLanes) {
      vf x = vload(s + c);
      vf th = vsplat(0.0f);
      if (t.softcap > 0) {
        th = vtanh(x * inv_cap);
        x = t.softcap * th;
      }
      if (t.bias) x += vload(t.bias + r * t.ld + c);
      vi j = viota(int32_t(c));
      vi ok = (j >= lo) & (j <= hi) & (vload(t.keep + c) >= vsplat(0.5f));
      if (t.qseg) ok &= vloadi(t.kseg + c) == (vi{} + t.qseg[r]);
      vf pr = vexp(x - lr);
      pr = ok ? pr : vsplat(0.0f);
      vf ds = pr * (vload(dp + c) - dr);
      if (DB) vstore(DB + r * t.ld + c, ds);
      if (t.softcap > 0) ds = ds * (1.0f - th * th);
      vstore(p + c, pr);
      vstore(s + c, ds);
    }
  }
}

void bwd_tile_f64(const Tile<double>& t, const double* lse, const double* delta, double* S,
                  const double* dP, double* P, double* DB) {
  const double ninf = -std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < t.rows; ++r) {
    double* s = S + r * t.ld;
    double* p = P + r * t.ld;
    const double* dp = dP + r * t.ld;
    for (int64_t c = 0; c < t.ncols; ++c) {
      const int64_t j = t.j0 + c;
      const bool ok = lse[r] != ninf && j >= t.lo[r] && j <= t.hi[r] && t.keep[c] >= 0.5 &&
                      (!t.qseg || t.qseg[r] == t.kseg[c]);
      double x = s[c], th = 0.0;
      if (t.softcap > 0) {
        th = std::tanh(x / t.softcap);
        x = t.softcap * th;
      }
      if (t.bias) x += t.bias[r * t.ld + c];
      const double pr = ok ? std::exp(x - lse[r]) : 0.0;
      double ds = ok ? pr * (dp[c] - delta[r]) : 0.0;
      if (DB) DB[r * t.ld + c] = ds;
      if (t.softcap > 0) ds *= 1.0 - th * th;
      p[c] = pr;
      s[c] = ds;
    }
  }
}

inline void fwd_tile(const Tile<float>& t, float* S, float* P, float* m, float* l, float* a) {
  fwd_tile_f32(t, S, P, m, l, a);
}
inline void fwd_tile(const Tile<double>& t, double* S, double* P, double* m, double* l,
                     double* a) {
  fwd_tile_f64(t, S, P, m, l, a);
}
inline void bwd_tile(const Tile<float>& t, const float* lse, const float* delta, float* S,
                     const float* dP, float* P, float* DB) {
  bwd_tile_f32(t, lse, delta, S, dP, P, DB);
}
inline void bwd_tile(const Tile<double>& t, const double* lse, const double* delta, double* S,
                     const double* dP, double* P, double* DB) {
  bwd_tile_f64(t, lse, delta, S, dP, P, DB);
}

// ---- problem description --------------------------------------------------------------------
using attention::Dims;  // B, Sq, Sk, H, Hkv, D
using attention::Opts;  // mask kind, window, scale, softcap, has_mask, has_bias

// Visible key range [lo, hi] of query row i (before the key mask).
inline void key_range(const Dims& d, const Opts& o, int64_t i, int64_t* lo, int64_t* hi) {
  const int64_t pos = i + std::max<int64_t>(d.Sk - d.Sq, 0);
  *lo = 0;
  *hi = d.Sk - 1;
  if (o.kind >= 1) *hi = std::min(pos, d.Sk - 1);
  if (o.kind == 2) *lo = std::max<int64_t>(pos - o.window, 0);
}

template <typename A>
struct Buf {
  std::vector<A> v;
  A* alloc(size_t n) { v.assign(n, A(0)); return v.data(); }
};

// Packs rows [j0, j0 + n) of head `head` of x [B, S, Hx, D] (batch b) as f32 rows of
// width ld (zero padded) into dst, times `mul`; rows n..nrows are zeroed.
template <typename T, typename A>
void pack_rows(const T* x, int64_t S, int64_t Hx, int64_t D, int64_t b, int64_t head, int64_t j0,
               int64_t n, int64_t nrows, int64_t ld, A mul, A* dst) {
  for (int64_t r = 0; r < nrows; ++r) {
    A* o = dst + r * ld;
    if (r < n) {
      const T* src = x + ((b * S + j0 + r) * Hx + head) * D;
      for (int64_t e = 0; e < D; ++e) o[e] = load<A>(src[e]) * mul;
      for (int64_t e = D; e < ld; ++e) o[e] = A(0);
    } else {
      for (int64_t e = 0; e < ld; ++e) o[e] = A(0);
    }
  }
}

// Same rows packed transposed: dst[e * ld + r], r < ncols (zero padded).
template <typename T, typename A>
void pack_rows_t(const T* x, int64_t S, int64_t Hx, int64_t D, int64_t b, int64_t head,
                 int64_t j0, int64_t n, int64_t ncols, int64_t ld, A* dst) {
  for (int64_t e = 0; e < D; ++e)
    for (int64_t r = n; r < ncols; ++r) dst[e * ld + r] = A(0);
  for (int64_t r = 0; r < n; ++r) {
    const T* src = x + ((b * S + j0 + r) * Hx + head) * D;
    for (int64_t e = 0; e < D; ++e) dst[e * ld + r] = load<A>(src[e]);
  }
}

// keep tile: mask values (1 without a mask) for keys j0.., 0 on padding columns.
template <typename A>
void pack_keep(const float* mask, const Dims& d, int64_t b, int64_t j0, int64_t n, int64_t ncols,
               A* dst) {
  for (int64_t c = 0; c < ncols; ++c)
    dst[c] = c < n ? (mask ? A(mask[b * d.Sk + j0 + c]) : A(1)) : A(0);
}

template <typename T, typename A>
void pack_bias(const T* bias, const Dims& d, int64_t b, int64_t h, int64_t i0, int64_t rows,
               int64_t j0, int64_t n, int64_t ld, A* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = bias + ((b * d.H + h) * d.Sq + i0 + r) * d.Sk + j0;
    for (int64_t c = 0; c < n; ++c) dst[r * ld + c] = load<A>(src[c]);
    for (int64_t c = n; c < ld; ++c) dst[r * ld + c] = A(0);
  }
}

// ---- segment ids ----------------------------------------------------------------------------
// Per tile of `tile` consecutive positions of each batch row of ids [B, S], the [min, max]
// of its segment ids: a (query tile, key tile) pair can hold a visible entry only where
// the two ranges meet.
struct SegmentRanges {
  std::vector<int32_t> minmax;  // [B, tiles, 2]
  int64_t tiles = 0;
  SegmentRanges(const int32_t* ids, int64_t B, int64_t S, int64_t tile) {
    if (!ids) return;
    tiles = (S + tile - 1) / tile;
    minmax.resize(size_t(B * tiles * 2));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < tiles; ++t) {
        const int32_t* x = ids + b * S + t * tile;
        const int64_t n = std::min(tile, S - t * tile);
        int32_t lo = x[0], hi = x[0];
        for (int64_t i = 1; i < n; ++i) { lo = std::min(lo, x[i]); hi = std::max(hi, x[i]); }
        minmax[(b * tiles + t) * 2] = lo;
        minmax[(b * tiles + t) * 2 + 1] = hi;
      }
  }
  const int32_t* at(int64_t b, int64_t t) const { return minmax.data() + (b * tiles + t) * 2; }
};

// False when the query tile qt and the key tile kt of batch b share no segment id (the
// pair is skipped); always true without segment ids.
inline bool tiles_meet(const SegmentRanges& qr, const SegmentRanges& kr, int64_t b, int64_t qt,
                       int64_t kt) {
  if (qr.minmax.empty()) return true;
  const int32_t* a = qr.at(b, qt);
  const int32_t* c = kr.at(b, kt);
  return a[0] <= c[1] && c[0] <= a[1];
}

// Key segment ids j0.. of batch b into dst (ncols of them, 0 on padding columns, which
// the keep tile hides anyway).
inline void pack_kseg(const int32_t* kseg, const Dims& d, int64_t b, int64_t j0, int64_t n,
                      int64_t ncols, int32_t* dst) {
  for (int64_t c = 0; c < ncols; ++c) dst[c] = c < n ? kseg[b * d.Sk + j0 + c] : 0;
}

// ---- forward ------------------------------------------------------------------------------------
template <typename T>
void attention_fwd_typed(ffi::ThreadPool& pool, const Dims& d, const Opts& o, const T* q,
                         const T* k, const T* v, const float* mask, const T* bias,
                         const int32_t* qseg, const int32_t* kseg, T* out, void* lse_out) {
  using A = typename Accum<T>::type;
  A* lse = static_cast<A*>(lse_out);
  const int64_t q_tiles = (d.Sq + kTileQ - 1) / kTileQ;
  const SegmentRanges q_ranges(qseg, d.B, d.Sq, kTileQ), k_ranges(kseg, d.B, d.Sk, kTileK);
  const int64_t Dp = round_up(std::max<int64_t>(d.D, 1), kPadN);
  const A ninf = -std::numeric_limits<A>::infinity();
  parallel_for(pool, d.B * d.H * q_tiles, [&](int64_t task) {
    const int64_t qt = task % q_tiles, h = (task / q_tiles) % d.H, b = task / (q_tiles * d.H);
    const int64_t kvh = h / d.group();
    const int64_t i0 = qt * kTileQ, rows = std::min(kTileQ, d.Sq - i0);
    const int64_t Mp = round_up(rows, kPadM);
    Buf<A> bq, bkt, bv, bs, bp, bo, bb, bkeep, bstat;
    A* Q = bq.alloc(Mp * Dp);
    A* KT = bkt.alloc(std::max<int64_t>(d.D, 1) * kTileK);
    A* V = bv.alloc(kTileK * Dp);
    A* S = bs.alloc(Mp * kTileK);
    A* P = bp.alloc(Mp * kTileK);
    A* O = bo.alloc(Mp * Dp);
    A* BT = o.has_bias ? bb.alloc(rows * kTileK) : nullptr;
    A* keep = bkeep.alloc(kTileK);
    A* stat = bstat.alloc(3 * rows);
    A *m = stat, *l = stat + rows, *alpha = stat + 2 * rows;
    int32_t KS[kTileK];
    std::vector<int64_t> lo(rows), hi(rows);
    for (int64_t r = 0; r < rows; ++r) {
      key_range(d, o, i0 + r, &lo[r], &hi[r]);
      m[r] = ninf;
    }
    pack_rows(q, d.Sq, d.H, d.D, b, h, i0, rows, Mp, Dp, A(o.scale), Q);
    int64_t klo = d.Sk, khi = -1;  // keys any row of the tile can see
    for (int64_t r = 0; r < rows; ++r)
      if (lo[r] <= hi[r]) { klo = std::min(klo, lo[r]); khi = std::max(khi, hi[r]); }
    for (int64_t kt = klo / kTileK; khi >= 0 && kt <= khi / kTileK; ++kt) {
      if (!tiles_meet(q_ranges, k_ranges, b, qt, kt)) continue;
      const int64_t j0 = kt * kTileK, n = std::min(kTileK, d.Sk - j0);
      const int64_t Np = round_up(n, kPadN);
      if (kseg) pack_kseg(kseg, d, b, j0, n, Np, KS);
      pack_rows_t(k, d.Sk, d.Hkv, d.D, b, kvh, j0, n, Np, kTileK, KT);
      pack_rows(v, d.Sk, d.Hkv, d.D, b, kvh, j0, n, Np, Dp, A(1), V);
      pack_keep(mask, d, b, j0, n, Np, keep);
      if (BT) pack_bias(bias, d, b, h, i0, rows, j0, n, kTileK, BT);
      gemm(Mp, Np, d.D, Q, Dp, KT, kTileK, S, kTileK, false);
      Tile<A> t{rows, Np, kTileK, j0, keep, lo.data(), hi.data(), BT, A(o.softcap)};
      if (qseg) { t.qseg = qseg + b * d.Sq + i0; t.kseg = KS; }
      fwd_tile(t, S, P, m, l, alpha);
      for (int64_t r = 0; r < rows; ++r)
        if (alpha[r] != A(1))
          for (int64_t e = 0; e < Dp; ++e) O[r * Dp + e] *= alpha[r];
      gemm(Mp, Dp, Np, P, kTileK, V, Dp, O, Dp, true);
    }
    for (int64_t r = 0; r < rows; ++r) {
      // a NaN row (m or l NaN) is not an empty row: its NaN reaches out, lse and the grads
      const bool any = m[r] != ninf && !(l[r] <= A(0));
      const A inv = any ? A(1) / l[r] : A(0);
      T* dst = out + ((b * d.Sq + i0 + r) * d.H + h) * d.D;
      for (int64_t e = 0; e < d.D; ++e) dst[e] = store<T>(O[r * Dp + e] * inv);
      lse[(b * d.H + h) * d.Sq + i0 + r] = any ? m[r] + std::log(l[r]) : ninf;
    }
  });
}

// ---- backward -----------------------------------------------------------------------------------
constexpr int64_t kMinBwdTasks = 16;  // split keys into chunks below this many (batch, kv head)

// dq rows of the heads reading kv head kvh (batch b) from their accumulators [G, Sqp, Dp].
template <typename T, typename A>
void write_dq(const Dims& d, A scale, int64_t b, int64_t kvh, const A* dQ, int64_t Sqp, int64_t Dp,
              T* dq) {
  const int64_t G = d.group();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kvh * G + g;
    const A* dqg = dQ + g * Sqp * Dp;
    for (int64_t i = 0; i < d.Sq; ++i) {
      T* dst = dq + ((b * d.Sq + i) * d.H + h) * d.D;
      for (int64_t e = 0; e < d.D; ++e) dst[e] = store<T>(dqg[i * Dp + e] * scale);
    }
  }
}

template <typename T>
void attention_bwd_typed(ffi::ThreadPool& pool, const Dims& d, const Opts& o, const T* q,
                         const T* k, const T* v, const T* out, const void* lse_in, const T* dout,
                         const void* dlse_in, const float* mask, const T* bias,
                         const int32_t* qseg, const int32_t* kseg, T* dq, T* dk, T* dv, T* dbias) {
  using A = typename Accum<T>::type;
  const A* lse_all = static_cast<const A*>(lse_in);
  const A* dlse_all = static_cast<const A*>(dlse_in);
  const int64_t G = d.group();
  const int64_t Dp = round_up(std::max<int64_t>(d.D, 1), kPadN);
  const int64_t Sqp = round_up(std::max<int64_t>(d.Sq, 1), kPadM);
  // With few (batch, kv head) pairs the keys are also split into chunks, each with its own
  // dq partial sums, added in chunk order afterwards (a function of the shape only).
  const int64_t k_tiles = (d.Sk + kTileK - 1) / kTileK;
  const int64_t pairs = d.B * d.Hkv;
  const int64_t chunks = std::max<int64_t>(1, std::min(k_tiles, (kMinBwdTasks + pairs - 1) / pairs));
  const int64_t dq_size = G * Sqp * Dp;  // one (batch, kv head)'s dq accumulators
  std::vector<A> dq_parts(chunks > 1 ? size_t(pairs * chunks * dq_size) : 0);
  const SegmentRanges q_ranges(qseg, d.B, d.Sq, kTileQ), k_ranges(kseg, d.B, d.Sk, kTileK);
  parallel_for(pool, pairs * chunks, [&](int64_t task) {
    const int64_t chunk = task % chunks, kvh = (task / chunks) % d.Hkv, b = task / (chunks * d.Hkv);
    const int64_t kt0 = k_tiles * chunk / chunks, kt1 = k_tiles * (chunk + 1) / chunks;
    Buf<A> bq, bdo, bdq, bstat, bk, bkt, bvt, bs, bdp, bp, bdk, bdv, bb, bdb, bkeep;
    // per group head: scaled q, dout, dq accumulator [Sqp, Dp]; lse and delta [Sq]
    A* Qs = bq.alloc(dq_size);
    A* dO = bdo.alloc(dq_size);
    A* dQ = chunks > 1 ? dq_parts.data() + task * dq_size : bdq.alloc(dq_size);
    A* stat = bstat.alloc(2 * G * Sqp);
    A* K = bk.alloc(kTileK * Dp);
    A* KT = bkt.alloc(std::max<int64_t>(d.D, 1) * kTileK);
    A* VT = bvt.alloc(std::max<int64_t>(d.D, 1) * kTileK);
    A* S = bs.alloc(kTileQ * kTileK);
    A* dP = bdp.alloc(kTileQ * kTileK);
    A* P = bp.alloc(kTileQ * kTileK);
    A* dK = bdk.alloc(kTileK * Dp);
    A* dV = bdv.alloc(kTileK * Dp);
    A* BT = o.has_bias ? bb.alloc(kTileQ * kTileK) : nullptr;
    A* DB = o.has_bias ? bdb.alloc(kTileQ * kTileK) : nullptr;
    A* keep = bkeep.alloc(kTileK);
    int32_t KS[kTileK];
    std::vector<int64_t> lo(d.Sq), hi(d.Sq);
    for (int64_t i = 0; i < d.Sq; ++i) key_range(d, o, i, &lo[i], &hi[i]);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kvh * G + g;
      A* qg = Qs + g * Sqp * Dp;
      A* dog = dO + g * Sqp * Dp;
      pack_rows(q, d.Sq, d.H, d.D, b, h, 0, d.Sq, Sqp, Dp, A(o.scale), qg);
      pack_rows(dout, d.Sq, d.H, d.D, b, h, 0, d.Sq, Sqp, Dp, A(1), dog);
      A* lse = stat + g * 2 * Sqp;
      A* delta = lse + Sqp;
      for (int64_t i = 0; i < d.Sq; ++i) {
        const int64_t row = (b * d.H + h) * d.Sq + i;
        lse[i] = lse_all[row];
        const T* orow = out + ((b * d.Sq + i) * d.H + h) * d.D;
        A acc = 0;
        for (int64_t e = 0; e < d.D; ++e) acc += load<A>(orow[e]) * dog[i * Dp + e];
        delta[i] = acc - dlse_all[row];
      }
      if (o.has_bias) {  // tiles never visited (fully masked) keep a zero gradient
        const int64_t c0 = std::min(kt0 * kTileK, d.Sk), c1 = std::min(kt1 * kTileK, d.Sk);
        for (int64_t i = 0; i < d.Sq; ++i)
          for (int64_t c = c0; c < c1; ++c)
            dbias[((b * d.H + h) * d.Sq + i) * d.Sk + c] = store<T>(A(0));
      }
    }
    const int64_t off = std::max<int64_t>(d.Sk - d.Sq, 0);
    for (int64_t kt = kt0; kt < kt1; ++kt) {
      const int64_t j0 = kt * kTileK, n = std::min(kTileK, d.Sk - j0);
      const int64_t Np = round_up(n, kPadN);
      pack_rows(k, d.Sk, d.Hkv, d.D, b, kvh, j0, n, Np, Dp, A(1), K);
      pack_rows_t(k, d.Sk, d.Hkv, d.D, b, kvh, j0, n, Np, kTileK, KT);
      pack_rows_t(v, d.Sk, d.Hkv, d.D, b, kvh, j0, n, Np, kTileK, VT);
      pack_keep(mask, d, b, j0, n, Np, keep);
      if (kseg) pack_kseg(kseg, d, b, j0, n, Np, KS);
      std::fill(dK, dK + kTileK * Dp, A(0));
      std::fill(dV, dV + kTileK * Dp, A(0));
      // query rows that can see a key of this tile
      int64_t ilo = 0, ihi = d.Sq - 1;
      if (o.kind >= 1) ilo = std::max<int64_t>(j0 - off, 0);
      if (o.kind == 2) ihi = std::min<int64_t>(j0 + n - 1 - off + o.window, d.Sq - 1);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        A* qg = Qs + g * Sqp * Dp;
        A* dog = dO + g * Sqp * Dp;
        A* dqg = dQ + g * Sqp * Dp;
        const A* lse = stat + g * 2 * Sqp;
        const A* delta = lse + Sqp;
        for (int64_t i0 = ilo / kTileQ * kTileQ; i0 <= ihi; i0 += kTileQ) {
          if (!tiles_meet(q_ranges, k_ranges, b, i0 / kTileQ, kt)) continue;
          const int64_t rows = std::min(kTileQ, d.Sq - i0), Mp = round_up(rows, kPadM);
          if (BT) pack_bias(bias, d, b, h, i0, rows, j0, n, kTileK, BT);
          gemm(Mp, Np, d.D, qg + i0 * Dp, Dp, KT, kTileK, S, kTileK, false);
          gemm(Mp, Np, d.D, dog + i0 * Dp, Dp, VT, kTileK, dP, kTileK, false);
          Tile<A> t{rows, Np, kTileK, j0, keep, lo.data() + i0, hi.data() + i0, BT, A(o.softcap)};
          if (qseg) { t.qseg = qseg + b * d.Sq + i0; t.kseg = KS; }
          bwd_tile(t, lse + i0, delta + i0, S, dP, P, DB);
          for (int64_t r = rows; r < Mp; ++r)
            for (int64_t c = 0; c < Np; ++c) { P[r * kTileK + c] = 0; S[r * kTileK + c] = 0; }
          gemm_tn(Np, Dp, Mp, P, kTileK, dog + i0 * Dp, Dp, dV, Dp, true);
          gemm_tn(Np, Dp, Mp, S, kTileK, qg + i0 * Dp, Dp, dK, Dp, true);
          gemm(Mp, Dp, Np, S, kTileK, K, Dp, dqg + i0 * Dp, Dp, true);
          if (DB)
            for (int64_t r = 0; r < rows; ++r) {
              T* dst = dbias + ((b * d.H + h) * d.Sq + i0 + r) * d.Sk + j0;
              for (int64_t c = 0; c < n; ++c) dst[c] = store<T>(DB[r * kTileK + c]);
            }
        }
      }
      for (int64_t c = 0; c < n; ++c) {
        T* dkr = dk + ((b * d.Sk + j0 + c) * d.Hkv + kvh) * d.D;
        T* dvr = dv + ((b * d.Sk + j0 + c) * d.Hkv + kvh) * d.D;
        for (int64_t e = 0; e < d.D; ++e) {
          dkr[e] = store<T>(dK[c * Dp + e]);
          dvr[e] = store<T>(dV[c * Dp + e]);
        }
      }
    }
    if (chunks == 1) write_dq<T, A>(d, A(o.scale), b, kvh, dQ, Sqp, Dp, dq);
  });
  if (chunks == 1) return;
  parallel_for(pool, pairs, [&](int64_t pair) {
    A* acc = dq_parts.data() + pair * chunks * dq_size;
    for (int64_t c = 1; c < chunks; ++c) {
      const A* part = acc + c * dq_size;
      for (int64_t x = 0; x < dq_size; ++x) acc[x] += part[x];
    }
    write_dq<T, A>(d, A(o.scale), pair / d.Hkv, pair % d.Hkv, acc, Sqp, Dp, dq);
  });
}

// ---- validation -------------------------------------------------------------------------------
using attention::check_segments;

const int32_t* seg_data(const ffi::AnyBuffer* x) {
  return x ? static_cast<const int32_t*>(x->untyped_data()) : nullptr;
}

// The forward of both targets; qseg / kseg: null for the target without segment ids.
ffi::Error attention_fwd_checked(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::AnyBuffer mask, ffi::AnyBuffer bias,
                                 const ffi::AnyBuffer* qseg, const ffi::AnyBuffer* kseg,
                                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                                 const Opts& o) {
  Dims d;
  if (auto e = attention::check_inputs(Backend::kCpu, "attention", q, k, v, mask, bias, o, &d);
      e.failure())
    return e;
  if (auto e = check_segments("attention", qseg, kseg, d); e.failure()) return e;
  if (auto e = attention::check_fwd_results(Backend::kCpu, q, *out, *lse, d); e.failure()) return e;
  if (d.B * d.H * d.Sq == 0) return ffi::Error::Success();
  bool ok = dispatch_float(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    attention_fwd_typed<T>(pool, d, o, static_cast<const T*>(q.untyped_data()),
                           static_cast<const T*>(k.untyped_data()),
                           static_cast<const T*>(v.untyped_data()),
                           o.has_mask ? static_cast<const float*>(mask.untyped_data()) : nullptr,
                           o.has_bias ? static_cast<const T*>(bias.untyped_data()) : nullptr,
                           seg_data(qseg), seg_data(kseg), static_cast<T*>(out->untyped_data()),
                           lse->untyped_data());
  });
  if (!ok) return invalid("attention: unsupported dtype " + dtype_name(q.element_type()));
  return ffi::Error::Success();
}

ffi::Error AttentionFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer mask, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                            double scale, double softcap, int64_t mask_kind, int64_t window,
                            int64_t has_mask, int64_t has_bias) {
  const Opts o = attention::make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  return attention_fwd_checked(pool, q, k, v, mask, bias, nullptr, nullptr, out, lse, o);
}

ffi::Error AttentionSegmentsFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer mask, ffi::AnyBuffer bias,
                                    ffi::AnyBuffer qseg, ffi::AnyBuffer kseg,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> lse, double scale, double softcap,
                                    int64_t mask_kind, int64_t window, int64_t has_mask,
                                    int64_t has_bias) {
  const Opts o = attention::make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  return attention_fwd_checked(pool, q, k, v, mask, bias, &qseg, &kseg, out, lse, o);
}

// The backward of both targets; qseg / kseg: null for the target without segment ids.
ffi::Error attention_bwd_checked(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                 ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer mask,
                                 ffi::AnyBuffer bias, const ffi::AnyBuffer* qseg,
                                 const ffi::AnyBuffer* kseg, ffi::Result<ffi::AnyBuffer> dq,
                                 ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                 ffi::Result<ffi::AnyBuffer> dbias, const Opts& o) {
  Dims d;
  const char* who = "attention backward";
  if (auto e = attention::check_inputs(Backend::kCpu, who, q, k, v, mask, bias, o, &d); e.failure())
    return e;
  if (auto e = check_segments(who, qseg, kseg, d); e.failure()) return e;
  if (auto e = attention::check_bwd_rest(Backend::kCpu, q, k, bias, out, lse, dout, dlse, *dq, *dk,
                                         *dv, *dbias, o, d);
      e.failure())
    return e;
  const auto t = q.element_type();
  if (d.B * d.Hkv == 0) return ffi::Error::Success();
  bool ok = dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    attention_bwd_typed<T>(
        pool, d, o, static_cast<const T*>(q.untyped_data()),
        static_cast<const T*>(k.untyped_data()), static_cast<const T*>(v.untyped_data()),
        static_cast<const T*>(out.untyped_data()), lse.untyped_data(),
        static_cast<const T*>(dout.untyped_data()), dlse.untyped_data(),
        o.has_mask ? static_cast<const float*>(mask.untyped_data()) : nullptr,
        o.has_bias ? static_cast<const T*>(bias.untyped_data()) : nullptr, seg_data(qseg),
        seg_data(kseg), static_cast<T*>(dq->untyped_data()), static_cast<T*>(dk->untyped_data()),
        static_cast<T*>(dv->untyped_data()),
        o.has_bias ? static_cast<T*>(dbias->untyped_data()) : nullptr);
  });
  if (!ok) return invalid("attention backward: unsupported dtype " + dtype_name(t));
  return ffi::Error::Success();
}

ffi::Error AttentionBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                            ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer mask,
                            ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dq,
                            ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                            ffi::Result<ffi::AnyBuffer> dbias, double scale, double softcap,
                            int64_t mask_kind, int64_t window, int64_t has_mask,
                            int64_t has_bias) {
  const Opts o = attention::make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  return attention_bwd_checked(pool, q, k, v, out, lse, dout, dlse, mask, bias, nullptr, nullptr,
                               dq, dk, dv, dbias, o);
}

ffi::Error AttentionSegmentsBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                    ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer mask,
                                    ffi::AnyBuffer bias, ffi::AnyBuffer qseg, ffi::AnyBuffer kseg,
                                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                    ffi::Result<ffi::AnyBuffer> dv,
                                    ffi::Result<ffi::AnyBuffer> dbias, double scale,
                                    double softcap, int64_t mask_kind, int64_t window,
                                    int64_t has_mask, int64_t has_bias) {
  const Opts o = attention::make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  return attention_bwd_checked(pool, q, k, v, out, lse, dout, dlse, mask, bias, &qseg, &kseg, dq,
                               dk, dv, dbias, o);
}

// ---- bindings ---------------------------------------------------------------------------------
// forward:  (q, k, v, mask, bias) -> (out, lse)
// backward: (q, k, v, out, lse, dout, dlse, mask, bias) -> (dq, dk, dv, dbias)
// The segment-id targets take q_segment_ids [B, Sq] and kv_segment_ids [B, Sk] (int32) after
// the bias. Absent mask / bias are dummy [0] operands (dbias then a dummy [0] result). Every
// target takes the same attributes.
auto bind() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionFwd, AttentionFwdImpl,
                              attention::with_attrs(attention::results<2>(attention::operands<5>(bind()))));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionBwd, AttentionBwdImpl,
                              attention::with_attrs(attention::results<4>(attention::operands<9>(bind()))));
// Targets of their own for the segment ids, so the two above keep their ABI.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionSegmentsFwd, AttentionSegmentsFwdImpl,
                              attention::with_attrs(attention::results<2>(attention::operands<7>(bind()))));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionSegmentsBwd, AttentionSegmentsBwdImpl,
                              attention::with_attrs(attention::results<4>(attention::operands<11>(bind()))));

RLX_REGISTER_HANDLER("rlx_attention_fwd", RlxAttentionFwd);
RLX_REGISTER_HANDLER("rlx_attention_bwd", RlxAttentionBwd);
RLX_REGISTER_HANDLER("rlx_attention_segments_fwd", RlxAttentionSegmentsFwd);
RLX_REGISTER_HANDLER("rlx_attention_segments_bwd", RlxAttentionSegmentsBwd);

}  // namespace rlx
