// torch.cuda.MemPool on the allocator's private pools: creation with an optional segment source,
// use_on_oom and no_split, the empty_cache of one pool, and the out-of-memory path's last resort.
// Locking: docs/design/locking.md.
#include <algorithm>
#include <memory>
#include <utility>

#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;

absl::Status DeviceAllocatorImpl::CreateOrIncrefPool(MempoolId id,
                                                     std::shared_ptr<SegmentSource> source) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    // A MemPool made inside a region belongs to it (unless its segments come from a source of
    // its own, which cannot be paused).
    if (source != nullptr || !CreateInRegion(id, /*uses=*/1)) {
      result = private_pools_.CreateOrIncref(id, std::move(source));
    }
  }
  return AfterOperation("create_or_incref_pool", std::move(result));
}

absl::Status DeviceAllocatorImpl::SetUseOnOOM(MempoolId id, bool use_on_oom) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = private_pools_.SetUseOnOOM(id, use_on_oom);
  }
  return AfterOperation("set_use_on_oom", std::move(result));
}

absl::Status DeviceAllocatorImpl::SetNoSplit(MempoolId id) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = private_pools_.SetNoSplit(id);
  }
  return AfterOperation("set_no_split", std::move(result));
}

absl::Status DeviceAllocatorImpl::EmptyCache(MempoolId id) {
  if (id == MempoolId{0, 0}) return EmptyCache();
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    // torch releases only a pool with no use left (a live graph's or MemPool's free blocks stay
    // its own), waits only for that pool's events, and leaves an unknown pool and every other
    // pool alone; nothing is freed while a capture may be under way.
    const auto it = std::find_if(private_pools_.begin(), private_pools_.end(),
                                 [&](const auto& entry) { return entry.first == id; });
    if (it != private_pools_.end() && it->second->use_count == 0 && !CaptureUnderway()) {
      result = SettlePendingFrees(PoolSegments(*it->second),
                                  "Events should have synchronized when emptying a pool");
      if (result.ok()) result = ReleaseFreeablePrivatePools(&id);
    }
  }
  return AfterOperation("empty_cache_of_pool", std::move(result));
}

Block* DeviceAllocatorImpl::TakeFromUseOnOomPools(const BlockPool* pool,
                                                  const AllocationRequest& request) {
  if (pool->owner != MempoolId{0, 0}) return nullptr;  // torch: a pool's request just fails
  for (core::PrivatePools::Pool* candidate : private_pools_.UseOnOomPools()) {
    // A region's pools are expandable: a free block there may lie on unmapped pages (or, paused,
    // on none), so it cannot serve a request as it is.
    if (candidate->small.expandable) continue;
    BlockPool& blocks = request.rounded <= 1 * kMiB ? candidate->small : candidate->large;
    auto found = blocks.blocks.FindBestFit(request.stream, request.rounded, options_.max_split_size,
                                           options_.max_non_split_rounding);
    if (found == blocks.blocks.end()) continue;
    Block* block = *found;
    blocks.blocks.erase(found);
    return block;
  }
  return nullptr;
}

absl::Status DeviceAllocatorImpl::SegmentMalloc(const BlockPool* pool, std::size_t size,
                                                StreamId stream, DevicePtr* ptr) {
  if (pool->source == nullptr) return backend_->Malloc(size, ptr);
  absl::StatusOr<DevicePtr> got = pool->source->Allocate(size, stream);
  if (!got.ok()) return got.status();
  if (*got == 0) return absl::ResourceExhaustedError("the pool's allocator returned no memory");
  *ptr = *got;
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::SegmentFree(const BlockPool* pool, DevicePtr ptr) {
  return pool->source == nullptr ? backend_->Free(ptr) : pool->source->Free(ptr);
}

absl::Status DeviceAllocator::CreateOrIncrefPool(MempoolId pool,
                                                 std::shared_ptr<SegmentSource> source) {
  return impl_->CreateOrIncrefPool(pool, std::move(source));
}

absl::Status DeviceAllocator::SetUseOnOOM(MempoolId pool, bool use_on_oom) {
  return impl_->SetUseOnOOM(pool, use_on_oom);
}

absl::Status DeviceAllocator::SetNoSplit(MempoolId pool) { return impl_->SetNoSplit(pool); }

absl::Status DeviceAllocator::EmptyCache(MempoolId pool) { return impl_->EmptyCache(pool); }

}  // namespace vramledger
