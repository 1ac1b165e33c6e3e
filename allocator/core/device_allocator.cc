// The allocation and free paths of one device, composing its parts (free-block indexes, stream
// events, private pools, stats): Malloc's steps, segment growth, Free and record_stream.
// Locking: docs/design/locking.md.
#include "vramledger/device_allocator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/device_allocator_impl.h"
#include "core/size_policy.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::Segment;
namespace sp = size_policy;

std::string FormatSize(std::uint64_t bytes) {
  // torch's format_size (c10/cuda/CUDACachingAllocator.cpp).
  if (bytes <= 1024) return absl::StrCat(bytes, " bytes");
  if (bytes <= 1048576) return absl::StrFormat("%.2f KiB", bytes / 1024.0);
  if (bytes <= 1073741824) return absl::StrFormat("%.2f MiB", bytes / 1048576.0);
  return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
}

DeviceAllocatorImpl::DeviceAllocatorImpl(const Options& options, DeviceBackend* backend)
    : options_(options), backend_(backend), device_(backend->device()) {
  // Debian's Abseil runs Mutex deadlock detection on every Lock (a graph update, ~300 ns),
  // which would be most of the hot path. Our lock order is flat (one mutex per device, no
  // nesting; docs/design/locking.md), so the detector has nothing to find.
  static const bool kDetectionOff = [] {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    return true;
  }();
  (void)kDetectionOff;
  core::DeviceMutexLock lock(&mu_);
  if (options_.per_process_memory_fraction > 0.0) {
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    if (backend_->MemGetInfo(&free_bytes, &total_bytes).ok()) {
      fraction_set_ = true;
      allowed_bytes_ = static_cast<std::size_t>(options_.per_process_memory_fraction *
                                                static_cast<double>(total_bytes));
    }
  }
  stats_.max_split_size =
      options_.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(options_.max_split_size);
}

DeviceAllocatorImpl::~DeviceAllocatorImpl() {
  core::DeviceMutexLock lock(&mu_);
  (void)SynchronizeAndFreeEvents();
  ReleaseExpandableAtExit();  // old mappings, unreleased handles (expandable.cc)
  for (auto& [ptr, segment] : segments_) {
    (void)SegmentFree(segment->pool, ptr);
    for (Block* b = segment->head; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
  ReleaseExpandableSegmentsAtExit();
  for (const auto& region : regions_.all()) {  // pinned backups and kept buffers
    for (const auto* list : {&region->buffers, &region->kept}) {
      for (const auto& buffer : *list) (void)backend_->HostFreePinned(buffer.data);
    }
  }
  for (const auto& [handle, fd] : exported_fds_) (void)backend_->CloseExported(fd);
  spare_events_.DestroyAll(backend_);
}

absl::StatusOr<DevicePtr> DeviceAllocatorImpl::Malloc(std::size_t size, StreamId stream) {
  if (size == 0) return DevicePtr{0};
  AllocationRequest request;
  request.device = device_;
  request.size = size;
  request.stream = stream;
  AllocatorHooks* hooks = hooks_.load(std::memory_order_acquire);
  if (hooks != nullptr) {  // stacks and tags are captured before the lock is taken
    request.context = hooks->CaptureContext(TraceAction::kAlloc);
    request.tag = hooks->CurrentTag();
  }
  absl::StatusOr<DevicePtr> result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = MallocLocked(request, hooks);
  }
  return AfterOperation("malloc", std::move(result));
}

absl::StatusOr<DevicePtr> DeviceAllocatorImpl::MallocLocked(AllocationRequest& request,
                                                            AllocatorHooks* hooks) {
  if (absl::Status s = Admit(request, hooks); !s.ok()) return s;
  // The thread-local scope only matters with expandable segments on: skip its read otherwise.
  const bool contiguous = options_.expandable_segments && ContiguousSegmentsScope::active();
  BlockPool* pool = private_pools_.any_active()  // a private pool's filter may take it
                        ? private_pools_.Route(request.stream, request.rounded)
                        : nullptr;
  if (pool == nullptr) pool = PoolFor(request.rounded, contiguous);
  if (pool->paused) return PausedRegionRefusal(pool, request);
  if (pool->expandable) {
    growth_refusal_ = absl::OkStatus();
    return MallocExpandable(pool, request);
  }
  const bool gc = fraction_set_ && options_.garbage_collection_threshold > 0;
  if (gc) ++pool->free_lookups;
  auto found = pool->blocks.FindBestFit(request.stream, request.rounded, options_.max_split_size,
                                        options_.max_non_split_rounding);
  if (found != pool->blocks.end()) return UseBlock(*found, request, &found)->ptr;
  absl::StatusOr<Block*> grown = GrowPool(pool, request, gc);
  if (!grown.ok()) return grown.status();
  return UseBlock(*grown, request, nullptr)->ptr;
}

absl::Status DeviceAllocatorImpl::Admit(AllocationRequest& request, AllocatorHooks* hooks) {
  if (request.size >= sp::kMaxRequest) {
    ++stats_.num_ooms;
    return absl::ResourceExhaustedError(
        "CUDA out of memory. Tried to allocate more than 1EB memory.");
  }
  if (stream_events_.pending() > 0) {
    if (absl::Status s = ProcessEvents(); !s.ok()) return s;
  }
  request.rounded = sp::RoundSize(request.size, options_.roundup_power2_divisions);
  if (hooks != nullptr) {
    if (absl::Status s = hooks->CheckAllocation(request, HookView()); !s.ok()) {
      ++stats_.num_ooms;
      Emit(TraceAction::kOom, 0, request.rounded, request.stream, request.context, request.tag);
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Block*> DeviceAllocatorImpl::GrowPool(BlockPool* pool,
                                                     const AllocationRequest& request, bool gc) {
  // torch's order: garbage collection once no cached block fits, before a new segment.
  if (gc) {
    if (absl::Status s = GarbageCollectCachedBlocks(); !s.ok()) return s;
  }
  growth_refusal_ = absl::OkStatus();
  const std::size_t alloc_size = sp::AllocationSize(request.rounded, options_.large_segment_size);
  auto grown = AllocSegment(pool, request, alloc_size);
  if (!grown.ok()) return grown.status();
  if (*grown == nullptr && options_.max_split_size != SIZE_MAX) {
    auto released = ReleaseAvailableCachedBlocks(request.stream, alloc_size);
    if (!released.ok()) return released.status();
    if (*released) {
      grown = AllocSegment(pool, request, alloc_size);
      if (!grown.ok()) return grown.status();
    }
  }
  if (*grown == nullptr) {
    // Last resort: wait for every event, return every fully free segment, retry once.
    if (absl::Status s = ReleaseCachedBlocks(); !s.ok()) return s;
    ++stats_.num_alloc_retries;
    grown = AllocSegment(pool, request, alloc_size);
    if (!grown.ok()) return grown.status();
  }
  if (*grown != nullptr) return *grown;
  if (growth_refusal_.ok()) {  // out of memory, not refused: torch's last resort first
    if (Block* taken = TakeFromUseOnOomPools(pool, request); taken != nullptr) return taken;
  }
  if (!growth_refusal_.ok()) {  // the guard said no, even after the cache was released
    ++stats_.num_ooms;
    Emit(TraceAction::kOom, 0, request.rounded, request.stream, request.context, request.tag);
    return growth_refusal_;
  }
  return OutOfMemory(request, alloc_size);
}

void DeviceAllocatorImpl::EmitToHooks(TraceAction action, DevicePtr addr, std::size_t size,
                                      StreamId stream, std::uint64_t context, std::uint32_t tag,
                                      MempoolId pool) {
  AllocatorHooks* hooks = hooks_.load(std::memory_order_relaxed);
  if (hooks == nullptr) return;
  TraceEntry e;
  e.action = action;
  e.device = device_;
  e.addr = addr;
  e.size = size;
  e.stream = stream;
  e.context = context;
  e.tag = tag;
  e.pool = pool;
  hooks->OnEvent(e);
}

absl::StatusOr<Block*> DeviceAllocatorImpl::AllocSegment(BlockPool* pool,
                                                         const AllocationRequest& request,
                                                         std::size_t alloc_size) {
  const StreamId stream = request.stream;
  const std::size_t reserved = static_cast<std::size_t>(stats_.reserved_bytes.current(kAggregate));
  if (fraction_set_ && reserved + alloc_size > allowed_bytes_) return nullptr;
  if (AllocatorHooks* hooks = hooks_.load(std::memory_order_relaxed); hooks != nullptr) {
    absl::Status verdict = hooks->CheckGrowth(request, reserved + alloc_size, HookView());
    if (!verdict.ok()) {
      growth_refusal_ = std::move(verdict);
      return nullptr;
    }
    growth_refusal_ = absl::OkStatus();  // a later check allowed it
  }
  DevicePtr ptr = 0;
  absl::Status s;
  {
    RelaxedCaptureScope relaxed(backend_);  // cudaMalloc must not break a capture under way
    s = SegmentMalloc(pool, alloc_size, stream, &ptr);
  }
  if (absl::IsResourceExhausted(s)) return nullptr;
  if (!s.ok()) return s;
  auto segment = std::make_unique<Segment>();
  Block* block = NewBlock();
  block->ptr = ptr;
  block->size = alloc_size;
  block->stream = stream;
  block->pool = pool;
  block->segment = segment.get();
  segment->ptr = ptr;
  segment->size = alloc_size;
  segment->stream = stream;
  segment->pool = pool;
  segment->head = block;
  segments_.emplace(ptr, std::move(segment));
  const StatType types = StatTypesFor(pool);
  stats_.SegmentReserved(types, static_cast<std::int64_t>(alloc_size));
  if (alloc_size >= options_.max_split_size) stats_.oversize_segments.Increase(1);
  Emit(TraceAction::kSegmentAlloc, ptr, alloc_size, stream, request.context, request.tag,
       pool->owner);
  return block;
}

bool DeviceAllocatorImpl::ShouldSplit(const Block* block, std::size_t size) const {
  const std::size_t remaining = block->size - size;
  // An expandable segment's free tail is the unmapped rest of its range, not a cached block:
  // it is split off even under no_split, or one request would take (and count) the whole range.
  if (block->pool->expandable) return remaining >= sp::kMinBlockSize;
  if (block->pool->no_split) return false;  // a MemPool's no_split
  if (block->pool->is_small) return remaining >= sp::kMinBlockSize;
  return size < options_.max_split_size && remaining > sp::kSmallSize;
}

Block* DeviceAllocatorImpl::UseBlock(Block* block, const AllocationRequest& request,
                                     const BlockPool::Index::iterator* indexed) {
  const std::size_t rounded = request.rounded;
  const std::size_t requested = request.size;
  BlockPool* pool = block->pool;
  const StatType types = StatTypesFor(pool);
  const bool already_split = block->is_split();
  if (ShouldSplit(block, rounded)) {
    // The front becomes the allocation; the remainder stays free in the pool.
    Block* remaining = block;
    block = pool->blocks.SplitFront(remaining, rounded, NewBlock(), indexed != nullptr);
    if (pool->expandable) {
      // torch counts no inactive split in expandable segments (its alloc_found_block and
      // free_block skip them), so neither do we: the figures stay comparable.
    } else if (already_split) {
      stats_.inactive_split_bytes.Decrease(types, static_cast<std::int64_t>(block->size));
    } else {
      stats_.inactive_split_bytes.Increase(types, static_cast<std::int64_t>(remaining->size));
      stats_.inactive_split.Increase(types, 1);
    }
  } else {
    if (indexed != nullptr) pool->blocks.erase(*indexed);
    if (already_split && !pool->expandable) {
      stats_.inactive_split_bytes.Decrease(types, static_cast<std::int64_t>(block->size));
      stats_.inactive_split.Decrease(types, 1);
    }
  }
  if (pool->expandable) CountUse(block, +1);
  block->allocated = true;
  block->requested_size = requested;
  block->tag = request.tag;
  block->context = request.context;
  block->free_context = 0;
  live_blocks_.Insert(block->ptr, block);
  stats_.Allocated(types, static_cast<std::int64_t>(block->size),
                   static_cast<std::int64_t>(requested));
  if (block->size >= options_.max_split_size) stats_.oversize_allocations.Increase(1);
  Emit(TraceAction::kAlloc, block->ptr, requested, block->stream, request.context, request.tag,
       pool->owner);
  return block;
}

absl::Status DeviceAllocatorImpl::Free(DevicePtr ptr) {
  if (ptr == 0) return absl::OkStatus();
  AllocatorHooks* hooks = hooks_.load(std::memory_order_acquire);
  const std::uint64_t context =
      hooks != nullptr ? hooks->CaptureContext(TraceAction::kFreeRequested) : 0;
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = FreeLocked(ptr, context);
  }
  return AfterOperation("free", std::move(result));
}

absl::Status DeviceAllocatorImpl::FreeLocked(DevicePtr ptr, std::uint64_t context) {
  std::size_t slot = 0;
  Block* block = live_blocks_.Find(ptr, &slot);
  if (block == nullptr || !block->allocated) {
    return absl::NotFoundError(absl::StrFormat(
        "free of address 0x%x, which vramledger did not allocate on device %d or already freed",
        ptr, backend_->device()));
  }
  if (block->pool->paused) ReadmitPausedBlock(block);  // its pages are gone: freed at once
  block->allocated = false;
  block->free_context = context;
  Emit(TraceAction::kFreeRequested, block->ptr, block->requested_size, block->stream, context,
       block->tag, block->pool->owner);
  const StatType types = StatTypesFor(block->pool);
  stats_.FreeRequested(types, static_cast<std::int64_t>(block->size));
  if (block->size >= options_.max_split_size) stats_.oversize_allocations.Decrease(1);
  if (!block->stream_uses.empty()) {
    // Used on other streams: reusable only once their work up to now has completed.
    return InsertEvents(block);
  }
  live_blocks_.EraseAt(slot);
  FreeBlock(block);
  return absl::OkStatus();
}

void DeviceAllocatorImpl::FreeBlock(Block* block) {
  BlockPool* pool = block->pool;
  const StatType types = StatTypesFor(pool);
  const auto original_size = static_cast<std::int64_t>(block->size);
  const auto requested = static_cast<std::int64_t>(block->requested_size);
  Emit(TraceAction::kFreeCompleted, block->ptr, block->requested_size, block->stream,
       block->free_context, block->tag, pool->owner);
  if (pool->expandable) CountUse(block, -1);
  const core::FreeBlockIndex::Merged merged = pool->blocks.Merge(block);
  for (int i = 0; i < merged.num_gone; ++i) DeleteBlock(merged.gone[i]);
  std::int64_t split_blocks_change = -merged.neighbours;
  std::int64_t split_bytes_change = -merged.neighbour_bytes;
  Block* result = merged.block;
  result->gc_base = pool->free_lookups;  // freed now: a merge takes the newest age
  if (result->is_split()) {
    split_blocks_change += 1;
    split_bytes_change += static_cast<std::int64_t>(result->size);
  }
  if (!pool->expandable) {
    UpdateStat(stats_.inactive_split, types, split_blocks_change);
    UpdateStat(stats_.inactive_split_bytes, types, split_bytes_change);
  }
  stats_.FreeCompleted(types, original_size, requested);
}

absl::Status DeviceAllocatorImpl::RecordStream(DevicePtr ptr, StreamId stream) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = RecordStreamLocked(ptr, stream);
  }
  return AfterOperation("record_stream", std::move(result));
}

absl::Status DeviceAllocatorImpl::RecordStreamLocked(DevicePtr ptr, StreamId stream) {
  Block* block = live_blocks_.Find(ptr);
  if (block == nullptr || !block->allocated) {
    return absl::NotFoundError(absl::StrFormat(
        "record_stream on address 0x%x, which is not a live vramledger block", ptr));
  }
  if (stream == block->stream) return absl::OkStatus();
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::InsertEvents(Block* block) {
  return stream_events_.Record(
      block, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return CaptureUnderway(); });
}

absl::Status DeviceAllocatorImpl::ProcessEvents() {
  return stream_events_.Process(
      [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return CaptureUnderway(); },
      [this](Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ReleaseAfterEvents(b); });
}

absl::Status DeviceAllocatorImpl::SynchronizeAndFreeEvents() {
  if (stream_events_.pending() > 0) ++stats_.num_sync_all_streams;
  return stream_events_.SynchronizeAll(
      [this](Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ReleaseAfterEvents(b); });
}

absl::Status DeviceAllocatorImpl::SetMemoryFraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory fraction ", fraction, " is outside [0, 1]"));
  }
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  {
    RelaxedCaptureScope relaxed(backend_);  // another thread may be capturing
    if (absl::Status s = backend_->MemGetInfo(&free_bytes, &total_bytes); !s.ok()) return s;
  }
  {
    core::DeviceMutexLock lock(&mu_);
    fraction_set_ = true;
    allowed_bytes_ = static_cast<std::size_t>(fraction * static_cast<double>(total_bytes));
  }
  return AfterOperation("set_memory_fraction", absl::OkStatus());
}

}  // namespace vramledger
