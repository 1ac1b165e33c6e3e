// Pausable regions in the ledger's reports (docs/design/regions.md, "In the ledger"): each
// region's figures as JSON, as flat memory_stats keys, and as the lines memory_summary and the
// out-of-memory report print. Stateless.
#ifndef VRAMLEDGER_LEDGER_REGION_REPORT_H_
#define VRAMLEDGER_LEDGER_REGION_REPORT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"
#include "vramledger/device_allocator.h"

namespace vramledger {

/// The figures of a region, in the order the reports list them: name in the keys, bytes in the
/// values (docs/design/regions.md lists their meanings).
inline constexpr const char* kRegionFigures[] = {
    "reserved_bytes",  "mapped_bytes",      "allocated_bytes", "paused_bytes",
    "backed_up_bytes", "host_buffer_bytes", "lost_bytes"};

/// {"device", "name", "pool": [first, second], "paused", and every kRegionFigures field}.
nlohmann::json RegionJson(int device, const RegionInfo& region);

/// memory_stats keys of every region: "regions.<name>.<figure>" for each of kRegionFigures
/// (bytes) and "regions.<name>.paused" (0 or 1), in region order.
std::vector<std::pair<std::string, std::int64_t>> FlattenRegionStats(
    const std::vector<RegionInfo>& regions);

/// One line per region for memory_summary and the out-of-memory report:
/// "region <name>: running|paused, reserved X, mapped X, allocated X, paused X, backed up X",
/// then ", lost X (...)" when a failed pause lost pages; empty when there is no region.
std::vector<std::string> RegionLines(const std::vector<RegionInfo>& regions);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_REGION_REPORT_H_
