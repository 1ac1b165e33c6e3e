// CudaBackend's pinned host memory and synchronous copies, which pausable regions back their
// live blocks up with (docs/design/regions.md). Thread-safe: each call sets the device itself.
#include <cuda_runtime_api.h>

#include "device/cuda_backend.h"
#include "device/cuda_internal.h"

namespace vramledger {

absl::StatusOr<void*> CudaBackend::HostAllocPinned(std::size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("cudaHostAlloc: size 0");
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  void* p = nullptr;
  // cudaHostAllocPortable: a backup may be restored by a copy issued with another device current.
  if (absl::Status s =
          RuntimeStatus(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc", device_);
      !s.ok()) {
    return s;
  }
  return p;
}

absl::Status CudaBackend::HostFreePinned(void* p) {
  return RuntimeStatus(cudaFreeHost(p), "cudaFreeHost", device_);
}

absl::Status CudaBackend::CopyDeviceToHost(void* dst, DevicePtr src, std::size_t bytes) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  return RuntimeStatus(
      cudaMemcpy(dst, reinterpret_cast<const void*>(src), bytes, cudaMemcpyDeviceToHost),
      "cudaMemcpy (device to host)", device_);
}

absl::Status CudaBackend::CopyHostToDevice(DevicePtr dst, const void* src, std::size_t bytes) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  return RuntimeStatus(cudaMemcpy(reinterpret_cast<void*>(dst), src, bytes, cudaMemcpyHostToDevice),
                       "cudaMemcpy (host to device)", device_);
}

}  // namespace vramledger
