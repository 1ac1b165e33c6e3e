// Pausable regions through the runtime's device table (region_api.h): each call finds the
// device's allocator (begin creates it; the others need it to exist), forwards to it, and
// reports a failure across the C ABI with the region named.
#include "torch_plugin/runtime/region_api.h"

#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "ledger/region_report.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/runtime/device_table.h"
#include "torch_plugin/runtime/guard_api.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

absl::Status CheckName(const char* name) {
  if (name == nullptr || name[0] == '\0') {
    return absl::InvalidArgumentError("vramledger: a region needs a non-empty name");
  }
  return absl::OkStatus();
}

// The allocator of `device`; `create` makes it if it does not exist yet (a region's first
// scope), otherwise a device that never allocated has no region: NotFound naming `name`.
absl::StatusOr<DeviceAllocator*> AllocatorFor(int device, const char* name, bool create) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  DeviceTable& table = DeviceTable::Get();
  if (absl::Status s = table.EnsureDevices(); !s.ok()) return s;
  if (absl::Status s = table.CheckDevice(device); !s.ok()) return s;
  if (create) return table.GetOrCreate(device);
  DeviceAllocator* allocator = table.Existing(device);
  if (allocator == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("vramledger: no region named '", name, "' on device ", device));
  }
  return allocator;
}

// `status` with "region '<name>': " in front unless its message names the region already.
absl::Status Named(const absl::Status& status, const char* name) {
  const std::string quoted = absl::StrCat("'", name, "'");
  if (status.message().find(quoted) != absl::string_view::npos) return status;
  absl::string_view message = status.message();
  absl::ConsumePrefix(&message, "vramledger: ");
  return absl::Status(status.code(), absl::StrCat("vramledger: region ", quoted, ": ", message));
}

// CatchAll for the region calls: a ResourceExhausted status is VRAMLEDGER_OUT_OF_MEMORY, so
// Python raises torch.OutOfMemoryError for a resume the card or the plan cannot hold.
template <typename Fn>
int Report(const char* name, Fn fn) {  // not noexcept: a forced unwind passes (c_errors.h)
  absl::Status failure;
  const int rc = CatchAll([&]() -> absl::Status {
    failure = fn();
    if (!failure.ok() && name != nullptr && name[0] != '\0') failure = Named(failure, name);
    return failure;
  });
  return rc != VRAMLEDGER_OK && absl::IsResourceExhausted(failure) ? VRAMLEDGER_OUT_OF_MEMORY : rc;
}

absl::StatusOr<RegionBackup> BackupOf(int backup) {
  switch (backup) {
    case VRAMLEDGER_BACKUP_NONE:
      return RegionBackup::kNone;
    case VRAMLEDGER_BACKUP_CPU:
      return RegionBackup::kCpu;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("vramledger: backup must be 0 (none) or 1 (cpu), got ", backup));
  }
}

absl::Status CheckOut(char** json_out) {
  if (json_out == nullptr) return absl::InvalidArgumentError("vramledger: json_out is null");
  *json_out = nullptr;
  return absl::OkStatus();
}

}  // namespace
}  // namespace vramledger

extern "C" {

int vramledger_region_begin(int device, const char* name) {
  return vramledger::Report(name, [&]() -> absl::Status {
    absl::StatusOr<vramledger::DeviceAllocator*> allocator =
        vramledger::AllocatorFor(device, name, /*create=*/true);
    if (!allocator.ok()) return allocator.status();
    // Every stream of the calling thread, as torch's use_mem_pool filter: the core routes by
    // the filter, so another thread's allocations stay where they were.
    return (*allocator)
        ->BeginRegion(name,
                      [thread = std::this_thread::get_id()](vramledger::StreamId) {
                        return std::this_thread::get_id() == thread;
                      })
        .status();
  });
}

int vramledger_region_end(int device, const char* name) {
  return vramledger::Report(name, [&]() -> absl::Status {
    absl::StatusOr<vramledger::DeviceAllocator*> allocator =
        vramledger::AllocatorFor(device, name, /*create=*/false);
    if (!allocator.ok()) return allocator.status();
    return (*allocator)->EndRegion(name);
  });
}

int vramledger_region_pause(int device, const char* name, int backup, char** json_out) {
  return vramledger::Report(name, [&]() -> absl::Status {
    if (absl::Status s = vramledger::CheckOut(json_out); !s.ok()) return s;
    absl::StatusOr<vramledger::RegionBackup> kind = vramledger::BackupOf(backup);
    if (!kind.ok()) return kind.status();
    absl::StatusOr<vramledger::DeviceAllocator*> allocator =
        vramledger::AllocatorFor(device, name, /*create=*/false);
    if (!allocator.ok()) return allocator.status();
    absl::StatusOr<vramledger::RegionPauseResult> r = (*allocator)->PauseRegion(name, *kind);
    if (!r.ok()) return r.status();
    const nlohmann::json json = {{"device", device},
                                 {"region", name},
                                 {"released_bytes", r->released_bytes},
                                 {"backed_up_bytes", r->backed_up_bytes},
                                 {"already_paused", r->already_paused},
                                 {"handles", r->handles},
                                 {"wait_seconds", r->wait_seconds},
                                 {"copy_seconds", r->copy_seconds},
                                 {"driver_seconds", r->driver_seconds}};
    return vramledger::ExportString(json.dump(), json_out);
  });
}

int vramledger_region_resume(int device, const char* name, int keep_host_buffers, char** json_out) {
  return vramledger::Report(name, [&]() -> absl::Status {
    if (absl::Status s = vramledger::CheckOut(json_out); !s.ok()) return s;
    absl::StatusOr<vramledger::DeviceAllocator*> allocator =
        vramledger::AllocatorFor(device, name, /*create=*/false);
    if (!allocator.ok()) return allocator.status();
    absl::StatusOr<vramledger::RegionResumeResult> r =
        (*allocator)->ResumeRegion(name, keep_host_buffers != 0);
    // A refusal for memory gets the report an allocation's would: the guard's completed
    // message (or the out-of-memory dump) and the device's regions.
    if (!r.ok()) return vramledger::GuardRefusalOrOomDump(device, r.status());
    const nlohmann::json json = {{"device", device},
                                 {"region", name},
                                 {"mapped_bytes", r->mapped_bytes},
                                 {"restored_bytes", r->restored_bytes},
                                 {"already_running", r->already_running},
                                 {"handles", r->handles},
                                 {"driver_seconds", r->driver_seconds},
                                 {"copy_seconds", r->copy_seconds}};
    return vramledger::ExportString(json.dump(), json_out);
  });
}

int vramledger_region_list(int device, char** json_out) {
  return vramledger::Report(nullptr, [&]() -> absl::Status {
    if (absl::Status s = vramledger::CheckOut(json_out); !s.ok()) return s;
    vramledger::DeviceTable& table = vramledger::DeviceTable::Get();
    if (absl::Status s = table.EnsureDevices(); !s.ok()) return s;
    if (device != -1) {
      if (absl::Status s = table.CheckDevice(device); !s.ok()) return s;
    }
    nlohmann::json list = nlohmann::json::array();
    const int first = device == -1 ? 0 : device;
    const int last = device == -1 ? table.device_count() - 1 : device;
    for (int d = first; d <= last; ++d) {
      const vramledger::DeviceAllocator* allocator = table.Existing(d);
      if (allocator == nullptr) continue;
      for (const vramledger::RegionInfo& r : allocator->Regions()) {
        list.push_back(vramledger::RegionJson(d, r));
      }
    }
    return vramledger::ExportString(list.dump(), json_out);
  });
}

}  // extern "C"
