// XLA FFI handlers for softmax cross-entropy with int32 class labels on CUDA: targets
// rlx_softmax_ce_fwd, rlx_softmax_ce_bwd and rlx_softmax_ce_loss_grad, with the operands and
// semantics of the CPU handlers (ffi/cpu/cross_entropy.cc).
//
//   logits [R.., C], labels int32 [R..]
//   forward:  lse_n = log sum_j exp(logits_nj) (f32 [R..]), loss_n = lse_n - logits_n,label_n
//   backward: dlogits_nj = (exp(logits_nj - lse_n) - [j == label_n]) * dloss_n
//   loss_grad (scale f32 [R..]): lse_n and loss_n (f32) as the forward, and dlogits_nj as the
//             backward with dloss_n = scale_n, written in dlogits' own floating dtype
// A label outside [0, C) marks a row that takes no part: loss 0, zero gradient; labels
// are compared with C before any indexing.
//
// Passes over the logits. The forward reads each row once (a running max and rescaled
// sum per thread, reduced over the row group in a fixed order) and writes two numbers
// per row. The backward with the saved lse is one streaming read of the logits and one
// write of dlogits. With `recompute_lse` (the RLX backward op, no saved statistics) it
// first computes lse from the row (default-cached loads), then writes dlogits walking
// the row's chunks in reverse: the last chunk is still in registers and the others are
// re-read from L2. loss_grad is that recomputing pass with the row's lse and loss written
// too: one read of the logits from memory and one write of dlogits for both (the fused
// linear cross-entropy's logits blocks). On sm_90, rows of 16 KB to 64 KB (bf16 / f16
// vocabularies of 8192 to 32768 words) take a staged kernel for these recomputing passes
// instead: whole rows in flight in shared memory, each read once (ce_grad_staged_k).
// loss_grad may write dlogits over the logits (rlx_jax aliases the two when their dtypes
// agree): in both kernels a thread writes only elements it has read, and the label's logit
// is read before the row's reductions, past whose barriers the gradient is written; so
// neither kernel marks the two pointers __restrict__. Layout: rowwise_common.cuh.
#include "cuda/rowwise_common.cuh"
#include "cross_entropy_checks.h"

namespace rlx {
namespace cuda {
namespace {

using namespace rw;

constexpr int kMaxThreads = 512;
constexpr int kElems = 16;  // elements a thread keeps per chunk

// lse of the row from the threads' running (m, s): max then sum over the group.
__device__ __forceinline__ float group_lse(float m, float s, int tpr, float* red, int& ph) {
  float M;
  const float S = group_sumexp(m, s, tpr, red, ph, M);
  return M + logf(S);
}

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kMaxThreads, 2)
ce_fwd_k(const T* __restrict__ logits, const int32_t* __restrict__ labels, T* __restrict__ loss,
         float* __restrict__ lse, int64_t rows, int64_t C, int tpr) {
  __shared__ float red[64];
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr, t = threadIdx.x - g * tpr;
  const int64_t chunk = int64_t(tpr) * NV * VEC;
  const int64_t nch = (C + chunk - 1) / chunk;
  int ph = 0;
  for (int64_t rb = blockIdx.x; rb * gpb < rows; rb += gridDim.x) {
    const int64_t r = rb * gpb + g;
    const bool rv = r < rows;
    const T* lr = logits + (rv ? r : 0) * C;
    float v[NV][VEC];
    float m = -INFINITY, s = 0.f;
    for (int64_t c = 0; c < nch; ++c) {
      load_chunk<T, VEC, NV>(lr, c * chunk, tpr, t, C, rv, true, -INFINITY, v);
      online_max_sumexp<NV, VEC>(v, m, s);
    }
    const float l = group_lse(m, s, tpr, red, ph);
    if (rv && t == 0) {
      const int32_t label = labels[r];
      const bool ok = label >= 0 && int64_t(label) < C;
      lse[r] = l;
      loss[r] = from_f32<T>(ok ? l - to_f32(lr[label]) : 0.f);
    }
  }
}

// VEC values as G: 16-byte streaming stores where VEC * sizeof(G) is a multiple of 16, one
// aligned pack of 4 or 8 bytes, else element by element (the scalar path).
template <typename G, int VEC>
__device__ __forceinline__ void store_grad(G* __restrict__ p, const float (&v)[VEC]) {
  constexpr int kPer = 16 / int(sizeof(G));
  if constexpr (VEC % kPer == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += kPer) {
      float w[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) w[j] = v[i + j];
      store_vec<G, kPer>(p + i, w);
    }
  } else if constexpr (VEC * sizeof(G) == 4 || VEC * sizeof(G) == 8) {
    Pack<G, VEC> pk;
#pragma unroll
    for (int i = 0; i < VEC; ++i) pk.v[i] = from_f32<G>(v[i]);
    st_pack_stream<G, VEC>(p, pk);
  } else {
    store_vec<G, VEC>(p, v);
  }
}

// The gradient (exp(x - l) - [j == label]) * gr of a thread's vectors v of one chunk of the
// row (columns c0 + (t + k * tpr) * VEC, k < NV; those at or past C skipped) into dr (the row).
template <typename G, int VEC, int NV>
__device__ __forceinline__ void store_grad_chunk(G* dr, int64_t c0, int t, int tpr, int64_t C,
                                                 const float (&v)[NV][VEC], float l, float gr, int32_t label) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t col = c0 + int64_t(t + k * tpr) * VEC;
    if (col >= C) continue;
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float p = fast_exp(v[k][i] - l) * gr;
      o[i] = (col + i == int64_t(label)) ? p - gr : p;
    }
    store_grad<G, VEC>(dr + col, o);
  }
}

// dlogits_nj = (exp(x_nj - lse_n) - [j == label_n]) * d_n from logits x (T) into G, d_n =
// dloss_n (S; 0 where the label is outside [0, C)). `recompute` (uniform): lse from the row
// first (default-cached loads), then the row walked in reverse, its last chunk still in
// registers and the others re-read from L2. STATS (recompute set): also lse_n and loss_n =
// lse_n - x_n,label (0 for such rows), both f32: the fused linear cross-entropy's logits
// block, read once from memory for its loss and its gradient.
template <typename T, typename G, typename S, int VEC, int NV, bool STATS>
__global__ void __launch_bounds__(kMaxThreads, 2)
ce_grad_k(const T* logits, const int32_t* __restrict__ labels, const float* __restrict__ lse_in,
          const S* __restrict__ dloss, G* dlogits, float* __restrict__ lse_out, float* __restrict__ loss_out,
          int64_t rows, int64_t C, int tpr, bool recompute) {
  __shared__ float red[64];
  const int gpb = blockDim.x / tpr;
  const int g = threadIdx.x / tpr, t = threadIdx.x - g * tpr;
  const int64_t chunk = int64_t(tpr) * NV * VEC;
  const int64_t nch = (C + chunk - 1) / chunk;
  int ph = 0;
  for (int64_t rb = blockIdx.x; rb * gpb < rows; rb += gridDim.x) {
    const int64_t r = rb * gpb + g;
    const bool rv = r < rows;
    const T* lr = logits + (rv ? r : 0) * C;
    float v[NV][VEC];
    float l = 0.f;
    const int32_t label = rv ? labels[r] : -1;
    const bool ok = label >= 0 && int64_t(label) < C;
    // the label's logit (STATS), read before the reductions' barriers: past them the
    // group writes dlogits, which may be the logits' own buffer
    const float picked = STATS && ok && t == 0 ? to_f32(lr[label]) : 0.f;
    if (recompute) {  // uniform over the block: the reductions' barriers are reached by all
      float m = -INFINITY, s = 0.f;
      for (int64_t c = 0; c < nch; ++c) {
        load_chunk<T, VEC, NV>(lr, c * chunk, tpr, t, C, rv, nch == 1, -INFINITY, v);
        online_max_sumexp<NV, VEC>(v, m, s);
      }
      l = group_lse(m, s, tpr, red, ph);
      if (tpr <= 32) __syncwarp();  // group_lse's shuffles order no memory
    }
    if (!rv) continue;
    if (!recompute) l = lse_in[r];
    if constexpr (STATS) {
      if (t == 0) {
        lse_out[r] = l;
        loss_out[r] = ok ? l - picked : 0.f;
      }
    }
    const float gr = ok ? to_f32(dloss[r]) : 0.f;
    G* dr = dlogits + r * C;
    for (int64_t c = nch - 1; c >= 0; --c) {
      if (!recompute || c != nch - 1) load_chunk<T, VEC, NV>(lr, c * chunk, tpr, t, C, true, true, -INFINITY, v);
      store_grad_chunk<G, VEC, NV>(dr, c * chunk, t, tpr, C, v, l, gr, label);
    }
  }
}

// ---- sm_90: whole rows staged through shared memory, for the recomputing passes -------
// ce_grad_k keeps kElems elements a thread in flight, so on rows of tens of KB (a logits
// block of a 32000-word vocabulary) it waits on memory latency: about 2.4 TB/s on an H200,
// reading each row from memory once and from L2 once. Here each block (kStagedThreads
// threads, persistent over a contiguous run of rows) keeps `stages` whole rows in flight in
// shared memory through bulk copies (cp.async.bulk completing on the stage's mbarrier), so
// the bytes in flight no longer depend on registers. Every thread reads its NV * VEC
// columns of the row from the stage into registers once; the row's max and sum of exp are
// reduced over the block, whose barriers tell thread 0 that every thread has read the
// stage, so it refills the stage with a later row; the gradient is then written from the
// registers. One read of the logits from memory, one write of dlogits. Shared memory and
// row split: rw::StagedRows. Two exps an element (the running max-and-sum pass, then the
// gradient's exp(x - lse)): keeping exp(x - M) in registers after reducing the max first,
// for one exp an element and an earlier refill, ran 3-6 % slower on an H200 (ce_loss_grad
// alone at 4096 x 32000 bf16, not in place, three alternating processes), so it was not
// kept; in the Llama step, where the gradient overwrites the logits, two alternating
// processes each put it 0.3 % ahead, inside that table's noise.
constexpr int kStagedThreads = 512;
constexpr int kStagedMaxNv = 8;                // columns a thread keeps: NV * VEC <= 64
constexpr int kStagedMaxStages = 3;            // rows in flight per block
constexpr int64_t kStagedMinRowBytes = 16384;  // narrower rows keep ce_grad_k's row groups

template <typename T, typename G, typename S, int NV, bool STATS>
__global__ void __launch_bounds__(kStagedThreads, 1)
ce_grad_staged_k(const T* logits, const int32_t* __restrict__ labels, const S* __restrict__ dloss, G* dlogits,
                 float* __restrict__ lse_out, float* __restrict__ loss_out, int64_t rows, int64_t C, int stages,
                 uint32_t stage_stride) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  constexpr int VEC = kVec16<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const StagedRows sr(smem_raw, rows, gridDim.x);
  float* red = sr.red;
  uint64_t* bar = sr.bar;
  const int64_t r0 = sr.r0, n = sr.n;
  const uint32_t row_bytes = uint32_t(C) * uint32_t(sizeof(T));
  const int t = threadIdx.x;
  sr.init_barriers(stages);
  auto issue = [&](int64_t i) {  // row r0 + i into stage i % stages
    const int q = int(i % stages);
    mbar_arrive_expect_tx(&bar[q], row_bytes);
    bulk_load(sr.stages + size_t(q) * stage_stride, logits + (r0 + i) * C, row_bytes, &bar[q]);
  };
  if (t == 0)
    for (int64_t i = 0; i < n && i < stages; ++i) issue(i);
  int ph = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int q = int(i % stages);
    const int64_t r = r0 + i;
    mbar_wait(&bar[q], uint32_t((i / stages) & 1));
    const T* xs = reinterpret_cast<const T*>(sr.stages + size_t(q) * stage_stride);
    float v[NV][VEC];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t col = int64_t(t + k * kStagedThreads) * VEC;
      if (col < C) {
        load_vec_smem<T, VEC>(xs + col, v[k]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[k][e] = -INFINITY;
      }
    }
    float m = -INFINITY, s = 0.f;
    online_max_sumexp<NV, VEC>(v, m, s);
    const float l = group_lse(m, s, kStagedThreads, red, ph);  // its barriers: stage q is read
    const int32_t label = labels[r];
    const bool ok = label >= 0 && int64_t(label) < C;
    if (t == 0) {
      if constexpr (STATS) {
        lse_out[r] = l;
        loss_out[r] = ok ? l - to_f32(xs[label]) : 0.f;
      }
      if (i + stages < n) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(i + stages);
      }
    }
    const float gr = ok ? to_f32(dloss[r]) : 0.f;
    store_grad_chunk<G, VEC, NV>(dlogits + r * C, 0, t, kStagedThreads, C, v, l, gr, label);
  }
#endif
}

// Launches the staged kernel for a recomputing pass where it applies (sm_90+, 16-byte
// vectors, rows of kStagedMinRowBytes or more that fit kStagedThreads * kStagedMaxNv
// vectors and two stages); false (nothing launched) where it does not. Wider rows (a
// 128256-word vocabulary) keep ce_grad_k: a variant streaming them through the stages in
// chunks, reading each chunk twice (for the lse, then for the gradient), measured level
// with it on an H200 (2.4 TB/s at 2048 x 128256 and 2.6 at 4096 x 65536, bf16): the
// second read, not the bytes in flight, bounds both there.
template <typename T, typename G, typename S, bool STATS>
bool launch_grad_staged(cudaStream_t stream, const T* logits, const int32_t* labels, const S* dloss, G* dlogits,
                        float* lse_out, float* loss_out, int64_t rows, int64_t C, cudaError_t* err) {
  constexpr int VEC = kVec16<T>;
  const int64_t row_bytes = C * int64_t(sizeof(T));
  if (row_bytes < kStagedMinRowBytes || C % VEC != 0 || !aligned16(logits) || !aligned16(dlogits)) return false;
  DeviceInfo dev;
  int major = 0;
  if (device_info(&dev) != cudaSuccess || device_cc_major(dev.device, &major) != cudaSuccess || major < 9)
    return false;
  bool launched = false;
  auto go = [&](auto kernel) {
    size_t max_smem = 0;
    if (allow_max_smem(dev.device, kernel, &max_smem) != cudaSuccess) return;
    const uint32_t stride = uint32_t((row_bytes + 127) / 128 * 128);
    const int stages = int(std::min<int64_t>(kStagedMaxStages, (int64_t(max_smem) - kStagedHeader) / stride));
    if (stages < 2) return;
    const size_t smem = size_t(kStagedHeader) + size_t(stages) * stride;
    int per_sm = 1;
    if ((*err = blocks_per_sm(dev.device, kernel, kStagedThreads, smem, &per_sm)) != cudaSuccess) return;
    const int64_t grid = std::min<int64_t>(rows, int64_t(dev.sms) * per_sm);
    kernel<<<unsigned(grid), kStagedThreads, smem, stream>>>(logits, labels, dloss, dlogits, lse_out, loss_out, rows,
                                                             C, stages, stride);
    launched = true;
  };
  const int64_t nv = ceil_div(C, int64_t(kStagedThreads) * VEC);
  if (nv <= 2) go(ce_grad_staged_k<T, G, S, 2, STATS>);
  else if (nv <= 4) go(ce_grad_staged_k<T, G, S, 4, STATS>);
  else if (nv <= kStagedMaxNv) go(ce_grad_staged_k<T, G, S, kStagedMaxNv, STATS>);
  return launched || *err != cudaSuccess;
}

template <typename F>
void with_vec(bool vector_ok, F&& f) {
  if (vector_ok) f(std::true_type{});
  else f(std::false_type{});
}

template <typename T>
ffi::Error launch_fwd(cudaStream_t stream, const T* logits, const int32_t* labels, T* loss, float* lse, int64_t rows,
                      int64_t C) {
  constexpr int v16 = kVec16<T>;
  const int sms = num_sms();
  with_vec(aligned16(logits) && C % v16 == 0, [&](auto vec16) {
    constexpr int VEC = decltype(vec16)::value ? v16 : 1;
    constexpr int NV = VEC == 1 ? 8 : kElems / VEC;  // the scalar path: 8 (16 spills)
    const Geom gm = row_geom(rows, ceil_div(C, VEC), NV, kMaxThreads, sms);
    ce_fwd_k<T, VEC, NV><<<unsigned(gm.grid), gm.threads, 0, stream>>>(logits, labels, loss, lse, rows, C, gm.tpr);
  });
  return check_launch("softmax_cross_entropy (cuda) launch");
}

template <typename T, typename G, typename S, bool STATS>
ffi::Error launch_grad(cudaStream_t stream, const T* logits, const int32_t* labels, const float* lse_in,
                       const S* dloss, G* dlogits, float* lse_out, float* loss_out, int64_t rows, int64_t C,
                       bool recompute, const char* what) {
  constexpr int v16 = kVec16<T>;
  if (recompute) {
    cudaError_t err = cudaSuccess;
    if (launch_grad_staged<T, G, S, STATS>(stream, logits, labels, dloss, dlogits, lse_out, loss_out, rows, C, &err)) {
      if (err != cudaSuccess) return cuda_error(what, err);
      return check_launch(what);
    }
  }
  const int sms = num_sms();
  with_vec(aligned16(logits) && aligned16(dlogits) && C % v16 == 0, [&](auto vec16) {
    constexpr int VEC = decltype(vec16)::value ? v16 : 1;
    constexpr int NV = VEC == 1 ? 8 : kElems / VEC;  // the scalar path: 8 (16 spills)
    const Geom gm = row_geom(rows, ceil_div(C, VEC), NV, kMaxThreads, sms);
    ce_grad_k<T, G, S, VEC, NV, STATS><<<unsigned(gm.grid), gm.threads, 0, stream>>>(
        logits, labels, lse_in, dloss, dlogits, lse_out, loss_out, rows, C, gm.tpr, recompute);
  });
  return check_launch(what);
}

ffi::Error CeFwdImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                     ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse) {
  if (auto e = cross_entropy::check_fwd(Backend::kCuda, logits, labels, *loss, *lse); e.failure()) return e;
  const RowsView v = rows_view(logits);
  if (v.rows == 0) return ffi::Error::Success();
  if (v.width == 0) return invalid("softmax_cross_entropy: logits need at least one class");
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = launch_fwd<T>(stream, static_cast<const T*>(logits.untyped_data()),
                           static_cast<const int32_t*>(labels.untyped_data()), static_cast<T*>(loss->untyped_data()),
                           static_cast<float*>(lse->untyped_data()), v.rows, v.width);
  });
  if (!ok) return invalid("softmax_cross_entropy (cuda): unsupported dtype " + dtype_name(logits.element_type()));
  return result;
}

ffi::Error CeBwdImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer lse,
                     ffi::AnyBuffer dloss, ffi::Result<ffi::AnyBuffer> dlogits, bool recompute_lse) {
  if (auto e = cross_entropy::check_bwd(Backend::kCuda, logits, labels, lse, dloss, *dlogits); e.failure())
    return e;
  const RowsView v = rows_view(logits);
  if (v.rows == 0 || v.width == 0) return ffi::Error::Success();
  ffi::Error result = ffi::Error::Success();
  const bool ok = dispatch(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    result = launch_grad<T, T, T, false>(
        stream, static_cast<const T*>(logits.untyped_data()), static_cast<const int32_t*>(labels.untyped_data()),
        static_cast<const float*>(lse.untyped_data()), static_cast<const T*>(dloss.untyped_data()),
        static_cast<T*>(dlogits->untyped_data()), nullptr, nullptr, v.rows, v.width, recompute_lse,
        "softmax_cross_entropy backward (cuda) launch");
  });
  if (!ok)
    return invalid("softmax_cross_entropy backward (cuda): unsupported dtype " + dtype_name(logits.element_type()));
  return result;
}

ffi::Error CeLossGradImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                          ffi::Result<ffi::AnyBuffer> dlogits) {
  if (auto e = cross_entropy::check_loss_grad(Backend::kCuda, logits, labels, scale, *loss, *lse, *dlogits);
      e.failure())
    return e;
  const RowsView v = rows_view(logits);
  if (v.rows == 0) return ffi::Error::Success();
  if (v.width == 0) return invalid("softmax_cross_entropy loss_grad: logits need at least one class");
  ffi::Error result = ffi::Error::Success();
  bool ok_g = false;
  const bool ok = dispatch(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    ok_g = dispatch(dlogits->element_type(), [&](auto gtag) {
      using G = decltype(gtag);
      result = launch_grad<T, G, float, true>(
          stream, static_cast<const T*>(logits.untyped_data()), static_cast<const int32_t*>(labels.untyped_data()),
          nullptr, static_cast<const float*>(scale.untyped_data()), static_cast<G*>(dlogits->untyped_data()),
          static_cast<float*>(lse->untyped_data()), static_cast<float*>(loss->untyped_data()), v.rows, v.width,
          true, "softmax_cross_entropy loss_grad (cuda) launch");
    });
  });
  if (!ok || !ok_g)
    return invalid("softmax_cross_entropy loss_grad (cuda): unsupported dtypes " +
                   dtype_name(logits.element_type()) + " -> " + dtype_name(dlogits->element_type()));
  return result;
}

}  // namespace

// Command-buffer compatible: kernels on XLA's stream only, launch shapes from the
// buffer shapes and the device.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxCeFwdCuda, CeFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // logits
                                  .Arg<ffi::AnyBuffer>()   // labels (int32)
                                  .Ret<ffi::AnyBuffer>()   // loss
                                  .Ret<ffi::AnyBuffer>(),  // lse (f32)
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxCeBwdCuda, CeBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // logits
                                  .Arg<ffi::AnyBuffer>()  // labels (int32)
                                  .Arg<ffi::AnyBuffer>()  // lse (f32)
                                  .Arg<ffi::AnyBuffer>()  // dloss
                                  .Ret<ffi::AnyBuffer>()  // dlogits
                                  .Attr<bool>("recompute_lse"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlxSoftmaxCeLossGradCuda, CeLossGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // logits
                                  .Arg<ffi::AnyBuffer>()   // labels (int32)
                                  .Arg<ffi::AnyBuffer>()   // scale (f32, per row)
                                  .Ret<ffi::AnyBuffer>()   // loss (f32)
                                  .Ret<ffi::AnyBuffer>()   // lse (f32)
                                  .Ret<ffi::AnyBuffer>(),  // dlogits
                              {ffi::Traits::kCmdBufferCompatible});

RLX_CUDA_REGISTER_HANDLER("rlx_softmax_ce_fwd", RlxSoftmaxCeFwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_softmax_ce_bwd", RlxSoftmaxCeBwdCuda);
RLX_CUDA_REGISTER_HANDLER("rlx_softmax_ce_loss_grad", RlxSoftmaxCeLossGradCuda);

}  // namespace cuda
}  // namespace rlx
