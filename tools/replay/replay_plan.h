// A plan enforced on a replay: the plan file of Options (plan:FILE) resolved against the
// simulated device, a BudgetGuard installed as the replay allocator's hooks (chained before the
// replay's own), and each refusal turned into a PlanRefusal naming the trace line. Design:
// docs/design/budget-guard.md ("On a replay"). Not thread-safe (one replay's state).
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAY_PLAN_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAY_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "guard/budget_guard.h"
#include "guard/hooks_chain.h"
#include "guard/tags.h"
#include "replay/trace_reader.h"
#include "vramledger/hooks.h"

namespace vramledger {

/// One allocation of the trace that the plan refused.
struct PlanRefusal {
  std::int64_t event = 0;  // 1-based index into the trace's events
  int line = 0;            // the event's line in the input
  std::string event_text;  // the trace row: "alloc,ADDR,SIZE,STREAM,TIME_US"
  int plan_line = 0;       // the plan line of the rule that refused
  std::string rule;        // the rule's field: "limit", "category_limits.untagged", ...
  /// The guard's message: rule, request, live bytes by category against the plan, allocated
  /// and reserved bytes, and the largest free block of the simulated device.
  std::string message;
};

/// The plan's figures of one replay (ReplayResult::plan).
struct PlanFigures {
  std::string path;                 // the plan file; empty: no plan was enforced
  int device = 0;                   // the device whose rules applied
  std::uint64_t cap = 0;            // limit - headroom on reserved bytes (0: not capped)
  bool keep_going = false;          // ReplayConfig::plan_keep_going
  std::int64_t refusals = 0;        // allocations refused
  std::vector<PlanRefusal> listed;  // the first ReplayConfig::max_refusals_listed of them
  std::int64_t warnings = 0;        // warn_at warnings (one per step at most)
  std::string first_warning;        // the first warning's text
  /// The replay stopped at the first refusal (not keep_going): later events were not replayed.
  bool stopped = false;
};

/// The guard of a replay. Create() before the allocator's first event; Hooks() goes to SetHooks.
class ReplayPlan {
 public:
  /// Loads `plan_path` and resolves it for `device` of `capacity_bytes`; `replay_hooks` (borrowed,
  /// may be null) are chained after the guard. Errors: the plan's (InvalidArgument
  /// "PLAN:LINE: field 'F': ...", NotFound "PLAN: cannot read the plan file: ...").
  static absl::StatusOr<std::unique_ptr<ReplayPlan>> Create(const std::string& plan_path,
                                                            int device, std::size_t capacity_bytes,
                                                            AllocatorHooks* replay_hooks);

  /// The hooks to install: the guard, then the replay's own.
  AllocatorHooks* Hooks() { return &chain_; }

  /// True if `status` (a failed Malloc of `event`, the `index`-th of the trace, 1-based) is the
  /// guard's refusal; it is then counted and, within the first `max_listed`, kept with
  /// `largest_free_block` added to its message.
  bool TakeRefusal(const absl::Status& status, const TraceEvent& event, std::int64_t index,
                   std::size_t max_listed, std::int64_t largest_free_block);

  /// The figures so far (refusals, warnings).
  const PlanFigures& figures() const { return figures_; }
  PlanFigures& mutable_figures() { return figures_; }

 private:
  ReplayPlan(std::unique_ptr<guard::TagRegistry> tags, std::unique_ptr<guard::BudgetGuard> guard,
             AllocatorHooks* replay_hooks);

  std::unique_ptr<guard::TagRegistry> tags_;
  std::unique_ptr<guard::BudgetGuard> guard_;
  guard::HooksChain chain_;
  PlanFigures figures_;
};

/// "alloc,ADDR,SIZE,STREAM,TIME_US": the event as a trace CSV row.
std::string TraceRow(const TraceEvent& event);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_PLAN_H_
