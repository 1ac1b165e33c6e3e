// core::Placement on hand-built expandable segments: page costs, the block and the place a
// request takes, the second scoring after old mappings settle, and the order mapped free pages
// are recycled in.
#include "core/placement.h"
#include "core/free_block_index.h"

#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/old_mappings.h"
#include "core/page_table.h"

namespace vramledger::core {
namespace {

constexpr std::size_t kPage = 2 * kMiB;
constexpr DevicePtr kBase = 1ull << 40;

class PlacementTest : public ::testing::Test {
 protected:
  // One segment of 16 pages at `base` on `stream` cut into blocks of the given page counts, each
  // live or free (free ones are indexed in the large pool). It becomes seg_; block(i) counts on
  // across segments.
  void Cut(const std::vector<std::pair<std::size_t, bool>>& blocks, StreamId stream = 0,
           DevicePtr base = kBase) {
    seg_ = table_.AddSegment(base, 16, kPage, stream, &large_);
    DevicePtr p = base;
    Block* prev = nullptr;
    for (const auto& [pages, live] : blocks) {
      auto b = std::make_unique<Block>();
      b->ptr = p;
      b->size = pages * kPage;
      b->pool = &large_;
      b->segment = seg_;
      b->stream = stream;
      b->prev = prev;
      b->allocated = live;
      if (prev != nullptr) {
        prev->next = b.get();
      } else {
        seg_->head = b.get();
      }
      if (!live) large_.blocks.insert(b.get());
      prev = b.get();
      p += b->size;
      blocks_.push_back(std::move(b));
    }
    ASSERT_EQ(p, base + 16 * kPage);
  }
  void MapPages(std::size_t first, std::size_t count) {
    for (std::size_t i = first; i < first + count; ++i) table_.Map(seg_, i, 1, next_handle_++);
  }
  Block* block(int i) { return blocks_[static_cast<std::size_t>(i)].get(); }
  DevicePtr Page(std::size_t i) { return seg_->PageAddress(i); }

  BlockPool small_{true, true, kPage};
  BlockPool large_{false, true, kPage};
  PageTable table_;
  OldMappings old_;
  Placement placement_{&table_, &old_, {&small_, &large_}, /*recycle_tails_first=*/false};
  Segment* seg_ = nullptr;
  std::vector<std::unique_ptr<Block>> blocks_;
  PhysicalHandle next_handle_ = 100;
};

auto NoSettle() {
  return []() -> absl::Status { return absl::InternalError("not expected"); };
}

TEST_F(PlacementTest, PageCostWeighsMappedUnmappedAndOldMappings) {
  Cut({{16, false}});
  MapPages(0, 1);
  MapPages(1, 1);
  std::size_t pages = 0;
  const PhysicalHandle moved = table_.Unmap(seg_, 1, &pages);
  old_.Add(seg_, 1, 1, moved, /*fence=*/42);
  bool in_use = false;
  EXPECT_EQ(placement_.PageCost(seg_, 0, &in_use, nullptr), 0u);
  EXPECT_EQ(placement_.PageCost(seg_, 2, &in_use, nullptr), Placement::kUnmappedPageCost);
  EXPECT_FALSE(in_use);
  EXPECT_EQ(placement_.PageCost(seg_, 1, &in_use, nullptr), Placement::kInUsePageCost);
  EXPECT_TRUE(in_use);
  seg_->old_mapping[1] = Segment::kOldMappingIdle;
  in_use = false;
  EXPECT_EQ(placement_.PageCost(seg_, 1, &in_use, nullptr), Placement::kUnmappedPageCost);
  EXPECT_FALSE(in_use);
}

TEST_F(PlacementTest, AReusableOldMappingCostsWhatAMappedPageCosts) {
  Cut({{16, false}});
  MapPages(1, 1);
  std::size_t pages = 0;
  const PhysicalHandle h = table_.Unmap(seg_, 1, &pages);
  old_.Add(seg_, 1, 1, h, 42);
  table_.Map(seg_, 5, 1, h);  // the handle now lies free at page 5
  old_.set_reuse_now(true);
  bool in_use = false;
  EXPECT_EQ(placement_.PageCost(seg_, 1, &in_use, nullptr), Placement::kReusablePageCost);
  EXPECT_FALSE(in_use);
}

TEST_F(PlacementTest, TakeBlockPrefersMappedPagesOverTheBestFitBySize) {
  Cut({{1, false}, {1, true}, {3, false}, {11, true}});
  MapPages(2, 3);
  DevicePtr start = 0;
  Block* got = placement_.TakeBlock(&large_, 0, kPage, &start, NoSettle());
  EXPECT_EQ(got, block(2));
  EXPECT_EQ(start, block(2)->ptr);
  EXPECT_EQ(large_.blocks.count(block(2)), 0u);  // taken out of the index
  EXPECT_EQ(large_.blocks.count(block(0)), 1u);
}

TEST_F(PlacementTest, TakeBlockFindsNothingForAnotherStream) {
  Cut({{16, false}});
  DevicePtr start = 0;
  EXPECT_EQ(placement_.TakeBlock(&large_, /*stream=*/1, kPage, &start, NoSettle()), nullptr);
  EXPECT_EQ(large_.blocks.size(), 1u);
}

TEST_F(PlacementTest, OldMappingsInUseAreSettledAndTheCandidatesScoredAgain) {
  // Block 0 (1 page) lies over an old mapping in use; block 2 (3 pages) is unmapped.
  Cut({{1, false}, {1, true}, {3, false}, {11, true}});
  MapPages(0, 1);
  std::size_t pages = 0;
  const PhysicalHandle h = table_.Unmap(seg_, 0, &pages);
  old_.Add(seg_, 0, 1, h, 42);
  int settles = 0;
  // Settling finds nothing completed: the unmapped block wins.
  DevicePtr start = 0;
  Block* got = placement_.TakeBlock(&large_, 0, kPage, &start, [&]() -> absl::Status {
    ++settles;
    return absl::OkStatus();
  });
  EXPECT_EQ(settles, 1);
  EXPECT_EQ(got, block(2));
  large_.blocks.insert(got);
  // Settling finds the fence completed (the old mapping is unmapped): the best fit wins again.
  got = placement_.TakeBlock(&large_, 0, kPage, &start, [&]() -> absl::Status {
    ++settles;
    old_.Erase(0, [](EventId) {});
    return absl::OkStatus();
  });
  EXPECT_EQ(settles, 2);
  EXPECT_EQ(got, block(0));
}

TEST_F(PlacementTest, StartForMovesTheRequestOntoMappedPagesFurtherIn) {
  Cut({{6, false}, {10, true}});
  MapPages(3, 2);
  EXPECT_EQ(placement_.StartFor(block(0), 2 * kPage, /*start=*/0), Page(3));
  EXPECT_EQ(placement_.StartFor(block(0), 2 * kPage, /*start=*/Page(1)), Page(1));  // as found
}

TEST_F(PlacementTest, MappedRunIsTheLongestMappedStretch) {
  Cut({{8, false}, {8, true}});
  MapPages(0, 2);
  MapPages(3, 3);
  EXPECT_EQ(Placement::MappedRun(block(0)), 3 * kPage);
}

TEST_F(PlacementTest, FreeMappedPagesListsWholeHandlesInFreeBlocks) {
  // Free 0-3 (pages 0-3), live 4 (page 4), free 5-15. Handles: page 1, pages 2-4 (under the live
  // block too: not whole in a free block), page 6, page 9.
  Cut({{4, false}, {1, true}, {11, false}});
  table_.Map(seg_, 1, 1, 11);
  table_.Map(seg_, 2, 3, 12);
  table_.Map(seg_, 6, 1, 13);
  table_.Map(seg_, 9, 1, 14);
  using List = std::vector<std::pair<Segment*, std::size_t>>;
  // Smallest free block first.
  EXPECT_EQ(placement_.FreeMappedPages(kPage, SIZE_MAX), (List{{seg_, 1}, {seg_, 6}, {seg_, 9}}));
  EXPECT_EQ(placement_.FreeMappedPages(kPage, 2), (List{{seg_, 1}, {seg_, 6}}));
  // `also` (out of the index) comes first, from `also_from` on.
  large_.blocks.erase(block(2));
  EXPECT_EQ(placement_.FreeMappedPages(kPage, SIZE_MAX, block(2), Page(7)),
            (List{{seg_, 9}, {seg_, 1}}));
  EXPECT_TRUE(placement_.FreeMappedPages(4 * kMiB, SIZE_MAX).empty());  // another page size
}

TEST_F(PlacementTest, FreeMappedPagesListsTheStreamOfTheBlockPlacedFirst) {
  using List = std::vector<std::pair<Segment*, std::size_t>>;
  Cut({{2, false}, {14, true}});  // stream 0: a free block of 2 mapped pages
  Segment* first = seg_;
  MapPages(0, 2);
  constexpr StreamId kSide = 0x33;
  Cut({{4, false}, {1, true}, {11, false}}, kSide, kBase + 16 * kPage);  // block(2) .. block(4)
  Segment* side = seg_;
  MapPages(0, 4);
  large_.blocks.erase(block(4));  // the block being placed, on the side stream
  // Without a block being placed, pool order: stream 0's blocks first.
  EXPECT_EQ(placement_.FreeMappedPages(kPage, SIZE_MAX),
            (List{{first, 0}, {first, 1}, {side, 0}, {side, 1}, {side, 2}, {side, 3}}));
  // Placing on the side stream: its own free pages first, though its block is the larger.
  EXPECT_EQ(placement_.FreeMappedPages(kPage, SIZE_MAX, block(4), block(4)->ptr),
            (List{{side, 0}, {side, 1}, {side, 2}, {side, 3}, {first, 0}, {first, 1}}));
  EXPECT_EQ(placement_.FreeMappedPages(kPage, 4, block(4), block(4)->ptr),
            (List{{side, 0}, {side, 1}, {side, 2}, {side, 3}}));
  // And the same with recycle_tails_first (no free tail here has a mapped page).
  Placement tails{&table_, &old_, {&small_, &large_}, /*recycle_tails_first=*/true};
  EXPECT_EQ(tails.FreeMappedPages(kPage, 5, block(4), block(4)->ptr),
            (List{{side, 0}, {side, 1}, {side, 2}, {side, 3}, {first, 0}}));
}

TEST_F(PlacementTest, RecycleTailsFirstTakesTheTailHighestFirst) {
  Placement tails{&table_, &old_, {&small_, &large_}, /*recycle_tails_first=*/true};
  Cut({{4, false}, {1, true}, {11, false}});
  table_.Map(seg_, 1, 1, 11);
  table_.Map(seg_, 6, 1, 13);
  table_.Map(seg_, 9, 1, 14);
  using List = std::vector<std::pair<Segment*, std::size_t>>;
  EXPECT_EQ(tails.FreeMappedPages(kPage, SIZE_MAX), (List{{seg_, 9}, {seg_, 6}, {seg_, 1}}));
}

}  // namespace
}  // namespace vramledger::core
