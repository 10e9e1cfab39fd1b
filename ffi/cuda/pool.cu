// XLA FFI handlers for 2-D max pooling on CUDA: targets rlx_max_pool2d_fwd and
// rlx_max_pool2d_bwd (the CPU kernels in ffi/cpu/pool.cc define the maths; see
// rlx_jax/vjp_rules/pool.py). Average pooling's backward has no CUDA kernel: a
// one-column-per-thread kernel measured 0.35-0.85x XLA's code on an H200 (2026-11-22,
// benchmarks/results/gather_pool_h200_2026-11-22.txt), so on GPUs it stays XLA's.
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
// Every kernel gives each thread one column and a few consecutive rows of a plane (see
// Launch below), runs on XLA's stream, allocates nothing, and returns at once on
// zero-sized operands.
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

// Outputs whose windows cover input coordinate n along one axis: [lo, hi) within
// [0, out), as the CPU kernel's covering(). Window i covers i*s - p + [0, k):
// i*s <= n + p and i*s >= n + p - k + 1. The unclipped bounds (first i with
// i*s >= n + p - k + 1, first i with i*s > n + p) only grow with n, so a thread walking
// down consecutive rows divides once and then steps them (Cover::advance).
struct Cover {
  int k, s, p, out;
  int first, past;  // unclipped: first covering window, one past the last
  __device__ __forceinline__ void init(int n) {
    const int top = n + p, bottom = top - k + 1;
    first = bottom <= 0 ? 0 : (bottom + s - 1) / s;
    past = top < 0 ? 0 : top / s + 1;
  }
  __device__ __forceinline__ void advance(int n) {  // n = previous n + 1
    const int top = n + p, bottom = top - k + 1;
    while (first * s < bottom) ++first;
    while (past * s <= top) ++past;
  }
  __device__ __forceinline__ int lo() const { return first; }
  __device__ __forceinline__ int hi() const {
    const int h = past < out ? past : out;
    return h < first ? first : h;
  }
};

// Work layout of every kernel here: blockDim (TX, TY) with TX * TY = 256 threads;
// thread x walks one column of one plane (grid.x tiles the columns), thread y takes
// kRows consecutive rows (grid.y tiles the rows), grid.z the planes (both y and z
// loop when the grid limit is reached). A warp covers 32 consecutive columns of one
// row: coalesced loads and stores. No per-element integer division.
constexpr int kThreads = 256;
constexpr int kRows = 8;

struct Launch {
  dim3 grid, block;
  int row_tiles;
};

Launch launch_for(int64_t planes, int64_t rows, int64_t cols) {
  const int tx = cols <= 32 ? 32 : (cols <= 64 ? 64 : 128);
  const int ty = kThreads / tx;
  const int64_t row_tiles = (rows + int64_t(ty) * kRows - 1) / (int64_t(ty) * kRows);
  Launch l;
  l.block = dim3(unsigned(tx), unsigned(ty), 1);
  l.grid = dim3(unsigned((cols + tx - 1) / tx), unsigned(std::min<int64_t>(row_tiles, 65535)),
                unsigned(std::min<int64_t>(planes, 65535)));
  l.row_tiles = int(row_tiles);
  return l;
}

struct Geom32 {
  int kh, kw, sh, sw, ph, pw;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) max_fwd_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                           int32_t* __restrict__ am, int64_t planes, int h, int w,
                                                           int ho, int wo, Geom32 g, int row_tiles) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= wo) return;  // no barriers below
  const int cs = j * g.sw - g.pw;
  const int c0 = cs > 0 ? cs : 0, c1 = cs + g.kw < w ? cs + g.kw : w;
  for (int64_t p = blockIdx.z; p < planes; p += gridDim.z) {
    const T* xp = x + p * int64_t(h) * w;
    T* yp = y + p * int64_t(ho) * wo;
    int32_t* ap = am + p * int64_t(ho) * wo;
    for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
      const int i_begin = (rt * int(blockDim.y) + int(threadIdx.y)) * kRows;
      const int i_end = i_begin + kRows < ho ? i_begin + kRows : ho;
      for (int i = i_begin; i < i_end; ++i) {
        const int rs = i * g.sh - g.ph;
        const int r0 = rs > 0 ? rs : 0, r1 = rs + g.kh < h ? rs + g.kh : h;
        float best = -INFINITY;
        int64_t arg = -1;
        for (int r = r0; r < r1; ++r) {
          const T* row = xp + int64_t(r) * w;
          for (int c = c0; c < c1; ++c) {
            const float v = to_f32(row[c]);
            if (v > best) {
              best = v;
              arg = int64_t(r) * w + c;
            }
          }
        }
        const int64_t o = int64_t(i) * wo + j;
        yp[o] = arg >= 0 ? xp[arg] : from_f32<T>(best);
        ap[o] = int32_t(arg);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) max_bwd_kernel(const T* __restrict__ dy, const int32_t* __restrict__ am,
                                                           T* __restrict__ dx, int64_t planes, int h, int w, int ho,
                                                           int wo, Geom32 g, int row_tiles) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= w) return;
  Cover cc{g.kw, g.sw, g.pw, wo};
  cc.init(c);
  const int j0 = cc.lo(), j1 = cc.hi();
  for (int64_t p = blockIdx.z; p < planes; p += gridDim.z) {
    const T* dyp = dy + p * int64_t(ho) * wo;
    const int32_t* ap = am + p * int64_t(ho) * wo;
    T* dxp = dx + p * int64_t(h) * w;
    for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
      const int r_begin = (rt * int(blockDim.y) + int(threadIdx.y)) * kRows;
      const int r_end = r_begin + kRows < h ? r_begin + kRows : h;
      Cover rc{g.kh, g.sh, g.ph, ho};
      rc.init(r_begin);
      for (int r = r_begin; r < r_end; ++r) {
        if (r > r_begin) rc.advance(r);
        const int i0 = rc.lo(), i1 = rc.hi();
        const int32_t me = int32_t(int64_t(r) * w + c);
        float acc = 0.f;
        for (int i = i0; i < i1; ++i)
          for (int j = j0; j < j1; ++j) {
            const int64_t o = int64_t(i) * wo + j;
            if (__ldg(ap + o) == me) acc += to_f32(dyp[o]);
          }
        dxp[int64_t(r) * w + c] = from_f32<T>(acc);
      }
    }
  }
}

// The kernels index within a plane with 32-bit coordinates: every extent, padded
// extent, window and stride must stay below 2^30 (sums of two stay below 2^31).
ffi::Error check_extents(const char* who, const PlaneView& v, int64_t ho, int64_t wo, const Geom& g) {
  const int64_t lim = int64_t(1) << 30;
  if (v.h + 2 * g.ph >= lim || v.w + 2 * g.pw >= lim || ho >= lim || wo >= lim || g.kh >= lim || g.kw >= lim ||
      g.sh >= lim || g.sw >= lim)
    return invalid(std::string(who) + " (cuda): plane extents, padding, window and stride must be below 2^30");
  return ffi::Error::Success();
}

Geom32 geom32(const Geom& g) {
  return {int(g.kh), int(g.kw), int(g.sh), int(g.sw), int(g.ph), int(g.pw)};
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
  if (v.planes == 0 || ho == 0 || wo == 0) return ffi::Error::Success();
  if (auto e = check_extents("max_pool2d", v, ho, wo, g); e.failure()) return e;
  const Launch l = launch_for(v.planes, ho, wo);
  bool ok = dispatch(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    max_fwd_kernel<T><<<l.grid, l.block, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()),
        static_cast<int32_t*>(argmax->untyped_data()), v.planes, int(v.h), int(v.w), int(ho), int(wo), geom32(g),
        l.row_tiles);
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
  if (v.planes == 0 || v.h == 0 || v.w == 0) return ffi::Error::Success();
  if (auto e = check_extents("max_pool2d backward", v, ho, wo, g); e.failure()) return e;
  const Launch l = launch_for(v.planes, v.h, v.w);
  bool ok = dispatch(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    max_bwd_kernel<T><<<l.grid, l.block, 0, stream>>>(
        static_cast<const T*>(dy.untyped_data()), static_cast<const int32_t*>(argmax.untyped_data()),
        static_cast<T*>(dx->untyped_data()), v.planes, int(v.h), int(v.w), int(ho), int(wo), geom32(g), l.row_tiles);
  });
  if (!ok) return invalid("max_pool2d backward (cuda): unsupported dtype " + dtype_name(dy.element_type()));
  return check_launch("max_pool2d (cuda) backward launch");
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

RLX_CUDA_REGISTER_HANDLER("rlx_max_pool2d_fwd", RlxMaxPool2dFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_max_pool2d_bwd", RlxMaxPool2dBwdCuda);

}  // namespace cuda
}  // namespace rlx
