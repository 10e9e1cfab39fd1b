// 3-D Gaussian splatting on the CPU (RLX GaussianSplatRender / GaussianSplatRenderBackward).
//
// Forward: project every Gaussian (EWA, SH colour), number the tile-Gaussian pairs
// Gaussian by Gaussian (pairs past max_list_entries dropped), bucket them per tile, sort
// each tile by (depth, index), composite each pixel front to back with the cut-offs.
// Backward: the same preparation (on the anisotropy-limited scales), then per tile each
// pixel replays its compositing to find its final transmittance and last contributor and
// walks back to front, adding its gradient w.r.t. (u, v, conic, rgb, opacity) into the
// slot of that tile-Gaussian pair; slots are summed Gaussian by Gaussian in pair order and
// chained through the projection with forward-mode duals. Every task writes its own
// slots, so results do not depend on the thread count. Maths: vjp_rules/gaussian_splat.py.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/common.h"
#include "cpu/gaussian_splat_math.h"
#include "gaussian_splat_checks.h"

namespace rlx {
namespace {

using splat::Camera;
using splat::Dual;

struct Params {
  int width, height, tile_size;
  float radius_scale, alpha_cutoff;
  int64_t max_steps;
  float threshold;
  int64_t max_list;
  int tiles_x() const { return (width + tile_size - 1) / tile_size; }
  int tiles_y() const { return (height + tile_size - 1) / tile_size; }
};

struct Scene {
  const float *pos, *scale, *rot, *opac, *col, *sh;
  int64_t n, k;
};

struct Prepared {
  std::vector<float> u, v, conic, rgb, opac, depth;
  std::vector<uint8_t> visible;
  std::vector<int> rect;            // 4 per Gaussian
  std::vector<int64_t> offset;      // first pair number
  std::vector<int64_t> tile_start;  // tiles + 1
  std::vector<int32_t> list_g;      // Gaussian of each entry, tile by tile, depth order
  std::vector<int64_t> list_rank;   // its pair number
  int64_t pairs = 0;
};

constexpr int64_t kChunk = 512;

void prepare(ffi::ThreadPool& pool, const Scene& s, const float* scales, const Camera& cam, const Params& p,
             Prepared& out) {
  const int64_t n = s.n;
  const int tx = p.tiles_x(), ty = p.tiles_y();
  out.u.assign(n, 0.f); out.v.assign(n, 0.f); out.conic.assign(3 * n, 0.f); out.rgb.assign(3 * n, 0.f);
  out.opac.assign(n, 0.f); out.depth.assign(n, 0.f); out.visible.assign(n, 0); out.rect.assign(4 * n, 0);
  int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(pool, chunks, [&](int64_t c) {
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      float u, v, conic[3], depth = 0.f, lam = 0.f;
      bool vis = splat::project_gaussian<float>(s.pos + 3 * i, scales + 3 * i, s.rot + 4 * i, cam, u, v, conic,
                                                depth, lam);
      out.depth[i] = depth;
      out.opac[i] = splat::sigmoidf(s.opac[i]);
      float dx, dy, dz;
      splat::view_dir<float>(s.pos + 3 * i, cam, dx, dy, dz);
      float b[splat::kMaxSh];
      splat::sh_basis<float>(dx, dy, dz, int(s.k), b);
      for (int ch = 0; ch < 3; ++ch) {
        float acc = s.col[3 * i + ch];
        for (int64_t k = 0; k < s.k; ++k) acc += b[k] * s.sh[(i * s.k + k) * 3 + ch];
        out.rgb[3 * i + ch] = acc;
      }
      if (!vis) continue;
      out.visible[i] = 1;
      out.u[i] = u; out.v[i] = v;
      for (int j = 0; j < 3; ++j) out.conic[3 * i + j] = conic[j];
      splat::tile_rect(u, v, lam, p.radius_scale, p.tile_size, tx, ty, &out.rect[4 * i]);
    }
  });
  // pair numbers, Gaussian by Gaussian
  out.offset.assign(n, 0);
  std::vector<int64_t> tile_count(int64_t(tx) * ty + 1, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    out.offset[i] = total;
    if (!out.visible[i]) continue;
    const int* r = &out.rect[4 * i];
    int64_t w = std::max(r[1] - r[0], 0), h = std::max(r[3] - r[2], 0);
    int64_t rank = total;
    for (int yy = r[2]; yy < r[3] && rank < p.max_list; ++yy)
      for (int xx = r[0]; xx < r[1] && rank < p.max_list; ++xx, ++rank) tile_count[int64_t(yy) * tx + xx]++;
    total += w * h;
  }
  out.pairs = std::min(total, p.max_list);
  out.tile_start.assign(int64_t(tx) * ty + 1, 0);
  for (int64_t t = 0; t < int64_t(tx) * ty; ++t) out.tile_start[t + 1] = out.tile_start[t] + tile_count[t];
  out.list_g.assign(out.pairs, 0);
  out.list_rank.assign(out.pairs, 0);
  std::vector<int64_t> cursor(out.tile_start.begin(), out.tile_start.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (!out.visible[i]) continue;
    const int* r = &out.rect[4 * i];
    int64_t rank = out.offset[i];
    for (int yy = r[2]; yy < r[3] && rank < p.max_list; ++yy)
      for (int xx = r[0]; xx < r[1] && rank < p.max_list; ++xx, ++rank) {
        int64_t slot = cursor[int64_t(yy) * tx + xx]++;
        out.list_g[slot] = int32_t(i);
        out.list_rank[slot] = rank;
      }
  }
  // per-tile depth order (ties by index: deterministic)
  parallel_for(pool, int64_t(tx) * ty, [&](int64_t t) {
    int64_t a = out.tile_start[t], b = out.tile_start[t + 1];
    if (b - a < 2) return;
    std::vector<int64_t> idx(b - a);
    std::iota(idx.begin(), idx.end(), a);
    std::sort(idx.begin(), idx.end(), [&](int64_t l, int64_t r) {
      float dl = out.depth[out.list_g[l]], dr = out.depth[out.list_g[r]];
      return dl < dr || (dl == dr && out.list_g[l] < out.list_g[r]);
    });
    std::vector<int32_t> g(b - a);
    std::vector<int64_t> rk(b - a);
    for (int64_t j = 0; j < b - a; ++j) { g[j] = out.list_g[idx[j]]; rk[j] = out.list_rank[idx[j]]; }
    std::copy(g.begin(), g.end(), out.list_g.begin() + a);
    std::copy(rk.begin(), rk.end(), out.list_rank.begin() + a);
  });
}

inline float alpha_of(const Prepared& pr, int32_t g, float px, float py, float& gauss, float& dx, float& dy) {
  dx = pr.u[g] - px;
  dy = pr.v[g] - py;
  const float* c = &pr.conic[3 * g];
  float q = c[0] * dx * dx + 2.f * c[1] * dx * dy + c[2] * dy * dy;
  gauss = std::exp(-0.5f * q);
  return std::min(splat::kAlphaMax, pr.opac[g] * gauss);
}

// front-to-back compositing of one pixel; returns (final T, entries consumed) and colour
inline void composite(const Prepared& pr, const Params& p, int64_t a, int64_t b, float px, float py, float* rgb,
                      float& t_final, int64_t& last) {
  float T = 1.f;
  int64_t steps = 0;
  last = a;
  rgb[0] = rgb[1] = rgb[2] = 0.f;
  for (int64_t e = a; e < b; ++e) {
    if (steps >= p.max_steps) break;
    int32_t g = pr.list_g[e];
    float gauss, dx, dy;
    float alpha = alpha_of(pr, g, px, py, gauss, dx, dy);
    if (!(alpha >= p.alpha_cutoff)) continue;
    float test = T * (1.f - alpha);
    if (test < p.threshold) break;
    float w = alpha * T;
    for (int c = 0; c < 3; ++c) rgb[c] += w * pr.rgb[3 * g + c];
    T = test;
    ++steps;
    last = e + 1;
  }
  t_final = T;
}

ffi::Error read_scene(const ffi::Buffer<ffi::F32>& pos, const ffi::Buffer<ffi::F32>& scale,
                      const ffi::Buffer<ffi::F32>& rot, const ffi::Buffer<ffi::F32>& opac,
                      const ffi::Buffer<ffi::F32>& col, const ffi::Buffer<ffi::F32>& sh,
                      const ffi::Buffer<ffi::F32>& meta, Scene& s) {
  splat::SceneSize size{};
  if (auto e = splat::check_scene(Backend::kCpu, pos, scale, rot, opac, col, sh, meta, size); e.failure()) return e;
  s.n = size.n;
  s.k = size.k;
  s.pos = pos.typed_data(); s.scale = scale.typed_data(); s.rot = rot.typed_data();
  s.opac = opac.typed_data(); s.col = col.typed_data(); s.sh = sh.typed_data();
  return ffi::Error::Success();
}

Params make_params(int64_t width, int64_t height, int64_t tile_size, float radius_scale, float alpha_cutoff,
                   int64_t max_steps, float threshold, int64_t max_list) {
  return Params{int(width), int(height), int(tile_size), radius_scale, alpha_cutoff, max_steps, threshold, max_list};
}

ffi::Error SplatFwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> pos, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> rot, ffi::Buffer<ffi::F32> opac, ffi::Buffer<ffi::F32> col,
                        ffi::Buffer<ffi::F32> sh, ffi::Buffer<ffi::F32> meta, ffi::Result<ffi::Buffer<ffi::F32>> img,
                        int64_t width, int64_t height, int64_t tile_size, float radius_scale, float alpha_cutoff,
                        int64_t max_splat_steps, float transmittance_threshold, int64_t max_list_entries) {
  if (width <= 0 || height <= 0 || tile_size <= 0) return invalid("gaussian_splat: width, height, tile_size must be > 0");
  if (auto e = splat::check_image("image", img->element_count(), width, height); e.failure()) return e;
  Scene s;
  if (auto e = read_scene(pos, scale, rot, opac, col, sh, meta, s); e.failure()) return e;
  Params p = make_params(width, height, tile_size, radius_scale, alpha_cutoff, max_splat_steps,
                         transmittance_threshold, max_list_entries);
  Camera cam = splat::camera_from_meta(meta.typed_data(), p.width, p.height);
  Prepared pr;
  prepare(pool, s, s.scale, cam, p, pr);
  float* out = img->typed_data();
  const int tx = p.tiles_x();
  parallel_for(pool, int64_t(tx) * p.tiles_y(), [&](int64_t t) {
    int ty0 = int(t / tx) * p.tile_size, tx0 = int(t % tx) * p.tile_size;
    int64_t a = pr.tile_start[t], b = pr.tile_start[t + 1];
    for (int y = ty0; y < std::min(ty0 + p.tile_size, p.height); ++y)
      for (int x = tx0; x < std::min(tx0 + p.tile_size, p.width); ++x) {
        float rgb[3], T;
        int64_t last;
        composite(pr, p, a, b, x + 0.5f, y + 0.5f, rgb, T, last);
        float* o = out + (int64_t(y) * p.width + x) * 4;
        for (int c = 0; c < 3; ++c) o[c] = rgb[c] + T * cam.bg[c];
        o[3] = 1.f - T;
      }
  });
  return ffi::Error::Success();
}

constexpr int kPairGrad = 9;  // du dv da db dc dr dg db dopacity(sigmoid)

ffi::Error SplatBwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> pos, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> rot, ffi::Buffer<ffi::F32> opac, ffi::Buffer<ffi::F32> col,
                        ffi::Buffer<ffi::F32> sh, ffi::Buffer<ffi::F32> meta, ffi::Buffer<ffi::F32> dimg,
                        ffi::Result<ffi::Buffer<ffi::F32>> d_pos, ffi::Result<ffi::Buffer<ffi::F32>> d_scale,
                        ffi::Result<ffi::Buffer<ffi::F32>> d_rot, ffi::Result<ffi::Buffer<ffi::F32>> d_opac,
                        ffi::Result<ffi::Buffer<ffi::F32>> d_col, ffi::Result<ffi::Buffer<ffi::F32>> d_sh,
                        int64_t width, int64_t height, int64_t tile_size, float radius_scale, float alpha_cutoff,
                        int64_t max_splat_steps, float transmittance_threshold, int64_t max_list_entries,
                        float loss_grad_clip, int64_t sh_band, float max_anisotropy) {
  if (width <= 0 || height <= 0 || tile_size <= 0) return invalid("gaussian_splat: width, height, tile_size must be > 0");
  if (auto e = splat::check_image("dy", dimg.element_count(), width, height); e.failure()) return e;
  Scene s;
  if (auto e = read_scene(pos, scale, rot, opac, col, sh, meta, s); e.failure()) return e;
  if (auto e = splat::check_gradient_sizes(pos, scale, rot, opac, col, sh, *d_pos, *d_scale, *d_rot, *d_opac, *d_col,
                                           *d_sh);
      e.failure())
    return e;
  Params p = make_params(width, height, tile_size, radius_scale, alpha_cutoff, max_splat_steps,
                         transmittance_threshold, max_list_entries);
  const int64_t n = s.n;
  Camera cam = splat::camera_from_meta(meta.typed_data(), p.width, p.height);
  // anisotropy limit: raise log-scales to max - log(max_anisotropy); clamped axes are constants
  std::vector<float> scales(s.scale, s.scale + 3 * n);
  std::vector<uint8_t> clamped(3 * n, 0);
  if (max_anisotropy > 0.f) {
    float lg = std::log(std::max(max_anisotropy, 1.f));
    for (int64_t i = 0; i < n; ++i) {
      float* sc = &scales[3 * i];
      float floor = std::max(sc[0], std::max(sc[1], sc[2])) - lg;
      for (int j = 0; j < 3; ++j)
        if (sc[j] < floor) { sc[j] = floor; clamped[3 * i + j] = 1; }
    }
  }
  Prepared pr;
  prepare(pool, s, scales.data(), cam, p, pr);
  const float* dy = dimg.typed_data();
  const float clip = loss_grad_clip;
  std::vector<float> pair_grad(size_t(pr.pairs) * kPairGrad, 0.f);
  const int tx = p.tiles_x();
  parallel_for(pool, int64_t(tx) * p.tiles_y(), [&](int64_t t) {
    int ty0 = int(t / tx) * p.tile_size, tx0 = int(t % tx) * p.tile_size;
    int64_t a = pr.tile_start[t], b = pr.tile_start[t + 1];
    if (a == b) return;
    for (int y = ty0; y < std::min(ty0 + p.tile_size, p.height); ++y)
      for (int x = tx0; x < std::min(tx0 + p.tile_size, p.width); ++x) {
        const float px = x + 0.5f, py = y + 0.5f;
        float rgb[3], t_final;
        int64_t last;
        composite(pr, p, a, b, px, py, rgb, t_final, last);
        float g[4];
        for (int c = 0; c < 4; ++c) {
          float d = dy[(int64_t(y) * p.width + x) * 4 + c];
          if (clip > 0.f) d = std::min(clip, std::max(-clip, d));
          g[c] = d;
        }
        float T = t_final;
        float acc[3] = {cam.bg[0], cam.bg[1], cam.bg[2]};
        for (int64_t e = last - 1; e >= a; --e) {
          int32_t gi = pr.list_g[e];
          float gauss, dx, dyy;
          float alpha = alpha_of(pr, gi, px, py, gauss, dx, dyy);
          if (!(alpha >= p.alpha_cutoff)) continue;
          float one_minus = 1.f - alpha;
          float Ti = T / one_minus;
          const float* c = &pr.rgb[3 * gi];
          float dalpha = g[3] * t_final / one_minus;
          float* slot = &pair_grad[size_t(pr.list_rank[e]) * kPairGrad];
          for (int ch = 0; ch < 3; ++ch) {
            dalpha += Ti * (c[ch] - acc[ch]) * g[ch];
            slot[5 + ch] += alpha * Ti * g[ch];
            acc[ch] = alpha * c[ch] + one_minus * acc[ch];
          }
          T = Ti;
          if (pr.opac[gi] * gauss < splat::kAlphaMax) {
            slot[8] += gauss * dalpha;
            float dq = -0.5f * gauss * pr.opac[gi] * dalpha;
            const float* cn = &pr.conic[3 * gi];
            slot[0] += dq * 2.f * (cn[0] * dx + cn[1] * dyy);
            slot[1] += dq * 2.f * (cn[1] * dx + cn[2] * dyy);
            slot[2] += dq * dx * dx;
            slot[3] += dq * 2.f * dx * dyy;
            slot[4] += dq * dyy * dyy;
          }
        }
      }
  });
  // per Gaussian: sum its pair slots in pair order, then chain through the projection
  float* gp = d_pos->typed_data();
  float* gs = d_scale->typed_data();
  float* gr = d_rot->typed_data();
  float* go = d_opac->typed_data();
  float* gc = d_col->typed_data();
  float* gsh = d_sh->typed_data();
  const int64_t keep_sh = sh_band < 0 ? s.k : std::min<int64_t>(s.k, (sh_band + 1) * (sh_band + 1));
  int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(pool, chunks, [&](int64_t ch) {
    for (int64_t i = ch * kChunk; i < std::min(n, (ch + 1) * kChunk); ++i) {
      float sum[kPairGrad] = {0};
      if (pr.visible[i]) {
        const int* r = &pr.rect[4 * i];
        int64_t cnt = int64_t(std::max(r[1] - r[0], 0)) * std::max(r[3] - r[2], 0);
        int64_t end = std::min(pr.offset[i] + cnt, pr.pairs);
        for (int64_t k = pr.offset[i]; k < end; ++k)
          for (int j = 0; j < kPairGrad; ++j) sum[j] += pair_grad[size_t(k) * kPairGrad + j];
      }
      float sig = pr.opac[i];
      go[i] = sum[8] * sig * (1.f - sig);
      for (int c = 0; c < 3; ++c) gc[3 * i + c] = sum[5 + c];
      // colour: d sh = Y(dir) * d rgb; d position through the view direction
      using D3 = Dual<3>;
      D3 p3[3] = {D3::seed(s.pos[3 * i], 0), D3::seed(s.pos[3 * i + 1], 1), D3::seed(s.pos[3 * i + 2], 2)};
      D3 vx, vy, vz;
      splat::view_dir<D3>(p3, cam, vx, vy, vz);
      D3 basis[splat::kMaxSh];
      splat::sh_basis<D3>(vx, vy, vz, int(s.k), basis);
      float dpos[3] = {0.f, 0.f, 0.f};
      for (int64_t k = 0; k < s.k; ++k) {
        for (int c = 0; c < 3; ++c) {
          float drgb = sum[5 + c];
          gsh[(i * s.k + k) * 3 + c] = k < keep_sh ? basis[k].v * drgb : 0.f;
          float w = s.sh[(i * s.k + k) * 3 + c] * drgb;
          for (int j = 0; j < 3; ++j) dpos[j] += w * basis[k].d[j];
        }
      }
      float dscale[3] = {0.f, 0.f, 0.f}, drot[4] = {0.f, 0.f, 0.f, 0.f};
      if (pr.visible[i]) {
        using D10 = Dual<10>;
        D10 pp[3], ls[3], qq[4];
        for (int j = 0; j < 3; ++j) pp[j] = D10::seed(s.pos[3 * i + j], j);
        for (int j = 0; j < 3; ++j) ls[j] = clamped[3 * i + j] ? D10(scales[3 * i + j]) : D10::seed(scales[3 * i + j], 3 + j);
        for (int j = 0; j < 4; ++j) qq[j] = D10::seed(s.rot[4 * i + j], 6 + j);
        D10 u, v, conic[3];
        float depth, lam;
        splat::project_gaussian<D10>(pp, ls, qq, cam, u, v, conic, depth, lam);
        const D10* outs[5] = {&u, &v, &conic[0], &conic[1], &conic[2]};
        for (int o = 0; o < 5; ++o) {
          float w = sum[o];
          if (w == 0.f) continue;
          for (int j = 0; j < 3; ++j) dpos[j] += w * outs[o]->d[j];
          for (int j = 0; j < 3; ++j) dscale[j] += w * outs[o]->d[3 + j];
          for (int j = 0; j < 4; ++j) drot[j] += w * outs[o]->d[6 + j];
        }
      }
      for (int j = 0; j < 3; ++j) { gp[3 * i + j] = dpos[j]; gs[3 * i + j] = dscale[j]; }
      for (int j = 0; j < 4; ++j) gr[4 * i + j] = drot[j];
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#define RLX_SPLAT_ATTRS                                   \
  .Attr<int64_t>("width")                                 \
      .Attr<int64_t>("height")                            \
      .Attr<int64_t>("tile_size")                         \
      .Attr<float>("radius_scale")                        \
      .Attr<float>("alpha_cutoff")                        \
      .Attr<int64_t>("max_splat_steps")                   \
      .Attr<float>("transmittance_threshold")             \
      .Attr<int64_t>("max_list_entries")

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGaussianSplatFwd, SplatFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() RLX_SPLAT_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGaussianSplatBwd, SplatBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
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
                                  .Ret<ffi::Buffer<ffi::F32>>() RLX_SPLAT_ATTRS
                                  .Attr<float>("loss_grad_clip")
                                  .Attr<int64_t>("sh_band")
                                  .Attr<float>("max_anisotropy"));

RLX_REGISTER_HANDLER("rlx_gaussian_splat_fwd", RlxGaussianSplatFwd);
RLX_REGISTER_HANDLER("rlx_gaussian_splat_bwd", RlxGaussianSplatBwd);

}  // namespace rlx
