// The program's own releases in a recorded trace: runs of segment_free / segment_unmap events
// (torch.cuda.empty_cache(), or torch's release of its cache on an out-of-memory retry), found
// before the replay, and the follower that applies them to the replay's allocator at the point
// they happened. Design: docs/design/replay-releases.md. Not thread-safe (one replay's state).
#ifndef VRAMLEDGER_TOOLS_REPLAY_TRACE_RELEASES_H_
#define VRAMLEDGER_TOOLS_REPLAY_TRACE_RELEASES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "replay/trace_reader.h"
#include "vramledger/device_allocator.h"

namespace vramledger {

/// One release of the traced program: a maximal run of consecutive segment_free / segment_unmap
/// events. torch frees cached segments only in release_cached_blocks (empty_cache and the
/// out-of-memory retry), in release_available_cached_blocks and in the garbage collector, each
/// under the device lock, so their events are adjacent in the trace.
struct TraceRelease {
  std::size_t last_index = 0;  // 0-based index of the run's last event
  int first_line = 0;
  int last_line = 0;
  std::int64_t segments = 0;  // segment_free / segment_unmap events in the run
  std::uint64_t bytes = 0;    // their sizes
  /// The run is followed by segment_alloc / segment_map events before the next alloc or free.
  bool before_growth = false;
  /// Bytes of those following segment events.
  std::uint64_t growth_bytes = 0;
  /// The trace's reserved bytes just before the run (running sum of its segment events).
  std::int64_t reserved_before = 0;
  /// The release may be torch's out-of-memory retry: it is followed by growth, and reserved
  /// before it plus that growth passes every figure the trace's reserved bytes reached. torch
  /// retries only when reserved + the new segment would pass its cap, and reserved never passes
  /// the cap, so a release before a growth the trace reached elsewhere was the program's
  /// empty_cache() (then the next allocation made a segment in the emptied cache).
  bool possible_retry = false;
};

/// The releases of `events`, in trace order. A run of segment_unmap events followed by
/// segment_map events of exactly the same bytes is left out: it is a page moved by vramledger's
/// page recycling (a trace vramledger recorded), which the replay's allocator makes itself.
std::vector<TraceRelease> FindTraceReleases(const std::vector<TraceEvent>& events);

/// What following the releases did (ReplayResult::releases).
struct ReleaseFigures {
  bool followed = true;               // ReplayConfig::follow_releases
  std::int64_t runs = 0;              // releases in the trace
  std::int64_t empty_cache_runs = 0;  // of them, the program's empty_cache() calls
  std::int64_t retry_runs = 0;        // of them, possibly torch's out-of-memory retries
  std::uint64_t trace_bytes = 0;      // bytes the trace released in them
  /// EmptyCache calls the replay made for them (0 when not followed).
  std::int64_t applied = 0;
  /// Retry releases not applied: the replay was not as full as torch was when torch ran out.
  std::int64_t skipped = 0;
  /// Reserved bytes the replay's EmptyCache calls returned to the simulated device.
  std::uint64_t replay_released_bytes = 0;
  int first_applied_line = 0;  // line of the first applied release's last event (0: none)
};

/// Applies a trace's releases to a replay's allocator. Call After() after every trace event.
class ReleaseFollower {
 public:
  /// `follow` false only counts the releases.
  ReleaseFollower(const std::vector<TraceEvent>& events, bool follow);

  /// After events[index] was applied: at the last event of a release, calls
  /// allocator->EmptyCache() when the replayed policy would also have let go of its cache there:
  /// always for an empty_cache() call; for a possible retry only when the replay's reserved bytes
  /// plus the growth that followed the release pass torch's reserved bytes before the release
  /// (the least torch's cap can have been), i.e. when the replay would have run out at torch's
  /// cap too. Returns true when EmptyCache was called; the allocator's error otherwise.
  absl::StatusOr<bool> After(std::size_t index, DeviceAllocator* allocator);

  const ReleaseFigures& figures() const { return figures_; }

 private:
  std::vector<TraceRelease> releases_;
  std::size_t next_ = 0;  // the next release not yet reached
  ReleaseFigures figures_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_TRACE_RELEASES_H_
