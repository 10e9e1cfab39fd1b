// XLA FFI handlers for NeoX rotary position embedding on CUDA: targets rlx_rope_fwd,
// rlx_rope_bwd, rlx_rope_split and rlx_rope_merge, with the operands, attributes and semantics of
// the CPU handlers (ffi/cpu/rope.cc, rlx_jax/vjp_rules/rope.py):
//
//   x, y: [B, S, W = H * head_dim]; cos, sin: [S, T] with T >= n_rot / 2 (x's dtype)
//   per head, half = n_rot / 2, i < half, c = cos[s, i], t = sign * sin[s, i]:
//     y[i] = x[i] c - x[half + i] t,  y[half + i] = x[half + i] c + x[i] t,
//     y[j] = x[j] for n_rot <= j < head_dim;   sign = +1 forward, -1 backward.
//   rope_split: x [B, S, W] -> parts [B, S, W_p] (sum W_p = W, whole heads), each part's heads
//     rotated (sign +1) where bit p of rotate_mask is set, else copied; rope_merge: the transpose,
//     parts -> x with sign -1 (a query / key / value projection's packed output and gradient).
//
// Work layout: a row (b, s) of W values splits into "items" of VEC consecutive elements: per head,
// half / VEC pair items (item k reads x[kV..], x[half + kV..] and writes both) followed by the copy
// items of the pass-through part, two vectors each (rope_k; faster than one vector per copy item in an
// H200 A/B). VEC is the widest power of two (at most 16 bytes) dividing half, head_dim, the table
// width and the row strides with every buffer 16-byte aligned; else narrower, down to scalars. A
// block is TX x TY threads: threadIdx.y picks a row of the block's TY rows, threadIdx.x strides over
// the row's items; blocks stride over row groups. Each output element is written by exactly one
// thread with the same arithmetic every run (no reductions): deterministic. f32 math for
// f32/bf16/f16, f64 for f64. Nothing is allocated; kernels run on XLA's stream.

#include "cuda/common.cuh"
#include <string>
#include <vector>

#include "rope_checks.h"

namespace rlx {
namespace cuda {
namespace {

// The heads a launch moves: up to kMaxRopeParts parts, each a run of whole heads read from
// `in` and written to `out`, both [rows, *] with their own row strides (in elements). Part p
// holds the packed row's heads [head_end[p - 1], head_end[p]); bit p of rotate_mask says
// whether it rotates or is copied unchanged. rope / rope_backward are one part (x -> y, the
// row's width as both strides); rope_split reads parts of one packed row (x + offset, the
// packed width as the input stride) into separate outputs, rope_merge the reverse.
constexpr int kMaxRopeParts = rope::kMaxParts;

template <typename T>
struct RopeParts {
  const T* in[kMaxRopeParts];
  T* out[kMaxRopeParts];
  int64_t in_stride[kMaxRopeParts];
  int64_t out_stride[kMaxRopeParts];
  int head_end[kMaxRopeParts];
  int count;
  unsigned rotate_mask;
};

// Balanced layout: every item moves two vectors. Per head, half / VEC pair
// items (as above) then ceil(Pv / 2) copy items, Pv = (head_dim - n_rot) / VEC: copy item
// k copies vectors k and k + ceil(Pv / 2) of the pass-through part (the second only when
// it exists). All lanes issue their two x loads from the same instructions (no branch
// between the pair and the copy case around the loads: with one vector per copy item a
// warp mixing both ran them one after the other), the pair lanes of a rotating part add the
// cos / sin loads, and the copy lanes (and every lane of a part that does not rotate: its pair
// items move the same two vectors unchanged) store the loaded packs unchanged (exact
// pass-through). With hd 128, rot 64, bf16: 8 items a head, 256 a row, one per thread of a
// 256-thread block (one vector per copy item made 12 items of unequal size: 384 a row, half
// the threads of a block doing two).
template <typename T, int VEC>
__global__ void __launch_bounds__(256) rope_k(const RopeParts<T> parts, const T* __restrict__ cs,
                                              const T* __restrict__ sn, int64_t rows, int64_t seq,
                                              int64_t table_w, int head_dim, int half, int n_rot,
                                              int items_per_head, int items_per_row, int copy_vecs, bool backward) {
  using A = acc_t<T>;
  using P = Pack<T, VEC>;
  const int pair_items = half / VEC;
  const int copy_half = (copy_vecs + 1) / 2;
  const int64_t row_step = int64_t(gridDim.x) * blockDim.y;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += row_step) {
    const int64_t s = row % seq;
    const T* cr = cs + s * table_w;
    const T* sr = sn + s * table_w;
    for (int it = threadIdx.x; it < items_per_row; it += blockDim.x) {
      const int h = it / items_per_head;
      const int k = it - h * items_per_head;
      int p = 0;
      while (h >= parts.head_end[p]) ++p;
      const int local = h - (p > 0 ? parts.head_end[p - 1] : 0);
      const T* xr = parts.in[p] + row * parts.in_stride[p] + int64_t(local) * head_dim;
      T* yr = parts.out[p] + row * parts.out_stride[p] + int64_t(local) * head_dim;
      const bool pair = k < pair_items;
      const bool rotate = pair && ((parts.rotate_mask >> p) & 1u);
      const int kc = k - pair_items;  // copy item index (copy lanes)
      const bool second = pair || kc + copy_half < copy_vecs;
      const int ja = pair ? k * VEC : n_rot + kc * VEC;
      const int jb = pair ? ja + half : ja + copy_half * VEC;
      P a = ld_pack<T, VEC, Cache::kStream>(xr + ja);
      P b;
      if (second) b = ld_pack<T, VEC, Cache::kStream>(xr + jb);
      if (rotate) {
        const int i = k * VEC;
        const P c = ld_pack<T, VEC, Cache::kReadOnly>(cr + i);
        const P t = ld_pack<T, VEC, Cache::kReadOnly>(sr + i);
        P ya, yb;
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          const A cq = to_acc(c.v[q]);
          const A tq = backward ? -to_acc(t.v[q]) : to_acc(t.v[q]);
          const A aq = to_acc(a.v[q]), bq = to_acc(b.v[q]);
          ya.v[q] = from_acc<T>(aq * cq - bq * tq);
          yb.v[q] = from_acc<T>(bq * cq + aq * tq);
        }
        a = ya;
        b = yb;
      }
      st_pack_stream<T, VEC>(yr + ja, a);
      if (second) st_pack_stream<T, VEC>(yr + jb, b);
    }
  }
}

template <typename T, int VEC>
ffi::Error launch_vec(cudaStream_t stream, const RopeParts<T>& parts, const T* cs, const T* sn, int64_t rows,
                      int64_t seq, int64_t table_w, int64_t head_dim, int64_t n_rot, bool backward) {
  const int half = int(n_rot / 2);
  const int copy_vecs = int((head_dim - n_rot) / VEC);
  const int items_per_head = int(half / VEC + (copy_vecs + 1) / 2);
  const int64_t heads = parts.head_end[parts.count - 1];
  const int64_t items_per_row64 = heads * items_per_head;
  if (items_per_row64 > INT32_MAX) return invalid("rope (cuda): rows wider than 2^31 vectors are not supported");
  const int items_per_row = int(items_per_row64);
  if (items_per_row == 0) return ffi::Error::Success();
  int tx = 32;
  while (tx < items_per_row && tx < 256) tx *= 2;
  const int ty = 256 / tx;
  DeviceInfo info;
  if (cudaError_t e = device_info(&info); e != cudaSuccess) return cuda_error("rope (cuda): device query", e);
  const int64_t groups = (rows + ty - 1) / ty;
  // enough resident blocks to fill the device (8 of 256 threads per SM), each looping
  // over row groups
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(groups, int64_t(info.sms) * 16));
  rope_k<T, VEC><<<dim3(unsigned(blocks)), dim3(tx, ty), 0, stream>>>(
      parts, cs, sn, rows, seq, table_w, int(head_dim), half, int(n_rot), items_per_head, items_per_row, copy_vecs,
      backward);
  return check_launch("rope (cuda): kernel launch");
}

// VEC: the widest power of two (at most 16 bytes) dividing half, head_dim, the table width
// and every row stride, with every pointer aligned to it.
template <typename T>
ffi::Error launch(cudaStream_t stream, const RopeParts<T>& parts, const T* cs, const T* sn, int64_t rows,
                  int64_t seq, int64_t table_w, int64_t head_dim, int64_t n_rot, bool backward) {
  const int64_t half = n_rot / 2;
  auto fits = [&](int vec) {
    const int bytes = vec * int(sizeof(T));
    bool ok = (half % vec == 0) && (head_dim % vec == 0) && (table_w % vec == 0) && aligned_to(cs, bytes) &&
              aligned_to(sn, bytes);
    for (int p = 0; p < parts.count; ++p)
      ok = ok && parts.in_stride[p] % vec == 0 && parts.out_stride[p] % vec == 0 && aligned_to(parts.in[p], bytes) &&
           aligned_to(parts.out[p], bytes);
    return ok;
  };
  constexpr int kMax = 16 / int(sizeof(T));
  if constexpr (kMax >= 8) {
    if (fits(8)) return launch_vec<T, 8>(stream, parts, cs, sn, rows, seq, table_w, head_dim, n_rot, backward);
  }
  if constexpr (kMax >= 4) {
    if (fits(4)) return launch_vec<T, 4>(stream, parts, cs, sn, rows, seq, table_w, head_dim, n_rot, backward);
  }
  if constexpr (kMax >= 2) {
    if (fits(2)) return launch_vec<T, 2>(stream, parts, cs, sn, rows, seq, table_w, head_dim, n_rot, backward);
  }
  return launch_vec<T, 1>(stream, parts, cs, sn, rows, seq, table_w, head_dim, n_rot, backward);
}

// The parts of a call: `packed` is the buffer holding every head in one row (x of rope and
// rope_split, the result of rope_merge), `pieces` the per-part buffers (rope: y itself, one
// part). split: packed -> pieces; otherwise pieces -> packed (merge) or packed -> y (rope).
template <typename T>
RopeParts<T> make_parts(void* packed, const std::vector<void*>& pieces, const rope::PartsShape& sh,
                        bool packed_is_input) {
  RopeParts<T> parts{};
  parts.count = int(pieces.size());
  parts.rotate_mask = unsigned(sh.rotate_mask);
  int64_t heads = 0;
  for (int p = 0; p < parts.count; ++p) {
    T* packed_at = static_cast<T*>(packed) + heads * sh.head_dim;
    T* piece = static_cast<T*>(pieces[p]);
    heads += sh.widths[p] / sh.head_dim;
    parts.head_end[p] = int(heads);
    parts.in[p] = packed_is_input ? packed_at : piece;
    parts.out[p] = packed_is_input ? piece : packed_at;
    parts.in_stride[p] = packed_is_input ? sh.width : sh.widths[p];
    parts.out_stride[p] = packed_is_input ? sh.widths[p] : sh.width;
  }
  return parts;
}

ffi::Error run(cudaStream_t stream, ffi::DataType dtype, void* packed, const std::vector<void*>& pieces,
               const void* cos, const void* sin, const rope::PartsShape& sh, bool packed_is_input, bool backward) {
  if (sh.head_dim > INT32_MAX) return invalid("rope (cuda): head_dim must be < 2^31");
  if (sh.width / sh.head_dim > INT32_MAX) return invalid("rope (cuda): more than 2^31 heads in a row");
  if (sh.batch == 0 || sh.seq == 0 || sh.width == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch<true>(dtype, [&](auto tag) {
    using T = decltype(tag);
    result = launch<T>(stream, make_parts<T>(packed, pieces, sh, packed_is_input), static_cast<const T*>(cos),
                       static_cast<const T*>(sin), sh.batch * sh.seq, sh.seq, sh.table_width, sh.head_dim, sh.n_rot,
                       backward);
  });
  if (!ok) return invalid("rope: unsupported dtype " + dtype_name(dtype));
  return result;
}

// Operands checked as on the CPU (rope_checks.h), plus the CUDA kernels' 32-bit head_dim.
ffi::Error RopeImpl(cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& cos,
                    const ffi::AnyBuffer& sin, ffi::Result<ffi::AnyBuffer>& y, int64_t head_dim, int64_t n_rot,
                    bool backward) {
  rope::Shape sh{};
  if (auto e = rope::check(x, cos, sin, *y, head_dim, n_rot, sh); e.failure()) return e;
  const rope::PartsShape parts = rope::single_part(sh, head_dim, n_rot);
  return run(stream, x.element_type(), x.untyped_data(), {y->untyped_data()}, cos.untyped_data(), sin.untyped_data(),
             parts, true, backward);
}

ffi::Error RopeFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                       ffi::Result<ffi::AnyBuffer> y, int64_t head_dim, int64_t n_rot) {
  return RopeImpl(stream, x, cos, sin, y, head_dim, n_rot, false);
}

ffi::Error RopeBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                       ffi::Result<ffi::AnyBuffer> dx, int64_t head_dim, int64_t n_rot) {
  return RopeImpl(stream, dy, cos, sin, dx, head_dim, n_rot, true);
}

// rope_split: (x [B, S, W], cos, sin) -> parts [B, S, W_p], the rotating ones by +theta.
ffi::Error RopeSplitImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                         ffi::RemainingRets outs, int64_t head_dim, int64_t n_rot, int64_t rotate_mask) {
  rope::PartsShape sh{};
  std::vector<void*> ptrs;
  if (auto e = rope::gather_parts(outs, x, cos, sin, head_dim, n_rot, rotate_mask, sh, ptrs); e.failure()) return e;
  return run(stream, x.element_type(), x.untyped_data(), ptrs, cos.untyped_data(), sin.untyped_data(), sh, true,
             false);
}

// rope_merge, rope_split's transpose: (cos, sin, parts [B, S, W_p]) -> x [B, S, W], the
// rotating parts by -theta.
ffi::Error RopeMergeImpl(cudaStream_t stream, ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::RemainingArgs ins,
                         ffi::Result<ffi::AnyBuffer> x, int64_t head_dim, int64_t n_rot, int64_t rotate_mask) {
  rope::PartsShape sh{};
  std::vector<void*> ptrs;
  if (auto e = rope::gather_parts(ins, *x, cos, sin, head_dim, n_rot, rotate_mask, sh, ptrs); e.failure()) return e;
  return run(stream, x->element_type(), x->untyped_data(), ptrs, cos.untyped_data(), sin.untyped_data(), sh, false,
             true);
}

}  // namespace

#define RLX_ROPE_CUDA_BINDING                        \
  ffi::Ffi::Bind()                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
      .Arg<ffi::AnyBuffer>()  /* x (dy)  */          \
      .Arg<ffi::AnyBuffer>()  /* cos */              \
      .Arg<ffi::AnyBuffer>()  /* sin */              \
      .Ret<ffi::AnyBuffer>()  /* y (dx) */           \
      .Attr<int64_t>("head_dim")                     \
      .Attr<int64_t>("n_rot")

// Command-buffer compatible: one launch on XLA's stream whose shape depends on the
// buffer shapes, their alignment and the device alone.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeFwdCuda, RopeFwdImpl, RLX_ROPE_CUDA_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeBwdCuda, RopeBwdImpl, RLX_ROPE_CUDA_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_rope_fwd", RlxRopeFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_rope_bwd", RlxRopeBwdCuda);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeSplitCuda, RopeSplitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // cos
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .RemainingRets()        // parts
                                  .Attr<int64_t>("head_dim")
                                  .Attr<int64_t>("n_rot")
                                  .Attr<int64_t>("rotate_mask"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeMergeCuda, RopeMergeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // cos
                                  .Arg<ffi::AnyBuffer>()  // sin
                                  .RemainingArgs()        // parts
                                  .Ret<ffi::AnyBuffer>()  // x
                                  .Attr<int64_t>("head_dim")
                                  .Attr<int64_t>("n_rot")
                                  .Attr<int64_t>("rotate_mask"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_rope_split", RlxRopeSplitCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_rope_merge", RlxRopeMergeCuda);

}  // namespace cuda
}  // namespace rlx
