// Memory snapshots in torch 2.11's dict shape (docs/design/torch-facts.md §6.2): segments with
// blocks, per-device device_traces from the history, allocator_settings, plus a "vramledger" key.
// Thread-safety: stateless; reads each allocator and the history under their own locks.
#ifndef VRAMLEDGER_LEDGER_SNAPSHOT_H_
#define VRAMLEDGER_LEDGER_SNAPSHOT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ledger/history.h"
#include "nlohmann/json.hpp"
#include "vramledger/device_allocator.h"

namespace vramledger {

/// The snapshot document: keys keep torch's order.
using SnapshotJson = nlohmann::ordered_json;

/// What a snapshot includes beyond torch's keys.
struct SnapshotOptions {
  /// Append torch's `snapshot` trace entry to each device's history first, as _snapshot() does.
  bool record_snapshot_entry = true;
  /// Members merged into the top-level "vramledger" object (e.g. replay details, the plan).
  SnapshotJson extra = SnapshotJson::object();
  /// Names a tag id for the per-block tags; unset: "tag<N>".
  std::function<std::string(std::uint32_t)> tag_name;
};

/// Figures of one device's segments, computed from a snapshot's own segment list (bytes).
struct SegmentFigures {
  std::int64_t reserved_bytes = 0;   // sum of total_size
  std::int64_t allocated_bytes = 0;  // sum of allocated_size
  std::int64_t active_bytes = 0;     // allocated + pending free
  std::int64_t requested_bytes = 0;  // requested sizes of active blocks
  std::int64_t free_bytes = 0;       // inactive blocks
  std::int64_t largest_free_block = 0;
  std::int64_t holes = 0;  // inactive blocks in segments that also hold active ones
  std::int64_t hole_bytes = 0;
  std::int64_t segments = 0;
  std::int64_t blocks = 0;
  double utilization = 0;               // allocated / reserved, now (0 if nothing reserved)
  double free_space_fragmentation = 0;  // 1 - largest free / free (0 if nothing free)
  struct PerStream {
    std::int64_t holes = 0;
    std::int64_t hole_bytes = 0;
    std::int64_t free_bytes = 0;
    std::int64_t largest_free_block = 0;
  };
  std::map<StreamId, PerStream> per_stream;
};

/// Computes SegmentFigures over `segments` (one device's), leaving out paused regions' ranges.
SegmentFigures ComputeSegmentFigures(const std::vector<SegmentInfo>& segments);

/// Builds the whole snapshot. `allocators` may hold nullptr for devices without an allocator;
/// `history` may be nullptr (then device_traces lists are empty and blocks have no frames).
/// device_traces has one list per device index up to the highest device seen. Takes each
/// allocator's lock in turn and may take the GIL (History::Frames): never call it while holding
/// a device lock or a lock that a thread holding the GIL could wait for.
SnapshotJson BuildSnapshot(const std::vector<const DeviceAllocator*>& allocators, History* history,
                           const SnapshotOptions& options = SnapshotOptions());

/// Writes the same document as JSON to `out`, streaming the trace entries one at a time (the
/// history is never held in memory as JSON). Invalid UTF-8 in frame names is replaced.
/// Errors: DataLoss when the stream fails.
absl::Status WriteSnapshotJson(std::ostream& out,
                               const std::vector<const DeviceAllocator*>& allocators,
                               History* history,
                               const SnapshotOptions& options = SnapshotOptions());

/// WriteSnapshotJson into `path` atomically (temporary file + rename).
/// Errors: those of WriteFileAtomically (the path and the system error in the message).
absl::Status WriteSnapshotJsonFile(const std::string& path,
                                   const std::vector<const DeviceAllocator*>& allocators,
                                   History* history,
                                   const SnapshotOptions& options = SnapshotOptions());

/// torch's allocator_settings dict for `options` (2.11 keys, torch's units).
SnapshotJson AllocatorSettingsJson(const Options& options);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_SNAPSHOT_H_
