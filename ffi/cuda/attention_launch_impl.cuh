// Definitions of the attention launchers (attention_launch.cuh): the kernel choice per call and the
// launches. Included only by the
// per-(pass, dtype) translation units, each of which instantiates one launcher.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include <map>
#include <mutex>
#include <queue>

#include "cuda/attention_mma.cuh"
#include "cuda/attention_wgmma.cuh"
#include "cuda/attention_wgmma_bwd.cuh"
#include "cuda/attention_fused_bwd.cuh"
#include "cuda/attention_fused_bwd_ws.cuh"
#include "cuda/attention_wgmma_bwd_ws.cuh"
#include "cuda/attention_wgmma_ws.cuh"
#include "cuda/attention_launch.cuh"

namespace rlx {
namespace cuda {
namespace {

using attn::AttnArgs;

// Tensor-core path available for this call?
template <typename T>
bool use_mma(const AttnArgs& a, int device) {
  if constexpr (std::is_same<T, float>::value) {
    return false;
  } else {
    if (a.D != 64 && a.D != 128) return false;
    int major = 0;
    if (device_cc_major(device, &major) != cudaSuccess) return false;
    return major >= 8;
  }
}

// The kernels a call takes, by hardware and case (bf16 / f16 at head dim 64 or 128):
//   - sm_90a image on a compute capability 9.0 GPU, no bias, scale > 0: the forward on the
//     warp-specialised wgmma kernel (attention_wgmma_ws.cuh), the backward on the fused dk / dv / dq
//     kernel (attention_fused_bwd_ws.cuh; attention_fused_bwd.cuh at D 64 with a softcap) where its
//     scratch is given and a (batch, kv head)'s key blocks fit on the device at once, else on the
//     two-kernel backward (wgmma dk / dv, then the warp-specialised dq at D 128 or the mma.sync dq at
//     D 64; with a softcap, key mask or window the mma.sync kernels);
//   - other GPUs of compute capability 8.x / 9.x, or an additive bias: the mma.sync kernels
//     (attention_mma.cuh);
//   - f32, f64 and other head dims: the generic kernels (attention_generic.cuh).
// Segment ids (the segment targets: AttnArgs::qseg non-null) run only on the first case's
// kernels, in their MASK form 3 (attention_segments.cuh), the backward on the fused kernel:
// any other call is an error (check_segments_served), never a kernel that ignores the ids.
// RLX_ATTENTION_CUDA_WGMMA (read once per process), a debugging aid: 0 runs the mma.sync kernels
// where the wgmma ones would serve (the path of a GPU without sm_90a code); 1 makes a case the wgmma
// kernels serve an error when the loaded image has no sm_90a code (instead of the mma.sync fallback)
// and names each wgmma kernel on stderr at its first launch ("rlx attention forward: wgmma kernel
// ...", "rlx attention backward: wgmma dkdv kernel ..." / "... wgmma dq kernel ..." / "... wgmma
// fused dkdv+dq kernel ..."; " CAP" and / or " MASK" end the line of a softcap / key-mask-or-window
// kernel). Unset or another value: the routing above.
int attn_wgmma_env() {
  static const int env = env_starts_with("RLX_ATTENTION_CUDA_WGMMA", '0')   ? 0
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA", '1') ? 1
                                                                            : -1;
  return env;
}
bool attn_wgmma_off() { return attn_wgmma_env() == 0; }
bool attn_wgmma_required() { return attn_wgmma_env() == 1; }

// Causal forward tile order: one head's query tiles after another's, heaviest first (the kernels'
// tile order takes heads in chunks of hc; chunks of several heads, longest first across them,
// measured 0.97x / 0.985x at D 128 / 64).
constexpr int kFwdHeadChunk = 1;

// Grid of the persistent warp-specialised kernels: min(tiles, SMs) blocks looping over the tiles (one
// block per tile measured slower).
int64_t attn_ws_grid(int64_t tiles, int sms) { return std::min<int64_t>(tiles, std::max(sms, 1)); }

// Pass order of the persistent warp-specialised grids (attn::ws_tile: 0 the plain stride, 1
// boustrophedon passes) for `blocks` blocks over the query tiles of bm rows (fwd_tile's order, hc):
// the one whose busiest block has less work by the model "a tile's work = its key tiles of bc keys
// + 1" (the + 1: its Q load and output), the plain stride on a tie and without a mask (every tile
// the same work). O(tiles) host work, once per shape (cached: a launch of a shape seen before
// looks the choice up). At B4 S4096 H16 causal the model picks 1 (1.03x against 1.12x the mean
// load): the causal forward 1.05-1.12x (H100). Both orders compute bitwise the same outputs.
int attn_ws_zig(const AttnArgs& a, int64_t nqt, int64_t hc, int64_t blocks, int64_t bm, int64_t bc) {
  const int64_t nbh = a.B * a.H, tiles = nqt * nbh;
  if (a.kind == 0 || blocks <= 1 || tiles <= blocks) return 0;
  using Key = std::vector<int64_t>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  const Key key{a.kind, a.Sq, a.Sk, a.off, a.window, nbh, nqt, hc, blocks, bm, bc};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  std::vector<int64_t> plain(size_t(blocks), 0), zig(size_t(blocks), 0);
  for (int64_t t = 0; t < tiles; ++t) {
    int64_t qt, bh;
    attn::fwd_tile(t, nqt, nbh, hc, &qt, &bh);
    // the tile's keys as the kernels take them: causal up to its last row, sliding from its first
    // row's window start
    const int64_t q0 = qt * bm;
    int64_t kbeg, kend;
    attn::key_range(a, q0, std::min(a.Sq - 1, q0 + bm - 1), &kbeg, &kend, bc);
    const int64_t work = (kend > kbeg ? (kend - kbeg + bc - 1) / bc : 0) + 1;
    const int64_t n = t / blocks, i = t - n * blocks;
    plain[size_t(i)] += work;
    zig[size_t((n & 1) ? blocks - 1 - i : i)] += work;
  }
  const int pick = *std::max_element(zig.begin(), zig.end()) < *std::max_element(plain.begin(), plain.end()) ? 1 : 0;
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= 4096) cache.clear();  // bounded: a program uses few shapes
  cache.emplace(key, pick);
  return pick;
}
// Head splits of the fused backward (FusedSplit, attention_fused_bwd.cuh), at most this many.
constexpr int64_t kMaxFusedSplits = 4;

// The head splits n of a fused backward grid (1, 2, 4, ... up to max_splits): the n whose grid
// finishes first by the model "blocks start in ticket order, each on the first of `slots` block
// slots to come free; a block's work = its items (query tiles of bq rows x its group / n query
// heads) + 2 (its K / V loads, its dK / dV stores) + 2 a tree level (a partial written or read)",
// the smaller n on a tie. The items are those of FusedSchedule without segment ids (with ids the
// schedule depends on the data). O(blocks log slots) host work, once per shape (cached).
int64_t attn_fused_splits(const AttnArgs& a, int64_t nkt, int64_t nqt, int64_t bq, int64_t slots,
                          int64_t max_splits) {
  if (max_splits <= 1 || slots <= 0 || nkt <= 0) return 1;
  using Key = std::vector<int64_t>;
  static std::mutex mu;
  static std::map<Key, int64_t> cache;
  const Key key{a.kind, a.Sq, a.Sk, a.off, a.window, a.B, a.Hkv, a.group, nkt, nqt, bq, slots, max_splits};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  std::vector<int64_t> tiles(size_t(nkt), 0);  // query tiles of key block kt
  for (int64_t kt = 0; kt < nkt; ++kt) {
    int64_t t0, t1;
    attn::key_block_tiles<int64_t>(kt, attn::kWgBwdKeys, bq, nqt, a.kind != 0, a.off, a.kind == 2 ? a.window : -1,
                                   &t0, &t1);
    tiles[size_t(kt)] = std::max<int64_t>(0, t1 - t0);
  }
  int64_t best = 1, best_span = -1;
  for (int64_t n = 1, levels = 0; n <= max_splits; n *= 2, ++levels) {
    std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>> free_at;
    for (int64_t i = 0; i < std::min(slots, a.B * a.Hkv * n * nkt); ++i) free_at.push(0);
    int64_t span = 0;
    for (int64_t grp = 0; grp < a.B * a.Hkv * n; ++grp)
      for (int64_t kt = 0; kt < nkt; ++kt) {
        const int64_t start = free_at.top(), end = start + tiles[size_t(kt)] * (a.group / n) + 2 + 2 * levels;
        free_at.pop();
        free_at.push(end);
        span = std::max(span, end);
      }
    if (best_span < 0 || span < best_span) best = n, best_span = span;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= 4096) cache.clear();  // bounded: a program uses few shapes
  cache.emplace(key, best);
  return best;
}

// Does the loaded image of this module carry the sm_90a (wgmma) code for `device`? The probe
// kernel's static shared memory says which compilation pass the loaded image came from
// (attention_wgmma.cuh); cudaFuncGetAttributes launches nothing (safe under stream capture).
// Cached per device.
bool wgmma_available(int device) {
  static std::mutex mu;
  static std::map<int, bool> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int major = 0, minor = 0;
  bool ok = device_cc_major(device, &major) == cudaSuccess &&
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
            major == 9 && minor == 0;
  if (ok) {
    cudaFuncAttributes at{};
    ok = cudaFuncGetAttributes(&at, attn::wgmma_probe_kernel) == cudaSuccess &&
         at.sharedSizeBytes == size_t(attn::kWgmmaProbeSmem);
    (void)cudaGetLastError();
  }
  cache[device] = ok;
  return ok;
}

// With RLX_ATTENTION_CUDA_WGMMA=1: one stderr line per wgmma kernel on its first launch in the
// process, so that a test sees which kernels ran: "rlx attention forward: wgmma kernel D=.. BC=..
// NWG=3 WS ...", "rlx attention backward: wgmma dkdv kernel D=.. BK=.. NWG=.. OVL=..", "rlx attention
// backward: wgmma dq kernel D=.. BM=.. BC=.. WS ...", "rlx attention backward: wgmma fused dkdv+dq
// kernel ...".
void log_wgmma_kernel(const void* kernel, bool backward, const char* what) {
  static std::mutex mu;
  static std::map<const void*, bool> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (seen.emplace(kernel, true).second)
    std::fprintf(stderr, "rlx attention %s: wgmma %s\n", backward ? "backward" : "forward", what);
}

constexpr int64_t kMaxGrid = 2147483647;

// The MASK form a call takes (the wgmma kernels' MASK template value): 0 none (mask kind none or
// causal, no key mask), 1 a key mask (mask kind none or causal), 2 mask kind sliding (a window, with
// or without a key mask), 3 segment ids (attention_segments.cuh; any mask kind, a key mask
// optional). The window's code stays out of the key-mask-only kernels: compiled into them it raised
// the fused backward's spills at D 64 from 96 / 88 to 224 / 344 bytes and ran the key-masked
// backward at ~0.75x.
int mask_level(const AttnArgs& a) { return a.qseg != nullptr ? 3 : a.kind == 2 ? 2 : a.mask != nullptr ? 1 : 0; }

// f(cap_tag, mask_tag): the runtime softcap flag and mask level (mask_level) as
// std::integral_constant tags, for the kernels' CAP / MASK template values.
template <typename F>
ffi::Error with_cap_mask(bool cap, int level, F&& f) {
  using Tr = std::true_type;
  using Fa = std::false_type;
  auto with_level = [&](auto cap_tag) {
    if (level == 3) return f(cap_tag, std::integral_constant<int, 3>{});
    if (level == 2) return f(cap_tag, std::integral_constant<int, 2>{});
    if (level == 1) return f(cap_tag, std::integral_constant<int, 1>{});
    return f(cap_tag, std::integral_constant<int, 0>{});
  };
  return cap ? with_level(Tr{}) : with_level(Fa{});
}

ffi::Error grid_check(int64_t blocks, const char* who) {
  if (blocks > kMaxGrid) return invalid(std::string(who) + " (cuda): problem too large for one grid");
  return ffi::Error::Success();
}

// Sets the dynamic shared-memory limit of `kernel` and checks `smem` fits.
template <typename Kernel>
ffi::Error prepare(int device, Kernel kernel, size_t smem, const char* who) {
  size_t max_bytes = 0;
  if (cudaError_t e = allow_max_smem(device, kernel, &max_bytes); e != cudaSuccess) return cuda_error(who, e);
  if (smem > max_bytes)
    return invalid(std::string(who) + " (cuda): needs " + std::to_string(smem) + " bytes of shared memory, device has " +
                   std::to_string(max_bytes));
  return ffi::Error::Success();
}


}  // namespace

// Segment ids run only on the wgmma kernels (their MASK form 3): the other kernels would ignore
// them, so a call they would take is an error (the Python side routes such calls to XLA's code).
template <typename T>
ffi::Error check_segments_served(const AttnArgs& a, bool bias, int device, const char* who) {
  if (a.qseg == nullptr) return ffi::Error::Success();
  if (use_mma<T>(a, device) && !bias && a.scale > 0.f && !attn_wgmma_off() && wgmma_available(device))
    return ffi::Error::Success();
  return invalid(std::string(who) +
                 " (cuda): segment ids run on the sm_90a (wgmma) kernels only: bf16 / f16, head dim 64 or 128, no "
                 "bias, scale > 0, a compute capability 9.0 device, RLX_ATTENTION_CUDA_WGMMA not 0");
}

template <typename T>
ffi::Error AttentionFwd<T>::launch(cudaStream_t stream, const AttnArgs& a, const T* q, const T* k, const T* v,
                                   const T* bias, T* out, float* lse) {
  DeviceInfo info;
  if (cudaError_t e = device_info(&info); e != cudaSuccess) return cuda_error("attention", e);
  if (auto e = check_segments_served<T>(a, bias != nullptr, info.device, "attention"); e.failure()) return e;
  if (use_mma<T>(a, info.device)) {
    if constexpr (!std::is_same<T, float>::value) {
      // the warp-specialised wgmma forward: no bias, scale > 0 (a softcap, a key mask or a sliding
      // window in its CAP / MASK forms); else the mma.sync forward. general: the MASK form (a key mask
      // and / or a sliding window)
      const int level = mask_level(a);
      const bool cap = a.softcap > 0.f, general = level != 0;
      if (bias == nullptr && a.scale > 0.f && !attn_wgmma_off()) {
        if (wgmma_available(info.device)) {
          // 1 producer + 2 consumer warpgroups, 128 query rows per tile, a K / V ring of 3 stages of 128
          // keys, the consumer loop pipelined within each warpgroup (attention_wgmma_ws.cuh). ptxas
          // sm_90a (nvcc 13.0, -lineinfo; bf16, f16): 168 registers at launch, setmaxnreg 24 / 240,
          // 104 / 116 bytes of spill stores at D 64 / 128, no wgmma serialisation (C7513).
          // maps: the TMA tensor maps of q, k, v (tma.cuh), read by the TMA kernels only
          auto run_ws = [&](auto kernel, int d, int nst, size_t smem, const attn::TileMaps& maps,
                            bool tma) -> ffi::Error {
            constexpr int kBC = 128;
            const int64_t nqt = (a.Sq + 127) / 128, tiles = nqt * a.H * a.B;
            const int64_t blocks = attn_ws_grid(tiles, info.sms);
            if (attn_wgmma_required()) {
              char line[64];
              std::snprintf(line, sizeof line, "kernel D=%d BC=%d NWG=3 WS NST=%d persistent PIPE%s%s%s", d, kBC,
                            nst, tma ? " TMA" : "", cap ? " CAP" : "", general ? " MASK" : "");
              log_wgmma_kernel(reinterpret_cast<const void*>(kernel), false, line);
            }
            if (auto e = grid_check(blocks, "attention"); e.failure()) return e;
            if (auto e = prepare(info.device, kernel, smem, "attention"); e.failure()) return e;
            if (blocks > 0)
              kernel<<<unsigned(blocks), 384u, smem, stream>>>(
                  a, q, k, v, out, lse, kFwdHeadChunk,
                  a.qorder != nullptr ? 1 : attn_ws_zig(a, nqt, kFwdHeadChunk, blocks, 128, kBC), maps);
            return check_launch("attention forward (wgmma ws)");
          };
          // The pipelined consumer loop releases a ring stage one step later (after the next tile's
          // S = Q K^T has been issued), so it takes 3 stages: the producer then still has a whole
          // step to load each K / V tile (230,488 bytes of shared memory at D 128: fits the 227 KB).
          auto run_ws_d = [&](auto dim, auto cap_tag, auto mask_tag) -> ffi::Error {
            constexpr int D = decltype(dim)::value;
            constexpr bool CAP = decltype(cap_tag)::value;
            constexpr int MASK = decltype(mask_tag)::value;
            // TMA: maps of q [B, Sq, H, D] and k, v [B, Sk, Hkv, D], boxes of the 128 rows of a query
            // tile / key tile (without keys, Sk 0, no key tile is loaded: k's and v's maps are q's); one
            // producer thread issues the copies (1.08-1.15x the producer warpgroup's cp.async, H100).
            // Where the driver refuses a map, the producer warpgroup's cp.async copies (same tiles, same
            // layout: the outputs are bitwise equal).
            attn::TileMaps maps{};
            constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
            const bool tma = a.B > 0 && a.Sq > 0 &&
                             attn::encode_rows_map(&maps.q, q, kBf16, a.B, a.Sq, a.H, D, 128) &&
                             (a.Sk == 0 ? (maps.k = maps.v = maps.q, true)
                                        : attn::encode_rows_map(&maps.k, k, kBf16, a.B, a.Sk, a.Hkv, D, 128) &&
                                              attn::encode_rows_map(&maps.v, v, kBf16, a.B, a.Sk, a.Hkv, D, 128));
            if (tma)
              return run_ws(attn::wgmma_fwd_ws_kernel<T, D, 128, 3, true, CAP, MASK>, D, 3,
                            attn::wg_ws_smem<D, 128, 3>(), maps, true);
            return run_ws(attn::wgmma_fwd_ws_kernel<T, D, 128, 3, false, CAP, MASK>, D, 3,
                          attn::wg_ws_smem<D, 128, 3>(), maps, false);
          };
          return with_cap_mask(cap, level, [&](auto cap_tag, auto mask_tag) {
            if (a.D == 64) return run_ws_d(std::integral_constant<int, 64>{}, cap_tag, mask_tag);
            return run_ws_d(std::integral_constant<int, 128>{}, cap_tag, mask_tag);
          });
        }
        if (attn_wgmma_required())
          return invalid("attention (cuda): RLX_ATTENTION_CUDA_WGMMA=1 but the loaded kernel image has no "
                         "wgmma (sm_90a) code for this device");
      }
      // shared tile layout of the kernel launched (attention_mma.cuh: fwd_swizzle)
      const bool sw = attn::fwd_swizzle(int(a.D), a.mask != nullptr);
      auto run = [&](auto kernel, int mt, int nk, int nbuf) -> ffi::Error {
        const int64_t rows = 64 * mt;
        const int64_t blocks = (a.Sq + rows - 1) / rows * a.H * a.B;
        if (auto e = grid_check(blocks, "attention"); e.failure()) return e;
        const size_t smem = attn::mma_fwd_smem(int(a.D), sw, mt, nk, nbuf);
        if (auto e = prepare(info.device, kernel, smem, "attention"); e.failure()) return e;
        kernel<<<unsigned(blocks), attn::kMmaThreads, smem, stream>>>(a, q, k, v, bias, out, lse, kFwdHeadChunk);
        return check_launch("attention forward (mma)");
      };
      // 64 query rows x 64 keys per step. (Tried on the H200, bf16 B4 S4096 H16 non-causal:
      // 128 rows per block, two m-tiles per warp, 64 keys per step at D 64 and 32 at D 128,
      // took 5.47 ms at D 64 and 5.44 ms at D 128, against 3.69 ms and 5.45 ms for this tiling
      // on another machine; the template keeps MT / NK as parameters. MT 2 measured faster
      // for the PLAIN D 64 kernel without a key mask and is taken there.)
      // Pipeline per head dim, the faster one measured (H200): without a key mask K / V double
      // buffered at D 64 (__launch_bounds__ for 3 blocks per SM: 168 registers; the unrolled
      // tile loads took 179 without, i.e. 2 blocks); staggered (one K and one V buffer) with
      // __launch_bounds__ asking for 3 blocks per SM at D 128; with a key mask staggered at
      // both (4 / 3 blocks). Template flags: MASK (a key mask is given: per-tile mask bits) and
      // PLAIN (no softcap, no bias, scale > 0: an unmasked tile costs one max, one fma and one
      // ex2 per score, with no per-score index arithmetic, tanh or bias load).
      const bool plain = a.softcap == 0.f && bias == nullptr && a.scale > 0.f;
      if (a.mask != nullptr) {
        if (a.D == 64)
          return plain ? run(attn::mma_fwd_kernel<T, 64, 1, 64, true, 4, true, true>, 1, 64, 1)
                       : run(attn::mma_fwd_kernel<T, 64, 1, 64, true, 4, true, false>, 1, 64, 1);
        return plain ? run(attn::mma_fwd_kernel<T, 128, 1, 64, true, 3, true, true>, 1, 64, 1)
                     : run(attn::mma_fwd_kernel<T, 128, 1, 64, true, 3, true, false>, 1, 64, 1);
      }
      if (a.D == 64) {
        // PLAIN: two m-tiles per warp (MT 2): 128 rows per block, each K / V
        // fragment read from shared memory feeds two mma; K / V double buffered (48 KB of shared
        // memory with the swizzled tiles, 55 KB padded), no register cap: ptxas sm_90 248
        // registers (250 padded), no spill, 2 blocks per SM (8 warps, 256 rows) against 3 blocks
        // of 64 rows (161 registers) for MT 1. Measured on the H200:
        // shared wavefronts per
        // forward -46 %, ncu kernel time -10 % (B1 S4096 H16), B4 fwd 1-2 % faster by the median
        // of 10 alternating rounds. Not taken: MT 2 for the general kernel (softcap 3 % slower:
        // 254 registers) and MT 2 capped at 168 registers for 3 blocks (128 B of spills; slower).
        if (plain) return run(attn::mma_fwd_kernel<T, 64, 2, 64, false, 2, false, true>, 2, 64, 2);
        return run(attn::mma_fwd_kernel<T, 64, 1, 64, false, 3, false, false>, 1, 64, 2);
      }
      return plain ? run(attn::mma_fwd_kernel<T, 128, 1, 64, true, 3, false, true>, 1, 64, 1)
                   : run(attn::mma_fwd_kernel<T, 128, 1, 64, true, 3, false, false>, 1, 64, 1);
    }
  }
  const int64_t blocks = (a.Sq + attn::kGenWarps - 1) / attn::kGenWarps * a.H * a.B;
  if (auto e = grid_check(blocks, "attention"); e.failure()) return e;
  const size_t smem = attn::gen_smem_bytes(a.D);
  if (auto e = prepare(info.device, attn::gen_fwd_kernel<T>, smem, "attention"); e.failure()) return e;
  attn::gen_fwd_kernel<T><<<unsigned(blocks), attn::kGenWarps * 32, smem, stream>>>(a, q, k, v, bias, out, lse);
  return check_launch("attention forward (generic)");
}

template <typename T>
ffi::Error AttentionBwd<T>::launch(cudaStream_t stream, const AttnArgs& a, const T* q, const T* k, const T* v,
                                   const T* out, const float* lse, const T* dout, const float* dlse, const T* bias,
                                   T* dq, T* dk, T* dv, T* dbias, float* delta, int64_t scratch_elems) {
  DeviceInfo info;
  if (cudaError_t e = device_info(&info); e != cudaSuccess) return cuda_error("attention backward", e);
  if (auto e = check_segments_served<T>(a, bias != nullptr, info.device, "attention backward"); e.failure()) return e;
  const int64_t rows = a.B * a.Sq * a.H;
  if (rows > 0) {
    // 16-byte vectors where every row starts 16-byte aligned (D * sizeof(T) a multiple of 16)
    constexpr int kV = kVec16<T>;
    const bool vec = a.D % kV == 0 && (reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(dout)) % 16 == 0;
    const int L = attn::delta_lanes(a.D, vec ? kV : 1);
    const int64_t blocks = (rows * L + 255) / 256;
    if (auto e = grid_check(blocks, "attention backward"); e.failure()) return e;
    if (vec)
      attn::delta_kernel<T, kV><<<unsigned(blocks), 256, 0, stream>>>(rows, a.Sq, a.H, int(a.D), L, out, dout, dlse,
                                                                       delta);
    else
      attn::delta_kernel<T, 1><<<unsigned(blocks), 256, 0, stream>>>(rows, a.Sq, a.H, int(a.D), L, out, dout, dlse,
                                                                      delta);
    if (auto e = check_launch("attention backward (delta)"); e.failure()) return e;
  }
  const int64_t q_blocks_g = (a.Sq + attn::kGenWarps - 1) / attn::kGenWarps * a.H * a.B;
  const int64_t k_blocks_g = (a.Sk + attn::kGenWarps - 1) / attn::kGenWarps * a.Hkv * a.B;
  if (use_mma<T>(a, info.device)) {
    if constexpr (!std::is_same<T, float>::value) {
      const int64_t qb = (a.Sq + attn::kBQ - 1) / attn::kBQ * a.H * a.B;
      const int64_t kb = (a.Sk + attn::kBK - 1) / attn::kBK * a.Hkv * a.B;
      if (auto e = grid_check(std::max(qb, kb), "attention backward"); e.failure()) return e;
      auto run = [&](auto dkdv, size_t smem_kv, auto dqk, size_t smem_q) -> ffi::Error {
        if (auto e = prepare(info.device, dkdv, smem_kv, "attention backward"); e.failure()) return e;
        if (auto e = prepare(info.device, dqk, smem_q, "attention backward"); e.failure()) return e;
        if (kb > 0) {
          dkdv<<<unsigned(kb), attn::kMmaThreads, smem_kv, stream>>>(a, q, k, v, dout, lse, delta, bias, dk, dv,
                                                                      dbias);
          if (auto e = check_launch("attention backward (mma dk dv)"); e.failure()) return e;
        }
        if (qb > 0) {
          dqk<<<unsigned(qb), attn::kMmaThreads, smem_q, stream>>>(a, q, k, v, dout, lse, delta, bias, dq);
          if (auto e = check_launch("attention backward (mma dq)"); e.failure()) return e;
        }
        return ffi::Error::Success();
      };
      // Template flags: MASK (a key mask is given; without one the kernels carry no mask bits
      // or flags: fewer live registers) and PLAIN (no softcap, no bias: unmasked tiles run one
      // fma, one ex2 and the dS product per score); AR: the warp's loop-invariant A operands
      // held in registers (dkdv: K, V; dq: Q, dO), one ldmatrix less per k-chunk of S / dP,
      // where ptxas (sm_90) finds the registers without losing blocks per SM or spilling:
      // dkdv D 64 both (2 blocks as before; D 128 has no registers left), dq D 64 Q (and dO with a
      // key mask, PLAIN), capped at 168 registers for 3 blocks (the mask + general kernel
      // spilled: none), dq D 128 Q (255 registers, 2 blocks as before: shared memory limits).
      // (H200: 1-4 % faster than AR = 0 in all 8 cases of the A/B.)
      const bool km = a.mask != nullptr, plain = a.softcap == 0.f && bias == nullptr;
      // The Hopper backward (no bias, scale > 0, sequences under 2^30): the fused dk / dv / dq kernel,
      // in its CAP / MASK form where there is a softcap, a key mask or a window; where it does not serve
      // (scratch too small, or more key blocks than fit on the device at once) the two-kernel wgmma
      // backward for the PLAIN cases, and the mma.sync kernels below for the rest.
      // general: the MASK form (a key mask and / or a sliding window)
      const int level = mask_level(a);
      const bool cap = a.softcap > 0.f, general = level != 0;
      if (bias == nullptr && a.scale > 0.f && !attn_wgmma_off() && a.Sq < (int64_t(1) << 30) &&
          a.Sk < (int64_t(1) << 30)) {
        if (wgmma_available(info.device)) {
          // the wgmma dk / dv kernel (its OVL flag for the log) without its dq launch
          auto run_dkdv = [&](auto dkdv, int ovl, size_t smem_kv) -> ffi::Error {
            const int64_t kbw = (a.Sk + attn::kWgBwdKeys - 1) / attn::kWgBwdKeys * a.Hkv * a.B;
            if (attn_wgmma_required()) {
              char line[96];
              std::snprintf(line, sizeof line, "dkdv kernel D=%d BK=%d NWG=2 OVL=%d", int(a.D), attn::kWgBwdKeys, ovl);
              log_wgmma_kernel(reinterpret_cast<const void*>(dkdv), true, line);
            }
            if (auto e = prepare(info.device, dkdv, smem_kv, "attention backward"); e.failure()) return e;
            if (kbw > 0) {
              dkdv<<<unsigned(kbw), attn::kWgBwdThreads, smem_kv, stream>>>(a, q, k, v, dout, lse, delta, dk, dv);
              if (auto e = check_launch("attention backward (wgmma dk dv)"); e.failure()) return e;
            }
            return ffi::Error::Success();
          };
          // the warp-specialised dq (attention_wgmma_bwd_ws.cuh), after run_dkdv
          auto run_dq_ws = [&](auto kernel, int nst, size_t smem) -> ffi::Error {
            const int64_t nqt = (a.Sq + 127) / 128, tiles = nqt * a.H * a.B;
            const int64_t blocks = attn_ws_grid(tiles, info.sms);
            if (attn_wgmma_required()) {
              char line[96];
              std::snprintf(line, sizeof line, "dq kernel D=%d BM=128 BC=%d WS NST=%d persistent PIPE", int(a.D),
                            attn::kWsDqKeys, nst);
              log_wgmma_kernel(reinterpret_cast<const void*>(kernel), true, line);
            }
            if (auto e = grid_check(blocks, "attention backward"); e.failure()) return e;
            if (auto e = prepare(info.device, kernel, smem, "attention backward"); e.failure()) return e;
            if (blocks > 0)
              kernel<<<unsigned(blocks), 384u, smem, stream>>>(
                  a, q, k, v, dout, lse, delta, dq, kFwdHeadChunk,
                  attn_ws_zig(a, nqt, kFwdHeadChunk, blocks, 128, attn::kWsDqKeys));
            return check_launch("attention backward (wgmma ws dq)");
          };
          // fused dk / dv / dq (attention_fused_bwd.cuh) where the scratch holds its dQ accumulator; its
          // deadlock-freedom argument needs the nkt key blocks of one (batch, kv head) resident at once:
          // *served false (nothing launched) otherwise
          auto run_fused = [&](auto fused, int threads, size_t smem, bool* served) -> ffi::Error {
            *served = false;
            const int64_t D = a.D;
            if (auto e = prepare(info.device, fused, smem, "attention backward"); e.failure()) return e;
            int per_sm = 0;
            if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fused, threads, smem);
                e != cudaSuccess)
              return cuda_error("attention backward", e);
            const int64_t nkt = (a.Sk + attn::kWgBwdKeys - 1) / attn::kWgBwdKeys;
            if (nkt > int64_t(per_sm) * info.sms) return ffi::Error::Success();
            *served = true;
            if (attn_wgmma_required()) {
              char line[96];
              std::snprintf(line, sizeof line, "fused dkdv+dq kernel D=%d BK=%d BQ=%d%s%s%s", int(D),
                            attn::kWgBwdKeys, attn::fused_rows(D), threads == attn::kFusedWsThreads ? " WS" : "",
                            cap ? " CAP" : "", general ? " MASK" : "");
              log_wgmma_kernel(reinterpret_cast<const void*>(fused), true, line);
            }
            const int64_t nqt = (a.Sq + attn::fused_rows(D) - 1) / attn::fused_rows(D);
            // head splits: the model's pick among those the group and the scratch allow
            int64_t max_splits = 1;
            while (max_splits * 2 <= kMaxFusedSplits && a.group % (max_splits * 2) == 0 &&
                   scratch_elems >= attn::fused_bwd_scratch(a.B, a.H, a.Sq, D, a.Hkv, a.Sk, max_splits * 2))
              max_splits *= 2;
            const int64_t splits =
                attn_fused_splits(a, nkt, nqt, attn::fused_rows(D), int64_t(per_sm) * info.sms, max_splits);
            float* dqacc = delta + attn::fused_bwd_delta_pad(a.B * a.H * a.Sq);
            uint32_t* sem = reinterpret_cast<uint32_t*>(dqacc + a.B * a.H * a.Sq * D);
            uint32_t* ticket = sem + a.B * a.H * nqt;  // then the converters' tile counter
            const int64_t nodes = splits > 1 ? attn::fused_split_nodes(a.B, a.Hkv, a.Sk, splits) : 0;
            // (the split tree's counters follow the two counters: one memset)
            if (cudaError_t e =
                    cudaMemsetAsync(sem, 0, size_t(a.B * a.H * nqt + 2 + 2 * nodes) * sizeof(uint32_t), stream);
                e != cudaSuccess)
              return cuda_error("attention backward", e);
            const int64_t base = attn::fused_bwd_scratch(a.B, a.H, a.Sq, D);
            const attn::FusedSplit fs{int(splits), ticket + 2, delta + (base + 2 * nodes + 3) / 4 * 4};
            // kbw key blocks, then converter blocks (dq = scale * dQacc as the tiles' sums complete;
            // tiles no key block visits get dq = 0): as many as fit on the device at once, at most one
            // a tile (the header of attention_fused_bwd.cuh)
            const int64_t kbw = nkt * splits * a.Hkv * a.B, tiles = a.B * a.H * nqt;
            const int64_t blocks = kbw + std::min<int64_t>(tiles, int64_t(per_sm) * info.sms);
            if (auto e = grid_check(blocks, "attention backward"); e.failure()) return e;
            if (blocks > 0) {
              fused<<<unsigned(blocks), threads, smem, stream>>>(a, q, k, v, dout, lse, delta, dk, dv, dqacc, sem, ticket,
                                                                  dq, fs);
              if (auto e = check_launch("attention backward (wgmma fused)"); e.failure()) return e;
            }
            return ffi::Error::Success();
          };
          // the fused kernel of this head dim, in its CAP / MASK form or not: the warp-specialised one
          // (attention_fused_bwd_ws.cuh), except at D 64 with a softcap, where its consumers' 224
          // registers hold the softcap's P^T and P^T (1 - tanh^2) only with spills that serialise every
          // wgmma. (It loads Q and dO with cp.async: TMA copies of them, as the forward's, ran 0.965x
          // without a mask and level causal, perhaps because the SM's TMA unit also carries the dQ
          // partials' bulk adds.)
          auto fused_for = [&](auto cap_tag, auto mask_tag, bool* served) -> ffi::Error {
            constexpr bool CAP = decltype(cap_tag)::value;
            constexpr int MASK = decltype(mask_tag)::value;
            if (a.D == 128)
              return run_fused(attn::wgmma_fused_bwd_ws_kernel<T, 128, CAP, MASK>, attn::kFusedWsThreads,
                               attn::wg_fused_ws_smem<128>(), served);
            if constexpr (!CAP)
              return run_fused(attn::wgmma_fused_bwd_ws_kernel<T, 64, false, MASK>, attn::kFusedWsThreads,
                               attn::wg_fused_ws_smem<64>(), served);
            else
              return run_fused(attn::wgmma_fused_bwd_kernel<T, 64, true, MASK>, attn::kWgBwdThreads,
                               attn::wg_fused_smem<64>(), served);
          };
          if (scratch_elems >= attn::fused_bwd_scratch(a.B, a.H, a.Sq, a.D)) {
            bool served = false;
            const ffi::Error e = with_cap_mask(
                cap, level, [&](auto cap_tag, auto mask_tag) { return fused_for(cap_tag, mask_tag, &served); });
            if (e.failure() || served) return e;
          }
          // segment ids: the fused kernel only (the others take no ids)
          if (a.qseg != nullptr)
            return invalid("attention backward (cuda): segment ids need the fused backward: its scratch (" +
                           std::to_string(attn::fused_bwd_scratch(a.B, a.H, a.Sq, a.D)) +
                           " f32 elements) and a (batch, kv head)'s key blocks resident at once (Sk <= 128 x SMs "
                           "x blocks per SM)");
          // The two-kernel backward for the PLAIN cases the fused kernel did not serve: at D 128 the OVL
          // wgmma dk / dv (dS computed while dV's product runs) and the warp-specialised dq (ptxas sm_90a,
          // bf16 / f16: 168 registers at launch, setmaxnreg 64 / 216, no spill); at D 64 the plain wgmma
          // dk / dv and the mma.sync dq (the warp-specialised dq at D 64 ran 6-9 % slower causal, level
          // without a mask: H100).
          if (!cap && !general) {
            if (a.D == 64) {
              if (auto e = run_dkdv(attn::wgmma_dkdv_kernel<T, 64, false>, 0, attn::wg_dkdv_smem<64>()); e.failure())
                return e;
              auto dqk = attn::mma_dq_kernel<T, 64, false, true, 1>;
              const size_t smem_q = attn::mma_dq_smem<64>();
              if (auto e = prepare(info.device, dqk, smem_q, "attention backward"); e.failure()) return e;
              if (qb > 0) {
                dqk<<<unsigned(qb), attn::kMmaThreads, smem_q, stream>>>(a, q, k, v, dout, lse, delta, bias, dq);
                if (auto e = check_launch("attention backward (dq after wgmma dk dv)"); e.failure()) return e;
              }
              return ffi::Error::Success();
            }
            if (auto e = run_dkdv(attn::wgmma_dkdv_kernel<T, 128, true>, 1, attn::wg_dkdv_smem<128>()); e.failure())
              return e;
            return run_dq_ws(attn::wgmma_dq_ws_kernel<T, 128, 4>, 4, attn::wg_dq_ws_smem<128, 4>());
          }
        } else if (attn_wgmma_required()) {
          return invalid("attention backward (cuda): RLX_ATTENTION_CUDA_WGMMA=1 but the loaded kernel image "
                         "has no wgmma (sm_90a) code for this device");
        }
      }
      auto pick = [&](auto mask_tag, auto plain_tag) -> ffi::Error {
        constexpr bool M = decltype(mask_tag)::value, P = decltype(plain_tag)::value;
        constexpr int kDq64 = M ? (P ? 2 : 0) : 1;
        if (a.D == 64)
          return run(attn::mma_dkdv_kernel<T, 64, M, P, 2>, attn::mma_dkdv_smem<64>(),
                     attn::mma_dq_kernel<T, 64, M, P, kDq64>, attn::mma_dq_smem<64>());
        return run(attn::mma_dkdv_kernel<T, 128, M, P>, attn::mma_dkdv_smem<128>(),
                   attn::mma_dq_kernel<T, 128, M, P, 1>, attn::mma_dq_smem<128>());
      };
      using F = std::false_type;
      using Tr = std::true_type;
      if (km) return plain ? pick(Tr{}, Tr{}) : pick(Tr{}, F{});
      return plain ? pick(F{}, Tr{}) : pick(F{}, F{});
    }
  }
  if (auto e = grid_check(std::max(q_blocks_g, k_blocks_g), "attention backward"); e.failure()) return e;
  const size_t smem = attn::gen_smem_bytes(a.D);
  if (auto e = prepare(info.device, attn::gen_dq_kernel<T>, smem, "attention backward"); e.failure()) return e;
  if (auto e = prepare(info.device, attn::gen_dkdv_kernel<T>, smem, "attention backward"); e.failure()) return e;
  if (k_blocks_g > 0) {
    attn::gen_dkdv_kernel<T><<<unsigned(k_blocks_g), attn::kGenWarps * 32, smem, stream>>>(a, q, k, v, dout, lse,
                                                                                          delta, bias, dk, dv);
    if (auto e = check_launch("attention backward (generic dk dv)"); e.failure()) return e;
  }
  if (q_blocks_g > 0) {
    attn::gen_dq_kernel<T><<<unsigned(q_blocks_g), attn::kGenWarps * 32, smem, stream>>>(a, q, k, v, dout, lse,
                                                                                        delta, bias, dq, dbias);
    if (auto e = check_launch("attention backward (generic dq)"); e.failure()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace rlx
