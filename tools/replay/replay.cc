// Trace replay on SimBackend: one allocator and one simulated device per pass, the trace's
// addresses mapped to the allocator's. Stateless between calls; thread-safe.
#include "replay/replay.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "device/sim_backend.h"
#include "device/sim_cost_model.h"
#include "ledger/device_report.h"
#include "replay/replay_observers.h"
#include "vramledger/device_allocator.h"
#include "vramledger/device_backend.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

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

absl::Status AtLine(const ReplayConfig& config, const TraceEvent& event, absl::StatusCode code,
                    absl::string_view what) {
  return absl::Status(code, absl::StrCat(config.source, ":", event.line, ": ", what));
}

// The stream with the most alloc events; the lowest id among equals; 0 for none.
StreamId MainStream(const std::vector<TraceEvent>& events) {
  absl::flat_hash_map<StreamId, std::int64_t> allocs;
  for (const TraceEvent& e : events) {
    if (e.action == TraceAction::kAlloc) ++allocs[e.stream];
  }
  StreamId best = 0;
  std::int64_t best_count = 0;
  for (const auto& [stream, count] : allocs) {
    if (count > best_count || (count == best_count && stream < best)) {
      best = stream;
      best_count = count;
    }
  }
  return best;
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

double Percent(double micros, std::int64_t span_us) {
  return span_us > 0 ? 100.0 * micros / static_cast<double>(span_us) : 0.0;
}

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

// One allocator on one simulated device, fed a trace's events one at a time.
class Replayer {
 public:
  Replayer(const Options& options, const ReplayConfig& config)
      : config_(config), backend_(SimConfig(config)), allocator_(options, &backend_) {
    live_.reserve(4096);
    allocator_.SetHooks(&tracker_);
  }
  ~Replayer() { allocator_.SetHooks(nullptr); }
  Replayer(const Replayer&) = delete;
  Replayer& operator=(const Replayer&) = delete;

  // Applies `event` and counts it in `tally`; true when it reached the allocator (an alloc, or
  // a free_completed of a live address). Errors: Replay's, naming the event's line.
  absl::StatusOr<bool> Apply(const TraceEvent& event, Tally* tally) {
    RecordedFigures& recorded = tally->recorded;
    if (config_.gpu_lag_us > 0) backend_.AdvanceClock(event.time_us);
    switch (event.action) {
      case TraceAction::kAlloc: {
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
        absl::StatusOr<DevicePtr> ptr = allocator_.Malloc(event.size, event.stream);
        if (!ptr.ok()) {
          const absl::string_view message = ptr.status().message();
          // The allocator's hint names the variable; a replay's user types --conf.
          const bool hint = absl::StrContains(message, "VRAMLEDGER_CONF=expandable_segments:True");
          return AtLine(config_, event, ptr.status().code(),
                        absl::StrCat("alloc of ", event.size, " bytes on stream ", event.stream,
                                     " failed (simulated capacity ", config_.capacity_bytes,
                                     " bytes): ", message,
                                     hint ? " (Here: --conf expandable_segments:True.)" : ""));
        }
        live_.emplace(event.addr, LiveBlock{*ptr, event.size});
        recorded.live += static_cast<std::int64_t>(event.size);
        recorded.peak_live = std::max(recorded.peak_live, recorded.live);
        ++tally->allocs;
        return true;
      }
      case TraceAction::kFreeCompleted: {
        auto it = live_.find(event.addr);
        if (it == live_.end()) {
          tally->unknown_frees.push_back({event.line, event.addr});
          return false;
        }
        if (absl::Status s = allocator_.Free(it->second.ours); !s.ok()) {
          return AtLine(config_, event, s.code(),
                        absl::StrCat("free of ", it->second.size, " bytes failed: ", s.message()));
        }
        recorded.live -= static_cast<std::int64_t>(it->second.size);
        live_.erase(it);
        ++tally->frees;
        return true;
      }
      case TraceAction::kSegmentAlloc:
      case TraceAction::kSegmentMap:
        recorded.Reserve(static_cast<std::int64_t>(event.size));
        ++tally->recorded_segment_allocs;
        if (event.action == TraceAction::kSegmentMap) ++tally->recorded_segment_maps;
        tally->recorded_modeled_driver_us += RecordedEventMicros(event);
        return false;
      case TraceAction::kSegmentFree:
      case TraceAction::kSegmentUnmap:
        recorded.Reserve(-static_cast<std::int64_t>(event.size));
        ++tally->recorded_segment_frees;
        tally->recorded_modeled_driver_us += RecordedEventMicros(event);
        return false;
      case TraceAction::kOom:
        ++tally->recorded_ooms;
        return false;
      case TraceAction::kSnapshot:
        ++tally->step_marks;
        return false;
      case TraceAction::kFreeRequested:
        return false;
    }
    return false;
  }

  // The allocator's figures now (GetStats(): use sparingly, see ReservedTracker).
  ReplayState State() const {
    const DeviceStats stats = allocator_.GetStats();
    return {stats.allocated_bytes[kAggregate].current, stats.reserved_bytes[kAggregate].current,
            stats.requested_bytes[kAggregate].current};
  }
  // Reserved bytes now, cheaply.
  std::int64_t reserved() const { return tracker_.reserved(); }

  DeviceAllocator& allocator() { return allocator_; }
  const DriverCallLedger& calls() const { return backend_.calls(); }
  std::int64_t live_blocks() const { return static_cast<std::int64_t>(live_.size()); }

 private:
  static SimBackend::Config SimConfig(const ReplayConfig& config) {
    SimBackend::Config sim;
    sim.capacity = config.capacity_bytes;
    sim.auto_complete_events = config.gpu_lag_us <= 0;
    sim.event_lag_us = config.gpu_lag_us;
    return sim;
  }

  const ReplayConfig& config_;
  SimBackend backend_;
  ReservedTracker tracker_;  // declared before the allocator, which borrows it
  DeviceAllocator allocator_;
  absl::flat_hash_map<DevicePtr, LiveBlock> live_;  // trace address -> block
};

// Fragmentation right after events[0 .. count): a second pass that stops there (the replay is
// deterministic; one GetFragmentation per new running peak cost far more on expandable runs).
absl::StatusOr<Fragmentation> FragmentationAfter(const std::vector<TraceEvent>& events,
                                                 std::int64_t count, StreamId stream,
                                                 const Options& options,
                                                 const ReplayConfig& config) {
  Replayer replayer(options, config);
  Tally scratch;
  for (std::int64_t i = 0; i < count; ++i) {
    absl::StatusOr<bool> applied = replayer.Apply(events[static_cast<std::size_t>(i)], &scratch);
    if (!applied.ok()) return applied.status();
  }
  return FragmentationOf(replayer.allocator(), stream);
}

}  // namespace

absl::StatusOr<ReplayResult> Replay(const std::vector<TraceEvent>& events, const Options& options,
                                    const ReplayConfig& config) {
  Replayer replayer(options, config);
  const DriverCallLedger& calls = replayer.calls();

  ReplayResult result;
  result.source = config.source;
  result.capacity_bytes = config.capacity_bytes;
  result.conf = options.conf_string;
  const auto total = static_cast<std::int64_t>(events.size());
  result.trace_events = total;
  result.main_stream = MainStream(events);
  if (!events.empty()) {
    result.first_time_us = events.front().time_us;
    result.last_time_us = events.back().time_us;
    result.trace_span_us = result.last_time_us - result.first_time_us;
  }

  // Steady state: events warmup+1 .. total.
  const double after = std::clamp(config.steady_state_after, 0.0, 1.0);
  const auto warmup =
      std::min(total, static_cast<std::int64_t>(after * static_cast<double>(total)));
  LedgerTotals at_warmup;
  std::int64_t warmup_time_us = result.first_time_us;

  std::optional<TimelineSampler> sampler;
  if (config.timeline) {
    result.sample_every =
        config.sample_every > 0 ? config.sample_every : TimelineSampler::AutomaticInterval(total);
    sampler.emplace(result.sample_every, total, &result.timeline);
  }
  // Per-step peaks need allocated bytes after every event; otherwise they are read only where a
  // timeline point needs them (GetStats() is costly, see ReservedTracker).
  const bool marks_steps = std::any_of(events.begin(), events.end(), [](const TraceEvent& e) {
    return e.action == TraceAction::kSnapshot;
  });
  StepTracker steps(&result.steps);
  steps.Open(ReplayState(), LedgerTotals());
  Tally tally;
  ReplayState state;
  std::int64_t peak_reserved_seen = 0;
  std::int64_t peak_recorded_seen = 0;

  for (std::int64_t index = 1; index <= total; ++index) {
    const TraceEvent& event = events[static_cast<std::size_t>(index - 1)];
    if (index > 1) {
      const std::int64_t before = events[static_cast<std::size_t>(index - 2)].time_us;
      if (event.time_us < before) {
        if (result.time_reversals++ == 0) {
          result.first_time_reversal_line = event.line;
          result.first_time_reversal_us = before - event.time_us;
        }
      }
    }
    absl::StatusOr<bool> replayed = replayer.Apply(event, &tally);
    if (!replayed.ok()) return replayed.status();

    std::array<bool, TimelineSampler::kNumCurves> new_peak{};
    if (*replayed) {
      state.reserved = replayer.reserved();
      state.requested = tally.recorded.live;  // the replay's requested bytes are the trace's
      if (state.reserved > peak_reserved_seen) {
        peak_reserved_seen = state.reserved;
        new_peak[TimelineSampler::kReserved] = true;
        result.peak_reserved_event = index;
        result.peak_reserved_line = event.line;
        result.peak_reserved_time_us = event.time_us;
      }
    }
    if (tally.recorded.reserved > peak_recorded_seen) {
      peak_recorded_seen = tally.recorded.reserved;
      new_peak[TimelineSampler::kRecordedReserved] = true;
    }
    const bool sampled = sampler.has_value() &&
                         (sampler->IsSamplePoint(index) || new_peak[TimelineSampler::kReserved] ||
                          new_peak[TimelineSampler::kRecordedReserved]);
    if ((*replayed && marks_steps) || sampled) state.allocated = replayer.State().allocated;
    steps.Observe(state, *replayed);
    if (event.action == TraceAction::kSnapshot) {
      steps.Close(event, /*complete=*/true, state, LedgerTotals::Of(calls));
    }
    if (index == warmup) {
      at_warmup = LedgerTotals::Of(calls);
      warmup_time_us = event.time_us;
    }
    if (sampled) {
      TimelinePoint point;
      point.event = index;
      point.line = event.line;
      point.time_us = event.time_us;
      point.allocated_bytes = state.allocated;
      point.reserved_bytes = state.reserved;
      point.requested_bytes = state.requested;
      point.recorded_reserved_bytes = tally.recorded.reserved;
      point.driver_us = calls.total_micros();
      sampler->Add(point, new_peak);
    }
  }

  result.allocs = tally.allocs;
  result.frees = tally.frees;
  result.events = result.allocs + result.frees;
  result.unknown_frees = std::move(tally.unknown_frees);
  result.reused_live_addresses = std::move(tally.reused_live_addresses);
  result.recorded_events = result.events + static_cast<std::int64_t>(result.unknown_frees.size());
  result.recorded_segment_allocs = tally.recorded_segment_allocs;
  result.recorded_segment_maps = tally.recorded_segment_maps;
  result.recorded_segment_frees = tally.recorded_segment_frees;
  result.recorded_ooms = tally.recorded_ooms;
  result.step_marks = tally.step_marks;

  DeviceAllocator& allocator = replayer.allocator();
  const DeviceStats stats = allocator.GetStats();
  if (stats.reserved_bytes[kAggregate].current != replayer.reserved()) {
    return absl::InternalError(absl::StrCat(
        config.source, ": reserved bytes from the allocator's segment events (",
        replayer.reserved(), ") differ from its stats (", stats.reserved_bytes[kAggregate].current,
        "); the replay's peak figures cannot be trusted"));
  }
  result.peak_allocated_bytes = stats.allocated_bytes[kAggregate].peak;
  result.peak_requested_bytes = stats.requested_bytes[kAggregate].peak;
  result.peak_reserved_bytes = stats.reserved_bytes[kAggregate].peak;
  result.final_reserved_bytes = stats.reserved_bytes[kAggregate].current;
  result.final_allocated_bytes = stats.allocated_bytes[kAggregate].current;
  result.utilization = stats.utilization();
  result.device_allocs = stats.num_device_alloc;
  result.device_frees = stats.num_device_free;
  result.alloc_retries = stats.num_alloc_retries;
  result.fragmentation_at_end = FragmentationOf(allocator, result.main_stream);
  result.page_moves = result.fragmentation_at_end.page_moves;
  result.reused_old_mappings = result.fragmentation_at_end.reused_old_mappings;

  // Read before the allocator's destructor returns its segments (those calls are not the trace's).
  const LedgerTotals end = LedgerTotals::Of(calls);
  result.driver_calls = end.CountsByName();
  result.driver_us = end.MicrosByName();
  result.modeled_driver_us = end.total_micros();
  result.driver_pct_of_span = Percent(result.modeled_driver_us, result.trace_span_us);
  if (result.step_marks > 0 && steps.open_events() > 0) {
    steps.Close(events.back(), /*complete=*/false, state, end);
  }

  SteadyState& steady = result.steady_state;
  const LedgerTotals steady_calls = end.Minus(at_warmup);
  steady.after_fraction = after;
  if (warmup < total) {
    steady.start_event = warmup + 1;
    steady.start_line = events[static_cast<std::size_t>(warmup)].line;
    steady.span_us = result.last_time_us - warmup_time_us;
  }
  steady.driver_calls = steady_calls.CountsByName();
  steady.driver_us = steady_calls.MicrosByName();
  steady.modeled_driver_us = steady_calls.total_micros();
  steady.pct_of_span = Percent(steady.modeled_driver_us, steady.span_us);

  const RecordedFigures& recorded = tally.recorded;
  result.trace_peak_requested_bytes = recorded.peak_live;
  result.recorded_peak_reserved_bytes = recorded.peak_reserved;
  result.recorded_utilization =
      recorded.peak_reserved > 0
          ? static_cast<double>(recorded.peak_live) / static_cast<double>(recorded.peak_reserved)
          : 0.0;
  result.recorded_modeled_driver_us = tally.recorded_modeled_driver_us;
  result.recorded_driver_pct_of_span =
      Percent(result.recorded_modeled_driver_us, result.trace_span_us);
  result.live_at_end = replayer.live_blocks();
  result.live_bytes_at_end = recorded.live;

  if (result.peak_reserved_event == total) {
    result.fragmentation_at_peak = result.fragmentation_at_end;
  } else if (result.peak_reserved_event > 0) {
    absl::StatusOr<Fragmentation> at_peak =
        FragmentationAfter(events, result.peak_reserved_event, result.main_stream, options, config);
    if (!at_peak.ok()) return at_peak.status();
    result.fragmentation_at_peak = *at_peak;
  }
  return result;
}

}  // namespace vramledger
