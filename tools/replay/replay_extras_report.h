// Presents the parts of a ReplayResult that follow the program's releases and the plan: their
// JSON objects and their lines in the table. Pure functions; thread-safe.
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAY_EXTRAS_REPORT_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAY_EXTRAS_REPORT_H_

#include <string>

#include "nlohmann/json.hpp"
#include "replay/replay.h"

namespace vramledger {

/// {"followed", "runs", "empty_cache_runs", "retry_runs", "trace_bytes", "applied", "skipped",
/// "replay_released_bytes", "first_applied_line"} (ReleaseFigures' fields).
nlohmann::json ReleaseFiguresJson(const ReleaseFigures& releases);

/// null without a plan; else {"path", "device", "cap_bytes", "keep_going", "refusals",
/// "stopped", "warnings", "first_warning", "listed": [{"event", "line", "row", "plan_line",
/// "rule", "message"}]}.
nlohmann::json PlanFiguresJson(const PlanFigures& plan);

/// The table's lines for the releases (empty when the trace has none) and the plan (empty
/// without one), each line starting with two spaces and ending in '\n'. `source` names the trace.
std::string FormatReleases(const ReleaseFigures& releases);
std::string FormatPlan(const PlanFigures& plan, const std::string& source);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_EXTRAS_REPORT_H_
