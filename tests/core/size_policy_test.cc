// Exhaustive checks of torch's size policy: rounding, pool choice, segment sizes.
#include "core/size_policy.h"

#include <gtest/gtest.h>

namespace vramledger::size_policy {
namespace {

constexpr std::array<std::size_t, kRoundupPower2Intervals> kNoDivisions{};

TEST(SizePolicy, RoundsUpTo512AtEveryBoundary) {
  EXPECT_EQ(RoundSize(1, kNoDivisions), 512u);
  EXPECT_EQ(RoundSize(511, kNoDivisions), 512u);
  EXPECT_EQ(RoundSize(512, kNoDivisions), 512u);
  EXPECT_EQ(RoundSize(513, kNoDivisions), 1024u);
  EXPECT_EQ(RoundSize(4000, kNoDivisions), 4096u);
  EXPECT_EQ(RoundSize(kMiB, kNoDivisions), kMiB);
  EXPECT_EQ(RoundSize(kMiB + 1, kNoDivisions), kMiB + 512);
  // Every size up to 4 MiB: rounded is the next multiple of 512, never smaller than asked.
  for (std::size_t s = 1; s <= 4 * kMiB; s += 37) {
    const std::size_t r = RoundSize(s, kNoDivisions);
    ASSERT_EQ(r % 512, 0u) << s;
    ASSERT_GE(r, s) << s;
    ASSERT_LT(r - s, 512u) << s;
  }
}

TEST(SizePolicy, PoolBoundaryIsOneMiB) {
  EXPECT_TRUE(IsSmallRequest(RoundSize(kMiB, kNoDivisions)));
  EXPECT_FALSE(IsSmallRequest(RoundSize(kMiB + 1, kNoDivisions)));
}

TEST(SizePolicy, SegmentSizesFollowTorch) {
  // Torch's segment sizes as measured (docs/design/torch-facts.md §4, "Sizes"): 400 B -> 2 MiB;
  // 1 MiB+1 -> 20 MiB; 30 MiB+1 -> 32 MiB; 300 MiB -> 300 MiB.
  EXPECT_EQ(AllocationSize(RoundSize(400, kNoDivisions), 20 * kMiB), 2 * kMiB);
  EXPECT_EQ(AllocationSize(RoundSize(kMiB, kNoDivisions), 20 * kMiB), 2 * kMiB);
  EXPECT_EQ(AllocationSize(RoundSize(kMiB + 1, kNoDivisions), 20 * kMiB), 20 * kMiB);
  EXPECT_EQ(AllocationSize(RoundSize(10 * kMiB - 513, kNoDivisions), 20 * kMiB), 20 * kMiB);
  EXPECT_EQ(AllocationSize(RoundSize(10 * kMiB - 1, kNoDivisions), 20 * kMiB), 10 * kMiB);
  // A large_segment_size under the request: the request, rounded up to 2 MiB.
  EXPECT_EQ(AllocationSize(RoundSize(4 * kMiB, kNoDivisions), 2 * kMiB), 4 * kMiB);
  EXPECT_EQ(AllocationSize(RoundSize(3 * kMiB + 1, kNoDivisions), 2 * kMiB), 4 * kMiB);
  EXPECT_EQ(AllocationSize(RoundSize(kMiB + 1, kNoDivisions), 2 * kMiB), 2 * kMiB);
  EXPECT_EQ(AllocationSize(10 * kMiB, 20 * kMiB), 10 * kMiB);
  EXPECT_EQ(RoundSize(30 * kMiB + 1, kNoDivisions), 31457792u);
  EXPECT_EQ(AllocationSize(31457792u, 20 * kMiB), 32 * kMiB);
  EXPECT_EQ(AllocationSize(300 * kMiB, 20 * kMiB), 300 * kMiB);
  EXPECT_EQ(AllocationSize(5 * kMiB, 64 * kMiB), 64 * kMiB);  // large_segment_size_mb
  for (std::size_t s = 10 * kMiB; s < 64 * kMiB; s += 4099) {
    const std::size_t a = AllocationSize(RoundSize(s, kNoDivisions), 20 * kMiB);
    ASSERT_EQ(a % (2 * kMiB), 0u);
    ASSERT_GE(a, s);
    ASSERT_LT(a - s, 2 * kMiB + 512);
  }
}

TEST(SizePolicy, PowerTwoDivisions) {
  std::array<std::size_t, kRoundupPower2Intervals> four{};
  four.fill(4);
  // torch's example: 1200 with 4 divisions -> 1280; RoundSize only applies divisions above
  // 512 x divisions bytes, so 1200 itself still rounds to 512-byte steps.
  EXPECT_EQ(RoundUpPowerTwoDivision(1200, 4), 1280u);
  EXPECT_EQ(RoundSize(1200, four), 1536u);
  EXPECT_EQ(RoundSize(kMiB + 1, four), kMiB + kMiB / 4);
  EXPECT_EQ(RoundSize(3 * kMiB, four), 3 * kMiB);
  EXPECT_EQ(RoundSize(3 * kMiB + 1, four), 3 * kMiB + kMiB / 2);
  EXPECT_EQ(RoundSize(4 * kMiB, four), 4 * kMiB);  // powers of two stay
  EXPECT_EQ(PowerTwoInterval(512), 0);
  EXPECT_EQ(PowerTwoInterval(2 * kMiB), 1);
  EXPECT_EQ(PowerTwoInterval(std::size_t{1} << 50), kRoundupPower2Intervals - 1);
}

}  // namespace
}  // namespace vramledger::size_policy
