// The budget guard: an AllocatorHooks that enforces one device's plan (limit on reserved bytes,
// per-category limits at allocation, warn_at), keeps per-tag current/peak bytes and per-step peaks.
// Thread-safety: hooks run under the device allocator's lock; the rest may be called from any
// thread. Design: docs/design/budget-guard.md.
#ifndef VRAMLEDGER_GUARD_BUDGET_GUARD_H_
#define VRAMLEDGER_GUARD_BUDGET_GUARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "guard/plan.h"
#include "guard/refusal.h"
#include "guard/stack.h"
#include "guard/tags.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"

namespace vramledger::guard {

/// Live bytes of one tag on one device (requested sizes, as torch's requested_bytes).
struct TagUsage {
  std::uint32_t id = 0;
  std::string name;
  std::int64_t current = 0;
  std::int64_t peak = 0;       // since the guard was made or ResetTagPeaks()
  std::int64_t step_peak = 0;  // since the last EndStep()
};

/// One training step's figures on one device (bytes).
struct StepRecord {
  std::int64_t step = 0;  // 0 for the first step
  int device = 0;
  std::uint64_t peak_allocated = 0;  // within 1 MiB: see docs/design/budget-guard.md
  std::uint64_t peak_reserved = 0;
  std::uint64_t allocated = 0;  // at the end of the step
  std::uint64_t reserved = 0;
  std::int64_t warnings = 0;  // warn_at warnings logged in the step (0 or 1)
  std::vector<std::pair<std::string, std::int64_t>> tag_peaks;  // tags live in the step
};

/// Writes a forensic snapshot for a refusal and returns its path, or an error saying why none
/// was written. Called outside the allocator lock on the refusing thread (the ledger's OOM dump provides it).
using ForensicDumpFn =
    std::function<absl::StatusOr<std::string>(int device, const std::string& message)>;
/// Receives each warn_at warning (a multi-line text without a final newline). Default: stderr.
using WarningSink = std::function<void(const std::string& text)>;

/// The guard of one device. Install it (alone or first in a HooksChain) on exactly one
/// DeviceAllocator. Without a budget it only accounts (tags, step peaks) and never refuses.
class BudgetGuard final : public AllocatorHooks {
 public:
  /// Makes the guard of `device`. `tags` is borrowed and must outlive the guard; the budget's
  /// category names are interned in it. ResourceExhausted when the registry is full.
  static absl::StatusOr<std::unique_ptr<BudgetGuard>> Create(int device, TagRegistry* tags,
                                                             std::optional<DeviceBudget> budget);
  ~BudgetGuard() override;
  BudgetGuard(const BudgetGuard&) = delete;
  BudgetGuard& operator=(const BudgetGuard&) = delete;

  // ---- AllocatorHooks (fast path: a TLS read and a few relaxed atomics) ----
  std::uint32_t CurrentTag() override { return EffectiveTag(*tags_); }
  /// Refuses (ResourceExhausted, "vramledger plan violation...") when the tag's live bytes plus
  /// the request would pass its category limit; logs a warn_at warning once per step.
  absl::Status CheckAllocation(const AllocationRequest& request, const HookStats& stats) override;
  /// Refuses when reserved would pass limit - headroom.
  absl::Status CheckGrowth(const AllocationRequest& request, std::size_t reserved_after,
                           const HookStats& stats) override;
  void OnEvent(const TraceEntry& event) override;

  /// If `status` is this guard's refusal of the calling thread's last Malloc, returns it with
  /// the message completed: largest free block (from `allocator`), the stack (symbolizer for the
  /// request's context, else live Python frames and native frames) and the forensic snapshot.
  /// Any other status is returned unchanged. Call outside the allocator lock, on that thread.
  absl::Status CompleteRefusal(const absl::Status& status, const DeviceAllocator& allocator);

  /// Every tag with bytes seen on this device, plus "untagged", by id.
  std::vector<TagUsage> TagUsages() const;
  /// Every tag peak becomes its current value (reset_peak_memory_stats).
  void ResetTagPeaks();

  /// Ends the current step: returns its peaks (folding in `now`, the device's stats at the end)
  /// and starts the next step with peaks equal to the current values.
  StepRecord EndStep(const DeviceStats& now) ABSL_LOCKS_EXCLUDED(step_mu_);
  /// Index of the step in progress (0 before the first EndStep).
  std::int64_t step() const { return step_.load(std::memory_order_relaxed); }

  void SetWarningSink(WarningSink sink) ABSL_LOCKS_EXCLUDED(config_mu_);
  void SetSymbolizer(StackSymbolizer* symbolizer) ABSL_LOCKS_EXCLUDED(config_mu_);
  void SetPythonStackProvider(PythonStackProvider provider) ABSL_LOCKS_EXCLUDED(config_mu_);
  void SetForensicDump(ForensicDumpFn dump) ABSL_LOCKS_EXCLUDED(config_mu_);

  /// Allocations refused (by a category limit, or by the limit after the cache was released).
  std::int64_t refusals() const { return refusals_.load(std::memory_order_relaxed); }
  /// warn_at warnings logged.
  std::int64_t warnings() const { return warnings_.load(std::memory_order_relaxed); }
  const std::optional<DeviceBudget>& budget() const { return budget_; }
  int device() const { return device_; }

 private:
  BudgetGuard(int device, TagRegistry* tags, std::optional<DeviceBudget> budget);

  struct TagCounter {
    std::atomic<std::int64_t> current{0};
    std::atomic<std::int64_t> peak{0};
    std::atomic<std::int64_t> step_peak{0};
  };

  absl::Status Refuse(Refusal refusal);
  void MaybeWarn(std::uint64_t reserved, std::uint64_t allocated);
  std::vector<CategoryUsage> Categories() const;
  Refusal Base(const AllocationRequest& request, const HookStats& stats) const;

  const int device_;
  TagRegistry* const tags_;
  const std::optional<DeviceBudget> budget_;
  const std::uint64_t cap_;         // 0: no cap on reserved
  const std::uint64_t warn_bytes_;  // 0: no warning
  bool has_category_limits_ = false;
  std::unique_ptr<TagCounter[]> counters_;  // kMaxTags
  static constexpr std::uint64_t kNoLimit = ~std::uint64_t{0};
  std::unique_ptr<std::uint64_t[]> tag_limit_;  // kMaxTags; kNoLimit = none
  std::unique_ptr<int[]> tag_limit_line_;       // kMaxTags

  // Written only under the device allocator's lock (by the hooks).
  std::uint64_t pending_allocated_after_ = 0;  // allocated bytes once the current Malloc succeeds
  std::uint64_t reserved_now_ = 0;

  std::atomic<std::int64_t> step_{0};
  std::atomic<std::int64_t> warned_step_{-1};
  std::atomic<std::int64_t> step_warnings_{0};
  std::atomic<std::uint64_t> step_peak_allocated_{0};
  std::atomic<std::uint64_t> step_peak_reserved_{0};
  std::atomic<std::int64_t> refusals_{0};
  std::atomic<std::int64_t> warnings_{0};
  absl::Mutex step_mu_;  // serialises EndStep

  mutable absl::Mutex config_mu_;
  WarningSink warning_sink_ ABSL_GUARDED_BY(config_mu_);
  StackSymbolizer* symbolizer_ ABSL_GUARDED_BY(config_mu_) = nullptr;
  PythonStackProvider python_stack_ ABSL_GUARDED_BY(config_mu_);
  ForensicDumpFn forensic_dump_ ABSL_GUARDED_BY(config_mu_);
};

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_BUDGET_GUARD_H_
