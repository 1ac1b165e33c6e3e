// Out-of-memory observers: the registered C callback (Python's ctypes trampoline) and its call
// from the plugin's OOM path, with torch's OutOfMemoryObserver arguments (PYTORCH-FACTS §1.5).
#include "torch_plugin/oom_observers.h"

#include <atomic>
#include <cstdio>
#include <exception>

#include "torch_plugin/plugin.h"

namespace vramledger {
namespace {

std::atomic<vramledger_oom_observer_fn> g_observer{nullptr};

}  // namespace

void NotifyOutOfMemoryObservers(int device, std::size_t requested, const OutOfMemoryInfo& oom) {
  const vramledger_oom_observer_fn observer = g_observer.load(std::memory_order_acquire);
  if (observer == nullptr) return;
  // last_oom() may describe another failure (or none, for a budget-guard refusal): fall back to
  // the request itself when it is not this one.
  const bool same = oom.device == device && oom.requested == requested;
  const std::size_t alloc_size = same && oom.alloc_size != 0 ? oom.alloc_size : requested;
  const std::size_t limit = !same ? 0 : (oom.allowed != 0 ? oom.allowed : oom.device_total);
  const std::size_t device_free = same ? oom.device_free : 0;
  try {
    observer(device, alloc_size, limit, device_free);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: out-of-memory observer threw: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "vramledger: out-of-memory observer threw\n");
  }
}

}  // namespace vramledger

extern "C" {

int vramledger_set_oom_observer(vramledger_oom_observer_fn observer) {
  vramledger::g_observer.store(observer, std::memory_order_release);
  return VRAMLEDGER_OK;
}

}  // extern "C"
