// The shadow model of allocator_ops_fuzz: the blocks the caller owns (address, requested size,
// stream), checked after every operation against the allocator's segments and statistics and
// against what the SimBackend holds; every broken expectation aborts. Single-threaded.
#ifndef VRAMLEDGER_TESTS_FUZZ_ALLOCATOR_OPS_MODEL_H_
#define VRAMLEDGER_TESTS_FUZZ_ALLOCATOR_OPS_MODEL_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/pool_checkpoint.h"
#include "core/size_policy.h"
#include "device/sim_backend.h"
#include "fuzz_check.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"

namespace vramledger::fuzz {

class Model {
 public:
  Model(DeviceAllocator* alloc, SimBackend* sim,
        const std::array<std::size_t, kRoundupPower2Intervals>& divisions)
      : alloc_(alloc), sim_(sim), divisions_(divisions) {}

  /// Called before each operation: remembers the calls a capture forbids.
  void BeginOp(bool capturing) {
    capturing_ = capturing;
    forbidden_before_ = ForbiddenCalls();
    not_relaxed_before_ = sim_->calls_during_capture_not_relaxed();
    for (int k = 0; k < kNumDriverCalls; ++k) {
      calls_before_[k] = sim_->calls().count(static_cast<DriverCall>(k));
    }
  }

  /// `status` is OK, one of `codes`, or an injected driver error (once one has fired).
  void Allowed(const std::string& name, const absl::Status& status,
               std::initializer_list<absl::StatusCode> codes) {
    if (status.ok()) return;
    // VRAMLEDGER_FUZZ_TRACE=1 (allocator_ops_fuzz.cc): every refusal, allowed or not.
    if (std::getenv("VRAMLEDGER_FUZZ_TRACE") != nullptr) {
      std::fprintf(stderr, "  -> %s\n", status.ToString().c_str());
    }
    if (std::find(codes.begin(), codes.end(), status.code()) != codes.end()) return;
    if (status.code() == absl::StatusCode::kInternal && sim_->injected_failures() > 0) return;
    Fail(absl::StrCat(name, ": unexpected error ", status.ToString()));
  }

  void Malloc(const std::string& name, std::size_t size, StreamId stream,
              const absl::StatusOr<DevicePtr>& p) {
    if (!p.ok()) {
      // A request routed to a paused region is refused, naming it.
      if (!paused_.empty() && p.status().code() == absl::StatusCode::kFailedPrecondition) {
        Check(p.status().message().find("region") != std::string_view::npos,
              absl::StrCat(name, ": refusal names no region: ", p.status().ToString()));
        return;
      }
      Allowed(name, p.status(), {absl::StatusCode::kResourceExhausted});
      Check(size > 0, name + ": malloc(0) failed");
      Check(!p.status().message().empty(), name + ": an error without a message");
      return;
    }
    if (size == 0) {
      Check(*p == 0, name + ": malloc(0) returned an address");
      return;
    }
    Check(*p != 0, absl::StrCat(name, ": malloc(", size, ") returned null"));
    Check(*p % 512 == 0, absl::StrCat(name, ": unaligned address ", *p));
    Check(live_.count(*p) == 0, absl::StrCat(name, ": address ", *p, " handed out twice"));
    live_[*p] = {size, stream};
    order_.push_back(*p);
  }

  /// A live address chosen by `pick` (none when nothing is live).
  std::optional<DevicePtr> Pick(std::uint16_t pick) const {
    if (order_.empty()) return std::nullopt;
    return order_[pick % order_.size()];
  }
  DevicePtr LastFreed() const { return last_freed_; }

  /// A region paused (its blocks leave the device's statistics and lose their pages) or running.
  void SetPaused(const std::string& region, bool paused) {
    if (paused) {
      paused_.insert(region);
    } else {
      paused_.erase(region);
    }
  }

  void Free(const std::string& name, DevicePtr p) {
    // An injected error on the way (an event record) still frees the block.
    Allowed(name, alloc_->Free(p), {});
    Forget(p);
  }
  void FreeUnknown(const std::string& name, DevicePtr p) {
    if (live_.count(p) != 0) return Free(name, p);
    const absl::Status s = alloc_->Free(p);
    if (p == 0) return Check(s.ok(), name + ": free(0) failed");
    Check(s.code() == absl::StatusCode::kNotFound,
          absl::StrCat(name, ": free of unknown ", p, ": ", s.ToString()));
  }

  void Restore(const std::string& name, MempoolId pool,
               const absl::StatusOr<core::PoolRestore>& r) {
    Allowed(name, r.status(),
            {absl::StatusCode::kNotFound, absl::StatusCode::kFailedPrecondition,
             absl::StatusCode::kInvalidArgument, absl::StatusCode::kResourceExhausted});
    if (!r.ok()) return;
    for (DevicePtr p : r->freed) {
      Check(live_.count(p) != 0, absl::StrCat(name, ": restore of pool ", pool.first, " freed ", p,
                                              ", which the caller did not own"));
      Forget(p);
    }
    for (const core::BlockCheckpoint& b : r->allocated) {
      Check(live_.count(b.ptr) == 0, absl::StrCat(name, ": restore allocated live ", b.ptr));
      live_[b.ptr] = {b.requested_size, b.stream};
      order_.push_back(b.ptr);
    }
  }

  void FreeEverything() {
    while (!order_.empty()) {
      const DevicePtr p = order_.back();
      Check(alloc_->Free(p).ok(), "free at finish");
      Forget(p);
    }
  }

  /// Every identity between the shadow, the segments, the statistics and the device.
  void CheckAll(const std::string& name) {
    const absl::Status inv = alloc_->CheckInvariants();
    Check(inv.ok(), absl::StrCat(name, ": ", inv.ToString()));
    const DeviceStats s = alloc_->GetStats();
    std::int64_t allocated = 0, active = 0, reserved = 0, plain = 0;
    std::size_t owned = 0, owned_paused = 0;
    DevicePtr end_of_last = 0;
    // A paused region's segments keep their blocks, but not its pages nor its statistics.
    std::map<DevicePtr, std::pair<const BlockInfo*, bool>> blocks;  // and whether paused
    const std::vector<SegmentInfo> segments = SegmentsOf(*alloc_);
    std::size_t paused_segments = 0;
    for (const SegmentInfo& seg : segments) {
      Check(!seg.paused || seg.is_expandable, name + ": a paused plain segment");
      paused_segments += seg.paused;
      if (!seg.paused) reserved += static_cast<std::int64_t>(seg.total_size);
      if (!seg.is_expandable) plain += static_cast<std::int64_t>(seg.total_size);
      for (const BlockInfo& b : seg.blocks) blocks[b.address] = {&b, seg.paused};
    }
    Check(paused_segments == 0 || !paused_.empty(), name + ": a paused segment, no paused region");
    // A paused region holds device memory only where a failed resume could not unmap a handle
    // (RegionInfo::mapped_bytes): reserved, as the driver holds it. Pages a failed pause lost
    // (RegionInfo::lost_bytes) are in no segment the snapshot lists: the blocks on them are
    // missing from it or clipped to their mapped part (at either end), and checked against the
    // stats within those bytes (the allocator's own CheckInvariants still walks them whole).
    std::int64_t lost = 0;
    for (const RegionInfo& r : alloc_->Regions()) {
      if (r.paused) reserved += static_cast<std::int64_t>(r.mapped_bytes);
      lost += static_cast<std::int64_t>(r.lost_bytes);
    }
    for (const auto& [address, entry] : blocks) {
      const auto& [b, paused] = entry;
      Check(address >= end_of_last, absl::StrCat(name, ": block ", address, " overlaps"));
      end_of_last = address + b->size;
      const std::string_view state = b->state;
      if (state == "inactive") continue;
      if (!paused) active += static_cast<std::int64_t>(b->size);
      if (state != "active_allocated") continue;
      if (!paused) allocated += static_cast<std::int64_t>(b->size);
      auto it = live_.find(address);
      // Clipped: it starts on a lost page, or it is the part of a block after lost pages.
      if (it == live_.end() && lost > 0) continue;
      ++owned;
      owned_paused += paused;
      Check(it != live_.end(), absl::StrCat(name, ": allocated block ", address, " not owned"));
      Check(b->requested_size == it->second.size,
            absl::StrCat(name, ": block ", address, " requested ", b->requested_size,
                         " != ", it->second.size));
      // A block that runs onto a lost page is clipped there too: the snapshot lists each mapped
      // run of its segment, so such a block shows only its part up to the lost pages.
      Check(lost > 0 || b->size >= size_policy::RoundSize(it->second.size, divisions_),
            absl::StrCat(name, ": block ", address, " smaller than its rounded request: size ",
                         b->size, " of ", it->second.size));
    }
    Check(lost > 0 ? owned <= live_.size() : owned == live_.size(),
          absl::StrCat(name, ": ", live_.size(), " blocks owned, ", owned, " allocated"));
    Check(
        s.allocation[kAggregate].current == static_cast<std::int64_t>(live_.size() - owned_paused),
        name + ": allocation count");
    auto within_lost = [lost](std::int64_t stat, std::int64_t seen) {
      return stat >= seen && stat - seen <= lost;
    };
    Check(within_lost(s.allocated_bytes[kAggregate].current, allocated),
          absl::StrCat(name, ": allocated_bytes ", s.allocated_bytes[kAggregate].current,
                       " != the segments' ", allocated, " (lost pages ", lost, ")"));
    Check(within_lost(s.active_bytes[kAggregate].current, active),
          absl::StrCat(name, ": active_bytes ", s.active_bytes[kAggregate].current,
                       " != the segments' ", active, " (lost pages ", lost, ")"));
    Check(s.reserved_bytes[kAggregate].current == reserved,
          absl::StrCat(name, ": reserved_bytes ", s.reserved_bytes[kAggregate].current,
                       " != the running segments' ", reserved));
    Check(s.allocated_bytes[kAggregate].current <= s.allocated_bytes[kAggregate].peak,
          name + ": allocated above its peak");
    // Reserved is what the driver holds: mapped pages (each handle once) plus plain segments.
    const std::size_t device = sim_->mapped_bytes() - sim_->aliased_bytes();
    Check(static_cast<std::size_t>(reserved - plain) == device,
          absl::StrCat(name, ": reserved ", reserved, " - plain ", plain, " != mapped ", device));
    Check(
        static_cast<std::size_t>(FragmentationOf(*alloc_).retiring_bytes) == sim_->aliased_bytes(),
        name + ": retiring bytes != aliased mappings");
    for (const SegmentInfo& seg : segments) {
      if (!seg.is_expandable || seg.paused) continue;
      for (const BlockInfo& b : seg.blocks) {
        if (std::string_view(b.state) == "inactive") continue;
        Check(sim_->IsAccessible(b.address, b.size),
              absl::StrCat(name, ": live block ", b.address, " on a page without access"));
      }
    }
    Check(sim_->calls_during_capture_not_relaxed() == not_relaxed_before_,
          absl::StrCat(name, ": a driver call during a capture outside relaxed mode; ", Calls()));
    if (capturing_) {
      Check(ForbiddenCalls() == forbidden_before_,
            absl::StrCat(name, ": a free, event record or query, or event wait during a capture; ",
                         Calls()));
    }
  }

  /// After FreeEverything and empty_cache: nothing reserved, nothing held on the device.
  void CheckEmpty() {
    const DeviceStats s = alloc_->GetStats();
    Check(s.reserved_bytes[kAggregate].current == 0,
          absl::StrCat("reserved ", s.reserved_bytes[kAggregate].current, " after empty_cache"));
    Check(s.active_bytes[kAggregate].current == 0, "active bytes after freeing everything");
    Check(s.requested_bytes[kAggregate].current == 0, "requested bytes after freeing everything");
    Check(sim_->used_bytes() == 0, absl::StrCat("leaked ", sim_->used_bytes(), " device bytes"));
    Check(sim_->mapped_bytes() == 0, "pages still mapped after empty_cache");
  }

 private:
  struct Live {
    std::size_t size;
    StreamId stream;
  };
  void Forget(DevicePtr p) {
    live_.erase(p);
    order_.erase(std::find(order_.begin(), order_.end(), p));
    last_freed_ = p;
  }
  // The driver calls of the operation, by kind.
  std::string Calls() const {
    std::string out = "calls:";
    for (int k = 0; k < kNumDriverCalls; ++k) {
      const auto call = static_cast<DriverCall>(k);
      const std::int64_t n = sim_->calls().count(call) - calls_before_[k];
      if (n != 0) absl::StrAppend(&out, " ", std::string(DriverCallName(call)), " x", n);
    }
    return out;
  }
  std::int64_t ForbiddenCalls() const {
    std::int64_t n = 0;
    // What a capture forbids (device_allocator.h, BeginAllocateToPool): an event recorded or
    // queried, a cudaFree, a synchronize on an event, a reservation returned. Page moves of the
    // device's own expandable pools may unmap and wait for their source stream (relaxed mode;
    // page-recycling.md), and a handle that was never mapped may be released.
    for (DriverCall c : {DriverCall::kFree, DriverCall::kEventRecord, DriverCall::kEventQuery,
                         DriverCall::kEventSynchronize, DriverCall::kAddressFree}) {
      n += sim_->calls().count(c);
    }
    return n;
  }

  DeviceAllocator* alloc_;
  SimBackend* sim_;
  std::array<std::size_t, kRoundupPower2Intervals> divisions_;
  std::map<DevicePtr, Live> live_;
  std::set<std::string> paused_;  // the regions paused
  std::vector<DevicePtr> order_;
  DevicePtr last_freed_ = 0;
  bool capturing_ = false;
  std::int64_t forbidden_before_ = 0;
  std::int64_t not_relaxed_before_ = 0;
  std::array<std::int64_t, kNumDriverCalls> calls_before_{};
};

}  // namespace vramledger::fuzz

#endif  // VRAMLEDGER_TESTS_FUZZ_ALLOCATOR_OPS_MODEL_H_
