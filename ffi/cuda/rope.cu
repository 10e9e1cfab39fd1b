// XLA FFI handlers for NeoX rotary position embedding on CUDA: targets rlx_rope_fwd and
// rlx_rope_bwd, with the operands, attributes and semantics of the CPU handlers
// (ffi/cpu/rope.cc, rlx_jax/vjp_rules/rope.py):
//
//   x, y: [B, S, W = H * head_dim]; cos, sin: [S, T] with T >= n_rot / 2 (x's dtype)
//   per head, half = n_rot / 2, i < half, c = cos[s, i], t = sign * sin[s, i]:
//     y[i] = x[i] c - x[half + i] t,  y[half + i] = x[half + i] c + x[i] t,
//     y[j] = x[j] for n_rot <= j < head_dim;   sign = +1 forward, -1 backward.
//
// Work layout: a row (b, s) of W values splits into "items" of VEC consecutive elements: per head,
// half / VEC pair items (item k reads x[kV..], x[half + kV..] and writes both) followed by the copy
// items of the pass-through part, two vectors each (rope_k; faster than one vector per copy item in an
// H200 A/B). VEC is the widest
// power of two (at most 16 bytes) dividing half, head_dim and the table width with all four buffers
// 16-byte aligned; else narrower, down to scalars. A block is TX x TY threads: threadIdx.y picks a
// row of the block's TY rows, threadIdx.x strides over the row's items; blocks stride over row
// groups. Each output element is written by exactly one thread with the same arithmetic every run
// (no reductions): deterministic. f32 math for f32/bf16/f16, f64 for f64. Nothing is allocated;
// kernels run on XLA's stream.

#include "cuda/common.cuh"
#include "rope_checks.h"

namespace rlx {
namespace cuda {
namespace {

// Balanced layout: every item moves two vectors. Per head, half / VEC pair
// items (as above) then ceil(Pv / 2) copy items, Pv = (head_dim - n_rot) / VEC: copy item
// k copies vectors k and k + ceil(Pv / 2) of the pass-through part (the second only when
// it exists). All lanes issue their two x loads from the same instructions (no branch
// between the pair and the copy case around the loads: with one vector per copy item a
// warp mixing both ran them one after the other), the pair lanes add the cos / sin loads, and the
// copy lanes store the loaded packs unchanged (exact pass-through). With hd 128, rot 64,
// bf16: 8 items a head, 256 a row, one per thread of a 256-thread block (one vector per
// copy item made 12 items of unequal size: 384 a row, half the threads of a block doing two).
template <typename T, int VEC>
__global__ void __launch_bounds__(256) rope_k(const T* __restrict__ x, const T* __restrict__ cs,
                                              const T* __restrict__ sn, T* __restrict__ y, int64_t rows,
                                              int64_t seq, int64_t width, int64_t table_w, int head_dim,
                                              int half, int n_rot, int items_per_head, int items_per_row,
                                              int copy_vecs, bool backward) {
  using A = acc_t<T>;
  using P = Pack<T, VEC>;
  const int pair_items = half / VEC;
  const int copy_half = (copy_vecs + 1) / 2;
  const int64_t row_step = int64_t(gridDim.x) * blockDim.y;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += row_step) {
    const int64_t s = row % seq;
    const T* xr = x + row * width;
    T* yr = y + row * width;
    const T* cr = cs + s * table_w;
    const T* sr = sn + s * table_w;
    for (int it = threadIdx.x; it < items_per_row; it += blockDim.x) {
      const int h = it / items_per_head;
      const int k = it - h * items_per_head;
      const int64_t base = int64_t(h) * head_dim;
      const bool pair = k < pair_items;
      const int kc = k - pair_items;  // copy item index (copy lanes)
      const bool second = pair || kc + copy_half < copy_vecs;
      const int64_t ja = pair ? base + int64_t(k) * VEC : base + n_rot + int64_t(kc) * VEC;
      const int64_t jb = pair ? ja + half : ja + int64_t(copy_half) * VEC;
      P a = ld_pack<T, VEC, Cache::kStream>(xr + ja);
      P b;
      if (second) b = ld_pack<T, VEC, Cache::kStream>(xr + jb);
      if (pair) {
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
ffi::Error launch_vec(cudaStream_t stream, const T* x, const T* cs, const T* sn, T* y, int64_t rows,
                      int64_t seq, int64_t width, int64_t table_w, int64_t head_dim, int64_t n_rot,
                      bool backward) {
  const int half = int(n_rot / 2);
  const int copy_vecs = int((head_dim - n_rot) / VEC);
  const int items_per_head = int(half / VEC + (copy_vecs + 1) / 2);
  const int64_t heads = width / head_dim;
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
      x, cs, sn, y, rows, seq, width, table_w, int(head_dim), half, int(n_rot), items_per_head, items_per_row,
      copy_vecs, backward);
  return check_launch("rope (cuda): kernel launch");
}

template <typename T>
ffi::Error launch(cudaStream_t stream, const T* x, const T* cs, const T* sn, T* y, int64_t rows, int64_t seq,
                  int64_t width, int64_t table_w, int64_t head_dim, int64_t n_rot, bool backward) {
  const int64_t half = n_rot / 2;
  auto fits = [&](int vec) {
    const int bytes = vec * int(sizeof(T));
    return (half % vec == 0) && (head_dim % vec == 0) && (table_w % vec == 0) && aligned_to(x, bytes) &&
           aligned_to(y, bytes) && aligned_to(cs, bytes) && aligned_to(sn, bytes);
  };
  constexpr int kMax = 16 / int(sizeof(T));
  if constexpr (kMax >= 8) {
    if (fits(8)) return launch_vec<T, 8>(stream, x, cs, sn, y, rows, seq, width, table_w, head_dim, n_rot, backward);
  }
  if constexpr (kMax >= 4) {
    if (fits(4)) return launch_vec<T, 4>(stream, x, cs, sn, y, rows, seq, width, table_w, head_dim, n_rot, backward);
  }
  if constexpr (kMax >= 2) {
    if (fits(2)) return launch_vec<T, 2>(stream, x, cs, sn, y, rows, seq, width, table_w, head_dim, n_rot, backward);
  }
  return launch_vec<T, 1>(stream, x, cs, sn, y, rows, seq, width, table_w, head_dim, n_rot, backward);
}

// Operands checked as on the CPU (rope_checks.h), plus the CUDA kernels' 32-bit head_dim.
ffi::Error RopeImpl(cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& cos,
                    const ffi::AnyBuffer& sin, ffi::Result<ffi::AnyBuffer>& y, int64_t head_dim, int64_t n_rot,
                    bool backward) {
  rope::Shape sh{};
  if (auto e = rope::check(x, cos, sin, *y, head_dim, n_rot, sh); e.failure()) return e;
  if (head_dim > INT32_MAX) return invalid("rope (cuda): head_dim must be < 2^31");
  const int64_t batch = sh.batch, seq = sh.seq, width = sh.width;
  if (batch == 0 || seq == 0 || width == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch<true>(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = launch<T>(stream, static_cast<const T*>(x.untyped_data()), static_cast<const T*>(cos.untyped_data()),
                       static_cast<const T*>(sin.untyped_data()), static_cast<T*>(y->untyped_data()), batch * seq,
                       seq, width, sh.table_width, head_dim, n_rot, backward);
  });
  if (!ok) return invalid("rope: unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

ffi::Error RopeFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                       ffi::Result<ffi::AnyBuffer> y, int64_t head_dim, int64_t n_rot) {
  return RopeImpl(stream, x, cos, sin, y, head_dim, n_rot, false);
}

ffi::Error RopeBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                       ffi::Result<ffi::AnyBuffer> dx, int64_t head_dim, int64_t n_rot) {
  return RopeImpl(stream, dy, cos, sin, dx, head_dim, n_rot, true);
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

}  // namespace cuda
}  // namespace rlx
