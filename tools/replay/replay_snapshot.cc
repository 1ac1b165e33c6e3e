// ReplaySnapshot: Replay()'s event semantics in a loop that can stop after a chosen event,
// with the history installed, then BuildSnapshot. Stateless between calls; thread-safe.
#include "replay/replay_snapshot.h"

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "device/sim_backend.h"
#include "ledger/history.h"
#include "vramledger/device_allocator.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

absl::Status AtLine(const ReplayConfig& config, const TraceEvent& event, const absl::Status& s,
                    const std::string& what) {
  return absl::Status(s.code(),
                      absl::StrCat(config.source, ":", event.line, ": ", what, s.message()));
}

// Runs events[0..last] (inclusive) through `allocator` with Replay()'s rules, the simulated
// GPU's clock following the trace's times when config.gpu_lag_us > 0 (as Replay() does).
// `after_alloc(i)` runs after each successful alloc event i.
absl::Status RunEvents(const std::vector<TraceEvent>& events, std::size_t last,
                       const ReplayConfig& config, SimBackend& backend, DeviceAllocator& allocator,
                       const std::function<void(std::size_t)>& after_alloc) {
  absl::flat_hash_map<DevicePtr, DevicePtr> live;  // trace address -> ours
  live.reserve(4096);
  for (std::size_t i = 0; i <= last && i < events.size(); ++i) {
    const TraceEvent& event = events[i];
    if (config.gpu_lag_us > 0) backend.AdvanceClock(event.time_us);
    if (event.action == TraceAction::kAlloc) {
      if (auto it = live.find(event.addr); it != live.end()) {
        if (absl::Status s = allocator.Free(it->second); !s.ok()) {
          return AtLine(config, event, s, "free of the earlier block at a reused address failed: ");
        }
        live.erase(it);
      }
      absl::StatusOr<DevicePtr> ptr = allocator.Malloc(event.size, event.stream);
      if (!ptr.ok()) {
        return AtLine(
            config, event, ptr.status(),
            absl::StrCat("alloc of ", event.size, " bytes on stream ", event.stream,
                         " failed (simulated capacity ", config.capacity_bytes, " bytes): "));
      }
      live.emplace(event.addr, *ptr);
      if (after_alloc) after_alloc(i);
    } else if (event.action == TraceAction::kFreeCompleted) {
      auto it = live.find(event.addr);
      if (it == live.end()) continue;  // a free of an address the trace never allocated
      if (absl::Status s = allocator.Free(it->second); !s.ok()) {
        return AtLine(config, event, s, "free failed: ");
      }
      live.erase(it);
    }
  }
  return absl::OkStatus();
}

// As Replay()'s backend: fences complete at once, or gpu_lag_us of trace time after they are
// recorded.
SimBackend::Config SimConfig(const ReplayConfig& config) {
  SimBackend::Config sim;
  sim.capacity = config.capacity_bytes;
  sim.auto_complete_events = config.gpu_lag_us <= 0;
  sim.event_lag_us = config.gpu_lag_us;
  return sim;
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
    SimBackend backend(SimConfig(config.replay));
    DeviceAllocator allocator(options, &backend);
    std::size_t peak_index = 0;
    absl::Status s = RunEvents(events, last, config.replay, backend, allocator, [&](std::size_t i) {
      const std::int64_t reserved = allocator.GetStats().reserved_bytes[kAggregate].current;
      if (reserved > peak) {
        peak = reserved;
        peak_index = i;
      }
    });
    if (!s.ok()) return s;
    last = peak_index;
  }

  SimBackend backend(SimConfig(config.replay));
  DeviceAllocator allocator(options, &backend);
  HistorySettings settings;
  settings.enabled = HistoryEnabled::kAll;
  settings.context = HistoryContext::kNone;
  settings.max_entries = config.max_entries;
  History history(settings);
  allocator.SetHooks(&history);
  absl::Status s = RunEvents(events, last, config.replay, backend, allocator, nullptr);
  allocator.SetHooks(nullptr);
  if (!s.ok()) return s;

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
