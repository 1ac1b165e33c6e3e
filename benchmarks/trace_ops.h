// A recorded trace as a list of allocator calls, for the benchmarks that replay it through an
// allocator (replay_bench on SimBackend; gpu/host_cost_bench through torch's and vramledger's
// allocators on a real device).
#ifndef VRAMLEDGER_BENCHMARKS_TRACE_OPS_H_
#define VRAMLEDGER_BENCHMARKS_TRACE_OPS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "replay/trace_reader.h"
#include "vramledger/types.h"

namespace vramledger {

/// One allocator call of a trace: Malloc(size, stream) into `slot`, or Free of `slot`.
struct TraceOp {
  bool alloc = false;
  std::uint32_t slot = 0;
  std::size_t size = 0;  // bytes; 0 for a free
  StreamId stream = 0;
};

/// A trace as allocator calls. Slots are reused once freed; `slots` is how many a replay needs.
struct TraceOps {
  std::vector<TraceOp> ops;
  std::uint32_t slots = 0;
  std::string error;  // non-empty when the trace could not be read
};

/// Reads `path` (the CSV of ReadTraceFile) into allocator calls: free_completed of an unknown
/// address is dropped; an alloc at a live address frees the earlier block first, as Replay()
/// does. Errors (unreadable or malformed trace) come back in `error`, naming the file.
inline TraceOps LoadTraceOps(const std::string& path) {
  TraceOps w;
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(path);
  if (!events.ok()) {
    w.error = std::string(events.status().message());
    return w;
  }
  absl::flat_hash_map<DevicePtr, std::uint32_t> live;  // trace address -> slot
  std::vector<std::uint32_t> free_slots;
  for (const TraceEvent& e : *events) {
    if (e.action != TraceAction::kAlloc && e.action != TraceAction::kFreeCompleted) continue;
    if (auto it = live.find(e.addr); it != live.end()) {
      w.ops.push_back({false, it->second, 0, 0});
      free_slots.push_back(it->second);
      live.erase(it);
    } else if (e.action == TraceAction::kFreeCompleted) {
      continue;  // unknown free
    }
    if (e.action == TraceAction::kAlloc) {
      std::uint32_t slot = w.slots;
      if (free_slots.empty()) {
        ++w.slots;
      } else {
        slot = free_slots.back();
        free_slots.pop_back();
      }
      live.emplace(e.addr, slot);
      w.ops.push_back({true, slot, e.size, e.stream});
    }
  }
  return w;
}

}  // namespace vramledger

#endif  // VRAMLEDGER_BENCHMARKS_TRACE_OPS_H_
