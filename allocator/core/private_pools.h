// Private pools of one device (CUDA graph pools, later torch.cuda.MemPool): pools keyed by
// MempoolId with use counts, the ones being allocated to with their stream filters and owner
// threads, and the cleanup of failed captures. Not locked: the owner's mutex guards it.
#ifndef VRAMLEDGER_CORE_PRIVATE_POOLS_H_
#define VRAMLEDGER_CORE_PRIVATE_POOLS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/free_block_index.h"
#include "vramledger/device_allocator.h"
#include "vramledger/device_backend.h"

namespace vramledger::core {

class PrivatePools {
 public:
  /// One private pool: plain (never expandable) small and large pools of its own, and what a
  /// torch.cuda.MemPool sets on it.
  struct Pool {
    /// `large_page` > 0: the pool's blocks live in expandable segments (a region's pools), the
    /// small ones on 2 MiB pages, the large ones on `large_page`.
    explicit Pool(MempoolId id, std::shared_ptr<SegmentSource> segment_source = nullptr,
                  std::size_t large_page = 0);
    int use_count = 1;
    BlockPool small;
    BlockPool large;
    std::shared_ptr<SegmentSource> source;  // null: segments from the backend
    bool use_on_oom = false;
    /// Which pool of this id it is (1 for the first made, and so on, across ids): a pool
    /// forgotten and made again under the same id is another incarnation, so what was recorded
    /// of the old one (a checkpoint) can be told from the new.
    std::uint64_t incarnation = 0;
  };
  /// By id. Ordered (a btree): released in the same order in every process (trace entries too).
  using Map = absl::btree_map<MempoolId, std::unique_ptr<Pool>>;

  explicit PrivatePools(DeviceBackend* backend) : backend_(backend) {}

  /// Starts allocating to pool `id` (created, or one more use of it) for the streams `filter`
  /// accepts, owned by the calling thread. A pool may have several such entries at once (as in
  /// torch: use_mem_pool on two threads, nested, or a capture into it inside use_mem_pool).
  /// A `fallback` entry (a region's) takes a stream only when no other entry accepts it, and is
  /// never taken for a capture's.
  absl::Status Begin(MempoolId id, StreamFilter filter, bool fallback = false);
  /// Creates pool `id` with expandable block pools (large pages of `large_page` bytes) and
  /// `uses` uses: a region's pool, or a private pool created inside a region. InvalidArgument
  /// when it exists or for {0, 0}.
  absl::Status CreateExpandable(MempoolId id, std::size_t large_page, int uses);
  /// The pool `id`, or nullptr.
  Pool* Find(MempoolId id) const {
    auto it = pools_.find(id);
    return it == pools_.end() ? nullptr : it->second.get();
  }
  /// Stops allocating to `id`: the calling thread's latest entry of it, else (as torch) the
  /// first entry of it. NotFound if it is not being allocated to (nor was pruned). When the
  /// thread keeps another entry of `id` and the one taken had served no stream, the End may
  /// have been that other entry's while the one taken was a capture that goes on (the two
  /// cannot be told apart): the kept entry then counts as a capture (Active::may_hold_capture),
  /// as torch counts every open entry, even when an entry of the thread routed a capture that
  /// has ended (that may have been one of two captures into the pool).
  absl::Status End(MempoolId id);
  /// One use of `id` less; returns the uses left. NotFound for an unknown or unused pool.
  absl::StatusOr<int> Release(MempoolId id);
  /// Uses of `id` (0: unknown).
  int UseCount(MempoolId id) const;

  // torch.cuda.MemPool's calls (DeviceAllocator's CreateOrIncrefPool, SetUseOnOOM, SetNoSplit).
  /// Creates `id` (one use, segments from `source` if given) or adds a use to it. InvalidArgument
  /// for {0, 0} or a source for a pool that exists.
  absl::Status CreateOrIncref(MempoolId id, std::shared_ptr<SegmentSource> source);
  /// NotFound for an unknown pool.
  absl::Status SetUseOnOOM(MempoolId id, bool use_on_oom);
  absl::Status SetNoSplit(MempoolId id);
  /// Pools whose free blocks an out-of-memory default-pool allocation may take: use_on_oom and
  /// still in use, in id order.
  std::vector<Pool*> UseOnOomPools();

  /// True while some pool is being allocated to (the allocator routes requests then).
  bool any_active() const { return !active_.empty(); }
  /// The pool of an active private pool whose filter accepts `stream` (small or large by
  /// `rounded`), recording the stream (and whether it captures); nullptr if none accepts it.
  /// torch's entries (captures, use_mem_pool) first, the first begun among them, as torch's
  /// get_pool; then regions' (fallback) entries, the innermost among them.
  BlockPool* Route(StreamId stream, std::size_t rounded);
  /// True while a capture may be under way: an active pool has served no stream yet, or one of
  /// its streams is capturing. Prunes the pools of failed captures first.
  bool CaptureUnderway();
  /// While CaptureUnderway(): the capture, for an error that refuses what a capture forbids
  /// ("stream S captures into private pool (a, b)", or that one may be under way).
  std::string DescribeCapture() const;
  /// An active pool that served a capturing stream, none of whose streams capture any more, had
  /// its capture fail (torch sends no End or Release then): it stops being active and loses a
  /// use. Only its owner thread decides so at once: torch calls endAllocateToPool after
  /// cudaStreamEndCapture, so on another thread an ended capture whose End has not come yet
  /// looks failed, and pruning it there would let empty_cache free the graph's memory. Another
  /// thread prunes it once it has looked over for kFailedCaptureGrace: the window is
  /// microseconds, and a capturing thread that failed and never calls again must not hold the
  /// pool, its memory and the allocator's capture checks for the rest of the process.
  void PruneFailedCaptures();
  static constexpr absl::Duration kFailedCaptureGrace = absl::Seconds(1);

  /// For each pool with no use left (only `*only` when given): `release` on its large then small
  /// pool (returning their whole free segments), then the pool is forgotten unless
  /// `has_segments` says it still owns some. Stops at the first error.
  absl::Status ReleaseUnused(absl::FunctionRef<absl::Status(BlockPool*)> release,
                             absl::FunctionRef<bool(const Pool&)> has_segments,
                             const MempoolId* only = nullptr);
  /// Free blocks indexed in all private pools.
  std::int64_t FreeBlocks() const;

  /// Iteration over the pools by id (pair<const MempoolId, unique_ptr<Pool>>).
  Map::const_iterator begin() const { return pools_.begin(); }
  Map::const_iterator end() const { return pools_.end(); }

  /// Every active entry's pool exists; a pool's use count is at least its active entries and not
  /// negative; each pool's free indexes hold their invariants (FreeBlockIndex::CheckInvariants).
  absl::Status CheckInvariants() const;

 private:
  // A pool being allocated to (between Begin and End).
  struct Active {
    MempoolId id;
    StreamFilter filter;
    std::vector<StreamId> streams;  // streams routed to it so far
    bool saw_capture = false;       // one of them was capturing when routed
    bool served_plain = false;      // one was not: a use_mem_pool entry, never pruned
    std::thread::id owner;          // the thread that began it (torch's capturing thread)
    bool fallback = false;          // a region's entry: routed to after every other entry
    // An End of the same pool on this thread removed another entry that may have been a
    // capture still under way (it had served no stream): this entry counts as one may (in
    // CaptureUnderway) until its own End, so no event, free or unmap breaks that capture.
    bool may_hold_capture = false;
    // When another thread first found its capture over (InfiniteFuture: not found so): after
    // kFailedCaptureGrace of that, any thread may prune it.
    absl::Time ended_seen = absl::InfiniteFuture();
  };

  // After an End of `id` took an entry that had served no stream: Active::may_hold_capture on
  // the calling thread's innermost entry of `id` left.
  void KeepCaptureCaution(MempoolId id);
  // The entry that shows a capture may be under way (CaptureUnderway, DescribeCapture): first
  // one that served a stream capturing now (that stream in `*stream` when given), else one that
  // served none or is kept for a capture (Active::may_hold_capture); nullptr when none.
  const Active* FindCapture(std::optional<StreamId>* stream) const;
  // A pool for `id` with the next incarnation (Pool::incarnation).
  std::unique_ptr<Pool> MakePool(MempoolId id, std::shared_ptr<SegmentSource> source = nullptr,
                                 std::size_t large_page = 0);
  // Route among the entries that are (not) fallback: the first of torch's, the last of regions'.
  BlockPool* RouteAmong(StreamId stream, std::size_t rounded, bool fallback);

  DeviceBackend* const backend_;
  Map pools_;
  std::uint64_t pools_made_ = 0;  // the last Pool::incarnation given
  std::vector<Active> active_;
  // An entry pruned as a failed capture, until its owner's End or next Begin of the pool.
  struct Pruned {
    MempoolId id;
    std::thread::id owner;
  };
  std::vector<Pruned> pruned_;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_PRIVATE_POOLS_H_
