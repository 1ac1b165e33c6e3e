// The runtime's C ABI (see c_api.h): options, statistics and fragmentation as JSON, cache control,
// contiguous-segments scopes, the testing hooks, and the torch-native library's accessors.
#include "torch_plugin/runtime/c_api.h"

#include <cuda_runtime_api.h>

#include <cxxabi.h>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "ledger/fragmentation_json.h"
#include "ledger/history.h"
#include "ledger/region_report.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/runtime/device_table.h"
#include "torch_plugin/runtime/history_api.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

// The driver calls made so far, added to vramledger_fragmentation_json's object: each kind's
// count and time (microseconds, measured by CudaBackend or modelled by SimBackend) and totals.
void AddDriverCalls(const DriverCallLedger& calls, bool modelled, nlohmann::json* json) {
  nlohmann::json per_kind = nlohmann::json::object();
  for (int i = 0; i < kNumDriverCalls; ++i) {
    const auto call = static_cast<DriverCall>(i);
    per_kind[std::string(DriverCallName(call))] = {{"count", calls.count(call)},
                                                   {"time_us", calls.micros(call)}};
  }
  (*json)["driver_calls"] = std::move(per_kind);
  (*json)["driver_calls_total"] = calls.total_count();
  (*json)["driver_time_us_total"] = calls.total_micros();
  (*json)["driver_time"] = modelled ? "modelled" : "measured";
}

// Frees `ptr` on whichever device's allocator handed it out (the current device first).
void FreeOnAnyDevice(void* ptr) {
  vramledger::DeviceTable& state = vramledger::DeviceTable::Get();
  if (!state.EnsureDevices().ok()) return;
  // Every DataPtr of the torch-native mode is freed here: with one device (or simulated ones,
  // where device 0 is current) there is nothing to ask, so the current-device query is skipped.
  const int count = state.device_count();
  int current = 0;
  if (count > 1 && !state.simulated() && cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    current = 0;
  }
  for (int i = 0; i < count; ++i) {
    const int d = i == 0 ? current : (i <= current ? i - 1 : i);  // current, then the rest
    vramledger::DeviceAllocator* allocator = state.Existing(d);
    if (allocator == nullptr) continue;
    const absl::Status s = allocator->Free(reinterpret_cast<vramledger::DevicePtr>(ptr));
    if (s.ok()) return;
    if (!absl::IsNotFound(s)) {
      std::fprintf(stderr, "vramledger: free of %p on device %d failed: %s\n", ptr, d,
                   std::string(s.message()).c_str());
      return;
    }
  }
  std::fprintf(stderr,
               "vramledger: free of %p, which no vramledger allocator handed out; "
               "ignored\n",
               ptr);
}

// The allocator of `device` if one exists (never creates one), else nullptr.
DeviceAllocator* ExistingAllocator(int device) {
  DeviceTable& state = DeviceTable::Get();
  return state.EnsureDevices().ok() ? state.Existing(device) : nullptr;
}

// Runs `read(allocator)` on `device`'s allocator if it exists; false when it does not, or when
// `read` throws (host memory), which is reported naming `what`. Never throws.
template <typename Read>
bool ReadExisting(int device, const char* what, Read read) {
  try {
    DeviceAllocator* allocator = ExistingAllocator(device);
    if (allocator == nullptr) return false;
    read(*allocator);
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: %s of device %d: %s\n", what, device, e.what());
    return false;
  }
}
}  // namespace
}  // namespace vramledger

using vramledger::DeviceAllocator;
using vramledger::StreamId;

extern "C" {

bool vramledger_current_options(vramledger::Options* out) {
  try {
    absl::StatusOr<vramledger::Options> options =
        vramledger::DeviceTable::Get().CurrentOptions(/*freeze=*/false);
    if (!options.ok()) return false;
    *out = *std::move(options);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool vramledger_device_free_bytes(int device, std::size_t* free_bytes) {
  try {
    absl::StatusOr<DeviceAllocator*> allocator = vramledger::DeviceTable::Get().GetOrCreate(device);
    if (!allocator.ok()) return false;
    std::size_t total = 0;
    return (*allocator)->backend()->MemGetInfo(free_bytes, &total).ok();
  } catch (const std::exception&) {
    return false;
  }
}

void vramledger_free_any_device(void* ptr) {
  if (ptr == nullptr) return;
  try {  // a deleter must not throw (std::terminate): report and leak instead
    vramledger::FreeOnAnyDevice(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: free of %p threw: %s\n", ptr, e.what());
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    std::fprintf(stderr, "vramledger: free of %p threw\n", ptr);
  }
}

bool vramledger_device_stats(int device, vramledger::DeviceStats* out) {
  return vramledger::ReadExisting(device, "stats",
                                  [&](const DeviceAllocator& a) { *out = a.GetStats(); });
}

bool vramledger_device_segments(int device, std::vector<vramledger::SegmentInfo>* segments,
                                vramledger::Options* options) {
  return vramledger::ReadExisting(device, "segments", [&](const DeviceAllocator& a) {
    *segments = SegmentsOf(a);
    *options = a.options();
  });
}

int vramledger_trace_action(const char* name) {
  if (name == nullptr) return -1;
  const std::optional<vramledger::TraceAction> action = vramledger::ParseTraceAction(name);
  return action.has_value() ? static_cast<int>(*action) : -1;
}

int vramledger_configure(const char* conf) {
  return vramledger::CatchAll(
      [&] { return vramledger::DeviceTable::Get().Configure(conf == nullptr ? "" : conf); });
}

const char* vramledger_option_names() {
  static const std::string* const names = [] {
    auto* s = new std::string;
    for (const vramledger::OptionDoc& d : vramledger::OptionTable()) {
      if (!s->empty()) s->push_back(',');
      s->append(d.name);
    }
    return s;
  }();
  return names->c_str();
}

int vramledger_device_count() {
  int count = -1;
  const int rc = vramledger::CatchAll([&]() -> absl::Status {
    absl::Status s = vramledger::DeviceTable::Get().EnsureDevices();
    if (s.ok()) count = vramledger::DeviceTable::Get().device_count();
    return s;
  });
  return rc == VRAMLEDGER_OK ? count : -1;
}

int vramledger_memory_stats_json(int device, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::CatchAll([&]() -> absl::Status {
    if (json_out == nullptr) return absl::InvalidArgumentError("vramledger: json_out is null");
    vramledger::DeviceTable& state = vramledger::DeviceTable::Get();
    if (absl::Status s = state.CheckDevice(device); !s.ok()) return s;
    vramledger::DeviceStats stats;
    std::vector<vramledger::RegionInfo> regions;
    if (DeviceAllocator* a = state.Existing(device)) {
      stats = a->GetStats();
      regions = a->Regions();
    } else {
      // Nothing allocated on this device yet: zeros, and the configured max_split_size.
      absl::StatusOr<vramledger::Options> options = state.CurrentOptions(/*freeze=*/false);
      if (!options.ok()) return options.status();
      if (options->max_split_size != SIZE_MAX) {
        stats.max_split_size = static_cast<std::int64_t>(options->max_split_size);
      }
    }
    nlohmann::json json = nlohmann::json::object();
    for (const auto& [key, value] : vramledger::FlattenStats(stats)) json[key] = value;
    for (const auto& [key, value] : vramledger::FlattenRegionStats(regions)) json[key] = value;
    json["utilization"] = stats.utilization();
    return vramledger::ExportString(json.dump(), json_out);
  });
}

int vramledger_fragmentation_json(int device, cudaStream_t current_stream, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::CatchAll([&]() -> absl::Status {
    if (json_out == nullptr) return absl::InvalidArgumentError("vramledger: json_out is null");
    vramledger::DeviceTable& state = vramledger::DeviceTable::Get();
    if (absl::Status s = state.CheckDevice(device); !s.ok()) return s;
    const auto stream = reinterpret_cast<StreamId>(current_stream);
    vramledger::Fragmentation f;        // zeros until the device allocates
    vramledger::DriverCallLedger none;  // no call made yet
    DeviceAllocator* a = state.Existing(device);
    if (a != nullptr) f = FragmentationOf(*a, stream);
    nlohmann::json json = vramledger::FragmentationJson(f);
    vramledger::AddDriverCalls(a != nullptr ? a->backend()->calls() : none, state.simulated(),
                               &json);
    // Host time inside the allocator's Malloc and Free, zeros unless host_timing is on
    // (step-time-measurement.md).
    const vramledger::HostTime t = a != nullptr ? a->host_time() : vramledger::HostTime{};
    json["host_time"] = {{"malloc", {{"count", t.malloc_calls}, {"time_us", t.malloc_ns / 1e3}}},
                         {"free", {{"count", t.free_calls}, {"time_us", t.free_ns / 1e3}}}};
    nlohmann::json regions = nlohmann::json::array();
    if (a != nullptr) {
      for (const vramledger::RegionInfo& r : a->Regions()) {
        regions.push_back(vramledger::RegionJson(device, r));
      }
    }
    json["regions"] = std::move(regions);
    json["device"] = device;
    json["current_stream"] = stream;
    return vramledger::ExportString(json.dump(), json_out);
  });
}

int vramledger_contiguous_segments_enter(void) {
  vramledger::ContiguousSegmentsScope::Enter();
  return VRAMLEDGER_OK;
}

int vramledger_contiguous_segments_exit(void) {
  return vramledger::CatchAll([] {
    const absl::Status s = vramledger::ContiguousSegmentsScope::Exit();
    return s.ok() ? s : absl::FailedPreconditionError(absl::StrCat("vramledger: ", s.message()));
  });
}

int vramledger_contiguous_segments_depth(void) {
  return vramledger::ContiguousSegmentsScope::depth();
}

int vramledger_testing_use_sim_backend(int device_count, std::size_t capacity) {
  return vramledger::CatchAll(
      [&] { return vramledger::DeviceTable::Get().UseSimBackend(device_count, capacity); });
}

int vramledger_testing_complete_events(int device) {
  return vramledger::CatchAll([&]() -> absl::Status {
    vramledger::SimBackend* sim = vramledger::DeviceTable::Get().sim_backend(device);
    if (sim == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("vramledger: device ", device, " has no simulated allocator"));
    }
    sim->CompleteAllEvents();
    return absl::OkStatus();
  });
}

int vramledger_empty_cache(int device) {
  return vramledger::CatchAll([&] {
    return vramledger::DeviceTable::Get().ForDevices(
        device, [](DeviceAllocator* a) { return a->EmptyCache(); });
  });
}

int vramledger_reset_peak(int device) {
  return vramledger::CatchAll([&] {
    return vramledger::DeviceTable::Get().ForDevices(device, [](DeviceAllocator* a) {
      a->ResetPeakStats();
      return absl::OkStatus();
    });
  });
}

int vramledger_reset_accumulated(int device) {
  return vramledger::CatchAll([&] {
    return vramledger::DeviceTable::Get().ForDevices(device, [](DeviceAllocator* a) {
      a->ResetAccumulatedStats();
      return absl::OkStatus();
    });
  });
}

}  // extern "C"
