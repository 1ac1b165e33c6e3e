// Presentation of replay figures: JSON for machines, a fixed-width table and warnings for people,
// the timeline as CSV. Pure functions; thread-safe.
#include "replay/replay_report.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "ledger/fragmentation_json.h"
#include "replay/replay_extras_report.h"
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

// The recorded column's heading: which policy wrote the trace's segments, so a replay under
// another conf is not read as that policy's figures. Mapped pages are expandable segments'.
std::string RecordedHeading(const ReplayResult& r) {
  if (r.recorded_segment_maps > 0) return "recorded (trace, expandable)";
  if (r.recorded_segment_allocs > 0) return "recorded (trace, native)";
  return "recorded (trace)";
}

std::string Row(absl::string_view label, absl::string_view replay, absl::string_view recorded) {
  return absl::StrFormat("  %-19s %-36s %s\n", label, replay, recorded);
}

nlohmann::json SteadyStateToJson(const SteadyState& s) {
  return {{"after_fraction", s.after_fraction},
          {"start_event", s.start_event},
          {"start_line", s.start_line},
          {"span_us", s.span_us},
          {"driver_calls", s.driver_calls},
          {"driver_us", s.driver_us},
          {"modeled_driver_us", s.modeled_driver_us},
          {"driver_time_pct_of_span", s.pct_of_span}};
}

nlohmann::json StepToJson(std::size_t index, const StepFigures& step) {
  return {{"step", index + 1},
          {"end_line", step.end_line},
          {"end_time_us", step.end_time_us},
          {"complete", step.complete},
          {"events", step.events},
          {"peak_allocated_bytes", step.peak_allocated_bytes},
          {"peak_reserved_bytes", step.peak_reserved_bytes},
          {"utilization", step.utilization},
          {"driver_calls", step.driver_calls},
          {"memory_calls", step.memory_calls},
          {"modeled_driver_us", step.modeled_driver_us}};
}

std::int64_t TotalCalls(const std::map<std::string, std::int64_t>& calls) {
  std::int64_t n = 0;
  for (const auto& [name, count] : calls) n += count;
  return n;
}

std::string Seconds(std::int64_t micros) {
  return absl::StrFormat("%.3f s", static_cast<double>(micros) / 1e6);
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

std::string TimelineCsv(const ReplayResult& result) {
  std::string out = absl::StrCat(kTimelineCsvHeader, "\n");
  out.reserve(out.size() + result.timeline.size() * 96);
  for (const TimelinePoint& p : result.timeline) {
    absl::StrAppend(&out, p.event, ",", p.line, ",", p.time_us, ",", p.allocated_bytes, ",",
                    p.reserved_bytes, ",", p.wasted_bytes(), ",", p.requested_bytes, ",",
                    p.recorded_reserved_bytes, ",", absl::StrFormat("%.3f", p.driver_us), "\n");
  }
  return out;
}

nlohmann::json ReplayResultToJson(const ReplayResult& result, std::size_t max_listed) {
  nlohmann::json j;
  // The headline figures first: what torch recorded beside what vramledger did.
  j["events"] = result.events;
  j["peak_allocated_bytes"] = result.peak_allocated_bytes;
  j["peak_requested_bytes"] = result.peak_requested_bytes;
  j["peak_reserved_bytes"] = result.peak_reserved_bytes;
  j["utilization"] = result.utilization;
  j["recorded_peak_reserved_bytes"] = result.recorded_peak_reserved_bytes;
  j["recorded_utilization"] = result.recorded_utilization;
  j["driver_calls"] = result.driver_calls;
  j["modeled_driver_us"] = result.modeled_driver_us;
  // Expandable segments: page moves and their driver cost.
  j["page_moves"] = result.page_moves;
  j["reused_old_mappings"] = result.reused_old_mappings;
  nlohmann::json at_peak = FragmentationJson(result.fragmentation_at_peak);
  at_peak["event"] = result.peak_reserved_event;
  at_peak["line"] = result.peak_reserved_line;
  at_peak["time_us"] = result.peak_reserved_time_us;
  j["fragmentation_at_peak"] = std::move(at_peak);
  j["fragmentation_at_end"] = FragmentationJson(result.fragmentation_at_end);
  nlohmann::json steps = nlohmann::json::array();
  for (std::size_t i = 0; i < result.steps.size(); ++i) {
    steps.push_back(StepToJson(i, result.steps[i]));
  }
  j["utilization_at_each_step"] = std::move(steps);
  j["step_marks"] = result.step_marks;
  j["trace_span_us"] = result.trace_span_us;
  j["driver_time_pct_of_span"] = result.driver_pct_of_span;
  j["steady_state"] = SteadyStateToJson(result.steady_state);
  j["recorded_modeled_driver_us"] = result.recorded_modeled_driver_us;
  j["recorded_driver_time_pct_of_span"] = result.recorded_driver_pct_of_span;
  // Everything else.
  j["trace"] = result.source;
  j["capacity_bytes"] = result.capacity_bytes;
  j["conf"] = result.conf;
  j["allocs"] = result.allocs;
  j["frees"] = result.frees;
  j["final_reserved_bytes"] = result.final_reserved_bytes;
  j["final_allocated_bytes"] = result.final_allocated_bytes;
  j["first_time_us"] = result.first_time_us;
  j["last_time_us"] = result.last_time_us;
  j["main_stream"] = result.main_stream;
  j["sample_every"] = result.sample_every;
  j["timeline_points"] = result.timeline.size();
  j["device_allocs"] = result.device_allocs;
  j["device_frees"] = result.device_frees;
  j["alloc_retries"] = result.alloc_retries;
  j["driver_us"] = result.driver_us;
  j["trace_events"] = result.trace_events;
  j["recorded_events"] = result.recorded_events;
  j["trace_peak_requested_bytes"] = result.trace_peak_requested_bytes;
  j["recorded_segment_allocs"] = result.recorded_segment_allocs;
  j["recorded_segment_maps"] = result.recorded_segment_maps;
  j["recorded_segment_frees"] = result.recorded_segment_frees;
  j["recorded_ooms"] = result.recorded_ooms;
  j["time_reversals"] = result.time_reversals;
  j["first_time_reversal_line"] = result.first_time_reversal_line;
  j["first_time_reversal_us"] = result.first_time_reversal_us;
  j["unknown_frees"] = result.unknown_frees.size();
  j["unknown_frees_listed"] = ListLines(result.unknown_frees, max_listed);
  j["reused_live_addresses"] = result.reused_live_addresses.size();
  j["reused_live_addresses_listed"] = ListLines(result.reused_live_addresses, max_listed);
  j["live_at_end"] = result.live_at_end;
  j["live_bytes_at_end"] = result.live_bytes_at_end;
  j["releases"] = ReleaseFiguresJson(result.releases);
  j["plan"] = PlanFiguresJson(result.plan);
  return j;
}

namespace {

// Driver time against the trace's span, steady state, page moves.
std::string FormatDriverTime(const ReplayResult& r) {
  const SteadyState& s = r.steady_state;
  std::string out = absl::StrFormat("\n  %-24s %s us (%s), first to last event\n", "trace span",
                                    WithThousands(r.trace_span_us), Seconds(r.trace_span_us));
  absl::StrAppend(&out,
                  absl::StrFormat("  %-24s %s us = %.3f%% of the span\n", "driver time (modelled)",
                                  MicrosWithThousands(r.modeled_driver_us), r.driver_pct_of_span));
  absl::StrAppend(
      &out, absl::StrFormat("  %-24s %s us = %.3f%% of the span (the trace's segment "
                            "events, same cost model)\n",
                            "recorded (trace)", MicrosWithThousands(r.recorded_modeled_driver_us),
                            r.recorded_driver_pct_of_span));
  absl::StrAppend(&out,
                  absl::StrFormat("  %-24s after %.0f%% of the events (from line %d; span %s): %s "
                                  "calls, %s us = %.3f%% of its span\n",
                                  "steady state", 100.0 * s.after_fraction, s.start_line,
                                  Seconds(s.span_us), WithThousands(TotalCalls(s.driver_calls)),
                                  MicrosWithThousands(s.modeled_driver_us), s.pct_of_span));
  absl::StrAppend(
      &out,
      absl::StrFormat("  %-24s %s (%s back onto an old mapping, no driver call)\n", "page moves",
                      WithThousands(r.page_moves), WithThousands(r.reused_old_mappings)));
  return out;
}

// Fragmentation at the moment reserved first reached its peak and at the end, side by side. The
// first row of bytes is reserved - allocated at that moment; the second, peak reserved - peak
// allocated (the same in both columns). They differ: reserved can reach its peak late, when a
// page is created within recycle_slack of the peak while little is allocated.
std::string FormatFragmentation(const ReplayResult& r) {
  const Fragmentation& p = r.fragmentation_at_peak;
  const Fragmentation& e = r.fragmentation_at_end;
  std::string out =
      absl::StrFormat("\n  %-26s %-34s %s\n", "fragmentation",
                      absl::StrCat("reserved's peak (line ", r.peak_reserved_line, ")"), "at end");
  auto bytes_row = [&out](absl::string_view label, std::int64_t a, std::int64_t b) {
    absl::StrAppend(&out,
                    absl::StrFormat("  %-26s %-34s %s\n", label, BytesAndGiB(a), BytesAndGiB(b)));
  };
  auto number_row = [&out](absl::string_view label, const std::string& a, const std::string& b) {
    absl::StrAppend(&out, absl::StrFormat("  %-26s %-34s %s\n", label, a, b));
  };
  // Fragmentation::utilization is peak allocated / peak reserved at either point.
  number_row("utilization, peaks so far", absl::StrFormat("%.4f", p.utilization),
             absl::StrFormat("%.4f", e.utilization));
  bytes_row("wasted then (res.-alloc.)", p.wasted_bytes, e.wasted_bytes);
  bytes_row("peak res. - peak alloc.", p.wasted_bytes_at_peak, e.wasted_bytes_at_peak);
  bytes_row("largest free block", p.largest_free_block, e.largest_free_block);
  number_row("free-space fragmentation", absl::StrFormat("%.4f", p.free_space_fragmentation),
             absl::StrFormat("%.4f", e.free_space_fragmentation));
  number_row("holes", WithThousands(p.holes), WithThousands(e.holes));
  number_row("mapped free pages", WithThousands(p.mapped_free_pages),
             WithThousands(e.mapped_free_pages));
  bytes_row("other streams' cache", p.other_stream_cached_bytes, e.other_stream_cached_bytes);
  absl::StrAppend(&out,
                  "  at end: reserved - allocated is the cache the program still held when the "
                  "trace ended (empty_cache() or the process's exit returns it)\n");
  return out;
}

// One row per step; empty when the trace marks no steps.
std::string FormatSteps(const ReplayResult& r) {
  if (r.steps.empty()) return "";
  std::string out = absl::StrFormat("\n  %-6s %10s %9s %18s %18s %11s %8s %9s %14s\n", "step",
                                    "end line", "events", "peak allocated", "peak reserved",
                                    "utilization", "calls", "mem calls", "driver (us)");
  for (std::size_t i = 0; i < r.steps.size(); ++i) {
    const StepFigures& s = r.steps[i];
    absl::StrAppend(
        &out,
        absl::StrFormat("  %-6s %10s %9s %18s %18s %11.4f %8s %9s %14s\n",
                        absl::StrCat(i + 1, s.complete ? "" : "*"),
                        s.complete ? WithThousands(s.end_line) : "end", WithThousands(s.events),
                        WithThousands(s.peak_allocated_bytes), WithThousands(s.peak_reserved_bytes),
                        s.utilization, WithThousands(s.driver_calls), WithThousands(s.memory_calls),
                        MicrosWithThousands(s.modeled_driver_us)));
  }
  absl::StrAppend(&out,
                  "  mem calls: the calls that map, unmap, create or free device memory "
                  "(cuMem*, cudaMalloc, cudaFree); the others are events and queries\n");
  if (!r.steps.back().complete) {
    absl::StrAppend(&out, "  * events after the last step mark (an unfinished step)\n");
  }
  return out;
}

}  // namespace

std::string FormatReplayTable(const ReplayResult& result) {
  std::string out = absl::StrCat("vramledger replay of ", result.source, "\n");
  absl::StrAppend(&out, "  ", WithThousands(result.trace_events),
                  " trace events; simulated capacity ", BytesAndGiB(result.capacity_bytes),
                  "; conf: ", result.conf.empty() ? "(defaults)" : result.conf, "\n\n");
  absl::StrAppend(&out, Row("", "vramledger (replay)", RecordedHeading(result)));
  absl::StrAppend(&out, Row("alloc + free events", WithThousands(result.events),
                            WithThousands(result.recorded_events)));
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
  // torch's stat names: cudaMalloc / cudaFree calls, or with expandable segments map / unmap
  // calls (docs/design/torch-facts.md); the trace's segment events count the same for torch.
  absl::StrAppend(&out, Row("num_device_alloc", WithThousands(result.device_allocs),
                            WithThousands(result.recorded_segment_allocs)));
  absl::StrAppend(&out, Row("num_device_free", WithThousands(result.device_frees),
                            WithThousands(result.recorded_segment_frees)));
  // torch's num_alloc_retries: a request that freed cached memory and tried again. The trace's
  // oom events are torch's refusals; a replay that refuses stops with an error instead.
  absl::StrAppend(&out, Row("num_alloc_retries", WithThousands(result.alloc_retries), "n/a"));
  absl::StrAppend(
      &out, Row("num_ooms", "0 (a replay stops at one)", WithThousands(result.recorded_ooms)));

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
  absl::StrAppend(&out, FormatDriverTime(result), FormatFragmentation(result), FormatSteps(result));
  absl::StrAppend(
      &out,
      absl::StrFormat("\n  live at end: %s blocks, %s; unknown frees: %d; "
                      "allocs of live addresses: %d\n",
                      WithThousands(result.live_at_end), BytesAndGiB(result.live_bytes_at_end),
                      result.unknown_frees.size(), result.reused_live_addresses.size()));
  absl::StrAppend(&out, FormatReleases(result.releases), FormatPlan(result.plan, result.source));
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
  if (result.time_reversals > 0) {
    warnings.push_back(absl::StrCat(
        result.time_reversals,
        result.time_reversals == 1 ? " event is earlier (time_us) than the event before it, at "
                                   : " events are earlier (time_us) than the event before them, "
                                     "the first at ",
        result.source, ":", result.first_time_reversal_line, " (", result.first_time_reversal_us,
        " us earlier): the trace is not in time order, so its span "
        "and the driver-time shares are not meaningful (the memory figures are)"));
  }
  return warnings;
}

}  // namespace vramledger
