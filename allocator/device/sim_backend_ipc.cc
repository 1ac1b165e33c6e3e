// SimBackend's interprocess sharing: one registry per host process stands for the driver's, so
// two SimBackends with different simulated process ids share memory as two processes would.
// Thread-safe: the registry has its own mutex, taken inside mu_ or alone, never the reverse.
#include <unistd.h>

#include <cstring>
#include <map>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "device/sim_backend.h"

namespace vramledger {
namespace {

// A simulated cudaIpcMemHandle_t: this tag, then the exporting process, device and address.
constexpr char kHandleTag[8] = {'v', 'l', '-', 's', 'i', 'm', 'c', '\0'};
struct SimMallocHandle {
  char tag[8];
  std::int32_t pid;
  std::int32_t device;
  std::uint64_t base;
};
static_assert(sizeof(SimMallocHandle) <= sizeof(IpcMemHandle));

// What the driver knows across processes: the live exported allocations and descriptors.
class SimIpcRegistry {
 public:
  static SimIpcRegistry& Get() {
    static SimIpcRegistry* registry = new SimIpcRegistry();  // never destroyed
    return *registry;
  }
  absl::Mutex mu;
  // (pid, device, base) -> bytes of each exported Malloc'd allocation.
  std::map<std::tuple<int, int, DevicePtr>, std::size_t> mallocs ABSL_GUARDED_BY(mu);
  // (pid, fd) -> bytes of the physical allocation each open descriptor names.
  std::map<std::pair<int, int>, std::size_t> fds ABSL_GUARDED_BY(mu);
  int next_fd ABSL_GUARDED_BY(mu) = 1000;  // descriptor numbers, unique in the host process
};

}  // namespace

int SimBackend::ProcessId() const { return config_.pid != 0 ? config_.pid : getpid(); }

void SimBackend::ForgetMallocExport(int pid, int device, DevicePtr base) {
  SimIpcRegistry& registry = SimIpcRegistry::Get();
  absl::MutexLock lock(&registry.mu);
  registry.mallocs.erase({pid, device, base});
}

absl::Status SimBackend::ExportMalloc(DevicePtr base, IpcMemHandle* out) {
  absl::MutexLock lock(&mu_);  // with the registry's inside, so a Free cannot come between
  const auto it = mallocs_.find(base);
  if (it == mallocs_.end() || out == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cudaIpcGetMemHandle: %#x does not start a live cudaMalloc allocation", base));
  }
  SimMallocHandle h{};
  std::memcpy(h.tag, kHandleTag, sizeof(kHandleTag));
  h.pid = ProcessId();
  h.device = config_.device;
  h.base = base;
  out->fill(0);
  std::memcpy(out->data(), &h, sizeof(h));
  exported_mallocs_.insert(base);
  SimIpcRegistry& registry = SimIpcRegistry::Get();
  absl::MutexLock registry_lock(&registry.mu);
  registry.mallocs[{h.pid, h.device, base}] = it->second;
  return absl::OkStatus();
}

absl::Status SimBackend::OpenMalloc(const IpcMemHandle& handle, DevicePtr* out) {
  SimMallocHandle h{};
  std::memcpy(&h, handle.data(), sizeof(h));
  if (std::memcmp(h.tag, kHandleTag, sizeof(kHandleTag)) != 0 || out == nullptr) {
    return absl::InvalidArgumentError("cudaIpcOpenMemHandle: not a cudaIpcMemHandle_t");
  }
  if (h.pid == ProcessId()) {
    return absl::InvalidArgumentError(
        "cudaIpcOpenMemHandle: the handle was exported by this process, which cannot open it");
  }
  std::size_t size = 0;
  {
    SimIpcRegistry& registry = SimIpcRegistry::Get();
    absl::MutexLock lock(&registry.mu);
    const auto it = registry.mallocs.find({h.pid, h.device, h.base});
    if (it == registry.mallocs.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cudaIpcOpenMemHandle: allocation %#x of process %d is not exported (freed?)", h.base,
          h.pid));
    }
    size = it->second;
  }
  absl::MutexLock lock(&mu_);
  const DevicePtr ptr = TakeAddressLocked(size, config_.granularity);
  if (ptr == 0) return absl::ResourceExhaustedError("cudaIpcOpenMemHandle: no address space");
  opened_.emplace(ptr, size);
  *out = ptr;
  return absl::OkStatus();
}

absl::Status SimBackend::CloseMalloc(DevicePtr ptr) {
  absl::MutexLock lock(&mu_);
  const auto it = opened_.find(ptr);
  if (it == opened_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaIpcCloseMemHandle: %#x was not opened by cudaIpcOpenMemHandle", ptr));
  }
  GiveBackAddressLocked(ptr, it->second);
  opened_.erase(it);
  return absl::OkStatus();
}

absl::Status SimBackend::ExportPhysical(PhysicalHandle handle, int* fd) {
  std::size_t size = 0;
  {
    absl::MutexLock lock(&mu_);
    const auto it = handles_.find(handle);
    if (it == handles_.end() || fd == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuMemExportToShareableHandle: %#x is not a live physical handle", handle));
    }
    size = it->second.size;
  }
  int number = 0;
  {
    SimIpcRegistry& registry = SimIpcRegistry::Get();
    absl::MutexLock lock(&registry.mu);
    number = registry.next_fd++;
    registry.fds[{ProcessId(), number}] = size;
  }
  absl::MutexLock lock(&mu_);
  exports_.emplace(number, handle);
  *fd = number;
  return absl::OkStatus();
}

absl::Status SimBackend::CloseExported(int fd) {
  {
    absl::MutexLock lock(&mu_);
    if (exports_.erase(fd) == 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("close: descriptor %d is not one ExportPhysical gave", fd));
    }
  }
  SimIpcRegistry& registry = SimIpcRegistry::Get();
  absl::MutexLock lock(&registry.mu);
  registry.fds.erase({ProcessId(), fd});
  return absl::OkStatus();
}

absl::Status SimBackend::ImportPhysical(int pid, const std::vector<int>& fds,
                                        std::vector<PhysicalHandle>* out) {
  if (out == nullptr) return absl::InvalidArgumentError("cuMemImportFromShareableHandle: no out");
  std::vector<std::size_t> sizes;
  {
    SimIpcRegistry& registry = SimIpcRegistry::Get();
    absl::MutexLock lock(&registry.mu);
    for (int fd : fds) {
      const auto it = registry.fds.find({pid, fd});
      if (it == registry.fds.end()) {
        return absl::NotFoundError(
            absl::StrFormat("pidfd_getfd: process %d has no open descriptor %d (%s)", pid, fd,
                            "Bad file descriptor"));
      }
      sizes.push_back(it->second);
    }
  }
  absl::MutexLock lock(&mu_);
  out->clear();
  for (std::size_t size : sizes) {
    const PhysicalHandle handle = next_handle_++;
    handles_.emplace(handle, Handle{size, 0, /*imported=*/true});
    out->push_back(handle);
  }
  return absl::OkStatus();
}

absl::Status SimBackend::SynchronizeDevice() {
  absl::MutexLock lock(&mu_);
  for (auto& [stream, through] : completed_through_) through = next_seq_ - 1;
  return absl::OkStatus();
}

std::int64_t SimBackend::live_exports() const {
  absl::MutexLock lock(&mu_);
  return static_cast<std::int64_t>(exports_.size());
}

PhysicalHandle SimBackend::HandleAt(DevicePtr va) const {
  absl::MutexLock lock(&mu_);
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) return 0;
  --it;
  return va < it->first + it->second.size ? it->second.handle : 0;
}

std::int64_t SimBackend::live_opened() const {
  absl::MutexLock lock(&mu_);
  return static_cast<std::int64_t>(opened_.size());
}

}  // namespace vramledger
