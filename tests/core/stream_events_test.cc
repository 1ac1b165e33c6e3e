// StreamEvents and EventPool alone on a SimBackend whose events complete only when the test says
// so: per-stream order, release after the last event, deferral during a capture and after a
// driver error, synchronize, and event reuse.
#include "core/stream_events.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "device/sim_backend.h"

namespace vramledger::core {
namespace {

class StreamEventsTest : public ::testing::Test {
 protected:
  // A freed block of stream 0 that streams `uses` used (record_stream).
  Block* Freed(DevicePtr ptr, std::vector<StreamId> uses) {
    blocks_.push_back(std::make_unique<Block>());
    Block* b = blocks_.back().get();
    b->ptr = ptr;
    b->size = 512;
    b->stream_uses = std::move(uses);
    return b;
  }
  absl::Status Record(Block* b) {
    return events_.Record(b, [this] { return capturing_; });
  }
  absl::Status Process() {
    return events_.Process([this] { return capturing_; },
                           [this](Block* b) { released_.push_back(b); });
  }
  absl::Status Flush() {
    return events_.FlushDeferred([this] { return capturing_; },
                                 [this](Block* b) { released_.push_back(b); });
  }
  void ExpectValid() { EXPECT_TRUE(events_.CheckInvariants().ok()) << events_.CheckInvariants(); }

  SimBackend sim_;
  EventPool spare_;
  StreamEvents events_{&sim_, &spare_};
  bool capturing_ = false;
  std::vector<Block*> released_;
  std::vector<std::unique_ptr<Block>> blocks_;
};

TEST_F(StreamEventsTest, ABlockIsReleasedOnlyAfterTheEventOfEveryStreamCompleted) {
  Block* b = Freed(0x1000, {1, 2});
  ASSERT_TRUE(Record(b).ok());
  EXPECT_EQ(b->event_count, 2);
  EXPECT_TRUE(b->stream_uses.empty());
  EXPECT_EQ(events_.pending(), 2);
  ExpectValid();
  ASSERT_TRUE(Process().ok());
  EXPECT_TRUE(released_.empty());
  sim_.CompleteStream(1);
  ASSERT_TRUE(Process().ok());
  EXPECT_TRUE(released_.empty());
  EXPECT_EQ(b->event_count, 1);
  EXPECT_EQ(spare_.size(), 1u);  // stream 1's event is spare again
  ExpectValid();
  sim_.CompleteStream(2);
  ASSERT_TRUE(Process().ok());
  ASSERT_EQ(released_.size(), 1u);
  EXPECT_EQ(released_[0], b);
  EXPECT_EQ(events_.pending(), 0);
  EXPECT_EQ(spare_.size(), 2u);
  ExpectValid();
}

TEST_F(StreamEventsTest, ASlowStreamDoesNotHoldBackAnother) {
  Block* slow = Freed(0x1000, {1});
  Block* fast = Freed(0x2000, {2});
  ASSERT_TRUE(Record(slow).ok());
  ASSERT_TRUE(Record(fast).ok());
  sim_.CompleteStream(2);
  ASSERT_TRUE(Process().ok());
  ASSERT_EQ(released_.size(), 1u);
  EXPECT_EQ(released_[0], fast);
  EXPECT_EQ(slow->event_count, 1);
  ExpectValid();
}

TEST_F(StreamEventsTest, WithinAStreamEventsCompleteInRecordOrder) {
  Block* first = Freed(0x1000, {1});
  Block* second = Freed(0x2000, {1});
  ASSERT_TRUE(Record(first).ok());
  ASSERT_TRUE(Record(second).ok());
  ASSERT_TRUE(Process().ok());
  EXPECT_TRUE(released_.empty());
  sim_.CompleteAllEvents();
  ASSERT_TRUE(Process().ok());
  ASSERT_EQ(released_.size(), 2u);
  EXPECT_EQ(released_[0], first);
  EXPECT_EQ(released_[1], second);
}

TEST_F(StreamEventsTest, DuringACaptureNothingIsRecordedOrQueried) {
  capturing_ = true;
  Block* b = Freed(0x1000, {1});
  ASSERT_TRUE(Record(b).ok());
  EXPECT_TRUE(events_.has_deferred());
  EXPECT_EQ(b->event_count, 1);  // held by the deferral
  EXPECT_EQ(b->stream_uses.size(), 1u);
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventRecord), 0);
  ASSERT_TRUE(Process().ok());  // still capturing: nothing happens
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventQuery), 0);
  ExpectValid();
  capturing_ = false;
  ASSERT_TRUE(Flush().ok());
  EXPECT_FALSE(events_.has_deferred());
  EXPECT_EQ(b->event_count, 1);  // now stream 1's event
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventRecord), 1);
  ExpectValid();
  sim_.CompleteStream(1);
  ASSERT_TRUE(Process().ok());
  ASSERT_EQ(released_.size(), 1u);
}

TEST_F(StreamEventsTest, AFlushedBlockWithNoUseLeftIsReleasedAtOnce) {
  capturing_ = true;
  Block* b = Freed(0x1000, {});
  ASSERT_TRUE(Record(b).ok());
  capturing_ = false;
  ASSERT_TRUE(Flush().ok());
  ASSERT_EQ(released_.size(), 1u);
  EXPECT_EQ(b->event_count, 0);
  EXPECT_EQ(events_.pending(), 0);
}

TEST_F(StreamEventsTest, ARecordFailureDefersTheBlockAndAFlushRetriesIt) {
  Block* b = Freed(0x1000, {1, 2});
  sim_.FailCall(DriverCall::kEventRecord, 1, absl::InternalError("injected"));
  EXPECT_FALSE(Record(b).ok());
  // Stream 2's event was recorded; stream 1's use is kept for the retry.
  EXPECT_EQ(b->stream_uses, std::vector<StreamId>{1});
  EXPECT_EQ(b->event_count, 2);
  EXPECT_TRUE(events_.has_deferred());
  EXPECT_EQ(spare_.size(), 1u);  // the failed record's event is spare
  ExpectValid();
  ASSERT_TRUE(Process().ok());  // flushes first: records stream 1's event
  EXPECT_FALSE(events_.has_deferred());
  EXPECT_EQ(b->event_count, 2);
  EXPECT_EQ(spare_.size(), 0u);  // reused, not a new one
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventCreate), 2);
  ExpectValid();
  ASSERT_TRUE(events_.SynchronizeAll([this](Block* x) { released_.push_back(x); }).ok());
  ASSERT_EQ(released_.size(), 1u);
  EXPECT_EQ(events_.pending(), 0);
  ExpectValid();
}

TEST_F(StreamEventsTest, SynchronizeAllReleasesEveryBlockAndKeepsTheEvents) {
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Record(Freed(0x1000 * (i + 1), {1, 2, 3})).ok());
  EXPECT_EQ(events_.pending(), 15);
  ASSERT_TRUE(events_.SynchronizeAll([this](Block* x) { released_.push_back(x); }).ok());
  EXPECT_EQ(released_.size(), 5u);
  EXPECT_EQ(spare_.size(), 15u);
  // The next record reuses a spare event: no new one is created.
  const auto created = sim_.calls().count(DriverCall::kEventCreate);
  ASSERT_TRUE(Record(Freed(0x9000, {1})).ok());
  EXPECT_EQ(sim_.calls().count(DriverCall::kEventCreate), created);
  spare_.DestroyAll(&sim_);
  EXPECT_EQ(spare_.size(), 0u);
  EXPECT_EQ(sim_.live_events(), 1);  // the queued one
}

TEST_F(StreamEventsTest, CheckInvariantsFindsAMiscountedBlock) {
  Block* b = Freed(0x1000, {1});
  ASSERT_TRUE(Record(b).ok());
  ExpectValid();
  ++b->event_count;
  EXPECT_FALSE(events_.CheckInvariants().ok());
  --b->event_count;
  b->allocated = true;
  EXPECT_FALSE(events_.CheckInvariants().ok());
}

}  // namespace
}  // namespace vramledger::core
