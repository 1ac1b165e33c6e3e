// core::OldMappings on a SimBackend: a handle moved within its stream stays mapped at its old
// address until its fence completes (Settle), or is kept idle (keep_old_mappings); Clear waits
// for the fences of the entries it unmaps; fences are given back once; Reusable; invariants.
#include "core/old_mappings.h"
#include "core/free_block_index.h"

#include <vector>

#include <gtest/gtest.h>

#include "core/page_table.h"
#include "device/sim_backend.h"

namespace vramledger::core {
namespace {

constexpr std::size_t kPage = 2 * kMiB;

class OldMappingsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DevicePtr va = 0;
    ASSERT_TRUE(sim_.ReserveAddress(16 * kPage, &va).ok());
    seg_ = table_.AddSegment(va, 16, kPage, kStream, &pool_);
  }
  // A new handle mapped (driver and table) at `page`.
  PhysicalHandle MapNew(std::size_t page) {
    PhysicalHandle h = 0;
    EXPECT_TRUE(sim_.CreatePhysical(kPage, &h).ok());
    EXPECT_TRUE(sim_.Map(seg_->PageAddress(page), kPage, h).ok());
    EXPECT_TRUE(sim_.SetAccess(seg_->PageAddress(page), kPage).ok());
    table_.Map(seg_, page, 1, h);
    return h;
  }
  EventId RecordFence() {
    EventId e = 0;
    EXPECT_TRUE(sim_.CreateEvent(&e).ok());
    EXPECT_TRUE(sim_.RecordEvent(e, kStream).ok());
    return e;
  }
  // Moves the handle at `from` to `to` (as a recycling move within the stream does): mapped at
  // `to`, its old mapping at `from` left behind until `fence` completes.
  void Move(std::size_t from, std::size_t to, EventId fence) {
    std::size_t pages = 0;
    const PhysicalHandle h = table_.Unmap(seg_, from, &pages);
    old_.Add(seg_, from, pages, h, fence);
    ASSERT_TRUE(sim_.Map(seg_->PageAddress(to), kPage, h).ok());
    table_.Map(seg_, to, pages, h);
  }
  void ExpectValid() {
    ASSERT_TRUE(table_.CheckInvariants().ok()) << table_.CheckInvariants();
    ASSERT_TRUE(old_.CheckInvariants(table_).ok()) << old_.CheckInvariants(table_);
    ASSERT_EQ(static_cast<std::size_t>(old_.Bytes()), sim_.aliased_bytes());
  }
  auto GiveBack() {
    return [this](EventId e) { given_back_.push_back(e); };
  }

  static constexpr StreamId kStream = 5;
  SimBackend sim_;
  BlockPool pool_{false, true, kPage};
  PageTable table_;
  OldMappings old_;
  Segment* seg_ = nullptr;
  std::vector<EventId> given_back_;
};

TEST_F(OldMappingsTest, AMoveLeavesAnOldMappingInUse) {
  const PhysicalHandle h = MapNew(0);
  const EventId fence = RecordFence();
  Move(0, 3, fence);
  ASSERT_EQ(old_.entries().size(), 1u);
  EXPECT_EQ(old_.entries()[0].handle, h);
  EXPECT_EQ(seg_->old_mapping[0], Segment::kOldMappingInUse);
  EXPECT_EQ(seg_->old_handle[0], h);
  EXPECT_EQ(seg_->pages[0], 0u);
  EXPECT_EQ(old_.InUse(), 1u);
  EXPECT_EQ(old_.Bytes(), static_cast<std::int64_t>(kPage));
  EXPECT_EQ(old_.Find(h), 0u);
  EXPECT_EQ(old_.Find(h + 1), 1u);  // none: entries().size()
  ExpectValid();
}

TEST_F(OldMappingsTest, SettleUnmapsOnlyOnceTheFenceCompleted) {
  MapNew(0);
  const EventId fence = RecordFence();
  Move(0, 3, fence);
  PendingStreams pending;
  ASSERT_TRUE(
      old_.Settle(&sim_, /*wait=*/false, /*keep=*/false, nullptr, &pending, GiveBack()).ok());
  EXPECT_EQ(old_.entries().size(), 1u);  // still in use
  EXPECT_EQ(pending, PendingStreams{kStream});
  // The stream found pending is not queried again during the same allocation.
  const auto queries = sim_.calls().count(DriverCall::kEventQuery);
  sim_.CompleteAllEvents();
  ASSERT_TRUE(old_.Settle(&sim_, false, false, nullptr, &pending, GiveBack()).ok());
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventQuery), queries);
  EXPECT_EQ(old_.entries().size(), 1u);
  PendingStreams next;  // the next allocation asks again
  ASSERT_TRUE(old_.Settle(&sim_, false, false, nullptr, &next, GiveBack()).ok());
  EXPECT_TRUE(old_.empty());
  EXPECT_EQ(given_back_, std::vector<EventId>{fence});
  EXPECT_EQ(seg_->old_mapping[0], 0u);
  ExpectValid();
}

TEST_F(OldMappingsTest, SettleWithKeepLeavesAnIdleOldMappingUntilAWait) {
  MapNew(0);
  const EventId fence = RecordFence();
  Move(0, 3, fence);
  sim_.CompleteAllEvents();
  ASSERT_TRUE(old_.Settle(&sim_, false, /*keep=*/true, nullptr, nullptr, GiveBack()).ok());
  ASSERT_EQ(old_.entries().size(), 1u);
  EXPECT_EQ(old_.entries()[0].fence, 0u);
  EXPECT_EQ(seg_->old_mapping[0], Segment::kOldMappingIdle);
  EXPECT_EQ(old_.InUse(), 0u);
  EXPECT_EQ(given_back_, std::vector<EventId>{fence});  // no longer needed
  ExpectValid();
  // empty_cache and the OOM retry wait: kept ones are unmapped then.
  ASSERT_TRUE(old_.Settle(&sim_, /*wait=*/true, /*keep=*/true, nullptr, nullptr, GiveBack()).ok());
  EXPECT_TRUE(old_.empty());
  EXPECT_EQ(given_back_.size(), 1u);
  ExpectValid();
}

TEST_F(OldMappingsTest, SettleWithWaitSynchronizesEachFenceOnce) {
  MapNew(0);
  MapNew(1);
  const EventId fence = RecordFence();
  Move(0, 4, fence);
  Move(1, 5, fence);  // one allocation's moves share its fence
  ASSERT_TRUE(old_.Settle(&sim_, /*wait=*/true, false, nullptr, nullptr, GiveBack()).ok());
  EXPECT_TRUE(old_.empty());
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventSynchronize), 1);
  EXPECT_EQ(given_back_, std::vector<EventId>{fence});  // once, with the last entry
  ExpectValid();
}

TEST_F(OldMappingsTest, SettleOfOneSegmentLeavesTheOthers) {
  MapNew(0);
  const EventId fence = RecordFence();
  Move(0, 3, fence);
  sim_.CompleteAllEvents();
  Segment other;
  ASSERT_TRUE(old_.Settle(&sim_, false, false, &other, nullptr, GiveBack()).ok());
  EXPECT_EQ(old_.entries().size(), 1u);
  ASSERT_TRUE(old_.Settle(&sim_, false, false, seg_, nullptr, GiveBack()).ok());
  EXPECT_TRUE(old_.empty());
}

TEST_F(OldMappingsTest, ClearUnmapsTheSelectedEntriesWaitingForTheirFence) {
  const PhysicalHandle a = MapNew(0);
  const PhysicalHandle b = MapNew(1);
  Move(0, 4, RecordFence());
  Move(1, 5, RecordFence());
  ASSERT_TRUE(old_.Clear(
                      &sim_, [&](const OldMapping& r) { return r.handle == a; },
                      /*capture_underway=*/false, GiveBack())
                  .ok());
  ASSERT_EQ(old_.entries().size(), 1u);
  EXPECT_EQ(old_.entries()[0].handle, b);
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventSynchronize), 1);  // a's fence was pending
  EXPECT_EQ(given_back_.size(), 1u);
  ExpectValid();
}

TEST_F(OldMappingsTest, ClearDuringACaptureWaitsForTheFencesStreamNotTheFence) {
  // No event may be queried or waited for while a capture is under way (on another stream
  // here): the stream the fences were recorded on is synchronized once, in relaxed mode.
  MapNew(0);
  MapNew(1);
  const EventId fence = RecordFence();
  Move(0, 4, fence);
  Move(1, 5, fence);
  constexpr StreamId kCapturing = 9;
  sim_.SetCapturing(kCapturing, true);
  const std::int64_t queries = sim_.calls().count(DriverCall::kEventQuery);
  {
    RelaxedCaptureScope relaxed(&sim_);
    ASSERT_TRUE(old_.Clear(
                        &sim_, [](const OldMapping&) { return true; },
                        /*capture_underway=*/true, GiveBack())
                    .ok());
  }
  EXPECT_TRUE(old_.empty());
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventQuery), queries);
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventSynchronize), 0);
  EXPECT_EQ(sim_.calls().count(DriverCall::kStreamSynchronize), 1);
  EXPECT_EQ(sim_.calls_during_capture_not_relaxed(), 0);
  EXPECT_EQ(given_back_, std::vector<EventId>{fence});
  ExpectValid();
}

TEST_F(OldMappingsTest, ClearRefusesAFenceOnAStreamThatIsCapturing) {
  // The fence was recorded before the stream's capture began; synchronizing a capturing stream
  // would end its capture, so the entry stays, and the error says what it waits for.
  MapNew(0);
  Move(0, 4, RecordFence());
  sim_.SetCapturing(kStream, true);
  const absl::Status s = old_.Clear(
      &sim_, [](const OldMapping&) { return true; }, /*capture_underway=*/true, GiveBack());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("stream 5"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("capture ends"), std::string_view::npos) << s;
  EXPECT_EQ(old_.entries().size(), 1u);
  EXPECT_EQ(sim_.calls().count(DriverCall::kStreamSynchronize), 0);
  sim_.SetCapturing(kStream, false);
  ExpectValid();
}

TEST_F(OldMappingsTest, HeldByCaptureOnlyWhileTheFencesStreamCapturesAndTheFenceIsPending) {
  // What Clear would refuse during a capture: placement asks first and leaves such entries be.
  MapNew(0);
  MapNew(1);
  Move(0, 4, RecordFence());
  Move(1, 5, RecordFence());
  const auto all = [](const OldMapping&) { return true; };
  const PhysicalHandle second = old_.entries()[1].handle;
  const auto only_second = [second](const OldMapping& r) { return r.handle == second; };
  EXPECT_FALSE(old_.HeldByCapture(&sim_, all));  // nothing captures
  sim_.SetCapturing(kStream + 1, true);          // another stream captures
  EXPECT_FALSE(old_.HeldByCapture(&sim_, all));
  sim_.SetCapturing(kStream, true);
  EXPECT_TRUE(old_.HeldByCapture(&sim_, all));
  EXPECT_TRUE(old_.HeldByCapture(&sim_, only_second));
  EXPECT_FALSE(old_.HeldByCapture(&sim_, [](const OldMapping&) { return false; }));
  // Once seen complete (fence 0, kept idle), an entry needs no wait and holds nothing back.
  EXPECT_EQ(sim_.calls_during_capture_not_relaxed(), 0);  // it asks the driver nothing
  sim_.SetCapturing(kStream, false);
  sim_.SetCapturing(kStream + 1, false);
  sim_.CompleteAllEvents();
  ASSERT_TRUE(old_.Settle(&sim_, /*wait=*/false, /*keep=*/true, nullptr, nullptr, GiveBack()).ok());
  ASSERT_EQ(old_.entries().size(), 2u);
  sim_.SetCapturing(kStream, true);
  EXPECT_FALSE(old_.HeldByCapture(&sim_, all));
  sim_.SetCapturing(kStream, false);
  ExpectValid();
}

TEST_F(OldMappingsTest, AFailedUnmapKeepsTheEntry) {
  MapNew(0);
  Move(0, 3, RecordFence());
  sim_.FailCall(DriverCall::kMemUnmap, 0, absl::InternalError("injected"));
  EXPECT_FALSE(old_.UnmapEntry(&sim_, 0, GiveBack()).ok());
  EXPECT_EQ(old_.entries().size(), 1u);
  EXPECT_TRUE(given_back_.empty());
  ExpectValid();
  EXPECT_TRUE(old_.UnmapEntry(&sim_, 0, GiveBack()).ok());
  EXPECT_TRUE(old_.empty());
  ExpectValid();
}

TEST_F(OldMappingsTest, ASharedFenceGoesBackWithTheLastEntry) {
  MapNew(0);
  MapNew(1);
  const EventId fence = RecordFence();
  Move(0, 4, fence);
  Move(1, 5, fence);
  old_.Erase(0, GiveBack());
  EXPECT_TRUE(given_back_.empty());
  old_.Erase(0, GiveBack());
  EXPECT_EQ(given_back_, std::vector<EventId>{fence});
}

TEST_F(OldMappingsTest, ReusableWhenTheHandleLiesFreeInTheSameStream) {
  MapNew(0);
  Move(0, 3, RecordFence());
  EXPECT_FALSE(old_.Reusable(table_, seg_, 0));  // not during this allocation
  old_.set_reuse_now(true);
  EXPECT_TRUE(old_.Reusable(table_, seg_, 0));
  EXPECT_FALSE(old_.Reusable(table_, seg_, 1));  // no old mapping there
  seg_->use[3] = 1;                              // a block over its current place
  EXPECT_FALSE(old_.Reusable(table_, seg_, 0));
  seg_->use[3] = 0;
  Block within;  // a free block over both places: the handle stays at home
  within.ptr = seg_->ptr;
  within.size = 8 * kPage;
  within.segment = seg_;
  EXPECT_FALSE(old_.Reusable(table_, seg_, 0, &within));
  within.size = 2 * kPage;  // over the old mapping only
  EXPECT_TRUE(old_.Reusable(table_, seg_, 0, &within));
}

TEST_F(OldMappingsTest, CheckInvariantsFindsALostMark) {
  MapNew(0);
  Move(0, 3, RecordFence());
  seg_->old_handle[0] = 0;
  EXPECT_FALSE(old_.CheckInvariants(table_).ok());
  seg_->old_handle[0] = old_.entries()[0].handle;
  seg_->old_mapping[0] = Segment::kOldMappingIdle;  // its fence is still pending
  EXPECT_FALSE(old_.CheckInvariants(table_).ok());
}

}  // namespace
}  // namespace vramledger::core
