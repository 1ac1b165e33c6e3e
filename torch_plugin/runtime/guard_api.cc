// The runtime's budget guard: one BudgetGuard per device chained before the history, a
// process-wide tag registry, the step log, the Python stack provider, and the C ABI for the
// Python package. Process-wide state, never destroyed (tensors may be freed during shutdown).
#include "torch_plugin/runtime/guard_api.h"

#include <cxxabi.h>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "guard/budget_guard.h"
#include "guard/hooks_chain.h"
#include "guard/plan.h"
#include "guard/step_log.h"
#include "guard/tags.h"
#include "ledger/history.h"
#include "ledger/oom_dump.h"
#include "ledger/region_report.h"
#include "ledger/stack_capture.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/runtime/device_table.h"
#include "torch_plugin/runtime/history_api.h"
#include "torch_plugin/runtime/process_env.h"
#include "torch_plugin/runtime/trace_trackers.h"

namespace vramledger {
namespace {

constexpr int kMaxGuardDevices = History::kMaxDevices;

// One device's guard and the chain installed on its allocator.
struct DeviceGuard {
  std::unique_ptr<guard::BudgetGuard> guard;
  std::unique_ptr<guard::HooksChain> chain;
  DeviceAllocator* allocator = nullptr;
  Options options;
};

// Frames of a history context id, Python frames first (innermost first), then native ones.
class HistorySymbolizer final : public guard::StackSymbolizer {
 public:
  std::vector<guard::StackFrame> Symbolize(std::uint64_t context) override {
    std::vector<guard::StackFrame> python, native;
    for (const Frame& f : PluginHistory().Frames(context)) {
      (f.python ? python : native).push_back({f.filename, f.line, f.name, f.python});
    }
    python.insert(python.end(), native.begin(), native.end());
    return python;
  }
};

struct GuardState {
  guard::TagRegistry tags;
  std::array<std::atomic<DeviceGuard*>, kMaxGuardDevices> devices{};
  std::atomic<vramledger_python_stack_fn> python_fn{nullptr};
  HistorySymbolizer symbolizer;
  absl::Mutex step_mu;
  std::unique_ptr<guard::StepLog> step_log ABSL_GUARDED_BY(step_mu);
};

GuardState& G() {
  static GuardState* const state = new GuardState;  // never destroyed
  return *state;
}

DeviceGuard* Lookup(int device) {
  if (device < 0 || device >= kMaxGuardDevices) return nullptr;
  return G().devices[device].load(std::memory_order_acquire);
}

std::vector<const DeviceAllocator*> GuardedAllocators() {
  std::vector<const DeviceAllocator*> out;
  for (int d = 0; d < kMaxGuardDevices; ++d) {
    if (DeviceGuard* g = Lookup(d)) out.push_back(g->allocator);
  }
  return out;
}

constexpr int kMaxLivePythonFrames = 128;
constexpr std::size_t kMaxUserFrames = 24;

// Frames of torch, this package, the standard library and frozen modules; site-packages (which
// holds model code such as transformers) counts as user code. The same rule as _guard.py's.
bool IsLibraryFrame(absl::string_view file) {
  if (absl::StartsWith(file, "<frozen")) return true;
  if (absl::StrContains(file, "/site-packages/torch/") ||
      absl::StrContains(file, "/dist-packages/torch/") || absl::StrContains(file, "/vramledger/")) {
    return true;
  }
  if (absl::StrContains(file, "-packages/")) return false;
  return absl::StrContains(file, "/lib/python3");
}

// The calling thread's Python frames read through the C API (ledger/stack_capture.h), taking the
// GIL that torch's operators release before they allocate: user frames innermost first, then a
// note on the library frames left out. Empty when the thread runs no Python.
std::vector<guard::StackFrame> LivePythonFrames() {
  std::vector<guard::StackFrame> user, library;
  for (Frame& f : CaptureLivePythonFrames(kMaxLivePythonFrames)) {
    guard::StackFrame frame{std::move(f.filename), f.line, std::move(f.name), true};
    (IsLibraryFrame(frame.file) ? library : user).push_back(std::move(frame));
  }
  if (user.empty()) user.swap(library);
  std::size_t left_out = library.size();
  if (user.size() > kMaxUserFrames) {
    left_out += user.size() - kMaxUserFrames;
    user.resize(kMaxUserFrames);
  }
  if (left_out > 0) {
    guard::StackFrame note;
    note.python = true;
    note.function = absl::StrCat("(+", left_out, " torch, vramledger, standard-library or outer ",
                                 "frames left out)");
    user.push_back(std::move(note));
  }
  return user;
}

bool HasFileFrame(const std::vector<guard::StackFrame>& frames) {
  for (const guard::StackFrame& f : frames) {
    if (!f.file.empty()) return true;
  }
  return false;
}

std::vector<guard::StackFrame> ProviderFrames();

// The Python frames of a refusal: the Python package's provider (which also names the main
// thread's frames for autograd's threads); when it is not set or gives no frame, the frames read
// directly through the C API. Called outside the allocator lock.
std::vector<guard::StackFrame> PythonFrames() {
  std::vector<guard::StackFrame> frames = ProviderFrames();
  if (HasFileFrame(frames)) return frames;
  std::vector<guard::StackFrame> live = LivePythonFrames();
  return live.empty() ? frames : live;
}

// Calls the Python package's stack function and parses its lines (see guard_api.h).
std::vector<guard::StackFrame> ProviderFrames() {
  vramledger_python_stack_fn fn = G().python_fn.load(std::memory_order_acquire);
  if (fn == nullptr) return {};
  std::string buffer(64 * 1024, '\0');
  const std::size_t n = fn(buffer.data(), buffer.size());
  buffer.resize(std::min(n, buffer.size()));
  std::vector<guard::StackFrame> frames;
  for (absl::string_view line : absl::StrSplit(buffer, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits('\t', 3));
    guard::StackFrame f;
    f.python = true;
    if (parts.size() == 2 && parts[0] == "N") {
      f.function = std::string(parts[1]);  // a note: line 0, no file
    } else if (parts.size() == 4 && parts[0] == "F") {
      f.file = std::string(parts[1]);
      if (!absl::SimpleAtoi(parts[2], &f.line)) f.line = 0;
      f.function = std::string(parts[3]);
    } else {
      continue;
    }
    frames.push_back(std::move(f));
  }
  return frames;
}

}  // namespace

absl::Status AttachGuard(int device, int device_count, const Options& options,
                         DeviceBackend* backend, DeviceAllocator* allocator,
                         AllocatorHooks* ledger) {
  if (device < 0 || device >= kMaxGuardDevices) {
    allocator->SetHooks(ledger);  // beyond the table: history only, no guard
    return absl::OkStatus();
  }
  std::optional<guard::DeviceBudget> budget;
  if (!options.process.plan.empty()) {
    absl::StatusOr<guard::Plan> plan = guard::LoadPlanFile(options.process.plan, device_count);
    if (!plan.ok()) {
      return absl::Status(plan.status().code(),
                          absl::StrCat("vramledger plan error: ", plan.status().message()));
    }
    std::size_t free_bytes = 0, total_bytes = 0;
    if (absl::Status s = backend->MemGetInfo(&free_bytes, &total_bytes); !s.ok()) return s;
    absl::StatusOr<guard::DeviceBudget> resolved = guard::ResolvePlan(*plan, device, total_bytes);
    if (!resolved.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("vramledger plan error: ", resolved.status().message()));
    }
    budget = *std::move(resolved);
  }
  absl::StatusOr<std::unique_ptr<guard::BudgetGuard>> made =
      guard::BudgetGuard::Create(device, &G().tags, std::move(budget));
  if (!made.ok()) return made.status();
  auto entry = std::make_unique<DeviceGuard>();
  entry->guard = *std::move(made);
  entry->allocator = allocator;
  entry->options = options;
  entry->guard->SetSymbolizer(&G().symbolizer);
  entry->guard->SetPythonStackProvider(PythonFrames);
  const std::string dump_dir = options.process.dump_dir;
  const int max_dumps = options.process.max_dumps;
  entry->guard->SetForensicDump(
      [dump_dir, max_dumps](int dev, const std::string& message) -> absl::StatusOr<std::string> {
        OomDumpConfig config;
        config.dump_dir = dump_dir;
        config.max_dumps = max_dumps;
        config.device = dev;
        config.reason = "guard";
        config.message = message;
        absl::StatusOr<std::string> path =
            WriteOomDump(config, GuardedAllocators(), &PluginHistory());
        if (path.ok() && path->empty()) {
          return absl::FailedPreconditionError("max_dumps is 0");
        }
        return path;
      });
  // The trace trackers last: they see each entry after the history recorded it.
  entry->chain = std::make_unique<guard::HooksChain>(
      std::vector<AllocatorHooks*>{entry->guard.get(), ledger, &TraceTrackers::Get()});
  allocator->SetHooks(entry->chain.get());
  G().devices[device].store(entry.release(), std::memory_order_release);  // never destroyed
  return absl::OkStatus();
}

std::string GuardTagName(std::uint32_t id) { return G().tags.Name(id); }

namespace {

// `status` (a refusal or an out-of-memory error of `device`) with one line per pausable region
// of the device appended, so the report says which memory is paused and which runs.
absl::Status WithRegionLines(int device, const absl::Status& status) {
  if (!absl::IsResourceExhausted(status)) return status;
  try {
    const DeviceAllocator* allocator = DeviceTable::Get().Existing(device);
    if (allocator == nullptr) return status;
    const std::vector<std::string> lines = RegionLines(allocator->Regions());
    if (lines.empty()) return status;
    std::string text(status.message());
    absl::StrAppend(&text, "\nvramledger regions on device ", device, ":");
    for (const std::string& line : lines) absl::StrAppend(&text, "\n  ", line);
    return absl::ResourceExhaustedError(text);
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    return status;  // a failed report must not hide the refusal
  }
}

}  // namespace

absl::Status GuardRefusalOrOomDump(int device, const absl::Status& status) {
  try {
    if (DeviceGuard* g = Lookup(device)) {
      absl::Status completed = g->guard->CompleteRefusal(status, *g->allocator);
      if (completed.message() != status.message()) return WithRegionLines(device, completed);
    }
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    return status;  // a failed report must not hide the refusal
  }
  return WithRegionLines(device, WithOomDump(device, status));
}

}  // namespace vramledger

using vramledger::G;

extern "C" {

int vramledger_tag_id(const char* name, unsigned* id_out) {
  return vramledger::CatchAll([&]() -> absl::Status {
    if (name == nullptr || id_out == nullptr) {
      return absl::InvalidArgumentError("vramledger: tag name or id_out is null");
    }
    absl::StatusOr<std::uint32_t> id = G().tags.Intern(name);
    if (!id.ok()) {
      return absl::Status(id.status().code(), absl::StrCat("vramledger: ", id.status().message()));
    }
    *id_out = *id;
    return absl::OkStatus();
  });
}

unsigned vramledger_set_thread_tag(unsigned id) { return vramledger::guard::SetThreadTag(id); }

unsigned vramledger_set_phase(unsigned id) { return G().tags.SetPhase(id); }

int vramledger_tag_stats_json(int device, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::CatchAll([&]() -> absl::Status {
    if (json_out == nullptr) return absl::InvalidArgumentError("vramledger: json_out is null");
    nlohmann::json out = nlohmann::json::object();
    if (vramledger::DeviceGuard* g = vramledger::Lookup(device)) {
      for (const vramledger::guard::TagUsage& u : g->guard->TagUsages()) {
        out[absl::StrCat("tags.", u.name, ".current")] = u.current;
        out[absl::StrCat("tags.", u.name, ".peak")] = u.peak;
      }
      out["guard.refusals"] = g->guard->refusals();
      out["guard.warnings"] = g->guard->warnings();
      const auto& budget = g->guard->budget();
      out["guard.limit_bytes"] = budget && budget->enforces_limit ? budget->cap() : 0;
    }
    return vramledger::ExportString(out.dump(), json_out);
  });
}

int vramledger_reset_tag_peaks(int device) {
  return vramledger::CatchAll([&]() -> absl::Status {
    for (int d = 0; d < vramledger::kMaxGuardDevices; ++d) {
      if (device != -1 && d != device) continue;
      if (vramledger::DeviceGuard* g = vramledger::Lookup(d)) g->guard->ResetTagPeaks();
    }
    return absl::OkStatus();
  });
}

int vramledger_step(char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::CatchAll([&]() -> absl::Status {
    vramledger::GuardState& state = G();
    absl::MutexLock lock(&state.step_mu);
    const int rank = vramledger::ReadProcessEnv().rank;
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    nlohmann::json records = nlohmann::json::array();
    absl::Status first_error;
    for (int d = 0; d < vramledger::kMaxGuardDevices; ++d) {
      vramledger::DeviceGuard* g = vramledger::Lookup(d);
      if (g == nullptr) continue;
      const vramledger::guard::StepRecord record = g->guard->EndStep(g->allocator->GetStats());
      const std::string line = vramledger::guard::StepRecordJson(record, rank, now);
      records.push_back(nlohmann::json::parse(line));
      if (g->options.process.step_log.empty()) continue;
      if (state.step_log == nullptr) {
        auto log = vramledger::guard::StepLog::Open(g->options.process.step_log, rank);
        if (!log.ok()) {
          if (first_error.ok()) first_error = log.status();
          continue;
        }
        state.step_log = *std::move(log);
      }
      if (absl::Status s = state.step_log->Append(line); !s.ok() && first_error.ok()) {
        first_error = s;
      }
    }
    if (!first_error.ok()) return first_error;
    if (json_out == nullptr) return absl::OkStatus();
    return vramledger::ExportString(records.dump(), json_out);
  });
}

int vramledger_set_python_stack_fn(vramledger_python_stack_fn fn) {
  G().python_fn.store(fn, std::memory_order_release);
  return VRAMLEDGER_OK;
}

}  // extern "C"
