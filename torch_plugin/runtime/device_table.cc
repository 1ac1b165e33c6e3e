// The per-device allocator table (see device_table.h): creation, guard and history attachment,
// and the process's allocator options.
#include "torch_plugin/runtime/device_table.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "device/cuda_backend.h"
#include "torch_plugin/runtime/guard_api.h"
#include "torch_plugin/runtime/history_api.h"

namespace vramledger {

// One device's allocator. `ready` is published (release) once both members exist; readers that
// must not create (stats, free) only load it.
struct DeviceTable::Slot {
  std::once_flag once;
  absl::Status status;                     // sticky creation failure, written inside `once`
  std::unique_ptr<DeviceBackend> backend;  // CudaBackend, or SimBackend under testing
  std::unique_ptr<DeviceAllocator> allocator;
  std::atomic<DeviceAllocator*> ready{nullptr};
};

DeviceTable& DeviceTable::Get() {
  static DeviceTable* const table = new DeviceTable;  // never destroyed
  return *table;
}

absl::Status DeviceTable::EnsureDevices() {
  std::call_once(devices_once_, [this] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error so torch does not see it
      devices_status_ = absl::FailedPreconditionError(
          absl::StrCat("vramledger: cudaGetDeviceCount failed: ", cudaGetErrorString(err)));
      return;
    }
    if (count <= 0) {
      devices_status_ = absl::FailedPreconditionError("vramledger: no CUDA device is present");
      return;
    }
    InitSlots(count);
  });
  return devices_status_;
}

absl::Status DeviceTable::UseSimBackend(int count, std::size_t capacity) {
  if (count <= 0 || capacity == 0) {
    return absl::InvalidArgumentError("vramledger: simulated devices need a count and capacity");
  }
  bool ran = false;
  std::call_once(devices_once_, [&] {
    ran = true;
    sim_capacity_ = capacity;
    InitSlots(count);
  });
  if (!ran) return absl::FailedPreconditionError("vramledger: the device table already exists");
  return absl::OkStatus();
}

SimBackend* DeviceTable::sim_backend(int device) {
  if (!EnsureDevices().ok() || sim_capacity_ == 0 || Existing(device) == nullptr) return nullptr;
  return static_cast<SimBackend*>(slots_[device].backend.get());
}

absl::Status DeviceTable::CheckDevice(int device) {
  if (absl::Status s = EnsureDevices(); !s.ok()) return s;
  if (device < 0 || device >= device_count()) {
    return absl::InvalidArgumentError(absl::StrCat("vramledger: invalid device index ", device,
                                                   " (", device_count(), " CUDA devices)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceAllocator*> DeviceTable::GetOrCreate(int device) {
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  Slot& slot = slots_[device];
  if (DeviceAllocator* a = slot.ready.load(std::memory_order_acquire)) return a;
  std::call_once(slot.once, [&] { slot.status = CreateSlot(device, &slot); });
  if (!slot.status.ok()) return slot.status;
  return slot.ready.load(std::memory_order_acquire);
}

DeviceAllocator* DeviceTable::Existing(int device) const {
  if (device < 0 || device >= device_count()) return nullptr;  // acquire: slots_ is visible
  return slots_[device].ready.load(std::memory_order_acquire);
}

void DeviceTable::SetBeforeCreate(std::function<void(int device)> before) {
  before_create_ = std::move(before);
}

absl::Status DeviceTable::Configure(const std::string& conf) {
  absl::StatusOr<Options> parsed = OptionsFromEnvAndString(conf, RuntimeDefaults());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("vramledger: ", parsed.status().message()));
  }
  absl::MutexLock lock(&options_mu_);
  if (frozen_) {
    if (configured_ && conf == conf_) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "vramledger: the allocator is already running with options '", options_.conf_string,
        "'; options cannot change after the first allocation (asked for '", conf, "')"));
  }
  options_ = *std::move(parsed);
  conf_ = conf;
  configured_ = true;
  return absl::OkStatus();
}

absl::StatusOr<Options> DeviceTable::CurrentOptions(bool freeze) {
  absl::MutexLock lock(&options_mu_);
  if (!configured_) {
    absl::StatusOr<Options> parsed = OptionsFromEnvAndString("", RuntimeDefaults());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("vramledger: VRAMLEDGER_CONF: ", parsed.status().message()));
    }
    options_ = *std::move(parsed);
    configured_ = true;
  }
  if (freeze) frozen_ = true;
  return options_;
}

absl::Status DeviceTable::ForDevices(int device,
                                     const std::function<absl::Status(DeviceAllocator*)>& fn) {
  if (device == -1) {
    if (absl::Status s = EnsureDevices(); !s.ok()) return s;
    absl::Status first;
    for (int d = 0; d < device_count(); ++d) {
      if (DeviceAllocator* a = Existing(d)) {
        absl::Status s = fn(a);
        if (first.ok()) first = s;
      }
    }
    return first;
  }
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  DeviceAllocator* a = Existing(device);
  if (a == nullptr) return absl::OkStatus();
  return fn(a);
}

Options WithinBackendLimits(Options options, const absl::Status& vmm, std::string* warning) {
  warning->clear();
  if (!options.expandable_segments || vmm.ok() ||
      absl::StrContains(options.conf_string, "expandable_segments")) {
    return options;
  }
  options.expandable_segments = false;
  *warning = absl::StrCat("vramledger: expandable segments (the default) are not supported here (",
                          vmm.message(), "); this device uses plain segments (torch's policy)");
  return options;
}

absl::Status DeviceTable::CreateSlot(int device, Slot* slot) {
  absl::StatusOr<Options> current = CurrentOptions(/*freeze=*/true);
  if (!current.ok()) return current.status();
  if (before_create_) before_create_(device);
  if (sim_capacity_ > 0) {
    SimBackendConfig config;
    config.device = device;
    config.capacity = sim_capacity_;
    slot->backend = std::make_unique<SimBackend>(config);
  } else {
    // CudaBackend makes `device` current around each of its calls, so no caller here needs to.
    slot->backend = std::make_unique<CudaBackend>(device);
  }
  std::string warning;
  const Options options =
      WithinBackendLimits(*std::move(current), slot->backend->VirtualMemoryStatus(), &warning);
  if (!warning.empty()) std::fprintf(stderr, "%s\n", warning.c_str());
  slot->allocator = std::make_unique<DeviceAllocator>(options, slot->backend.get());
  // The budget guard, chained before the memory history (history_api.h).
  if (absl::Status s = AttachGuard(device, device_count(), options, slot->backend.get(),
                                   slot->allocator.get(), LedgerHooks());
      !s.ok()) {
    return s;
  }
  AttachLedger(device, slot->allocator.get());
  slot->ready.store(slot->allocator.get(), std::memory_order_release);
  return absl::OkStatus();
}

void DeviceTable::InitSlots(int count) {
  slots_ = new Slot[count];  // leaked on purpose, see the class comment
  published_count_.store(count, std::memory_order_release);
}

}  // namespace vramledger
