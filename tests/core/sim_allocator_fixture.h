// A DeviceAllocator on a SimBackend (expandable segments unless a test's Make says otherwise), for
// the core's scenario tests (expandable segments, old mappings, pools, checkpoints, IPC): every
// Alloc and Free checks the allocator's invariants and that reserved bytes are exactly what the
// driver has mapped (plain segments included), each handle counted once however many addresses
// it is mapped at.
#ifndef VRAMLEDGER_TESTS_CORE_SIM_ALLOCATOR_FIXTURE_H_
#define VRAMLEDGER_TESTS_CORE_SIM_ALLOCATOR_FIXTURE_H_

#include <cstdint>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"

namespace vramledger {

class SimAllocatorTest : public ::testing::Test {
 protected:
  /// A fresh simulated card of `capacity` bytes and an allocator with options `conf`.
  void Make(const std::string& conf, std::size_t capacity = 64 * kGiB) {
    alloc_.reset();  // before its backend goes
    SimBackend::Config config;
    config.capacity = capacity;
    sim_ = std::make_unique<SimBackend>(config);
    auto o = ParseOptions(conf);
    ASSERT_TRUE(o.ok()) << o.status();
    alloc_ = std::make_unique<DeviceAllocator>(*o, sim_.get());
  }
  void SetUp() override { Make("expandable_segments:True,expandable_page_mb:2"); }
  void TearDown() override {
    if (alloc_ != nullptr) Check();
  }
  /// Invariants; reserved == mapped - aliased (+ plain segments); retiring == aliased.
  void Check() {
    ASSERT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
    std::size_t plain = 0;
    for (const auto& seg : SegmentsOf(*alloc_)) plain += seg.is_expandable ? 0 : seg.total_size;
    ASSERT_EQ(static_cast<std::size_t>(Reserved()),
              sim_->mapped_bytes() - sim_->aliased_bytes() + plain);
    ASSERT_EQ(static_cast<std::size_t>(OldMappingBytes()), sim_->aliased_bytes());
  }
  DevicePtr Alloc(std::size_t size, StreamId stream = 0) {
    auto p = alloc_->Malloc(size, stream);
    EXPECT_TRUE(p.ok()) << p.status();
    Check();
    return p.ok() ? *p : 0;
  }
  void Free(DevicePtr p) {
    ASSERT_TRUE(alloc_->Free(p).ok());
    Check();
  }
  std::int64_t Reserved() { return alloc_->GetStats().reserved_bytes[kAggregate].current; }
  std::int64_t Allocated() { return alloc_->GetStats().allocated_bytes[kAggregate].current; }
  std::int64_t OldMappingBytes() { return FragmentationOf(*alloc_).retiring_bytes; }
  std::int64_t Calls(DriverCall call) { return sim_->calls().count(call); }

  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TESTS_CORE_SIM_ALLOCATOR_FIXTURE_H_
