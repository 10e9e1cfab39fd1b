// Tensor memory accelerator (TMA, sm_90) loads of row tiles of a [B, S, H, D] tensor (bf16 / f16):
// the host encodes a tensor map, a kernel copies boxes of `rows` rows x 64 columns of one (b, h)
// into shared memory in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7) of
// the row's 128 bytes, atoms of 8 rows = 1024 bytes, 1024-byte aligned): the layout of
// wg_load_tile (attention_wgmma.cuh), which the wgmma descriptors read. One thread issues a whole
// tile; it lands as transactions on an mbarrier (complete_tx), so the consumers need no proxy
// fence (the copy is an async-proxy write), and rows past S are zero-filled by the hardware, as
// wg_load_tile's zero fill. Compiled only for sm_90a device code (RLX_ATTN_WGMMA) and host code.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the driver call goes through the runtime)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention_wgmma.cuh"

namespace rlx {
namespace cuda {
namespace attn {

// The tensor maps of the forward's Q and K / V (kernel parameter: __grid_constant__, so the
// kernel may take the maps' addresses, which the TMA instructions need).
struct TileMaps {
  CUtensorMap q, k, v;
};

// Host: a tensor map over x [B, S, H, D] (2-byte elements, D a multiple of 64, H * D * 2 bytes a
// row), boxes of `rows` rows x 64 columns of one head. Dimensions fastest first: D, H, S, B, so a
// box (64, 1, rows, 1) is `rows` consecutive 128-byte rows in shared memory. False when the driver
// has no tensor maps or rejects the arguments (x not 16-byte aligned, say): the caller then loads
// with cp.async (same layout, same values).
inline bool encode_rows_map(CUtensorMap* map, const void* x, bool bf16, int64_t B, int64_t S, int64_t H, int64_t D,
                            int rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr || D % 64 != 0 || rows < 1 || rows > 256 || B < 1 || S < 1 || H < 1) return false;
  const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(H), cuuint64_t(S), cuuint64_t(B)};
  // byte strides of dimensions 1..3 (dimension 0 is contiguous)
  const cuuint64_t strides[3] = {cuuint64_t(D) * 2, cuuint64_t(H * D) * 2, cuuint64_t(S * H * D) * 2};
  const cuuint32_t box[4] = {64, 1, cuuint32_t(rows), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(x), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Device: rows r0 .. r0 + ROWS - 1 of head h, batch b, all D columns, into dst [D / 64][ROWS][64]
// (1024-byte aligned): announces the tile's ROWS * D * sizeof(T) bytes to `bar` (its one arrival,
// mbarrier.arrive.expect_tx) and issues the copies, which complete as transactions on it. Rows at
// or past S arrive as zeros.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void tma_load_rows(T* dst, const CUtensorMap* map, int64_t h, int64_t r0, int64_t b,
                                              uint64_t* bar) {
#if RLX_ATTN_WGMMA
  mbar_arrive_expect_tx(bar, uint32_t(ROWS) * D * sizeof(T));
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];" ::"r"(smem_addr(dst + c * ROWS * 64)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(64 * c), "r"(int(h)), "r"(int(r0)), "r"(int(b)), "r"(smem_addr(bar))
        : "memory");
#endif
}

}  // namespace attn
}  // namespace cuda
}  // namespace rlx
