// ContiguousSegmentsScope's depth API (Enter / Exit / depth) on SimBackend: nesting with the RAII
// form, exit without enter, per-thread depth, and where allocations land with expandable
// segments on (plain single-handle segment inside a scope, expandable segment outside).
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;

// The segment that holds `ptr`, or nullptr.
const SegmentInfo* SegmentOf(const std::vector<SegmentInfo>& segments, DevicePtr ptr) {
  for (const SegmentInfo& s : segments) {
    if (ptr >= s.address && ptr < s.address + s.total_size) return &s;
  }
  return nullptr;
}

TEST(ContiguousScopeDepthTest, EnterAndExitNestWithTheRaiiForm) {
  ASSERT_EQ(ContiguousSegmentsScope::depth(), 0);
  ContiguousSegmentsScope::Enter();
  EXPECT_EQ(ContiguousSegmentsScope::depth(), 1);
  EXPECT_TRUE(ContiguousSegmentsScope::active());
  {
    ContiguousSegmentsScope raii;
    EXPECT_EQ(ContiguousSegmentsScope::depth(), 2);
    ContiguousSegmentsScope::Enter();
    EXPECT_EQ(ContiguousSegmentsScope::depth(), 3);
    ASSERT_TRUE(ContiguousSegmentsScope::Exit().ok());
  }
  EXPECT_EQ(ContiguousSegmentsScope::depth(), 1);
  ASSERT_TRUE(ContiguousSegmentsScope::Exit().ok());
  EXPECT_EQ(ContiguousSegmentsScope::depth(), 0);
  EXPECT_FALSE(ContiguousSegmentsScope::active());
}

TEST(ContiguousScopeDepthTest, ExitWithoutEnterFailsAndLeavesDepthAtZero) {
  const absl::Status s = ContiguousSegmentsScope::Exit();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("exit without a matching enter"));
  EXPECT_EQ(ContiguousSegmentsScope::depth(), 0);
  // A later enter/exit pair still works.
  ContiguousSegmentsScope::Enter();
  EXPECT_TRUE(ContiguousSegmentsScope::Exit().ok());
  EXPECT_FALSE(ContiguousSegmentsScope::Exit().ok());
}

TEST(ContiguousScopeDepthTest, DepthIsPerThread) {
  ContiguousSegmentsScope::Enter();
  ContiguousSegmentsScope::Enter();
  int other_before = -1;
  int other_inside = -1;
  bool other_exit_failed = false;
  std::thread t([&] {
    other_before = ContiguousSegmentsScope::depth();
    other_exit_failed = !ContiguousSegmentsScope::Exit().ok();  // this thread opened none
    ContiguousSegmentsScope::Enter();
    other_inside = ContiguousSegmentsScope::depth();
    (void)ContiguousSegmentsScope::Exit();
  });
  t.join();
  EXPECT_EQ(other_before, 0);
  EXPECT_TRUE(other_exit_failed);
  EXPECT_EQ(other_inside, 1);
  EXPECT_EQ(ContiguousSegmentsScope::depth(), 2);  // untouched by the other thread
  ASSERT_TRUE(ContiguousSegmentsScope::Exit().ok());
  ASSERT_TRUE(ContiguousSegmentsScope::Exit().ok());
}

TEST(ContiguousScopeDepthTest, AllocationsInsideComeFromAPlainSingleHandleSegment) {
  SimBackend::Config config;
  config.capacity = 8 * kGiB;
  SimBackend sim(config);
  absl::StatusOr<Options> options = ParseOptions("expandable_segments:True,expandable_page_mb:2");
  ASSERT_TRUE(options.ok()) << options.status();
  DeviceAllocator alloc(*options, &sim);

  absl::StatusOr<DevicePtr> outside = alloc.Malloc(30 * kMiB, 0);
  ASSERT_TRUE(outside.ok()) << outside.status();
  ContiguousSegmentsScope::Enter();
  absl::StatusOr<DevicePtr> inside = alloc.Malloc(30 * kMiB, 0);
  ASSERT_TRUE(ContiguousSegmentsScope::Exit().ok());
  ASSERT_TRUE(inside.ok()) << inside.status();
  absl::StatusOr<DevicePtr> after = alloc.Malloc(6 * kMiB, 0);
  ASSERT_TRUE(after.ok()) << after.status();

  const std::vector<SegmentInfo> segments = SegmentsOf(alloc);
  const SegmentInfo* in = SegmentOf(segments, *inside);
  const SegmentInfo* out = SegmentOf(segments, *outside);
  const SegmentInfo* late = SegmentOf(segments, *after);
  ASSERT_NE(in, nullptr);
  ASSERT_NE(out, nullptr);
  ASSERT_NE(late, nullptr);
  EXPECT_FALSE(in->is_expandable);
  EXPECT_EQ(in->handles, 1u);
  EXPECT_EQ(in->total_size, 30 * kMiB);  // a large request gets a segment of its own size
  EXPECT_TRUE(out->is_expandable);
  EXPECT_EQ(late, out);          // after the scope, growth continues the same expandable range
  EXPECT_EQ(out->handles, 18u);  // 30 + 6 MiB of 2 MiB pages
  EXPECT_EQ(sim.calls().count(DriverCall::kMalloc), 1);  // the one plain segment
  EXPECT_TRUE(alloc.CheckInvariants().ok()) << alloc.CheckInvariants();
}

}  // namespace
}  // namespace vramledger
