// A snapshot of a replayed trace: the trace runs through a DeviceAllocator on SimBackend with
// the memory history on, and the snapshot is taken at the moment of peak reserved or at the end.
// Stateless, thread-safe.
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAY_SNAPSHOT_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAY_SNAPSHOT_H_

#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ledger/snapshot.h"
#include "replay/replay.h"
#include "replay/trace_reader.h"
#include "vramledger/options.h"

namespace vramledger {

/// When the snapshot is taken.
enum class SnapshotMoment {
  kPeakReserved,  // right after the first event at which reserved bytes reach their peak
  kEnd,           // after the last event
};

/// "peak" / "end" -> the moment; nullopt for anything else.
std::optional<SnapshotMoment> ParseSnapshotMoment(std::string_view name);

/// How to replay and what to record.
struct ReplaySnapshotConfig {
  ReplayConfig replay;
  SnapshotMoment at = SnapshotMoment::kPeakReserved;
  /// Trace entries the history keeps (the most recent ones); >= 1.
  std::size_t max_entries = SIZE_MAX;
};

/// Replays `events` exactly as Replay() does (alloc -> Malloc, free_completed -> Free of the
/// mapped block, an alloc of a live address frees the earlier block first; the program's
/// releases empty the cache when config.replay.follow_releases; a plan in `options` guards the
/// device and, unless config.replay.plan_keep_going, stops the replay at its first refusal;
/// config.replay.gpu_lag_us delays fences as there) with a History recording every
/// state change (enabled "all", no stacks: a trace has none), and returns the snapshot at
/// `config.at`. For kPeakReserved the trace is replayed twice: once to find the event, once to stop
/// after it (the replay is deterministic). The snapshot's "vramledger" object gets "replay":
/// {source, at, events_replayed (trace events up to and including the stop), line (of the stop
/// event, 0 if none), reserved_bytes, peak_reserved_bytes, capacity_bytes}. Its segments'
/// total_size sums to Replay()'s peak_reserved_bytes for kPeakReserved.
/// Errors: as Replay() (ResourceExhausted "SOURCE:LINE: alloc of N bytes ... failed: ...").
absl::StatusOr<SnapshotJson> ReplaySnapshot(const std::vector<TraceEvent>& events,
                                            const Options& options,
                                            const ReplaySnapshotConfig& config);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_SNAPSHOT_H_
