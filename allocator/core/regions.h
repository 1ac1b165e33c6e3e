// Pausable regions of one device (docs/design/regions.md): each region's name, its pool's id in
// the regions' id space, the private pools created inside it, the threads it is active on, and
// what a pause released and backed up. State only: the allocator (region_pause.cc) makes the
// driver calls and holds the lock.
#ifndef VRAMLEDGER_CORE_REGIONS_H_
#define VRAMLEDGER_CORE_REGIONS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/block.h"
#include "vramledger/device_allocator.h"
#include "vramledger/types.h"

namespace vramledger::core {

/// The first half of every region pool's id. torch's pool ids always have one half 0 (a graph
/// pool's {0, n}, a MemPool's {n, 0}), so {kRegionIdSpace, n} with n >= 1 never meets one.
inline constexpr std::uint64_t kRegionIdSpace = 0x5245'4749'4f4e'0000;  // "REGION\0\0"
/// The largest physical handle a region's pages get: at allocation, for the pages a block
/// covers whole, and at resume, for each run of pages that are all used or all free
/// (Regions::Regroup). The driver's cost of pause and resume is per handle (cuMemSetAccess,
/// cuMemUnmap ~14-38 us each on the H200, whatever the size up to 256 MiB), so fewer handles
/// make them fast; a handle is released only whole, so one over used pages stays until every
/// page under it is free.
inline constexpr std::size_t kRegionHandleBytes = std::size_t{256} << 20;

/// Not thread-safe: the owning allocator calls it with its lock held (docs/design/locking.md).
class Regions {
 public:
  /// A run of pages one physical handle covered when the pause released it: resume maps a new
  /// handle of the same size there.
  struct Released {
    Segment* segment = nullptr;
    std::size_t first_page = 0;
    std::size_t pages = 0;
    bool lost = false;  // pages a failed pause lost (Region::lost), not released by this pause
  };
  /// A handle a failed resume mapped and could not unmap: still mapped at `address` in
  /// `segment`, and counted in reserved bytes (it holds device memory) until released.
  struct Held {
    Segment* segment = nullptr;
    DevicePtr address = 0;
    std::size_t bytes = 0;
    PhysicalHandle handle = 0;
  };
  /// Pinned host memory (HostAllocPinned).
  struct HostBuffer {
    void* data = nullptr;
    std::size_t bytes = 0;
    bool kept = false;  // during a pause: taken from Region::kept (where a failure returns it)
  };
  /// One run of live bytes copied to `buffer` at `offset`.
  struct Backup {
    DevicePtr address = 0;
    std::size_t bytes = 0;
    std::size_t buffer = 0;  // index into Region::buffers
    std::size_t offset = 0;
  };
  /// The figures of the region's live blocks that leave the device's stats while it is paused
  /// (its pages are gone), per stat pool (kSmallPool, kLargePool).
  struct Withdrawn {
    std::array<std::int64_t, 2> allocation{};
    std::array<std::int64_t, 2> allocated_bytes{};
    std::array<std::int64_t, 2> active{};
    std::array<std::int64_t, 2> active_bytes{};
    std::array<std::int64_t, 2> requested_bytes{};
  };
  struct Region {
    std::string name;
    MempoolId id;                  // its own pool
    std::vector<MempoolId> pools;  // id, then the private pools created inside it
    bool paused = false;
    // While paused: what the pause released (and resume maps again), its bytes, the backups
    // and the pinned buffers holding them, and the withdrawn stats.
    std::vector<Released> released;
    std::size_t paused_bytes = 0;
    std::vector<HostBuffer> buffers;
    std::vector<Backup> backups;
    std::size_t backed_up_bytes = 0;
    Withdrawn withdrawn;
    // Pinned buffers a resume with keep_host_buffers kept, reused by the next pause (or freed
    // by empty_cache).
    std::vector<HostBuffer> kept;
    // While running: runs whose handle a failed pause unmapped and could not map back (booked
    // unmapped, released); the next pause adds their unmapped pages to what its resume maps.
    std::vector<Released> lost;
    // While paused: handles a failed resume could not unmap; the next resume releases them.
    std::vector<Held> held;
  };

  /// The region called `name`, created (with the next id) when `create` and it does not exist;
  /// nullptr otherwise.
  Region* Find(std::string_view name, bool create = false);
  /// The region pool `id` belongs to (its own or one created inside it), or nullptr.
  Region* OfPool(MempoolId id) const {
    const auto it = by_pool_.find(id);
    return it == by_pool_.end() ? nullptr : it->second;
  }
  /// Records private pool `id` as created inside `region`.
  void AddPool(Region* region, MempoolId id);
  /// Drops every member pool (not a region's own) for which `gone` is true: a private pool the
  /// allocator forgot (no use, no segment left). Its id may name another pool later, which
  /// belongs where that one is created.
  void ForgetPools(absl::FunctionRef<bool(MempoolId)> gone);
  /// Every region, in creation order.
  const std::vector<std::unique_ptr<Region>>& all() const { return regions_; }

  /// The runs a resume maps for `released` (a pause's runs, one per handle it released): the
  /// neighbouring runs of one segment joined, then cut where the pages change between used
  /// (Segment::use > 0) and free, and at `handle_bytes` (at least one page). A run of free
  /// pages then lies inside one free block, so empty_cache and page recycling can take its
  /// handle whole. In segment and page order.
  static std::vector<Released> Regroup(std::vector<Released> released, std::size_t handle_bytes);
  /// True when page `page` of `seg` lies in a run `region` lost (Region::lost).
  static bool IsLost(const Region& region, const Segment* seg, std::size_t page);
  /// The bytes of lost pages still unmapped, over every region: blocks may lie on them, so the
  /// active bytes may exceed the reserved (mapped) bytes by at most this much.
  std::size_t UnmappedLostBytes() const;
  /// The same, for one region.
  static std::size_t UnmappedLostBytes(const Region& region);

  /// The calling thread enters / leaves `region` (BeginRegion / EndRegion); they nest.
  void Enter(Region* region);
  /// The calling thread's innermost entry of region `name`, or NotFound naming it.
  absl::StatusOr<Region*> Inside(std::string_view name) const;
  /// NotFound when the calling thread is not inside region `name`.
  absl::Status Leave(std::string_view name);
  /// The calling thread's innermost region, or nullptr.
  Region* Current() const;

  /// Each region's pools name it back; a running region holds no released pages or backups; a
  /// paused one's backups lie inside its buffers and its released runs inside its segments.
  absl::Status CheckInvariants() const;

 private:
  std::vector<std::unique_ptr<Region>> regions_;
  absl::flat_hash_map<MempoolId, Region*> by_pool_;
  struct Entry {
    Region* region;
    std::thread::id owner;
  };
  std::vector<Entry> entered_;  // in order of entry
  std::uint64_t next_id_ = 1;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_REGIONS_H_
