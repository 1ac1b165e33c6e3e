// CUDA graph private pools of one device (PYTORCH-FACTS §6): routing by the capture's filter,
// shared pools with use counts, release after the graph is gone, failed-capture cleanup.
#include <algorithm>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;

namespace {

std::string PoolName(MempoolId id) { return absl::StrFormat("(%d, %d)", id.first, id.second); }

}  // namespace

absl::Status DeviceAllocatorImpl::BeginAllocateToPool(MempoolId id, StreamFilter filter) {
  core::DeviceMutexLock lock(&mu_);
  PruneFailedCaptures();
  for (const ActivePool& active : active_pools_) {
    if (active.id == id) {
      return absl::InvalidArgumentError(absl::StrCat("vramledger: private pool ", PoolName(id),
                                                     " is already being allocated to"));
    }
  }
  pruned_pools_.erase(std::remove(pruned_pools_.begin(), pruned_pools_.end(), id),
                      pruned_pools_.end());
  auto [it, created] = private_pools_.try_emplace(id);
  if (created) {
    it->second = std::make_unique<PrivatePool>();
  } else {
    ++it->second->use_count;  // shared: another graph captures into the same pool
  }
  ActivePool active;
  active.id = id;
  active.filter = std::move(filter);
  active.owner = std::this_thread::get_id();
  active_pools_.push_back(std::move(active));
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::EndAllocateToPool(MempoolId id) {
  core::DeviceMutexLock lock(&mu_);
  auto it = std::find_if(active_pools_.begin(), active_pools_.end(),
                         [&](const ActivePool& a) { return a.id == id; });
  if (it != active_pools_.end()) {
    active_pools_.erase(it);
  } else {
    // Pruned as failed by a call of its own thread between the end of its capture and this one
    // (not torch's order, which makes no call in between): undo the lost use.
    auto pruned = std::find(pruned_pools_.begin(), pruned_pools_.end(), id);
    auto pool = private_pools_.find(id);
    if (pruned == pruned_pools_.end() || pool == private_pools_.end()) {
      return absl::NotFoundError(
          absl::StrCat("vramledger: private pool ", PoolName(id), " is not being allocated to"));
    }
    pruned_pools_.erase(pruned);
    ++pool->second->use_count;
  }
  if (!CaptureUnderway()) return FlushDeferredFrees();
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::ReleasePool(MempoolId id) {
  core::DeviceMutexLock lock(&mu_);
  auto it = private_pools_.find(id);
  if (it == private_pools_.end() || it->second->use_count <= 0) {
    return absl::NotFoundError(
        absl::StrCat("vramledger: release of unknown private pool ", PoolName(id)));
  }
  --it->second->use_count;
  if (it->second->use_count > 0 || CaptureUnderway()) return absl::OkStatus();
  return ReleaseFreeablePrivatePools();
}

int DeviceAllocatorImpl::PoolUseCount(MempoolId id) const {
  core::DeviceMutexLock lock(&mu_);
  auto it = private_pools_.find(id);
  return it == private_pools_.end() ? 0 : it->second->use_count;
}

BlockPool* DeviceAllocatorImpl::RoutePool(const AllocationRequest& request, bool contiguous) {
  for (ActivePool& active : active_pools_) {
    if (!active.filter || !active.filter(request.stream)) continue;
    if (std::find(active.streams.begin(), active.streams.end(), request.stream) ==
        active.streams.end()) {
      active.streams.push_back(request.stream);
    }
    if (backend_->IsCapturing(request.stream)) active.saw_capture = true;
    PrivatePool& pool = *private_pools_.at(active.id);
    return request.rounded <= 1 * kMiB ? &pool.small : &pool.large;
  }
  return PoolFor(request.rounded, contiguous);
}

void DeviceAllocatorImpl::PruneFailedCaptures() {
  for (auto it = active_pools_.begin(); it != active_pools_.end();) {
    const bool over =
        it->saw_capture && std::none_of(it->streams.begin(), it->streams.end(),
                                        [&](StreamId s) { return backend_->IsCapturing(s); });
    if (!over) {
      it->ended_seen = absl::InfiniteFuture();
      ++it;
      continue;
    }
    if (it->owner != std::this_thread::get_id()) {  // maybe between EndCapture and End
      const absl::Time now = absl::Now();
      if (it->ended_seen == absl::InfiniteFuture()) it->ended_seen = now;
      if (now - it->ended_seen < kFailedCaptureGrace) {
        ++it;
        continue;
      }
    }
    if (auto pool = private_pools_.find(it->id); pool != private_pools_.end()) {
      --pool->second->use_count;  // no End and no Release will come for this capture
    }
    pruned_pools_.push_back(it->id);
    it = active_pools_.erase(it);
  }
}

bool DeviceAllocatorImpl::CaptureUnderway() {
  if (active_pools_.empty()) return false;
  PruneFailedCaptures();
  for (const ActivePool& active : active_pools_) {
    if (active.streams.empty()) return true;  // may be capturing without having allocated
    for (StreamId s : active.streams) {
      if (backend_->IsCapturing(s)) return true;
    }
  }
  return false;
}

absl::Status DeviceAllocatorImpl::FlushDeferredFrees() {
  return stream_events_.FlushDeferred(
      [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return CaptureUnderway(); },
      [this](Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ReleaseAfterEvents(b); });
}

absl::Status DeviceAllocatorImpl::ReleaseFreeablePrivatePools() {
  for (auto it = private_pools_.begin(); it != private_pools_.end();) {
    PrivatePool& pool = *it->second;
    if (pool.use_count > 0) {
      ++it;
      continue;
    }
    for (BlockPool* blocks : {&pool.large, &pool.small}) {
      std::vector<Block*> whole;
      for (Block* b : blocks->blocks) {
        if (!b->is_split()) whole.push_back(b);
      }
      for (Block* b : whole) {
        if (absl::Status s = ReleaseSegment(b); !s.ok()) return s;
      }
    }
    const bool has_segments =
        std::any_of(segments_.begin(), segments_.end(), [&](const auto& entry) {
          return entry.second->pool == &pool.small || entry.second->pool == &pool.large;
        });
    if (has_segments) {
      ++it;
    } else {
      it = private_pools_.erase(it);
    }
  }
  return absl::OkStatus();
}

std::int64_t DeviceAllocatorImpl::PrivatePoolFreeBlocks() const {
  std::int64_t n = 0;
  for (const auto& [id, pool] : private_pools_) {
    n += static_cast<std::int64_t>(pool->small.blocks.size() + pool->large.blocks.size());
  }
  return n;
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
