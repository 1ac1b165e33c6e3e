// Spare device events of one allocator, shared by record_stream events (stream_events.h) and the
// fences of old mappings: an event is created once and reused. Not locked: the owner's
// mutex guards it.
#ifndef VRAMLEDGER_CORE_EVENT_POOL_H_
#define VRAMLEDGER_CORE_EVENT_POOL_H_

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "vramledger/device_backend.h"

namespace vramledger::core {

class EventPool {
 public:
  /// A spare event (the one returned last), else a new one from the backend.
  absl::StatusOr<EventId> Get(DeviceBackend* backend) {
    if (!spare_.empty()) {
      const EventId e = spare_.back();
      spare_.pop_back();
      return e;
    }
    EventId e = 0;
    if (absl::Status s = backend->CreateEvent(&e); !s.ok()) return s;
    return e;
  }
  /// Takes back an event no longer in use (container-style name: the pool is a stack of them).
  void push_back(EventId e) { spare_.push_back(e); }
  std::size_t size() const { return spare_.size(); }
  bool Contains(EventId e) const;
  /// Destroys every spare event (the allocator's destructor).
  void DestroyAll(DeviceBackend* backend) {
    for (EventId e : spare_) (void)backend->DestroyEvent(e);
    spare_.clear();
  }

 private:
  std::vector<EventId> spare_;
};

inline bool EventPool::Contains(EventId e) const {
  for (EventId s : spare_) {
    if (s == e) return true;
  }
  return false;
}

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_EVENT_POOL_H_
