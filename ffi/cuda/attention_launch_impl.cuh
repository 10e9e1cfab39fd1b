// Definitions of the attention launchers (attention_launch.cuh): the kernel choice per call (the
// tensor-core path, the wgmma switches RLX_ATTENTION_CUDA_*) and the launches. Included only by the
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

// PLAIN forward at D 64 without a key mask: two 16-row m-tiles per warp (128-row blocks), unless
// RLX_ATTENTION_CUDA_FWD_MT=1 (the one-m-tile kernel before, kept for A/B); read once per process.
bool attn_fwd_mt2() {
  static const bool on = !env_starts_with("RLX_ATTENTION_CUDA_FWD_MT", '1');
  return on;
}

// wgmma forward (attention_wgmma.cuh) for the PLAIN cases without a key mask, mask kind none or
// causal (modes 3 and 4 below, the warp-specialised kernel, also with a softcap, a key mask and / or
// a sliding window: its CAP / MASK forms). RLX_ATTENTION_CUDA_WGMMA (read once per process; the A/B and the tests set it):
// 0 = the mma.sync forward; 2 = the 2-warpgroup wgmma forward (2 warpgroups x 128 keys) at both head
// dims (H200, 12 alternating rounds, B4 S4096 H16 bf16 forward: D 128 1.34x / 1.28x the mma.sync forward, none / causal; D 64 0.99x / 0.99x,
// within the noise, so D 64 stays on mma.sync).
// RLX_ATTENTION_CUDA_WGMMA_REQUIRE=1 (tests): a case the wgmma forward serves is an error when
// the loaded image has no wgmma code (instead of the mma.sync fallback).
// 3: at D 128 the warp-specialised kernel (attention_wgmma_ws.cuh: a producer warpgroup, 2 consumer
// warpgroups, mbarrier ring, persistent grid), at D 64 the mma.sync forward.
// 4, unset or another value (the default): the warp-specialised kernel at both head
// dims. B4 S4096 H16 bf16, 6 alternating rounds each, every round won: forward 1.30x / 1.31x the
// 2-warpgroup wgmma kernel at D 128 (none / causal; fwd+bwd 1.05x / 1.06x), 1.07x / 1.15x the
// mma.sync forward at D 64 (fwd+bwd 1.015x / 1.03x).
int attn_wgmma_mode(int64_t d) {
  static const int env = env_starts_with("RLX_ATTENTION_CUDA_WGMMA", '0')   ? 0
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA", '2') ? 2
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA", '3') ? 3
                                                                            : 4;
  if (env == 3) return d == 128 ? 3 : 0;
  return env;
}
// Forward tile order for the causal mask (attn::fwd_tile in attention_mma.cuh): hc heads per chunk,
// query tiles heaviest first across a chunk's heads. Default hc = 1 (one head's tiles after
// another's, heaviest first: the order before). RLX_ATTENTION_CUDA_FWD_HC=<n> (read once per
// process; n >= 1; 0 or unset: 1) chunks of n heads, longest-processing-time-first across them;
// measured (H200, 6 alternating rounds,
// B4 S4096 H16 bf16 forward) with n = ceil(2 SMs / query tiles) = 9: causal D 128 0.972x (0/6
// rounds faster), causal D 64 0.985x (2/6) against n = 1, so it is not the default. Mask kind
// none: always 1 (every tile has the same work).
int attn_fwd_hc(const AttnArgs& a, int64_t nqt, int sms) {
  (void)sms;
  static const long env = [] {
    const char* v = std::getenv("RLX_ATTENTION_CUDA_FWD_HC");
    const long n = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
    return n >= 1 ? n : 1L;
  }();
  if (a.kind == 0 || nqt <= 0) return 1;
  const int64_t nbh = std::max<int64_t>(1, a.B * a.H);
  return int(std::max<int64_t>(1, std::min<int64_t>(env, nbh)));
}
// Grid of the warp-specialised forward (RLX_ATTENTION_CUDA_WS_GRID, read once per process): unset
// (or another value) persistent, min(tiles, SMs) blocks looping over the tiles; 1: one block per
// tile; 2 (tests): min(tiles, 7) blocks, so that every block serves several tiles and the barrier
// ring's phases carry across tiles even in small cases.
int64_t attn_ws_grid(int64_t tiles, int sms) {
  static const int env = env_starts_with("RLX_ATTENTION_CUDA_WS_GRID", '1')   ? 1
                         : env_starts_with("RLX_ATTENTION_CUDA_WS_GRID", '2') ? 2
                                                                              : 0;
  if (env == 1) return tiles;
  return std::min<int64_t>(tiles, env == 2 ? 7 : std::max(sms, 1));
}
// Pass order of the persistent warp-specialised grids (attn::ws_tile: 0 the plain stride, 1
// boustrophedon passes) for `blocks` blocks over the query tiles of bm rows (fwd_tile's order, hc):
// the one whose busiest block has less work by the model "a tile's work = its key tiles of bc keys
// + 1" (the + 1: its Q load and output), the plain stride on a tie and without a mask (every tile
// the same work). O(tiles) host work, once per shape (cached: a launch of a shape seen before
// looks the choice up). RLX_ATTENTION_CUDA_WS_ORDER (read once per process): 0 / 1 force the order
// (tests: both give bitwise the same outputs), otherwise the model decides.
int attn_ws_zig(const AttnArgs& a, int64_t nqt, int64_t hc, int64_t blocks, int64_t bm, int64_t bc) {
  static const int env = env_starts_with("RLX_ATTENTION_CUDA_WS_ORDER", '0')   ? 0
                         : env_starts_with("RLX_ATTENTION_CUDA_WS_ORDER", '1') ? 1
                                                                               : -1;
  if (env >= 0) return env;
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
// Consumer loop of the warp-specialised forward (RLX_ATTENTION_CUDA_WS_PIPE, read once per process):
// unset (or another value): pipelined within each consumer warpgroup (the next key tile's S = Q K^T
// is issued before this tile's O += P V and the softmax runs while that product is in flight;
// attention_wgmma_ws.cuh); 0: each tile's products waited for in turn (the loop before). Both
// compute the same values in the same order: the outputs are bitwise equal (tested).
bool attn_ws_pipe() {
  static const bool on = !env_starts_with("RLX_ATTENTION_CUDA_WS_PIPE", '0');
  return on;
}
// Loads of the warp-specialised forward (RLX_ATTENTION_CUDA_TMA, read once per process): unset (or
// another value) TMA copies issued by one producer thread (tma.cuh; cp.async when the driver gives no
// tensor map for the buffers); 0: the producer warpgroup's cp.async copies. The same tiles in the
// same layout: the outputs are bitwise equal (tested).
bool attn_ws_tma() {
  static const bool on = !env_starts_with("RLX_ATTENTION_CUDA_TMA", '0');
  return on;
}
// Consumer loop of the warp-specialised dq kernel (RLX_ATTENTION_CUDA_WS_DQ_PIPE, read once per
// process): unset (or another value): pipelined within each consumer warpgroup (the next key tile's
// S and dP are issued before this tile's dQ += dS K, and the next dS is formed while that product is
// in flight; attention_wgmma_bwd_ws.cuh); 0: each tile's products waited for in turn. Bitwise equal
// (tested).
bool attn_ws_dq_pipe() {
  static const bool on = !env_starts_with("RLX_ATTENTION_CUDA_WS_DQ_PIPE", '0');
  return on;
}

// wgmma backward kernels (attention_wgmma_bwd.cuh: dk / dv, and dq) for the same PLAIN cases (scale
// > 0, no softcap, bias or key mask, mask kind none or causal).
// RLX_ATTENTION_CUDA_WGMMA_BWD (read once per process; the A/B and the tests set it): 0 = the
// mma.sync dkdv + dq; 4 = at D 128 the wgmma dkdv without the overlap (OVL false: one wait for S^T
// and dP^T, one for dV and dK) + the wgmma dq (wgmma_dq_kernel), at D 64 the default; 5: per head dim the fastest two-kernel pair measured
// (H200): D 128 the OVL dkdv and the wgmma dq, D 64 the plain dkdv and the mma.sync dq. (OVL dkdv or
// plain dkdv with the mma.sync dq at both head dims, and a D 64 wgmma dq, lost to these in every
// round; OVL vs plain at D 128 is undecided, so 4 stays as the alternative.)
// 6 = at D 64 and 128 the fused backward (attention_fused_bwd.cuh: one kernel for dk, dv and dq, dQ
// summed in f32 scratch in a fixed order per query tile) where the scratch result is large enough
// (fused_bwd_scratch) and a (batch, kv head)'s key blocks fit on the device at once; else as 9.
// 9 = at D 128 the OVL dkdv + the warp-specialised dq (attention_wgmma_bwd_ws.cuh: producer
// warpgroup, K / V ring of 4 stages of 64 keys, persistent grid as the forward's, attn_ws_grid) for
// both mask kinds (1.01x / 1.02x mode 5's backward; a ring of 2 stages ran level with mode 5); at
// D 64 as 5.
// 8 = the fused backward for mask kind none only (as 6 where it serves), the two kernels for causal
// (mode 9's at D 128, 5's at D 64).
// 7 = 6 with, at D 128, the warp-specialised fused kernel (attention_fused_bwd_ws.cuh: a producer
// warpgroup loads Q / dO / lse / delta and sends the dQ partials; no block-wide barrier in the loop;
// bitwise 6's results): the backward alone 1.03-1.045x mode 6 without a mask, 1.03-1.065x causal (H100,
// B4 S4096 H16 bf16, 3 alternating rounds).
// Unset or another value (the default) = 7. (The fused kernel of 6 runs the causal backward 1.24-1.26x
// (D 128) and 1.06-1.08x (D 64) the two kernels' since its unmasked tiles skip the per-score mask work
// (bwd_probs / bwd_dscores, attention_wgmma_bwd.cuh); without a mask 1.18-1.20x mode 9's fwd+bwd at
// D 128 and the backward 1.09x the two kernels at D 64; H100, B4 S4096 H16 bf16.)
int attn_wgmma_bwd_mode() {
  static const int env = env_starts_with("RLX_ATTENTION_CUDA_WGMMA_BWD", '0')   ? 0
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA_BWD", '4') ? 4
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA_BWD", '5') ? 5
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA_BWD", '6') ? 6
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA_BWD", '8') ? 8
                         : env_starts_with("RLX_ATTENTION_CUDA_WGMMA_BWD", '9') ? 9
                                                                                : 7;
  return env;
}
bool attn_wgmma_required() {
  static const bool on = env_starts_with("RLX_ATTENTION_CUDA_WGMMA_REQUIRE", '1');
  return on;
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

// With RLX_ATTENTION_CUDA_WGMMA_REQUIRE=1 (tests): one stderr line per wgmma kernel on its first
// launch in the process, so that a test sees which kernels ran: "rlx attention forward: wgmma kernel
// D=.. BC=.. NWG=..", "rlx attention backward: wgmma dkdv kernel D=.. BK=.. NWG=.. OVL=..",
// "rlx attention backward: wgmma dq kernel D=.. BM=.. BC=..".
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
// or without a key mask). The window's code stays out of the key-mask-only kernels: compiled into them
// it raised the fused backward's spills at D 64 from 96 / 88 to 224 / 344 bytes and
// ran the key-masked backward at ~0.75x.
int mask_level(const AttnArgs& a) { return a.kind == 2 ? 2 : a.mask != nullptr ? 1 : 0; }

// f(cap_tag, mask_tag): the runtime softcap flag and mask level (mask_level) as
// std::integral_constant tags, for the kernels' CAP / MASK template values.
template <typename F>
ffi::Error with_cap_mask(bool cap, int level, F&& f) {
  using Tr = std::true_type;
  using Fa = std::false_type;
  auto with_level = [&](auto cap_tag) {
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

template <typename T>
ffi::Error AttentionFwd<T>::launch(cudaStream_t stream, const AttnArgs& a, const T* q, const T* k, const T* v,
                                   const T* bias, T* out, float* lse) {
  DeviceInfo info;
  if (cudaError_t e = device_info(&info); e != cudaSuccess) return cuda_error("attention", e);
  if (use_mma<T>(a, info.device)) {
    if constexpr (!std::is_same<T, float>::value) {
      // wgmma forward: no bias, scale > 0, mask kind none or causal (attention_wgmma.cuh); with a
      // softcap, a key mask or a sliding window the warp-specialised kernel only (its CAP / MASK forms,
      // where the switch selects it: mode 4 at both head dims, 3 at D 128), else the mma.sync forward.
      // general: the MASK form (a key mask and / or a sliding window)
      const int level = mask_level(a);
      const bool cap = a.softcap > 0.f, general = level != 0, ws_mode = attn_wgmma_mode(a.D) >= 3;
      if (bias == nullptr && a.scale > 0.f && attn_wgmma_mode(a.D) != 0 && ((!cap && !general) || ws_mode)) {
        if (wgmma_available(info.device)) {
          auto run_wg = [&](auto kernel, int d, int bc, int nwg, size_t smem) -> ffi::Error {
            const int rows = 64 * nwg;
            const int64_t nqt = (a.Sq + rows - 1) / rows;
            const int64_t blocks = nqt * a.H * a.B;
            if (attn_wgmma_required()) {
              char line[64];
              std::snprintf(line, sizeof line, "kernel D=%d BC=%d NWG=%d", d, bc, nwg);
              log_wgmma_kernel(reinterpret_cast<const void*>(kernel), false, line);
            }
            if (auto e = grid_check(blocks, "attention"); e.failure()) return e;
            if (auto e = prepare(info.device, kernel, smem, "attention"); e.failure()) return e;
            kernel<<<unsigned(blocks), unsigned(2 * rows), smem, stream>>>(a, q, k, v, out, lse,
                                                                            attn_fwd_hc(a, nqt, info.sms));
            return check_launch("attention forward (wgmma)");
          };
          // warp-specialised: 1 producer + 2 consumer warpgroups, 128 query rows per tile, K / V ring
          // of 2 (3 pipelined) stages of 128 keys (attention_wgmma_ws.cuh); mode 4 (default) at both
          // head dims, 3 at D 128 only. ptxas sm_90a (nvcc 13.0, -lineinfo; bf16, f16): 168 registers
          // at launch; the loop that waits for each product no spill, the pipelined one (setmaxnreg
          // 24 / 240) 104 / 116 bytes of spill stores at D 64 / 128, no wgmma serialisation (C7513).
          // maps: the TMA tensor maps of q, k, v (tma.cuh), read by the TMA kernels only
          auto run_ws = [&](auto kernel, int d, int nst, size_t smem, const attn::TileMaps& maps,
                            bool tma) -> ffi::Error {
            constexpr int kBC = 128;
            const int64_t nqt = (a.Sq + 127) / 128, tiles = nqt * a.H * a.B;
            const int64_t blocks = attn_ws_grid(tiles, info.sms);
            static const bool one_per_tile = env_starts_with("RLX_ATTENTION_CUDA_WS_GRID", '1');
            if (attn_wgmma_required()) {
              char line[64];
              std::snprintf(line, sizeof line, "kernel D=%d BC=%d NWG=3 WS NST=%d %s%s%s%s%s", d, kBC, nst,
                            one_per_tile ? "tiles" : "persistent", attn_ws_pipe() ? " PIPE" : "", tma ? " TMA" : "",
                            cap ? " CAP" : "", general ? " MASK" : "");
              log_wgmma_kernel(reinterpret_cast<const void*>(kernel), false, line);
            }
            if (auto e = grid_check(blocks, "attention"); e.failure()) return e;
            if (auto e = prepare(info.device, kernel, smem, "attention"); e.failure()) return e;
            const int hc = attn_fwd_hc(a, nqt, info.sms);
            if (blocks > 0)
              kernel<<<unsigned(blocks), 384u, smem, stream>>>(a, q, k, v, out, lse, hc,
                                                                attn_ws_zig(a, nqt, hc, blocks, 128, kBC), maps);
            return check_launch("attention forward (wgmma ws)");
          };
          // The pipelined consumer loop releases a ring stage one step later (after the next tile's
          // S = Q K^T has been issued), so it takes 3 stages: the producer then still has a whole
          // step to load each K / V tile (230,488 bytes of shared memory at D 128: fits the 227 KB).
          auto run_ws_d = [&](auto dim, auto cap_tag, auto mask_tag) -> ffi::Error {
            constexpr int D = decltype(dim)::value;
            constexpr bool CAP = decltype(cap_tag)::value;
            constexpr int MASK = decltype(mask_tag)::value;
            // TMA (the pipelined loop only): maps of q [B, Sq, H, D] and k, v [B, Sk, Hkv, D], boxes of
            // the 128 rows of a query tile / key tile (without keys, Sk 0, no key tile is loaded: k's
            // and v's maps are q's); any map the driver refuses: cp.async
            attn::TileMaps maps{};
            constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
            const bool tma = attn_ws_pipe() && attn_ws_tma() && a.B > 0 && a.Sq > 0 &&
                             attn::encode_rows_map(&maps.q, q, kBf16, a.B, a.Sq, a.H, D, 128) &&
                             (a.Sk == 0 ? (maps.k = maps.v = maps.q, true)
                                        : attn::encode_rows_map(&maps.k, k, kBf16, a.B, a.Sk, a.Hkv, D, 128) &&
                                              attn::encode_rows_map(&maps.v, v, kBf16, a.B, a.Sk, a.Hkv, D, 128));
            if (!attn_ws_pipe())
              return run_ws(attn::wgmma_fwd_ws_kernel<T, D, 128, 2, false, false, CAP, MASK>, D, 2,
                            attn::wg_ws_smem<D, 128, 2>(), maps, false);
            if (tma)
              return run_ws(attn::wgmma_fwd_ws_kernel<T, D, 128, 3, true, true, CAP, MASK>, D, 3,
                            attn::wg_ws_smem<D, 128, 3>(), maps, true);
            return run_ws(attn::wgmma_fwd_ws_kernel<T, D, 128, 3, true, false, CAP, MASK>, D, 3,
                          attn::wg_ws_smem<D, 128, 3>(), maps, false);
          };
          // (attn_wgmma_mode is 4 at D 64 here whenever it is >= 3: mode 3 reads 0 at D 64)
          if (ws_mode)
            return with_cap_mask(cap, level, [&](auto cap_tag, auto mask_tag) {
              if (a.D == 64) return run_ws_d(std::integral_constant<int, 64>{}, cap_tag, mask_tag);
              return run_ws_d(std::integral_constant<int, 128>{}, cap_tag, mask_tag);
            });
          // <T, D, BC (keys per tile), NWG (warpgroups of 64 rows)>; ptxas sm_90a (bf16, f16):
          // <64, 128, 2> 221 registers, no spill; <128, 128, 2> 255 registers, 40 B of spills
          // (-lineinfo). 1 block of 8 warps per SM (registers).
          if (a.D == 64) return run_wg(attn::wgmma_fwd_kernel<T, 64, 128, 2>, 64, 128, 2, attn::wg_fwd_smem<64, 128, 2>());
          return run_wg(attn::wgmma_fwd_kernel<T, 128, 128, 2>, 128, 128, 2, attn::wg_fwd_smem<128, 128, 2>());
        }
        if (attn_wgmma_required())
          return invalid("attention (cuda): RLX_ATTENTION_CUDA_WGMMA_REQUIRE=1 but the loaded kernel image has no "
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
        kernel<<<unsigned(blocks), attn::kMmaThreads, smem, stream>>>(a, q, k, v, bias, out, lse,
                                                                       attn_fwd_hc(a, (a.Sq + rows - 1) / rows, info.sms));
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
        // PLAIN: two m-tiles per warp (MT 2, attn_fwd_mt2): 128 rows per block, each K / V
        // fragment read from shared memory feeds two mma; K / V double buffered (48 KB of shared
        // memory with the swizzled tiles, 55 KB padded), no register cap: ptxas sm_90 248
        // registers (250 padded), no spill, 2 blocks per SM (8 warps, 256 rows) against 3 blocks
        // of 64 rows (161 registers) for MT 1. Measured on the H200:
        // shared wavefronts per
        // forward -46 %, ncu kernel time -10 % (B1 S4096 H16), B4 fwd 1-2 % faster by the median
        // of 10 alternating rounds. Not taken: MT 2 for the general kernel (softcap 3 % slower:
        // 254 registers) and MT 2 capped at 168 registers for 3 blocks (128 B of spills; slower).
        if (plain && attn_fwd_mt2()) return run(attn::mma_fwd_kernel<T, 64, 2, 64, false, 2, false, true>, 2, 64, 2);
        return plain ? run(attn::mma_fwd_kernel<T, 64, 1, 64, false, 3, false, true>, 1, 64, 2)
                     : run(attn::mma_fwd_kernel<T, 64, 1, 64, false, 3, false, false>, 1, 64, 2);
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
      // wgmma dk / dv (attention_wgmma_bwd.cuh) for the PLAIN cases without a key mask, mask kind
      // none or causal; dq on the wgmma kernel or on the PLAIN mma.sync one (MASK false, the AR of
      // pick below), per RLX_ATTENTION_CUDA_WGMMA_BWD. With a softcap, a key mask or a sliding window
      // (and no bias) the fused kernels only (their CAP / MASK forms), where the switch selects them;
      // else the mma.sync kernels. general: the MASK form (a key mask and / or a sliding window).
      const int wg_bwd = attn_wgmma_bwd_mode();
      const int level = mask_level(a);
      const bool cap = a.softcap > 0.f, general = level != 0;
      const bool fused_mode = wg_bwd == 6 || wg_bwd == 7 || (wg_bwd == 8 && a.kind == 0);
      if (bias == nullptr && ((!general && !cap) || fused_mode) && a.scale > 0.f && wg_bwd != 0 &&
          a.Sq < (int64_t(1) << 30) && a.Sk < (int64_t(1) << 30)) {
        if (wgmma_available(info.device)) {
          // dk / dv kernel (its OVL flag for the log), then dq: the wgmma kernel (wg_dq) or mma.sync
          // (with_dq false: dk / dv only, the caller launches its dq kernel)
          auto run_wg = [&](auto dkdv, int ovl, size_t smem_kv, auto dqk, bool wg_dq, size_t smem_q,
                            bool with_dq = true) -> ffi::Error {
            const int64_t kbw = (a.Sk + attn::kWgBwdKeys - 1) / attn::kWgBwdKeys * a.Hkv * a.B;
            const int64_t qbw = wg_dq ? (a.Sq + attn::kWgDqRows - 1) / attn::kWgDqRows * a.H * a.B : qb;
            if (attn_wgmma_required()) {
              char line[96];
              std::snprintf(line, sizeof line, "dkdv kernel D=%d BK=%d NWG=2 OVL=%d", int(a.D), attn::kWgBwdKeys, ovl);
              log_wgmma_kernel(reinterpret_cast<const void*>(dkdv), true, line);
              if (wg_dq && with_dq) {
                std::snprintf(line, sizeof line, "dq kernel D=%d BM=%d BC=%d", int(a.D), attn::kWgDqRows,
                              attn::kWgDqKeys);
                log_wgmma_kernel(reinterpret_cast<const void*>(dqk), true, line);
              }
            }
            if (auto e = prepare(info.device, dkdv, smem_kv, "attention backward"); e.failure()) return e;
            if (with_dq)
              if (auto e = prepare(info.device, dqk, smem_q, "attention backward"); e.failure()) return e;
            if (kbw > 0) {
              dkdv<<<unsigned(kbw), attn::kWgBwdThreads, smem_kv, stream>>>(a, q, k, v, dout, lse, delta, dk, dv);
              if (auto e = check_launch("attention backward (wgmma dk dv)"); e.failure()) return e;
            }
            if (with_dq && qbw > 0) {
              if constexpr (std::is_invocable_v<decltype(dqk), AttnArgs, const T*, const T*, const T*, const T*,
                                                const float*, const float*, T*>) {
                dqk<<<unsigned(qbw), attn::kWgBwdThreads, smem_q, stream>>>(a, q, k, v, dout, lse, delta, dq);
              } else {
                dqk<<<unsigned(qbw), attn::kMmaThreads, smem_q, stream>>>(a, q, k, v, dout, lse, delta, bias, dq);
              }
              if (auto e = check_launch("attention backward (dq after wgmma dk dv)"); e.failure()) return e;
            }
            return ffi::Error::Success();
          };
          // the warp-specialised dq (attention_wgmma_bwd_ws.cuh), after a dk / dv kernel launched by
          // run_wg without its dq (qb of the mma path is not used there)
          auto run_dq_ws = [&](auto kernel, int nst, size_t smem) -> ffi::Error {
            const int64_t nqt = (a.Sq + 127) / 128, tiles = nqt * a.H * a.B;
            const int64_t blocks = attn_ws_grid(tiles, info.sms);
            static const bool one_per_tile = env_starts_with("RLX_ATTENTION_CUDA_WS_GRID", '1');
            if (attn_wgmma_required()) {
              char line[96];
              std::snprintf(line, sizeof line, "dq kernel D=%d BM=128 BC=%d WS NST=%d %s%s", int(a.D),
                            attn::kWsDqKeys, nst, one_per_tile ? "tiles" : "persistent",
                            attn_ws_dq_pipe() ? " PIPE" : "");
              log_wgmma_kernel(reinterpret_cast<const void*>(kernel), true, line);
            }
            if (auto e = grid_check(blocks, "attention backward"); e.failure()) return e;
            if (auto e = prepare(info.device, kernel, smem, "attention backward"); e.failure()) return e;
            const int hc = attn_fwd_hc(a, nqt, info.sms);
            if (blocks > 0)
              kernel<<<unsigned(blocks), 384u, smem, stream>>>(a, q, k, v, dout, lse, delta, dq, hc,
                                                                attn_ws_zig(a, nqt, hc, blocks, 128, attn::kWsDqKeys));
            return check_launch("attention backward (wgmma ws dq)");
          };
          // Modes at D 128: 4 plain dkdv + wgmma dq; 5 OVL
          // dkdv + wgmma dq; 7 (default) the warp-specialised fused kernel, 6 the fused kernel, else as 9;
          // 9 OVL dkdv + the warp-specialised dq (pipelined unless RLX_ATTENTION_CUDA_WS_DQ_PIPE=0); 8
          // the fused kernel for mask none, else as 9. D 64: 6 and 7 (default) the fused kernel, 8 the
          // fused kernel for mask none; otherwise plain dkdv + mma.sync dq
          // (the warp-specialised dq at D 64 ran 6-9 % slower causal, level without a mask: H100).
          // fused dk / dv / dq (attention_fused_bwd.cuh) where the switch asks for it and the scratch
          // holds its dQ accumulator; its deadlock-freedom argument needs the nkt key blocks of one
          // (batch, kv head) resident at once: *served false (nothing launched) otherwise
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
            float* dqacc = delta + attn::fused_bwd_delta_pad(a.B * a.H * a.Sq);
            uint32_t* sem = reinterpret_cast<uint32_t*>(dqacc + a.B * a.H * a.Sq * D);
            uint32_t* ticket = sem + a.B * a.H * nqt;  // then the converters' tile counter
            if (cudaError_t e = cudaMemsetAsync(sem, 0, size_t(a.B * a.H * nqt + 2) * sizeof(uint32_t), stream);
                e != cudaSuccess)
              return cuda_error("attention backward", e);
            // kbw key blocks, then converter blocks (dq = scale * dQacc as the tiles' sums complete;
            // tiles no key block visits get dq = 0): as many as fit on the device at once, at most one
            // a tile (the header of attention_fused_bwd.cuh)
            const int64_t kbw = nkt * a.Hkv * a.B, tiles = a.B * a.H * nqt;
            const int64_t blocks = kbw + std::min<int64_t>(tiles, int64_t(per_sm) * info.sms);
            if (auto e = grid_check(blocks, "attention backward"); e.failure()) return e;
            if (blocks > 0) {
              fused<<<unsigned(blocks), threads, smem, stream>>>(a, q, k, v, dout, lse, delta, dk, dv, dqacc, sem, ticket,
                                                                  dq);
              if (auto e = check_launch("attention backward (wgmma fused)"); e.failure()) return e;
            }
            return ffi::Error::Success();
          };
          // the fused kernel of this head dim and mode, in its CAP / MASK form or not
          auto fused_for = [&](auto cap_tag, auto mask_tag, bool* served) -> ffi::Error {
            constexpr bool CAP = decltype(cap_tag)::value;
            constexpr int MASK = decltype(mask_tag)::value;
            // (the WS kernel loads Q and dO with cp.async: TMA copies of them, as the forward's, ran
            // 0.965x without a mask and level causal, perhaps because the SM's TMA unit also carries
            // the dQ partials' bulk adds)
            // (at D 64 the warp-specialised kernel without a softcap only: its consumers' 224 registers
            // hold the softcap's P^T and P^T (1 - tanh^2) only with spills that serialise every wgmma)
            if (wg_bwd == 7) {
              if constexpr (!CAP) {
                if (a.D == 64)
                  return run_fused(attn::wgmma_fused_bwd_ws_kernel<T, 64, false, MASK>, attn::kFusedWsThreads,
                                   attn::wg_fused_ws_smem<64>(), served);
              }
              if (a.D == 128)
                return run_fused(attn::wgmma_fused_bwd_ws_kernel<T, 128, CAP, MASK>, attn::kFusedWsThreads,
                                 attn::wg_fused_ws_smem<128>(), served);
            }
            if (a.D == 64)
              return run_fused(attn::wgmma_fused_bwd_kernel<T, 64, CAP, MASK>, attn::kWgBwdThreads,
                               attn::wg_fused_smem<64>(), served);
            return run_fused(attn::wgmma_fused_bwd_kernel<T, 128, CAP, MASK>, attn::kWgBwdThreads,
                             attn::wg_fused_smem<128>(), served);
          };
          if (fused_mode && scratch_elems >= attn::fused_bwd_scratch(a.B, a.H, a.Sq, a.D)) {
            bool served = false;
            const ffi::Error e = with_cap_mask(
                cap, level, [&](auto cap_tag, auto mask_tag) { return fused_for(cap_tag, mask_tag, &served); });
            if (e.failure() || served) return e;
          }
          // without a softcap, key mask or window the two-kernel wgmma backward; a case with one that
          // the fused kernel did not serve (scratch too small, or more key blocks than fit on the
          // device at once) falls through to the mma.sync kernels below
          if (!cap && !general) {
            if (a.D == 64)
              return run_wg(attn::wgmma_dkdv_kernel<T, 64, false>, 0, attn::wg_dkdv_smem<64>(),
                            attn::mma_dq_kernel<T, 64, false, true, 1>, false, attn::mma_dq_smem<64>());
            if (wg_bwd == 6 || wg_bwd == 7 || wg_bwd == 8 || wg_bwd == 9) {
              // OVL dk / dv (run_wg with no dq launch: qb of the mma path is not used there), then the
              // warp-specialised dq
              if (auto e = run_wg(attn::wgmma_dkdv_kernel<T, 128, true>, 1, attn::wg_dkdv_smem<128>(),
                                  attn::wgmma_dq_kernel<T, 128>, true, attn::wg_dq_smem<128>(), false);
                  e.failure())
                return e;
              // ptxas sm_90a (bf16, f16): 168 registers at launch (setmaxnreg 64 / 216), no spill
              return attn_ws_dq_pipe()
                         ? run_dq_ws(attn::wgmma_dq_ws_kernel<T, 128, 4, true>, 4, attn::wg_dq_ws_smem<128, 4>())
                         : run_dq_ws(attn::wgmma_dq_ws_kernel<T, 128, 4, false>, 4, attn::wg_dq_ws_smem<128, 4>());
            }
            if (wg_bwd == 4)
              return run_wg(attn::wgmma_dkdv_kernel<T, 128, false>, 0, attn::wg_dkdv_smem<128>(),
                            attn::wgmma_dq_kernel<T, 128>, true, attn::wg_dq_smem<128>());
            return run_wg(attn::wgmma_dkdv_kernel<T, 128, true>, 1, attn::wg_dkdv_smem<128>(),
                          attn::wgmma_dq_kernel<T, 128>, true, attn::wg_dq_smem<128>());
          }
        } else if (attn_wgmma_required()) {
          return invalid("attention backward (cuda): RLX_ATTENTION_CUDA_WGMMA_REQUIRE=1 but the loaded kernel image "
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
