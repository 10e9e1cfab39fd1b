// Gaussian splatting maths shared by the CPU (gaussian_splat.cc) and CUDA
// (gaussian_splat.cu) kernels: camera from meta, per-Gaussian projection (EWA),
// SH colour, and a small forward-mode dual number used by the backward to get the exact
// Jacobian of the per-Gaussian projection (10 scene inputs -> 5 screen outputs)
// without hand-expanded derivative formulas. Conventions: rlx_jax/vjp_rules/gaussian_splat.py.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define RLX_HD __host__ __device__ __forceinline__
#else
#define RLX_HD inline
#endif

namespace rlx {
namespace splat {

constexpr float kLowPass = 0.3f;
constexpr float kAlphaMax = 0.99f;
constexpr int kMaxSh = 16;

// ---- forward-mode dual numbers --------------------------------------------------
template <int N>
struct Dual {
  float v;
  float d[N];
  RLX_HD Dual() : v(0.f) { for (int i = 0; i < N; ++i) d[i] = 0.f; }
  RLX_HD Dual(float x) : v(x) { for (int i = 0; i < N; ++i) d[i] = 0.f; }
  static RLX_HD Dual seed(float x, int i) { Dual r(x); r.d[i] = 1.f; return r; }
};
template <int N> RLX_HD Dual<N> operator+(const Dual<N>& a, const Dual<N>& b) {
  Dual<N> r(a.v + b.v); for (int i = 0; i < N; ++i) r.d[i] = a.d[i] + b.d[i]; return r; }
template <int N> RLX_HD Dual<N> operator-(const Dual<N>& a, const Dual<N>& b) {
  Dual<N> r(a.v - b.v); for (int i = 0; i < N; ++i) r.d[i] = a.d[i] - b.d[i]; return r; }
template <int N> RLX_HD Dual<N> operator-(const Dual<N>& a) {
  Dual<N> r(-a.v); for (int i = 0; i < N; ++i) r.d[i] = -a.d[i]; return r; }
template <int N> RLX_HD Dual<N> operator*(const Dual<N>& a, const Dual<N>& b) {
  Dual<N> r(a.v * b.v); for (int i = 0; i < N; ++i) r.d[i] = a.d[i] * b.v + a.v * b.d[i]; return r; }
template <int N> RLX_HD Dual<N> operator/(const Dual<N>& a, const Dual<N>& b) {
  float inv = 1.f / b.v; Dual<N> r(a.v * inv);
  for (int i = 0; i < N; ++i) { r.d[i] = (a.d[i] - r.v * b.d[i]) * inv; }
  return r; }
template <int N> RLX_HD Dual<N> operator+(const Dual<N>& a, float b) { Dual<N> r = a; r.v += b; return r; }
template <int N> RLX_HD Dual<N> operator+(float b, const Dual<N>& a) { return a + b; }
template <int N> RLX_HD Dual<N> operator-(const Dual<N>& a, float b) { Dual<N> r = a; r.v -= b; return r; }
template <int N> RLX_HD Dual<N> operator-(float b, const Dual<N>& a) { return -(a - b); }
template <int N> RLX_HD Dual<N> operator*(const Dual<N>& a, float b) {
  Dual<N> r(a.v * b); for (int i = 0; i < N; ++i) r.d[i] = a.d[i] * b; return r; }
template <int N> RLX_HD Dual<N> operator*(float b, const Dual<N>& a) { return a * b; }
template <int N> RLX_HD Dual<N> operator/(const Dual<N>& a, float b) { return a * (1.f / b); }
template <int N> RLX_HD Dual<N> operator/(float a, const Dual<N>& b) { return Dual<N>(a) / b; }
template <int N> RLX_HD Dual<N> dexp(const Dual<N>& a) {
  float e = expf(a.v); Dual<N> r(e); for (int i = 0; i < N; ++i) r.d[i] = a.d[i] * e; return r; }
template <int N> RLX_HD Dual<N> dsqrt(const Dual<N>& a) {
  float s = sqrtf(a.v); Dual<N> r(s); float k = 0.5f / s;
  for (int i = 0; i < N; ++i) { r.d[i] = a.d[i] * k; }
  return r; }
RLX_HD float dexp(float a) { return expf(a); }
RLX_HD float dsqrt(float a) { return sqrtf(a); }
RLX_HD float val(float a) { return a; }
template <int N> RLX_HD float val(const Dual<N>& a) { return a.v; }

// ---- camera -----------------------------------------------------------------------
struct Camera {
  float pos[3];
  float basis[9];  // rows: right, up, forward
  float focal, near_, far_;
  float bg[3];
  float width, height;
};

RLX_HD void unit3(float* v) {
  float n = sqrtf(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
  n = n > 1e-8f ? n : 1e-8f;
  v[0] /= n; v[1] /= n; v[2] /= n;
}
RLX_HD void cross3(const float* a, const float* b, float* o) {
  o[0] = a[1] * b[2] - a[2] * b[1];
  o[1] = a[2] * b[0] - a[0] * b[2];
  o[2] = a[0] * b[1] - a[1] * b[0];
}

// RLX look_at: forward = |target - pos|, right = |up x forward|, up' = |forward x right|.
RLX_HD Camera camera_from_meta(const float* m, int width, int height) {
  Camera c;
  for (int i = 0; i < 3; ++i) c.pos[i] = m[i];
  float up[3] = {m[6], m[7], m[8]};
  unit3(up);
  float fwd[3] = {m[3] - m[0], m[4] - m[1], m[5] - m[2]};
  unit3(fwd);
  float right[3], upc[3];
  cross3(up, fwd, right);
  unit3(right);
  cross3(fwd, right, upc);
  unit3(upc);
  for (int i = 0; i < 3; ++i) {
    c.basis[i] = right[i];
    c.basis[3 + i] = upc[i];
    c.basis[6 + i] = fwd[i];
  }
  const float deg2rad = 0.017453292519943295f;
  c.focal = 0.5f * float(height) / tanf(0.5f * m[9] * deg2rad);
  c.near_ = m[10];
  c.far_ = m[11];
  for (int i = 0; i < 3; ++i) c.bg[i] = m[12 + i];
  c.width = float(width);
  c.height = float(height);
  return c;
}

// ---- projection ---------------------------------------------------------------------
// p, log_scale, quat (x y z w) -> screen centre (u, v), conic (a, b, c) of the inverse
// 2-D covariance, depth z and the largest-eigenvalue bound lam. False when invisible.
template <class S>
RLX_HD bool project_gaussian(const S* p, const S* ls, const S* q, const Camera& cam, S& u, S& v, S* conic,
                             float& depth, float& lam) {
  S d0 = p[0] - cam.pos[0], d1 = p[1] - cam.pos[1], d2 = p[2] - cam.pos[2];
  const float* B = cam.basis;
  S x = d0 * B[0] + d1 * B[1] + d2 * B[2];
  S y = d0 * B[3] + d1 * B[4] + d2 * B[5];
  S z = d0 * B[6] + d1 * B[7] + d2 * B[8];
  depth = val(z);
  if (!(val(z) > cam.near_ && val(z) < cam.far_)) return false;
  const float f = cam.focal;
  u = f * x / z + 0.5f * cam.width;
  v = f * y / z + 0.5f * cam.height;
  S qn = dsqrt(q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3]);
  S qx = q[0] / qn, qy = q[1] / qn, qz = q[2] / qn, qw = q[3] / qn;
  S R[9] = {1.f - 2.f * (qy * qy + qz * qz), 2.f * (qx * qy - qw * qz), 2.f * (qx * qz + qw * qy),
            2.f * (qx * qy + qw * qz), 1.f - 2.f * (qx * qx + qz * qz), 2.f * (qy * qz - qw * qx),
            2.f * (qx * qz - qw * qy), 2.f * (qy * qz + qw * qx), 1.f - 2.f * (qx * qx + qy * qy)};
  S e[3] = {dexp(ls[0]), dexp(ls[1]), dexp(ls[2])};
  // M = B R S (camera-frame axes); camera covariance = M M^T
  S M[9];
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) M[i * 3 + j] = (B[i * 3] * R[j] + B[i * 3 + 1] * R[3 + j] + B[i * 3 + 2] * R[6 + j]) * e[j];
  // T = J M (2x3); Sigma2 = T T^T
  S iz = 1.f / z;
  S fz = f * iz;
  S j02 = -(f * x) * iz * iz, j12 = -(f * y) * iz * iz;
  S T0[3], T1[3];
  for (int j = 0; j < 3; ++j) {
    T0[j] = fz * M[j] + j02 * M[6 + j];
    T1[j] = fz * M[3 + j] + j12 * M[6 + j];
  }
  S sa = T0[0] * T0[0] + T0[1] * T0[1] + T0[2] * T0[2] + kLowPass;
  S sb = T0[0] * T1[0] + T0[1] * T1[1] + T0[2] * T1[2];
  S sc = T1[0] * T1[0] + T1[1] * T1[1] + T1[2] * T1[2] + kLowPass;
  S det = sa * sc - sb * sb;
  if (!(val(det) > 0.f)) return false;
  conic[0] = sc / det;
  conic[1] = -sb / det;
  conic[2] = sa / det;
  float mid = 0.5f * (val(sa) + val(sc));
  float disc = mid * mid - val(det);
  lam = mid + sqrtf(disc > 0.1f ? disc : 0.1f);
  return true;
}

// First k real SH basis functions (3DGS order and signs) at the unit direction (x, y, z).
template <class S>
RLX_HD void sh_basis(const S& x, const S& y, const S& z, int k, S* b) {
  const float C0 = 0.28209479177387814f, C1 = 0.4886025119029199f;
  const float C2[5] = {1.0925484305920792f, -1.0925484305920792f, 0.31539156525252005f, -1.0925484305920792f,
                       0.5462742152960396f};
  const float C3[7] = {-0.5900435899266435f, 2.890611442640554f, -0.4570457994644658f, 0.3731763325901154f,
                       -0.4570457994644658f, 1.445305721320277f, -0.5900435899266435f};
  if (k > 0) b[0] = S(C0);
  if (k > 1) b[1] = -C1 * y;
  if (k > 2) b[2] = C1 * z;
  if (k > 3) b[3] = -C1 * x;
  if (k > 4) {
    S xx = x * x, yy = y * y, zz = z * z;
    b[4] = C2[0] * (x * y);
    if (k > 5) b[5] = C2[1] * (y * z);
    if (k > 6) b[6] = C2[2] * (2.f * zz - xx - yy);
    if (k > 7) b[7] = C2[3] * (x * z);
    if (k > 8) b[8] = C2[4] * (xx - yy);
    if (k > 9) b[9] = C3[0] * y * (3.f * xx - yy);
    if (k > 10) b[10] = C3[1] * (x * y * z);
    if (k > 11) b[11] = C3[2] * y * (4.f * zz - xx - yy);
    if (k > 12) b[12] = C3[3] * z * (2.f * zz - 3.f * xx - 3.f * yy);
    if (k > 13) b[13] = C3[4] * x * (4.f * zz - xx - yy);
    if (k > 14) b[14] = C3[5] * z * (xx - yy);
    if (k > 15) b[15] = C3[6] * x * (xx - 3.f * yy);
  }
}

// unit view direction from the camera to p
template <class S>
RLX_HD void view_dir(const S* p, const Camera& cam, S& x, S& y, S& z) {
  S d0 = p[0] - cam.pos[0], d1 = p[1] - cam.pos[1], d2 = p[2] - cam.pos[2];
  S n = dsqrt(d0 * d0 + d1 * d1 + d2 * d2);
  x = d0 / n; y = d1 / n; z = d2 / n;
}

RLX_HD float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

// integer tile box [x0, x1) x [y0, y1) of a projected Gaussian (as the reference computes it)
RLX_HD void tile_rect(float u, float v, float lam, float radius_scale, int tile_size, int tiles_x, int tiles_y,
                      int* rect) {
  float r = radius_scale * sqrtf(lam);
  float ts = float(tile_size);
  auto clampi = [](float a, int hi) { return a < 0.f ? 0 : (a > float(hi) ? hi : int(a)); };
  rect[0] = clampi(floorf((u - r) / ts), tiles_x);
  rect[1] = clampi(floorf((u + r) / ts) + 1.f, tiles_x);
  rect[2] = clampi(floorf((v - r) / ts), tiles_y);
  rect[3] = clampi(floorf((v + r) / ts) + 1.f, tiles_y);
}

}  // namespace splat
}  // namespace rlx
