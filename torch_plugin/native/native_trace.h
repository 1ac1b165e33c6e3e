// vramledger's trace entries in torch's form (c10::CachingDeviceAllocator::TraceEntry), for
// torch's snapshot traces and its allocator trace trackers in the torch-native mode.
#ifndef VRAMLEDGER_TORCH_PLUGIN_NATIVE_NATIVE_TRACE_H_
#define VRAMLEDGER_TORCH_PLUGIN_NATIVE_NATIVE_TRACE_H_

#include <c10/core/CachingDeviceAllocator.h>

#include "vramledger/hooks.h"

namespace vramledger {

/// torch's action for `action` (the same nine kinds, one to one).
c10::CachingDeviceAllocator::TraceEntry::Action TorchTraceAction(TraceAction action);

/// `entry` as torch's trace entry: its device, address, size, stream and pool, stamped now;
/// no frames (vramledger keeps its own, in its history).
c10::CachingDeviceAllocator::TraceEntry TorchTraceEntry(const TraceEntry& entry);

}  // namespace vramledger

#endif  // VRAMLEDGER_TORCH_PLUGIN_NATIVE_NATIVE_TRACE_H_
