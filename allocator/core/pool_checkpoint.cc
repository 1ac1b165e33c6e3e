// Checkpoints of a private pool (pool_checkpoint.h): a segment's checkpoint, and the checks a
// restore makes on a checkpoint before it changes anything. No state of its own.
#include "core/pool_checkpoint.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/size_policy.h"

namespace vramledger::core {

SegmentCheckpoint CheckpointOf(const Segment& segment) {
  SegmentCheckpoint out;
  out.ptr = segment.ptr;
  out.size = segment.size;
  out.stream = segment.stream;
  out.is_small = segment.pool->is_small;
  for (const Block* b = segment.head; b != nullptr; b = b->next) {
    BlockCheckpoint block;
    block.ptr = b->ptr;
    block.size = b->size;
    block.allocated = b->allocated;
    block.stream = b->stream;
    if (b->allocated) {  // a free block's fields are those of its last allocation: not kept
      block.requested_size = b->requested_size;
      block.tag = b->tag;
      block.context = b->context;
    }
    out.blocks.push_back(block);
  }
  return out;
}

absl::Status CheckLayout(const SegmentCheckpoint& checkpoint) {
  auto bad = [&](const auto&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat(absl::StrFormat("vramledger: the checkpoint of segment 0x%x (%d bytes) ",
                                     checkpoint.ptr, checkpoint.size),
                     parts...));
  };
  if (checkpoint.blocks.empty()) return bad("has no blocks");
  DevicePtr at = checkpoint.ptr;
  bool previous_free = false;
  for (const BlockCheckpoint& b : checkpoint.blocks) {
    if (b.ptr != at) {
      return bad(absl::StrFormat("has a block at 0x%x where 0x%x was expected", b.ptr, at));
    }
    if (b.size == 0 || b.size % size_policy::kMinBlockSize != 0) {
      return bad(absl::StrFormat("has a block of %d bytes at 0x%x (not a positive multiple of %d)",
                                 b.size, b.ptr, size_policy::kMinBlockSize));
    }
    if (b.stream != checkpoint.stream) {
      return bad(absl::StrFormat("has a block at 0x%x on another stream than its segment", b.ptr));
    }
    if (!b.allocated && previous_free) {
      return bad(absl::StrFormat("has neighbouring free blocks at 0x%x", b.ptr));
    }
    if (b.size > checkpoint.ptr + checkpoint.size - at) {
      return bad(absl::StrFormat("has a block at 0x%x past the segment's end", b.ptr));
    }
    previous_free = !b.allocated;
    at += b.size;
  }
  if (at != checkpoint.ptr + checkpoint.size) {
    return bad(absl::StrFormat("has blocks ending at 0x%x, short of the segment's end", at));
  }
  return absl::OkStatus();
}

absl::Status CheckSegmentMatches(const SegmentCheckpoint& checkpoint, const Segment* live,
                                 const BlockPool* small, const BlockPool* large) {
  const BlockPool* owner = checkpoint.is_small ? small : large;
  if (live == nullptr || live->pool != owner || live->size != checkpoint.size ||
      live->stream != checkpoint.stream || live->expandable) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "vramledger: the checkpoint names segment 0x%x (%d bytes), which the pool no longer has "
        "(released, or its address reused, since the checkpoint; torch: could not find 0x%x); "
        "the pool is unchanged",
        checkpoint.ptr, checkpoint.size, checkpoint.ptr));
  }
  return absl::OkStatus();
}

}  // namespace vramledger::core
