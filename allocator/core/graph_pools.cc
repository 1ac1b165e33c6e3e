// The allocator's side of its private pools (core/private_pools.h): the public begin, end and
// release calls under the lock, the deferred frees flushed when a capture ends, and the release
// of the segments of pools with no use left.
#include <algorithm>
#include <utility>

#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;

absl::Status DeviceAllocatorImpl::BeginAllocateToPool(MempoolId id, StreamFilter filter) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    CreateInRegion(id, /*uses=*/0);  // a capture inside a region: its pool is the region's
    result = private_pools_.Begin(id, std::move(filter));
  }
  return AfterOperation("begin_allocate_to_pool", std::move(result));
}

absl::Status DeviceAllocatorImpl::EndAllocateToPool(MempoolId id) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = private_pools_.End(id);
    if (result.ok() && !CaptureUnderway()) result = FlushDeferredFrees();
  }
  return AfterOperation("end_allocate_to_pool", std::move(result));
}

absl::Status DeviceAllocatorImpl::ReleasePool(MempoolId id) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    absl::StatusOr<int> left = private_pools_.Release(id);
    if (!left.ok()) {
      result = left.status();
    } else if (*left == 0 && !CaptureUnderway()) {
      result = ReleaseFreeablePrivatePools();
    }
  }
  return AfterOperation("release_pool", std::move(result));
}

int DeviceAllocatorImpl::PoolUseCount(MempoolId id) const {
  core::DeviceMutexLock lock(&mu_);
  return private_pools_.UseCount(id);
}

absl::Status DeviceAllocatorImpl::FlushDeferredFrees() {
  return stream_events_.FlushDeferred(
      [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return CaptureUnderway(); },
      [this](Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ReleaseAfterEvents(b); });
}

absl::Status DeviceAllocatorImpl::ReleaseFreeablePrivatePools(const MempoolId* only) {
  const absl::Status released = private_pools_.ReleaseUnused(
      [this](BlockPool* pool)
          ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ReleaseWholeFreeSegments(pool); },
      [this](const core::PrivatePools::Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto owned = [&](const core::Segment& seg) {
          return seg.pool == &pool.small || seg.pool == &pool.large;
        };
        // A pool of a region keeps its expandable ranges (they are never released): the pool
        // stays, and with it the blocks' pool pointers.
        return std::any_of(segments_.begin(), segments_.end(),
                           [&](const auto& entry) { return owned(*entry.second); }) ||
               std::any_of(page_table_.segments().begin(), page_table_.segments().end(),
                           [&](const auto& seg) { return owned(*seg); });
      },
      only);
  // A forgotten pool leaves its region (also when a later pool's release failed): its id may
  // name a new pool later (the API allows it; torch's own ids only grow), made outside the
  // region or inside another, and a region whose list still named it would pause and check a
  // pool that is not its own.
  regions_.ForgetPools([this](MempoolId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return private_pools_.Find(id) == nullptr;
  });
  return released;
}

absl::Status DeviceAllocator::BeginAllocateToPool(MempoolId pool, StreamFilter filter) {
  return impl_->BeginAllocateToPool(pool, std::move(filter));
}

absl::Status DeviceAllocator::EndAllocateToPool(MempoolId pool) {
  return impl_->EndAllocateToPool(pool);
}

absl::Status DeviceAllocator::ReleasePool(MempoolId pool) { return impl_->ReleasePool(pool); }

int DeviceAllocator::PoolUseCount(MempoolId pool) const { return impl_->PoolUseCount(pool); }

}  // namespace vramledger
