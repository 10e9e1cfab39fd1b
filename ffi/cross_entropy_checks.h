// Operand checks of rlx_softmax_ce_fwd / _bwd / _loss_grad, shared by the CPU
// (ffi/cpu/cross_entropy.cc) and CUDA (ffi/cuda/cross_entropy.cu) handlers. Plain C++17
// (host side of both builds).
//
//   logits, dlogits: [R.., C] of one floating dtype; labels: int32 [R..]; loss, dloss: [R..]
//   of the logits' dtype; lse: [R..] of stat_dtype (host_common.h). loss_grad: scale, loss,
//   lse [R..] of stat_dtype; dlogits [R.., C] of any floating dtype the backend computes in
//   (f64 only for f64 logits, on the CPU).
#pragma once

#include <algorithm>
#include <string>

#include "host_common.h"

namespace rlx {
namespace cross_entropy {

inline ffi::Error check_labels(const ffi::AnyBuffer& logits, const ffi::AnyBuffer& labels) {
  auto dl = logits.dimensions(), dlab = labels.dimensions();
  if (dl.size() < 1) return invalid("softmax_cross_entropy: logits must have rank >= 1");
  if (labels.element_type() != ffi::DataType::S32)
    return invalid("softmax_cross_entropy: labels must be int32, got " + dtype_name(labels.element_type()));
  if (dlab.size() + 1 != dl.size() || !std::equal(dlab.begin(), dlab.end(), dl.begin()))
    return invalid("softmax_cross_entropy: labels must have the shape of logits without its last (class) axis");
  return ffi::Error::Success();
}

// The forward's operands; an empty class axis with rows to fill is an error the handler
// reports after this (it has nothing to compute when there are no rows).
inline ffi::Error check_fwd(Backend b, const ffi::AnyBuffer& logits, const ffi::AnyBuffer& labels,
                            const ffi::AnyBuffer& loss, const ffi::AnyBuffer& lse) {
  if (auto e = check_labels(logits, labels); e.failure()) return e;
  if (!same_dims(loss, labels) || loss.element_type() != logits.element_type())
    return invalid("softmax_cross_entropy: loss must have the labels' shape and the logits' dtype");
  if (!same_dims(lse, labels) || lse.element_type() != stat_dtype(b, logits.element_type()))
    return invalid(backend_op(b, "softmax_cross_entropy") + ": lse must be " + stat_dtype_rule(b, "logits") +
                   ", one per row");
  return ffi::Error::Success();
}

inline ffi::Error check_bwd(Backend b, const ffi::AnyBuffer& logits, const ffi::AnyBuffer& labels,
                            const ffi::AnyBuffer& lse, const ffi::AnyBuffer& dloss, const ffi::AnyBuffer& dlogits) {
  if (auto e = check_labels(logits, labels); e.failure()) return e;
  if (!same_dims(lse, labels) || lse.element_type() != stat_dtype(b, logits.element_type()))
    return invalid(backend_op(b, "softmax_cross_entropy backward") + ": lse must be " +
                   stat_dtype_rule(b, "logits") + ", one per row");
  if (!same_dims(dloss, labels) || dloss.element_type() != logits.element_type())
    return invalid("softmax_cross_entropy backward: dloss must have the labels' shape and the logits' dtype");
  if (!same_dims(logits, dlogits) || dlogits.element_type() != logits.element_type())
    return invalid("softmax_cross_entropy backward: dlogits must match logits");
  return ffi::Error::Success();
}

inline bool is_narrow_float(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline ffi::Error check_loss_grad(Backend b, const ffi::AnyBuffer& logits, const ffi::AnyBuffer& labels,
                                  const ffi::AnyBuffer& scale, const ffi::AnyBuffer& loss, const ffi::AnyBuffer& lse,
                                  const ffi::AnyBuffer& dlogits) {
  if (auto e = check_labels(logits, labels); e.failure()) return e;
  const ffi::DataType stat = stat_dtype(b, logits.element_type());
  const std::string who = backend_op(b, "softmax_cross_entropy loss_grad");
  for (const ffi::AnyBuffer* a : {&scale, &loss, &lse})
    if (!same_dims(*a, labels) || a->element_type() != stat)
      return invalid(who + ": scale, loss and lse must be " + stat_dtype_rule(b, "logits") + ", one per row");
  const ffi::DataType lt = logits.element_type(), gt = dlogits.element_type();
  const bool f64 = lt == ffi::DataType::F64 && gt == ffi::DataType::F64 && b == Backend::kCpu;
  if (!same_dims(logits, dlogits) || !(f64 || (is_narrow_float(lt) && is_narrow_float(gt))))
    return invalid(who + ": dlogits must have the logits' shape and an f32, bf16 or f16 dtype (f64 with f64 "
                   "logits on the CPU), got " + dtype_name(lt) + " -> " + dtype_name(gt));
  return ffi::Error::Success();
}

}  // namespace cross_entropy
}  // namespace rlx
