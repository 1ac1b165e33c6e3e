// Reports on one device's allocator read through its core view (core/core_view.h): the segments
// and blocks in torch's snapshot shape (SegmentInfo), and the fragmentation figures.
// Thread-safety: each call reads the allocator under its lock (DeviceAllocator::Read).
#ifndef VRAMLEDGER_LEDGER_DEVICE_REPORT_H_
#define VRAMLEDGER_LEDGER_DEVICE_REPORT_H_

#include <vector>

#include "core/core_view.h"
#include "vramledger/device_allocator.h"

namespace vramledger {

/// Segments and their blocks, in address order. An expandable segment shows as one segment per
/// contiguous mapped range, as torch reports it.
std::vector<SegmentInfo> SegmentsOf(const DeviceAllocator& allocator);
std::vector<SegmentInfo> SegmentsOf(const core::CoreView& view);

/// Fragmentation figures; `current_stream` decides what counts as another stream's cache.
Fragmentation FragmentationOf(const DeviceAllocator& allocator, StreamId current_stream = 0);
Fragmentation FragmentationOf(const core::CoreView& view, StreamId current_stream);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_DEVICE_REPORT_H_
