// The preload shim beside the driver API, on the GPU: a program that takes device memory with
// cuMemAlloc directly (the driver API, libcuda.so.1 opened with dlopen) besides one cudaMalloc
// through the runtime. Under libvramledger_preload.so the cudaMalloc is served and the cuMemAlloc
// memory is left alone; the shim's exit summary then reports the kept bytes as "device bytes used
// outside vramledger". benchmarks/gpu/checks/preload_check.sh runs it.
//
// Usage: driver_api_alloc LIBCUDART [KEEP_MIB]
//   LIBCUDART: the runtime to load (torch's nvidia/cu13/lib/libcudart.so.13); it is opened with
//   RTLD_GLOBAL and cudaMalloc is then looked up in the global scope, so a preloaded shim's
//   definition comes first, as it does for a program linked to libcudart.
//   KEEP_MIB (default 256): MiB taken with cuMemAlloc and kept until exit.
// Prints one line "driver_api: ..." and exits 0 when every call succeeded.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

namespace {

template <typename F>
F Symbol(void* handle, const char* name) {
  void* f = dlsym(handle, name);
  if (f == nullptr) {
    std::fprintf(stderr, "driver_api: %s not found: %s\n", name, dlerror());
    std::exit(2);
  }
  return reinterpret_cast<F>(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s LIBCUDART [KEEP_MIB]\n", argv[0]);
    return 2;
  }
  const size_t keep_mib = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 256;
  void* cudart = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (cudart == nullptr || cuda == nullptr) {
    std::fprintf(stderr, "driver_api: dlopen failed: %s\n", dlerror());
    return 2;
  }
  auto cuda_malloc = Symbol<cudaError_t (*)(void**, size_t)>(RTLD_DEFAULT, "cudaMalloc");
  auto cuda_free = Symbol<cudaError_t (*)(void*)>(RTLD_DEFAULT, "cudaFree");
  auto mem_alloc = Symbol<CUresult (*)(CUdeviceptr*, size_t)>(cuda, "cuMemAlloc_v2");
  auto mem_free = Symbol<CUresult (*)(CUdeviceptr)>(cuda, "cuMemFree_v2");
  int failures = 0;
  failures += cuda_free(nullptr) != cudaSuccess;  // creates the primary context, made current
  void* runtime_block = nullptr;
  failures += cuda_malloc(&runtime_block, size_t{1} << 20) != cudaSuccess;
  CUdeviceptr transient = 0, kept = 0;
  failures += mem_alloc(&transient, size_t{64} << 20) != CUDA_SUCCESS;
  failures += mem_free(transient) != CUDA_SUCCESS;
  failures += mem_alloc(&kept, keep_mib << 20) != CUDA_SUCCESS;
  failures += cuda_free(runtime_block) != cudaSuccess;
  std::printf(
      "driver_api: cudaMalloc 1 MiB and cudaFree (runtime); cuMemAlloc 64 MiB + cuMemFree, "
      "cuMemAlloc %zu MiB kept to exit (driver API); failures %d\n",
      keep_mib, failures);
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
