// The program the LD_PRELOAD shim's tests run (linked to the fake runtime, run under the shim):
// allocates and frees through the runtime API and prints one JSON line of what each layer saw.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

extern "C" void fake_cudart_counts(long* malloc_calls, long* free_calls, long* malloc_async_calls,
                                   long* free_async_calls);

int main() {
  int failures = 0;
  std::vector<void*> blocks;
  for (int i = 0; i < 10; ++i) {
    void* p = nullptr;
    if (cudaMalloc(&p, 1000 + 100 * i) != cudaSuccess || p == nullptr) ++failures;
    blocks.push_back(p);
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
