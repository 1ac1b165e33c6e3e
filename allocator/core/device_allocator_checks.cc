// The allocator's checking tier: its parts' own invariants (CheckParts, run by CheckInvariants)
// and, in a build with VRAMLEDGER_EXPENSIVE_CHECKS, the full check after every public operation.
#include "absl/strings/str_cat.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

absl::Status DeviceAllocatorImpl::CheckParts() const {
  for (const core::BlockPool* pool : AllPools()) {
    if (absl::Status s = pool->blocks.CheckInvariants(); !s.ok()) return s;
  }
  if (absl::Status s = private_pools_.CheckInvariants(); !s.ok()) return s;
  if (absl::Status s = stream_events_.CheckInvariants(); !s.ok()) return s;
  return stats_.CheckInvariants(static_cast<std::int64_t>(regions_.UnmappedLostBytes()));
}

absl::Status DeviceAllocatorImpl::CheckAfter(const char* operation, absl::Status result) const {
  absl::Status check = CheckInvariants();
  if (check.ok()) return result;
  // A broken invariant outranks the operation's own result, error or not: it is a bug here.
  return absl::InternalError(
      absl::StrCat("vramledger: invariant broken after ", operation, ": ", check.message()));
}

}  // namespace vramledger
