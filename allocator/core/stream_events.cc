// Recording, polling and waiting for record_stream events, and the frees deferred during a
// capture (stream_events.h). Not locked: the owner's mutex guards it.
#include "core/stream_events.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace vramledger::core {

absl::Status StreamEvents::Record(Block* block, CaptureUnderway capture_underway) {
  if (capture_underway()) {  // no event record during a capture: FlushDeferred does it later
    Defer(block);
    return absl::OkStatus();
  }
  while (!block->stream_uses.empty()) {
    const StreamId s = block->stream_uses.back();
    auto event = spare_->Get(backend_);
    absl::Status st = event.ok() ? backend_->RecordEvent(*event, s) : event.status();
    if (!st.ok()) {
      // A driver error: the uses not yet covered by an event are kept and tried again by the
      // next slow path (Process -> FlushDeferred); the block stays pending meanwhile
      // (driver-errors.md).
      if (event.ok()) spare_->push_back(*event);
      Defer(block);
      return st;
    }
    block->stream_uses.pop_back();
    ++block->event_count;
    ++pending_;
    queues_[s].emplace_back(*event, block);
  }
  return absl::OkStatus();
}

absl::Status StreamEvents::FlushDeferred(CaptureUnderway capture_underway, Release release) {
  std::vector<Block*> blocks = std::move(deferred_);
  deferred_.clear();
  pending_ -= static_cast<std::int64_t>(blocks.size());
  absl::Status first_error;
  for (Block* block : blocks) {
    --block->event_count;  // the deferral's; Record adds one per stream that used it
    // After a driver error Record defers the block again; the others still go on.
    if (absl::Status s = Record(block, capture_underway); !s.ok()) {
      first_error.Update(s);
    } else if (block->event_count == 0) {  // nothing left to wait for
      release(block);
    }
  }
  return first_error;
}

void StreamEvents::Completed(EventId event, Block* block, Release release) {
  --pending_;
  spare_->push_back(event);
  if (--block->event_count == 0) release(block);
}

absl::Status StreamEvents::Process(CaptureUnderway capture_underway, Release release) {
  if (capture_underway()) return absl::OkStatus();  // no cudaEventQuery during a capture
  if (!deferred_.empty()) {
    if (absl::Status s = FlushDeferred(capture_underway, release); !s.ok()) return s;
  }
  for (auto& [stream, queue] : queues_) {
    while (!queue.empty()) {
      auto [event, block] = queue.front();
      auto done = backend_->QueryEvent(event);
      if (!done.ok()) return done.status();
      if (!*done) break;  // later events of this stream cannot be done either
      queue.pop_front();
      Completed(event, block, release);
    }
  }
  return absl::OkStatus();
}

absl::Status StreamEvents::SynchronizeAll(Release release) {
  for (auto& [stream, queue] : queues_) {
    while (!queue.empty()) {
      auto [event, block] = queue.front();
      if (absl::Status s = backend_->SynchronizeEvent(event); !s.ok()) return s;
      queue.pop_front();
      Completed(event, block, release);
    }
  }
  return absl::OkStatus();
}

absl::Status StreamEvents::CheckInvariants() const {
  auto fail = [](auto&&... parts) {
    return absl::InternalError(absl::StrCat("stream events: ", parts...));
  };
  absl::flat_hash_map<const Block*, int> waits;  // entries per block
  absl::flat_hash_map<EventId, int> queued;
  std::int64_t entries = 0;
  for (const auto& [stream, queue] : queues_) {
    for (const auto& [event, block] : queue) {
      ++waits[block];
      ++entries;
      if (++queued[event] > 1) return fail("event ", event, " queued twice");
      if (spare_->Contains(event)) return fail("queued event ", event, " is also spare");
    }
  }
  for (const Block* block : deferred_) ++waits[block];
  entries += static_cast<std::int64_t>(deferred_.size());
  if (entries != pending_) return fail("pending is ", pending_, " but ", entries, " wait");
  for (const auto& [block, n] : waits) {
    if (block->allocated) return fail("block 0x", absl::Hex(block->ptr), " is allocated");
    if (block->event_count != n) {
      return fail("block 0x", absl::Hex(block->ptr), " counts ", block->event_count, " events, ", n,
                  " wait");
    }
  }
  return absl::OkStatus();
}

}  // namespace vramledger::core
