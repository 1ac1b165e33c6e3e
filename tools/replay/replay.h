// Trace replay: runs a recorded trace's alloc / free_completed events through a DeviceAllocator
// on a SimBackend and sets its figures beside the ones the trace recorded. Stateless, thread-safe.
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAY_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "replay/trace_reader.h"
#include "vramledger/options.h"
#include "vramledger/types.h"

namespace vramledger {

/// torch.cuda.get_device_properties(0).total_memory of the H200 the bundled traces come from.
inline constexpr std::size_t kH200TotalBytes = 150109880320;

/// How to replay.
struct ReplayConfig {
  /// Simulated device capacity in bytes.
  std::size_t capacity_bytes = kH200TotalBytes;
  /// Names the trace in messages ("SOURCE:LINE: ..."), e.g. its path.
  std::string source = "<trace>";
};

/// A trace line that referred to an address, for reporting.
struct LineAddress {
  int line = 0;
  DevicePtr addr = 0;
};

/// Figures of one replay. Bytes are bytes; times are microseconds.
struct ReplayResult {
  // ---- What was replayed ----
  std::string source;              // ReplayConfig::source
  std::size_t capacity_bytes = 0;  // ReplayConfig::capacity_bytes
  std::string conf;                // Options::conf_string the allocator ran with

  // ---- The replay (vramledger on SimBackend) ----
  /// alloc + free_completed events replayed through the allocator.
  std::int64_t events = 0;
  std::int64_t allocs = 0;
  std::int64_t frees = 0;
  /// Peaks of allocated_bytes (rounded), requested_bytes and reserved_bytes ("all" pool).
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t peak_requested_bytes = 0;
  std::int64_t peak_reserved_bytes = 0;
  /// reserved_bytes at the end of the replay (nothing released on purpose).
  std::int64_t final_reserved_bytes = 0;
  /// peak_allocated_bytes / peak_reserved_bytes; 0 when nothing was reserved.
  double utilization = 0.0;
  /// Segment allocations and frees the allocator made (num_device_alloc / num_device_free).
  std::int64_t device_allocs = 0;
  std::int64_t device_frees = 0;
  std::int64_t alloc_retries = 0;
  /// Driver calls by CUDA API name (every kind, zero counts included) and their modelled time.
  std::map<std::string, std::int64_t> driver_calls;
  std::map<std::string, double> driver_us;
  double modeled_driver_us = 0.0;

  // ---- The trace as recorded (torch's allocator) ----
  /// Every event of the trace, of any action.
  std::int64_t trace_events = 0;
  /// alloc + free_completed events of the trace (unknown frees included).
  std::int64_t recorded_events = 0;
  /// Peak of the trace's live requested bytes: alloc sizes minus free_completed sizes, counting
  /// only frees of addresses the trace allocated. The replay's peak_requested_bytes must match.
  std::int64_t trace_peak_requested_bytes = 0;
  /// Peak of the trace's reserved bytes: running sum of segment_alloc / segment_map sizes minus
  /// segment_free / segment_unmap sizes. 0 when the trace has no segment events.
  std::int64_t recorded_peak_reserved_bytes = 0;
  /// trace_peak_requested_bytes / recorded_peak_reserved_bytes (0 when nothing was reserved).
  /// The trace carries requested sizes only, not torch's rounded block sizes, so this is the
  /// requested-bytes utilization; torch's own figure uses allocated bytes, which on the bundled
  /// GPT-2 run were 0.09% above requested (traces/README.md, reference/h200-baselines.jsonl).
  double recorded_utilization = 0.0;
  std::int64_t recorded_segment_allocs = 0;  // segment_alloc + segment_map events
  std::int64_t recorded_segment_frees = 0;   // segment_free + segment_unmap events
  std::int64_t recorded_ooms = 0;            // oom events

  // ---- Anomalies (reported, never ignored) ----
  /// free_completed events of addresses not live in the replay (not allocated by the trace, or
  /// already freed). A snapshot's ring buffer starts mid-run, so it has some by nature.
  std::vector<LineAddress> unknown_frees;
  /// alloc events of an address that was still live; the earlier block was freed first
  /// (torch could only hand the address out again once it was free).
  std::vector<LineAddress> reused_live_addresses;
  /// Blocks still live at the end (a trace may end with work in flight) and their requested bytes.
  std::int64_t live_at_end = 0;
  std::int64_t live_bytes_at_end = 0;
};

/// Replays `events` in order: alloc -> Malloc(size, stream) (the trace's stream id passed
/// through), free_completed -> Free (free_requested is ignored: the memory became reusable at
/// free_completed); segment and oom events feed the recorded figures only.
/// Errors: ResourceExhausted "SOURCE:LINE: alloc of N bytes on stream S failed: <allocator
/// message>" when the simulated device runs out (the replay stops there); any other allocator
/// or backend failure with its line in the same shape.
absl::StatusOr<ReplayResult> Replay(const std::vector<TraceEvent>& events, const Options& options,
                                    const ReplayConfig& config);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_H_
