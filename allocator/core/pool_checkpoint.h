// Checkpoints of one private pool for CUDA graph trees (torch.compile's "reduce-overhead"): the
// pool's segments with their blocks in address order, and the checks a restore makes on one
// before anything changes. Plain data and pure functions; the allocator's side is
// graph_checkpoints.cc (docs/design/core-parts.md, "Checkpoints of a private pool").
#ifndef VRAMLEDGER_CORE_POOL_CHECKPOINT_H_
#define VRAMLEDGER_CORE_POOL_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/block.h"
#include "core/free_block_index.h"
#include "vramledger/device_allocator.h"
#include "vramledger/types.h"

namespace vramledger::core {

/// One block as the checkpoint saw it. `requested_size`, `tag` and `context` are those of its
/// allocation (0 for a free block): a restore allocates it again with them, so the statistics and
/// the ledger's per-tag figures read as if that allocation had happened.
struct BlockCheckpoint {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  bool allocated = false;
  StreamId stream = 0;
  std::uint32_t tag = 0;
  std::uint64_t context = 0;

  bool operator==(const BlockCheckpoint&) const = default;
};

/// One segment of the pool: its range, stream, small or large pool, and its blocks, which tile it
/// in address order.
struct SegmentCheckpoint {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  bool is_small = false;
  std::vector<BlockCheckpoint> blocks;

  bool operator==(const SegmentCheckpoint&) const = default;
};

/// Every segment of private pool `pool` of device `device`, in address order. Taken when no block
/// of the pool waits on stream events (none is pending free). `incarnation` says which pool of
/// that id it was taken from (PrivatePools::Pool::incarnation): once that pool is released and
/// forgotten, a pool made again under the same id does not take the checkpoint.
struct PoolCheckpoint {
  int device = 0;
  MempoolId pool{0, 0};
  std::uint64_t incarnation = 0;
  std::vector<SegmentCheckpoint> segments;

  bool operator==(const PoolCheckpoint&) const = default;
};

/// What a restore did: the addresses of the pool's allocations it freed (address order), and the
/// checkpoint's allocated blocks, allocated again at their addresses (segment, then address
/// order) for the caller to own.
struct PoolRestore {
  std::vector<DevicePtr> freed;
  std::vector<BlockCheckpoint> allocated;
};

/// The checkpoint of segment `segment` (a plain segment: every block is allocated or free, none
/// pending, which the caller ensures).
SegmentCheckpoint CheckpointOf(const Segment& segment);

/// OK when `segment` can be laid out as `checkpoint`: its blocks are not empty, each is a
/// positive multiple of 512 bytes on the segment's stream, they tile [ptr, ptr + size) in address
/// order, and no two free blocks are neighbours (a restored pool's free blocks are merged, as any
/// other). InvalidArgument naming what is wrong otherwise.
absl::Status CheckLayout(const SegmentCheckpoint& checkpoint);

/// OK when live segment `live` (nullptr: none at that address) is the one `checkpoint` names: the
/// same address, size and stream, plain, and owned by `small` or `large` as the checkpoint says.
/// FailedPrecondition naming the segment otherwise: the checkpoint is stale (the segment was
/// released since, or its address reused by another pool). A segment released and allocated
/// again with the same range, stream and pool passes: the checkpoint's layout is valid there.
absl::Status CheckSegmentMatches(const SegmentCheckpoint& checkpoint, const Segment* live,
                                 const BlockPool* small, const BlockPool* large);

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_POOL_CHECKPOINT_H_
