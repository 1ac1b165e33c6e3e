// libvramledger_preload.so (issue 7): interposes cudaMalloc/cudaFree/cudaMallocAsync/cudaFreeAsync
// and cudaMemGetInfo, serving device memory from one vramledger DeviceAllocator per device.
//
// Recursion: CudaBackend (compiled into this library) calls cudaMalloc/cudaFree/cudaMemGetInfo
// itself, and those names bind to this library's definitions (it comes first in the global
// scope). Every entry into vramledger therefore runs under InsideScope, a thread-local flag; an
// interposed function called while the flag is set forwards straight to the real runtime
// function (dlsym(RTLD_NEXT)). The flag is initial-exec TLS: reading it never allocates.
//
// Everything here is process-wide and never destroyed: frees can arrive during exit.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "device/cuda_backend.h"
#include "ledger/atomic_file.h"
#include "ledger/snapshot.h"
#include "ledger/stack_capture.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/guard_api.h"
#include "torch_plugin/plugin_history.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"
#include "vramledger/stats.h"

#define VRAMLEDGER_PRELOAD_EXPORT extern "C" __attribute__((visibility("default")))

namespace vramledger {

// guard_api.cc and plugin_history.cc report ctypes errors here (plugin.cc defines it there).
std::string& PluginLastError() {
  thread_local std::string error;
  return error;
}

namespace {

constexpr int kMaxDevices = History::kMaxDevices;

// ---- The real runtime ----

using MallocFn = cudaError_t (*)(void**, size_t);
using FreeFn = cudaError_t (*)(void*);
using MallocAsyncFn = cudaError_t (*)(void**, size_t, cudaStream_t);
using FreeAsyncFn = cudaError_t (*)(void*, cudaStream_t);
using MemGetInfoFn = cudaError_t (*)(size_t*, size_t*);

// The next definition of `name` after this library (the program's libcudart), or nullptr.
template <typename F>
F Real(const char* name) {
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
const RealRuntime& Runtime() {
  static const RealRuntime* const runtime = new RealRuntime;
  return *runtime;
}

// ---- The recursion guard ----

__attribute__((tls_model("initial-exec"))) thread_local bool t_inside = false;

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

struct Slot {
  std::once_flag once;
  absl::Status status;
  std::unique_ptr<CudaBackend> backend;
  std::unique_ptr<DeviceAllocator> allocator;
  std::atomic<DeviceAllocator*> ready{nullptr};
  std::atomic<std::int64_t> plan_limit{-2};  // -2: not resolved, -1: no limit
  // Device bytes in use (cudaMemGetInfo's total - free) just before vramledger's allocator for
  // this device was created; -1: unknown. The exit summary compares it with the bytes in use
  // then, less what vramledger reserved, for the memory the shim never saw (cuMemAlloc, ...).
  std::atomic<std::int64_t> baseline_used{-1};
};

// Registers the exit dump with atexit once more, from the first allocator's creation: the CUDA
// runtime is initialised by then, so this handler runs before any the runtime registered
// (atexit runs them in reverse) and cudaMemGetInfo still answers at exit.
void RegisterExitDumpAfterRuntime();

struct LiveBlock {
  int device = 0;
  StreamId stream = 0;
};

class Preload {
 public:
  explicit Preload(Options options) : options_(std::move(options)) {}

  const Options& options() const { return options_; }
  Counters& counters() { return counters_; }
  // Where the interposed calls' host time goes: null unless host_timing is on.
  std::atomic<std::int64_t>* InterposedTimer() {
    return options_.host_timing ? &counters_.interposed_ns : nullptr;
  }

  // The allocator of `device`, created on first use. Pre: inside an InsideScope.
  absl::StatusOr<DeviceAllocator*> GetOrCreate(int device) {
    if (device < 0 || device >= kMaxDevices) {
      return absl::InvalidArgumentError(absl::StrCat("vramledger: device ", device,
                                                     " is beyond the ", kMaxDevices, " supported"));
    }
    Slot& slot = slots_[device];
    if (DeviceAllocator* a = slot.ready.load(std::memory_order_acquire)) return a;
    std::call_once(slot.once, [&] {
      std::size_t free_bytes = 0, total_bytes = 0;
      if (Runtime().mem_get_info != nullptr &&
          Runtime().mem_get_info(&free_bytes, &total_bytes) == cudaSuccess) {
        slot.baseline_used.store(static_cast<std::int64_t>(total_bytes - free_bytes));
      }
      RegisterExitDumpAfterRuntime();
      slot.backend = std::make_unique<CudaBackend>(device);
      slot.allocator = std::make_unique<DeviceAllocator>(options_, slot.backend.get());
      slot.status =
          AttachGuard(device, options_, slot.backend.get(), slot.allocator.get(), LedgerHooks());
      if (!slot.status.ok()) return;
      AttachLedger(device, slot.allocator.get());
      slot.ready.store(slot.allocator.get(), std::memory_order_release);
    });
    if (!slot.status.ok()) return slot.status;
    return slot.ready.load(std::memory_order_acquire);
  }

  DeviceAllocator* Existing(int device) const {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    return slots_[device].ready.load(std::memory_order_acquire);
  }

  /// Device bytes in use before vramledger's allocator of `device` existed; -1 when unknown.
  std::int64_t BaselineUsed(int device) const {
    if (device < 0 || device >= kMaxDevices) return -1;
    return slots_[device].baseline_used.load();
  }

  // Every device's allocator up to the highest that exists (nullptr for the others).
  std::vector<const DeviceAllocator*> Allocators() const {
    std::vector<const DeviceAllocator*> out;
    for (int d = 0; d < kMaxDevices; ++d) {
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
  }

  // Removes `ptr` from the live table; false when vramledger did not allocate it.
  bool Forget(void* ptr, LiveBlock* block) {
    absl::MutexLock lock(&mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return false;
    *block = it->second;
    live_.erase(it);
    return true;
  }

  // The plan's limit on `device` in bytes (-1: no plan or no limit), resolved once against
  // the card's total. Pre: inside an InsideScope.
  std::int64_t PlanLimit(int device, std::size_t card_total) {
    if (options_.process.plan.empty() || device < 0 || device >= kMaxDevices) return -1;
    Slot& slot = slots_[device];
    std::int64_t limit = slot.plan_limit.load(std::memory_order_relaxed);
    if (limit != -2) return limit;
    limit = -1;
    char* json = nullptr;
    if (vramledger_plan_check(options_.process.plan.c_str(), device + 1, card_total, &json) == 0 &&
        json != nullptr) {
      const nlohmann::json doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
      if (doc.is_object() && doc.contains("devices") &&
          doc["devices"].size() > static_cast<std::size_t>(device)) {
        const nlohmann::json& d = doc["devices"][device];
        if (d.contains("limit") && d["limit"].is_number()) limit = d["limit"].get<std::int64_t>();
      }
    }
    vramledger_string_free(json);
    slot.plan_limit.store(limit, std::memory_order_relaxed);
    return limit;
  }

 private:
  const Options options_;
  Counters counters_;
  Slot slots_[kMaxDevices];
  absl::Mutex mu_;
  absl::flat_hash_map<void*, LiveBlock> live_ ABSL_GUARDED_BY(mu_);
};

// Set by the constructor; nullptr until then (and forever when the shim is disabled).
std::atomic<Preload*> g_preload{nullptr};
std::atomic<bool> g_dump_requested{false};  // SIGUSR1 arrived
std::atomic<int> g_dump_sequence{0};
struct sigaction g_previous_usr1;

// ---- Dumps ----

std::string FormatCount(std::int64_t n) { return absl::StrCat(n); }

// What the shim did not see on one device: the growth of the device's used bytes since the
// allocator was created (cudaMemGetInfo through the real runtime), less vramledger's reserved.
struct OutsideBytes {
  bool known = false;
  std::int64_t outside = 0;     // used_delta - reserved (bytes; may be negative)
  std::int64_t used_delta = 0;  // used now - used at the allocator's creation (bytes)
  std::int64_t reserved = 0;    // vramledger's reserved bytes now
  std::string why;              // when not known
};

// Pre: inside an InsideScope (cudaGetDevice/cudaSetDevice go to the runtime).
OutsideBytes MeasureOutsideBytes(Preload& p, int device) {
  OutsideBytes o;
  const DeviceAllocator* a = p.Existing(device);
  const std::int64_t baseline = p.BaselineUsed(device);
  if (a == nullptr || baseline < 0 || Runtime().mem_get_info == nullptr) {
    o.why = "no cudaMemGetInfo baseline";
    return o;
  }
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device && cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    o.why = "cudaSetDevice failed";
    return o;
  }
  std::size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t err = Runtime().mem_get_info(&free_bytes, &total_bytes);
  if (previous >= 0 && previous != device) cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();
    o.why = absl::StrCat("cudaMemGetInfo error ", static_cast<int>(err));
    return o;
  }
  o.known = true;
  o.used_delta = static_cast<std::int64_t>(total_bytes - free_bytes) - baseline;
  o.reserved = a->GetStats().reserved_bytes[kAggregate].current;
  o.outside = o.used_delta - o.reserved;
  return o;
}

// The one-screen summary: calls seen, then peaks and utilization per device.
std::string Summary(Preload& p, const char* reason) {
  const Counters& c = p.counters();
  std::ostringstream out;
  out << "vramledger preload summary (" << reason << ", pid " << getpid() << ")\n"
      << "options: " << OptionsToString(p.options()) << "\n"
      << "calls seen: cudaMalloc " << c.malloc_calls.load() << ", cudaMallocAsync "
      << c.malloc_async_calls.load() << ", cudaFree " << c.free_calls.load() << ", cudaFreeAsync "
      << c.free_async_calls.load() << "\n"
      << "served: allocations " << c.served_allocs.load() << ", frees " << c.served_frees.load()
      << ", size-0 " << c.zero_size_allocs.load() << "; forwarded frees (not ours) "
      << c.forwarded_frees.load() << "; refusals " << c.refusals.load() << ", errors "
      << c.errors.load() << "\n"
      << "host time in those calls: "
      << (p.options().host_timing ? absl::StrCat(c.interposed_ns.load() / 1000, " us")
                                  : std::string("not measured (host_timing:True measures it)"))
      << "\n";
  for (int d = 0; d < kMaxDevices; ++d) {
    const DeviceAllocator* a = p.Existing(d);
    if (a == nullptr) continue;
    const DeviceStats s = a->GetStats();
    const Fragmentation f = a->GetFragmentation();
    const Stat& alloc = s.allocated_bytes[kAggregate];
    const Stat& reserved = s.reserved_bytes[kAggregate];
    out << "device " << d << ": peak allocated " << FormatSize(alloc.peak) << ", peak reserved "
        << FormatSize(reserved.peak) << ", utilization " << f.utilization << "\n"
        << "  now: allocated " << FormatSize(alloc.current) << ", reserved "
        << FormatSize(reserved.current) << ", largest free block "
        << FormatSize(f.largest_free_block) << ", holes " << f.holes << "\n"
        << "  allocations " << FormatCount(s.allocation[kAggregate].allocated) << ", frees "
        << FormatCount(s.allocation[kAggregate].freed) << ", segments "
        << FormatCount(s.segment[kAggregate].allocated) << ", cudaMalloc retries "
        << s.num_alloc_retries << ", OOMs " << s.num_ooms << "\n";
    if (p.options().host_timing) {
      const HostTime t = a->host_time();
      out << "  host time inside the allocator: malloc " << t.malloc_ns / 1000 << " us over "
          << FormatCount(t.malloc_calls) << " calls, free " << t.free_ns / 1000 << " us over "
          << FormatCount(t.free_calls) << " calls\n";
    }
    const OutsideBytes o = MeasureOutsideBytes(p, d);
    if (o.known) {
      out << "  device bytes used outside vramledger: " << o.outside << " ("
          << FormatSize(o.outside) << "; cudaMemGetInfo used delta " << o.used_delta
          << " - vramledger reserved " << o.reserved << ")\n";
    } else {
      out << "  device bytes used outside vramledger: unknown (" << o.why << ")\n";
    }
  }
  return out.str();
}

// Writes <dump_dir>/vramledger-preload-pid<P>-<tag>.json (snapshot) and .txt (summary).
// Pre: no allocator lock held by this thread. Never throws.
void WriteDump(Preload& p, const std::string& tag) {
  InsideScope inside;
  try {
    const std::string base =
        absl::StrCat(p.options().process.dump_dir, "/vramledger-preload-pid", getpid(), "-", tag);
    ::mkdir(p.options().process.dump_dir.c_str(), 0755);  // WriteSnapshotJsonFile needs it to exist
    SnapshotOptions snapshot = PluginSnapshotOptions();
    const Counters& c = p.counters();
    snapshot.extra["preload"] = {
        {"reason", tag},
        {"cudaMalloc_calls", c.malloc_calls.load()},
        {"cudaMallocAsync_calls", c.malloc_async_calls.load()},
        {"cudaFree_calls", c.free_calls.load()},
        {"cudaFreeAsync_calls", c.free_async_calls.load()},
        {"served_allocations", c.served_allocs.load()},
        {"served_frees", c.served_frees.load()},
        {"forwarded_frees", c.forwarded_frees.load()},
        {"refusals", c.refusals.load()},
    };
    nlohmann::json outside = nlohmann::json::object();
    for (int d = 0; d < kMaxDevices; ++d) {
      if (p.Existing(d) == nullptr) continue;
      const OutsideBytes o = MeasureOutsideBytes(p, d);
      if (o.known) {
        outside[absl::StrCat(d)] = {{"outside_bytes", o.outside},
                                    {"used_delta_bytes", o.used_delta},
                                    {"reserved_bytes", o.reserved}};
      }
    }
    snapshot.extra["preload"]["device_bytes_outside_vramledger"] = outside;
    const absl::Status s =
        WriteSnapshotJsonFile(base + ".json", p.Allocators(), &PluginHistory(), snapshot);
    if (!s.ok()) {
      std::fprintf(stderr, "vramledger: preload snapshot not written: %s\n",
                   std::string(s.message()).c_str());
    }
    const std::string summary = Summary(p, tag.c_str());
    const absl::Status t = WriteFileAtomically(base + ".txt", [&](std::ostream& out) {
      out << summary;
      return out.good() ? absl::OkStatus() : absl::DataLossError("summary write failed");
    });
    if (!t.ok()) {
      std::fprintf(stderr, "vramledger: preload summary not written: %s\n",
                   std::string(t.message()).c_str());
    }
    if (!p.options().process.preload_quiet) {
      std::fprintf(stderr, "%swritten: %s.json, %s.txt\n", summary.c_str(), base.c_str(),
                   base.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: preload dump failed: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "vramledger: preload dump failed\n");
  }
}

// Writes the refusal report to <dump_dir>/vramledger-preload-pid<P>-refusal-<n>.txt (the first
// max_dumps of them; the guard's forensic snapshot is named in the text). Never throws.
void WriteRefusalReport(Preload& p, std::int64_t n, absl::string_view report) {
  if (n > std::max(p.options().process.max_dumps, 0)) return;
  try {
    ::mkdir(p.options().process.dump_dir.c_str(), 0755);
    const std::string path = absl::StrCat(p.options().process.dump_dir, "/vramledger-preload-pid",
                                          getpid(), "-refusal-", n, ".txt");
    const absl::Status s = WriteFileAtomically(path, [&](std::ostream& out) {
      out << report << "\n";
      return out.good() ? absl::OkStatus() : absl::DataLossError("report write failed");
    });
    if (!s.ok()) {
      std::fprintf(stderr, "vramledger: refusal report not written: %s\n",
                   std::string(s.message()).c_str());
    }
  } catch (...) {
    std::fprintf(stderr, "vramledger: refusal report not written\n");
  }
}

// SIGUSR1: only sets the flag; the dump runs on the next interposed call (async-signal-safe).
void OnUsr1(int signo, siginfo_t* info, void* context) {
  g_dump_requested.store(true, std::memory_order_relaxed);
  if (g_previous_usr1.sa_flags & SA_SIGINFO) {
    if (g_previous_usr1.sa_sigaction != nullptr) g_previous_usr1.sa_sigaction(signo, info, context);
  } else if (g_previous_usr1.sa_handler != SIG_DFL && g_previous_usr1.sa_handler != SIG_IGN &&
             g_previous_usr1.sa_handler != nullptr) {
    g_previous_usr1.sa_handler(signo);
  }
}

// The shim's state for a call from the program (nullptr: forward), doing a requested dump first.
Preload* Active() {
  if (t_inside) return nullptr;
  Preload* p = g_preload.load(std::memory_order_acquire);
  if (p != nullptr && g_dump_requested.load(std::memory_order_relaxed) &&
      g_dump_requested.exchange(false)) {
    WriteDump(*p, absl::StrCat("sigusr1-", g_dump_sequence.fetch_add(1) + 1));
  }
  return p;
}

int CurrentDevice() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    device = 0;
  }
  return device;
}

// Serves one allocation of the program. Pre: p is active (not inside).
cudaError_t Allocate(Preload& p, void** out, size_t size, cudaStream_t stream) {
  if (out == nullptr) return cudaErrorInvalidValue;
  if (size == 0) {
    *out = nullptr;
    p.counters().zero_size_allocs.fetch_add(1, std::memory_order_relaxed);
    return cudaSuccess;
  }
  InsideScope inside;
  const int device = CurrentDevice();
  absl::StatusOr<DevicePtr> ptr;
  absl::StatusOr<DeviceAllocator*> allocator = p.GetOrCreate(device);
  if (allocator.ok()) {
    ptr = (*allocator)->Malloc(size, reinterpret_cast<StreamId>(stream));
  } else {
    ptr = allocator.status();
  }
  if (!ptr.ok()) {
    if (absl::IsResourceExhausted(ptr.status())) {
      // The guard's report (or torch's OOM message) with the forensic snapshot's path.
      const absl::Status report = GuardRefusalOrOomDump(device, ptr.status());
      std::fprintf(stderr, "%s\n", std::string(report.message()).c_str());
      const std::int64_t n = p.counters().refusals.fetch_add(1, std::memory_order_relaxed) + 1;
      WriteRefusalReport(p, n, report.message());
      return cudaErrorMemoryAllocation;
    }
    std::fprintf(stderr, "vramledger: allocation of %zu bytes on device %d failed: %s\n", size,
                 device, std::string(ptr.status().message()).c_str());
    p.counters().errors.fetch_add(1, std::memory_order_relaxed);
    return absl::IsInvalidArgument(ptr.status()) ? cudaErrorInvalidValue : cudaErrorUnknown;
  }
  *out = reinterpret_cast<void*>(*ptr);
  p.Remember(*out, LiveBlock{device, reinterpret_cast<StreamId>(stream)});
  p.counters().served_allocs.fetch_add(1, std::memory_order_relaxed);
  return cudaSuccess;
}

// Frees `ptr` if vramledger allocated it (true); false means the caller forwards it.
bool Release(Preload& p, void* ptr, cudaStream_t stream, bool async, cudaError_t* result) {
  LiveBlock block;
  if (ptr == nullptr || !p.Forget(ptr, &block)) return false;
  InsideScope inside;
  *result = cudaSuccess;
  DeviceAllocator* a = p.Existing(block.device);
  absl::Status s;
  const StreamId free_stream = reinterpret_cast<StreamId>(stream);
  // cudaFreeAsync on another stream: reuse waits for that stream's work queued so far.
  if (async && free_stream != block.stream) {
    s = a->RecordStream(reinterpret_cast<DevicePtr>(ptr), free_stream);
  }
  if (s.ok()) s = a->Free(reinterpret_cast<DevicePtr>(ptr));
  if (!s.ok()) {
    std::fprintf(stderr, "vramledger: free of %p on device %d failed: %s\n", ptr, block.device,
                 std::string(s.message()).c_str());
    p.counters().errors.fetch_add(1, std::memory_order_relaxed);
    *result = cudaErrorInvalidValue;
  } else {
    p.counters().served_frees.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

// PYTORCH_CUDA_ALLOC_CONF gains backend:cudaMallocAsync unless it names a backend already, so
// that torch sends every tensor allocation through cudaMallocAsync (PYTORCH-FACTS §8). What this
// route costs per call, and the alternative: docs/design/preload-route.md.
void SelectTorchBackend() {
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  if (conf == nullptr || conf[0] == '\0') {
    setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
    return;
  }
  if (std::strstr(conf, "backend") != nullptr) return;
  setenv("PYTORCH_CUDA_ALLOC_CONF", absl::StrCat(conf, ",backend:cudaMallocAsync").c_str(), 1);
}

void AtExit() {
  Preload* p = g_preload.load(std::memory_order_acquire);
  static std::atomic<bool> done{false};
  if (p == nullptr || done.exchange(true)) return;
  if (p->options().process.preload_no_exit_dump) return;
  const Counters& c = p->counters();
  if (c.malloc_calls.load() + c.malloc_async_calls.load() == 0) return;  // never used CUDA
  WriteDump(*p, "exit");
}

// Runs before the program's main: reads VRAMLEDGER_CONF (a bad value ends the process with one
// line naming the key), checks the plan file, selects torch's backend, installs SIGUSR1.
__attribute__((constructor)) void PreloadInit() {
  InsideScope inside;
  // Checked before VRAMLEDGER_CONF is parsed, so that a bad setting cannot block this way out.
  if (std::getenv("VRAMLEDGER_PRELOAD_DISABLE") != nullptr) return;
  absl::StatusOr<Options> options = OptionsFromEnvAndString("");
  if (!options.ok()) {
    std::fprintf(stderr, "vramledger: %s\n", std::string(options.status().message()).c_str());
    std::fflush(stderr);
    std::_Exit(2);
  }
  if (options->process.preload_disable) return;
  if (!options->process.plan.empty()) {
    char* json = nullptr;
    if (vramledger_plan_check(options->process.plan.c_str(), 0, 0, &json) != 0) {
      std::fprintf(stderr, "vramledger: VRAMLEDGER_CONF: option 'plan': %s\n",
                   PluginLastError().c_str());
      std::fflush(stderr);
      std::_Exit(2);
    }
    vramledger_string_free(json);
  }
  SelectTorchBackend();
  // Never wait for the GIL on autograd's (or any non-main) thread: see
  // docs/design/preload-python-frames.md.
  SetPythonGilPolicy(PythonGilPolicy::kMainThreadOnly);
  g_preload.store(new Preload(*std::move(options)), std::memory_order_release);
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = OnUsr1;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGUSR1, &action, &g_previous_usr1);
  std::atexit(AtExit);
}

void RegisterExitDumpAfterRuntime() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(AtExit); });
}

__attribute__((destructor)) void PreloadFini() { AtExit(); }

}  // namespace
}  // namespace vramledger

using vramledger::Active;
using vramledger::Preload;
using vramledger::Runtime;

// ---- The interposed runtime functions ----

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaMalloc(void** ptr, size_t size) {
  Preload* p = Active();
  if (p == nullptr) {
    if (Preload* q = vramledger::g_preload.load(std::memory_order_relaxed)) {
      q->counters().inner_calls.fetch_add(1, std::memory_order_relaxed);
    }
    return Runtime().malloc(ptr, size);
  }
  const vramledger::CallTimer timer(p->InterposedTimer());
  p->counters().malloc_calls.fetch_add(1, std::memory_order_relaxed);
  return vramledger::Allocate(*p, ptr, size, nullptr);
}

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaMallocAsync(void** ptr, size_t size,
                                                      cudaStream_t stream) {
  Preload* p = Active();
  if (p == nullptr) return Runtime().malloc_async(ptr, size, stream);
  const vramledger::CallTimer timer(p->InterposedTimer());
  p->counters().malloc_async_calls.fetch_add(1, std::memory_order_relaxed);
  return vramledger::Allocate(*p, ptr, size, stream);
}

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaFree(void* ptr) {
  Preload* p = Active();
  if (p == nullptr) {
    if (Preload* q = vramledger::g_preload.load(std::memory_order_relaxed)) {
      q->counters().inner_calls.fetch_add(1, std::memory_order_relaxed);
    }
    return Runtime().free(ptr);
  }
  const vramledger::CallTimer timer(p->InterposedTimer());
  p->counters().free_calls.fetch_add(1, std::memory_order_relaxed);
  cudaError_t result = cudaSuccess;
  if (vramledger::Release(*p, ptr, nullptr, /*async=*/false, &result)) return result;
  if (ptr != nullptr) p->counters().forwarded_frees.fetch_add(1, std::memory_order_relaxed);
  return Runtime().free(ptr);  // not ours (or cudaFree(0), which initializes the context)
}

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  Preload* p = Active();
  if (p == nullptr) return Runtime().free_async(ptr, stream);
  const vramledger::CallTimer timer(p->InterposedTimer());
  p->counters().free_async_calls.fetch_add(1, std::memory_order_relaxed);
  cudaError_t result = cudaSuccess;
  if (vramledger::Release(*p, ptr, stream, /*async=*/true, &result)) return result;
  if (ptr != nullptr) p->counters().forwarded_frees.fetch_add(1, std::memory_order_relaxed);
  return Runtime().free_async(ptr, stream);
}

// With a plan, the device looks as large as the plan's limit: total = limit, free = what the
// limit leaves beyond vramledger's reserved bytes (never more than the real free memory).
VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  const cudaError_t err = Runtime().mem_get_info(free_bytes, total_bytes);
  Preload* p = Active();
  if (p == nullptr || err != cudaSuccess || p->options().process.plan.empty() ||
      free_bytes == nullptr || total_bytes == nullptr) {
    return err;
  }
  p->counters().memgetinfo_calls.fetch_add(1, std::memory_order_relaxed);
  vramledger::InsideScope inside;
  const int device = vramledger::CurrentDevice();
  const std::int64_t limit = p->PlanLimit(device, *total_bytes);
  if (limit < 0) return err;
  std::int64_t reserved = 0;
  if (const vramledger::DeviceAllocator* a = p->Existing(device)) {
    reserved = a->GetStats().reserved_bytes[vramledger::kAggregate].current;
  }
  const std::size_t plan_free = limit > reserved ? static_cast<std::size_t>(limit - reserved) : 0;
  *total_bytes = std::min(*total_bytes, static_cast<std::size_t>(limit));
  *free_bytes = std::min(*free_bytes, plan_free);
  return err;
}

// guard_api.cc's ctypes functions use these two of plugin.cc's (not exported here either).
int vramledger_device_count() {
  int count = -1;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return -1;
  return count;
}

void vramledger_string_free(char* s) { std::free(s); }

// ---- Introspection (tests, scripts through ctypes) ----

/// The shim's counters as a JSON object in a malloc'd string (free() it); NULL when inactive.
VRAMLEDGER_PRELOAD_EXPORT char* vramledger_preload_stats_json() {
  Preload* p = vramledger::g_preload.load(std::memory_order_acquire);
  if (p == nullptr) return nullptr;
  const vramledger::Counters& c = p->counters();
  nlohmann::json j = {
      {"cudaMalloc_calls", c.malloc_calls.load()},
      {"cudaMallocAsync_calls", c.malloc_async_calls.load()},
      {"cudaFree_calls", c.free_calls.load()},
      {"cudaFreeAsync_calls", c.free_async_calls.load()},
      {"served_allocations", c.served_allocs.load()},
      {"served_frees", c.served_frees.load()},
      {"forwarded_frees", c.forwarded_frees.load()},
      {"zero_size_allocations", c.zero_size_allocs.load()},
      {"refusals", c.refusals.load()},
      {"errors", c.errors.load()},
      {"inner_runtime_calls", c.inner_calls.load()},
  };
  // Host time of the interposed calls, whole and inside the allocators' Malloc and Free, all
  // devices; zeros unless host_timing is on (step-time-measurement.md).
  double malloc_us = 0, free_us = 0;
  for (int d = 0; d < vramledger::kMaxDevices; ++d) {
    if (const vramledger::DeviceAllocator* a = p->Existing(d)) {
      const vramledger::HostTime t = a->host_time();
      malloc_us += t.malloc_ns / 1e3;
      free_us += t.free_ns / 1e3;
    }
  }
  j["host_time_us"] = {{"interposed_calls", c.interposed_ns.load() / 1e3},
                       {"allocator_malloc", malloc_us},
                       {"allocator_free", free_us}};
  const std::string text = j.dump();
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

/// Writes a snapshot and summary now (as SIGUSR1 does), tagged `tag` ("manual" when NULL).
VRAMLEDGER_PRELOAD_EXPORT void vramledger_preload_dump(const char* tag) {
  Preload* p = vramledger::g_preload.load(std::memory_order_acquire);
  if (p != nullptr) vramledger::WriteDump(*p, tag == nullptr ? "manual" : tag);
}
