// Allocator trace trackers (torch's attachAllocatorTraceTracker): callables attached at run time
// that see every trace entry of every device. One process-wide hooks object, chained on each
// allocator's hooks beside the guard and the history (guard_api.cc). Thread-safe.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_TRACE_TRACKERS_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_TRACE_TRACKERS_H_

#include <atomic>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "vramledger/hooks.h"

namespace vramledger {

class TraceTrackers final : public AllocatorHooks {
 public:
  using Tracker = std::function<void(const TraceEntry&)>;

  /// The process's instance (never destroyed: allocators outlive static destructors).
  static TraceTrackers& Get();

  /// From now on `tracker` sees every trace entry, in order per device, called with that
  /// device's allocator lock held, as torch calls its trackers: events of mapped pages before
  /// the memory is handed out, of unmaps before the handle is released. It must not call the
  /// allocator nor Add. Trackers stay for the life of the process (torch has no detach).
  void Add(Tracker tracker) ABSL_LOCKS_EXCLUDED(mu_);

  /// Calls each tracker; one that throws is reported on stderr and the others still run (the
  /// allocator's books are mid-operation: an exception must not leave it).
  void OnEvent(const TraceEntry& event) override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TraceTrackers() = default;

  std::atomic<bool> any_{false};  // the hot path reads only this while none is attached
  absl::Mutex mu_;
  std::vector<Tracker> trackers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_TRACE_TRACKERS_H_
