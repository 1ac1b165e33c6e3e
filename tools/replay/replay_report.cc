// Presentation of replay figures: JSON for machines, a fixed-width table and warnings for people.
// Pure functions; thread-safe.
#include "replay/replay_report.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

nlohmann::json ListLines(const std::vector<LineAddress>& items, std::size_t max_listed) {
  nlohmann::json list = nlohmann::json::array();
  for (std::size_t i = 0; i < items.size() && i < max_listed; ++i) {
    list.push_back({{"line", items[i].line}, {"addr", items[i].addr}});
  }
  return list;
}

std::string Row(absl::string_view label, absl::string_view replay, absl::string_view recorded) {
  return absl::StrFormat("  %-16s %-36s %s\n", label, replay, recorded);
}

std::string Warning(const ReplayResult& result, const std::vector<LineAddress>& items,
                    absl::string_view what, std::size_t max_lines) {
  std::string line = absl::StrCat(items.size(), " ", what, "; at ");
  for (std::size_t i = 0; i < items.size() && i < max_lines; ++i) {
    absl::StrAppend(&line, i > 0 ? ", " : "", result.source, ":", items[i].line,
                    absl::StrFormat(" (addr 0x%x)", items[i].addr));
  }
  if (items.size() > max_lines) absl::StrAppend(&line, ", ...");
  return line;
}

}  // namespace

std::string WithThousands(std::int64_t value) {
  std::string digits =
      absl::StrCat(value < 0 ? -(value + 1) + std::uint64_t{1} : static_cast<std::uint64_t>(value));
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return value < 0 ? absl::StrCat("-", out) : out;
}

std::string MicrosWithThousands(double micros) {
  const std::string fixed = absl::StrFormat("%.1f", micros);
  const std::size_t dot = fixed.find('.');
  std::int64_t whole = 0;
  if (!absl::SimpleAtoi(absl::string_view(fixed).substr(0, dot), &whole)) return fixed;
  return absl::StrCat(fixed[0] == '-' && whole == 0 ? "-" : "", WithThousands(whole),
                      fixed.substr(dot));
}

std::string BytesAndGiB(std::int64_t bytes) {
  return absl::StrFormat("%s B (%.2f GiB)", WithThousands(bytes),
                         static_cast<double>(bytes) / static_cast<double>(kGiB));
}

nlohmann::json ReplayResultToJson(const ReplayResult& result, std::size_t max_listed) {
  nlohmann::json j;
  // The keys of issue 2, in its order.
  j["events"] = result.events;
  j["peak_allocated_bytes"] = result.peak_allocated_bytes;
  j["peak_requested_bytes"] = result.peak_requested_bytes;
  j["peak_reserved_bytes"] = result.peak_reserved_bytes;
  j["utilization"] = result.utilization;
  j["recorded_peak_reserved_bytes"] = result.recorded_peak_reserved_bytes;
  j["recorded_utilization"] = result.recorded_utilization;
  j["driver_calls"] = result.driver_calls;
  j["modeled_driver_us"] = result.modeled_driver_us;
  // Everything else.
  j["trace"] = result.source;
  j["capacity_bytes"] = result.capacity_bytes;
  j["conf"] = result.conf;
  j["allocs"] = result.allocs;
  j["frees"] = result.frees;
  j["final_reserved_bytes"] = result.final_reserved_bytes;
  j["device_allocs"] = result.device_allocs;
  j["device_frees"] = result.device_frees;
  j["alloc_retries"] = result.alloc_retries;
  j["driver_us"] = result.driver_us;
  j["trace_events"] = result.trace_events;
  j["recorded_events"] = result.recorded_events;
  j["trace_peak_requested_bytes"] = result.trace_peak_requested_bytes;
  j["recorded_segment_allocs"] = result.recorded_segment_allocs;
  j["recorded_segment_frees"] = result.recorded_segment_frees;
  j["recorded_ooms"] = result.recorded_ooms;
  j["unknown_frees"] = result.unknown_frees.size();
  j["unknown_frees_listed"] = ListLines(result.unknown_frees, max_listed);
  j["reused_live_addresses"] = result.reused_live_addresses.size();
  j["reused_live_addresses_listed"] = ListLines(result.reused_live_addresses, max_listed);
  j["live_at_end"] = result.live_at_end;
  j["live_bytes_at_end"] = result.live_bytes_at_end;
  return j;
}

std::string FormatReplayTable(const ReplayResult& result) {
  std::string out = absl::StrCat("vramledger replay of ", result.source, "\n");
  absl::StrAppend(&out, "  ", WithThousands(result.trace_events),
                  " trace events; simulated capacity ", BytesAndGiB(result.capacity_bytes),
                  "; conf: ", result.conf.empty() ? "(defaults)" : result.conf, "\n\n");
  absl::StrAppend(&out, Row("", "vramledger (replay)", "recorded (trace, torch)"));
  absl::StrAppend(
      &out, Row("events", WithThousands(result.events), WithThousands(result.recorded_events)));
  absl::StrAppend(&out, Row("peak allocated", BytesAndGiB(result.peak_allocated_bytes),
                            "n/a (the trace has requested sizes only)"));
  absl::StrAppend(&out, Row("peak requested", BytesAndGiB(result.peak_requested_bytes),
                            BytesAndGiB(result.trace_peak_requested_bytes)));
  absl::StrAppend(&out, Row("peak reserved", BytesAndGiB(result.peak_reserved_bytes),
                            result.recorded_segment_allocs > 0
                                ? BytesAndGiB(result.recorded_peak_reserved_bytes)
                                : "n/a (no segment events in the trace)"));
  absl::StrAppend(
      &out, Row("utilization", absl::StrFormat("%.4f (allocated / reserved)", result.utilization),
                result.recorded_peak_reserved_bytes > 0
                    ? absl::StrFormat("%.4f (requested / reserved)", result.recorded_utilization)
                    : std::string("n/a")));
  absl::StrAppend(&out, Row("segment allocs", WithThousands(result.device_allocs),
                            WithThousands(result.recorded_segment_allocs)));
  absl::StrAppend(&out, Row("segment frees", WithThousands(result.device_frees),
                            WithThousands(result.recorded_segment_frees)));

  absl::StrAppend(&out, absl::StrFormat("\n  %-24s %12s %16s\n", "driver calls (modelled)", "count",
                                        "time (us)"));
  std::int64_t total_calls = 0;
  for (const auto& [name, count] : result.driver_calls) {
    if (count == 0) continue;
    total_calls += count;
    const auto us = result.driver_us.find(name);
    absl::StrAppend(
        &out, absl::StrFormat("  %-24s %12s %16s\n", name, WithThousands(count),
                              MicrosWithThousands(us == result.driver_us.end() ? 0 : us->second)));
  }
  absl::StrAppend(&out, absl::StrFormat("  %-24s %12s %16s\n", "total", WithThousands(total_calls),
                                        MicrosWithThousands(result.modeled_driver_us)));
  absl::StrAppend(
      &out,
      absl::StrFormat("\n  live at end: %s blocks, %s; unknown frees: %d; "
                      "allocs of live addresses: %d\n",
                      WithThousands(result.live_at_end), BytesAndGiB(result.live_bytes_at_end),
                      result.unknown_frees.size(), result.reused_live_addresses.size()));
  return out;
}

std::vector<std::string> ReplayWarnings(const ReplayResult& result, std::size_t max_lines) {
  std::vector<std::string> warnings;
  if (!result.unknown_frees.empty()) {
    warnings.push_back(Warning(result, result.unknown_frees,
                               "free_completed events of addresses not live in the trace "
                               "(never allocated in it, or freed twice) were not replayed",
                               max_lines));
  }
  if (!result.reused_live_addresses.empty()) {
    warnings.push_back(Warning(result, result.reused_live_addresses,
                               "alloc events of addresses still live (the trace lost their "
                               "free; the earlier block was freed first)",
                               max_lines));
  }
  return warnings;
}

}  // namespace vramledger
