// Replay()'s engine: one allocator on one simulated device fed a trace's events one at a time,
// with the trace's own recorded figures, the plan's guard (plan:FILE) and the program's releases
// (trace_releases.h). Replay() runs it once for the figures and again to stop at the peak.
// Not thread-safe: one replay's state.
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAYER_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAYER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "device/sim_backend.h"
#include "guard/hooks_chain.h"
#include "replay/replay.h"
#include "replay/replay_observers.h"
#include "replay/replay_plan.h"
#include "replay/trace_reader.h"
#include "replay/trace_releases.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"
#include "vramledger/options.h"

namespace vramledger {

// A block the trace allocated and has not freed yet.
struct LiveBlock {
  DevicePtr ours = 0;    // what our allocator returned
  std::size_t size = 0;  // the trace's requested size in bytes
};

// The trace's own bookkeeping: live requested bytes and reserved bytes, with their peaks.
struct RecordedFigures {
  std::int64_t live = 0;
  std::int64_t peak_live = 0;
  std::int64_t reserved = 0;
  std::int64_t peak_reserved = 0;

  void Reserve(std::int64_t bytes) {
    reserved += bytes;
    peak_reserved = std::max(peak_reserved, reserved);
  }
};

// Counts of one pass over the trace, filled by Replayer::Apply.
struct Tally {
  std::int64_t allocs = 0;
  std::int64_t frees = 0;
  std::vector<LineAddress> unknown_frees;
  std::vector<LineAddress> reused_live_addresses;
  RecordedFigures recorded;
  std::int64_t recorded_segment_allocs = 0;
  std::int64_t recorded_segment_maps = 0;
  std::int64_t recorded_segment_frees = 0;
  std::int64_t recorded_ooms = 0;
  std::int64_t step_marks = 0;
  double recorded_modeled_driver_us = 0.0;
};

// Follows the allocator's reserved bytes from its segment events. GetStats() gives the same
// figure but also measures the largest free block, which on expandable segments walks every page
// of the free tail of the reserved range (~100k pages on an H200): too slow for every event.
// A recycled page emits segment_unmap then segment_map, which nets to zero as reserved does.
class ReservedTracker final : public AllocatorHooks {
 public:
  void OnEvent(const TraceEntry& event) override {
    switch (event.action) {
      case TraceAction::kSegmentAlloc:
      case TraceAction::kSegmentMap:
        reserved_ += static_cast<std::int64_t>(event.size);
        break;
      case TraceAction::kSegmentFree:
      case TraceAction::kSegmentUnmap:
        reserved_ -= static_cast<std::int64_t>(event.size);
        break;
      default:
        break;
    }
  }
  std::int64_t reserved() const { return reserved_; }

 private:
  std::int64_t reserved_ = 0;  // written under the allocator's lock; the replay is one thread
};

// What Replayer::Apply did with an event.
enum class Outcome {
  kSkipped,   // not an allocator event (segment, oom, snapshot rows), or a free of an unknown
              // or refused address
  kReplayed,  // an alloc or free_completed went through the allocator
  kReleased,  // the event ended a release of the program, and the allocator's cache was emptied
  kRefused,   // the plan refused the alloc (ReplayPlan::figures() has it)
};

// One allocator on one simulated device, fed a trace's events one at a time.
class Replayer {
 public:
  // `events` and `config` are borrowed and must outlive the replayer; `observer` (borrowed,
  // may be null: a History for a snapshot) sees the allocator's events after the replay's own
  // hooks. Errors: the plan's (Options::process.plan is loaded and resolved against
  // config.capacity_bytes).
  static absl::StatusOr<std::unique_ptr<Replayer>> Create(const std::vector<TraceEvent>& events,
                                                          const Options& options,
                                                          const ReplayConfig& config,
                                                          AllocatorHooks* observer = nullptr);
  ~Replayer();
  Replayer(const Replayer&) = delete;
  Replayer& operator=(const Replayer&) = delete;

  // Applies events[index] (0-based) and counts it in `tally`. Errors: Replay's, naming the
  // event's line.
  absl::StatusOr<Outcome> Apply(std::size_t index, Tally* tally);

  // The allocator's figures now (GetStats(): use sparingly, see ReservedTracker).
  ReplayState State() const;
  // Reserved bytes now, cheaply.
  std::int64_t reserved() const { return tracker_.reserved(); }

  DeviceAllocator& allocator() { return allocator_; }
  const DriverCallLedger& calls() const { return backend_.calls(); }
  std::int64_t live_blocks() const { return static_cast<std::int64_t>(live_.size()); }
  const ReleaseFigures& releases() const { return releases_.figures(); }
  // The plan's figures; null when no plan is enforced.
  const PlanFigures* plan() const { return plan_ ? &plan_->figures() : nullptr; }

 private:
  Replayer(const std::vector<TraceEvent>& events, const Options& options,
           const ReplayConfig& config, AllocatorHooks* observer);
  absl::StatusOr<Outcome> Alloc(const TraceEvent& event, std::size_t index, Tally* tally);

  const std::vector<TraceEvent>& events_;
  const ReplayConfig& config_;
  SimBackend backend_;
  ReservedTracker tracker_;           // declared before the allocator, which borrows it
  guard::HooksChain hooks_;           // the tracker, then the observer
  std::unique_ptr<ReplayPlan> plan_;  // its hooks chain hooks_; null without a plan
  DeviceAllocator allocator_;
  absl::flat_hash_map<DevicePtr, LiveBlock> live_;  // trace address -> block
  absl::flat_hash_set<DevicePtr> refused_;          // trace addresses whose alloc was refused
  ReleaseFollower releases_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAYER_H_
