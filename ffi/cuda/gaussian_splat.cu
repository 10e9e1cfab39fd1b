// 3-D Gaussian splatting on NVIDIA GPUs (RLX GaussianSplatRender / Backward); the same
// maths and order of decisions as ffi/cpu/gaussian_splat.cc (shared header
// cpu/gaussian_splat_math.h). All working memory is an i32 scratch result that XLA
// allocates (size: cuda_scratch_elems in rlx_jax/vjp_rules/gaussian_splat.py).
//
// Pipeline: preprocess (thread per Gaussian) -> pair numbers (block scan) -> per-tile
// counts and buckets -> per-tile order by (depth, index) (rank by counting: keys are
// unique, so the order does not depend on the bucket order atomics produced) ->
// composite (block per tile, thread per pixel). Backward: the same preparation, then per
// tile all pixels walk the tile's list back to front together; each pair's 9 partial
// gradients are block-reduced in a fixed order and written to that pair's own slot (no
// atomics on gradients), then summed Gaussian by Gaussian and chained through the
// projection with forward-mode duals. Deterministic.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cpu/gaussian_splat_math.h"

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

// scratch layout (i32 units)
struct Work {
  float* gf;        // 10 per Gaussian: u v c0 c1 c2 r g b opac depth
  int* rect;        // 4 per Gaussian (x0 x1 y0 y1), x0 = x1 when invisible
  int* cnt;         // pairs per Gaussian
  int* off;         // first pair number
  int* total;       // [0] total pairs (uncapped, clipped to int), [1] pairs kept
  int* pg;          // unsorted Gaussian of each bucket slot
  int* pr;          // unsorted pair number
  int* sg;          // sorted
  int* sr;
  float* pair_grad; // 9 per pair
  int* tile_start;  // tiles + 1
  int* cursor;      // tiles
  float* scales;    // 3 per Gaussian: log-scales the pass uses (anisotropy-limited)
  unsigned char* clamped;  // 3 per Gaussian
};

Work carve(int32_t* base, int n, int64_t e, int tiles) {
  Work w;
  int32_t* p = base;
  w.gf = reinterpret_cast<float*>(p); p += 10 * int64_t(n);
  w.rect = p; p += 4 * int64_t(n);
  w.cnt = p; p += n;
  w.off = p; p += n;
  w.total = p; p += 2;
  w.pg = p; p += e;
  w.pr = p; p += e;
  w.sg = p; p += e;
  w.sr = p; p += e;
  w.pair_grad = reinterpret_cast<float*>(p); p += 9 * e;
  w.scales = reinterpret_cast<float*>(p); p += 3 * int64_t(n);
  w.clamped = reinterpret_cast<unsigned char*>(p); p += (3 * int64_t(n) + 3) / 4;
  w.tile_start = p; p += tiles + 1;
  w.cursor = p; p += tiles;
  return w;
}

int64_t scratch_needed(int n, int64_t e, int tiles, int64_t pixels) {
  // must not exceed rlx_jax.vjp_rules.gaussian_splat.cuda_scratch_elems
  return 20 * int64_t(n) + 2 + e * 16 + int64_t(tiles) * 2 + pixels * 2 + 64;
}
int64_t scratch_used(int n, int64_t e, int tiles) {
  return 16 * int64_t(n) + 2 + 13 * e + 3 * int64_t(n) + (3 * int64_t(n) + 3) / 4 + 2 * int64_t(tiles) + 1;
}

__global__ void limit_scales(Scene s, float max_aniso, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n) return;
  const float* sc = s.scale + 3 * i;
  float floor_ = -INFINITY;
  if (max_aniso > 0.f) floor_ = fmaxf(sc[0], fmaxf(sc[1], sc[2])) - logf(fmaxf(max_aniso, 1.f));
  for (int j = 0; j < 3; ++j) {
    bool c = sc[j] < floor_;
    w.scales[3 * i + j] = c ? floor_ : sc[j];
    w.clamped[3 * i + j] = c ? 1 : 0;
  }
}

__global__ void preprocess(Scene s, Camera cam, Params p, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n) return;
  float u = 0.f, v = 0.f, conic[3] = {0.f, 0.f, 0.f}, depth = 0.f, lam = 0.f;
  bool vis = splat::project_gaussian<float>(s.pos + 3 * i, w.scales + 3 * i, s.rot + 4 * i, cam, u, v, conic, depth,
                                            lam);
  float* g = w.gf + 10 * int64_t(i);
  float dx, dy, dz;
  splat::view_dir<float>(s.pos + 3 * i, cam, dx, dy, dz);
  float b[splat::kMaxSh];
  splat::sh_basis<float>(dx, dy, dz, s.k, b);
  for (int ch = 0; ch < 3; ++ch) {
    float acc = s.col[3 * i + ch];
    for (int k = 0; k < s.k; ++k) acc += b[k] * s.sh[(int64_t(i) * s.k + k) * 3 + ch];
    g[5 + ch] = acc;
  }
  g[0] = u; g[1] = v; g[2] = conic[0]; g[3] = conic[1]; g[4] = conic[2];
  g[8] = splat::sigmoidf(s.opac[i]);
  g[9] = depth;
  int* r = w.rect + 4 * i;
  if (vis) {
    splat::tile_rect(u, v, lam, p.radius_scale, p.tile_size, p.tiles_x, p.tiles_y, r);
  } else {
    r[0] = r[1] = r[2] = r[3] = 0;
  }
  int cw = r[1] - r[0], ch = r[3] - r[2];
  w.cnt[i] = (vis && cw > 0 && ch > 0) ? cw * ch : 0;
}

// exclusive scan of m ints by one block of 1024 threads; total (and capped total) to out_total
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
  if (t == blockDim.x - 1 && out_total) {
    long long tot = sums[t];
    long long big = tot < 0x7fffffffLL ? tot : 0x7fffffffLL;
    out_total[0] = int(big);
    out_total[1] = int(tot < cap ? tot : cap);
    out[m] = int(big);
  }
}

__global__ void count_tiles(Scene s, Params p, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n || w.cnt[i] == 0) return;
  const int* r = w.rect + 4 * i;
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

__global__ void bucket(Scene s, Params p, Work w) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n || w.cnt[i] == 0) return;
  const int* r = w.rect + 4 * i;
  int64_t rank = w.off[i];
  for (int y = r[2]; y < r[3]; ++y)
    for (int x = r[0]; x < r[1]; ++x, ++rank) {
      if (rank >= p.max_list) return;
      int slot = atomicAdd(&w.cursor[y * p.tiles_x + x], 1);
      w.pg[slot] = i;
      w.pr[slot] = int(rank);
    }
}

// block per tile: position of each entry = number of entries with a smaller (depth, index)
__global__ void sort_tiles(Work w) {
  int t = blockIdx.x;
  int a = w.tile_start[t], b = w.tile_start[t + 1];
  for (int e = a + threadIdx.x; e < b; e += blockDim.x) {
    int g = w.pg[e];
    float d = w.gf[10 * int64_t(g) + 9];
    int pos = 0;
    for (int f = a; f < b; ++f) {
      int h = w.pg[f];
      float dh = w.gf[10 * int64_t(h) + 9];
      pos += (dh < d || (dh == d && h < g)) ? 1 : 0;
    }
    w.sg[a + pos] = g;
    w.sr[a + pos] = w.pr[e];
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

__global__ void render(Params p, Camera cam, Work w, float* img) {
  int t = blockIdx.x;
  int tx0 = (t % p.tiles_x) * p.tile_size, ty0 = (t / p.tiles_x) * p.tile_size;
  int a = w.tile_start[t], b = w.tile_start[t + 1];
  for (int l = threadIdx.x; l < p.tile_size * p.tile_size; l += blockDim.x) {
    int x = tx0 + l % p.tile_size, y = ty0 + l / p.tile_size;
    if (x >= p.width || y >= p.height) continue;
    float rgb[3], T;
    int last;
    composite(w, p, a, b, x + 0.5f, y + 0.5f, rgb, T, last);
    float* o = img + (int64_t(y) * p.width + x) * 4;
    for (int c = 0; c < 3; ++c) o[c] = rgb[c] + T * cam.bg[c];
    o[3] = 1.f - T;
  }
}

constexpr int kBwdThreads = 256;

// block per tile, one thread per pixel (tile_size <= 16 here); all threads walk the list
// back to front together so each pair's gradient is reduced within the block
__global__ void __launch_bounds__(kBwdThreads) raster_backward(Params p, Camera cam, Work w, const float* dimg,
                                                                float clip) {
  __shared__ float red[kBwdThreads / 32][9];
  __shared__ int max_last;
  int t = blockIdx.x;
  int tx0 = (t % p.tiles_x) * p.tile_size, ty0 = (t / p.tiles_x) * p.tile_size;
  int a = w.tile_start[t], b = w.tile_start[t + 1];
  if (threadIdx.x == 0) max_last = a;
  __syncthreads();
  int l = threadIdx.x;
  int x = tx0 + l % p.tile_size, y = ty0 + l / p.tile_size;
  bool active = l < p.tile_size * p.tile_size && x < p.width && y < p.height;
  float px = x + 0.5f, py = y + 0.5f;
  float t_final = 1.f, T = 1.f, g4[4] = {0.f, 0.f, 0.f, 0.f}, acc[3] = {cam.bg[0], cam.bg[1], cam.bg[2]};
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
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = max_last - 1; e >= a; --e) {
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

__global__ void chain(Scene s, Camera cam, Work w, int64_t keep_sh, float* gp, float* gs, float* gr, float* go,
                      float* gc, float* gsh) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s.n) return;
  float sum[9] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int pairs = w.total[1];
  if (w.cnt[i]) {
    int end = w.off[i] + w.cnt[i] < pairs ? w.off[i] + w.cnt[i] : pairs;
    for (int k = w.off[i]; k < end; ++k)
      for (int j = 0; j < 9; ++j) sum[j] += w.pair_grad[int64_t(k) * 9 + j];
  }
  float sig = w.gf[10 * int64_t(i) + 8];
  go[i] = sum[8] * sig * (1.f - sig);
  for (int c = 0; c < 3; ++c) gc[3 * i + c] = sum[5 + c];
  using D3 = Dual<3>;
  D3 p3[3] = {D3::seed(s.pos[3 * i], 0), D3::seed(s.pos[3 * i + 1], 1), D3::seed(s.pos[3 * i + 2], 2)};
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
    for (int j = 0; j < 3; ++j) pp[j] = D10::seed(s.pos[3 * i + j], j);
    for (int j = 0; j < 3; ++j)
      ls[j] = w.clamped[3 * i + j] ? D10(w.scales[3 * i + j]) : D10::seed(w.scales[3 * i + j], 3 + j);
    for (int j = 0; j < 4; ++j) qq[j] = D10::seed(s.rot[4 * i + j], 6 + j);
    D10 u, v, conic[3];
    float depth, lam;
    splat::project_gaussian<D10>(pp, ls, qq, cam, u, v, conic, depth, lam);
    const D10* outs[5] = {&u, &v, &conic[0], &conic[1], &conic[2]};
    for (int o = 0; o < 5; ++o) {
      float wgt = sum[o];
      for (int j = 0; j < 3; ++j) dpos[j] += wgt * outs[o]->d[j];
      for (int j = 0; j < 3; ++j) dscale[j] += wgt * outs[o]->d[3 + j];
      for (int j = 0; j < 4; ++j) drot[j] += wgt * outs[o]->d[6 + j];
    }
  }
  for (int j = 0; j < 3; ++j) { gp[3 * i + j] = dpos[j]; gs[3 * i + j] = dscale[j]; }
  for (int j = 0; j < 4; ++j) gr[4 * i + j] = drot[j];
}

ffi::Error check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("gaussian_splat ") + what + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// shared preparation; on return w holds sorted per-tile lists
ffi::Error prepare(cudaStream_t stream, const Scene& s, const Camera& cam, const Params& p, float max_aniso,
                   const Work& w) {
  int tiles = p.tiles_x * p.tiles_y;
  int blocks = (s.n + 255) / 256;
  limit_scales<<<blocks, 256, 0, stream>>>(s, max_aniso, w);
  preprocess<<<blocks, 256, 0, stream>>>(s, cam, p, w);
  // pair numbers; w.off has room for n + 1 (it is followed by total)
  block_scan<<<1, 1024, 0, stream>>>(w.cnt, w.off, s.n, nullptr, p.max_list);
  cudaMemsetAsync(w.cursor, 0, sizeof(int) * tiles, stream);
  count_tiles<<<blocks, 256, 0, stream>>>(s, p, w);
  block_scan<<<1, 1024, 0, stream>>>(w.cursor, w.tile_start, tiles, w.total, p.max_list);
  copy_ints<<<(tiles + 255) / 256, 256, 0, stream>>>(w.tile_start, w.cursor, tiles);
  bucket<<<blocks, 256, 0, stream>>>(s, p, w);
  sort_tiles<<<tiles, 256, 0, stream>>>(w);
  return check(cudaGetLastError(), "prepare");
}

bool read_scene(ffi::Buffer<ffi::F32>& pos, ffi::Buffer<ffi::F32>& scale, ffi::Buffer<ffi::F32>& rot,
                ffi::Buffer<ffi::F32>& opac, ffi::Buffer<ffi::F32>& col, ffi::Buffer<ffi::F32>& sh,
                ffi::Buffer<ffi::F32>& meta, Scene& s, std::string& err) {
  int64_t n = int64_t(pos.element_count()) / 3;
  s.n = int(n);
  s.pos = pos.typed_data(); s.scale = scale.typed_data(); s.rot = rot.typed_data();
  s.opac = opac.typed_data(); s.col = col.typed_data(); s.sh = sh.typed_data();
  if (n <= 0 || int64_t(scale.element_count()) != 3 * n || int64_t(rot.element_count()) != 4 * n ||
      int64_t(opac.element_count()) != n || int64_t(col.element_count()) != 3 * n) {
    err = "gaussian_splat: scene buffers disagree on the Gaussian count (or it is 0)";
    return false;
  }
  int64_t k = int64_t(sh.element_count()) / (3 * n);
  if (k * 3 * n != int64_t(sh.element_count()) || k > splat::kMaxSh) {
    err = "gaussian_splat: sh_coeffs must hold K <= 16 coefficients x 3 per Gaussian";
    return false;
  }
  s.k = int(k);
  if (meta.element_count() != 23) {
    err = "gaussian_splat: meta must have 23 values";
    return false;
  }
  return true;
}

// meta lives on the device: the camera is built on the host from a copy
ffi::Error host_camera(cudaStream_t stream, const float* meta, const Params& p, Camera& cam) {
  float m[23];
  if (auto e = check(cudaMemcpyAsync(m, meta, sizeof(m), cudaMemcpyDeviceToHost, stream), "meta copy"); e.failure())
    return e;
  if (auto e = check(cudaStreamSynchronize(stream), "meta sync"); e.failure()) return e;
  cam = splat::camera_from_meta(m, p.width, p.height);
  return ffi::Error::Success();
}

ffi::Error make_params(int64_t width, int64_t height, int64_t tile_size, float radius_scale, float alpha_cutoff,
                       int64_t max_steps, float threshold, int64_t max_list, Params& p) {
  if (width <= 0 || height <= 0 || tile_size <= 0 || tile_size > 16)
    return ffi::Error::InvalidArgument("gaussian_splat (CUDA): width, height > 0 and 0 < tile_size <= 16");
  if (max_list > 0x7fffffffLL) return ffi::Error::InvalidArgument("gaussian_splat (CUDA): max_list_entries < 2^31");
  p = Params{int(width), int(height), int(tile_size), int((width + tile_size - 1) / tile_size),
             int((height + tile_size - 1) / tile_size), radius_scale, alpha_cutoff, max_steps, threshold, max_list};
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
  std::string err;
  if (!read_scene(pos, scale, rot, opac, col, sh, meta, s, err)) return ffi::Error::InvalidArgument(err);
  int tiles = p.tiles_x * p.tiles_y;
  if (int64_t(scratch->element_count()) < scratch_needed(s.n, p.max_list, tiles, int64_t(width) * height) ||
      scratch_used(s.n, p.max_list, tiles) > scratch_needed(s.n, p.max_list, tiles, int64_t(width) * height))
    return ffi::Error::InvalidArgument("gaussian_splat (CUDA): scratch result too small");
  Camera cam;
  if (auto e = host_camera(stream, meta.typed_data(), p, cam); e.failure()) return e;
  Work w = carve(scratch->typed_data(), s.n, p.max_list, tiles);
  if (auto e = prepare(stream, s, cam, p, 0.f, w); e.failure()) return e;
  render<<<tiles, 256, 0, stream>>>(p, cam, w, img->typed_data());
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
  std::string err;
  if (!read_scene(pos, scale, rot, opac, col, sh, meta, s, err)) return ffi::Error::InvalidArgument(err);
  if (int64_t(dimg.element_count()) != width * height * 4)
    return ffi::Error::InvalidArgument("gaussian_splat: dy must be [H*W*4]");
  if (d_pos->element_count() != pos.element_count() || d_scale->element_count() != scale.element_count() ||
      d_rot->element_count() != rot.element_count() || d_opac->element_count() != opac.element_count() ||
      d_col->element_count() != col.element_count() || d_sh->element_count() != sh.element_count())
    return ffi::Error::InvalidArgument("gaussian_splat backward: each gradient must have the size of its scene buffer");
  int tiles = p.tiles_x * p.tiles_y;
  if (int64_t(scratch->element_count()) < scratch_needed(s.n, p.max_list, tiles, int64_t(width) * height))
    return ffi::Error::InvalidArgument("gaussian_splat (CUDA): scratch result too small");
  Camera cam;
  if (auto e = host_camera(stream, meta.typed_data(), p, cam); e.failure()) return e;
  Work w = carve(scratch->typed_data(), s.n, p.max_list, tiles);
  if (auto e = prepare(stream, s, cam, p, max_anisotropy, w); e.failure()) return e;
  raster_backward<<<tiles, kBwdThreads, 0, stream>>>(p, cam, w, dimg.typed_data(), loss_grad_clip);
  int64_t keep_sh = sh_band < 0 ? s.k : (sh_band + 1) * (sh_band + 1);
  chain<<<(s.n + 127) / 128, 128, 0, stream>>>(s, cam, w, keep_sh, d_pos->typed_data(), d_scale->typed_data(),
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
                                  .Ret<ffi::Buffer<ffi::S32>>() RLX_SPLAT_CUDA_ATTRS);
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
                                  .Attr<float>("max_anisotropy"));

RLX_CUDA_REGISTER_HANDLER("rlx_gaussian_splat_fwd", RlxGaussianSplatFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_gaussian_splat_bwd", RlxGaussianSplatBwdCuda);

}  // namespace cuda
}  // namespace rlx
