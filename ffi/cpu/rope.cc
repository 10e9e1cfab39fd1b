// NeoX rotary position embedding, forward and backward.
//
//   x, y: [B, S, H * head_dim] (the Python side flattens leading axes into B)
//   cos, sin: [S, T] with T >= n_rot / 2 (only the first n_rot / 2 columns are read;
//   RLX's own tables are [S, head_dim / 2])
// In every head, with half = n_rot / 2, i < half and c = cos[s, i], t = sign * sin[s, i]:
//   y[i]        = x[i] * c - x[half + i] * t
//   y[half + i] = x[half + i] * c + x[i] * t
//   y[j]        = x[j]                       for n_rot <= j < head_dim (pass-through)
// sign = +1 is the forward; sign = -1 is the backward (the rotation is orthogonal, so
// its transpose is the rotation by -theta): dx = rope(dy) with sin negated.
// rope_split reads a packed x [B, S, W] into parts [B, S, W_p] (whole heads, sum W_p = W), the
// parts flagged in rotate_mask rotated (sign +1), the others copied; rope_merge is its transpose
// (parts -> x, sign -1).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/common.h"
#include "cpu/rowwise.h"
#include "rope_checks.h"

namespace rlx {
namespace {

// One f32 row of `heads` heads (the hot path; compiled for AVX2 and the baseline ISA).
[[maybe_unused]] RLX_ROW_CLONES static void rope_row_f32(const float* __restrict x,
                                                         const float* __restrict c,
                                                         const float* __restrict sn,
                                                         float* __restrict y, int64_t heads,
                                                         int64_t head_dim, int64_t n_rot,
                                                         float sign) {
  const int64_t half = n_rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* xh = x + h * head_dim;
    float* yh = y + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float t = sign * sn[i], a = xh[i], b = xh[half + i];
      yh[i] = a * c[i] - b * t;
      yh[half + i] = b * c[i] + a * t;
    }
    for (int64_t j = n_rot; j < head_dim; ++j) yh[j] = xh[j];
  }
}

// One row's heads of one part: rotated (rope_row_f32 for f32) or copied.
template <typename T>
void rope_heads(const T* x, const T* cr, const T* sr, T* y, int64_t heads, int64_t head_dim, int64_t n_rot,
                float sign, bool rotate) {
  using A = typename Accum<T>::type;
  if (!rotate) {
    std::copy(x, x + heads * head_dim, y);
    return;
  }
  if constexpr (std::is_same<T, float>::value) {
    rope_row_f32(x, cr, sr, y, heads, head_dim, n_rot, sign);
  } else {
    const int64_t half = n_rot / 2;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + h * head_dim;
      T* yh = y + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const A c = load<A>(cr[i]), t = A(sign) * load<A>(sr[i]);
        const A a = load<A>(xh[i]), b = load<A>(xh[half + i]);
        yh[i] = store<T>(a * c - b * t);
        yh[half + i] = store<T>(b * c + a * t);
      }
      for (int64_t j = n_rot; j < head_dim; ++j) yh[j] = xh[j];
    }
  }
}

// Every row of every part. `packed` is the buffer holding all the heads of a row (x of rope and
// rope_split, the result of rope_merge), `pieces` the per-part buffers (rope: y, one part);
// packed_is_input: packed -> pieces (rope, split), else pieces -> packed (merge).
template <typename T>
void rope_parts(ffi::ThreadPool& pool, T* packed, const std::vector<T*>& pieces, const T* cos, const T* sin,
                const rope::PartsShape& sh, bool packed_is_input, float sign) {
  const int64_t rows = sh.batch * sh.seq;
  const int64_t chunks = row_chunks(rows, sh.width);
  parallel_for(pool, chunks, [&](int64_t ch) {
    const int64_t r0 = rows * ch / chunks, r1 = rows * (ch + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t s = r % sh.seq;
      int64_t offset = 0;
      for (size_t p = 0; p < pieces.size(); ++p) {
        const int64_t w = sh.widths[p];
        T* packed_row = packed + r * sh.width + offset;
        T* piece_row = pieces[p] + r * w;
        const T* in = packed_is_input ? packed_row : piece_row;
        T* out = packed_is_input ? piece_row : packed_row;
        rope_heads<T>(in, cos + s * sh.table_width, sin + s * sh.table_width, out, w / sh.head_dim, sh.head_dim,
                      sh.n_rot, sign, (sh.rotate_mask >> p) & 1);
        offset += w;
      }
    }
  });
}

ffi::Error run(ffi::ThreadPool& pool, ffi::DataType dtype, void* packed, const std::vector<void*>& pieces,
               const void* cos, const void* sin, const rope::PartsShape& sh, bool packed_is_input, float sign) {
  if (sh.batch == 0 || sh.seq == 0 || sh.width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    std::vector<T*> typed;
    for (void* p : pieces) typed.push_back(static_cast<T*>(p));
    rope_parts<T>(pool, static_cast<T*>(packed), typed, static_cast<const T*>(cos), static_cast<const T*>(sin), sh,
                  packed_is_input, sign);
  });
  if (!ok) return invalid("rope: unsupported dtype " + dtype_name(dtype));
  return ffi::Error::Success();
}

ffi::Error RopeImpl(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& cos,
                    const ffi::AnyBuffer& sin, ffi::Result<ffi::AnyBuffer>& y, int64_t head_dim,
                    int64_t n_rot, float sign) {
  rope::Shape sh{};
  if (auto e = rope::check(x, cos, sin, *y, head_dim, n_rot, sh); e.failure()) return e;
  return run(pool, x.element_type(), x.untyped_data(), {y->untyped_data()}, cos.untyped_data(), sin.untyped_data(),
             rope::single_part(sh, head_dim, n_rot), true, sign);
}

ffi::Error RopeFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer cos,
                       ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> y, int64_t head_dim,
                       int64_t n_rot) {
  return RopeImpl(pool, x, cos, sin, y, head_dim, n_rot, 1.0f);
}

ffi::Error RopeBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer cos,
                       ffi::AnyBuffer sin, ffi::Result<ffi::AnyBuffer> dx, int64_t head_dim,
                       int64_t n_rot) {
  return RopeImpl(pool, dy, cos, sin, dx, head_dim, n_rot, -1.0f);
}

// rope_split: (x [B, S, W], cos, sin) -> parts [B, S, W_p], the rotating ones by +theta.
ffi::Error RopeSplitImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                         ffi::RemainingRets outs, int64_t head_dim, int64_t n_rot, int64_t rotate_mask) {
  rope::PartsShape sh{};
  std::vector<void*> ptrs;
  if (auto e = rope::gather_parts(outs, x, cos, sin, head_dim, n_rot, rotate_mask, sh, ptrs); e.failure()) return e;
  return run(pool, x.element_type(), x.untyped_data(), ptrs, cos.untyped_data(), sin.untyped_data(), sh, true, 1.0f);
}

// rope_merge, rope_split's transpose: (cos, sin, parts [B, S, W_p]) -> x [B, S, W], the
// rotating parts by -theta.
ffi::Error RopeMergeImpl(ffi::ThreadPool pool, ffi::AnyBuffer cos, ffi::AnyBuffer sin, ffi::RemainingArgs ins,
                         ffi::Result<ffi::AnyBuffer> x, int64_t head_dim, int64_t n_rot, int64_t rotate_mask) {
  rope::PartsShape sh{};
  std::vector<void*> ptrs;
  if (auto e = rope::gather_parts(ins, *x, cos, sin, head_dim, n_rot, rotate_mask, sh, ptrs); e.failure()) return e;
  return run(pool, x->element_type(), x->untyped_data(), ptrs, cos.untyped_data(), sin.untyped_data(), sh, false,
             -1.0f);
}

}  // namespace

#define RLX_ROPE_BINDING                \
  ffi::Ffi::Bind()                      \
      .Ctx<ffi::ThreadPool>()           \
      .Arg<ffi::AnyBuffer>()            \
      .Arg<ffi::AnyBuffer>()            \
      .Arg<ffi::AnyBuffer>()            \
      .Ret<ffi::AnyBuffer>()            \
      .Attr<int64_t>("head_dim")        \
      .Attr<int64_t>("n_rot")

// forward: (x, cos, sin) -> y;  backward: (dy, cos, sin) -> dx
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeFwd, RopeFwdImpl, RLX_ROPE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeBwd, RopeBwdImpl, RLX_ROPE_BINDING);

RLX_REGISTER_HANDLER("rlx_rope_fwd", RlxRopeFwd);
RLX_REGISTER_HANDLER("rlx_rope_bwd", RlxRopeBwd);

// split: (x, cos, sin) -> parts;  merge: (cos, sin, parts) -> x
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeSplit, RopeSplitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<int64_t>("head_dim")
                                  .Attr<int64_t>("n_rot")
                                  .Attr<int64_t>("rotate_mask"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxRopeMerge, RopeMergeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("head_dim")
                                  .Attr<int64_t>("n_rot")
                                  .Attr<int64_t>("rotate_mask"));

RLX_REGISTER_HANDLER("rlx_rope_split", RlxRopeSplit);
RLX_REGISTER_HANDLER("rlx_rope_merge", RlxRopeMerge);

}  // namespace rlx
