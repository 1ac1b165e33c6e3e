// Presents a ReplayResult: the JSON object of `--json`, the side-by-side table, the warnings and
// the timeline CSV. Pure functions of their arguments; thread-safe.
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAY_REPORT_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAY_REPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "replay/replay.h"

namespace vramledger {

/// The `--json` object. Keys: events, peak_allocated_bytes, peak_requested_bytes,
/// peak_reserved_bytes, utilization, recorded_peak_reserved_bytes, recorded_utilization,
/// driver_calls ({CUDA API name: count}), modeled_driver_us (microseconds), page_moves,
/// fragmentation_at_peak and fragmentation_at_end (ledger/fragmentation_json.h; the first also has
/// event, line and time_us of the peak), utilization_at_each_step ([] when the trace marks no
/// steps; one object per StepFigures), trace_span_us, driver_time_pct_of_span, steady_state
/// (SteadyState's fields, pct_of_span as driver_time_pct_of_span), and the other ReplayResult
/// fields under their own names (the timeline excepted: TimelineCsv); `unknown_frees` and
/// `reused_live_addresses` are counts, with the first `max_listed` of each as [{"line", "addr"}]
/// under `*_listed`.
nlohmann::json ReplayResultToJson(const ReplayResult& result, std::size_t max_listed = 100);

/// The header line of TimelineCsv (no newline).
inline constexpr const char* kTimelineCsvHeader =
    "event,line,time_us,allocated_bytes,reserved_bytes,wasted_bytes,requested_bytes,"
    "recorded_reserved_bytes,driver_us";

/// result.timeline as CSV: kTimelineCsvHeader, then one row per point (bytes as integers,
/// driver_us with 3 decimals), each line ending in '\n'.
std::string TimelineCsv(const ReplayResult& result);

/// The readable report: replay vs the trace's recorded figures, sizes in bytes and GiB, then
/// driver calls by kind (non-zero ones) with their modelled time, driver time as a share of the
/// trace's span (all, and the steady state), page moves, fragmentation at peak and at the end,
/// and per-step utilization when the trace marks steps. Ends with a newline.
std::string FormatReplayTable(const ReplayResult& result);

/// One line per anomaly kind (frees of unknown addresses, allocs of live addresses), each naming
/// the count and up to `max_lines` of its SOURCE:LINE places, and one for events out of time
/// order (their count and the first one's SOURCE:LINE). Empty when there is none.
std::vector<std::string> ReplayWarnings(const ReplayResult& result, std::size_t max_lines = 5);

/// 27105552624 -> "27,105,552,624".
std::string WithThousands(std::int64_t value);

/// Microseconds with one decimal: 16996.64 -> "16,996.6".
std::string MicrosWithThousands(double micros);

/// Bytes as "27,105,552,624 B (25.24 GiB)".
std::string BytesAndGiB(std::int64_t bytes);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_REPORT_H_
