// Device statistics with torch.cuda.memory_stats()'s keys and meanings (docs/design/torch-facts.md
// §7). Plain values; the allocator updates them under its own lock and hands out copies.
#ifndef VRAMLEDGER_STATS_H_
#define VRAMLEDGER_STATS_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace vramledger {

/// One counter as torch keeps it: current value, peak since reset, total added, total removed.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void Increase(std::int64_t amount) {
    current += amount;
    peak = std::max(peak, current);
    allocated += amount;
  }
  void Decrease(std::int64_t amount) {
    current -= amount;
    freed += amount;
  }
  void ResetPeak() { peak = current; }
  void ResetAccumulated() { allocated = freed = 0; }
};

/// Index into a StatArray: "all", "small_pool", "large_pool" as in torch's key names.
enum StatType : int { kAggregate = 0, kSmallPool = 1, kLargePool = 2, kNumStatTypes = 3 };
using StatArray = std::array<Stat, kNumStatTypes>;

/// Everything memory_stats() reports for one device. Bytes are bytes; counts are counts.
struct DeviceStats {
  StatArray allocation;            // live allocations (blocks handed out)
  StatArray segment;               // cudaMalloc'd segments (0 with expandable segments, as torch)
  StatArray active;                // allocated + waiting for events
  StatArray inactive_split;        // free pieces of split segments
  StatArray allocated_bytes;       // rounded sizes of live blocks
  StatArray reserved_bytes;        // segment bytes, or mapped bytes for expandable segments
  StatArray active_bytes;          // allocated + pending-free bytes
  StatArray inactive_split_bytes;  // "Non-releasable memory"
  StatArray requested_bytes;       // original request sizes of live blocks
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  Stat oversize_allocations;
  Stat oversize_segments;
  /// -1 means unlimited, as torch reports it.
  std::int64_t max_split_size = -1;
  /// vramledger: size of the largest cached free block (bytes), current.
  std::int64_t largest_free_block_bytes = 0;

  /// Peak allocated / peak reserved (0 when nothing was reserved).
  double utilization() const {
    const auto r = reserved_bytes[kAggregate].peak;
    return r > 0 ? static_cast<double>(allocated_bytes[kAggregate].peak) / static_cast<double>(r)
                 : 0.0;
  }
};

/// Flattens to torch's dotted keys ("allocated_bytes.all.current", "num_ooms", ...) plus
/// "largest_free_block_bytes". Sorted by key, as torch.cuda.memory_stats() returns them.
/// `utilization` is a float and is not in this map; callers add DeviceStats::utilization().
std::map<std::string, std::int64_t> FlattenStats(const DeviceStats& stats);

}  // namespace vramledger

#endif  // VRAMLEDGER_STATS_H_
