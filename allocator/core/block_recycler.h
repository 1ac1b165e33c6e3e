// Block objects of one allocator: blocks that left their segments (merged, split off, released)
// are kept and handed out again, so the hot path's splits and merges make no heap call. Not
// locked: the owner's mutex guards it.
#ifndef VRAMLEDGER_CORE_BLOCK_RECYCLER_H_
#define VRAMLEDGER_CORE_BLOCK_RECYCLER_H_

#include <cstddef>
#include <vector>

#include "core/block.h"

namespace vramledger::core {

class BlockRecycler {
 public:
  BlockRecycler() = default;
  BlockRecycler(const BlockRecycler&) = delete;
  BlockRecycler& operator=(const BlockRecycler&) = delete;
  ~BlockRecycler() {
    for (Block* b : spare_) delete b;
  }

  /// A default-state block: the one recycled last (Block::Reset keeps its stream_uses'
  /// capacity), else a new one. The caller owns it until it is recycled.
  Block* New() {
    if (spare_.empty()) return new Block();
    Block* b = spare_.back();
    spare_.pop_back();
    b->Reset();
    return b;
  }
  /// Takes back a block that is in no segment, index or map any more.
  void Recycle(Block* block) { spare_.push_back(block); }
  /// Blocks kept for reuse.
  std::size_t spare() const { return spare_.size(); }

 private:
  std::vector<Block*> spare_;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_BLOCK_RECYCLER_H_
