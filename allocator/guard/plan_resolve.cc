// Applying a parsed plan to one device: merge the device's overrides over the top-level rules,
// turn fractions into bytes against the card, and check every size against the card.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "guard/plan.h"

namespace vramledger::guard {
namespace {

inline absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Error(const std::string& path, const PlanValue& v, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ":", v.line, ": field '", v.field, "': ", AV(what)));
}

PlanRules Merge(const Plan& plan, int device) {
  PlanRules merged = plan.all;
  auto it = plan.devices.find(device);
  if (it == plan.devices.end()) return merged;
  const PlanRules& own = it->second;
  if (own.limit) merged.limit = own.limit;
  if (own.headroom) merged.headroom = own.headroom;
  if (own.warn_at) merged.warn_at = own.warn_at;
  for (const auto& [name, value] : own.category_limits) merged.category_limits[name] = value;
  return merged;
}

}  // namespace

absl::StatusOr<DeviceBudget> ResolvePlan(const Plan& plan, int device, std::uint64_t card_bytes) {
  const PlanRules rules = Merge(plan, device);
  DeviceBudget b;
  b.path = plan.path;
  b.device = device;
  b.card_bytes = card_bytes;
  const std::string card =
      absl::StrCat("the card's total memory, ", FormatBytes(card_bytes), " on device ", device);
  b.limit = card_bytes;
  if (rules.limit) {
    b.limit = rules.limit->size.Resolve(card_bytes);
    b.limit_line = rules.limit->line;
    b.limit_field = rules.limit->field;
    if (b.limit > card_bytes) {
      return Error(plan.path, *rules.limit,
                   absl::StrCat("limit ", rules.limit->size.text, " = ", FormatBytes(b.limit),
                                " exceeds ", card));
    }
    if (b.limit == 0) return Error(plan.path, *rules.limit, "the limit resolves to 0 bytes");
  }
  if (rules.headroom) {
    b.headroom = rules.headroom->size.Resolve(card_bytes);
    b.headroom_line = rules.headroom->line;
    b.headroom_field = rules.headroom->field;
    if (b.headroom >= b.limit) {
      return Error(plan.path, *rules.headroom,
                   absl::StrCat("headroom ", FormatBytes(b.headroom),
                                " leaves nothing of the limit ", FormatBytes(b.limit)));
    }
  }
  b.enforces_limit = rules.limit.has_value() || rules.headroom.has_value();
  if (rules.warn_at) {
    b.warn_bytes = rules.warn_at->size.Resolve(b.cap());
    b.warn_line = rules.warn_at->line;
    b.warn_field = rules.warn_at->field;
    if (b.warn_bytes > b.cap()) {
      return Error(plan.path, *rules.warn_at,
                   absl::StrCat("warn_at ", FormatBytes(b.warn_bytes),
                                " is above the enforced limit ", FormatBytes(b.cap())));
    }
  }
  for (const auto& [name, value] : rules.category_limits) {
    CategoryBudget c;
    c.name = name;
    c.bytes = value.size.Resolve(card_bytes);
    c.line = value.line;
    c.field = value.field;
    if (c.bytes > card_bytes) {
      return Error(plan.path, value,
                   absl::StrCat("category limit ", value.size.text, " = ", FormatBytes(c.bytes),
                                " exceeds ", card));
    }
    b.categories.push_back(std::move(c));
  }
  return b;
}

}  // namespace vramledger::guard
