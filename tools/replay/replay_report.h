// Presents a ReplayResult: the JSON object of `--json`, the side-by-side table and the warnings.
// Pure functions of their arguments; thread-safe.
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
/// driver_calls ({CUDA API name: count}), modeled_driver_us (microseconds), and the other
/// ReplayResult fields under their own names; `unknown_frees` and `reused_live_addresses` are
/// counts, with the first `max_listed` of each as [{"line", "addr"}] under `*_listed`.
nlohmann::json ReplayResultToJson(const ReplayResult& result, std::size_t max_listed = 100);

/// The readable report: replay vs the trace's recorded figures, sizes in bytes and GiB, then
/// driver calls by kind (non-zero ones) with their modelled time. Ends with a newline.
std::string FormatReplayTable(const ReplayResult& result);

/// One line per anomaly kind (frees of unknown addresses, allocs of live addresses), each naming
/// the count and up to `max_lines` of its SOURCE:LINE places. Empty when there is none.
std::vector<std::string> ReplayWarnings(const ReplayResult& result, std::size_t max_lines = 5);

/// 27105552624 -> "27,105,552,624".
std::string WithThousands(std::int64_t value);

/// Microseconds with one decimal: 16996.64 -> "16,996.6".
std::string MicrosWithThousands(double micros);

/// Bytes as "27,105,552,624 B (25.24 GiB)".
std::string BytesAndGiB(std::int64_t bytes);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_REPORT_H_
