// CUDA graph private pools on SimBackend (core/graph_pools.cc, docs/design/torch-facts.md §8):
// routing by the filter, shared pools and use counts, release only after the blocks are free,
// failed captures.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

constexpr StreamId kEager = 0x10;
constexpr StreamId kCapture = 0x20;
constexpr MempoolId kPool{1, 0};
constexpr MempoolId kOtherPool{2, 0};

class GraphPoolsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SimBackend::Config config;
    config.capacity = 16 * kGiB;
    sim_ = std::make_unique<SimBackend>(config);
    auto options = ParseOptions("");
    ASSERT_TRUE(options.ok()) << options.status();
    alloc_ = std::make_unique<DeviceAllocator>(*options, sim_.get());
  }
  void TearDown() override {
    EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
  }
  DevicePtr Alloc(std::size_t size, StreamId stream) {
    auto p = alloc_->Malloc(size, stream);
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
    return p.ok() ? *p : 0;
  }
  void Free(DevicePtr p) {
    ASSERT_TRUE(alloc_->Free(p).ok());
    ASSERT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
  }
  // Starts a capture on kCapture into `pool`, as torch's capture_begin does.
  void BeginCapture(MempoolId pool) {
    // torch's filter: the capture's stream while it captures.
    SimBackend* sim = sim_.get();
    ASSERT_TRUE(alloc_
                    ->BeginAllocateToPool(
                        pool, [sim](StreamId s) { return s == kCapture && sim->IsCapturing(s); })
                    .ok());
    sim_->SetCapturing(kCapture, true);
  }
  // Ends it successfully (capture_end).
  void EndCapture(MempoolId pool) {
    sim_->SetCapturing(kCapture, false);
    ASSERT_TRUE(alloc_->EndAllocateToPool(pool).ok());
  }
  std::int64_t Reserved() { return alloc_->GetStats().reserved_bytes[kAggregate].current; }
  std::int64_t Calls(DriverCall call) { return sim_->calls().count(call); }

  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
};

TEST_F(GraphPoolsTest, FilterRoutesOnlyItsStreamsToThePrivatePool) {
  const DevicePtr eager = Alloc(4 * kMiB, kEager);
  Free(eager);  // cached in the global pool, same stream as nothing below
  BeginCapture(kPool);
  const DevicePtr captured = Alloc(4 * kMiB, kCapture);
  const DevicePtr other = Alloc(4 * kMiB, kEager);  // not accepted by the filter
  EXPECT_EQ(other, eager);                          // served by the global cache
  EndCapture(kPool);
  Free(captured);
  // The captured block's memory stays with the pool: eager code on the capture stream does not
  // get it back while the graph lives.
  const DevicePtr after = Alloc(4 * kMiB, kCapture);
  EXPECT_NE(after, captured);
  Free(after);
  Free(other);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
}

TEST_F(GraphPoolsTest, SharedPoolCountsUsesAndReleasesAtZero) {
  BeginCapture(kPool);
  const DevicePtr a = Alloc(8 * kMiB, kCapture);
  EndCapture(kPool);
  Free(a);
  BeginCapture(kPool);  // a second graph shares the pool: it reuses the pool's cached block
  const DevicePtr b = Alloc(8 * kMiB, kCapture);
  EXPECT_EQ(b, a);
  EndCapture(kPool);
  Free(b);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 2);
  const std::int64_t reserved = Reserved();
  EXPECT_GT(reserved, 0);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  EXPECT_EQ(Reserved(), reserved);  // one graph still uses it
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), reserved);  // empty_cache does not take a live pool's memory
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
  EXPECT_EQ(Reserved(), 0);
  EXPECT_FALSE(alloc_->ReleasePool(kPool).ok());  // gone
}

TEST_F(GraphPoolsTest, MemoryReturnsOnlyAfterReleaseAndFree) {
  BeginCapture(kPool);
  const DevicePtr output = Alloc(2 * kMiB, kCapture);  // a graph output that outlives the graph
  EndCapture(kPool);
  const std::int64_t reserved = Reserved();
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), reserved);  // the output is still live
  Free(output);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
}

// torch allows a graph captured into pool=p.id inside use_mem_pool(p): two entries of one pool.
TEST_F(GraphPoolsTest, ACaptureIntoAPoolInsideUseMemPoolOfItShareIt) {
  const std::thread::id me = std::this_thread::get_id();
  auto this_thread = [me](StreamId) { return std::this_thread::get_id() == me; };
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, this_thread).ok());  // use_mem_pool
  BeginCapture(kPool);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 2);
  const DevicePtr captured = Alloc(kMiB, kCapture);
  EndCapture(kPool);                            // this thread's latest entry: the capture's
  const DevicePtr eager = Alloc(kMiB, kEager);  // still use_mem_pool's
  const std::int64_t reserved = Reserved();
  Free(captured);
  Free(eager);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), reserved);  // both in the pool, which is in use
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  EXPECT_FALSE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// Inside use_mem_pool(p) a capture into its own pool routes to p first (as torch: the first
// entry that accepts the stream). Once that capture ends, p's entry is not a failed capture.
TEST_F(GraphPoolsTest, AUseMemPoolThatServedACaptureIsKeptAfterIt) {
  const std::thread::id me = std::this_thread::get_id();
  auto this_thread = [me](StreamId) { return std::this_thread::get_id() == me; };
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, this_thread).ok());
  BeginCapture(kOtherPool);
  const DevicePtr captured = Alloc(kMiB, kCapture);
  EndCapture(kOtherPool);
  const DevicePtr eager = Alloc(kMiB, kEager);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  const std::int64_t reserved = Reserved();
  Free(captured);
  Free(eager);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), reserved);  // still kPool's, which is in use
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kOtherPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// A capture into p, then use_mem_pool(p) on the same thread serving eager streams: the
// capture's end removes the capture's entry, not use_mem_pool's (the innermost, whose streams do
// not capture either), so eager requests still go to p and use_mem_pool's own end finds its
// entry. (allocator_ops_fuzz found the wrong entry removed: use_mem_pool's end then failed.)
TEST_F(GraphPoolsTest, TheEndOfACaptureLeavesAUseMemPoolBegunInsideIt) {
  const std::thread::id me = std::this_thread::get_id();
  auto this_thread = [me](StreamId) { return std::this_thread::get_id() == me; };
  BeginCapture(kPool);
  const DevicePtr captured = Alloc(kMiB, kCapture);
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, this_thread).ok());  // use_mem_pool
  const DevicePtr before = Alloc(kMiB, kEager);
  EndCapture(kPool);
  const DevicePtr after = Alloc(4 * kMiB, kEager);  // still use_mem_pool's: in kPool
  const std::int64_t reserved = Reserved();
  Free(captured);
  Free(before);
  Free(after);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), reserved);  // kPool's, which is in use
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  EXPECT_FALSE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());  // the graph's use
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());  // the MemPool's
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

TEST_F(GraphPoolsTest, FailedCaptureLeaksNothing) {
  const std::int64_t before = Reserved();
  BeginCapture(kPool);
  const DevicePtr a = Alloc(16 * kMiB, kCapture);
  const DevicePtr b = Alloc(64 * kKiB, kCapture);
  sim_->SetCapturing(kCapture, false);  // the capture failed: no End, no Release
  Free(a);
  Free(b);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), before);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
  // Allocations on the old capture stream are plain again, and the pool id can be reused.
  Free(Alloc(kMiB, kCapture));
  BeginCapture(kPool);
  Free(Alloc(kMiB, kCapture));
  EndCapture(kPool);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
}

// torch's capture_end calls cudaStreamEndCapture, then endAllocateToPool. Another thread's
// empty_cache (or out-of-memory retry) in between must not take the graph's memory: a block
// freed during the capture is the graph's on every replay (otherwise the pool's segment could be
// freed and handed to another stream while the graph still uses it).
TEST_F(GraphPoolsTest, AnotherThreadBetweenTheEndOfACaptureAndEndKeepsThePool) {
  BeginCapture(kPool);
  const DevicePtr temporary = Alloc(1000, kCapture);
  Free(temporary);  // freed during the capture: the graph's still
  const DevicePtr output = Alloc(4 * kMiB, kCapture);  // the graph's output, live
  sim_->SetCapturing(kCapture, false);                 // cudaStreamEndCapture
  const std::int64_t reserved = Reserved();
  std::thread other([this] {
    EXPECT_TRUE(alloc_->EmptyCache().ok());
    Free(Alloc(2 * kMiB, kEager));
    EXPECT_TRUE(alloc_->EmptyCache().ok());  // returns the eager segment
  });
  other.join();
  EXPECT_EQ(Reserved(), reserved);  // the pool's segments, the freed temporary's included
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  // The graph's freed temporary is not handed to eager work.
  const DevicePtr eager = Alloc(1000, kEager);
  EXPECT_NE(eager, temporary);
  Free(eager);
  Free(output);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// The same with a capture that keeps no block: End and Release still find the pool.
TEST_F(GraphPoolsTest, AnotherThreadBetweenTheEndOfAnEmptyCaptureAndEndKeepsThePool) {
  BeginCapture(kPool);
  Free(Alloc(1000, kCapture));
  sim_->SetCapturing(kCapture, false);
  std::thread other([this] { EXPECT_TRUE(alloc_->EmptyCache().ok()); });
  other.join();
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

// A failed capture is still cleaned up by its own thread's next call (FailedCaptureLeaksNothing),
// even when another thread called in between.
TEST_F(GraphPoolsTest, AFailedCaptureIsPrunedByItsOwnThreadAfterOthersCalled) {
  const std::int64_t before = Reserved();
  BeginCapture(kPool);
  const DevicePtr a = Alloc(16 * kMiB, kCapture);
  sim_->SetCapturing(kCapture, false);  // the capture failed: no End, no Release
  std::thread other([this] { EXPECT_TRUE(alloc_->EmptyCache().ok()); });
  other.join();
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);  // not yet: only its thread can tell
  Free(a);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
  EXPECT_EQ(Reserved(), before);
}

// A failed capture whose thread never calls again: another thread prunes it once it has looked
// over for a second (kFailedCaptureGrace), not before (otherwise it would hold its pool,
// memory and the capture checks for good).
TEST_F(GraphPoolsTest, AFailedCaptureOfAThreadThatExitsIsPrunedAfterTheGrace) {
  std::thread capturing([this] {
    BeginCapture(kPool);
    const DevicePtr p = Alloc(16 * kMiB, kCapture);
    sim_->SetCapturing(kCapture, false);  // the capture failed: no End, no Release
    Free(p);
  });
  capturing.join();
  ASSERT_TRUE(alloc_->EmptyCache().ok());  // sees it over: the grace starts
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  EXPECT_GT(Reserved(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
  EXPECT_EQ(Reserved(), 0);
  BeginCapture(kPool);  // the id is free again
  Free(Alloc(kMiB, kCapture));
  EndCapture(kPool);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
}

TEST_F(GraphPoolsTest, NoEventQueryOrFreeWhileCapturing) {
  const DevicePtr used = Alloc(4 * kMiB, kEager);
  ASSERT_TRUE(alloc_->RecordStream(used, 0x30).ok());
  Free(used);  // an event on 0x30 is pending
  const DevicePtr cached = Alloc(32 * kMiB, kEager);
  Free(cached);
  BeginCapture(kPool);
  const std::int64_t queries = Calls(DriverCall::kEventQuery);
  const std::int64_t frees = Calls(DriverCall::kFree);
  const std::int64_t syncs = Calls(DriverCall::kEventSynchronize);
  const DevicePtr in_capture = Alloc(kMiB, kCapture);
  Free(Alloc(2 * kMiB, kEager));  // another thread's eager work during the capture
  // A record_stream'ed free during the capture is deferred, not recorded.
  const DevicePtr shared = Alloc(kMiB, kCapture);
  ASSERT_TRUE(alloc_->RecordStream(shared, 0x30).ok());
  const std::int64_t records = Calls(DriverCall::kEventRecord);
  Free(shared);
  EXPECT_EQ(Calls(DriverCall::kEventRecord), records);
  // An out-of-memory retry during the capture frees and synchronizes nothing.
  sim_->SetCapacity(sim_->used_bytes());
  EXPECT_FALSE(alloc_->Malloc(8 * kGiB, kEager).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Calls(DriverCall::kEventQuery), queries);
  EXPECT_EQ(Calls(DriverCall::kFree), frees);
  EXPECT_EQ(Calls(DriverCall::kEventSynchronize), syncs);
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  EndCapture(kPool);
  sim_->SetCapacity(16 * kGiB);
  // After the capture the deferred events are recorded and processed as usual.
  EXPECT_GT(Calls(DriverCall::kEventRecord), records);
  sim_->CompleteAllEvents();
  Free(Alloc(kMiB, kEager));
  EXPECT_GT(Calls(DriverCall::kEventQuery), queries);
  Free(in_capture);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
}

TEST_F(GraphPoolsTest, SnapshotNamesThePrivatePoolOfItsSegments) {
  const DevicePtr eager = Alloc(4 * kMiB, kEager);
  BeginCapture(kPool);
  const DevicePtr captured = Alloc(4 * kMiB, kCapture);
  EndCapture(kPool);
  int in_pool = 0;
  int in_default = 0;
  for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
    const bool holds_captured = captured >= s.address && captured < s.address + s.total_size;
    EXPECT_EQ(s.pool_id, holds_captured ? kPool : (MempoolId{0, 0})) << "segment at " << s.address;
    ++(holds_captured ? in_pool : in_default);
  }
  EXPECT_EQ(in_pool, 1);
  EXPECT_EQ(in_default, 1);  // the eager block's
  Free(captured);
  Free(eager);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  for (const SegmentInfo& s : SegmentsOf(*alloc_)) EXPECT_EQ(s.pool_id, (MempoolId{0, 0}));
}

// The use a capture holds is given back by a release after its end only: a release before it is
// refused, and the pool stays as it was.
TEST_F(GraphPoolsTest, AReleaseBeforeItsCaptureEndedIsRefused) {
  BeginCapture(kPool);
  const DevicePtr p = Alloc(4 * kMiB, kCapture);
  const absl::Status refused = alloc_->ReleasePool(kPool);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("have not ended; end them first"), std::string::npos);
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 1);
  EndCapture(kPool);
  Free(p);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  EXPECT_EQ(alloc_->PoolUseCount(kPool), 0);
}

}  // namespace
}  // namespace vramledger
