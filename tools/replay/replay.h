// Trace replay: runs a recorded trace's alloc / free_completed events through a DeviceAllocator
// on a SimBackend and sets its figures (peaks, timeline, steps, fragmentation, driver time) beside
// the ones the trace recorded. Stateless, thread-safe.
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAY_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "replay/replay_plan.h"
#include "replay/trace_reader.h"
#include "replay/trace_releases.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"
#include "vramledger/types.h"

namespace vramledger {

/// torch.cuda.get_device_properties(0).total_memory of the H200 the bundled traces come from.
inline constexpr std::size_t kH200TotalBytes = 150109880320;

/// Timeline points aimed at when ReplayConfig::sample_every is 0 (automatic).
inline constexpr std::int64_t kTimelineTargetPoints = 2000;

/// How to replay.
struct ReplayConfig {
  /// Simulated device capacity in bytes.
  std::size_t capacity_bytes = kH200TotalBytes;
  /// Names the trace in messages ("SOURCE:LINE: ..."), e.g. its path.
  std::string source = "<trace>";
  /// Fill ReplayResult::timeline.
  bool timeline = false;
  /// Timeline: a point after every `sample_every`-th trace event (and after the last one);
  /// 0 = ceil(trace events / kTimelineTargetPoints). Negative is treated as 0.
  std::int64_t sample_every = 0;
  /// The steady state is every trace event after the first `steady_state_after` fraction of
  /// them (in [0, 1)); its driver calls are reported apart (ReplayResult::steady_state).
  double steady_state_after = 0.25;
  /// The simulated GPU runs this many microseconds of trace time behind the host: an event
  /// (fence) the allocator records completes once the trace's clock has passed it by this much.
  /// 0: at once, as before. Models the H200, where the host queues a step's work ahead.
  std::int64_t gpu_lag_us = 0;
  /// Empty the allocator's cache where the trace shows the program's releases (runs of
  /// segment_free / segment_unmap: empty_cache() calls, torch's out-of-memory retries; see
  /// trace_releases.h). false: they feed the recorded figures only.
  bool follow_releases = true;
  /// The device whose plan rules apply when Options::process.plan names a plan file.
  int device = 0;
  /// With a plan: a refused alloc is counted and skipped (its free ignored) and the replay goes
  /// on; false: the replay stops at the first refusal.
  bool plan_keep_going = false;
  /// Refusals kept with their messages (PlanFigures::listed).
  std::size_t max_refusals_listed = 10;
};

/// One point of the timeline: the state after trace event number `event`. Bytes are bytes.
struct TimelinePoint {
  std::int64_t event = 0;    // 1-based index into the trace's events (all actions)
  int line = 0;              // the event's source line
  std::int64_t time_us = 0;  // the event's time_us
  // The replay (allocated_bytes, reserved_bytes, requested_bytes of the "all" pool, current).
  std::int64_t allocated_bytes = 0;
  std::int64_t reserved_bytes = 0;
  std::int64_t requested_bytes = 0;
  /// The trace's own reserved bytes (running sum of its segment events), torch's curve.
  std::int64_t recorded_reserved_bytes = 0;
  /// Modelled driver time of the replay so far, microseconds.
  double driver_us = 0.0;

  /// reserved - allocated: cached or fragmented bytes of the replay.
  std::int64_t wasted_bytes() const { return reserved_bytes - allocated_bytes; }
};

/// One training step of a trace that marks its steps (a `snapshot` event ends a step; see
/// docs/design/replay-timeline.md). Bytes are bytes; times microseconds.
struct StepFigures {
  int end_line = 0;              // line of the `snapshot` event that ends it (0: unterminated)
  std::int64_t end_time_us = 0;  // time_us of that event (of the trace's last event if none)
  bool complete = true;          // false for events after the last mark
  std::int64_t events = 0;       // alloc + free_completed events replayed in the step
  /// Peaks within the step (values carried in from the step before count too).
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t peak_reserved_bytes = 0;
  /// peak_allocated_bytes / peak_reserved_bytes (0 when nothing was reserved).
  double utilization = 0.0;
  /// Driver calls the replay made during the step, and their modelled time.
  std::int64_t driver_calls = 0;
  /// Of driver_calls, those that allocate, map, grant access to, unmap or free device memory
  /// (cudaMalloc / cudaFree, cuMem*; LedgerTotals::memory_calls); the rest are events, waits
  /// and queries (a moved page's fence is a cudaEventRecord and a later cudaEventQuery).
  std::int64_t memory_calls = 0;
  double modeled_driver_us = 0.0;
};

/// Driver calls made after the first ReplayConfig::steady_state_after of the trace's events.
struct SteadyState {
  double after_fraction = 0.25;  // ReplayConfig::steady_state_after
  std::int64_t start_event = 0;  // 1-based index of the first steady-state event (0: none)
  int start_line = 0;            // its line
  /// time_us of the last event before the steady state (or of the first event) to the last.
  std::int64_t span_us = 0;
  std::map<std::string, std::int64_t> driver_calls;  // by CUDA API name, every kind
  std::map<std::string, double> driver_us;
  double modeled_driver_us = 0.0;
  /// modeled_driver_us / span_us x 100 (0 when the span is 0).
  double pct_of_span = 0.0;
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
  /// reserved_bytes and allocated_bytes at the end of the replay (nothing released on purpose).
  std::int64_t final_reserved_bytes = 0;
  std::int64_t final_allocated_bytes = 0;
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
  /// Whole physical pages moved by page recycling (Fragmentation::page_moves at the end).
  std::int64_t page_moves = 0;
  /// Of those, moves back to an address that still mapped the handle (keep_old_mappings): no
  /// driver call.
  std::int64_t reused_old_mappings = 0;

  // ---- Time ----
  /// time_us of the trace's first and last events, and last - first.
  std::int64_t first_time_us = 0;
  std::int64_t last_time_us = 0;
  std::int64_t trace_span_us = 0;
  /// modeled_driver_us / trace_span_us x 100 (0 when the span is 0).
  double driver_pct_of_span = 0.0;
  SteadyState steady_state;

  // ---- Fragmentation (DeviceAllocator::GetFragmentation of main_stream) ----
  /// The stream with the most alloc events (the lowest id among equals): "the current stream"
  /// for Fragmentation::other_stream_cached_bytes.
  StreamId main_stream = 0;
  /// Taken right after the event at which reserved bytes first reached their peak.
  Fragmentation fragmentation_at_peak;
  std::int64_t peak_reserved_event = 0;  // that event's 1-based index (0: nothing reserved)
  int peak_reserved_line = 0;
  std::int64_t peak_reserved_time_us = 0;
  /// Taken after the last event.
  Fragmentation fragmentation_at_end;

  // ---- Steps and timeline ----
  /// `snapshot` events in the trace (step marks).
  std::int64_t step_marks = 0;
  /// One entry per step when the trace marks steps; empty otherwise.
  std::vector<StepFigures> steps;
  /// The sampling interval used (0 when no timeline was asked for).
  std::int64_t sample_every = 0;
  /// Points in event order: after every sample_every-th event and after the last one, plus,
  /// within each interval, the last event that set a new running peak of allocated, reserved or
  /// recorded reserved bytes (so the curves' maxima are the reported peaks).
  std::vector<TimelinePoint> timeline;

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
  std::int64_t recorded_segment_maps = 0;    // segment_map: torch ran with expandable segments
  std::int64_t recorded_segment_frees = 0;   // segment_free + segment_unmap events
  std::int64_t recorded_ooms = 0;            // oom events
  /// The trace's segment events priced with SimBackend's cost model: segment_alloc/free as one
  /// cudaMalloc/cudaFree of their size; segment_map/unmap as torch's expandable segments make
  /// them, per handle (20 MiB, or 2 MiB when the size is not a multiple of 20 MiB):
  /// cuMemCreate + cuMemMap + cuMemSetAccess, and cuMemUnmap + cuMemRelease. Microseconds.
  double recorded_modeled_driver_us = 0.0;
  /// recorded_modeled_driver_us / trace_span_us x 100 (0 when the span is 0).
  double recorded_driver_pct_of_span = 0.0;

  // ---- The program's releases and the plan ----
  /// The trace's releases and what the replay did with them.
  ReleaseFigures releases;
  /// The plan enforced (Options::process.plan), its refusals and warnings; path empty: none.
  /// When plan.stopped, the figures above cover the events before the refused one.
  PlanFigures plan;

  // ---- Anomalies (reported, never ignored) ----
  /// free_completed events of addresses not live in the replay (not allocated by the trace, or
  /// already freed). A snapshot's ring buffer starts mid-run, so it has some by nature.
  std::vector<LineAddress> unknown_frees;
  /// alloc events of an address that was still live; the earlier block was freed first
  /// (torch could only hand the address out again once it was free).
  std::vector<LineAddress> reused_live_addresses;
  /// Events whose time_us is earlier than the event before them: the trace is not in time order,
  /// so its span and the driver-time shares are not meaningful (the memory figures are).
  std::int64_t time_reversals = 0;
  int first_time_reversal_line = 0;          // the first such event's line (0: none)
  std::int64_t first_time_reversal_us = 0;   // how much earlier than the event before it
  /// Blocks still live at the end (a trace may end with work in flight) and their requested bytes.
  std::int64_t live_at_end = 0;
  std::int64_t live_bytes_at_end = 0;
};

/// Replays `events` in order: alloc -> Malloc(size, stream) (the trace's stream id passed
/// through), free_completed -> Free (free_requested is ignored: the memory became reusable at
/// free_completed); segment and oom events feed the recorded figures, and the last event of a
/// release of the program's empties the cache (config.follow_releases); a `snapshot` event ends
/// a step. With a plan (Options::process.plan) a BudgetGuard guards the simulated device: a
/// refusal is reported in ReplayResult::plan, not as an error.
/// Errors: ResourceExhausted "SOURCE:LINE: alloc of N bytes on stream S failed: <allocator
/// message>" when the simulated device runs out (the replay stops there); any other allocator
/// or backend failure with its line in the same shape; the plan file's errors (InvalidArgument
/// naming its line and field, NotFound).
absl::StatusOr<ReplayResult> Replay(const std::vector<TraceEvent>& events, const Options& options,
                                    const ReplayConfig& config);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_H_
