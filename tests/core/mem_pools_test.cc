// torch.cuda.MemPool on SimBackend (core/mem_pools.cc, core/private_pools.h): pool lifecycle
// with a per-thread filter, pools whose segments come from a SegmentSource, use_on_oom, no_split,
// the empty_cache of one pool, trace entries for every segment change, and bad input.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"

namespace vramledger {
namespace {

constexpr MempoolId kPool{0, 1};
constexpr MempoolId kOther{0, 2};
constexpr StreamId kStream = 0x10;

// A segment source handing out addresses far from SimBackend's, counting its calls.
class FakeSource final : public SegmentSource {
 public:
  absl::StatusOr<DevicePtr> Allocate(std::size_t size, StreamId stream) override {
    (void)stream;
    if (refuse) return absl::ResourceExhaustedError("fake source: no memory");
    ++allocs;
    const DevicePtr p = next_;
    next_ += (size + kGiB - 1) / kGiB * kGiB;
    live.insert(p);
    return p;
  }
  absl::Status Free(DevicePtr ptr) override {
    if (live.erase(ptr) != 1) return absl::NotFoundError("fake source: unknown pointer");
    ++frees;
    return absl::OkStatus();
  }
  int allocs = 0;
  int frees = 0;
  bool refuse = false;
  std::set<DevicePtr> live;

 private:
  DevicePtr next_ = DevicePtr{1} << 46;
};

// Every trace entry, in order.
class RecordingHooks final : public AllocatorHooks {
 public:
  void OnEvent(const TraceEntry& e) override { events.push_back(e); }
  std::vector<TraceEntry> events;
};

class MemPoolsTest : public ::testing::Test {
 protected:
  void Make(const std::string& conf, std::size_t capacity = 16 * kGiB) {
    alloc_.reset();
    SimBackend::Config config;
    config.capacity = capacity;
    sim_ = std::make_unique<SimBackend>(config);
    auto options = ParseOptions(conf);
    ASSERT_TRUE(options.ok()) << options.status();
    alloc_ = std::make_unique<DeviceAllocator>(*options, sim_.get());
  }
  void SetUp() override { Make(""); }
  void TearDown() override {
    if (alloc_ != nullptr) {
      EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
    }
  }
  DevicePtr Alloc(std::size_t size, StreamId stream = kStream) {
    auto p = alloc_->Malloc(size, stream);
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
    return p.ok() ? *p : 0;
  }
  void Free(DevicePtr p) {
    ASSERT_TRUE(alloc_->Free(p).ok());
    ASSERT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
  }
  // The pool owning the segment that holds `p` ({9, 9} if none does).
  MempoolId OwnerOf(DevicePtr p) {
    for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
      if (p >= s.address && p < s.address + s.total_size) return s.pool_id;
    }
    return {9, 9};
  }
  std::size_t SegmentsIn(MempoolId pool) {
    std::size_t n = 0;
    for (const SegmentInfo& s : SegmentsOf(*alloc_)) n += s.pool_id == pool ? 1 : 0;
    return n;
  }
  // Allocations on this thread go to `pool` while `fn` runs (torch's use_mem_pool: begin with a
  // filter accepting the calling thread, end, release the use the begin took).
  template <typename Fn>
  void OnThisThreadIn(MempoolId pool, Fn fn) {
    const std::thread::id me = std::this_thread::get_id();
    ASSERT_TRUE(
        alloc_
            ->BeginAllocateToPool(pool, [me](StreamId) { return std::this_thread::get_id() == me; })
            .ok());
    fn();
    ASSERT_TRUE(alloc_->EndAllocateToPool(pool).ok());
    ASSERT_TRUE(alloc_->ReleasePool(pool).ok());
  }

  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
};

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

TEST_F(MemPoolsTest, TraceEntriesNameThePoolOfEachSegmentAndBlock) {
  RecordingHooks hooks;
  alloc_->SetHooks(&hooks);
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
  DevicePtr a = 0;
  OnThisThreadIn(kPool, [&] { a = Alloc(4 * kMiB); });
  const DevicePtr b = Alloc(4 * kMiB);
  Free(a);
  Free(b);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  alloc_->SetHooks(nullptr);
  std::vector<std::pair<TraceAction, MempoolId>> seen;
  for (const TraceEntry& e : hooks.events) {
    if (e.addr == a || e.addr == b) seen.emplace_back(e.action, e.pool);
  }
  using A = TraceAction;
  const std::vector<std::pair<TraceAction, MempoolId>> want = {
      {A::kSegmentAlloc, kPool},   {A::kAlloc, kPool},          {A::kSegmentAlloc, {0, 0}},
      {A::kAlloc, {0, 0}},         {A::kFreeRequested, kPool},  {A::kFreeCompleted, kPool},
      {A::kFreeRequested, {0, 0}}, {A::kFreeCompleted, {0, 0}}, {A::kSegmentFree, kPool},
      {A::kSegmentFree, {0, 0}}};
  EXPECT_EQ(seen, want);
}

// The pages a tracker sees mapped (segment alloc/map minus free/unmap) are the allocator's
// segments after every operation, through random churn with page recycling; a page is never
// mapped twice nor unmapped unmapped, and an allocation's pages are mapped before its alloc
// event.
class PageTracker final : public AllocatorHooks {
 public:
  void OnEvent(const TraceEntry& e) override {
    switch (e.action) {
      case TraceAction::kSegmentAlloc:
      case TraceAction::kSegmentMap:
        for (DevicePtr p = e.addr; p < e.addr + e.size; p += kPage) {
          if (!pages.insert(p).second) ++errors;
        }
        break;
      case TraceAction::kSegmentFree:
      case TraceAction::kSegmentUnmap:
        for (DevicePtr p = e.addr; p < e.addr + e.size; p += kPage) {
          if (pages.erase(p) != 1) ++errors;
        }
        break;
      case TraceAction::kAlloc:
        for (DevicePtr p = e.addr / kPage * kPage; p < e.addr + e.size; p += kPage) {
          if (pages.count(p) == 0) ++errors;
        }
        break;
      default:
        break;
    }
  }
  static constexpr std::size_t kPage = 2 * kMiB;
  std::set<DevicePtr> pages;
  int errors = 0;
};

class TrackerTest : public MemPoolsTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(TrackerTest, FollowsMappedPagesThroughRecycling) {
  Make(GetParam(), 1 * kGiB);
  PageTracker tracker;
  alloc_->SetHooks(&tracker);
  std::uint64_t x = 7;
  std::vector<DevicePtr> live;
  for (int op = 0; op < 3000; ++op) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const unsigned r = static_cast<unsigned>(x >> 33);
    if (r % 100 < 55 || live.empty()) {
      auto p = alloc_->Malloc(1 + (r % (48 * kMiB)), op % 3 == 0 ? 0 : kStream);
      if (p.ok()) live.push_back(*p);
    } else if (r % 100 < 98) {
      const std::size_t i = r % live.size();
      ASSERT_TRUE(alloc_->Free(live[i]).ok());
      live[i] = live.back();
      live.pop_back();
    } else {
      ASSERT_TRUE(alloc_->EmptyCache().ok());
    }
    std::set<DevicePtr> want;
    for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
      for (DevicePtr p = s.address; p < s.address + s.total_size; p += PageTracker::kPage) {
        want.insert(p);
      }
    }
    ASSERT_EQ(tracker.pages, want) << "op " << op;
    ASSERT_EQ(tracker.errors, 0) << "op " << op;
  }
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 0);
  if (std::string(GetParam()).find("keep_old_mappings:True") != std::string::npos) {
    EXPECT_GT(FragmentationOf(*alloc_).reused_old_mappings, 0);
  }
  for (DevicePtr p : live) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_TRUE(tracker.pages.empty());
  alloc_->SetHooks(nullptr);
}

// Page moves, old mappings taken back, and handles of several pages.
INSTANTIATE_TEST_SUITE_P(
    ExpandableKinds, TrackerTest,
    ::testing::Values("expandable_segments:True,expandable_page_mb:2",
                      "expandable_segments:True,expandable_page_mb:2,keep_old_mappings:True",
                      "expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8"));

}  // namespace
}  // namespace vramledger
