// Checkpoints of a private pool on SimBackend (core/pool_checkpoint.h, graph_checkpoints.cc), as
// CUDA graph trees use them: checkpoint and restore round trips block by block with the
// statistics and the ledger's per-tag figures, the exact live-set check, and blocks waiting on
// stream events.
#include <algorithm>
#include <random>
#include <vector>

#include "pool_checkpoint_fixture.h"

namespace vramledger {
namespace {

TEST_F(PoolCheckpointTest, RoundTripRestoresEveryBlockAndTheStatistics) {
  Begin();
  std::vector<DevicePtr> small, large;
  for (std::size_t kib : {1, 100, 3, 200, 40, 512}) {  // small pool: one 2 MiB segment
    ledger_.tag = static_cast<std::uint32_t>(kib % 3 + 1);
    small.push_back(Alloc(kib * 1024 + 7));
  }
  for (std::size_t mib : {3, 1, 7, 30, 2}) {  // large pool: several segments, one of 30 MiB
    ledger_.tag = static_cast<std::uint32_t>(mib % 3 + 1);
    large.push_back(Alloc(mib * kMiB + 11));
  }
  Free(small[1]);
  Free(small[3]);
  Free(large[1]);
  End();
  const core::PoolCheckpoint cp = Checkpoint();
  ASSERT_GE(cp.segments.size(), 3u);
  EXPECT_TRUE(std::any_of(cp.segments.begin(), cp.segments.end(),
                          [](const auto& s) { return s.is_small; }));
  const DeviceStats stats = alloc_->GetStats();
  const auto tags = ledger_.live;

  // The next recording frees some of the checkpoint's blocks and allocates others, growing a new
  // segment.
  Begin();
  Free(small[0]);
  Free(large[2]);
  const DevicePtr extra = Alloc(64 * kMiB);
  const DevicePtr reuse = Alloc(5 * 1024);
  End();
  std::vector<DevicePtr> before_restore = Allocated(Checkpoint());
  ASSERT_NE(Checkpoint(), cp);

  const core::PoolRestore r = Restore(cp);
  EXPECT_EQ(r.freed, before_restore);  // every allocation of the pool, in address order
  std::vector<DevicePtr> reallocated;
  for (const auto& b : r.allocated) reallocated.push_back(b.ptr);
  EXPECT_EQ(reallocated, Allocated(cp));
  EXPECT_TRUE(Live(Allocated(cp)));

  // Block by block as checkpointed; the segment grown since is one free block.
  const core::PoolCheckpoint after = Checkpoint();
  for (const auto& seg : after.segments) {
    auto same = std::find_if(cp.segments.begin(), cp.segments.end(),
                             [&](const auto& s) { return s.ptr == seg.ptr; });
    if (same != cp.segments.end()) {
      EXPECT_EQ(seg, *same);
    } else {
      ASSERT_EQ(seg.blocks.size(), 1u);
      EXPECT_FALSE(seg.blocks[0].allocated);
      EXPECT_EQ(seg.ptr, extra);
    }
  }
  // The statistics read as if the checkpoint's allocations had been made again.
  for (auto field :
       {&DeviceStats::allocated_bytes, &DeviceStats::active_bytes, &DeviceStats::requested_bytes,
        &DeviceStats::allocation, &DeviceStats::active}) {
    for (StatType t : {kAggregate, kSmallPool, kLargePool}) {
      EXPECT_EQ((alloc_->GetStats().*field)[t].current, (stats.*field)[t].current);
    }
  }
  EXPECT_EQ(Stat(&DeviceStats::inactive_split), stats.inactive_split[kAggregate].current);
  EXPECT_EQ(ledger_.live, tags);
  (void)reuse;

  // torch owns the re-allocated blocks: their frees leave the pool empty.
  for (const auto& b : r.allocated) Free(b.ptr);
  EXPECT_TRUE(Live({}));
  EXPECT_EQ(Stat(&DeviceStats::allocated_bytes), 0);
  EXPECT_TRUE(ledger_.live.empty());
}

TEST_F(PoolCheckpointTest, RandomRecordingsRestoreExactly) {
  for (unsigned seed = 1; seed <= 6; ++seed) {
    std::mt19937 rng(seed);
    const MempoolId pool{10 + seed, 0};
    auto size = [&] {
      const int kind = static_cast<int>(rng() % 3);
      if (kind == 0) return std::size_t{512} + rng() % (900 * 1024);  // small pool
      if (kind == 1) return kMiB + rng() % (9 * kMiB);
      return 10 * kMiB + rng() % (50 * kMiB);
    };
    std::vector<DevicePtr> live;
    int recordings = 0;  // each holds one use of the pool, as a torch graph does
    auto churn = [&](int steps) {
      ++recordings;
      Begin(pool);
      for (int i = 0; i < steps; ++i) {
        if (!live.empty() && rng() % 3 == 0) {
          const std::size_t k = rng() % live.size();
          Free(live[k]);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
        } else {
          ledger_.tag = rng() % 4;
          live.push_back(Alloc(size()));
        }
      }
      End(pool);
    };
    churn(60);
    const core::PoolCheckpoint cp = Checkpoint(pool);
    const DeviceStats stats = alloc_->GetStats();
    const auto tags = ledger_.live;
    churn(60);
    const core::PoolRestore r = Restore(cp, pool);
    std::vector<DevicePtr> sorted = live;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(r.freed, sorted) << "seed " << seed;
    live = Allocated(cp);
    EXPECT_TRUE(Live(live, pool));
    for (const auto& seg : Checkpoint(pool).segments) {
      auto same = std::find_if(cp.segments.begin(), cp.segments.end(),
                               [&](const auto& s) { return s.ptr == seg.ptr; });
      if (same != cp.segments.end()) {
        EXPECT_EQ(seg, *same) << "seed " << seed;
      } else {
        EXPECT_EQ(seg.blocks.size(), 1u);
      }
    }
    EXPECT_EQ(Stat(&DeviceStats::allocated_bytes), stats.allocated_bytes[kAggregate].current);
    EXPECT_EQ(Stat(&DeviceStats::requested_bytes), stats.requested_bytes[kAggregate].current);
    EXPECT_EQ(ledger_.live, tags);
    churn(30);  // the restored pool serves further recordings
    for (DevicePtr p : live) Free(p);
    for (int i = 0; i < recordings; ++i) ASSERT_TRUE(alloc_->ReleasePool(pool).ok());
    Check();
    EXPECT_EQ(alloc_->PoolUseCount(pool), 0);
  }
  EXPECT_EQ(Stat(&DeviceStats::allocated_bytes), 0);
}

TEST_F(PoolCheckpointTest, LiveAllocationsAreCheckedExactly) {
  const DevicePtr outside = Alloc(4 * kMiB, kEager);  // the device's own pool: never counted
  Begin();
  const DevicePtr a = Alloc(4 * kMiB);
  const DevicePtr b = Alloc(100 * 1024);
  const DevicePtr c = Alloc(8 * kMiB);
  End();
  Free(c);
  EXPECT_TRUE(Live({a, b}));
  EXPECT_TRUE(Live({b, a, b}));   // a set: duplicates count once
  EXPECT_FALSE(Live({a}));        // b is allocated too
  EXPECT_FALSE(Live({a, b, c}));  // c was freed
  EXPECT_FALSE(Live({a, b, outside}));
  EXPECT_FALSE(Live({}));
  Free(a);
  Free(b);
  EXPECT_TRUE(Live({}));
  auto unknown = alloc_->CheckPoolLiveAllocations(kOtherPool, {});
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(absl::IsNotFound(unknown.status()));
  EXPECT_NE(unknown.status().message().find("Could not find pool of id (2, 0)"), std::string::npos);
  Free(outside);
}

TEST_F(PoolCheckpointTest, BlocksWaitingOnEventsAreWaitedFor) {
  Begin();
  const DevicePtr used = Alloc(4 * kMiB);
  const DevicePtr kept = Alloc(4 * kMiB);
  End();
  ASSERT_TRUE(alloc_->RecordStream(used, kSide).ok());
  Free(used);  // pending until kSide's event completes
  const core::PoolCheckpoint cp = Checkpoint();
  EXPECT_EQ(Allocated(cp), std::vector<DevicePtr>{kept});
  for (const auto& seg : cp.segments) EXPECT_TRUE(core::CheckLayout(seg).ok());

  // A restore frees a block used on another stream and waits for it too.
  ASSERT_TRUE(alloc_->RecordStream(kept, kSide).ok());
  const core::PoolRestore r = Restore(cp);
  EXPECT_EQ(r.freed, std::vector<DevicePtr>{kept});
  EXPECT_EQ(Checkpoint(), cp);
  for (const auto& b : r.allocated) Free(b.ptr);
}

TEST_F(PoolCheckpointTest, WaitingBlocksDuringACaptureAreRefused) {
  Begin();
  const DevicePtr used = Alloc(4 * kMiB);
  const DevicePtr kept = Alloc(4 * kMiB);
  ASSERT_TRUE(alloc_->RecordStream(used, kSide).ok());
  sim_->SetCapturing(kCapture, true);
  Free(used);  // deferred: no event may be recorded during the capture
  auto cp = alloc_->CheckpointPool(kGraphPool);
  ASSERT_FALSE(cp.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(cp.status()));
  EXPECT_NE(cp.status().message().find("Events should have synchronized"), std::string::npos);
  sim_->SetCapturing(kCapture, false);
  End();
  EXPECT_EQ(Allocated(Checkpoint()), std::vector<DevicePtr>{kept});
  Free(kept);
}

}  // namespace
}  // namespace vramledger
