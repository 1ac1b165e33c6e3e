// The torch-native mode (torch_plugin/native/native_allocator.cc) on SimBackend: torch's
// CUDAAllocator calls answered by the runtime's allocator, with torch's stats struct, snapshot
// struct, errors and install rule. No GPU: allocations name their device (AllocateOn), as torch's
// current-device query needs one.
#include "torch_plugin/native/native_allocator.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "torch_plugin/pluggable/plugin.h"
#include "torch_plugin/runtime/history_api.h"

namespace vramledger {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 4 * kGiB;
constexpr int kAll = 0;  // StatType::AGGREGATE

class NativeAllocatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // No forensic dumps from the OOM cases into the working directory.
    // Plain segments: the cached-block figures below are the plain policy's.
    ASSERT_EQ(vramledger_configure("max_dumps:0,expandable_segments:False"), VRAMLEDGER_OK)
        << vramledger_last_error();
    ASSERT_EQ(vramledger_testing_use_sim_backend(2, kCapacity), VRAMLEDGER_OK)
        << vramledger_last_error();
  }
  void TearDown() override { ASSERT_EQ(vramledger_empty_cache(-1), VRAMLEDGER_OK); }

  NativeAllocator* a_ = NativeAllocator::Get();
};

TEST_F(NativeAllocatorTest, StatsFollowAllocationsInTorchsStruct) {
  const auto before = a_->getDeviceStats(0);
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 3 * kMiB + 1);
  ASSERT_NE(p.get(), nullptr);
  EXPECT_EQ(p.device(), c10::Device(c10::DeviceType::CUDA, 0));
  auto s = a_->getDeviceStats(0);
  // torch's size policy: 3 MiB + 1 rounds to 3 MiB + 512 in the large pool.
  EXPECT_EQ(s.allocated_bytes[kAll].current - before.allocated_bytes[kAll].current,
            static_cast<std::int64_t>(3 * kMiB + 512));
  EXPECT_EQ(s.requested_bytes[kAll].current - before.requested_bytes[kAll].current,
            static_cast<std::int64_t>(3 * kMiB + 1));
  EXPECT_EQ(s.allocation[kAll].current - before.allocation[kAll].current, 1);
  EXPECT_GE(s.reserved_bytes[kAll].current, s.allocated_bytes[kAll].current);
  p.clear();  // the DataPtr's own deleter frees it
  s = a_->getDeviceStats(0);
  EXPECT_EQ(s.allocated_bytes[kAll].current, before.allocated_bytes[kAll].current);
  EXPECT_EQ(s.allocation[kAll].freed - before.allocation[kAll].freed, 1);
  a_->emptyCache({0, 0});
  EXPECT_EQ(a_->getDeviceStats(0).reserved_bytes[kAll].current, 0);
}

TEST_F(NativeAllocatorTest, ZeroBytesGiveANullDataPtrOnTheDevice) {
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 0);
  EXPECT_EQ(p.get(), nullptr);
  EXPECT_EQ(p.device(), c10::Device(c10::DeviceType::CUDA, 0));
}

TEST_F(NativeAllocatorTest, PeakResetAndCacheInfo) {
  c10::DataPtr big = a_->AllocateOn(0, nullptr, 64 * kMiB);
  big.clear();
  auto s = a_->getDeviceStats(0);
  EXPECT_GE(s.allocated_bytes[kAll].peak, static_cast<std::int64_t>(64 * kMiB));
  a_->resetPeakStats(0);
  s = a_->getDeviceStats(0);
  EXPECT_EQ(s.allocated_bytes[kAll].peak, s.allocated_bytes[kAll].current);
  // torch's rule: a zero guess becomes the device's free bytes; a non-zero one is raised to
  // the largest cached block.
  std::size_t largest = 0;
  a_->cacheInfo(0, &largest);
  EXPECT_EQ(largest, kCapacity - static_cast<std::size_t>(s.reserved_bytes[kAll].current));
  largest = 1;
  a_->cacheInfo(0, &largest);
  EXPECT_EQ(largest, 64 * kMiB);  // the freed block, cached
  a_->resetAccumulatedStats(0);
  EXPECT_EQ(a_->getDeviceStats(0).allocation[kAll].allocated, 0);
}

TEST_F(NativeAllocatorTest, OutOfMemoryThrowsTorchsErrorAfterTorchsObservers) {
  // Observers stay attached for the process (as torch's): this one records into a static.
  static std::vector<std::size_t> seen;
  a_->attachOutOfMemoryObserver(
      [](std::int64_t device, std::size_t alloc_size, std::size_t, std::size_t) {
        EXPECT_EQ(device, 0);
        seen.push_back(alloc_size);
      });
  const std::int64_t ooms = a_->getDeviceStats(0).num_ooms;
  EXPECT_THROW(a_->AllocateOn(0, nullptr, 2 * kCapacity), c10::OutOfMemoryError);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_GE(seen[0], 2 * kCapacity);
  EXPECT_EQ(a_->getDeviceStats(0).num_ooms, ooms + 1);
}

TEST_F(NativeAllocatorTest, MemoryFractionCapsReservedMemory) {
  EXPECT_DOUBLE_EQ(a_->getMemoryFraction(0), 1.0);
  a_->setMemoryFraction(0.5, 0);
  EXPECT_DOUBLE_EQ(a_->getMemoryFraction(0), 0.5);
  EXPECT_THROW(a_->AllocateOn(0, nullptr, 3 * kGiB), c10::OutOfMemoryError);
  c10::DataPtr ok = a_->AllocateOn(0, nullptr, kGiB);
  EXPECT_NE(ok.get(), nullptr);
  ok.clear();
  a_->setMemoryFraction(1.0, 0);
  EXPECT_THROW(a_->setMemoryFraction(1.5, 0), c10::Error);  // the plugin's range check
}

TEST_F(NativeAllocatorTest, SnapshotCarriesSegmentsAndBlocksInTorchsStruct) {
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 30 * kMiB);
  const torch_alloc::SnapshotInfo info = a_->snapshot({0, 0}, true);
  ASSERT_EQ(info.device_traces.size(), 2u);  // one per device
  bool found = false;
  for (const auto& seg : info.segments) {
    std::size_t at = seg.address;
    for (const auto& b : seg.blocks) {
      if (at == reinterpret_cast<std::size_t>(p.get())) {
        found = true;
        EXPECT_TRUE(b.allocated);
        EXPECT_TRUE(b.active);
        EXPECT_EQ(b.requested_size, 30 * kMiB);
        EXPECT_TRUE(seg.is_large);
        EXPECT_EQ(seg.device, 0);
      }
      at += b.size;
    }
  }
  EXPECT_TRUE(found);
  EXPECT_FALSE(info.config_metadata.expandable_segments);
  EXPECT_EQ(info.config_metadata.max_split_size, SIZE_MAX);
}

// torch's snapshot(mempool_id): {0, 0} gives every segment, a private pool's id only that
// pool's, each segment naming its owner (torch's segment_pool_id).
TEST_F(NativeAllocatorTest, SnapshotOfAPrivatePoolHoldsOnlyItsSegments) {
  constexpr c10::MempoolId_t kPool{0, 7};
  c10::DataPtr outside = a_->AllocateOn(0, nullptr, 30 * kMiB);
  a_->beginAllocateToPool(0, kPool, [](cudaStream_t) { return true; });
  c10::DataPtr inside = a_->AllocateOn(0, nullptr, 30 * kMiB);
  a_->endAllocateToPool(0, kPool);
  auto owner_of = [](const torch_alloc::SnapshotInfo& info, const void* p) {
    const auto at = reinterpret_cast<std::size_t>(p);
    for (const auto& seg : info.segments) {
      if (at >= seg.address && at < seg.address + seg.total_size) {
        return std::optional<c10::MempoolId_t>(seg.owner_private_pool_id);
      }
    }
    return std::optional<c10::MempoolId_t>();
  };
  const torch_alloc::SnapshotInfo all = a_->snapshot({0, 0}, false);
  EXPECT_EQ(owner_of(all, inside.get()), std::optional<c10::MempoolId_t>(kPool));
  EXPECT_EQ(owner_of(all, outside.get()), (std::optional<c10::MempoolId_t>({0, 0})));
  const torch_alloc::SnapshotInfo only = a_->snapshot(kPool, false);
  EXPECT_EQ(owner_of(only, inside.get()), std::optional<c10::MempoolId_t>(kPool));
  EXPECT_FALSE(owner_of(only, outside.get()).has_value());
  for (const auto& seg : only.segments) EXPECT_EQ(seg.owner_private_pool_id, kPool);
  inside.clear();
  outside.clear();
  a_->releasePool(0, kPool);
  EXPECT_TRUE(a_->snapshot(kPool, false).segments.empty());
}

TEST_F(NativeAllocatorTest, HistoryThroughTorchsSwitchShowsInTorchsSnapshotTraces) {
  using Ctx = c10::CachingDeviceAllocator::RecordContext;
  a_->recordHistory(true, nullptr, 100, Ctx::ALL, /*clear_history=*/true, {});
  EXPECT_TRUE(a_->isHistoryEnabled());
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 5 * kMiB);
  const auto ptr = reinterpret_cast<std::size_t>(p.get());
  p.clear();
  const torch_alloc::SnapshotInfo info = a_->snapshot({0, 0}, true);
  a_->recordHistory(false, nullptr, 100, Ctx::NEVER, false, {});
  EXPECT_FALSE(a_->isHistoryEnabled());
  ASSERT_EQ(info.device_traces.size(), 2u);  // one per device
  std::vector<torch_alloc::TraceEntry::Action> at_ptr;
  for (const auto& e : info.device_traces[0]) {
    if (e.addr_ == ptr && e.size_ == 5 * kMiB) at_ptr.push_back(e.action_);
    EXPECT_GT(e.time_.t_, 1'600'000'000'000'000) << "epoch microseconds";
  }
  EXPECT_EQ(at_ptr, (std::vector<torch_alloc::TraceEntry::Action>{
                        torch_alloc::TraceEntry::ALLOC, torch_alloc::TraceEntry::FREE_REQUESTED,
                        torch_alloc::TraceEntry::FREE_COMPLETED}));
  EXPECT_TRUE(a_->snapshot({0, 0}, true).device_traces[0].empty());  // off: cleared, as torch
}

TEST_F(NativeAllocatorTest, HistoryContextsSkippedActionsAndThePluginsSwitch) {
  using Ctx = c10::CachingDeviceAllocator::RecordContext;
  using Action = torch_alloc::TraceEntry::Action;
  // enabled="state" reaches the allocator as a one-entry ring (torch's _record_memory_history).
  a_->recordHistory(true, nullptr, 1, Ctx::STATE, true, {});
  for (int i = 0; i < 3; ++i) a_->AllocateOn(0, nullptr, kMiB).clear();
  EXPECT_LE(a_->snapshot({0, 0}, true).device_traces[0].size(), 1u);
  // context="alloc" with a skipped action: the trace keeps the others.
  a_->recordHistory(true, nullptr, 100, Ctx::ALLOC, true, {"free_requested"});
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 7 * kMiB);
  const auto ptr = reinterpret_cast<std::size_t>(p.get());
  p.clear();
  std::vector<Action> at_ptr;
  const torch_alloc::SnapshotInfo info = a_->snapshot({0, 0}, true);
  for (const auto& e : info.device_traces[0]) {
    if (e.addr_ == ptr && e.size_ == 7 * kMiB) at_ptr.push_back(e.action_);
  }
  EXPECT_EQ(at_ptr, (std::vector<Action>{Action::ALLOC, Action::FREE_COMPLETED}));
  EXPECT_THROW(a_->recordHistory(true, nullptr, 100, Ctx::ALL, false, {"no_such_action"}),
               c10::ValueError);
  a_->recordHistory(false, nullptr, 100, Ctx::NEVER, false, {});
  // The switch is the plugin's, whichever route turned it on (vramledger.record_memory_history).
  ASSERT_EQ(vramledger_record_memory_history("all", "all", "python", 10, 0), VRAMLEDGER_OK);
  EXPECT_TRUE(a_->isHistoryEnabled());
  ASSERT_EQ(vramledger_record_memory_history(nullptr, nullptr, "python", 10, 0), VRAMLEDGER_OK);
  EXPECT_FALSE(a_->isHistoryEnabled());
}

TEST_F(NativeAllocatorTest, RawDeleterFreesWhateverDeviceMadeIt) {
  void* p = vramledger_malloc(kMiB, 1, nullptr);  // device 1; the current device is 0
  const auto live = a_->getDeviceStats(1).allocation[kAll].current;
  a_->raw_deleter()(p);
  EXPECT_EQ(a_->getDeviceStats(1).allocation[kAll].current, live - 1);
  a_->raw_delete(nullptr);  // no-op
}

TEST_F(NativeAllocatorTest, DevicesBeyondTheCountAreRefusedAndUnusedOnesReportTorchsDefaults) {
  EXPECT_THROW(a_->getDeviceStats(2), c10::Error);  // two simulated devices
  EXPECT_THROW(a_->cacheInfo(5, nullptr), c10::Error);
  EXPECT_EQ(a_->getDeviceStats(0).max_split_size, -1);  // unlimited, as torch reports it
}

TEST_F(NativeAllocatorTest, CachingCannotBeSwitchedOff) {
  EXPECT_NO_THROW(a_->enable(true));
  EXPECT_THROW(a_->enable(false), c10::Error);
  EXPECT_TRUE(a_->isEnabled());
}

TEST_F(NativeAllocatorTest, ForeignBlocksAreSkippedByRecordStream) {
  int host = 0;
  c10::DataPtr foreign(
      &host, &host, [](void*) {}, c10::Device(c10::DeviceType::CUDA, 0));
  const c10::cuda::CUDAStream stream(
      c10::cuda::CUDAStream::UNCHECKED,
      c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, 0), 0));
  EXPECT_NO_THROW(a_->recordStream(foreign, stream));
}

TEST_F(NativeAllocatorTest, ConcurrentTensorsOnTwoDevicesBalanceTheBooks) {
  // Eight threads make and drop DataPtrs on both simulated devices, some freed by another
  // thread than the one that made them (as autograd's backward thread does).
  constexpr int kThreads = 8;
  constexpr int kRounds = 2000;
  const auto before0 = a_->getDeviceStats(0);
  const auto before1 = a_->getDeviceStats(1);
  std::vector<std::vector<c10::DataPtr>> handed(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &handed] {
      std::uint32_t x = 12345u + static_cast<std::uint32_t>(t);
      for (int i = 0; i < kRounds; ++i) {
        x = x * 1664525u + 1013904223u;
        const std::size_t size = 512 + (x >> 8) % (2 * kMiB);  // held ones stay under 1.3 GiB
        c10::DataPtr p = a_->AllocateOn(static_cast<c10::DeviceIndex>(i % 2), nullptr, size);
        if (i % 7 == 0) {
          handed[t].push_back(std::move(p));  // freed later, by the main thread
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (auto& list : handed) list.clear();
  for (int d = 0; d < 2; ++d) {
    const auto s = a_->getDeviceStats(static_cast<c10::DeviceIndex>(d));
    const auto& before = d == 0 ? before0 : before1;
    EXPECT_EQ(s.allocated_bytes[kAll].current, before.allocated_bytes[kAll].current) << d;
    EXPECT_EQ(s.allocation[kAll].current, before.allocation[kAll].current) << d;
    EXPECT_EQ(s.allocation[kAll].allocated - before.allocation[kAll].allocated,
              kThreads * kRounds / 2)
        << d;
  }
}

TEST_F(NativeAllocatorTest, ADevicePastTheTableIsRefusedAndTheAllocatorNamesItself) {
  EXPECT_THROW(a_->AllocateOn(NativeAllocator::kMaxDevices, nullptr, kMiB), c10::Error);
  EXPECT_EQ(a_->name(), "vramledger");
}

TEST_F(NativeAllocatorTest, InstallReplacesTorchsAllocatorOnceBeforeCudaStarts) {
  torch_alloc::CUDAAllocator* torch_native = torch_alloc::allocator.load();
  ASSERT_NE(torch_native, nullptr);
  ASSERT_FALSE(torch_native->initialized());  // no CUDA in this process
  ASSERT_EQ(vramledger_native_install(), VRAMLEDGER_OK) << vramledger_native_last_error();
  EXPECT_EQ(torch_alloc::allocator.load(), a_);
  EXPECT_EQ(vramledger_native_install(), VRAMLEDGER_FAILED);
  EXPECT_NE(std::string(vramledger_native_last_error()).find("already"), std::string::npos);
  EXPECT_EQ(vramledger_native_allocator(), static_cast<void*>(a_));
  torch_alloc::allocator.store(torch_native);
}

}  // namespace
}  // namespace vramledger
