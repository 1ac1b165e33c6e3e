// ledger/device_report.h on a SimBackend allocator: the segment list built from the core's view
// (one entry per mapped range of an expandable segment, private pools' ids on their segments)
// and the fragmentation figures read through the same view.
#include "ledger/device_report.h"

#include <vector>

#include <gtest/gtest.h>

#include "../core/sim_allocator_fixture.h"

namespace vramledger {
namespace {

class DeviceReportTest : public SimAllocatorTest {};

TEST_F(DeviceReportTest, AnExpandableSegmentShowsOneEntryPerMappedRange) {
  const DevicePtr a = Alloc(4 * kMiB);
  const DevicePtr b = Alloc(4 * kMiB);
  const DevicePtr c = Alloc(4 * kMiB);
  Free(b);
  ASSERT_TRUE(alloc_->EmptyCache().ok());  // b's pages are unmapped: two mapped ranges
  const std::vector<SegmentInfo> segments = SegmentsOf(*alloc_);
  ASSERT_EQ(segments.size(), 2u);
  EXPECT_EQ(segments[0].address, a);
  EXPECT_EQ(segments[1].address, c);
  for (const SegmentInfo& s : segments) {
    EXPECT_TRUE(s.is_expandable);
    EXPECT_EQ(s.total_size, 4 * kMiB);
    EXPECT_EQ(s.allocated_size, 4 * kMiB);
    ASSERT_EQ(s.blocks.size(), 1u);
    EXPECT_STREQ(s.blocks[0].state, "active_allocated");
    EXPECT_EQ(s.blocks[0].size, 4 * kMiB);
  }
  Free(a);
  Free(c);
}

TEST_F(DeviceReportTest, FragmentationFiguresReadTheCore) {
  const DevicePtr a = Alloc(4 * kMiB);
  const DevicePtr b = Alloc(4 * kMiB);
  const DevicePtr c = Alloc(4 * kMiB);
  Free(b);  // a hole of two mapped pages between live blocks
  const Fragmentation f = FragmentationOf(*alloc_);
  EXPECT_EQ(f.free_bytes, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(f.largest_free_block, static_cast<std::int64_t>(4 * kMiB));  // the tail is unmapped
  EXPECT_EQ(f.holes, 1);
  EXPECT_EQ(f.mapped_free_pages, 2);
  EXPECT_EQ(f.wasted_bytes, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(f.other_stream_cached_bytes, 0);
  // Seen from another stream, the hole's mapped bytes are another stream's cache.
  EXPECT_EQ(FragmentationOf(*alloc_, /*current_stream=*/1).other_stream_cached_bytes,
            static_cast<std::int64_t>(4 * kMiB));
  // The stats' largest free block is the same figure, computed in the core.
  EXPECT_EQ(alloc_->GetStats().largest_free_block_bytes, f.largest_free_block);
  Free(a);
  Free(c);
}

TEST_F(DeviceReportTest, PlainSegmentsCarryTheirPrivatePoolsId) {
  Make("");
  const MempoolId pool{1, 2};
  ASSERT_TRUE(alloc_->BeginAllocateToPool(pool, [](StreamId) { return true; }).ok());
  const DevicePtr in_pool = Alloc(1 * kMiB);
  ASSERT_TRUE(alloc_->EndAllocateToPool(pool).ok());
  const DevicePtr outside = Alloc(1 * kMiB);
  const std::vector<SegmentInfo> segments = SegmentsOf(*alloc_);
  ASSERT_EQ(segments.size(), 2u);
  for (const SegmentInfo& s : segments) {
    EXPECT_FALSE(s.is_expandable);
    const MempoolId expected = s.address == in_pool ? pool : MempoolId(0, 0);
    EXPECT_EQ(s.pool_id, expected) << s.address;
  }
  EXPECT_NE(outside, in_pool);
  Free(in_pool);
  Free(outside);
  ASSERT_TRUE(alloc_->ReleasePool(pool).ok());
}

}  // namespace
}  // namespace vramledger
