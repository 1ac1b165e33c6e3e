// Mapping the pages under an expandable block before it is allocated (EnsureMapped), step by step:
// take back old mappings, find the missing pages, choose free pages to recycle, plan where each
// handle goes, check the growth, wait for other streams, release, create, detach, then map and
// grant access. A failed driver call leaves the books exact (AbandonPlan; driver-errors.md).
#include <algorithm>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::OldMapping;
using core::Segment;

// One EnsureMapped's plan: each recycled handle goes to the front of the first run of missing
// pages with room for all its pages; one that fits nowhere is released instead (it frees as many
// pages as new handles take); new handles fill the rest.
struct DeviceAllocatorImpl::MappingPlan {
  struct Mapping {
    std::size_t dst;  // first page
    std::size_t pages;
    PhysicalHandle handle;  // 0 until created
    bool fresh = false;     // created by this call (counted in reserved once mapped)
    bool detached = false;  // a recycled handle taken from its old place (counted in reserved)
    bool mapped = false;    // mapped at dst
  };
  Segment* seg = nullptr;
  std::size_t page = 0;                                   // seg's page size
  std::vector<std::pair<std::size_t, std::size_t>> runs;  // missing pages: {first, pages}
  std::size_t missing = 0;
  std::vector<Mapping> mappings;
  std::vector<std::pair<Segment*, std::size_t>> moved;  // moved[j] is mappings[j]
  std::vector<std::pair<Segment*, std::size_t>> released;
  std::size_t released_pages = 0;
  std::size_t fresh = 0;  // pages of new handles
  // A handle moving within its stream keeps its old mapping until the work queued there before
  // the move has finished (LeaveOldMapping): the new block's work comes later on the same
  // stream, so nothing waits. Not during a capture (no fence can be recorded there).
  bool leave_old_mappings = false;
  EventId fence = 0;  // the moves' fence, once recorded

  bool StaysMapped(const Segment* src) const {
    return leave_old_mappings && src->stream == seg->stream;
  }
};

absl::StatusOr<bool> DeviceAllocatorImpl::EnsureMapped(Block* block, std::size_t size,
                                                       const AllocationRequest& request,
                                                       PendingStreams* pending) {
  MappingPlan plan;
  plan.seg = block->segment;
  plan.page = plan.seg->page_size;
  const std::size_t first_page = plan.seg->PageOf(block->ptr);
  const std::size_t last_page = plan.seg->PageOf(block->ptr + size - 1);
  if (std::all_of(plan.seg->pages.begin() + static_cast<std::ptrdiff_t>(first_page),
                  plan.seg->pages.begin() + static_cast<std::ptrdiff_t>(last_page + 1),
                  [](PhysicalHandle h) { return h != 0; })) {
    return true;
  }
  if (absl::Status s = TakeBackOldMappings(block, size, request, pending); !s.ok()) return s;
  FindMissingPages(first_page, last_page, &plan);
  if (plan.missing == 0) return true;
  PlanMappings(block, size, RecyclablePages(block, size, plan), &plan);
  if (MapsOverCapturedWork(plan)) return false;
  if (!GrowthAllowed(plan, request)) return false;
  RelaxedCaptureScope relaxed(backend_);
  plan.leave_old_mappings = !CaptureUnderway();
  if (absl::Status s = WaitForSourceStreams(plan); !s.ok()) return s;
  if (absl::Status s = ReleaseUnplacedHandles(plan); !s.ok()) return s;
  // From here on a failed driver call leaves the books exact and leaks nothing (AbandonPlan):
  // every handle this call holds that is not mapped and accessible where planned is released.
  absl::StatusOr<bool> created = CreateHandles(&plan);
  if (!created.ok() || !*created) return created;
  if (absl::Status s = DetachMovedHandles(&plan); !s.ok()) return s;
  if (absl::Status s = MapAndGrantAccess(&plan, request); !s.ok()) return s;
  return true;
}

absl::Status DeviceAllocatorImpl::TakeBackOldMappings(Block* block, std::size_t size,
                                                      const AllocationRequest& request,
                                                      PendingStreams* pending) {
  if (absl::Status s = SettleOldMappings(/*wait=*/false, nullptr, pending); !s.ok()) return s;
  if (!options_.keep_old_mappings) return absl::OkStatus();
  return ReuseOldMappings(block, size, request);
}

void DeviceAllocatorImpl::FindMissingPages(std::size_t first_page, std::size_t last_page,
                                           MappingPlan* plan) {
  const Segment* seg = plan->seg;
  for (std::size_t i = first_page; i <= last_page; ++i) {
    if (seg->pages[i] != 0) continue;
    if (!plan->runs.empty() && plan->runs.back().first + plan->runs.back().second == i) {
      ++plan->runs.back().second;
    } else {
      plan->runs.emplace_back(i, 1);
    }
    ++plan->missing;
  }
}

std::vector<std::pair<Segment*, std::size_t>> DeviceAllocatorImpl::RecyclablePages(
    const Block* block, std::size_t size, const MappingPlan& plan) const {
  // Recycle only when new pages would take reserved past (1 + recycle_slack) x the peak of
  // allocated memory (the peak this allocation reaches included): below that, growing costs no
  // utilization at the peak, and moving pages back and forth between steps would cost driver
  // calls in every step (measured on the H200: ~120 calls a step on GPT-2 without the slack).
  if (!options_.page_recycling) return {};
  const Segment* seg = plan.seg;
  const auto& allocated = stats_.allocated_bytes;
  const double peak_after = static_cast<double>(std::max<std::int64_t>(
      allocated.peak(kAggregate), allocated.current(kAggregate) + static_cast<std::int64_t>(size)));
  const double reserved_after = static_cast<double>(stats_.reserved_bytes.current(kAggregate)) +
                                static_cast<double>(plan.missing * plan.page);
  if (reserved_after <= (1.0 + options_.recycle_slack) * peak_after) return {};
  // Under a memory fraction the room below the cap is the process's: growing there is one
  // driver call per new handle once, where moving pages costs calls in every step.
  if (fraction_set_ && options_.grow_under_cap &&
      reserved_after <= (1.0 - options_.recycle_slack) * static_cast<double>(allowed_bytes_)) {
    return {};
  }
  // Pages of the block itself past the request count too (it is out of the index now). A
  // private pool's (a region's) pages move only within it.
  std::array<const core::BlockPool*, 2> group;
  std::vector<std::pair<Segment*, std::size_t>> pages = placement_.FreeMappedPages(
      plan.page, plan.missing, block, seg->PageAddress(seg->PageOf(block->ptr + size - 1) + 1),
      GroupOf(seg->pool, &group));
  // A page moved or released waits for its segment's stream (or that stream's fence), which
  // cannot be done on a stream that is capturing: a synchronize would end its capture, and no
  // event may be waited for during one. Such pages stay where they are until it ends.
  if (private_pools_.any_active()) {
    std::vector<StreamId> capturing;
    std::vector<StreamId> not_capturing;
    std::erase_if(pages, [&](const std::pair<Segment*, std::size_t>& p) {
      const StreamId s = p.first->stream;
      if (absl::c_linear_search(not_capturing, s)) return false;
      if (absl::c_linear_search(capturing, s)) return true;
      const bool now = backend_->IsCapturing(s);
      (now ? capturing : not_capturing).push_back(s);
      return now;
    });
  }
  return pages;
}

void DeviceAllocatorImpl::PlanMappings(
    const Block* block, std::size_t size,
    const std::vector<std::pair<Segment*, std::size_t>>& recycled, MappingPlan* plan) const {
  std::vector<std::pair<std::size_t, std::size_t>> room = plan->runs;  // {next free, pages left}
  for (const auto& [src, i] : recycled) {
    const std::size_t k = src->HandleEnd(i) - i;
    auto fit = std::find_if(room.begin(), room.end(), [k](const auto& r) { return r.second >= k; });
    if (fit == room.end()) {
      // Releasing it would first unmap its old mapping, which waits for a capturing stream.
      const PhysicalHandle h = src->pages[i];
      if (private_pools_.any_active() &&
          old_mappings_.HeldByCapture(backend_,
                                      [h](const OldMapping& r) { return r.handle == h; })) {
        continue;
      }
      plan->released.emplace_back(src, i);
      plan->released_pages += k;
      continue;
    }
    plan->mappings.push_back({fit->first, k, src->pages[i]});
    plan->moved.emplace_back(src, i);
    fit->first += k;
    fit->second -= k;
  }
  // New handles: a page the request covers only in part gets one of its own (a neighbour may
  // keep it busy after this block is freed); the pages it covers whole share handles of up to
  // expandable_handle_size, which then lie wholly inside the free block once it is freed, and
  // so can be recycled whole.
  const Segment* seg = plan->seg;
  const std::size_t page = plan->page;
  // A region's pages get handles of up to kRegionHandleBytes: its pause and resume cost per
  // handle.
  const std::size_t handle_bytes =
      regions_.OfPool(seg->pool->owner) != nullptr
          ? std::max(options_.expandable_handle_size, core::kRegionHandleBytes)
          : options_.expandable_handle_size;
  const std::size_t max_pages = std::max<std::size_t>(1, handle_bytes / page);
  const std::size_t first_whole = seg->PageOf(block->ptr + page - 1);
  const std::size_t end_whole = seg->PageOf(block->ptr + size);  // one past the last whole page
  for (const auto& [next, left] : room) {
    std::size_t p = next;
    const std::size_t end = next + left;
    while (p < end) {
      std::size_t k = 1;
      if (p >= first_whole && p < end_whole) k = std::min({max_pages, end - p, end_whole - p});
      plan->mappings.push_back({p, k, 0, /*fresh=*/true});
      plan->fresh += k;
      p += k;
    }
  }
}

bool DeviceAllocatorImpl::MapsOverCapturedWork(const MappingPlan& plan) const {
  if (!private_pools_.any_active() || old_mappings_.empty()) return false;
  return old_mappings_.HeldByCapture(backend_, [&](const OldMapping& r) {
    return r.segment == plan.seg && absl::c_any_of(plan.runs, [&](const auto& run) {
             return r.first_page < run.first + run.second && run.first < r.first_page + r.pages;
           });
  });
}

bool DeviceAllocatorImpl::GrowthAllowed(const MappingPlan& plan, const AllocationRequest& request) {
  if (plan.fresh <= plan.released_pages) return true;
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current(kAggregate));
  const std::size_t after = reserved + (plan.fresh - plan.released_pages) * plan.page;
  if (fraction_set_ && after > allowed_bytes_) return false;
  if (AllocatorHooks* hooks = hooks_.load(std::memory_order_relaxed); hooks != nullptr) {
    absl::Status verdict = hooks->CheckGrowth(request, after, HookView());
    if (!verdict.ok()) {
      growth_refusal_ = std::move(verdict);
      return false;
    }
    growth_refusal_ = absl::OkStatus();  // a later check allowed it
  }
  return true;
}

absl::Status DeviceAllocatorImpl::WaitForSourceStreams(const MappingPlan& plan) {
  // Handles from another stream, and released ones, wait for their stream: a kernel may still
  // read them, and cuMemUnmap does not wait.
  std::vector<StreamId> synced;
  for (const auto* list : {&plan.moved, &plan.released}) {
    for (const auto& [src, i] : *list) {
      if (list == &plan.moved && plan.StaysMapped(src)) continue;
      if (std::find(synced.begin(), synced.end(), src->stream) == synced.end()) {
        if (absl::Status s = backend_->SynchronizeStream(src->stream); !s.ok()) return s;
        synced.push_back(src->stream);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::ReleaseUnplacedHandles(const MappingPlan& plan) {
  // Handles that fit nowhere are released first (their memory may be what the new ones need);
  // then new handles are created before any other mapping changes, so that running out of memory
  // leaves every live mapping as it was.
  for (const auto& [src, i] : plan.released) {
    if (absl::Status s = UnmapPage(src, i, /*release=*/true); !s.ok()) return s;
    page_table_.CountMove();
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> DeviceAllocatorImpl::CreateHandles(MappingPlan* plan) {
  for (MappingPlan::Mapping& m : plan->mappings) {
    if (!m.fresh) continue;
    absl::Status s = backend_->CreatePhysical(m.pages * plan->page, &m.handle);
    if (!s.ok()) {
      m.handle = 0;
      (void)AbandonPlan(plan, absl::OkStatus());
      if (absl::IsResourceExhausted(s)) return false;
      return s;
    }
  }
  return true;
}

absl::Status DeviceAllocatorImpl::DetachMovedHandles(MappingPlan* plan) {
  Segment* seg = plan->seg;
  // One fence for the handles that stay mapped where they were (all on this segment's stream).
  if (absl::c_any_of(plan->moved, [&](const auto& m) { return plan->StaysMapped(m.first); })) {
    auto event = GetEvent();
    if (!event.ok()) return AbandonPlan(plan, event.status());
    if (absl::Status s = backend_->RecordEvent(*event, seg->stream); !s.ok()) {
      spare_events_.push_back(*event);
      return AbandonPlan(plan, s);
    }
    plan->fence = *event;
  }
  for (std::size_t j = 0; j < plan->moved.size(); ++j) {
    const auto& [src, i] = plan->moved[j];
    const std::size_t bytes = (src->HandleEnd(i) - i) * plan->page;
    absl::Status s = plan->StaysMapped(src) ? LeaveOldMapping(src, i, plan->fence)
                                            : UnmapPage(src, i, /*release=*/false);
    if (!s.ok()) return AbandonPlan(plan, s);
    plan->mappings[j].detached = true;
    page_table_.CountMove();
    if (src->pool->is_small != seg->pool->is_small) {  // the page changes pool: move its bytes
      stats_.reserved_bytes.Move(StatTypesFor(src->pool), StatTypesFor(seg->pool),
                                 static_cast<std::int64_t>(bytes));
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::MapAndGrantAccess(MappingPlan* plan,
                                                    const AllocationRequest& request) {
  Segment* seg = plan->seg;
  const std::size_t page = plan->page;
  const StatType types = StatTypesFor(seg->pool);
  // Map, then grant access once per run of missing pages (now all mapped).
  for (MappingPlan::Mapping& m : plan->mappings) {
    const DevicePtr va = seg->PageAddress(m.dst);
    const auto marks = seg->old_mapping.begin() + static_cast<std::ptrdiff_t>(m.dst);
    if (std::any_of(marks, marks + static_cast<std::ptrdiff_t>(m.pages),
                    [](std::uint8_t f) { return f != 0; })) {
      absl::Status cleared = ClearOldMappings([&](const OldMapping& r) {  // mapped over next
        return r.segment == seg && r.first_page < m.dst + m.pages && m.dst < r.first_page + r.pages;
      });
      if (!cleared.ok()) return AbandonPlan(plan, cleared);
    }
    if (absl::Status s = backend_->Map(va, m.pages * page, m.handle); !s.ok()) {
      return AbandonPlan(plan, s);
    }
    page_table_.Map(seg, m.dst, m.pages, m.handle);
    m.mapped = true;
    m.detached = false;
    if (m.fresh) {
      UpdateStat(stats_.reserved_bytes, types, static_cast<std::int64_t>(m.pages * page));
    }
    ++stats_.num_device_alloc;
    Emit(TraceAction::kSegmentMap, va, m.pages * page, seg->stream, request.context, request.tag);
  }
  for (const auto& [first, count] : plan->runs) {
    if (absl::Status s = backend_->SetAccess(seg->PageAddress(first), count * page); !s.ok()) {
      return AbandonPlan(plan, s);  // a page without access must never hold a block
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::AbandonPlan(MappingPlan* plan, absl::Status error) {
  Segment* seg = plan->seg;
  const std::size_t page = plan->page;
  const StatType types = StatTypesFor(seg->pool);
  const EventId fence = plan->fence;
  // Decided before the releases below: they forget the fence's entries and give it back to the
  // pool themselves (OldMappings::Erase); giving it back twice would let two later users share
  // one event.
  const bool fence_unused =
      fence != 0 && absl::c_none_of(old_mappings_.entries(),
                                    [&](const OldMapping& r) { return r.fence == fence; });
  for (const MappingPlan::Mapping& m : plan->mappings) {
    const auto bytes = static_cast<std::int64_t>(m.pages * page);
    if (m.mapped) {
      // Counted in reserved: UnmapPage takes it. When the unmap fails too, the mapping stays
      // a mapped free page (still counted), which must then have access: a page mapped without
      // access never holds a block, and this one may be under the next request.
      const absl::Status unmapped = UnmapPage(seg, m.dst, /*release=*/true);
      if (!unmapped.ok() && seg->pages[m.dst] == m.handle) {
        absl::Status access = backend_->SetAccess(seg->PageAddress(m.dst), m.pages * page);
        if (!access.ok()) {
          page_table_.MarkInaccessible(
              seg, m.dst,
              absl::InternalError(absl::StrCat(
                  "vramledger: expandable memory at ", absl::Hex(seg->PageAddress(m.dst)),
                  " is mapped without access after driver failures (", error.message(),
                  "; its unmap: ", unmapped.message(), "; access again: ", access.message(),
                  "); expandable allocations are refused until empty_cache() unmaps it")));
        }
      }
    } else if (m.fresh && m.handle != 0) {
      (void)ReleaseHandle(m.handle);  // not counted yet
    } else if (m.detached) {          // mapped nowhere now, or only at its old mapping
      (void)ReleaseCounted(m.handle, types, bytes);
    }
  }
  if (fence_unused) spare_events_.push_back(fence);
  return error;
}

}  // namespace vramledger
