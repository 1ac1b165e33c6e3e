// The plan of a replay: loading, the guard's hooks, and refusals named by trace line.
#include "replay/replay_plan.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "guard/plan.h"
#include "guard/size_spec.h"

namespace vramledger {
namespace {

constexpr absl::string_view kViolation = "vramledger plan violation: ";

}  // namespace

std::string TraceRow(const TraceEvent& event) {
  return absl::StrCat(std::string(TraceActionName(event.action)), ",", event.addr, ",", event.size,
                      ",", event.stream, ",", event.time_us);
}

absl::StatusOr<std::unique_ptr<ReplayPlan>> ReplayPlan::Create(const std::string& plan_path,
                                                               int device,
                                                               std::size_t capacity_bytes,
                                                               AllocatorHooks* replay_hooks) {
  // The device count is the trace's: one device (its index checked by ResolvePlan's rules).
  absl::StatusOr<guard::Plan> plan = guard::LoadPlanFile(plan_path, /*device_count=*/0);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<guard::DeviceBudget> budget = guard::ResolvePlan(*plan, device, capacity_bytes);
  if (!budget.ok()) return budget.status();
  auto tags = std::make_unique<guard::TagRegistry>();
  const std::uint64_t cap = budget->enforces_limit ? budget->cap() : 0;
  absl::StatusOr<std::unique_ptr<guard::BudgetGuard>> guard =
      guard::BudgetGuard::Create(device, tags.get(), *std::move(budget));
  if (!guard.ok()) return guard.status();
  std::unique_ptr<ReplayPlan> out(new ReplayPlan(std::move(tags), *std::move(guard), replay_hooks));
  out->figures_.path = plan_path;
  out->figures_.device = device;
  out->figures_.cap = cap;
  PlanFigures* figures = &out->figures_;
  out->guard_->SetWarningSink([figures](const std::string& text) {
    if (figures->warnings++ == 0) figures->first_warning = text;
  });
  return out;
}

ReplayPlan::ReplayPlan(std::unique_ptr<guard::TagRegistry> tags,
                       std::unique_ptr<guard::BudgetGuard> guard, AllocatorHooks* replay_hooks)
    : tags_(std::move(tags)), guard_(std::move(guard)), chain_({guard_.get(), replay_hooks}) {}

bool ReplayPlan::TakeRefusal(const absl::Status& status, const TraceEvent& event,
                             std::int64_t index, std::size_t max_listed,
                             std::int64_t largest_free_block) {
  if (!absl::IsResourceExhausted(status) || !absl::StartsWith(status.message(), kViolation)) {
    return false;
  }
  ++figures_.refusals;
  if (figures_.listed.size() >= max_listed) return true;
  PlanRefusal r;
  r.event = index;
  r.line = event.line;
  r.event_text = TraceRow(event);
  // The first line is "vramledger plan violation: PLAN:LINE: FIELD: reason" (guard/refusal.h).
  absl::string_view rest = status.message().substr(kViolation.size());
  if (absl::ConsumePrefix(&rest, figures_.path) && absl::ConsumePrefix(&rest, ":")) {
    const std::size_t colon = rest.find(": ");
    if (colon != absl::string_view::npos && absl::SimpleAtoi(rest.substr(0, colon), &r.plan_line)) {
      rest.remove_prefix(colon + 2);
      r.rule = std::string(rest.substr(0, rest.find(": ")));
    }
  }
  r.message = absl::StrCat(status.message(), ", largest free block ",
                           guard::FormatBytes(static_cast<std::uint64_t>(
                               largest_free_block > 0 ? largest_free_block : 0)));
  figures_.listed.push_back(std::move(r));
  return true;
}

}  // namespace vramledger
