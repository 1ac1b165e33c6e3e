// Trace replay on SimBackend: one allocator and one simulated device per call, the trace's
// addresses mapped to the allocator's. Stateless between calls; thread-safe.
#include "replay/replay.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "device/sim_backend.h"
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

absl::Status AtLine(const ReplayConfig& config, const TraceEvent& event, absl::StatusCode code,
                    absl::string_view what) {
  return absl::Status(code, absl::StrCat(config.source, ":", event.line, ": ", what));
}

}  // namespace

absl::StatusOr<ReplayResult> Replay(const std::vector<TraceEvent>& events, const Options& options,
                                    const ReplayConfig& config) {
  SimBackend::Config sim_config;
  sim_config.capacity = config.capacity_bytes;
  sim_config.auto_complete_events = true;
  SimBackend backend(sim_config);
  DeviceAllocator allocator(options, &backend);

  ReplayResult result;
  result.source = config.source;
  result.capacity_bytes = config.capacity_bytes;
  result.conf = options.conf_string;
  result.trace_events = static_cast<std::int64_t>(events.size());
  RecordedFigures recorded;
  absl::flat_hash_map<DevicePtr, LiveBlock> live;  // trace address -> block
  live.reserve(4096);

  for (const TraceEvent& event : events) {
    switch (event.action) {
      case TraceAction::kAlloc: {
        if (auto it = live.find(event.addr); it != live.end()) {
          // The trace lost a free: release the earlier block as torch must have.
          result.reused_live_addresses.push_back({event.line, event.addr});
          if (absl::Status s = allocator.Free(it->second.ours); !s.ok()) {
            return AtLine(config, event, s.code(),
                          absl::StrCat("free of the earlier block at reused address ", event.addr,
                                       " failed: ", s.message()));
          }
          recorded.live -= static_cast<std::int64_t>(it->second.size);
          live.erase(it);
        }
        absl::StatusOr<DevicePtr> ptr = allocator.Malloc(event.size, event.stream);
        if (!ptr.ok()) {
          return AtLine(config, event, ptr.status().code(),
                        absl::StrCat("alloc of ", event.size, " bytes on stream ", event.stream,
                                     " failed (simulated capacity ", config.capacity_bytes,
                                     " bytes): ", ptr.status().message()));
        }
        live.emplace(event.addr, LiveBlock{*ptr, event.size});
        recorded.live += static_cast<std::int64_t>(event.size);
        recorded.peak_live = std::max(recorded.peak_live, recorded.live);
        ++result.allocs;
        break;
      }
      case TraceAction::kFreeCompleted: {
        auto it = live.find(event.addr);
        if (it == live.end()) {
          result.unknown_frees.push_back({event.line, event.addr});
          break;
        }
        if (absl::Status s = allocator.Free(it->second.ours); !s.ok()) {
          return AtLine(config, event, s.code(),
                        absl::StrCat("free of ", it->second.size, " bytes failed: ", s.message()));
        }
        recorded.live -= static_cast<std::int64_t>(it->second.size);
        live.erase(it);
        ++result.frees;
        break;
      }
      case TraceAction::kSegmentAlloc:
      case TraceAction::kSegmentMap:
        recorded.Reserve(static_cast<std::int64_t>(event.size));
        ++result.recorded_segment_allocs;
        break;
      case TraceAction::kSegmentFree:
      case TraceAction::kSegmentUnmap:
        recorded.Reserve(-static_cast<std::int64_t>(event.size));
        ++result.recorded_segment_frees;
        break;
      case TraceAction::kOom:
        ++result.recorded_ooms;
        break;
      case TraceAction::kFreeRequested:
      case TraceAction::kSnapshot:
        break;
    }
  }
  result.events = result.allocs + result.frees;
  result.recorded_events = result.events + static_cast<std::int64_t>(result.unknown_frees.size());

  const DeviceStats stats = allocator.GetStats();
  result.peak_allocated_bytes = stats.allocated_bytes[kAggregate].peak;
  result.peak_requested_bytes = stats.requested_bytes[kAggregate].peak;
  result.peak_reserved_bytes = stats.reserved_bytes[kAggregate].peak;
  result.final_reserved_bytes = stats.reserved_bytes[kAggregate].current;
  result.utilization = stats.utilization();
  result.device_allocs = stats.num_device_alloc;
  result.device_frees = stats.num_device_free;
  result.alloc_retries = stats.num_alloc_retries;

  // Read before the allocator's destructor returns its segments (those calls are not the trace's).
  const DriverCallLedger& calls = backend.calls();
  for (int i = 0; i < kNumDriverCalls; ++i) {
    const auto call = static_cast<DriverCall>(i);
    const std::string name(DriverCallName(call));
    result.driver_calls[name] = calls.count(call);
    result.driver_us[name] = calls.micros(call);
  }
  result.modeled_driver_us = calls.total_micros();

  result.trace_peak_requested_bytes = recorded.peak_live;
  result.recorded_peak_reserved_bytes = recorded.peak_reserved;
  result.recorded_utilization =
      recorded.peak_reserved > 0
          ? static_cast<double>(recorded.peak_live) / static_cast<double>(recorded.peak_reserved)
          : 0.0;
  result.live_at_end = static_cast<std::int64_t>(live.size());
  result.live_bytes_at_end = recorded.live;
  return result;
}

}  // namespace vramledger
