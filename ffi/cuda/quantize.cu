// XLA FFI handlers for fake-quantization backward on CUDA, same targets and contracts as
// ffi/cpu/quantize.cc (x, dy, dx: [G, O, C, I]; scale s: [G, C] f32; q = q_max attr):
//
// rlx_fake_quantize_bwd: x, s, dy -> dx, attrs q_max (f32), ste (i64), STE codes
//   0 identity          dx = dy            (a device-to-device copy)
//   1 clipped identity  dx = dy * [|x| <= q s]
//   2 tanh              dx = dy * (1 - tanh(x / s)^2)
//   3 hard tanh         dx = dy * max(0, 1 - |x / (q s)|)
// rlx_fake_quantize_lsq_bwd: x, s, dy -> dx, dscale [G, C] f32, scratch [S] f32, attr
//   q_max. s_eff = max(s, 1e-12), z = x / s_eff:
//   dx = dy * [|z| <= q],  dscale[g, c] = sum over the channel of dy * psi(z),
//   psi(z) = round(z) - z inside (round half away from zero), sign(z) q outside.
//   The CUDA call has one more result than the CPU one: the f32 scratch of per-warp /
//   per-chunk partial sums, S >= max(1, per_sum) with per_sum from channel_reduce.cuh's
//   plan (rlx_jax/vjp_rules/quantize.py: cuda_lsq_scratch_size). XLA allocates it.
//
// rlx_fake_quantize_bwd is compiled and registered only with -DRLX_CUDA_FAKE_QUANTIZE_STE
// (e.g. CMAKE_CUDA_FLAGS): it is elementwise, and XLA's own fusion of the reference runs at
// the copy floor (below the 1:1 copy for this 2-read / 1-write mix) and fuses the per-batch
// max-abs scale into the same pass; this kernel measured 0.68-0.90x XLA on an H200,
// so by default the STE gradient stays on XLA on GPUs. The code passed the GPU tests.
// Divisions are IEEE (__fdiv_rn) although the module builds with --use_fast_math: the
// rounding of z at halves and the |z| <= q edge must agree with the CPU kernel and XLA.
// x, dy, dx in f32, bf16 or f16 (f64 stays on the CPU / XLA); arithmetic in f32.
#include "cuda/channel_reduce.cuh"
#include "quantize_checks.h"

namespace rlx {
namespace cuda {
namespace {

#ifdef RLX_CUDA_FAKE_QUANTIZE_STE
template <typename TT, int STE>
struct SteOp {
  using T = TT;
  static constexpr int NS = 0;
  const T* __restrict__ x;
  const T* __restrict__ dy;
  T* __restrict__ dx;
  const float* __restrict__ s;
  float q;
  struct Param { float s, bound; };
  __device__ __forceinline__ Param param(int64_t ch) const {
    const float sc = __ldg(s + ch);
    return {sc, q * sc};
  }
  __device__ __forceinline__ float apply(float xv, float g, const Param& p, float*) const {
    float f;
    if constexpr (STE == 1) {
      f = fabsf(xv) <= p.bound ? 1.f : 0.f;
    } else if constexpr (STE == 2) {
      // tanh(|z|) = expm1(2|z|) / (expm1(2|z|) + 2): expm1f (1 ulp) and an IEEE division,
      // both untouched by --use_fast_math (tanhf measured ~1e-5 off the f64 value there);
      // tanh(|z| >= 10) is 1 in f32
      const float az = fabsf(__fdiv_rn(xv, p.s));
      float th = 1.f;
      if (!(az >= 10.f)) {  // (a NaN z stays NaN)
        const float m = expm1f(2.f * az);
        th = __fdiv_rn(m, m + 2.f);
      }
      f = 1.f - th * th;
    } else {
      const float att = 1.f - fabsf(__fdiv_rn(xv, p.bound));
      f = att > 0.f ? att : 0.f;
    }
    return g * f;
  }
};
#endif  // RLX_CUDA_FAKE_QUANTIZE_STE

template <typename TT>
struct LsqOp {
  using T = TT;
  static constexpr int NS = 1;
  const T* __restrict__ x;
  const T* __restrict__ dy;
  T* __restrict__ dx;
  const float* __restrict__ s;
  float* __restrict__ ds;
  float q;
  struct Param { float s; };
  __device__ __forceinline__ Param param(int64_t ch) const { return {fmaxf(__ldg(s + ch), 1e-12f)}; }
  __device__ __forceinline__ float apply(float xv, float g, const Param& p, float* acc) const {
    const float z = __fdiv_rn(xv, p.s);
    const bool inside = fabsf(z) <= q;
    const float zc = fminf(fmaxf(z, -q - 1.f), q + 1.f);
    const float psi = inside ? roundf(zc) - z : (z > 0.f ? q : -q);
    acc[0] += psi * g;
    return inside ? g : 0.f;
  }
  __device__ __forceinline__ void finish(int64_t ch, const float* sums) const { ds[ch] = sums[0]; }
};

#ifdef RLX_CUDA_FAKE_QUANTIZE_STE
ffi::Error FakeQuantizeBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::AnyBuffer dy,
                               ffi::Result<ffi::AnyBuffer> dx, float q_max, int64_t ste) {
  const char* who = "fake_quantize backward";
  quantize::Shape sh{};
  if (auto e = quantize::check_ste_bwd(Backend::kCuda, x, s, dy, *dx, q_max, ste, sh); e.failure()) return e;
  const chan::View v{sh.g, sh.o, sh.c, sh.i};
  if (v.elements() == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.untyped_data());
    const T* dyp = static_cast<const T*>(dy.untyped_data());
    T* dxp = static_cast<T*>(dx->untyped_data());
    const float* sp = static_cast<const float*>(s.untyped_data());
    switch (ste) {
      case 0: {
        cudaError_t e = cudaMemcpyAsync(dxp, dyp, sizeof(T) * size_t(v.elements()), cudaMemcpyDeviceToDevice, stream);
        result = e == cudaSuccess ? ffi::Error::Success() : cuda_error(who, e);
        break;
      }
      case 1: result = chan::launch(stream, SteOp<T, 1>{xp, dyp, dxp, sp, q_max}, v, nullptr, who); break;
      case 2: result = chan::launch(stream, SteOp<T, 2>{xp, dyp, dxp, sp, q_max}, v, nullptr, who); break;
      default: result = chan::launch(stream, SteOp<T, 3>{xp, dyp, dxp, sp, q_max}, v, nullptr, who); break;
    }
  });
  if (!ok) return invalid("fake_quantize backward (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}
#endif  // RLX_CUDA_FAKE_QUANTIZE_STE

ffi::Error LsqBwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer s, ffi::AnyBuffer dy,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> ds,
                      ffi::Result<ffi::AnyBuffer> scratch, float q_max) {
  const char* who = "fake_quantize_lsq backward";
  quantize::Shape sh{};
  if (auto e = quantize::check_lsq_bwd(Backend::kCuda, x, s, dy, *dx, *ds, q_max, sh); e.failure()) return e;
  const chan::View v{sh.g, sh.o, sh.c, sh.i};
  if (auto e = chan::check_scratch(who, v, LsqOp<float>::NS, *scratch); e.failure()) return e;
  ffi::Error result = ffi::Error::Success();
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    LsqOp<T> op{static_cast<const T*>(x.untyped_data()), static_cast<const T*>(dy.untyped_data()),
                static_cast<T*>(dx->untyped_data()), static_cast<const float*>(s.untyped_data()),
                static_cast<float*>(ds->untyped_data()), q_max};
    result = chan::launch(stream, op, v, static_cast<float*>(scratch->untyped_data()), who);
  });
  if (!ok) return invalid("fake_quantize_lsq backward (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return result;
}

}  // namespace

// Command-buffer compatible: kernels (and a device-to-device copy) on XLA's stream only,
// launch shapes from the buffer shapes and the device alone.
#ifdef RLX_CUDA_FAKE_QUANTIZE_STE
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxFakeQuantizeBwdCuda, FakeQuantizeBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [G, O, C, I]
                                  .Arg<ffi::AnyBuffer>()  // scale [G, C] f32
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<float>("q_max")
                                  .Attr<int64_t>("ste"),
                              {ffi::Traits::kCmdBufferCompatible});
RLX_CUDA_REGISTER_HANDLER("rlx_fake_quantize_bwd", RlxFakeQuantizeBwdCuda);
#endif  // RLX_CUDA_FAKE_QUANTIZE_STE

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxFakeQuantizeLsqBwdCuda, LsqBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [G, O, C, I]
                                  .Arg<ffi::AnyBuffer>()  // scale [G, C] f32
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dscale [G, C] f32
                                  .Ret<ffi::AnyBuffer>()  // scratch f32
                                  .Attr<float>("q_max"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_fake_quantize_lsq_bwd", RlxFakeQuantizeLsqBwdCuda);

}  // namespace cuda
}  // namespace rlx
