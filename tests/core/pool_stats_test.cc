// The per-pool statistics alone: the updates of one allocation, free and segment, the "all" row
// derived from the pools (totals net of pages moved between pools), resets, and the invariants
// check catching a row that went wrong.
#include "core/pool_stats.h"

#include <gtest/gtest.h>

#include "vramledger/types.h"

namespace vramledger::core {
namespace {

constexpr std::int64_t kM = kMiB;  // the stats count signed bytes

TEST(CoreStats, AnAllocationAndItsFreeMoveEveryRowAndBack) {
  CoreStats s;
  s.SegmentReserved(kLargePool, 20 * kM);
  s.Allocated(kLargePool, 4 * kM, 4 * kM - 100);
  s.Allocated(kSmallPool, 512, 200);
  s.SegmentReserved(kSmallPool, 2 * kM);
  ASSERT_TRUE(s.CheckInvariants().ok()) << s.CheckInvariants();
  DeviceStats d = s.ToDeviceStats();
  EXPECT_EQ(d.allocation[kAggregate].current, 2);
  EXPECT_EQ(d.allocated_bytes[kLargePool].current, 4 * kM);
  EXPECT_EQ(d.requested_bytes[kAggregate].current, 4 * kM - 100 + 200);
  EXPECT_EQ(d.reserved_bytes[kAggregate].current, 22 * kM);
  EXPECT_EQ(d.num_device_alloc, 2);
  // The free is requested (record_stream events pending): still active until it completes.
  s.FreeRequested(kLargePool, 4 * kM);
  d = s.ToDeviceStats();
  EXPECT_EQ(d.allocated_bytes[kLargePool].current, 0);
  EXPECT_EQ(d.active_bytes[kLargePool].current, 4 * kM);
  s.FreeCompleted(kLargePool, 4 * kM, 4 * kM - 100);
  s.SegmentReleased(kLargePool, 20 * kM);
  ASSERT_TRUE(s.CheckInvariants().ok()) << s.CheckInvariants();
  d = s.ToDeviceStats();
  EXPECT_EQ(d.active[kLargePool].current, 0);
  EXPECT_EQ(d.active[kLargePool].freed, 1);
  EXPECT_EQ(d.allocated_bytes[kAggregate].peak, 4 * kM + 512);
  EXPECT_EQ(d.reserved_bytes[kLargePool].freed, 20 * kM);
  EXPECT_EQ(d.num_device_free, 1);
}

TEST(CoreStats, PagesMovedBetweenPoolsLeaveTheAllRowTotalsAlone) {
  CoreStats s;
  s.SegmentReserved(kLargePool, 8 * kM);
  s.reserved_bytes.Move(kLargePool, kSmallPool, 2 * kM);
  const DeviceStats d = s.ToDeviceStats();
  EXPECT_EQ(d.reserved_bytes[kSmallPool].current, 2 * kM);
  EXPECT_EQ(d.reserved_bytes[kLargePool].freed, 2 * kM);
  EXPECT_EQ(d.reserved_bytes[kAggregate].allocated, 8 * kM);
  EXPECT_EQ(d.reserved_bytes[kAggregate].freed, 0);
  EXPECT_TRUE(s.CheckInvariants().ok()) << s.CheckInvariants();
}

TEST(CoreStats, ResetsKeepTheInvariants) {
  CoreStats s;
  s.SegmentReserved(kSmallPool, 2 * kM);
  s.Allocated(kSmallPool, 1024, 1000);
  s.Allocated(kSmallPool, 1024, 1000);
  s.FreeRequested(kSmallPool, 1024);
  s.FreeCompleted(kSmallPool, 1024, 1000);
  s.ResetPeak();
  DeviceStats d = s.ToDeviceStats();
  EXPECT_EQ(d.allocated_bytes[kAggregate].peak, 1024);
  s.ResetAccumulated();
  d = s.ToDeviceStats();
  EXPECT_EQ(d.allocation[kSmallPool].allocated, 0);
  EXPECT_EQ(d.allocation[kSmallPool].freed, 0);
  EXPECT_EQ(d.num_device_alloc, 0);
  s.FreeRequested(kSmallPool, 1024);
  s.FreeCompleted(kSmallPool, 1024, 1000);
  d = s.ToDeviceStats();
  EXPECT_EQ(d.allocation[kSmallPool].freed, 1);  // counted from the reset on
  EXPECT_TRUE(s.CheckInvariants().ok()) << s.CheckInvariants();
}

TEST(CoreStats, CheckInvariantsCatchesANegativeRowAndAllocatedAboveReserved) {
  CoreStats s;
  s.FreeRequested(kLargePool, 512);  // a free with no allocation
  EXPECT_FALSE(s.CheckInvariants().ok());
  CoreStats t;
  t.Allocated(kLargePool, 4 * kM, 4 * kM);  // no segment reserved under it
  EXPECT_FALSE(t.CheckInvariants().ok());
  t.SegmentReserved(kLargePool, 4 * kM);
  EXPECT_TRUE(t.CheckInvariants().ok()) << t.CheckInvariants();
}

TEST(PoolStat, CheckInvariantsHoldsThroughIncreasesDecreasesAndMoves) {
  PoolStat p;
  p.Increase(kSmallPool, 10);
  p.Increase(kLargePool, 5);
  p.Move(kSmallPool, kLargePool, 4);
  p.Decrease(kLargePool, 9);
  EXPECT_TRUE(p.CheckInvariants().ok()) << p.CheckInvariants();
  EXPECT_EQ(p.current(kAggregate), 6);
  EXPECT_EQ(p.peak(kAggregate), 15);
  p.Decrease(kSmallPool, 7);
  EXPECT_FALSE(p.CheckInvariants().ok());
}

}  // namespace
}  // namespace vramledger::core
