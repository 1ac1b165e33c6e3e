// Randomised sequences (>= 100,000 operations) against a shadow model: no live blocks overlap,
// stats identities hold after every step; and 8 threads allocating and freeing concurrently.
#include <cmath>
#include <map>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "core/size_policy.h"
#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

struct Live {
  std::size_t size;
  std::size_t rounded;
  StreamId stream;
};

// Returns a size that is log-uniform in [1, 64 MiB], sometimes 0.
std::size_t RandomSize(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> lg(0.0, 26.0);
  if (rng() % 50 == 0) return 0;
  return static_cast<std::size_t>(std::exp2(lg(rng))) + rng() % 512;
}

void ExpectNoOverlap(const std::map<DevicePtr, Live>& live, DevicePtr p) {
  auto it = live.find(p);
  ASSERT_NE(it, live.end());
  if (it != live.begin()) {
    auto prev = std::prev(it);
    ASSERT_LE(prev->first + prev->second.rounded, p) << "overlaps the block before";
  }
  auto next = std::next(it);
  if (next != live.end()) {
    ASSERT_LE(p + it->second.rounded, next->first) << "overlaps the next";
  }
}

TEST(AllocatorModel, RandomSequencesKeepStatsAndNoOverlap) {
  constexpr int kOps = 120000;
  const StreamId streams[] = {0, 0x11, 0x22};
  SimBackend::Config config;
  config.capacity = 6 * kGiB;  // small enough that OOM retries and failures happen
  SimBackend sim(config);
  auto options = ParseOptions("max_split_size_mb:64");
  ASSERT_TRUE(options.ok());
  DeviceAllocator alloc(*options, &sim);
  std::mt19937_64 rng(12345);
  std::map<DevicePtr, Live> live;
  std::vector<DevicePtr> order;
  std::int64_t peak_allocated = 0;
  int ooms = 0;
  for (int op = 0; op < kOps; ++op) {
    const int what = static_cast<int>(rng() % 100);
    if (what < 52 || live.empty()) {
      const std::size_t size = RandomSize(rng);
      const StreamId stream = streams[rng() % 3];
      auto p = alloc.Malloc(size, stream);
      if (!p.ok()) {
        ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
        ++ooms;
        continue;
      }
      if (size == 0) {
        ASSERT_EQ(*p, 0u);
        continue;
      }
      ASSERT_NE(*p, 0u);
      ASSERT_EQ(live.count(*p), 0u) << "address handed out twice";
      live[*p] =
          Live{size, size_policy::RoundSize(size, options->roundup_power2_divisions), stream};
      order.push_back(*p);
      ExpectNoOverlap(live, *p);
    } else if (what < 97) {
      const std::size_t i = rng() % order.size();
      const DevicePtr p = order[i];
      order[i] = order.back();
      order.pop_back();
      if (rng() % 10 == 0) {
        ASSERT_TRUE(alloc.RecordStream(p, streams[rng() % 3]).ok());
      }
      ASSERT_TRUE(alloc.Free(p).ok());
      live.erase(p);
    } else if (what < 99) {
      sim.CompleteAllEvents();
    } else {
      ASSERT_TRUE(alloc.EmptyCache().ok());
    }
    const DeviceStats s = alloc.GetStats();
    std::int64_t allocated = 0;
    std::int64_t requested = 0;
    for (const auto& [p, l] : live) {
      allocated += static_cast<std::int64_t>(l.rounded);
      requested += static_cast<std::int64_t>(l.size);
    }
    peak_allocated = std::max(peak_allocated, allocated);
    const auto& a = s.allocated_bytes[kAggregate];
    // A block may be larger than the rounded request (no split when the remainder is too small).
    ASSERT_GE(a.current, allocated) << "op " << op;
    ASSERT_EQ(s.allocation[kAggregate].current, static_cast<std::int64_t>(live.size()));
    ASSERT_GE(s.requested_bytes[kAggregate].current, requested);
    ASSERT_LE(a.current, s.active_bytes[kAggregate].current);
    ASSERT_LE(s.active_bytes[kAggregate].current, s.reserved_bytes[kAggregate].current);
    ASSERT_LE(a.current, a.peak);
    ASSERT_LE(s.reserved_bytes[kAggregate].current, s.reserved_bytes[kAggregate].peak);
    ASSERT_LE(static_cast<std::size_t>(s.reserved_bytes[kAggregate].current), config.capacity);
    ASSERT_EQ(static_cast<std::size_t>(s.reserved_bytes[kAggregate].current), sim.used_bytes());
    if (op % 500 == 0) {
      ASSERT_TRUE(alloc.CheckInvariants().ok()) << alloc.CheckInvariants();
      // Exact comparison with the segments: every model block is an active_allocated block of
      // at least its rounded size, and the block sums are the stats.
      std::map<DevicePtr, BlockInfo> blocks;
      std::int64_t snap_allocated = 0, snap_requested = 0;
      for (const SegmentInfo& seg : SegmentsOf(alloc)) {
        for (const BlockInfo& b : seg.blocks) {
          if (std::string_view(b.state) == "active_allocated") {
            blocks[b.address] = b;
            snap_allocated += static_cast<std::int64_t>(b.size);
          }
          snap_requested += static_cast<std::int64_t>(b.requested_size);
        }
      }
      ASSERT_EQ(blocks.size(), live.size());
      for (const auto& [p, l] : live) {
        auto it = blocks.find(p);
        ASSERT_NE(it, blocks.end());
        ASSERT_GE(it->second.size, l.rounded);
        ASSERT_EQ(it->second.requested_size, l.size);
      }
      ASSERT_EQ(snap_allocated, a.current);
      ASSERT_EQ(snap_requested, s.requested_bytes[kAggregate].current);
    }
  }
  ASSERT_TRUE(alloc.CheckInvariants().ok()) << alloc.CheckInvariants();
  EXPECT_GT(ooms, 0) << "the sequence should exercise the out-of-memory path";
  EXPECT_GT(alloc.GetStats().num_alloc_retries, 0);
  EXPECT_GE(alloc.GetStats().allocated_bytes[kAggregate].peak, peak_allocated);
  for (DevicePtr p : order) ASSERT_TRUE(alloc.Free(p).ok());
  sim.CompleteAllEvents();
  ASSERT_TRUE(alloc.EmptyCache().ok());
  const DeviceStats end = alloc.GetStats();
  EXPECT_EQ(end.allocated_bytes[kAggregate].current, 0);
  EXPECT_EQ(end.active_bytes[kAggregate].current, 0);
  EXPECT_EQ(end.requested_bytes[kAggregate].current, 0);
  EXPECT_EQ(end.reserved_bytes[kAggregate].current, 0);
  EXPECT_EQ(sim.used_bytes(), 0u);
}

TEST(AllocatorModel, EightThreadsAllocateAndFreeConcurrently) {
  SimBackend sim;
  DeviceAllocator alloc(Options(), &sim);
  absl::Mutex mu;
  std::map<DevicePtr, std::size_t> live;  // guarded by mu: every live range, all threads
  std::atomic<int> overlaps{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      const StreamId stream = t % 2 == 0 ? 0 : 0x100 + t;  // shared and own streams
      std::vector<std::pair<DevicePtr, std::size_t>> mine;
      for (int i = 0; i < 20000; ++i) {
        if (mine.empty() || rng() % 2 == 0) {
          const std::size_t size = 1 + rng() % (4 * kMiB);
          auto p = alloc.Malloc(size, stream);
          if (!p.ok()) continue;
          {
            absl::MutexLock lock(&mu);
            auto [it, inserted] = live.emplace(*p, size);
            if (!inserted) ++overlaps;
            if (it != live.begin() && std::prev(it)->first + std::prev(it)->second > *p) {
              ++overlaps;
            }
            if (std::next(it) != live.end() && *p + size > std::next(it)->first) {
              ++overlaps;
            }
          }
          mine.emplace_back(*p, size);
        } else {
          const std::size_t i2 = rng() % mine.size();
          const DevicePtr p = mine[i2].first;
          mine[i2] = mine.back();
          mine.pop_back();
          {
            absl::MutexLock lock(&mu);
            live.erase(p);
          }
          if (!alloc.Free(p).ok()) ++overlaps;
        }
      }
      for (auto [p, size] : mine) {
        {
          absl::MutexLock lock(&mu);
          live.erase(p);
        }
        (void)alloc.Free(p);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(overlaps.load(), 0);
  ASSERT_TRUE(alloc.CheckInvariants().ok()) << alloc.CheckInvariants();
  const DeviceStats s = alloc.GetStats();
  EXPECT_EQ(s.allocated_bytes[kAggregate].current, 0);
  EXPECT_EQ(s.allocation[kAggregate].current, 0);
  EXPECT_EQ(s.allocation[kAggregate].allocated, s.allocation[kAggregate].freed);
  EXPECT_GT(s.allocation[kAggregate].allocated, 8 * 5000);
}

}  // namespace
}  // namespace vramledger
