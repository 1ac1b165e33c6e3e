// Reports on one device's allocator (device_report.h): its segments in torch's snapshot shape
// and its fragmentation figures, read through the core's view under the allocator's lock.
#include "ledger/device_report.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::Segment;

std::vector<SegmentInfo> SegmentsOf(const DeviceAllocator& allocator) {
  std::vector<SegmentInfo> out;
  allocator.Read([&](const core::CoreView& view) { out = SegmentsOf(view); });
  return out;
}

Fragmentation FragmentationOf(const DeviceAllocator& allocator, StreamId current_stream) {
  Fragmentation f;
  allocator.Read([&](const core::CoreView& view) { f = FragmentationOf(view, current_stream); });
  return f;
}

Fragmentation FragmentationOf(const core::CoreView& view, StreamId current_stream) {
  const core::CoreStats& stats = *view.stats;
  Fragmentation f;
  f.utilization = stats.utilization();
  const auto& reserved = stats.reserved_bytes;
  const auto& allocated = stats.allocated_bytes;
  f.wasted_bytes = reserved.current(kAggregate) - allocated.current(kAggregate);
  f.wasted_bytes_at_peak = reserved.peak(kAggregate) - allocated.peak(kAggregate);
  f.free_bytes = reserved.current(kAggregate) - stats.active_bytes.current(kAggregate);
  f.largest_free_block = static_cast<std::int64_t>(core::LargestFreeBlock(view.pools));
  f.free_space_fragmentation =
      f.free_bytes > 0 ? 1.0 - static_cast<double>(f.largest_free_block) / f.free_bytes : 0.0;
  f.holes = core::CountHoles(view.pools);
  // FreeMappedPages lists each whole free handle once, by its first page, across every pool of
  // that page size: pages, not handles, are counted (expandable_handle_mb puts several pages in
  // a handle), and one page size is listed once.
  const BlockPool* exp_small = view.pools[2];
  const BlockPool* exp_large = view.pools[3];
  for (const BlockPool* pool : {exp_small, exp_large}) {
    if (pool == exp_large && exp_small->page_size == exp_large->page_size) break;
    for (const auto& [segment, first] :
         view.placement->FreeMappedPages(pool->page_size, SIZE_MAX)) {
      f.mapped_free_pages += static_cast<std::int64_t>(segment->HandleEnd(first) - first);
    }
  }
  f.retiring_bytes = view.old_mappings->Bytes();
  for (const BlockPool* pool : view.pools) {
    for (const Block* b : pool->blocks) {
      if (b->stream == current_stream) continue;
      const Segment* seg = b->segment;
      if (!seg->expandable) {
        f.other_stream_cached_bytes += static_cast<std::int64_t>(b->size);
        continue;
      }
      const std::size_t last = std::min(seg->PageOf(b->ptr + b->size - 1) + 1, seg->page_limit);
      for (std::size_t i = seg->PageOf(b->ptr); i < last; ++i) {
        if (seg->pages[i] == 0) continue;
        const DevicePtr lo = std::max(b->ptr, seg->PageAddress(i));
        const DevicePtr hi = std::min(b->ptr + b->size, seg->PageAddress(i) + seg->page_size);
        f.other_stream_cached_bytes += static_cast<std::int64_t>(hi - lo);
      }
    }
  }
  f.page_moves = view.page_table->page_moves();
  f.reused_old_mappings = view.old_mappings->reused();
  return f;
}

namespace {

// Physical handles mapped over pages [first, end) of an expandable segment: one per run of
// pages carrying the same handle (a handle of expandable_handle_mb spans several pages); the
// unmapped pages under a free block count none.
std::size_t HandlesIn(const Segment* seg, std::size_t first, std::size_t end) {
  std::size_t n = 0;
  for (std::size_t k = first; k < end && k < seg->page_limit; ++k) {
    if (seg->pages[k] != 0 && (k == first || seg->pages[k] != seg->pages[k - 1])) ++n;
  }
  return n;
}

BlockInfo DescribeBlock(const Block* b, DevicePtr lo, DevicePtr hi) {
  BlockInfo bi;
  bi.address = lo;
  bi.size = hi - lo;
  if (b->allocated) {
    bi.state = "active_allocated";
  } else if (b->event_count > 0) {
    bi.state = "active_pending_free";
  } else {
    bi.state = "inactive";
  }
  const bool live = !b->is_free();
  bi.requested_size = live ? b->requested_size : 0;
  bi.tag = live ? b->tag : 0;
  bi.context = live ? b->context : 0;
  const Segment* seg = b->segment;
  bi.handles = seg->expandable ? HandlesIn(seg, seg->PageOf(lo), seg->PageOf(hi - 1) + 1) : 1;
  return bi;
}

void AddBlock(SegmentInfo& info, const Block* b, const BlockInfo& bi) {
  if (b->allocated) info.allocated_size += bi.size;
  if (!b->is_free()) {
    info.active_size += bi.size;
    info.requested_size += bi.requested_size;
  }
  info.blocks.push_back(bi);
}

}  // namespace

std::vector<SegmentInfo> SegmentsOf(const core::CoreView& view) {
  // Private pools own plain segments only, so only those need a pool id.
  absl::flat_hash_map<const BlockPool*, MempoolId> owner;
  for (const auto& [pool, id] : view.private_pools) owner[pool] = id;
  std::vector<SegmentInfo> out;
  out.reserve(view.plain_segments->size());
  for (const auto& [ptr, segment] : *view.plain_segments) {
    SegmentInfo info;
    info.device = view.device;
    info.address = ptr;
    info.total_size = segment->size;
    info.stream = segment->stream;
    info.is_small = segment->pool->is_small;
    if (auto it = owner.find(segment->pool); it != owner.end()) info.pool_id = it->second;
    for (const Block* b = segment->head; b != nullptr; b = b->next) {
      AddBlock(info, b, DescribeBlock(b, b->ptr, b->ptr + b->size));
    }
    out.push_back(std::move(info));
  }
  // Expandable segments: one SegmentInfo per contiguous mapped range, blocks clipped to it; a
  // paused region's segment, one per contiguous range its pause released (marked paused).
  for (const auto& seg : view.page_table->segments()) {
    const Block* b = seg->head;
    const bool paused = seg->pool->paused;
    std::vector<bool> released;
    if (paused && view.regions != nullptr) {
      released.assign(seg->page_limit, false);
      if (const auto* region = view.regions->OfPool(seg->pool->owner); region != nullptr) {
        for (const auto& run : region->released) {
          if (run.segment != seg.get()) continue;
          for (std::size_t k = 0; k < run.pages; ++k) released[run.first_page + k] = true;
        }
      }
    }
    auto present = [&](std::size_t k) {
      return paused ? k < released.size() && released[k] : seg->pages[k] != 0;
    };
    std::size_t i = 0;
    while (i < seg->page_limit) {
      if (!present(i)) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < seg->page_limit && present(j)) ++j;
      SegmentInfo info;
      info.device = view.device;
      info.address = seg->PageAddress(i);
      info.total_size = (j - i) * seg->page_size;
      info.stream = seg->stream;
      info.is_small = seg->pool->is_small;
      info.is_expandable = true;
      info.handles = HandlesIn(seg.get(), i, j);
      info.pool_id = seg->pool->owner;  // a region's pool, or {0, 0}
      info.paused = paused;
      const DevicePtr lo = info.address;
      const DevicePtr hi = lo + info.total_size;
      while (b != nullptr && b->ptr + b->size <= lo) b = b->next;
      for (const Block* c = b; c != nullptr && c->ptr < hi; c = c->next) {
        AddBlock(info, c, DescribeBlock(c, std::max(c->ptr, lo), std::min(c->ptr + c->size, hi)));
      }
      out.push_back(std::move(info));
      i = j;
    }
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

}  // namespace vramledger
