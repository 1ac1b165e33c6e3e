// Out-of-memory observers: the registered C callback (Python's ctypes trampoline) and torch's
// own observers, called from the OOM path with torch's OutOfMemoryObserver arguments.
#include "torch_plugin/runtime/oom_observers.h"

#include <cxxabi.h>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "torch_plugin/runtime/c_api.h"

namespace vramledger {
namespace {

std::atomic<vramledger_oom_observer_fn> g_observer{nullptr};

using CppObserver = std::function<void(std::int64_t, std::size_t, std::size_t, std::size_t)>;

// torch's own observers in the torch-native mode (vramledger_add_oom_observer), in order.
absl::Mutex g_cpp_mu;
std::vector<CppObserver>& CppObservers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_cpp_mu) {
  static auto* const observers = new std::vector<CppObserver>;  // never destroyed
  return *observers;
}

}  // namespace

void NotifyOutOfMemoryObservers(int device, std::size_t requested, const OutOfMemoryInfo& oom) {
  const vramledger_oom_observer_fn observer = g_observer.load(std::memory_order_acquire);
  std::vector<CppObserver> cpp;
  {
    absl::MutexLock lock(&g_cpp_mu);
    cpp = CppObservers();
  }
  if (observer == nullptr && cpp.empty()) return;
  // last_oom() may describe another failure (or none, for a budget-guard refusal): fall back to
  // the request itself when it is not this one.
  const bool same = oom.device == device && oom.requested == requested;
  const std::size_t alloc_size = same && oom.alloc_size != 0 ? oom.alloc_size : requested;
  const std::size_t limit = !same ? 0 : (oom.allowed != 0 ? oom.allowed : oom.device_total);
  const std::size_t device_free = same ? oom.device_free : 0;
  // Each observer on its own: one that throws does not keep the others (often snapshot
  // writers) from running.
  auto call = [&](const auto& fn) {
    try {
      fn(device, alloc_size, limit, device_free);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "vramledger: out-of-memory observer threw: %s\n", e.what());
    } catch (const abi::__forced_unwind&) {
      throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
    } catch (...) {
      std::fprintf(stderr, "vramledger: out-of-memory observer threw\n");
    }
  };
  if (observer != nullptr) call(observer);
  for (const CppObserver& o : cpp) call(o);
}

}  // namespace vramledger

extern "C" {

int vramledger_set_oom_observer(vramledger_oom_observer_fn observer) {
  vramledger::g_observer.store(observer, std::memory_order_release);
  return VRAMLEDGER_OK;
}

void vramledger_add_oom_observer(
    std::function<void(std::int64_t, std::size_t, std::size_t, std::size_t)> observer) {
  if (!observer) return;
  absl::MutexLock lock(&vramledger::g_cpp_mu);
  vramledger::CppObservers().push_back(std::move(observer));
}

}  // extern "C"
