// What a refusal (or a warn_at warning) reports, and its text: the message that starts with
// `vramledger plan violation`. Plain values and pure functions; thread-safe.
#ifndef VRAMLEDGER_GUARD_REFUSAL_H_
#define VRAMLEDGER_GUARD_REFUSAL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "guard/stack.h"
#include "vramledger/types.h"

namespace vramledger::guard {

/// Live bytes of one category (tag) against its plan limit.
struct CategoryUsage {
  std::string name;
  std::uint64_t current = 0;  // live requested bytes
  bool has_limit = false;     // the plan limits this category
  std::uint64_t limit = 0;    // bytes, when has_limit
  int line = 0;               // plan line of the limit
};

/// Everything a refusal message says. The guard fills the first part under the allocator lock;
/// BudgetGuard::CompleteRefusal adds the rest outside it.
struct Refusal {
  // The rule that refused.
  std::string plan_path;
  int line = 0;        // plan line of the rule
  std::string field;   // "limit", "devices.0.limit", "category_limits.activations"
  std::string reason;  // one sentence: what would happen, against what
  // The request.
  int device = 0;
  std::uint64_t request_bytes = 0;
  std::uint64_t rounded_bytes = 0;
  StreamId stream = 0;
  std::string tag;
  std::uint64_t context = 0;
  // The device.
  std::uint64_t allocated = 0;
  std::uint64_t reserved = 0;
  std::uint64_t cap = 0;  // enforced limit on reserved; 0 when the plan sets none
  std::vector<CategoryUsage> categories;
  // Completed outside the lock; until then (`complete` false) the message leaves out the
  // largest free block, the stack and the snapshot.
  bool complete = false;
  std::optional<std::uint64_t> largest_free_block;
  std::vector<StackFrame> frames;  // innermost first: Python frames, then native ones
  std::string stack_note;          // where the frames came from, or why there are none
  std::string snapshot_path;       // empty: none written
  std::string snapshot_note;       // why none was written
};

/// The full message: first line "vramledger plan violation: <path>:<line>: <field>: <reason>",
/// then the request, live bytes by category against the plan, allocated / reserved / largest
/// free block, the stack (innermost first) and the forensic snapshot path.
std::string FormatRefusal(const Refusal& refusal);

/// The category lines shared by refusals and warnings: one "    name  current / limit" line each,
/// sorted by current bytes (largest first); categories with no bytes and no limit are left out.
std::string FormatCategories(const std::vector<CategoryUsage>& categories);

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_REFUSAL_H_
