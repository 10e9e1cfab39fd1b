// Shared helpers for the CPU XLA FFI handlers: element types, a deterministic
// parallel-for over XLA's intra-op thread pool, and the handler registry that
// module.cc exposes to Python.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "host_common.h"
#include "xla/ffi/api/ffi.h"

namespace rlx {
namespace ffi = xla::ffi;

// ---- 16-bit floating point storage types (f32 arithmetic) -------------------
struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float to_f32(bf16 v) { return bits_to_f32(uint32_t(v.bits) << 16); }
inline bf16 from_f32_bf16(float f) {
  // round to nearest even; NaN stays a (quiet) NaN. Branch-free so loops vectorise.
  uint32_t u = f32_to_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (u >> 16) | 0x40u;
  return bf16{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
}

inline float to_f32(f16 v) {
  uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1fu, man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    // subnormal: value = man * 2^-24
    float f = float(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
inline f16 from_f32_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};          // nan
  if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};         // overflow -> inf
  if (a < 0x38800000u) {                                              // subnormal or zero
    // round a * 2^24 to nearest even integer
    float m = bits_to_f32(a) * 16777216.0f;
    uint32_t r = uint32_t(m);
    float rem = m - float(r);
    if (rem > 0.5f || (rem == 0.5f && (r & 1u))) ++r;
    return f16{uint16_t(sign | r)};
  }
  uint32_t e = (a >> 23) - 112u, man = a & 0x7fffffu;
  uint32_t h = (e << 10) | (man >> 13);
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;           // may carry into exp
  return f16{uint16_t(sign | h)};
}

// load/store between storage type T and accumulation type A
template <typename A> inline A load(float v) { return A(v); }
template <typename A> inline A load(double v) { return A(v); }
template <typename A> inline A load(bf16 v) { return A(to_f32(v)); }
template <typename A> inline A load(f16 v) { return A(to_f32(v)); }
template <typename T> struct Store;
template <> struct Store<float> { template <typename A> static float of(A v) { return float(v); } };
template <> struct Store<double> { template <typename A> static double of(A v) { return double(v); } };
template <> struct Store<bf16> { template <typename A> static bf16 of(A v) { return from_f32_bf16(float(v)); } };
template <> struct Store<f16> { template <typename A> static f16 of(A v) { return from_f32_f16(float(v)); } };
template <typename T, typename A> inline T store(A v) { return Store<T>::of(v); }

// Accumulation type: f32 for every floating type but f64.
template <typename T> struct Accum { using type = float; };
template <> struct Accum<double> { using type = double; };

// Calls fn(T{}) with T the storage type of `dtype`; returns false when unsupported.
template <typename F>
bool dispatch_float(ffi::DataType dtype, F&& fn) {
  switch (dtype) {
    case ffi::DataType::F32: fn(float{}); return true;
    case ffi::DataType::F64: fn(double{}); return true;
    case ffi::DataType::BF16: fn(bf16{}); return true;
    case ffi::DataType::F16: fn(f16{}); return true;
    default: return false;
  }
}

// ---- parallel for -----------------------------------------------------------
// Runs fn(task) for task in [0, n_tasks) on the caller and on XLA's intra-op pool.
// Tasks are claimed from an atomic counter, so the caller never waits on a task
// that has not started (no deadlock when the pool is busy); helpers that start
// after all tasks are claimed return without touching `fn`. Results must not
// depend on which thread runs a task: callers give each task its own output slot,
// which keeps the kernels deterministic.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n_tasks, F&& fn) {
  if (n_tasks <= 0) return;
  int64_t threads = pool.num_threads();
  int64_t helpers = std::min<int64_t>(threads, n_tasks - 1);
  if (helpers <= 0) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto* fn_ptr = &fn;
  auto run = [state, fn_ptr, n_tasks]() {
    for (;;) {
      int64_t t = state->next.fetch_add(1);
      if (t >= n_tasks) return;
      (*fn_ptr)(t);
      if (state->done.fetch_add(1) + 1 == n_tasks) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n_tasks; });
}

// Number of row chunks for a row-parallel kernel: a function of the problem size
// only (never of the thread count), so partial sums combine in the same order
// on every machine and every run.
inline int64_t row_chunks(int64_t rows, int64_t width, int64_t max_chunks = 256) {
  int64_t target = std::max<int64_t>(1, (rows * std::max<int64_t>(width, 1)) / 16384);
  return std::max<int64_t>(1, std::min({rows, target, max_chunks}));
}

// ---- registry -----------------------------------------------------------------
struct Registration { const char* name; void* handler; };
inline std::vector<Registration>& registry() {
  static std::vector<Registration> r;
  return r;
}
struct Registrar {
  Registrar(const char* name, void* handler) { registry().push_back({name, handler}); }
};
#define RLX_REGISTER_HANDLER(target_name, symbol) \
  static ::rlx::Registrar rlx_registrar_##symbol(target_name, reinterpret_cast<void*>(symbol))

}  // namespace rlx
