// A CPU backup's pinned buffers are allocated before the pause takes the allocator's lock
// (cudaHostAlloc takes about half a second per GiB on an H200): other threads allocate and free
// meanwhile, and the pause backs up what is live when it runs.
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "regions_fixture.h"
#include "sim_forwarding_backend.h"

namespace vramledger {
namespace {

// Runs `on_pin` before each pinned allocation (once: a hook that allocates pins nothing itself).
class PinHookBackend final : public SimForwardingBackend {
 public:
  explicit PinHookBackend(SimBackend* sim) : SimForwardingBackend(sim) {}
  absl::StatusOr<void*> HostAllocPinned(std::size_t bytes) override {
    if (auto hook = std::exchange(on_pin, nullptr)) hook();
    ++pins;
    return sim_->HostAllocPinned(bytes);
  }
  std::function<void()> on_pin;
  int pins = 0;
};

class RegionsPinningTest : public RegionsTest {
 protected:
  void SetUp() override {
    RegionsTest::SetUp();
    alloc_.reset();
    hooked_ = std::make_unique<PinHookBackend>(sim_.get());
    auto o = ParseOptions("expandable_segments:True,expandable_page_mb:2");
    ASSERT_TRUE(o.ok()) << o.status();
    alloc_ = std::make_unique<DeviceAllocator>(*o, hooked_.get());
  }
  void TearDown() override {
    RegionsTest::TearDown();
    alloc_.reset();  // before the backend it uses
  }
  std::unique_ptr<PinHookBackend> hooked_;
};

TEST_F(RegionsPinningTest, OtherThreadsAllocateWhileAPauseIsPinning) {
  const DevicePtr a = AllocIn("train", 6 * kMiB);
  Write(a, Pattern(6 * kMiB, 1));
  DevicePtr other = 0;
  hooked_->on_pin = [&] {
    // Under the lock this allocation would wait for the pause, and the pause for it.
    auto served = std::async(std::launch::async, [&] { return alloc_->Malloc(kMiB, 0); });
    ASSERT_EQ(served.wait_for(std::chrono::seconds(20)), std::future_status::ready)
        << "an allocation waited for the pause's pinning";
    auto p = served.get();
    ASSERT_TRUE(p.ok()) << p.status();
    other = *p;
  };
  const RegionPauseResult paused = Pause("train", RegionBackup::kCpu);
  EXPECT_EQ(hooked_->pins, 1);
  EXPECT_EQ(paused.backed_up_bytes, 6 * kMiB);
  ASSERT_NE(other, 0u);
  Free(other);
  Resume("train");
  EXPECT_EQ(Read(a, 6 * kMiB), Pattern(6 * kMiB, 1));
  EXPECT_EQ(sim_->pinned_bytes(), 0u);
  Free(a);
}

TEST_F(RegionsPinningTest, ABlockAllocatedWhilePinningIsBackedUpToo) {
  const DevicePtr a = AllocIn("train", 4 * kMiB);
  Write(a, Pattern(4 * kMiB, 2));
  DevicePtr b = 0;
  hooked_->on_pin = [&] {  // the pause's own thread, the lock not held
    b = AllocIn("train", 6 * kMiB);
    Write(b, Pattern(6 * kMiB, 3));
  };
  const RegionPauseResult paused = Pause("train", RegionBackup::kCpu);
  EXPECT_EQ(paused.backed_up_bytes, 10 * kMiB);
  // The buffer pinned ahead (4 MiB) was too small: the pause pinned one of 10 MiB and freed it.
  EXPECT_EQ(hooked_->pins, 2);
  EXPECT_EQ(sim_->pinned_bytes(), 10 * kMiB);
  Resume("train");
  EXPECT_EQ(Read(a, 4 * kMiB), Pattern(4 * kMiB, 2));
  EXPECT_EQ(Read(b, 6 * kMiB), Pattern(6 * kMiB, 3));
  EXPECT_EQ(sim_->pinned_bytes(), 0u);
  Free(a);
  Free(b);
}

TEST_F(RegionsPinningTest, ABufferPinnedForASegmentFreedMeanwhileIsFreed) {
  const DevicePtr a = AllocIn("train", 4 * kMiB, /*stream=*/0);
  const DevicePtr b = AllocIn("train", 8 * kMiB, /*stream=*/1);  // a segment of its own
  Write(a, Pattern(4 * kMiB, 4));
  hooked_->on_pin = [&] { Free(b); };
  const RegionPauseResult paused = Pause("train", RegionBackup::kCpu);
  EXPECT_EQ(hooked_->pins, 2);  // one per segment, both ahead of the lock
  EXPECT_EQ(paused.backed_up_bytes, 4 * kMiB);
  EXPECT_EQ(sim_->pinned_bytes(), 4 * kMiB);  // the 8 MiB one was not used: freed
  Resume("train");
  EXPECT_EQ(Read(a, 4 * kMiB), Pattern(4 * kMiB, 4));
  Free(a);
}

TEST_F(RegionsPinningTest, APinFailureAheadOfTheLockChangesNothing) {
  const DevicePtr a = AllocIn("train", 4 * kMiB, /*stream=*/0);
  const DevicePtr b = AllocIn("train", 8 * kMiB, /*stream=*/1);
  sim_->SetPinnedCapacity(6 * kMiB);  // the first segment's buffer fits, the second's does not
  const RegionInfo before = Info("train");
  auto refused = alloc_->PauseRegion("train", RegionBackup::kCpu);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "pause of region 'train': pinned host memory for its backup (8.00 MiB)"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(sim_->pinned_bytes(), 0u);  // the first buffer is freed again
  EXPECT_FALSE(Info("train").paused);
  EXPECT_EQ(Info("train").reserved_bytes, before.reserved_bytes);
  Check();
  Free(a);
  Free(b);
}

}  // namespace
}  // namespace vramledger
