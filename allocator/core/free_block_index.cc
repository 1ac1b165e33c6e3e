// Splitting and merging blocks of one pool's free index, and its invariants check
// (free_block_index.h). Not locked: its owner's mutex guards it.
#include "core/free_block_index.h"

#include "absl/strings/str_cat.h"

namespace vramledger::core {

Block* FreeBlockIndex::SplitFront(Block* block, std::size_t size, Block* front, bool indexed) {
  front->ptr = block->ptr;
  front->size = size;
  front->stream = block->stream;
  front->pool = block->pool;
  front->segment = block->segment;
  front->prev = block->prev;
  if (front->prev != nullptr) front->prev->next = front;
  front->next = block;
  block->prev = front;
  block->ptr += size;
  block->size -= size;
  if (front->prev == nullptr) front->segment->head = front;
  if (indexed) {
    RepositionShrunk(Position(block));  // the remainder keeps the indexed node
  } else {
    insert(block);
  }
  return front;
}

FreeBlockIndex::Merged FreeBlockIndex::Merge(Block* block) {
  Merged out;
  Block* prev = Mergeable(block->prev) ? block->prev : nullptr;
  Block* next = Mergeable(block->next) ? block->next : nullptr;
  if (prev == nullptr && next == nullptr) {
    block->requested_size = 0;
    insert(block);
    out.block = block;
    return out;
  }
  // Merge into a free neighbour that is already indexed, changing its key in place.
  Block* keep = prev != nullptr ? prev : next;
  const iterator it = Position(keep);  // its node: no search
  if (prev != nullptr && next != nullptr) erase(Position(next));
  for (const Block* absorbed : {prev, next}) {
    if (absorbed == nullptr) continue;
    ++out.neighbours;
    out.neighbour_bytes += static_cast<std::int64_t>(absorbed->size);
  }
  if (prev != nullptr) {
    prev->size += block->size;
    prev->next = block->next;
    if (prev->next != nullptr) prev->next->prev = prev;
    out.gone[out.num_gone++] = block;
    if (next != nullptr) {
      prev->size += next->size;
      prev->next = next->next;
      if (prev->next != nullptr) prev->next->prev = prev;
      out.gone[out.num_gone++] = next;
    }
  } else {
    next->ptr = block->ptr;
    next->size += block->size;
    next->prev = block->prev;
    if (next->prev != nullptr) {
      next->prev->next = next;
    } else {
      next->segment->head = next;
    }
    out.gone[out.num_gone++] = block;
  }
  RepositionGrown(it);
  out.block = keep;
  return out;
}

std::size_t FreeBlockIndex::Absorb(Block* dst, Block* src) {
  if (!Mergeable(src)) return 0;
  if (dst->prev == src) {
    dst->ptr = src->ptr;
    dst->prev = src->prev;
    if (dst->prev != nullptr) {
      dst->prev->next = dst;
    } else {
      dst->segment->head = dst;
    }
  } else {
    dst->next = src->next;
    if (dst->next != nullptr) dst->next->prev = dst;
  }
  const std::size_t subsumed = src->size;
  dst->size += subsumed;
  dst->pool->blocks.erase(src);
  return subsumed;
}

absl::Status FreeBlockIndex::CheckInvariants() const {
  auto fail = [](const Block* b, auto&&... parts) {
    return absl::InternalError(
        absl::StrCat("free index, block 0x", absl::Hex(b->ptr), ": ", parts...));
  };
  const BlockBestFitLess less;
  for (auto it = begin(); it != end(); ++it) {
    const Block* b = *it;
    if (b->index_pos != it) return fail(b, "index_pos is not its node");
    if (std::next(it) != end() && !less(b, *std::next(it))) return fail(b, "out of order");
    if (b->pool == nullptr || &b->pool->blocks != this) return fail(b, "of another pool");
    if (!b->is_free()) return fail(b, "not free");
    if (Mergeable(b->prev) || Mergeable(b->next)) return fail(b, "not merged with a neighbour");
  }
  return absl::OkStatus();
}

}  // namespace vramledger::core
