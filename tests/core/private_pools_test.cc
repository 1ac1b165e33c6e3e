// PrivatePools alone on a SimBackend (capture state set by the test): use counts, routing by
// stream filter, several entries of one pool, capture detection, failed-capture pruning by the
// owner thread only, and the release of pools with no use left.
#include "core/private_pools.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "device/sim_backend.h"

namespace vramledger::core {
namespace {

constexpr MempoolId kGraph{1, 0};
constexpr MempoolId kOther{2, 0};

class PrivatePoolsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    EXPECT_TRUE(pools_.CheckInvariants().ok()) << pools_.CheckInvariants();
  }
  static StreamFilter Only(StreamId stream) {
    return [stream](StreamId s) { return s == stream; };
  }
  // A capture's filter, as torch's capture_begin gives: its stream, while it captures.
  StreamFilter CaptureOf(StreamId stream) {
    return [this, stream](StreamId s) { return s == stream && sim_.IsCapturing(s); };
  }

  SimBackend sim_;
  PrivatePools pools_{&sim_};
};

TEST_F(PrivatePoolsTest, UseCountsFollowBeginAndRelease) {
  EXPECT_EQ(pools_.UseCount(kGraph), 0);
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());
  EXPECT_EQ(pools_.UseCount(kGraph), 1);
  ASSERT_TRUE(pools_.End(kGraph).ok());
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());  // a second graph shares the pool
  ASSERT_TRUE(pools_.End(kGraph).ok());
  EXPECT_EQ(pools_.UseCount(kGraph), 2);
  auto left = pools_.Release(kGraph);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 1);
  left = pools_.Release(kGraph);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 0);
  EXPECT_TRUE(absl::IsNotFound(pools_.Release(kGraph).status()));  // no use left
  EXPECT_TRUE(absl::IsNotFound(pools_.Release(kOther).status()));  // never begun
}

// As torch: a pool may be allocated to by several entries at once (use_mem_pool on two threads
// or nested, a capture into it inside use_mem_pool); each takes a use, each End one entry.
TEST_F(PrivatePoolsTest, APoolMayBeBegunTwiceAndEachEndTakesOneEntry) {
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());
  ASSERT_TRUE(pools_.Begin(kGraph, Only(2)).ok());
  EXPECT_EQ(pools_.UseCount(kGraph), 2);
  EXPECT_NE(pools_.Route(2, 512), nullptr);
  ASSERT_TRUE(pools_.End(kGraph).ok());  // the latest entry: stream 2's
  EXPECT_EQ(pools_.Route(2, 512), nullptr);
  EXPECT_NE(pools_.Route(1, 512), nullptr);
  ASSERT_TRUE(pools_.End(kGraph).ok());
  EXPECT_FALSE(pools_.any_active());
  EXPECT_TRUE(absl::IsNotFound(pools_.End(kGraph)));
  EXPECT_TRUE(absl::IsNotFound(pools_.End(kOther)));
  EXPECT_EQ(pools_.UseCount(kGraph), 2);
}

// One thread's End never removes another thread's entry of the same pool.
TEST_F(PrivatePoolsTest, AnEndTakesTheCallingThreadsEntry) {
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());
  std::thread other([this] {
    ASSERT_TRUE(pools_.Begin(kGraph, Only(2)).ok());
    ASSERT_TRUE(pools_.End(kGraph).ok());
  });
  other.join();
  EXPECT_NE(pools_.Route(1, 512), nullptr);  // this thread's entry is still there
  EXPECT_EQ(pools_.Route(2, 512), nullptr);
  ASSERT_TRUE(pools_.End(kGraph).ok());
  EXPECT_FALSE(pools_.any_active());
}

TEST_F(PrivatePoolsTest, RoutesOnlyTheStreamsItsFilterAcceptsBySize) {
  EXPECT_FALSE(pools_.any_active());
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());
  EXPECT_TRUE(pools_.any_active());
  EXPECT_EQ(pools_.Route(2, 512), nullptr);
  BlockPool* small = pools_.Route(1, 1 * kMiB);
  BlockPool* large = pools_.Route(1, 1 * kMiB + 512);
  ASSERT_NE(small, nullptr);
  ASSERT_NE(large, nullptr);
  EXPECT_TRUE(small->is_small);
  EXPECT_FALSE(large->is_small);
  EXPECT_FALSE(small->expandable);
  const auto& [id, pool] = *pools_.begin();
  EXPECT_EQ(id, kGraph);
  EXPECT_EQ(small, &pool->small);
  EXPECT_EQ(large, &pool->large);
  ASSERT_TRUE(pools_.Begin(kOther, nullptr).ok());  // no filter: accepts no stream
  EXPECT_EQ(pools_.Route(3, 512), nullptr);
}

TEST_F(PrivatePoolsTest, ACaptureIsUnderwayUntilItsStreamsAreKnownAndNoneCaptures) {
  EXPECT_FALSE(pools_.CaptureUnderway());
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());
  EXPECT_TRUE(pools_.CaptureUnderway());  // no stream routed yet: it may be capturing
  ASSERT_NE(pools_.Route(1, 512), nullptr);
  EXPECT_FALSE(pools_.CaptureUnderway());  // stream 1 is not capturing
  sim_.SetCapturing(1, true);
  EXPECT_TRUE(pools_.CaptureUnderway());
  sim_.SetCapturing(1, false);
}

TEST_F(PrivatePoolsTest, TheOwnerThreadPrunesAFailedCaptureAndItsEndRestoresTheUse) {
  ASSERT_TRUE(pools_.Begin(kGraph, CaptureOf(1)).ok());
  sim_.SetCapturing(1, true);
  ASSERT_NE(pools_.Route(1, 512), nullptr);  // routed while capturing
  sim_.SetCapturing(1, false);               // the capture ended with no End (failed)
  EXPECT_FALSE(pools_.CaptureUnderway());
  EXPECT_FALSE(pools_.any_active());
  EXPECT_EQ(pools_.UseCount(kGraph), 0);
  ASSERT_TRUE(pools_.End(kGraph).ok());  // it had only ended: the lost use comes back
  EXPECT_EQ(pools_.UseCount(kGraph), 1);
}

// use_mem_pool(p) serving eager and capturing streams, two captures into p on two streams
// begun inside it, the first ended (its End takes the second's entry, which served nothing:
// the two cannot be told apart), then use_mem_pool's end (taking the first capture's entry):
// the entry left counts as a capture until its own End, as torch counts every open entry,
// although use_mem_pool's entry routed a capture that has ended. Otherwise a free beside the
// second capture, still under way, would record an event outside relaxed mode.
TEST_F(PrivatePoolsTest, AnEndedCaptureBesideAnotherDoesNotLetTheEntryLeftLookCaptureFree) {
  constexpr StreamId kFirst = 0x30;
  constexpr StreamId kSecond = 0x20;
  ASSERT_TRUE(pools_.Begin(kGraph, [](StreamId) { return true; }).ok());  // use_mem_pool
  ASSERT_NE(pools_.Route(kFirst, 512), nullptr);                          // not capturing
  ASSERT_TRUE(pools_.Begin(kGraph, CaptureOf(kFirst)).ok());
  sim_.SetCapturing(kFirst, true);
  ASSERT_TRUE(pools_.Begin(kGraph, CaptureOf(kSecond)).ok());
  sim_.SetCapturing(kSecond, true);
  ASSERT_NE(pools_.Route(kFirst, 512), nullptr);  // use_mem_pool's entry takes it (the first)
  sim_.SetCapturing(kFirst, false);               // the first capture ends, then its pool's end
  ASSERT_TRUE(pools_.End(kGraph).ok());
  EXPECT_TRUE(pools_.CaptureUnderway());
  ASSERT_NE(pools_.Route(kFirst, 512), nullptr);  // eager again
  ASSERT_TRUE(pools_.End(kGraph).ok());           // use_mem_pool's end
  EXPECT_TRUE(pools_.CaptureUnderway());          // the second capture goes on
  EXPECT_EQ(pools_.DescribeCapture(),
            "a capture into private pool (1, 0) may be under way: it has begun and not ended");
  sim_.SetCapturing(kSecond, false);
  ASSERT_TRUE(pools_.End(kGraph).ok());  // the second capture's end takes the entry left
  EXPECT_FALSE(pools_.any_active());
  EXPECT_FALSE(pools_.CaptureUnderway());
  EXPECT_EQ(pools_.DescribeCapture(), "none seen");
  EXPECT_EQ(pools_.UseCount(kGraph), 3);
}

TEST_F(PrivatePoolsTest, DescribeCaptureNamesTheCapturingStreamFirst) {
  ASSERT_TRUE(pools_.Begin(kOther, Only(2)).ok());  // served nothing yet: may capture
  ASSERT_TRUE(pools_.Begin(kGraph, CaptureOf(1)).ok());
  sim_.SetCapturing(1, true);
  ASSERT_NE(pools_.Route(1, 512), nullptr);
  EXPECT_EQ(pools_.DescribeCapture(), "stream 1 captures into private pool (1, 0)");
  sim_.SetCapturing(1, false);
  ASSERT_TRUE(pools_.End(kGraph).ok());
  EXPECT_EQ(pools_.DescribeCapture(),
            "a capture into private pool (2, 0) may be under way: it has begun and not ended");
  ASSERT_TRUE(pools_.End(kOther).ok());
}

// A use_mem_pool entry (its filter: the owner's thread, any stream) that has served only a
// capturing stream is not a failed capture once that capture ends.
TEST_F(PrivatePoolsTest, AnEntryWhoseFilterStillAcceptsTheStreamIsNotPruned) {
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());
  sim_.SetCapturing(1, true);
  ASSERT_NE(pools_.Route(1, 512), nullptr);
  sim_.SetCapturing(1, false);
  EXPECT_FALSE(pools_.CaptureUnderway());
  EXPECT_TRUE(pools_.any_active());
  EXPECT_EQ(pools_.UseCount(kGraph), 1);
  ASSERT_TRUE(pools_.End(kGraph).ok());
}

TEST_F(PrivatePoolsTest, AnotherThreadDoesNotPruneWithinTheGrace) {
  ASSERT_TRUE(pools_.Begin(kGraph, CaptureOf(1)).ok());
  sim_.SetCapturing(1, true);
  ASSERT_NE(pools_.Route(1, 512), nullptr);
  sim_.SetCapturing(1, false);
  // Between the owner's cudaStreamEndCapture and its End: another thread must not prune it.
  std::thread other([this] { pools_.PruneFailedCaptures(); });
  other.join();
  EXPECT_TRUE(pools_.any_active());
  EXPECT_EQ(pools_.UseCount(kGraph), 1);
  ASSERT_TRUE(pools_.End(kGraph).ok());
  EXPECT_EQ(pools_.UseCount(kGraph), 1);
}

TEST_F(PrivatePoolsTest, ReleaseUnusedVisitsLargeThenSmallAndForgetsEmptyPools) {
  for (MempoolId id : {kGraph, kOther}) {
    ASSERT_TRUE(pools_.Begin(id, Only(1)).ok());
    ASSERT_TRUE(pools_.End(id).ok());
  }
  ASSERT_TRUE(pools_.Release(kGraph).ok());  // kGraph: no use left; kOther: still used
  std::vector<BlockPool*> visited;
  const PrivatePools::Pool* graph = pools_.begin()->second.get();
  bool keep = true;
  auto release = [&](BlockPool* p) {
    visited.push_back(p);
    return absl::OkStatus();
  };
  auto has_segments = [&](const PrivatePools::Pool&) { return keep; };
  ASSERT_TRUE(pools_.ReleaseUnused(release, has_segments).ok());
  ASSERT_EQ(visited.size(), 2u);
  EXPECT_EQ(visited[0], &graph->large);
  EXPECT_EQ(visited[1], &graph->small);
  EXPECT_EQ(pools_.UseCount(kGraph), 0);
  EXPECT_EQ(std::distance(pools_.begin(), pools_.end()), 2);  // kept: it still has segments
  keep = false;
  ASSERT_TRUE(pools_.ReleaseUnused(release, has_segments).ok());
  EXPECT_EQ(std::distance(pools_.begin(), pools_.end()), 1);
  EXPECT_EQ(pools_.begin()->first, kOther);
  // An error stops the walk and is returned.
  ASSERT_TRUE(pools_.Release(kOther).ok());
  EXPECT_TRUE(absl::IsInternal(pools_.ReleaseUnused(
      [](BlockPool*) { return absl::InternalError("cudaFree failed"); }, has_segments)));
  EXPECT_EQ(std::distance(pools_.begin(), pools_.end()), 1);
}

TEST_F(PrivatePoolsTest, FreeBlocksCountsTheIndexesOfEveryPool) {
  ASSERT_TRUE(pools_.Begin(kGraph, Only(1)).ok());
  EXPECT_EQ(pools_.FreeBlocks(), 0);
  BlockPool* small = pools_.Route(1, 512);
  Segment seg;
  Block b;
  b.ptr = seg.ptr = 0x1000;
  b.size = seg.size = 2 * kMiB;
  b.stream = 1;
  b.pool = seg.pool = small;
  b.segment = &seg;
  seg.head = &b;
  small->blocks.insert(&b);
  EXPECT_EQ(pools_.FreeBlocks(), 1);
  EXPECT_TRUE(pools_.CheckInvariants().ok()) << pools_.CheckInvariants();
  small->blocks.erase(&b);
}

}  // namespace
}  // namespace vramledger::core
