// Figures gathered while a trace replays: driver-call totals at a moment, per-step figures
// (StepTracker) and timeline sampling (TimelineSampler). Plain objects; not thread-safe.
#ifndef VRAMLEDGER_TOOLS_REPLAY_REPLAY_OBSERVERS_H_
#define VRAMLEDGER_TOOLS_REPLAY_REPLAY_OBSERVERS_H_

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "replay/replay.h"
#include "replay/trace_reader.h"
#include "vramledger/device_backend.h"

namespace vramledger {

/// Driver-call counts and modelled time (microseconds) per kind at one moment.
struct LedgerTotals {
  std::array<std::int64_t, kNumDriverCalls> counts{};
  std::array<double, kNumDriverCalls> micros{};

  /// The ledger's current totals.
  static LedgerTotals Of(const DriverCallLedger& ledger);
  /// this - earlier, kind by kind.
  LedgerTotals Minus(const LedgerTotals& earlier) const;
  std::int64_t calls() const;
  /// Calls that allocate, map, grant access to, unmap or free device memory: cudaMalloc,
  /// cudaFree and the cuMem* calls (address reservations included).
  std::int64_t memory_calls() const;
  double total_micros() const;
  /// Keyed by CUDA API name, every kind.
  std::map<std::string, std::int64_t> CountsByName() const;
  std::map<std::string, double> MicrosByName() const;
};

/// The replay's figures after an event (bytes, "all" pool, current).
struct ReplayState {
  std::int64_t allocated = 0;
  std::int64_t reserved = 0;
  std::int64_t requested = 0;
};

/// Per-step figures: Close() ends the open step (at a `snapshot` mark, or at the trace's end for
/// an unfinished one) and opens the next with the state of that moment.
class StepTracker {
 public:
  /// Steps are appended to `out` (borrowed). Call Open() before the first event.
  explicit StepTracker(std::vector<StepFigures>* out) : out_(out) {}

  /// Starts a step whose peaks begin at `state` and whose calls count from `ledger`.
  void Open(const ReplayState& state, const LedgerTotals& ledger);
  /// After every event; `replayed` for alloc / free_completed events the allocator saw.
  void Observe(const ReplayState& state, bool replayed);
  /// Ends the open step at `event`; complete = false for the events after the last mark.
  void Close(const TraceEvent& event, bool complete, const ReplayState& state,
             const LedgerTotals& ledger);
  /// Replayed events in the open step.
  std::int64_t open_events() const { return step_.events; }

 private:
  std::vector<StepFigures>* out_;
  StepFigures step_;
  std::int64_t start_calls_ = 0;
  std::int64_t start_memory_calls_ = 0;
  double start_us_ = 0.0;
};

/// Timeline sampling (ReplayResult::timeline): a point after every `every`-th event and after
/// the last one; within each interval the last point that set a running peak of each curve
/// rides along, so the maxima of the sampled curves are the true peaks.
class TimelineSampler {
 public:
  /// The curves whose running peaks are kept.
  enum Curve { kReserved = 0, kRecordedReserved = 1, kNumCurves = 2 };

  /// `every` >= 1; `total` is the number of events; points go to `out` (borrowed).
  TimelineSampler(std::int64_t every, std::int64_t total, std::vector<TimelinePoint>* out)
      : every_(every), total_(total), out_(out) {}

  /// True if a point is always taken after event `event` (1-based).
  bool IsSamplePoint(std::int64_t event) const { return event % every_ == 0 || event == total_; }

  /// `point` is the state after event point.event (1-based, increasing); `new_peak[c]` says
  /// that it set curve c's running peak. Events that are neither sample points nor new peaks
  /// may be skipped.
  void Add(const TimelinePoint& point, const std::array<bool, kNumCurves>& new_peak);

  /// ceil(total / kTimelineTargetPoints), at least 1: the automatic interval.
  static std::int64_t AutomaticInterval(std::int64_t total);

 private:
  std::int64_t every_;
  std::int64_t total_;
  std::vector<TimelinePoint>* out_;
  std::array<std::optional<TimelinePoint>, kNumCurves> pending_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_REPLAY_OBSERVERS_H_
