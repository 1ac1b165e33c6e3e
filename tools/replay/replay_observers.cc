// Replay observers: driver-call totals, per-step figures and timeline sampling.
// Plain objects; not thread-safe.
#include "replay/replay_observers.h"

#include <algorithm>

namespace vramledger {

LedgerTotals LedgerTotals::Of(const DriverCallLedger& ledger) {
  LedgerTotals t;
  for (int i = 0; i < kNumDriverCalls; ++i) {
    t.counts[i] = ledger.count(static_cast<DriverCall>(i));
    t.micros[i] = ledger.micros(static_cast<DriverCall>(i));
  }
  return t;
}

LedgerTotals LedgerTotals::Minus(const LedgerTotals& earlier) const {
  LedgerTotals t;
  for (int i = 0; i < kNumDriverCalls; ++i) {
    t.counts[i] = counts[i] - earlier.counts[i];
    t.micros[i] = micros[i] - earlier.micros[i];
  }
  return t;
}

std::int64_t LedgerTotals::calls() const {
  std::int64_t n = 0;
  for (std::int64_t c : counts) n += c;
  return n;
}

std::int64_t LedgerTotals::memory_calls() const {
  // Named, not a range of the enum: a kind added between them is not counted unseen.
  constexpr DriverCall kMemoryCalls[] = {
      DriverCall::kMalloc,      DriverCall::kFree,      DriverCall::kAddressReserve,
      DriverCall::kAddressFree, DriverCall::kMemCreate, DriverCall::kMemRelease,
      DriverCall::kMemMap,      DriverCall::kMemUnmap,  DriverCall::kMemSetAccess};
  std::int64_t n = 0;
  for (const DriverCall call : kMemoryCalls) n += counts[static_cast<int>(call)];
  return n;
}

double LedgerTotals::total_micros() const {
  double us = 0;
  for (double m : micros) us += m;
  return us;
}

std::map<std::string, std::int64_t> LedgerTotals::CountsByName() const {
  std::map<std::string, std::int64_t> out;
  for (int i = 0; i < kNumDriverCalls; ++i) {
    out[std::string(DriverCallName(static_cast<DriverCall>(i)))] = counts[i];
  }
  return out;
}

std::map<std::string, double> LedgerTotals::MicrosByName() const {
  std::map<std::string, double> out;
  for (int i = 0; i < kNumDriverCalls; ++i) {
    out[std::string(DriverCallName(static_cast<DriverCall>(i)))] = micros[i];
  }
  return out;
}

void StepTracker::Open(const ReplayState& state, const LedgerTotals& ledger) {
  step_ = StepFigures();
  step_.peak_allocated_bytes = state.allocated;
  step_.peak_reserved_bytes = state.reserved;
  start_calls_ = ledger.calls();
  start_memory_calls_ = ledger.memory_calls();
  start_us_ = ledger.total_micros();
}

void StepTracker::Observe(const ReplayState& state, bool replayed) {
  step_.peak_allocated_bytes = std::max(step_.peak_allocated_bytes, state.allocated);
  step_.peak_reserved_bytes = std::max(step_.peak_reserved_bytes, state.reserved);
  if (replayed) ++step_.events;
}

void StepTracker::Close(const TraceEvent& event, bool complete, const ReplayState& state,
                        const LedgerTotals& ledger) {
  step_.end_line = complete ? event.line : 0;
  step_.end_time_us = event.time_us;
  step_.complete = complete;
  step_.utilization = step_.peak_reserved_bytes > 0
                          ? static_cast<double>(step_.peak_allocated_bytes) /
                                static_cast<double>(step_.peak_reserved_bytes)
                          : 0.0;
  step_.driver_calls = ledger.calls() - start_calls_;
  step_.memory_calls = ledger.memory_calls() - start_memory_calls_;
  step_.modeled_driver_us = ledger.total_micros() - start_us_;
  out_->push_back(step_);
  Open(state, ledger);
}

void TimelineSampler::Add(const TimelinePoint& point,
                          const std::array<bool, kNumCurves>& new_peak) {
  if (!IsSamplePoint(point.event)) {
    for (int c = 0; c < kNumCurves; ++c) {
      if (new_peak[c]) pending_[c] = point;
    }
    return;
  }
  // A pending peak rides along unless this point raised the same curve again.
  std::vector<const TimelinePoint*> extra;
  for (int c = 0; c < kNumCurves; ++c) {
    if (pending_[c].has_value() && !new_peak[c]) extra.push_back(&*pending_[c]);
  }
  std::sort(extra.begin(), extra.end(),
            [](const TimelinePoint* a, const TimelinePoint* b) { return a->event < b->event; });
  for (std::size_t i = 0; i < extra.size(); ++i) {
    if (i > 0 && extra[i]->event == extra[i - 1]->event) continue;
    out_->push_back(*extra[i]);
  }
  for (std::optional<TimelinePoint>& p : pending_) p.reset();
  out_->push_back(point);
}

std::int64_t TimelineSampler::AutomaticInterval(std::int64_t total) {
  return std::max<std::int64_t>(1, (total + kTimelineTargetPoints - 1) / kTimelineTargetPoints);
}

}  // namespace vramledger
