// Pausable regions' handles and copies (docs/design/regions.md, "Resume"): a
// resume maps few large handles, cut where pages change between used and free, which empty_cache
// then releases only whole; a region's blocks get large handles; the copies are one batch per
// pause and per resume; empty_cache frees kept pinned buffers; a failed map-back (a new handle
// under the live blocks, or lost pages) and a handle a failed resume cannot unmap leave books that
// match the card; EndRegion after the pool's entry
// was ended elsewhere leaves both books agreeing.
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "regions_fixture.h"

namespace vramledger {
namespace {

class RegionHandlesTest : public RegionsTest {
 protected:
  // Ten blocks of 3 MiB in region "train" on 2 MiB pages: pages 0-14, one handle each (each
  // block covers at most one page whole); then blocks 3-5 ([9, 18) MiB) freed: pages 5-8 free.
  void SetUp() override {
    RegionsTest::SetUp();
    Begin("train");
    for (int i = 0; i < 10; ++i) blocks_.push_back(Alloc(3 * kMiB));
    End("train");
    for (int i = 0; i < 10; ++i) {
      if (i < 3 || i > 5) Write(blocks_[i], Pattern(3 * kMiB, i));
    }
    for (int i = 3; i <= 5; ++i) Free(blocks_[i]);
  }
  void ExpectContents() {
    for (int i = 0; i < 10; ++i) {
      if (i < 3 || i > 5) {
        EXPECT_EQ(Read(blocks_[i], 3 * kMiB), Pattern(3 * kMiB, i)) << i;
      }
    }
  }
  // The description less the card's line and the reserved figures (which a held handle moves).
  std::string DescribeRegion() {
    std::string d = Describe();
    return d.substr(0, d.find('\n'));
  }
  // Only block 0 ([0, 3) MiB, pages 0-1) left live; then a pause whose second unmap, its
  // map-back and a new handle all fail: one page under block 0 is lost.
  void LoseAPageUnderBlockZero() {
    for (int i : {1, 2, 6, 7, 8, 9}) Free(blocks_[i]);
    ASSERT_TRUE(alloc_->EmptyCache().ok());
    sim_->FailCall(DriverCall::kMemUnmap, 1, absl::InternalError("cuMemUnmap: injected"));
    sim_->FailCall(DriverCall::kMemMap, 0, absl::InternalError("cuMemMap: injected"));
    sim_->FailCall(DriverCall::kMemCreate, 0, absl::InternalError("cuMemCreate: injected"));
    ASSERT_FALSE(alloc_->PauseRegion("train", RegionBackup::kNone).ok());
    ASSERT_EQ(Info("train").lost_bytes, 2 * kMiB);
  }
  std::vector<DevicePtr> blocks_;
};

TEST_F(RegionHandlesTest, AResumeMapsOneHandlePerRunOfUsedOrFreePagesAndThePauseReleasesThem) {
  const std::int64_t creates = Calls(DriverCall::kMemCreate);
  const std::int64_t access = Calls(DriverCall::kMemSetAccess);
  const std::int64_t waits = sim_->copy_waits();
  const std::int64_t copies = sim_->copies();
  const RegionPauseResult paused = Pause("train", RegionBackup::kCpu);
  EXPECT_EQ(paused.handles, 15u);
  EXPECT_EQ(paused.released_bytes, 30 * kMiB);
  EXPECT_EQ(sim_->copy_waits(), waits + 1);  // one batch
  EXPECT_EQ(sim_->copies(), copies + 2);     // the live runs [0, 9) and [18, 30) MiB
  EXPECT_EQ(paused.backed_up_bytes, 21 * kMiB);
  EXPECT_GE(paused.copy_seconds, 0.0);
  const RegionResumeResult resumed = Resume("train");
  // Pages 0-4 used, 5-8 free, 9-14 used: three handles, access granted once (one range).
  EXPECT_EQ(resumed.handles, 3u);
  EXPECT_EQ(Calls(DriverCall::kMemCreate), creates + 3);
  EXPECT_EQ(Calls(DriverCall::kMemSetAccess), access + 1);
  EXPECT_EQ(sim_->copy_waits(), waits + 2);
  EXPECT_EQ(resumed.mapped_bytes, 30 * kMiB);
  ExpectContents();
  const DevicePtr base = blocks_[0];
  EXPECT_EQ(sim_->HandleAt(base), sim_->HandleAt(base + 9 * kMiB));  // page 4
  EXPECT_NE(sim_->HandleAt(base + 9 * kMiB), sim_->HandleAt(base + 10 * kMiB));
  EXPECT_EQ(sim_->HandleAt(base + 10 * kMiB), sim_->HandleAt(base + 17 * kMiB));
  EXPECT_EQ(sim_->HandleAt(base + 18 * kMiB), sim_->HandleAt(base + 29 * kMiB));
  // The next pause releases those three.
  EXPECT_EQ(Pause("train", RegionBackup::kCpu).handles, 3u);
  Resume("train");
  ExpectContents();
}

TEST_F(RegionHandlesTest, EmptyCacheReleasesAResumedRegionsHandlesOnlyWhole) {
  Pause("train", RegionBackup::kCpu);
  Resume("train");
  const std::size_t used = sim_->used_bytes();
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  Check();
  EXPECT_EQ(sim_->used_bytes(), used - 8 * kMiB);  // the free handle of pages 5-8
  Free(blocks_[0]);  // page 0 free, but its handle (pages 0-4) still holds blocks 1 and 2
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  Check();
  EXPECT_EQ(sim_->used_bytes(), used - 8 * kMiB);
  Free(blocks_[1]);
  Free(blocks_[2]);  // the whole handle is free now
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  Check();
  EXPECT_EQ(sim_->used_bytes(), used - 18 * kMiB);
  for (int i = 6; i < 10; ++i) {
    EXPECT_EQ(Read(blocks_[i], 3 * kMiB), Pattern(3 * kMiB, i)) << i;
  }
}

TEST_F(RegionHandlesTest, ARegionsBlockGetsHandlesOfUpTo256MiB) {
  const std::int64_t creates = Calls(DriverCall::kMemCreate);
  const DevicePtr big = AllocIn("big", 600 * kMiB);
  EXPECT_EQ(Calls(DriverCall::kMemCreate), creates + 3);  // 128 + 128 + 44 pages of 2 MiB
  EXPECT_EQ(Pause("big", RegionBackup::kNone).handles, 3u);
  EXPECT_EQ(Resume("big").handles, 3u);
  Free(big);
  const std::int64_t outside = Calls(DriverCall::kMemCreate);
  Free(Alloc(600 * kMiB));  // the default pools keep expandable_handle_mb (one page each)
  EXPECT_EQ(Calls(DriverCall::kMemCreate), outside + 300);
}

TEST_F(RegionHandlesTest, EmptyCacheFreesTheKeptPinnedBuffers) {
  Pause("train", RegionBackup::kCpu);
  Resume("train", /*keep=*/true);
  EXPECT_GT(Info("train").host_buffer_bytes, 0u);
  EXPECT_EQ(sim_->pinned_bytes(), Info("train").host_buffer_bytes);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  Check();
  EXPECT_EQ(Info("train").host_buffer_bytes, 0u);
  EXPECT_EQ(sim_->pinned_bytes(), 0u);
  Pause("train", RegionBackup::kCpu);  // pins again
  Resume("train");
  ExpectContents();
  EXPECT_EQ(sim_->pinned_bytes(), 0u);
}

// The books once counted the live block over a lost page as allocated with no page under it
// (allocated above reserved, and the snapshot without the block): a new handle goes there.
TEST_F(RegionHandlesTest, AMapBackThatFailsMapsANewHandleUnderTheLiveBlock) {
  // The third unmap fails; mapping the first handle back fails too: page 0's contents are lost.
  sim_->FailCall(DriverCall::kMemUnmap, 2, absl::InternalError("cuMemUnmap: injected"));
  sim_->FailCall(DriverCall::kMemMap, 0, absl::InternalError("cuMemMap: injected"));
  const std::size_t used = sim_->used_bytes();
  const PhysicalHandle old = sim_->HandleAt(blocks_[0]);
  auto r = alloc_->PauseRegion("train", RegionBackup::kCpu);
  EXPECT_TRUE(absl::IsInternal(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("contents are lost"), std::string::npos) << r.status();
  Check();
  EXPECT_FALSE(Info("train").paused);
  EXPECT_EQ(Info("train").mapped_bytes, 30 * kMiB);
  EXPECT_EQ(sim_->used_bytes(), used);
  EXPECT_NE(sim_->HandleAt(blocks_[0]), 0u);
  EXPECT_NE(sim_->HandleAt(blocks_[0]), old);
  EXPECT_TRUE(sim_->IsAccessible(blocks_[0], 3 * kMiB));
  EXPECT_EQ(sim_->pinned_bytes(), 0u);
  for (int i = 1; i < 10; ++i) {
    if (i < 3 || i > 5) {
      EXPECT_EQ(Read(blocks_[i], 3 * kMiB), Pattern(3 * kMiB, i)) << i;
    }
  }
  Pause("train", RegionBackup::kCpu);
  Resume("train");
  EXPECT_EQ(sim_->used_bytes(), used);
}

TEST_F(RegionHandlesTest, AMapBackThatFailsBooksThePagesUnmappedUntilTheNextResume) {
  // The third unmap fails; mapping the first handle back fails too, and so does creating a new
  // handle for it: its page (page 0) is lost.
  sim_->FailCall(DriverCall::kMemUnmap, 2, absl::InternalError("cuMemUnmap: injected"));
  sim_->FailCall(DriverCall::kMemMap, 0, absl::InternalError("cuMemMap: injected"));
  sim_->FailCall(DriverCall::kMemCreate, 0, absl::InternalError("cuMemCreate: injected"));
  const std::size_t used = sim_->used_bytes();
  auto r = alloc_->PauseRegion("train", RegionBackup::kCpu);
  EXPECT_TRUE(absl::IsInternal(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("contents are lost"), std::string::npos) << r.status();
  Check();  // the books match the card: page 0 unmapped and released
  EXPECT_FALSE(Info("train").paused);
  EXPECT_EQ(Info("train").mapped_bytes, 28 * kMiB);
  EXPECT_EQ(Info("train").lost_bytes, 2 * kMiB);
  EXPECT_EQ(sim_->used_bytes(), used - 2 * kMiB);
  EXPECT_EQ(sim_->HandleAt(blocks_[0]), 0u);
  EXPECT_EQ(sim_->pinned_bytes(), 0u);
  // The next pause backs up what is mapped and its resume maps page 0 again.
  const RegionPauseResult paused = Pause("train", RegionBackup::kCpu);
  EXPECT_EQ(paused.backed_up_bytes, 19 * kMiB);
  EXPECT_EQ(Info("train").paused_bytes, 30 * kMiB);
  Resume("train");
  EXPECT_EQ(Info("train").mapped_bytes, 30 * kMiB);
  EXPECT_EQ(Info("train").lost_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(), used);
  const std::vector<std::uint8_t> first = Pattern(3 * kMiB, 0);
  EXPECT_EQ(Read(blocks_[0] + 2 * kMiB, kMiB),
            std::vector<std::uint8_t>(first.begin() + 2 * kMiB, first.end()));  // past page 0
  for (int i = 1; i < 10; ++i) {
    if (i < 3 || i > 5) {
      EXPECT_EQ(Read(blocks_[i], 3 * kMiB), Pattern(3 * kMiB, i)) << i;
    }
  }
}

// A block alone on its pages, the first of them lost: its active bytes exceed the region's
// mapped (reserved) bytes by at most the lost page, which the books and the report say.
TEST_F(RegionHandlesTest, ABlockOverALostPageIsActiveBeyondTheReservedBytes) {
  for (int i : {1, 2, 6, 7, 8, 9}) Free(blocks_[i]);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  Check();
  ASSERT_EQ(Info("train").mapped_bytes, 4 * kMiB);  // pages 0-1 under block 0's 3 MiB
  sim_->FailCall(DriverCall::kMemUnmap, 1, absl::InternalError("cuMemUnmap: injected"));
  sim_->FailCall(DriverCall::kMemMap, 0, absl::InternalError("cuMemMap: injected"));
  sim_->FailCall(DriverCall::kMemCreate, 0, absl::InternalError("cuMemCreate: injected"));
  auto r = alloc_->PauseRegion("train", RegionBackup::kNone);
  EXPECT_TRUE(absl::IsInternal(r.status())) << r.status();
  Check();
  EXPECT_EQ(Info("train").mapped_bytes, 2 * kMiB);
  EXPECT_EQ(Info("train").lost_bytes, 2 * kMiB);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(alloc_->GetStats().active_bytes[kAggregate].current,
            static_cast<std::int64_t>(3 * kMiB));
  Pause("train", RegionBackup::kNone);
  Resume("train");
  EXPECT_EQ(Info("train").lost_bytes, 0u);
  EXPECT_EQ(Info("train").mapped_bytes, 4 * kMiB);
  Free(blocks_[0]);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// A lost page mapped again (its block freed, a new block placed over it) is an ordinary page of
// the next pause: that pause releases it once, and the resume maps it once. Counting it as lost
// too made the resume map two handles at its address (the second refused: "overlaps").
TEST_F(RegionHandlesTest, ALostPageMappedAgainComesBackOnceWithTheNextResume) {
  ASSERT_NO_FATAL_FAILURE(LoseAPageUnderBlockZero());
  Free(blocks_[0]);  // the block over the lost page
  Begin("train");
  const DevicePtr again = Alloc(3 * kMiB);  // placed over the lost page: mapped again
  End("train");
  Check();
  EXPECT_EQ(Info("train").lost_bytes, 0u);
  EXPECT_EQ(Info("train").mapped_bytes, 4 * kMiB);
  Pause("train", RegionBackup::kNone);
  EXPECT_EQ(Info("train").paused_bytes, 4 * kMiB);
  Resume("train");
  EXPECT_EQ(Info("train").mapped_bytes, 4 * kMiB);
  EXPECT_EQ(sim_->mapped_bytes(), 4 * kMiB);
  Free(again);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// A lost page stays unmapped under its live block, so growth after the failed pause may take
// the memory it had; the region's next pause then releases more than the cap holds. Its resume
// is refused as out of memory, naming the bytes and the cap, with nothing changed, even once
// every block is freed (a resume maps every page its pause released); it runs when room is made.
TEST_F(RegionHandlesTest, AResumePastTheCapAfterLostPagesWereRefilledIsRefusedWithNothingChanged) {
  ASSERT_NO_FATAL_FAILURE(LoseAPageUnderBlockZero());
  ASSERT_EQ(Reserved(), static_cast<std::int64_t>(2 * kMiB));
  // A cap of 6 MiB (3 x 2^-15 of the 64 GiB card, exact in binary); the new block takes it all.
  ASSERT_TRUE(alloc_->SetMemoryFraction(3.0 / 32768).ok());
  const DevicePtr more = AllocIn("train", 4 * kMiB);  // [3, 7) MiB: pages 2 and 3
  ASSERT_EQ(Reserved(), static_cast<std::int64_t>(6 * kMiB));
  Pause("train", RegionBackup::kNone);
  EXPECT_EQ(Info("train").paused_bytes, 8 * kMiB);
  Free(blocks_[0]);
  Free(more);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  const std::string before = Describe();
  auto r = alloc_->ResumeRegion("train", false);
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              ::testing::HasSubstr("resume of region 'train' needs 8.00 MiB"));
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("cap of 6.00 MiB"));
  Check();
  EXPECT_EQ(Describe(), before);
  EXPECT_TRUE(Info("train").paused);
  ASSERT_TRUE(alloc_->SetMemoryFraction(1.0).ok());
  Resume("train");
  EXPECT_EQ(Info("train").lost_bytes, 0u);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(8 * kMiB));
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

TEST_F(RegionHandlesTest, AHandleAFailedResumeCannotUnmapIsHeldAndReleasedByTheNextResume) {
  Pause("train", RegionBackup::kCpu);
  const std::string region = DescribeRegion();
  const std::size_t mapped = sim_->mapped_bytes();
  const std::int64_t reserved = Reserved();
  // Access fails, and the undo's first unmap fails too: that handle (pages 0-4) stays mapped.
  sim_->FailCall(DriverCall::kMemSetAccess, 0, absl::InternalError("cuMemSetAccess: injected"));
  sim_->FailCall(DriverCall::kMemUnmap, 0, absl::InternalError("cuMemUnmap: injected"));
  auto r = alloc_->ResumeRegion("train", false);
  EXPECT_TRUE(absl::IsInternal(r.status())) << r.status();
  Check();  // reserved counts the held handle, as the card does, and so does the region
  EXPECT_EQ(DescribeRegion(), absl::StrReplaceAll(region, {{" mapped=0 ", " mapped=10485760 "}}));
  EXPECT_EQ(sim_->mapped_bytes(), mapped + 10 * kMiB);
  EXPECT_EQ(Reserved(), reserved + static_cast<std::int64_t>(10 * kMiB));
  Resume("train");
  EXPECT_EQ(Reserved(), reserved + static_cast<std::int64_t>(30 * kMiB));
  ExpectContents();
}

TEST_F(RegionHandlesTest, EndRegionAfterItsPoolEntryEndedElsewhereLeavesBothBooksAgreeing) {
  const auto id = alloc_->BeginRegion("train", ThisThread());
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(alloc_->EndAllocateToPool(*id).ok());  // through torch's pool API
  EXPECT_FALSE(alloc_->EndRegion("train").ok());
  Check();
  // The thread is in no region any more: a pool it creates is no region's.
  ASSERT_TRUE(alloc_->CreateOrIncrefPool({0, 77}).ok());
  EXPECT_EQ(Info("train").pools.size(), 1u);
  EXPECT_TRUE(absl::IsNotFound(alloc_->EndRegion("train")));
}

TEST_F(RegionHandlesTest, MakingARegionPreparesTheCopiesOnceAndNotDuringACapture) {
  constexpr StreamId kCapture = 3;
  const std::int64_t before = sim_->copy_prepares();  // "train", made by SetUp, prepared once
  EXPECT_EQ(before, 1);
  sim_->SetCapturing(kCapture, true);
  ASSERT_TRUE(alloc_->BeginAllocateToPool({0, 5}, [](StreamId s) { return s == kCapture; }).ok());
  Begin("early");  // made while a capture is under way: nothing is prepared beside it
  End("early");
  EXPECT_EQ(sim_->copy_prepares(), before);
  sim_->SetCapturing(kCapture, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool({0, 5}).ok());
  ASSERT_TRUE(alloc_->ReleasePool({0, 5}).ok());
  Begin("rollout");  // made: its first pause finds the copy stream ready
  End("rollout");
  EXPECT_EQ(sim_->copy_prepares(), before + 1);
  Begin("rollout");  // entered again: already made
  End("rollout");
  EXPECT_EQ(sim_->copy_prepares(), before + 1);
  Check();
}

}  // namespace
}  // namespace vramledger
