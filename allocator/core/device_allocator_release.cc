// Returning cached memory of one device to the driver: empty_cache, garbage collection under a
// memory fraction, and the releases of Malloc's out-of-memory retries. Locking:
// docs/design/locking.md.
#include <algorithm>
#include <vector>

#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::Segment;

absl::Status DeviceAllocatorImpl::GarbageCollectCachedBlocks() {
  // torch's garbage_collect_cached_blocks (CUDACachingAllocator.cpp): above threshold x the
  // memory-fraction cap of reserved bytes, return whole cached segments of the large pool,
  // the oldest first (unused for more free-block lookups than the average of the candidates),
  // until reserved is back under the threshold or nothing more can go. Not during a capture:
  // no cudaFree then (the out-of-memory path's releases skip it too).
  if (CaptureUnderway()) return absl::OkStatus();
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current(kAggregate));
  const auto threshold = static_cast<std::size_t>(options_.garbage_collection_threshold *
                                                  static_cast<double>(allowed_bytes_));
  if (reserved <= threshold) return absl::OkStatus();
  const std::size_t target = reserved - threshold;
  const std::uint64_t now = large_pool_.free_lookups;
  auto age = [now](const Block* b) { return now - b->gc_base; };
  BlockPool& pool = large_pool_;
  std::uint64_t total_age = 0;
  std::size_t candidates = 0;
  for (const Block* b : pool.blocks) {
    if (b->is_split()) continue;
    total_age += age(b);
    ++candidates;
  }
  std::size_t reclaimed = 0;
  bool freed = true;
  while (reclaimed < target && freed && candidates > 0) {
    const double age_threshold = static_cast<double>(total_age) / static_cast<double>(candidates);
    freed = false;
    std::vector<Block*> old;  // not stopping at the target: a GC each malloc would cost more
    for (Block* b : pool.blocks) {
      if (!b->is_split() && static_cast<double>(age(b)) >= age_threshold) old.push_back(b);
    }
    for (Block* b : old) {
      freed = true;
      reclaimed += b->size;
      total_age -= age(b);
      --candidates;
      if (absl::Status s = ReleaseSegment(b); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::ReleaseSegment(Block* block) {
  // Pre: `block` spans its whole segment and is in its pool's free index.
  Segment* segment = block->segment;
  if (absl::Status s = SegmentFree(block->pool, segment->ptr); !s.ok()) return s;
  const StatType types = StatTypesFor(block->pool);
  stats_.SegmentReleased(types, static_cast<std::int64_t>(segment->size));
  if (segment->size >= options_.max_split_size) stats_.oversize_segments.Decrease(1);
  Emit(TraceAction::kSegmentFree, segment->ptr, segment->size, segment->stream, 0, 0,
       block->pool->owner);
  block->pool->blocks.erase(block);
  DeleteBlock(block);
  segments_.erase(segment->ptr);
  return absl::OkStatus();
}

absl::StatusOr<bool> DeviceAllocatorImpl::ReleaseAvailableCachedBlocks(StreamId stream,
                                                                       std::size_t size) {
  // torch's release_available_cached_blocks: oversize, unsplit cached blocks of this stream,
  // the smallest one that covers `size`, else the largest ones until `size` is covered.
  if (CaptureUnderway()) return false;  // no cudaFree during a capture
  BlockPool& pool = large_pool_;
  std::vector<Block*> candidates;
  for (Block* b : pool.blocks) {
    if (b->stream == stream && b->size >= options_.max_split_size && !b->is_split()) {
      candidates.push_back(b);
    }
  }
  if (candidates.empty()) return false;
  auto fit =
      std::find_if(candidates.begin(), candidates.end(), [&](Block* b) { return b->size >= size; });
  if (fit != candidates.end()) {
    if (absl::Status s = ReleaseSegment(*fit); !s.ok()) return s;
    return true;
  }
  std::size_t released = 0;
  for (auto it = candidates.rbegin(); it != candidates.rend() && released < size; ++it) {
    released += (*it)->size;
    if (absl::Status s = ReleaseSegment(*it); !s.ok()) return s;
  }
  return released >= size;
}

absl::Status DeviceAllocatorImpl::ReleaseCachedBlocks() {
  if (CaptureUnderway()) return absl::OkStatus();  // no synchronize, free or unmap in a capture
  if (absl::Status s = FlushDeferredFrees(); !s.ok()) return s;
  if (absl::Status s = SynchronizeAndFreeEvents(); !s.ok()) return s;
  if (absl::Status s = ReleaseFreeablePrivatePools(); !s.ok()) return s;
  for (BlockPool* pool : {&large_pool_, &small_pool_}) {
    if (absl::Status s = ReleaseWholeFreeSegments(pool); !s.ok()) return s;
  }
  return ReleaseExpandablePages();
}

absl::Status DeviceAllocatorImpl::ReleaseWholeFreeSegments(BlockPool* pool) {
  // An expandable pool's ranges stay; its free pages go with ReleaseExpandablePages.
  if (pool->expandable) return absl::OkStatus();
  std::vector<Block*> whole;
  for (Block* b : pool->blocks) {
    if (!b->is_split()) whole.push_back(b);
  }
  for (Block* b : whole) {
    if (absl::Status s = ReleaseSegment(b); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::EmptyCache() {
  absl::Status result;
  std::vector<core::Regions::HostBuffer> kept;
  {
    core::DeviceMutexLock lock(&mu_);
    result = ReleaseCachedBlocks();
    // The pinned buffers running regions kept for their next pause (keep_host_buffers) are
    // cache too: freed after the lock is dropped (region_backup.cc).
    kept = TakeKeptBuffers();
  }
  absl::Status freed = FreePinned(std::move(kept));
  if (result.ok()) result = std::move(freed);
  return AfterOperation("empty_cache", std::move(result));
}

}  // namespace vramledger
