// XLA FFI handlers for 2-D pooling on CUDA: targets rlx_max_pool2d_fwd,
// rlx_max_pool2d_bwd and rlx_avg_pool2d_bwd (the CPU kernels in ffi/cpu/pool.cc define
// the maths; see rlx_jax/vjp_rules/pool.py).
//
// x [P..., H, W] (every leading index is a plane), window (kh, kw), stride (sh, sw),
// padding (ph, pw) on both sides; Ho = (H + 2 ph - kh) / sh + 1; window (i, j) covers
// rows i*sh - ph + [0, kh) and columns j*sw - pw + [0, kw).
//
// rlx_max_pool2d_fwd: x -> y, argmax (i32), attrs kh kw sh sw ph pw (as on CPU). One
//   thread per output: y = window max (padding -inf), argmax = flat in-plane index of
//   the FIRST maximum in row-major window order (strictly greater than every earlier
//   value, starting from -inf; NaN never wins), -1 when nothing exceeds -inf; y is then
//   x[argmax] (or -inf). Same comparisons as the CPU kernel, so the same bits.
// rlx_max_pool2d_bwd (CUDA contract): dy, argmax -> dx, WITH the geometry attrs
//   kh kw sh sw ph pw (the CPU handler takes none: the Python side passes them on CUDA
//   only). No scatter: one thread per input element (h, w) loops over the outputs whose
//   windows cover it, in increasing output order, and adds dy where argmax equals its
//   flat index h*W + w (f32 accumulation, written once): deterministic, no atomics,
//   the same sums in the same order as the CPU kernel's scatter for every argmax the
//   forward produces (an argmax always lies in its own window; an index outside its
//   window, which the forward never writes, passes no gradient here).
// rlx_avg_pool2d_bwd: dy -> dx, attrs as on CPU. One thread per input element: the sum
//   over the covering outputs (row by row: each row's sum over the covering columns,
//   then those row sums in increasing row order, as the CPU kernel) times 1 / (kh kw)
//   (count_include_pad).
//
// Every kernel is a grid-stride loop over elements (32-bit index arithmetic when every
// extent fits, else 64-bit), runs on XLA's stream,
// allocates nothing, and returns at once on zero-sized operands.
#include <cmath>
#include <limits>

#include "cuda/common.cuh"

namespace rlx {
namespace cuda {
namespace {

struct Geom {
  int64_t kh, kw, sh, sw, ph, pw;
};

struct PlaneView {
  int64_t planes, h, w;
};

PlaneView plane_view(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  int64_t planes = 1;
  for (size_t i = 0; i + 2 < d.size(); ++i) planes *= d[i];
  return {planes, d[d.size() - 2], d[d.size() - 1]};
}

bool same_dims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  return da.size() == db.size() && std::equal(da.begin(), da.end(), db.begin());
}
ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }

int64_t pooled(int64_t n, int64_t k, int64_t s, int64_t p) { return (n + 2 * p - k) / s + 1; }

ffi::Error check_geom(const char* who, const Geom& g) {
  if (g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1 || g.ph < 0 || g.pw < 0)
    return invalid(std::string(who) + ": kernel and stride must be >= 1, padding >= 0");
  return ffi::Error::Success();
}

// `in` [P..., H, W] and `out` [P..., Ho, Wo]: same planes, (Ho, Wo) the pooled size.
ffi::Error check_pair(const char* who, const ffi::AnyBuffer& in, const ffi::AnyBuffer& out, const Geom& g) {
  auto di = in.dimensions(), dout = out.dimensions();
  if (di.size() < 2 || dout.size() != di.size())
    return invalid(std::string(who) + ": operands must have equal rank >= 2 ([..., H, W])");
  for (size_t i = 0; i + 2 < di.size(); ++i)
    if (di[i] != dout[i]) return invalid(std::string(who) + ": leading (plane) dims differ");
  const int64_t h = di[di.size() - 2], w = di[di.size() - 1];
  if (h + 2 * g.ph < g.kh || w + 2 * g.pw < g.kw)
    return invalid(std::string(who) + ": kernel larger than the padded input");
  if (dout[di.size() - 2] != pooled(h, g.kh, g.sh, g.ph) || dout[di.size() - 1] != pooled(w, g.kw, g.sw, g.pw))
    return invalid(std::string(who) + ": pooled dims do not match the window geometry");
  return ffi::Error::Success();
}

template <typename F>
bool dispatch(ffi::DataType dtype, F&& fn) {
  switch (dtype) {
    case ffi::DataType::F32: fn(float{}); return true;
    case ffi::DataType::BF16: fn(__nv_bfloat16{}); return true;
    case ffi::DataType::F16: fn(__half{}); return true;
    default: return false;
  }
}

// Outputs whose windows cover input coordinate n along one axis: [lo, hi) within
// [0, out). Window i covers i*s - p + [0, k): i*s <= n + p and i*s >= n + p - k + 1.
template <typename I>
__device__ __forceinline__ void covering(I n, I k, I s, I p, I out, I* lo, I* hi) {
  const I top = n + p;
  const I bottom = top - k + 1;
  const I first = bottom <= 0 ? 0 : (bottom + s - 1) / s;
  const I last = top < 0 ? -1 : top / s;
  *lo = first > 0 ? first : 0;
  *hi = last + 1 < out ? last + 1 : out;
  if (*hi < *lo) *hi = *lo;
}

constexpr int kThreads = 256;

// The window geometry in the index type I of a kernel instantiation: int (every
// extent, padded extent and element count below 2^30: cheap 32-bit divisions) or
// int64_t.
template <typename I>
struct GeomI {
  I kh, kw, sh, sw, ph, pw;
};

// Element e of a [planes, n1, n2] layout -> (plane, a, b); two divisions.
template <typename I>
__device__ __forceinline__ void split3(I e, I n1, I n2, I* p, I* a, I* b) {
  const I t = e / n2;
  *b = e - t * n2;
  *p = t / n1;
  *a = t - *p * n1;
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) max_fwd_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                           int32_t* __restrict__ am, I total, I h, I w, I ho, I wo,
                                                           GeomI<I> g) {
  const I step = I(gridDim.x) * I(blockDim.x);
  for (I e = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); e < total; e += step) {
    I p, i, j;
    split3(e, ho, wo, &p, &i, &j);
    const T* xp = x + int64_t(p) * h * w;
    const I rs = i * g.sh - g.ph, cs = j * g.sw - g.pw;
    const I r0 = rs > 0 ? rs : 0, r1 = rs + g.kh < h ? rs + g.kh : h;
    const I c0 = cs > 0 ? cs : 0, c1 = cs + g.kw < w ? cs + g.kw : w;
    float best = -INFINITY;
    I arg = -1;
    for (I r = r0; r < r1; ++r) {
      const T* row = xp + r * w;
      for (I c = c0; c < c1; ++c) {
        const float v = to_f32(row[c]);
        if (v > best) {
          best = v;
          arg = r * w + c;
        }
      }
    }
    y[e] = arg >= 0 ? xp[arg] : from_f32<T>(best);
    am[e] = int32_t(arg);
  }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) max_bwd_kernel(const T* __restrict__ dy, const int32_t* __restrict__ am,
                                                           T* __restrict__ dx, I total, I h, I w, I ho, I wo,
                                                           GeomI<I> g) {
  const I step = I(gridDim.x) * I(blockDim.x);
  for (I e = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); e < total; e += step) {
    I p, r, c;
    split3(e, h, w, &p, &r, &c);
    I i0, i1, j0, j1;
    covering<I>(r, g.kh, g.sh, g.ph, ho, &i0, &i1);
    covering<I>(c, g.kw, g.sw, g.pw, wo, &j0, &j1);
    const int32_t me = int32_t(r * w + c);
    const T* dyp = dy + int64_t(p) * ho * wo;
    const int32_t* ap = am + int64_t(p) * ho * wo;
    float acc = 0.f;
    for (I i = i0; i < i1; ++i)
      for (I j = j0; j < j1; ++j) {
        const I o = i * wo + j;
        if (__ldg(ap + o) == me) acc += to_f32(dyp[o]);
      }
    dx[e] = from_f32<T>(acc);
  }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads) avg_bwd_kernel(const T* __restrict__ dy, T* __restrict__ dx, I total, I h,
                                                           I w, I ho, I wo, GeomI<I> g, float inv) {
  const I step = I(gridDim.x) * I(blockDim.x);
  for (I e = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); e < total; e += step) {
    I p, r, c;
    split3(e, h, w, &p, &r, &c);
    I i0, i1, j0, j1;
    covering<I>(r, g.kh, g.sh, g.ph, ho, &i0, &i1);
    covering<I>(c, g.kw, g.sw, g.pw, wo, &j0, &j1);
    const T* dyp = dy + int64_t(p) * ho * wo;
    float s = 0.f;
    for (I i = i0; i < i1; ++i) {
      float rs = 0.f;
      for (I j = j0; j < j1; ++j) rs += to_f32(dyp[i * wo + j]);
      s += rs;
    }
    dx[e] = from_f32<T>(s * inv);
  }
}

// True when every index a kernel forms for these extents fits a 32-bit int: element
// counts, padded extents, window and stride below 2^30 (sums of two stay below 2^31).
bool fits32(int64_t total, const PlaneView& v, int64_t ho, int64_t wo, const Geom& g) {
  const int64_t lim = int64_t(1) << 30;
  return total < lim && v.planes * v.h * v.w < lim && v.planes * ho * wo < lim && v.h + 2 * g.ph < lim &&
         v.w + 2 * g.pw < lim && g.kh < lim && g.kw < lim && g.sh < lim && g.sw < lim;
}

template <typename I>
GeomI<I> geom_as(const Geom& g) {
  return {I(g.kh), I(g.kw), I(g.sh), I(g.sw), I(g.ph), I(g.pw)};
}

// Launches kernel<I> with I = int when fits32, else int64_t (fn(I{}) launches).
template <typename F>
void with_index(bool small, F&& fn) {
  if (small) fn(int{});
  else fn(int64_t{});
}

// Blocks of kThreads for `total` elements: enough to fill the device, the rest by the
// grid-stride loop.
ffi::Error grid_for(int64_t total, unsigned* blocks) {
  DeviceInfo info;
  if (cudaError_t e = device_info(&info); e != cudaSuccess) return cuda_error("pool: device query", e);
  const int64_t need = (total + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(info.sms) * 32;
  *blocks = unsigned(need < cap ? need : cap);
  return ffi::Error::Success();
}

ffi::Error MaxPoolFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> argmax, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                          int64_t ph, int64_t pw) {
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = check_geom("max_pool2d", g); e.failure()) return e;
  if (auto e = check_pair("max_pool2d", x, *y, g); e.failure()) return e;
  if (y->element_type() != x.element_type()) return invalid("max_pool2d: y dtype must match x");
  if (argmax->element_type() != ffi::DataType::S32 || !same_dims(*y, *argmax))
    return invalid("max_pool2d: argmax must be i32 shaped like y");
  const PlaneView v = plane_view(x);
  if (v.h * v.w > int64_t(std::numeric_limits<int32_t>::max()))
    return invalid("max_pool2d: a plane of more than 2^31 - 1 elements does not fit an i32 argmax");
  auto dd = y->dimensions();
  const int64_t ho = dd[dd.size() - 2], wo = dd[dd.size() - 1];
  const int64_t total = v.planes * ho * wo;
  if (total == 0) return ffi::Error::Success();
  unsigned blocks = 0;
  if (auto e = grid_for(total, &blocks); e.failure()) return e;
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    with_index(fits32(total, v, ho, wo, g), [&](auto itag) {
      using I = decltype(itag);
      max_fwd_kernel<T, I><<<blocks, kThreads, 0, stream>>>(
          static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
          static_cast<int32_t*>(argmax->untyped_data()), I(total), I(v.h), I(v.w), I(ho), I(wo), geom_as<I>(g));
    });
  });
  if (!ok) return invalid("max_pool2d (cuda): unsupported dtype " + dtype_name(x.element_type()));
  return check_launch("max_pool2d (cuda) forward launch");
}

ffi::Error MaxPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer argmax,
                          ffi::Result<ffi::AnyBuffer> dx, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                          int64_t pw) {
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (argmax.element_type() != ffi::DataType::S32 || !same_dims(dy, argmax))
    return invalid("max_pool2d backward: argmax must be i32 shaped like dy");
  if (dx->element_type() != dy.element_type()) return invalid("max_pool2d backward: dx dtype must match dy");
  if (auto e = check_geom("max_pool2d backward", g); e.failure()) return e;
  if (auto e = check_pair("max_pool2d backward", *dx, dy, g); e.failure()) return e;
  const PlaneView v = plane_view(*dx);
  if (v.h * v.w > int64_t(std::numeric_limits<int32_t>::max()))
    return invalid("max_pool2d backward: a plane of more than 2^31 - 1 elements does not fit an i32 argmax");
  auto dd = dy.dimensions();
  const int64_t ho = dd[dd.size() - 2], wo = dd[dd.size() - 1];
  const int64_t total = v.planes * v.h * v.w;
  if (total == 0) return ffi::Error::Success();
  unsigned blocks = 0;
  if (auto e = grid_for(total, &blocks); e.failure()) return e;
  bool ok = dispatch(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    with_index(fits32(total, v, ho, wo, g), [&](auto itag) {
      using I = decltype(itag);
      max_bwd_kernel<T, I><<<blocks, kThreads, 0, stream>>>(
          static_cast<const T*>(dy.untyped_data()), static_cast<const int32_t*>(argmax.untyped_data()),
          static_cast<T*>(dx->untyped_data()), I(total), I(v.h), I(v.w), I(ho), I(wo), geom_as<I>(g));
    });
  });
  if (!ok) return invalid("max_pool2d backward (cuda): unsupported dtype " + dtype_name(dy.element_type()));
  return check_launch("max_pool2d (cuda) backward launch");
}

ffi::Error AvgPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx, int64_t kh,
                          int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  const Geom g{kh, kw, sh, sw, ph, pw};
  if (auto e = check_geom("avg_pool2d backward", g); e.failure()) return e;
  if (auto e = check_pair("avg_pool2d backward", *dx, dy, g); e.failure()) return e;
  if (dx->element_type() != dy.element_type()) return invalid("avg_pool2d backward: dx dtype must match dy");
  const PlaneView v = plane_view(*dx);
  auto dd = dy.dimensions();
  const int64_t ho = dd[dd.size() - 2], wo = dd[dd.size() - 1];
  const int64_t total = v.planes * v.h * v.w;
  if (total == 0) return ffi::Error::Success();
  unsigned blocks = 0;
  if (auto e = grid_for(total, &blocks); e.failure()) return e;
  const float inv = 1.0f / float(g.kh * g.kw);
  bool ok = dispatch(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    with_index(fits32(total, v, ho, wo, g), [&](auto itag) {
      using I = decltype(itag);
      avg_bwd_kernel<T, I><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(dy.untyped_data()),
                                                            static_cast<T*>(dx->untyped_data()), I(total), I(v.h),
                                                            I(v.w), I(ho), I(wo), geom_as<I>(g), inv);
    });
  });
  if (!ok) return invalid("avg_pool2d backward (cuda): unsupported dtype " + dtype_name(dy.element_type()));
  return check_launch("avg_pool2d (cuda) backward launch");
}

}  // namespace

// Command-buffer compatible: kernel launches on XLA's stream only, launch shapes from the
// buffer shapes and the device.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxMaxPool2dFwdCuda, MaxPoolFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // argmax
                                  .Attr<int64_t>("kh")
                                  .Attr<int64_t>("kw")
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("ph")
                                  .Attr<int64_t>("pw"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxMaxPool2dBwdCuda, MaxPoolBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // argmax
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<int64_t>("kh")
                                  .Attr<int64_t>("kw")
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("ph")
                                  .Attr<int64_t>("pw"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxAvgPool2dBwdCuda, AvgPoolBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<int64_t>("kh")
                                  .Attr<int64_t>("kw")
                                  .Attr<int64_t>("sh")
                                  .Attr<int64_t>("sw")
                                  .Attr<int64_t>("ph")
                                  .Attr<int64_t>("pw"),
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_max_pool2d_fwd", RlxMaxPool2dFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_max_pool2d_bwd", RlxMaxPool2dBwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_avg_pool2d_bwd", RlxAvgPool2dBwdCuda);

}  // namespace cuda
}  // namespace rlx
