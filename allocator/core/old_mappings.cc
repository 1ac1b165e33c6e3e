// Old mappings of moved handles (expandable segments): a handle that moves within its stream
// stays mapped at the address it left until the work queued there has finished (RetireMapping,
// RetireMappings, ClearRetiring), and with keep_old_mappings after that too, until the address is
// needed; an allocation over an old mapping whose handle lies free takes it back with no driver
// call (ReuseOldMappings). Design: docs/design/expandable-segments.md, "Moves without a stall" and
// "Old mappings kept". Placement and mapping: expandable.cc.
#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/container/inlined_vector.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::Segment;

bool DeviceAllocatorImpl::OldMappingReusable(const Segment* seg, std::size_t page,
                                             const Block* within) const {
  const PhysicalHandle h = seg->old_handle[page];
  if (h == 0 || !reuse_old_mappings_now_) return false;
  // Where h is mapped now: the page's hint when h still begins there in this segment (a handle
  // is mapped at one place, its pages consecutive, so that place is h's home), else handle_home_
  // (placement asks this for every old-mapping page it weighs: the lookup was 14% of a
  // checkpointed replay's instructions).
  const Segment* at = seg;
  std::size_t first = seg->old_home_hint[page];
  if (first >= seg->page_limit || seg->pages[first] != h ||
      (first > 0 && seg->pages[first - 1] == h)) {
    const auto home = handle_home_.find(h);
    if (home == handle_home_.end()) return false;
    std::tie(at, first) = home->second;
    if (at == seg) seg->old_home_hint[page] = static_cast<std::uint32_t>(first);
  }
  if (at->stream != seg->stream) return false;  // its work there would race the new block's
  // Its home inside the block being placed in: a placement there may cover both places, and
  // ReuseOldMappings then leaves the handle at home and maps over this page, which waits for
  // the page's fence while the old mapping is in use (expandable-segments.md, "Repeated steps").
  if (within != nullptr && at == within->segment &&
      at->PageAddress(first) < within->ptr + within->size &&
      at->PageAddress(at->HandleEnd(first)) > within->ptr) {
    return false;
  }
  for (std::size_t j = first; j < at->page_limit && at->pages[j] == h; ++j) {
    if (at->use[j] != 0) return false;  // a block there is allocated or pending free
  }
  return true;
}

absl::Status DeviceAllocatorImpl::ReuseOldMappings(Block* block, std::size_t size,
                                                   const AllocationRequest& request) {
  Segment* seg = block->segment;
  if (retiring_.empty() || !reuse_old_mappings_now_) return absl::OkStatus();
  const std::size_t lo = seg->PageOf(block->ptr);
  const std::size_t hi = seg->PageOf(block->ptr + size - 1) + 1;  // one past the last page
  const auto flags = seg->retiring.begin();
  if (std::none_of(flags + static_cast<std::ptrdiff_t>(lo), flags + static_cast<std::ptrdiff_t>(hi),
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
  for (const RetiringMapping& r : retiring_) {
    if (r.segment != seg || r.first_page < lo || r.first_page + r.pages > hi) continue;
    if (!OldMappingReusable(seg, r.first_page)) continue;
    const auto& [at, first] = handle_home_.at(r.handle);
    if (at == seg && first < hi && seg->HandleEnd(first) > lo) continue;  // under the request
    // A handle with two old mappings under the request goes back to one of them.
    if (absl::c_any_of(reuses, [&](const Reuse& u) { return u.handle == r.handle; })) continue;
    reuses.push_back({r.first_page, r.pages, r.handle, at, first});
  }
  if (reuses.empty()) return absl::OkStatus();
  // The places the handles leave become old mappings: fenced like a move's (RetireMapping).
  auto fence = GetEvent();
  if (!fence.ok()) return fence.status();
  if (absl::Status s = backend_->RecordEvent(*fence, seg->stream); !s.ok()) {
    spare_events_.push_back(*fence);
    return s;
  }
  for (const Reuse& u : reuses) {
    if (absl::Status s = RetireMapping(u.from, u.from_page, *fence); !s.ok()) return s;
    const auto entry = absl::c_find_if(retiring_, [&](const RetiringMapping& r) {
      return r.segment == seg && r.first_page == u.first_page && r.handle == u.handle;
    });
    ForgetRetiring(static_cast<std::size_t>(entry - retiring_.begin()));
    std::fill_n(seg->pages.begin() + static_cast<std::ptrdiff_t>(u.first_page), u.pages, u.handle);
    std::fill_n(seg->retiring.begin() + static_cast<std::ptrdiff_t>(u.first_page), u.pages,
                std::uint8_t{0});
    std::fill_n(seg->old_handle.begin() + static_cast<std::ptrdiff_t>(u.first_page), u.pages,
                PhysicalHandle{0});
    handle_home_[u.handle] = {seg, u.first_page};
    seg->mapped_pages += u.pages;
    seg->page_limit = std::max(seg->page_limit, u.first_page + u.pages);
    if (u.from->pool->is_small != seg->pool->is_small) {  // the page changes pool: its bytes too
      stats_.reserved_bytes.Move(StatTypesFor(u.from->pool), StatTypesFor(seg->pool),
                                 static_cast<std::int64_t>(u.pages * seg->page_size));
    }
    ++stats_.num_device_alloc;
    ++page_moves_;
    ++reused_old_mappings_;
    Emit(TraceAction::kSegmentMap, seg->PageAddress(u.first_page), u.pages * seg->page_size,
         seg->stream, request.context, request.tag);
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::RetireMapping(Segment* seg, std::size_t page, EventId fence) {
  const std::size_t k = seg->HandleEnd(page) - page;
  const PhysicalHandle handle = seg->pages[page];
  std::fill_n(seg->pages.begin() + static_cast<std::ptrdiff_t>(page), k, PhysicalHandle{0});
  seg->mapped_pages -= k;
  ++stats_.num_device_free;
  Emit(TraceAction::kSegmentUnmap, seg->PageAddress(page), k * seg->page_size, seg->stream, 0, 0);
  std::fill_n(seg->retiring.begin() + static_cast<std::ptrdiff_t>(page), k,
              Segment::kOldMappingInUse);
  std::fill_n(seg->old_handle.begin() + static_cast<std::ptrdiff_t>(page), k, handle);
  handle_home_.erase(handle);  // mapped again where it goes (EnsureMapped, ReuseOldMappings)
  retiring_.push_back({seg, page, k, handle, fence});
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::UnmapRetired(std::size_t index) {
  const RetiringMapping r = retiring_[index];
  const std::size_t bytes = r.pages * r.segment->page_size;
  if (absl::Status s = backend_->Unmap(r.segment->PageAddress(r.first_page), bytes); !s.ok()) {
    return s;
  }
  std::fill_n(r.segment->retiring.begin() + static_cast<std::ptrdiff_t>(r.first_page), r.pages,
              std::uint8_t{0});
  std::fill_n(r.segment->old_handle.begin() + static_cast<std::ptrdiff_t>(r.first_page), r.pages,
              PhysicalHandle{0});
  ForgetRetiring(index);
  return absl::OkStatus();
}

void DeviceAllocatorImpl::ReturnHome(std::size_t index, StatType types) {
  const RetiringMapping r = retiring_[index];
  Segment* seg = r.segment;
  const auto first = static_cast<std::ptrdiff_t>(r.first_page);
  const auto n = static_cast<std::ptrdiff_t>(r.pages);
  std::fill_n(seg->pages.begin() + first, n, r.handle);
  std::fill_n(seg->retiring.begin() + first, n, std::uint8_t{0});
  std::fill_n(seg->old_handle.begin() + first, n, PhysicalHandle{0});
  handle_home_[r.handle] = {seg, r.first_page};
  seg->mapped_pages += r.pages;
  seg->page_limit = std::max(seg->page_limit, r.first_page + r.pages);
  const auto bytes = static_cast<std::int64_t>(r.pages * seg->page_size);
  if (StatTypesFor(seg->pool) != types) {
    stats_.reserved_bytes.Move(types, StatTypesFor(seg->pool), bytes);
  }
  ++stats_.num_device_alloc;
  Emit(TraceAction::kSegmentMap, seg->PageAddress(r.first_page), r.pages * seg->page_size,
       seg->stream, 0, 0);
  ForgetRetiring(index);
}

void DeviceAllocatorImpl::ForgetRetiring(std::size_t index) {
  const EventId fence = retiring_[index].fence;
  retiring_.erase(retiring_.begin() + static_cast<std::ptrdiff_t>(index));
  // The handles moved by one EnsureMapped share its fence: back to the pool with the last one.
  if (fence != 0 && std::none_of(retiring_.begin(), retiring_.end(),
                                 [&](const RetiringMapping& o) { return o.fence == fence; })) {
    spare_events_.push_back(fence);
  }
}

std::size_t DeviceAllocatorImpl::RetiringInUse() const {
  return static_cast<std::size_t>(
      absl::c_count_if(retiring_, [](const RetiringMapping& r) { return r.fence != 0; }));
}

absl::Status DeviceAllocatorImpl::RetireMappings(bool wait, const Segment* only,
                                                 PendingStreams* pending) {
  if (retiring_.empty() || CaptureUnderway()) return absl::OkStatus();
  // Entries sharing a fence are adjacent (one EnsureMapped pushes them together): one query or
  // wait per fence. A stream's fences complete in the order they were recorded, which is the
  // order of retiring_: after one is found pending, that stream's later ones are not queried,
  // nor, through `pending`, by the rest of the allocation.
  EventId known = 0;
  bool known_done = false;
  PendingStreams local;
  PendingStreams& pending_streams = pending != nullptr && !wait ? *pending : local;
  const bool keep = options_.keep_old_mappings && !wait;
  for (std::size_t i = 0; i < retiring_.size();) {
    const EventId fence = retiring_[i].fence;
    const StreamId stream = retiring_[i].segment->stream;  // the fence was recorded there
    if ((only != nullptr && retiring_[i].segment != only) || (fence == 0 && keep)) {
      ++i;
      continue;
    }
    if (fence == 0) {  // kept after its work finished: unmapped now (wait: empty_cache, OOM)
      if (absl::Status s = UnmapRetired(i); !s.ok()) return s;
      continue;
    }
    if (fence != known) {
      known = fence;
      if (absl::c_linear_search(pending_streams, stream)) {
        known_done = false;
      } else if (wait) {
        if (absl::Status s = backend_->SynchronizeEvent(fence); !s.ok()) return s;
        known_done = true;
      } else {
        absl::StatusOr<bool> done = backend_->QueryEvent(fence);
        if (!done.ok()) return done.status();
        known_done = *done;
        if (!known_done) pending_streams.push_back(stream);
      }
    }
    if (!known_done) {
      ++i;
      continue;
    }
    if (keep) {  // kept, idle: the fence goes back to the pool with its last entry
      RetiringMapping& r = retiring_[i];
      std::fill_n(r.segment->retiring.begin() + static_cast<std::ptrdiff_t>(r.first_page), r.pages,
                  Segment::kOldMappingIdle);
      r.fence = 0;
      if (absl::c_none_of(retiring_, [&](const RetiringMapping& o) { return o.fence == fence; })) {
        spare_events_.push_back(fence);
      }
      ++i;
      continue;
    }
    if (absl::Status s = UnmapRetired(i); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::ClearRetiring(
    absl::FunctionRef<bool(const RetiringMapping&)> which) {
  for (std::size_t i = 0; i < retiring_.size();) {
    if (!which(retiring_[i])) {
      ++i;
      continue;
    }
    if (retiring_[i].fence != 0) {
      absl::StatusOr<bool> done = backend_->QueryEvent(retiring_[i].fence);  // waits if it must
      if (!done.ok()) return done.status();
      if (!*done) {
        if (absl::Status s = backend_->SynchronizeEvent(retiring_[i].fence); !s.ok()) return s;
      }
    }
    if (absl::Status s = UnmapRetired(i); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace vramledger
