// Gather backward (scatter-add) along the middle axis:
//   dy [O, K, T], idx [K] (i32), d_table [O, V, T]:
//   d_table[o, v, :] = sum over k with idx[k] = v of dy[o, k, :]; an index outside
//   [0, V) adds nothing (the Python side clamps first where the op's semantics clamp)
// Race-free and deterministic: a counting sort puts the positions k into one bucket per
// table row (increasing k inside a bucket); then tasks own disjoint ranges of table rows
// and each row is written exactly once (zero when its bucket is empty), its sum taken
// in increasing k with f32 (f64) accumulation.
#include "cpu/common.h"
#include "gather_checks.h"

namespace rlx {
namespace {

// CSR buckets: rows v's positions are order[start[v] .. start[v + 1]).
struct Buckets {
  std::vector<int64_t> start;
  std::vector<int64_t> order;
};

Buckets bucket_rows(const int32_t* idx, int64_t k, int64_t v) {
  Buckets b;
  b.start.assign(v + 1, 0);
  b.order.resize(k);
  std::vector<int64_t> row(k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t r = idx[i];
    row[i] = (r < 0 || r >= v) ? -1 : r;  // -1: dropped, in no bucket
    if (row[i] >= 0) ++b.start[r + 1];
  }
  for (int64_t r = 0; r < v; ++r) b.start[r + 1] += b.start[r];
  std::vector<int64_t> fill(b.start.begin(), b.start.end() - 1);
  for (int64_t i = 0; i < k; ++i)
    if (row[i] >= 0) b.order[fill[row[i]]++] = i;
  return b;
}

template <typename T>
void gather_bwd_typed(ffi::ThreadPool& pool, const T* dy, const Buckets& b, T* out, int64_t o_dim,
                      int64_t k, int64_t v, int64_t t) {
  using A = typename Accum<T>::type;
  const int64_t rows = o_dim * v;
  const int64_t tasks = row_chunks(rows, t, 1024);
  parallel_for(pool, tasks, [&](int64_t task) {
    const int64_t r0 = rows * task / tasks, r1 = rows * (task + 1) / tasks;
    std::vector<A> acc(t);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r / v, row = r % v;
      T* dst = out + r * t;
      const int64_t s0 = b.start[row], s1 = b.start[row + 1];
      if (s0 == s1) {  // all-zero bits are +0 in every float type
        std::memset(dst, 0, sizeof(T) * t);
        continue;
      }
      const T* base = dy + o * k * t;
      if (s1 - s0 == 1) {
        std::memcpy(dst, base + b.order[s0] * t, sizeof(T) * t);
        continue;
      }
      A* a = acc.data();
      const T* first = base + b.order[s0] * t;
      for (int64_t j = 0; j < t; ++j) a[j] = load<A>(first[j]);
      for (int64_t s = s0 + 1; s < s1; ++s) {
        const T* src = base + b.order[s] * t;
        for (int64_t j = 0; j < t; ++j) a[j] += load<A>(src[j]);
      }
      for (int64_t j = 0; j < t; ++j) dst[j] = store<T>(a[j]);
    }
  });
}

ffi::Error GatherBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer idx,
                         ffi::Result<ffi::AnyBuffer> d_table) {
  gather::Shape sh{};
  if (auto e = gather::check_dy_and_d_table(dy, *d_table, sh); e.failure()) return e;
  if (auto e = gather::check_index_vector(idx, sh, ": indices"); e.failure()) return e;
  const int64_t o_dim = sh.o, k = sh.k, t = sh.t, v = sh.v;
  if (o_dim == 0 || v == 0 || t == 0) return gather::check_empty_table(sh);
  const Buckets b = bucket_rows(static_cast<const int32_t*>(idx.untyped_data()), k, v);
  bool ok = dispatch_float(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    gather_bwd_typed<T>(pool, static_cast<const T*>(dy.untyped_data()), b,
                        static_cast<T*>(d_table->untyped_data()), o_dim, k, v, t);
  });
  if (!ok) return invalid("gather backward: unsupported dtype " + dtype_name(dy.element_type()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxGatherBwd, GatherBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // dy [O, K, T]
                                  .Arg<ffi::AnyBuffer>()    // indices [K] i32
                                  .Ret<ffi::AnyBuffer>());  // d_table [O, V, T]

RLX_REGISTER_HANDLER("rlx_gather_bwd", RlxGatherBwd);

}  // namespace rlx
