// The runtime's history, the registry of its allocators for snapshots, and the OOM dump glue.
// Process-wide state, never destroyed (tensors may be freed during interpreter shutdown).
#include "torch_plugin/runtime/history_api.h"

#include <cxxabi.h>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "ledger/oom_dump.h"
#include "ledger/snapshot.h"
#include "torch_plugin/runtime/c_api.h"

namespace vramledger {
namespace {

std::array<std::atomic<DeviceAllocator*>, History::kMaxDevices>& Registry() {
  static auto* const registry =
      new std::array<std::atomic<DeviceAllocator*>, History::kMaxDevices>();
  return *registry;
}

std::vector<const DeviceAllocator*> Allocators() {
  std::vector<const DeviceAllocator*> out;
  for (const std::atomic<DeviceAllocator*>& slot : Registry()) {
    if (DeviceAllocator* a = slot.load(std::memory_order_acquire)) out.push_back(a);
  }
  return out;
}

// The C ABI's body `fn` under CatchAll, every failure's message starting with "vramledger: ".
template <typename Fn>
int Reported(Fn fn) {
  return CatchAll([&]() -> absl::Status {
    const absl::Status s = fn();
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat("vramledger: ", s.message()));
  });
}

absl::Mutex& DecoratorMutex() {
  static absl::Mutex* const mu = new absl::Mutex;
  return *mu;
}

std::function<void(SnapshotOptions*)>& Decorator() {
  static auto* const decorate = new std::function<void(SnapshotOptions*)>;
  return *decorate;
}

}  // namespace

void SetSnapshotDecorator(std::function<void(SnapshotOptions*)> decorate) {
  absl::MutexLock lock(&DecoratorMutex());
  Decorator() = std::move(decorate);
}

SnapshotOptions PluginSnapshotOptions() {
  std::function<void(SnapshotOptions*)> decorate;
  {
    absl::MutexLock lock(&DecoratorMutex());
    decorate = Decorator();
  }
  SnapshotOptions options;
  if (decorate) decorate(&options);
  return options;
}

History& PluginHistory() {
  static History* const history = new History();
  return *history;
}

AllocatorHooks* LedgerHooks() { return &PluginHistory(); }

void AttachLedger(int device, DeviceAllocator* allocator) {
  if (device < 0 || device >= History::kMaxDevices) return;
  Registry()[device].store(allocator, std::memory_order_release);
}

absl::Status WithOomDump(int device, const absl::Status& status) {
  if (!absl::IsResourceExhausted(status)) return status;
  try {
    const DeviceAllocator* allocator = device >= 0 && device < History::kMaxDevices
                                           ? Registry()[device].load(std::memory_order_acquire)
                                           : nullptr;
    if (allocator == nullptr) return status;
    OomDumpConfig config;
    config.dump_dir = allocator->options().process.dump_dir;
    config.max_dumps = allocator->options().process.max_dumps;
    config.device = device;
    config.message = std::string(status.message());
    config.snapshot = PluginSnapshotOptions();
    absl::StatusOr<std::string> path = WriteOomDump(config, Allocators(), &PluginHistory());
    if (!path.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          status.message(),
          "\nvramledger: the forensic snapshot could not be written: ", path.status().message()));
    }
    if (path->empty()) return status;  // max_dumps <= 0
    return absl::ResourceExhaustedError(
        absl::StrCat(status.message(), "\nvramledger: memory snapshot written to ", *path,
                     " (summarise it with `vramledger inspect ", *path,
                     "`, or open it at pytorch.org/memory_viz)"));
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    return status;  // a failed dump must not hide the out-of-memory error
  }
}

}  // namespace vramledger

extern "C" {

int vramledger_record_memory_history(const char* enabled, const char* context, const char* stacks,
                                     unsigned long long max_entries, int clear_history) {
  return vramledger::Reported([&]() -> absl::Status {
    std::optional<std::string_view> e, c;
    if (enabled != nullptr) e = enabled;
    if (context != nullptr) c = context;
    absl::StatusOr<vramledger::HistorySettings> settings =
        vramledger::ParseHistorySettings(e, c, stacks == nullptr ? "python" : stacks, max_entries);
    if (!settings.ok()) return settings.status();
    vramledger::PluginHistory().Configure(*settings, clear_history != 0);
    return absl::OkStatus();
  });
}

int vramledger_snapshot_json(char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::Reported([&]() -> absl::Status {
    if (json_out == nullptr) return absl::InvalidArgumentError("json_out is null");
    std::ostringstream out;
    absl::Status s =
        vramledger::WriteSnapshotJson(out, vramledger::Allocators(), &vramledger::PluginHistory(),
                                      vramledger::PluginSnapshotOptions());
    if (!s.ok()) return s;
    return vramledger::ExportString(std::move(out).str(), json_out);
  });
}

bool vramledger_history_recording(void) {
  return vramledger::PluginHistory().settings().enabled != vramledger::HistoryEnabled::kNone;
}

void vramledger_history_entries(int device, std::vector<vramledger::RecordedEntry>* out) {
  try {
    *out = vramledger::PluginHistory().Entries(device);
  } catch (const std::exception& e) {  // host memory: nothing to hand over
    out->clear();
    std::fprintf(stderr, "vramledger: reading the history of device %d failed: %s\n", device,
                 e.what());
  }
}

int vramledger_dump_snapshot_json(const char* path) {
  return vramledger::Reported([&]() -> absl::Status {
    if (path == nullptr || *path == '\0') return absl::InvalidArgumentError("empty path");
    return vramledger::WriteSnapshotJsonFile(path, vramledger::Allocators(),
                                             &vramledger::PluginHistory(),
                                             vramledger::PluginSnapshotOptions());
  });
}

}  // extern "C"
