// The page tables of one device's expandable segments: the reserved ranges, the handle mapped at
// each page, each mapped handle's home, the blocks using each page, and the handles and mappings
// driver errors left behind. State only: the allocator makes the driver calls and holds the lock.
#ifndef VRAMLEDGER_CORE_PAGE_TABLE_H_
#define VRAMLEDGER_CORE_PAGE_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "core/block.h"
#include "vramledger/types.h"

namespace vramledger::core {

/// Not thread-safe: the owning allocator calls it with its lock held (docs/design/locking.md).
class PageTable {
 public:
  /// Where a mapped handle is: {segment, first page}.
  using Home = std::pair<Segment*, std::size_t>;

  /// The expandable segments, in the order they were reserved: one per (stream, pool), and a
  /// further one for that (stream, pool) when a request fits none of its ranges' free blocks (as
  /// torch's find_expandable_block). A handful: scanned, not indexed.
  const std::vector<std::unique_ptr<Segment>>& segments() const { return segments_; }
  /// A new segment over the reserved range [va, va + pages * page_size), nothing mapped.
  Segment* AddSegment(DevicePtr va, std::size_t pages, std::size_t page_size, StreamId stream,
                      BlockPool* pool);

  /// The device's total memory (cudaMemGetInfo), recorded when the first range is reserved.
  void set_device_total(std::size_t bytes) { device_total_bytes_ = bytes; }
  /// Bytes of one virtual range with pages of `page_size`: torch reserves 1.125 x the device's
  /// memory per segment, page-rounded. SIZE_MAX before the device's size is known (no bound).
  std::size_t RangeBytes(std::size_t page_size) const;

  /// Records `handle` mapped over pages [first, first + pages) of `seg`: its home, the mapped
  /// count and the page limit follow.
  void Map(Segment* seg, std::size_t first, std::size_t pages, PhysicalHandle handle);
  /// Takes the whole handle that begins at `page` out of `seg`'s table; returns it and sets
  /// *pages to its page count. Its home is forgotten (it is mapped again elsewhere, or gone).
  PhysicalHandle Unmap(Segment* seg, std::size_t page, std::size_t* pages);
  /// The home of a mapped handle, or nullptr when it is mapped in no page table.
  const Home* HomeOf(PhysicalHandle handle) const {
    const auto it = homes_.find(handle);
    return it == homes_.end() ? nullptr : &it->second;
  }

  /// Adds `delta` to Segment::use of each page under an expandable block (allocated: +1; its
  /// free completes: -1).
  static void CountUse(const Block* block, std::int32_t delta) {
    Segment* seg = block->segment;
    const std::size_t last = seg->PageOf(block->ptr + block->size - 1);
    for (std::size_t i = seg->PageOf(block->ptr); i <= last; ++i) {
      seg->use[i] = static_cast<std::uint32_t>(static_cast<std::int64_t>(seg->use[i]) + delta);
    }
  }

  /// Mappings without access: a mapping that could be neither unmapped nor given access (three
  /// driver failures in a row) must never hold a block, so no expandable allocation is served
  /// while one exists (driver-errors.md, "Two failures"). `refusal()` is the error returned
  /// then; OK when there is none.
  const absl::Status& refusal() const { return inaccessible_; }
  /// Records the mapping at {seg, page} as without access; `error` becomes the refusal when it
  /// is the first such mapping.
  void MarkInaccessible(const Segment* seg, std::size_t page, absl::Status error);
  /// The mapping at {seg, page} is gone (unmapped): the refusal ends with the last such mapping.
  void ForgetInaccessible(const Segment* seg, std::size_t page) {
    if (!inaccessible_pages_.empty() && inaccessible_pages_.erase({seg, page}) > 0 &&
        inaccessible_pages_.empty()) {
      inaccessible_ = absl::OkStatus();
    }
  }

  /// Unmapped handles the driver would not release, kept to be released again (by empty_cache
  /// or at destruction) so that none is lost.
  const std::vector<PhysicalHandle>& unreleased() const { return unreleased_; }
  void KeepUnreleased(PhysicalHandle handle) { unreleased_.push_back(handle); }
  std::vector<PhysicalHandle> TakeUnreleased() { return std::exchange(unreleased_, {}); }
  /// Drops `handle` from the unreleased ones (it is mapped again); false if it was not there.
  bool ForgetUnreleased(PhysicalHandle handle);

  /// Handles moved from one place to another, or released to make room (Fragmentation).
  std::int64_t page_moves() const { return page_moves_; }
  void CountMove() { ++page_moves_; }

  /// Each page's use count matches the allocated or pending-free blocks over it, and each
  /// mapped handle has one home, the first page of its run.
  absl::Status CheckInvariants() const;

 private:
  std::vector<std::unique_ptr<Segment>> segments_;
  std::size_t device_total_bytes_ = 0;
  absl::flat_hash_map<PhysicalHandle, Home> homes_;
  absl::Status inaccessible_;
  absl::flat_hash_set<std::pair<const Segment*, std::size_t>> inaccessible_pages_;
  std::vector<PhysicalHandle> unreleased_;
  std::int64_t page_moves_ = 0;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_PAGE_TABLE_H_
