// HooksChain: fan-out of the allocator's one hooks slot (see hooks_chain.h for the order rules).
#include "guard/hooks_chain.h"

#include <algorithm>
#include <utility>

namespace vramledger::guard {
namespace {

std::vector<AllocatorHooks*> WithoutNulls(std::vector<AllocatorHooks*> hooks) {
  hooks.erase(std::remove(hooks.begin(), hooks.end(), nullptr), hooks.end());
  return hooks;
}

}  // namespace

HooksChain::HooksChain(std::vector<AllocatorHooks*> hooks)
    : hooks_(WithoutNulls(std::move(hooks))) {}

std::uint64_t HooksChain::CaptureContext(TraceAction action) {
  for (AllocatorHooks* h : hooks_) {
    if (const std::uint64_t c = h->CaptureContext(action); c != 0) return c;
  }
  return 0;
}

std::uint32_t HooksChain::CurrentTag() {
  for (AllocatorHooks* h : hooks_) {
    if (const std::uint32_t t = h->CurrentTag(); t != 0) return t;
  }
  return 0;
}

absl::Status HooksChain::CheckAllocation(const AllocationRequest& request, const HookStats& stats) {
  for (AllocatorHooks* h : hooks_) {
    if (absl::Status s = h->CheckAllocation(request, stats); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status HooksChain::CheckGrowth(const AllocationRequest& request, std::size_t reserved_after,
                                     const HookStats& stats) {
  for (AllocatorHooks* h : hooks_) {
    if (absl::Status s = h->CheckGrowth(request, reserved_after, stats); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void HooksChain::OnEvent(const TraceEntry& event) {
  for (AllocatorHooks* h : hooks_) h->OnEvent(event);
}

}  // namespace vramledger::guard
