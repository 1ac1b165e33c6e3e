// record_stream events and deferred frees of one allocator: a freed block used on other streams
// becomes reusable once an event recorded on each of them has completed. Not locked: the
// owner's mutex guards it (its methods are called with that lock held).
#ifndef VRAMLEDGER_CORE_STREAM_EVENTS_H_
#define VRAMLEDGER_CORE_STREAM_EVENTS_H_

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "core/block.h"
#include "core/event_pool.h"
#include "vramledger/device_backend.h"

namespace vramledger::core {

class StreamEvents {
 public:
  /// Asked before each event record or query: true while a CUDA graph capture may be under way
  /// (no cudaEventRecord or cudaEventQuery then: the capture would take or refuse them).
  using CaptureUnderway = absl::FunctionRef<bool()>;
  /// Called for each block whose last event completed: it is free now (the caller returns it
  /// to its pool).
  using Release = absl::FunctionRef<void(Block*)>;

  StreamEvents(DeviceBackend* backend, EventPool* spare) : backend_(backend), spare_(spare) {}

  /// Records an event on each stream in block->stream_uses (the block stays pending until they
  /// complete). During a capture, or after a driver error, the block is deferred instead (its
  /// uses kept, one event_count held) until FlushDeferred; a driver error is returned.
  absl::Status Record(Block* block, CaptureUnderway capture_underway);
  /// Records the events of the deferred blocks (a block left with nothing to wait for is
  /// released); the first driver error is returned, the failing blocks deferred again.
  absl::Status FlushDeferred(CaptureUnderway capture_underway, Release release);
  /// Polls each stream's events in order (stopping at its first pending one) and releases the
  /// blocks whose last event completed. Nothing while a capture may be under way.
  absl::Status Process(CaptureUnderway capture_underway, Release release);
  /// Waits for every recorded event and releases their blocks.
  absl::Status SynchronizeAll(Release release);

  /// Events recorded and not yet seen complete, plus deferred blocks.
  std::int64_t pending() const { return pending_; }
  bool has_deferred() const { return !deferred_.empty(); }

  /// pending() is the queues' entries plus the deferred blocks; each block waiting here is not
  /// allocated and its event_count is its entries here; no event is queued twice or spare.
  absl::Status CheckInvariants() const;

 private:
  void Defer(Block* block) {
    deferred_.push_back(block);
    ++block->event_count;
    ++pending_;
  }
  // One queued event of `block` completed: the event goes back to the pool, and the block is
  // released when it was its last.
  void Completed(EventId event, Block* block, Release release);

  DeviceBackend* const backend_;
  EventPool* const spare_;
  // One FIFO per stream, so a slow stream never blocks another. Ordered by stream (a btree, not
  // a hash map): events are processed, blocks freed and trace entries emitted in the same order
  // in every process (a hash map's order varies with its seed, which made runs with
  // record_stream differ where a driver failure fell).
  absl::btree_map<StreamId, std::deque<std::pair<EventId, Block*>>> queues_;
  std::int64_t pending_ = 0;
  std::vector<Block*> deferred_;  // blocks whose events wait for the end of a capture
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_STREAM_EVENTS_H_
