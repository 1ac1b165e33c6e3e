// The device contract: the dozen primitives through which every CUDA call of vramledger goes.
// Implementations: CudaBackend (allocator/device/cuda_backend.h), SimBackend (sim_backend.h).
// Thread-safety: every method may be called from any thread; implementations synchronise
// themselves.
#ifndef VRAMLEDGER_DEVICE_BACKEND_H_
#define VRAMLEDGER_DEVICE_BACKEND_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "vramledger/types.h"

namespace vramledger {

/// Every kind of driver/runtime call a backend makes, for counting and timing.
enum class DriverCall : int {
  kMalloc = 0,         // cudaMalloc
  kFree,               // cudaFree
  kAddressReserve,     // cuMemAddressReserve
  kAddressFree,        // cuMemAddressFree
  kMemCreate,          // cuMemCreate
  kMemRelease,         // cuMemRelease
  kMemMap,             // cuMemMap
  kMemUnmap,           // cuMemUnmap
  kMemSetAccess,       // cuMemSetAccess
  kEventCreate,        // cudaEventCreateWithFlags
  kEventRecord,        // cudaEventRecord
  kEventQuery,         // cudaEventQuery
  kEventSynchronize,   // cudaEventSynchronize
  kEventDestroy,       // cudaEventDestroy
  kStreamSynchronize,  // cudaStreamSynchronize
  kMemGetInfo,         // cudaMemGetInfo
  kCount,
};
inline constexpr int kNumDriverCalls = static_cast<int>(DriverCall::kCount);

/// A cudaIpcMemHandle_t: the 64 bytes that name a cudaMalloc'd allocation to another process.
using IpcMemHandle = std::array<std::uint8_t, 64>;

/// Name of a call kind as the CUDA API spells it, e.g. "cudaMalloc", "cuMemMap".
std::string_view DriverCallName(DriverCall call);

/// Counts and time (microseconds: measured for CUDA, modelled for the simulator) per call kind.
/// Lock-free; readers see a consistent-enough view (each counter is individually atomic).
class DriverCallLedger {
 public:
  void Record(DriverCall call, double micros) {
    const int i = static_cast<int>(call);
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    nanos_[i].fetch_add(static_cast<std::int64_t>(micros * 1000.0), std::memory_order_relaxed);
  }
  std::int64_t count(DriverCall call) const {
    return counts_[static_cast<int>(call)].load(std::memory_order_relaxed);
  }
  /// Total time of this call kind in microseconds.
  double micros(DriverCall call) const {
    return nanos_[static_cast<int>(call)].load(std::memory_order_relaxed) / 1000.0;
  }
  /// Calls of every kind.
  std::int64_t total_count() const {
    std::int64_t n = 0;
    for (int i = 0; i < kNumDriverCalls; ++i) n += count(static_cast<DriverCall>(i));
    return n;
  }
  double total_micros() const {
    double t = 0;
    for (int i = 0; i < kNumDriverCalls; ++i) t += micros(static_cast<DriverCall>(i));
    return t;
  }
  void Reset() {
    for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
    for (auto& n : nanos_) n.store(0, std::memory_order_relaxed);
  }

 private:
  std::array<std::atomic<std::int64_t>, kNumDriverCalls> counts_{};
  std::array<std::atomic<std::int64_t>, kNumDriverCalls> nanos_{};
};

/// The device primitives. Every method returns a status; on failure nothing changed on the device.
/// Out of device memory is reported as absl::ResourceExhaustedError; any other failure as
/// absl::InternalError (CUDA) or absl::InvalidArgumentError / FailedPreconditionError (misuse).
/// One copy between pinned host memory and a device range (DeviceBackend::CopyDeviceToHost).
struct HostCopy {
  void* host = nullptr;
  DevicePtr device = 0;
  std::size_t bytes = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  /// Device index this backend serves.
  virtual int device() const = 0;

  // ---- Plain segments (cudaMalloc / cudaFree) ----
  /// Allocates `size` bytes (size > 0). Post: *out is a fresh address, 512-byte aligned or more,
  /// not overlapping any live allocation. ResourceExhausted if the device has no room.
  virtual absl::Status Malloc(std::size_t size, DevicePtr* out) = 0;
  /// Frees an address returned by Malloc. Pre: no kernel still uses it (cudaFree synchronises).
  virtual absl::Status Free(DevicePtr ptr) = 0;

  // ---- Virtual memory management (driver VMM) ----
  /// OK when the VMM calls below work on this device; else why not (a driver without its entry
  /// points, a device without VMM support). Expandable segments need them.
  virtual absl::Status VirtualMemoryStatus() const { return absl::OkStatus(); }
  /// Physical allocation granularity in bytes (2 MiB on the H200).
  virtual std::size_t Granularity() const = 0;
  /// Reserves `size` bytes (multiple of Granularity()) of virtual address space, nothing mapped.
  virtual absl::Status ReserveAddress(std::size_t size, DevicePtr* out) = 0;
  /// Releases a reservation. Pre: nothing mapped inside it.
  virtual absl::Status ReleaseAddress(DevicePtr ptr, std::size_t size) = 0;
  /// Creates a physical allocation of `size` bytes (multiple of Granularity()).
  /// ResourceExhausted if the device has no room.
  virtual absl::Status CreatePhysical(std::size_t size, PhysicalHandle* out) = 0;
  /// Releases a physical allocation. Pre: not mapped anywhere.
  virtual absl::Status ReleasePhysical(PhysicalHandle handle) = 0;
  /// Maps the whole of `handle` (its size is `size`) at `va` inside a reservation.
  virtual absl::Status Map(DevicePtr va, std::size_t size, PhysicalHandle handle) = 0;
  /// Unmaps `[va, va + size)`. Pre: the caller synchronised the streams that used it.
  virtual absl::Status Unmap(DevicePtr va, std::size_t size) = 0;
  /// Grants this device read/write access to the mapped range `[va, va + size)`.
  virtual absl::Status SetAccess(DevicePtr va, std::size_t size) = 0;

  // ---- Events and streams ----
  /// Creates an event without timing (cudaEventDisableTiming).
  virtual absl::Status CreateEvent(EventId* out) = 0;
  virtual absl::Status RecordEvent(EventId event, StreamId stream) = 0;
  /// True once all work captured by the last RecordEvent has completed.
  virtual absl::StatusOr<bool> QueryEvent(EventId event) = 0;
  /// Blocks until the event completed.
  virtual absl::Status SynchronizeEvent(EventId event) = 0;
  virtual absl::Status DestroyEvent(EventId event) = 0;
  /// Blocks until all work on `stream` completed.
  virtual absl::Status SynchronizeStream(StreamId stream) = 0;

  // ---- Device state ----
  /// Free and total device memory in bytes, as cudaMemGetInfo reports them.
  virtual absl::Status MemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) = 0;
  /// True while `stream` is being captured into a CUDA graph.
  virtual bool IsCapturing(StreamId stream) = 0;
  /// Switches the calling thread to relaxed stream-capture mode until ExitRelaxedCapture; returns
  /// the previous mode to pass back. Allocation calls made during a capture must be wrapped in it.
  virtual int EnterRelaxedCapture() = 0;
  virtual void ExitRelaxedCapture(int previous_mode) = 0;

  // ---- Pinned host memory and copies (pausable regions' backups, docs/design/regions.md) ----
  // Off the allocation path, so not counted in calls().
  /// `bytes` (> 0) of page-locked host memory (cudaHostAlloc). ResourceExhausted when the host
  /// cannot give it; the memory is the caller's until HostFreePinned.
  virtual absl::StatusOr<void*> HostAllocPinned(std::size_t bytes) = 0;
  /// Frees memory HostAllocPinned gave (cudaFreeHost).
  virtual absl::Status HostFreePinned(void* p) = 0;
  /// Copies each of `copies` between its device range (mapped, accessible) and its host memory
  /// (pinned, from HostAllocPinned), device to host, in order on one stream of the backend's own,
  /// and returns once every one is complete (cudaMemcpyAsync per copy, one
  /// cudaStreamSynchronize): one wait for a whole region rather than one per run. On failure the
  /// destination of every copy is undefined.
  virtual absl::Status CopyDeviceToHost(absl::Span<const HostCopy> copies) = 0;
  /// The same, host to device.
  virtual absl::Status CopyHostToDevice(absl::Span<const HostCopy> copies) = 0;
  /// Makes ready what the copies need before the first one (CudaBackend: its copy stream, for
  /// which the driver takes device memory it keeps), so that a region's first pause gives back as
  /// much as every later one. Called when a region is made; later calls do nothing.
  virtual absl::Status PrepareCopies() { return absl::OkStatus(); }

  // ---- Interprocess sharing (CUDA IPC, docs/design/ipc.md) ----
  // Off the allocation path, so not counted in calls(). Torch's IPC handle names the exporting
  // process and its descriptors; these primitives give and take exactly those.
  /// The id other processes know this one by (getpid(); a simulated process's own id).
  virtual int ProcessId() const = 0;
  /// The cudaIpcMemHandle_t of the Malloc'd allocation that starts at `base`
  /// (cudaIpcGetMemHandle). An error for an address that starts no live allocation.
  virtual absl::Status ExportMalloc(DevicePtr base, IpcMemHandle* out) = 0;
  /// Opens a handle another process exported (cudaIpcOpenMemHandle, peer access enabled lazily):
  /// *out is that allocation's address here. A process cannot open its own handles (CUDA refuses
  /// them); a handle whose allocation is gone is an error.
  virtual absl::Status OpenMalloc(const IpcMemHandle& handle, DevicePtr* out) = 0;
  /// Closes an address OpenMalloc returned (cudaIpcCloseMemHandle).
  virtual absl::Status CloseMalloc(DevicePtr ptr) = 0;
  /// A POSIX file descriptor for physical `handle` (cuMemExportToShareableHandle). CreatePhysical
  /// asks for handles shareable that way; FailedPrecondition where the device gave none. The
  /// descriptor is the caller's: it keeps the memory alive until CloseExported.
  virtual absl::Status ExportPhysical(PhysicalHandle handle, int* fd) = 0;
  /// Closes a descriptor ExportPhysical gave.
  virtual absl::Status CloseExported(int fd) = 0;
  /// Imports the physical handles process `pid` exported as descriptors `fds` (its numbers):
  /// each is duplicated into this process (pidfd_open, pidfd_getfd) and imported
  /// (cuMemImportFromShareableHandle). *out gets one handle per descriptor, to Map and
  /// ReleasePhysical like a created one. All or nothing: on failure no handle is left.
  virtual absl::Status ImportPhysical(int pid, const std::vector<int>& fds,
                                      std::vector<PhysicalHandle>* out) = 0;
  /// Blocks until all work on the device completed (cudaDeviceSynchronize): imported memory is
  /// unmapped only after it, since the work that used it may be on any stream.
  virtual absl::Status SynchronizeDevice() = 0;

  /// Counts and time of every call made so far.
  const DriverCallLedger& calls() const { return calls_; }
  DriverCallLedger& mutable_calls() { return calls_; }

 protected:
  DriverCallLedger calls_;
};

/// RAII: relaxed capture mode for the calling thread for the scope's lifetime.
class RelaxedCaptureScope {
 public:
  explicit RelaxedCaptureScope(DeviceBackend* backend)
      : backend_(backend), previous_(backend->EnterRelaxedCapture()) {}
  ~RelaxedCaptureScope() { backend_->ExitRelaxedCapture(previous_); }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  DeviceBackend* backend_;
  int previous_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_DEVICE_BACKEND_H_
