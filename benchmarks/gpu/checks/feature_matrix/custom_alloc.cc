// A CUDAPluggableAllocator library for the feature matrix's MemPool-with-an-allocator cell:
// cudaMalloc/cudaFree from the CUDA runtime the process already loaded (torch's), with a count of
// the calls. No CUDA headers: built on the GPU machine with g++ only.
#include <dlfcn.h>

#include <atomic>
#include <cstddef>

namespace {
using MallocFn = int (*)(void**, std::size_t);
using FreeFn = int (*)(void*);
std::atomic<long> g_alloc_calls{0};

template <typename Fn>
Fn Runtime(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}
}  // namespace

extern "C" {
void* fm_alloc(std::size_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  void* ptr = nullptr;
  static const MallocFn cuda_malloc = Runtime<MallocFn>("cudaMalloc");
  if (cuda_malloc == nullptr || cuda_malloc(&ptr, size) != 0) return nullptr;
  g_alloc_calls.fetch_add(1);
  return ptr;
}

void fm_free(void* ptr, std::size_t size, int device, void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  static const FreeFn cuda_free = Runtime<FreeFn>("cudaFree");
  if (cuda_free != nullptr) cuda_free(ptr);
}

long fm_alloc_calls() { return g_alloc_calls.load(); }
}
