// ReplaySnapshot: Replay()'s event semantics in a loop that can stop after a chosen event,
// with the history installed, then BuildSnapshot. Stateless between calls; thread-safe.
#include "replay/replay_snapshot.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "ledger/history.h"
#include "replay/replayer.h"
#include "vramledger/device_allocator.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

// Runs events[0..last] (inclusive) through a Replayer (Replay()'s rules: its releases, its plan,
// the simulated GPU's clock) with `observer` among its hooks; stops after a plan refusal unless
// config.plan_keep_going. `after_alloc(i, allocator)` runs after each alloc event i that went
// through. Returns the replayer, for the state at the stop.
absl::StatusOr<std::unique_ptr<Replayer>> RunEvents(
    const std::vector<TraceEvent>& events, std::size_t last, const Options& options,
    const ReplayConfig& config, AllocatorHooks* observer,
    const std::function<void(std::size_t, DeviceAllocator&)>& after_alloc) {
  absl::StatusOr<std::unique_ptr<Replayer>> replayer =
      Replayer::Create(events, options, config, observer);
  if (!replayer.ok()) return replayer.status();
  Tally tally;
  for (std::size_t i = 0; i <= last && i < events.size(); ++i) {
    absl::StatusOr<Outcome> outcome = (*replayer)->Apply(i, &tally);
    if (!outcome.ok()) return outcome.status();
    if (*outcome == Outcome::kRefused && !config.plan_keep_going) break;
    if (*outcome == Outcome::kReplayed && events[i].action == TraceAction::kAlloc && after_alloc) {
      after_alloc(i, (*replayer)->allocator());
    }
  }
  return replayer;
}

}  // namespace

std::optional<SnapshotMoment> ParseSnapshotMoment(std::string_view name) {
  if (name == "peak") return SnapshotMoment::kPeakReserved;
  if (name == "end") return SnapshotMoment::kEnd;
  return std::nullopt;
}

absl::StatusOr<SnapshotJson> ReplaySnapshot(const std::vector<TraceEvent>& events,
                                            const Options& options,
                                            const ReplaySnapshotConfig& config) {
  std::size_t last = events.empty() ? 0 : events.size() - 1;
  std::int64_t peak = 0;
  if (config.at == SnapshotMoment::kPeakReserved) {
    std::size_t peak_index = 0;
    absl::StatusOr<std::unique_ptr<Replayer>> pass = RunEvents(
        events, last, options, config.replay, nullptr,
        [&](std::size_t i, DeviceAllocator& allocator) {
          const std::int64_t reserved = allocator.GetStats().reserved_bytes[kAggregate].current;
          if (reserved > peak) {
            peak = reserved;
            peak_index = i;
          }
        });
    if (!pass.ok()) return pass.status();
    last = peak_index;
  }

  HistorySettings settings;
  settings.enabled = HistoryEnabled::kAll;
  settings.context = HistoryContext::kNone;
  settings.max_entries = config.max_entries;
  History history(settings);
  absl::StatusOr<std::unique_ptr<Replayer>> replayer =
      RunEvents(events, last, options, config.replay, &history, nullptr);
  if (!replayer.ok()) return replayer.status();
  DeviceAllocator& allocator = (*replayer)->allocator();

  const DeviceStats stats = allocator.GetStats();
  SnapshotOptions snapshot_options;
  SnapshotJson replay = SnapshotJson::object();
  replay["source"] = config.replay.source;
  replay["at"] = config.at == SnapshotMoment::kPeakReserved ? "peak" : "end";
  replay["events_replayed"] = events.empty() ? 0 : last + 1;
  replay["line"] = events.empty() ? 0 : events[last].line;
  replay["reserved_bytes"] = stats.reserved_bytes[kAggregate].current;
  replay["peak_reserved_bytes"] = stats.reserved_bytes[kAggregate].peak;
  replay["capacity_bytes"] = config.replay.capacity_bytes;
  snapshot_options.extra["replay"] = std::move(replay);
  // The allocator is still alive: its segments are the state at the stop event.
  return BuildSnapshot({&allocator}, &history, snapshot_options);
}

}  // namespace vramledger
