// The free-block index of one pool: best fit under torch's max_split_size rules, splitting a free
// block and merging a freed one with its free neighbours. Not locked: its owner's mutex guards it.
#ifndef VRAMLEDGER_CORE_FREE_BLOCK_INDEX_H_
#define VRAMLEDGER_CORE_FREE_BLOCK_INDEX_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <utility>

#include "absl/status/status.h"
#include "core/block.h"

namespace vramledger {
class SegmentSource;  // vramledger/device_allocator.h
}  // namespace vramledger

namespace vramledger::core {

/// A pool's free blocks in best-fit order (stream, size, address): a std::set whose insert also
/// stores each block's node in Block::index_pos, so that merging and the in-place key updates
/// reach a block's node without a search (docs/design/locking.md, "Hot path"). Only the inserts
/// below exist, so no insert can leave index_pos stale; erase, lookups and iteration are
/// std::set's. Keys change in place (a split's remainder shrinks, a merge grows): Reposition
/// restores the order afterwards without allocating.
class FreeBlockIndex : public FreeIndexSet {
 public:
  using FreeIndexSet::FreeIndexSet;
  std::pair<iterator, bool> insert(Block* const& block) {
    auto result = FreeIndexSet::insert(block);
    block->index_pos = result.first;
    return result;
  }
  /// Re-inserts an extracted node (Relink); the block's index_pos follows.
  iterator insert(node_type&& node) {
    Block* block = node.value();
    auto result = FreeIndexSet::insert(std::move(node));
    block->index_pos = result.position;
    return result.position;
  }
  /// The node of `block`, which must be in this index (O(1)).
  static iterator Position(const Block* block) { return block->index_pos; }

  /// Best fit for (stream, size): the smallest free block of `stream` that holds `size`, the
  /// lowest address among equals; end() if none, or if torch's max_split_size rules refuse it:
  /// a request below `max_split` never takes an oversize block (>= max_split), and an oversize
  /// request takes only a block that wastes less than `max_non_split_rounding`.
  iterator FindBestFit(StreamId stream, std::size_t size, std::size_t max_split,
                       std::size_t max_non_split_rounding) {
    Block key;
    key.stream = stream;
    key.size = size;
    key.ptr = 0;
    auto it = lower_bound(&key);
    if (it == end() || (*it)->stream != stream) return end();
    if (size < max_split && (*it)->size >= max_split) return end();
    if (size >= max_split && (*it)->size >= size + max_non_split_rounding) return end();
    return it;
  }

  /// Restores the order after the key of the block at `it` changed in place: the node stays
  /// where it is when the order still holds, else it is unlinked and relinked (no allocation).
  void Reposition(iterator it) {
    const BlockBestFitLess less;
    const bool ordered = (it == begin() || less(*std::prev(it), *it)) &&
                         (std::next(it) == end() || less(*it, *std::next(it)));
    if (!ordered) Relink(it);
  }
  /// Reposition when the key only shrank (a split's remainder: only its predecessor can be out
  /// of order) or only grew (a merge: only its successor can).
  void RepositionShrunk(iterator it) {
    if (it != begin() && !BlockBestFitLess()(*std::prev(it), *it)) Relink(it);
  }
  void RepositionGrown(iterator it) {
    const auto after = std::next(it);
    if (after != end() && !BlockBestFitLess()(*it, *after)) Relink(it);
  }
  void Relink(iterator it) { insert(extract(it)); }  // the node is reused: no allocation

  /// A block a freed neighbour may merge with: free, no event outstanding, no stream use.
  static bool Mergeable(const Block* b) {
    return b != nullptr && !b->allocated && b->event_count == 0 && b->stream_uses.empty();
  }

  /// Splits free block `block` of this index's pool: `front` (a fresh block, filled here) takes
  /// its first `size` bytes and is returned, not indexed; `block` keeps the rest and stays
  /// free. `indexed`: `block` is in this index (its node is kept, moved if the order needs it);
  /// else the remainder is inserted.
  Block* SplitFront(Block* block, std::size_t size, Block* front, bool indexed);

  /// What Merge did: the block now holding the freed bytes (indexed), the blocks it absorbed
  /// and which left their segments (for the caller to recycle, in this order), and the count
  /// and bytes of the free neighbours absorbed.
  struct Merged {
    Block* block = nullptr;
    std::array<Block*, 2> gone{};
    int num_gone = 0;
    std::int64_t neighbours = 0;
    std::int64_t neighbour_bytes = 0;
  };
  /// Returns no-longer-live `block` to the index, merged with its Mergeable neighbours: into an
  /// already indexed neighbour whose key changes in place (the previous one when both are).
  Merged Merge(Block* block);

  /// Merges Mergeable neighbour `src` (indexed) into `dst` (not indexed): `src` leaves the index
  /// and its segment; returns its bytes (0, nothing changed, when `src` is not Mergeable). The
  /// caller recycles `src` when the result is not 0.
  static std::size_t Absorb(Block* dst, Block* src);

  /// Strict best-fit order; every block's index_pos is its node; every block is free, of this
  /// index's pool and merged with its neighbours (no Mergeable neighbour).
  absl::Status CheckInvariants() const;
};

/// The free blocks of one pool (small or large, plain or expandable), indexed for best fit.
struct BlockPool {
  explicit BlockPool(bool small, bool expandable_pool = false, std::size_t page = 0)
      : is_small(small), expandable(expandable_pool), page_size(page) {}
  using Index = FreeBlockIndex;
  NodeFreeList free_nodes;  // declared first: destroyed after `blocks`
  Index blocks{BlockBestFitLess(), NodeRecycler<Block*>(&free_nodes)};
  const bool is_small;
  const bool expandable;  // blocks live in expandable segments
  // Free-block lookups made in this pool while garbage_collection_threshold is on (torch's
  // get_free_blocks_call_count): the clock of Block::gc_base.
  std::uint64_t free_lookups = 0;
  const std::size_t page_size;  // expandable only: bytes per physical page
  // Private pools only (core/private_pools.h): the owner's id (trace entries carry it), torch's
  // no_split (no block of the pool is split), and where its segments come from when not from
  // the backend (borrowed: the private pool holds it).
  std::pair<std::uint64_t, std::uint64_t> owner{0, 0};
  bool no_split = false;
  SegmentSource* source = nullptr;
  // A paused region's pool (docs/design/regions.md): Malloc refuses it; a free of its blocks
  // releases them at once (their pages are gone) and its figures leave the region's withdrawn
  // stats instead of the device's.
  bool paused = false;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_FREE_BLOCK_INDEX_H_
