// A read-only view of one device's allocator, for reports built outside the core (the ledger's
// snapshot and fragmentation figures): given by DeviceAllocator::Read under the allocator's lock.
#ifndef VRAMLEDGER_CORE_CORE_VIEW_H_
#define VRAMLEDGER_CORE_CORE_VIEW_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "core/block.h"
#include "core/free_block_index.h"
#include "core/old_mappings.h"
#include "core/page_table.h"
#include "core/placement.h"
#include "core/pool_stats.h"
#include "core/regions.h"
#include "vramledger/device_allocator.h"
#include "vramledger/types.h"

namespace vramledger::core {

/// Valid only inside the reader passed to DeviceAllocator::Read (the lock is held meanwhile).
struct CoreView {
  int device = 0;
  const CoreStats* stats = nullptr;
  /// Plain (cudaMalloc'd) segments by address.
  const absl::btree_map<DevicePtr, std::unique_ptr<Segment>>* plain_segments = nullptr;
  /// The pools of CUDA graph private pools, with their pool's id (they own plain segments only).
  std::vector<std::pair<const BlockPool*, MempoolId>> private_pools;
  /// The device's own free indices: small, large, expandable small, expandable large.
  std::array<const BlockPool*, 4> pools{};
  /// Expandable segments: their page tables, old mappings and placement (FreeMappedPages).
  const PageTable* page_table = nullptr;
  const OldMappings* old_mappings = nullptr;
  const Placement* placement = nullptr;
  /// Pausable regions: what each paused one released (Regions::Region::released).
  const Regions* regions = nullptr;
};

/// The largest request the free blocks of `pools` can serve without growing: a plain free block's
/// size, an expandable one's longest mapped run (Placement::MappedRun). The core reports it in
/// its stats and out-of-memory message; the ledger in its fragmentation figures.
std::size_t LargestFreeBlock(const std::array<const BlockPool*, 4>& pools);
/// Free blocks with live neighbours, inside a segment that also holds live blocks (for
/// expandable segments: not the free tail after the last live block).
std::int64_t CountHoles(const std::array<const BlockPool*, 4>& pools);

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_CORE_VIEW_H_
