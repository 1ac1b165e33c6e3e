// Plan access (see plan_access.h): guard::LoadPlanFile and guard::ResolvePlan behind a per-device
// cache, and the JSON summary of vramledger_plan_check.
#include "torch_plugin/runtime/plan_access.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>

#include "absl/status/statusor.h"
#include "guard/plan.h"
#include "ledger/history.h"
#include "nlohmann/json.hpp"

namespace vramledger {
namespace {

constexpr int kMaxPlanDevices = History::kMaxDevices;
constexpr std::int64_t kUnresolved = -2;
constexpr std::int64_t kNoLimit = -1;

std::array<std::atomic<std::int64_t>, kMaxPlanDevices>& ResolvedLimits() {
  static auto* const limits = [] {
    auto* l = new std::array<std::atomic<std::int64_t>, kMaxPlanDevices>();  // never destroyed
    for (auto& limit : *l) limit.store(kUnresolved);
    return l;
  }();
  return *limits;
}

nlohmann::json BudgetJson(const guard::DeviceBudget& b) {
  nlohmann::json limits = nlohmann::json::object();
  for (const guard::CategoryBudget& c : b.categories) limits[c.name] = c.bytes;
  return {{"device", b.device},
          {"card_bytes", b.card_bytes},
          {"limit", b.limit},
          {"headroom", b.headroom},
          {"cap", b.cap()},
          {"warn_bytes", b.warn_bytes},
          {"enforces_limit", b.enforces_limit},
          {"category_limits", limits}};
}

}  // namespace

absl::Status CheckPlanFile(const std::string& path) {
  return guard::LoadPlanFile(path, 0).status();
}

std::optional<std::int64_t> PlanLimitBytes(const std::string& path, int device,
                                           std::size_t card_bytes) {
  if (device < 0 || device >= kMaxPlanDevices) return std::nullopt;
  std::atomic<std::int64_t>& slot = ResolvedLimits()[device];
  std::int64_t limit = slot.load(std::memory_order_relaxed);
  if (limit == kUnresolved) {
    limit = kNoLimit;
    absl::StatusOr<guard::Plan> plan = guard::LoadPlanFile(path, device + 1);
    if (plan.ok()) {
      absl::StatusOr<guard::DeviceBudget> budget = guard::ResolvePlan(*plan, device, card_bytes);
      if (budget.ok()) limit = budget->limit;
    }
    slot.store(limit, std::memory_order_relaxed);
  }
  return limit == kNoLimit ? std::nullopt : std::optional<std::int64_t>(limit);
}

}  // namespace vramledger

extern "C" {

int vramledger_plan_check(const char* path, int device_count, unsigned long long card_bytes,
                          char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  return vramledger::CatchAll([&]() -> absl::Status {
    if (path == nullptr || json_out == nullptr) {
      return absl::InvalidArgumentError("vramledger: path or json_out is null");
    }
    absl::StatusOr<vramledger::guard::Plan> plan =
        vramledger::guard::LoadPlanFile(path, device_count > 0 ? device_count : 0);
    if (!plan.ok()) return plan.status();
    nlohmann::json out = {{"path", plan->path}, {"categories", plan->categories}};
    out["devices"] = nlohmann::json::array();
    if (card_bytes > 0) {
      for (int d = 0; d < std::max(device_count, 1); ++d) {
        auto budget = vramledger::guard::ResolvePlan(*plan, d, card_bytes);
        if (!budget.ok()) return budget.status();
        out["devices"].push_back(vramledger::BudgetJson(*budget));
      }
    }
    return vramledger::ExportString(out.dump(), json_out);
  });
}

}  // extern "C"
