// Expandable segments on SimBackend: whole-page mapping, page recycling, empty_cache, the
// design's scenarios with exact figures, handles per block, contiguous_segments(), and a
// randomized run checking that no live block ever sits on an unmapped page.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ledger/device_report.h"
#include "sim_allocator_fixture.h"

namespace vramledger {
namespace {

class ExpandableTest : public SimAllocatorTest {
 protected:
  // `ops` random mallocs (1 B - 32 MiB, two streams), frees (10% after a record_stream), event
  // completions and empty_cache calls on a 2 GiB card, every invariant checked after each one.
  void Randomized(const std::string& conf, int ops);
};

TEST_F(ExpandableTest, MapsWholePagesAndFollowsTorchStats) {
  DevicePtr a = Alloc(3 * kMiB);  // two 2 MiB pages
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(4 * kMiB));
  DevicePtr b = Alloc(1 * kMiB + 512);  // fits in the mapped remainder? 1 MiB left: no -> 1 page
  EXPECT_EQ(b, a + 3 * kMiB);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(6 * kMiB));
  DeviceStats s = alloc_->GetStats();
  EXPECT_EQ(s.segment[kAggregate].current, 0);         // torch: expandable segments not counted
  EXPECT_EQ(s.inactive_split[kAggregate].current, 0);  // nor inactive splits
  EXPECT_EQ(s.num_device_alloc, 3);                    // one per page mapped
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemCreate), 3);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMalloc), 0);
}

// A live block in the middle of a stream's range can leave no free run long enough while the
// card has the memory: a further range is reserved, as torch's find_expandable_block does (not
// an out-of-memory error with 922 MiB of a 1 GiB card free).
TEST_F(ExpandableTest, AFragmentedRangeGetsAnotherRangeNotAnOutOfMemoryError) {
  Make("expandable_segments:True,expandable_page_mb:2", 1 * kGiB);  // ranges of 1.125 GiB
  const DevicePtr a = Alloc(450 * kMiB);
  const DevicePtr b = Alloc(100 * kMiB);  // at 450-550 MiB: free runs of 450 and 602 MiB after
  Free(a);
  Free(Alloc(450 * kMiB));
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(100 * kMiB));
  const auto reserves = sim_->calls().count(DriverCall::kAddressReserve);
  const DevicePtr d = Alloc(620 * kMiB);  // fits neither run of the first range
  EXPECT_EQ(sim_->calls().count(DriverCall::kAddressReserve), reserves + 1);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(720 * kMiB));
  Check();
  // The new range serves later requests too; no third one is reserved while one fits.
  const DevicePtr e = Alloc(200 * kMiB);
  EXPECT_EQ(sim_->calls().count(DriverCall::kAddressReserve), reserves + 1);
  // A request no range could hold is an out-of-memory error and reserves nothing.
  EXPECT_FALSE(alloc_->Malloc(2 * kGiB, 0).ok());
  EXPECT_EQ(sim_->calls().count(DriverCall::kAddressReserve), reserves + 1);
  // Out of memory on a full card (the range has room): still no further range.
  EXPECT_FALSE(alloc_->Malloc(300 * kMiB, 0).ok());
  EXPECT_EQ(sim_->calls().count(DriverCall::kAddressReserve), reserves + 1);
  Free(b);
  Free(d);
  Free(e);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// With a second range, the snapshot shows both ranges' mapped bytes, and recycling moves the
// first range's cached pages to the second instead of going past the card.
TEST_F(ExpandableTest, ASecondRangeIsInTheSnapshotAndRecyclesTheFirstRangesPages) {
  Make("expandable_segments:True,expandable_page_mb:2", 1 * kGiB);
  const DevicePtr a = Alloc(450 * kMiB);
  const DevicePtr b = Alloc(100 * kMiB);
  const DevicePtr c = Alloc(400 * kMiB);
  Free(a);
  Free(c);                                // 850 MiB cached and mapped in the first range, around b
  const DevicePtr d = Alloc(620 * kMiB);  // a second range, by moving the cached pages
  EXPECT_EQ(Calls(DriverCall::kAddressReserve), 2);
  EXPECT_LE(Reserved(), static_cast<std::int64_t>(1 * kGiB));
  std::size_t total = 0;
  for (const auto& seg : SegmentsOf(*alloc_)) total += seg.total_size;
  EXPECT_EQ(total, static_cast<std::size_t>(Reserved()));
  Free(b);
  Free(d);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// Churn on a 1 GiB card with requests up to 400 MiB on two streams, so that ranges fragment and
// further ones are reserved: every invariant after each operation, nothing left at the end.
class MultiRangeTest : public SimAllocatorTest,
                       public ::testing::WithParamInterface<std::string> {};

TEST_P(MultiRangeTest, InvariantsHoldWithSeveralRanges) {
  std::int64_t most_ranges = 0;
  for (std::uint64_t seed = 1; seed < 12; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    Make(GetParam(), 1 * kGiB);
    std::mt19937_64 rng(seed);
    std::vector<DevicePtr> live;
    for (int op = 0; op < 3000; ++op) {
      const int what = static_cast<int>(rng() % 100);
      if (what < 50 || live.empty()) {
        const std::size_t size =
            rng() % 4 == 0 ? (rng() % 400 + 1) * kMiB : (rng() % 4096 + 1) * 1024;
        auto p = alloc_->Malloc(size, rng() % 3 == 0 ? 0x55 : 0);
        if (p.ok()) {
          live.push_back(*p);
        } else {
          ASSERT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
        }
      } else if (what < 95) {
        const std::size_t i = rng() % live.size();
        ASSERT_TRUE(alloc_->Free(live[i]).ok());
        live[i] = live.back();
        live.pop_back();
      } else {
        sim_->CompleteAllEvents();
        ASSERT_TRUE(alloc_->EmptyCache().ok());
      }
      Check();
      if (HasFatalFailure()) return;
    }
    most_ranges = std::max(most_ranges, Calls(DriverCall::kAddressReserve));
    for (DevicePtr p : live) ASSERT_TRUE(alloc_->Free(p).ok());
    sim_->CompleteAllEvents();
    ASSERT_TRUE(alloc_->EmptyCache().ok());
    EXPECT_EQ(Reserved(), 0);
    EXPECT_EQ(sim_->used_bytes(), 0u);
  }
  EXPECT_GT(most_ranges, 2);  // some run needed a further range (two streams: two at least)
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MultiRangeTest,
    ::testing::Values("expandable_segments:True", "expandable_segments:True,expandable_page_mb:2",
                      "expandable_segments:True,keep_old_mappings:False",
                      "expandable_segments:True,expandable_handle_mb:12,recycle_slack:0"));

TEST_F(ExpandableTest, ReuseAfterFreeNeedsNoDriverCall) {
  DevicePtr a = Alloc(100 * kMiB);
  Free(a);
  const auto maps = sim_->calls().count(DriverCall::kMemMap);
  DevicePtr b = Alloc(60 * kMiB);
  DevicePtr c = Alloc(40 * kMiB);
  EXPECT_EQ(b, a);
  EXPECT_EQ(c, a + 60 * kMiB);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemMap), maps);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(100 * kMiB));
}

TEST_F(ExpandableTest, EmptyCacheLeavesOnlyPagesUnderLiveBlocks) {
  DevicePtr a = Alloc(10 * kMiB);
  DevicePtr b = Alloc(10 * kMiB);
  DevicePtr c = Alloc(3 * kMiB);  // pages 10..11 (its last page is shared with nothing)
  Free(b);
  (void)a;
  (void)c;
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  // a: 5 pages, c: 2 pages; b's 5 pages unmapped.
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(14 * kMiB));
  EXPECT_EQ(alloc_->GetStats().num_device_free, 5);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemRelease), 5);
  EXPECT_GE(sim_->calls().count(DriverCall::kStreamSynchronize), 1);  // before unmapping
  Free(a);
  Free(c);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

TEST_F(ExpandableTest, RecyclesFreePagesBeforeCreatingNewOnes) {
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr hole = Alloc(8 * kMiB);
  DevicePtr b = Alloc(8 * kMiB);
  Free(hole);  // 4 whole free pages sit in the hole between a and b
  (void)a;
  const auto creates = sim_->calls().count(DriverCall::kMemCreate);
  DevicePtr big = Alloc(10 * kMiB);  // does not fit the hole: 5 pages at the tail
  EXPECT_EQ(big, b + 8 * kMiB);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemCreate) - creates, 1);  // 4 moved, 1 created
  EXPECT_EQ(FragmentationOf(*alloc_).page_moves, 4);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(26 * kMiB));  // not 34 MiB
  EXPECT_EQ(Allocated(), static_cast<std::int64_t>(26 * kMiB));
}

// Which free pages recycling takes (page-recycling.md, "Recycling"). Stream 0, in
// MiB from a, 2 MiB pages: a [0, 8) h1 [8, 12) b [12, 20) h2 [20, 22) c [22, 30); h1 is freed
// and its pages returned (empty_cache), then h2 is freed (a 1-page hole); stream 1 has a free
// tail of 4 mapped pages [u, u + 8). A 4 MiB request on stream 0 fills h1 and needs 2 pages.
// The asking stream's pages go first: h2's page in either order. Then stream 1's: by default the
// holes before the tails, so the tail from its lowest page (u's first); with
// recycle_tails_first the tail from its highest page (u's last). The mapped ranges (one snapshot
// segment each) show which.
TEST_F(ExpandableTest, RecyclingTakesHolesFirstOrTailsFirst) {
  for (const bool tails_first : {false, true}) {
    SCOPED_TRACE(tails_first ? "recycle_tails_first" : "default");
    Make(std::string("expandable_segments:True,expandable_page_mb:2,recycle_tails_first:") +
         (tails_first ? "True" : "False"));
    const DevicePtr a = Alloc(8 * kMiB);
    const DevicePtr h1 = Alloc(4 * kMiB);
    const DevicePtr b = Alloc(8 * kMiB);
    const DevicePtr h2 = Alloc(2 * kMiB);
    const DevicePtr c = Alloc(8 * kMiB);
    Free(h1);
    ASSERT_TRUE(alloc_->EmptyCache().ok());  // h1's 2 pages unmapped
    const DevicePtr u = Alloc(8 * kMiB, /*stream=*/1);
    Free(u);
    Free(h2);
    sim_->CompleteAllEvents();
    alloc_->ResetPeakStats();  // peak allocated 24 MiB: growth past the slack recycles
    const std::int64_t creates = Calls(DriverCall::kMemCreate);
    const DevicePtr x = Alloc(4 * kMiB);
    EXPECT_EQ(x, h1);
    EXPECT_EQ(Calls(DriverCall::kMemCreate) - creates, 0);
    EXPECT_EQ(FragmentationOf(*alloc_).page_moves, 2);
    using Ranges = std::vector<std::pair<std::int64_t, std::size_t>>;  // MiB: start, size
    Ranges stream0, stream1;
    for (const SegmentInfo& seg : SegmentsOf(*alloc_)) {
      const DevicePtr base = seg.stream == 0 ? a : u;
      (seg.stream == 0 ? stream0 : stream1)
          .emplace_back(static_cast<std::int64_t>(seg.address - base) / std::int64_t{kMiB},
                        seg.total_size / kMiB);
    }
    // The asking stream's hole h2 gives its page in either order (a page of the asking stream
    // goes before another stream's); then stream 1's tail: its lowest page, or with
    // recycle_tails_first its highest.
    EXPECT_EQ(stream0, (Ranges{{0, 20}, {22, 8}}));
    EXPECT_EQ(stream1, tails_first ? (Ranges{{0, 6}}) : (Ranges{{2, 6}}));
    for (DevicePtr p : {a, b, c, x}) Free(p);
  }
}

// Moves without a stall (page-recycling.md): a page that moves within its stream is not
// waited for; its old address stays mapped until a fence recorded on the stream at the move has
// completed, and is unmapped by a later slow path (or waited for before anything is mapped over
// it). A page from another stream's segment is waited for, as before.
TEST_F(ExpandableTest, MovesWithinAStreamDoNotWait) {
  Make("expandable_segments:True,expandable_page_mb:2,keep_old_mappings:False");
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr hole = Alloc(8 * kMiB);
  DevicePtr b = Alloc(8 * kMiB);
  Free(hole);
  (void)a;
  const DriverCallLedger& calls = sim_->calls();
  DevicePtr big = Alloc(10 * kMiB);  // 4 pages move from the hole, 1 is created
  EXPECT_EQ(big, b + 8 * kMiB);
  EXPECT_EQ(FragmentationOf(*alloc_).page_moves, 4);
  EXPECT_EQ(calls.count(DriverCall::kStreamSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 0);
  EXPECT_EQ(calls.count(DriverCall::kEventRecord), 1);  // one fence for the four handles
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(26 * kMiB));
  EXPECT_TRUE(sim_->IsAccessible(big, 10 * kMiB));
  EXPECT_TRUE(sim_->IsAccessible(hole, 8 * kMiB));  // still mapped: queued work may read it
  // Once the stream got there, the next slow path unmaps them without waiting: 2 MiB goes to the
  // hole (best fit), whose first page is new.
  sim_->CompleteStream(0);
  DevicePtr d = Alloc(2 * kMiB);
  EXPECT_EQ(d, hole);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 4);
  EXPECT_EQ(calls.count(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kStreamSynchronize), 0);
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_TRUE(sim_->IsAccessible(hole, 2 * kMiB));
  EXPECT_FALSE(sim_->IsAccessible(hole + 2 * kMiB, 2 * kMiB));
  for (DevicePtr p : {big, d}) Free(p);
}

// keep_old_mappings (the default): the same moves, but once the stream got there the old
// mappings stay until their address is needed for another handle; a handle that lies free again
// goes back to its old address with no driver call (a page move, counted, traced, in reserved
// once), and its place there becomes an old mapping in turn. Each step's figures are exact.
TEST_F(ExpandableTest, OldMappingsAreKeptAndTakenBackWithoutDriverCalls) {
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr hole = Alloc(8 * kMiB);  // pages 4-7
  DevicePtr b = Alloc(8 * kMiB);
  Free(hole);
  const DriverCallLedger& calls = sim_->calls();
  DevicePtr big = Alloc(10 * kMiB);  // the hole's 4 handles move to pages 12-15, page 16 is new
  ASSERT_EQ(big, b + 8 * kMiB);
  DevicePtr after = Alloc(2 * kMiB);  // page 16's free half and one new page
  ASSERT_EQ(after, big + 10 * kMiB);
  EXPECT_EQ(FragmentationOf(*alloc_).page_moves, 4);
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));
  sim_->CompleteStream(0);
  // `big` goes. 4 MiB: the hole is the best fit, and its pages cost what mapped ones do (old
  // mappings of h4-h7, which lie free), so it lands there and h4, h5 go back to pages 4-5 with no
  // driver call; their places in `big` (pages 12, 13) become old mappings in turn, fenced by one
  // event. h6 and h7 stay at pages 14-15.
  Free(big);
  const std::int64_t maps = calls.count(DriverCall::kMemMap);
  const std::int64_t creates = calls.count(DriverCall::kMemCreate);
  const std::int64_t records = calls.count(DriverCall::kEventRecord);
  DevicePtr c = Alloc(4 * kMiB);
  ASSERT_EQ(c, hole);
  EXPECT_EQ(calls.count(DriverCall::kMemMap), maps);
  EXPECT_EQ(calls.count(DriverCall::kMemCreate), creates);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 0);  // the work there finished: kept anyway
  EXPECT_EQ(calls.count(DriverCall::kEventRecord) - records, 1);
  Fragmentation f = FragmentationOf(*alloc_);
  EXPECT_EQ(f.page_moves, 6);
  EXPECT_EQ(f.reused_old_mappings, 2);
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));  // pages 6, 7, 12, 13
  EXPECT_TRUE(sim_->IsAccessible(hole, 8 * kMiB));
  EXPECT_TRUE(sim_->IsAccessible(big, 10 * kMiB));
  sim_->CompleteStream(0);
  // 8 MiB: in `big`'s 10 MiB, pages 13-16 cost 2 (page 13: an old mapping of h5, in use at page
  // 5, so mapping there unmaps it first) against 4 at pages 12-15 and 8 at the tail.
  const std::int64_t reserved = Reserved();
  DevicePtr d = Alloc(8 * kMiB);
  EXPECT_EQ(d, big + 2 * kMiB);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 1);
  EXPECT_EQ(calls.count(DriverCall::kMemMap) - maps, 1);  // a new handle (no free page to move)
  EXPECT_EQ(calls.count(DriverCall::kMemCreate) - creates, 1);
  EXPECT_EQ(calls.count(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kStreamSynchronize), 0);
  EXPECT_EQ(Reserved() - reserved, static_cast<std::int64_t>(2 * kMiB));
  f = FragmentationOf(*alloc_);
  EXPECT_EQ(f.reused_old_mappings, 2);
  // Old mappings now: h6, h7 at pages 6-7 and h4 at page 12.
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(6 * kMiB));
  EXPECT_TRUE(sim_->IsAccessible(big, 10 * kMiB));
  EXPECT_TRUE(sim_->IsAccessible(hole, 8 * kMiB));
  // empty_cache unmaps every old mapping and releases every free page.
  for (DevicePtr p : {a, b, c, d, after}) Free(p);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->aliased_bytes(), 0u);
}

// An old address still in use is not mapped over while another place costs fewer than 64 pages
// per old-mapping page (OldMappingMovesTest covers the wait when it is the cheapest), and a page
// moved from another stream's segment makes the allocation wait for that stream.
TEST_F(ExpandableTest, OldMappingAddressIsAvoidedWhileInUseAndOtherStreamsWait) {
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr hole = Alloc(8 * kMiB);
  DevicePtr b = Alloc(8 * kMiB);
  Free(hole);
  DevicePtr big = Alloc(10 * kMiB);  // the hole's 4 pages move; their old address retires
  const DriverCallLedger& calls = sim_->calls();
  ASSERT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));
  // 8 MiB more: the hole (best fit) has no page and its old mappings are still in use (the
  // fence is queried, not waited for): four new pages at the tail instead, nothing waits.
  DevicePtr again = Alloc(8 * kMiB);
  EXPECT_EQ(again, big + 10 * kMiB);
  EXPECT_EQ(calls.count(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kStreamSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 0);
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(34 * kMiB));
  EXPECT_TRUE(sim_->IsAccessible(again, 8 * kMiB));
  // Once the fence completed, the hole is the best fit again and its old mappings go first.
  sim_->CompleteStream(0);
  DevicePtr next = Alloc(8 * kMiB);
  EXPECT_EQ(next, hole);
  EXPECT_EQ(calls.count(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 4);
  EXPECT_EQ(OldMappingBytes(), 0);
  Free(next);
  for (DevicePtr p : {again, a, b, big}) Free(p);
  // Another stream: its allocation takes pages of stream 0's free blocks and waits for stream 0.
  Make("expandable_segments:True,expandable_page_mb:2");
  const DriverCallLedger& fresh = sim_->calls();
  DevicePtr x = Alloc(8 * kMiB);
  DevicePtr y = Alloc(8 * kMiB);
  DevicePtr z = Alloc(8 * kMiB);
  Free(y);
  auto other = alloc_->Malloc(8 * kMiB, 0x33);
  ASSERT_TRUE(other.ok()) << other.status();
  Check();
  EXPECT_EQ(FragmentationOf(*alloc_).page_moves, 4);
  EXPECT_EQ(fresh.count(DriverCall::kStreamSynchronize), 1);
  EXPECT_EQ(fresh.count(DriverCall::kMemUnmap), 4);
  EXPECT_EQ(OldMappingBytes(), 0);
  ASSERT_TRUE(alloc_->Free(*other).ok());
  for (DevicePtr p : {x, z}) Free(p);
}

// Recycling takes the asking stream's own free pages before another stream's: those move
// without a wait. Pools order blocks by stream first, so without the preference stream 0's hole
// would go first and stream 0x33's request would wait for stream 0.
TEST_F(ExpandableTest, RecyclingTakesTheAskingStreamsPagesFirst) {
  constexpr StreamId kSide = 0x33;
  const DevicePtr x = Alloc(8 * kMiB);
  const DevicePtr y = Alloc(8 * kMiB);  // stream 0's hole: 4 pages
  const DevicePtr z = Alloc(8 * kMiB);
  const DevicePtr p = Alloc(8 * kMiB, kSide);  // the side stream's hole: 4 pages
  const DevicePtr q = Alloc(8 * kMiB, kSide);
  const DevicePtr r = Alloc(4 * kMiB, kSide);  // its tail keeps these 2 pages when freed
  Free(y);
  Free(p);
  Free(r);
  const DriverCallLedger& calls = sim_->calls();
  const auto maps = calls.count(DriverCall::kMemMap);
  const auto creates = calls.count(DriverCall::kMemCreate);
  // 12 MiB on the side stream: past its hole, at the tail, whose 2 mapped pages leave 4 missing;
  // reserved would pass the slack over peak allocated, so 4 pages move: the side stream's own.
  const DevicePtr big = Alloc(12 * kMiB, kSide);
  EXPECT_EQ(big, r);
  EXPECT_EQ(FragmentationOf(*alloc_).page_moves, 4);
  EXPECT_EQ(calls.count(DriverCall::kStreamSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(calls.count(DriverCall::kMemMap), maps + 4);
  EXPECT_EQ(calls.count(DriverCall::kMemCreate), creates);  // no new page
  EXPECT_TRUE(sim_->IsAccessible(y, 8 * kMiB));             // stream 0's pages stay where they are
  EXPECT_TRUE(sim_->IsAccessible(big, 12 * kMiB));
  Check();
  for (DevicePtr d : {x, z, q, big}) Free(d);
}

TEST_F(ExpandableTest, NoRecyclingWhenTurnedOff) {
  Make("expandable_segments:True,expandable_page_mb:2,page_recycling:False");
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr hole = Alloc(8 * kMiB);
  DevicePtr b = Alloc(8 * kMiB);
  Free(hole);
  (void)a;
  (void)b;
  Alloc(10 * kMiB);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(34 * kMiB));
}

TEST_F(ExpandableTest, Scenario16GiBCard) {
  // 16 GiB: alloc 10240 MiB, free, 32 x 16 MiB live, 10240 MiB again: fits, reserved at most
  // 10752 MiB + one page, no OOM.
  Make("expandable_segments:True,expandable_page_mb:2", 16 * kGiB);
  DevicePtr a = Alloc(10240 * kMiB);
  Free(a);
  for (int i = 0; i < 32; ++i) Alloc(16 * kMiB);
  DevicePtr b = Alloc(10240 * kMiB);
  EXPECT_NE(b, 0u);
  EXPECT_LE(Reserved(), static_cast<std::int64_t>(10752 * kMiB + 2 * kMiB));
  EXPECT_EQ(alloc_->GetStats().num_ooms, 0);
}

TEST_F(ExpandableTest, ScenarioMaxSplitCycles) {
  // expandable + max_split_size_mb:128: 100 x {91 MiB, 45.5 MiB, 2 MiB kept, free 91 and 45.5}
  // -> allocated grows 2 MiB a cycle, reserved stays under 500 MiB; then the OOM path is clean.
  Make("expandable_segments:True,max_split_size_mb:128", 4 * kGiB);
  const std::size_t half = 45 * kMiB + 512 * kKiB;
  for (int i = 0; i < 100; ++i) {
    DevicePtr x = Alloc(91 * kMiB);
    DevicePtr y = Alloc(half);
    Alloc(2 * kMiB);
    Free(x);
    Free(y);
    ASSERT_EQ(Allocated(), static_cast<std::int64_t>((i + 1) * 2 * kMiB));
    ASSERT_LT(Reserved(), static_cast<std::int64_t>(500 * kMiB));
  }
  std::vector<DevicePtr> fill;
  for (;;) {
    auto p = alloc_->Malloc(256 * kMiB, 0);
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_NE(p.status().message().find("CUDA out of memory"), std::string::npos);
      break;
    }
    fill.push_back(*p);
    ASSERT_LT(fill.size(), 100u);
  }
  Check();
  EXPECT_EQ(alloc_->GetStats().num_ooms, 1);
  for (DevicePtr p : fill) Free(p);
}

TEST_F(ExpandableTest, ScenarioSmallRequestDoesNotDoubleReserved) {
  // alloc 4096 MiB, free, alloc 10 KiB, alloc 4096 MiB -> 4096 MiB + one small page, not 8192.
  DevicePtr a = Alloc(4096 * kMiB);
  Free(a);
  Alloc(10 * kKiB);
  Alloc(4096 * kMiB);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(4096 * kMiB + 2 * kMiB));
}

TEST_F(ExpandableTest, HandlesPerBlockAndContiguousScope) {
  // 8 MiB then 30 MiB with 20 MiB handles: the 30 MiB block spans 2 handles.
  Make("expandable_segments:True,expandable_page_mb:20");
  DevicePtr a = Alloc(8 * kMiB);
  DevicePtr b = Alloc(30 * kMiB);
  std::size_t handles_of_b = 0;
  for (const auto& seg : SegmentsOf(*alloc_)) {
    EXPECT_TRUE(seg.is_expandable);
    EXPECT_EQ(seg.handles, 2u);  // 40 MiB mapped in two 20 MiB handles
    for (const auto& blk : seg.blocks) {
      if (blk.address == b) handles_of_b = blk.handles;
      if (blk.address == a) {
        EXPECT_EQ(blk.handles, 1u);
      }
    }
  }
  EXPECT_EQ(handles_of_b, 2u);
  // Under contiguous_segments(), a 1 GiB buffer is backed by exactly one handle.
  DevicePtr c = 0;
  {
    ContiguousSegmentsScope contiguous;
    c = Alloc(1024 * kMiB);
  }
  bool found = false;
  for (const auto& seg : SegmentsOf(*alloc_)) {
    if (seg.address == c) {
      found = true;
      EXPECT_FALSE(seg.is_expandable);
      EXPECT_EQ(seg.handles, 1u);
      EXPECT_EQ(seg.total_size, 1024 * kMiB);
    }
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMalloc), 1);
  EXPECT_FALSE(ContiguousSegmentsScope::active());
}

TEST_F(ExpandableTest, FragmentationFigures) {
  DevicePtr a = Alloc(4 * kMiB);
  DevicePtr b = Alloc(6 * kMiB);
  DevicePtr c = Alloc(4 * kMiB);
  Free(b);
  (void)a;
  (void)c;
  Fragmentation f = FragmentationOf(*alloc_, 0);
  EXPECT_EQ(f.wasted_bytes, static_cast<std::int64_t>(6 * kMiB));
  EXPECT_EQ(f.free_bytes, static_cast<std::int64_t>(6 * kMiB));
  EXPECT_EQ(f.largest_free_block, static_cast<std::int64_t>(6 * kMiB));
  EXPECT_DOUBLE_EQ(f.free_space_fragmentation, 0.0);
  EXPECT_EQ(f.holes, 1);
  EXPECT_EQ(f.mapped_free_pages, 3);
  EXPECT_EQ(FragmentationOf(*alloc_, 0x77).other_stream_cached_bytes,
            static_cast<std::int64_t>(6 * kMiB));
}

// A training-like step whose shapes change every step (a sequence length from a fixed cycle):
// after the steps of the cycle have been seen twice (the first pass leaves partly used pages
// that the second pass settles), a step maps, unmaps, creates and releases nothing. With old
// mappings kept the settled cycle takes handles back to old mappings (free of page-table calls,
// each fenced by one cudaEventRecord, queried later): those event calls are all that remain.
TEST_F(ExpandableTest, RepeatedStepPatternMakesNoPageTableCallAfterWarmup) {
  // Warm-up passes over every shape until the layout settles: three by default (after two,
  // the next three passes still map 2 of their 44 moved pages anew); two without
  // keep_old_mappings; three when free tails are recycled before holes (page-recycling.md,
  // "Recycling").
  for (const auto& [conf, warmups] :
       {std::pair<const char*, int>{"expandable_segments:True", 3},
        std::pair<const char*, int>{"expandable_segments:True,keep_old_mappings:False", 2},
        std::pair<const char*, int>{"expandable_segments:True,recycle_tails_first:True", 3}}) {
    SCOPED_TRACE(conf);
    Make(conf);  // default page size, recycling and slack
    std::vector<DevicePtr> weights;
    for (int i = 0; i < 24; ++i) weights.push_back(Alloc(48 * kMiB + 4 * kMiB * i));
    const std::size_t seqs[] = {512, 1024, 256, 768, 384};
    auto step = [&](std::size_t seq) {
      std::vector<DevicePtr> acts;  // forward: activations kept for backward
      for (int layer = 0; layer < 24; ++layer) {
        acts.push_back(Alloc(seq * 24 * kKiB));
        DevicePtr tmp = Alloc(seq * 40 * kKiB + 512);  // a temporary of another shape
        acts.push_back(Alloc(seq * 8 * kKiB + 4096));
        Free(tmp);
      }
      while (!acts.empty()) {  // backward: gradients appear while activations go
        DevicePtr grad = Alloc(seq * 16 * kKiB);
        Free(acts.back());
        acts.pop_back();
        Free(grad);
      }
      sim_->CompleteAllEvents();  // the step's work finishes (a loss.item() waits for it)
    };
    for (int warm = 0; warm < warmups; ++warm) {
      for (std::size_t seq : seqs) step(seq);
    }
    const DriverCallLedger& ledger = sim_->calls();
    auto event_calls = [&ledger] {
      return ledger.count(DriverCall::kEventCreate) + ledger.count(DriverCall::kEventRecord) +
             ledger.count(DriverCall::kEventQuery);
    };
    const std::int64_t calls = ledger.total_count();
    const std::int64_t events = event_calls();
    const std::int64_t records = ledger.count(DriverCall::kEventRecord);
    const std::int64_t moves = FragmentationOf(*alloc_).page_moves;
    const std::int64_t reused = FragmentationOf(*alloc_).reused_old_mappings;
    const std::int64_t reserved = Reserved();
    std::vector<std::int64_t> records_per_round;
    for (int round = 0; round < 3; ++round) {
      const std::int64_t before = ledger.count(DriverCall::kEventRecord);
      for (std::size_t seq : seqs) step(seq);
      records_per_round.push_back(ledger.count(DriverCall::kEventRecord) - before);
    }
    // A cycle: every round fences as many reuses as the one before (none without old mappings
    // kept, some with them).
    EXPECT_EQ(records_per_round[1], records_per_round[0]);
    EXPECT_EQ(records_per_round[2], records_per_round[0]);
    if (std::string(conf).find("keep_old_mappings:False") == std::string::npos) {
      EXPECT_GT(records_per_round[0], 0);
    }
    // Every call after the warm-up is an event call (no wait among them), one record per reuse
    // at most, and every page move is a reuse.
    EXPECT_EQ(ledger.total_count() - calls, event_calls() - events);
    const Fragmentation f = FragmentationOf(*alloc_);
    EXPECT_EQ(f.page_moves - moves, f.reused_old_mappings - reused);
    EXPECT_LE(ledger.count(DriverCall::kEventRecord) - records, f.reused_old_mappings - reused);
    EXPECT_EQ(Reserved(), reserved);
    for (DevicePtr w : weights) Free(w);
  }
}

// expandable_handle_mb: a run of new pages takes one handle per 64 MiB instead of one per page;
// a freed run's handles lie wholly in the free block and move whole; destruction unmaps and
// releases each handle once.
TEST_F(ExpandableTest, VariableSizeHandlesCoverRunsAndMoveWhole) {
  Make("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:64");
  DevicePtr a = Alloc(100 * kMiB);  // 50 whole pages: a 64 MiB and a 36 MiB handle
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemCreate), 2);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemMap), 2);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemSetAccess), 1);
  ASSERT_EQ(SegmentsOf(*alloc_).size(), 1u);
  EXPECT_EQ(SegmentsOf(*alloc_)[0].total_size, 100 * kMiB);
  EXPECT_EQ(SegmentsOf(*alloc_)[0].handles, 2u);  // handles, not its 50 pages
  ASSERT_EQ(SegmentsOf(*alloc_)[0].blocks.size(), 1u);
  EXPECT_EQ(SegmentsOf(*alloc_)[0].blocks[0].handles, 2u);
  DevicePtr b = Alloc(10 * kMiB);  // the tail: one 10 MiB handle
  EXPECT_EQ(b, a + 100 * kMiB);
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemCreate), 3);
  Free(a);  // both handles of `a` lie wholly inside the free hole
  const std::int64_t creates = sim_->calls().count(DriverCall::kMemCreate);
  DevicePtr c = Alloc(120 * kMiB);  // does not fit the hole: 60 pages at the tail
  EXPECT_EQ(c, b + 10 * kMiB);
  EXPECT_EQ(FragmentationOf(*alloc_).page_moves, 2);  // the two handles, whole
  // Same stream: the handles stay mapped at their old address until the stream's work queued
  // before the move has finished (nothing waited), then empty_cache unmaps them.
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemUnmap), 0);
  EXPECT_EQ(sim_->calls().count(DriverCall::kStreamSynchronize), 0);
  EXPECT_EQ(OldMappingBytes(), static_cast<std::int64_t>(100 * kMiB));
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemCreate) - creates, 1);  // 20 MiB left to create
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(130 * kMiB));
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->calls().count(DriverCall::kMemUnmap), 2);
  EXPECT_EQ(OldMappingBytes(), 0);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(130 * kMiB));
  Free(b);
  Free(c);
  alloc_.reset();  // unmaps and releases every handle once
  EXPECT_EQ(sim_->mapped_bytes(), 0u);
  EXPECT_EQ(sim_->used_bytes(), 0u);
  Make("expandable_segments:True,expandable_page_mb:2");  // for TearDown's check
}

TEST_F(ExpandableTest, RandomizedNoLiveBlockOnUnmappedPage) {
  Randomized("expandable_segments:True,expandable_page_mb:2,max_split_size_mb:64", 100000);
}

// The same with free tails' pages recycled before holes' (recycle_tails_first).
TEST_F(ExpandableTest, RandomizedWithoutKeptOldMappings) {
  Randomized("expandable_segments:True,expandable_page_mb:2,keep_old_mappings:False", 30000);
}

TEST_F(ExpandableTest, RandomizedWithTailsFirst) {
  Randomized("expandable_segments:True,expandable_page_mb:2,recycle_tails_first:True", 30000);
}

// The same with handles of up to 8 MiB over 2 MiB pages (expandable_handle_mb): handles move
// whole, and one that fits nowhere is released.
TEST_F(ExpandableTest, RandomizedWithMultiPageHandles) {
  Randomized("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", 30000);
}

void ExpandableTest::Randomized(const std::string& conf, int ops) {
  Make(conf, 2 * kGiB);
  std::mt19937_64 rng(7);
  std::vector<std::pair<DevicePtr, StreamId>> live;
  const StreamId streams[] = {0, 0x33};
  int ooms = 0;
  for (int op = 0; op < ops; ++op) {
    const int what = static_cast<int>(rng() % 100);
    if (what < 52 || live.empty()) {
      const std::size_t size = 1 + static_cast<std::size_t>(std::exp2((rng() % 2500) / 100.0));
      const StreamId s = streams[rng() % 2];
      auto p = alloc_->Malloc(size, s);
      if (!p.ok()) {
        ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
        ++ooms;
      } else {
        live.emplace_back(*p, s);
      }
    } else if (what < 98) {
      const std::size_t i = rng() % live.size();
      if (rng() % 10 == 0) {
        ASSERT_TRUE(alloc_->RecordStream(live[i].first, streams[0]).ok());
      }
      ASSERT_TRUE(alloc_->Free(live[i].first).ok());
      live[i] = live.back();
      live.pop_back();
    } else if (what < 99) {
      sim_->CompleteAllEvents();
    } else {
      ASSERT_TRUE(alloc_->EmptyCache().ok());
    }
    // Every operation: chains, live blocks on mapped pages, reserved == mapped bytes.
    ASSERT_TRUE(alloc_->CheckInvariants().ok()) << "op " << op << ": " << alloc_->CheckInvariants();
    ASSERT_EQ(Reserved(), static_cast<std::int64_t>(sim_->mapped_bytes() - sim_->aliased_bytes()))
        << "op " << op;
    if (op % 1000 == 0) {  // the allocator's own figure for them, now and then (it walks)
      ASSERT_EQ(OldMappingBytes(), static_cast<std::int64_t>(sim_->aliased_bytes())) << "op " << op;
    }
  }
  EXPECT_GT(ooms, 0);
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 0);
  for (auto [p, s] : live) ASSERT_TRUE(alloc_->Free(p).ok());
  sim_->CompleteAllEvents();
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// mapped_free_pages counts pages, not handles: with expandable_handle_mb a handle holds several
// (8 MiB of free 2 MiB pages in one handle count 4, not 1).
TEST_F(ExpandableTest, MappedFreePagesCountsThePagesOfEachFreeHandle) {
  Make("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", 1 * kGiB);
  const DevicePtr p = Alloc(8 * kMiB);
  Free(p);
  EXPECT_EQ(Reserved(), 8 * kMiB);
  EXPECT_EQ(FragmentationOf(*alloc_).mapped_free_pages, 4);
  Make("expandable_segments:True,expandable_page_mb:2", 1 * kGiB);  // one page per handle
  Free(Alloc(8 * kMiB));
  EXPECT_EQ(FragmentationOf(*alloc_).mapped_free_pages, 4);
  Make("expandable_segments:True,expandable_page_mb:6", 1 * kGiB);  // two page sizes
  const DevicePtr small = Alloc(4096);
  Free(Alloc(12 * kMiB));
  Free(small);
  EXPECT_EQ(FragmentationOf(*alloc_).mapped_free_pages, 2 + 1);  // 2 of 6 MiB + 1 of 2 MiB
}

}  // namespace
}  // namespace vramledger
