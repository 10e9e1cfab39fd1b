// Operand checks of rlx_gaussian_splat_fwd / rlx_gaussian_splat_bwd, shared by the CPU
// (ffi/cpu/gaussian_splat.cc) and CUDA (ffi/cuda/gaussian_splat.cu) handlers. Plain C++17
// (host side of both builds).
//
//   N Gaussians: pos [N*3], scale [N*3], rot [N*4], opacity [N], colour [N*3], sh_coeffs
//   [N*K*3] with K <= splat::kMaxSh, meta [23] (camera); image and its cotangent [H*W*4];
//   each gradient has the size of its scene buffer. The CUDA kernels need N >= 1 and number
//   (Gaussian, tile) pairs in 32 bits.
#pragma once

#include <string>

#include "cpu/gaussian_splat_math.h"
#include "host_common.h"

namespace rlx {
namespace splat {

using SceneBuffer = ffi::Buffer<ffi::F32>;

struct SceneSize {
  int64_t n, k;  // Gaussians, spherical-harmonic coefficients per colour channel
};

inline ffi::Error check_scene(Backend b, const SceneBuffer& pos, const SceneBuffer& scale, const SceneBuffer& rot,
                              const SceneBuffer& opac, const SceneBuffer& col, const SceneBuffer& sh,
                              const SceneBuffer& meta, SceneSize& size) {
  const int64_t n = int64_t(pos.element_count()) / 3;
  const bool empty_rejected = b == Backend::kCuda && n <= 0;
  if (empty_rejected || int64_t(pos.element_count()) != 3 * n || int64_t(scale.element_count()) != 3 * n ||
      int64_t(rot.element_count()) != 4 * n || int64_t(opac.element_count()) != n ||
      int64_t(col.element_count()) != 3 * n)
    return invalid(b == Backend::kCpu ? "gaussian_splat: scene buffers disagree on the Gaussian count"
                                      : "gaussian_splat: scene buffers disagree on the Gaussian count (or it is 0)");
  if (b == Backend::kCuda && n >= (int64_t(1) << 31) / 32)
    return invalid("gaussian_splat (CUDA): too many Gaussians for 32-bit pair numbers");
  const int64_t k = n ? int64_t(sh.element_count()) / (3 * n) : 0;
  if (n && (k * 3 * n != int64_t(sh.element_count()) || k > kMaxSh))
    return invalid("gaussian_splat: sh_coeffs must hold K <= 16 coefficients x 3 per Gaussian");
  if (meta.element_count() != 23) return invalid("gaussian_splat: meta must have 23 values");
  size = {n, k};
  return ffi::Error::Success();
}

// The image (forward result) or its cotangent (backward operand): [H*W*4]; `what` names it.
inline ffi::Error check_image(const char* what, size_t count, int64_t width, int64_t height) {
  if (int64_t(count) != width * height * 4) return invalid(std::string("gaussian_splat: ") + what + " must be [H*W*4]");
  return ffi::Error::Success();
}

// The backward writes each gradient with its scene buffer's size: a smaller result would overflow.
inline ffi::Error check_gradient_sizes(const SceneBuffer& pos, const SceneBuffer& scale, const SceneBuffer& rot,
                                       const SceneBuffer& opac, const SceneBuffer& col, const SceneBuffer& sh,
                                       const SceneBuffer& d_pos, const SceneBuffer& d_scale, const SceneBuffer& d_rot,
                                       const SceneBuffer& d_opac, const SceneBuffer& d_col, const SceneBuffer& d_sh) {
  if (d_pos.element_count() != pos.element_count() || d_scale.element_count() != scale.element_count() ||
      d_rot.element_count() != rot.element_count() || d_opac.element_count() != opac.element_count() ||
      d_col.element_count() != col.element_count() || d_sh.element_count() != sh.element_count())
    return invalid("gaussian_splat backward: each gradient must have the size of its scene buffer");
  return ffi::Error::Success();
}

}  // namespace splat
}  // namespace rlx
