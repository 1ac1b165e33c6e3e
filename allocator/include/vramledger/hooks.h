// The one extension point of the core: a hooks object that sees every state change (history,
// per-tag accounting) and may refuse an allocation or a growth of reserved memory (the guard).
// Thread-safety: methods are called from allocating threads; see each method for the lock state.
#ifndef VRAMLEDGER_HOOKS_H_
#define VRAMLEDGER_HOOKS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "vramledger/stats.h"
#include "vramledger/types.h"

namespace vramledger {

/// Torch's trace actions (docs/design/torch-facts.md §6.2), in torch's spelling via
/// TraceActionName().
enum class TraceAction : std::uint8_t {
  kAlloc,
  kFreeRequested,
  kFreeCompleted,
  kSegmentAlloc,
  kSegmentFree,
  kSegmentMap,
  kSegmentUnmap,
  kSnapshot,
  kOom,
};

/// "alloc", "free_requested", ..., "oom".
std::string_view TraceActionName(TraceAction action);
/// The action named `name` (exact, case-sensitive), or nullopt if there is none.
std::optional<TraceAction> ParseTraceAction(std::string_view name);

/// One state change of the allocator (torch calls these trace entries).
struct TraceEntry {
  TraceAction action = TraceAction::kAlloc;
  int device = 0;
  /// Block or segment address; for kOom the device's free bytes (torch's `device_free`).
  DevicePtr addr = 0;
  /// Requested bytes for alloc/free events, segment or mapped bytes for segment events, the
  /// rounded request for kOom (torch's conventions).
  std::size_t size = 0;
  StreamId stream = 0;
  /// Opaque context id from AllocatorHooks::CaptureContext when the block was allocated (0 none).
  std::uint64_t context = 0;
  /// Tag id from AllocatorHooks::CurrentTag when the block was allocated (0 untagged).
  std::uint32_t tag = 0;
  /// The private pool of the block or segment (torch's MempoolId_t; {0, 0}: the default pools).
  std::pair<std::uint64_t, std::uint64_t> pool{0, 0};
};

/// What an allocation asks for, as the guard sees it.
struct AllocationRequest {
  int device = 0;
  std::size_t size = 0;     // requested bytes
  std::size_t rounded = 0;  // block bytes it will take (at least)
  StreamId stream = 0;
  std::uint32_t tag = 0;
  std::uint64_t context = 0;
};

/// The figures of a device's stats that hooks are shown, in bytes, over all pools ("all"),
/// current. A hook check runs on every Malloc, so the allocator hands over these two numbers
/// rather than building a whole DeviceStats (docs/design/locking.md, "Hot path").
struct HookStats {
  std::int64_t allocated_bytes = 0;  // allocated_bytes.all.current
  std::int64_t reserved_bytes = 0;   // reserved_bytes.all.current

  static HookStats From(const DeviceStats& stats) {
    return {stats.allocated_bytes[kAggregate].current, stats.reserved_bytes[kAggregate].current};
  }
};

/// Hooks into one or more device allocators. Default implementations do nothing and allow all.
class AllocatorHooks {
 public:
  virtual ~AllocatorHooks() = default;

  /// Called before the device lock is taken, once per Malloc/Free: returns an opaque id for the
  /// caller's context (an interned stack), stored with the block. Must be cheap and thread-safe.
  virtual std::uint64_t CaptureContext(TraceAction action) {
    (void)action;
    return 0;
  }
  /// Called before the device lock is taken, once per Malloc: the caller's tag id (0 = untagged).
  virtual std::uint32_t CurrentTag() { return 0; }

  /// Called with the device lock held before a block is handed out. A non-OK status (use
  /// ResourceExhausted) refuses the allocation with that status. `stats` are the current stats.
  virtual absl::Status CheckAllocation(const AllocationRequest& request, const HookStats& stats) {
    (void)request;
    (void)stats;
    return absl::OkStatus();
  }
  /// Called with the device lock held before reserved memory grows to `reserved_after` bytes.
  /// A non-OK status refuses the growth: the allocator then releases its cache and asks again,
  /// and fails the allocation with this status if it is still refused.
  virtual absl::Status CheckGrowth(const AllocationRequest& request, std::size_t reserved_after,
                                   const HookStats& stats) {
    (void)request;
    (void)reserved_after;
    (void)stats;
    return absl::OkStatus();
  }

  /// Called with the device lock held, once per state change, in order. Must not call back
  /// into the allocator.
  virtual void OnEvent(const TraceEntry& event) { (void)event; }
};

}  // namespace vramledger

#endif  // VRAMLEDGER_HOOKS_H_
