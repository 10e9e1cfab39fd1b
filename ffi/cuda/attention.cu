// XLA FFI handlers for attention on CUDA: targets rlx_attention_fwd and rlx_attention_bwd.
// The contract (shapes, masks, scale, softcap, bias, fully hidden rows) is the module
// docstring of rlx_jax/vjp_rules/attention.py and ffi/cpu/attention.cc; the kernels are in
// attention_generic.cuh (every case) and attention_mma.cuh (tensor cores).
//
// rlx_attention_fwd: q [B, Sq, H, D], k, v [B, Sk, Hkv, D], mask [B, Sk] f32 (or [0]),
//   bias [B, H, Sq, Sk] (or [0]) -> out (q's shape and dtype), lse [B, H, Sq] f32.
// rlx_attention_bwd: q, k, v, out, lse, dout, dlse, mask, bias -> dq, dk, dv, dbias (bias's
//   shape, [0] without a bias), scratch f32 with at least B * H * Sq elements (delta_i =
//   rowsum(dout * out) - dlse_i; the Python side sizes it, XLA allocates it).
// Attrs: scale, softcap (f64; softcap 0 = off), mask_kind (0 none, 1 causal, 2 sliding),
//   window, has_mask, has_bias (i64).
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

#include "cuda/attention_launch.cuh"

namespace rlx {
namespace cuda {
namespace {

using attn::AttnArgs;

std::string dims_str(const ffi::AnyBuffer& x) {
  std::string s = "[";
  auto dd = x.dimensions();
  for (size_t i = 0; i < dd.size(); ++i) s += (i ? ", " : "") + std::to_string(dd[i]);
  return s + "]";
}
bool has_dims(const ffi::AnyBuffer& x, std::initializer_list<int64_t> want) {
  auto dd = x.dimensions();
  return dd.size() == want.size() && std::equal(dd.begin(), dd.end(), want.begin());
}
struct Opts {
  int64_t kind, window;
  double scale, softcap;
  bool has_mask, has_bias;
};

ffi::Error check_inputs(const char* who, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& mask, const ffi::AnyBuffer& bias, const Opts& o, AttnArgs* a) {
  const std::string w = who;
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4)
    return invalid(w + ": q and k must have rank 4 ([B, S, H, D]), got q " + dims_str(q) + ", k " + dims_str(k));
  auto qd = q.dimensions(), kd = k.dimensions();
  *a = AttnArgs{};
  a->B = qd[0];
  a->Sq = qd[1];
  a->H = qd[2];
  a->D = qd[3];
  a->Sk = kd[1];
  a->Hkv = kd[2];
  if (kd[0] != a->B || kd[3] != a->D)
    return invalid(w + ": k " + dims_str(k) + " does not match q " + dims_str(q) + " in batch or head dim");
  if (!same_dims(k, v)) return invalid(w + ": v " + dims_str(v) + " must match k " + dims_str(k));
  if (a->Hkv == 0 ? a->H != 0 : a->H % a->Hkv != 0)
    return invalid(w + ": kv heads (" + std::to_string(a->Hkv) + ") must divide heads (" + std::to_string(a->H) +
                   ")");
  const auto t = q.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16)
    return invalid(w + " (cuda): unsupported dtype " + dtype_name(t) + " (f32, bf16, f16)");
  if (k.element_type() != t || v.element_type() != t) return invalid(w + ": q, k, v dtypes differ");
  if (o.has_mask && (mask.element_type() != ffi::DataType::F32 || !has_dims(mask, {a->B, a->Sk})))
    return invalid(w + ": mask must be f32 [B, Sk], got " + dims_str(mask));
  if (o.has_bias && (bias.element_type() != t || !has_dims(bias, {a->B, a->H, a->Sq, a->Sk})))
    return invalid(w + ": bias must be [B, H, Sq, Sk] with q's dtype, got " + dims_str(bias));
  if (o.kind < 0 || o.kind > 2) return invalid(w + ": mask_kind must be 0, 1 or 2");
  if (o.kind == 2 && o.window < 0) return invalid(w + ": window must be >= 0");
  if (!(o.softcap >= 0.0) || !std::isfinite(o.softcap) || !std::isfinite(o.scale))
    return invalid(w + ": softcap must be >= 0 (0: off) and finite, scale finite");
  if (a->D > attn::kGenMaxD)
    return invalid(w + " (cuda): head dim " + std::to_string(a->D) + " > " + std::to_string(attn::kGenMaxD));
  a->group = a->Hkv > 0 ? a->H / a->Hkv : 1;
  a->off = a->Sk > a->Sq ? a->Sk - a->Sq : 0;
  a->kind = int(o.kind);
  a->window = o.kind == 2 ? o.window : 0;
  a->scale = float(o.scale);
  a->softcap = float(o.softcap);
  a->mask = nullptr;
  return ffi::Error::Success();
}


Opts make_opts(double scale, double softcap, int64_t kind, int64_t window, int64_t has_mask, int64_t has_bias) {
  return Opts{kind, window, scale, softcap, has_mask != 0, has_bias != 0};
}

ffi::Error AttentionFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> lse, double scale, double softcap, int64_t mask_kind,
                            int64_t window, int64_t has_mask, int64_t has_bias) {
  const Opts o = make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  AttnArgs a;
  if (auto e = check_inputs("attention", q, k, v, mask, bias, o, &a); e.failure()) return e;
  if (!same_dims(q, *out) || out->element_type() != q.element_type()) return invalid("attention: out must match q");
  if (lse->element_type() != ffi::DataType::F32 || !has_dims(*lse, {a.B, a.H, a.Sq}))
    return invalid("attention (cuda): lse must be [B, H, Sq] f32");
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

ffi::Error AttentionBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                            ffi::AnyBuffer mask, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dq,
                            ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> scratch, double scale,
                            double softcap, int64_t mask_kind, int64_t window, int64_t has_mask, int64_t has_bias) {
  const Opts o = make_opts(scale, softcap, mask_kind, window, has_mask, has_bias);
  AttnArgs a;
  const char* who = "attention backward";
  if (auto e = check_inputs(who, q, k, v, mask, bias, o, &a); e.failure()) return e;
  const auto t = q.element_type();
  for (const ffi::AnyBuffer* x : {&out, &dout})
    if (!same_dims(q, *x) || x->element_type() != t)
      return invalid("attention backward: out and dout must match q in shape and dtype");
  for (const ffi::AnyBuffer* x : {&lse, &dlse})
    if (x->element_type() != ffi::DataType::F32 || !has_dims(*x, {a.B, a.H, a.Sq}))
      return invalid("attention backward (cuda): lse and dlse must be [B, H, Sq] f32");
  if (!same_dims(q, *dq) || dq->element_type() != t || !same_dims(k, *dk) || dk->element_type() != t ||
      !same_dims(k, *dv) || dv->element_type() != t)
    return invalid("attention backward: dq, dk, dv must match q, k, v");
  if (o.has_bias && (!same_dims(bias, *dbias) || dbias->element_type() != t))
    return invalid("attention backward: dbias must match bias");
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

}  // namespace

// Command-buffer compatible: the handlers only launch kernels on XLA's stream, with launch
// shapes that depend on the buffer shapes, the attributes and the device alone.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionFwdCuda, AttentionFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // mask (dummy [0] when absent)
                                  .Arg<ffi::AnyBuffer>()  // bias (dummy [0] when absent)
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attr<double>("scale")
                                  .Attr<double>("softcap")
                                  .Attr<int64_t>("mask_kind")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("has_mask")
                                  .Attr<int64_t>("has_bias"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAttentionBwdCuda, AttentionBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // dbias (dummy [0] when no bias)
                                  .Ret<ffi::AnyBuffer>()  // scratch f32 [>= B * H * Sq]
                                  .Attr<double>("scale")
                                  .Attr<double>("softcap")
                                  .Attr<int64_t>("mask_kind")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("has_mask")
                                  .Attr<int64_t>("has_bias"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_attention_fwd", RlxAttentionFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_attention_bwd", RlxAttentionBwdCuda);

}  // namespace cuda
}  // namespace rlx
