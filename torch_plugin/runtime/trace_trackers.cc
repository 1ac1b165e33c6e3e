// TraceTrackers: the process's attached trace trackers and their calls (trace_trackers.h).
#include "torch_plugin/runtime/trace_trackers.h"

#include <cxxabi.h>
#include <cstdio>
#include <exception>
#include <utility>

namespace vramledger {

TraceTrackers& TraceTrackers::Get() {
  static TraceTrackers* const instance = new TraceTrackers;  // never destroyed
  return *instance;
}

void TraceTrackers::Add(Tracker tracker) {
  if (!tracker) return;
  absl::MutexLock lock(&mu_);
  trackers_.push_back(std::move(tracker));
  any_.store(true, std::memory_order_release);
}

void TraceTrackers::OnEvent(const TraceEntry& event) {
  if (!any_.load(std::memory_order_acquire)) return;
  absl::ReaderMutexLock lock(&mu_);
  for (const Tracker& tracker : trackers_) {
    try {
      tracker(event);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "vramledger: an allocator trace tracker threw: %s\n", e.what());
    } catch (const abi::__forced_unwind&) {
      throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
    } catch (...) {
      std::fprintf(stderr, "vramledger: an allocator trace tracker threw\n");
    }
  }
}

}  // namespace vramledger
