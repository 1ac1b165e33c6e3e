// core::PageTable on its own: segments, handles and their homes, per-page use counts, mappings
// without access and unreleased handles, and the invariants it checks.
#include "core/page_table.h"
#include "core/free_block_index.h"

#include <cstdint>

#include <gtest/gtest.h>

#include "vramledger/types.h"

namespace vramledger::core {
namespace {

constexpr std::size_t kPage = 2 * kMiB;
constexpr DevicePtr kBase = 1ull << 40;

class PageTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seg_ = table_.AddSegment(kBase, 16, kPage, /*stream=*/0, &pool_);
    whole_.ptr = kBase;
    whole_.size = seg_->size;
    whole_.pool = &pool_;
    whole_.segment = seg_;
    seg_->head = &whole_;  // one free block over the whole range
  }
  BlockPool pool_{false, true, kPage};
  PageTable table_;
  Segment* seg_ = nullptr;
  Block whole_;
};

TEST_F(PageTableTest, ANewSegmentMapsNothing) {
  EXPECT_EQ(table_.segments().size(), 1u);
  EXPECT_EQ(seg_->size, 16 * kPage);
  EXPECT_TRUE(seg_->expandable);
  EXPECT_EQ(seg_->pages.size(), 16u);
  EXPECT_EQ(seg_->old_mapping.size(), 16u);
  EXPECT_EQ(seg_->use.size(), 16u);
  EXPECT_EQ(seg_->mapped_pages, 0u);
  EXPECT_EQ(seg_->page_limit, 0u);
  EXPECT_TRUE(table_.CheckInvariants().ok()) << table_.CheckInvariants();
}

TEST_F(PageTableTest, RangeBytesIsUnboundedUntilTheDeviceSizeIsKnown) {
  EXPECT_EQ(table_.RangeBytes(kPage), SIZE_MAX);
  table_.set_device_total(8 * kGiB);
  EXPECT_EQ(table_.RangeBytes(kPage), 9 * kGiB);  // 1.125 x
  table_.set_device_total(8 * kGiB + kMiB);       // 9 GiB + 1.125 MiB: up to whole pages
  EXPECT_EQ(table_.RangeBytes(kPage), 9 * kGiB + kPage);
}

TEST_F(PageTableTest, MapAndUnmapKeepHomesAndCounts) {
  table_.Map(seg_, 3, 2, /*handle=*/7);
  table_.Map(seg_, 5, 1, /*handle=*/9);
  EXPECT_EQ(seg_->pages[3], 7u);
  EXPECT_EQ(seg_->pages[4], 7u);
  EXPECT_EQ(seg_->HandleEnd(3), 5u);
  EXPECT_EQ(seg_->mapped_pages, 3u);
  EXPECT_EQ(seg_->page_limit, 6u);
  ASSERT_NE(table_.HomeOf(7), nullptr);
  EXPECT_EQ(*table_.HomeOf(7), PageTable::Home(seg_, 3));
  EXPECT_TRUE(table_.CheckInvariants().ok()) << table_.CheckInvariants();

  std::size_t pages = 0;
  EXPECT_EQ(table_.Unmap(seg_, 3, &pages), 7u);
  EXPECT_EQ(pages, 2u);
  EXPECT_EQ(table_.HomeOf(7), nullptr);
  EXPECT_EQ(seg_->pages[3], 0u);
  EXPECT_EQ(seg_->pages[5], 9u);  // the neighbour stays
  EXPECT_EQ(seg_->mapped_pages, 1u);
  EXPECT_EQ(seg_->page_limit, 6u);  // bounds page walks: never lowered
  EXPECT_TRUE(table_.CheckInvariants().ok()) << table_.CheckInvariants();
}

TEST_F(PageTableTest, UseCountsFollowTheLiveBlocks) {
  Block live;  // allocated over pages 1-2 (bytes 3 MiB .. 5 MiB - 1)
  live.ptr = kBase + 3 * kMiB;
  live.size = 2 * kMiB;
  live.pool = &pool_;
  live.segment = seg_;
  live.allocated = true;
  whole_.size = live.ptr - kBase;
  whole_.next = &live;
  live.prev = &whole_;
  table_.Map(seg_, 1, 2, 7);
  EXPECT_FALSE(table_.CheckInvariants().ok());  // counted nowhere yet
  PageTable::CountUse(&live, +1);
  EXPECT_EQ(seg_->use[1], 1u);
  EXPECT_EQ(seg_->use[2], 1u);
  EXPECT_EQ(seg_->use[3], 0u);
  EXPECT_TRUE(table_.CheckInvariants().ok()) << table_.CheckInvariants();
  live.allocated = false;  // its free completes
  PageTable::CountUse(&live, -1);
  EXPECT_TRUE(table_.CheckInvariants().ok()) << table_.CheckInvariants();
}

TEST_F(PageTableTest, CheckInvariantsFindsAHandleWithoutItsHome) {
  table_.Map(seg_, 0, 1, 7);
  seg_->pages[1] = 8;  // written past the table's back
  seg_->mapped_pages = 2;
  seg_->page_limit = 2;
  const absl::Status s = table_.CheckInvariants();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("home"), absl::string_view::npos) << s;
}

TEST_F(PageTableTest, CheckInvariantsFindsAWrongMappedCount) {
  table_.Map(seg_, 0, 2, 7);
  seg_->mapped_pages = 1;
  EXPECT_FALSE(table_.CheckInvariants().ok());
}

TEST_F(PageTableTest, RefusalLastsUntilTheLastMappingWithoutAccessIsGone) {
  EXPECT_TRUE(table_.refusal().ok());
  table_.MarkInaccessible(seg_, 1, absl::InternalError("first"));
  table_.MarkInaccessible(seg_, 4, absl::InternalError("second"));
  EXPECT_EQ(table_.refusal().message(), "first");  // the first failure is the one reported
  table_.ForgetInaccessible(seg_, 2);              // not one of them
  table_.ForgetInaccessible(seg_, 1);
  EXPECT_EQ(table_.refusal().message(), "first");
  table_.ForgetInaccessible(seg_, 4);
  EXPECT_TRUE(table_.refusal().ok());
}

TEST_F(PageTableTest, UnreleasedHandlesAreKeptUntilTakenOrMappedAgain) {
  table_.KeepUnreleased(7);
  table_.KeepUnreleased(8);
  EXPECT_TRUE(table_.ForgetUnreleased(7));
  EXPECT_FALSE(table_.ForgetUnreleased(7));
  EXPECT_EQ(table_.TakeUnreleased(), std::vector<PhysicalHandle>{8});
  EXPECT_TRUE(table_.unreleased().empty());
}

TEST_F(PageTableTest, MovesAreCounted) {
  EXPECT_EQ(table_.page_moves(), 0);
  table_.CountMove();
  table_.CountMove();
  EXPECT_EQ(table_.page_moves(), 2);
}

}  // namespace
}  // namespace vramledger::core
