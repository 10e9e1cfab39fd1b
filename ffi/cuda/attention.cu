// XLA FFI handlers for attention on CUDA: targets rlx_attention_fwd and rlx_attention_bwd.
// The contract (shapes, masks, scale, softcap, bias, fully hidden rows) is the module
// docstring of rlx_jax/vjp_rules/attention.py and ffi/cpu/attention.cc; the kernels are in
// attention_generic.cuh (every case) and attention_mma.cuh (tensor cores).
//
// rlx_attention_fwd: q [B, Sq, H, D], k, v [B, Sk, Hkv, D], mask [B, Sk] f32 (or [0]),
//   bias [B, H, Sq, Sk] (or [0]), sinks [B, H] f32 (or [0]) -> out (q's shape and dtype), lse
//   [B, H, Sq] f32. Sinks: one logit per (batch, query head) joins every row's softmax
//   denominator with no value; the kernels' epilogue applies it (row_finish,
//   attention_generic.cuh), and lse is then that of the whole denominator (the sink's
//   probability is exp(sink - lse)). The CPU targets take no sinks operand: there XLA applies
//   the sink to the kernel's (out, lse) (rlx_jax/vjp_rules/attention_segments.py).
// rlx_attention_bwd: q, k, v, out, lse, dout, dlse, mask, bias -> dq, dk, dv, dbias (bias's
//   shape, [0] without a bias), scratch f32 with at least B * H * Sq elements (delta_i =
//   rowsum(dout * out) - dlse_i; the Python side sizes it, XLA allocates it).
// Attrs: scale, softcap (f64; softcap 0 = off), mask_kind (0 none, 1 causal, 2 sliding),
//   window, has_mask, has_bias (i64).
// rlx_attention_segments_fwd / _bwd: the same operands, then after bias (the forward: after
//   sinks) the segment ids q_segment_ids [B, Sq], kv_segment_ids [B, Sk] int32 and their granule
//   tables [B, ceil(Sq / 64), 4], [B, ceil(Sk / 64), 4] int32 (attention_segments.cuh; the CPU
//   targets take the ids only), and the forward then its tile order [B * ceil(Sq / 128)] int32
//   (the (batch, query tile) pairs by descending work: segment_tile_order in
//   rlx_jax/vjp_rules/attention_segments.py). They run the wgmma kernels' segment forms only
//   (bf16 / f16, head dim 64 or 128, no bias, scale > 0, an sm_90a image on a compute capability
//   9.0 device, the backward's fused kernel): any other call is an error, never a silent fallback
//   that would ignore the ids.
//
// Path: bf16 / f16 with head dim 64 or 128 on sm_80+ run the mma.sync kernels, except where the
// module carries sm_90a code and runs on a compute capability 9.0 device, for the cases without a
// bias, scale > 0: there the forward is the warp-specialised wgmma kernel (attention_wgmma_ws.cuh)
// and the backward the fused wgmma kernel (attention_fused_bwd_ws.cuh; attention_fused_bwd.cuh at
// D 64 with a softcap), each plain (mask kind none or causal) or, in their CAP / MASK forms, with a
// softcap, a key mask and / or a sliding window; where the fused kernel cannot serve, the two-kernel
// wgmma backward (attention_wgmma_bwd.cuh, attention_wgmma_bwd_ws.cuh). Everything else (f32, other
// head dims up to 256, bias) runs the mma.sync or generic kernels. All are deterministic. The
// routing and its one debugging switch, RLX_ATTENTION_CUDA_WGMMA: attention_launch_impl.cuh.
//
// Files: this one holds the handlers (argument checks, dtype dispatch); attention_launch.cuh the
// launchers they call, instantiated per pass and dtype in attention_{fwd,bwd}_{bf16,f16}.cu and
// attention_f32.cu.

#include <algorithm>
#include <cmath>
#include <string>

#include "attention_bindings.h"
#include "attention_checks.h"
#include "cuda/attention_launch.cuh"
#include "cuda/attention_segments.cuh"

namespace rlx {
namespace cuda {
namespace {

using attn::AttnArgs;

using attention::Dims;
using attention::Opts;

// The shared checks (attention_checks.h) plus the CUDA kernels' dtypes and head-dim limit; fills
// the kernels' arguments.
ffi::Error check_inputs(const char* who, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& mask, const ffi::AnyBuffer& bias, const Opts& o, AttnArgs* a) {
  const std::string w = who;
  Dims d;
  if (auto e = attention::check_inputs(Backend::kCuda, who, q, k, v, mask, bias, o, &d); e.failure()) return e;
  const auto t = q.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16)
    return invalid(w + " (cuda): unsupported dtype " + dtype_name(t) + " (f32, bf16, f16)");
  if (d.D > attn::kGenMaxD)
    return invalid(w + " (cuda): head dim " + std::to_string(d.D) + " > " + std::to_string(attn::kGenMaxD));
  *a = AttnArgs{};
  a->B = d.B;
  a->Sq = d.Sq;
  a->H = d.H;
  a->D = d.D;
  a->Sk = d.Sk;
  a->Hkv = d.Hkv;
  a->group = a->Hkv > 0 ? a->H / a->Hkv : 1;
  a->off = a->Sk > a->Sq ? a->Sk - a->Sq : 0;
  a->kind = int(o.kind);
  a->window = o.kind == 2 ? o.window : 0;
  a->scale = float(o.scale);
  a->softcap = float(o.softcap);
  a->mask = nullptr;
  return ffi::Error::Success();
}

// The segment targets' extra operands (null for the targets without segment ids): the ids, their
// granule tables and, the forward's only, its tile order.
struct Segments {
  const ffi::AnyBuffer *qseg = nullptr, *kseg = nullptr, *qinfo = nullptr, *kinfo = nullptr, *qorder = nullptr;
};

// Checks the segment operands (if any) and points a's fields at them.
ffi::Error set_segments(const char* who, const Segments& sg, AttnArgs* a) {
  if (sg.qseg == nullptr) return ffi::Error::Success();
  const Dims d{a->B, a->Sq, a->Sk, a->H, a->Hkv, a->D};
  if (auto e = attention::check_segments(who, sg.qseg, sg.kseg, d, sg.qinfo, sg.kinfo, attn::kSegGranule);
      e.failure())
    return e;
  a->qseg = static_cast<const int*>(sg.qseg->untyped_data());
  a->kseg = static_cast<const int*>(sg.kseg->untyped_data());
  a->qinfo = static_cast<const int4*>(sg.qinfo->untyped_data());
  a->kinfo = static_cast<const int4*>(sg.kinfo->untyped_data());
  if (sg.qorder != nullptr) {
    const int64_t n = a->B * ((a->Sq + attn::kSegOrderRows - 1) / attn::kSegOrderRows);
    if (sg.qorder->element_type() != ffi::DataType::S32 || !attention::has_dims(*sg.qorder, {n}))
      return invalid(std::string(who) + ": the tile order must be int32 [B * ceil(Sq / " +
                     std::to_string(attn::kSegOrderRows) + ")] = [" + std::to_string(n) + "], got " +
                     attention::dims_str(*sg.qorder));
    a->qorder = static_cast<const int*>(sg.qorder->untyped_data());
  }
  return ffi::Error::Success();
}

// The forward's sinks operand: f32 [B, H] (a's sinks point at it) or [0] (none).
ffi::Error set_sinks(const ffi::AnyBuffer& sinks, AttnArgs* a) {
  if (sinks.element_count() == 0 && sinks.dimensions().size() == 1) return ffi::Error::Success();
  if (sinks.element_type() != ffi::DataType::F32 || !attention::has_dims(sinks, {a->B, a->H}))
    return invalid("attention (cuda): sinks must be f32 [B, H] = [" + std::to_string(a->B) + ", " +
                   std::to_string(a->H) + "] (or [0]: none), got " + attention::dims_str(sinks));
  a->sinks = static_cast<const float*>(sinks.untyped_data());
  return ffi::Error::Success();
}

ffi::Error attention_fwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::AnyBuffer sinks, const Segments& sg,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> lse, double scale, double softcap, int64_t mask_kind,
                         int64_t window, int64_t has_mask, int64_t has_bias) {
  const Opts o = attention::make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  AttnArgs a;
  if (auto e = check_inputs("attention", q, k, v, mask, bias, o, &a); e.failure()) return e;
  if (auto e = set_segments("attention", sg, &a); e.failure()) return e;
  if (auto e = set_sinks(sinks, &a); e.failure()) return e;
  const Dims d{a.B, a.Sq, a.Sk, a.H, a.Hkv, a.D};
  if (auto e = attention::check_fwd_results(Backend::kCuda, q, *out, *lse, d); e.failure()) return e;
  if (a.B * a.H * a.Sq == 0) return ffi::Error::Success();
  if (o.has_mask) a.mask = static_cast<const float*>(mask.untyped_data());
  ffi::Error result = ffi::Error::Success();
  dispatch(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = AttentionFwd<T>::launch(stream, a, static_cast<const T*>(q.untyped_data()),
                                     static_cast<const T*>(k.untyped_data()), static_cast<const T*>(v.untyped_data()),
                                     o.has_bias ? static_cast<const T*>(bias.untyped_data()) : nullptr,
                                     static_cast<T*>(out->untyped_data()), static_cast<float*>(lse->untyped_data()));
  });
  return result;
}

ffi::Error attention_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                         ffi::AnyBuffer mask, ffi::AnyBuffer bias, const Segments& sg, ffi::Result<ffi::AnyBuffer> dq,
                         ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                         ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> scratch, double scale,
                         double softcap, int64_t mask_kind, int64_t window, int64_t has_mask, int64_t has_bias) {
  const Opts o = attention::make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  AttnArgs a;
  const char* who = "attention backward";
  if (auto e = check_inputs(who, q, k, v, mask, bias, o, &a); e.failure()) return e;
  if (auto e = set_segments(who, sg, &a); e.failure()) return e;
  const Dims d{a.B, a.Sq, a.Sk, a.H, a.Hkv, a.D};
  if (auto e = attention::check_bwd_rest(Backend::kCuda, q, k, bias, out, lse, dout, dlse, *dq, *dk, *dv, *dbias, o, d);
      e.failure())
    return e;
  const auto t = q.element_type();
  const int64_t need = a.B * a.H * a.Sq;
  if (scratch->element_type() != ffi::DataType::F32 || int64_t(scratch->element_count()) < need)
    return invalid("attention backward (cuda): scratch must be f32 with at least B * H * Sq (" +
                   std::to_string(need) + ") elements, got " + std::to_string(scratch->element_count()));
  if (a.B * a.Hkv == 0) return ffi::Error::Success();
  if (o.has_mask) a.mask = static_cast<const float*>(mask.untyped_data());
  ffi::Error result = ffi::Error::Success();
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    result = AttentionBwd<T>::launch(
        stream, a, static_cast<const T*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
        static_cast<const T*>(v.untyped_data()), static_cast<const T*>(out.untyped_data()),
        static_cast<const float*>(lse.untyped_data()), static_cast<const T*>(dout.untyped_data()),
        static_cast<const float*>(dlse.untyped_data()), o.has_bias ? static_cast<const T*>(bias.untyped_data()) : nullptr,
        static_cast<T*>(dq->untyped_data()), static_cast<T*>(dk->untyped_data()), static_cast<T*>(dv->untyped_data()),
        o.has_bias ? static_cast<T*>(dbias->untyped_data()) : nullptr, static_cast<float*>(scratch->untyped_data()),
        int64_t(scratch->element_count()));
  });
  return result;
}

ffi::Error AttentionFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::AnyBuffer sinks,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, double scale,
                            double softcap, int64_t mask_kind, int64_t window, int64_t has_mask, int64_t has_bias) {
  return attention_fwd(stream, q, k, v, mask, bias, sinks, Segments{}, out, lse, scale, softcap, mask_kind, window,
                       has_mask, has_bias);
}

ffi::Error AttentionSegmentsFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::AnyBuffer sinks,
                                    ffi::AnyBuffer qseg, ffi::AnyBuffer kseg, ffi::AnyBuffer qinfo,
                                    ffi::AnyBuffer kinfo, ffi::AnyBuffer qorder, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> lse, double scale, double softcap, int64_t mask_kind,
                                    int64_t window, int64_t has_mask, int64_t has_bias) {
  return attention_fwd(stream, q, k, v, mask, bias, sinks, Segments{&qseg, &kseg, &qinfo, &kinfo, &qorder}, out, lse,
                       scale, softcap, mask_kind, window, has_mask, has_bias);
}

ffi::Error AttentionBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                            ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dq,
                            ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> scratch, double scale,
                            double softcap, int64_t mask_kind, int64_t window, int64_t has_mask, int64_t has_bias) {
  return attention_bwd(stream, q, k, v, out, lse, dout, dlse, mask, bias, Segments{}, dq, dk, dv, dbias, scratch,
                       scale, softcap, mask_kind, window, has_mask, has_bias);
}

ffi::Error AttentionSegmentsBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                                    ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::AnyBuffer qseg,
                                    ffi::AnyBuffer kseg, ffi::AnyBuffer qinfo, ffi::AnyBuffer kinfo,
                                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                    ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                                    ffi::Result<ffi::AnyBuffer> scratch, double scale, double softcap,
                                    int64_t mask_kind, int64_t window, int64_t has_mask, int64_t has_bias) {
  return attention_bwd(stream, q, k, v, out, lse, dout, dlse, mask, bias, Segments{&qseg, &kseg, &qinfo, &kinfo}, dq,
                       dk, dv, dbias, scratch, scale, softcap, mask_kind, window, has_mask, has_bias);
}

auto bind() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

}  // namespace

// The bindings (attention_bindings.h): forward (q, k, v, mask, bias, sinks) -> (out, lse); backward (q,
// k, v, out, lse, dout, dlse, mask, bias) -> (dq, dk, dv, dbias, scratch); the segment targets
// take the ids and their tables after the bias, the forward after the sinks (attention_segments.cuh).
// Absent mask / bias / sinks are dummy [0] operands (dbias then a dummy [0] result). Command-buffer
// compatible: the handlers only launch kernels on XLA's stream, with launch shapes that depend on
// the buffer shapes, the attributes and the device alone.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionFwdCuda, AttentionFwdImpl,
                              attention::with_attrs(attention::results<2>(attention::operands<6>(bind()))),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionBwdCuda, AttentionBwdImpl,
                              attention::with_attrs(attention::results<5>(attention::operands<9>(bind()))),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionSegmentsFwdCuda, AttentionSegmentsFwdImpl,
                              attention::with_attrs(attention::results<2>(attention::operands<11>(bind()))),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionSegmentsBwdCuda, AttentionSegmentsBwdImpl,
                              attention::with_attrs(attention::results<5>(attention::operands<13>(bind()))),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_attention_fwd", RlxAttentionFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_attention_bwd", RlxAttentionBwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_attention_segments_fwd", RlxAttentionSegmentsFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_attention_segments_bwd", RlxAttentionSegmentsBwdCuda);

}  // namespace cuda
}  // namespace rlx
