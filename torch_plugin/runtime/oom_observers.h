// Out-of-memory observers of the torch routes: one C callback and torch's own observers, called
// with torch's observer arguments (device, alloc size, limit, device free) before an
// OutOfMemoryError is thrown. Thread-safe.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_OOM_OBSERVERS_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_OOM_OBSERVERS_H_

#include <cstddef>

#include "vramledger/device_allocator.h"

namespace vramledger {

/// Calls the registered observer, if any, for an out-of-memory failure of `requested` bytes on
/// `device`, with the figures of `oom` (the allocator's last_oom()): the segment size that could
/// not be obtained, the limit (the memory-fraction cap if one is set, else the device total) and
/// the device's free bytes. Must be called without any allocator lock held. Never throws.
void NotifyOutOfMemoryObservers(int device, std::size_t requested, const OutOfMemoryInfo& oom);

}  // namespace vramledger

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_OOM_OBSERVERS_H_
