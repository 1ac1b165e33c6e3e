// Placement in expandable segments: which free block a request takes and where in it, by what its
// pages cost (mapped, unmapped, an old mapping to take back or to wait for), and which mapped free
// pages are recycled first. Reads the page table and the old mappings; changes only free blocks.
#ifndef VRAMLEDGER_CORE_PLACEMENT_H_
#define VRAMLEDGER_CORE_PLACEMENT_H_

#include <array>
#include <cstddef>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "core/block.h"
#include "core/old_mappings.h"
#include "core/page_table.h"
#include "vramledger/types.h"

namespace vramledger::core {

/// Not thread-safe: the owning allocator calls it with its lock held (docs/design/locking.md).
class Placement {
 public:
  /// `pools`: the expandable pools (small, large), whose free blocks hold the mapped free pages.
  Placement(const PageTable* table, const OldMappings* old, std::array<const BlockPool*, 2> pools,
            bool recycle_tails_first)
      : table_(table), old_(old), pools_(pools), recycle_tails_first_(recycle_tails_first) {}

  /// What mapping page i of `seg` costs a placement inside free block `within`: 0 if mapped;
  /// kUnmappedPageCost if not, or if it holds an idle old mapping (mapping over it unmaps that
  /// first); kReusablePageCost if it holds an old mapping whose handle lies free now
  /// (OldMappings::Reusable: taking it back makes no driver call); kInUsePageCost, and
  /// *in_use set, if it holds an old mapping that may still be in use there: mapping over it
  /// waits for that fence unless the fence has completed.
  std::size_t PageCost(const Segment* seg, std::size_t i, bool* in_use, const Block* within) const {
    if (seg->pages[i] != 0) return 0;
    if (seg->old_mapping[i] == 0) return kUnmappedPageCost;
    return OldMappingPageCost(seg, i, in_use, within);
  }

  /// Best fit among the stream's free blocks of `pool`, scored by their cheapest place (missing
  /// pages, pages of old mappings in use weighing more, then the fewest pinned pages), taken out
  /// of the index; nullptr if none fits. *start: the cheapest place in that block, or 0 when it
  /// was scored by its first bytes only (the tail; StartFor then searches it). When a candidate
  /// was scored as mapping over an old mapping in use and none needs no page, `settle` (drops the
  /// old mappings of this stream's segments of `pool` whose fences completed) runs once and the
  /// candidates are scored again if it changed anything.
  Block* TakeBlock(BlockPool* pool, StreamId stream, std::size_t size, DevicePtr* start,
                   absl::FunctionRef<absl::Status()> settle) const;
  /// Where in free `block` the request of `size` bytes starts: `start` when TakeBlock found it
  /// (nothing has changed since), else the cheapest place's own search.
  DevicePtr StartFor(const Block* block, std::size_t size, DevicePtr start) const;

  /// Whole mapped handles strictly inside free blocks of pools with `page_size` (up to `limit`
  /// pages), by their first page, in the order they are taken: `also`'s, then the free blocks
  /// smallest first, those of `also`'s stream before the other streams'; with
  /// recycle_tails_first, each segment's free tail (highest first) before the holes
  /// (page-recycling.md, "Recycling"). `also` (optional): a free block
  /// taken out of the index, whose pages from `also_from` on count. `among` (optional): the
  /// pools to search instead of the device's own (a private pool's: a region's pages move only
  /// within its pool, docs/design/regions.md).
  std::vector<std::pair<Segment*, std::size_t>> FreeMappedPages(
      std::size_t page_size, std::size_t limit, const Block* also = nullptr,
      DevicePtr also_from = 0, const std::array<const BlockPool*, 2>* among = nullptr) const;

  /// Mapped bytes of the longest mapped run inside a free block (what it can serve at once).
  static std::size_t MappedRun(const Block* block);

  // The weights. kInUsePageCost, 64 unmapped pages, compares one cudaEventSynchronize (H200,
  // checkpointed Llama-1B: 11 waits, 52 ms) with one page (30-80 us). The reusable cost equals
  // a mapped page's: with any preference for the page where a free handle is mapped now over
  // its old mapping, placement depends on where the last reuse left each handle, and a repeated
  // identical step never settles (checkpointed Llama-1B, a step repeated: 100-170 map / unmap /
  // access calls in every repetition, reserved drifting to 1.0145 x allocated); at 0 it settles
  // into a cycle that makes no such call. Except where the handle is mapped inside the same free
  // block (Reusable's `within`): the reuse would leave it there and map over the old mapping,
  // waiting for its fence if it is still in use; counting both places free also cost GPT-2's
  // new-peak steps moves (page-recycling.md, "Repeated steps").
  static constexpr std::size_t kUnmappedPageCost = 2;
  static constexpr std::size_t kReusablePageCost = 0;
  static constexpr std::size_t kInUsePageCost = 64 * kUnmappedPageCost;

 private:
  std::size_t OldMappingPageCost(const Segment* seg, std::size_t i, bool* in_use,
                                 const Block* within) const;

  const PageTable* table_;
  const OldMappings* old_;
  std::array<const BlockPool*, 2> pools_;
  bool recycle_tails_first_;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_PLACEMENT_H_
