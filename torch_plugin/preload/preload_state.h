// The LD_PRELOAD shim's state, shared by its interposed functions (preload.cc), its route into
// torch (direct_route.cc) and its reports (preload_report.cc): the real runtime's functions, the
// recursion flag, the counters of the calls seen, the live blocks the shim handed out and, on the
// direct route, the plugin's runtime. Process-wide, never destroyed.
#ifndef VRAMLEDGER_TORCH_PLUGIN_PRELOAD_PRELOAD_STATE_H_
#define VRAMLEDGER_TORCH_PLUGIN_PRELOAD_PRELOAD_STATE_H_

#include <cuda_runtime_api.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "ledger/history.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/runtime/device_table.h"
#include "torch_plugin/runtime/plan_access.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"

namespace vramledger::preload {

constexpr int kMaxDevices = History::kMaxDevices;

// ---- The real runtime ----

using MallocFn = cudaError_t (*)(void**, size_t);
using FreeFn = cudaError_t (*)(void*);
using MallocAsyncFn = cudaError_t (*)(void**, size_t, cudaStream_t);
using FreeAsyncFn = cudaError_t (*)(void*, cudaStream_t);
using MemGetInfoFn = cudaError_t (*)(size_t*, size_t*);

// The next definition of `name` after this library (the program's libcudart), or nullptr.
template <typename F>
inline F Real(const char* name) {
  static_assert(sizeof(F) == sizeof(void*));
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

struct RealRuntime {
  MallocFn malloc = Real<MallocFn>("cudaMalloc");
  FreeFn free = Real<FreeFn>("cudaFree");
  MallocAsyncFn malloc_async = Real<MallocAsyncFn>("cudaMallocAsync");
  FreeAsyncFn free_async = Real<FreeAsyncFn>("cudaFreeAsync");
  MemGetInfoFn mem_get_info = Real<MemGetInfoFn>("cudaMemGetInfo");
};

// Resolved at the first interposed call, when the program's runtime is loaded (never at
// constructor time: torch loads libcudart after this library's constructor ran).
inline const RealRuntime& Runtime() {
  static const RealRuntime* const runtime = new RealRuntime;
  return *runtime;
}

// ---- The recursion guard ----

// True while the calling thread is inside vramledger (defined in preload.cc).
extern constinit __attribute__((tls_model("initial-exec"))) thread_local bool t_inside;

// Runs the body of an exported function (an interposed CUDA call, dlopen, a ctypes entry):
// an exception (host memory exhausted, one thrown by a library below) becomes `on_error` with a
// line on stderr naming `call`, instead of unwinding into a caller that expects a return code
// (through C frames, or frames built without unwind tables, it would end the process). A
// thread's forced unwinding (pthread_exit, pthread_cancel) runs on (c_errors.h says why).
template <typename R, typename Fn>
R NoThrow(const char* call, R on_error, Fn fn) {
  try {
    return fn();
  } catch (const abi::__forced_unwind&) {
    throw;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: %s failed: %s\n", call, e.what());
  } catch (...) {
    std::fprintf(stderr, "vramledger: %s failed: unknown C++ exception\n", call);
  }
  return on_error;
}

// Marks the calling thread as inside vramledger for its lifetime (nests).
class InsideScope {
 public:
  InsideScope() : previous_(t_inside) { t_inside = true; }
  ~InsideScope() { t_inside = previous_; }
  InsideScope(const InsideScope&) = delete;
  InsideScope& operator=(const InsideScope&) = delete;

 private:
  const bool previous_;
};

// ---- Counters ----

struct Counters {
  std::atomic<std::int64_t> malloc_calls{0};        // cudaMalloc calls from the program
  std::atomic<std::int64_t> malloc_async_calls{0};  // cudaMallocAsync calls from the program
  std::atomic<std::int64_t> free_calls{0};          // cudaFree calls from the program
  std::atomic<std::int64_t> free_async_calls{0};    // cudaFreeAsync calls from the program
  std::atomic<std::int64_t> served_allocs{0};       // allocations vramledger served
  std::atomic<std::int64_t> served_frees{0};        // frees of vramledger's blocks
  std::atomic<std::int64_t> forwarded_frees{0};     // frees of memory vramledger did not allocate
  std::atomic<std::int64_t> zero_size_allocs{0};    // size-0 requests (null, no memory)
  std::atomic<std::int64_t> refusals{0};            // cudaErrorMemoryAllocation returned
  std::atomic<std::int64_t> errors{0};              // other failures returned
  std::atomic<std::int64_t> inner_calls{0};         // vramledger's own calls sent to the runtime
  std::atomic<std::int64_t> memgetinfo_calls{0};
  // Host time of the program's cudaMalloc/cudaMallocAsync/cudaFree/cudaFreeAsync calls while the
  // shim is active, entry to return (ns; frees forwarded to the runtime included): the shim's
  // whole cost on the host (step-time-measurement.md, "Time inside the allocator").
  std::atomic<std::int64_t> interposed_ns{0};
};

// Adds the time from construction to destruction to `*sink` (ns); does nothing, reading no clock,
// when `sink` is null (host_timing off).
class CallTimer {
 public:
  explicit CallTimer(std::atomic<std::int64_t>* sink) : sink_(sink) {
    if (sink_ != nullptr) start_ = std::chrono::steady_clock::now();
  }
  ~CallTimer() {
    if (sink_ == nullptr) return;
    sink_->fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - start_)
                         .count(),
                     std::memory_order_relaxed);
  }
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;

 private:
  std::atomic<std::int64_t>* const sink_;
  std::chrono::steady_clock::time_point start_;
};

// ---- Process state ----

// Registers the exit dump with atexit once more, from the first allocator's creation: the CUDA
// runtime is initialised by then, so this handler runs before any the runtime registered
// (atexit runs them in reverse) and cudaMemGetInfo still answers at exit.
void RegisterExitDumpAfterRuntime();

struct LiveBlock {
  int device = 0;
  StreamId stream = 0;
};

// ---- The direct route (direct_route.cc) ----

// The region calls of one runtime (runtime/region_api.h): the shim's own, or the plugin's.
struct RegionCalls {
  int (*begin)(int device, const char* name) = nullptr;
  int (*end)(int device, const char* name) = nullptr;
  int (*pause)(int device, const char* name, int backup, char** json_out) = nullptr;
  int (*resume)(int device, const char* name, int keep_host_buffers, char** json_out) = nullptr;
  int (*list)(int device, char** json_out) = nullptr;
};

// The plugin's runtime, which serves torch once libvramledger_native.so is torch's allocator:
// the entry points the reports read it through (torch_plugin/runtime/c_api.h, history_api.h),
// resolved from the native library's dependencies. Set once, never freed.
struct PluginRuntime {
  int (*device_count)() = nullptr;
  bool (*device_stats)(int device, DeviceStats* out) = nullptr;
  int (*fragmentation_json)(int device, cudaStream_t stream, char** json_out) = nullptr;
  int (*snapshot_json)(char** json_out) = nullptr;
  void (*string_free)(char* s) = nullptr;
  // Pausable regions (runtime/region_api.h) and the plugin's last error, which the shim's
  // vramledger_preload_region_* calls forward to (preload_regions.cc).
  RegionCalls regions;
  const char* (*last_error)() = nullptr;
  const void* base = nullptr;  // the plugin's load address (its own calls see the real runtime)
  std::string torch_minor;     // the torch minor the native library was built for
};

/// At the constructor, after Instance() is set: a backend named in torch's allocator settings
/// keeps the interposition; torch already loaded (a C++ program linked to libtorch) is decided
/// now; otherwise the interposed dlopen decides when torch's libraries load.
void InitTorchRoute();

/// The shim's state (nullptr before the constructor, and when the shim is disabled).
class Preload;
Preload* Instance();

/// Called once vramledger is torch's allocator: the interposed functions forward from then on,
/// and SIGUSR1 dumps run on a thread of their own (no interposed call would carry them).
void EnterDirectRoute();

/// Writes the refusal report of the direct route (the plugin's callback; never throws).
void OnDirectRefusal(int device, const char* report);

// What the reports read of one device's allocator, from whichever runtime serves the program.
struct DeviceFigures {
  DeviceStats stats;
  double utilization = 0;
  std::int64_t largest_free_block = 0;
  std::int64_t holes = 0;
  HostTime host_time;
};

class Preload {
 public:
  explicit Preload(Options options) : options_(std::move(options)) {
    for (std::atomic<std::int64_t>& used : baseline_used_) used.store(-1);
  }

  const Options& options() const { return options_; }
  Counters& counters() { return counters_; }
  // Where the interposed calls' host time goes: null unless host_timing is on.
  std::atomic<std::int64_t>* InterposedTimer() {
    return options_.host_timing ? &counters_.interposed_ns : nullptr;
  }

  // The allocator of `device`, created on first use (the runtime's table). Pre: inside an
  // InsideScope.
  absl::StatusOr<DeviceAllocator*> GetOrCreate(int device) {
    return DeviceTable::Get().GetOrCreate(device);
  }

  DeviceAllocator* Existing(int device) const { return DeviceTable::Get().Existing(device); }

  // Runs inside the creation of `device`'s allocator, before it exists: records the device's
  // bytes in use then (cudaMemGetInfo through the real runtime) for the exit summary.
  void BeforeCreate(int device) {
    created_any_.store(true, std::memory_order_release);
    std::size_t free_bytes = 0, total_bytes = 0;
    if (device >= 0 && device < kMaxDevices && Runtime().mem_get_info != nullptr &&
        Runtime().mem_get_info(&free_bytes, &total_bytes) == cudaSuccess) {
      baseline_used_[device].store(static_cast<std::int64_t>(total_bytes - free_bytes));
    }
    RegisterExitDumpAfterRuntime();
  }

  /// Device bytes in use before vramledger's allocator of `device` existed; -1 when unknown.
  std::int64_t BaselineUsed(int device) const {
    if (device < 0 || device >= kMaxDevices) return -1;
    return baseline_used_[device].load();
  }

  // Every device's allocator up to the highest that exists (nullptr for the others).
  std::vector<const DeviceAllocator*> Allocators() const {
    std::vector<const DeviceAllocator*> out;
    for (int d = 0; d < DeviceTable::Get().device_count(); ++d) {
      if (const DeviceAllocator* a = Existing(d)) {
        out.resize(d + 1, nullptr);
        out[d] = a;
      }
    }
    return out;
  }

  void Remember(void* ptr, LiveBlock block) {
    absl::MutexLock lock(&mu_);
    live_[ptr] = block;
    live_count_.store(live_.size(), std::memory_order_relaxed);
  }

  // Removes `ptr` from the live table; false when vramledger did not allocate it.
  bool Forget(void* ptr, LiveBlock* block) {
    absl::MutexLock lock(&mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return false;
    *block = it->second;
    live_.erase(it);
    live_count_.store(live_.size(), std::memory_order_relaxed);
    return true;
  }

  // True while blocks the interposition served are live (on the direct route, those made before
  // torch loaded are still freed here).
  bool HasLiveBlocks() const { return live_count_.load(std::memory_order_relaxed) > 0; }

  // The plugin's runtime once the direct route serves torch; nullptr on the interposition.
  const PluginRuntime* plugin() const { return plugin_.load(std::memory_order_acquire); }
  void set_plugin(const PluginRuntime* plugin) { plugin_.store(plugin, std::memory_order_release); }

  // One line for the summary: the route and why (set before the route is published).
  std::string route_note() const {
    absl::MutexLock lock(&mu_);
    return route_note_;
  }
  void set_route_note(std::string note) {
    absl::MutexLock lock(&mu_);
    route_note_ = std::move(note);
  }

  // True once the serving runtime created an allocator (the first allocation on some device).
  bool AnyAllocatorCreated() const { return created_any_.load(std::memory_order_acquire); }

  // Devices the serving runtime has (the reports loop over them); 0 before its first allocator,
  // so that a report never starts CUDA in a program that did not.
  int DeviceCount() const {
    const PluginRuntime* plugin = this->plugin();
    if (plugin == nullptr) return DeviceTable::Get().device_count();
    if (!AnyAllocatorCreated()) return 0;
    const int n = plugin->device_count();
    return n > 0 ? n : 0;
  }

  // The figures of `device`'s allocator in the serving runtime; false when it has none.
  // Pre: inside an InsideScope.
  bool Figures(int device, DeviceFigures* out) const;

  // The plan's limit on `device` in bytes (-1: no plan or no limit), resolved once against
  // the card's total. Pre: inside an InsideScope.
  std::int64_t PlanLimit(int device, std::size_t card_total) {
    if (options_.process.plan.empty()) return -1;
    return PlanLimitBytes(options_.process.plan, device, card_total).value_or(-1);
  }

 private:
  const Options options_;
  Counters counters_;
  // Device bytes in use (cudaMemGetInfo's total - free) just before vramledger's allocator for
  // each device was created; -1: unknown. The exit summary compares it with the bytes in use
  // then, less what vramledger reserved, for the memory the shim never saw (cuMemAlloc, ...).
  std::array<std::atomic<std::int64_t>, kMaxDevices> baseline_used_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<void*, LiveBlock> live_ ABSL_GUARDED_BY(mu_);
  std::atomic<std::size_t> live_count_{0};
  std::atomic<bool> created_any_{false};  // BeforeCreate ran once
  std::atomic<const PluginRuntime*> plugin_{nullptr};
  std::string route_note_ ABSL_GUARDED_BY(mu_) = "cudaMalloc/cudaMallocAsync interposition";
};

// ---- Reports (preload_report.cc) ----

/// The shim's call counters as JSON (the stats entry point and the dumps both show them).
nlohmann::json CountersJson(const Counters& c);

/// Writes <dump_dir>/vramledger-preload-pid<P>-<tag>.json (snapshot) and .txt (summary), and
/// prints the summary unless VRAMLEDGER_PRELOAD_QUIET is set. Pre: no allocator lock held by
/// this thread. Never throws.
void WriteDump(Preload& p, const std::string& tag);

// The shim's counters as a JSON object in a malloc'd string; nullptr when inactive
// (vramledger_preload_stats_json, preload_report.cc).
char* StatsJson();

/// <dump_dir>/vramledger-preload-pid<P>-refusal-<n>.txt.
std::string RefusalReportPath(const Preload& p, std::int64_t n);

/// Writes the refusal report to <dump_dir>/vramledger-preload-pid<P>-refusal-<n>.txt (the first
/// max_dumps of them; the guard's forensic snapshot is named in the text). Never throws.
void WriteRefusalReport(Preload& p, std::int64_t n, absl::string_view report);

}  // namespace vramledger::preload

#endif  // VRAMLEDGER_TORCH_PLUGIN_PRELOAD_PRELOAD_STATE_H_
