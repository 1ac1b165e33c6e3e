// Tag accounting under 8 threads: each thread allocates under its own thread-local tag (and some
// under the process-wide phase) on one guarded DeviceAllocator; every tag's current and peak
// bytes must come out exact, and the sum over tags must equal the allocator's requested bytes.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device/sim_backend.h"
#include "guard/budget_guard.h"
#include "guard/tags.h"
#include "vramledger/device_allocator.h"

namespace vramledger::guard {
namespace {

constexpr int kThreads = 8;
constexpr int kRounds = 200;

TEST(GuardConcurrencyTest, EightTaggedThreadsKeepExactBooks) {
  SimBackend sim;
  DeviceAllocator alloc(Options(), &sim);
  TagRegistry tags;
  auto guard = BudgetGuard::Create(0, &tags, std::nullopt);
  ASSERT_TRUE(guard.ok());
  alloc.SetHooks(guard->get());
  const std::uint32_t phase = *tags.Intern("backward");
  tags.SetPhase(phase);

  std::atomic<bool> failed{false};
  std::vector<std::int64_t> expected_peak(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Odd threads set their own tag; even threads fall back to the phase, except thread 0,
      // which tags explicitly too so that the phase is shared by threads 2, 4, 6.
      const bool own = t % 2 == 1 || t == 0;
      std::uint32_t id = phase;
      if (own) {
        id = *tags.Intern("tag" + std::to_string(t));
        SetThreadTag(id);
      }
      std::mt19937 rng(1234 + t);
      // Each round holds `live` blocks of a size fixed per thread, then frees them all: the
      // tag's peak is the largest round's total.
      const std::size_t size = 1000 + 4096 * static_cast<std::size_t>(t);
      std::int64_t peak = 0;
      for (int round = 0; round < kRounds && !failed; ++round) {
        const int live = 1 + static_cast<int>(rng() % 16);
        std::vector<DevicePtr> ptrs;
        for (int i = 0; i < live; ++i) {
          auto p = alloc.Malloc(size, 0);
          if (!p.ok()) {
            failed = true;
            break;
          }
          ptrs.push_back(*p);
        }
        peak = std::max<std::int64_t>(peak, static_cast<std::int64_t>(live * size));
        for (DevicePtr p : ptrs) {
          if (!alloc.Free(p).ok()) failed = true;
        }
      }
      expected_peak[t] = peak;
      SetThreadTag(kUntaggedTag);
    });
  }
  for (std::thread& th : threads) th.join();
  ASSERT_FALSE(failed);
  ASSERT_TRUE(alloc.CheckInvariants().ok());

  std::int64_t sum_current = 0;
  for (const TagUsage& u : (*guard)->TagUsages()) {
    sum_current += u.current;
    EXPECT_EQ(u.current, 0) << u.name;
    for (int t = 0; t < kThreads; ++t) {
      if (u.name == "tag" + std::to_string(t)) {
        EXPECT_EQ(u.peak, expected_peak[t]) << u.name;
      }
    }
    if (u.name == "backward") {
      // Threads 2, 4, 6 share the phase: its peak is at least each one's own and at most the sum.
      const std::int64_t sum = expected_peak[2] + expected_peak[4] + expected_peak[6];
      EXPECT_GE(u.peak, std::max({expected_peak[2], expected_peak[4], expected_peak[6]}));
      EXPECT_LE(u.peak, sum);
    }
  }
  EXPECT_EQ(sum_current, alloc.GetStats().requested_bytes[kAggregate].current);
  // 1 (untagged) + 5 own tags + the phase.
  EXPECT_EQ(tags.size(), 1u + 5u + 1u);
  alloc.SetHooks(nullptr);
}

TEST(GuardConcurrencyTest, TagsHeldWhileAllocatingMatchTheRequestedBytes) {
  SimBackend sim;
  DeviceAllocator alloc(Options(), &sim);
  TagRegistry tags;
  auto guard = BudgetGuard::Create(0, &tags, std::nullopt);
  ASSERT_TRUE(guard.ok());
  alloc.SetHooks(guard->get());
  std::vector<std::vector<DevicePtr>> kept(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // "t" + std::to_string(t) trips GCC 12's -Wrestrict false positive at -O3.
      std::string name = "t";
      name += std::to_string(t);
      ScopedThreadTag scope(*tags.Intern(name));
      for (int i = 0; i < 100; ++i) kept[t].push_back(*alloc.Malloc(512 * (t + 1), 0));
    });
  }
  for (std::thread& th : threads) th.join();
  std::int64_t total = 0;
  for (const TagUsage& u : (*guard)->TagUsages()) {
    total += u.current;
    if (u.name != "untagged") {
      const int t = std::stoi(u.name.substr(1));
      EXPECT_EQ(u.current, 100 * 512 * (t + 1)) << u.name;
      EXPECT_EQ(u.peak, u.current);
    }
  }
  EXPECT_EQ(total, alloc.GetStats().requested_bytes[kAggregate].current);
  for (auto& v : kept) {
    for (DevicePtr p : v) ASSERT_TRUE(alloc.Free(p).ok());
  }
  alloc.SetHooks(nullptr);
}

}  // namespace
}  // namespace vramledger::guard
