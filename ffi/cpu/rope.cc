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
#include <cmath>

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

template <typename T>
void rope_typed(ffi::ThreadPool& pool, const T* x, const T* cos, const T* sin, T* y,
                int64_t batch, int64_t seq, int64_t width, int64_t table_w, int64_t head_dim,
                int64_t n_rot, float sign) {
  using A = typename Accum<T>::type;
  const int64_t rows = batch * seq, heads = width / head_dim, half = n_rot / 2;
  const int64_t chunks = row_chunks(rows, width);
  parallel_for(pool, chunks, [&](int64_t ch) {
    const int64_t r0 = rows * ch / chunks, r1 = rows * (ch + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t s = r % seq;
      const T* cr = cos + s * table_w;
      const T* sr = sin + s * table_w;
      if constexpr (std::is_same<T, float>::value) {
        rope_row_f32(x + r * width, cr, sr, y + r * width, heads, head_dim, n_rot, sign);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + r * width + h * head_dim;
        T* yh = y + r * width + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const A c = load<A>(cr[i]), t = A(sign) * load<A>(sr[i]);
          const A a = load<A>(xh[i]), b = load<A>(xh[half + i]);
          yh[i] = store<T>(a * c - b * t);
          yh[half + i] = store<T>(b * c + a * t);
        }
        for (int64_t j = n_rot; j < head_dim; ++j) yh[j] = xh[j];
      }
    }
  });
}

ffi::Error RopeImpl(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& cos,
                    const ffi::AnyBuffer& sin, ffi::Result<ffi::AnyBuffer>& y, int64_t head_dim,
                    int64_t n_rot, float sign) {
  rope::Shape sh{};
  if (auto e = rope::check(x, cos, sin, *y, head_dim, n_rot, sh); e.failure()) return e;
  const int64_t batch = sh.batch, seq = sh.seq, width = sh.width;
  if (batch == 0 || seq == 0 || width == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    rope_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                  static_cast<const T*>(cos.untyped_data()),
                  static_cast<const T*>(sin.untyped_data()), static_cast<T*>(y->untyped_data()),
                  batch, seq, width, sh.table_width, head_dim, n_rot, sign);
  });
  if (!ok) return invalid("rope: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
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

}  // namespace rlx
