// Old mappings of expandable segments: a handle that moves within its stream stays mapped at the
// address it left until the work queued there has finished (its fence), and with
// keep_old_mappings after that too, until the address is needed or the handle goes back there.
// Design: docs/design/page-recycling.md, "Moves without a stall" and "Old mappings kept".
#ifndef VRAMLEDGER_CORE_OLD_MAPPINGS_H_
#define VRAMLEDGER_CORE_OLD_MAPPINGS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "core/block.h"
#include "core/page_table.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

namespace vramledger::core {

/// One old mapping: `handle`, moved away (or never mapped back), still mapped over pages
/// [first_page, first_page + pages) of `segment`.
struct OldMapping {
  Segment* segment;
  std::size_t first_page;
  std::size_t pages;
  PhysicalHandle handle;  // mapped elsewhere too, or nowhere; released only after this is gone
  EventId fence;          // recorded on the segment's stream at the move; 0 once seen complete
};

/// Streams whose oldest old-mapping fence one allocation found pending: their later fences are
/// not queried again during that allocation (a stream's fences complete in order).
using PendingStreams = absl::InlinedVector<StreamId, 4>;

/// The old mappings and their per-page marks (Segment::old_mapping, old_handle, old_home_hint).
/// Fences it no longer needs are handed to `give_back` (the allocator's event pool). Not
/// thread-safe: the owning allocator calls it with its lock held (docs/design/locking.md).
class OldMappings {
 public:
  using GiveBack = absl::FunctionRef<void(EventId)>;

  const std::vector<OldMapping>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }
  /// Entries whose fence has not been seen complete.
  std::size_t InUse() const;
  /// Bytes still mapped at old addresses (each page of each entry).
  std::int64_t Bytes() const;
  /// The first entry of `handle`, or entries().size().
  std::size_t Find(PhysicalHandle handle) const;

  /// Records `handle` as still mapped over pages [page, page + pages) of `seg`, whose page-table
  /// entry was just cleared, until `fence` completes.
  void Add(Segment* seg, std::size_t page, std::size_t pages, PhysicalHandle handle, EventId fence);
  /// Forgets entry `index` and its page marks; its fence goes to `give_back` when no other
  /// entry shares it (the handles moved by one allocation share one fence).
  void Erase(std::size_t index, GiveBack give_back);

  /// Drops entries (all, or only `only`'s) whose fence completed, each unmapped by `backend`:
  /// with `keep` they stay instead, idle, until their address is needed. `wait`: every fence is
  /// waited for; otherwise each is queried once, and a stream found pending (recorded in
  /// `pending`, when given) is not queried again. Idle entries are unmapped unless `keep`.
  absl::Status Settle(DeviceBackend* backend, bool wait, bool keep, const Segment* only,
                      PendingStreams* pending, GiveBack give_back);
  /// Unmaps the entries `which` selects, waiting for their fence if need be: before something
  /// is mapped over an old address, or before a handle is released. While a capture may be
  /// under way (`capture_underway`) no event is queried or waited for (torch's rule: no
  /// cudaEventQuery during any capture): the stream each fence was recorded on is synchronized
  /// instead, in relaxed capture mode as a page move waits for its source stream. A fence on a
  /// stream that is capturing itself cannot be waited for: FailedPrecondition naming it.
  absl::Status Clear(DeviceBackend* backend, absl::FunctionRef<bool(const OldMapping&)> which,
                     bool capture_underway, GiveBack give_back);
  /// Whether Clear would refuse an entry `which` selects while a capture is under way: its fence
  /// is pending on a stream that `backend` reports capturing. That place, and that entry's
  /// handle, can be used again only once the capture ends (placement leaves both alone until then).
  bool HeldByCapture(DeviceBackend* backend,
                     absl::FunctionRef<bool(const OldMapping&)> which) const;
  /// Unmaps entry `index` (backend) and forgets it.
  absl::Status UnmapEntry(DeviceBackend* backend, std::size_t index, GiveBack give_back);

  /// Whether old mappings may be taken back during the allocation in progress
  /// (keep_old_mappings and no capture under way: no fence can be recorded in a capture).
  bool reuse_now() const { return reuse_now_; }
  void set_reuse_now(bool on) { reuse_now_ = on; }
  /// The old mapping at `page` of `seg` holds a handle that could go back there now: it is
  /// mapped in a segment of the same stream, all of its pages there free (Segment::use), not
  /// inside free block `within` when given, and reuse_now().
  bool Reusable(const PageTable& table, const Segment* seg, std::size_t page,
                const Block* within = nullptr) const;
  /// Handles taken back to an old mapping (no driver call but a fence's record).
  std::int64_t reused() const { return reused_; }
  void CountReuse() { ++reused_; }

  /// Each page's mark and handle agree, and the marked pages are exactly the entries' pages,
  /// each carrying its entry's handle.
  absl::Status CheckInvariants(const PageTable& table) const;

 private:
  std::vector<OldMapping> entries_;
  bool reuse_now_ = false;
  std::int64_t reused_ = 0;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_OLD_MAPPINGS_H_
