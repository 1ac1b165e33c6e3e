// The hot path's own data structures against reference models: LiveBlockMap against
// std::unordered_map under random insert/erase (probe runs that wrap, collide and shift back),
// PoolStat against the straightforward per-row Stat updates it replaces.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "core/block.h"
#include "core/free_block_index.h"
#include "core/live_block_map.h"
#include "core/pool_stats.h"

namespace vramledger::core {
namespace {

TEST(LiveBlockMap, MatchesAReferenceMapUnderRandomInsertAndErase) {
  std::mt19937_64 rng(7);
  std::vector<Block> blocks(4096);
  LiveBlockMap map;
  std::unordered_map<DevicePtr, Block*> model;
  // Addresses in a narrow 512-aligned range so probe runs collide, wrap and grow the table.
  auto address = [&] { return DevicePtr{0x7f0000000000} + 512 * (rng() % 6000); };
  for (int step = 0; step < 200000; ++step) {
    const DevicePtr p = address();
    if (rng() % 3 != 0) {
      Block* b = &blocks[rng() % blocks.size()];
      map.Insert(p, b);
      model[p] = b;
    } else {
      ASSERT_EQ(map.Erase(p), model.erase(p) == 1) << step;
    }
    ASSERT_EQ(map.size(), model.size()) << step;
    const DevicePtr q = address();
    auto it = model.find(q);
    ASSERT_EQ(map.Find(q), it == model.end() ? nullptr : it->second) << step;
  }
  for (const auto& [p, b] : model) ASSERT_EQ(map.Find(p), b);
  EXPECT_EQ(map.Find(0), nullptr);
  EXPECT_FALSE(map.Erase(0));
}

TEST(LiveBlockMap, EraseEverythingLeavesNoStaleEntry) {
  LiveBlockMap map;
  std::vector<Block> blocks(3000);
  for (std::size_t i = 0; i < blocks.size(); ++i) map.Insert(512 * (i + 1), &blocks[i]);
  for (std::size_t i = 0; i < blocks.size(); i += 2) ASSERT_TRUE(map.Erase(512 * (i + 1)));
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    ASSERT_EQ(map.Find(512 * (i + 1)), i % 2 == 0 ? nullptr : &blocks[i]) << i;
  }
  for (std::size_t i = 1; i < blocks.size(); i += 2) ASSERT_TRUE(map.Erase(512 * (i + 1)));
  EXPECT_EQ(map.size(), 0u);
}

// The reference: every row updated on every change, as torch does.
void Reference(StatArray& a, StatType pool, std::int64_t amount) {
  if (amount >= 0) {
    a[kAggregate].Increase(amount);
    a[pool].Increase(amount);
  } else {
    a[kAggregate].Decrease(-amount);
    a[pool].Decrease(-amount);
  }
}

void ExpectSame(const StatArray& want, const StatArray& got, int step) {
  for (int t = 0; t < kNumStatTypes; ++t) {
    ASSERT_EQ(got[t].current, want[t].current) << "row " << t << " step " << step;
    ASSERT_EQ(got[t].peak, want[t].peak) << "row " << t << " step " << step;
    ASSERT_EQ(got[t].allocated, want[t].allocated) << "row " << t << " step " << step;
    ASSERT_EQ(got[t].freed, want[t].freed) << "row " << t << " step " << step;
  }
}

TEST(LiveBlockMap, FindWithSlotThenEraseAtMatchesErase) {
  LiveBlockMap map;
  std::vector<Block> blocks(300);
  for (std::size_t i = 0; i < blocks.size(); ++i) map.Insert((i + 1) * 512, &blocks[i]);
  for (std::size_t i = 0; i < blocks.size(); i += 2) {  // every other one, via slot
    std::size_t slot = 0;
    ASSERT_EQ(map.Find((i + 1) * 512, &slot), &blocks[i]);
    map.EraseAt(slot);
  }
  EXPECT_EQ(map.size(), 150u);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(map.Find((i + 1) * 512), i % 2 == 0 ? nullptr : &blocks[i]) << i;
  }
}

TEST(FreeIndex, PositionFollowsEveryInsertAndRelink) {
  BlockPool pool(true);
  std::vector<Block> blocks(64);
  std::mt19937_64 rng(7);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    blocks[i].ptr = (i + 1) * 4096;
    blocks[i].size = 512 * (1 + rng() % 16);
    blocks[i].stream = rng() % 3;
    pool.blocks.insert(&blocks[i]);
  }
  for (int round = 0; round < 1000; ++round) {
    Block* b = &blocks[rng() % blocks.size()];
    auto it = FreeBlockIndex::Position(b);
    ASSERT_EQ(*it, b);
    b->size = 512 * (1 + rng() % 16);  // an in-place key change, then the node is relinked
    pool.blocks.insert(pool.blocks.extract(it));
    for (Block& x : blocks) ASSERT_EQ(*FreeBlockIndex::Position(&x), &x);
    ASSERT_TRUE(std::is_sorted(pool.blocks.begin(), pool.blocks.end(), BlockBestFitLess()));
  }
  pool.blocks.erase(FreeBlockIndex::Position(&blocks[5]));
  EXPECT_EQ(pool.blocks.size(), blocks.size() - 1);
  EXPECT_FALSE(pool.blocks.contains(&blocks[5]));
}

TEST(PoolStat, MatchesPerRowUpdatesThroughResets) {
  std::mt19937_64 rng(11);
  PoolStat stat;
  StatArray want;
  for (int step = 0; step < 100000; ++step) {
    const StatType pool = rng() % 2 == 0 ? kSmallPool : kLargePool;
    const auto r = rng() % 100;
    if (r < 1) {
      stat.ResetPeak();
      for (Stat& s : want) s.ResetPeak();
    } else if (r < 2) {
      stat.ResetAccumulated();
      for (Stat& s : want) s.ResetAccumulated();
    } else if (r < 5 && want[pool].current > 0) {  // a page changing pool: "all" totals stay
      const StatType to = pool == kSmallPool ? kLargePool : kSmallPool;
      const std::int64_t amount = 1 + static_cast<std::int64_t>(rng() % want[pool].current);
      stat.Move(pool, to, amount);
      want[pool].Decrease(amount);
      want[to].Increase(amount);
    } else {
      // Keep every row's current >= 0, as the allocator does.
      const std::int64_t amount =
          static_cast<std::int64_t>(rng() % 1000) -
          static_cast<std::int64_t>(std::min<std::int64_t>(want[pool].current, 900));
      stat.Add(pool, amount);
      Reference(want, pool, amount);
    }
    ExpectSame(want, stat.ToStatArray(), step);
    ASSERT_EQ(stat.current(kAggregate), want[kAggregate].current);
    ASSERT_EQ(stat.peak(kAggregate), want[kAggregate].peak);
  }
}

TEST(CoreStats, ToDeviceStatsCarriesEveryRowAndCounter) {
  CoreStats s;
  s.allocated_bytes.Increase(kSmallPool, 4096);
  s.allocated_bytes.Increase(kLargePool, 8 << 20);
  s.allocated_bytes.Decrease(kSmallPool, 4096);
  s.reserved_bytes.Increase(kLargePool, 20 << 20);
  s.num_ooms = 3;
  s.max_split_size = 1 << 30;
  s.oversize_segments.Increase(1);
  const DeviceStats d = s.ToDeviceStats();
  EXPECT_EQ(d.allocated_bytes[kAggregate].current, 8 << 20);
  EXPECT_EQ(d.allocated_bytes[kAggregate].peak, (8 << 20) + 4096);
  EXPECT_EQ(d.allocated_bytes[kSmallPool].freed, 4096);
  EXPECT_EQ(d.allocated_bytes[kAggregate].allocated, (8 << 20) + 4096);
  EXPECT_EQ(d.reserved_bytes[kLargePool].current, 20 << 20);
  EXPECT_EQ(d.num_ooms, 3);
  EXPECT_EQ(d.max_split_size, 1 << 30);
  EXPECT_EQ(d.oversize_segments.current, 1);
  EXPECT_DOUBLE_EQ(s.utilization(), d.utilization());
  s.ResetAccumulated();
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(s.ToDeviceStats().allocated_bytes[kAggregate].freed, 0);
}

}  // namespace
}  // namespace vramledger::core
