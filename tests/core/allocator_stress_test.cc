// Many threads on two device allocators at once (one with expandable segments, one with torch's
// plain segments), mixing every operation a training process makes concurrently: malloc and free
// on several streams, record_stream and event completion, empty_cache, private pools entered and
// left, snapshots, stats and fragmentation reads. Run under ThreadSanitizer in CI
// (scripts/sanitize.sh tsan); here it checks that nothing is lost: at the end every block is
// freed, the invariants hold and reserved returns to 0.
#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "ledger/history.h"
#include "ledger/snapshot.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

constexpr int kThreads = 8;
constexpr int kOpsPerThread = 3000;
constexpr std::size_t kMaxLivePerThread = 48;
// Streams shared by all threads, so that blocks cached for one thread's stream serve another's.
constexpr StreamId kStreams[] = {0, 0x100, 0x200, 0x300};

struct Device {
  std::unique_ptr<SimBackend> sim;
  std::unique_ptr<DeviceAllocator> alloc;
};

Device MakeDevice(int index, const std::string& conf) {
  SimBackend::Config config;
  config.device = index;
  config.capacity = 8 * kGiB;  // small enough that out-of-memory retries happen
  Device d;
  d.sim = std::make_unique<SimBackend>(config);
  auto options = ParseOptions(conf);
  EXPECT_TRUE(options.ok()) << options.status();
  d.alloc = std::make_unique<DeviceAllocator>(*options, d.sim.get());
  return d;
}

std::size_t RandomSize(std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0:
      return 1 + rng() % 4096;  // small pool
    case 1:
      return 4096 + rng() % kMiB;
    case 2:
      return kMiB + rng() % (16 * kMiB);  // large pool
    default:
      return 16 * kMiB + rng() % (96 * kMiB);
  }
}

// The operations of one thread. Failures are collected as counts, not asserted inside the
// thread, so that a failing run still joins every thread.
struct Worker {
  int id;
  std::vector<Device>* devices;
  History* history;
  std::atomic<int>* errors;
  std::atomic<std::int64_t>* ooms;

  void Fail() { errors->fetch_add(1); }

  void Run() {
    std::mt19937_64 rng(0x5eed + id);
    struct Live {
      Device* device;
      DevicePtr ptr;
    };
    std::vector<Live> live;
    // This thread's private pool on each device, entered and left in turns.
    const MempoolId pool{1000 + static_cast<std::uint64_t>(id), 0};
    const std::thread::id me = std::this_thread::get_id();
    Device* in_pool = nullptr;
    auto leave_pool = [&] {
      if (in_pool == nullptr) return;
      if (!in_pool->alloc->EndAllocateToPool(pool).ok()) Fail();
      if (!in_pool->alloc->ReleasePool(pool).ok()) Fail();
      in_pool = nullptr;
    };
    for (int op = 0; op < kOpsPerThread; ++op) {
      Device& device = (*devices)[rng() % devices->size()];
      const StreamId stream = kStreams[rng() % std::size(kStreams)];
      const int what = static_cast<int>(rng() % 100);
      if ((what < 40 && live.size() < kMaxLivePerThread) || live.empty()) {
        auto p = device.alloc->Malloc(RandomSize(rng), stream);
        if (p.ok()) {
          live.push_back({&device, *p});
        } else if (p.status().code() == absl::StatusCode::kResourceExhausted) {
          ooms->fetch_add(1);
        } else {
          Fail();
        }
      } else if (what < 75 || live.size() >= kMaxLivePerThread) {
        const std::size_t i = rng() % live.size();
        if (!live[i].device->alloc->Free(live[i].ptr).ok()) Fail();
        live[i] = live.back();
        live.pop_back();
      } else if (what < 83) {
        const Live& l = live[rng() % live.size()];
        if (!l.device->alloc->RecordStream(l.ptr, stream).ok()) Fail();
      } else if (what < 88) {
        if (rng() % 2 == 0) {
          device.sim->CompleteStream(stream);
        } else {
          device.sim->CompleteAllEvents();
        }
      } else if (what < 90) {
        if (!device.alloc->EmptyCache().ok()) Fail();
      } else if (what < 93) {
        if (in_pool != nullptr) {
          leave_pool();
          if (rng() % 2 == 0 && !device.alloc->EmptyCache(pool).ok()) Fail();
        } else {
          if (!device.alloc
                   ->BeginAllocateToPool(
                       pool, [me](StreamId) { return std::this_thread::get_id() == me; })
                   .ok()) {
            Fail();
          } else {
            in_pool = &device;
          }
        }
      } else if (what < 95) {
        std::vector<const DeviceAllocator*> allocators;
        for (const Device& d : *devices) allocators.push_back(d.alloc.get());
        const SnapshotJson snapshot = BuildSnapshot(allocators, history);
        if (!snapshot.contains("segments")) Fail();
      } else if (what < 98) {
        const DeviceStats stats = device.alloc->GetStats();
        if (stats.allocated_bytes[kAggregate].current > stats.reserved_bytes[kAggregate].current) {
          Fail();
        }
        const Fragmentation f = FragmentationOf(*device.alloc, stream);
        if (f.free_bytes < 0) Fail();
      } else {
        if (SegmentsOf(*device.alloc).size() > 100000) Fail();
      }
    }
    leave_pool();
    for (const Live& l : live) {
      if (!l.device->alloc->Free(l.ptr).ok()) Fail();
    }
  }
};

TEST(AllocatorStress, EightThreadsMixingEveryOperationOnTwoDevices) {
  std::vector<Device> devices;
  devices.push_back(MakeDevice(0, "expandable_segments:True,expandable_page_mb:2"));
  devices.push_back(MakeDevice(1, "max_split_size_mb:64"));
  HistorySettings settings;
  settings.enabled = HistoryEnabled::kAll;
  settings.context = HistoryContext::kState;
  settings.max_entries = 1024;
  History history(settings);
  for (Device& d : devices) d.alloc->SetHooks(&history);

  std::atomic<int> errors{0};
  std::atomic<std::int64_t> ooms{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] { Worker{t, &devices, &history, &errors, &ooms}.Run(); });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);

  for (Device& d : devices) {
    ASSERT_TRUE(d.alloc->CheckInvariants().ok()) << d.alloc->CheckInvariants();
    d.sim->CompleteAllEvents();
    ASSERT_TRUE(d.alloc->EmptyCache().ok());
    for (int t = 0; t < kThreads; ++t) {
      ASSERT_TRUE(d.alloc->EmptyCache(MempoolId{1000 + static_cast<std::uint64_t>(t), 0}).ok());
    }
    ASSERT_TRUE(d.alloc->CheckInvariants().ok()) << d.alloc->CheckInvariants();
    const DeviceStats stats = d.alloc->GetStats();
    EXPECT_EQ(stats.allocated_bytes[kAggregate].current, 0);
    EXPECT_EQ(stats.reserved_bytes[kAggregate].current, 0);
    EXPECT_EQ(d.sim->used_bytes(), 0u);
    EXPECT_EQ(d.sim->mapped_bytes(), 0u);
    EXPECT_GT(stats.allocation[kAggregate].allocated, 0);
    EXPECT_EQ(stats.allocation[kAggregate].freed, stats.allocation[kAggregate].allocated);
    d.alloc->SetHooks(nullptr);
  }
}

}  // namespace
}  // namespace vramledger
