// Placement in expandable segments (placement.h): block choice by page cost, the place inside a
// block, and the order mapped free pages are recycled in. Design:
// docs/design/expandable-segments.md.
#include "core/placement.h"
#include "core/free_block_index.h"

#include <algorithm>

namespace vramledger::core {

namespace {

// PageCost summed over the pages under [lo, lo + size).
template <typename CostFn>
std::size_t CostAt(const Segment* seg, DevicePtr lo, std::size_t size, const CostFn& cost_of,
                   bool* in_use) {
  std::size_t cost = 0;
  for (std::size_t i = seg->PageOf(lo); i <= seg->PageOf(lo + size - 1); ++i) {
    cost += cost_of(seg, i, in_use);
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
// page-aligned start further in (Placement::StartFor); among places of equal cost, the one that
// pins the fewest pages (Pinned: a partly used page is what the peak loses). *start: that
// address (block->ptr for its start); *in_use as for PageCost; *pinned: its pinned pages.
// Placing against the block's end instead was measured and not kept (checkpointed Llama-1B
// 0.9853 -> 0.9820, expandable-segments.md).
template <typename CostFn>
std::size_t BestPlacement(const Block* block, std::size_t size, const CostFn& cost_of,
                          DevicePtr* start, bool* in_use, std::size_t* pinned) {
  const Segment* seg = block->segment;
  const std::size_t page = seg->page_size;
  const DevicePtr end = block->ptr + block->size;
  const std::size_t n = (size + page - 1) / page;
  *start = block->ptr;
  std::size_t best = CostAt(seg, block->ptr, size, cost_of, in_use);
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
    for (std::size_t i = j0; i < j0 + n; ++i) cost += cost_of(seg, i, in_use);
    for (std::size_t j = j0;; ++j) {
      if (cost < best) {
        best = cost;
        *start = seg->PageAddress(j);
        *pinned = Pinned(block, *start, size);
        if (cost == 0) break;
      }
      if (j + 1 > j_last) break;
      cost -= cost_of(seg, j, in_use);
      cost += cost_of(seg, j + n, in_use);
    }
  }
  if (j_end <= j_last) {
    const DevicePtr a = seg->PageAddress(j_end);
    const std::size_t pin = Pinned(block, a, size);
    if (pin < *pinned && a != *start) {
      const std::size_t end_cost = CostAt(seg, a, size, cost_of, in_use);
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

std::size_t Placement::OldMappingPageCost(const Segment* seg, std::size_t i, bool* in_use,
                                          const Block* within) const {
  if (old_->Reusable(*table_, seg, i, within)) return kReusablePageCost;
  if (seg->old_mapping[i] == Segment::kOldMappingIdle) return kUnmappedPageCost;
  *in_use = true;
  return kInUsePageCost;
}

std::size_t Placement::MappedRun(const Block* block) {
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

Block* Placement::TakeBlock(BlockPool* pool, StreamId stream, std::size_t size, DevicePtr* start,
                            absl::FunctionRef<absl::Status()> settle) const {
  *start = 0;
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = pool->blocks.lower_bound(&key);
  if (it == pool->blocks.end() || (*it)->stream != stream) return nullptr;
  // Best fit by size, but a block with room for `size` bytes on mapped pages beats a smaller one
  // that would need pages: look at a few candidates, and the stream's largest (the tail). Each
  // is scored by its best page-aligned placement (BestPlacement, what StartFor then
  // uses), not by its first bytes: on the checkpointed Llama-1B trace that halves the page
  // moves (2,600 -> 1,214) and the steady-state driver time (expandable-segments.md).
  constexpr int kCandidates = 8;
  auto cost_in = [this](const Block* b) {  // PageCost for placements inside free block b
    return [this, b](const Segment* s, std::size_t i, bool* r) { return PageCost(s, i, r, b); };
  };
  const std::size_t pages = (size + pool->page_size - 1) / pool->page_size;
  auto best = pool->blocks.end();
  for (int round = 0; round < 2; ++round) {
    std::size_t best_cost = SIZE_MAX;
    std::size_t best_pinned = SIZE_MAX;
    bool saw_in_use = false;  // some cost counted a page of an old mapping in use
    int seen = 0;
    DevicePtr unused_start = 0;  // each candidate's cheapest place (BestPlacement)
    // Among equal costs the candidate that pins the fewest pages wins; the search stops at one
    // on mapped pages that shares a page with a neighbour (BestPlacement's "good enough").
    for (auto c = it; c != pool->blocks.end() && (*c)->stream == stream && seen < kCandidates;
         ++c, ++seen) {
      std::size_t pinned = 0;
      const std::size_t cost =
          BestPlacement(*c, size, cost_in(*c), &unused_start, &saw_in_use, &pinned);
      if (cost < best_cost || (cost == best_cost && pinned < best_pinned)) {
        best = c;
        best_cost = cost;
        best_pinned = pinned;
        *start = unused_start;                   // where StartFor will put it
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
          CostAt((*last)->segment, (*last)->ptr, size, cost_in(*last), &saw_in_use) < best_cost) {
        best = last;
        *start = 0;  // scored by its first bytes: StartFor searches it
      }
    }
    // A candidate was scored as mapping over an old mapping in use and none needs no page: drop
    // the old mappings of this stream's segments of the pool (the only ones that can change the
    // choice) whose fences have completed (one query per stream, no wait) and score once more,
    // so that only addresses still in use count. A query error is reported by the same call in
    // EnsureMapped.
    if (round == 1 || best_cost == 0 || !saw_in_use || old_->empty()) break;
    const std::size_t before = old_->InUse();
    if (!settle().ok() || old_->InUse() == before) break;
  }
  Block* block = *best;
  pool->blocks.erase(best);
  return block;
}

DevicePtr Placement::StartFor(const Block* block, std::size_t size, DevicePtr start) const {
  if (start != 0) return start;
  // Not searched yet (the tail): as TakeBlock scores its candidates.
  DevicePtr a = 0;
  bool unused_in_use = false;
  std::size_t unused_pinned = 0;
  auto cost_of = [this, block](const Segment* s, std::size_t i, bool* r) {
    return PageCost(s, i, r, block);
  };
  BestPlacement(block, size, cost_of, &a, &unused_in_use, &unused_pinned);
  return a;
}

std::vector<std::pair<Segment*, std::size_t>> Placement::FreeMappedPages(
    std::size_t page_size, std::size_t limit, const Block* also, DevicePtr also_from,
    const std::array<const BlockPool*, 2>* among) const {
  const std::array<const BlockPool*, 2>& pools = among != nullptr ? *among : pools_;
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
  // (page-recycling.md, "Recycling").
  const bool tails_first = recycle_tails_first_;
  auto sweep = [&](auto keep) {
    for (const BlockPool* pool : pools) {
      if (!tails_first || pool->page_size != page_size) continue;
      for (const Block* b : pool->blocks) {
        if (pages >= limit) return;
        if (b->next == nullptr && keep(b)) collect_last_first(b);
      }
    }
    for (const BlockPool* pool : pools) {
      if (pool->page_size != page_size) continue;
      for (const Block* b : pool->blocks) {
        if (pages >= limit) return;
        if ((!tails_first || b->next != nullptr) && keep(b)) collect(b, b->ptr, b->ptr + b->size);
      }
    }
  };
  if (also == nullptr) {
    sweep([](const Block*) { return true; });
    return out;
  }
  // The stream of the block being placed before the others: a page from its own stream moves
  // without a wait and can be taken back later with no driver call, where one from another
  // stream waits for that stream (the host stalls until its queued work ends) and leaves no old
  // mapping to take back (page-recycling.md, "Moves without a stall"). Pools order their blocks
  // by stream first, so without this preference the lowest stream's holes go first whichever
  // stream asks.
  const StreamId stream = also->stream;
  sweep([stream](const Block* b) { return b->stream == stream; });
  sweep([stream](const Block* b) { return b->stream != stream; });
  return out;
}

}  // namespace vramledger::core
