// Stand-alone check and timing of the RMSNorm CUDA kernels (not part of the Python
// module: CMake globs ffi/cuda/*.cu only). Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -DRLX_RMS_ALL_VARIANTS -I ffi \
//        -isystem $(python3 -c 'import jax; print(jax.ffi.include_dir())') \
//        ffi/cuda/tools/rms_norm_sweep.cu -o /tmp/rms_sweep && /tmp/rms_sweep
// 1. every kernel variant against a double-precision CPU reference on random data
//    (outputs poisoned with NaN first: an unwritten element fails), several widths
//    including odd ones and the slabbed wide-row path, f32/bf16/f16; bitwise
//    determinism of two backward runs;
// 2. timings (CUDA events, median of 30 after warm-up) of each variant at 32768 x 4096
//    f32 and bf16 against a device-to-device copy's bandwidth.
// With the argument "step": timings only, of every staged and register variant at the
// Llama step's norm (16384 x 2048 bf16, benchmarks/e2e_step.py --preset llama-v32k)
// against a 64 MiB copy.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifndef RLX_RMS_ALL_VARIANTS
#define RLX_RMS_ALL_VARIANTS  // every tuning variant, not only the module's defaults
#endif
#include "cuda/rms_norm_kernels.cuh"

using namespace rlx::cuda;
using namespace rlx::cuda::rms;

#define CK(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

static void CKF(const xla::ffi::Error& e) {
  if (e.failure()) {
    std::fprintf(stderr, "ffi error: %s\n", e.message().c_str());
    std::exit(1);
  }
}

template <typename T> const char* tname();
template <> const char* tname<float>() { return "f32"; }
template <> const char* tname<__nv_bfloat16>() { return "bf16"; }
template <> const char* tname<__half>() { return "f16"; }

__device__ __host__ inline uint32_t hash32(uint64_t v) {
  v ^= v >> 33; v *= 0xff51afd7ed558ccdULL; v ^= v >> 33; v *= 0xc4ceb9fe1a85ec53ULL; v ^= v >> 33;
  return uint32_t(v);
}
template <typename T>
__global__ void fill_uniform(T* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float u = (hash32(seed * 0x9E3779B97F4A7C15ULL + uint64_t(i)) >> 8) * (1.0f / 16777216.0f);
    p[i] = from_f32<T>(lo + (hi - lo) * u);
  }
}
template <typename T> void fill(T* p, int64_t n, uint64_t seed, float lo, float hi) {
  if (n > 0) fill_uniform<T><<<1024, 256>>>(p, n, seed, lo, hi);
  CK(cudaGetLastError());
}

template <typename T> float h2f(T v) { return float(v); }
template <> float h2f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> float h2f<__half>(__half v) { return __half2float(v); }

template <typename T> std::vector<double> to_host(const T* d, int64_t n) {
  std::vector<T> h(n);
  if (n) CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = h2f(h[i]);
  return out;
}

static double rel_err(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

static int64_t scratch_len(int64_t rows, int64_t W) {  // as rlx_jax.vjp_rules.rms_norm.cuda_bwd_scratch_size
  if (W == 0) return 2 * rows;
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>({rows, 1024, (int64_t(1) << 23) / (2 * W)}));
  return parts * 2 * W + 2 * rows;
}

static int failures = 0;

template <typename T>
void check_case(int64_t rows, int64_t W, Tuning tu, double tol, bool recompute = false) {
  const int64_t n = rows * W;
  T *x, *dy, *g, *b, *y, *dx, *dg, *db;
  float *rstd, *scr;
  const int64_t sl = scratch_len(rows, W);
  CK(cudaMalloc(&x, std::max<int64_t>(n, 1) * sizeof(T)));
  CK(cudaMalloc(&dy, std::max<int64_t>(n, 1) * sizeof(T)));
  CK(cudaMalloc(&y, std::max<int64_t>(n, 1) * sizeof(T)));
  CK(cudaMalloc(&dx, std::max<int64_t>(n, 1) * sizeof(T)));
  CK(cudaMalloc(&g, W * sizeof(T)));
  CK(cudaMalloc(&b, W * sizeof(T)));
  CK(cudaMalloc(&dg, W * sizeof(T)));
  CK(cudaMalloc(&db, W * sizeof(T)));
  CK(cudaMalloc(&rstd, std::max<int64_t>(rows, 1) * sizeof(float)));
  CK(cudaMalloc(&scr, sl * sizeof(float)));
  const uint64_t seed = uint64_t(rows) * 1000003 + W * 7 + tu.nv * 3 + tu.prefetch;
  fill(x, n, seed + 1, -2.f, 2.f);
  fill(dy, n, seed + 2, -1.f, 1.f);
  fill(g, W, seed + 3, 0.5f, 1.5f);
  fill(b, W, seed + 4, -0.5f, 0.5f);
  CK(cudaMemset(y, 0xff, std::max<int64_t>(n, 1) * sizeof(T)));  // NaN poison
  CK(cudaMemset(dx, 0xff, std::max<int64_t>(n, 1) * sizeof(T)));
  CK(cudaMemset(dg, 0xff, W * sizeof(T)));
  CK(cudaMemset(db, 0xff, W * sizeof(T)));
  CK(cudaMemset(rstd, 0xff, std::max<int64_t>(rows, 1) * sizeof(float)));
  CK(cudaMemset(scr, 0xff, sl * sizeof(float)));
  const float eps = 1e-5f;
  RowPlan pf{}, pb{};
  if (rows > 0) CKF(launch_fwd<T>(0, x, g, b, y, rstd, eps, rows, W, tu, &pf));
  // backward on the kernel's own rstd (the path the custom VJP takes)
  const float rc_eps = recompute ? eps : -1.f;
  CKF(launch_bwd<T>(0, x, g, recompute ? nullptr : rstd, dy, dx, dg, db, scr, sl, rows, W, tu, &pb, rc_eps));
  CK(cudaDeviceSynchronize());
  auto hx = to_host(x, n), hdy = to_host(dy, n), hg = to_host(g, W), hb = to_host(b, W);
  auto hy = to_host(y, n), hdx = to_host(dx, n), hdg = to_host(dg, W), hdb = to_host(db, W);
  std::vector<double> hr(rows);
  std::vector<float> fr(rows);
  if (rows) CK(cudaMemcpy(fr.data(), rstd, rows * 4, cudaMemcpyDeviceToHost));
  for (int64_t r = 0; r < rows; ++r) hr[r] = fr[r];
  std::vector<double> ry(n), rr(rows), rdx(n), rdg(W, 0.0), rdb(W, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0, dot = 0;
    for (int64_t j = 0; j < W; ++j) ss += hx[r * W + j] * hx[r * W + j];
    const double rs = 1.0 / std::sqrt(ss / W + eps);
    rr[r] = rs;
    for (int64_t j = 0; j < W; ++j) {
      ry[r * W + j] = hx[r * W + j] * rs * hg[j] + hb[j];
      dot += hdy[r * W + j] * hg[j] * hx[r * W + j];
    }
    for (int64_t j = 0; j < W; ++j) {
      rdx[r * W + j] = rs * hdy[r * W + j] * hg[j] - hx[r * W + j] * rs * rs * rs * dot / W;
      rdg[j] += hdy[r * W + j] * hx[r * W + j] * rs;
      rdb[j] += hdy[r * W + j];
    }
  }
  double e[5] = {rows ? rel_err(hy, ry) : 0, rows ? rel_err(hr, rr) : 0, rows ? rel_err(hdx, rdx) : 0,
                 rel_err(hdg, rdg), rel_err(hdb, rdb)};
  // determinism: run the backward again, compare bits
  std::vector<T> dx1(n), dg1(W), db1(W), dx2(n), dg2(W), db2(W);
  if (n) CK(cudaMemcpy(dx1.data(), dx, n * sizeof(T), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dg1.data(), dg, W * sizeof(T), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(db1.data(), db, W * sizeof(T), cudaMemcpyDeviceToHost));
  CKF(launch_bwd<T>(0, x, g, recompute ? nullptr : rstd, dy, dx, dg, db, scr, sl, rows, W, tu, nullptr, rc_eps));
  CK(cudaDeviceSynchronize());
  if (n) CK(cudaMemcpy(dx2.data(), dx, n * sizeof(T), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dg2.data(), dg, W * sizeof(T), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(db2.data(), db, W * sizeof(T), cudaMemcpyDeviceToHost));
  const bool det = std::memcmp(dx1.data(), dx2.data(), n * sizeof(T)) == 0 &&
                   std::memcmp(dg1.data(), dg2.data(), W * sizeof(T)) == 0 &&
                   std::memcmp(db1.data(), db2.data(), W * sizeof(T)) == 0;
  bool ok = det;
  for (double v : e) ok = ok && v <= tol;
  if (!ok) ++failures;
  std::printf("%-4s %6lld x %-6lld rc=%d nv=%d pf=%d tma=%d st=%d | plan vec=%d nv=%d tpr=%d thr=%d parts=%lld slabs=%lld st=%d | "
              "err y %.1e rstd %.1e dx %.1e dg %.1e db %.1e det=%d %s\n",
              tname<T>(), (long long)rows, (long long)W, int(recompute), tu.nv, tu.prefetch, tu.tma, tu.stages, pb.vec, pb.nv, pb.tpr,
              pb.threads, (long long)pb.parts, (long long)pb.slabs, pb.stages, e[0], e[1], e[2], e[3], e[4], int(det), ok ? "ok" : "FAIL");
  for (void* p : {(void*)x, (void*)dy, (void*)y, (void*)dx, (void*)g, (void*)b, (void*)dg, (void*)db,
                  (void*)rstd, (void*)scr})
    CK(cudaFree(p));
}

template <typename F> float median_ms(F&& f, int reps = 30) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ts[ts.size() / 2];
}

template <typename T>
void time_case(int64_t rows, int64_t W, double copy_bw, const std::vector<Tuning>& tunings) {
  const int64_t n = rows * W;
  T *x, *dy, *g, *b, *y, *dx, *dg, *db;
  float *rstd, *scr;
  const int64_t sl = scratch_len(rows, W);
  CK(cudaMalloc(&x, n * sizeof(T)));
  CK(cudaMalloc(&dy, n * sizeof(T)));
  CK(cudaMalloc(&y, n * sizeof(T)));
  CK(cudaMalloc(&dx, n * sizeof(T)));
  CK(cudaMalloc(&g, W * sizeof(T)));
  CK(cudaMalloc(&b, W * sizeof(T)));
  CK(cudaMalloc(&dg, W * sizeof(T)));
  CK(cudaMalloc(&db, W * sizeof(T)));
  CK(cudaMalloc(&rstd, rows * sizeof(float)));
  CK(cudaMalloc(&scr, sl * sizeof(float)));
  fill(x, n, 11, -2.f, 2.f);
  fill(dy, n, 12, -1.f, 1.f);
  fill(g, W, 13, 0.5f, 1.5f);
  fill(b, W, 14, -0.5f, 0.5f);
  CKF(launch_fwd<T>(0, x, g, b, y, rstd, 1e-5f, rows, W));
  const double tb = double(n) * sizeof(T);
  const double fwd_bytes = 2 * tb + rows * 4.0, bwd_bytes = 3 * tb + rows * 4.0;
  for (const Tuning& tu : tunings) {
    RowPlan pf{}, pb{};
    CKF(launch_fwd<T>(0, x, g, b, y, rstd, 1e-5f, rows, W, tu, &pf));
    CKF(launch_bwd<T>(0, x, g, rstd, dy, dx, dg, db, scr, sl, rows, W, tu, &pb));
    const float tf = median_ms([&] { launch_fwd<T>(0, x, g, b, y, rstd, 1e-5f, rows, W, tu); });
    const float tbw = median_ms([&] { launch_bwd<T>(0, x, g, rstd, dy, dx, dg, db, scr, sl, rows, W, tu); });
    const float trc = median_ms(
        [&] { launch_bwd<T>(0, x, g, nullptr, dy, dx, dg, db, scr, sl, rows, W, tu, nullptr, 1e-5f); });
    CK(cudaGetLastError());
    std::printf("TIME %-4s %lldx%lld nv=%d pf=%d st=%d/%d (tpr=%d parts=%lld/%lld) | fwd %.4f ms %.0f GB/s %.3fx floor | "
                "bwd %.4f ms %.0f GB/s %.3fx floor | bwd recomputing rstd %.4f ms\n",
                tname<T>(), (long long)rows, (long long)W, pb.nv, int(pb.prefetch), pf.stages, pb.stages, pb.tpr,
                (long long)pf.parts, (long long)pb.parts,
                tf, fwd_bytes / tf / 1e6, tf / (fwd_bytes / copy_bw * 1e3), tbw, bwd_bytes / tbw / 1e6,
                tbw / (bwd_bytes / copy_bw * 1e3), trc);
  }
  for (void* p : {(void*)x, (void*)dy, (void*)y, (void*)dx, (void*)g, (void*)b, (void*)dg, (void*)db,
                  (void*)rstd, (void*)scr})
    CK(cudaFree(p));
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  // mode: "quick" (a few small cases: for compute-sanitizer), "check" (all cases), else
  // all cases and the timings
  const std::string mode = argc > 1 ? argv[1] : "";

  if (mode == "step") {  // the Llama step's norm shape: every staged / register variant
    const size_t cb = size_t(64) << 20;
    void *ca, *cbuf;
    CK(cudaMalloc(&ca, cb));
    CK(cudaMalloc(&cbuf, cb));
    const float tc = median_ms([&] { cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice); });
    const double copy_bw = 2.0 * cb / (tc * 1e-3);
    std::printf("COPY 64 MiB d2d: %.4f ms, %.0f GB/s (read + write)\n", tc, copy_bw / 1e9);
    const Tuning def{0, -1, -1, 0};
    time_case<__nv_bfloat16>(16384, 2048, copy_bw,
                             {def, def, {1, 0, 1, 2}, {1, 0, 1, 4}, {1, 0, 1, 6}, {1, 0, 1, 8}, {2, 0, 1, 2},
                              {2, 0, 1, 3}, {2, 0, 1, 6}, {1, 0, 0, 0}, {2, 0, 0, 0}, {1, 1, 0, 0}, {2, 1, 0, 0}});
    return 0;
  }
  // ---- correctness ----
  if (mode == "quick") {
    for (int64_t W : {64, 100, 999, 4096, 12288})
      for (int64_t rows : {0, 1, 37}) {
        check_case<float>(rows, W, {}, 1e-5);
        check_case<__nv_bfloat16>(rows, W, {}, 1e-2);
      }
    check_case<__half>(37, 1024, {}, 2e-3);
    check_case<float>(37, 4096, {4, 0, 0}, 1e-5);
    check_case<float>(37, 256, {1, 1, 0}, 1e-5);
    check_case<__nv_bfloat16>(37, 4096, {1, 0, 0}, 1e-2);
    check_case<float>(5, 2048, {2, -1, -1, 3}, 1e-5);
    check_case<__nv_bfloat16>(37, 4096, {}, 1e-2, true);
    check_case<float>(37, 12288, {}, 1e-5, true);
    check_case<float>(37, 100, {}, 1e-5, true);
    std::printf("correctness (quick): %d failures\n", failures);
    return failures ? 1 : 0;
  }
  const int64_t widths[] = {64, 100, 999, 1024, 4096, 8192, 12288, 65536};
  const int64_t rowss[] = {0, 1, 37, 300};
  for (int64_t W : widths)
    for (int64_t rows : rowss) {
      if (rows * W > 300 * 16384) continue;
      check_case<float>(rows, W, {}, 1e-5);
      check_case<__nv_bfloat16>(rows, W, {}, 1e-2);
      check_case<__half>(rows, W, {}, 2e-3);
    }
  check_case<__nv_bfloat16>(20, 65536, {}, 1e-2);
  check_case<float>(20, 65536, {}, 1e-5);
  for (int nv : {1, 2, 4})
    for (int pf : {0, 1})
      for (int tma : {0, 1})
        for (int64_t W : {256, 4096, 8192}) {
          check_case<float>(257, W, {nv, pf, tma}, 1e-5);
          if (nv <= 2) check_case<__nv_bfloat16>(257, W, {nv, pf, tma}, 1e-2);
        }
  for (int st : {2, 3, 5})
    for (int64_t rows : {1, 2, 3, 7, 300}) {
      check_case<float>(rows, 2048, {2, -1, -1, st}, 1e-5);
      check_case<__half>(rows, 4096, {1, -1, -1, st}, 2e-3);
    }
  for (int64_t W : {64, 999, 1024, 4096, 8192, 12288, 65536})
    for (int64_t rows : {1, 37}) {
      check_case<float>(rows, W, {}, 1e-5, true);
      check_case<__nv_bfloat16>(rows, W, {}, 1e-2, true);
      check_case<float>(rows, W, {0, -1, 0, 0}, 1e-5, true);  // register path
    }
  std::printf("correctness: %d failures\n", failures);
  if (mode == "check") return failures ? 1 : 0;

  // ---- copy bandwidth ----
  const size_t cb = size_t(1) << 30;
  void *ca, *cbuf;
  CK(cudaMalloc(&ca, cb));
  CK(cudaMalloc(&cbuf, cb));
  CK(cudaMemset(ca, 1, cb));
  const float tc = median_ms([&] { cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice); });
  const double copy_bw = 2.0 * cb / (tc * 1e-3);  // bytes read + written per second
  std::printf("COPY 1 GiB d2d: %.4f ms, %.0f GB/s (read + write)\n", tc, copy_bw / 1e9);
  CK(cudaFree(ca));
  CK(cudaFree(cbuf));

  // ---- timings ----
  // {nv, prefetch, tma, stages}; {0, -1, -1, 0} = the defaults (timed twice: the spread)
  const Tuning def{0, -1, -1, 0};
  time_case<float>(32768, 4096, copy_bw, {def, def, {2, 1, 0, 0}});
  time_case<__nv_bfloat16>(32768, 4096, copy_bw, {def, def, {1, 0, 0, 0}});
  time_case<__half>(32768, 4096, copy_bw, {def});
  time_case<float>(131072, 1024, copy_bw, {def, {2, 1, 0, 0}});
  time_case<__nv_bfloat16>(65536, 2048, copy_bw, {def, {1, 0, 0, 0}});
  time_case<__nv_bfloat16>(131072, 1024, copy_bw, {def, {1, 1, 0, 0}, {0, -1, 1, 2}, {0, -1, 1, 3}});
  time_case<float>(262144, 512, copy_bw, {def, {0, -1, 1, 2}});
  time_case<float>(16384, 8192, copy_bw, {def});
  time_case<__nv_bfloat16>(8192, 16384, copy_bw, {def});
  return failures ? 1 : 0;
}
