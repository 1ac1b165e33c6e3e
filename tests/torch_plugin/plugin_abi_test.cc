// The plugin's C ABI (pluggable/plugin.h, runtime/c_api.h) on simulated devices: null for size 0,
// refusals thrown as c10::OutOfMemoryError, frees that never throw, stats JSON, configure rules,
// threads.
#include "torch_plugin/pluggable/plugin.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 4 * kGiB;  // per simulated device
constexpr int kDevices = 2;

cudaStream_t Stream(std::uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

// The plugin's state is process-wide: every test shares two simulated devices configured once
// with max_split_size_mb:200 and plain segments (the books these cases count), and leaves
// nothing allocated behind.
void SetUpOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    ASSERT_EQ(vramledger_testing_use_sim_backend(kDevices, kCapacity), VRAMLEDGER_OK)
        << vramledger_last_error();
    ASSERT_EQ(vramledger_configure("max_split_size_mb:200,max_dumps:0,expandable_segments:False"),
              VRAMLEDGER_OK)
        << vramledger_last_error();
  });
}

nlohmann::json Stats(int device) {
  char* text = nullptr;
  EXPECT_EQ(vramledger_memory_stats_json(device, &text), VRAMLEDGER_OK) << vramledger_last_error();
  if (text == nullptr) return nlohmann::json::object();
  nlohmann::json json = nlohmann::json::parse(text);
  vramledger_string_free(text);
  return json;
}

std::int64_t Stat(int device, const char* key) { return Stats(device).at(key).get<std::int64_t>(); }

class PluginAbiTest : public ::testing::Test {
 protected:
  void SetUp() override { SetUpOnce(); }
};

TEST_F(PluginAbiTest, SizeZeroReturnsNullAndNullFreeIsNoOp) {
  const std::int64_t before = Stat(0, "allocation.all.allocated");
  EXPECT_EQ(vramledger_malloc(0, 0, Stream(0)), nullptr);
  vramledger_free(nullptr, 0, 0, Stream(0));
  EXPECT_EQ(Stat(0, "allocation.all.allocated"), before);
}

TEST_F(PluginAbiTest, MallocFreeAndStatsFollowTorchSemantics) {
  const nlohmann::json before = Stats(0);
  void* p = vramledger_malloc(4000, 0, Stream(0));
  ASSERT_NE(p, nullptr);
  const nlohmann::json live = Stats(0);
  EXPECT_EQ(live["allocated_bytes.all.current"].get<std::int64_t>() -
                before["allocated_bytes.all.current"].get<std::int64_t>(),
            4096);  // rounded to 512
  EXPECT_EQ(live["requested_bytes.all.current"].get<std::int64_t>() -
                before["requested_bytes.all.current"].get<std::int64_t>(),
            4000);
  EXPECT_EQ(live["allocation.all.current"].get<std::int64_t>() -
                before["allocation.all.current"].get<std::int64_t>(),
            1);
  EXPECT_GE(live["reserved_bytes.all.current"].get<std::int64_t>(),
            live["allocated_bytes.all.current"].get<std::int64_t>());
  EXPECT_EQ(live["max_split_size"].get<std::int64_t>(), 200 * static_cast<std::int64_t>(kMiB));
  EXPECT_TRUE(live["utilization"].is_number_float());
  EXPECT_TRUE(live.contains("largest_free_block_bytes"));
  for (const char* family :
       {"allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
        "active_bytes", "inactive_split_bytes", "requested_bytes"}) {
    for (const char* pool : {"all", "small_pool", "large_pool"}) {
      for (const char* field : {"current", "peak", "allocated", "freed"}) {
        const std::string key = std::string(family) + "." + pool + "." + field;
        EXPECT_TRUE(live.contains(key)) << key;
      }
    }
  }
  vramledger_free(p, 4000, 0, Stream(0));
  EXPECT_EQ(Stat(0, "allocated_bytes.all.current"),
            before["allocated_bytes.all.current"].get<std::int64_t>());
}

TEST_F(PluginAbiTest, RefusalThrowsOutOfMemoryErrorAndAllocatorStaysUsable) {
  const std::int64_t ooms = Stat(0, "num_ooms");
  try {
    vramledger_malloc(2 * kCapacity, 0, Stream(0));
    FAIL() << "no exception";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_EQ(message.rfind("CUDA out of memory. Tried to allocate ", 0), 0u) << message;
    EXPECT_NE(message.find("GPU 0 has a total capacity of 4.00 GiB"), std::string::npos) << message;
  }
  EXPECT_EQ(Stat(0, "num_ooms"), ooms + 1);
  EXPECT_THROW(vramledger_malloc(SIZE_MAX / 2, 0, Stream(0)), c10::OutOfMemoryError);
  void* p = vramledger_malloc(kMiB, 0, Stream(0));
  EXPECT_NE(p, nullptr);
  vramledger_free(p, kMiB, 0, Stream(0));
}

TEST_F(PluginAbiTest, BadDeviceIsAValueError) {
  EXPECT_THROW(vramledger_malloc(16, kDevices, Stream(0)), c10::ValueError);
  EXPECT_THROW(vramledger_malloc(16, -1, Stream(0)), c10::ValueError);
  char* text = nullptr;
  EXPECT_EQ(vramledger_memory_stats_json(kDevices, &text), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(text, nullptr);
  EXPECT_NE(std::string(vramledger_last_error()).find("invalid device index 2"), std::string::npos);
  EXPECT_EQ(vramledger_memory_stats_json(0, nullptr), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(vramledger_empty_cache(7), VRAMLEDGER_INVALID_ARGUMENT);
}

TEST_F(PluginAbiTest, FreeOfUnknownPointerPrintsOneLineAndContinues) {
  testing::internal::CaptureStderr();
  vramledger_free(reinterpret_cast<void*>(0x1234), 16, 0, Stream(0));
  vramledger_free(reinterpret_cast<void*>(0x1234), 16, kDevices, Stream(0));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 2) << err;
  EXPECT_EQ(err.rfind("vramledger: free of 0x1234 (16 bytes) on device 0", 0), 0u) << err;
  void* p = vramledger_malloc(512, 0, Stream(0));  // still usable
  EXPECT_NE(p, nullptr);
  vramledger_free(p, 512, 0, Stream(0));
}

TEST_F(PluginAbiTest, OptionsAreFrozenByTheFirstAllocation) {
  void* p = vramledger_malloc(512, 0, Stream(0));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(vramledger_configure("max_split_size_mb:200,max_dumps:0,expandable_segments:False"),
            VRAMLEDGER_OK);
  EXPECT_EQ(vramledger_configure("max_split_size_mb:300"), VRAMLEDGER_FAILED);
  EXPECT_NE(std::string(vramledger_last_error()).find("already running"), std::string::npos);
  EXPECT_EQ(vramledger_configure("no_such_key:1"), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vramledger_last_error()).find("no_such_key"), std::string::npos);
  vramledger_free(p, 512, 0, Stream(0));
  const std::string names = vramledger_option_names();
  EXPECT_EQ(names.rfind("max_split_size_mb,", 0), 0u) << names;
  EXPECT_NE(names.find(",expandable_segments,"), std::string::npos) << names;
}

TEST_F(PluginAbiTest, EmptyCacheReturnsFreeSegments) {
  void* p = vramledger_malloc(30 * kMiB, 0, Stream(0));
  ASSERT_NE(p, nullptr);
  vramledger_free(p, 30 * kMiB, 0, Stream(0));
  EXPECT_GE(Stat(0, "reserved_bytes.all.current"), static_cast<std::int64_t>(30 * kMiB));
  EXPECT_EQ(vramledger_empty_cache(0), VRAMLEDGER_OK) << vramledger_last_error();
  EXPECT_EQ(Stat(0, "reserved_bytes.all.current"), 0);
  p = vramledger_malloc(30 * kMiB, 0, Stream(0));
  vramledger_free(p, 30 * kMiB, 0, Stream(0));
  vramledger_reset();  // torch.cuda.empty_cache(): every device
  EXPECT_EQ(Stat(0, "reserved_bytes.all.current"), 0);
  EXPECT_EQ(vramledger_empty_cache(-1), VRAMLEDGER_OK);
}

// Two devices keep separate books. A block of device 1 is freed to device 1's allocator
// whatever device is current, and empty_cache (torch's reset hook, every device) returns device 1's
// free segment while device 0's live block and its segment stay.
TEST_F(PluginAbiTest, TwoDevicesKeepSeparateBooksAndEmptyCacheReleasesEach) {
  ASSERT_EQ(vramledger_empty_cache(-1), VRAMLEDGER_OK) << vramledger_last_error();
  const std::int64_t alloc0 = Stat(0, "allocation.all.allocated");
  void* on0 = vramledger_malloc(64 * kMiB, 0, Stream(0));
  void* on1 = vramledger_malloc(1 * kGiB, 1, Stream(0));
  ASSERT_NE(on0, nullptr);
  ASSERT_NE(on1, nullptr);
  EXPECT_EQ(Stat(0, "allocation.all.allocated"), alloc0 + 1);
  EXPECT_EQ(Stat(1, "allocated_bytes.all.current"), static_cast<std::int64_t>(kGiB));
  EXPECT_EQ(Stat(0, "allocated_bytes.all.current"), static_cast<std::int64_t>(64 * kMiB));
  const std::int64_t reserved0 = Stat(0, "reserved_bytes.all.current");

  vramledger_free(on1, kGiB, 1, Stream(0));
  EXPECT_EQ(Stat(1, "allocated_bytes.all.current"), 0);
  EXPECT_EQ(Stat(1, "reserved_bytes.all.current"), static_cast<std::int64_t>(kGiB));  // cached
  vramledger_reset();
  EXPECT_EQ(Stat(1, "reserved_bytes.all.current"), 0);
  EXPECT_EQ(Stat(1, "num_device_free"), Stat(1, "num_device_alloc"));
  EXPECT_EQ(Stat(0, "reserved_bytes.all.current"), reserved0);  // device 0's block is live
  EXPECT_EQ(Stat(0, "allocated_bytes.all.current"), static_cast<std::int64_t>(64 * kMiB));
  vramledger_free(on0, 64 * kMiB, 0, Stream(0));
  EXPECT_EQ(vramledger_empty_cache(-1), VRAMLEDGER_OK);
}

TEST_F(PluginAbiTest, MemoryFractionCapsReserved) {
  vramledger_set_memory_fraction(0.5, 1);  // 2 GiB of device 1's 4 GiB
  void* a = vramledger_malloc(1536 * kMiB, 1, Stream(0));
  ASSERT_NE(a, nullptr);
  try {
    vramledger_malloc(kGiB, 1, Stream(0));
    FAIL() << "no exception";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("allowed"), std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_LE(Stat(1, "reserved_bytes.all.current"), static_cast<std::int64_t>(2 * kGiB));
  EXPECT_THROW(vramledger_set_memory_fraction(1.5, 1), c10::ValueError);
  vramledger_set_memory_fraction(1.0, 1);
  void* b = vramledger_malloc(kGiB, 1, Stream(0));
  EXPECT_NE(b, nullptr);
  vramledger_free(a, 1536 * kMiB, 1, Stream(0));
  vramledger_free(b, kGiB, 1, Stream(0));
  EXPECT_EQ(vramledger_empty_cache(1), VRAMLEDGER_OK);
}

TEST_F(PluginAbiTest, RecordStreamDefersReuseUntilTheStreamCompletes) {
  const cudaStream_t main = Stream(0x100);
  const cudaStream_t side = Stream(0x200);
  void* p = vramledger_malloc(64 * kMiB, 0, main);
  ASSERT_NE(p, nullptr);
  vramledger_record_stream(p, side);
  vramledger_free(p, 64 * kMiB, 0, main);
  const nlohmann::json pending = Stats(0);
  EXPECT_EQ(pending["active_bytes.all.current"].get<std::int64_t>() -
                pending["allocated_bytes.all.current"].get<std::int64_t>(),
            static_cast<std::int64_t>(64 * kMiB));
  void* q = vramledger_malloc(64 * kMiB, 0, main);
  EXPECT_NE(q, p);  // the side stream may still use p
  ASSERT_EQ(vramledger_testing_complete_events(0), VRAMLEDGER_OK) << vramledger_last_error();
  void* r = vramledger_malloc(64 * kMiB, 0, main);  // events are processed here
  EXPECT_EQ(r, p);
  const nlohmann::json done = Stats(0);
  EXPECT_EQ(done["active_bytes.all.current"], done["allocated_bytes.all.current"]);
  vramledger_free(q, 64 * kMiB, 0, main);
  vramledger_free(r, 64 * kMiB, 0, main);
  vramledger_record_stream(nullptr, side);  // size-0 tensors: no-op
  EXPECT_THROW(vramledger_record_stream(reinterpret_cast<void*>(0x1234), side), c10::Error);
  EXPECT_EQ(vramledger_empty_cache(0), VRAMLEDGER_OK);
}

TEST_F(PluginAbiTest, ResetPeakAndAccumulated) {
  void* p = vramledger_malloc(8 * kMiB, 0, Stream(0));
  vramledger_free(p, 8 * kMiB, 0, Stream(0));
  EXPECT_GE(Stat(0, "allocated_bytes.all.peak"), static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(vramledger_reset_peak(0), VRAMLEDGER_OK);
  EXPECT_EQ(Stat(0, "allocated_bytes.all.peak"), Stat(0, "allocated_bytes.all.current"));
  EXPECT_EQ(vramledger_reset_accumulated(-1), VRAMLEDGER_OK);
  const nlohmann::json s = Stats(0);
  EXPECT_EQ(s["allocated_bytes.all.allocated"], 0);
  EXPECT_EQ(s["allocation.all.freed"], 0);
  EXPECT_EQ(s["num_ooms"], 0);
  EXPECT_EQ(vramledger_empty_cache(0), VRAMLEDGER_OK);
}

TEST_F(PluginAbiTest, EightThreadsNeverGetOverlappingBlocks) {
  const std::int64_t live_before = Stat(0, "allocation.all.current");
  std::mutex mu;
  std::map<std::uintptr_t, std::size_t> live;  // address -> size, all threads
  bool overlap = false;
  auto worker = [&](int seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<std::size_t> size_of(1, 4 * kMiB);
    std::vector<std::pair<void*, std::size_t>> mine;
    for (int i = 0; i < 3000; ++i) {
      if (mine.size() < 8 && (mine.empty() || rng() % 2 == 0)) {
        const std::size_t size = size_of(rng);
        void* p = vramledger_malloc(size, 0, Stream(0));
        const auto a = reinterpret_cast<std::uintptr_t>(p);
        std::lock_guard<std::mutex> lock(mu);
        auto next = live.lower_bound(a);
        if (next != live.end() && next->first < a + size) overlap = true;
        if (next != live.begin() && std::prev(next)->first + std::prev(next)->second > a) {
          overlap = true;
        }
        live.emplace(a, size);
        mine.emplace_back(p, size);
      } else {
        const std::size_t k = rng() % mine.size();
        auto [p, size] = mine[k];
        mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        {
          std::lock_guard<std::mutex> lock(mu);
          live.erase(reinterpret_cast<std::uintptr_t>(p));
        }
        vramledger_free(p, size, 0, Stream(0));
      }
    }
    for (auto [p, size] : mine) {
      {
        std::lock_guard<std::mutex> lock(mu);
        live.erase(reinterpret_cast<std::uintptr_t>(p));
      }
      vramledger_free(p, size, 0, Stream(0));
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) threads.emplace_back(worker, t);
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(overlap);
  EXPECT_TRUE(live.empty());
  const nlohmann::json s = Stats(0);
  EXPECT_EQ(s["allocation.all.current"].get<std::int64_t>(), live_before);
  EXPECT_LE(s["allocated_bytes.all.current"].get<std::int64_t>(),
            s["active_bytes.all.current"].get<std::int64_t>());
  EXPECT_LE(s["active_bytes.all.current"].get<std::int64_t>(),
            s["reserved_bytes.all.current"].get<std::int64_t>());
  EXPECT_EQ(vramledger_empty_cache(0), VRAMLEDGER_OK);
}

}  // namespace
