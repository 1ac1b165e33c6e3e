// The allocator's side of private-pool checkpoints (core/pool_checkpoint.h), which CUDA graph
// trees take after recording a graph and restore before recording the next one: checkpoint,
// restore at the exact addresses, and the exact check of the pool's live allocations.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::PoolCheckpoint;
using core::PoolRestore;
using core::Segment;
using core::SegmentCheckpoint;

namespace {

std::string PoolName(MempoolId id) { return absl::StrFormat("(%d, %d)", id.first, id.second); }

// The pool `id` names, or nullptr.
const core::PrivatePools::Pool* FindPool(const core::PrivatePools& pools, MempoolId id) {
  auto it = std::find_if(pools.begin(), pools.end(),
                         [&](const auto& entry) { return entry.first == id; });
  return it == pools.end() ? nullptr : it->second.get();
}

// torch's errors for a pool it cannot checkpoint or restore: unknown, or released (its graphs
// were reset: torch calls it freeable).
absl::Status CheckPoolUsable(const core::PrivatePools::Pool* pool, MempoolId id, int device,
                             const char* call) {
  if (pool == nullptr) {
    return absl::NotFoundError(absl::StrFormat(
        "vramledger: %s: Could not find pool of id %s on device %d", call, PoolName(id), device));
  }
  if (pool->small.expandable || pool->large.expandable) {  // the walks here see plain segments
    return absl::UnimplementedError(absl::StrFormat(
        "vramledger: %s: private pool %s on device %d has expandable segments, which pool "
        "checkpoints do not cover",
        call, PoolName(id), device));
  }
  if (pool->use_count <= 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "vramledger: %s: private pool %s on device %d was released (torch: Not expected to "
        "checkpoint freeable graph)",
        call, PoolName(id), device));
  }
  return absl::OkStatus();
}

bool PendingFree(const Block* b) { return !b->allocated && b->event_count > 0; }

// Synchronizes every stream a live block of `segments` was used on (record_stream).
absl::Status WaitForStreamUses(DeviceBackend* backend, const std::vector<Segment*>& segments) {
  std::vector<StreamId> streams;
  for (const Segment* segment : segments) {
    for (const Block* b = segment->head; b != nullptr; b = b->next) {
      if (!b->allocated) continue;
      for (StreamId s : b->stream_uses) {
        if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
      }
    }
  }
  for (StreamId s : streams) {
    if (absl::Status st = backend->SynchronizeStream(s); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<Segment*> DeviceAllocatorImpl::PoolSegments(
    const core::PrivatePools::Pool& pool) const {
  std::vector<Segment*> out;
  for (const auto& [ptr, segment] : segments_) {
    if (segment->pool == &pool.small || segment->pool == &pool.large) out.push_back(segment.get());
  }
  return out;
}

absl::Status DeviceAllocatorImpl::SettlePendingFrees(const std::vector<Segment*>& segments,
                                                     const char* torch_words) {
  auto pending = [&] {
    for (const Segment* segment : segments) {
      for (const Block* b = segment->head; b != nullptr; b = b->next) {
        if (PendingFree(b)) return true;
      }
    }
    return false;
  };
  if (!pending()) return absl::OkStatus();
  if (CaptureUnderway()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "vramledger: blocks of the private pool wait on stream events while a capture is under "
        "way, so they cannot be waited for (torch: %s)",
        torch_words));
  }
  if (stream_events_.has_deferred()) {
    if (absl::Status s = FlushDeferredFrees(); !s.ok()) return s;
  }
  if (absl::Status s = ProcessEvents(); !s.ok()) return s;
  if (!pending()) return absl::OkStatus();
  return SynchronizeAndFreeEvents();  // off the hot path: graph trees checkpoint per recording
}

absl::StatusOr<PoolCheckpoint> DeviceAllocatorImpl::CheckpointPool(MempoolId id) {
  absl::StatusOr<PoolCheckpoint> result;
  {
    core::DeviceMutexLock lock(&mu_);
    const core::PrivatePools::Pool* pool = FindPool(private_pools_, id);
    if (absl::Status s = CheckPoolUsable(pool, id, device_, "getCheckpointState"); !s.ok()) {
      result = s;
    } else {
      const std::vector<Segment*> segments = PoolSegments(*pool);
      absl::Status settled =
          SettlePendingFrees(segments, "Events should have synchronized when checkpointing block");
      if (!settled.ok()) {
        result = settled;
      } else {
        PoolCheckpoint checkpoint;
        checkpoint.device = device_;
        checkpoint.pool = id;
        checkpoint.incarnation = pool->incarnation;
        for (const Segment* segment : segments) {
          checkpoint.segments.push_back(core::CheckpointOf(*segment));
        }
        result = std::move(checkpoint);
      }
    }
  }
  return AfterOperation("checkpoint_pool", std::move(result));
}

absl::StatusOr<PoolRestore> DeviceAllocatorImpl::RestorePool(MempoolId id,
                                                             const PoolCheckpoint& checkpoint) {
  auto restore = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<PoolRestore> {
    if (checkpoint.pool != id || checkpoint.device != device_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "vramledger: setCheckpointPoolState: a checkpoint of private pool %s on device %d "
          "cannot restore private pool %s on device %d",
          PoolName(checkpoint.pool), checkpoint.device, PoolName(id), device_));
    }
    const core::PrivatePools::Pool* pool = FindPool(private_pools_, id);
    if (pool != nullptr && pool->incarnation != checkpoint.incarnation) {
      // Its segments went back with the pool; the pool of that id now (torch's ids only grow,
      // the C++ API may reuse one) may even be of another kind, a region's expandable pool.
      return absl::FailedPreconditionError(absl::StrFormat(
          "vramledger: setCheckpointPoolState: the checkpoint of private pool %s on device %d "
          "was taken from a pool released and forgotten since; the pool of that id now is "
          "another one, which the checkpoint cannot restore (it is unchanged)",
          PoolName(id), device_));
    }
    if (absl::Status s = CheckPoolUsable(pool, id, device_, "setCheckpointPoolState"); !s.ok()) {
      return s;
    }
    // Every check before the first change: a refused checkpoint leaves the pool as it was.
    absl::flat_hash_set<DevicePtr> named;
    for (const SegmentCheckpoint& seg : checkpoint.segments) {
      if (absl::Status s = core::CheckLayout(seg); !s.ok()) return s;
      if (!named.insert(seg.ptr).second) {
        return absl::InvalidArgumentError(
            absl::StrFormat("vramledger: the checkpoint names segment 0x%x twice", seg.ptr));
      }
      auto live = segments_.find(seg.ptr);
      if (absl::Status s =
              core::CheckSegmentMatches(seg, live == segments_.end() ? nullptr : live->second.get(),
                                        &pool->small, &pool->large);
          !s.ok()) {
        return s;
      }
    }
    const std::vector<Segment*> segments = PoolSegments(*pool);
    const bool needs_events = std::any_of(segments.begin(), segments.end(), [](Segment* seg) {
      for (const Block* b = seg->head; b != nullptr; b = b->next) {
        if (PendingFree(b) || (b->allocated && !b->stream_uses.empty())) return true;
      }
      return false;
    });
    if (needs_events && CaptureUnderway()) {
      return absl::FailedPreconditionError(
          "vramledger: setCheckpointPoolState: blocks of the private pool wait on stream events "
          "while a capture is under way (torch: Events should have synchronized when setting "
          "checkpointed block); the pool is unchanged");
    }
    // What can fail comes before the pool's frees, so a failure leaves the caller's blocks
    // live: the frees it requested already (waiting on events) complete, then the work queued
    // on its live blocks' other streams is waited for, so those blocks free at once.
    if (absl::Status s = SettlePendingFrees(
            segments, "Events should have synchronized when setting checkpointed block");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = WaitForStreamUses(backend_, segments); !s.ok()) return s;
    PoolRestore restored;
    for (Segment* segment : segments) {
      for (Block* b = segment->head; b != nullptr; b = b->next) {
        if (!b->allocated) continue;
        b->stream_uses.clear();  // their work is done (above)
        restored.freed.push_back(b->ptr);
      }
    }
    for (DevicePtr ptr : restored.freed) {
      if (absl::Status s = FreeLocked(ptr, /*context=*/0); !s.ok()) return s;
    }
    for (const SegmentCheckpoint& seg : checkpoint.segments) {
      const Block* head = segments_.at(seg.ptr)->head;
      if (head->next != nullptr || !head->is_free()) {  // the frees above leave none such
        return absl::InternalError(absl::StrFormat(
            "vramledger: segment 0x%x is not one free block after its pool's frees", seg.ptr));
      }
    }
    for (const SegmentCheckpoint& seg : checkpoint.segments) {
      LayOutSegment(segments_.at(seg.ptr).get(), seg, &restored);
    }
    return restored;
  };
  absl::StatusOr<PoolRestore> result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = restore();
  }
  return AfterOperation("restore_pool", std::move(result));
}

void DeviceAllocatorImpl::LayOutSegment(Segment* segment, const SegmentCheckpoint& checkpoint,
                                        PoolRestore* restored) {
  // Every allocation of the pool was freed and no block waits on events: the segment is one
  // free block, indexed.
  BlockPool* pool = segment->pool;
  const StatType types = StatTypesFor(pool);
  Block* whole = segment->head;
  pool->blocks.erase(core::FreeBlockIndex::Position(whole));
  const bool split = checkpoint.blocks.size() > 1;
  Block* prev = nullptr;
  for (const core::BlockCheckpoint& saved : checkpoint.blocks) {
    Block* b = prev == nullptr ? whole : NewBlock();
    b->ptr = saved.ptr;
    b->size = saved.size;
    b->stream = segment->stream;
    b->pool = pool;
    b->segment = segment;
    b->prev = prev;
    b->next = nullptr;
    if (prev != nullptr) prev->next = b;
    prev = b;
    b->gc_base = pool->free_lookups;
    if (!saved.allocated) {
      b->requested_size = 0;
      b->tag = 0;
      b->context = 0;
      pool->blocks.insert(b);
      if (split) {
        stats_.inactive_split.Increase(types, 1);
        stats_.inactive_split_bytes.Increase(types, static_cast<std::int64_t>(b->size));
      }
      continue;
    }
    // As UseBlock's allocation: live map, statistics and the trace entry the ledger reads.
    b->allocated = true;
    b->requested_size = saved.requested_size;
    b->tag = saved.tag;
    b->context = saved.context;
    b->free_context = 0;
    live_blocks_.Insert(b->ptr, b);
    stats_.Allocated(types, static_cast<std::int64_t>(b->size),
                     static_cast<std::int64_t>(saved.requested_size));
    if (b->size >= options_.max_split_size) stats_.oversize_allocations.Increase(1);
    Emit(TraceAction::kAlloc, b->ptr, saved.requested_size, b->stream, saved.context, saved.tag);
    restored->allocated.push_back(saved);
  }
}

absl::StatusOr<bool> DeviceAllocatorImpl::CheckPoolLiveAllocations(
    MempoolId id, const std::vector<DevicePtr>& live) const {
  core::DeviceMutexLock lock(&mu_);
  const core::PrivatePools::Pool* pool = FindPool(private_pools_, id);
  if (pool == nullptr) {
    return absl::NotFoundError(absl::StrFormat(
        "vramledger: checkPoolLiveAllocations: Could not find pool of id %s on device %d",
        PoolName(id), device_));
  }
  if (pool->small.expandable || pool->large.expandable) {
    return absl::UnimplementedError(absl::StrFormat(
        "vramledger: checkPoolLiveAllocations: private pool %s on device %d has expandable "
        "segments, which the check does not cover",
        PoolName(id), device_));
  }
  const absl::flat_hash_set<DevicePtr> expected(live.begin(), live.end());
  std::size_t allocated = 0;
  for (const Segment* segment : PoolSegments(*pool)) {
    for (const Block* b = segment->head; b != nullptr; b = b->next) {
      if (!b->allocated) continue;
      if (!expected.contains(b->ptr)) return false;
      ++allocated;
    }
  }
  return allocated == expected.size();
}

absl::StatusOr<PoolCheckpoint> DeviceAllocator::CheckpointPool(MempoolId pool) {
  return impl_->CheckpointPool(pool);
}

absl::StatusOr<PoolRestore> DeviceAllocator::RestorePool(MempoolId pool,
                                                         const PoolCheckpoint& checkpoint) {
  return impl_->RestorePool(pool, checkpoint);
}

absl::StatusOr<bool> DeviceAllocator::CheckPoolLiveAllocations(
    MempoolId pool, const std::vector<DevicePtr>& live) const {
  return impl_->CheckPoolLiveAllocations(pool, live);
}

}  // namespace vramledger
