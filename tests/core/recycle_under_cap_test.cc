// Page recycling under a per-process memory fraction (grow_under_cap): reserved grows into the
// room below the cap before pages move, and pages move as without a cap once growing would take
// reserved past (1 - recycle_slack) x the cap, or always with grow_under_cap:False.
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ledger/device_report.h"
#include "sim_allocator_fixture.h"

namespace vramledger {
namespace {

constexpr std::size_t kCard = 1 * kGiB;

class RecycleUnderCapTest : public SimAllocatorTest {
 protected:
  // 2 MiB pages on stream 0, in MiB from a: a [0, 8) hole [8, 16) b [16, 24), the hole freed (4
  // whole mapped pages), then a 10 MiB request that fits no free run: 5 pages past b. Returns the
  // request's address.
  DevicePtr HoleThenLargerRequest() {
    const DevicePtr a = Alloc(8 * kMiB);
    const DevicePtr hole = Alloc(8 * kMiB);
    b_ = Alloc(8 * kMiB);
    EXPECT_EQ(hole, a + 8 * kMiB);
    Free(hole);
    creates_ = Calls(DriverCall::kMemCreate);
    return Alloc(10 * kMiB);
  }
  std::int64_t Created() { return Calls(DriverCall::kMemCreate) - creates_; }
  std::int64_t Moves() { return FragmentationOf(*alloc_).page_moves; }
  // As without a cap: the hole's 4 pages moved, one page new, reserved 26 MiB (not 34).
  void ExpectTheHoleRecycled() {
    EXPECT_EQ(Created(), 1);
    EXPECT_EQ(Moves(), 4);
    EXPECT_EQ(Reserved(), static_cast<std::int64_t>(26 * kMiB));
  }

  DevicePtr b_ = 0;
  std::int64_t creates_ = 0;
};

// A cap of 512 MiB leaves room: the 5 pages are new, the hole keeps its pages, nothing moves.
TEST_F(RecycleUnderCapTest, RoomBelowTheCapIsUsedBeforePagesMove) {
  Make("expandable_segments:True,expandable_page_mb:2,per_process_memory_fraction:0.5", kCard);
  const DevicePtr big = HoleThenLargerRequest();
  EXPECT_EQ(big, b_ + 8 * kMiB);
  EXPECT_EQ(Created(), 5);
  EXPECT_EQ(Moves(), 0);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(34 * kMiB));
  // The hole's pages are still mapped and serve a request that fits there with no driver call.
  const std::int64_t maps = Calls(DriverCall::kMemMap);
  Alloc(8 * kMiB);
  EXPECT_EQ(Calls(DriverCall::kMemMap), maps);
}

// The same with the cap set by set_memory_fraction (torch's route) rather than the option.
TEST_F(RecycleUnderCapTest, ACapSetLaterCountsTheSame) {
  Make("expandable_segments:True,expandable_page_mb:2", kCard);
  ASSERT_TRUE(alloc_->SetMemoryFraction(0.5).ok());
  HoleThenLargerRequest();
  EXPECT_EQ(Moves(), 0);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(34 * kMiB));
}

// A cap of 33 MiB: the 34 MiB that growing would reach is past 0.994 x 33 MiB, so the hole's 4
// pages move and one page is new (as without a cap); reserved stays at 26 MiB.
TEST_F(RecycleUnderCapTest, PagesMoveWhenGrowingWouldReachTheCap) {
  const double fraction = 33.0 * kMiB / kCard;
  Make(absl::StrCat("expandable_segments:True,expandable_page_mb:2,per_process_memory_fraction:",
                    fraction),
       kCard);
  HoleThenLargerRequest();
  ExpectTheHoleRecycled();
}

// The line is (1 - recycle_slack) x the cap: with a slack of 0.1, a 36 MiB cap (line 32.4 MiB)
// moves pages at 34 MiB; with the default slack (line 35.8 MiB) it grows.
TEST_F(RecycleUnderCapTest, TheLineIsTheSlackBelowTheCap) {
  const double fraction = 36.0 * kMiB / kCard;
  for (const char* slack : {"0.1", "0.006"}) {
    SCOPED_TRACE(slack);
    Make(absl::StrCat("expandable_segments:True,expandable_page_mb:2,recycle_slack:", slack,
                      ",per_process_memory_fraction:", fraction),
         kCard);
    HoleThenLargerRequest();
    EXPECT_EQ(Moves(), std::string(slack) == "0.1" ? 4 : 0);
  }
}

// grow_under_cap:False recycles under a cap as without one.
TEST_F(RecycleUnderCapTest, OffRecyclesAsWithoutACap) {
  Make(
      "expandable_segments:True,expandable_page_mb:2,per_process_memory_fraction:0.5,"
      "grow_under_cap:False",
      kCard);
  HoleThenLargerRequest();
  ExpectTheHoleRecycled();
}

// Without a cap the slack over peak allocated alone decides (26 MiB allocated at the peak, 34 MiB
// would be past 1.006 x 26): pages move.
TEST_F(RecycleUnderCapTest, WithoutACapPagesMoveAsBefore) {
  Make("expandable_segments:True,expandable_page_mb:2", kCard);
  HoleThenLargerRequest();
  ExpectTheHoleRecycled();
}

}  // namespace
}  // namespace vramledger
