// CudaBackend: runtime calls, driver VMM calls through entry points (libcuda is not linked), the
// device guard and error mapping. Thread-safe: no mutable state besides the atomic call ledger.
#include "device/cuda_backend.h"

#include <cuda.h>  // Types only: every driver function is reached through CudaDriverApi.
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "device/cuda_internal.h"

namespace vramledger {

static_assert(std::is_base_of_v<DeviceBackend, CudaBackend> && !std::is_abstract_v<CudaBackend>,
              "CudaBackend must implement every DeviceBackend primitive");

// Maps a runtime error; clears the runtime's last error so later checks do not see it.
absl::Status RuntimeStatus(cudaError_t err, std::string_view call, int device) {
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  const std::string message = absl::StrFormat("%s on device %d: %s (%s)", call, device,
                                              cudaGetErrorString(err), cudaGetErrorName(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

// Maps a driver error, naming it through the driver's own error strings.
absl::Status DriverStatus(CUresult err, std::string_view call, int device,
                          const CudaDriverApi& api) {
  if (err == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = "unknown CUresult";
  const char* text = "no description";
  if (api.get_error_name(err, &name) != CUDA_SUCCESS) name = "unknown CUresult";
  if (api.get_error_string(err, &text) != CUDA_SUCCESS) text = "no description";
  const std::string message = absl::StrFormat("%s on device %d: %s (%s, %d)", call, device, text,
                                              name, static_cast<int>(err));
  if (err == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

namespace {

constexpr unsigned int kDriverAbiVersion = 12000;

// Resolves `symbol` into `*fn`; the error names the symbol.
template <typename Fn>
absl::Status LoadEntryPoint(const char* symbol, Fn* fn) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &address, kDriverAbiVersion,
                                                           cudaEnableDefault, &found);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(absl::StrFormat("cudaGetDriverEntryPointByVersion(%s): %s", symbol,
                                               cudaGetErrorString(err)));
  }
  if (found != cudaDriverEntryPointSuccess || address == nullptr) {
    return absl::InternalError(absl::StrFormat(
        "cudaGetDriverEntryPointByVersion(%s): not found for ABI %d (query result %d)", symbol,
        kDriverAbiVersion, static_cast<int>(found)));
  }
  *fn = reinterpret_cast<Fn>(address);
  return absl::OkStatus();
}

absl::Status LoadDriverApi(CudaDriverApi* api) {
  for (const absl::Status& status : {
           LoadEntryPoint("cuMemAddressReserve", &api->mem_address_reserve),
           LoadEntryPoint("cuMemAddressFree", &api->mem_address_free),
           LoadEntryPoint("cuMemCreate", &api->mem_create),
           LoadEntryPoint("cuMemRelease", &api->mem_release),
           LoadEntryPoint("cuMemMap", &api->mem_map),
           LoadEntryPoint("cuMemUnmap", &api->mem_unmap),
           LoadEntryPoint("cuMemSetAccess", &api->mem_set_access),
           LoadEntryPoint("cuMemGetAllocationGranularity", &api->mem_get_allocation_granularity),
           LoadEntryPoint("cuCtxGetCurrent", &api->ctx_get_current),
           LoadEntryPoint("cuDeviceGet", &api->device_get),
           LoadEntryPoint("cuDevicePrimaryCtxGetState", &api->primary_ctx_get_state),
           LoadEntryPoint("cuGetErrorString", &api->get_error_string),
           LoadEntryPoint("cuGetErrorName", &api->get_error_name),
           LoadEntryPoint("cuMemExportToShareableHandle", &api->mem_export_to_shareable_handle),
           LoadEntryPoint("cuMemImportFromShareableHandle", &api->mem_import_from_shareable_handle),
       }) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// Runs `fn` (a CUDA call), records its wall time in microseconds under `call`, returns its result.
template <typename Fn>
auto Timed(DriverCallLedger& ledger, DriverCall call, Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  auto result = std::forward<Fn>(fn)();
  ledger.Record(
      call,
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  return result;
}

cudaStream_t ToStream(StreamId stream) { return reinterpret_cast<cudaStream_t>(stream); }
cudaEvent_t ToEvent(EventId event) { return reinterpret_cast<cudaEvent_t>(event); }
CUdeviceptr ToDevicePtr(DevicePtr ptr) { return static_cast<CUdeviceptr>(ptr); }

CUmemLocation DeviceLocation(int device) {
  CUmemLocation location = {};
  location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  location.id = device;
  return location;
}

CUmemAllocationProp PinnedDeviceProp(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location = DeviceLocation(device);
  return prop;
}

constexpr int kMaxPeerDevices = 64;  // bits of a peer mask

// Access descriptors for `self` (if >= 0) and every device in `peers`.
std::vector<CUmemAccessDesc> AccessDescriptors(int self, std::uint64_t peers) {
  std::vector<CUmemAccessDesc> descs;
  for (int d = -1; d < kMaxPeerDevices; ++d) {
    if (d == -1 ? self < 0 : (peers >> d & 1) == 0) continue;
    CUmemAccessDesc desc = {};
    desc.location = DeviceLocation(d == -1 ? self : d);
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    descs.push_back(desc);
  }
  return descs;
}

}  // namespace

// Process-wide peer access of VMM memory (docs/design/peer-access.md): the CudaBackends alive and
// the devices granted read/write access to every page they map. A device is granted once its
// primary context is active (so a process that never touches a GPU never creates page tables on
// it: one process per GPU under torchrun stays on its own GPU).
class PeerAccessRegistry {
 public:
  static PeerAccessRegistry& Get() {
    static PeerAccessRegistry* registry = new PeerAccessRegistry();  // never destroyed
    return *registry;
  }

  void Add(CudaBackend* backend, const CudaDriverApi* driver) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    backends_.push_back(backend);
    capable_ |= backend->peer_capable_;
    if (driver_ == nullptr) driver_ = driver;
  }

  void Remove(CudaBackend* backend) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    backends_.erase(std::remove(backends_.begin(), backends_.end(), backend), backends_.end());
    if (driver_ == backend->driver_.get()) {  // borrow another live backend's entry points
      driver_ = backends_.empty() ? nullptr : backends_.front()->driver_.get();
    }
  }

  // Grants newly active peer-capable devices access to every backend's mapped handles; returns
  // the devices granted so far (in `*granted`) even when a grant failed.
  absl::Status Refresh(std::uint64_t* granted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *granted = granted_;
    const std::uint64_t pending = capable_ & ~granted_;
    if (pending == 0 || driver_ == nullptr) return absl::OkStatus();
    std::uint64_t fresh = 0;
    for (int d = 0; d < kMaxPeerDevices; ++d) {
      if ((pending >> d & 1) == 0) continue;
      CUdevice dev = 0;
      unsigned int flags = 0;
      int active = 0;
      if (driver_->device_get(&dev, d) == CUDA_SUCCESS &&
          driver_->primary_ctx_get_state(dev, &flags, &active) == CUDA_SUCCESS && active != 0) {
        fresh |= std::uint64_t{1} << d;
      }
    }
    if (fresh == 0) return absl::OkStatus();
    absl::Status status;
    for (CudaBackend* backend : backends_) {
      status.Update(backend->GrantMapped(fresh & backend->peer_capable_));
    }
    granted_ |= fresh;
    *granted = granted_;
    return status;
  }

  std::uint64_t granted() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return granted_;
  }

  absl::Mutex mu_;  // before any CudaBackend::mapped_mu_

 private:
  std::vector<CudaBackend*> backends_ ABSL_GUARDED_BY(mu_);
  std::uint64_t capable_ ABSL_GUARDED_BY(mu_) = 0;  // union of the backends' peer_capable_
  std::uint64_t granted_ ABSL_GUARDED_BY(mu_) = 0;  // devices granted on every mapped handle
  const CudaDriverApi* driver_ ABSL_GUARDED_BY(mu_) = nullptr;  // any backend's entry points
};

CudaBackend::CudaBackend(int device) : device_(device) {
  auto api = std::make_unique<CudaDriverApi>();
  vmm_status_ = LoadDriverApi(api.get());
  if (!vmm_status_.ok()) return;
  ScopedDevice scope(device_, api.get());
  if (!scope.status().ok()) {
    vmm_status_ = scope.status();
    return;
  }
  const CUmemAllocationProp prop = PinnedDeviceProp(device_);
  std::size_t granularity = 0;
  vmm_status_ = DriverStatus(
      api->mem_get_allocation_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuMemGetAllocationGranularity", device_, *api);
  if (!vmm_status_.ok()) return;
  granularity_ = granularity;
  driver_ = std::move(api);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) (void)cudaGetLastError();
  for (int peer = 0; peer < std::min(count, kMaxPeerDevices); ++peer) {
    int can = 0;
    if (peer == device_) continue;
    if (cudaDeviceCanAccessPeer(&can, peer, device_) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (can != 0) peer_capable_ |= std::uint64_t{1} << peer;
  }
  PeerAccessRegistry::Get().Add(this, driver_.get());
}

CudaBackend::~CudaBackend() {
  if (driver_ != nullptr) PeerAccessRegistry::Get().Remove(this);
  absl::MutexLock lock(&copy_mu_);
  if (copy_stream_ != nullptr) {
    // At exit the runtime may be unloading already: its error is not torch's to see.
    if (cudaStreamDestroy(static_cast<cudaStream_t>(copy_stream_)) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
}

std::uint64_t CudaBackend::peer_mask() const {
  return PeerAccessRegistry::Get().granted() & peer_capable_;
}

absl::Status CudaBackend::RefreshPeerAccess() {
  PeerAccessRegistry& registry = PeerAccessRegistry::Get();
  absl::MutexLock lock(&registry.mu_);
  std::uint64_t granted = 0;
  return registry.Refresh(&granted);
}

absl::Status CudaBackend::GrantMapped(std::uint64_t peers) {
  if (peers == 0 || driver_ == nullptr) return absl::OkStatus();
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  const std::vector<CUmemAccessDesc> descs = AccessDescriptors(/*self=*/-1, peers);
  absl::MutexLock lock(&mapped_mu_);
  for (const auto& [va, size] : mapped_) {
    // The bindings are captured by name: clang before 16 cannot capture a structured binding.
    const CUresult err = Timed(calls_, DriverCall::kMemSetAccess, [&, va = va, size = size] {
      return driver_->mem_set_access(ToDevicePtr(va), size, descs.data(), descs.size());
    });
    if (err != CUDA_SUCCESS) {
      return DriverStatus(
          err, absl::StrFormat("cuMemSetAccess(%#x, %d bytes) for peers %#x", va, size, peers),
          device_, *driver_);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CheckGranular(const char* call, const char* what,
                                        std::size_t value) const {
  if (value != 0 && value % granularity_ == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %s %#x is not a positive multiple of the granularity %d bytes", call,
                      what, value, granularity_));
}

// ---- Plain segments ----

absl::Status CudaBackend::Malloc(std::size_t size, DevicePtr* out) {
  if (out == nullptr || size == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaMalloc: size %d must be positive and out non-null", size));
  }
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  void* ptr = nullptr;
  const cudaError_t err =
      Timed(calls_, DriverCall::kMalloc, [&] { return cudaMalloc(&ptr, size); });
  if (err != cudaSuccess) {
    return RuntimeStatus(err, absl::StrFormat("cudaMalloc(%d bytes)", size), device_);
  }
  *out = reinterpret_cast<DevicePtr>(ptr);
  return absl::OkStatus();
}

absl::Status CudaBackend::Free(DevicePtr ptr) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  const cudaError_t err =
      Timed(calls_, DriverCall::kFree, [&] { return cudaFree(reinterpret_cast<void*>(ptr)); });
  return RuntimeStatus(err, absl::StrFormat("cudaFree(%#x)", ptr), device_);
}

// ---- Virtual memory management ----

absl::Status CudaBackend::ReserveAddress(std::size_t size, DevicePtr* out) {
  if (!vmm_status_.ok()) return vmm_status_;
  if (out == nullptr) return absl::InvalidArgumentError("cuMemAddressReserve: out is null");
  if (absl::Status s = CheckGranular("cuMemAddressReserve", "size", size); !s.ok()) return s;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  CUdeviceptr ptr = 0;
  const CUresult err = Timed(calls_, DriverCall::kAddressReserve, [&] {
    return driver_->mem_address_reserve(&ptr, size, /*alignment=*/0, /*addr=*/0, /*flags=*/0);
  });
  if (err != CUDA_SUCCESS) {
    return DriverStatus(err, absl::StrFormat("cuMemAddressReserve(%d bytes)", size), device_,
                        *driver_);
  }
  *out = static_cast<DevicePtr>(ptr);
  return absl::OkStatus();
}

absl::Status CudaBackend::ReleaseAddress(DevicePtr ptr, std::size_t size) {
  if (!vmm_status_.ok()) return vmm_status_;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  const CUresult err = Timed(calls_, DriverCall::kAddressFree,
                             [&] { return driver_->mem_address_free(ToDevicePtr(ptr), size); });
  return DriverStatus(err, absl::StrFormat("cuMemAddressFree(%#x, %d bytes)", ptr, size), device_,
                      *driver_);
}

absl::Status CudaBackend::CreatePhysical(std::size_t size, PhysicalHandle* out) {
  if (!vmm_status_.ok()) return vmm_status_;
  if (out == nullptr) return absl::InvalidArgumentError("cuMemCreate: out is null");
  if (absl::Status s = CheckGranular("cuMemCreate", "size", size); !s.ok()) return s;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  // Shareable as a POSIX descriptor (CUDA IPC, docs/design/ipc.md), as torch asks for its
  // expandable segments; a device or platform that refuses that type gets plain handles from
  // then on (ExportPhysical then says so).
  CUmemAllocationProp prop = PinnedDeviceProp(device_);
  const bool shareable = posix_handles_.load(std::memory_order_relaxed);
  if (shareable) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle handle = 0;
  CUresult err = Timed(calls_, DriverCall::kMemCreate,
                       [&] { return driver_->mem_create(&handle, size, &prop, /*flags=*/0); });
  // Only a refusal of the handle type turns it off; a transient or sticky error must not cost
  // every later handle its shareability.
  if (shareable && (err == CUDA_ERROR_NOT_SUPPORTED || err == CUDA_ERROR_INVALID_VALUE ||
                    err == CUDA_ERROR_NOT_PERMITTED)) {
    posix_handles_.store(false, std::memory_order_relaxed);
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    err = Timed(calls_, DriverCall::kMemCreate,
                [&] { return driver_->mem_create(&handle, size, &prop, /*flags=*/0); });
  }
  if (err != CUDA_SUCCESS) {
    return DriverStatus(err, absl::StrFormat("cuMemCreate(%d bytes)", size), device_, *driver_);
  }
  *out = static_cast<PhysicalHandle>(handle);
  return absl::OkStatus();
}

absl::Status CudaBackend::ReleasePhysical(PhysicalHandle handle) {
  if (!vmm_status_.ok()) return vmm_status_;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  const CUresult err = Timed(calls_, DriverCall::kMemRelease, [&] {
    return driver_->mem_release(static_cast<CUmemGenericAllocationHandle>(handle));
  });
  return DriverStatus(err, absl::StrFormat("cuMemRelease(%#x)", handle), device_, *driver_);
}

absl::Status CudaBackend::Map(DevicePtr va, std::size_t size, PhysicalHandle handle) {
  if (!vmm_status_.ok()) return vmm_status_;
  if (absl::Status s = CheckGranular("cuMemMap", "address", va); !s.ok()) return s;
  if (absl::Status s = CheckGranular("cuMemMap", "size", size); !s.ok()) return s;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  const CUresult err = Timed(calls_, DriverCall::kMemMap, [&] {
    return driver_->mem_map(ToDevicePtr(va), size, /*offset=*/0,
                            static_cast<CUmemGenericAllocationHandle>(handle), /*flags=*/0);
  });
  if (err == CUDA_SUCCESS) {
    absl::MutexLock lock(&mapped_mu_);
    mapped_[va] = size;
  }
  return DriverStatus(err, absl::StrFormat("cuMemMap(%#x, %d bytes, handle %#x)", va, size, handle),
                      device_, *driver_);
}

absl::Status CudaBackend::Unmap(DevicePtr va, std::size_t size) {
  if (!vmm_status_.ok()) return vmm_status_;
  if (absl::Status s = CheckGranular("cuMemUnmap", "address", va); !s.ok()) return s;
  if (absl::Status s = CheckGranular("cuMemUnmap", "size", size); !s.ok()) return s;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  {
    // Forget the handles first, so that no peer grant touches them once they are unmapped.
    absl::MutexLock lock(&mapped_mu_);
    for (auto it = mapped_.lower_bound(va); it != mapped_.end() && it->first < va + size;) {
      it = mapped_.erase(it);
    }
  }
  const CUresult err = Timed(calls_, DriverCall::kMemUnmap,
                             [&] { return driver_->mem_unmap(ToDevicePtr(va), size); });
  return DriverStatus(err, absl::StrFormat("cuMemUnmap(%#x, %d bytes)", va, size), device_,
                      *driver_);
}

absl::Status CudaBackend::SetAccess(DevicePtr va, std::size_t size) {
  if (!vmm_status_.ok()) return vmm_status_;
  if (absl::Status s = CheckGranular("cuMemSetAccess", "address", va); !s.ok()) return s;
  if (absl::Status s = CheckGranular("cuMemSetAccess", "size", size); !s.ok()) return s;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  // Under the registry's lock, so that a peer granted by a concurrent refresh is either in
  // `peers` here or finds this range in mapped_ (Map recorded it before this call).
  PeerAccessRegistry& registry = PeerAccessRegistry::Get();
  absl::MutexLock lock(&registry.mu_);
  std::uint64_t granted = 0;
  const absl::Status refreshed = registry.Refresh(&granted);
  const std::uint64_t peers = granted & peer_capable_;
  const std::vector<CUmemAccessDesc> descs = AccessDescriptors(device_, peers);
  const CUresult err = Timed(calls_, DriverCall::kMemSetAccess, [&] {
    return driver_->mem_set_access(ToDevicePtr(va), size, descs.data(), descs.size());
  });
  if (err != CUDA_SUCCESS) {
    return DriverStatus(
        err, absl::StrFormat("cuMemSetAccess(%#x, %d bytes, peers %#x)", va, size, peers), device_,
        *driver_);
  }
  return refreshed;
}

// ---- Events and streams ----

absl::Status CudaBackend::CreateEvent(EventId* out) {
  if (out == nullptr) return absl::InvalidArgumentError("cudaEventCreateWithFlags: out is null");
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  cudaEvent_t event = nullptr;
  const cudaError_t err = Timed(calls_, DriverCall::kEventCreate, [&] {
    return cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  });
  if (err != cudaSuccess) return RuntimeStatus(err, "cudaEventCreateWithFlags", device_);
  *out = reinterpret_cast<EventId>(event);
  return absl::OkStatus();
}

absl::Status CudaBackend::RecordEvent(EventId event, StreamId stream) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  const cudaError_t err = Timed(calls_, DriverCall::kEventRecord,
                                [&] { return cudaEventRecord(ToEvent(event), ToStream(stream)); });
  return RuntimeStatus(err, "cudaEventRecord", device_);
}

absl::StatusOr<bool> CudaBackend::QueryEvent(EventId event) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  const cudaError_t err =
      Timed(calls_, DriverCall::kEventQuery, [&] { return cudaEventQuery(ToEvent(event)); });
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // Not an error; clear it as torch does.
    return false;
  }
  return RuntimeStatus(err, "cudaEventQuery", device_);
}

absl::Status CudaBackend::SynchronizeEvent(EventId event) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  const cudaError_t err = Timed(calls_, DriverCall::kEventSynchronize,
                                [&] { return cudaEventSynchronize(ToEvent(event)); });
  return RuntimeStatus(err, "cudaEventSynchronize", device_);
}

absl::Status CudaBackend::DestroyEvent(EventId event) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  const cudaError_t err =
      Timed(calls_, DriverCall::kEventDestroy, [&] { return cudaEventDestroy(ToEvent(event)); });
  return RuntimeStatus(err, "cudaEventDestroy", device_);
}

absl::Status CudaBackend::SynchronizeStream(StreamId stream) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  const cudaError_t err = Timed(calls_, DriverCall::kStreamSynchronize,
                                [&] { return cudaStreamSynchronize(ToStream(stream)); });
  return RuntimeStatus(err, "cudaStreamSynchronize", device_);
}

// ---- Device state ----

absl::Status CudaBackend::MemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) {
    return absl::InvalidArgumentError("cudaMemGetInfo: output pointers must be non-null");
  }
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  const cudaError_t err = Timed(calls_, DriverCall::kMemGetInfo,
                                [&] { return cudaMemGetInfo(free_bytes, total_bytes); });
  return RuntimeStatus(err, "cudaMemGetInfo", device_);
}

bool CudaBackend::IsCapturing(StreamId stream) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(ToStream(stream), &status);
  if (err == cudaSuccess) return status != cudaStreamCaptureStatusNone;
  (void)cudaGetLastError();
  // The legacy stream is implicitly part of another stream's global-mode capture.
  return err == cudaErrorStreamCaptureImplicit;
}

int CudaBackend::EnterRelaxedCapture() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return static_cast<int>(mode);
}

void CudaBackend::ExitRelaxedCapture(int previous_mode) {
  if (previous_mode < 0) return;
  cudaStreamCaptureMode mode = static_cast<cudaStreamCaptureMode>(previous_mode);
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace vramledger
