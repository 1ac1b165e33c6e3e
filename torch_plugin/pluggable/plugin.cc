// The C ABI of libvramledger_plugin.so: one DeviceAllocator over a CudaBackend per device, created
// lazily and thread-safely, with refusals thrown as c10::OutOfMemoryError (PYTORCH-FACTS §1, §8).
#include "torch_plugin/plugin.h"

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "device/cuda_backend.h"
#include "device/sim_backend.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/guard_api.h"      // issue 6: budget guard
#include "torch_plugin/oom_observers.h"  // issue 4
#include "torch_plugin/plugin_history.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

// One device's allocator. `ready` is published (release) once both members exist; readers that
// must not create (stats, free) only load it.
struct DeviceSlot {
  std::once_flag once;
  absl::Status status;                     // sticky creation failure, written inside `once`
  std::unique_ptr<DeviceBackend> backend;  // CudaBackend, or SimBackend under testing
  std::unique_ptr<DeviceAllocator> allocator;
  std::atomic<DeviceAllocator*> ready{nullptr};
};

// Process-wide plugin state. Never destroyed: tensors may be freed during interpreter shutdown,
// after static destructors would have run, and the CUDA runtime may already be gone by then.
class PluginState {
 public:
  // Reads the device count once. FailedPrecondition when CUDA has no device.
  absl::Status EnsureDevices() {
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

  // Testing: `count` simulated devices of `capacity` bytes instead of CUDA. Only before anything
  // touched the device table.
  absl::Status UseSimBackend(int count, std::size_t capacity) {
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

  // Testing: the simulated backend of `device`, or nullptr.
  SimBackend* sim_backend(int device) {
    if (!EnsureDevices().ok() || sim_capacity_ == 0 || Existing(device) == nullptr) return nullptr;
    return static_cast<SimBackend*>(slots_[device].backend.get());
  }

  int device_count() const { return device_count_; }
  // True when the devices are simulated (testing); valid after EnsureDevices().
  bool simulated() const { return sim_capacity_ > 0; }

  absl::Status CheckDevice(int device) {
    if (absl::Status s = EnsureDevices(); !s.ok()) return s;
    if (device < 0 || device >= device_count_) {
      return absl::InvalidArgumentError(absl::StrCat("vramledger: invalid device index ", device,
                                                     " (", device_count_, " CUDA devices)"));
    }
    return absl::OkStatus();
  }

  // The allocator of `device`, creating it on first use.
  absl::StatusOr<DeviceAllocator*> GetOrCreate(int device) {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    DeviceSlot& slot = slots_[device];
    if (DeviceAllocator* a = slot.ready.load(std::memory_order_acquire)) return a;
    std::call_once(slot.once, [&] { slot.status = CreateSlot(device, &slot); });
    if (!slot.status.ok()) return slot.status;
    return slot.ready.load(std::memory_order_acquire);
  }

  // The allocator of `device` if it exists; nullptr otherwise (never creates).
  // Pre: EnsureDevices() returned on this thread (it publishes the table).
  DeviceAllocator* Existing(int device) const {
    if (device < 0 || device >= device_count_ || slots_ == nullptr) return nullptr;
    return slots_[device].ready.load(std::memory_order_acquire);
  }

  // Sets the options; see vramledger_configure.
  int Configure(const char* conf, std::string* error) {
    const std::string conf_string = conf == nullptr ? "" : conf;
    absl::StatusOr<Options> parsed = OptionsFromEnvAndString(conf_string);
    if (!parsed.ok()) {
      *error = absl::StrCat("vramledger: ", parsed.status().message());
      return VRAMLEDGER_INVALID_ARGUMENT;
    }
    std::lock_guard<std::mutex> lock(options_mu_);
    if (frozen_) {
      if (configured_ && conf_string == conf_) return VRAMLEDGER_OK;
      *error = absl::StrCat(
          "vramledger: the allocator is already running with options '", options_.conf_string,
          "'; options cannot change after the first allocation (asked for '", conf_string, "')");
      return VRAMLEDGER_FAILED;
    }
    options_ = *std::move(parsed);
    conf_ = conf_string;
    configured_ = true;
    return VRAMLEDGER_OK;
  }

  // The options allocators are (or will be) created with; parses VRAMLEDGER_CONF if
  // vramledger_configure was never called. `freeze` forbids later changes.
  absl::StatusOr<Options> CurrentOptions(bool freeze) {
    std::lock_guard<std::mutex> lock(options_mu_);
    if (!configured_) {
      absl::StatusOr<Options> parsed = OptionsFromEnvAndString("");
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

 private:
  absl::Status CreateSlot(int device, DeviceSlot* slot) {
    absl::StatusOr<Options> options = CurrentOptions(/*freeze=*/true);
    if (!options.ok()) return options.status();
    if (sim_capacity_ > 0) {
      SimBackendConfig config;
      config.device = device;
      config.capacity = sim_capacity_;
      slot->backend = std::make_unique<SimBackend>(config);
    } else {
      // CudaBackend makes `device` current around each of its calls, so no caller here needs to.
      slot->backend = std::make_unique<CudaBackend>(device);
    }
    slot->allocator = std::make_unique<DeviceAllocator>(*options, slot->backend.get());
    // Issue 6: the budget guard, chained before the memory history (plugin_history.cc).
    if (absl::Status s = AttachGuard(device, *options, slot->backend.get(), slot->allocator.get(),
                                     LedgerHooks());
        !s.ok()) {
      return s;
    }
    AttachLedger(device, slot->allocator.get());
    slot->ready.store(slot->allocator.get(), std::memory_order_release);
    return absl::OkStatus();
  }

  void InitSlots(int count) {
    device_count_ = count;
    slots_ = new DeviceSlot[count];  // leaked on purpose, see the class comment
  }

  std::once_flag devices_once_;
  absl::Status devices_status_;
  int device_count_ = 0;
  DeviceSlot* slots_ = nullptr;
  std::size_t sim_capacity_ = 0;  // > 0: SimBackend devices (testing)

  std::mutex options_mu_;
  bool configured_ = false;  // options_ holds parsed options
  bool frozen_ = false;      // an allocator was created with options_
  std::string conf_;         // the string given to Configure
  Options options_;
};

PluginState& State() {
  static PluginState* const state = new PluginState;  // never destroyed
  return *state;
}

std::string& LastError() {
  thread_local std::string error;
  return error;
}

// Records `status` for vramledger_last_error and returns its code.
int Fail(const absl::Status& status) {
  LastError() = std::string(status.message());
  return absl::IsInvalidArgument(status) ? VRAMLEDGER_INVALID_ARGUMENT : VRAMLEDGER_FAILED;
}

// Throws `status` as the matching c10 error.
[[noreturn]] void Throw(const absl::Status& status) {
  if (absl::IsResourceExhausted(status)) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, std::string(status.message()));
  }
  TORCH_CHECK_VALUE(!absl::IsInvalidArgument(status), std::string(status.message()));
  TORCH_CHECK(false, std::string(status.message()));
  std::abort();  // unreachable: TORCH_CHECK(false) throws
}

// Runs `fn(allocator)` on the allocator of `device`, or of every device for device -1.
// Devices without an allocator have nothing to do. The first error wins.
template <typename Fn>
absl::Status ForDevices(int device, Fn fn) {
  PluginState& state = State();
  if (device == -1) {
    if (absl::Status s = state.EnsureDevices(); !s.ok()) return s;
    absl::Status first;
    for (int d = 0; d < state.device_count(); ++d) {
      if (DeviceAllocator* a = state.Existing(d)) {
        absl::Status s = fn(a);
        if (first.ok()) first = s;
      }
    }
    return first;
  }
  if (absl::Status s = state.CheckDevice(device); !s.ok()) return s;
  DeviceAllocator* a = state.Existing(device);
  if (a == nullptr) return absl::OkStatus();
  return fn(a);
}

// Runs a ctypes-facing body, turning any C++ exception into VRAMLEDGER_FAILED.
template <typename Fn>
int CatchAll(Fn fn) {
  try {
    LastError().clear();
    absl::Status s = fn();
    return s.ok() ? VRAMLEDGER_OK : Fail(s);
  } catch (const std::exception& e) {
    LastError() = absl::StrCat("vramledger: ", e.what());
  } catch (...) {
    LastError() = "vramledger: unknown C++ exception";
  }
  return VRAMLEDGER_FAILED;
}

// Copies `text` into a malloc'd string for the ctypes side (vramledger_string_free releases it).
absl::Status ExportString(const std::string& text, char** out) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (copy == nullptr) return absl::ResourceExhaustedError("vramledger: out of host memory");
  std::memcpy(copy, text.c_str(), text.size() + 1);
  *out = copy;
  return absl::OkStatus();
}

// vramledger_fragmentation_json's object (issue 3): every Fragmentation field, then the driver
// calls per kind with their count and time (microseconds, measured or modelled).
nlohmann::json FragmentationJson(const Fragmentation& f, const DriverCallLedger& calls,
                                 bool modelled) {
  nlohmann::json json = nlohmann::json::object();
  json["utilization"] = f.utilization;
  json["wasted_bytes"] = f.wasted_bytes;
  json["wasted_bytes_at_peak"] = f.wasted_bytes_at_peak;
  json["free_bytes"] = f.free_bytes;
  json["largest_free_block"] = f.largest_free_block;
  json["free_space_fragmentation"] = f.free_space_fragmentation;
  json["holes"] = f.holes;
  json["mapped_free_pages"] = f.mapped_free_pages;
  json["other_stream_cached_bytes"] = f.other_stream_cached_bytes;
  json["page_moves"] = f.page_moves;
  json["retiring_bytes"] = f.retiring_bytes;
  json["reused_old_mappings"] = f.reused_old_mappings;
  nlohmann::json per_kind = nlohmann::json::object();
  for (int i = 0; i < kNumDriverCalls; ++i) {
    const auto call = static_cast<DriverCall>(i);
    per_kind[std::string(DriverCallName(call))] = {{"count", calls.count(call)},
                                                   {"time_us", calls.micros(call)}};
  }
  json["driver_calls"] = std::move(per_kind);
  json["driver_calls_total"] = calls.total_count();
  json["driver_time_us_total"] = calls.total_micros();
  json["driver_time"] = modelled ? "modelled" : "measured";
  return json;
}

// Frees `ptr` on whichever device's allocator handed it out (the current device first).
void FreeOnAnyDevice(void* ptr) {
  vramledger::PluginState& state = State();
  if (!state.EnsureDevices().ok()) return;
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || state.simulated()) {
    (void)cudaGetLastError();
    current = 0;
  }
  const int count = state.device_count();
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
  PluginState& state = State();
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

std::string& PluginLastError() { return LastError(); }  // for plugin_history.cc

}  // namespace vramledger

using vramledger::DeviceAllocator;
using vramledger::DevicePtr;
using vramledger::State;
using vramledger::StreamId;

extern "C" {

void* vramledger_malloc(std::size_t size, int device, cudaStream_t stream) {
  if (size == 0) return nullptr;
  absl::StatusOr<DeviceAllocator*> allocator = State().GetOrCreate(device);
  if (!allocator.ok()) vramledger::Throw(allocator.status());
  const absl::StatusOr<DevicePtr> ptr =
      (*allocator)->Malloc(size, reinterpret_cast<StreamId>(stream));
  // Issue 6: a guard refusal gets its full report; any other failure goes to WithOomDump.
  if (!ptr.ok()) {
    if (absl::IsResourceExhausted(ptr.status())) {  // observers first, outside the device lock
      vramledger::NotifyOutOfMemoryObservers(device, size, (*allocator)->last_oom());
    }
    vramledger::Throw(vramledger::GuardRefusalOrOomDump(device, ptr.status()));
  }
  TORCH_CHECK(*ptr != 0, "vramledger: allocation of ", size, " bytes on device ", device,
              " returned a null address");
  return reinterpret_cast<void*>(*ptr);
}

void vramledger_free(void* ptr, std::size_t size, int device, cudaStream_t stream) {
  (void)stream;
  if (ptr == nullptr) return;
  try {
    vramledger::PluginState& state = State();
    DeviceAllocator* allocator = state.EnsureDevices().ok() ? state.Existing(device) : nullptr;
    if (allocator == nullptr) {
      std::fprintf(stderr,
                   "vramledger: free of %p (%zu bytes) on device %d, which has no allocator; "
                   "ignored\n",
                   ptr, size, device);
      return;
    }
    const absl::Status s = allocator->Free(reinterpret_cast<DevicePtr>(ptr));
    if (!s.ok()) {
      std::fprintf(stderr, "vramledger: free of %p (%zu bytes) on device %d failed: %s\n", ptr,
                   size, device, std::string(s.message()).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: free of %p on device %d threw: %s\n", ptr, device, e.what());
  } catch (...) {
    std::fprintf(stderr, "vramledger: free of %p on device %d threw\n", ptr, device);
  }
}

bool vramledger_current_options(vramledger::Options* out) {
  try {
    absl::StatusOr<vramledger::Options> options = State().CurrentOptions(/*freeze=*/false);
    if (!options.ok()) return false;
    *out = *std::move(options);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool vramledger_device_free_bytes(int device, std::size_t* free_bytes) {
  try {
    absl::StatusOr<DeviceAllocator*> allocator = State().GetOrCreate(device);
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
    *segments = a.Snapshot();
    *options = a.options();
  });
}

int vramledger_trace_action(const char* name) {
  if (name == nullptr) return -1;
  const std::optional<vramledger::TraceAction> action = vramledger::ParseTraceAction(name);
  return action.has_value() ? static_cast<int>(*action) : -1;
}

void vramledger_init(int device_count) {
  const absl::Status s = State().EnsureDevices();
  if (!s.ok()) vramledger::Throw(s);
  if (device_count != State().device_count()) {
    std::fprintf(stderr, "vramledger: torch reports %d CUDA devices, cudaGetDeviceCount %d\n",
                 device_count, State().device_count());
  }
}

void vramledger_reset() {
  const absl::Status s =
      vramledger::ForDevices(-1, [](DeviceAllocator* a) { return a->EmptyCache(); });
  if (!s.ok()) vramledger::Throw(s);
}

void vramledger_set_memory_fraction(double fraction, int device) {
  absl::StatusOr<DeviceAllocator*> allocator = State().GetOrCreate(device);
  if (!allocator.ok()) vramledger::Throw(allocator.status());
  const absl::Status s = (*allocator)->SetMemoryFraction(fraction);
  if (!s.ok()) vramledger::Throw(s);
}

void vramledger_record_stream(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) return;
  vramledger::PluginState& state = State();
  const absl::Status devices = state.EnsureDevices();
  if (!devices.ok()) vramledger::Throw(devices);
  for (int d = 0; d < state.device_count(); ++d) {
    DeviceAllocator* allocator = state.Existing(d);
    if (allocator == nullptr) continue;
    const absl::Status s = allocator->RecordStream(reinterpret_cast<DevicePtr>(ptr),
                                                   reinterpret_cast<StreamId>(stream));
    if (s.ok()) return;
    if (!absl::IsNotFound(s)) vramledger::Throw(s);
  }
  TORCH_CHECK(false, "vramledger: record_stream on ", ptr,
              ", which no vramledger allocator handed out");
}

void vramledger_begin_allocate_to_pool(int device, vramledger_mempool_id pool_id,
                                       std::function<bool(cudaStream_t)> filter) {
  absl::StatusOr<DeviceAllocator*> allocator = State().GetOrCreate(device);
  if (!allocator.ok()) vramledger::Throw(allocator.status());
  const absl::Status s =
      (*allocator)
          ->BeginAllocateToPool({pool_id.first, pool_id.second},
                                [filter = std::move(filter)](StreamId stream) {
                                  return filter && filter(reinterpret_cast<cudaStream_t>(stream));
                                });
  if (!s.ok()) vramledger::Throw(s);
}

void vramledger_end_allocate_to_pool(int device, vramledger_mempool_id pool_id) {
  absl::StatusOr<DeviceAllocator*> allocator = State().GetOrCreate(device);
  if (!allocator.ok()) vramledger::Throw(allocator.status());
  const absl::Status s = (*allocator)->EndAllocateToPool({pool_id.first, pool_id.second});
  if (!s.ok()) vramledger::Throw(s);
}

void vramledger_release_pool(int device, vramledger_mempool_id pool_id) {
  absl::StatusOr<DeviceAllocator*> allocator = State().GetOrCreate(device);
  if (!allocator.ok()) vramledger::Throw(allocator.status());
  const absl::Status s = (*allocator)->ReleasePool({pool_id.first, pool_id.second});
  if (!s.ok()) vramledger::Throw(s);
}

const char* vramledger_last_error() { return vramledger::LastError().c_str(); }

int vramledger_configure(const char* conf) {
  return vramledger::CatchAll([&]() -> absl::Status {
    std::string error;
    const int code = State().Configure(conf, &error);
    if (code == VRAMLEDGER_OK) return absl::OkStatus();
    return code == VRAMLEDGER_INVALID_ARGUMENT ? absl::InvalidArgumentError(error)
                                               : absl::FailedPreconditionError(error);
  });
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
    absl::Status s = State().EnsureDevices();
    if (s.ok()) count = State().device_count();
    return s;
  });
  return rc == VRAMLEDGER_OK ? count : -1;
}

int vramledger_memory_stats_json(int device, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::CatchAll([&]() -> absl::Status {
    if (json_out == nullptr) return absl::InvalidArgumentError("vramledger: json_out is null");
    vramledger::PluginState& state = State();
    if (absl::Status s = state.CheckDevice(device); !s.ok()) return s;
    vramledger::DeviceStats stats;
    if (DeviceAllocator* a = state.Existing(device)) {
      stats = a->GetStats();
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
    json["utilization"] = stats.utilization();
    const std::string text = json.dump();
    char* out = static_cast<char*>(std::malloc(text.size() + 1));
    if (out == nullptr) return absl::ResourceExhaustedError("vramledger: out of host memory");
    std::memcpy(out, text.c_str(), text.size() + 1);
    *json_out = out;
    return absl::OkStatus();
  });
}

int vramledger_fragmentation_json(int device, cudaStream_t current_stream, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::CatchAll([&]() -> absl::Status {
    if (json_out == nullptr) return absl::InvalidArgumentError("vramledger: json_out is null");
    vramledger::PluginState& state = State();
    if (absl::Status s = state.CheckDevice(device); !s.ok()) return s;
    const auto stream = reinterpret_cast<StreamId>(current_stream);
    vramledger::Fragmentation f;        // zeros until the device allocates
    vramledger::DriverCallLedger none;  // no call made yet
    DeviceAllocator* a = state.Existing(device);
    if (a != nullptr) f = a->GetFragmentation(stream);
    nlohmann::json json = vramledger::FragmentationJson(
        f, a != nullptr ? a->backend()->calls() : none, state.simulated());
    // Host time inside the allocator's Malloc and Free, zeros unless host_timing is on
    // (step-time-measurement.md).
    const vramledger::HostTime t = a != nullptr ? a->host_time() : vramledger::HostTime{};
    json["host_time"] = {{"malloc", {{"count", t.malloc_calls}, {"time_us", t.malloc_ns / 1e3}}},
                         {"free", {{"count", t.free_calls}, {"time_us", t.free_ns / 1e3}}}};
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

void vramledger_string_free(char* s) { std::free(s); }

int vramledger_testing_use_sim_backend(int device_count, std::size_t capacity) {
  return vramledger::CatchAll([&] { return State().UseSimBackend(device_count, capacity); });
}

int vramledger_testing_complete_events(int device) {
  return vramledger::CatchAll([&]() -> absl::Status {
    vramledger::SimBackend* sim = State().sim_backend(device);
    if (sim == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("vramledger: device ", device, " has no simulated allocator"));
    }
    sim->CompleteAllEvents();
    return absl::OkStatus();
  });
}

void* vramledger_testing_malloc(size_t size, int device, char** message_out) {
  if (message_out != nullptr) *message_out = nullptr;
  std::string message;
  try {
    return vramledger_malloc(size, device, nullptr);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    message = e.what();
  }
  if (message_out != nullptr) {  // released with vramledger_string_free (std::free)
    *message_out = static_cast<char*>(std::malloc(message.size() + 1));
    if (*message_out != nullptr) std::memcpy(*message_out, message.c_str(), message.size() + 1);
  }
  return nullptr;
}

int vramledger_empty_cache(int device) {
  return vramledger::CatchAll([&] {
    return vramledger::ForDevices(device, [](DeviceAllocator* a) { return a->EmptyCache(); });
  });
}

int vramledger_reset_peak(int device) {
  return vramledger::CatchAll([&] {
    return vramledger::ForDevices(device, [](DeviceAllocator* a) {
      a->ResetPeakStats();
      return absl::OkStatus();
    });
  });
}

int vramledger_reset_accumulated(int device) {
  return vramledger::CatchAll([&] {
    return vramledger::ForDevices(device, [](DeviceAllocator* a) {
      a->ResetAccumulatedStats();
      return absl::OkStatus();
    });
  });
}

}  // extern "C"
