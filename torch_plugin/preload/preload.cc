// libvramledger_preload.so: interposes cudaMalloc/cudaFree/cudaMallocAsync/cudaFreeAsync and
// cudaMemGetInfo, serving device memory from the runtime's per-device allocators; once
// vramledger is torch's allocator (the direct route, direct_route.cc) they forward.
//
// Recursion: CudaBackend (linked into this library) calls cudaMalloc/cudaFree/cudaMemGetInfo
// itself, and those names bind to this library's definitions (it comes first in the global
// scope). Every entry into vramledger therefore runs under InsideScope, a thread-local flag; an
// interposed function called while the flag is set forwards straight to the real runtime
// function (dlsym(RTLD_NEXT)). The flag is initial-exec TLS: reading it never allocates.
//
// Everything here is process-wide and never destroyed: frees can arrive during exit. The shim's
// state is in preload_state.h, its summary and dumps in preload_report.cc.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ledger/stack_capture.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/preload/preload_state.h"
#include "torch_plugin/runtime/device_table.h"
#include "torch_plugin/runtime/guard_api.h"
#include "torch_plugin/runtime/plan_access.h"
#include "torch_plugin/runtime/process_env.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"
#include "vramledger/stats.h"

#define VRAMLEDGER_PRELOAD_EXPORT extern "C" __attribute__((visibility("default")))

namespace vramledger::preload {

constinit __attribute__((tls_model("initial-exec"))) thread_local bool t_inside = false;

namespace {

// Set by the constructor; nullptr until then (and forever when the shim is disabled).
std::atomic<Preload*> g_preload{nullptr};
// The state the interposed functions serve from: g_preload until vramledger becomes torch's
// allocator (the direct route), then nullptr: every call forwards to the real runtime.
std::atomic<Preload*> g_serving{nullptr};
std::atomic<bool> g_dump_requested{false};  // SIGUSR1 arrived
std::atomic<int> g_dump_sequence{0};
std::atomic<bool> g_dump_thread{false};  // the direct route's dump thread waits on g_dump_sem
sem_t g_dump_sem;
struct sigaction g_previous_usr1;

// SIGUSR1: only sets the flag (or posts the dump thread's semaphore on the direct route); the
// dump runs on the next interposed call or on that thread (both async-signal-safe).
void OnUsr1(int signo, siginfo_t* info, void* context) {
  g_dump_requested.store(true, std::memory_order_relaxed);
  if (g_dump_thread.load(std::memory_order_relaxed)) sem_post(&g_dump_sem);
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
  Preload* p = g_serving.load(std::memory_order_acquire);
  if (p != nullptr && g_dump_requested.load(std::memory_order_relaxed) &&
      g_dump_requested.exchange(false)) {
    WriteDump(*p, absl::StrCat("sigusr1-", g_dump_sequence.fetch_add(1) + 1));
  }
  return p;
}

// True when `address` lies in the library loaded at `base`.
bool CalledFrom(const void* address, const void* base) {
  Dl_info info;
  return base != nullptr && dladdr(address, &info) != 0 && info.dli_fbase == base;
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

bool Release(Preload& p, void* ptr, cudaStream_t stream, bool async, cudaError_t* result);

// On the direct route: frees `ptr` if the interposition served it before torch loaded (true).
bool ServedBeforeDirectRoute(Preload& p, void* ptr, cudaStream_t stream, bool async,
                             cudaError_t* result) {
  if (t_inside || p.plugin() == nullptr || !p.HasLiveBlocks()) return false;
  return Release(p, ptr, stream, async, result);
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

// True once the serving runtime allocated on some device.
bool UsedCuda(Preload& p) {
  if (p.plugin() == nullptr) {
    const Counters& c = p.counters();
    return c.malloc_calls.load() + c.malloc_async_calls.load() > 0;
  }
  return p.AnyAllocatorCreated();
}

void AtExit() {
  Preload* p = g_preload.load(std::memory_order_acquire);
  static std::atomic<bool> done{false};
  if (p == nullptr || done.exchange(true)) return;
  if (p->options().process.preload_no_exit_dump) return;
  if (!UsedCuda(*p)) return;
  WriteDump(*p, "exit");
}

// The direct route's SIGUSR1 dumps: the allocations no longer pass through the shim.
void* DumpThread(void*) {
  for (;;) {
    if (sem_wait(&g_dump_sem) != 0) continue;  // EINTR
    if (!g_dump_requested.exchange(false)) continue;
    if (Preload* p = g_preload.load(std::memory_order_acquire)) {
      WriteDump(*p, absl::StrCat("sigusr1-", g_dump_sequence.fetch_add(1) + 1));
    }
  }
  return nullptr;
}

// Runs before the program's main: reads VRAMLEDGER_CONF (a bad value ends the process with one
// line naming the key), checks the plan file, selects torch's backend, installs SIGUSR1.
__attribute__((constructor)) void PreloadInit() {
  InsideScope inside;
  // Checked before VRAMLEDGER_CONF is parsed, so that a bad setting cannot block this way out.
  if (ReadProcessEnv().preload_disable) return;
  absl::StatusOr<Options> options = OptionsFromEnvAndString("");
  if (!options.ok()) {
    std::fprintf(stderr, "vramledger: %s\n", std::string(options.status().message()).c_str());
    std::fflush(stderr);
    std::_Exit(2);
  }
  if (options->process.preload_disable) return;  // set in VRAMLEDGER_CONF itself
  if (!options->process.plan.empty()) {
    if (const absl::Status plan = CheckPlanFile(options->process.plan); !plan.ok()) {
      std::fprintf(stderr, "vramledger: VRAMLEDGER_CONF: option 'plan': %s\n",
                   std::string(plan.message()).c_str());
      std::fflush(stderr);
      std::_Exit(2);
    }
  }
  // Never wait for the GIL on autograd's (or any non-main) thread: see
  // docs/design/preload-python-frames.md.
  SetPythonGilPolicy(PythonGilPolicy::kMainThreadOnly);
  Preload* preload = new Preload(*std::move(options));  // never destroyed
  DeviceTable::Get().SetBeforeCreate([preload](int device) { preload->BeforeCreate(device); });
  g_preload.store(preload, std::memory_order_release);
  g_serving.store(preload, std::memory_order_release);
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = OnUsr1;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGUSR1, &action, &g_previous_usr1);
  std::atexit(AtExit);
  // Which route serves torch: decided here when torch is linked in, else at its dlopen.
  InitTorchRoute();
}

__attribute__((destructor)) void PreloadFini() { AtExit(); }

}  // namespace

Preload* Instance() { return g_preload.load(std::memory_order_acquire); }

void EnterDirectRoute() {
  g_serving.store(nullptr, std::memory_order_release);
  if (sem_init(&g_dump_sem, 0, 0) != 0) return;
  pthread_t thread;
  if (pthread_create(&thread, nullptr, DumpThread, nullptr) != 0) return;
  pthread_detach(thread);
  g_dump_thread.store(true, std::memory_order_release);
}

void OnDirectRefusal(int device, const char* report) {
  Preload* p = Instance();
  if (p == nullptr || report == nullptr) return;
  InsideScope inside;
  const std::int64_t n = p->counters().refusals.fetch_add(1, std::memory_order_relaxed) + 1;
  WriteRefusalReport(*p, n, report);
  // torch's OutOfMemoryError carries the report itself; one line says where the file is.
  if (n <= std::max(p->options().process.max_dumps, 0)) {
    std::fprintf(stderr, "vramledger: device %d: allocation refused; report: %s\n", device,
                 RefusalReportPath(*p, n).c_str());
  }
}

void RegisterExitDumpAfterRuntime() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(AtExit); });
}

// With a plan, the device looks as large as the plan's limit (cudaMemGetInfo below).
cudaError_t PlanMemGetInfo(Preload& p, cudaError_t err, size_t* free_bytes, size_t* total_bytes) {
  InsideScope inside;
  const int device = CurrentDevice();
  const std::int64_t limit = p.PlanLimit(device, *total_bytes);
  if (limit < 0) return err;
  std::int64_t reserved = 0;
  DeviceFigures figures;
  if (p.Figures(device, &figures)) {
    reserved = figures.stats.reserved_bytes[vramledger::kAggregate].current;
  }
  const std::size_t plan_free = limit > reserved ? static_cast<std::size_t>(limit - reserved) : 0;
  *total_bytes = std::min(*total_bytes, static_cast<std::size_t>(limit));
  *free_bytes = std::min(*free_bytes, plan_free);
  return err;
}

}  // namespace vramledger::preload

using vramledger::preload::Active;
using vramledger::preload::Preload;
using vramledger::preload::Runtime;

// ---- The interposed runtime functions ----

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaMalloc(void** ptr, size_t size) {
  Preload* p = Active();
  if (p == nullptr) {
    if (Preload* q = vramledger::preload::g_preload.load(std::memory_order_relaxed)) {
      q->counters().inner_calls.fetch_add(1, std::memory_order_relaxed);
    }
    return Runtime().malloc(ptr, size);
  }
  const vramledger::preload::CallTimer timer(p->InterposedTimer());
  p->counters().malloc_calls.fetch_add(1, std::memory_order_relaxed);
  return vramledger::preload::NoThrow("cudaMalloc", cudaErrorMemoryAllocation,
                                      [&] { return vramledger::preload::Allocate(*p, ptr, size, nullptr); });
}

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaMallocAsync(void** ptr, size_t size,
                                                      cudaStream_t stream) {
  Preload* p = Active();
  if (p == nullptr) return Runtime().malloc_async(ptr, size, stream);
  const vramledger::preload::CallTimer timer(p->InterposedTimer());
  p->counters().malloc_async_calls.fetch_add(1, std::memory_order_relaxed);
  return vramledger::preload::NoThrow("cudaMallocAsync", cudaErrorMemoryAllocation,
                                      [&] { return vramledger::preload::Allocate(*p, ptr, size, stream); });
}

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaFree(void* ptr) {
  Preload* p = Active();
  if (p == nullptr) {
    if (Preload* q = vramledger::preload::g_preload.load(std::memory_order_relaxed)) {
      q->counters().inner_calls.fetch_add(1, std::memory_order_relaxed);
      cudaError_t result = cudaErrorUnknown;  // stays so if the release fails midway
      if (vramledger::preload::NoThrow("cudaFree", true, [&] {
            return vramledger::preload::ServedBeforeDirectRoute(*q, ptr, nullptr, false, &result);
          })) {
        return result;
      }
    }
    return Runtime().free(ptr);
  }
  const vramledger::preload::CallTimer timer(p->InterposedTimer());
  p->counters().free_calls.fetch_add(1, std::memory_order_relaxed);
  cudaError_t result = cudaErrorUnknown;  // stays so if the release fails midway
  if (vramledger::preload::NoThrow("cudaFree", true, [&] {
        return vramledger::preload::Release(*p, ptr, nullptr, /*async=*/false, &result);
      })) {
    return result;
  }
  if (ptr != nullptr) p->counters().forwarded_frees.fetch_add(1, std::memory_order_relaxed);
  return Runtime().free(ptr);  // not ours (or cudaFree(0), which initializes the context)
}

VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  Preload* p = Active();
  if (p == nullptr) {
    cudaError_t result = cudaErrorUnknown;  // stays so if the release fails midway
    Preload* q = vramledger::preload::g_preload.load(std::memory_order_relaxed);
    if (q != nullptr && vramledger::preload::NoThrow("cudaFreeAsync", true, [&] {
          return vramledger::preload::ServedBeforeDirectRoute(*q, ptr, stream, true, &result);
        })) {
      return result;
    }
    return Runtime().free_async(ptr, stream);
  }
  const vramledger::preload::CallTimer timer(p->InterposedTimer());
  p->counters().free_async_calls.fetch_add(1, std::memory_order_relaxed);
  cudaError_t result = cudaErrorUnknown;  // stays so if the release fails midway
  if (vramledger::preload::NoThrow("cudaFreeAsync", true, [&] {
        return vramledger::preload::Release(*p, ptr, stream, /*async=*/true, &result);
      })) {
    return result;
  }
  if (ptr != nullptr) p->counters().forwarded_frees.fetch_add(1, std::memory_order_relaxed);
  return Runtime().free_async(ptr, stream);
}

// With a plan, the device looks as large as the plan's limit: total = limit, free = what the
// limit leaves beyond vramledger's reserved bytes (never more than the real free memory).
// On the direct route the plugin's own calls (its backend's device size) see the real figures,
// as the interposition's inner calls do.
VRAMLEDGER_PRELOAD_EXPORT cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  const cudaError_t err = Runtime().mem_get_info(free_bytes, total_bytes);
  Preload* p = Active();
  if (p == nullptr && !vramledger::preload::t_inside) {
    Preload* q = vramledger::preload::g_preload.load(std::memory_order_acquire);
    if (q != nullptr && q->plugin() != nullptr &&
        !vramledger::preload::CalledFrom(__builtin_return_address(0), q->plugin()->base)) {
      p = q;
    }
  }
  if (p == nullptr || err != cudaSuccess || p->options().process.plan.empty() ||
      free_bytes == nullptr || total_bytes == nullptr) {
    return err;
  }
  p->counters().memgetinfo_calls.fetch_add(1, std::memory_order_relaxed);
  // The real figures are in place; a failure below leaves them, unshrunk by the plan.
  return vramledger::preload::NoThrow("cudaMemGetInfo", err, [&] {
    return vramledger::preload::PlanMemGetInfo(*p, err, free_bytes, total_bytes);
  });
}
