// HooksChain: one AllocatorHooks that fans out to several (the guard and the history), since a
// DeviceAllocator takes one hooks object. Immutable after construction; thread-safe as its parts.
#ifndef VRAMLEDGER_GUARD_HOOKS_CHAIN_H_
#define VRAMLEDGER_GUARD_HOOKS_CHAIN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vramledger/hooks.h"

namespace vramledger::guard {

/// Calls its hooks in order:
/// - CaptureContext / CurrentTag: the first non-zero answer wins (later hooks are not asked);
/// - CheckAllocation / CheckGrowth: the first refusal wins (put the guard first);
/// - OnEvent: every hook sees every event.
class HooksChain final : public AllocatorHooks {
 public:
  /// `hooks` are borrowed and must outlive the chain; null entries are skipped.
  explicit HooksChain(std::vector<AllocatorHooks*> hooks);

  std::uint64_t CaptureContext(TraceAction action) override;
  std::uint32_t CurrentTag() override;
  absl::Status CheckAllocation(const AllocationRequest& request, const HookStats& stats) override;
  absl::Status CheckGrowth(const AllocationRequest& request, std::size_t reserved_after,
                           const HookStats& stats) override;
  void OnEvent(const TraceEntry& event) override;

  const std::vector<AllocatorHooks*>& hooks() const { return hooks_; }

 private:
  const std::vector<AllocatorHooks*> hooks_;
};

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_HOOKS_CHAIN_H_
