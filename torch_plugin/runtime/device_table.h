// The process's per-device allocator table, which every route serves from: one DeviceAllocator
// per device, created on first use with the process's options, its budget guard and its history
// attached. Thread-safe; process-wide and never destroyed (tensors may be freed during
// interpreter shutdown, after static destructors would have run).
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_DEVICE_TABLE_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_DEVICE_TABLE_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>  // std::once_flag
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "device/sim_backend.h"
#include "vramledger/device_allocator.h"
#include "vramledger/device_backend.h"
#include "vramledger/options.h"

namespace vramledger {

/// `options` as a device whose backend reports `vmm` (DeviceBackend::VirtualMemoryStatus) can
/// serve them: expandable segments that only the defaults asked for (no
/// `expandable_segments` key in options.conf_string) become plain segments there, with
/// *warning set to one line that says why, as torch falls back on a platform without them; an
/// explicit request is kept (its first allocation then fails naming the driver's error).
Options WithinBackendLimits(Options options, const absl::Status& vmm, std::string* warning);

class DeviceTable {
 public:
  /// The process's table.
  static DeviceTable& Get();

  /// Reads the device count once (cudaGetDeviceCount). FailedPrecondition when CUDA has no
  /// device or the count cannot be read.
  absl::Status EnsureDevices();

  /// Testing: `count` simulated devices of `capacity` bytes (SimBackend) instead of CUDA. Only
  /// before anything touched the table: FailedPrecondition afterwards.
  absl::Status UseSimBackend(int count, std::size_t capacity);

  /// Testing: the simulated backend of `device` once its allocator exists, else nullptr.
  SimBackend* sim_backend(int device);

  /// Devices in the table; 0 until EnsureDevices succeeded.
  int device_count() const { return published_count_.load(std::memory_order_acquire); }

  /// True when the devices are simulated (testing); valid after EnsureDevices().
  bool simulated() const { return sim_capacity_ > 0; }

  /// OK when `device` is an index of the table (EnsureDevices first), else InvalidArgument.
  absl::Status CheckDevice(int device);

  /// The allocator of `device`, created on first use: the process's options (frozen from then
  /// on), CudaBackend (SimBackend under testing), the budget guard and the history attached.
  /// A creation failure (bad options or plan) is sticky for that device.
  absl::StatusOr<DeviceAllocator*> GetOrCreate(int device);

  /// The allocator of `device` if it exists; nullptr otherwise (never creates one).
  DeviceAllocator* Existing(int device) const;

  /// Runs `before(device)` inside each allocator's creation, before anything of it exists (the
  /// shim records the device's memory in use then). Set once, before the first allocation.
  void SetBeforeCreate(std::function<void(int device)> before);

  /// Sets the options from `conf` merged over VRAMLEDGER_CONF over RuntimeDefaults() (expandable
  /// segments on; see vramledger_configure):
  /// InvalidArgument for a bad key or value, FailedPrecondition once allocators run with another
  /// string. Messages start with "vramledger: ".
  absl::Status Configure(const std::string& conf);

  /// The options allocators are (or will be) created with; parses VRAMLEDGER_CONF if Configure
  /// was never called (InvalidArgument "vramledger: VRAMLEDGER_CONF: ..." when it does not
  /// parse). `freeze` forbids later changes.
  absl::StatusOr<Options> CurrentOptions(bool freeze);

  /// Runs `fn(allocator)` on the allocator of `device`, or of every device for -1. Devices
  /// without an allocator have nothing to do. The first error wins.
  absl::Status ForDevices(int device, const std::function<absl::Status(DeviceAllocator*)>& fn);

 private:
  struct Slot;

  DeviceTable() = default;
  absl::Status CreateSlot(int device, Slot* slot);
  void InitSlots(int count);

  std::once_flag devices_once_;
  absl::Status devices_status_;          // written inside devices_once_
  Slot* slots_ = nullptr;                // written inside devices_once_, leaked on purpose
  std::atomic<int> published_count_{0};  // set (release) once slots_ exists
  std::size_t sim_capacity_ = 0;         // > 0: SimBackend devices (testing)
  std::function<void(int)> before_create_;

  absl::Mutex options_mu_;
  bool configured_ ABSL_GUARDED_BY(options_mu_) = false;  // options_ holds parsed options
  bool frozen_ ABSL_GUARDED_BY(options_mu_) = false;      // an allocator was created
  std::string conf_ ABSL_GUARDED_BY(options_mu_);         // the string given to Configure
  Options options_ ABSL_GUARDED_BY(options_mu_);
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_DEVICE_TABLE_H_
