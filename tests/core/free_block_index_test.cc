// FreeBlockIndex alone, on hand-built segments (no allocator, no backend): best fit under the
// max_split_size rules, where a split leaves its remainder, merges with either and both
// neighbours, and the order after keys change in place.
#include "core/free_block_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

namespace vramledger::core {
namespace {

constexpr std::size_t kNoSplitLimit = SIZE_MAX;  // max_split_size unset
constexpr std::size_t kRounding = 20 * kMiB;     // torch's default max_non_split_rounding

// One plain segment of `pool` cut into blocks of `sizes` (all free and indexed unless listed in
// `live`), owned by the fixture.
class FreeBlockIndexTest : public ::testing::Test {
 protected:
  Segment* MakeSegment(BlockPool* pool, DevicePtr base, StreamId stream,
                       const std::vector<std::size_t>& sizes, const std::vector<int>& live = {}) {
    auto seg = std::make_unique<Segment>();
    seg->ptr = base;
    seg->stream = stream;
    seg->pool = pool;
    Block* prev = nullptr;
    DevicePtr at = base;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      Block* b = NewBlock();
      b->ptr = at;
      b->size = sizes[i];
      b->stream = stream;
      b->pool = pool;
      b->segment = seg.get();
      b->prev = prev;
      if (prev != nullptr) prev->next = b;
      if (prev == nullptr) seg->head = b;
      b->allocated = std::find(live.begin(), live.end(), static_cast<int>(i)) != live.end();
      if (!b->allocated) pool->blocks.insert(b);
      at += sizes[i];
      prev = b;
    }
    seg->size = at - base;
    segments_.push_back(std::move(seg));
    return segments_.back().get();
  }
  Block* NewBlock() {
    blocks_.push_back(std::make_unique<Block>());
    return blocks_.back().get();
  }
  static Block* Nth(Segment* seg, int n) {
    Block* b = seg->head;
    while (n-- > 0) b = b->next;
    return b;
  }

  BlockPool large_{false};
  std::vector<std::unique_ptr<Segment>> segments_;
  std::vector<std::unique_ptr<Block>> blocks_;
};

TEST_F(FreeBlockIndexTest, FindsTheSmallestFitOfTheStreamAtTheLowestAddress) {
  MakeSegment(&large_, 0x100000, 1, {4 * kMiB, 1 * kMiB, 8 * kMiB}, {1});
  MakeSegment(&large_, 0x200000000, 1, {4 * kMiB, 6 * kMiB}, {1});
  MakeSegment(&large_, 0x300000000, 2, {5 * kMiB});
  auto it = large_.blocks.FindBestFit(1, 3 * kMiB, kNoSplitLimit, kRounding);
  ASSERT_NE(it, large_.blocks.end());
  EXPECT_EQ((*it)->ptr, 0x100000u);  // two 4 MiB blocks: the lower address
  it = large_.blocks.FindBestFit(1, 5 * kMiB, kNoSplitLimit, kRounding);
  ASSERT_NE(it, large_.blocks.end());
  EXPECT_EQ((*it)->size, 8 * kMiB);  // stream 2's 5 MiB block is not stream 1's
  EXPECT_EQ(large_.blocks.FindBestFit(1, 9 * kMiB, kNoSplitLimit, kRounding), large_.blocks.end());
  EXPECT_EQ(large_.blocks.FindBestFit(3, 512, kNoSplitLimit, kRounding), large_.blocks.end());
  EXPECT_TRUE(large_.blocks.CheckInvariants().ok()) << large_.blocks.CheckInvariants();
}

TEST_F(FreeBlockIndexTest, MaxSplitSizeKeepsOversizeBlocksFromSmallRequests) {
  const std::size_t max_split = 64 * kMiB;
  MakeSegment(&large_, 0x100000, 0, {100 * kMiB});
  // Below max_split_size: an oversize block is never handed out.
  EXPECT_EQ(large_.blocks.FindBestFit(0, 4 * kMiB, max_split, kRounding), large_.blocks.end());
  // An oversize request takes it only if it wastes less than max_non_split_rounding.
  EXPECT_EQ(large_.blocks.FindBestFit(0, 70 * kMiB, max_split, kRounding), large_.blocks.end());
  auto it = large_.blocks.FindBestFit(0, 81 * kMiB, max_split, kRounding);
  ASSERT_NE(it, large_.blocks.end());
  EXPECT_EQ((*it)->size, 100 * kMiB);
}

TEST_F(FreeBlockIndexTest, SplitGivesTheFrontAndLeavesTheRemainderIndexedBehindIt) {
  Segment* seg = MakeSegment(&large_, 0x100000, 0, {3 * kMiB, 20 * kMiB}, {0});
  MakeSegment(&large_, 0x200000000, 0, {12 * kMiB});
  Block* big = Nth(seg, 1);
  auto it = large_.blocks.FindBestFit(0, 13 * kMiB, kNoSplitLimit, kRounding);
  ASSERT_EQ(*it, big);
  Block* front = large_.blocks.SplitFront(big, 13 * kMiB, NewBlock(), /*indexed=*/true);
  EXPECT_EQ(front->ptr, 0x100000u + 3 * kMiB);
  EXPECT_EQ(front->size, 13 * kMiB);
  EXPECT_EQ(front->prev, seg->head);
  EXPECT_EQ(seg->head->next, front);
  EXPECT_EQ(front->next, big);
  EXPECT_EQ(big->prev, front);
  EXPECT_EQ(big->ptr, front->ptr + 13 * kMiB);
  EXPECT_EQ(big->size, 7 * kMiB);
  EXPECT_FALSE(large_.blocks.contains(front));
  // The remainder (7 MiB) now sorts before the 12 MiB block of the other segment.
  ASSERT_EQ(large_.blocks.size(), 2u);
  EXPECT_EQ(*large_.blocks.begin(), big);
  EXPECT_EQ(FreeBlockIndex::Position(big), large_.blocks.begin());
  front->allocated = true;
  EXPECT_TRUE(large_.blocks.CheckInvariants().ok()) << large_.blocks.CheckInvariants();
}

TEST_F(FreeBlockIndexTest, SplitOfAnUnindexedHeadMakesTheFrontTheHead) {
  Segment* seg = MakeSegment(&large_, 0x100000, 0, {8 * kMiB});
  Block* whole = seg->head;
  large_.blocks.erase(whole);
  Block* front = large_.blocks.SplitFront(whole, 2 * kMiB, NewBlock(), /*indexed=*/false);
  EXPECT_EQ(seg->head, front);
  EXPECT_EQ(front->prev, nullptr);
  EXPECT_TRUE(large_.blocks.contains(whole));
  EXPECT_EQ(whole->ptr, 0x100000u + 2 * kMiB);
}

TEST_F(FreeBlockIndexTest, MergeWithBothNeighboursKeepsThePreviousOne) {
  Segment* seg =
      MakeSegment(&large_, 0x100000, 0, {2 * kMiB, 3 * kMiB, 4 * kMiB, 1 * kMiB}, {1, 3});
  Block* prev = Nth(seg, 0);
  Block* freed = Nth(seg, 1);
  Block* next = Nth(seg, 2);
  Block* tail = Nth(seg, 3);
  freed->allocated = false;
  const FreeBlockIndex::Merged m = large_.blocks.Merge(freed);
  EXPECT_EQ(m.block, prev);
  EXPECT_EQ(prev->size, 9 * kMiB);
  EXPECT_EQ(prev->next, tail);
  EXPECT_EQ(tail->prev, prev);
  ASSERT_EQ(m.num_gone, 2);
  EXPECT_EQ(m.gone[0], freed);
  EXPECT_EQ(m.gone[1], next);
  EXPECT_EQ(m.neighbours, 2);
  EXPECT_EQ(m.neighbour_bytes, static_cast<std::int64_t>(6 * kMiB));
  ASSERT_EQ(large_.blocks.size(), 1u);
  EXPECT_EQ(*large_.blocks.begin(), prev);
  EXPECT_TRUE(large_.blocks.CheckInvariants().ok()) << large_.blocks.CheckInvariants();
}

TEST_F(FreeBlockIndexTest, MergeWithTheNextOnlyMovesItsStartDown) {
  Segment* seg = MakeSegment(&large_, 0x100000, 0, {2 * kMiB, 3 * kMiB}, {0});
  MakeSegment(&large_, 0x200000000, 0, {4 * kMiB});
  Block* freed = seg->head;
  Block* next = freed->next;
  freed->allocated = false;
  const FreeBlockIndex::Merged m = large_.blocks.Merge(freed);
  EXPECT_EQ(m.block, next);
  EXPECT_EQ(next->ptr, 0x100000u);
  EXPECT_EQ(next->size, 5 * kMiB);
  EXPECT_EQ(seg->head, next);
  EXPECT_EQ(next->prev, nullptr);
  ASSERT_EQ(m.num_gone, 1);
  EXPECT_EQ(m.gone[0], freed);
  // Grown from 3 to 5 MiB: it now sorts after the other segment's 4 MiB block.
  EXPECT_EQ(*large_.blocks.rbegin(), next);
  EXPECT_TRUE(large_.blocks.CheckInvariants().ok()) << large_.blocks.CheckInvariants();
}

TEST_F(FreeBlockIndexTest, MergeSkipsNeighboursWithEventsOrStreamUses) {
  Segment* seg = MakeSegment(&large_, 0x100000, 0, {2 * kMiB, 2 * kMiB, 2 * kMiB}, {0, 1, 2});
  Block* pending = Nth(seg, 0);
  Block* freed = Nth(seg, 1);
  Block* used = Nth(seg, 2);
  pending->allocated = false;
  pending->event_count = 1;  // a record_stream event outstanding
  used->allocated = false;
  used->stream_uses.push_back(3);  // events not recorded yet
  freed->allocated = false;
  const FreeBlockIndex::Merged m = large_.blocks.Merge(freed);
  EXPECT_EQ(m.block, freed);
  EXPECT_EQ(m.num_gone, 0);
  EXPECT_EQ(m.neighbours, 0);
  EXPECT_EQ(freed->requested_size, 0u);
  EXPECT_TRUE(large_.blocks.contains(freed));
}

TEST_F(FreeBlockIndexTest, AbsorbTakesAFreeNeighbourOutOfTheIndex) {
  Segment* seg = MakeSegment(&large_, 0x100000, 0, {2 * kMiB, 6 * kMiB, 1 * kMiB}, {2});
  Block* front = seg->head;
  Block* dst = front->next;
  large_.blocks.erase(dst);  // as a placement takes its block out of the index
  EXPECT_EQ(FreeBlockIndex::Absorb(dst, front), 2 * kMiB);
  EXPECT_EQ(dst->ptr, 0x100000u);
  EXPECT_EQ(dst->size, 8 * kMiB);
  EXPECT_EQ(seg->head, dst);
  EXPECT_TRUE(large_.blocks.empty());
  EXPECT_EQ(FreeBlockIndex::Absorb(dst, dst->next), 0u);  // allocated: nothing changes
  EXPECT_EQ(dst->size, 8 * kMiB);
}

TEST_F(FreeBlockIndexTest, RepositionKeepsTheOrderAfterRandomInPlaceKeyChanges) {
  std::mt19937_64 rng(11);
  std::vector<Block*> all;
  for (int s = 0; s < 40; ++s) {
    Segment* seg =
        MakeSegment(&large_, DevicePtr{0x100000000} * (s + 1), s % 3, {512 * (1 + rng() % 64)});
    all.push_back(seg->head);
  }
  for (int round = 0; round < 2000; ++round) {
    Block* b = all[rng() % all.size()];
    const std::size_t old_size = b->size;
    b->size = 512 * (1 + rng() % 64);
    auto it = FreeBlockIndex::Position(b);
    switch (round % 3) {
      case 0:
        large_.blocks.Reposition(it);
        break;
      case 1:
        if (b->size <= old_size) {
          large_.blocks.RepositionShrunk(it);
        } else {
          large_.blocks.RepositionGrown(it);
        }
        break;
      default:
        large_.blocks.Relink(it);
    }
    ASSERT_TRUE(large_.blocks.CheckInvariants().ok()) << round << large_.blocks.CheckInvariants();
  }
}

TEST_F(FreeBlockIndexTest, CheckInvariantsFindsAnUnmergedPairAndAStaleKey) {
  Segment* seg = MakeSegment(&large_, 0x100000, 0, {2 * kMiB, 2 * kMiB});
  EXPECT_FALSE(large_.blocks.CheckInvariants().ok());  // two free neighbours, both indexed
  large_.blocks.erase(seg->head->next);
  seg->head->next->allocated = true;
  EXPECT_TRUE(large_.blocks.CheckInvariants().ok());
  MakeSegment(&large_, 0x200000000, 0, {4 * kMiB});
  seg->head->size = 8 * kMiB;  // a key change with no Reposition
  EXPECT_FALSE(large_.blocks.CheckInvariants().ok());
}

}  // namespace
}  // namespace vramledger::core
