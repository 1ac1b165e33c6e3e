// The allocator's statistics, per pool (small, large): counters updated on the hot path, the
// "all" row and every `freed` total derived when stats are read (docs/design/locking.md, "Hot
// path"), and the updates one allocation, free or segment makes. Not locked: the owning
// DeviceAllocatorImpl guards it with its mutex.
#ifndef VRAMLEDGER_CORE_POOL_STATS_H_
#define VRAMLEDGER_CORE_POOL_STATS_H_

#include <algorithm>
#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "vramledger/stats.h"

namespace vramledger::core {

/// One of torch's per-pool stats ("allocated_bytes", "active", ...) over small and large pools.
/// An increase updates the pool's current, peak and allocated total and the peak of the sum
/// (torch's "all" peak is the peak of the sum, so it is kept exact); a decrease only lowers the
/// pool's current. Read back as a StatArray, with torch's meanings, by ToStatArray().
class PoolStat {
 public:
  /// Adds `amount` (>= 0) to pool `pool` (kSmallPool or kLargePool).
  void Increase(StatType pool, std::int64_t amount) {
    // In registers: stores through Block fields (size_t) may alias these, so read each once.
    const std::int64_t now = current_[pool] + amount;
    current_[pool] = now;
    allocated_[pool] += amount;
    if (now > peak_[pool]) peak_[pool] = now;
    const std::int64_t all = now + current_[kSmallPool + kLargePool - pool];  // the other pool
    if (all > peak_[kAggregate]) peak_[kAggregate] = all;
  }
  /// Removes `amount` (>= 0) from pool `pool`. The freed total follows from the others.
  void Decrease(StatType pool, std::int64_t amount) { current_[pool] -= amount; }
  /// Increase for amount >= 0, else Decrease by -amount.
  void Add(StatType pool, std::int64_t amount) {
    if (amount >= 0) {
      Increase(pool, amount);
    } else {
      Decrease(pool, -amount);
    }
  }

  /// Moves `amount` (>= 0) from pool `from` to pool `to` (an expandable page changing pool):
  /// both pools count it as freed / allocated, the "all" row's totals do not change.
  void Move(StatType from, StatType to, std::int64_t amount) {
    Decrease(from, amount);
    Increase(to, amount);
    moved_ += amount;
  }

  /// Takes `amount` (>= 0) out of pool `pool`'s current value without counting it as freed: a
  /// paused region's live blocks leave the figures while its pages are gone (regions.md).
  void Withdraw(StatType pool, std::int64_t amount) {
    current_[pool] -= amount;
    base_[pool] -= amount;
  }
  /// Puts back what Withdraw took, without counting it as allocated; the peaks follow when
  /// `update_peak` (a resume; not a free of a paused block, which leaves again at once).
  void Readmit(StatType pool, std::int64_t amount, bool update_peak) {
    current_[pool] += amount;
    base_[pool] += amount;
    if (!update_peak) return;
    peak_[pool] = std::max(peak_[pool], current_[pool]);
    peak_[kAggregate] = std::max(peak_[kAggregate], current(kAggregate));
  }

  /// Current value of `type` (kAggregate: the sum of both pools).
  std::int64_t current(StatType type) const {
    return type == kAggregate ? current_[kSmallPool] + current_[kLargePool] : current_[type];
  }
  /// Peak of `type` since the last ResetPeak.
  std::int64_t peak(StatType type) const { return peak_[type]; }

  /// torch's four numbers per row. Per pool, freed = (current at the last reset of the totals)
  /// + allocated - current; "all" sums the pools' current and totals and keeps its own peak.
  StatArray ToStatArray() const {
    StatArray out;
    for (StatType p : {kSmallPool, kLargePool}) {
      out[p].current = current_[p];
      out[p].peak = peak_[p];
      out[p].allocated = allocated_[p];
      out[p].freed = base_[p] + allocated_[p] - current_[p];
      out[kAggregate].current += out[p].current;
      out[kAggregate].allocated += out[p].allocated;
      out[kAggregate].freed += out[p].freed;
    }
    out[kAggregate].allocated -= moved_;
    out[kAggregate].freed -= moved_;
    out[kAggregate].peak = peak_[kAggregate];
    return out;
  }

  /// Per pool and for "all": 0 <= current <= peak, and freed >= 0.
  absl::Status CheckInvariants() const {
    const StatArray a = ToStatArray();
    for (int t = 0; t < kNumStatTypes; ++t) {
      if (a[t].current < 0 || a[t].current > a[t].peak || a[t].freed < 0) {
        return absl::InternalError(absl::StrCat("stat row ", t, ": current ", a[t].current,
                                                ", peak ", a[t].peak, ", freed ", a[t].freed));
      }
    }
    return absl::OkStatus();
  }

  /// Every peak becomes its current value.
  void ResetPeak() {
    for (StatType p : {kSmallPool, kLargePool}) peak_[p] = current_[p];
    peak_[kAggregate] = current(kAggregate);
  }
  /// The allocated and freed totals restart from 0.
  void ResetAccumulated() {
    for (StatType p : {kSmallPool, kLargePool}) {
      allocated_[p] = 0;
      base_[p] = current_[p];
    }
    moved_ = 0;
  }

 private:
  // Indexed by StatType; current_[kAggregate], allocated_[kAggregate] and base_[kAggregate]
  // stay 0 (derived), peak_[kAggregate] is the peak of the sum.
  std::array<std::int64_t, kNumStatTypes> current_{};
  std::array<std::int64_t, kNumStatTypes> peak_{};
  std::array<std::int64_t, kNumStatTypes> allocated_{};
  std::array<std::int64_t, kNumStatTypes> base_{};  // current at the last ResetAccumulated
  std::int64_t moved_ = 0;  // Move()d since the last ResetAccumulated: not in the "all" totals
};

/// Everything DeviceStats reports, with the per-pool rows as PoolStats. ToDeviceStats() gives
/// the public form (GetStats and the hooks' view).
struct CoreStats {
  PoolStat allocation;
  PoolStat segment;
  PoolStat active;
  PoolStat inactive_split;
  PoolStat allocated_bytes;
  PoolStat reserved_bytes;
  PoolStat active_bytes;
  PoolStat inactive_split_bytes;
  PoolStat requested_bytes;
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  Stat oversize_allocations;
  Stat oversize_segments;
  std::int64_t max_split_size = -1;

  /// Peak allocated / peak reserved (0 when nothing was reserved), as DeviceStats::utilization.
  double utilization() const {
    const auto r = reserved_bytes.peak(kAggregate);
    return r > 0 ? static_cast<double>(allocated_bytes.peak(kAggregate)) / static_cast<double>(r)
                 : 0.0;
  }

  /// The public form. largest_free_block_bytes is left 0 (the allocator fills it in).
  DeviceStats ToDeviceStats() const {
    DeviceStats s;
    s.allocation = allocation.ToStatArray();
    s.segment = segment.ToStatArray();
    s.active = active.ToStatArray();
    s.inactive_split = inactive_split.ToStatArray();
    s.allocated_bytes = allocated_bytes.ToStatArray();
    s.reserved_bytes = reserved_bytes.ToStatArray();
    s.active_bytes = active_bytes.ToStatArray();
    s.inactive_split_bytes = inactive_split_bytes.ToStatArray();
    s.requested_bytes = requested_bytes.ToStatArray();
    s.num_alloc_retries = num_alloc_retries;
    s.num_ooms = num_ooms;
    s.num_sync_all_streams = num_sync_all_streams;
    s.num_device_alloc = num_device_alloc;
    s.num_device_free = num_device_free;
    s.oversize_allocations = oversize_allocations;
    s.oversize_segments = oversize_segments;
    s.max_split_size = max_split_size;
    return s;
  }

  /// A block of `bytes` (`requested` by the caller) of pool `type` handed out.
  void Allocated(StatType type, std::int64_t bytes, std::int64_t requested) {
    allocation.Increase(type, 1);
    allocated_bytes.Increase(type, bytes);
    active.Increase(type, 1);
    active_bytes.Increase(type, bytes);
    requested_bytes.Increase(type, requested);
  }
  /// Its free requested: no longer allocated, still active until its events complete.
  void FreeRequested(StatType type, std::int64_t bytes) {
    allocation.Decrease(type, 1);
    allocated_bytes.Decrease(type, bytes);
  }
  /// Its free completed: no longer active.
  void FreeCompleted(StatType type, std::int64_t bytes, std::int64_t requested) {
    active.Decrease(type, 1);
    active_bytes.Decrease(type, bytes);
    requested_bytes.Decrease(type, requested);
  }
  /// A segment of `bytes` reserved (a cudaMalloc) or returned (a cudaFree).
  void SegmentReserved(StatType type, std::int64_t bytes) {
    segment.Increase(type, 1);
    reserved_bytes.Increase(type, bytes);
    ++num_device_alloc;
  }
  void SegmentReleased(StatType type, std::int64_t bytes) {
    segment.Decrease(type, 1);
    reserved_bytes.Decrease(type, bytes);
    ++num_device_free;
  }

  /// Each row's invariants (PoolStat::CheckInvariants); allocated <= active <= reserved +
  /// `unmapped_live` (bytes of pages a failed pause lost under live blocks: Region::lost); the
  /// counters are not negative.
  absl::Status CheckInvariants(std::int64_t unmapped_live = 0) const {
    const char* names[] = {
        "allocation",      "segment",        "active",       "inactive_split",
        "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
        "requested_bytes"};
    const std::array<const PoolStat*, 9> all = {
        &allocation,      &segment,        &active,       &inactive_split,
        &allocated_bytes, &reserved_bytes, &active_bytes, &inactive_split_bytes,
        &requested_bytes};
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (absl::Status s = all[i]->CheckInvariants(); !s.ok()) {
        return absl::InternalError(absl::StrCat(names[i], ": ", s.message()));
      }
    }
    // For "all" only: an expandable page's reserved bytes move between the pools (Move) apart
    // from the blocks' active bytes.
    const std::int64_t allocated_now = allocated_bytes.current(kAggregate);
    const std::int64_t active_now = active_bytes.current(kAggregate);
    const std::int64_t reserved_now = reserved_bytes.current(kAggregate);
    if (allocated_now > active_now || active_now > reserved_now + unmapped_live) {
      return absl::InternalError(absl::StrCat("allocated ", allocated_now, ", active ", active_now,
                                              ", reserved ", reserved_now));
    }
    for (std::int64_t n :
         {num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free}) {
      if (n < 0) return absl::InternalError("negative stat counter");
    }
    return absl::OkStatus();
  }

  /// reset_peak_memory_stats().
  void ResetPeak() {
    for (PoolStat* p : rows()) p->ResetPeak();
    oversize_allocations.ResetPeak();
    oversize_segments.ResetPeak();
  }
  /// reset_accumulated_memory_stats().
  void ResetAccumulated() {
    for (PoolStat* p : rows()) p->ResetAccumulated();
    oversize_allocations.ResetAccumulated();
    oversize_segments.ResetAccumulated();
    num_alloc_retries = num_ooms = num_sync_all_streams = 0;
    num_device_alloc = num_device_free = 0;
  }

 private:
  std::array<PoolStat*, 9> rows() {
    return {&allocation,      &segment,        &active,       &inactive_split,
            &allocated_bytes, &reserved_bytes, &active_bytes, &inactive_split_bytes,
            &requested_bytes};
  }
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_POOL_STATS_H_
