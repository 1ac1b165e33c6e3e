// Pausable regions and the private pools made inside them (docs/design/regions.md, "Pools
// created inside it"): a pool the allocator forgets (released, no segment left) leaves its
// region, so a pool made later with the same id belongs where that one is made: outside every
// region (plain), or inside another region (paused and resumed with that one only).
#include <algorithm>

#include "regions_fixture.h"

namespace vramledger {
namespace {

constexpr MempoolId kPool{1, 0};

bool HasPool(const RegionInfo& region, MempoolId id) {
  return std::find(region.pools.begin(), region.pools.end(), id) != region.pools.end();
}

class RegionPoolsTest : public RegionsTest {
 protected:
  // A MemPool made inside `region` and released before any allocation: the allocator forgets it.
  void MakeAndForget(std::string_view region) {
    Begin(region);
    ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
    End(region);
    ASSERT_TRUE(HasPool(Info(region), kPool));
    ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
    Check();
    EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
    EXPECT_FALSE(HasPool(Info(region), kPool));
  }
  // Allocates `size` bytes through pool `id` (use_mem_pool on this thread).
  DevicePtr AllocInPool(MempoolId id, std::size_t size) {
    EXPECT_TRUE(alloc_->BeginAllocateToPool(id, ThisThread()).ok());
    const DevicePtr p = Alloc(size);
    EXPECT_TRUE(alloc_->EndAllocateToPool(id).ok());
    Check();
    return p;
  }
};

// The invariant check once failed here ("region 'train': a pool that is not expandable"): the
// region still listed the forgotten pool, and the plain pool made later with its id.
TEST_F(RegionPoolsTest, APoolMadeOutsideWithTheIdOfAForgottenRegionPoolIsPlainAndNotTheRegions) {
  Make("expandable_segments:False");
  MakeAndForget("train");
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());  // outside every region
  Check();
  EXPECT_FALSE(HasPool(Info("train"), kPool));
  const DevicePtr p = AllocInPool(kPool, 4 * kMiB);
  const DevicePtr t = AllocIn("train", 4 * kMiB);
  Pause("train", RegionBackup::kNone);
  EXPECT_EQ(sim_->HandleAt(t), 0u);
  int segments = 0;
  for (const SegmentInfo& seg : SegmentsOf(*alloc_)) {
    if (seg.pool_id != kPool) continue;
    ++segments;
    EXPECT_FALSE(seg.is_expandable);  // the pool's own plain segment, untouched by the pause
    EXPECT_FALSE(seg.paused);
  }
  EXPECT_EQ(segments, 1);
  const DevicePtr q = AllocInPool(kPool, kMiB);  // the pool is not paused
  Resume("train");
  for (DevicePtr x : {p, q, t}) Free(x);
}

// The invariant check once failed here ("region 'train': a pool's paused flag disagrees"): the
// pool made inside "rollout" with a forgotten id of paused "train" was listed as train's.
TEST_F(RegionPoolsTest, APoolMadeInAnotherRegionWithTheIdOfAForgottenOneRunsAndPausesWithThatOne) {
  const DevicePtr t = AllocIn("train", 4 * kMiB);
  Begin("rollout");
  MakeAndForget("train");  // "train" entered inside "rollout"
  Pause("train", RegionBackup::kNone);
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, ThisThread()).ok());  // a capture's pool, say
  Check();
  EXPECT_TRUE(HasPool(Info("rollout"), kPool));
  EXPECT_FALSE(HasPool(Info("train"), kPool));
  const DevicePtr p = Alloc(4 * kMiB);  // "train" is paused, "rollout" runs
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  End("rollout");
  Check();
  EXPECT_NE(sim_->HandleAt(p), 0u);
  Pause("rollout", RegionBackup::kNone);
  EXPECT_EQ(sim_->HandleAt(p), 0u);
  Resume("train");
  EXPECT_NE(sim_->HandleAt(t), 0u);
  EXPECT_EQ(sim_->HandleAt(p), 0u);
  Resume("rollout");
  EXPECT_NE(sim_->HandleAt(p), 0u);
  Free(p);
  Free(t);
}

// A pool released while it still holds segments stays, and stays its region's: its blocks'
// pages go with the region's pause.
TEST_F(RegionPoolsTest, AReleasedPoolThatKeepsSegmentsStaysInItsRegion) {
  Begin("train");
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
  End("train");
  const DevicePtr p = AllocInPool(kPool, 4 * kMiB);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  Check();
  EXPECT_TRUE(HasPool(Info("train"), kPool));
  Pause("train", RegionBackup::kNone);
  EXPECT_EQ(sim_->HandleAt(p), 0u);
  Resume("train");
  Free(p);
}

// Nested region scopes on one thread: the innermost region takes the allocations, as it takes a
// pool made there; leaving it sends them to the outer one again.
TEST_F(RegionPoolsTest, NestedRegionsSendAllocationsAndNewPoolsToTheInnermost) {
  Begin("outer");
  const DevicePtr a = Alloc(4 * kMiB);
  Begin("inner");
  const DevicePtr b = Alloc(6 * kMiB);
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
  End("inner");
  const DevicePtr c = Alloc(2 * kMiB);
  End("outer");
  EXPECT_EQ(Info("outer").allocated_bytes, 6 * kMiB);
  EXPECT_EQ(Info("inner").allocated_bytes, 6 * kMiB);
  EXPECT_TRUE(HasPool(Info("inner"), kPool));
  EXPECT_FALSE(HasPool(Info("outer"), kPool));
  Pause("inner", RegionBackup::kNone);  // b's pages go, a's and c's stay
  EXPECT_EQ(sim_->HandleAt(b), 0u);
  EXPECT_NE(sim_->HandleAt(a), 0u);
  EXPECT_NE(sim_->HandleAt(c), 0u);
  Resume("inner");
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  Free(a);
  Free(b);
  Free(c);
}

}  // namespace
}  // namespace vramledger
