// The program the LD_PRELOAD shim's tests run (linked to the fake runtime, run under the shim):
// allocates and frees through the runtime API and prints one JSON line of what each layer saw.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

extern "C" void fake_cudart_counts(long* malloc_calls, long* free_calls, long* malloc_async_calls,
                                   long* free_async_calls);
extern "C" void fake_cudart_use_outside(long bytes);

// PRELOAD_DRIVER_BENCH=N: N rounds of 16 cudaMallocAsync then 16 cudaFreeAsync (sizes 512 B to
// 2 MiB, as a training step's tensors), timed; prints ns per allocation+free pair and the shim's
// stats (with host_timing:True, its time inside the interposed calls and inside the allocator:
// the difference is the shim's own cost per call).
int Bench(long rounds) {
  constexpr int kLive = 16;
  void* p[kLive];
  int failures = 0;
  const auto start = std::chrono::steady_clock::now();
  for (long r = 0; r < rounds; ++r) {
    for (int i = 0; i < kLive; ++i) {
      failures += cudaMallocAsync(&p[i], size_t{512} << (i % 13), nullptr) != cudaSuccess;
    }
    for (int i = kLive - 1; i >= 0; --i) failures += cudaFreeAsync(p[i], nullptr) != cudaSuccess;
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  using StatsFn = char* (*)();
  auto stats = reinterpret_cast<StatsFn>(dlsym(RTLD_DEFAULT, "vramledger_preload_stats_json"));
  char* shim = stats != nullptr ? stats() : nullptr;
  std::printf("{\"bench_ns_per_pair\": %.1f, \"pairs\": %ld, \"failures\": %d, \"shim\": %s}\n",
              ns / static_cast<double>(rounds * kLive), rounds * kLive, failures,
              shim != nullptr ? shim : "null");
  std::free(shim);
  return failures == 0 ? 0 : 1;
}

// PRELOAD_DRIVER_DLOPEN=PATH: dlopens PATH (a fake torch library, or a library that dlopens its
// sibling by bare name), calls its `int probe()` when it has one, and prints one JSON line with
// the outcome and the PYTORCH_CUDA_ALLOC_CONF the program sees afterwards.
int Dlopen(const char* path) {
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  const char* error = handle == nullptr ? dlerror() : nullptr;
  using ProbeFn = int (*)();
  auto probe = handle != nullptr ? reinterpret_cast<ProbeFn>(dlsym(handle, "probe")) : nullptr;
  const int probed = probe != nullptr ? probe() : -1;
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  std::printf("{\"dlopen\": %s, \"error\": \"%s\", \"probe\": %d, \"alloc_conf\": \"%s\"}\n",
              handle != nullptr ? "true" : "false", error != nullptr ? error : "", probed,
              conf != nullptr ? conf : "");
  return 0;
}

// PRELOAD_DRIVER_REFUSE_ON_THREAD: each refusal path of the interposed functions taken on a
// thread the program started (as torch's autograd workers and data-loader threads are): the
// shim answers with the CUDA error code, and the process goes on to print and exit 0.
int RefuseOnThread() {
  int refused = 0, freed = 0;
  std::thread worker([&] {
    void* p = nullptr;
    refused += cudaMalloc(&p, size_t{4} << 30) == cudaErrorMemoryAllocation;
    refused += cudaMallocAsync(&p, size_t{4} << 30, nullptr) == cudaErrorMemoryAllocation;
    refused += cudaMallocAsync(&p, ~size_t{0}, nullptr) == cudaErrorMemoryAllocation;
    refused += cudaMalloc(nullptr, 4096) == cudaErrorInvalidValue;
    if (cudaMallocAsync(&p, 4096, nullptr) == cudaSuccess) {
      freed += cudaFreeAsync(p, nullptr) == cudaSuccess;
    }
  });
  worker.join();
  std::printf("{\"failures\": 0, \"thread_refused\": %d, \"thread_freed\": %d}\n", refused,
              freed);
  return 0;
}

int main() {
  if (const char* bench = std::getenv("PRELOAD_DRIVER_BENCH")) return Bench(std::atol(bench));
  if (const char* path = std::getenv("PRELOAD_DRIVER_DLOPEN")) return Dlopen(path);
  if (std::getenv("PRELOAD_DRIVER_REFUSE_ON_THREAD") != nullptr) return RefuseOnThread();
  int failures = 0;
  std::vector<void*> blocks;
  for (int i = 0; i < 10; ++i) {
    void* p = nullptr;
    if (cudaMalloc(&p, 1000 + 100 * i) != cudaSuccess || p == nullptr) ++failures;
    blocks.push_back(p);
  }
  // PRELOAD_DRIVER_OUTSIDE_BYTES: device memory taken behind the runtime's back (as cuMemAlloc
  // would), after the shim's first allocation, and kept until exit.
  if (const char* outside = std::getenv("PRELOAD_DRIVER_OUTSIDE_BYTES")) {
    fake_cudart_use_outside(std::atol(outside));
  }
  for (int i = 0; i < 5; ++i) {
    void* p = nullptr;
    if (cudaMallocAsync(&p, 3 << 20, nullptr) != cudaSuccess || p == nullptr) ++failures;
    blocks.push_back(p);
  }
  // A thread that never touched the device: the shim picks device 0 by cudaGetDevice.
  std::thread worker([&] {
    void* p = nullptr;
    if (cudaMallocAsync(&p, 4096, nullptr) != cudaSuccess) ++failures;
    if (cudaFreeAsync(p, nullptr) != cudaSuccess) ++failures;
  });
  worker.join();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const cudaError_t err = i < 10 ? cudaFree(blocks[i]) : cudaFreeAsync(blocks[i], nullptr);
    if (err != cudaSuccess) ++failures;
  }
  // Memory the shim did not allocate: handed to the real runtime by the caller's own pointer.
  void* foreign = std::malloc(64);
  if (cudaFree(foreign) != cudaSuccess) ++failures;
  if (cudaFree(nullptr) != cudaSuccess) ++failures;
  // More than the fake device holds: refused with cudaErrorMemoryAllocation.
  void* huge = nullptr;
  const cudaError_t refused = cudaMalloc(&huge, size_t{4} << 30);
  long m = 0, f = 0, ma = 0, fa = 0;
  fake_cudart_counts(&m, &f, &ma, &fa);
  using StatsFn = char* (*)();
  auto stats = reinterpret_cast<StatsFn>(dlsym(RTLD_DEFAULT, "vramledger_preload_stats_json"));
  char* shim = stats != nullptr ? stats() : nullptr;
  std::printf(
      "{\"failures\": %d, \"refused\": %d, \"real\": {\"cudaMalloc\": %ld, \"cudaFree\": %ld, "
      "\"cudaMallocAsync\": %ld, \"cudaFreeAsync\": %ld}, \"shim\": %s}\n",
      failures, refused == cudaErrorMemoryAllocation ? 1 : 0, m, f, ma, fa,
      shim != nullptr ? shim : "null");
  std::free(shim);
  return 0;
}
