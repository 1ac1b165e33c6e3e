// Expandable segments: reserved virtual ranges per (stream, pool) (one, and more when a request
// fits none), physical pages mapped on demand, whole free pages moved (recycled) before new ones
// are created, and unmapped on empty_cache / OOM retry. Design: docs/design/expandable-segments.md.
// Locking: locking.md.
#include <algorithm>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "core/device_allocator_impl.h"
#include "core/size_policy.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::Segment;

namespace {
thread_local int contiguous_depth = 0;

// What mapping page i of `seg` costs a placement (DeviceAllocatorImpl::PageCost): 0 if mapped;
// kUnmappedPageCost if not, or if it holds an old mapping whose work has finished
// (keep_old_mappings; mapping over it unmaps that first); kReusablePageCost if it holds an old
// mapping whose handle lies free now (OldMappingReusable: taking it back makes no driver call);
// kRetiringPageCost if it holds an old mapping that may still be in use there (RetireMapping):
// mapping over it waits for that fence unless the fence has completed (expandable-segments.md,
// "Retiring addresses out of placement"). That weight, 64 unmapped pages, compares one
// cudaEventSynchronize (H200, checkpointed Llama-1B: 11 waits, 52 ms) with one page (30-80 us).
// The reusable cost equals a mapped page's: with any preference for the page where a free handle
// is mapped now over its old mapping, placement depends on where the last reuse left each handle,
// and a repeated identical step never settles (checkpointed Llama-1B, a step repeated: 100-170
// map / unmap / access calls in every repetition, reserved drifting to 1.0145 x allocated);
// at 0 it settles into a cycle that makes no such call. Except where the handle is mapped inside
// the same free block (OldMappingReusable's `within`): ReuseOldMappings would leave it there and
// map over the old mapping, waiting for its fence if it is still in use; counting both places
// free also cost GPT-2's new-peak steps moves (expandable-segments.md, "Repeated steps").
constexpr std::size_t kUnmappedPageCost = 2;
constexpr std::size_t kReusablePageCost = 0;
constexpr std::size_t kRetiringPageCost = 64 * kUnmappedPageCost;
// The cost functions below are PageCost, called as cost_of(segment, page, &retiring);
// *retiring is set when a retiring page was counted. Templates, so that the call inlines.

// PageCost summed over the pages under [lo, lo + size).
template <typename CostFn>
std::size_t CostAt(const Segment* seg, DevicePtr lo, std::size_t size, const CostFn& cost_of,
                   bool* retiring) {
  std::size_t cost = 0;
  for (std::size_t i = seg->PageOf(lo); i <= seg->PageOf(lo + size - 1); ++i) {
    cost += cost_of(seg, i, retiring);
  }
  return cost;
}

// Pages under [a, a + size) (inside free `block`) that no other block touches: the pages this
// placement pins. The first page is shared when it begins before the block (the previous block
// holds its head), the last when it ends past the block's end (the next block holds its tail).
std::size_t Pinned(const Block* block, DevicePtr a, std::size_t size) {
  const Segment* seg = block->segment;
  const std::size_t first = seg->PageOf(a);
  const std::size_t last = seg->PageOf(a + size - 1);
  std::size_t n = last - first + 1;
  const bool shares_first = seg->PageAddress(first) < block->ptr;
  const bool shares_last = seg->PageAddress(last) + seg->page_size > block->ptr + block->size &&
                           block->ptr + block->size < seg->ptr + seg->size;
  if (shares_first) --n;
  if (shares_last && (last != first || !shares_first)) --n;
  return n;
}

// The cheapest place (PageCost) for `size` bytes inside free `block`: its start, or a
// page-aligned start further in (PlaceOnMappedPages); among places of equal cost, the one that
// pins the fewest pages (Pinned: a partly used page is what the peak loses). *start: that
// address (block->ptr for its start); *retiring as for PageCost; *pinned: its pinned pages.
// Placing against the block's end instead was measured and not kept (checkpointed Llama-1B
// 0.9853 -> 0.9820, expandable-segments.md).
template <typename CostFn>
std::size_t BestPlacement(const Block* block, std::size_t size, const CostFn& cost_of,
                          DevicePtr* start, bool* retiring, std::size_t* pinned) {
  const Segment* seg = block->segment;
  const std::size_t page = seg->page_size;
  const DevicePtr end = block->ptr + block->size;
  const std::size_t n = (size + page - 1) / page;
  *start = block->ptr;
  std::size_t best = CostAt(seg, block->ptr, size, cost_of, retiring);
  *pinned = Pinned(block, block->ptr, size);
  // Good enough: on mapped pages, sharing a page with a neighbour.
  if (best == 0 && *pinned < n) return 0;
  // Page-aligned starts a with a + size <= end; [a, a + size) covers n pages. Slide a window of n
  // pages, summing their cost; nothing past page_limit was ever mapped. An aligned window shares
  // no first page, so it pins n pages unless it is the last one, whose last page may be the next
  // block's: the slide looks for the cheapest, then the last window is weighed for the tie.
  const DevicePtr first_start = seg->PageAddress(seg->PageOf(block->ptr + page - 1));
  if (first_start + size > end) return best;
  const std::size_t j0 = seg->PageOf(first_start);
  const std::size_t j_end = seg->PageOf(end - size);  // the last aligned start that fits
  const std::size_t j_last = std::min(j_end, seg->page_limit);
  if (best > 0) {
    std::size_t cost = 0;
    for (std::size_t i = j0; i < j0 + n; ++i) cost += cost_of(seg, i, retiring);
    for (std::size_t j = j0;; ++j) {
      if (cost < best) {
        best = cost;
        *start = seg->PageAddress(j);
        *pinned = Pinned(block, *start, size);
        if (cost == 0) break;
      }
      if (j + 1 > j_last) break;
      cost -= cost_of(seg, j, retiring);
      cost += cost_of(seg, j + n, retiring);
    }
  }
  if (j_end <= j_last) {
    const DevicePtr a = seg->PageAddress(j_end);
    const std::size_t pin = Pinned(block, a, size);
    if (pin < *pinned && a != *start) {
      const std::size_t end_cost = CostAt(seg, a, size, cost_of, retiring);
      if (end_cost <= best) {
        best = end_cost;
        *pinned = pin;
        *start = a;
      }
    }
  }
  return best;
}
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

// Small enough to inline into the placement loops (CostAt, BestPlacement are templates on the
// cost function for that): a checkpointed replay asks it ~4 million times; with the call and
// absl::FunctionRef's indirection gone, 853 M -> 800 M instructions (callgrind), same results.
inline std::size_t DeviceAllocatorImpl::PageCost(const Segment* seg, std::size_t i, bool* retiring,
                                                 const Block* within) const {
  if (seg->pages[i] != 0) return 0;
  if (seg->retiring[i] == 0) return kUnmappedPageCost;
  return OldMappingPageCost(seg, i, retiring, within);
}

std::size_t DeviceAllocatorImpl::OldMappingPageCost(const Segment* seg, std::size_t i,
                                                    bool* retiring, const Block* within) const {
  if (OldMappingReusable(seg, i, within)) return kReusablePageCost;
  if (seg->retiring[i] == Segment::kOldMappingIdle) return kUnmappedPageCost;
  *retiring = true;
  return kRetiringPageCost;
}

std::size_t DeviceAllocatorImpl::MappedRun(const Block* block) {
  const Segment* seg = block->segment;
  if (!seg->expandable) return block->size;
  std::size_t best = 0;
  std::size_t run = 0;
  const DevicePtr end = block->ptr + block->size;
  for (std::size_t i = seg->PageOf(block->ptr); i < seg->page_limit; ++i) {
    const DevicePtr lo = std::max(block->ptr, seg->PageAddress(i));
    const DevicePtr hi = std::min(end, seg->PageAddress(i) + seg->page_size);
    if (lo >= hi) break;
    run = seg->pages[i] != 0 ? run + (hi - lo) : 0;
    best = std::max(best, run);
  }
  return best;
}

Block* DeviceAllocatorImpl::TakeExpandableBlock(BlockPool* pool, StreamId stream, std::size_t size,
                                                PendingStreams* pending, DevicePtr* start) {
  *start = 0;
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = pool->blocks.lower_bound(&key);
  if (it == pool->blocks.end() || (*it)->stream != stream) return nullptr;
  // Best fit by size, but a block with room for `size` bytes on mapped pages beats a smaller one
  // that would need pages: look at a few candidates, and the stream's largest (the tail). Each
  // is scored by its best page-aligned placement (BestPlacement, what PlaceOnMappedPages then
  // uses), not by its first bytes: on the checkpointed Llama-1B trace that halves the page
  // moves (2,600 -> 1,214) and the steady-state driver time (expandable-segments.md).
  constexpr int kCandidates = 8;
  auto cost_in = [this](const Block* b) {  // PageCost for placements inside free block b
    // Called through the placement templates, which know nothing of mu_ (held by the caller).
    return [this, b](const Segment* s, std::size_t i, bool* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return PageCost(s, i, r, b);
    };
  };
  const std::size_t pages = (size + pool->page_size - 1) / pool->page_size;
  auto best = pool->blocks.end();
  for (int round = 0; round < 2; ++round) {
    std::size_t best_cost = SIZE_MAX;
    std::size_t best_pinned = SIZE_MAX;
    bool saw_retiring = false;  // some cost counted a retiring page
    int seen = 0;
    DevicePtr unused_start = 0;  // each candidate's cheapest place (BestPlacement)
    // Among equal costs the candidate that pins the fewest pages wins; the search stops at one
    // on mapped pages that shares a page with a neighbour (BestPlacement's "good enough").
    for (auto c = it; c != pool->blocks.end() && (*c)->stream == stream && seen < kCandidates;
         ++c, ++seen) {
      std::size_t pinned = 0;
      const std::size_t cost =
          BestPlacement(*c, size, cost_in(*c), &unused_start, &saw_retiring, &pinned);
      if (cost < best_cost || (cost == best_cost && pinned < best_pinned)) {
        best = c;
        best_cost = cost;
        best_pinned = pinned;
        *start = unused_start;  // where PlaceOnMappedPages will put it
        if (cost == 0 && pinned < pages) break;  // on mapped pages, sharing one: good enough
      }
    }
    if (best_cost > 0) {
      // A full scan of every fitting block (least missing pages after BestPlacement) was
      // measured and not kept: GPT-2 0.9915 but Llama 0.9892 at 6 MiB pages
      // (expandable-segments.md).
      key.size = SIZE_MAX;
      key.ptr = ~DevicePtr{0};
      auto last = std::prev(pool->blocks.upper_bound(&key));
      // The tail by its first bytes only: scoring it by its best placement too was measured
      // worse (checkpointed Llama-1B 0.9790, 2,734 moves).
      if ((*last)->stream == stream && (*last)->size >= size &&
          CostAt((*last)->segment, (*last)->ptr, size, cost_in(*last), &saw_retiring) < best_cost) {
        best = last;
        *start = 0;  // scored by its first bytes: PlaceOnMappedPages searches it
      }
    }
    // A candidate was scored as mapping over a retiring address and none needs no page: drop
    // the old mappings of this stream's segment of the pool (the only ones that can change the
    // choice) whose fences have completed (one query per stream, no wait) and score once more,
    // so that only addresses still in use count as retiring. A query error is reported by the
    // same call in EnsureMapped.
    if (round == 1 || best_cost == 0 || !saw_retiring || retiring_.empty()) break;
    const std::size_t before = RetiringInUse();
    bool failed = false;
    for (const auto& seg : exp_segments_) {
      if (seg->stream != stream || seg->pool != pool) continue;
      failed = failed || !RetireMappings(/*wait=*/false, seg.get(), pending).ok();
    }
    if (failed || RetiringInUse() == before) break;
  }
  Block* block = *best;
  pool->blocks.erase(best);
  return block;
}

Block* DeviceAllocatorImpl::PlaceOnMappedPages(Block* block, std::size_t size, DevicePtr start) {
  Segment* seg = block->segment;
  DevicePtr a = start;
  if (a == 0) {  // not searched yet (the tail): as TakeExpandableBlock scores its candidates
    bool unused_retiring = false;
    std::size_t unused_pinned = 0;
    auto cost_of = [this, block](const Segment* s, std::size_t i, bool* r)
                       ABSL_NO_THREAD_SAFETY_ANALYSIS { return PageCost(s, i, r, block); };
    BestPlacement(block, size, cost_of, &a, &unused_retiring, &unused_pinned);
  }
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

std::size_t DeviceAllocatorImpl::ExpandableRangeBytes(const BlockPool* pool) const {
  // Before the first range the device's size is not known yet (CreateExpandableSegment asks
  // the driver and sizes the range): no bound.
  if (device_total_bytes_ == 0) return SIZE_MAX;
  // torch reserves 1.125 x the device's memory per segment (PYTORCH-FACTS §3), page-rounded.
  const std::size_t page = pool->page_size;
  return (device_total_bytes_ + device_total_bytes_ / 8 + page - 1) / page * page;
}

absl::Status DeviceAllocatorImpl::CreateExpandableSegment(BlockPool* pool, StreamId stream) {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  if (absl::Status s = backend_->MemGetInfo(&free_bytes, &total_bytes); !s.ok()) return s;
  device_total_bytes_ = total_bytes;
  const std::size_t page = pool->page_size;
  const std::size_t pages = ExpandableRangeBytes(pool) / page;
  DevicePtr va = 0;
  {
    RelaxedCaptureScope relaxed(backend_);
    if (absl::Status s = backend_->ReserveAddress(pages * page, &va); !s.ok()) return s;
  }
  auto segment = std::make_unique<Segment>();
  segment->ptr = va;
  segment->size = pages * page;
  segment->stream = stream;
  segment->pool = pool;
  segment->expandable = true;
  segment->page_size = page;
  segment->pages.assign(pages, 0);
  segment->retiring.assign(pages, 0);
  segment->old_handle.assign(pages, 0);
  segment->use.assign(pages, 0);
  segment->old_home_hint.assign(pages, Segment::kNoHomeHint);
  Block* block = NewBlock();
  block->ptr = va;
  block->size = segment->size;
  block->stream = stream;
  block->pool = pool;
  block->segment = segment.get();
  segment->head = block;
  pool->blocks.insert(block);
  exp_segments_.push_back(std::move(segment));
  return absl::OkStatus();
}

std::vector<std::pair<Segment*, std::size_t>> DeviceAllocatorImpl::FreeMappedPages(
    std::size_t page_size, std::size_t limit, const Block* also, DevicePtr also_from) const {
  std::vector<std::pair<Segment*, std::size_t>> out;
  std::size_t pages = 0;
  // Whole handles (all their pages) inside [lo, hi) of free block `b`, by their first page.
  auto collect = [&](const Block* b, DevicePtr lo, DevicePtr hi) {
    Segment* seg = b->segment;
    if (seg->mapped_pages == 0 || hi <= lo) return;
    const std::size_t first = seg->PageOf(lo + page_size - 1);           // first whole page
    const std::size_t end = std::min(seg->PageOf(hi), seg->page_limit);  // one past the last
    for (std::size_t i = first; i < end && pages < limit;) {
      if (seg->pages[i] == 0) {
        ++i;
        continue;
      }
      const std::size_t j = seg->HandleEnd(i);
      if ((i == 0 || seg->pages[i - 1] != seg->pages[i]) && j <= end) {
        out.emplace_back(seg, i);
        pages += j - i;
      }
      i = j;
    }
  };
  // The same, last handle first.
  auto collect_last_first = [&](const Block* b) {
    Segment* seg = b->segment;
    if (seg->mapped_pages == 0) return;
    const std::size_t first = seg->PageOf(b->ptr + page_size - 1);
    const std::size_t end = std::min(seg->PageOf(b->ptr + b->size), seg->page_limit);
    for (std::size_t j = end; j > first && pages < limit;) {
      if (seg->pages[j - 1] == 0) {
        --j;
        continue;
      }
      std::size_t i = j - 1;  // back to the first page of the handle that ends at j
      while (i > 0 && seg->pages[i - 1] == seg->pages[j - 1]) --i;
      if (i >= first && seg->HandleEnd(i) == j) {
        out.emplace_back(seg, i);
        pages += j - i;
      }
      j = i;
    }
  };
  // The block being placed first: its own pages past the request move within the block.
  if (also != nullptr && also->segment->page_size == page_size) {
    collect(also, also_from, also->ptr + also->size);
  }
  // Then the free blocks in pool order (smallest first). With recycle_tails_first, each
  // segment's free tail (the block that runs to the range's end) comes first, its highest pages
  // first, then the holes: taking the holes' pages first leaves small holes without their pages,
  // so the next step's requests of those sizes find the best-fit candidates short of a page and
  // take one from another small hole (on the checkpointed Llama-1B trace the moves of steps 2-10
  // came from holes of 1-3 pages, with 2-21 fitting holes fully mapped). Not the default: on the
  // H200 it cut the checkpointed workload's moves by a quarter but raised Llama-1B's by a quarter
  // and its peak reserved / allocated from 1.0086 to 1.0094-1.0105, past the 1.01 target once
  // (expandable-segments.md, "Steady-state churn").
  const bool tails_first = options_.recycle_tails_first;
  for (const BlockPool* pool : {&exp_small_pool_, &exp_large_pool_}) {
    if (!tails_first || pool->page_size != page_size) continue;
    for (const Block* b : pool->blocks) {
      if (pages >= limit) return out;
      if (b->next == nullptr) collect_last_first(b);
    }
  }
  for (const BlockPool* pool : {&exp_small_pool_, &exp_large_pool_}) {
    if (pool->page_size != page_size) continue;
    for (const Block* b : pool->blocks) {
      if (pages >= limit) return out;
      if (!tails_first || b->next != nullptr) collect(b, b->ptr, b->ptr + b->size);
    }
  }
  return out;
}

absl::Status DeviceAllocatorImpl::UnmapPage(Segment* seg, std::size_t page, bool release) {
  // The whole handle that begins at `page`.
  const std::size_t k = seg->HandleEnd(page) - page;
  const std::size_t bytes = k * seg->page_size;
  const DevicePtr va = seg->PageAddress(page);
  RelaxedCaptureScope relaxed(backend_);
  if (absl::Status s = backend_->Unmap(va, bytes); !s.ok()) return s;
  const PhysicalHandle handle = seg->pages[page];
  std::fill_n(seg->pages.begin() + static_cast<std::ptrdiff_t>(page), k, PhysicalHandle{0});
  handle_home_.erase(handle);
  seg->mapped_pages -= k;
  ++stats_.num_device_free;
  Emit(TraceAction::kSegmentUnmap, va, bytes, seg->stream, 0, 0);
  if (!inaccessible_pages_.empty() && inaccessible_pages_.erase({seg, page}) > 0 &&
      inaccessible_pages_.empty()) {
    inaccessible_ = absl::OkStatus();  // no mapping without access is left
  }
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
  const auto old = s.ok() ? retiring_.end() : absl::c_find_if(retiring_, [&](const auto& r) {
    return r.handle == handle;
  });
  if (old != retiring_.end()) {
    if (auto u = absl::c_find(unreleased_handles_, handle); u != unreleased_handles_.end()) {
      unreleased_handles_.erase(u);  // mapped again: not one to release
    }
    ReturnHome(static_cast<std::size_t>(old - retiring_.begin()), types);
  } else {
    UpdateStat(stats_.reserved_bytes, types, -bytes);
  }
  return s;
}

absl::Status DeviceAllocatorImpl::ReleaseHandle(PhysicalHandle handle) {
  // A handle that moved may still be mapped where it was (RetireMapping): not released before
  // that mapping is gone. A handle the driver would not release is kept and released again by
  // the next empty_cache (ReleaseExpandablePages) or the destructor, so it is never lost.
  absl::Status s = ClearRetiring([&](const RetiringMapping& r) { return r.handle == handle; });
  if (s.ok()) s = backend_->ReleasePhysical(handle);
  if (!s.ok()) unreleased_handles_.push_back(handle);
  return s;
}

absl::StatusOr<bool> DeviceAllocatorImpl::EnsureMapped(Block* block, std::size_t size,
                                                       const AllocationRequest& request,
                                                       PendingStreams* pending) {
  Segment* seg = block->segment;
  const std::size_t page = seg->page_size;
  const std::size_t first_page = seg->PageOf(block->ptr);
  const std::size_t last_page = seg->PageOf(block->ptr + size - 1);
  if (std::all_of(seg->pages.begin() + static_cast<std::ptrdiff_t>(first_page),
                  seg->pages.begin() + static_cast<std::ptrdiff_t>(last_page + 1),
                  [](PhysicalHandle h) { return h != 0; })) {
    return true;
  }
  if (absl::Status s = RetireMappings(/*wait=*/false, nullptr, pending); !s.ok()) return s;
  if (options_.keep_old_mappings) {
    if (absl::Status s = ReuseOldMappings(block, size, request); !s.ok()) return s;
  }
  // Runs of missing pages under the request: {first page, pages}.
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  std::size_t missing = 0;
  for (std::size_t i = first_page; i <= last_page; ++i) {
    if (seg->pages[i] != 0) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == i) {
      ++runs.back().second;
    } else {
      runs.emplace_back(i, 1);
    }
    ++missing;
  }
  if (missing == 0) return true;
  // Recycle only when new pages would take reserved past (1 + recycle_slack) x the peak of
  // allocated memory (the peak this allocation reaches included): below that, growing costs no
  // utilization at the peak, and moving pages back and forth between steps would cost driver
  // calls in every step (measured on the H200: ~120 calls a step on GPT-2 without the slack).
  std::vector<std::pair<Segment*, std::size_t>> recycled;
  if (options_.page_recycling) {
    const auto& allocated = stats_.allocated_bytes;
    const double peak_after = static_cast<double>(
        std::max<std::int64_t>(allocated.peak(kAggregate),
                               allocated.current(kAggregate) + static_cast<std::int64_t>(size)));
    const double reserved_after = static_cast<double>(stats_.reserved_bytes.current(kAggregate)) +
                                  static_cast<double>(missing * page);
    if (reserved_after > (1.0 + options_.recycle_slack) * peak_after) {
      // Pages of the block itself past the request count too (it is out of the index now).
      recycled = FreeMappedPages(page, missing, block,
                                 seg->PageAddress(seg->PageOf(block->ptr + size - 1) + 1));
    }
  }
  // Plan: each recycled handle goes to the front of the first run with room for all its pages;
  // one that fits nowhere is released instead (it frees as many pages as new handles take).
  struct Mapping {
    std::size_t dst;  // first page
    std::size_t pages;
    PhysicalHandle handle;  // 0 until created
    bool fresh = false;     // created by this call (counted in reserved once mapped)
    bool detached = false;  // a recycled handle taken from its old place (counted in reserved)
    bool mapped = false;    // mapped at dst
  };
  std::vector<Mapping> mappings;
  std::vector<std::pair<Segment*, std::size_t>> moved;
  std::vector<std::pair<Segment*, std::size_t>> released;
  std::vector<std::pair<std::size_t, std::size_t>> room = runs;  // {next free page, pages left}
  std::size_t released_pages = 0;
  for (const auto& [src, i] : recycled) {
    const std::size_t k = src->HandleEnd(i) - i;
    auto fit = std::find_if(room.begin(), room.end(), [k](const auto& r) { return r.second >= k; });
    if (fit == room.end()) {
      released.emplace_back(src, i);
      released_pages += k;
      continue;
    }
    mappings.push_back({fit->first, k, src->pages[i]});
    moved.emplace_back(src, i);  // moved[j] is mappings[j]
    fit->first += k;
    fit->second -= k;
  }
  // New handles: a page the request covers only in part gets one of its own (a neighbour may
  // keep it busy after this block is freed); the pages it covers whole share handles of up to
  // expandable_handle_size, which then lie wholly inside the free block once it is freed, and
  // so can be recycled whole.
  const std::size_t max_pages = std::max<std::size_t>(1, options_.expandable_handle_size / page);
  const std::size_t first_whole = seg->PageOf(block->ptr + page - 1);
  const std::size_t end_whole = seg->PageOf(block->ptr + size);  // one past the last whole page
  std::size_t fresh = 0;
  for (const auto& [next, left] : room) {
    std::size_t p = next;
    const std::size_t end = next + left;
    while (p < end) {
      std::size_t k = 1;
      if (p >= first_whole && p < end_whole) k = std::min({max_pages, end - p, end_whole - p});
      mappings.push_back({p, k, 0, /*fresh=*/true});
      fresh += k;
      p += k;
    }
  }
  if (fresh > released_pages) {
    const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current(kAggregate));
    const std::size_t after = reserved + (fresh - released_pages) * page;
    if (fraction_set_ && after > allowed_bytes_) return false;
    if (AllocatorHooks* hooks = hooks_.load(std::memory_order_relaxed); hooks != nullptr) {
      absl::Status verdict = hooks->CheckGrowth(request, after, HookView());
      if (!verdict.ok()) {
        growth_refusal_ = std::move(verdict);
        return false;
      }
      growth_refusal_ = absl::OkStatus();  // a later check allowed it
    }
  }
  RelaxedCaptureScope relaxed(backend_);
  // A handle moving within its stream keeps its old mapping until the work queued there before
  // the move has finished (RetireMapping): the new block's work comes later on the same stream,
  // so nothing waits. Handles from another stream, and released ones, wait for their stream (a
  // kernel may still read them; cuMemUnmap does not wait). During a capture: the old way.
  const bool retire = !CaptureUnderway();
  auto stays_mapped = [&](const Segment* src) { return retire && src->stream == seg->stream; };
  std::vector<StreamId> synced;
  for (const auto* list : {&moved, &released}) {
    for (const auto& [src, i] : *list) {
      if (list == &moved && stays_mapped(src)) continue;
      if (std::find(synced.begin(), synced.end(), src->stream) == synced.end()) {
        if (absl::Status s = backend_->SynchronizeStream(src->stream); !s.ok()) return s;
        synced.push_back(src->stream);
      }
    }
  }
  // Handles that fit nowhere are released first (their memory may be what the new ones need);
  // then new handles are created before any other mapping changes, so that running out of memory
  // leaves every live mapping as it was.
  for (const auto& [src, i] : released) {
    if (absl::Status s = UnmapPage(src, i, /*release=*/true); !s.ok()) return s;
    ++page_moves_;
  }
  // From here on a failed driver call leaves the books exact and leaks nothing (`abandon`;
  // driver-errors.md): every handle this call holds that is not mapped and accessible where
  // planned is released.
  EventId fence = 0;
  auto abandon = [&](absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    const StatType types = StatTypesFor(seg->pool);
    // Decided before the releases below: they forget the fence's entries and give it back to the
    // pool themselves (ForgetRetiring); giving it back twice let two later users share one event
    // (found by OldMappingFenceTest.AbandonGivesTheFenceBackOnce).
    const bool fence_unused =
        fence != 0 &&
        absl::c_none_of(retiring_, [&](const RetiringMapping& r) { return r.fence == fence; });
    for (const Mapping& m : mappings) {
      const auto bytes = static_cast<std::int64_t>(m.pages * page);
      if (m.mapped) {
        // Counted in reserved: UnmapPage takes it. When the unmap fails too, the mapping stays
        // a mapped free page (still counted), which must then have access: a page mapped without
        // access never holds a block, and this one may be under the next request.
        const absl::Status unmapped = UnmapPage(seg, m.dst, /*release=*/true);
        if (!unmapped.ok() && seg->pages[m.dst] == m.handle) {
          absl::Status access = backend_->SetAccess(seg->PageAddress(m.dst), m.pages * page);
          if (!access.ok()) {
            inaccessible_pages_.insert({seg, m.dst});
            if (inaccessible_.ok()) {
              inaccessible_ = absl::InternalError(absl::StrCat(
                  "vramledger: expandable memory at ", absl::Hex(seg->PageAddress(m.dst)),
                  " is mapped without access after driver failures (", error.message(),
                  "; its unmap: ", unmapped.message(), "; access again: ", access.message(),
                  "); expandable allocations are refused until empty_cache() unmaps it"));
            }
          }
        }
      } else if (m.fresh && m.handle != 0) {
        (void)ReleaseHandle(m.handle);  // not counted yet
      } else if (m.detached) {          // mapped nowhere now, or only at its retiring old address
        (void)ReleaseCounted(m.handle, types, bytes);
      }
    }
    if (fence_unused) spare_events_.push_back(fence);
    return error;
  };
  for (Mapping& m : mappings) {
    if (!m.fresh) continue;
    absl::Status s = backend_->CreatePhysical(m.pages * page, &m.handle);
    if (!s.ok()) {
      m.handle = 0;
      (void)abandon(absl::OkStatus());
      if (absl::IsResourceExhausted(s)) return false;
      return s;
    }
  }
  // One fence for the handles that stay mapped where they were (all on this segment's stream).
  if (std::any_of(moved.begin(), moved.end(),
                  [&](const auto& m) { return stays_mapped(m.first); })) {
    auto event = GetEvent();
    if (!event.ok()) return abandon(event.status());
    if (absl::Status s = backend_->RecordEvent(*event, seg->stream); !s.ok()) {
      spare_events_.push_back(*event);
      return abandon(s);
    }
    fence = *event;
  }
  for (std::size_t j = 0; j < moved.size(); ++j) {
    const auto& [src, i] = moved[j];
    const std::size_t bytes = (src->HandleEnd(i) - i) * page;
    absl::Status s = stays_mapped(src) ? RetireMapping(src, i, fence) : UnmapPage(src, i, false);
    if (!s.ok()) return abandon(s);
    mappings[j].detached = true;
    ++page_moves_;
    if (src->pool->is_small != seg->pool->is_small) {  // the page changes pool: move its bytes
      stats_.reserved_bytes.Move(StatTypesFor(src->pool), StatTypesFor(seg->pool),
                                 static_cast<std::int64_t>(bytes));
    }
  }
  const StatType types = StatTypesFor(seg->pool);
  // Map, then grant access once per run of missing pages (now all mapped).
  for (Mapping& m : mappings) {
    const DevicePtr va = seg->PageAddress(m.dst);
    const auto flags = seg->retiring.begin() + static_cast<std::ptrdiff_t>(m.dst);
    if (std::any_of(flags, flags + static_cast<std::ptrdiff_t>(m.pages),
                    [](std::uint8_t f) { return f != 0; })) {
      absl::Status cleared = ClearRetiring([&](const RetiringMapping& r) {  // mapped over next
        return r.segment == seg && r.first_page < m.dst + m.pages && m.dst < r.first_page + r.pages;
      });
      if (!cleared.ok()) return abandon(cleared);
    }
    if (absl::Status s = backend_->Map(va, m.pages * page, m.handle); !s.ok()) return abandon(s);
    std::fill_n(seg->pages.begin() + static_cast<std::ptrdiff_t>(m.dst), m.pages, m.handle);
    handle_home_[m.handle] = {seg, m.dst};
    seg->mapped_pages += m.pages;
    seg->page_limit = std::max(seg->page_limit, m.dst + m.pages);
    m.mapped = true;
    m.detached = false;
    if (m.fresh) {
      UpdateStat(stats_.reserved_bytes, types, static_cast<std::int64_t>(m.pages * page));
    }
    ++stats_.num_device_alloc;
    Emit(TraceAction::kSegmentMap, va, m.pages * page, seg->stream, request.context, request.tag);
  }
  for (const auto& [first, count] : runs) {
    if (absl::Status s = backend_->SetAccess(seg->PageAddress(first), count * page); !s.ok()) {
      return abandon(s);  // a page without access must never hold a block
    }
  }
  return true;
}

absl::StatusOr<DevicePtr> DeviceAllocatorImpl::MallocExpandable(BlockPool* pool,
                                                                const AllocationRequest& request) {
  if (!inaccessible_.ok()) return inaccessible_;
  const std::size_t size = request.rounded;
  for (int attempt = 0; attempt < 2; ++attempt) {
    PendingStreams pending;  // per attempt: fences found pending before may have completed since
    // Old mappings are not taken back during a capture (no fence can be recorded there).
    reuse_old_mappings_now_ = options_.keep_old_mappings && !CaptureUnderway();
    DevicePtr start = 0;
    Block* block = TakeExpandableBlock(pool, request.stream, size, &pending, &start);
    if (block == nullptr && size <= ExpandableRangeBytes(pool)) {
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
  return OutOfMemory(request, size);
}

absl::Status DeviceAllocatorImpl::ReleaseExpandablePages() {
  // A failing driver call does not stop the rest: each step goes on past it and the first error
  // is returned at the end. Stopping at a handle that would not release left every free page
  // mapped, a mapping without access among them, refusing expandable allocations for good (a
  // reviewer's finding); stopping in the middle of the retries leaked the rest.
  absl::Status first_error;
  // Unmap only after the owning stream finished with the pages (cuMemUnmap does not wait).
  first_error.Update(RetireMappings(/*wait=*/true));
  // Handles a failed driver call left unreleased (ReleaseHandle): once more.
  for (std::vector<PhysicalHandle> again = std::exchange(unreleased_handles_, {});
       PhysicalHandle h : again) {
    first_error.Update(ReleaseHandle(h));
  }
  std::vector<StreamId> synced;  // one wait per stream, for all its ranges
  std::vector<StreamId> failed;  // streams that could not be waited for: their pages stay
  for (BlockPool* pool : {&exp_small_pool_, &exp_large_pool_}) {
    for (const auto& [seg, i] : FreeMappedPages(pool->page_size, SIZE_MAX)) {
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
  return first_error;
}

}  // namespace vramledger
