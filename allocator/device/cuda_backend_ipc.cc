// CudaBackend's interprocess sharing: cudaIpc*MemHandle for cudaMalloc'd memory, POSIX
// descriptors of physical handles (duplicated across processes with pidfd_getfd). Thread-safe.
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "device/cuda_backend.h"
#include "device/cuda_internal.h"

// Older C libraries lack the names; the kernel numbers are fixed (Linux 5.3 and 5.6).
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace vramledger {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(IpcMemHandle));

// torch's explanation when the kernel lacks a pidfd call, with vramledger's own switches (it
// does not read torch's allocator settings).
std::string NoPidfd(const char* call) {
  return absl::StrFormat(
      "The kernel on this machine does not support the %s syscall needed to use IPC for CUDA "
      "tensors in expandable segments. Allocate the shared tensors inside "
      "`with vramledger.contiguous_segments():` in the sending process, or turn expandable "
      "segments off there (vramledger.install(expandable_segments=False), or "
      "VRAMLEDGER_CONF=expandable_segments:False).",
      call);
}

}  // namespace

int CudaBackend::ProcessId() const { return static_cast<int>(getpid()); }

absl::Status CudaBackend::ExportMalloc(DevicePtr base, IpcMemHandle* out) {
  if (out == nullptr) return absl::InvalidArgumentError("cudaIpcGetMemHandle: out is null");
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  cudaIpcMemHandle_t handle;
  const cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (err != cudaSuccess) {
    return RuntimeStatus(err, absl::StrFormat("cudaIpcGetMemHandle(%#x)", base), device_);
  }
  std::memcpy(out->data(), &handle, sizeof(handle));
  return absl::OkStatus();
}

absl::Status CudaBackend::OpenMalloc(const IpcMemHandle& handle, DevicePtr* out) {
  if (out == nullptr) return absl::InvalidArgumentError("cudaIpcOpenMemHandle: out is null");
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) return RuntimeStatus(err, "cudaIpcOpenMemHandle", device_);
  *out = reinterpret_cast<DevicePtr>(ptr);
  return absl::OkStatus();
}

absl::Status CudaBackend::CloseMalloc(DevicePtr ptr) {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  return RuntimeStatus(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)),
                       absl::StrFormat("cudaIpcCloseMemHandle(%#x)", ptr), device_);
}

absl::Status CudaBackend::ExportPhysical(PhysicalHandle handle, int* fd) {
  if (!vmm_status_.ok()) return vmm_status_;
  if (fd == nullptr) return absl::InvalidArgumentError("cuMemExportToShareableHandle: fd is null");
  if (!posix_handles_.load(std::memory_order_relaxed)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuMemExportToShareableHandle on device %d: cuMemCreate refused POSIX file descriptor "
        "handles here, so mapped pages cannot be shared with another process; allocate the "
        "tensor inside vramledger.contiguous_segments() to share it",
        device_));
  }
  // Each shared page keeps a descriptor open while its handle lives, so a large tensor needs
  // thousands: the soft limit is raised to the hard one once, before the first export.
  static const bool raised = [] {
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return false;
    limit.rlim_cur = limit.rlim_max;
    return setrlimit(RLIMIT_NOFILE, &limit) == 0;
  }();
  (void)raised;
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  int exported = -1;
  errno = 0;  // the driver's own dup sets it when the process is out of descriptors
  const CUresult err = driver_->mem_export_to_shareable_handle(
      &exported, static_cast<CUmemGenericAllocationHandle>(handle),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, /*flags=*/0);
  if (err != CUDA_SUCCESS) {
    const absl::Status status = DriverStatus(
        err, absl::StrFormat("cuMemExportToShareableHandle(%#x)", handle), device_, *driver_);
    if (errno != EMFILE) return status;
    return absl::ResourceExhaustedError(absl::StrCat(
        status.message(),
        ": the process has no file descriptor left (one stays open per shared page); raise "
        "`ulimit -n`, set expandable_handle_mb (fewer, larger handles), or allocate the shared "
        "tensors inside vramledger.contiguous_segments()"));
  }
  *fd = exported;
  return absl::OkStatus();
}

absl::Status CudaBackend::CloseExported(int fd) {
  if (close(fd) != 0) {
    return absl::InternalError(absl::StrFormat("close(%d): %s", fd, std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ImportPhysical(int pid, const std::vector<int>& fds,
                                         std::vector<PhysicalHandle>* out) {
  if (!vmm_status_.ok()) return vmm_status_;
  if (out == nullptr) return absl::InvalidArgumentError("cuMemImportFromShareableHandle: no out");
  ScopedDevice scope(device_, driver_.get());
  if (!scope.status().ok()) return scope.status();
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  if (pidfd == -1) {
    const int err = errno;
    if (err == ENOSYS) return absl::FailedPreconditionError(NoPidfd("pidfd_open"));
    return absl::NotFoundError(absl::StrFormat(
        "pidfd_open(%d): %s (has the sending process exited?)", pid, std::strerror(err)));
  }
  std::vector<PhysicalHandle> imported;
  absl::Status status;
  for (int fd : fds) {
    const long mine = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    if (mine == -1) {
      const int err = errno;
      const std::string what = absl::StrFormat("pidfd_getfd(process %d, descriptor %d): %s", pid,
                                               fd, std::strerror(err));
      if (err == ENOSYS) {
        status = absl::FailedPreconditionError(NoPidfd("pidfd_getfd"));
      } else if (err == EPERM) {
        status = absl::PermissionDeniedError(
            what +
            ": this process may not take the sender's descriptors (a seccomp profile, or "
            "kernel.yama.ptrace_scope, which the sender can lift with prctl(PR_SET_PTRACER))");
      } else {
        status = absl::NotFoundError(what);
      }
      break;
    }
    CUmemGenericAllocationHandle handle = 0;
    const CUresult err = driver_->mem_import_from_shareable_handle(
        &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(mine)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(static_cast<int>(mine));  // the imported handle holds the memory from here on
    if (err != CUDA_SUCCESS) {
      status = DriverStatus(err, "cuMemImportFromShareableHandle", device_, *driver_);
      break;
    }
    imported.push_back(static_cast<PhysicalHandle>(handle));
  }
  close(static_cast<int>(pidfd));
  if (!status.ok()) {
    for (PhysicalHandle h : imported) {
      (void)driver_->mem_release(static_cast<CUmemGenericAllocationHandle>(h));
    }
    return status;
  }
  *out = std::move(imported);
  return absl::OkStatus();
}

absl::Status CudaBackend::SynchronizeDevice() {
  ScopedDevice scope(device_, nullptr);
  if (!scope.status().ok()) return scope.status();
  return RuntimeStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device_);
}

}  // namespace vramledger
