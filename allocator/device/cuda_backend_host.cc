// CudaBackend's pinned host memory and batched copies on a stream of its own, which pausable
// regions back their live blocks up with (docs/design/regions.md). Thread-safe: each call sets the
// device itself.
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

absl::Status CudaBackend::EnsureCopyStreamLocked() {
  if (copy_stream_ != nullptr) return absl::OkStatus();
  cudaStream_t stream = nullptr;
  // Non-blocking: the legacy default stream's work does not hold the copies up (the region's
  // streams were synchronised before the copies are issued).
  if (absl::Status s = RuntimeStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                     "cudaStreamCreateWithFlags", device_);
      !s.ok()) {
    return s;
  }
  copy_stream_ = stream;
  return absl::OkStatus();
}

absl::Status CudaBackend::PrepareCopies() {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  absl::MutexLock lock(&copy_mu_);
  return EnsureCopyStreamLocked();
}

absl::Status CudaBackend::Copy(absl::Span<const HostCopy> copies, bool to_host) {
  if (copies.empty()) return absl::OkStatus();
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  absl::MutexLock lock(&copy_mu_);
  if (absl::Status s = EnsureCopyStreamLocked(); !s.ok()) return s;
  auto stream = static_cast<cudaStream_t>(copy_stream_);
  const char* call =
      to_host ? "cudaMemcpyAsync (device to host)" : "cudaMemcpyAsync (host to device)";
  for (const HostCopy& c : copies) {
    auto* device = reinterpret_cast<void*>(c.device);
    const cudaError_t e =
        to_host ? cudaMemcpyAsync(c.host, device, c.bytes, cudaMemcpyDeviceToHost, stream)
                : cudaMemcpyAsync(device, c.host, c.bytes, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) {
      // The copies already issued finish before the error is returned: their memory may be freed
      // by the caller then.
      (void)cudaStreamSynchronize(stream);
      return RuntimeStatus(e, call, device_);
    }
  }
  return RuntimeStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize (copies)", device_);
}

absl::Status CudaBackend::CopyDeviceToHost(absl::Span<const HostCopy> copies) {
  return Copy(copies, /*to_host=*/true);
}

absl::Status CudaBackend::CopyHostToDevice(absl::Span<const HostCopy> copies) {
  return Copy(copies, /*to_host=*/false);
}

}  // namespace vramledger
