// The attention launchers, one per (pass, dtype): each checks which kernel serves the call (the
// tensor-core and wgmma paths and their switches: attention_launch_impl.cuh) and launches it on
// XLA's stream. Declared here for the FFI handlers (attention.cu); defined in
// attention_launch_impl.cuh and instantiated in one translation unit per pass and dtype
// (attention_fwd_bf16.cu, attention_fwd_f16.cu, attention_bwd_bf16.cu, attention_bwd_f16.cu,
// attention_f32.cu), so that a build compiles the ~150 kernel instantiations in parallel.
#pragma once

#include <cstdint>

#include "cuda/attention_generic.cuh"

namespace rlx {
namespace cuda {

// q [B, Sq, H, D], k, v [B, Sk, Hkv, D], bias [B, H, Sq, Sk] or null -> out (q's shape), lse [B, H, Sq].
template <typename T>
struct AttentionFwd {
  static ffi::Error launch(cudaStream_t stream, const attn::AttnArgs& a, const T* q, const T* k, const T* v,
                           const T* bias, T* out, float* lse);
};

// ... + out, lse, dout, dlse [B, H, Sq] -> dq, dk, dv, dbias (or null), with delta the f32 scratch of
// scratch_elems >= B * H * Sq elements.
template <typename T>
struct AttentionBwd {
  static ffi::Error launch(cudaStream_t stream, const attn::AttnArgs& a, const T* q, const T* k, const T* v,
                           const T* out, const float* lse, const T* dout, const float* dlse, const T* bias, T* dq,
                           T* dk, T* dv, T* dbias, float* delta, int64_t scratch_elems);
};

}  // namespace cuda
}  // namespace rlx
