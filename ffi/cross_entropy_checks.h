// Operand checks of rlx_softmax_ce_fwd / rlx_softmax_ce_bwd, shared by the CPU
// (ffi/cpu/cross_entropy.cc) and CUDA (ffi/cuda/cross_entropy.cu) handlers. Plain C++17
// (host side of both builds).
//
//   logits, dlogits: [R.., C] of one floating dtype; labels: int32 [R..]; loss, dloss: [R..]
//   of the logits' dtype; lse: [R..] of stat_dtype (host_common.h).
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

}  // namespace cross_entropy
}  // namespace rlx
