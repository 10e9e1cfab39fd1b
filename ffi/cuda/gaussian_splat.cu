// 3-D Gaussian splatting on NVIDIA GPUs (RLX GaussianSplatRender / Backward); the same
// maths and order of decisions as ffi/cpu/gaussian_splat.cc (shared header
// cpu/gaussian_splat_math.h). All working memory is an i32 scratch result that XLA
// allocates (size: cuda_scratch_elems in rlx_jax/vjp_rules/gaussian_splat.py, which must
// agree with scratch_needed below). No host synchronisation: the camera is built from
// meta on the device, and every list is sized by the static max_list_entries bound, so
// a call only enqueues kernels and a memset on XLA's stream (the handlers are marked
// command-buffer compatible; XLA was not observed capturing them into a CUDA graph,
// only that nothing breaks with command buffers enabled).
//
// Pipeline: camera (one thread) -> anisotropy limit and preprocess (thread per Gaussian)
// -> pair numbers (block scan) -> per-tile counts (pairs numbered >= max_list_entries
// dropped) -> bucket each pair into its tile with the 64-bit key (depth, index) ->
// per-tile sort (block per tile: bitonic sort of chunks of kSortChunk keys in shared
// memory, then merge passes by ranking in global memory; keys are unique, so the result
// does not depend on the bucket order the atomics produced, and equal depths order by
// index exactly as the CPU kernel's comparison does) -> composite (block per tile,
// thread per pixel).
// Backward: the same preparation, then per tile all pixels walk the tile's list back to
// front together; each pair's 9 partial gradients are block-reduced in a fixed order and
// written to that pair's own slot (pairs no pixel reached get zeros), then summed
// Gaussian by Gaussian in pair order and chained through the projection with
// forward-mode duals. No float atomics: bitwise deterministic.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cpu/gaussian_splat_math.h"
#include "gaussian_splat_checks.h"

namespace rlx {
namespace cuda {
namespace {

using splat::Camera;
using splat::Dual;

struct Params {
  int width, height, tile_size, tiles_x, tiles_y;
  float radius_scale, alpha_cutoff;
  int64_t max_steps;
  float threshold;
  int64_t max_list;
};

struct Scene {
  const float *pos, *scale, *rot, *opac, *col, *sh;
  int n, k;
};

typedef unsigned long long Key;  // (orderable depth bits << 32) | Gaussian index

// scratch layout (i32 units); the pair region first so the 64-bit keys are 8-byte aligned
struct Work {
  Camera* cam;       // kCamSlots i32
  Key* key_a;        // per pair: bucketed keys, then sorted in place
  Key* key_b;        // per pair: merge buffer
  int* sg;           // per pair: Gaussian of each list entry, tile by tile, depth order
  int* sr;           // per pair (backward only): its pair number
  float* pair_grad;  // 9 per pair (backward only)
  float* gf;         // 10 per Gaussian: u v c0 c1 c2 r g b opac depth
  int* rect;         // 4 per Gaussian (x0 x1 y0 y1), all 0 when invisible
  int* cnt;          // pairs per Gaussian
  int* off;          // first pair number
  int* total;        // [0] kept pairs (clipped to int), [1] kept pairs capped by max_list
  float* scales;     // 3 per Gaussian: log-scales the pass uses (anisotropy-limited)
  unsigned char* clamped;  // 3 per Gaussian
  int* tile_start;   // tiles + 1
  int* cursor;       // tiles
};

constexpr int64_t kCamSlots = 32;
static_assert(sizeof(Camera) <= kCamSlots * 4, "camera slot too small");

// i32 elements the kernels use; rlx_jax.vjp_rules.gaussian_splat.cuda_scratch_elems must
// return exactly this (it is checked on every call)
int64_t scratch_needed(int64_t n, int64_t e, int64_t tiles, bool backward) {
  return kCamSlots + (backward ? 15 : 5) * e + 20 * n + 2 * tiles + 8;
}

Work carve(int32_t* base, int64_t n, int64_t e, int64_t tiles, bool backward) {
  Work w;
  int32_t* p = base;
  w.cam = reinterpret_cast<Camera*>(p); p += kCamSlots;
  w.key_a = reinterpret_cast<Key*>(p); p += 2 * e;
  w.key_b = reinterpret_cast<Key*>(p); p += 2 * e;
  w.sg = p; p += e;
  w.sr = nullptr;
  w.pair_grad = nullptr;
  if (backward) {
    w.sr = p; p += e;
    w.pair_grad = reinterpret_cast<float*>(p); p += 9 * e;
  }
  w.gf = reinterpret_cast<float*>(p); p += 10 * n;
  w.rect = p; p += 4 * n;
  w.cnt = p; p += n;
  w.off = p; p += n + 1;
  w.total = p; p += 2;
  w.scales = reinterpret_cast<float*>(p); p += 3 * n;
  w.clamped = reinterpret_cast<unsigned char*>(p); p += (3 * n + 3) / 4;
  w.tile_start = p; p += tiles + 1;
  w.cursor = p; p += tiles;
  // used: kCamSlots + (5|15) e + 19 n + ceil(3n/4) + 2 tiles + 4 <= scratch_needed (n >= 1)
  return w;
}

// ---- camera on the device (double precision, rounded once to float: independent of
// --use_fast_math; agrees with the host float computation of camera_from_meta to an ulp)
__device__ void unit3d(double* v) {
  double n = sqrt(v[0] * v[0] + v[1] * v[1] + v[2] * v[2]);
  n = n > 1e-8 ? n : 1e-8;
  v[0] /= n; v[1] /= n; v[2] /= n;
}
__device__ void cross3d(const double* a, const double* b, double* o) {
  o[0] = a[1] * b[2] - a[2] * b[1];
  o[1] = a[2] * b[0] - a[0] * b[2];
  o[2] = a[0] * b[1] - a[1] * b[0];
}

__global__ void make_camera(const float* m, int width, int height, Camera* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  Camera c;
  double up[3] = {m[6], m[7], m[8]};
  unit3d(up);
  double fwd[3] = {double(m[3]) - m[0], double(m[4]) - m[1], double(m[5]) - m[2]};
  unit3d(fwd);
  double right[3], upc[3];
  cross3d(up, fwd, right);
  unit3d(right);
  cross3d(fwd, right, upc);
  unit3d(upc);
  for (int i = 0; i < 3; ++i) {
    c.pos[i] = m[i];
    c.basis[i] = float(right[i]);
    c.basis[3 + i] = float(upc[i]);
    c.basis[6 + i] = float(fwd[i]);
    c.bg[i] = m[12 + i];
  }
  // the host computes 0.5 * height / tanf(0.5 * fov * deg2rad) in float
  float half_angle = 0.5f * m[9] * 0.017453292519943295f;  // exact-rounded float products
  const float tan_half = float(tan(double(half_angle)));                // tanf, correctly rounded
  c.focal = __fdiv_rn(0.5f * float(height), tan_half);                   // IEEE division
  c.near_ = m[10];
  c.far_ = m[11];
  c.width = float(width);
  c.height = float(height);
  *out = c;
}

__global__ void limit_scales(Scene s, float log_max_aniso, bool limit, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n) return;
  const float* sc = s.scale + 3 * int64_t(i);
  float floor_ = limit ? fmaxf(sc[0], fmaxf(sc[1], sc[2])) - log_max_aniso : -INFINITY;
  for (int j = 0; j < 3; ++j) {
    bool c = sc[j] < floor_;
    w.scales[3 * int64_t(i) + j] = c ? floor_ : sc[j];
    w.clamped[3 * int64_t(i) + j] = c ? 1 : 0;
  }
}

__global__ void preprocess(Scene s, Params p, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n) return;
  const Camera cam = *w.cam;
  float u = 0.f, v = 0.f, conic[3] = {0.f, 0.f, 0.f}, depth = 0.f, lam = 0.f;
  bool vis = splat::project_gaussian<float>(s.pos + 3 * int64_t(i), w.scales + 3 * int64_t(i),
                                            s.rot + 4 * int64_t(i), cam, u, v, conic, depth, lam);
  float* g = w.gf + 10 * int64_t(i);
  float dx, dy, dz;
  splat::view_dir<float>(s.pos + 3 * int64_t(i), cam, dx, dy, dz);
  float b[splat::kMaxSh];
  splat::sh_basis<float>(dx, dy, dz, s.k, b);
  for (int ch = 0; ch < 3; ++ch) {
    float acc = s.col[3 * int64_t(i) + ch];
    for (int k = 0; k < s.k; ++k) acc += b[k] * s.sh[(int64_t(i) * s.k + k) * 3 + ch];
    g[5 + ch] = acc;
  }
  g[0] = u; g[1] = v; g[2] = conic[0]; g[3] = conic[1]; g[4] = conic[2];
  g[8] = splat::sigmoidf(s.opac[i]);
  g[9] = depth;
  int* r = w.rect + 4 * int64_t(i);
  if (vis) {
    splat::tile_rect(u, v, lam, p.radius_scale, p.tile_size, p.tiles_x, p.tiles_y, r);
  } else {
    r[0] = r[1] = r[2] = r[3] = 0;
  }
  int cw = r[1] - r[0], ch = r[3] - r[2];
  w.cnt[i] = (vis && cw > 0 && ch > 0) ? cw * ch : 0;
}

// exclusive scan of m ints by one block of 1024 threads (out[m] = total, clipped to int);
// with out_total: [0] = total clipped to int, [1] = min(total, cap)
__global__ void block_scan(const int* in, int* out, int m, int* out_total, int64_t cap) {
  __shared__ long long sums[1024];
  int t = threadIdx.x;
  int64_t per = (int64_t(m) + blockDim.x - 1) / blockDim.x;
  int64_t a = t * per, b = a + per < m ? a + per : m;
  long long local = 0;
  for (int64_t i = a; i < b; ++i) local += in[i];
  sums[t] = local;
  __syncthreads();
  for (int d = 1; d < blockDim.x; d <<= 1) {
    long long x = t >= d ? sums[t - d] : 0;
    __syncthreads();
    sums[t] += x;
    __syncthreads();
  }
  long long run = sums[t] - local;
  for (int64_t i = a; i < b; ++i) {
    int x = in[i];
    out[i] = int(run < 0x7fffffffLL ? run : 0x7fffffffLL);
    run += x;
  }
  if (t == blockDim.x - 1) {
    long long tot = sums[t];
    long long big = tot < 0x7fffffffLL ? tot : 0x7fffffffLL;
    out[m] = int(big);
    if (out_total) {
      out_total[0] = int(big);
      out_total[1] = int(tot < cap ? tot : cap);
    }
  }
}

__global__ void count_tiles(Scene s, Params p, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n || w.cnt[i] == 0) return;
  const int* r = w.rect + 4 * int64_t(i);
  int64_t rank = w.off[i];
  for (int y = r[2]; y < r[3]; ++y)
    for (int x = r[0]; x < r[1]; ++x, ++rank) {
      if (rank >= p.max_list) return;
      atomicAdd(&w.cursor[y * p.tiles_x + x], 1);
    }
}

__global__ void copy_ints(const int* a, int* b, int m) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < m) b[i] = a[i];
}

// float -> unsigned with the same order for non-NaN values (-0 and +0 equal, as the CPU
// kernel's float comparison treats them)
__device__ __forceinline__ unsigned order_bits(float d) {
  unsigned u = __float_as_uint(d == 0.f ? 0.f : d);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void bucket(Scene s, Params p, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n || w.cnt[i] == 0) return;
  const int* r = w.rect + 4 * int64_t(i);
  Key key = (Key(order_bits(w.gf[10 * int64_t(i) + 9])) << 32) | Key(unsigned(i));
  int64_t rank = w.off[i];
  for (int y = r[2]; y < r[3]; ++y)
    for (int x = r[0]; x < r[1]; ++x, ++rank) {
      if (rank >= p.max_list) return;
      int slot = atomicAdd(&w.cursor[y * p.tiles_x + x], 1);
      w.key_a[slot] = key;
    }
}

constexpr int kSortThreads = 512;
constexpr int kSortChunk = 4096;  // keys sorted in shared memory at once (32 KiB)

// number of keys in sorted k[0, len) smaller than key
__device__ __forceinline__ int rank_in(const Key* k, int len, Key key) {
  int lo = 0, hi = len;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (k[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// block per tile: sort the tile's keys ascending, then write the Gaussian of each entry
// (and in the backward its pair number: offset + row-major position in its tile box)
__global__ void __launch_bounds__(kSortThreads) sort_tiles(Params p, Work w) {
  __shared__ Key sk[kSortChunk];
  const int t = blockIdx.x;
  const int a = w.tile_start[t], m = w.tile_start[t + 1] - a;
  if (m <= 0) return;
  Key* src = w.key_a + a;
  Key* dst = w.key_b + a;
  // 1. chunks of kSortChunk keys: bitonic sort in shared memory (padded with ~0)
  for (int c0 = 0; c0 < m; c0 += kSortChunk) {
    const int len = m - c0 < kSortChunk ? m - c0 : kSortChunk;
    int pw = 1;
    while (pw < len) pw <<= 1;
    for (int i = threadIdx.x; i < pw; i += blockDim.x) sk[i] = i < len ? src[c0 + i] : ~Key(0);
    __syncthreads();
    for (int k = 2; k <= pw; k <<= 1)
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = threadIdx.x; i < pw; i += blockDim.x) {
          int ixj = i ^ j;
          if (ixj > i) {
            Key x = sk[i], y = sk[ixj];
            bool up = (i & k) == 0;
            if ((x > y) == up) { sk[i] = y; sk[ixj] = x; }
          }
        }
        __syncthreads();
      }
    for (int i = threadIdx.x; i < len; i += blockDim.x) src[c0 + i] = sk[i];
    __syncthreads();
  }
  // 2. merge sorted runs pairwise (keys unique: position = own index + rank in partner)
  for (int64_t width = kSortChunk; width < m; width <<= 1) {
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      const int64_t run = i / width, start = run * width, base = (run & ~int64_t(1)) * width;
      const Key key = src[i];
      int64_t other;
      if (run & 1) {
        other = rank_in(src + base, int(width), key);
      } else {
        int64_t r0 = start + width;
        int64_t rlen = m - r0 < width ? m - r0 : width;
        other = rlen > 0 ? rank_in(src + r0, int(rlen), key) : 0;
      }
      dst[base + (i - start) + other] = key;
    }
    __syncthreads();
    Key* tmp = src; src = dst; dst = tmp;
  }
  const int tx = t % p.tiles_x, ty = t / p.tiles_x;
  for (int i = threadIdx.x; i < m; i += blockDim.x) {
    int g = int(unsigned(src[i] & 0xffffffffull));
    w.sg[a + i] = g;
    if (w.sr) {
      const int* r = w.rect + 4 * int64_t(g);
      w.sr[a + i] = w.off[g] + (ty - r[2]) * (r[1] - r[0]) + (tx - r[0]);
    }
  }
}

__device__ __forceinline__ float alpha_at(const float* g, float px, float py, float& gauss, float& dx, float& dy) {
  dx = g[0] - px;
  dy = g[1] - py;
  float q = g[2] * dx * dx + 2.f * g[3] * dx * dy + g[4] * dy * dy;
  gauss = expf(-0.5f * q);
  return fminf(splat::kAlphaMax, g[8] * gauss);
}

__device__ void composite(const Work& w, const Params& p, int a, int b, float px, float py, float* rgb,
                          float& t_final, int& last) {
  float T = 1.f;
  int64_t steps = 0;
  last = a;
  rgb[0] = rgb[1] = rgb[2] = 0.f;
  for (int e = a; e < b; ++e) {
    if (steps >= p.max_steps) break;
    const float* g = w.gf + 10 * int64_t(w.sg[e]);
    float gauss, dx, dy;
    float alpha = alpha_at(g, px, py, gauss, dx, dy);
    if (!(alpha >= p.alpha_cutoff)) continue;
    float test = T * (1.f - alpha);
    if (test < p.threshold) break;
    float wgt = alpha * T;
    for (int c = 0; c < 3; ++c) rgb[c] += wgt * g[5 + c];
    T = test;
    ++steps;
    last = e + 1;
  }
  t_final = T;
}

__global__ void render(Params p, Work w, float* img) {
  int t = blockIdx.x;
  int tx0 = (t % p.tiles_x) * p.tile_size, ty0 = (t / p.tiles_x) * p.tile_size;
  int a = w.tile_start[t], b = w.tile_start[t + 1];
  const float bg[3] = {w.cam->bg[0], w.cam->bg[1], w.cam->bg[2]};
  for (int l = threadIdx.x; l < p.tile_size * p.tile_size; l += blockDim.x) {
    int x = tx0 + l % p.tile_size, y = ty0 + l / p.tile_size;
    if (x >= p.width || y >= p.height) continue;
    float rgb[3], T;
    int last;
    composite(w, p, a, b, x + 0.5f, y + 0.5f, rgb, T, last);
    float* o = img + (int64_t(y) * p.width + x) * 4;
    for (int c = 0; c < 3; ++c) o[c] = rgb[c] + T * bg[c];
    o[3] = 1.f - T;
  }
}

constexpr int kBwdThreads = 256;

// block per tile, one thread per pixel (tile_size <= 16 here); all threads walk the list
// back to front together so each pair's gradient is reduced within the block (warp
// shuffles, then the warps' sums in warp order: a fixed order)
__global__ void __launch_bounds__(kBwdThreads) raster_backward(Params p, Work w, const float* dimg, float clip) {
  __shared__ float red[kBwdThreads / 32][9];
  __shared__ int max_last;
  int t = blockIdx.x;
  int tx0 = (t % p.tiles_x) * p.tile_size, ty0 = (t / p.tiles_x) * p.tile_size;
  int a = w.tile_start[t], b = w.tile_start[t + 1];
  if (a == b) return;
  if (threadIdx.x == 0) max_last = a;
  __syncthreads();
  int l = threadIdx.x;
  int x = tx0 + l % p.tile_size, y = ty0 + l / p.tile_size;
  bool active = l < p.tile_size * p.tile_size && x < p.width && y < p.height;
  float px = x + 0.5f, py = y + 0.5f;
  float t_final = 1.f, T = 1.f, g4[4] = {0.f, 0.f, 0.f, 0.f};
  float acc[3] = {w.cam->bg[0], w.cam->bg[1], w.cam->bg[2]};
  int last = a;
  if (active) {
    float rgb[3];
    composite(w, p, a, b, px, py, rgb, t_final, last);
    T = t_final;
    for (int c = 0; c < 4; ++c) {
      float d = dimg[(int64_t(y) * p.width + x) * 4 + c];
      if (clip > 0.f) d = fminf(clip, fmaxf(-clip, d));
      g4[c] = d;
    }
    atomicMax(&max_last, last);
  }
  __syncthreads();
  const int top = max_last;
  // entries no pixel of the tile reached carry no gradient: their slots get zeros
  for (int e = top + threadIdx.x; e < b; e += blockDim.x) {
    float* slot = w.pair_grad + int64_t(w.sr[e]) * 9;
    for (int j = 0; j < 9; ++j) slot[j] = 0.f;
  }
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = top - 1; e >= a; --e) {
    float part[9] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (active && e < last) {
      const float* g = w.gf + 10 * int64_t(w.sg[e]);
      float gauss, dx, dy;
      float alpha = alpha_at(g, px, py, gauss, dx, dy);
      if (alpha >= p.alpha_cutoff) {
        float om = 1.f - alpha;
        float Ti = T / om;
        float dalpha = g4[3] * t_final / om;
        for (int ch = 0; ch < 3; ++ch) {
          dalpha += Ti * (g[5 + ch] - acc[ch]) * g4[ch];
          part[5 + ch] = alpha * Ti * g4[ch];
          acc[ch] = alpha * g[5 + ch] + om * acc[ch];
        }
        T = Ti;
        if (g[8] * gauss < splat::kAlphaMax) {
          part[8] = gauss * dalpha;
          float dq = -0.5f * gauss * g[8] * dalpha;
          part[0] = dq * 2.f * (g[2] * dx + g[3] * dy);
          part[1] = dq * 2.f * (g[3] * dx + g[4] * dy);
          part[2] = dq * dx * dx;
          part[3] = dq * 2.f * dx * dy;
          part[4] = dq * dy * dy;
        }
      }
    }
    for (int j = 0; j < 9; ++j) {
      float v = part[j];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
      if (lane == 0) red[warp][j] = v;
    }
    __syncthreads();
    if (threadIdx.x < 9) {
      float s = 0.f;
      for (int k = 0; k < kBwdThreads / 32; ++k) s += red[k][threadIdx.x];
      w.pair_grad[int64_t(w.sr[e]) * 9 + threadIdx.x] = s;
    }
    __syncthreads();
  }
}

__global__ void chain(Scene s, Work w, int64_t keep_sh, float* gp, float* gs, float* gr, float* go, float* gc,
                      float* gsh) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n) return;
  const Camera cam = *w.cam;
  float sum[9] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int pairs = w.total[1];
  if (w.cnt[i]) {
    int64_t end = int64_t(w.off[i]) + w.cnt[i];
    end = end < pairs ? end : pairs;
    for (int64_t k = w.off[i]; k < end; ++k)
      for (int j = 0; j < 9; ++j) sum[j] += w.pair_grad[k * 9 + j];
  }
  float sig = w.gf[10 * int64_t(i) + 8];
  go[i] = sum[8] * sig * (1.f - sig);
  for (int c = 0; c < 3; ++c) gc[3 * int64_t(i) + c] = sum[5 + c];
  using D3 = Dual<3>;
  const float* pos = s.pos + 3 * int64_t(i);
  D3 p3[3] = {D3::seed(pos[0], 0), D3::seed(pos[1], 1), D3::seed(pos[2], 2)};
  D3 vx, vy, vz;
  splat::view_dir<D3>(p3, cam, vx, vy, vz);
  D3 basis[splat::kMaxSh];
  splat::sh_basis<D3>(vx, vy, vz, s.k, basis);
  float dpos[3] = {0.f, 0.f, 0.f};
  for (int k = 0; k < s.k; ++k)
    for (int c = 0; c < 3; ++c) {
      float drgb = sum[5 + c];
      gsh[(int64_t(i) * s.k + k) * 3 + c] = k < keep_sh ? basis[k].v * drgb : 0.f;
      float wgt = s.sh[(int64_t(i) * s.k + k) * 3 + c] * drgb;
      for (int j = 0; j < 3; ++j) dpos[j] += wgt * basis[k].d[j];
    }
  float dscale[3] = {0.f, 0.f, 0.f}, drot[4] = {0.f, 0.f, 0.f, 0.f};
  if (w.cnt[i]) {
    using D10 = Dual<10>;
    D10 pp[3], ls[3], qq[4];
    for (int j = 0; j < 3; ++j) pp[j] = D10::seed(pos[j], j);
    for (int j = 0; j < 3; ++j)
      ls[j] = w.clamped[3 * int64_t(i) + j] ? D10(w.scales[3 * int64_t(i) + j])
                                            : D10::seed(w.scales[3 * int64_t(i) + j], 3 + j);
    for (int j = 0; j < 4; ++j) qq[j] = D10::seed(s.rot[4 * int64_t(i) + j], 6 + j);
    D10 u, v, conic[3];
    float depth, lam;
    splat::project_gaussian<D10>(pp, ls, qq, cam, u, v, conic, depth, lam);
    const D10* outs[5] = {&u, &v, &conic[0], &conic[1], &conic[2]};
    for (int o = 0; o < 5; ++o) {
      float wgt = sum[o];
      if (wgt == 0.f) continue;
      for (int j = 0; j < 3; ++j) dpos[j] += wgt * outs[o]->d[j];
      for (int j = 0; j < 3; ++j) dscale[j] += wgt * outs[o]->d[3 + j];
      for (int j = 0; j < 4; ++j) drot[j] += wgt * outs[o]->d[6 + j];
    }
  }
  for (int j = 0; j < 3; ++j) { gp[3 * int64_t(i) + j] = dpos[j]; gs[3 * int64_t(i) + j] = dscale[j]; }
  for (int j = 0; j < 4; ++j) gr[4 * int64_t(i) + j] = drot[j];
}

ffi::Error check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("gaussian_splat ") + what + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// shared preparation (no host synchronisation); on return w holds sorted per-tile lists
ffi::Error prepare(cudaStream_t stream, const Scene& s, const float* meta, const Params& p, float max_aniso,
                   const Work& w) {
  int tiles = p.tiles_x * p.tiles_y;
  int blocks = (s.n + 255) / 256;
  make_camera<<<1, 32, 0, stream>>>(meta, p.width, p.height, w.cam);
  const bool limit = max_aniso > 0.f;
  const float log_aniso = limit ? std::log(max_aniso > 1.f ? max_aniso : 1.f) : 0.f;  // as the CPU kernel
  limit_scales<<<blocks, 256, 0, stream>>>(s, log_aniso, limit, w);
  preprocess<<<blocks, 256, 0, stream>>>(s, p, w);
  block_scan<<<1, 1024, 0, stream>>>(w.cnt, w.off, s.n, nullptr, p.max_list);
  if (auto e = check(cudaMemsetAsync(w.cursor, 0, sizeof(int) * tiles, stream), "memset"); e.failure()) return e;
  count_tiles<<<blocks, 256, 0, stream>>>(s, p, w);
  block_scan<<<1, 1024, 0, stream>>>(w.cursor, w.tile_start, tiles, w.total, p.max_list);
  copy_ints<<<(tiles + 255) / 256, 256, 0, stream>>>(w.tile_start, w.cursor, tiles);
  bucket<<<blocks, 256, 0, stream>>>(s, p, w);
  sort_tiles<<<tiles, kSortThreads, 0, stream>>>(p, w);
  return check(cudaGetLastError(), "prepare");
}

ffi::Error read_scene(ffi::Buffer<ffi::F32>& pos, ffi::Buffer<ffi::F32>& scale, ffi::Buffer<ffi::F32>& rot,
                      ffi::Buffer<ffi::F32>& opac, ffi::Buffer<ffi::F32>& col, ffi::Buffer<ffi::F32>& sh,
                      ffi::Buffer<ffi::F32>& meta, Scene& s) {
  splat::SceneSize size{};
  if (auto e = splat::check_scene(Backend::kCuda, pos, scale, rot, opac, col, sh, meta, size); e.failure()) return e;
  s.n = int(size.n);
  s.k = int(size.k);
  s.pos = pos.typed_data(); s.scale = scale.typed_data(); s.rot = rot.typed_data();
  s.opac = opac.typed_data(); s.col = col.typed_data(); s.sh = sh.typed_data();
  return ffi::Error::Success();
}

ffi::Error make_params(int64_t width, int64_t height, int64_t tile_size, float radius_scale, float alpha_cutoff,
                       int64_t max_steps, float threshold, int64_t max_list, Params& p) {
  if (width <= 0 || height <= 0 || tile_size <= 0 || tile_size > 16)
    return ffi::Error::InvalidArgument("gaussian_splat (CUDA): width, height > 0 and 0 < tile_size <= 16");
  if (width > (1 << 20) || height > (1 << 20))
    return ffi::Error::InvalidArgument("gaussian_splat (CUDA): width and height must be <= 2^20");
  if (max_list < 0 || max_list > 0x7fffffffLL)
    return ffi::Error::InvalidArgument("gaussian_splat (CUDA): 0 <= max_list_entries < 2^31");
  int64_t tx = (width + tile_size - 1) / tile_size, ty = (height + tile_size - 1) / tile_size;
  if (tx * ty >= 0x7fffffffLL) return ffi::Error::InvalidArgument("gaussian_splat (CUDA): too many tiles");
  p = Params{int(width), int(height), int(tile_size), int(tx), int(ty), radius_scale, alpha_cutoff, max_steps,
             threshold, max_list};
  return ffi::Error::Success();
}

ffi::Error check_scratch(int64_t have, const Scene& s, const Params& p, bool backward) {
  int64_t need = scratch_needed(s.n, p.max_list, int64_t(p.tiles_x) * p.tiles_y, backward);
  if (have < need)
    return ffi::Error::InvalidArgument("gaussian_splat (CUDA): scratch result has " +
                                       std::to_string(have) + " i32 elements, needs " +
                                       std::to_string(need));
  return ffi::Error::Success();
}

ffi::Error SplatFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> pos, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> rot, ffi::Buffer<ffi::F32> opac, ffi::Buffer<ffi::F32> col,
                        ffi::Buffer<ffi::F32> sh, ffi::Buffer<ffi::F32> meta, ffi::Result<ffi::Buffer<ffi::F32>> img,
                        ffi::Result<ffi::Buffer<ffi::S32>> scratch, int64_t width, int64_t height, int64_t tile_size,
                        float radius_scale, float alpha_cutoff, int64_t max_splat_steps,
                        float transmittance_threshold, int64_t max_list_entries) {
  Params p;
  if (auto e = make_params(width, height, tile_size, radius_scale, alpha_cutoff, max_splat_steps,
                           transmittance_threshold, max_list_entries, p); e.failure())
    return e;
  Scene s;
  if (auto e = read_scene(pos, scale, rot, opac, col, sh, meta, s); e.failure()) return e;
  if (auto e = splat::check_image("image", img->element_count(), width, height); e.failure()) return e;
  if (auto e = check_scratch(int64_t(scratch->element_count()), s, p, false); e.failure()) return e;
  int tiles = p.tiles_x * p.tiles_y;
  Work w = carve(scratch->typed_data(), s.n, p.max_list, tiles, false);
  if (auto e = prepare(stream, s, meta.typed_data(), p, 0.f, w); e.failure()) return e;
  render<<<tiles, 256, 0, stream>>>(p, w, img->typed_data());
  return check(cudaGetLastError(), "render");
}

ffi::Error SplatBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> pos, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> rot, ffi::Buffer<ffi::F32> opac, ffi::Buffer<ffi::F32> col,
                        ffi::Buffer<ffi::F32> sh, ffi::Buffer<ffi::F32> meta, ffi::Buffer<ffi::F32> dimg,
                        ffi::Result<ffi::Buffer<ffi::F32>> d_pos, ffi::Result<ffi::Buffer<ffi::F32>> d_scale,
                        ffi::Result<ffi::Buffer<ffi::F32>> d_rot, ffi::Result<ffi::Buffer<ffi::F32>> d_opac,
                        ffi::Result<ffi::Buffer<ffi::F32>> d_col, ffi::Result<ffi::Buffer<ffi::F32>> d_sh,
                        ffi::Result<ffi::Buffer<ffi::S32>> scratch, int64_t width, int64_t height, int64_t tile_size,
                        float radius_scale, float alpha_cutoff, int64_t max_splat_steps,
                        float transmittance_threshold, int64_t max_list_entries, float loss_grad_clip,
                        int64_t sh_band, float max_anisotropy) {
  Params p;
  if (auto e = make_params(width, height, tile_size, radius_scale, alpha_cutoff, max_splat_steps,
                           transmittance_threshold, max_list_entries, p); e.failure())
    return e;
  Scene s;
  if (auto e = read_scene(pos, scale, rot, opac, col, sh, meta, s); e.failure()) return e;
  if (auto e = splat::check_image("dy", dimg.element_count(), width, height); e.failure()) return e;
  if (auto e = splat::check_gradient_sizes(pos, scale, rot, opac, col, sh, *d_pos, *d_scale, *d_rot, *d_opac, *d_col,
                                           *d_sh);
      e.failure())
    return e;
  if (auto e = check_scratch(int64_t(scratch->element_count()), s, p, true); e.failure()) return e;
  int tiles = p.tiles_x * p.tiles_y;
  Work w = carve(scratch->typed_data(), s.n, p.max_list, tiles, true);
  if (auto e = prepare(stream, s, meta.typed_data(), p, max_anisotropy, w); e.failure()) return e;
  raster_backward<<<tiles, kBwdThreads, 0, stream>>>(p, w, dimg.typed_data(), loss_grad_clip);
  int64_t keep_sh = sh_band < 0 ? s.k : (sh_band + 1) * (sh_band + 1);
  chain<<<(s.n + 127) / 128, 128, 0, stream>>>(s, w, keep_sh, d_pos->typed_data(), d_scale->typed_data(),
                                               d_rot->typed_data(), d_opac->typed_data(), d_col->typed_data(),
                                               d_sh->typed_data());
  return check(cudaGetLastError(), "backward");
}

}  // namespace

#define RLX_SPLAT_CUDA_ATTRS                  \
  .Attr<int64_t>("width")                     \
      .Attr<int64_t>("height")                \
      .Attr<int64_t>("tile_size")             \
      .Attr<float>("radius_scale")            \
      .Attr<float>("alpha_cutoff")            \
      .Attr<int64_t>("max_splat_steps")       \
      .Attr<float>("transmittance_threshold") \
      .Attr<int64_t>("max_list_entries")

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGaussianSplatFwdCuda, SplatFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>() RLX_SPLAT_CUDA_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGaussianSplatBwdCuda, SplatBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>() RLX_SPLAT_CUDA_ATTRS
                                  .Attr<float>("loss_grad_clip")
                                  .Attr<int64_t>("sh_band")
                                  .Attr<float>("max_anisotropy"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_gaussian_splat_fwd", RlxGaussianSplatFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_gaussian_splat_bwd", RlxGaussianSplatBwdCuda);

}  // namespace cuda
}  // namespace rlx
