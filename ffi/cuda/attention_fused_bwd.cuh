// Fused attention backward on Hopper wgmma (sm_90a), bf16 / f16, head dim 64 or 128, the PLAIN cases of
// wgmma_dkdv_kernel (scale > 0, no softcap / bias / key mask, mask kind none or causal), and in its
// CAP / MASK forms (bwd_probs, bwd_kept_keys: attention_wgmma_bwd.cuh; FusedSchedule's window bound) the
// same cases with a softcap, a key mask and / or a sliding window: one kernel
// computes dk, dv AND dq, so S and dP are formed once (5 S x S x D products instead of the 7 of
// wgmma_dkdv_kernel + a dq kernel). Selection: attention_launch_impl.cuh.
//
// Block = 2 warpgroups over 128 keys of one kv head, exactly wgmma_dkdv_kernel's OVL schedule
// (attention_wgmma_bwd.cuh) for S^T, dP^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q; in addition, per
// query tile (BQ = fused_rows(D) rows of one query head: 64 at D 128, 128 at D 64, where S^T and
// dP^T are m64n128 products) it forms the block's partial
//   dQ_tile = dS K_block   (BQ queries x 128 keys x D), 8 k-steps of 16 keys: at D 128 wgmma
// m64n64k16, warpgroup w computing the D columns [64 w, 64 w + 64) of the 64 rows; at D 64 wgmma
// m64n64k16, warpgroup w computing the 64 rows [64 w, 64 w + 64) over all columns. A = dS, read
// from shared memory where both warpgroups stored their dS^T rows (keys) as [BQ / 64][128 keys][64
// queries] in the 128-byte swizzle layout (queries contiguous: the A operand MN-major, transpose
// bit); B = the block's K tile, MN-major (transpose bit), as V in the forward's P V product.
//
// The partials of the key blocks of one kv head are summed in f32 in global scratch (dQacc [B, H,
// Sq, D]) in a FIXED order per query tile, so dq is bitwise reproducible: no float atomics.
//   - Work order: every block takes a ticket (integer atomicAdd on a zeroed counter) when it
//     starts; the ticket, not blockIdx, names its (key tile, kv head, batch), key tile fastest.
//   - Block kt visits its items (query head of the group, query tile) in a rotated order: item
//     (r_kt + m) mod iters at step m (r_kt = kt * iters / nkt without a mask: the key blocks of a head
//     start on different tiles instead of queueing behind each other; causal: r = 0, the blocks
//     already start on different tiles, their diagonals).
//   - The fixed add order of a tile: its contributors sorted by (step m at which they visit it, kt).
//     The contributor of rank r sends its partial once the tile's uint32 semaphore equals r, and then
//     sets it to r + 1 (the ranks: fill_ranks, 64 items at a time). The partial (64 x D f32) goes
//     to shared memory (two buffers, the dQacc layout of fused_chunk) at the end of iteration m;
//     the TMA engine sums it into dQacc, pipelined over the loop:
//       iteration m + 1, after its first MMAs are issued: one thread (kFusedSender) spins on
//         ld.acquire of the semaphore until it equals r, then issues ONE bulk operation for the
//         tile's rows below Sq (the partial's 16-byte chunks are permuted, fused_chunk, so shared
//         memory and dQacc hold the same contiguous layout): rank 0 a bulk copy (cp.async.bulk:
//         dQacc is not zeroed first), the others a bulk add (cp.reduce.async.bulk .add.f32,
//         performed at L2 element by element);
//       iteration m + 1, after its dQ product is issued: that thread waits for its bulk group (the
//         sums performed), then stores r + 1 with st.release.gpu.
//     The f32 sum of a dQacc element is therefore ((p_0 + p_1) + p_2) + ... in the fixed rank order:
//     dq is bitwise reproducible. The grid's last blocks (tickets kbw and up) are converters,
//     fused_convert_tiles: they write dq = scale * dQacc in T tile by tile as the tiles' sums complete
//     (instead of a separate kernel after this one). Reading the dQacc tile into shared memory with
//     cp.async and adding and storing it with the math threads would put 64 KB through L2 a block and
//     tile on the math warps' path; the bulk ops take the sum off their path.
//     dq rows of tiles no key block visits (causal rows that see no key, Sk = 0) are zeroed by the
//     converters; the launcher zeroes the semaphores and the ticket and converter counters.
//   - Deadlock freedom: an item (kt, m) waits only on items of the same (batch, kv head) that are
//     lexicographically smaller in (m, kt), and a block runs its own items in increasing m, so the
//     wait graph has no cycle; every waited-on item belongs to a block of the same (batch, kv head),
//     and those blocks hold consecutive tickets. Tickets are taken in start order, so the started
//     blocks are a prefix of the ticket order: every (batch, kv head) group wholly inside the
//     prefix completes, and at most one group is partly started. The launcher serves only grids
//     whose groups (nkt blocks) fit on the device at once (nkt <= SMs x resident blocks per SM), so
//     when the whole groups have finished, a partly started group's blocks leave room to start the
//     rest of it. Otherwise the launcher runs the two-kernel backward.
// This kernel runs at D 64 with a softcap; everywhere else its warp-specialised form,
// attention_fused_bwd_ws.cuh, runs (1.03-1.07x this kernel at D 128; 1.14-1.16x at D 64).
// Measured choices (B4 S4096 H16 bf16, H100 unless noted; 3 alternating rounds each):
//   - the dQ sums: the math threads reading, adding and storing the dQacc tile ran 0.77x / 0.73x the
//     two-kernel fwd+bwd (H200); bulk ops row by row with a __threadfence before the release 0.73x; one
//     bulk op a tile (chunks permuted) 1.00x; without the __threadfence 1.08-1.09x. The ordered sums
//     cost about 7 % of fwd+bwd (diagnosis builds without the semaphore wait, then the bulk ops).
//   - the ranks computed kFusedRankChunk items at a time by all warps (fill_ranks): 1.01-1.04x against
//     one item an iteration on one warp; computing the next item's rank during the dQ product: 0.97x.
//   - causal: the per-score mask selects had compiled into a path that tested every score of every
//     causal tile (ncu source counters, B2 D 128: 10.2 k against 8.1 k instructions per item); with
//     the unmasked tiles on mask-free loops (bwd_probs / bwd_dscores<T, false>,
//     attention_wgmma_bwd.cuh) the fused causal backward runs 1.24-1.26x the two kernels at D 128 and
//     1.06-1.08x at D 64.
//   - dV's and dK's products waited for after the middle barrier, with dQ's: 1.02-1.04x none,
//     1.01-1.04x causal at D 128; 1.01-1.03x / 0.98x at D 64.
//   - D 64 items of 128 query rows (fused_rows): backward alone 1.27-1.29x none, 1.24-1.26x causal
//     (tensor pipe 30 % -> 39 % busy, barrier stalls 0.72 -> 0.46 warps an issue).
//   - not kept: staging lse / delta by cp.async (level; 0.98x in the dk / dv kernel); a pipelined D 64
//     loop issuing the next item's S^T and dP^T behind this item's dQ product (0.95x); a product kept
//     in flight across the loop's back edge (ptxas serialises every wgmma: C7514 / C7518).
// ptxas (sm_90a, nvcc 13): D 128 254 registers, no spill; D 64 255, 44 bytes spilled (the prologue and
// the pending item's bookkeeping at the end of the loop); 1 block of 8 warps per SM.
#pragma once

#include <cstdint>

#include "cuda/attention_wgmma_bwd.cuh"

namespace rlx {
namespace cuda {
namespace attn {

// D[64 x 64] (+)= A B with A and B both from shared memory, both MN-major (transpose bits set):
// the fused backward's dQ = dS K, 64 columns per warpgroup (D 128: a column half of 64 rows; D 64:
// all columns of the warpgroup's 64 rows).
template <typename T>
__device__ __forceinline__ void wgmma_ss_tt(float (&d)[8][4], uint64_t da, uint64_t db, uint64_t aoff, uint64_t boff,
                                            int scale_d) {
#if RLX_ATTN_WGMMA
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\n"
        "add.s64 da, %32, %34;\nadd.s64 db, %33, %35;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, p, "
        "1, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
  } else {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\n"
        "add.s64 da, %32, %34;\nadd.s64 db, %33, %35;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, p, "
        "1, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "l"(aoff), "l"(boff), "r"(scale_d));
  }
#endif
}

__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Query rows of a fused item (BQ): 128 at D 64, 64 at D 128. At D 64 the 64-row items left the
// tensor pipe about 30 % busy (ncu): each m64n64 product is half the work of D 128's
// m64n64 / n128 ones for the same barriers, staging and sends; 128 rows give each warpgroup
// m64n128 S^T / dP^T products (64 + 64 registers), 8 k-steps of dV / dK, and split dQ by rows
// (each warpgroup 64 queries x all 64 columns) instead of by columns. At D 128 the 128-row item
// would need 128 + 128 registers of S^T / dP^T: it stays at 64.
__host__ __device__ constexpr int fused_rows(int64_t D) { return D == 64 ? 128 : 64; }

// Scratch of the fused backward, in f32 elements after delta (B * H * Sq, rounded up to 4):
// dQacc B * H * Sq * D, then B * H * nqt + 2 uint32 (the tile semaphores, the ticket counter, the
// converters' tile counter; nqt: query tiles of fused_rows(D) rows).
// With head splits (FusedSplit, splits > 1), then the split tree's (arrival count, ready flag) uint32
// pairs, B * Hkv * nkt * (splits - 1) of them, and from the next multiple of 4 its partials, one
// 2 x 128 x D f32 (dK, dV of a key block) a tree node.
inline int64_t fused_bwd_delta_pad(int64_t bhs) { return (bhs + 3) / 4 * 4; }
inline int64_t fused_split_nodes(int64_t B, int64_t Hkv, int64_t Sk, int64_t splits) {
  return B * Hkv * ((Sk + 127) / 128) * (splits - 1);
}
inline int64_t fused_bwd_scratch(int64_t B, int64_t H, int64_t Sq, int64_t D, int64_t Hkv = 0, int64_t Sk = 0,
                                 int64_t splits = 1) {
  const int64_t nqt = (Sq + fused_rows(D) - 1) / fused_rows(D);
  const int64_t base = fused_bwd_delta_pad(B * H * Sq) + B * H * Sq * D + B * H * nqt + 2;
  if (splits <= 1) return base;
  const int64_t nodes = fused_split_nodes(B, Hkv, Sk, splits);
  return (base + 2 * nodes + 3) / 4 * 4 + nodes * 2 * 128 * D;
}

// Head splits (grouped-query attention): the key block of a (batch, kv head) is n blocks, each over
// group / n of the group's query heads (n a power of 2 dividing the group; 1: one block over the
// whole group). A block's work is then 1 / n of the group's, so the grid has n times as many,
// shorter, blocks: the unsplit grid's last (batch, kv head) groups started late and their long
// causal key blocks ran alone at the end (the grouped-query backward trailed the same kernel
// without grouping; launcher: attention_launch_impl.cuh). The n partial dK, dV of a key block are
// summed by a binary tree in f32 (fused_split_sum): at each node the second of its two children
// to arrive adds the first one's partial (left in global scratch) to its own and goes up; the last
// one stores dk, dv. Every node's sum is of the same two values whichever arrives first, and f32
// addition is commutative, so dk and dv are bitwise the same from run to run. No block waits on a
// block that has not started (the first child has taken the node's count before it writes), so
// the deadlock-freedom argument of the header holds: the dQ chains are per (batch, kv head, split)
// group of nkt consecutive tickets. Measured (H200, bf16, D 128, causal, 16 query / 4 kv heads, the
// fused backward kernel's time under the profiler, benchmarks.attention_kernels): B4 S4096 1567 us
// unsplit, 1419 us in 2 splits, 1418 us in 4; B8 S2048 841, 782 and 818 us. The launcher's model
// (attn_fused_splits) picks 2 at both shapes; fwd + bwd then runs at 1.02x (B4 S4096) and 1.08x
// (B8 S2048) cuDNN's speed, against 0.95x and 1.02x unsplit.
struct FusedSplit {
  int n;           // blocks per key block
  uint32_t* sync;  // [key block][n - 1 nodes] x (arrivals, ready)
  float* part;     // [key block][n - 1 nodes][2][D / 8][256 threads][4]
};

// The tree sum of FusedSplit for this block (split sp of key block kb = (b Hkv + hk) nkt + kt) over
// the 256 threads that hold dK, dV (tid: 0 .. 255; bar(): a barrier of exactly those threads; role:
// an int of shared memory). True in the block left with the whole sum (it stores dk and dv).
template <int D, typename Bar>
__device__ __forceinline__ bool fused_split_sum(float (&dka)[D / 8][4], float (&dva)[D / 8][4], const FusedSplit& fs,
                                                int64_t kb, int sp, int tid, int* role, Bar bar) {
  for (int l = 0; (1 << l) < fs.n; ++l) {
    // node of level l: levels of n / 2, n / 4, ... nodes one after another
    const int64_t node = kb * (fs.n - 1) + (fs.n - (fs.n >> l)) + (sp >> (l + 1));
    uint32_t* sync = fs.sync + 2 * node;
    float4* slot = reinterpret_cast<float4*>(fs.part) + node * (2 * 128 * D / 4);
    bar();  // every thread's read of role (the level before)
    if (tid == 0) *role = int(atomicAdd(sync, 1u));
    bar();
    if (*role == 0) {  // the first child: its partial for the second
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        slot[nt * 256 + tid] = make_float4(dka[nt][0], dka[nt][1], dka[nt][2], dka[nt][3]);
        slot[(D / 8 + nt) * 256 + tid] = make_float4(dva[nt][0], dva[nt][1], dva[nt][2], dva[nt][3]);
      }
      __threadfence();
      bar();
      if (tid == 0) st_release_u32(sync + 1, 1u);
      return false;
    }
    if (tid == 0)
      while (ld_acquire_u32(sync + 1) == 0u) __nanosleep(64);
    bar();  // thread 0's acquire, then every thread's reads (L2: __ldcg)
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const float4 ok = __ldcg(slot + nt * 256 + tid), ov = __ldcg(slot + (D / 8 + nt) * 256 + tid);
      dka[nt][0] += ok.x;
      dka[nt][1] += ok.y;
      dka[nt][2] += ok.z;
      dka[nt][3] += ok.w;
      dva[nt][0] += ov.x;
      dva[nt][1] += ov.y;
      dva[nt][2] += ov.z;
      dva[nt][3] += ov.w;
    }
  }
  return true;
}

// Bulk (TMA engine) copies from shared to global memory, completed per thread as bulk groups:
// dst = src (copy) or dst += src (add.f32: a reduction performed at L2, one per element), bytes a
// multiple of 16, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_store_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// every bulk group of this thread complete: its global writes performed
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// orders this thread's async-proxy global accesses (the bulk ops) with its generic-proxy ones
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// dQacc layout: [B, H, Sq, D] f32 with the 16-byte chunks of each row permuted (D a multiple of 32):
// chunk c (columns 4 c .. 4 c + 3) of query row i is stored at chunk c ^ 2 (i & 3). The shared-memory
// partial of a BQ-row tile has the same layout (its rows start at multiples of BQ), so the whole tile
// is ONE contiguous bulk operation. Fragment stores (fused_store_partial): in a half-warp (rows with
// i & 7 = g < 4, or 4 <= g < 8, of 128-byte-aligned rows), lane (g, tq) stores a float2 into chunk
// (c0 + tq / 2) ^ 2 (g & 3), c0 even: the 8 chunks of an aligned group, each by two lanes (its two
// halves), so the 16 stores cover the 32 banks once. The permutation c ^ (i & 7) puts two rows on each
// chunk half: 2-way bank conflicts (8.7 M extra shared-memory wavefronts in the D 128 backward at B1
// S4096 H16, ncu). Against it, backward alone, H100: D 64 1.007-1.017x, D 128 causal 1.01-1.05x
// and D 128 without a mask 1.02-1.05x (in the two-sender WS kernel; with one sender it had run
// 0.97-0.99x there). Either layout gives the same sums: dq is bitwise the same.
__host__ __device__ constexpr int fused_chunk(int c, int64_t i) { return c ^ int(2 * (i & 3)); }

// The ranks of a block's items are computed kFusedRankChunk at a time (all 8 warps, every
// kFusedRankChunk iterations) into shared memory.
constexpr int kFusedRankChunk = 64;

// Shared memory (BQ = fused_rows(D)): wgmma_dkdv_kernel's layout for BQ-row tiles, plus dS^T
// [BQ / 64][128 keys][64 queries] T, two dQ partials [BQ rows][D] f32 (the one being sent to global
// memory and the next), 4 ints and the ranks of a chunk. D 64: 195 KB; D 128: 153 KB.
template <int D>
constexpr size_t wg_fused_smem() {
  constexpr int BQ = fused_rows(D);
  return wg_dkdv_smem<D, BQ>() + size_t(2) * kWgBwdKeys * BQ + size_t(4) * 2 * BQ * D + 16 + 4 * kFusedRankChunk;
}

// dQ partial = dS K over the block's 128 keys (8 k-steps of 16) for a warpgroup's 64 rows x 64
// columns: A = dS^T (descriptor sdt), B = K (kdq), both MN-major; fenced, issued and committed.
template <typename T>
__device__ __forceinline__ void fused_issue_dq(float (&dqa)[8][4], uint64_t sdt, uint64_t kdq) {
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < kWgBwdKeys / 16; ++kk)
    wgmma_ss_tt<T>(dqa, sdt, kdq, uint64_t(kk * 16 * 128 >> 4), uint64_t(kk * 16 * 128 >> 4), kk > 0);
  wg_commit();
}

// This thread's dQ partial (dqa: rows row0 = r0 + 16 warp + g and row0 + 8 of the tile, g = row &
// 7; columns kcol + 8 nt + 2 tq (+ 1)) into the partial buffer ps ([BQ][D] f32 in dQacc's layout):
// chunk kcol / 4 + 2 nt + tq / 2 stored at fused_chunk(chunk, g).
template <int D, int DH>
__device__ __forceinline__ void fused_store_partial(float* ps, const float (&dqa)[DH / 8][4], int row0, int kcol,
                                                    int g, int tq) {
  float* pr = ps + row0 * D + 2 * (tq & 1);
#pragma unroll
  for (int nt = 0; nt < DH / 8; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<float2*>(pr + 8 * r * D + 4 * fused_chunk(kcol / 4 + 2 * nt + (tq >> 1), g)) =
          make_float2(dqa[nt][2 * r], dqa[nt][2 * r + 1]);
}

// The thread that sends the dQ partials (waits on the semaphores, issues and waits for the bulk ops):
// lane 0 of warp 5, in warpgroup 1; thread 0 (warpgroup 0, the first to issue each step's MMAs)
// ran 1.01-1.04x slower (backward alone, none; 1.015x causal).
constexpr unsigned kFusedSender = 160;

// The rotation start of key block kt (items of the block: iters).
__device__ __forceinline__ int fused_rot(int kt, int nkt, int iters, bool causal) {
  return causal ? 0 : int((int64_t(kt) * iters) / nkt);
}

// Segment ids: the key granules of a row of kinfo, and batch b's row (null without ids).
__device__ __forceinline__ int fused_key_granules(const AttnArgs& a) {
  return int((a.Sk + kSegGranule - 1) / kSegGranule);
}
__device__ __forceinline__ const int4* fused_kinfo(const AttnArgs& a, int64_t b) {
  return a.kinfo == nullptr ? nullptr : a.kinfo + b * fused_key_granules(a);
}

// The block a ticket names (key tile fastest, then the head split): key tile kt of nkt, split sp of
// splits, kv head hk, batch b.
__device__ __forceinline__ void fused_block(const AttnArgs& a, int nkt, int splits, int64_t ticket, int* kt, int* sp,
                                            int64_t* hk, int64_t* b) {
  *kt = int(ticket % nkt);
  ticket /= nkt;
  *sp = int(ticket % splits);
  ticket /= splits;
  *hk = ticket % a.Hkv;
  *b = ticket / a.Hkv;
}

// The query tiles [*t0, *t1) of bq rows that key block x (keys x keys .. x keys + keys - 1) is visible
// to by position (t0 >= t1: none). Causal: from the tile of the block's first key on (row i sees
// key j <= i + off). A window of win >= 0 keys: row i sees key j >= i + off - win, so the block's
// last key is seen up to row x keys + keys - 1 - off + win. (Host too: the launcher's split model,
// attn_fused_splits, in int64_t; the kernels in int.)
template <typename I>
__host__ __device__ __forceinline__ void key_block_tiles(I x, I keys, I bq, I nqt, bool causal, I off, I win, I* t0,
                                                         I* t1) {
  *t0 = causal ? max(I(0), x * keys - off) / bq : I(0);
  *t1 = nqt;
  if (win >= 0) {
    const int64_t last = int64_t(x) * keys + keys - 1 - off + win;
    *t1 = last < 0 ? I(0) : I(min(int64_t(nqt), last / bq + 1));
  }
}

// The item schedule of key block kt (of nkt, 128 keys each) of one (batch, kv head): its items are
// (query head hl of the group of grp, query tile t of BQ rows), t in [qt0, qt1) (causal: from the
// tile of the block's first key on; a sliding window of win >= 0 keys: up to the tile of the last
// row whose window reaches the block's last key; otherwise to nqt), visited in the rotated order of
// the header (step m: item (rot + m) mod iters); and each item's rank among the contributors of its
// tile. (win < 0: no window; the kernels pass a constant -1 where they take no window.) With
// segment ids (kinfo: the batch's key granule info, attention_segments.cuh; null without) the
// query tiles are also bounded by the hull of the block's granules, so every kernel and converter
// computes the same (data-dependent) schedule from the same ids.
template <int BQ>
struct FusedSchedule {
  int kt, nkt, nqt, grp, off;
  bool causal;
  int win;
  const int4* kinfo;
  int nkg;  // key granules (kinfo's row length)
  int qt0, nq, iters, rot;
  __device__ __forceinline__ FusedSchedule(int kt_, int nkt_, int nqt_, int grp_, int off_, bool causal_,
                                           int win_ = -1, const int4* kinfo_ = nullptr, int nkg_ = 0)
      : kt(kt_), nkt(nkt_), nqt(nqt_), grp(grp_), off(off_), causal(causal_), win(win_), kinfo(kinfo_), nkg(nkg_) {
    int qt1;
    range_of(kt, &qt0, &qt1);
    nq = qt1 > qt0 ? qt1 - qt0 : 0;
    iters = nq * grp;
    rot = fused_rot(kt, nkt, iters, causal);
  }
  // segment ids: the query tiles [t0, t1) of the hull of key block x's granules (t0 >= t1: none)
  __device__ __forceinline__ void seg_tiles(int x, int* t0, int* t1) const {
    constexpr int per = kWgBwdKeys / kSegGranule;
    int z, w;
    seg_hull(kinfo, int64_t(x) * per, min(int64_t(nkg), int64_t(x + 1) * per), &z, &w);
    *t0 = z < w ? z * kSegGranule / BQ : nqt;
    *t1 = z < w ? (w * kSegGranule + BQ - 1) / BQ : 0;
  }
  // The query tiles [qt0, qt1) of key block x (qt0 >= qt1: none): key_block_tiles, and with
  // segment ids inside the block's hull (one table read a call: rank and contributors call it once
  // a key block).
  __device__ __forceinline__ void range_of(int x, int* qt0_, int* qt1_) const {
    int t0, t1;
    key_block_tiles<int>(x, kWgBwdKeys, BQ, nqt, causal, off, win, &t0, &t1);
    if (kinfo != nullptr) {
      int s0, s1;
      seg_tiles(x, &s0, &s1);
      t0 = max(t0, s0);
      t1 = min(t1, s1);
    }
    *qt0_ = t0;
    *qt1_ = t1;
  }
  // the item of step m
  __device__ __forceinline__ void item(int m, int* hl, int* t) const {
    int idx = m + rot;
    if (idx >= iters) idx -= iters;
    *hl = idx / nq;
    *t = qt0 + idx % nq;
  }
  // The rank of this block's item of step m (hl, t) among the contributors of tile t of head hl:
  // the key blocks x that visit it at a step xm with (xm, x) < (m, kt). Warp-collective (all 32
  // lanes, one key block a lane per pass); every lane returns the rank.
  __device__ __forceinline__ int rank(int m, int hl, int t, int lane) const {
    int r = 0;
    for (int x0 = 0; x0 < nkt; x0 += 32) {
      const int x = x0 + lane;
      bool before = false;
      int xq0 = 0, xq1 = 0;
      if (x < nkt) range_of(x, &xq0, &xq1);
      if (xq0 <= t && t < xq1) {  // x visits t
        const int xnq = xq1 - xq0, xit = xnq * grp;
        int xm = hl * xnq + (t - xq0) - fused_rot(x, nkt, xit, causal);
        if (xm < 0) xm += xit;
        before = x != kt && (xm < m || (xm == m && x < kt));
      }
      r += __popc(__ballot_sync(0xffffffffu, before));
    }
    return r;
  }
  // The number of key blocks that visit query tile t (of any head of the group): the value its
  // semaphore holds once every partial of the tile is summed. Warp-collective, as rank.
  __device__ __forceinline__ int contributors(int t, int lane) const {
    int n = 0;
    for (int x0 = 0; x0 < nkt; x0 += 32) {
      const int x = x0 + lane;
      int xq0 = 0, xq1 = 0;
      if (x < nkt) range_of(x, &xq0, &xq1);
      n += __popc(__ballot_sync(0xffffffffu, xq0 <= t && t < xq1));
    }
    return n;
  }
};

// The converter blocks of a fused backward grid (tickets kbw and up, after the kbw key blocks):
// dq = scale * dQacc, tile by tile, each tile once all its partials are summed. A warp takes the
// next tile u = (b H + h) nqt + t from the counter *next (u increasing: the order the (batch, kv
// head) groups start in, so the tiles of finished groups come first), waits until the tile's
// semaphore equals its contributor count (ld.acquire; a tile no key block visits, causal rows that
// see no key or Sk = 0, has count 0 and gets dq = 0 without reading dQacc), and converts its
// min(BQ, Sq - t BQ) rows: dQacc [B, H, Sq, D] f32 (16-byte chunks permuted, fused_chunk) -> dq
// [B, Sq, H, D] in T, kBatch 16-byte loads a lane in flight. A converter block starts only once
// every key block has started (tickets are taken in start order) and no key block waits on a
// converter, so the deadlock-freedom argument of the header is unchanged; the converters take SMs
// the key blocks no longer need (the last wave's idle SMs) instead of a separate kernel after them
// (B4 S4096 H16 D128 bf16: 66 us on an H100).
template <typename T, int D, int BQ>
__device__ __forceinline__ void fused_convert_tiles(const AttnArgs& a, int nkt, int nqt, int grp, bool causal, int win,
                                                    const float* __restrict__ dqacc, const uint32_t* sem,
                                                    uint32_t* next, T* __restrict__ dq) {
  const int nkg = fused_key_granules(a);
  constexpr int kRowChunks = D / 4, kPerLane = BQ * kRowChunks / 32, kBatch = 16;
  static_assert(kPerLane % kBatch == 0, "fused_convert_tiles: whole batches");
  const int lane = threadIdx.x & 31;
  const int64_t ntiles = a.B * a.H * int64_t(nqt);
  for (;;) {
    int64_t u = 0;
    if (lane == 0) u = atomicAdd(next, 1u);
    u = __shfl_sync(0xffffffffu, u, 0);
    if (u >= ntiles) return;
    const int t = int(u % nqt);
    const int64_t bh = u / nqt, h = bh % a.H, b = bh / a.H, i0 = int64_t(t) * BQ;
    // the tile's visits (any block's schedule: kt 0; at least one key block, for the constructor's
    // division; Sk = 0, no key block, is nkt 0 here; segment ids: the tile's batch's)
    const FusedSchedule<BQ> tsch(0, max(nkt, 1), nqt, grp, int(a.off), causal, win, fused_kinfo(a, b), nkg);
    const int need = nkt > 0 ? tsch.contributors(t, lane) : 0;
    // (backing off to 1 us: up to a warp a tile polls, in the tail, while the last key blocks
    // still send their partials through L2)
    if (need > 0 && lane == 0)
      for (unsigned ns = 64; ld_acquire_u32(sem + u) != uint32_t(need); ns = min(2 * ns, 1024u)) __nanosleep(ns);
    __syncwarp();  // lane 0's acquire, then every lane's reads
    const int rows = int(min(int64_t(BQ), a.Sq - i0));
    const float* src = dqacc + (bh * a.Sq + i0) * D;
    T* dst = dq + ((b * a.Sq + i0) * a.H + h) * D;
#pragma unroll 1
    for (int p = 0; p < kPerLane; p += kBatch) {
      float4 f[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int e = lane + 32 * (p + j), r = e / kRowChunks, c = e % kRowChunks;
        f[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (need > 0 && r < rows)
          f[j] = *reinterpret_cast<const float4*>(src + r * D + 4 * fused_chunk(c, i0 + r));
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int e = lane + 32 * (p + j), r = e / kRowChunks, c = e % kRowChunks;
        if (r < rows) {
          uint2 o;
          o.x = pack2<T>(f[j].x * a.scale, f[j].y * a.scale);
          o.y = pack2<T>(f[j].z * a.scale, f[j].w * a.scale);
          *reinterpret_cast<uint2*>(dst + int64_t(r) * a.H * D + 4 * c) = o;
        }
      }
    }
  }
}

// CAP: a softcap c > 0 (bwd_probs; the launcher takes CAP for a.softcap > 0 only). MASK 1: a key mask
// [B, Sk] (a.mask); 2: a sliding window (mask kind 2), a key mask optional (the window's code is
// compiled at 2 only: mask_level in attention_launch_impl.cuh). The block's keys are fixed,
// so with a key mask each thread reads its two keys' mask values once (bwd_kept_keys) and a warp
// with a hidden key masks every tile; a window bounds the block's query tiles (FusedSchedule) and
// masks the tiles its lower edge crosses (BwdTileMask::lo). MASK 3: segment ids
// (attention_segments.cuh), a key mask and a window optional: the block's query tiles are bounded by
// its keys' hull (FusedSchedule) and an item whose ids hide a score takes the positional test with
// the item's SegTile.
template <typename T, int D, bool CAP = false, int MASK = 0>
__global__ void __launch_bounds__(kWgBwdThreads, 1)
    wgmma_fused_bwd_kernel(AttnArgs a, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                           T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dqacc,
                           uint32_t* __restrict__ sem, uint32_t* __restrict__ ticket, T* __restrict__ dq,
                           FusedSplit fs) {
#if RLX_ATTN_WGMMA
  static_assert(D == 64 || D == 128, "wgmma_fused_bwd_kernel: head dim 64 or 128");
  constexpr int BK = kWgBwdKeys, BQ = fused_rows(D), NT = kWgBwdThreads;
  // dQ = dS K split over the warpgroups by query rows (BQ 128: warpgroup w rows [64 w, 64 w + 64),
  // all D columns) or by columns (BQ 64: all rows, columns [D/2 w, D/2 w + D/2))
  constexpr bool ROWS = BQ == 128;
  constexpr int DH = ROWS ? D : D / 2;  // dQ columns of a warpgroup
  static_assert(DH == 64, "wgmma_fused_bwd_kernel: dQ as m64n64 products (wgmma_ss_tt)");
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  const uint32_t pad = (1024u - (smem_addr(wg_smem) & 1023u)) & 1023u;
  T* Ks = reinterpret_cast<T*>(wg_smem + pad);  // [D / 64][BK][64]
  T* Vs = Ks + BK * D;                            // [D / 64][BK][64]
  T* Qs = Vs + BK * D;                            // [2][D / 64][BQ][64]
  T* Gs = Qs + 2 * BQ * D;                        // dO, [2][D / 64][BQ][64]
  T* Ss = Gs + 2 * BQ * D;                        // dS^T [BQ / 64][BK][64] (128-byte swizzle)
  float* Ps = reinterpret_cast<float*>(Ss + BK * BQ);  // dQ partials [2][BQ][D], chunks permuted
  float* Ls = Ps + 2 * BQ * D;                          // [2][BQ], log2 units
  float* Dl = Ls + 2 * BQ;                              // [2][BQ]
  int* Rc = reinterpret_cast<int*>(Dl + 2 * BQ);        // [0] = ticket
  int* Rk = Rc + 4;                                      // [kFusedRankChunk] ranks (fill_ranks)
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  if (threadIdx.x == 0) Rc[0] = int(atomicAdd(ticket, 1u));
  __syncthreads();
  const int nkt = int((a.Sk + BK - 1) / BK);
  // grp: the query heads of this block (of its split of the kv head's group)
  const int off = int(a.off), sq = int(a.Sq), sk = int(a.Sk), grp = int(a.group) / fs.n;
  const bool causal = a.kind != 0;
  const int nqt = (sq + BQ - 1) / BQ;
  // the sliding window (MASK 2 and 3 only; -1: none)
  const int win = MASK >= 2 && a.kind == 2 ? int(min(a.window, int64_t(1) << 30)) : -1;
  if (Rc[0] >= int64_t(nkt) * fs.n * a.Hkv * a.B) {  // a converter block (the header)
    fused_convert_tiles<T, D, BQ>(a, nkt, nqt, grp, causal, win, dqacc, sem, ticket + 1, dq);
    return;
  }
  int kt, sp;
  int64_t hk, b;
  fused_block(a, nkt, fs.n, Rc[0], &kt, &sp, &hk, &b);
  const int64_t h0 = hk * a.group + int64_t(sp) * grp;  // the block's first query head
  const int64_t k0 = int64_t(kt) * BK;
  const int kw0 = int(k0) + 64 * wg;
  const int jw = kw0 + 16 * warp;
  const int64_t q_rs = a.H * D, kv_rs = a.Hkv * D;
  wg_load_tile<T, D, BK, NT>(Ks, k + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  wg_load_tile<T, D, BK, NT>(Vs, v + (b * a.Sk * a.Hkv + hk) * D, kv_rs, k0, a.Sk);
  const FusedSchedule<BQ> sch(kt, nkt, nqt, grp, off, causal, win, MASK == 3 ? fused_kinfo(a, b) : nullptr,
                              fused_key_granules(a));
  const int iters = sch.iters;
  auto item = [&](int m, int* hl, int* t) { sch.item(m, hl, t); };
  // stage(m, bf): item m's Q / dO tiles into buffer bf (cp.async) and its lse / delta rows into
  // registers (row_l, row_d: thread i < BQ holds row i); put_rows(bf) stores those into Ls / Dl.
  // The loop stores them late in the iteration (before its middle barrier), so a warp does not wait
  // for the global loads before it issues the item's first products: H100, D 64 backward alone, 3
  // alternating rounds against the stores at the top, 1.011-1.017x without a mask, 0.997-1.045x causal.
  float row_l = INFINITY, row_d = 0.f;
  auto stage = [&](int m, int bf) {
    int hl, t;
    item(m, &hl, &t);
    const int64_t h = h0 + hl, i0 = int64_t(t) * BQ;
    wg_load_tile<T, D, BQ, NT>(Qs + bf * BQ * D, q + (b * a.Sq * a.H + h) * D, q_rs, i0, a.Sq);
    wg_load_tile<T, D, BQ, NT>(Gs + bf * BQ * D, dout + (b * a.Sq * a.H + h) * D, q_rs, i0, a.Sq);
    if (threadIdx.x < BQ) {
      const int64_t i = i0 + threadIdx.x;
      row_l = INFINITY;
      row_d = 0.f;
      if (i < a.Sq) {
        row_l = lse[(b * a.H + h) * a.Sq + i];
        row_d = delta[(b * a.H + h) * a.Sq + i];
      }
    }
  };
  auto put_rows = [&](int bf) {
    if (threadIdx.x < BQ) {
      Ls[bf * BQ + threadIdx.x] = (row_l == -INFINITY ? INFINITY : row_l) * kLog2e;  // dead row: P = 0
      Dl[bf * BQ + threadIdx.x] = row_d;
    }
  };
  if (iters > 0) {
    stage(0, 0);
    put_rows(0);
  }
  cp_async_commit();
  // raw score -> log2 units: S c2, or with CAP c2 tanh(S carg)
  const float c2 = CAP ? a.softcap * kLog2e : a.scale * kLog2e, carg = CAP ? a.scale / a.softcap : 0.f;
  float dka[D / 8][4], dva[D / 8][4];
  zero(dka);
  zero(dva);
  bool warp_hides = false;  // MASK: a key of this warp's 16 is hidden by the key mask
  const uint32_t kept = MASK && a.mask != nullptr ? bwd_kept_keys(a.mask + b * a.Sk, jw + g, sk, &warp_hides) : 3u;
  // MASK 3: the ids of this thread's keys jw + g (+ 8), and of the item's queries (lane l: i0 + 32 w + l)
  constexpr int WQ = MASK == 3 ? BQ / 32 : 1;
  int qid[WQ];
  SegRows skeys{};
  if constexpr (MASK == 3) skeys = seg_rows(a.kseg + b * a.Sk, a.Sk, jw + g);
  const uint64_t kdsc = wg_desc(smem_addr(Ks) + uint32_t(wg * 64 * 128), 16, 1024);
  const uint64_t vdsc = wg_desc(smem_addr(Vs) + uint32_t(wg * 64 * 128), 16, 1024);
  // dQ operands: dS^T (A, MN-major: 64 queries = one 128-byte row per key, 8-key groups 1024 bytes
  // apart; ROWS: this warpgroup's 64 queries, block wg of Ss) and K (B, MN-major, the same strides;
  // not ROWS: this warpgroup's column half, columns [DH wg, DH wg + DH) starting in 64-column block
  // DH wg / 64 at byte 2 (DH wg % 64) of its rows; the hardware swizzles the computed address, so
  // the descriptor may start inside the swizzle atom's row as the K-major k-steps do)
  const uint32_t saddr = smem_addr(Ss);
  const uint64_t sdt = wg_desc(saddr + (ROWS ? uint32_t(wg * BK * 128) : 0u), BK * 128, 1024);
  const int kcol = ROWS ? 0 : DH * wg;
  const uint64_t kdq = wg_desc(smem_addr(Ks) + uint32_t((kcol / 64) * BK * 128 + 2 * (kcol % 64)), BK * 128, 1024);
  uint8_t* const srow = reinterpret_cast<uint8_t*>(Ss);
  // Ordered dQ sums through the TMA engine, pipelined over the loop (item m's partial is in
  // Ps[m & 1] from the end of iteration m), by thread kFusedSender:
  //   iteration m + 1, after its first MMAs are issued (send): wait until item m's tile semaphore
  //     equals its rank, then send the partial's rows below Sq as one bulk operation: a copy for
  //     rank 0 (dQacc needs no zeroing), an add (f32, at L2) for the others;
  //   iteration m + 1, after its dQ product is issued (finish): wait for the bulk group (the sums
  //     performed, Ps[m & 1] read), release the tile (st.release rank + 1);
  //   Ps[m & 1] is written again at the end of iteration m + 2, after the barriers that follow.
  // No membar.gl (__threadfence) before the release: a build with one ran 1.13x slower (fwd+bwd,
  // H100); wait_group 0 has performed the sums, and the proxy fence orders them before
  // the generic-proxy release. After the loop: send the last item, wait, release.
  // dq = scale * dQacc is written by the grid's converter blocks (fused_convert_tiles).
  int p_rank = -1, p_i0 = 0, p_buf = 0;  // the pending item (its partial in Ps[p_buf])
  int64_t p_h = 0;
  uint32_t* p_sem = nullptr;
  auto send = [&]() {
    if (p_rank < 0 || threadIdx.x != kFusedSender) return;
    if (p_rank > 0)
      while (ld_acquire_u32(p_sem) != uint32_t(p_rank)) __nanosleep(32);
    fence_proxy_async_global();  // the acquired sums, then this thread's bulk add
    const uint32_t src = smem_addr(Ps + p_buf * BQ * D), bytes = uint32_t(min(BQ, sq - p_i0) * D * 4);
    float* dst = dqacc + ((b * a.H + p_h) * a.Sq + p_i0) * D;
    if (p_rank == 0)
      bulk_store_f32(dst, src, bytes);
    else
      bulk_add_f32(dst, src, bytes);
    bulk_commit();
  };
  auto finish = [&]() {
    if (p_rank < 0 || threadIdx.x != kFusedSender) return;
    bulk_wait_all();
    fence_proxy_async_global();
    st_release_u32(p_sem, uint32_t(p_rank + 1));
  };
  // ranks of items [m0, m0 + kFusedRankChunk) (this block among the contributors of the item's
  // tile, ordered by (step, kt)) into Rk: warp w takes items m0 + w, m0 + w + 8, ...; called by
  // every thread at iterations m0 = 0, kFusedRankChunk, ... after the first MMAs are issued (the
  // writes follow the top barrier, the last reads of the previous chunk precede it); read by the
  // sender after the middle barrier. (With warp 4 computing each item's rank in its iteration,
  // the backward without any rank work ran 1.04x faster, H200.)
  auto fill_ranks = [&](int m0) {
    for (int j = threadIdx.x >> 5; j < kFusedRankChunk && m0 + j < iters; j += NT / 32) {
      int hl, t;
      item(m0 + j, &hl, &t);
      const int rank = sch.rank(m0 + j, hl, t, lane);
      if (lane == 0) Rk[j] = rank;
    }
  };
  int buf = 0;
  for (int m = 0; m < iters; ++m, buf ^= 1) {
    int hl, t;
    item(m, &hl, &t);
    const int i0 = t * BQ;
    const int64_t h = h0 + hl;
    if constexpr (MASK == 3) seg_load(qid, a.qseg + b * a.Sq, i0, a.Sq, skeys.uni, lane);
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // tiles landed; both warpgroups done with buf ^ 1 and Ss; Ps written
    if (m + 1 < iters) stage(m + 1, buf ^ 1);
    cp_async_commit();
    // Every warpgroup forms S^T, dP^T, P^T and dS^T, also one whose keys the tile does not see
    // (causal, or past Sk): the mask zeroes its P^T and dS^T (such a warp always needs the mask).
    // So no branch separates the products: dV's and dK's stay in flight through the middle
    // barrier and are waited for with dQ's (1.02-1.04x the backward that waited for them before the
    // barrier at D 128, 1.01-1.03x at D 64, none and causal: H100).
    uint32_t pa[BQ / 16][4], da[BQ / 16][4];
    const uint32_t qaddr = smem_addr(Qs + buf * BQ * D), gaddr = smem_addr(Gs + buf * BQ * D);
    float st[BQ / 8][4], dpt[BQ / 8][4];
    bwd_issue_scores<T, D, true, BQ>(st, dpt, kdsc, vdsc, qaddr, gaddr);
    SegTile sg;  // MASK 3: the ids' test of this item (while the products run)
    if constexpr (MASK == 3) sg = seg_tile<BQ / 8>(skeys, qid, tq);
    send();
    if (m % kFusedRankChunk == 0) fill_ranks(m);
    const float* Lb = Ls + buf * BQ;
    const float* Db = Dl + buf * BQ;
    // warp-uniform: the causal diagonal or the end of the keys crosses this warp's 16 keys (dS^T
    // feeds dQ, so keys past Sk are masked too), or a window's lower edge (key jw below the window
    // of the tile's last row): the positional test; else, where the key mask hides one of them, the
    // key-only one (TileHide)
    const bool pos = (causal && jw + 15 > i0 + off) || jw + 15 >= sk || (win >= 0 && jw < i0 + BQ - 1 + off - win) ||
                     (MASK == 3 && sg.need);
    const int hide = pos ? kHidePos : warp_hides ? kHideKeys : kHideNone;
    const uint64_t gdt = wg_desc(gaddr, BQ * 128, 1024), qdt = wg_desc(qaddr, BQ * 128, 1024);
    const BwdTileMask msk{jw + g, sk, causal ? i0 + off : INT_MAX, kept, win >= 0 ? i0 + off - win : INT_MIN, sg};
    bwd_dv_dk_products<T, D, BQ, CAP, MASK != 0>(st, dpt, pa, da, dva, dka, Lb, Db, c2, tq, hide, msk, gdt, qdt, carg);
    wg_commit();
    // dS^T rows of this thread (keys 64 wg + 16 warp + g (+ 8)) to shared memory: queries
    // nt * 8 + 2 tq, +1 are 4 bytes in 16-byte chunk nt % 8 of query block nt / 8, at chunk
    // position (nt % 8) ^ (row & 7)
#pragma unroll
    for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 64 * wg + 16 * warp + g + 8 * r;
        *reinterpret_cast<uint32_t*>(srow + (nt >> 3) * BK * 128 + row * 128 + (((nt & 7) ^ (row & 7)) << 4) +
                                     4 * tq) = da[nt >> 1][(nt & 1) * 2 + r];
      }
    if (m + 1 < iters) put_rows(buf ^ 1);  // the next item's lse / delta rows (read after the top barrier)
    cp_async_wait_all();  // the next Q / dO tiles
    fence_proxy_async();  // dS^T (st.shared) -> the async proxy
    __syncthreads();      // both warpgroups' dS^T rows stored; Rk written
    float dqa[DH / 8][4];
    fused_issue_dq<T>(dqa, sdt, kdq);
    finish();  // the previous item, while this tile's dQ product runs
    p_rank = Rk[m % kFusedRankChunk];
    p_i0 = i0;
    p_h = h;
    p_buf = buf;
    p_sem = sem + (b * a.H + h) * nqt + t;
    wg_wait0();
    wg_fence_regs(dqa);
    wg_fence_regs(dva);  // and dV's and dK's products (in flight since before the barrier)
    wg_fence_regs(dka);
    wg_fence_afrag(pa);
    wg_fence_afrag(da);
    // this thread's dQ rows r0 + 16 warp + g (+ 8) (r0 = 64 wg where ROWS, else 0) into Ps[buf]
    // (sent by iteration m + 1's send, after the barrier at its top)
    fused_store_partial<D, DH>(Ps + buf * BQ * D, dqa, (ROWS ? 64 * wg : 0) + 16 * warp + g, kcol, g, tq);
    fence_proxy_async();  // Ps (st.shared) -> the async proxy (the bulk ops)
  }
  // the last item
  __syncthreads();
  send();
  finish();
  cp_async_wait_all();
  if (fs.n > 1 && !fused_split_sum<D>(dka, dva, fs, (b * a.Hkv + hk) * nkt + kt, sp, int(threadIdx.x), Rc + 1,
                                      [] { __syncthreads(); }))
    return;
  store_dk_dv<T, D>(a, dka, dva, dk, dv, (b * a.Sk) * a.Hkv + hk, jw + g, tq);
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
