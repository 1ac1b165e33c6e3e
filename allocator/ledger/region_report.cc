// Pausable regions in the ledger's reports (see region_report.h).
#include "ledger/region_report.h"

#include "absl/strings/str_cat.h"

namespace vramledger {
namespace {

// The figures of `r` in kRegionFigures' order.
std::vector<std::int64_t> Figures(const RegionInfo& r) {
  return {
      static_cast<std::int64_t>(r.reserved_bytes),  static_cast<std::int64_t>(r.mapped_bytes),
      static_cast<std::int64_t>(r.allocated_bytes), static_cast<std::int64_t>(r.paused_bytes),
      static_cast<std::int64_t>(r.backed_up_bytes), static_cast<std::int64_t>(r.host_buffer_bytes),
      static_cast<std::int64_t>(r.lost_bytes)};
}

}  // namespace

nlohmann::json RegionJson(int device, const RegionInfo& region) {
  nlohmann::json j = {{"device", device},
                      {"name", region.name},
                      {"pool", {region.pool.first, region.pool.second}},
                      {"paused", region.paused}};
  const std::vector<std::int64_t> figures = Figures(region);
  for (std::size_t i = 0; i < figures.size(); ++i) j[kRegionFigures[i]] = figures[i];
  return j;
}

std::vector<std::pair<std::string, std::int64_t>> FlattenRegionStats(
    const std::vector<RegionInfo>& regions) {
  std::vector<std::pair<std::string, std::int64_t>> out;
  for (const RegionInfo& r : regions) {
    const std::string prefix = absl::StrCat("regions.", r.name, ".");
    const std::vector<std::int64_t> figures = Figures(r);
    for (std::size_t i = 0; i < figures.size(); ++i) {
      out.emplace_back(absl::StrCat(prefix, kRegionFigures[i]), figures[i]);
    }
    out.emplace_back(absl::StrCat(prefix, "paused"), r.paused ? 1 : 0);
  }
  return out;
}

std::vector<std::string> RegionLines(const std::vector<RegionInfo>& regions) {
  std::vector<std::string> lines;
  for (const RegionInfo& r : regions) {
    lines.push_back(
        absl::StrCat("region ", r.name, ": ", r.paused ? "paused" : "running", ", reserved ",
                     FormatSize(r.reserved_bytes), ", mapped ", FormatSize(r.mapped_bytes),
                     ", allocated ", FormatSize(r.allocated_bytes), ", paused ",
                     FormatSize(r.paused_bytes), ", backed up ", FormatSize(r.backed_up_bytes)));
    // Only after a failed pause that could not map its pages back: said where it is seen.
    if (r.lost_bytes > 0) {
      absl::StrAppend(&lines.back(), ", lost ", FormatSize(r.lost_bytes),
                      " (unmapped under live blocks until the next pause and resume)");
    }
  }
  return lines;
}

}  // namespace vramledger
