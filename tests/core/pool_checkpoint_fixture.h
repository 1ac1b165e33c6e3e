// The fixture of the private-pool checkpoint tests (pool_checkpoint_test.cc,
// pool_checkpoint_refusal_test.cc): an allocator on SimBackend whose every step is followed by
// its invariant check, recordings into a private pool, and the ledger's per-tag live bytes.
#ifndef VRAMLEDGER_TESTS_CORE_POOL_CHECKPOINT_FIXTURE_H_
#define VRAMLEDGER_TESTS_CORE_POOL_CHECKPOINT_FIXTURE_H_

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <vector>

#include "core/pool_checkpoint.h"
#include "device/sim_backend.h"
#include "sim_allocator_fixture.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"

namespace vramledger {

inline constexpr StreamId kEager = 0x10;
inline constexpr StreamId kCapture = 0x20;
inline constexpr StreamId kSide = 0x30;
inline constexpr MempoolId kGraphPool{1, 0};
inline constexpr MempoolId kOtherPool{2, 0};

// Live requested bytes per tag, from the trace entries (what the ledger's per-tag figures read).
class TagLedger : public AllocatorHooks {
 public:
  std::uint32_t CurrentTag() override { return tag; }
  void OnEvent(const TraceEntry& e) override {
    if (e.action == TraceAction::kAlloc) live[e.tag] += static_cast<std::int64_t>(e.size);
    if (e.action == TraceAction::kFreeCompleted) live[e.tag] -= static_cast<std::int64_t>(e.size);
    if (live[e.tag] == 0) live.erase(e.tag);
  }
  std::uint32_t tag = 0;
  std::map<std::uint32_t, std::int64_t> live;
};

// SimAllocatorTest (every step checked) with torch's defaults, the tag ledger attached, its
// allocations on kCapture.
class PoolCheckpointTest : public SimAllocatorTest {
 protected:
  void SetUp() override {
    Make("");
    alloc_->SetHooks(&ledger_);
  }
  void TearDown() override {
    Check();
    alloc_->SetHooks(nullptr);
  }
  DevicePtr Alloc(std::size_t size, StreamId stream = kCapture) {
    return SimAllocatorTest::Alloc(size, stream);
  }
  // Routes kCapture's allocations to `pool` (a recording, as torch's capture does).
  void Begin(MempoolId pool = kGraphPool) {
    ASSERT_TRUE(alloc_->BeginAllocateToPool(pool, [](StreamId s) { return s == kCapture; }).ok());
    Check();
  }
  void End(MempoolId pool = kGraphPool) {
    ASSERT_TRUE(alloc_->EndAllocateToPool(pool).ok());
    Check();
  }
  core::PoolCheckpoint Checkpoint(MempoolId pool = kGraphPool) {
    auto cp = alloc_->CheckpointPool(pool);
    EXPECT_TRUE(cp.ok()) << cp.status();
    Check();
    return cp.ok() ? *cp : core::PoolCheckpoint{};
  }
  core::PoolRestore Restore(const core::PoolCheckpoint& cp, MempoolId pool = kGraphPool) {
    auto r = alloc_->RestorePool(pool, cp);
    EXPECT_TRUE(r.ok()) << r.status();
    Check();
    return r.ok() ? *r : core::PoolRestore{};
  }
  // A checkpoint of kGraphPool holding one 6 MiB block, taken before the block is freed and the
  // pool released: with no block left its segment goes back to the driver and the pool is
  // forgotten.
  core::PoolCheckpoint CheckpointThenForget() {
    Begin();
    const DevicePtr old_block = Alloc(6 * kMiB);
    End();
    core::PoolCheckpoint saved = Checkpoint();
    Free(old_block);
    EXPECT_TRUE(alloc_->ReleasePool(kGraphPool).ok());
    Check();
    return saved;
  }
  bool Live(const std::vector<DevicePtr>& live, MempoolId pool = kGraphPool) {
    auto r = alloc_->CheckPoolLiveAllocations(pool, live);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() && *r;
  }
  static std::vector<DevicePtr> Allocated(const core::PoolCheckpoint& cp) {
    std::vector<DevicePtr> out;
    for (const auto& seg : cp.segments) {
      for (const auto& b : seg.blocks) {
        if (b.allocated) out.push_back(b.ptr);
      }
    }
    return out;
  }
  std::int64_t Stat(StatArray DeviceStats::*field, StatType type = kAggregate) {
    return (alloc_->GetStats().*field)[type].current;
  }

  TagLedger ledger_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TESTS_CORE_POOL_CHECKPOINT_FIXTURE_H_
