// Pausable regions on a SimBackend: SimAllocatorTest plus helpers to allocate inside a region,
// write and read patterns, and a full description of the allocator's state (regions, stats,
// segments with their blocks, the simulated card's usage) that failure tests compare before and
// after a refused pause or resume.
#ifndef VRAMLEDGER_TESTS_CORE_REGIONS_FIXTURE_H_
#define VRAMLEDGER_TESTS_CORE_REGIONS_FIXTURE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "sim_allocator_fixture.h"

namespace vramledger {

class RegionsTest : public SimAllocatorTest {
 protected:
  /// A filter that accepts the calling thread's allocations, as the runtime's region scope does.
  static StreamFilter ThisThread() {
    const std::thread::id self = std::this_thread::get_id();
    return [self](StreamId) { return std::this_thread::get_id() == self; };
  }
  void Begin(std::string_view name) {
    auto id = alloc_->BeginRegion(name, ThisThread());
    ASSERT_TRUE(id.ok()) << id.status();
  }
  void End(std::string_view name) { ASSERT_TRUE(alloc_->EndRegion(name).ok()); }
  /// Allocates `size` bytes inside region `name`.
  DevicePtr AllocIn(std::string_view name, std::size_t size, StreamId stream = 0) {
    Begin(name);
    const DevicePtr p = Alloc(size, stream);
    End(name);
    return p;
  }
  RegionInfo Info(std::string_view name) {
    for (const RegionInfo& r : alloc_->Regions()) {
      if (r.name == name) return r;
    }
    ADD_FAILURE() << "no region " << name;
    return {};
  }
  RegionPauseResult Pause(std::string_view name, RegionBackup backup) {
    auto r = alloc_->PauseRegion(name, backup);
    EXPECT_TRUE(r.ok()) << r.status();
    Check();
    return r.ok() ? *r : RegionPauseResult{};
  }
  RegionResumeResult Resume(std::string_view name, bool keep = false) {
    auto r = alloc_->ResumeRegion(name, keep);
    EXPECT_TRUE(r.ok()) << r.status();
    Check();
    return r.ok() ? *r : RegionResumeResult{};
  }

  /// A pattern of `size` bytes that depends on `seed`.
  static std::vector<std::uint8_t> Pattern(std::size_t size, std::uint32_t seed) {
    std::vector<std::uint8_t> out(size);
    std::uint32_t x = seed * 2654435761u + 1;
    for (auto& b : out) {
      x = x * 1664525u + 1013904223u;
      b = static_cast<std::uint8_t>(x >> 24);
    }
    return out;
  }
  void Write(DevicePtr p, const std::vector<std::uint8_t>& bytes) {
    ASSERT_TRUE(sim_->WriteDevice(p, bytes.data(), bytes.size()).ok());
  }
  std::vector<std::uint8_t> Read(DevicePtr p, std::size_t size) {
    std::vector<std::uint8_t> out(size);
    absl::Status s = sim_->ReadDevice(out.data(), p, size);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  /// Everything a failed pause or resume must leave as it was.
  std::string Describe() {
    std::string out;
    for (const RegionInfo& r : alloc_->Regions()) {
      absl::StrAppend(&out, "region ", r.name, " paused=", r.paused, " reserved=", r.reserved_bytes,
                      " mapped=", r.mapped_bytes, " allocated=", r.allocated_bytes,
                      " paused_bytes=", r.paused_bytes, " backed_up=", r.backed_up_bytes,
                      " kept=", r.host_buffer_bytes, " lost=", r.lost_bytes, "\n");
    }
    const DeviceStats st = alloc_->GetStats();
    for (const StatArray* a : {&st.allocated_bytes, &st.reserved_bytes, &st.active_bytes,
                               &st.requested_bytes, &st.allocation, &st.active}) {
      for (int t = 0; t < kNumStatTypes; ++t) absl::StrAppend(&out, (*a)[t].current, " ");
      absl::StrAppend(&out, "\n");
    }
    for (const SegmentInfo& seg : SegmentsOf(*alloc_)) {
      absl::StrAppend(&out, "segment ", seg.address, "+", seg.total_size, " paused=", seg.paused,
                      " handles=", seg.handles, " pool=", seg.pool_id.first, ",",
                      seg.pool_id.second, ":");
      for (const BlockInfo& b : seg.blocks) {
        absl::StrAppend(&out, " ", b.address, "+", b.size, "/", b.state);
      }
      absl::StrAppend(&out, "\n");
    }
    absl::StrAppend(&out, "card used=", sim_->used_bytes(), " mapped=", sim_->mapped_bytes(),
                    " pinned=", sim_->pinned_bytes(), "\n");
    return out;
  }
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TESTS_CORE_REGIONS_FIXTURE_H_
