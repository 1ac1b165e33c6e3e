// Finding a trace's releases and applying them to a replay (see trace_releases.h).
#include "replay/trace_releases.h"

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

bool IsRelease(TraceAction a) {
  return a == TraceAction::kSegmentFree || a == TraceAction::kSegmentUnmap;
}
bool IsGrowth(TraceAction a) {
  return a == TraceAction::kSegmentAlloc || a == TraceAction::kSegmentMap;
}

}  // namespace

std::vector<TraceRelease> FindTraceReleases(const std::vector<TraceEvent>& events) {
  std::vector<TraceRelease> out;
  std::int64_t reserved = 0;
  std::int64_t peak = 0;
  auto follow = [&](const TraceEvent& e) {
    if (IsGrowth(e.action)) reserved += static_cast<std::int64_t>(e.size);
    if (IsRelease(e.action)) reserved -= static_cast<std::int64_t>(e.size);
    peak = std::max(peak, reserved);
  };
  for (const TraceEvent& e : events) follow(e);
  const std::int64_t trace_peak = peak;
  reserved = 0;
  std::size_t i = 0;
  while (i < events.size()) {
    if (!IsRelease(events[i].action)) {
      follow(events[i]);
      ++i;
      continue;
    }
    TraceRelease r;
    r.reserved_before = reserved;
    r.first_line = events[i].line;
    bool unmaps_only = true;
    for (; i < events.size() && IsRelease(events[i].action); ++i) {
      r.last_index = i;
      r.last_line = events[i].line;
      ++r.segments;
      r.bytes += events[i].size;
      unmaps_only = unmaps_only && events[i].action == TraceAction::kSegmentUnmap;
      follow(events[i]);
    }
    // What follows before the next alloc or free: growth (the release served an allocation), or
    // nothing (an empty_cache() call). free_requested, snapshot and oom rows say nothing of it.
    bool maps_only = true;
    for (std::size_t j = i; j < events.size(); ++j) {
      const TraceAction a = events[j].action;
      if (IsGrowth(a)) {
        r.before_growth = true;
        r.growth_bytes += events[j].size;
        maps_only = maps_only && a == TraceAction::kSegmentMap;
      } else if (a == TraceAction::kAlloc || a == TraceAction::kFreeCompleted || IsRelease(a)) {
        break;
      }
    }
    r.possible_retry = r.before_growth &&
                       r.reserved_before + static_cast<std::int64_t>(r.growth_bytes) > trace_peak;
    const bool page_move = unmaps_only && r.before_growth && maps_only && r.growth_bytes == r.bytes;
    if (!page_move) out.push_back(r);
  }
  return out;
}

ReleaseFollower::ReleaseFollower(const std::vector<TraceEvent>& events, bool follow)
    : releases_(FindTraceReleases(events)) {
  figures_.followed = follow;
  figures_.runs = static_cast<std::int64_t>(releases_.size());
  for (const TraceRelease& r : releases_) {
    ++(r.possible_retry ? figures_.retry_runs : figures_.empty_cache_runs);
    figures_.trace_bytes += r.bytes;
  }
}

absl::StatusOr<bool> ReleaseFollower::After(std::size_t index, DeviceAllocator* allocator) {
  if (next_ >= releases_.size() || releases_[next_].last_index != index) return false;
  const TraceRelease& r = releases_[next_++];
  if (!figures_.followed) return false;
  const std::int64_t before = allocator->GetStats().reserved_bytes[kAggregate].current;
  if (r.possible_retry) {
    // torch ran out with `reserved_before` reserved and a segment of `growth_bytes` to make: its
    // cap was at least reserved_before. The replayed policy would have released only if it too was
    // that full.
    if (before + static_cast<std::int64_t>(r.growth_bytes) <= r.reserved_before) {
      ++figures_.skipped;
      return false;
    }
  }
  if (absl::Status s = allocator->EmptyCache(); !s.ok()) return s;
  const std::int64_t after = allocator->GetStats().reserved_bytes[kAggregate].current;
  ++figures_.applied;
  if (figures_.first_applied_line == 0) figures_.first_applied_line = r.last_line;
  if (before > after) figures_.replay_released_bytes += static_cast<std::uint64_t>(before - after);
  return true;
}

}  // namespace vramledger
