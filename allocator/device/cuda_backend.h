// CudaBackend: the DeviceBackend over the CUDA runtime and the driver's VMM entry points, each
// call timed into calls(). Thread-safe: immutable after construction but for one atomic flag;
// CUDA is thread-safe.
#ifndef VRAMLEDGER_DEVICE_CUDA_BACKEND_H_
#define VRAMLEDGER_DEVICE_CUDA_BACKEND_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

namespace vramledger {

// The driver entry points, resolved once through cudaGetDriverEntryPointByVersion
// (cuda_backend.cc).
struct CudaDriverApi;

/// One CUDA device. Every call runs with `device` current: the calling thread's current device is
/// saved, set and restored around it (nothing is set when it already is current). Driver VMM
/// calls additionally make sure the thread has a current context (the device's primary context).
///
/// Errors: out of memory (cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY) is
/// ResourceExhausted; any other CUDA error is Internal, naming the call and CUDA's error string.
/// The runtime's last error is cleared after a failed runtime call, so that torch's own
/// cudaGetLastError checks do not pick it up. Arguments the contract rules out (null outputs,
/// size 0, VMM sizes or addresses that are not multiples of Granularity()) are InvalidArgument,
/// checked before any CUDA call, as SimBackend does.
/// Times are wall-clock microseconds of the CUDA call alone (std::chrono::steady_clock).
class CudaBackend final : public DeviceBackend {
 public:
  /// Binds to CUDA device `device`. Resolves the driver VMM entry points and queries the minimum
  /// allocation granularity once. If that fails (no driver, no device), the VMM methods return
  /// vmm_status() and Granularity() reports 2 MiB; the runtime methods still work where CUDA does.
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  int device() const override { return device_; }
  absl::Status Malloc(std::size_t size, DevicePtr* out) override;
  absl::Status Free(DevicePtr ptr) override;

  /// Minimum granularity of a pinned device allocation on this device, in bytes.
  std::size_t Granularity() const override { return granularity_; }
  absl::Status ReserveAddress(std::size_t size, DevicePtr* out) override;
  absl::Status ReleaseAddress(DevicePtr ptr, std::size_t size) override;
  absl::Status CreatePhysical(std::size_t size, PhysicalHandle* out) override;
  absl::Status ReleasePhysical(PhysicalHandle handle) override;
  absl::Status Map(DevicePtr va, std::size_t size, PhysicalHandle handle) override;
  absl::Status Unmap(DevicePtr va, std::size_t size) override;
  /// Grants read/write access to `[va, va + size)` to this device and to every peer in
  /// peer_mask() (docs/design/peer-access.md: cudaDeviceEnablePeerAccess does not cover VMM
  /// memory, so vramledger grants peers itself).
  absl::Status SetAccess(DevicePtr va, std::size_t size) override;

  absl::Status CreateEvent(EventId* out) override;
  absl::Status RecordEvent(EventId event, StreamId stream) override;
  absl::StatusOr<bool> QueryEvent(EventId event) override;
  absl::Status SynchronizeEvent(EventId event) override;
  absl::Status DestroyEvent(EventId event) override;
  absl::Status SynchronizeStream(StreamId stream) override;

  absl::Status MemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) override;
  /// True while `stream` is capturing (cudaStreamIsCapturing says Active or Invalidated, or
  /// reports cudaErrorStreamCaptureImplicit for the legacy stream). False on any other error.
  bool IsCapturing(StreamId stream) override;
  /// cudaThreadExchangeStreamCaptureMode to relaxed; returns the previous cudaStreamCaptureMode,
  /// or -1 if the exchange failed (then ExitRelaxedCapture restores nothing).
  int EnterRelaxedCapture() override;
  void ExitRelaxedCapture(int previous_mode) override;

  // Interprocess sharing (cuda_backend_ipc.cc; docs/design/ipc.md).
  int ProcessId() const override;
  absl::Status ExportMalloc(DevicePtr base, IpcMemHandle* out) override;
  absl::Status OpenMalloc(const IpcMemHandle& handle, DevicePtr* out) override;
  absl::Status CloseMalloc(DevicePtr ptr) override;
  /// FailedPrecondition when cuMemCreate refused POSIX-descriptor handles on this device.
  absl::Status ExportPhysical(PhysicalHandle handle, int* fd) override;
  absl::Status CloseExported(int fd) override;
  /// The kernel's pidfd_open and pidfd_getfd (Linux 5.6) are needed; without them the error
  /// says so, as torch's does.
  absl::Status ImportPhysical(int pid, const std::vector<int>& fds,
                              std::vector<PhysicalHandle>* out) override;
  absl::Status SynchronizeDevice() override;
  // Pinned host memory and copies (cuda_backend_host.cc; docs/design/regions.md).
  absl::StatusOr<void*> HostAllocPinned(std::size_t bytes) override;
  absl::Status HostFreePinned(void* p) override;
  absl::Status CopyDeviceToHost(absl::Span<const HostCopy> copies) override
      ABSL_LOCKS_EXCLUDED(copy_mu_);
  absl::Status CopyHostToDevice(absl::Span<const HostCopy> copies) override
      ABSL_LOCKS_EXCLUDED(copy_mu_);
  absl::Status PrepareCopies() override ABSL_LOCKS_EXCLUDED(copy_mu_);

  /// OK if the driver VMM entry points were resolved and the granularity queried; else why not.
  const absl::Status& vmm_status() const { return vmm_status_; }
  absl::Status VirtualMemoryStatus() const override { return vmm_status_; }

  /// Devices (bit d = CUDA device d) that may read and write this device's mapped pages: the
  /// devices that cudaDeviceCanAccessPeer this one and whose primary context is active in this
  /// process, as of the last refresh (docs/design/peer-access.md). 0 with one device.
  std::uint64_t peer_mask() const;

  /// Refreshes the peers of every CudaBackend of the process: a peer-capable device whose primary
  /// context became active since the last refresh is granted read/write access to every range
  /// already mapped by every backend (one cuMemSetAccess per mapped handle). Also run by
  /// SetAccess. Call it after a device that vramledger never allocated on starts reading
  /// vramledger memory. Errors: the first failing cuMemSetAccess; the grants made stay.
  static absl::Status RefreshPeerAccess();

 private:
  friend class PeerAccessRegistry;
  // Grants `peers` access to every mapped handle of this backend (catch-up after a refresh).
  absl::Status GrantMapped(std::uint64_t peers) ABSL_LOCKS_EXCLUDED(mapped_mu_);

  // Checks that `value` is a positive multiple of the granularity, for the call named `call`.
  absl::Status CheckGranular(const char* call, const char* what, std::size_t value) const;

  const int device_;
  std::unique_ptr<const CudaDriverApi> driver_;  // Null if the entry points could not be loaded.
  absl::Status vmm_status_;
  std::size_t granularity_ = 2 * kMiB;
  std::uint64_t peer_capable_ = 0;  // devices that can access this one (cudaDeviceCanAccessPeer)
  // cuMemCreate asks for POSIX-descriptor handles until the driver refuses that type once.
  std::atomic<bool> posix_handles_{true};

  // The copies' stream (non-blocking, made by PrepareCopies or the first copy), one batch of
  // copies at a time.
  absl::Status Copy(absl::Span<const HostCopy> copies, bool to_host) ABSL_LOCKS_EXCLUDED(copy_mu_);
  absl::Status EnsureCopyStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(copy_mu_);
  absl::Mutex copy_mu_;
  void* copy_stream_ ABSL_GUARDED_BY(copy_mu_) = nullptr;  // cudaStream_t

  // Every mapped handle (address -> size), for granting peers that appear later.
  mutable absl::Mutex mapped_mu_;
  absl::btree_map<DevicePtr, std::size_t> mapped_ ABSL_GUARDED_BY(mapped_mu_);
};

}  // namespace vramledger

#endif  // VRAMLEDGER_DEVICE_CUDA_BACKEND_H_
