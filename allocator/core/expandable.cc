// Expandable segments in the allocator: reserved virtual ranges per (stream, pool) (one, and more
// when a request fits none), physical pages mapped on demand (ensure_mapped.cc), whole free pages
// moved (recycled) before new ones are created, old mappings left and taken back, and pages
// unmapped on empty_cache / OOM retry. The state is the parts' (core/page_table.h,
// core/old_mappings.h, core/placement.h); this file composes them with the driver calls, stats
// and trace. Design: docs/design/expandable-segments.md. Locking: locking.md.
#include <algorithm>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/container/inlined_vector.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::OldMapping;
using core::Segment;

namespace {
thread_local int contiguous_depth = 0;
}  // namespace

ContiguousSegmentsScope::ContiguousSegmentsScope() { ++contiguous_depth; }
ContiguousSegmentsScope::~ContiguousSegmentsScope() { --contiguous_depth; }
bool ContiguousSegmentsScope::active() { return contiguous_depth > 0; }
void ContiguousSegmentsScope::Enter() { ++contiguous_depth; }
absl::Status ContiguousSegmentsScope::Exit() {
  if (contiguous_depth <= 0) {
    return absl::FailedPreconditionError(
        "contiguous_segments: exit without a matching enter on this thread (no scope is open)");
  }
  --contiguous_depth;
  return absl::OkStatus();
}
int ContiguousSegmentsScope::depth() { return contiguous_depth; }

absl::StatusOr<DevicePtr> DeviceAllocatorImpl::MallocExpandable(BlockPool* pool,
                                                                const AllocationRequest& request) {
  if (!page_table_.refusal().ok()) return page_table_.refusal();
  const std::size_t size = request.rounded;
  for (int attempt = 0; attempt < 2; ++attempt) {
    PendingStreams pending;  // per attempt: fences found pending before may have completed since
    // Old mappings are not taken back during a capture (no fence can be recorded there).
    old_mappings_.set_reuse_now(options_.keep_old_mappings && !CaptureUnderway());
    DevicePtr start = 0;
    Block* block = TakeExpandableBlock(pool, request.stream, size, &pending, &start);
    if (block == nullptr && size <= page_table_.RangeBytes(pool->page_size)) {
      // No range of this (stream, pool) has a free run of `size` bytes (none yet, or live
      // blocks split them): reserve one more, as torch's find_expandable_block does. A request
      // a new range cannot hold gets the out-of-memory error without reserving anything, and a
      // range stays until the allocator is destroyed (expandable-segments.md, "Releasing
      // memory"), so a repeated failing request finds the empty one and reserves no more.
      if (absl::Status s = CreateExpandableSegment(pool, request.stream); !s.ok()) return s;
      block = TakeExpandableBlock(pool, request.stream, size, &pending, &start);
    }
    if (block != nullptr) {
      block = PlaceOnMappedPages(block, size, start);
      auto mapped = EnsureMapped(block, size, request, &pending);
      if (mapped.ok() && *mapped) return UseBlock(block, request, nullptr)->ptr;
      TryMerge(block, block->prev);  // undo PlaceOnMappedPages' split, if any
      pool->blocks.insert(block);    // back to the index (unchanged unless a driver call failed)
      if (!mapped.ok()) return mapped.status();
    }
    if (attempt == 0) {
      // Release every cached segment and free page, then try once more.
      if (absl::Status s = ReleaseCachedBlocks(); !s.ok()) return s;
      ++stats_.num_alloc_retries;
    }
  }
  if (!growth_refusal_.ok()) {
    ++stats_.num_ooms;
    Emit(TraceAction::kOom, 0, size, request.stream, request.context, request.tag);
    return growth_refusal_;
  }
  if (Block* taken = TakeFromUseOnOomPools(pool, request); taken != nullptr) {
    return UseBlock(taken, request, nullptr)->ptr;  // torch's last resort: a use_on_oom pool
  }
  return OutOfMemory(request, size);
}

Block* DeviceAllocatorImpl::TakeExpandableBlock(BlockPool* pool, StreamId stream, std::size_t size,
                                                PendingStreams* pending, DevicePtr* start) {
  // Placement calls back, with mu_ held by this caller, to settle the old mappings of this
  // stream's segments of the pool (one query per fence, no wait), stopping at the first error.
  auto settle = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    for (const auto& seg : page_table_.segments()) {
      if (seg->stream != stream || seg->pool != pool) continue;
      if (absl::Status s = SettleOldMappings(/*wait=*/false, seg.get(), pending); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  };
  return placement_.TakeBlock(pool, stream, size, start, settle);
}

Block* DeviceAllocatorImpl::PlaceOnMappedPages(Block* block, std::size_t size, DevicePtr start) {
  Segment* seg = block->segment;
  const DevicePtr a = placement_.StartFor(block, size, start);
  if (a == block->ptr) return block;
  // Split off the front [block->ptr, a) as a free block of its own.
  Block* front = NewBlock();
  front->ptr = block->ptr;
  front->size = a - block->ptr;
  front->stream = block->stream;
  front->pool = block->pool;
  front->segment = seg;
  front->prev = block->prev;
  if (front->prev != nullptr) {
    front->prev->next = front;
  } else {
    seg->head = front;
  }
  front->next = block;
  block->prev = front;
  block->ptr = a;
  block->size -= front->size;
  block->pool->blocks.insert(front);
  return block;
}

absl::Status DeviceAllocatorImpl::CreateExpandableSegment(BlockPool* pool, StreamId stream) {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  DevicePtr va = 0;
  {
    // Another stream may be capturing (an eager allocation beside a capture): in global capture
    // mode the driver refuses, or invalidates that capture over, any call outside relaxed mode.
    RelaxedCaptureScope relaxed(backend_);
    if (absl::Status s = backend_->MemGetInfo(&free_bytes, &total_bytes); !s.ok()) return s;
    page_table_.set_device_total(total_bytes);
    const std::size_t pages = page_table_.RangeBytes(pool->page_size) / pool->page_size;
    if (absl::Status s = backend_->ReserveAddress(pages * pool->page_size, &va); !s.ok()) {
      return s;
    }
  }
  const std::size_t page = pool->page_size;
  const std::size_t pages = page_table_.RangeBytes(page) / page;
  Segment* segment = page_table_.AddSegment(va, pages, page, stream, pool);
  Block* block = NewBlock();
  block->ptr = va;
  block->size = segment->size;
  block->stream = stream;
  block->pool = pool;
  block->segment = segment;
  segment->head = block;
  pool->blocks.insert(block);
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::UnmapPage(Segment* seg, std::size_t page, bool release) {
  // The whole handle that begins at `page`.
  const std::size_t bytes = (seg->HandleEnd(page) - page) * seg->page_size;
  const DevicePtr va = seg->PageAddress(page);
  RelaxedCaptureScope relaxed(backend_);
  if (absl::Status s = backend_->Unmap(va, bytes); !s.ok()) return s;
  std::size_t unused_pages = 0;
  const PhysicalHandle handle = page_table_.Unmap(seg, page, &unused_pages);
  ++stats_.num_device_free;
  Emit(TraceAction::kSegmentUnmap, va, bytes, seg->stream, 0, 0);
  page_table_.ForgetInaccessible(seg, page);  // no mapping without access is left there
  if (release) {
    return ReleaseCounted(handle, StatTypesFor(seg->pool), static_cast<std::int64_t>(bytes));
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::ReleaseCounted(PhysicalHandle handle, StatType types,
                                                 std::int64_t bytes) {
  absl::Status s = ReleaseHandle(handle);
  // Reserved bytes are mapped bytes: the handle's leave reserved, unless a driver error kept it
  // mapped at an old address (ReleaseHandle clears those before releasing): then it is a mapped
  // free page there again, reserved, in the snapshot, and released by a later empty_cache
  // (driver-errors.md, "Two failures"). Counting it nowhere put reserved under the mapped bytes.
  const std::size_t old = s.ok() ? old_mappings_.entries().size() : old_mappings_.Find(handle);
  if (old != old_mappings_.entries().size()) {
    page_table_.ForgetUnreleased(handle);  // mapped again: not one to release
    ReturnHome(old, types);
  } else {
    UpdateStat(stats_.reserved_bytes, types, -bytes);
  }
  return s;
}

absl::Status DeviceAllocatorImpl::ReleaseHandle(PhysicalHandle handle) {
  // A handle that moved may still be mapped where it was (LeaveOldMapping): not released before
  // that mapping is gone. A handle the driver would not release is kept and released again by
  // the next empty_cache (ReleaseExpandablePages) or the destructor, so it is never lost.
  absl::Status s = ClearOldMappings([&](const OldMapping& r) { return r.handle == handle; });
  if (s.ok()) s = backend_->ReleasePhysical(handle);
  if (!s.ok()) page_table_.KeepUnreleased(handle);
  if (s.ok() && !exported_fds_.empty()) CloseExportedFd(handle);  // shared through IPC
  return s;
}

absl::Status DeviceAllocatorImpl::ReleaseExpandablePages() {
  // A failing driver call does not stop the rest: each step goes on past it and the first error
  // is returned at the end. Stopping at a handle that would not release left every free page
  // mapped, a mapping without access among them, refusing expandable allocations for good;
  // stopping in the middle of the retries leaked the rest.
  absl::Status first_error;
  // Unmap only after the owning stream finished with the pages (cuMemUnmap does not wait).
  first_error.Update(SettleOldMappings(/*wait=*/true));
  // Handles a failed driver call left unreleased (ReleaseHandle): once more.
  for (PhysicalHandle h : page_table_.TakeUnreleased()) first_error.Update(ReleaseHandle(h));
  std::vector<StreamId> synced;  // one wait per stream, for all its ranges
  std::vector<StreamId> failed;  // streams that could not be waited for: their pages stay
  for (const auto& group : ExpandableGroups()) {  // the device's pools, then private ones
    for (const BlockPool* pool : group) {
      for (const auto& [seg, i] :
           placement_.FreeMappedPages(pool->page_size, SIZE_MAX, nullptr, 0, &group)) {
        if (seg->pool != pool || absl::c_linear_search(failed, seg->stream)) continue;
        if (!absl::c_linear_search(synced, seg->stream)) {
          if (absl::Status s = backend_->SynchronizeStream(seg->stream); !s.ok()) {
            first_error.Update(s);
            failed.push_back(seg->stream);
            continue;
          }
          synced.push_back(seg->stream);
        }
        first_error.Update(UnmapPage(seg, i, /*release=*/true));
      }
    }
  }
  return first_error;
}

void DeviceAllocatorImpl::ReleaseExpandableAtExit() {
  // Old mappings first (their handles are mapped elsewhere too or released below), waiting for
  // each fence; one that will not unmap is dropped (the process is letting the device go).
  while (!old_mappings_.empty()) {
    const EventId fence = old_mappings_.entries().front().fence;
    if (fence != 0) (void)backend_->SynchronizeEvent(fence);
    if (!old_mappings_
             .UnmapEntry(backend_, 0,
                         [this](EventId e)
                             ABSL_NO_THREAD_SAFETY_ANALYSIS { spare_events_.push_back(e); })
             .ok()) {
      old_mappings_.Erase(0, [](EventId) {});
    }
  }
  for (PhysicalHandle h : page_table_.unreleased()) (void)backend_->ReleasePhysical(h);
}

void DeviceAllocatorImpl::ReleaseExpandableSegmentsAtExit() {
  for (const auto& segment : page_table_.segments()) {
    for (std::size_t i = 0, j = 1; i < segment->pages.size(); i = j++) {
      if (segment->pages[i] == 0) continue;
      while (j < segment->pages.size() && segment->pages[j] == segment->pages[i]) ++j;  // a handle
      (void)backend_->Unmap(segment->PageAddress(i), (j - i) * segment->page_size);
      (void)backend_->ReleasePhysical(segment->pages[i]);
    }
    (void)backend_->ReleaseAddress(segment->ptr, segment->size);
    for (Block* b = segment->head; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
}

// ---- Old mappings: the allocator's side (the entries are core::OldMappings') ----

absl::Status DeviceAllocatorImpl::LeaveOldMapping(Segment* seg, std::size_t page, EventId fence) {
  std::size_t k = 0;
  const PhysicalHandle handle = page_table_.Unmap(seg, page, &k);  // mapped again where it goes
  ++stats_.num_device_free;
  Emit(TraceAction::kSegmentUnmap, seg->PageAddress(page), k * seg->page_size, seg->stream, 0, 0);
  old_mappings_.Add(seg, page, k, handle, fence);
  return absl::OkStatus();
}

void DeviceAllocatorImpl::ReturnHome(std::size_t index, StatType types) {
  const OldMapping r = old_mappings_.entries()[index];
  Segment* seg = r.segment;
  page_table_.Map(seg, r.first_page, r.pages, r.handle);
  const auto bytes = static_cast<std::int64_t>(r.pages * seg->page_size);
  if (StatTypesFor(seg->pool) != types) {
    stats_.reserved_bytes.Move(types, StatTypesFor(seg->pool), bytes);
  }
  ++stats_.num_device_alloc;
  Emit(TraceAction::kSegmentMap, seg->PageAddress(r.first_page), r.pages * seg->page_size,
       seg->stream, 0, 0);
  old_mappings_.Erase(index, GiveBackFence());
}

absl::Status DeviceAllocatorImpl::SettleOldMappings(bool wait, const Segment* only,
                                                    PendingStreams* pending) {
  if (old_mappings_.empty() || CaptureUnderway()) return absl::OkStatus();
  return old_mappings_.Settle(backend_, wait, options_.keep_old_mappings, only, pending,
                              GiveBackFence());
}

absl::Status DeviceAllocatorImpl::ClearOldMappings(
    absl::FunctionRef<bool(const OldMapping&)> which) {
  // During a capture the fences' streams are waited for instead of the fences (old_mappings.h),
  // and every call is one a capture allows in relaxed mode.
  RelaxedCaptureScope relaxed(backend_);
  return old_mappings_.Clear(backend_, which, CaptureUnderway(), GiveBackFence());
}

absl::Status DeviceAllocatorImpl::ReuseOldMappings(Block* block, std::size_t size,
                                                   const AllocationRequest& request) {
  Segment* seg = block->segment;
  if (old_mappings_.empty() || !old_mappings_.reuse_now()) return absl::OkStatus();
  const std::size_t lo = seg->PageOf(block->ptr);
  const std::size_t hi = seg->PageOf(block->ptr + size - 1) + 1;  // one past the last page
  const auto marks = seg->old_mapping.begin();
  if (std::none_of(marks + static_cast<std::ptrdiff_t>(lo), marks + static_cast<std::ptrdiff_t>(hi),
                   [](std::uint8_t f) { return f != 0; })) {
    return absl::OkStatus();
  }
  struct Reuse {
    std::size_t first_page;
    std::size_t pages;
    PhysicalHandle handle;
    Segment* from;
    std::size_t from_page;
  };
  absl::InlinedVector<Reuse, 8> reuses;
  for (const OldMapping& r : old_mappings_.entries()) {
    if (r.segment != seg || r.first_page < lo || r.first_page + r.pages > hi) continue;
    if (!old_mappings_.Reusable(page_table_, seg, r.first_page)) continue;
    const auto& [at, first] = *page_table_.HomeOf(r.handle);
    if (at == seg && first < hi && seg->HandleEnd(first) > lo) continue;  // under the request
    // A handle with two old mappings under the request goes back to one of them.
    if (absl::c_any_of(reuses, [&](const Reuse& u) { return u.handle == r.handle; })) continue;
    reuses.push_back({r.first_page, r.pages, r.handle, at, first});
  }
  if (reuses.empty()) return absl::OkStatus();
  // The places the handles leave become old mappings: fenced like a move's (LeaveOldMapping).
  auto fence = GetEvent();
  if (!fence.ok()) return fence.status();
  if (absl::Status s = backend_->RecordEvent(*fence, seg->stream); !s.ok()) {
    spare_events_.push_back(*fence);
    return s;
  }
  for (const Reuse& u : reuses) {
    if (absl::Status s = LeaveOldMapping(u.from, u.from_page, *fence); !s.ok()) return s;
    const auto& entries = old_mappings_.entries();
    const auto entry = absl::c_find_if(entries, [&](const OldMapping& r) {
      return r.segment == seg && r.first_page == u.first_page && r.handle == u.handle;
    });
    old_mappings_.Erase(static_cast<std::size_t>(entry - entries.begin()), GiveBackFence());
    page_table_.Map(seg, u.first_page, u.pages, u.handle);
    if (u.from->pool->is_small != seg->pool->is_small) {  // the page changes pool: its bytes too
      stats_.reserved_bytes.Move(StatTypesFor(u.from->pool), StatTypesFor(seg->pool),
                                 static_cast<std::int64_t>(u.pages * seg->page_size));
    }
    ++stats_.num_device_alloc;
    page_table_.CountMove();
    old_mappings_.CountReuse();
    Emit(TraceAction::kSegmentMap, seg->PageAddress(u.first_page), u.pages * seg->page_size,
         seg->stream, request.context, request.tag);
  }
  return absl::OkStatus();
}

}  // namespace vramledger
