// Memory history with torch's record modes: per-device rings keeping exactly the N most recent
// trace entries, and interned stacks symbolised when read (docs/design/memory-history.md).
// Thread-safety: any thread; a mutex per ring and one for the stack table; OnEvent never blocks.
#ifndef VRAMLEDGER_LEDGER_HISTORY_H_
#define VRAMLEDGER_LEDGER_HISTORY_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ledger/stack_capture.h"
#include "vramledger/hooks.h"
#include "vramledger/types.h"

namespace vramledger {

/// torch's `enabled`: None (off, history cleared), "state" (stacks of live blocks only, no
/// trace entries), "all" (also the trace ring buffer).
enum class HistoryEnabled : std::uint8_t { kNone, kState, kAll };
/// torch's `context`: which events carry a stack. None: none; "state": live blocks only (trace
/// entries have no frames); "alloc": also alloc-side trace entries; "all": also free events.
enum class HistoryContext : std::uint8_t { kNone, kState, kAlloc, kAll };
/// torch's `stacks`: "python" (Python frames) or "all" (Python and native frames).
enum class HistoryStacks : std::uint8_t { kPython, kAll };

/// How the history records. The default is off.
struct HistorySettings {
  HistoryEnabled enabled = HistoryEnabled::kNone;
  HistoryContext context = HistoryContext::kAll;
  HistoryStacks stacks = HistoryStacks::kPython;
  /// Trace entries kept per device (the most recent ones); at least 1. torch's default is
  /// sys.maxsize (unbounded).
  std::size_t max_entries = SIZE_MAX;
};

/// Parses torch's spellings: `enabled` nullopt/"state"/"all", `context` nullopt/"state"/
/// "alloc"/"all", `stacks` "python"/"all"; `max_entries` >= 1.
/// Errors: InvalidArgument naming the argument, the value and the accepted values.
absl::StatusOr<HistorySettings> ParseHistorySettings(std::optional<std::string_view> enabled,
                                                     std::optional<std::string_view> context,
                                                     std::string_view stacks,
                                                     std::uint64_t max_entries);
/// torch's spellings of the settings ("all", "state", "alloc", "python", or "None").
std::string_view HistoryEnabledName(HistoryEnabled enabled);
std::string_view HistoryContextName(HistoryContext context);
std::string_view HistoryStacksName(HistoryStacks stacks);

/// One recorded trace entry. Bytes are bytes; time is epoch microseconds.
struct RecordedEntry {
  TraceAction action = TraceAction::kAlloc;
  DevicePtr addr = 0;    // for kOom: the device's free bytes (torch's device_free)
  std::size_t size = 0;  // torch's convention per action (see TraceEntry::size)
  StreamId stream = 0;
  std::int64_t time_us = 0;
  std::uint64_t stack = 0;  // interned stack id (0: no frames recorded)
  std::uint32_t tag = 0;
};

/// The history: an AllocatorHooks to install on one or more DeviceAllocators (it may be shared).
class History : public AllocatorHooks {
 public:
  /// Devices 0..kMaxDevices-1 are recorded; events of other devices are counted as dropped.
  static constexpr int kMaxDevices = 64;
  /// Frames kept per captured stack (innermost first).
  static constexpr int kMaxPythonFrames = 128;
  static constexpr int kMaxNativeFrames = 64;

  explicit History(const HistorySettings& settings = HistorySettings());
  History(const History&) = delete;
  History& operator=(const History&) = delete;

  /// Changes the settings (torch's _record_memory_history). kNone clears every ring; a new
  /// max_entries keeps the most recent entries; `clear` empties the rings. Interned stacks are
  /// kept (live blocks refer to them).
  void Configure(const HistorySettings& settings, bool clear = false) ABSL_LOCKS_EXCLUDED(mu_);
  HistorySettings settings() const;

  // ---- AllocatorHooks ----
  /// The interned id of the caller's stack, or 0 when this action records no context.
  std::uint64_t CaptureContext(TraceAction action) override ABSL_LOCKS_EXCLUDED(mu_);
  /// Appends `event` to its device's ring (when enabled is kAll). No allocation once the ring
  /// is full; no symbolisation.
  void OnEvent(const TraceEntry& event) override;

  /// Appends torch's `snapshot` entry (addr 0, size = active bytes) to `device`'s ring, as
  /// torch's _snapshot() does. No-op unless enabled is kAll.
  void RecordSnapshot(int device, std::size_t active_bytes);

  /// The entries of `device`, oldest first (empty for an unknown device).
  std::vector<RecordedEntry> Entries(int device) const;
  /// Devices whose ring holds entries, ascending.
  std::vector<int> DevicesWithEntries() const;
  /// Entries overwritten or dropped so far (all devices).
  std::uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

  /// The stack id recorded with the segment_alloc / segment_map of `address` on `device` while
  /// the segment lives (0 if none).
  std::uint64_t SegmentStack(int device, DevicePtr address) const;

  /// The frames of stack `id`, innermost first: native frames (when stacks were "all") then
  /// Python frames. Native frames are symbolised and Python lines computed here (both cached);
  /// computing a line takes the GIL (PyGILState_Ensure), so call this with no lock held that a
  /// thread holding the GIL could wait for (never under a device lock). Empty for id 0 or
  /// unknown ids.
  std::vector<Frame> Frames(std::uint64_t id) const ABSL_LOCKS_EXCLUDED(mu_, symbol_mu_);

  /// Interns an explicit stack (tests); returns its id (0 for an empty stack). `python` holds
  /// fake code addresses with lines as positions, named by `python_names` (same length);
  /// nothing is retained. Do not mix with real captures in one History.
  std::uint64_t InternForTesting(const std::vector<PythonFrameRef>& python,
                                 const std::vector<Frame>& python_names,
                                 const std::vector<std::uintptr_t>& native)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Distinct stacks interned so far.
  std::size_t num_stacks() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Ring {
    mutable absl::Mutex mu;
    std::vector<RecordedEntry> slots ABSL_GUARDED_BY(mu);
    // Next slot to overwrite once slots.size() == max_entries; 0 while the ring is filling.
    std::size_t head ABSL_GUARDED_BY(mu) = 0;
    absl::flat_hash_map<DevicePtr, std::uint64_t> segment_stacks ABSL_GUARDED_BY(mu);
  };
  struct StoredStack {
    std::uint64_t hash = 0;
    std::uint32_t python_begin = 0, python_count = 0;
    std::uint32_t native_begin = 0, native_count = 0;
    std::uint64_t next_same_hash = 0;  // collision chain (stack id), 0 = end
  };
  struct CodeName {
    std::string filename;
    std::string name;
  };

  // The id of a stored stack equal to the given one, or 0.
  std::uint64_t Find(std::uint64_t hash, const PythonFrameRef* python, int num_python,
                     const std::uintptr_t* native, int num_native) const ABSL_LOCKS_EXCLUDED(mu_);
  std::uint64_t FindLocked(std::uint64_t hash, const PythonFrameRef* python, int num_python,
                           const std::uintptr_t* native, int num_native) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retains and names the code objects of `python` not seen before. Pre: the GIL is held.
  void RetainNewCodes(const PythonFrameRef* python, int num_python) ABSL_LOCKS_EXCLUDED(mu_);
  // Stores the stack (unless a racing thread did) and returns its id.
  std::uint64_t Insert(std::uint64_t hash, const PythonFrameRef* python, int num_python,
                       const std::uintptr_t* native, int num_native) ABSL_LOCKS_EXCLUDED(mu_);
  bool SameStack(const StoredStack& s, const PythonFrameRef* python, int num_python,
                 const std::uintptr_t* native, int num_native) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Push(Ring& ring, const RecordedEntry& entry, std::size_t max_entries,
                   std::atomic<std::uint64_t>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ring.mu);
  static void Resize(Ring& ring, std::size_t max_entries) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ring.mu);

  std::atomic<HistoryEnabled> enabled_;
  std::atomic<HistoryContext> context_;
  std::atomic<HistoryStacks> stacks_;
  std::atomic<std::size_t> max_entries_;
  std::atomic<std::uint64_t> dropped_{0};
  absl::Mutex config_mu_;  // serialises Configure
  std::array<Ring, kMaxDevices> rings_;

  // The stack table. Ids are index + 1.
  mutable absl::Mutex mu_;
  std::vector<StoredStack> stacks_table_ ABSL_GUARDED_BY(mu_);
  std::vector<PythonFrameRef> python_frames_ ABSL_GUARDED_BY(mu_);
  std::vector<std::uintptr_t> native_frames_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::uint64_t, std::uint64_t> by_hash_ ABSL_GUARDED_BY(mu_);  // -> id
  absl::flat_hash_map<std::uintptr_t, CodeName> code_names_ ABSL_GUARDED_BY(mu_);

  // Symbolised native frames and Python lines, filled lazily by Frames().
  static std::pair<std::uintptr_t, int> LineKey(const PythonFrameRef& f) {
    return {f.code, f.position};
  }
  mutable absl::Mutex symbol_mu_;
  mutable absl::flat_hash_map<std::uintptr_t, Frame> symbols_ ABSL_GUARDED_BY(symbol_mu_);
  mutable absl::flat_hash_map<std::pair<std::uintptr_t, int>, int> lines_
      ABSL_GUARDED_BY(symbol_mu_);
  // Set by InternForTesting: Python positions are lines (the code objects are fake).
  std::atomic<bool> testing_lines_{false};
};

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_HISTORY_H_
