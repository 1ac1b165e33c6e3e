// What CudaBackend's two sources share (cuda_backend.cc, cuda_backend_ipc.cc): the driver entry
// points, CUDA error mapping and the device guard. Internal to allocator/device; thread-safe.
#ifndef VRAMLEDGER_DEVICE_CUDA_INTERNAL_H_
#define VRAMLEDGER_DEVICE_CUDA_INTERNAL_H_

#include <cuda.h>  // Types only: every driver function is reached through CudaDriverApi.
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"

namespace vramledger {

// Driver ABI versions: all VMM entry points have had one ABI since CUDA 10.2 (the _v10020
// typedefs). Asking for the 12.0 ABI pins those and stays valid on newer drivers.
struct CudaDriverApi {
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDevicePrimaryCtxGetState_v7000 primary_ctx_get_state = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
};

// Maps a runtime error; clears the runtime's last error so later checks do not see it.
absl::Status RuntimeStatus(cudaError_t err, std::string_view call, int device);
// Maps a driver error, naming it through the driver's own error strings.
absl::Status DriverStatus(CUresult err, std::string_view call, int device,
                          const CudaDriverApi& api);

// Makes `device` current for the scope (and, for driver calls, gives the thread a context);
// restores the previous device on exit. Does nothing when the device is already current.
class ScopedDevice {
 public:
  ScopedDevice(int device, const CudaDriverApi* driver_for_context) {
    int current = -1;
    if (cudaError_t err = cudaGetDevice(&current); err != cudaSuccess) {
      status_ = RuntimeStatus(err, "cudaGetDevice", device);
      return;
    }
    if (current != device) {
      if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
        status_ = RuntimeStatus(err, "cudaSetDevice", device);
        return;
      }
      previous_ = current;
      return;
    }
    if (driver_for_context != nullptr) {
      // cudaGetDevice reports device 0 on a thread that never touched CUDA, with no context
      // bound; the driver VMM calls need one. cudaSetDevice binds the primary context (CUDA 12+).
      CUcontext context = nullptr;
      if (driver_for_context->ctx_get_current(&context) == CUDA_SUCCESS && context == nullptr) {
        status_ = RuntimeStatus(cudaSetDevice(device), "cudaSetDevice", device);
      }
    }
  }
  ~ScopedDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;  // Device to restore, or -1 if nothing was switched.
  absl::Status status_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_DEVICE_CUDA_INTERNAL_H_
