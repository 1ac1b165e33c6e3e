// BlockRecycler alone: a recycled block comes back last-in first-out, reset to the default state
// with its stream_uses' capacity kept, and new blocks are made only when none is spare.
#include "core/block_recycler.h"

#include <gtest/gtest.h>

namespace vramledger::core {
namespace {

TEST(BlockRecycler, ReusesTheLastRecycledBlockReset) {
  BlockRecycler recycler;
  Block* a = recycler.New();
  Block* b = recycler.New();
  EXPECT_NE(a, b);
  EXPECT_EQ(recycler.spare(), 0u);
  b->ptr = 0x1000;
  b->size = 4096;
  b->allocated = true;
  b->event_count = 2;
  b->stream_uses.assign(8, 3);
  const std::size_t capacity = b->stream_uses.capacity();
  recycler.Recycle(a);
  recycler.Recycle(b);
  EXPECT_EQ(recycler.spare(), 2u);
  Block* again = recycler.New();
  EXPECT_EQ(again, b);  // last in, first out
  EXPECT_EQ(again->ptr, 0u);
  EXPECT_EQ(again->size, 0u);
  EXPECT_FALSE(again->allocated);
  EXPECT_EQ(again->event_count, 0);
  EXPECT_TRUE(again->stream_uses.empty());
  EXPECT_EQ(again->stream_uses.capacity(), capacity);
  EXPECT_EQ(recycler.New(), a);
  EXPECT_EQ(recycler.spare(), 0u);
  recycler.Recycle(a);
  recycler.Recycle(b);  // the recycler deletes its spare blocks
}

}  // namespace
}  // namespace vramledger::core
