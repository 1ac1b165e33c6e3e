// The caching allocator of one device: torch's size policy, best fit with split and coalesce,
// per-stream reuse, record_stream events, empty_cache and the out-of-memory path.
// Thread-safety: every public method may be called from any thread (one mutex per device).
#ifndef VRAMLEDGER_DEVICE_ALLOCATOR_H_
#define VRAMLEDGER_DEVICE_ALLOCATOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "vramledger/device_backend.h"
#include "vramledger/hooks.h"
#include "vramledger/options.h"
#include "vramledger/stats.h"
#include "vramledger/types.h"

namespace vramledger {

/// The numbers of an out-of-memory failure, the same ones torch's message carries
/// (its CUDACachingAllocator's out-of-memory text). All sizes in bytes.
struct OutOfMemoryInfo {
  int device = 0;
  StreamId stream = 0;
  std::size_t requested = 0;   // what the caller asked for
  std::size_t alloc_size = 0;  // the segment size that could not be obtained ("Tried to allocate")
  std::size_t device_total = 0;  // cudaMemGetInfo total
  std::size_t device_free = 0;   // cudaMemGetInfo free
  std::size_t allowed = 0;       // memory-fraction cap on reserved (bytes); 0 when none is set
  std::size_t allocated = 0;     // allocated_bytes.all.current
  std::size_t reserved = 0;      // reserved_bytes.all.current
  std::size_t largest_free_block = 0;
  std::int64_t holes = 0;  // free blocks inside segments
  /// The full message, in torch's shape.
  std::string message;
};

/// One block of a segment as a snapshot shows it.
struct BlockInfo {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;  // 0 for inactive blocks
  /// "active_allocated", "active_pending_free" or "inactive" (torch's exact strings).
  const char* state = "inactive";
  std::size_t handles = 1;    // physical handles mapped under the block; 1 for plain segments
  std::uint32_t tag = 0;      // AllocatorHooks::CurrentTag at allocation (0 for inactive)
  std::uint64_t context = 0;  // AllocatorHooks::CaptureContext at allocation (0 for inactive)
};

/// A CUDA graph private pool's id: torch's MempoolId_t (`std::pair<CaptureId_t, CaptureId_t>`);
/// {0, 0} is the device's default pools.
using MempoolId = std::pair<std::uint64_t, std::uint64_t>;

/// One segment (a cudaMalloc'd range, or a mapped range of an expandable segment).
struct SegmentInfo {
  int device = 0;
  DevicePtr address = 0;
  std::size_t total_size = 0;
  std::size_t allocated_size = 0;
  std::size_t active_size = 0;
  std::size_t requested_size = 0;
  StreamId stream = 0;
  bool is_small = false;  // segment_type "small" / "large"
  bool is_expandable = false;
  MempoolId pool_id = {0, 0};  // the private pool that owns it (torch's segment_pool_id)
  std::size_t handles = 1;     // physical handles backing it (expandable: one per page, or
                               // per expandable_handle_mb of a run)
  // A paused region's range (docs/design/regions.md): its pages were released by the pause and
  // come back at resume; total_size is what the pause released, handles is 0, and its blocks
  // are the live and free blocks that will be there again.
  bool paused = false;
  std::vector<BlockInfo> blocks;  // in address order
};

/// What torch's shareIpcHandle returns (its ShareableHandle): the handle bytes another process
/// opens (torch's format, docs/design/ipc.md) and the block's offset into what they name.
struct IpcShare {
  std::ptrdiff_t offset = 0;
  std::string handle;
};

/// Fragmentation figures of one device (all sizes in bytes).
struct Fragmentation {
  double utilization = 0;                 // peak allocated / peak reserved
  std::int64_t wasted_bytes = 0;          // reserved - allocated, now
  std::int64_t wasted_bytes_at_peak = 0;  // peak reserved - peak allocated
  std::int64_t free_bytes = 0;            // reserved - active: cached, reusable
  std::int64_t largest_free_block = 0;    // largest request servable without growing
  double free_space_fragmentation = 0;    // 1 - largest_free_block / free_bytes (0 if none free)
  std::int64_t holes = 0;                 // free blocks between live blocks
  std::int64_t mapped_free_pages = 0;     // pages of the handles wholly inside free blocks (exp.)
  std::int64_t other_stream_cached_bytes = 0;  // free bytes cached for streams != `stream`
  std::int64_t page_moves = 0;                 // pages recycled (unmapped here, mapped there)
  // Bytes of moved handles still mapped at the address they left: until work queued there before
  // the move has finished (page-recycling.md, "Moves without a stall"), and with
  // keep_old_mappings until that address is needed or empty_cache ("Old mappings kept"); not
  // reserved twice.
  std::int64_t retiring_bytes = 0;
  // Page moves that took a handle back to an address where it was still mapped (no driver call;
  // keep_old_mappings); included in page_moves.
  std::int64_t reused_old_mappings = 0;
};

/// Allocations made on this thread while one of these is alive come from plain, single-handle
/// segments even with expandable segments on (buffers registered for RDMA or shared with NCCL).
/// Nests; thread-local.
class ContiguousSegmentsScope {
 public:
  ContiguousSegmentsScope();
  ~ContiguousSegmentsScope();
  ContiguousSegmentsScope(const ContiguousSegmentsScope&) = delete;
  ContiguousSegmentsScope& operator=(const ContiguousSegmentsScope&) = delete;
  /// True while the calling thread is inside a scope.
  static bool active();

  // Depth API, for callers whose enter and leave are separate calls and cannot hold a C++ object
  // across them (the C ABI behind Python's `with vramledger.contiguous_segments():`). It counts
  // on the same per-thread depth as the constructor and destructor, so both forms nest together.

  /// Opens one scope on the calling thread (what the constructor does).
  static void Enter();
  /// Closes the innermost scope opened on the calling thread. FailedPrecondition, with the depth
  /// left at 0, when no scope is open on this thread (a leave without an enter).
  static absl::Status Exit();
  /// Number of scopes open on the calling thread (0 outside any).
  static int depth();
};

/// Host time spent inside Malloc and Free since construction, with `host_timing:True` (zeros
/// otherwise), measured around each call with std::chrono::steady_clock: lock wait, bookkeeping
/// and any driver call made inside. What the allocator itself costs a host-bound step; its
/// callers' glue (the plugin's entry points, torch's pluggable-allocator wrapper) is outside, and
/// with several threads the summed waits can exceed wall time
/// (docs/design/step-time-measurement.md, "Time inside the allocator").
struct HostTime {
  std::int64_t malloc_calls = 0;
  std::int64_t malloc_ns = 0;  // nanoseconds
  std::int64_t free_calls = 0;
  std::int64_t free_ns = 0;  // nanoseconds
};

/// Pausable regions (docs/design/regions.md). What a pause keeps of a region's live blocks.
enum class RegionBackup {
  kNone,  // nothing: the contents of its blocks are undefined after resume
  kCpu,   // copied to pinned host memory before the pages go, copied back by resume
};
/// What PauseRegion did (bytes).
struct RegionPauseResult {
  std::size_t released_bytes = 0;   // physical bytes unmapped and released
  std::size_t backed_up_bytes = 0;  // live bytes copied to pinned host memory (kCpu)
  bool already_paused = false;      // the region was paused: nothing was done
  // Where the time went (wall-clock seconds, steady clock): waiting for the region's streams
  // and events, the backup's copies (pinning included), unmapping and releasing `handles`
  // physical handles with the books.
  std::size_t handles = 0;
  double wait_seconds = 0;
  double copy_seconds = 0;
  double driver_seconds = 0;
};
/// What ResumeRegion did (bytes).
struct RegionResumeResult {
  std::size_t mapped_bytes = 0;    // physical bytes created and mapped at the old addresses
  std::size_t restored_bytes = 0;  // bytes copied back from the backups
  bool already_running = false;    // the region was not paused: nothing was done
  // Where the time went (wall-clock seconds): creating and mapping `handles` physical handles
  // and granting access, then copying the backups back.
  std::size_t handles = 0;
  double driver_seconds = 0;
  double copy_seconds = 0;
};
/// One region as Regions() reports it (bytes).
struct RegionInfo {
  std::string name;
  MempoolId pool;  // its own pool (in the regions' id space)
  bool paused = false;
  std::size_t reserved_bytes = 0;  // virtual bytes of its segments
  // Physical bytes held now; when paused, only handles a failed resume could not unmap.
  std::size_t mapped_bytes = 0;
  std::size_t allocated_bytes = 0;    // live blocks (allocated, not yet freed)
  std::size_t paused_bytes = 0;       // physical bytes released by the pause (0 when running)
  std::size_t backed_up_bytes = 0;    // bytes held in pinned host buffers as backups
  std::size_t host_buffer_bytes = 0;  // pinned bytes kept (keep_host_buffers) for the next pause
  // Pages a failed pause could neither keep nor map again (its error said their contents are
  // lost): unmapped under live blocks, so not in mapped_bytes nor in the snapshot's segments,
  // until the next pause and resume map them. 0 except after such a double driver failure.
  std::size_t lost_bytes = 0;
  std::vector<MempoolId> pools;  // its own pool, then the private pools created inside it
};

class DeviceAllocatorImpl;
namespace core {
struct CoreView;
struct PoolCheckpoint;  // core/pool_checkpoint.h
struct PoolRestore;     // core/pool_checkpoint.h
}  // namespace core

/// Decides whether an allocation on a stream goes to a private pool (torch's filter callback).
using StreamFilter = std::function<bool(StreamId)>;

/// Where a private pool's segments come from instead of the device backend (torch: a MemPool
/// created with a CUDAPluggableAllocator takes its segments from that allocator). Called under
/// the device lock: it must not call the allocator.
class SegmentSource {
 public:
  virtual ~SegmentSource() = default;
  /// `size` bytes for `stream`. ResourceExhausted when it has no memory (the allocation then
  /// takes the out-of-memory path); any other error fails the allocation with it.
  virtual absl::StatusOr<DevicePtr> Allocate(std::size_t size, StreamId stream) = 0;
  /// Returns a pointer Allocate gave.
  virtual absl::Status Free(DevicePtr ptr) = 0;
};

/// The caching allocator of one device. Construct one per device from options and a backend;
/// the backend must outlive it.
class DeviceAllocator {
 public:
  /// `backend` is borrowed. Options are taken as parsed (see ParseOptions).
  DeviceAllocator(const Options& options, DeviceBackend* backend);
  /// Returns every segment to the backend. Live blocks at destruction are leaked (their memory
  /// is still freed), so destroy only when the device is done.
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  /// Allocates `size` bytes for use on `stream`. Size 0 returns 0 (a null pointer), as torch's
  /// native allocator does; any size > 0 returns a non-null address or an error:
  /// ResourceExhausted with torch's out-of-memory message (details in last_oom()), or the
  /// backend's error for other driver failures.
  absl::StatusOr<DevicePtr> Malloc(std::size_t size, StreamId stream);

  /// Frees an address returned by Malloc. Free(0) is a no-op. NotFound for an unknown address.
  /// If the block was used on other streams (RecordStream), its memory is reused only after
  /// events recorded now on those streams complete.
  absl::Status Free(DevicePtr ptr);

  /// Marks the live block at `ptr` as used on `stream` (torch's Tensor.record_stream).
  /// NotFound for an unknown address.
  absl::Status RecordStream(DevicePtr ptr, StreamId stream);

  /// Waits for pending events and returns every fully free segment to the driver.
  absl::Status EmptyCache();

  /// Caps reserved bytes at `fraction` x device total (torch's set_per_process_memory_fraction:
  /// a segment that would take reserved past the cap fails as if the device were full).
  /// InvalidArgument outside [0, 1].
  absl::Status SetMemoryFraction(double fraction);

  /// A copy of the statistics (torch's memory_stats keys).
  DeviceStats GetStats() const;
  void ResetPeakStats();
  void ResetAccumulatedStats();

  /// Calls `reader` with a read-only view of the allocator's state, under its lock (the reader
  /// must not call the allocator). The ledger's reports read it: the segments in torch's
  /// snapshot shape (SegmentsOf) and the fragmentation figures (FragmentationOf), in
  /// ledger/device_report.h.
  void Read(absl::FunctionRef<void(const core::CoreView&)> reader) const;

  /// The numbers of the most recent out-of-memory failure.
  OutOfMemoryInfo last_oom() const;

  /// Calls to Malloc and Free and the host time spent in them, with `host_timing:True` (zeros
  /// otherwise; cumulative, not reset by ResetAccumulatedStats, like the driver-call ledger).
  HostTime host_time() const;

  /// Checks every internal invariant (block chains, free index, stats identities).
  /// Internal error naming the first broken invariant. O(blocks); for tests and fuzzers.
  absl::Status CheckInvariants() const;

  // ---- CUDA graph private pools (torch's graph pool API; core/graph_pools.cc) ----

  /// From now on, allocations on streams for which `filter` is true (called under the device
  /// lock; it must not call the allocator) come from private pool `pool`, created on first use or
  /// shared (use count + 1) if it exists. While such a pool is active and a stream it served is
  /// capturing (or it has served none yet), no event is queried or recorded, nothing is freed or
  /// unmapped, and frees of record_stream'ed blocks are deferred.
  /// InvalidArgument if `pool` is already active (being allocated to).
  absl::Status BeginAllocateToPool(MempoolId pool, StreamFilter filter);
  /// Stops routing to `pool` (torch's capture_end); its memory stays reserved for it.
  /// NotFound if `pool` is not active.
  absl::Status EndAllocateToPool(MempoolId pool);
  /// Drops one use of `pool` (torch's graph reset). At zero uses its memory returns to the
  /// driver once its blocks are free: whole free segments at once, the rest at the next
  /// EmptyCache or out-of-memory retry. NotFound for an unknown pool; FailedPrecondition for the
  /// use an allocation to the pool still under way holds (BeginAllocateToPool without its End).
  absl::Status ReleasePool(MempoolId pool);
  /// Use count of `pool`, 0 if it does not exist (any more).
  int PoolUseCount(MempoolId pool) const;

  // ---- Checkpoints of a private pool, for CUDA graph trees (core/pool_checkpoint.h,
  //      core/graph_checkpoints.cc) ----

  /// The state of private pool `pool`: each of its segments with its blocks in address order.
  /// Blocks of the pool still waiting on record_stream events are waited for first (a checkpoint
  /// holds allocated and free blocks only). NotFound for an unknown pool; FailedPrecondition for
  /// a released one, or when blocks of the pool wait on events while a capture is under way.
  absl::StatusOr<core::PoolCheckpoint> CheckpointPool(MempoolId pool);
  /// Sets private pool `pool` to `checkpoint`: every allocated block of the pool is freed (its
  /// address in PoolRestore::freed), each segment of the checkpoint is split again at its
  /// blocks' addresses and sizes, and the checkpoint's allocated blocks are allocated again
  /// (PoolRestore::allocated: the caller owns them), with their requested sizes, tags and
  /// contexts; segments of the pool the checkpoint does not name end free. Checked before
  /// anything changes: InvalidArgument for a checkpoint of another pool or device, or one whose
  /// blocks do not tile their segments; FailedPrecondition for a stale one (a segment it names is
  /// no longer the pool's, or the pool it was taken from was released and forgotten since and
  /// the id made again) or a released pool; NotFound for an unknown pool.
  absl::StatusOr<core::PoolRestore> RestorePool(MempoolId pool,
                                                const core::PoolCheckpoint& checkpoint);
  /// True when the allocated blocks of private pool `pool` are exactly the addresses in `live`
  /// (torch's checkPoolLiveAllocations; duplicates count once). NotFound for an unknown pool.
  absl::StatusOr<bool> CheckPoolLiveAllocations(MempoolId pool,
                                                const std::vector<DevicePtr>& live) const;

  // ---- torch.cuda.MemPool (core/mem_pools.cc): the same private pools, made and set apart
  //      from a capture ----

  /// Creates private pool `pool` with one use, or adds a use to it (torch's createOrIncrefPool).
  /// With `source`, the new pool's segments come from it and go back to it, not the backend.
  /// InvalidArgument for the default pool {0, 0}, or a source given for a pool that exists.
  absl::Status CreateOrIncrefPool(MempoolId pool, std::shared_ptr<SegmentSource> source = nullptr);
  /// When a default-pool allocation cannot be served, the free blocks of the pools set so are
  /// tried before the out-of-memory error (torch's use_on_oom; no new segment is made for it).
  /// NotFound for an unknown pool.
  absl::Status SetUseOnOOM(MempoolId pool, bool use_on_oom);
  /// No block of `pool` is split from now on (torch's no_split). NotFound for an unknown pool.
  absl::Status SetNoSplit(MempoolId pool);
  /// EmptyCache() for {0, 0}. For a private pool, as torch's emptyCache(mempool_id): once it has
  /// no use left, its whole free segments are returned and it is forgotten when none is left;
  /// other pools, and a pool still in use or unknown, are left as they are.
  absl::Status EmptyCache(MempoolId pool);

  // ---- CUDA IPC (core/ipc.cc, core/ipc_imports.h; docs/design/ipc.md) ----

  /// torch's shareIpcHandle of the live block that starts at `ptr`: a plain segment's
  /// cudaIpcMemHandle_t and the block's offset from the segment's base; for an expandable
  /// segment, POSIX descriptors of the physical handles under the block's pages (exported once
  /// per handle, open until the handle is released) and its offset from the first. The pages
  /// stay where they are while the block lives (a block's pages are never recycled or
  /// unmapped), which torch's IPC reference count makes last until every receiver let go.
  /// FailedPrecondition for a freed block (also one waiting for its streams) or pages of
  /// unequal handles (expandable_handle_mb), NotFound for an address the allocator never gave,
  /// InvalidArgument inside a block; the backend's error if the export fails.
  absl::StatusOr<IpcShare> ShareIpcHandle(DevicePtr ptr);
  /// torch's getIpcDevPtr: opens what another process shared (IpcShare::handle, or torch's own
  /// bytes) on this device, once per handle, closed when the last reference goes. The memory is
  /// not the allocator's: it never serves an allocation. Errors: a malformed handle
  /// (InvalidArgument naming what is wrong), the backend's. A reference must not outlive the
  /// allocator (after it the memory is closed).
  absl::StatusOr<std::shared_ptr<void>> OpenIpcHandle(std::string_view handle);
  /// Handles opened by OpenIpcHandle and still referenced.
  std::size_t open_ipc_handles() const;
  /// torch's getBaseAllocation: {base, size} of the plain segment holding the live block that
  /// starts at `ptr`. FailedPrecondition for expandable memory (no single allocation backs it:
  /// share it with ShareIpcHandle); the errors of ShareIpcHandle for other addresses.
  absl::StatusOr<std::pair<DevicePtr, std::size_t>> BaseAllocation(DevicePtr ptr) const;

  // ---- Pausable regions (core/regions.h, core/region_pause.cc; docs/design/regions.md) ----

  /// Creates region `name` on first use (its pool gets an id of the regions' id space,
  /// {kRegionIdSpace, n}), then routes the calling thread's allocations on streams `filter`
  /// accepts to the region's pool until EndRegion; private pools created meanwhile on this
  /// thread (CreateOrIncrefPool, a capture's BeginAllocateToPool) belong to the region, are
  /// expandable, and are paused with it. A private pool being allocated to takes precedence
  /// over the region for the streams it accepts. Nests. InvalidArgument for an empty name.
  absl::StatusOr<MempoolId> BeginRegion(std::string_view name, StreamFilter filter);
  /// Ends the calling thread's innermost BeginRegion of `name`. NotFound when there is none.
  absl::Status EndRegion(std::string_view name);
  /// Waits for the work queued on the region's memory (its streams, record_stream uses, pending
  /// frees), copies its live blocks to pinned host memory for kCpu, then unmaps and releases
  /// every physical page of its segments, keeping their virtual addresses. A paused region:
  /// already_paused, nothing done. NotFound for an unknown region; FailedPrecondition during a
  /// capture; a failed pinned allocation (ResourceExhausted), copy or unmap leaves the region as
  /// it was.
  absl::StatusOr<RegionPauseResult> PauseRegion(std::string_view name, RegionBackup backup);
  /// Maps new pages where the pause released them (asking AllocatorHooks::CheckGrowth first),
  /// copies the backups back and frees their pinned memory (kept for the next pause with
  /// `keep_host_buffers`). A running region: already_running, nothing done. NotFound for an
  /// unknown region; FailedPrecondition during a capture; ResourceExhausted when the device or
  /// the guard refuses the memory; on any failure what it mapped is released and the region
  /// stays paused with its backups.
  absl::StatusOr<RegionResumeResult> ResumeRegion(std::string_view name, bool keep_host_buffers);
  /// Every region, in creation order.
  std::vector<RegionInfo> Regions() const;

  /// Installs `hooks` (borrowed; nullptr removes them). They must outlive their installation.
  /// Safe to call at any time; an allocation in flight sees either the old or the new hooks.
  void SetHooks(AllocatorHooks* hooks);

  const Options& options() const;
  DeviceBackend* backend() const;

 private:
  std::unique_ptr<DeviceAllocatorImpl> impl_;
  const bool host_timing_;  // Options::host_timing
  // HostTime's figures; relaxed atomics, so reading them takes no lock.
  std::atomic<std::int64_t> malloc_calls_{0};
  std::atomic<std::int64_t> malloc_ns_{0};
  std::atomic<std::int64_t> free_calls_{0};
  std::atomic<std::int64_t> free_ns_{0};
};

/// Formats a byte count as torch's format_size does: "N bytes" below 1 KiB, else "x.xx
/// KiB/MiB/GiB".
std::string FormatSize(std::uint64_t bytes);

}  // namespace vramledger

#endif  // VRAMLEDGER_DEVICE_ALLOCATOR_H_
