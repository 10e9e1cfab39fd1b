// Softmax cross-entropy over the last axis (integer class labels), forward and backward.
//
//   logits: [N, C] (leading axes flattened into N rows), labels: int32 [N]
//   forward:   lse_n  = log sum_j exp(logits_nj)            (saved: f32, f64 for f64)
//              loss_n = lse_n - logits_n,label_n
//   backward:  dlogits_nj = (exp(logits_nj - lse_n) - [j == label_n]) * dloss_n
//   loss_grad: lse_n, loss_n (stat dtype) and dlogits_nj with dloss_n = scale_n (a stat-dtype
//              operand), dlogits in its own floating dtype: the fused linear cross-entropy's
//              logits blocks, one read of each row for the loss and the gradient
// A label outside [0, C) (for example the ignore index -100) marks a row that takes
// no part in the loss: its loss is 0 and its logits get a zero gradient. Labels are
// compared against C before any indexing, so no label can read out of bounds.
// The backward reads each logits row once from memory and writes dlogits once. When
// `recompute_lse` is set it ignores the lse operand and works from the row alone, while
// the row is in cache: m = max_j x_j (the one pass that reads memory), e_j = exp(x_j - m)
// written into the dlogits row with s = sum_j e_j, then dlogits_j = e_j * (dloss / s)
// (minus dloss at the label) in place: one exp per element, as with a given lse. The
// RLX backward op (no saved statistics) and, on the CPU, every gradient use this form,
// so the gradient's only residual is the logits and XLA drops the forward kernel when
// nothing reads the loss (jax.grad of a loss: one read of the logits, one write).
#include <cmath>
#include <vector>

#include "cpu/common.h"
#include "cpu/rowwise.h"
#include "cross_entropy_checks.h"

namespace rlx {
namespace {

inline bool label_ok(int32_t label, int64_t classes) { return label >= 0 && label < classes; }

// f32 rows in place; bf16 rows through the 16-element conversions of rowwise.h
// (vectorised, AVX-512 where the CPU has it), the max of the row computed while it is
// converted; f16 rows through the generic scalar conversions. Same values as
// load<float> / row_max / store<T>.
template <typename T>
float ce_row_in_max(const T* src, float* scratch, int64_t n, const float** row) {
  *row = row_as_f32<T>(src, scratch, n);
  return row_max(*row, n);
}
template <>
float ce_row_in_max<bf16>(const bf16* src, float* scratch, int64_t n, const float** row) {
  *row = scratch;
  return bf16_to_f32_max(src, scratch, n);
}
template <typename T>
const float* ce_row_in(const T* src, float* scratch, int64_t n) {
  if constexpr (std::is_same<T, bf16>::value) {
    bf16_to_f32_max(src, scratch, n);  // (the max comes free with the conversion)
    return scratch;
  } else {
    return row_as_f32<T>(src, scratch, n);
  }
}
template <typename T>
void ce_row_out(const float* src, T* dst, int64_t n) { store_row<T>(src, dst, n); }
template <>
void ce_row_out<bf16>(const float* src, bf16* dst, int64_t n) { store_bf16(src, dst, n); }

// The row after row r (nullptr for the last row): prefetched during row r's exp pass.
template <typename T>
const T* next_row(const T* row, int64_t r, int64_t rows, int64_t classes) {
  return r + 1 < rows ? row + classes : nullptr;
}

// One row of the recomputing backward, read from memory once: m = max_j x_j (while a bf16 /
// f16 row is converted into in_buf), e_j = exp(x_j - m) into the f32 row er with s = sum_j e_j
// (the next row prefetched meanwhile), then dr_j = e_j * (g / s), minus g at the label (when
// ok), in G: one exp per element, as with a given lse. Returns lse = m + log s; *picked = x at
// the label as f32 (0 when !ok).
template <typename T, typename G>
float ce_grad_row(const T* lr, G* dr, float* er, float* in_buf, int64_t classes, int32_t label, bool ok, float g,
                  const T* next, float* picked) {
  const float* xr;
  const float m = ce_row_in_max<T>(lr, in_buf, classes, &xr);
  const float s = exp_shift_sum16(xr, m, er, classes, next, sizeof(T));
  *picked = ok ? xr[label] : 0.0f;
  const float scale = g / s;
  if constexpr (std::is_same<G, bf16>::value) {
    // e_j * scale rounded straight into dlogits (one pass over the row, not two); the
    // label's element again from e, minus g.
    scale_store_bf16(er, scale, dr, classes);
    if (ok) {
      const float v = er[label] * scale;  // this file is built without FMA
      dr[label] = store<G>(v - g);
    }
  } else {
    scale_row(er, scale, classes);
    if (ok) er[label] -= g;
    store_row<G>(er, dr, classes);  // (nothing to do when er is dr: G = f32)
  }
  return m + std::log(s);
}

// The same in f64 (no conversions): e_j into dr, then scaled in place.
inline double ce_grad_row_f64(const double* lr, double* dr, int64_t classes, int32_t label, bool ok, double g) {
  double m = -INFINITY, s = 0;
  for (int64_t j = 0; j < classes; ++j) m = lr[j] > m ? lr[j] : m;
  for (int64_t j = 0; j < classes; ++j) {
    dr[j] = std::exp(lr[j] - m);
    s += dr[j];
  }
  const double scale = g / s;
  for (int64_t j = 0; j < classes; ++j) dr[j] *= scale;
  if (ok) dr[label] -= g;
  return m + std::log(s);
}

template <typename T>
void ce_fwd_typed(ffi::ThreadPool& pool, const T* logits, const int32_t* labels, T* loss,
                  void* lse_out, int64_t rows, int64_t classes) {
  using A = typename Accum<T>::type;
  A* lse = static_cast<A*>(lse_out);
  const int64_t chunks = row_chunks(rows, classes);
  parallel_for(pool, chunks, [&](int64_t c) {
    std::vector<float> buf(std::is_same<T, float>::value ? 0 : classes);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const T* lr = logits + r * classes;
      A l;
      if constexpr (std::is_same<T, double>::value) {
        double m = -INFINITY, s = 0;
        for (int64_t j = 0; j < classes; ++j) m = lr[j] > m ? lr[j] : m;
        for (int64_t j = 0; j < classes; ++j) s += std::exp(lr[j] - m);
        l = m + std::log(s);
      } else {
        const float* xr;
        const float m = ce_row_in_max<T>(lr, buf.data(), classes, &xr);
        l = m + std::log(exp_shift_sum16(xr, m, nullptr, classes, next_row(lr, r, rows, classes), sizeof(T)));
      }
      lse[r] = l;
      const int32_t label = labels[r];
      loss[r] = store<T>(label_ok(label, classes) ? l - load<A>(lr[label]) : A(0));
    }
  });
}

template <typename T>
void ce_bwd_typed(ffi::ThreadPool& pool, const T* logits, const int32_t* labels,
                  const void* lse_in, const T* dloss, T* dlogits, int64_t rows, int64_t classes,
                  bool recompute) {
  using A = typename Accum<T>::type;
  const A* lse = static_cast<const A*>(lse_in);
  const int64_t chunks = row_chunks(rows, classes);
  parallel_for(pool, chunks, [&](int64_t c) {
    const bool f32 = std::is_same<T, float>::value;
    std::vector<float> in_buf(f32 ? 0 : classes), out_buf(f32 ? 0 : classes);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const T* lr = logits + r * classes;
      T* dr = dlogits + r * classes;
      const int32_t label = labels[r];
      const bool ok = label_ok(label, classes);
      const A g = ok ? load<A>(dloss[r]) : A(0);
      if constexpr (std::is_same<T, double>::value) {
        if (recompute) {
          ce_grad_row_f64(lr, dr, classes, label, ok, g);
        } else {
          const double l = lse[r];
          for (int64_t j = 0; j < classes; ++j) dr[j] = std::exp(lr[j] - l) * g;
          if (ok) dr[label] -= g;
        }
      } else {
        float* outr = out_row_f32<T>(dr, out_buf.data());
        if (recompute) {
          float picked;
          ce_grad_row<T, T>(lr, dr, outr, in_buf.data(), classes, label, ok, float(g),
                            next_row(lr, r, rows, classes), &picked);
          continue;
        }
        const float* xr = ce_row_in<T>(lr, in_buf.data(), classes);
        exp_shift_scale(xr, float(lse[r]), float(g), outr, classes);
        if (ok) outr[label] -= float(g);
        ce_row_out<T>(outr, dr, classes);
      }
    }
  });
}

// The fused linear cross-entropy's logits block: per row the lse and loss (as the forward,
// in A) and dlogits = (exp(x - lse) - onehot) * scale_n in G, from one read of the row
// (ce_grad_row with g = scale_n).
template <typename T, typename G>
void ce_loss_grad_typed(ffi::ThreadPool& pool, const T* logits, const int32_t* labels, const void* scale_in,
                        void* loss_out, void* lse_out, G* dlogits, int64_t rows, int64_t classes) {
  using A = typename Accum<T>::type;
  const A* scale = static_cast<const A*>(scale_in);
  A* loss = static_cast<A*>(loss_out);
  A* lse = static_cast<A*>(lse_out);
  const int64_t chunks = row_chunks(rows, classes);
  parallel_for(pool, chunks, [&](int64_t c) {
    constexpr bool in_place = std::is_same<G, float>::value;  // e_j straight into dlogits
    std::vector<float> in_buf(std::is_same<T, float>::value ? 0 : classes), out_buf(in_place ? 0 : classes);
    const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const T* lr = logits + r * classes;
      G* dr = dlogits + r * classes;
      const int32_t label = labels[r];
      const bool ok = label_ok(label, classes);
      const A g = ok ? scale[r] : A(0);
      if constexpr (std::is_same<T, double>::value) {
        const double l = ce_grad_row_f64(lr, dr, classes, label, ok, g);
        lse[r] = l;
        loss[r] = ok ? l - lr[label] : 0.0;
      } else {
        float picked;
        const float l = ce_grad_row<T, G>(lr, dr, in_place ? reinterpret_cast<float*>(dr) : out_buf.data(),
                                          in_buf.data(), classes, label, ok, float(g),
                                          next_row(lr, r, rows, classes), &picked);
        lse[r] = l;
        loss[r] = ok ? l - picked : 0.0f;
      }
    }
  });
}

ffi::Error CeFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                     ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse) {
  if (auto e = cross_entropy::check_fwd(Backend::kCpu, logits, labels, *loss, *lse); e.failure()) return e;
  auto [rows, classes] = rows_view(logits);
  if (rows == 0) return ffi::Error::Success();
  if (classes == 0) return invalid("softmax_cross_entropy: logits need at least one class");
  bool ok = dispatch_float(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    ce_fwd_typed<T>(pool, static_cast<const T*>(logits.untyped_data()),
                    static_cast<const int32_t*>(labels.untyped_data()),
                    static_cast<T*>(loss->untyped_data()), lse->untyped_data(), rows, classes);
  });
  if (!ok)
    return invalid("softmax_cross_entropy: unsupported dtype " + dtype_name(logits.element_type()));
  return ffi::Error::Success();
}

ffi::Error CeBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                     ffi::AnyBuffer lse, ffi::AnyBuffer dloss,
                     ffi::Result<ffi::AnyBuffer> dlogits, bool recompute_lse) {
  if (auto e = cross_entropy::check_bwd(Backend::kCpu, logits, labels, lse, dloss, *dlogits); e.failure())
    return e;
  auto [rows, classes] = rows_view(logits);
  if (rows == 0 || classes == 0) return ffi::Error::Success();
  bool ok = dispatch_float(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    ce_bwd_typed<T>(pool, static_cast<const T*>(logits.untyped_data()),
                    static_cast<const int32_t*>(labels.untyped_data()), lse.untyped_data(),
                    static_cast<const T*>(dloss.untyped_data()),
                    static_cast<T*>(dlogits->untyped_data()), rows, classes, recompute_lse);
  });
  if (!ok)
    return invalid("softmax_cross_entropy backward: unsupported dtype " +
                   dtype_name(logits.element_type()));
  return ffi::Error::Success();
}

ffi::Error CeLossGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                          ffi::Result<ffi::AnyBuffer> dlogits) {
  if (auto e = cross_entropy::check_loss_grad(Backend::kCpu, logits, labels, scale, *loss, *lse, *dlogits);
      e.failure())
    return e;
  auto [rows, classes] = rows_view(logits);
  if (rows == 0) return ffi::Error::Success();
  if (classes == 0) return invalid("softmax_cross_entropy loss_grad: logits need at least one class");
  dispatch_float(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_float(dlogits->element_type(), [&](auto gtag) {
      using G = decltype(gtag);
      if constexpr (std::is_same<T, double>::value == std::is_same<G, double>::value)
        ce_loss_grad_typed<T, G>(pool, static_cast<const T*>(logits.untyped_data()),
                                 static_cast<const int32_t*>(labels.untyped_data()), scale.untyped_data(),
                                 loss->untyped_data(), lse->untyped_data(), static_cast<G*>(dlogits->untyped_data()),
                                 rows, classes);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxCeFwd, CeFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // logits
                                  .Arg<ffi::AnyBuffer>()   // labels (int32)
                                  .Ret<ffi::AnyBuffer>()   // loss
                                  .Ret<ffi::AnyBuffer>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxCeBwd, CeBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels (int32)
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // dloss
                                  .Ret<ffi::AnyBuffer>()  // dlogits
                                  .Attr<bool>("recompute_lse"));

RLX_REGISTER_HANDLER("rlx_softmax_ce_fwd", RlxSoftmaxCeFwd);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxCeLossGrad, CeLossGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // logits
                                  .Arg<ffi::AnyBuffer>()   // labels (int32)
                                  .Arg<ffi::AnyBuffer>()   // scale (per row, stat dtype)
                                  .Ret<ffi::AnyBuffer>()   // loss (stat dtype)
                                  .Ret<ffi::AnyBuffer>()   // lse (stat dtype)
                                  .Ret<ffi::AnyBuffer>());  // dlogits

RLX_REGISTER_HANDLER("rlx_softmax_ce_bwd", RlxSoftmaxCeBwd);
RLX_REGISTER_HANDLER("rlx_softmax_ce_loss_grad", RlxSoftmaxCeLossGrad);

}  // namespace rlx
