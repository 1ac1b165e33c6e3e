// Trace entries in torch's form and attachAllocatorTraceTracker in the torch-native mode: each
// tracker is attached to the runtime's trace trackers (runtime/trace_trackers.h), which every
// device allocator's hooks call under its lock, as torch calls its own trackers.
#include "torch_plugin/native/native_trace.h"

#include <c10/util/ApproximateClock.h>

#include <utility>

#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/pluggable/plugin.h"

namespace vramledger {

c10::CachingDeviceAllocator::TraceEntry::Action TorchTraceAction(TraceAction action) {
  using Torch = c10::CachingDeviceAllocator::TraceEntry;
  switch (action) {
    case TraceAction::kAlloc:
      return Torch::ALLOC;
    case TraceAction::kFreeRequested:
      return Torch::FREE_REQUESTED;
    case TraceAction::kFreeCompleted:
      return Torch::FREE_COMPLETED;
    case TraceAction::kSegmentAlloc:
      return Torch::SEGMENT_ALLOC;
    case TraceAction::kSegmentFree:
      return Torch::SEGMENT_FREE;
    case TraceAction::kSegmentMap:
      return Torch::SEGMENT_MAP;
    case TraceAction::kSegmentUnmap:
      return Torch::SEGMENT_UNMAP;
    case TraceAction::kSnapshot:
      return Torch::SNAPSHOT;
    case TraceAction::kOom:
      return Torch::OOM;
  }
  return Torch::ALLOC;  // unreachable: every action is listed
}

c10::CachingDeviceAllocator::TraceEntry TorchTraceEntry(const TraceEntry& entry) {
  return c10::CachingDeviceAllocator::TraceEntry(
      TorchTraceAction(entry.action), static_cast<c10::DeviceIndex>(entry.device),
      static_cast<std::size_t>(entry.addr), entry.size, reinterpret_cast<void*>(entry.stream),
      c10::MempoolId_t{entry.pool.first, entry.pool.second}, c10::getApproximateTime());
}

void NativeAllocator::attachAllocatorTraceTracker(
    c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) {
  if (!tracker) return;
  vramledger_attach_trace_tracker(
      [tracker = std::move(tracker)](const TraceEntry& entry) { tracker(TorchTraceEntry(entry)); });
}

}  // namespace vramledger
