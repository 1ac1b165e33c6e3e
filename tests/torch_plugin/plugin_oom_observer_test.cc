// The plugin's out-of-memory observer (torch_plugin/runtime/oom_observers.cc) on SimBackend:
// torch's arguments, called before the throw and outside the device lock, the fraction cap as the
// limit.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "torch_plugin/pluggable/plugin.h"

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 4 * kGiB;

cudaStream_t Stream(std::uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

// One observer call's arguments.
struct Call {
  int device;
  std::size_t alloc_size;
  std::size_t limit;
  std::size_t device_free;
  bool stats_readable;  // the stats (which take the device lock) could be read from inside
};

std::vector<Call>& Calls() {
  static std::vector<Call> calls;
  return calls;
}

void Observer(int device, std::size_t alloc_size, std::size_t limit, std::size_t device_free) {
  char* text = nullptr;
  const bool readable = vramledger_memory_stats_json(device, &text) == VRAMLEDGER_OK;
  vramledger_string_free(text);
  Calls().push_back({device, alloc_size, limit, device_free, readable});
}

class PluginOomObserverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::once_flag once;
    std::call_once(once, [] {
      ASSERT_EQ(vramledger_testing_use_sim_backend(1, kCapacity), VRAMLEDGER_OK)
          << vramledger_last_error();
      ASSERT_EQ(vramledger_configure("max_dumps:0"), VRAMLEDGER_OK) << vramledger_last_error();
    });
    Calls().clear();
    ASSERT_EQ(vramledger_set_oom_observer(&Observer), VRAMLEDGER_OK);
  }
  void TearDown() override {
    vramledger_set_oom_observer(nullptr);
    vramledger_set_memory_fraction(1.0, 0);
    EXPECT_EQ(vramledger_empty_cache(-1), VRAMLEDGER_OK);
  }
};

TEST_F(PluginOomObserverTest, CalledOnceWithTorchsArgumentsBeforeTheThrow) {
  void* a = vramledger_malloc(kGiB, 0, Stream(0));
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(Calls().empty());  // not for successes
  try {
    vramledger_malloc(8 * kGiB, 0, Stream(0));
    FAIL() << "no exception";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("free-space fragmentation"), std::string::npos) << message;
  }
  ASSERT_EQ(Calls().size(), 1u);
  const Call& call = Calls()[0];
  EXPECT_EQ(call.device, 0);
  EXPECT_GE(call.alloc_size, 8 * kGiB);
  EXPECT_EQ(call.limit, kCapacity);  // no fraction set: the device total
  EXPECT_LE(call.device_free, kCapacity - kGiB);
  EXPECT_TRUE(call.stats_readable);  // the device lock was not held
  vramledger_free(a, kGiB, 0, Stream(0));
}

TEST_F(PluginOomObserverTest, TheLimitIsTheFractionCapWhenSet) {
  vramledger_set_memory_fraction(0.25, 0);  // 1 GiB
  EXPECT_THROW(vramledger_malloc(2 * kGiB, 0, Stream(0)), c10::OutOfMemoryError);
  ASSERT_EQ(Calls().size(), 1u);
  EXPECT_EQ(Calls()[0].limit, kCapacity / 4);
}

TEST_F(PluginOomObserverTest, RemovedObserverIsNotCalled) {
  ASSERT_EQ(vramledger_set_oom_observer(nullptr), VRAMLEDGER_OK);
  EXPECT_THROW(vramledger_malloc(8 * kGiB, 0, Stream(0)), c10::OutOfMemoryError);
  EXPECT_TRUE(Calls().empty());
  void* small = vramledger_malloc(kMiB, 0, Stream(0));  // still usable
  ASSERT_NE(small, nullptr);
  vramledger_free(small, kMiB, 0, Stream(0));
}

}  // namespace
