// torch.cuda.MemPool on SimBackend (core/mem_pools.cc, core/private_pools.h): pool lifecycle
// with a per-thread filter, pools whose segments come from a SegmentSource, use_on_oom, no_split,
// the empty_cache of one pool, and bad input.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>

#include "mem_pools_fixture.h"

namespace vramledger {
namespace {

TEST_F(MemPoolsTest, LifecycleWithAThreadFilter) {
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());  // incref
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 2);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);

  // Another thread allocates into the pool through its own filter; this thread does not.
  DevicePtr in_pool = 0;
  DevicePtr outside = 0;
  std::thread worker([&] {
    OnThisThreadIn(kPool, [&] {
      EXPECT_EQ(alloc_->PoolUseCount(kPool), 2);
      in_pool = Alloc(4 * kMiB);
    });
  });
  worker.join();
  ASSERT_FALSE(HasFailure());
  const std::thread::id other_thread{};  // a filter for a thread that never allocates
  ASSERT_TRUE(alloc_
                  ->BeginAllocateToPool(kOther,
                                        [other_thread](StreamId) {
                                          return std::this_thread::get_id() == other_thread;
                                        })
                  .ok());
  outside = Alloc(4 * kMiB);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kOther).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kOther).ok());
  EXPECT_EQ(OwnerOf(in_pool), kPool);
  EXPECT_EQ(OwnerOf(outside), (MempoolId{0, 0}));
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);

  // Released with a live block: the pool and its segment stay until the block is freed and the
  // pool's cache emptied.
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
  EXPECT_EQ(SegmentsIn(kPool), 1u);
  Free(in_pool);
  Free(outside);
  ASSERT_TRUE(alloc_->EmptyCache(kPool).ok());
  EXPECT_EQ(SegmentsIn(kPool), 0u);
  EXPECT_EQ(SegmentsIn({0, 0}), 1u);  // the default pool's cache is not this call's
}

TEST_F(MemPoolsTest, EmptyingOnePoolLeavesTheOthers) {
  DevicePtr a = 0, b = 0;
  for (MempoolId id : {kPool, kOther}) ASSERT_TRUE(alloc_->CreateOrIncrefPool(id).ok());
  OnThisThreadIn(kPool, [&] { a = Alloc(4 * kMiB); });
  OnThisThreadIn(kOther, [&] { b = Alloc(4 * kMiB); });
  for (MempoolId id : {kPool, kOther}) ASSERT_TRUE(alloc_->ReleasePool(id).ok());
  Free(a);
  Free(b);
  ASSERT_EQ(SegmentsIn(kPool), 1u);
  ASSERT_EQ(SegmentsIn(kOther), 1u);
  const std::int64_t frees = sim_->calls().count(DriverCall::kFree);
  ASSERT_TRUE(alloc_->EmptyCache(kPool).ok());
  EXPECT_EQ(SegmentsIn(kPool), 0u);
  EXPECT_EQ(SegmentsIn(kOther), 1u);
  EXPECT_EQ(sim_->calls().count(DriverCall::kFree), frees + 1);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
  ASSERT_TRUE(alloc_->EmptyCache(kPool).ok());  // forgotten: nothing to do, as torch
  ASSERT_TRUE(alloc_->EmptyCache(kOther).ok());
  EXPECT_EQ(SegmentsIn(kOther), 0u);
}

TEST_F(MemPoolsTest, EmptyCacheOfAPoolInUseKeepsItsMemory) {
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
  OnThisThreadIn(kPool, [&] { Free(Alloc(4 * kMiB)); });
  ASSERT_TRUE(alloc_->EmptyCache(kPool).ok());
  EXPECT_EQ(SegmentsIn(kPool), 1u);              // a live MemPool (or graph) keeps its free blocks
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());  // no use left: its whole free segments go
  EXPECT_EQ(SegmentsIn(kPool), 0u);
  EXPECT_EQ(alloc_->GetStats().reserved_bytes[kAggregate].current, 0);
}

TEST_F(MemPoolsTest, ExternalSourceGivesAndTakesBackThePoolsSegments) {
  auto source = std::make_shared<FakeSource>();
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool, source).ok());
  const std::int64_t mallocs = sim_->calls().count(DriverCall::kMalloc);
  DevicePtr small = 0, large = 0;
  OnThisThreadIn(kPool, [&] {
    small = Alloc(100 * 1024);
    large = Alloc(30 * kMiB);
  });
  EXPECT_EQ(source->allocs, 2);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMalloc), mallocs);  // nothing from the backend
  for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
    EXPECT_EQ(s.pool_id, kPool);
    EXPECT_EQ(source->live.count(s.address), 1u) << s.address;
  }
  EXPECT_GT(alloc_->GetStats().reserved_bytes[kAggregate].current, 30 * kMiB);
  // A source with no memory left: the pool's allocation gets the out-of-memory error.
  source->refuse = true;
  OnThisThreadIn(kPool, [&] {
    auto p = alloc_->Malloc(64 * kMiB, kStream);
    EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
  });
  source->refuse = false;
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  Free(small);
  Free(large);
  ASSERT_TRUE(alloc_->EmptyCache(kPool).ok());
  EXPECT_EQ(source->frees, 2);
  EXPECT_TRUE(source->live.empty());
  EXPECT_EQ(sim_->calls().count(DriverCall::kFree), 0);
  EXPECT_EQ(alloc_->GetStats().reserved_bytes[kAggregate].current, 0);
}

TEST_F(MemPoolsTest, ExternalSourceSegmentsGoBackAtDestruction) {
  auto source = std::make_shared<FakeSource>();
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool, source).ok());
  OnThisThreadIn(kPool, [&] { Free(Alloc(4 * kMiB)); });
  EXPECT_EQ(source->allocs, 1);
  alloc_.reset();
  EXPECT_EQ(source->frees, 1);
  EXPECT_EQ(sim_->calls().count(DriverCall::kFree), 0);
}

// The device holds 64 MiB: the pool caches a free 20 MiB block, the default pool holds 40 MiB,
// and a 20 MiB default-pool request then fits nowhere but in the pool's block.
class UseOnOomTest : public MemPoolsTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(UseOnOomTest, FreeBlocksOfUseOnOomPoolsComeBeforeTheError) {
  for (bool use_on_oom : {false, true}) {
    SCOPED_TRACE(use_on_oom);
    Make(GetParam(), 64 * kMiB);
    ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
    if (use_on_oom) {
      ASSERT_TRUE(alloc_->SetUseOnOOM(kPool, true).ok());
    }
    DevicePtr cached = 0;
    OnThisThreadIn(kPool, [&] { cached = Alloc(20 * kMiB); });
    Free(cached);
    const DevicePtr held = Alloc(40 * kMiB);
    const std::int64_t ooms = alloc_->GetStats().num_ooms;
    auto p = alloc_->Malloc(20 * kMiB, kStream);
    if (!use_on_oom) {
      EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
      EXPECT_EQ(alloc_->GetStats().num_ooms, ooms + 1);
    } else {
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(*p, cached);
      EXPECT_EQ(OwnerOf(*p), kPool);
      EXPECT_EQ(alloc_->GetStats().num_ooms, ooms);
      EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
      Free(*p);
      // Turned off again: the error comes back.
      ASSERT_TRUE(alloc_->SetUseOnOOM(kPool, false).ok());
      EXPECT_TRUE(absl::IsResourceExhausted(alloc_->Malloc(20 * kMiB, kStream).status()));
    }
    Free(held);
    EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  }
}

INSTANTIATE_TEST_SUITE_P(PlainAndExpandable, UseOnOomTest,
                         ::testing::Values("", "expandable_segments:True,expandable_page_mb:2"));

TEST_F(MemPoolsTest, NoSplitKeepsEveryBlockWhole) {
  for (bool no_split : {false, true}) {
    SCOPED_TRACE(no_split);
    Make("");
    ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
    if (no_split) {
      ASSERT_TRUE(alloc_->SetNoSplit(kPool).ok());
    }
    DevicePtr a = 0, b = 0;
    OnThisThreadIn(kPool, [&] {
      a = Alloc(512 * 1024);  // a 2 MiB small segment
      b = Alloc(8 * kMiB);    // a 20 MiB large segment
    });
    for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
      EXPECT_EQ(s.blocks.size(), no_split ? 1u : 2u) << s.total_size;
    }
    Free(a);
    Free(b);
  }
}

TEST_F(MemPoolsTest, BadInputIsRefused) {
  EXPECT_TRUE(absl::IsInvalidArgument(alloc_->CreateOrIncrefPool({0, 0})));
  EXPECT_TRUE(absl::IsNotFound(alloc_->SetUseOnOOM(kPool, true)));
  EXPECT_TRUE(absl::IsNotFound(alloc_->SetNoSplit(kPool)));
  EXPECT_TRUE(absl::IsNotFound(alloc_->ReleasePool(kPool)));
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
  ASSERT_TRUE(alloc_->EmptyCache(kPool).ok());  // unknown: nothing to empty, as torch
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
  absl::Status again = alloc_->CreateOrIncrefPool(kPool, std::make_shared<FakeSource>());
  EXPECT_TRUE(absl::IsInvalidArgument(again)) << again;
  EXPECT_NE(again.message().find("(0, 1)"), std::string::npos) << again;
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);  // nothing changed
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  absl::Status twice = alloc_->ReleasePool(kPool);  // released twice
  EXPECT_TRUE(absl::IsNotFound(twice)) << twice;
  EXPECT_NE(twice.message().find("(0, 1)"), std::string::npos) << twice;
}

}  // namespace
}  // namespace vramledger
