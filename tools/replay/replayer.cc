// Replay()'s engine (see replayer.h): trace addresses mapped to the allocator's, the trace's own
// figures, the plan's refusals and the program's releases.
#include "replay/replayer.h"

#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "device/sim_cost_model.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

absl::Status AtLine(const ReplayConfig& config, const TraceEvent& event, absl::StatusCode code,
                    absl::string_view what) {
  return absl::Status(code, absl::StrCat(config.source, ":", event.line, ": ", what));
}

// What torch's own driver calls for a segment event cost in SimBackend's model (see
// ReplayResult::recorded_modeled_driver_us); 0 for other actions.
double RecordedEventMicros(const TraceEvent& event) {
  constexpr std::size_t kTorchLargePage = 20 * kMiB;  // torch's expandable page sizes
  constexpr std::size_t kTorchSmallPage = 2 * kMiB;
  const std::size_t page = event.size % kTorchLargePage == 0 ? kTorchLargePage : kTorchSmallPage;
  const double handles = std::ceil(static_cast<double>(event.size) / static_cast<double>(page));
  switch (event.action) {
    case TraceAction::kSegmentAlloc:
      return ModelledCallMicros(DriverCall::kMalloc, event.size);
    case TraceAction::kSegmentFree:
      return ModelledCallMicros(DriverCall::kFree, event.size);
    case TraceAction::kSegmentMap:
      return handles * (ModelledCallMicros(DriverCall::kMemCreate, page) +
                        ModelledCallMicros(DriverCall::kMemMap, page) +
                        ModelledCallMicros(DriverCall::kMemSetAccess, page));
    case TraceAction::kSegmentUnmap:
      return handles * (ModelledCallMicros(DriverCall::kMemUnmap, page) +
                        ModelledCallMicros(DriverCall::kMemRelease, page));
    default:
      return 0.0;
  }
}

SimBackend::Config SimConfig(const ReplayConfig& config) {
  SimBackend::Config sim;
  sim.capacity = config.capacity_bytes;
  sim.auto_complete_events = config.gpu_lag_us <= 0;
  sim.event_lag_us = config.gpu_lag_us;
  return sim;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Replayer>> Replayer::Create(const std::vector<TraceEvent>& events,
                                                           const Options& options,
                                                           const ReplayConfig& config,
                                                           AllocatorHooks* observer) {
  std::unique_ptr<Replayer> r(new Replayer(events, options, config, observer));
  if (!options.process.plan.empty()) {
    absl::StatusOr<std::unique_ptr<ReplayPlan>> plan =
        ReplayPlan::Create(options.process.plan, config.device, config.capacity_bytes, &r->hooks_);
    if (!plan.ok()) return plan.status();
    r->plan_ = *std::move(plan);
    r->plan_->mutable_figures().keep_going = config.plan_keep_going;
    r->allocator_.SetHooks(r->plan_->Hooks());
  }
  return r;
}

Replayer::Replayer(const std::vector<TraceEvent>& events, const Options& options,
                   const ReplayConfig& config, AllocatorHooks* observer)
    : events_(events),
      config_(config),
      backend_(SimConfig(config)),
      hooks_({&tracker_, observer}),
      allocator_(options, &backend_),
      releases_(events, config.follow_releases) {
  live_.reserve(4096);
  // Without an observer the tracker alone: the replay's hot path keeps one virtual call.
  allocator_.SetHooks(observer != nullptr ? static_cast<AllocatorHooks*>(&hooks_) : &tracker_);
}

Replayer::~Replayer() { allocator_.SetHooks(nullptr); }

ReplayState Replayer::State() const {
  const DeviceStats stats = allocator_.GetStats();
  return {stats.allocated_bytes[kAggregate].current, stats.reserved_bytes[kAggregate].current,
          stats.requested_bytes[kAggregate].current};
}

absl::StatusOr<Outcome> Replayer::Alloc(const TraceEvent& event, std::size_t index, Tally* tally) {
  RecordedFigures& recorded = tally->recorded;
  if (auto it = live_.find(event.addr); it != live_.end()) {
    // The trace lost a free: release the earlier block as torch must have.
    tally->reused_live_addresses.push_back({event.line, event.addr});
    if (absl::Status s = allocator_.Free(it->second.ours); !s.ok()) {
      return AtLine(config_, event, s.code(),
                    absl::StrCat("free of the earlier block at reused address ", event.addr,
                                 " failed: ", s.message()));
    }
    recorded.live -= static_cast<std::int64_t>(it->second.size);
    live_.erase(it);
  }
  refused_.erase(event.addr);
  absl::StatusOr<DevicePtr> ptr = allocator_.Malloc(event.size, event.stream);
  if (!ptr.ok()) {
    if (plan_ != nullptr) {
      const bool listed = plan_->figures().listed.size() < config_.max_refusals_listed;
      const std::int64_t largest =
          listed ? allocator_.GetStats().largest_free_block_bytes : std::int64_t{0};
      if (plan_->TakeRefusal(ptr.status(), event, static_cast<std::int64_t>(index) + 1,
                             config_.max_refusals_listed, largest)) {
        // The program saw an out-of-memory error here; its free of the address never comes.
        refused_.insert(event.addr);
        return Outcome::kRefused;
      }
    }
    const absl::string_view message = ptr.status().message();
    // The allocator's hint names the variable; a replay's user types --conf.
    const bool hint = absl::StrContains(message, "VRAMLEDGER_CONF=expandable_segments:True");
    return AtLine(config_, event, ptr.status().code(),
                  absl::StrCat("alloc of ", event.size, " bytes on stream ", event.stream,
                               " failed (simulated capacity ", config_.capacity_bytes, " bytes): ",
                               message, hint ? " (Here: --conf expandable_segments:True.)" : ""));
  }
  live_.emplace(event.addr, LiveBlock{*ptr, event.size});
  recorded.live += static_cast<std::int64_t>(event.size);
  recorded.peak_live = std::max(recorded.peak_live, recorded.live);
  ++tally->allocs;
  return Outcome::kReplayed;
}

absl::StatusOr<Outcome> Replayer::Apply(std::size_t index, Tally* tally) {
  const TraceEvent& event = events_[index];
  RecordedFigures& recorded = tally->recorded;
  if (config_.gpu_lag_us > 0) backend_.AdvanceClock(event.time_us);
  switch (event.action) {
    case TraceAction::kAlloc:
      return Alloc(event, index, tally);
    case TraceAction::kFreeCompleted: {
      auto it = live_.find(event.addr);
      if (it == live_.end()) {
        // A refused allocation's free is the program's handling of its error, not an anomaly.
        if (refused_.erase(event.addr) == 0) {
          tally->unknown_frees.push_back({event.line, event.addr});
        }
        return Outcome::kSkipped;
      }
      if (absl::Status s = allocator_.Free(it->second.ours); !s.ok()) {
        return AtLine(config_, event, s.code(),
                      absl::StrCat("free of ", it->second.size, " bytes failed: ", s.message()));
      }
      recorded.live -= static_cast<std::int64_t>(it->second.size);
      live_.erase(it);
      ++tally->frees;
      return Outcome::kReplayed;
    }
    case TraceAction::kSegmentAlloc:
    case TraceAction::kSegmentMap:
      recorded.Reserve(static_cast<std::int64_t>(event.size));
      ++tally->recorded_segment_allocs;
      if (event.action == TraceAction::kSegmentMap) ++tally->recorded_segment_maps;
      tally->recorded_modeled_driver_us += RecordedEventMicros(event);
      return Outcome::kSkipped;
    case TraceAction::kSegmentFree:
    case TraceAction::kSegmentUnmap: {
      recorded.Reserve(-static_cast<std::int64_t>(event.size));
      ++tally->recorded_segment_frees;
      tally->recorded_modeled_driver_us += RecordedEventMicros(event);
      absl::StatusOr<bool> released = releases_.After(index, &allocator_);
      if (!released.ok()) {
        return AtLine(config_, event, released.status().code(),
                      absl::StrCat("emptying the cache at the trace's release failed: ",
                                   released.status().message()));
      }
      return *released ? Outcome::kReleased : Outcome::kSkipped;
    }
    case TraceAction::kOom:
      ++tally->recorded_ooms;
      return Outcome::kSkipped;
    case TraceAction::kSnapshot:
      ++tally->step_marks;
      return Outcome::kSkipped;
    case TraceAction::kFreeRequested:
      return Outcome::kSkipped;
  }
  return Outcome::kSkipped;
}

}  // namespace vramledger
