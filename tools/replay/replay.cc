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
#include "replay/replayer.h"
#include "vramledger/device_allocator.h"
#include "vramledger/device_backend.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

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

double Percent(double micros, std::int64_t span_us) {
  return span_us > 0 ? 100.0 * micros / static_cast<double>(span_us) : 0.0;
}

// Fragmentation right after events[0 .. count): a second pass that stops there (the replay is
// deterministic; one GetFragmentation per new running peak cost far more on expandable runs).
absl::StatusOr<Fragmentation> FragmentationAfter(const std::vector<TraceEvent>& events,
                                                 std::int64_t count, StreamId stream,
                                                 const Options& options,
                                                 const ReplayConfig& config) {
  absl::StatusOr<std::unique_ptr<Replayer>> replayer = Replayer::Create(events, options, config);
  if (!replayer.ok()) return replayer.status();
  Tally scratch;
  for (std::int64_t i = 0; i < count; ++i) {
    absl::StatusOr<Outcome> applied = (*replayer)->Apply(static_cast<std::size_t>(i), &scratch);
    if (!applied.ok()) return applied.status();
  }
  return FragmentationOf((*replayer)->allocator(), stream);
}

}  // namespace

absl::StatusOr<ReplayResult> Replay(const std::vector<TraceEvent>& events, const Options& options,
                                    const ReplayConfig& config) {
  absl::StatusOr<std::unique_ptr<Replayer>> created = Replayer::Create(events, options, config);
  if (!created.ok()) return created.status();
  Replayer& replayer = **created;
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
    absl::StatusOr<Outcome> outcome = replayer.Apply(static_cast<std::size_t>(index - 1), &tally);
    if (!outcome.ok()) return outcome.status();
    if (*outcome == Outcome::kRefused && !config.plan_keep_going) {
      result.plan.stopped = true;
      break;
    }
    // A release changes reserved bytes but is no replayed event (steps count alloc and free).
    const bool replayed = *outcome == Outcome::kReplayed;
    std::array<bool, TimelineSampler::kNumCurves> new_peak{};
    if (replayed || *outcome == Outcome::kReleased) {
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
    if ((replayed && marks_steps) || sampled) state.allocated = replayer.State().allocated;
    steps.Observe(state, replayed);
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
  result.releases = replayer.releases();
  if (const PlanFigures* plan = replayer.plan(); plan != nullptr) {
    const bool stopped = result.plan.stopped;
    result.plan = *plan;
    result.plan.stopped = stopped;
  }
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
