// One device's caching allocator, composed of unlocked parts (free-block indexes, stream events,
// private pools, stats, ...) that its one mutex `mu_` guards (docs/design/locking.md).
#ifndef VRAMLEDGER_CORE_DEVICE_ALLOCATOR_IMPL_H_
#define VRAMLEDGER_CORE_DEVICE_ALLOCATOR_IMPL_H_

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/block.h"
#include "core/block_recycler.h"
#include "core/core_view.h"
#include "core/device_mutex.h"
#include "core/event_pool.h"
#include "core/free_block_index.h"
#include "core/ipc_imports.h"
#include "core/live_block_map.h"
#include "core/old_mappings.h"
#include "core/page_table.h"
#include "core/placement.h"
#include "core/pool_checkpoint.h"
#include "core/pool_stats.h"
#include "core/private_pools.h"
#include "core/regions.h"
#include "core/stream_events.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"

namespace vramledger {

class DeviceAllocatorImpl {
 public:
  DeviceAllocatorImpl(const Options& options, DeviceBackend* backend);
  ~DeviceAllocatorImpl();

  absl::StatusOr<DevicePtr> Malloc(std::size_t size, StreamId stream) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Free(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RecordStream(DevicePtr ptr, StreamId stream) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status EmptyCache() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetMemoryFraction(double fraction) ABSL_LOCKS_EXCLUDED(mu_);
  DeviceStats GetStats() const ABSL_LOCKS_EXCLUDED(mu_);
  void ResetPeakStats() ABSL_LOCKS_EXCLUDED(mu_);
  void ResetAccumulatedStats() ABSL_LOCKS_EXCLUDED(mu_);
  // Calls `reader` with a view of the core, under the lock (core/core_view.h).
  void Read(absl::FunctionRef<void(const core::CoreView&)> reader) const ABSL_LOCKS_EXCLUDED(mu_);
  OutOfMemoryInfo last_oom() const ABSL_LOCKS_EXCLUDED(mu_);
  // The parts' own invariants (CheckParts, device_allocator_checks.cc), then the checks across
  // them: segments against blocks, the free indexes, the live map and the stats.
  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckSegmentChain(const core::Segment& segment, std::int64_t* counts) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status BeginAllocateToPool(MempoolId id, StreamFilter filter) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status EndAllocateToPool(MempoolId id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReleasePool(MempoolId id) ABSL_LOCKS_EXCLUDED(mu_);
  int PoolUseCount(MempoolId id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Checkpoints of a private pool (core/pool_checkpoint.h; graph_checkpoints.cc).
  absl::StatusOr<core::PoolCheckpoint> CheckpointPool(MempoolId id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<core::PoolRestore> RestorePool(MempoolId id,
                                                const core::PoolCheckpoint& checkpoint)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<bool> CheckPoolLiveAllocations(MempoolId id,
                                                const std::vector<DevicePtr>& live) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // torch.cuda.MemPool's calls on the private pools (core/mem_pools.cc).
  absl::Status CreateOrIncrefPool(MempoolId id, std::shared_ptr<SegmentSource> source)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetUseOnOOM(MempoolId id, bool use_on_oom) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetNoSplit(MempoolId id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status EmptyCache(MempoolId id) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Pausable regions (region_scope.cc, region_pause.cc; docs/design/regions.md) ----
  absl::StatusOr<MempoolId> BeginRegion(std::string_view name, StreamFilter filter)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status EndRegion(std::string_view name) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<RegionPauseResult> PauseRegion(std::string_view name, RegionBackup backup)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<RegionResumeResult> ResumeRegion(std::string_view name, bool keep_host_buffers)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<RegionInfo> Regions() const ABSL_LOCKS_EXCLUDED(mu_);

  // ---- CUDA IPC (ipc.cc): the sender's exports; the receiver's imports are ipc_imports_ ----
  absl::StatusOr<IpcShare> ShareIpcHandle(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::pair<DevicePtr, std::size_t>> BaseAllocation(DevicePtr ptr) const
      ABSL_LOCKS_EXCLUDED(mu_);
  core::IpcImports& ipc_imports() { return ipc_imports_; }

  void SetHooks(AllocatorHooks* hooks) { hooks_.store(hooks, std::memory_order_release); }
  const Options& options() const { return options_; }
  DeviceBackend* backend() const { return backend_; }

 private:
  // The two figures hooks are shown (vramledger/hooks.h HookStats), without building DeviceStats.
  HookStats HookView() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return {stats_.allocated_bytes.current(kAggregate), stats_.reserved_bytes.current(kAggregate)};
  }

  // The parts' invariants: free indexes, private pools, stream events, stats.
  absl::Status CheckParts() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The result of public operation `operation`; with VRAMLEDGER_EXPENSIVE_CHECKS, CheckInvariants
  // runs first and an invariant it finds broken is returned instead (an Internal error).
#ifdef VRAMLEDGER_EXPENSIVE_CHECKS
  static constexpr bool kExpensiveChecks = true;
#else
  static constexpr bool kExpensiveChecks = false;
#endif
  absl::Status CheckAfter(const char* operation, absl::Status result) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AfterOperation(const char* operation, absl::Status result) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    if constexpr (kExpensiveChecks) return CheckAfter(operation, std::move(result));
    return result;
  }
  template <typename T>
  absl::StatusOr<T> AfterOperation(const char* operation, absl::StatusOr<T> result) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    if constexpr (kExpensiveChecks) {
      absl::Status s = CheckAfter(operation, result.status());
      if (!s.ok()) return s;
    }
    return result;
  }

  // The per-pool stat index of a pool: kSmallPool or kLargePool ("all" is derived from both).
  static StatType StatTypesFor(const core::BlockPool* pool) {
    return pool->is_small ? kSmallPool : kLargePool;
  }

  core::BlockPool* PoolFor(std::size_t rounded_size, bool contiguous) {
    const bool small = rounded_size <= 1 * kMiB;
    // Expandable: only requests up to 512 KiB take the small pool's 2 MiB pages; the rest (torch's
    // 1 MiB blocks among them) share the large pool's pages, whose partly used edges they fill
    // (expandable-segments.md, "Placement").
    if (options_.expandable_segments && !contiguous)
      return rounded_size <= kExpandableSmallMax ? &exp_small_pool_ : &exp_large_pool_;
    return small ? &small_pool_ : &large_pool_;
  }
  static constexpr std::size_t kExpandableSmallMax = 512 * 1024;

  // ---- Private pools (core/private_pools.h; the allocator's side: graph_pools.cc) ----
  // True while a capture may be under way (PrivatePools::CaptureUnderway).
  bool CaptureUnderway() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return private_pools_.CaptureUnderway();
  }
  // Records events for blocks whose frees were deferred during a capture.
  absl::Status FlushDeferredFrees() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns whole free segments of pools with no use left (only `*only` if given); forgets pools
  // with no segment left.
  absl::Status ReleaseFreeablePrivatePools(const MempoolId* only = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Free blocks indexed in private pools (for CheckInvariants).
  std::int64_t PrivatePoolFreeBlocks() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return private_pools_.FreeBlocks();
  }
  // torch's last resort before an out-of-memory error (core/mem_pools.cc): a free block of a
  // use_on_oom private pool that fits `request`, taken out of its index; nullptr if none, or if
  // `pool`, where the request was to go, is itself a private pool's.
  core::Block* TakeFromUseOnOomPools(const core::BlockPool* pool, const AllocationRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A plain segment's memory from / back to where its pool takes it: the pool's SegmentSource
  // (a MemPool's allocator), else the backend.
  absl::Status SegmentMalloc(const core::BlockPool* pool, std::size_t size, StreamId stream,
                             DevicePtr* ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SegmentFree(const core::BlockPool* pool, DevicePtr ptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns the whole free segments (unsplit free blocks) of plain pool `pool`.
  absl::Status ReleaseWholeFreeSegments(core::BlockPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Pausable regions (region_scope.cc, region_pause.cc) ----
  using Region = core::Regions::Region;
  // A private pool created now on this thread (CreateOrIncrefPool: 1 use; BeginAllocateToPool:
  // 0, its Begin adds one) joins the thread's current region, expandable; false when there is
  // none or the pool exists (then nothing is done).
  bool CreateInRegion(MempoolId id, int uses) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The expandable segments of `region`'s pools.
  std::vector<core::Segment*> RegionSegments(const Region& region) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The small and large block pools of the region's pools (those that still exist).
  std::vector<core::BlockPool*> RegionPools(const Region& region) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Malloc routed to a paused region's pool.
  absl::Status PausedRegionRefusal(const core::BlockPool* pool,
                                   const AllocationRequest& request) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A free of a paused region's block: its figures come back from the region's withdrawn stats
  // into the device's (the free then takes them out as any free does) and its stream uses are
  // dropped (its memory is unmapped: no work can use it, and the pause waited for what was
  // queued).
  void ReadmitPausedBlock(core::Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live blocks' figures of `segments` leave the device's stats into region.withdrawn
  // (pause), or come back (resume).
  void WithdrawStats(Region* region, const std::vector<core::Segment*>& segments)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReadmitStats(Region* region) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `pinned`: buffers PinAhead pinned for the backup; those it does not use stay there.
  absl::StatusOr<RegionPauseResult> PauseLocked(Region* region, RegionBackup backup,
                                                std::vector<core::Regions::HostBuffer>* pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A CPU backup's pinned buffers, allocated before the pause takes the lock (cudaHostAlloc
  // takes about half a second per GiB, and other threads allocate meanwhile): the sizes
  // BackUpRegion would pin for the region as it is now (BackupPins). The pause pins what blocks
  // allocated in between still need; the caller frees what it did not use. On failure nothing
  // is pinned and the error is the pause's.
  struct PinRequest {
    std::size_t bytes = 0;   // the segment's live bytes
    std::size_t pinned = 0;  // rounded up to 2 MiB
  };
  std::vector<PinRequest> BackupPins(const Region& region) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PinAhead(std::string_view name, std::vector<core::Regions::HostBuffer>* pinned)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<RegionResumeResult> ResumeLocked(Region* region, bool keep_host_buffers,
                                                  std::vector<core::Regions::HostBuffer>* to_free)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pause's steps: wait for the region's queued work; copy its live blocks to pinned buffers
  // (freed again on failure; region_backup.cc); unmap every handle (mapped back on failure; a
  // handle that cannot be is released and a new one mapped in its place by LosePages, which
  // keeps the run in region.lost when the driver refuses that too).
  absl::Status WaitForRegion(const Region& region, const std::vector<core::Segment*>& segments)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status BackUpRegion(Region* region, const std::vector<core::Segment*>& segments,
                            std::vector<core::Regions::HostBuffer>* pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status UnmapRegion(Region* region, const std::vector<core::Regions::Released>& runs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LosePages(Region* region, const std::vector<core::Regions::Released>& lost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Books a run's handle (unmapped by the driver already) as unmapped, emits its unmap and
  // releases it (a handle the driver will not release waits for a later empty_cache); returns
  // its bytes.
  std::size_t ReleaseUnmappedRun(const core::Regions::Released& run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Resume's driver steps: handles a failed resume left mapped are unmapped and released
  // (ReleaseHeld); one handle created and mapped per run of `runs` (`handles`), access granted
  // per contiguous range, backups copied back (*mapped_at: when the mapping was done); on
  // failure everything it mapped and created is undone, but for a handle that will not unmap,
  // which the region holds (Region::held).
  absl::Status ReleaseHeld(Region* region) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MapRegion(Region* region, const std::vector<core::Regions::Released>& runs,
                         std::vector<PhysicalHandle>* handles, absl::Time* mapped_at)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The region's backups copied back, one batch.
  absl::Status RestoreBackups(const Region& region) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns pinned buffers to `region.kept` (kKeep), to the backend (kFree), or where they came
  // from (kAsBefore: a failed pause's; HostBuffer::kept says). One the backend refuses stays in
  // kept, to be freed later.
  enum class BufferFate { kKeep, kFree, kAsBefore };
  void GiveBackBuffers(Region* region, std::vector<core::Regions::HostBuffer> buffers,
                       BufferFate fate) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every region's kept pinned buffers, taken out of the books for empty_cache (none while a
  // capture may be under way: cudaFreeHost would end it).
  std::vector<core::Regions::HostBuffer> TakeKeptBuffers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees pinned buffers no book names, without the lock; one the backend refuses goes back to
  // `home`'s kept buffers (the first region's when null).
  absl::Status FreePinned(std::vector<core::Regions::HostBuffer> buffers, Region* home = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Regions against the pools and segments: paused flags agree, a paused region maps nothing.
  // Fills `withdrawn` with the sum of the paused regions' withdrawn figures, the order of the
  // counts CheckSegmentChain fills.
  absl::Status CheckRegions(std::int64_t* withdrawn) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The expandable pools whose free pages recycle among themselves: the device's own two, and
  // each expandable private pool's two.
  std::vector<std::array<const core::BlockPool*, 2>> ExpandableGroups() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The group of `pool` (nullptr: the device's own, Placement's default).
  const std::array<const core::BlockPool*, 2>* GroupOf(
      const core::BlockPool* pool, std::array<const core::BlockPool*, 2>* buf) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Checkpoints of a private pool (graph_checkpoints.cc) ----
  // The segments of private pool `pool`, in address order.
  std::vector<core::Segment*> PoolSegments(const core::PrivatePools::Pool& pool) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until no block of `segments` is pending free (the deferred frees recorded, then every
  // event waited for); FailedPrecondition naming `torch_words` while a capture is under way.
  absl::Status SettlePendingFrees(const std::vector<core::Segment*>& segments,
                                  const char* torch_words) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lays out `segment`, one whole free block, as `checkpoint`: split at its blocks, the allocated
  // ones allocated again (appended to `restored`), the free ones indexed.
  void LayOutSegment(core::Segment* segment, const core::SegmentCheckpoint& checkpoint,
                     core::PoolRestore* restored) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Expandable segments: expandable.cc composes the parts (page_table_, old_mappings_,
  //      placement_) with driver calls, stats and trace; ensure_mapped.cc maps a block's pages;
  //      docs/design/expandable-segments.md ----
  using PendingStreams = core::PendingStreams;
  absl::StatusOr<DevicePtr> MallocExpandable(core::BlockPool* pool,
                                             const AllocationRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Placement::TakeBlock, settling this stream's old mappings of `pool` when it asks
  // (`pending` as for SettleOldMappings).
  core::Block* TakeExpandableBlock(core::BlockPool* pool, StreamId stream, std::size_t size,
                                   PendingStreams* pending, DevicePtr* start)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the start of free `block` to Placement::StartFor's place; the bytes before it stay
  // free as their own block. Returns the block.
  core::Block* PlaceOnMappedPages(core::Block* block, std::size_t size, DevicePtr start)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves a virtual range for (stream, pool) (the first, or one more: MallocExpandable); its
  // one free block joins the pool.
  absl::Status CreateExpandableSegment(core::BlockPool* pool, StreamId stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Maps every unmapped page under [block->ptr, block->ptr + size): recycled pages first, then new
  // handles. false (OK) when out of memory or refused (growth_refusal_); nothing changed then.
  // Its steps (ensure_mapped.cc) share one MappingPlan.
  absl::StatusOr<bool> EnsureMapped(core::Block* block, std::size_t size,
                                    const AllocationRequest& request, PendingStreams* pending)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct MappingPlan;
  // Settles old mappings (no wait), then with keep_old_mappings takes back those under the
  // request whose handle lies free (ReuseOldMappings).
  absl::Status TakeBackOldMappings(core::Block* block, std::size_t size,
                                   const AllocationRequest& request, PendingStreams* pending)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The runs of unmapped pages in [first_page, last_page] of plan->seg, and their count.
  static void FindMissingPages(std::size_t first_page, std::size_t last_page, MappingPlan* plan);
  // Mapped free pages to move under the request (Placement::FreeMappedPages), when growing
  // instead would take reserved past (1 + recycle_slack) x the peak of allocated memory and, under
  // a memory fraction with grow_under_cap, past (1 - recycle_slack) x the cap.
  std::vector<std::pair<core::Segment*, std::size_t>> RecyclablePages(const core::Block* block,
                                                                      std::size_t size,
                                                                      const MappingPlan& plan) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where each recycled handle goes, which are released, and the new handles to create.
  void PlanMappings(const core::Block* block, std::size_t size,
                    const std::vector<std::pair<core::Segment*, std::size_t>>& recycled,
                    MappingPlan* plan) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Some page the plan maps lies under an old mapping whose fence is pending on a stream that is
  // capturing: that mapping cannot go before the capture ends, nor can the request go there
  // (EnsureMapped's false, out of memory as torch's during a capture, which frees nothing).
  bool MapsOverCapturedWork(const MappingPlan& plan) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The memory fraction and the hooks allow the plan's growth (a refusal: growth_refusal_).
  bool GrowthAllowed(const MappingPlan& plan, const AllocationRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the streams of the handles to be unmapped from them (not those left as old
  // mappings).
  absl::Status WaitForSourceStreams(const MappingPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReleaseUnplacedHandles(const MappingPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // false (OK) when the device is out of memory.
  absl::StatusOr<bool> CreateHandles(MappingPlan* plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the recycled handles from their places: an old mapping (fenced) within the stream,
  // else unmapped.
  absl::Status DetachMovedHandles(MappingPlan* plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status MapAndGrantAccess(MappingPlan* plan, const AllocationRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Undoes a plan after a failed driver call: every handle it holds that is not mapped and
  // accessible where planned is released, the books staying exact. Returns `error`.
  absl::Status AbandonPlan(MappingPlan* plan, absl::Status error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unmaps and releases every whole free page of every expandable segment.
  absl::Status ReleaseExpandablePages() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At destruction: old mappings and unreleased handles, then the segments themselves.
  void ReleaseExpandableAtExit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseExpandableSegmentsAtExit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status UnmapPage(core::Segment* segment, std::size_t page, bool release)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases `handle` once no old mapping of it remains; one the driver refuses is kept
  // (PageTable::unreleased) and tried again by ReleaseExpandablePages and the destructor.
  absl::Status ReleaseHandle(PhysicalHandle handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ReleaseHandle for a handle mapped nowhere in the page tables whose `bytes` are in reserved
  // (`types`) and are to leave it: they do, unless a driver error kept the handle mapped at an
  // old address; then it goes back there as a mapped free page (ReturnHome), still reserved
  // (driver-errors.md, "Two failures").
  absl::Status ReleaseCounted(PhysicalHandle handle, StatType types, std::int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Old mappings (page-recycling.md, "Moves without a stall"): a handle that moves within
  // its stream is taken out of the page table at once (counts, trace) but stays mapped at its
  // old address until `fence`, recorded on the stream at the move, has completed.
  // LeaveOldMapping starts that for the handle at `page`.
  absl::Status LeaveOldMapping(core::Segment* segment, std::size_t page, EventId fence)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts the handle of old mapping `index`, mapped only there, back in that segment's page
  // table (no driver call: it is mapped, with access); its reserved bytes move from `types` to
  // that segment's pool's.
  void ReturnHome(std::size_t index, StatType types) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OldMappings::Settle, unless none exists or a capture is under way. `only`: that segment's
  // entries alone (nullptr: all); `pending` (optional, not waiting): streams already found
  // pending, extended by this call.
  absl::Status SettleOldMappings(bool wait, const core::Segment* only = nullptr,
                                 PendingStreams* pending = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ClearOldMappings(absl::FunctionRef<bool(const core::OldMapping&)> which)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // keep_old_mappings: the old mappings wholly under [block->ptr, block->ptr + size) whose handle
  // now lies free (whole, inside a free block of the same stream; `block`'s own pages past the
  // request count) are taken back: the handle's page-table entry returns to the old address,
  // which still maps it with access granted, and its current place becomes an old mapping in
  // turn (fenced, like a move). No driver call but the fence's cudaEventRecord
  // (page-recycling.md, "Old mappings kept").
  absl::Status ReuseOldMappings(core::Block* block, std::size_t size,
                                const AllocationRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CUDA IPC (ipc.cc). ShareIpcHandle under the lock.
  absl::StatusOr<IpcShare> ShareLocked(DevicePtr ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live allocated block that starts at `ptr`, else why it cannot be
  // shared (`call` names the operation in the message).
  absl::StatusOr<const core::Block*> SharedBlock(DevicePtr ptr, const char* call) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The descriptor of `handle`, exported on first use.
  absl::StatusOr<int> ExportedFd(PhysicalHandle handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes `handle`'s descriptor, if it was exported: the handle is released.
  void CloseExportedFd(PhysicalHandle handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every exported descriptor's handle is still held: mapped in a page table, an old mapping,
  // or kept to be released again.
  absl::Status CheckExports() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where the parts hand back fences they no longer need: the event pool.
  auto GiveBackFence() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return [this](EventId e) ABSL_NO_THREAD_SAFETY_ANALYSIS { spare_events_.push_back(e); };
  }
  static void CountUse(const core::Block* block, std::int32_t delta) {
    core::PageTable::CountUse(block, delta);
  }
  std::array<core::BlockPool*, 4> AllPools() {
    return {&small_pool_, &large_pool_, &exp_small_pool_, &exp_large_pool_};
  }
  std::array<const core::BlockPool*, 4> AllPools() const {
    return {&small_pool_, &large_pool_, &exp_small_pool_, &exp_large_pool_};
  }
  // Malloc's steps under the lock: admit the request (the 1 EB limit, completed events, rounding,
  // the hooks' check), choose its pool (a private pool's, else by size), then the pool's cached
  // blocks (best fit) or, for expandable pools, MallocExpandable; else GrowPool.
  absl::StatusOr<DevicePtr> MallocLocked(AllocationRequest& request, AllocatorHooks* hooks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Admit(AllocationRequest& request, AllocatorHooks* hooks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new segment for `request` in plain `pool`, in torch's order: garbage collection (`gc`), a
  // cudaMalloc, then after releasing oversize cached blocks (max_split_size), then after
  // releasing the whole cache; the guard's refusal or the out-of-memory error if none succeeds.
  absl::StatusOr<core::Block*> GrowPool(core::BlockPool* pool, const AllocationRequest& request,
                                        bool gc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // cudaMallocs a new segment of `alloc_size`. nullptr with OK status on out-of-memory (or the
  // fraction cap); an error status for any other driver failure.
  absl::StatusOr<core::Block*> AllocSegment(core::BlockPool* pool, const AllocationRequest& request,
                                            std::size_t alloc_size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One trace entry to the hooks, if any (the check is inline: the hot path pays one load).
  // `pool`: the private pool's id for its blocks and segments.
  void Emit(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
            std::uint64_t context, std::uint32_t tag, MempoolId pool = {0, 0})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (hooks_.load(std::memory_order_relaxed) != nullptr) {
      EmitToHooks(action, addr, size, stream, context, tag, pool);
    }
  }
  void EmitToHooks(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream,
                   std::uint64_t context, std::uint32_t tag, MempoolId pool)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Free and RecordStream under the lock (`context`: the hooks' capture of the free request).
  absl::Status FreeLocked(DevicePtr ptr, std::uint64_t context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RecordStreamLocked(DevicePtr ptr, StreamId stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Splits as needed and marks `block` allocated for `request`. `indexed`: the block's position
  // in its pool's free index if it is still there (the remainder of a split then keeps the node).
  core::Block* UseBlock(core::Block* block, const AllocationRequest& request,
                        const core::BlockPool::Index::iterator* indexed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ShouldSplit(const core::Block* block, std::size_t size) const;
  // Returns a no-longer-active block to its pool, coalescing with free neighbours.
  void FreeBlock(core::Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Merges free neighbour `src` into unindexed `dst` (FreeBlockIndex::Absorb) and recycles it.
  std::size_t TryMerge(core::Block* dst, core::Block* src) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::size_t subsumed = core::FreeBlockIndex::Absorb(dst, src);
    if (subsumed != 0) DeleteBlock(src);
    return subsumed;
  }
  // Frees oversize cached blocks of `stream` (max_split_size set) until `size` could fit.
  absl::StatusOr<bool> ReleaseAvailableCachedBlocks(StreamId stream, std::size_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for all events, then frees every fully free segment.
  absl::Status ReleaseCachedBlocks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReleaseSegment(core::Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // garbage_collection_threshold (with a memory fraction): returns the large pool's oldest whole
  // cached segments while reserved is above threshold x the cap (torch's
  // garbage_collect_cached_blocks). Errors: a failed cudaFree.
  absl::Status GarbageCollectCachedBlocks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The allocator's side of stream_events_ (core/stream_events.h): the capture check it asks
  // before each event call, and the release of a block whose events completed.
  absl::Status InsertEvents(core::Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ProcessEvents() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SynchronizeAndFreeEvents() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseAfterEvents(core::Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    live_blocks_.Erase(block->ptr);
    FreeBlock(block);
  }
  absl::StatusOr<EventId> GetEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return spare_events_.Get(backend_);
  }
  absl::Status OutOfMemory(const AllocationRequest& request, std::size_t alloc_size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  core::Block* NewBlock() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return block_recycler_.New(); }
  void DeleteBlock(core::Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    block_recycler_.Recycle(block);
  }
  static void UpdateStat(core::PoolStat& stat, StatType type, std::int64_t amount) {
    stat.Add(type, amount);
  }

  const Options options_;
  DeviceBackend* const backend_;
  const int device_;  // backend_->device(), read once (the hot path makes no virtual call for it)
  std::atomic<AllocatorHooks*> hooks_{nullptr};
  mutable core::DeviceMutex mu_;
  core::BlockPool small_pool_ ABSL_GUARDED_BY(mu_){true};
  core::BlockPool large_pool_ ABSL_GUARDED_BY(mu_){false};
  core::BlockPool exp_small_pool_ ABSL_GUARDED_BY(mu_){true, true, 2 * kMiB};
  core::BlockPool exp_large_pool_ ABSL_GUARDED_BY(mu_){false, true, options_.expandable_page_size};
  // Expandable segments: their page tables, the old mappings of moved handles, and the
  // placement that reads both (declared after the pools it reads).
  core::PageTable page_table_ ABSL_GUARDED_BY(mu_);
  core::OldMappings old_mappings_ ABSL_GUARDED_BY(mu_);
  core::Placement placement_ ABSL_GUARDED_BY(mu_){&page_table_,
                                                  &old_mappings_,
                                                  {&exp_small_pool_, &exp_large_pool_},
                                                  options_.recycle_tails_first};
  // Plain (cudaMalloc'd) segments by address.
  absl::btree_map<DevicePtr, std::unique_ptr<core::Segment>> segments_ ABSL_GUARDED_BY(mu_);
  // Allocated and pending-free blocks by address.
  core::LiveBlockMap live_blocks_ ABSL_GUARDED_BY(mu_);
  // Spare events (record_stream's and the old mappings' fences), and the record_stream events and
  // deferred frees.
  core::EventPool spare_events_ ABSL_GUARDED_BY(mu_);
  core::StreamEvents stream_events_ ABSL_GUARDED_BY(mu_){backend_, &spare_events_};
  core::BlockRecycler block_recycler_ ABSL_GUARDED_BY(mu_);
  core::CoreStats stats_ ABSL_GUARDED_BY(mu_);          // public form: ToDeviceStats()
  bool fraction_set_ ABSL_GUARDED_BY(mu_) = false;      // set_per_process_memory_fraction called
  std::size_t allowed_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // cap on reserved when fraction_set_
  OutOfMemoryInfo last_oom_ ABSL_GUARDED_BY(mu_);
  // Private pools (CUDA graph pools): by id, the active ones, failed captures.
  core::PrivatePools private_pools_ ABSL_GUARDED_BY(mu_){backend_};
  // The guard's refusal of the current Malloc's growth, if any (reset per Malloc).
  absl::Status growth_refusal_ ABSL_GUARDED_BY(mu_);
  // CUDA IPC: descriptors of the physical handles shared so far, closed as each is released
  // (a receiver may duplicate one until then); memory other processes shared, opened here.
  absl::flat_hash_map<PhysicalHandle, int> exported_fds_ ABSL_GUARDED_BY(mu_);
  core::IpcImports ipc_imports_{backend_};
  // Pausable regions: names, ids, member pools, what their pauses released and backed up.
  core::Regions regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace vramledger

#endif  // VRAMLEDGER_CORE_DEVICE_ALLOCATOR_IMPL_H_
