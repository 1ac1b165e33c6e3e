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
  core::DeviceMutexLock lock(&mu_);
  return private_pools_.Begin(id, std::move(filter));
}

absl::Status DeviceAllocatorImpl::EndAllocateToPool(MempoolId id) {
  core::DeviceMutexLock lock(&mu_);
  if (absl::Status s = private_pools_.End(id); !s.ok()) return s;
  if (!CaptureUnderway()) return FlushDeferredFrees();
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::ReleasePool(MempoolId id) {
  core::DeviceMutexLock lock(&mu_);
  absl::StatusOr<int> left = private_pools_.Release(id);
  if (!left.ok()) return left.status();
  if (*left > 0 || CaptureUnderway()) return absl::OkStatus();
  return ReleaseFreeablePrivatePools();
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

absl::Status DeviceAllocatorImpl::ReleaseFreeablePrivatePools() {
  return private_pools_.ReleaseUnused(
      [this](BlockPool* pool)
          ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ReleaseWholeFreeSegments(pool); },
      [this](const core::PrivatePools::Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return std::any_of(segments_.begin(), segments_.end(), [&](const auto& entry) {
          return entry.second->pool == &pool.small || entry.second->pool == &pool.large;
        });
      });
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
