// The releases' and the plan's JSON and table lines (see replay_extras_report.h).
#include "replay/replay_extras_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "replay/replay_report.h"

namespace vramledger {

nlohmann::json ReleaseFiguresJson(const ReleaseFigures& r) {
  return {{"followed", r.followed},
          {"runs", r.runs},
          {"empty_cache_runs", r.empty_cache_runs},
          {"retry_runs", r.retry_runs},
          {"trace_bytes", r.trace_bytes},
          {"applied", r.applied},
          {"skipped", r.skipped},
          {"replay_released_bytes", r.replay_released_bytes},
          {"first_applied_line", r.first_applied_line}};
}

nlohmann::json PlanFiguresJson(const PlanFigures& p) {
  if (p.path.empty()) return nullptr;
  nlohmann::json listed = nlohmann::json::array();
  for (const PlanRefusal& r : p.listed) {
    listed.push_back({{"event", r.event},
                      {"line", r.line},
                      {"row", r.event_text},
                      {"plan_line", r.plan_line},
                      {"rule", r.rule},
                      {"message", r.message}});
  }
  return {{"path", p.path},
          {"device", p.device},
          {"cap_bytes", p.cap},
          {"keep_going", p.keep_going},
          {"refusals", p.refusals},
          {"stopped", p.stopped},
          {"warnings", p.warnings},
          {"first_warning", p.first_warning},
          {"listed", std::move(listed)}};
}

std::string FormatReleases(const ReleaseFigures& r) {
  if (r.runs == 0) return "";
  std::string out =
      absl::StrCat("\n  program's releases: ", WithThousands(r.runs), " in the trace (",
                   WithThousands(r.empty_cache_runs), " empty_cache(), ",
                   WithThousands(r.retry_runs), " out-of-memory retries; ",
                   BytesAndGiB(static_cast<std::int64_t>(r.trace_bytes)), " released by torch)\n");
  if (!r.followed) {
    absl::StrAppend(&out, "  not applied (--ignore-releases): the replay kept its cache\n");
    return out;
  }
  absl::StrAppend(&out, "  applied ", WithThousands(r.applied), " (the replay's cache emptied ",
                  "there, ", BytesAndGiB(static_cast<std::int64_t>(r.replay_released_bytes)),
                  " returned)");
  if (r.skipped > 0) {
    absl::StrAppend(&out, "; ", WithThousands(r.skipped),
                    " retries skipped: the replay was not as full as torch when torch ran out");
  }
  absl::StrAppend(&out, "\n");
  return out;
}

std::string FormatPlan(const PlanFigures& p, const std::string& source) {
  if (p.path.empty()) return "";
  std::string out = absl::StrCat("\n  plan ", p.path, " (device ", p.device, "): ");
  absl::StrAppend(
      &out,
      p.cap > 0 ? absl::StrCat("cap on reserved ", BytesAndGiB(static_cast<std::int64_t>(p.cap)))
                : "no cap on reserved",
      "; refusals: ", WithThousands(p.refusals));
  if (p.refusals > 0) {
    absl::StrAppend(&out, p.stopped ? " (the replay stopped at the first)"
                                    : " (each refused allocation skipped, the replay went on)");
  }
  absl::StrAppend(&out, "; warn_at warnings: ", WithThousands(p.warnings), "\n");
  for (std::size_t i = 0; i < p.listed.size(); ++i) {
    const PlanRefusal& r = p.listed[i];
    absl::StrAppend(&out, "  refusal ", i + 1, " at ", source, ":", r.line, " (trace event ",
                    WithThousands(r.event), "): ", r.event_text, "\n    ",
                    absl::StrReplaceAll(r.message, {{"\n", "\n    "}}), "\n");
  }
  if (p.refusals > static_cast<std::int64_t>(p.listed.size())) {
    absl::StrAppend(&out, "  (",
                    WithThousands(p.refusals - static_cast<std::int64_t>(p.listed.size())),
                    " more refusals not listed)\n");
  }
  return out;
}

}  // namespace vramledger
