// A fake CUDA runtime on host memory for the LD_PRELOAD shim's tests: the functions CudaBackend
// and the shim call, with call counters (fake_cudart_counts) and one simulated 1 GiB device whose
// cudaMemGetInfo counts live cudaMalloc bytes plus bytes "allocated outside the runtime"
// (fake_cudart_use_outside, standing in for cuMemAlloc through the driver API).
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kTotal = size_t{1} << 30;
std::atomic<long> g_malloc{0}, g_free{0}, g_malloc_async{0}, g_free_async{0}, g_used{0};
std::atomic<long> g_outside{0};  // device bytes used by "the driver API" (never cudaMalloc)
thread_local int t_device = 0;
std::mutex g_sizes_mu;
std::unordered_map<void*, size_t>& Sizes() {  // cudaMalloc's live pointers and their sizes
  static auto* sizes = new std::unordered_map<void*, size_t>;
  return *sizes;
}

}  // namespace

extern "C" {

/// Calls that reached this runtime: cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync.
void fake_cudart_counts(long* malloc_calls, long* free_calls, long* malloc_async_calls,
                        long* free_async_calls) {
  *malloc_calls = g_malloc.load();
  *free_calls = g_free.load();
  *malloc_async_calls = g_malloc_async.load();
  *free_async_calls = g_free_async.load();
}

/// Makes cudaMemGetInfo report `bytes` more (or, negative, fewer) device bytes used, as a
/// cuMemAlloc/cuMemFree that bypasses the runtime would.
void fake_cudart_use_outside(long bytes) { g_outside += bytes; }

cudaError_t cudaMalloc(void** ptr, size_t size) {
  ++g_malloc;
  if (static_cast<size_t>(g_used.load() + g_outside.load()) + size > kTotal) {
    return cudaErrorMemoryAllocation;
  }
  *ptr = std::aligned_alloc(512, (size + 511) / 512 * 512);
  if (*ptr == nullptr) return cudaErrorMemoryAllocation;
  g_used += static_cast<long>(size);
  std::lock_guard<std::mutex> lock(g_sizes_mu);
  Sizes()[*ptr] = size;
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  ++g_free;
  {
    std::lock_guard<std::mutex> lock(g_sizes_mu);
    auto it = Sizes().find(ptr);
    if (it != Sizes().end()) {
      g_used -= static_cast<long>(it->second);
      Sizes().erase(it);
    }
  }
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t) {
  ++g_malloc_async;
  *ptr = std::malloc(size);
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) {
  ++g_free_async;
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *total = kTotal;
  *free_bytes = kTotal - static_cast<size_t>(g_used.load() + g_outside.load());
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  t_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t) { return "fake error"; }
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorFake"; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(std::malloc(8));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::free(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  *mode = cudaStreamCaptureModeGlobal;
  return cudaSuccess;
}
cudaError_t cudaGetDriverEntryPointByVersion(const char*, void** fn, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  *fn = nullptr;  // no driver: CudaBackend's VMM methods report it, plain segments still work
  if (status != nullptr) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaErrorNotSupported;
}

}  // extern "C"
