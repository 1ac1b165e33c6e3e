// The memory plan: its model (per-GPU limit, headroom, warn_at, per-category limits), the JSON
// parser that names file, line and field in every error, and resolution against a card's size.
// Schema: docs/design/plan-file.md. Pure values and functions; thread-safe.
#ifndef VRAMLEDGER_GUARD_PLAN_H_
#define VRAMLEDGER_GUARD_PLAN_H_

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "guard/size_spec.h"

namespace vramledger::guard {

/// Categories every plan knows; a plan declares more in its "categories" list.
inline constexpr std::array<std::string_view, 7> kBuiltinCategories = {
    "weights", "gradients", "optimizer", "activations", "workspace", "communication", "untagged"};

/// One size-valued rule and where the plan sets it.
struct PlanValue {
  SizeSpec size;
  int line = 0;       // 1-based line in the plan file
  std::string field;  // dotted field name: "limit", "devices.1.category_limits.activations"
};

/// The rules of one scope: every device (top level) or one device (an entry of "devices").
struct PlanRules {
  std::optional<PlanValue> limit;
  std::optional<PlanValue> headroom;
  std::optional<PlanValue> warn_at;
  std::map<std::string, PlanValue> category_limits;  // by category name
};

/// A parsed plan, before it meets a card.
struct Plan {
  std::string path;                     // as given to the parser
  std::vector<std::string> categories;  // built-in ones, then the plan's own, in order
  PlanRules all;                        // top-level rules, for every device
  std::map<int, PlanRules> devices;     // per-device overrides, by device index

  bool HasCategory(std::string_view name) const;
};

/// Parses plan JSON `text` read from `path` (used in messages only). `device_count` > 0 checks
/// that every key of "devices" is an index below it; 0 skips that check.
/// Errors: InvalidArgument "<path>:<line>: field '<field>': <what>" for a syntax error, a wrong
/// type, an unknown key, an unknown device or category, a malformed size, a bad fraction.
absl::StatusOr<Plan> ParsePlan(std::string_view text, std::string_view path, int device_count);

/// Reads and parses the plan file at `path`. NotFound "<path>: cannot read the plan file: ..."
/// when it cannot be read; otherwise as ParsePlan.
absl::StatusOr<Plan> LoadPlanFile(std::string_view path, int device_count);

/// One category limit of a device, in bytes.
struct CategoryBudget {
  std::string name;
  std::uint64_t bytes = 0;
  int line = 0;
  std::string field;
};

/// A plan applied to one device of `card_bytes`: every size in bytes, with its plan location.
struct DeviceBudget {
  std::string path;
  int device = 0;
  std::uint64_t card_bytes = 0;
  /// The hard limit on reserved bytes; the card when the plan sets none (limit_line 0 then).
  std::uint64_t limit = 0;
  int limit_line = 0;
  std::string limit_field;
  /// Bytes of the limit kept free (0 when unset).
  std::uint64_t headroom = 0;
  int headroom_line = 0;
  std::string headroom_field;
  /// Reserved bytes past which a warning is logged (0 = no warning).
  std::uint64_t warn_bytes = 0;
  int warn_line = 0;
  std::string warn_field;
  /// False when the plan sets neither limit nor headroom: reserved memory is not capped.
  bool enforces_limit = false;
  std::vector<CategoryBudget> categories;

  /// The enforced cap on reserved bytes: limit - headroom.
  std::uint64_t cap() const { return limit - headroom; }
};

/// Applies `plan` to `device` whose card has `card_bytes` (> 0): device rules override the
/// top-level ones field by field (category limits by name). Fractions of limit, headroom and
/// category limits are of the card; a fraction for warn_at is of the cap (limit - headroom).
/// Errors: InvalidArgument "<path>:<line>: field '<field>': <what>" when a limit or category
/// limit exceeds the card, headroom is not below the limit, or warn_at exceeds the cap.
absl::StatusOr<DeviceBudget> ResolvePlan(const Plan& plan, int device, std::uint64_t card_bytes);

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_PLAN_H_
