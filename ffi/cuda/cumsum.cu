// XLA FFI handlers for the cumulative sum on CUDA: targets rlx_cumsum_fwd and
// rlx_cumsum_bwd, with the operands, attribute and semantics of the CPU handlers
// (ffi/cpu/cumsum.cc) plus one scratch result:
//
//   x [O, L, I] -> y [O, L, I] (x's dtype), scratch [S] (f32; f64 for f64 inputs)
//   forward  (rlx_cumsum_fwd): y[o, l, i] = sum_{k <= l} x[o, k, i]  (k < l if exclusive)
//   backward (rlx_cumsum_bwd): y[o, l, i] = sum_{k >= l} x[o, k, i]  (k > l if exclusive)
// S >= cumsum_scratch_size(O, L, I) below; rlx_jax/vjp_rules/cumsum.py sizes it with the
// same formula (cuda_scratch_size). Sums run in f32 (f64 for f64). The scratch holds the
// chunk totals of the chunked passes, or the chained scans' 64-bit carry slots and ticket
// counter (zeroed on XLA's stream before each chained launch).
//
// Work layout. Scan positions k run in scan order (k = l forward, k = L - 1 - l reverse).
// - I == 1 (scan along contiguous rows): a group of tpr threads (4..256, a power of two)
//   scans one row, or one chunk of a row, in sub-tiles of tpr * VEC elements (each
//   thread VEC consecutive elements as one 16-byte access where aligned), NV sub-tiles
//   loaded before they are scanned; a group scan (warp shuffles, then the group's warp
//   totals in a fixed order) gives each thread its prefix; the running carry crosses
//   sub-tiles.
//   row_scan_k keeps the sub-tiles as packs of T and scans a trip's NV = 4 sub-tiles with
//   one barrier.
//   Long rows with few of them (where the chunked passes below would run), 16-byte vectors,
//   f32 / bf16 / f16: one pass of chain_scan_k instead (64 KB tiles in ticket order, each
//   waiting for its predecessor's inclusive prefix: a strict chain, x read once).
// - I > 1 (scan across rows of I contiguous values): one thread per (o, VEC columns),
//   walking its positions sequentially with 8 loads in flight.
//   Where the chunked passes below would run: with 16-byte vectors, f32 / bf16 / f16 and
//   at least 32 strips of 256 bytes, one pass of col_chain_k (tiles of 256 scan positions x
//   one strip, chained like chain_scan_k); else f32 with at least one strip of 16 columns a
//   multiprocessor: one pass of col_strip_k (x read once).
// A long scan axis with few rows / columns splits into C chunks (C from the shape
// alone, cumsum_chunks): pass 1 writes each chunk's total to scratch, pass 2 turns the
// totals of each (o, i) into exclusive prefixes (one warp per (o, i), fixed order),
// pass 3 rescans each chunk from its prefix. Every sum is taken in an order fixed by
// the shape: results are bitwise reproducible run to run (no float atomics; the chained
// scans' one integer atomic hands out tickets, which decide no sum's order). Nothing is
// allocated; all launches go to XLA's stream.

#include <utility>

#include "cuda/common.cuh"
#include "cumsum_checks.h"

namespace rlx {
namespace cuda {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- the chunking (keep in sync with rlx_jax/vjp_rules/cumsum.py) ---------------------
constexpr int64_t kRowChunkAlign = 4096;  // row chunks: a multiple of every sub-tile group
constexpr int64_t kColTarget = int64_t(1) << 18;

struct Chunks { int64_t n; int64_t len; };
Chunks cumsum_chunks(int64_t o, int64_t l, int64_t i) {
  if (o == 0 || l == 0 || i == 0) return {1, l};
  int64_t n = 1;
  if (i == 1) {
    if (o < 256 && l >= 16384) n = std::min(ceil_div(512, o), ceil_div(l, 8192));
  } else {
    if (o * i < kColTarget && l >= 128) n = std::min({ceil_div(kColTarget, o * i), ceil_div(l, 64), int64_t(1024)});
  }
  if (n <= 1) return {1, l};
  int64_t len = ceil_div(l, n);
  if (i == 1) len = ceil_div(len, kRowChunkAlign) * kRowChunkAlign;
  return {ceil_div(l, len), len};
}
// Columns (I > 1) take the chained column scan (col_chain_k) where strips of 256 bytes fit
// and there are at least kColChainMinStrips of them (with fewer, its chains are too few and
// too long); they need 16-byte aligned buffers too, which only the handler knows.
// (one definition for the host checks and the kernel: col_chain_k's tiles are kColChainRows
// scan positions tall)
constexpr int kColChainRows = 256;
constexpr int kColChainMinStrips = 32;
bool col_chain_fits(int64_t o, int64_t i, int64_t elem_bytes) {
  const int64_t cw = 256 / elem_bytes;
  return elem_bytes <= 4 && i % cw == 0 && o * (i / cw) >= kColChainMinStrips;
}
// Tiles of a row in the chained scan (chain_scan_k: kChainTileBytes / elem_bytes elements).
constexpr int kChainTileBytes = 65536;
int64_t chain_tiles(int64_t l, int64_t elem_bytes) { return ceil_div(l, kChainTileBytes / elem_bytes); }
// The formula of the Python side: O * I * C where C > 1, else 1; rows (I == 1) of f32 /
// bf16 / f16 that are chunked also hold the chained scan's slots and counter
// (2 * O * tiles + 1 four-byte words), whichever is more.
int64_t cumsum_scratch_size(int64_t o, int64_t l, int64_t i, int64_t elem_bytes) {
  const Chunks c = cumsum_chunks(o, l, i);
  if (c.n <= 1) return 1;
  if (i == 1 && elem_bytes <= 4) return std::max(o * c.n, 2 * o * chain_tiles(l, elem_bytes) + 1);
  if (col_chain_fits(o, i, elem_bytes)) return std::max(o * i * c.n, 2 * o * i * ceil_div(l, kColChainRows) + 1);
  return o * i * c.n;
}

enum Mode { kFull = 0, kSums = 1, kCarry = 2 };

// One step of a running scan: the value stored at this position (the running sum before
// val when exclusive, after it when inclusive) in T, with run advanced by val.
template <typename T, typename A>
__device__ __forceinline__ T scan_step(A& run, A val, bool exclusive) {
  if (exclusive) {
    const T out = from_acc<T>(run);
    run += val;
    return out;
  }
  run += val;
  return from_acc<T>(run);
}

// N exclusive scans at once over aligned groups of tpr threads (a power of two, 4..256):
// excl[n] gets the thread's exclusive prefix of s[n] in its group, total[n] the group's sum
// (the same bits in every thread of the group). Warp shuffles, then, with tpr > 32, the
// group's warp totals through red[parity][N][8 warps] added in warp order, with one barrier
// for all N; alternating parity between calls makes one barrier per call enough. Every
// thread of the block must call.
template <typename A, int N>
__device__ __forceinline__ void group_scan_n(const A (&s)[N], int tpr, A* red, int parity, A (&excl)[N],
                                             A (&total)[N]) {
  const int lane = threadIdx.x & 31;
  const int w = tpr < 32 ? tpr : 32;
  const int sl = lane & (w - 1);
  A v[N];
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = s[n];
  for (int d = 1; d < w; d <<= 1) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const A u = __shfl_up_sync(0xffffffffu, v[n], d, w);
      if (sl >= d) v[n] += u;
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n) {
    A ex = __shfl_up_sync(0xffffffffu, v[n], 1, w);
    if (sl == 0) ex = A(0);
    excl[n] = ex;
    total[n] = __shfl_sync(0xffffffffu, v[n], w - 1, w);
  }
  if (tpr > 32) {
    const int warp = threadIdx.x >> 5, wpg = tpr >> 5, first = (warp / wpg) * wpg;
    A* slot = red + parity * N * 8;
    if (lane == 31) {
#pragma unroll
      for (int n = 0; n < N; ++n) slot[n * 8 + warp] = total[n];
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < N; ++n) {
      A pre = A(0), tot = A(0);
      for (int k = first; k < first + wpg; ++k) {
        if (k == warp) pre = tot;
        tot += slot[n * 8 + k];
      }
      excl[n] += pre;
      total[n] = tot;
    }
  }
}

// I == 1. One unit = (row, chunk); a group of tpr threads per unit, 256 / tpr groups a
// block. trips: sub-tile groups per unit (the same for every group of a block: with
// several groups a block, there is one chunk per row of length L). The trip's NV sub-tiles
// are kept as packs of T (16-bit data takes half the registers of f32 copies) and scanned
// by one group_scan_n (one barrier a trip: faster than one barrier a sub-tile with f32 copies
// in an H200 A/B).
// The scan direction is a template parameter (REV; the last argument is ignored). Capped at
// 64 registers (4 blocks of 256 threads an SM). 16-bit packs (VEC >= 2) pass through an empty
// asm after the group scan, so that the f32 values taken for the sums die there and the
// output step converts again from the packs: without it the compiler kept the 8 * NV f32
// copies live across the scan and needed 80 registers (3 blocks an SM; bf16 exclusive rows
// 1.84x the copy floor that way, 1.16x with the empty asm). 16-bit scalar
// rows (VEC 1) keep the bound of 3 blocks they were tested with (at most 63 registers).
template <typename T, int VEC, int NV, int MODE, bool REV>
__global__ void __launch_bounds__(256, sizeof(T) == 2 && VEC == 1 ? 3 : 4) row_scan_k(const T* __restrict__ x, T* __restrict__ y,
                                                      acc_t<T>* __restrict__ scr, int64_t units, int64_t L,
                                                      int64_t nchunk, int64_t chunk_len, int tpr, bool exclusive,
                                                      bool) {
  constexpr bool reverse = REV;
  using A = acc_t<T>;
  using P = Pack<T, VEC>;
  __shared__ A red[16 * NV];
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr, t = threadIdx.x - g * tpr;
  const int64_t unit = int64_t(blockIdx.x) * gpb + g;
  const bool live = unit < units;
  // no 64-bit division where a row is one unit (a thread of a 4096-wide f32 row scans 16
  // elements: three int64 divisions a thread made the kernel issue-bound); chunked rows
  // have one group a block (the launcher's tpr is 256 then), so the block's trip count is
  // its own unit's
  int64_t row = 0, c = 0;
  if (live) {
    if (nchunk == 1) {
      row = unit;
    } else {
      row = unit / nchunk;
      c = unit - row * nchunk;
    }
  }
  const int64_t k0 = c * chunk_len;
  const int64_t k1 = live ? std::min(L, k0 + chunk_len) : k0;
  const int64_t span = nchunk == 1 ? L : std::min(L, k0 + chunk_len) - k0;
  const int64_t sub = int64_t(tpr) * VEC;
  const int sh = __ffs(tpr * VEC * NV) - 1;  // tpr, VEC and NV are powers of two
  const int64_t trips = (span + (int64_t(1) << sh) - 1) >> sh;
  const T* xr = x + row * L;
  T* yr = y + row * L;
  A carry = (MODE == kCarry && live) ? scr[unit] : A(0);
  int parity = 0;
  for (int64_t tr = 0; tr < trips; ++tr) {
    P e[NV];  // physical order; logical element q of sub-tile j is e[j].v[reverse ? VEC - 1 - q : q]
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t ks = k0 + (tr * NV + j) * sub + int64_t(t) * VEC;
      if (ks + VEC <= k1) {
        const int64_t p = reverse ? L - ks - VEC : ks;
        e[j] = ld_pack<T, VEC, (MODE != kSums) ? Cache::kStream : Cache::kL2>(xr + p);
      } else {
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          const int64_t k = ks + q;
          const T z = from_acc<T>(A(0));
          const T val = k < k1 ? xr[reverse ? L - 1 - k : k] : z;
          if (reverse) {
            e[j].v[VEC - 1 - q] = val;
          } else {
            e[j].v[q] = val;
          }
        }
      }
    }
    A s_n[NV], ex_n[NV], tot_n[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      A s = A(0);
#pragma unroll
      for (int q = 0; q < VEC; ++q) s += to_acc(reverse ? e[j].v[VEC - 1 - q] : e[j].v[q]);
      s_n[j] = s;
    }
    group_scan_n<A, NV>(s_n, tpr, red, parity, ex_n, tot_n);
    parity ^= 1;
    if constexpr (sizeof(T) == 2 && VEC >= 2) {
      // the packed words pass through an empty asm: the f32 values taken for the sums are
      // dead here, and the output step converts again from the packs
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        uint32_t* wd = reinterpret_cast<uint32_t*>(&e[j]);
#pragma unroll
        for (int h = 0; h < VEC / 2; ++h) asm volatile("" : "+r"(wd[h]));
      }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (MODE != kSums) {
        const int64_t ks = k0 + (tr * NV + j) * sub + int64_t(t) * VEC;
        A run = carry + ex_n[j];
        P o;  // logical order
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          const A val = to_acc(reverse ? e[j].v[VEC - 1 - q] : e[j].v[q]);
          o.v[q] = scan_step<T>(run, val, exclusive);
        }
        if (ks + VEC <= k1) {
          const int64_t p = reverse ? L - ks - VEC : ks;
          P w;
#pragma unroll
          for (int q = 0; q < VEC; ++q) w.v[q] = reverse ? o.v[VEC - 1 - q] : o.v[q];
          st_pack_stream<T, VEC>(yr + p, w);
        } else {
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
            const int64_t k = ks + q;
            if (k < k1) yr[reverse ? L - 1 - k : k] = o.v[q];
          }
        }
      }
      carry += tot_n[j];
    }
  }
  if (MODE == kSums && live && t == 0) scr[unit] = carry;
}

// I > 1. One thread per (o, chunk, VEC columns).
template <typename T, int VEC, int MODE, int U>
__global__ void __launch_bounds__(256) col_scan_k(const T* __restrict__ x, T* __restrict__ y,
                                                  acc_t<T>* __restrict__ scr, int64_t O, int64_t L,
                                                  int64_t I, int64_t nchunk, int64_t chunk_len, bool exclusive,
                                                  bool reverse) {
  using A = acc_t<T>;
  const int64_t iv_n = I / VEC;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid >= O * nchunk * iv_n) return;
  const int64_t iv = tid % iv_n, r = tid / iv_n;
  const int64_t c = r % nchunk, o = r / nchunk;
  const int64_t i = iv * VEC;
  A acc[VEC];
#pragma unroll
  for (int q = 0; q < VEC; ++q) acc[q] = MODE == kCarry ? scr[(o * nchunk + c) * I + i + q] : A(0);
  const int64_t k0 = c * chunk_len, k1 = std::min(L, k0 + chunk_len);
  const T* xb = x + o * L * I + i;
  T* yb = y + o * L * I + i;
  for (int64_t k = k0; k < k1; k += U) {
    Pack<T, VEC> e[U] = {};
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t kk = k + u;
      if (kk < k1) e[u] = ld_pack<T, VEC, (MODE != kSums) ? Cache::kStream : Cache::kL2>(xb + (reverse ? L - 1 - kk : kk) * I);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t kk = k + u;
      if (kk < k1) {
        if (MODE == kSums) {
#pragma unroll
          for (int q = 0; q < VEC; ++q) acc[q] += to_acc(e[u].v[q]);
        } else {
          Pack<T, VEC> w;
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
            const A val = to_acc(e[u].v[q]);
            w.v[q] = scan_step<T>(acc[q], val, exclusive);
          }
          st_pack_stream<T, VEC>(yb + (reverse ? L - 1 - kk : kk) * I, w);
        }
      }
    }
  }
  if (MODE == kSums) {
#pragma unroll
    for (int q = 0; q < VEC; ++q) scr[(o * nchunk + c) * I + i + q] = acc[q];
  }
}

// I > 1, single pass (the default where the chunked passes would run and there are enough
// strips: see launch_cols). A block of 256 threads owns a strip of CV = 4 vectors (4 * VEC
// columns, 64 bytes a row) of one o and walks the whole scan axis in tiles of 32 * J
// positions... precisely: thread (rg = tid / CV, cg = tid % CV) holds the J consecutive
// scan positions rg * J + j of a tile (TILE = 64 * J) for its vector of columns, as packs
// of T; the next tile's packs are loaded before the current one is scanned (J * 16 bytes
// a thread in flight all the time). Per tile: each thread sums its J values per column; an
// exclusive scan of those sums over the 8 row groups of a warp (shuffles), the 8 warp
// totals through shared memory (one barrier a tile, two parity slots); a thread's start
// is carry + the earlier warps' totals (in warp order) + its exclusive sum, then it runs
// through its J values and stores; the carry adds the tile's 8 warp totals in warp order.
// Every sum has an order fixed by the shape: bitwise reproducible. Reads x once and writes
// y once (the chunked path reads x twice: its first pass's totals, then the rescan).
constexpr int kStripCV = 4;
template <typename T, int VEC, int J, bool REV>
__global__ void __launch_bounds__(256) col_strip_k(const T* __restrict__ x, T* __restrict__ y, int64_t L,
                                                   int64_t I, int64_t strips_per_o, bool exclusive) {
  using A = acc_t<T>;
  using P = Pack<T, VEC>;
  constexpr int CV = kStripCV, RGW = 32 / CV, WARPS = 8, TILE = (256 / CV) * J;
  __shared__ A wsum[2][WARPS][CV][VEC];
  const int cg = threadIdx.x % CV, rg = threadIdx.x / CV;
  const int rgw = (threadIdx.x & 31) / CV, warp = threadIdx.x >> 5;
  const int64_t o = blockIdx.x / strips_per_o, strip = blockIdx.x - o * strips_per_o;
  const int64_t col = (strip * CV + cg) * VEC;
  const T* xb = x + o * L * I + col;
  T* yb = y + o * L * I + col;
  const int64_t ntiles = (L + TILE - 1) / TILE;
  auto load = [&](P (&e)[J], int64_t tile) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int64_t k = tile * TILE + int64_t(rg) * J + j;
      if (k < L) {
        e[j] = ld_pack<T, VEC, Cache::kStream>(xb + (REV ? L - 1 - k : k) * I);
      } else {
#pragma unroll
        for (int q = 0; q < VEC; ++q) e[j].v[q] = from_acc<T>(A(0));
      }
    }
  };
  A carry[VEC];
#pragma unroll
  for (int q = 0; q < VEC; ++q) carry[q] = A(0);
  P cur[J], nxt[J];
  load(cur, 0);
  int parity = 0;
  for (int64_t tl = 0; tl < ntiles; ++tl) {
    if (tl + 1 < ntiles) load(nxt, tl + 1);
    A v[VEC], tot[VEC];
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      A s = A(0);
#pragma unroll
      for (int j = 0; j < J; ++j) s += to_acc(cur[j].v[q]);
      tot[q] = s;
      v[q] = s;
    }
#pragma unroll
    for (int d = 1; d < RGW; d <<= 1) {
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        const A u = __shfl_up_sync(0xffffffffu, v[q], d * CV);
        if (rgw >= d) v[q] += u;
      }
    }
    A start[VEC];
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      A ex = __shfl_up_sync(0xffffffffu, v[q], CV);
      start[q] = rgw == 0 ? A(0) : ex;
    }
    if (rgw == RGW - 1) {
#pragma unroll
      for (int q = 0; q < VEC; ++q) wsum[parity][warp][cg][q] = v[q];
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      A pre = carry[q], tt = A(0);
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const A ws = wsum[parity][w][cg][q];
        if (w < warp) pre += ws;
        tt += ws;
      }
      start[q] = pre + start[q];
      carry[q] += tt;
    }
    parity ^= 1;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int64_t k = tl * TILE + int64_t(rg) * J + j;
      P w;
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        const A val = to_acc(cur[j].v[q]);
        w.v[q] = scan_step<T>(start[q], val, exclusive);
      }
      if (k < L) st_pack_stream<T, VEC>(yb + (REV ? L - 1 - k : k) * I, w);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) cur[j] = nxt[j];
  }
}

// I == 1, long rows with few of them (where the chunked passes would run), 16-byte vectors,
// f32 / bf16 / f16: one pass of a chained scan. A block takes a ticket from a counter
// (atomicAdd; tickets in order chunk-major: ticket = c * O + row), so the block holding tile
// (row, c - 1) took an earlier ticket and is running: it cannot wait on a block that never
// starts. It copies its tile of kChainTileBytes (the row's logical elements [c * TL,
// (c + 1) * TL), contiguous in memory forwards or backwards) into shared memory with one
// bulk copy, takes its sums (thread t, sub-tile j: logical vector j * 256 + t) and scans
// them with group_scan_n, then thread 0 waits for tile c - 1's published inclusive prefix
// (a 64-bit slot: flag in the high word, the f32 bits in the low word, one relaxed 64-bit
// access at gpu scope: nothing else is ordered by it), publishes carry + its tile total at once, and the block writes its outputs
// from shared memory. A strict chain: every carry is exactly its predecessor's inclusive
// prefix, each sum in an order fixed by the shape (no look-back over partial aggregates):
// bitwise reproducible. Reads x once, writes y once. The slots and the counter live in
// the scratch result and are zeroed on XLA's stream before each launch.
template <typename T, bool REV>
__global__ void __launch_bounds__(256, 3) chain_scan_k(const T* __restrict__ x, T* __restrict__ y,
                                                       unsigned long long* __restrict__ slots,
                                                       unsigned int* __restrict__ counter, int64_t O, int64_t L,
                                                       bool exclusive) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = float;
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int S = kChainTileBytes / (256 * 16);  // sub-tiles a thread
  constexpr int64_t TL = kChainTileBytes / int(sizeof(T));
  using P = Pack<T, VEC>;
  extern __shared__ __align__(128) unsigned char chain_smem[];
  const P* tile = reinterpret_cast<const P*>(chain_smem);
  __shared__ uint64_t bar;
  __shared__ A red[2 * S * 8];
  __shared__ unsigned int s_ticket;
  __shared__ A s_carry;
  const int t = threadIdx.x;
  if (t == 0) {
    s_ticket = atomicAdd(counter, 1u);
    mbar_init(&bar, 1);
    mbar_init_fence();
  }
  __syncthreads();
  const int64_t ticket = s_ticket;
  const int64_t c = ticket / O, row = ticket - c * O;
  const int64_t k0 = c * TL;
  const int64_t len = L - k0 < TL ? L - k0 : TL;
  const int64_t p0 = REV ? L - k0 - len : k0;  // physical start of the tile
  const int nvl = int(len / VEC);              // vectors in the tile (L % VEC == 0)
  if (t == 0) {
    mbar_arrive_expect_tx(&bar, uint32_t(len * int64_t(sizeof(T))));
    bulk_load(chain_smem, x + row * L + p0, uint32_t(len * int64_t(sizeof(T))), &bar);
  }
  mbar_wait(&bar, 0);
  A s_n[S], ex_n[S], tot_n[S];
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const int v = j * 256 + t;
    A s = A(0);
    if (v < nvl) {
      const P e = tile[REV ? nvl - 1 - v : v];
#pragma unroll
      for (int q = 0; q < VEC; ++q) s += to_acc(e.v[REV ? VEC - 1 - q : q]);
    }
    s_n[j] = s;
  }
  group_scan_n<A, S>(s_n, 256, red, 0, ex_n, tot_n);
  if (t == 0) {
    A total = A(0);
#pragma unroll
    for (int j = 0; j < S; ++j) total += tot_n[j];
    A carry = A(0);
    if (c > 0) {
      const unsigned long long* prev = slots + (c - 1) * O + row;
      unsigned long long w = 0;
      do {
        asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(prev) : "memory");
      } while ((w >> 32) == 0);
      carry = __uint_as_float(uint32_t(w));
    }
    const unsigned long long mine = (1ull << 32) | __float_as_uint(carry + total);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(slots + c * O + row), "l"(mine) : "memory");
    s_carry = carry;
  }
  __syncthreads();
  A base = s_carry;
  T* yr = y + row * L + p0;
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const int v = j * 256 + t;
    if (v < nvl) {
      const int pv = REV ? nvl - 1 - v : v;
      const P e = tile[pv];
      A run = base + ex_n[j];
      P w;  // physical order
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        const int pq = REV ? VEC - 1 - q : q;
        const A val = to_acc(e.v[pq]);
        w.v[pq] = scan_step<T>(run, val, exclusive);
      }
      st_pack_stream<T, VEC>(yr + int64_t(pv) * VEC, w);
    }
    base += tot_n[j];
  }
#endif
}

// I > 1, long scan axis with few columns (where the chunked passes would run), 16-byte
// vectors, f32 / bf16 / f16, at least kColChainMinStrips strips: one pass of a chained scan
// over tiles of kColChainRows scan positions x one strip of 256 bytes (CW = 256 / sizeof(T)
// columns) of one o. Tickets as in chain_scan_k (ticket = c * (O * strips) + strip, strips
// counted over all o), so tile (strip, c - 1) is running when tile (strip, c) waits for it.
// Each thread copies one row of the tile (256 bytes) into shared memory with a bulk copy;
// thread (rg, cv) (16 row groups of 16 rows, 16 vectors of VEC columns) sums its 16 rows
// per column; the 16 row groups' sums meet in shared memory and every thread adds the
// earlier groups' sums (its start) and all 16 (the tile total) in group order; the threads of
// row group 0 wait for the predecessor's per-column inclusive prefixes (a 64-bit slot per
// column: flag in the high word, f32 bits in the low word), publish carry + tile total,
// and every thread writes its 16 outputs per column. Every sum in an order fixed by the
// shape: bitwise reproducible. x read once, y written once; warp accesses are 2 rows x 256
// contiguous bytes.
template <typename T, bool REV>
__global__ void __launch_bounds__(256, 3) col_chain_k(const T* __restrict__ x, T* __restrict__ y,
                                                      unsigned long long* __restrict__ slots,
                                                      unsigned int* __restrict__ counter, int64_t L, int64_t I,
                                                      int64_t strips_per_o, int64_t nstrips, bool exclusive) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = float;
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int CW = 256 / int(sizeof(T));  // columns a strip
  constexpr int R = kColChainRows, RG = 16, RPG = R / RG;
  using P = Pack<T, VEC>;
  extern __shared__ __align__(128) unsigned char chain_smem[];
  const P* tile = reinterpret_cast<const P*>(chain_smem);  // [R][16] packs
  __shared__ uint64_t bar;
  __shared__ A part[RG][16][VEC];
  __shared__ A s_carry[16][VEC];
  __shared__ unsigned int s_ticket;
  const int t = threadIdx.x;
  const int cv = t & 15, rg = t >> 4;
  if (t == 0) {
    const unsigned int ticket = atomicAdd(counter, 1u);
    s_ticket = ticket;
    const int64_t c = int64_t(ticket) / nstrips;
    const int64_t nr = L - c * R < R ? L - c * R : R;
    mbar_init(&bar, 1);
    mbar_init_fence();
    mbar_arrive_expect_tx(&bar, uint32_t(nr * 256));
  }
  __syncthreads();
  const int64_t ticket = s_ticket;
  const int64_t c = ticket / nstrips, sg = ticket - c * nstrips;
  const int64_t o = sg / strips_per_o, strip = sg - o * strips_per_o;
  const int64_t k0 = c * R;
  const int nr = int(L - k0 < R ? L - k0 : R);
  const T* xb = x + o * L * I + strip * CW;
  T* yb = y + o * L * I + strip * CW;
  if (t < nr) {
    const int64_t k = k0 + t;
    bulk_load(chain_smem + t * 256, xb + (REV ? L - 1 - k : k) * I, 256u, &bar);
  }
  mbar_wait(&bar, 0);
  A s[VEC];
#pragma unroll
  for (int q = 0; q < VEC; ++q) s[q] = A(0);
#pragma unroll 4
  for (int i = 0; i < RPG; ++i) {
    const int r = rg * RPG + i;
    if (r < nr) {
      const P e = tile[r * 16 + cv];
#pragma unroll
      for (int q = 0; q < VEC; ++q) s[q] += to_acc(e.v[q]);
    }
  }
#pragma unroll
  for (int q = 0; q < VEC; ++q) part[rg][cv][q] = s[q];
  __syncthreads();
  A start[VEC], total[VEC];
#pragma unroll
  for (int q = 0; q < VEC; ++q) {
    A pre = A(0), tot = A(0);
#pragma unroll
    for (int g = 0; g < RG; ++g) {
      if (g == rg) pre = tot;
      tot += part[g][cv][q];
    }
    start[q] = pre;
    total[q] = tot;
  }
  if (rg == 0) {
    // the predecessor's inclusive prefixes of this thread's VEC columns, then ours
    unsigned long long* mine = slots + (c * nstrips + sg) * CW + cv * VEC;
    A carry[VEC];
    if (c > 0) {
      const unsigned long long* prev = mine - nstrips * CW;
      unsigned long long w[VEC];
      bool ready;
      do {
        ready = true;
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w[q]) : "l"(prev + q) : "memory");
          ready = ready && (w[q] >> 32) != 0;
        }
      } while (!ready);
#pragma unroll
      for (int q = 0; q < VEC; ++q) carry[q] = __uint_as_float(uint32_t(w[q]));
    } else {
#pragma unroll
      for (int q = 0; q < VEC; ++q) carry[q] = A(0);
    }
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      const unsigned long long v = (1ull << 32) | __float_as_uint(carry[q] + total[q]);
      asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(mine + q), "l"(v) : "memory");
      s_carry[cv][q] = carry[q];
    }
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < VEC; ++q) start[q] = s_carry[cv][q] + start[q];
#pragma unroll 4
  for (int i = 0; i < RPG; ++i) {
    const int r = rg * RPG + i;
    if (r < nr) {
      const P e = tile[r * 16 + cv];
      P w;
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        const A val = to_acc(e.v[q]);
        w.v[q] = scan_step<T>(start[q], val, exclusive);
      }
      const int64_t k = k0 + r;
      st_pack_stream<T, VEC>(yb + (REV ? L - 1 - k : k) * I + cv * VEC, w);
    }
  }
#endif
}

// Pass 2: scr [O, nchunk, cols] chunk totals -> exclusive prefixes over the chunk axis,
// one warp per (o, col), 32 chunks at a time in a fixed order.
template <typename A>
__global__ void __launch_bounds__(256) chunk_prefix_k(A* __restrict__ scr, int64_t O, int64_t nchunk, int64_t cols) {
  const int64_t wid = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (wid >= O * cols) return;  // whole warps leave together
  const int64_t o = wid / cols, col = wid - o * cols;
  A* base = scr + o * nchunk * cols + col;
  A carry = A(0);
  for (int64_t c0 = 0; c0 < nchunk; c0 += 32) {
    const int64_t cc = c0 + lane;
    const A v0 = cc < nchunk ? base[cc * cols] : A(0);
    A v = v0;
    for (int d = 1; d < 32; d <<= 1) {
      const A n = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += n;
    }
    A ex = __shfl_up_sync(0xffffffffu, v, 1);
    if (lane == 0) ex = A(0);
    const A tot = __shfl_sync(0xffffffffu, v, 31);
    if (cc < nchunk) base[cc * cols] = carry + ex;
    carry += tot;
  }
}


inline int rw_num_sms() {
  static const int sms = [] {
    DeviceInfo dev;
    return device_info(&dev) == cudaSuccess ? dev.sms : 132;
  }();
  return sms;
}

template <typename T, int VEC, int NV, int MODE>
auto row_kernel(bool reverse) {
  return reverse ? row_scan_k<T, VEC, NV, MODE, true> : row_scan_k<T, VEC, NV, MODE, false>;
}

template <typename T, int VEC, int NV>
ffi::Error launch_rows_nv(cudaStream_t stream, const T* x, T* y, acc_t<T>* scr, int64_t O, int64_t L,
                          Chunks ch, bool exclusive, bool reverse) {
  const int64_t span = ch.n > 1 ? ch.len : L;
  int tpr = 4;
  while (tpr < 256 && int64_t(tpr) * VEC * NV < span) tpr *= 2;
  if (ch.n > 1) tpr = 256;  // one unit a block (row_scan_k relies on it; chunks are >= 8192 long anyway)
  const int gpb = 256 / tpr;
  const int64_t units = O * ch.n;
  const int64_t blocks = ceil_div(units, gpb);
  if (blocks > INT32_MAX) return invalid("cumsum (cuda): too many rows");
  if (ch.n == 1) {
    row_kernel<T, VEC, NV, kFull>(reverse)<<<unsigned(blocks), 256, 0, stream>>>(x, y, scr, units, L, 1, L, tpr, exclusive,
                                                                         reverse);
  } else {
    using A = acc_t<T>;
    row_kernel<T, VEC, NV, kSums>(reverse)<<<unsigned(blocks), 256, 0, stream>>>(x, y, scr, units, L, ch.n, ch.len, tpr,
                                                                         exclusive, reverse);
    chunk_prefix_k<A><<<unsigned(ceil_div(O * 32, 256)), 256, 0, stream>>>(scr, O, ch.n, 1);
    row_kernel<T, VEC, NV, kCarry>(reverse)<<<unsigned(blocks), 256, 0, stream>>>(x, y, scr, units, L, ch.n, ch.len, tpr,
                                                                          exclusive, reverse);
  }
  return check_launch("cumsum (cuda): row scan launch");
}

template <typename T, int VEC>
ffi::Error launch_rows(cudaStream_t stream, const T* x, T* y, acc_t<T>* scr, int64_t O, int64_t L,
                       Chunks ch, bool exclusive, bool reverse) {
  // 4 sub-tiles a trip (2 measured 1.57x the copy floor against 1.16x for bf16 exclusive rows)
  return launch_rows_nv<T, VEC, 4>(stream, x, y, scr, O, L, ch, exclusive, reverse);
}

template <typename T>
ffi::Error launch_chain(cudaStream_t stream, const T* x, T* y, void* scr, int64_t O, int64_t L, bool exclusive,
                        bool reverse) {
  const int64_t tiles = O * chain_tiles(L, sizeof(T));
  if (tiles > INT32_MAX || tiles >= (int64_t(1) << 32)) return invalid("cumsum (cuda): too many tiles");
  unsigned long long* slots = static_cast<unsigned long long*>(scr);
  unsigned int* counter = reinterpret_cast<unsigned int*>(static_cast<float*>(scr) + 2 * tiles);
  if (cudaError_t e = cudaMemsetAsync(scr, 0, size_t(2 * tiles + 1) * 4, stream); e != cudaSuccess)
    return cuda_error("cumsum (cuda): zeroing the chain slots", e);
  auto kernel = reverse ? chain_scan_k<T, true> : chain_scan_k<T, false>;
  if (cudaError_t e = allow_dyn_smem(kernel, kChainTileBytes); e != cudaSuccess)
    return cuda_error("cumsum (cuda): shared memory limit of the chained row scan", e);
  kernel<<<unsigned(tiles), 256, kChainTileBytes, stream>>>(x, y, slots, counter, O, L, exclusive);
  return check_launch("cumsum (cuda): chained row scan launch");
}

template <typename T>
ffi::Error launch_col_chain(cudaStream_t stream, const T* x, T* y, void* scr, int64_t O, int64_t L, int64_t I,
                            bool exclusive, bool reverse) {
  constexpr int64_t cw = 256 / int64_t(sizeof(T));
  const int64_t strips_per_o = I / cw, nstrips = O * strips_per_o;
  const int64_t tiles = nstrips * ceil_div(L, kColChainRows);
  if (tiles > INT32_MAX) return invalid("cumsum (cuda): too many tiles");
  const int64_t words = 2 * O * I * ceil_div(L, kColChainRows);
  unsigned long long* slots = static_cast<unsigned long long*>(scr);
  unsigned int* counter = reinterpret_cast<unsigned int*>(static_cast<float*>(scr) + words);
  if (cudaError_t e = cudaMemsetAsync(scr, 0, size_t(words + 1) * 4, stream); e != cudaSuccess)
    return cuda_error("cumsum (cuda): zeroing the chain slots", e);
  auto kernel = reverse ? col_chain_k<T, true> : col_chain_k<T, false>;
  if (cudaError_t e = allow_dyn_smem(kernel, kColChainRows * 256); e != cudaSuccess)
    return cuda_error("cumsum (cuda): shared memory limit of the chained column scan", e);
  kernel<<<unsigned(tiles), 256, kColChainRows * 256, stream>>>(x, y, slots, counter, L, I, strips_per_o, nstrips,
                                                                 exclusive);
  return check_launch("cumsum (cuda): chained column scan launch");
}

template <typename T, int VEC, int U>
ffi::Error launch_cols_u(cudaStream_t stream, const T* x, T* y, acc_t<T>* scr, int64_t O, int64_t L,
                         int64_t I, Chunks ch, bool exclusive, bool reverse) {
  using A = acc_t<T>;
  const int64_t threads = O * ch.n * (I / VEC);
  const int64_t blocks = ceil_div(threads, 256);
  if (blocks > INT32_MAX) return invalid("cumsum (cuda): input too large");
  if (ch.n == 1) {
    col_scan_k<T, VEC, kFull, U><<<unsigned(blocks), 256, 0, stream>>>(x, y, scr, O, L, I, 1, L, exclusive, reverse);
  } else {
    col_scan_k<T, VEC, kSums, U><<<unsigned(blocks), 256, 0, stream>>>(x, y, scr, O, L, I, ch.n, ch.len, exclusive,
                                                                     reverse);
    const int64_t pblocks = ceil_div(O * I * 32, 256);
    if (pblocks > INT32_MAX) return invalid("cumsum (cuda): input too large");
    chunk_prefix_k<A><<<unsigned(pblocks), 256, 0, stream>>>(scr, O, ch.n, I);
    col_scan_k<T, VEC, kCarry, U><<<unsigned(blocks), 256, 0, stream>>>(x, y, scr, O, L, I, ch.n, ch.len, exclusive,
                                                                      reverse);
  }
  return check_launch("cumsum (cuda): column scan launch");
}

template <typename T, int VEC>
ffi::Error launch_cols(cudaStream_t stream, const T* x, T* y, acc_t<T>* scr, int64_t O, int64_t L,
                       int64_t I, Chunks ch, bool exclusive, bool reverse) {
  // the single pass where the chunked passes would run (few columns for a long axis), with
  // 16-byte vectors and at least one strip a multiprocessor
  if constexpr (VEC * sizeof(T) == 16 && sizeof(T) == 4) {  // f32 (measured); 16-bit: 162 registers
    const int64_t strip_cols = int64_t(kStripCV) * VEC;
    if (ch.n > 1 && I % strip_cols == 0 && O * (I / strip_cols) >= rw_num_sms()) {
      const int64_t strips = I / strip_cols, blocks = O * strips;
      if (blocks > INT32_MAX) return invalid("cumsum (cuda): input too large");
      constexpr int J = 8;
      if (reverse)
        col_strip_k<T, VEC, J, true><<<unsigned(blocks), 256, 0, stream>>>(x, y, L, I, strips, exclusive);
      else
        col_strip_k<T, VEC, J, false><<<unsigned(blocks), 256, 0, stream>>>(x, y, L, I, strips, exclusive);
      return check_launch("cumsum (cuda): column strip scan launch");
    }
  }
  return launch_cols_u<T, VEC, 8>(stream, x, y, scr, O, L, I, ch, exclusive, reverse);
}

template <typename T>
ffi::Error launch(cudaStream_t stream, const T* x, T* y, acc_t<T>* scr, int64_t O, int64_t L,
                  int64_t I, bool exclusive, bool reverse) {
  const Chunks ch = cumsum_chunks(O, L, I);
  constexpr int kMax = 16 / int(sizeof(T));
  // the vector width: it must divide the contiguous run (L for rows, I for columns) so
  // that every vector stays aligned, and both buffers must be aligned to it
  const int64_t run = I == 1 ? L : I;
  auto fits = [&](int vec) {
    return run % vec == 0 && aligned_to(x, vec * int(sizeof(T))) && aligned_to(y, vec * int(sizeof(T)));
  };
  if (I == 1) {
    if constexpr (sizeof(T) <= 4) {
      if (ch.n > 1 && fits(kMax)) return launch_chain<T>(stream, x, y, scr, O, L, exclusive, reverse);
    }
    if constexpr (kMax >= 8) if (fits(8)) return launch_rows<T, 8>(stream, x, y, scr, O, L, ch, exclusive, reverse);
    if constexpr (kMax >= 4) if (fits(4)) return launch_rows<T, 4>(stream, x, y, scr, O, L, ch, exclusive, reverse);
    if (fits(2)) return launch_rows<T, 2>(stream, x, y, scr, O, L, ch, exclusive, reverse);
    return launch_rows<T, 1>(stream, x, y, scr, O, L, ch, exclusive, reverse);
  }
  if constexpr (sizeof(T) <= 4) {
    if (ch.n > 1 && fits(kMax) && col_chain_fits(O, I, sizeof(T)))
      return launch_col_chain<T>(stream, x, y, scr, O, L, I, exclusive, reverse);
  }
  if constexpr (kMax >= 8) if (fits(8)) return launch_cols<T, 8>(stream, x, y, scr, O, L, I, ch, exclusive, reverse);
  if constexpr (kMax >= 4) if (fits(4)) return launch_cols<T, 4>(stream, x, y, scr, O, L, I, ch, exclusive, reverse);
  if (fits(2)) return launch_cols<T, 2>(stream, x, y, scr, O, L, I, ch, exclusive, reverse);
  return launch_cols<T, 1>(stream, x, y, scr, O, L, I, ch, exclusive, reverse);
}

ffi::Error CumsumImpl(cudaStream_t stream, const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& y,
                      ffi::Result<ffi::AnyBuffer>& scratch, bool exclusive, bool reverse) {
  if (auto e = cumsum::check(x, *y); e.failure()) return e;
  auto d = x.dimensions();
  const ffi::DataType acc = x.element_type() == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
  const int64_t need = cumsum_scratch_size(d[0], d[1], d[2], ffi::ByteWidth(x.element_type()));
  if (scratch->element_type() != acc || int64_t(scratch->element_count()) < need)
    return invalid("cumsum (cuda): scratch must be " + dtype_name(acc) + " with at least " + std::to_string(need) +
                   " elements, got " + dtype_name(scratch->element_type()) + "[" +
                   std::to_string(scratch->element_count()) + "]");
  if (x.element_count() == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch<true>(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    result = launch<T>(stream, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
                       static_cast<A*>(scratch->untyped_data()), d[0], d[1], d[2], exclusive, reverse);
  });
  if (!ok) return invalid("cumsum: unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

ffi::Error CumsumFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> scratch, bool exclusive) {
  return CumsumImpl(stream, x, y, scratch, exclusive, false);
}

ffi::Error CumsumBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> scratch, bool exclusive) {
  return CumsumImpl(stream, dy, dx, scratch, exclusive, true);
}

}  // namespace

#define RLX_CUMSUM_CUDA_BINDING                 \
  ffi::Ffi::Bind()                              \
      .Ctx<ffi::PlatformStream<cudaStream_t>>() \
      .Arg<ffi::AnyBuffer>() /* x (dy) */       \
      .Ret<ffi::AnyBuffer>() /* y (dx) */       \
      .Ret<ffi::AnyBuffer>() /* scratch */      \
      .Attr<bool>("exclusive")

// Command-buffer compatible: launches on XLA's stream only, shaped by the buffer
// shapes, their alignment and nothing else.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxCumsumFwdCuda, CumsumFwdImpl, RLX_CUMSUM_CUDA_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxCumsumBwdCuda, CumsumBwdImpl, RLX_CUMSUM_CUDA_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_cumsum_fwd", RlxCumsumFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_cumsum_bwd", RlxCumsumBwdCuda);

}  // namespace cuda
}  // namespace rlx
