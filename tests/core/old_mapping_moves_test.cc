// Moves without a stall (old mappings, expandable-segments.md) under stress: events that
// never complete, destruction with old mappings outstanding, reuse of a old-mapping address, other
// streams, multi-page handles released while still mapped elsewhere, out of memory, captures,
// and the event pool staying bounded. Written to break the feature; the bugs found are fixed.
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "ledger/device_report.h"
#include "sim_allocator_fixture.h"

namespace vramledger {
namespace {

constexpr StreamId kS1 = 0x33;
constexpr StreamId kCapture = 0x20;
constexpr MempoolId kPool{1, 0};

class OldMappingMovesTest : public SimAllocatorTest {
 protected:
  // a | hole | b, free hole, then a 10 MiB allocation at the tail: the hole's 4 pages move
  // within stream `s` and their old address retires.
  DevicePtr MakeOldMapping(StreamId s, std::vector<DevicePtr>* live) {
    DevicePtr a = Alloc(8 * kMiB, s);
    DevicePtr hole = Alloc(8 * kMiB, s);
    DevicePtr b = Alloc(8 * kMiB, s);
    Free(hole);
    DevicePtr big = Alloc(10 * kMiB, s);
    live->insert(live->end(), {a, b, big});
    return hole;
  }
  // x | y | z with x = `x_bytes`, y = `y_bytes`: y freed, then an allocation at the tail takes
  // y's handle (y's address retires, fence pending); then x is freed, so x and y form one free
  // block whose pages are all mapped except y's old-mapping ones. Mapping over those is then the
  // cheapest place for a request that covers them (placement counts a old-mapping page as 64, a
  // missing one as 1: the tail costs x_bytes / 2 MiB + 1 pages). Returns x's address.
  DevicePtr MakeOldMappingInLargeHole(std::size_t x_bytes, std::size_t y_bytes,
                                      std::vector<DevicePtr>* live) {
    DevicePtr x = Alloc(x_bytes);
    DevicePtr y = Alloc(y_bytes);
    DevicePtr z = Alloc(8 * kMiB);
    Free(y);
    DevicePtr tail = Alloc(y_bytes + 2 * kMiB);
    EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(y_bytes));
    Free(x);
    live->insert(live->end(), {z, tail});
    return x;
  }
  DevicePtr MakeReleasableAlias(std::vector<DevicePtr>* live);
  // Random single-/two-stream churn; events never complete unless `complete`.
  void Churn(const std::string& conf, int ops, std::size_t capacity, bool two_streams,
             bool complete, std::vector<std::pair<DevicePtr, StreamId>>* live, int* ooms);
};

void OldMappingMovesTest::Churn(const std::string& conf, int ops, std::size_t capacity,
                                bool two_streams, bool complete,
                                std::vector<std::pair<DevicePtr, StreamId>>* live, int* ooms) {
  Make(conf, capacity);
  std::mt19937_64 rng(11);
  const StreamId streams[] = {0, kS1};
  std::int64_t max_old_mapping_bytes = 0;
  for (int op = 0; op < ops; ++op) {
    const int what = static_cast<int>(rng() % 100);
    if (what < 52 || live->empty()) {
      const std::size_t size = 1 + static_cast<std::size_t>(std::exp2((rng() % 2500) / 100.0));
      const StreamId s = two_streams ? streams[rng() % 2] : 0;
      auto p = alloc_->Malloc(size, s);
      if (!p.ok()) {
        ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted)
            << "op " << op << ": " << p.status();
        ++*ooms;
      } else {
        live->emplace_back(*p, s);
      }
    } else if (what < 99) {
      const std::size_t i = rng() % live->size();
      ASSERT_TRUE(alloc_->Free((*live)[i].first).ok());
      (*live)[i] = live->back();
      live->pop_back();
    } else if (complete) {
      sim_->CompleteAllEvents();
    }
    ASSERT_TRUE(alloc_->CheckInvariants().ok()) << "op " << op << ": " << alloc_->CheckInvariants();
    ASSERT_EQ(Reserved(), static_cast<std::int64_t>(sim_->mapped_bytes() - sim_->aliased_bytes()))
        << "op " << op;
    if (op % 500 == 0) {
      max_old_mapping_bytes = std::max(max_old_mapping_bytes, OldMappingBytes());
      ASSERT_EQ(OldMappingBytes(), static_cast<std::int64_t>(sim_->aliased_bytes())) << "op " << op;
    }
  }
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 0);
}

// 1. Many moves, no event ever completes, then empty_cache.
TEST_F(OldMappingMovesTest, ManyMovesNoCompletionThenEmptyCache) {
  std::vector<std::pair<DevicePtr, StreamId>> live;
  int ooms = 0;
  Churn("expandable_segments:True,expandable_page_mb:2", 20000, 64 * kGiB, false, false, &live,
        &ooms);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_EQ(sim_->aliased_bytes(), 0u);
  EXPECT_EQ(static_cast<std::size_t>(Reserved()), sim_->mapped_bytes());
  EXPECT_EQ(static_cast<std::size_t>(Reserved()), sim_->used_bytes());
  for (auto [p, s] : live) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
  EXPECT_EQ(sim_->mapped_bytes(), 0u);
}

// 1b. The same with multi-page handles (moves whole, and "released because they fit nowhere").
TEST_F(OldMappingMovesTest, ManyMovesNoCompletionMultiPageHandles) {
  std::vector<std::pair<DevicePtr, StreamId>> live;
  int ooms = 0;
  Churn("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", 20000, 64 * kGiB,
        false, false, &live, &ooms);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->aliased_bytes(), 0u);
  for (auto [p, s] : live) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// 1c. Two streams, small card (OOM paths), multi-page handles, never completing.
TEST_F(OldMappingMovesTest, TwoStreamsSmallCardNoCompletion) {
  std::vector<std::pair<DevicePtr, StreamId>> live;
  int ooms = 0;
  Churn("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", 30000, 2 * kGiB,
        true, false, &live, &ooms);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_GT(ooms, 0);
  for (auto [p, s] : live) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

TEST_F(OldMappingMovesTest, TwoStreamsSmallCardSometimesCompleting) {
  std::vector<std::pair<DevicePtr, StreamId>> live;
  int ooms = 0;
  Churn("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", 30000, 2 * kGiB,
        true, true, &live, &ooms);
  ASSERT_FALSE(HasFatalFailure());
  for (auto [p, s] : live) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// 2. Destroyed with old mappings outstanding: nothing leaks.
TEST_F(OldMappingMovesTest, DestroyWithOldMappingOutstanding) {
  std::vector<DevicePtr> live;
  MakeOldMapping(0, &live);
  MakeOldMapping(kS1, &live);
  ASSERT_EQ(OldMappingBytes(), static_cast<std::int64_t>(16 * kMiB));
  ASSERT_GT(sim_->live_events(), 0);
  for (DevicePtr p : live) Free(p);  // cached, pages mapped
  alloc_.reset();
  EXPECT_EQ(sim_->mapped_bytes(), 0u);
  EXPECT_EQ(sim_->aliased_bytes(), 0u);
  EXPECT_EQ(sim_->used_bytes(), 0u);
  EXPECT_EQ(sim_->live_events(), 0);
  EXPECT_EQ(sim_->live_reservations(), 0);
  EXPECT_EQ(sim_->live_allocations(), 0);
}

TEST_F(OldMappingMovesTest, DestroyWithOldMappingAndLiveBlocksAfterChurn) {
  std::vector<std::pair<DevicePtr, StreamId>> live;
  int ooms = 0;
  Churn("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", 5000, 2 * kGiB,
        true, false, &live, &ooms);
  ASSERT_FALSE(HasFatalFailure());
  alloc_.reset();  // live blocks leaked by contract, but the driver state is returned
  EXPECT_EQ(sim_->mapped_bytes(), 0u);
  EXPECT_EQ(sim_->used_bytes(), 0u);
  EXPECT_EQ(sim_->live_events(), 0);
  EXPECT_EQ(sim_->live_reservations(), 0);
}

// 3. A old-mapping address reused as a destination: waits while pending, not after completion.
TEST_F(OldMappingMovesTest, OldMappingAddressReusedAfterFenceCompletedDoesNotWait) {
  std::vector<DevicePtr> live;
  DevicePtr hole = MakeOldMapping(0, &live);
  sim_->CompleteStream(0);
  const auto esync = Calls(DriverCall::kEventSynchronize);
  const auto ssync = Calls(DriverCall::kStreamSynchronize);
  DevicePtr again = Alloc(8 * kMiB);
  EXPECT_EQ(again, hole);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), esync);
  EXPECT_EQ(Calls(DriverCall::kStreamSynchronize), ssync);
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_TRUE(sim_->IsAccessible(again, 8 * kMiB));
}

// While its fence is pending, a old-mapping address is taken only where every other place costs
// more; then the allocation waits once, and only the overlapping entry is unmapped.
TEST_F(OldMappingMovesTest, OldMappingAddressAvoidedWhilePendingUnlessCheapest) {
  std::vector<DevicePtr> live;
  DevicePtr hole = MakeOldMapping(0, &live);  // 4 old-mapping pages at `hole`
  const auto esync = Calls(DriverCall::kEventSynchronize);
  DevicePtr elsewhere = Alloc(2 * kMiB);  // one new page at the tail beats a retiring one
  EXPECT_NE(elsewhere, hole);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), esync);
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));
  Free(elsewhere);
  for (DevicePtr p : live) Free(p);

  Make("expandable_segments:True,expandable_page_mb:2");
  live.clear();
  // 160 MiB mapped + 8 MiB (4 pages) retiring, a request covering all of it: 4 x 64 = 256 >
  // 84 new pages at the tail.
  DevicePtr x = MakeOldMappingInLargeHole(160 * kMiB, 8 * kMiB, &live);
  DevicePtr p = Alloc(168 * kMiB);
  EXPECT_NE(p, x);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), 0);
  Free(p);
  for (DevicePtr q : live) Free(q);

  Make("expandable_segments:True,expandable_page_mb:2");
  live.clear();
  // 200 MiB mapped + 4 MiB (2 pages) retiring: 2 x 64 = 128 > 101 new pages, but a request
  // covering one of them costs 64 < 101: it waits once, and the other page stays retiring
  // until the next slow path finds its (shared, now completed) fence.
  x = MakeOldMappingInLargeHole(200 * kMiB, 4 * kMiB, &live);
  const auto esync2 = Calls(DriverCall::kEventSynchronize);
  DevicePtr part = Alloc(202 * kMiB);
  EXPECT_EQ(part, x);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), esync2 + 1);
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(2 * kMiB));
  DevicePtr rest = Alloc(2 * kMiB);
  EXPECT_EQ(rest, x + 202 * kMiB);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), esync2 + 1);  // completed: no second wait
  EXPECT_EQ(OldMappingBytes(), 0);
  for (DevicePtr q : {part, rest}) Free(q);
  for (DevicePtr q : live) Free(q);
}

// Multi-page handle: the destination overlaps one page of a 4-page old-mapping alias.
TEST_F(OldMappingMovesTest, PartialOverlapOfMultiPageOldMappingAlias) {
  Make("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8");
  std::vector<DevicePtr> live;
  // 600 MiB mapped + one 8 MiB handle retiring; 602 MiB covers one page of it: 64 < 302 pages.
  DevicePtr x = MakeOldMappingInLargeHole(600 * kMiB, 8 * kMiB, &live);
  ASSERT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));
  const auto esync = Calls(DriverCall::kEventSynchronize);
  DevicePtr p = Alloc(602 * kMiB);
  EXPECT_EQ(p, x);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), esync + 1);
  EXPECT_EQ(OldMappingBytes(), 0);  // the whole handle's old mapping goes
  Free(p);
  for (DevicePtr q : live) Free(q);
}

// 4. Mixed streams: a page that moved within stream 0 (alias pending) and whose new block was
// freed moves to stream kS1: must wait for stream 0.
TEST_F(OldMappingMovesTest, HandleWithPendingAliasMovesToAnotherStream) {
  std::vector<DevicePtr> live;
  MakeOldMapping(0, &live);
  DevicePtr big = live.back();
  live.pop_back();
  Free(big);  // the moved handles are now in a free block of stream 0
  const auto ssync = Calls(DriverCall::kStreamSynchronize);
  alloc_->ResetPeakStats();
  DevicePtr other = Alloc(10 * kMiB, kS1);
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 4);
  EXPECT_EQ(Calls(DriverCall::kStreamSynchronize), ssync + 1);
  Free(other);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->aliased_bytes(), 0u);
  for (DevicePtr p : live) Free(p);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// The same while kCapture, whose free pages would be recycled, captures: waiting for it (a
// synchronize, or its fences) would end the capture, so its pages stay and new ones are mapped.
TEST_F(OldMappingMovesTest, PagesOfACapturingStreamAreNotRecycledDuringItsCapture) {
  std::vector<DevicePtr> live;
  MakeOldMapping(kCapture, &live);
  DevicePtr big = live.back();
  live.pop_back();
  Free(big);  // the moved handles are now in a free block of kCapture's
  SimBackend* sim = sim_.get();
  ASSERT_TRUE(alloc_
                  ->BeginAllocateToPool(
                      kPool, [sim](StreamId s) { return s == kCapture && sim->IsCapturing(s); })
                  .ok());
  sim_->SetCapturing(kCapture, true);
  const auto moves = FragmentationOf(*alloc_).page_moves;
  const auto ssync = Calls(DriverCall::kStreamSynchronize);
  const auto events = Calls(DriverCall::kEventQuery) + Calls(DriverCall::kEventSynchronize);
  alloc_->ResetPeakStats();
  DevicePtr other = Alloc(10 * kMiB, kS1);
  EXPECT_EQ(FragmentationOf(*alloc_).page_moves, moves);
  EXPECT_EQ(Calls(DriverCall::kStreamSynchronize), ssync);
  EXPECT_EQ(Calls(DriverCall::kEventQuery) + Calls(DriverCall::kEventSynchronize), events);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  sim_->SetCapturing(kCapture, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  Free(other);
  for (DevicePtr p : live) Free(p);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// A handle with a pending alias that is released "because it fits nowhere".
// Stream kS1: a 12 MiB free block F whose pages are [unmapped x2][mapped][unmapped x3].
// Stream 0: handle H (4 pages) moves within stream 0 (old address retiring, fence pending),
// then its new block is freed. A 10 MiB request on kS1 lands in F (runs of 2 pages): H is
// recycled, fits no run, and is released; it was released while still mapped at its old
// address ("cuMemRelease: still mapped") before UnmapPage cleared its old mappings first.
// Returns F's address; `live` gets the blocks to keep.
DevicePtr OldMappingMovesTest::MakeReleasableAlias(std::vector<DevicePtr>* live) {
  Make("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8");
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr hole = Alloc(8 * kMiB);
  DevicePtr b = Alloc(7 * kMiB);  // its last page is partial
  DevicePtr f1 = Alloc(4 * kMiB, kS1);
  DevicePtr f2 = Alloc(2 * kMiB, kS1);
  DevicePtr f3 = Alloc(6 * kMiB, kS1);
  DevicePtr g = Alloc(2 * kMiB, kS1);
  Free(f1);
  Free(f3);
  EXPECT_TRUE(alloc_->EmptyCache().ok());
  Free(f2);  // F = [f1, g): page 2 mapped
  Free(hole);
  alloc_->ResetPeakStats();
  DevicePtr big = Alloc(9 * kMiB);  // page 11 mapped, 4 missing: H moves
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));
  Free(big);
  live->insert(live->end(), {a, b, g});
  return f1;
}

TEST_F(OldMappingMovesTest, ReleasedHandleWithPendingAlias) {
  std::vector<DevicePtr> live;
  const DevicePtr f = MakeReleasableAlias(&live);
  const auto moves = FragmentationOf(*alloc_).page_moves;
  auto p = alloc_->Malloc(10 * kMiB, kS1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, moves);
  Check();
  EXPECT_EQ(*p, f);
}

// The same with a capture under way on another stream (SettleOldMappings returns at once then).
TEST_F(OldMappingMovesTest, ReleasedHandleWithPendingAliasDuringCapture) {
  std::vector<DevicePtr> live;
  const DevicePtr f = MakeReleasableAlias(&live);
  const auto moves = FragmentationOf(*alloc_).page_moves;
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, [](StreamId s) { return s == kCapture; }).ok());
  sim_->SetCapturing(kCapture, true);
  const auto events = Calls(DriverCall::kEventQuery) + Calls(DriverCall::kEventSynchronize);
  auto p = alloc_->Malloc(10 * kMiB, kS1);
  // The released handle's old mapping goes first: its stream is waited for, not its fence.
  EXPECT_EQ(Calls(DriverCall::kEventQuery) + Calls(DriverCall::kEventSynchronize), events);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  sim_->SetCapturing(kCapture, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, moves);
  Check();
  EXPECT_EQ(*p, f);
}

// The released handle has since moved to a third stream (its old mapping's fence, recorded on
// stream 0, not yet seen complete), and now stream 0 captures. Releasing the handle would first
// unmap that old mapping, waiting for the capturing stream: so it stays (neither moved nor
// released), the request gets new pages, and the old mapping goes once the capture has ended.
TEST_F(OldMappingMovesTest, HandleWithAnOldMappingOnACapturingStreamIsNotReleased) {
  constexpr StreamId kS2 = 0x44;
  std::vector<DevicePtr> live;
  const DevicePtr f = MakeReleasableAlias(&live);
  const std::int64_t old_bytes = OldMappingBytes();
  DevicePtr there = Alloc(8 * kMiB, kS2);  // the handle moves to kS2 (stream 0 waited for)
  Free(there);
  ASSERT_EQ(OldMappingBytes(), old_bytes);
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, [](StreamId) { return false; }).ok());
  sim_->SetCapturing(0, true);
  const auto released = Calls(DriverCall::kMemRelease);
  const auto created = Calls(DriverCall::kMemCreate);
  auto p = alloc_->Malloc(10 * kMiB, kS1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, f);
  EXPECT_EQ(Calls(DriverCall::kMemRelease), released);
  EXPECT_GT(Calls(DriverCall::kMemCreate), created);
  EXPECT_EQ(OldMappingBytes(), old_bytes);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  Check();
  sim_->SetCapturing(0, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  Free(*p);
  for (DevicePtr q : live) Free(q);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// 5. Out of memory while old mappings exist.
TEST_F(OldMappingMovesTest, OomWithOldMappingMappingsIsClean) {
  Make("expandable_segments:True,expandable_page_mb:2", 64 * kMiB);
  std::vector<DevicePtr> live;
  MakeOldMapping(0, &live);  // 24+... MiB reserved
  ASSERT_GT(OldMappingBytes(), 0);
  auto p = alloc_->Malloc(60 * kMiB, 0);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  Check();
  // fill the card with small pieces while the alias exists
  MakeOldMapping(kS1, &live);
  std::vector<DevicePtr> fill;
  for (int i = 0; i < 100; ++i) {
    auto q = alloc_->Malloc(3 * kMiB, i % 2 ? kS1 : 0);
    if (!q.ok()) {
      EXPECT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted) << q.status();
      continue;
    }
    fill.push_back(*q);
    Check();
  }
  for (DevicePtr q : fill) Free(q);
  for (DevicePtr q : live) Free(q);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// 6. Capture under way (another stream captures into a private pool) while an eager move
// happens: no event record/query, and no non-relaxed call.
TEST_F(OldMappingMovesTest, MoveDuringCaptureRecordsNoFence) {
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr hole = Alloc(8 * kMiB);
  DevicePtr b = Alloc(8 * kMiB);
  Free(hole);
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, [](StreamId s) { return s == kCapture; }).ok());
  sim_->SetCapturing(kCapture, true);
  const auto records = Calls(DriverCall::kEventRecord);
  const auto queries = Calls(DriverCall::kEventQuery);
  DevicePtr big = Alloc(10 * kMiB);  // eager stream 0 during the capture
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 0);
  EXPECT_EQ(Calls(DriverCall::kEventRecord), records);
  EXPECT_EQ(Calls(DriverCall::kEventQuery), queries);
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  sim_->SetCapturing(kCapture, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  for (DevicePtr p : {a, b, big}) Free(p);
}

// A old-mapping alias made before the capture, whose address is mapped over during the capture.
TEST_F(OldMappingMovesTest, OldMappingAddressMappedOverDuringCaptureWaitsForItsStream) {
  std::vector<DevicePtr> live;
  DevicePtr hole = MakeOldMappingInLargeHole(200 * kMiB, 2 * kMiB, &live);
  ASSERT_GT(OldMappingBytes(), 0);
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, [](StreamId s) { return s == kCapture; }).ok());
  sim_->SetCapturing(kCapture, true);
  const auto queries = Calls(DriverCall::kEventQuery);
  const auto esync = Calls(DriverCall::kEventSynchronize);
  const auto ssync = Calls(DriverCall::kStreamSynchronize);
  DevicePtr again = Alloc(202 * kMiB);  // over the old-mapping address (64 < 101 new pages)
  EXPECT_EQ(again, hole);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  // The old mapping must go before a handle is mapped there. No event is queried or waited for
  // during a capture (torch's rule), so the stream the fence was recorded on (stream 0, not
  // capturing) is synchronized instead, in relaxed mode; no fence is recorded either.
  EXPECT_EQ(Calls(DriverCall::kEventQuery), queries);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), esync);
  EXPECT_GT(Calls(DriverCall::kStreamSynchronize), ssync);
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_GT(sim_->calls_during_capture_relaxed(), 0);
  sim_->SetCapturing(kCapture, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
}

// The same old mapping when its own stream (0 here) is the one capturing, and the request, on that
// stream, is one its capture's pool does not take (it goes to the device's pool there): unmapping
// the old mapping would wait for the capturing stream, ending its capture. So nothing is mapped
// over it while the capture lasts: the request is out of memory (torch's error during a capture,
// which frees nothing), not a failed precondition, and nothing changes; once the capture ends the
// same request goes there.
TEST_F(OldMappingMovesTest, OldMappingFencedOnACapturingStreamIsNotMappedOverDuringItsCapture) {
  std::vector<DevicePtr> live;
  DevicePtr hole = MakeOldMappingInLargeHole(200 * kMiB, 2 * kMiB, &live);
  const std::int64_t old_bytes = OldMappingBytes();
  ASSERT_GT(old_bytes, 0);
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, [](StreamId) { return false; }).ok());
  sim_->SetCapturing(0, true);
  const std::int64_t reserved = Reserved();
  const auto ssync = Calls(DriverCall::kStreamSynchronize);
  auto p = alloc_->Malloc(202 * kMiB, 0);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_EQ(OldMappingBytes(), old_bytes);
  EXPECT_EQ(Reserved(), reserved);
  EXPECT_EQ(Calls(DriverCall::kStreamSynchronize), ssync);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  Check();
  sim_->SetCapturing(0, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  DevicePtr again = Alloc(202 * kMiB);
  EXPECT_EQ(again, hole);
  EXPECT_EQ(OldMappingBytes(), 0);
  Free(again);
  for (DevicePtr q : live) Free(q);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// SettleOldMappings(wait=false) queries a pending fence once per slow path, not once per entry.
TEST_F(OldMappingMovesTest, PendingFenceIsQueriedOncePerSlowPath) {
  std::vector<DevicePtr> live;
  MakeOldMapping(0, &live);  // 4 entries share one pending fence
  const auto queries = Calls(DriverCall::kEventQuery);
  DevicePtr more = Alloc(20 * kMiB);  // new pages at the tail: a slow path
  (void)more;
  EXPECT_EQ(Calls(DriverCall::kEventQuery) - queries, 1);
}

// 7. Event leak: a long loop of moves keeps live events bounded.
TEST_F(OldMappingMovesTest, EventsStayBoundedOverManyMoves) {
  DevicePtr a = Alloc(8 * kMiB);
  std::int64_t max_events = 0;
  std::int64_t moves = 0;
  for (int i = 0; i < 2000; ++i) {
    DevicePtr hole = Alloc(8 * kMiB);
    DevicePtr b = Alloc(8 * kMiB);
    Free(hole);
    DevicePtr big = Alloc(10 * kMiB);
    Free(big);
    Free(b);
    if (i % 3 == 0) sim_->CompleteStream(0);
    if (i % 7 == 0) {
      ASSERT_TRUE(alloc_->EmptyCache().ok());
    }
    max_events = std::max(max_events, sim_->live_events());
  }
  moves = FragmentationOf(*alloc_).page_moves;
  EXPECT_GT(moves, 100);
  EXPECT_LE(max_events, 16);
  Free(a);
}

// Old mappings never completing, many moves without any slow path that waits.
TEST_F(OldMappingMovesTest, EventsBoundedWhenFencesNeverComplete) {
  DevicePtr a = Alloc(8 * kMiB);
  std::int64_t max_events = 0;
  for (int i = 0; i < 500; ++i) {
    DevicePtr hole = Alloc(8 * kMiB);
    DevicePtr b = Alloc(8 * kMiB);
    Free(hole);
    DevicePtr big = Alloc(10 * kMiB);
    Free(big);
    Free(b);
    max_events = std::max(max_events, sim_->live_events());
  }
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 0);
  std::printf("max live events %lld, retiring %lld\n", static_cast<long long>(max_events),
              static_cast<long long>(OldMappingBytes()));
  Free(a);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->aliased_bytes(), 0u);
}

// Training steps of changing shapes on a GPU that lags one step behind the host: the fences of
// one step's page moves complete only midway through the next step. A old-mapping address is then
// mapped over only where nothing else is as cheap, so no step waits for a fence.
TEST_F(OldMappingMovesTest, LaggingStepsDoNotWaitForFences) {
  Make("expandable_segments:True");  // default 6 MiB pages, recycling and slack
  std::vector<DevicePtr> weights;
  for (int i = 0; i < 24; ++i) weights.push_back(Alloc(48 * kMiB + 4 * kMiB * i));
  std::mt19937_64 rng(5);
  auto step = [&](std::size_t seq) {
    std::vector<DevicePtr> acts;  // forward: activations kept for backward
    for (int layer = 0; layer < 24; ++layer) {
      acts.push_back(Alloc(seq * 24 * kKiB));
      DevicePtr tmp = Alloc(seq * 40 * kKiB + 512);
      acts.push_back(Alloc(seq * 8 * kKiB + 4096));
      Free(tmp);
      if (layer == 12) sim_->CompleteAllEvents();  // the previous step's work finishes now
    }
    while (!acts.empty()) {  // backward: gradients appear while activations go
      DevicePtr grad = Alloc(seq * 16 * kKiB);
      Free(acts.back());
      acts.pop_back();
      Free(grad);
    }
  };
  for (int i = 0; i < 40; ++i) step(256 + 64 * (rng() % 13));
  const std::int64_t moves = FragmentationOf(*alloc_).page_moves;
  std::printf("page moves %lld, event waits %lld, stream waits %lld\n",
              static_cast<long long>(moves),
              static_cast<long long>(Calls(DriverCall::kEventSynchronize)),
              static_cast<long long>(Calls(DriverCall::kStreamSynchronize)));
  EXPECT_GT(moves, 0);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(Calls(DriverCall::kStreamSynchronize), 0);
  for (DevicePtr w : weights) Free(w);
}

}  // namespace
}  // namespace vramledger
