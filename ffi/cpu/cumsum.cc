// Cumulative sum along the middle axis of [O, L, I], forward and backward.
//
//   x, y: [O, L, I] (the Python side folds the axes before / after the scanned axis
//   into O and I)
//   forward  (reverse = false):  y[o, l, i] = sum_{k <= l} x[o, k, i]   (k < l if exclusive)
//   backward (reverse = true):   dx[o, l, i] = sum_{k >= l} dy[o, k, i]  (k > l if exclusive)
// The backward of an inclusive (exclusive) cumsum is the reverse inclusive (exclusive)
// cumsum of dy. Sums run sequentially along L in the accumulation type (f32, f64 for
// f64), so results do not depend on the thread count. For I == 1 several rows are
// scanned together so that independent additions overlap; for I > 1 the scan runs
// over contiguous I-vectors (vectorised).
#include <cmath>
#include <vector>

#include "cpu/common.h"
#include "cumsum_checks.h"

namespace rlx {
namespace {

template <typename T>
void cumsum_typed(ffi::ThreadPool& pool, const T* x, T* y, int64_t outer, int64_t len,
                  int64_t inner, bool exclusive, bool reverse) {
  using A = typename Accum<T>::type;
  // position of the k-th step along L
  auto pos = [&](int64_t k) { return reverse ? len - 1 - k : k; };
  if (inner == 1) {
    constexpr int64_t G = 8;  // rows scanned together
    const int64_t groups = (outer + G - 1) / G;
    const int64_t chunks = std::max<int64_t>(1, std::min(groups, row_chunks(outer, len)));
    parallel_for(pool, chunks, [&](int64_t c) {
      const int64_t g0 = groups * c / chunks, g1 = groups * (c + 1) / chunks;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t o0 = g * G, n = std::min(G, outer - o0);
        if (n == G) {
          A acc[G] = {};
          for (int64_t k = 0; k < len; ++k) {
            const int64_t l = pos(k);
            for (int64_t q = 0; q < G; ++q) {
              const A v = load<A>(x[(o0 + q) * len + l]);
              if (exclusive) {
                y[(o0 + q) * len + l] = store<T>(acc[q]);
                acc[q] += v;
              } else {
                acc[q] += v;
                y[(o0 + q) * len + l] = store<T>(acc[q]);
              }
            }
          }
        } else {
          for (int64_t q = 0; q < n; ++q) {
            A acc = 0;
            const T* xr = x + (o0 + q) * len;
            T* yr = y + (o0 + q) * len;
            for (int64_t k = 0; k < len; ++k) {
              const int64_t l = pos(k);
              const A v = load<A>(xr[l]);
              if (exclusive) { yr[l] = store<T>(acc); acc += v; }
              else { acc += v; yr[l] = store<T>(acc); }
            }
          }
        }
      }
    });
    return;
  }
  // inner > 1: tasks are (o, block of I) pairs; each keeps a vector of running sums.
  const int64_t block = 1024;
  const int64_t blocks = (inner + block - 1) / block;
  const int64_t tasks = outer * blocks;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(tasks, row_chunks(outer * len, inner)));
  parallel_for(pool, chunks, [&](int64_t c) {
    std::vector<A> acc(std::min(block, inner));
    const int64_t t0 = tasks * c / chunks, t1 = tasks * (c + 1) / chunks;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t / blocks, i0 = (t % blocks) * block, w = std::min(block, inner - i0);
      std::fill(acc.begin(), acc.begin() + w, A(0));
      for (int64_t k = 0; k < len; ++k) {
        const int64_t off = (o * len + pos(k)) * inner + i0;
        const T* xr = x + off;
        T* yr = y + off;
        if (exclusive) {
          for (int64_t i = 0; i < w; ++i) { const A v = load<A>(xr[i]); yr[i] = store<T>(acc[i]); acc[i] += v; }
        } else {
          for (int64_t i = 0; i < w; ++i) { acc[i] += load<A>(xr[i]); yr[i] = store<T>(acc[i]); }
        }
      }
    }
  });
}

ffi::Error CumsumImpl(ffi::ThreadPool& pool, const ffi::AnyBuffer& x,
                      ffi::Result<ffi::AnyBuffer>& y, bool exclusive, bool reverse) {
  if (auto e = cumsum::check(x, *y); e.failure()) return e;
  auto d = x.dimensions();
  if (x.element_count() == 0) return ffi::Error::Success();
  bool ok = dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    cumsum_typed<T>(pool, static_cast<const T*>(x.untyped_data()),
                    static_cast<T*>(y->untyped_data()), d[0], d[1], d[2], exclusive, reverse);
  });
  if (!ok) return invalid("cumsum: unsupported dtype " + dtype_name(x.element_type()));
  return ffi::Error::Success();
}

ffi::Error CumsumFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         bool exclusive) {
  return CumsumImpl(pool, x, y, exclusive, false);
}

ffi::Error CumsumBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy,
                         ffi::Result<ffi::AnyBuffer> dx, bool exclusive) {
  return CumsumImpl(pool, dy, dx, exclusive, true);
}

}  // namespace

// forward: x -> y;  backward: dy -> dx (reverse scan)
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxCumsumFwd, CumsumFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("exclusive"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxCumsumBwd, CumsumBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("exclusive"));

RLX_REGISTER_HANDLER("rlx_cumsum_fwd", RlxCumsumFwd);
RLX_REGISTER_HANDLER("rlx_cumsum_bwd", RlxCumsumBwd);

}  // namespace rlx
