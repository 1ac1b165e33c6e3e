// Checkpoints of a private pool on SimBackend: the refusals of a restore (a stale checkpoint,
// one of a pool forgotten since, another pool's or device's, a malformed one, an unknown or
// released pool, a stream that cannot be waited for), each with torch's words or clearer ones,
// and the pool left as it was.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "pool_checkpoint_fixture.h"

namespace vramledger {
namespace {

// The segments and blocks as a snapshot shows them, one line each: what a refused restore must
// leave as it was, for expandable pools too (which CheckPoolLiveAllocations does not cover).
std::vector<std::string> Layout(const DeviceAllocator& alloc) {
  std::vector<std::string> out;
  for (const SegmentInfo& seg : SegmentsOf(alloc)) {
    out.push_back(absl::StrCat("segment ", seg.address, " ", seg.total_size, " pool ",
                               seg.pool_id.first, " expandable ", seg.is_expandable));
    for (const BlockInfo& b : seg.blocks) {
      out.push_back(absl::StrCat(" block ", b.address, " ", b.size, " ", b.state));
    }
  }
  return out;
}

TEST_F(PoolCheckpointTest, StaleCheckpointIsRefusedAndThePoolUnchanged) {
  const core::PoolCheckpoint stale = CheckpointThenForget();
  Begin();  // the same id again: a new pool with a segment of another size
  const DevicePtr now = Alloc(40 * kMiB);
  End();
  const core::PoolCheckpoint current = Checkpoint();
  const DeviceStats stats = alloc_->GetStats();

  auto r = alloc_->RestorePool(kGraphPool, stale);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("released and forgotten since"), std::string::npos)
      << r.status();
  Check();
  EXPECT_EQ(Checkpoint(), current);
  EXPECT_TRUE(Live({now}));
  EXPECT_EQ(Stat(&DeviceStats::allocated_bytes), stats.allocated_bytes[kAggregate].current);
  Free(now);
}

// The pool of the checkpoint released and forgotten, a pool of the same id made inside a region
// (so with the region's expandable segments): the restore is refused as a checkpoint of another
// incarnation, before the check that refuses an expandable pool (Unimplemented) could name a
// cause the caller cannot act on, and nothing changes.
TEST_F(PoolCheckpointTest, CheckpointOfAPoolForgottenSinceIsRefusedInAPoolMadeInARegion) {
  const core::PoolCheckpoint saved = CheckpointThenForget();
  ASSERT_EQ(alloc_->PoolUseCount(kGraphPool), 0);
  ASSERT_TRUE(alloc_->BeginRegion("train", [](StreamId) { return true; }).ok());
  Begin();  // made inside the region: expandable
  const DevicePtr now = Alloc(4 * kMiB);
  End();
  ASSERT_TRUE(alloc_->EndRegion("train").ok());
  Check();
  bool expandable = false;
  for (const SegmentInfo& seg : SegmentsOf(*alloc_)) {
    if (seg.pool_id == kGraphPool) expandable = seg.is_expandable;
  }
  ASSERT_TRUE(expandable);
  const std::vector<std::string> layout = Layout(*alloc_);
  const std::int64_t allocated = Stat(&DeviceStats::allocated_bytes);
  const std::int64_t reserved = Stat(&DeviceStats::reserved_bytes);

  auto r = alloc_->RestorePool(kGraphPool, saved);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("private pool (1, 0)"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("released and forgotten since"), std::string::npos)
      << r.status();
  Check();
  EXPECT_EQ(Layout(*alloc_), layout);
  EXPECT_EQ(Stat(&DeviceStats::allocated_bytes), allocated);
  EXPECT_EQ(Stat(&DeviceStats::reserved_bytes), reserved);
  EXPECT_EQ(alloc_->PoolUseCount(kGraphPool), 1);
  Free(now);
}

TEST_F(PoolCheckpointTest, CheckpointOfAnotherPoolIsRefused) {
  Begin(kGraphPool);
  const DevicePtr mine = Alloc(4 * kMiB);
  End(kGraphPool);
  Begin(kOtherPool);
  const DevicePtr theirs = Alloc(4 * kMiB);
  End(kOtherPool);
  const core::PoolCheckpoint other = Checkpoint(kOtherPool);
  const core::PoolCheckpoint own = Checkpoint(kGraphPool);

  auto r = alloc_->RestorePool(kGraphPool, other);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("checkpoint of private pool (2, 0)"), std::string::npos);
  // Relabelled as this pool's, its segments still belong to the other pool.
  core::PoolCheckpoint relabelled = other;
  relabelled.pool = kGraphPool;
  r = alloc_->RestorePool(kGraphPool, relabelled);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  // Another device's checkpoint.
  core::PoolCheckpoint elsewhere = own;
  elsewhere.device = 1;
  EXPECT_TRUE(absl::IsInvalidArgument(alloc_->RestorePool(kGraphPool, elsewhere).status()));
  Check();
  EXPECT_EQ(Checkpoint(kGraphPool), own);
  EXPECT_EQ(Checkpoint(kOtherPool), other);
  EXPECT_TRUE(Live({mine}, kGraphPool));
  EXPECT_TRUE(Live({theirs}, kOtherPool));
  Free(mine);
  Free(theirs);
}

TEST_F(PoolCheckpointTest, MalformedCheckpointsAreRefusedBeforeAnyChange) {
  Begin();
  const DevicePtr a = Alloc(3 * kMiB);
  const DevicePtr b = Alloc(2 * kMiB);
  End();
  const core::PoolCheckpoint good = Checkpoint();
  auto refused = [&](core::PoolCheckpoint cp) {
    auto r = alloc_->RestorePool(kGraphPool, cp);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
    Check();
    EXPECT_EQ(Checkpoint(), good);
  };
  core::PoolCheckpoint cp = good;
  cp.segments[0].blocks[0].size += 512;  // past the next block
  refused(cp);
  cp = good;
  cp.segments[0].blocks.pop_back();  // short of the segment's end
  refused(cp);
  cp = good;
  cp.segments[0].blocks[0].size = 100;  // not a multiple of 512
  refused(cp);
  cp = good;
  for (auto& blk : cp.segments[0].blocks) blk.allocated = false;  // neighbouring free blocks
  refused(cp);
  cp = good;
  cp.segments.push_back(cp.segments[0]);  // one segment twice
  refused(cp);
  EXPECT_TRUE(Live({a, b}));
  Free(a);
  Free(b);
}

TEST_F(PoolCheckpointTest, UnknownAndReleasedPoolsGetTorchsErrors) {
  auto cp = alloc_->CheckpointPool(kGraphPool);
  ASSERT_FALSE(cp.ok());
  EXPECT_TRUE(absl::IsNotFound(cp.status()));
  EXPECT_NE(cp.status().message().find("Could not find pool of id"), std::string::npos);
  Begin();
  const DevicePtr held = Alloc(4 * kMiB);
  End();
  const core::PoolCheckpoint saved = Checkpoint();
  ASSERT_TRUE(alloc_->ReleasePool(kGraphPool).ok());  // released; its block still holds the segment
  cp = alloc_->CheckpointPool(kGraphPool);
  ASSERT_FALSE(cp.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(cp.status()));
  EXPECT_NE(cp.status().message().find("Not expected to checkpoint freeable graph"),
            std::string::npos);
  EXPECT_TRUE(absl::IsFailedPrecondition(alloc_->RestorePool(kGraphPool, saved).status()));
  Free(held);
}

// A restore that cannot wait for the streams its live blocks were used on fails before it frees
// them: the caller still owns every block. (It once freed them first, then failed on an event,
// so the caller's blocks were gone behind an error.)
TEST_F(PoolCheckpointTest, ARestoreThatCannotWaitForItsBlocksStreamsLeavesThemLive) {
  constexpr StreamId kOther = 0x11;
  Begin();
  const DevicePtr a = Alloc(3 * kMiB);
  const DevicePtr b = Alloc(2 * kMiB);
  End();
  const core::PoolCheckpoint saved = Checkpoint();
  ASSERT_TRUE(alloc_->RecordStream(a, kOther).ok());
  const std::int64_t allocated = Stat(&DeviceStats::allocated_bytes);
  sim_->FailCall(DriverCall::kStreamSynchronize, 0,
                 absl::InternalError("cudaStreamSynchronize: injected"));
  auto r = alloc_->RestorePool(kGraphPool, saved);
  EXPECT_TRUE(absl::IsInternal(r.status())) << r.status();
  Check();
  EXPECT_TRUE(Live({a, b}));
  EXPECT_EQ(Stat(&DeviceStats::allocated_bytes), allocated);
  EXPECT_EQ(Checkpoint(), saved);
  // Waited for, the restore frees both without an event and lays the pool out as saved.
  const std::int64_t events = Calls(DriverCall::kEventRecord);
  const core::PoolRestore restored = Restore(saved);
  EXPECT_EQ(restored.freed.size(), 2u);
  EXPECT_EQ(restored.allocated.size(), 2u);
  EXPECT_EQ(Calls(DriverCall::kEventRecord), events);
  EXPECT_TRUE(Live({a, b}));
  Free(a);
  Free(b);
}

}  // namespace
}  // namespace vramledger
