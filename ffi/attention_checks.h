// Operand checks of rlx_attention_fwd / rlx_attention_bwd, shared by the CPU
// (ffi/cpu/attention.cc) and CUDA (ffi/cuda/attention.cu) handlers. Plain C++17 (host side
// of both builds).
//
//   q, out, dout, dq: [B, Sq, H, D]; k, v, dk, dv: [B, Sk, Hkv, D] with Hkv dividing H; one
//   floating dtype; mask (when has_mask): f32 [B, Sk]; bias, dbias (when has_bias):
//   [B, H, Sq, Sk] of q's dtype; lse, dlse: [B, H, Sq] of stat_dtype (host_common.h).
//   mask_kind 0 (none), 1 (causal) or 2 (sliding, window >= 0); softcap >= 0 (0: off) and
//   scale finite (the CUDA kernels also need a finite softcap).
#pragma once

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>

#include "host_common.h"

namespace rlx {
namespace attention {

struct Dims {
  int64_t B, Sq, Sk, H, Hkv, D;
  int64_t group() const { return H / Hkv; }
};
struct Opts {
  int64_t kind;    // 0 none, 1 causal, 2 sliding
  int64_t window;  // sliding window w
  double scale, softcap;
  bool has_mask, has_bias;
};

inline Opts make_opts(double scale, double softcap, int64_t kind, int64_t window, int64_t has_mask,
                      int64_t has_bias) {
  return Opts{kind, window, scale, softcap, has_mask != 0, has_bias != 0};
}

inline std::string dims_str(const ffi::AnyBuffer& x) {
  std::string s = "[";
  auto dd = x.dimensions();
  for (size_t i = 0; i < dd.size(); ++i) s += (i ? ", " : "") + std::to_string(dd[i]);
  return s + "]";
}

inline bool has_dims(const ffi::AnyBuffer& x, std::initializer_list<int64_t> want) {
  auto dd = x.dimensions();
  return dd.size() == want.size() && std::equal(dd.begin(), dd.end(), want.begin());
}

// q, k, v, mask, bias and the attributes, for both targets (`who` names the target); fills d.
inline ffi::Error check_inputs(Backend b, const char* who, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                               const ffi::AnyBuffer& v, const ffi::AnyBuffer& mask, const ffi::AnyBuffer& bias,
                               const Opts& o, Dims* d) {
  const std::string w = who;
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4)
    return invalid(w + ": q and k must have rank 4 ([B, S, H, D]), got q " + dims_str(q) + ", k " + dims_str(k));
  auto qd = q.dimensions(), kd = k.dimensions();
  *d = Dims{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3]};
  if (kd[0] != d->B || kd[3] != d->D)
    return invalid(w + ": k " + dims_str(k) + " does not match q " + dims_str(q) + " in batch or head dim");
  if (!same_dims(k, v)) return invalid(w + ": v " + dims_str(v) + " must match k " + dims_str(k));
  if (d->Hkv == 0 ? d->H != 0 : d->H % d->Hkv != 0)
    return invalid(w + ": kv heads (" + std::to_string(d->Hkv) + ") must divide heads (" + std::to_string(d->H) +
                   ")");
  const auto t = q.element_type();
  if (k.element_type() != t || v.element_type() != t) return invalid(w + ": q, k, v dtypes differ");
  if (o.has_mask && (mask.element_type() != ffi::DataType::F32 || !has_dims(mask, {d->B, d->Sk})))
    return invalid(w + ": mask must be f32 [B, Sk], got " + dims_str(mask));
  if (o.has_bias && (bias.element_type() != t || !has_dims(bias, {d->B, d->H, d->Sq, d->Sk})))
    return invalid(w + ": bias must be [B, H, Sq, Sk] with q's dtype, got " + dims_str(bias));
  if (o.kind < 0 || o.kind > 2) return invalid(w + ": mask_kind must be 0, 1 or 2");
  if (o.kind == 2 && o.window < 0) return invalid(w + ": window must be >= 0");
  if (b == Backend::kCpu && (!(o.softcap >= 0.0) || !std::isfinite(o.scale)))
    return invalid(w + ": softcap must be >= 0 (0: off) and scale finite");
  if (b == Backend::kCuda && (!(o.softcap >= 0.0) || !std::isfinite(o.softcap) || !std::isfinite(o.scale)))
    return invalid(w + ": softcap must be >= 0 (0: off) and finite, scale finite");
  return ffi::Error::Success();
}

// A log-sum-exp operand or result: [B, H, Sq] of stat_dtype.
inline bool is_lse(Backend b, const ffi::AnyBuffer& x, const ffi::AnyBuffer& q, const Dims& d) {
  return x.element_type() == stat_dtype(b, q.element_type()) && has_dims(x, {d.B, d.H, d.Sq});
}

inline ffi::Error check_fwd_results(Backend b, const ffi::AnyBuffer& q, const ffi::AnyBuffer& out,
                                    const ffi::AnyBuffer& lse, const Dims& d) {
  if (!same_dims(q, out) || out.element_type() != q.element_type()) return invalid("attention: out must match q");
  if (!is_lse(b, lse, q, d))
    return invalid(backend_op(b, "attention") + ": lse must be [B, H, Sq] " + stat_dtype_rule(b, "inputs"));
  return ffi::Error::Success();
}

// The backward's operands and results beyond check_inputs'.
inline ffi::Error check_bwd_rest(Backend b, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                 const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                 const ffi::AnyBuffer& dout, const ffi::AnyBuffer& dlse, const ffi::AnyBuffer& dq,
                                 const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv, const ffi::AnyBuffer& dbias,
                                 const Opts& o, const Dims& d) {
  const auto t = q.element_type();
  for (const ffi::AnyBuffer* x : {&out, &dout})
    if (!same_dims(q, *x) || x->element_type() != t)
      return invalid("attention backward: out and dout must match q in shape and dtype");
  for (const ffi::AnyBuffer* x : {&lse, &dlse})
    if (!is_lse(b, *x, q, d))
      return invalid(backend_op(b, "attention backward") + ": lse and dlse must be [B, H, Sq] " +
                     stat_dtype_rule(b, "inputs"));
  if (!same_dims(q, dq) || dq.element_type() != t || !same_dims(k, dk) || dk.element_type() != t ||
      !same_dims(k, dv) || dv.element_type() != t)
    return invalid("attention backward: dq, dk, dv must match q, k, v");
  if (o.has_bias && (!same_dims(bias, dbias) || dbias.element_type() != t))
    return invalid("attention backward: dbias must match bias");
  return ffi::Error::Success();
}

// Segment ids (the segment targets), when given (qseg non-null): qseg [B, Sq] and kseg [B, Sk]
// int32. The CUDA targets also take the per-granule tables qinfo [B, ceil(Sq / g), 4] and kinfo
// [B, ceil(Sk / g), 4] int32 (g = granule; checked when qinfo is non-null).
inline ffi::Error check_segments(const char* who, const ffi::AnyBuffer* qseg, const ffi::AnyBuffer* kseg,
                                 const Dims& d, const ffi::AnyBuffer* qinfo = nullptr,
                                 const ffi::AnyBuffer* kinfo = nullptr, int64_t granule = 1) {
  if (!qseg) return ffi::Error::Success();
  if (qseg->element_type() != ffi::DataType::S32 || !has_dims(*qseg, {d.B, d.Sq}))
    return invalid(std::string(who) + ": q_segment_ids must be int32 [B, Sq], got " + dims_str(*qseg));
  if (kseg->element_type() != ffi::DataType::S32 || !has_dims(*kseg, {d.B, d.Sk}))
    return invalid(std::string(who) + ": kv_segment_ids must be int32 [B, Sk], got " + dims_str(*kseg));
  if (!qinfo) return ffi::Error::Success();
  const int64_t nq = (d.Sq + granule - 1) / granule, nk = (d.Sk + granule - 1) / granule;
  if (qinfo->element_type() != ffi::DataType::S32 || !has_dims(*qinfo, {d.B, nq, 4}))
    return invalid(std::string(who) + ": the query segment table must be int32 [B, ceil(Sq / " +
                   std::to_string(granule) + "), 4], got " + dims_str(*qinfo));
  if (kinfo->element_type() != ffi::DataType::S32 || !has_dims(*kinfo, {d.B, nk, 4}))
    return invalid(std::string(who) + ": the key segment table must be int32 [B, ceil(Sk / " +
                   std::to_string(granule) + "), 4], got " + dims_str(*kinfo));
  return ffi::Error::Success();
}

}  // namespace attention
}  // namespace rlx
