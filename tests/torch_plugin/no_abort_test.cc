// No refusal ends the process: every refusal path of the entry points torch calls (the
// torch-native allocator, the plugin's C ABI) raises the c10 error torch turns into a Python
// exception, or returns its status code, on the calling thread and on a thread the program
// started (torch's autograd workers, queue feeder and IPC receiver are such threads). Each
// thread case runs in a child process (a death test) that must exit normally: a terminate or
// abort anywhere on the path fails it. Simulated devices, no GPU.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/pluggable/plugin.h"

namespace vramledger {
namespace {

constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 1 * kGiB;  // per simulated device

// What a refusal must raise: c10's type (torch.OutOfMemoryError, ValueError, RuntimeError), a
// status code of the ctypes ABI, or nothing at all (a free: it reports and goes on).
enum class Raises { kOutOfMemory, kValueError, kError, kFailedCode, kInvalidCode, kNothing };

struct Case {
  const char* name;
  Raises raises;
  std::function<void()> call;  // throws, or stores its status code in g_code
};

// gtest prints a case by its name.
void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

thread_local int g_code = VRAMLEDGER_OK;

NativeAllocator* Native() { return NativeAllocator::Get(); }

const std::vector<Case>& Cases() {
  static const auto* const cases = new std::vector<Case>{
      {"AllocateMoreThanTheCard", Raises::kOutOfMemory,
       [] { Native()->AllocateOn(0, nullptr, 8 * kGiB); }},
      {"AllocateSizeMax", Raises::kOutOfMemory,
       [] { Native()->AllocateOn(0, nullptr, SIZE_MAX); }},
      {"AllocateOnADeviceOutsideTheTable", Raises::kError,
       [] { Native()->AllocateOn(99, nullptr, 4096); }},
      {"StatsOfADeviceThatDoesNotExist", Raises::kError, [] { Native()->getDeviceStats(5); }},
      {"RawDeleteOfAnUnknownPointer", Raises::kNothing,
       [] { Native()->raw_delete(reinterpret_cast<void*>(0x1234)); }},
      {"MemoryFractionAboveOne", Raises::kValueError, [] { Native()->setMemoryFraction(2.0, 0); }},
      {"CachingDisabled", Raises::kError, [] { Native()->enable(false); }},
      {"HistoryWithAnUnknownSkipAction", Raises::kValueError,
       [] {
         Native()->recordHistory(false, nullptr, 1, c10::CachingDeviceAllocator::RecordContext::NEVER,
                                 false, {"not_an_action"});
       }},
      {"IpcOpenOfAMalformedHandle", Raises::kError, [] { Native()->OpenIpcOn(0, "garbage"); }},
      {"IpcShareOfAnUnknownPointer", Raises::kError,
       [] { Native()->shareIpcHandle(reinterpret_cast<void*>(0x1234)); }},
      {"BaseAllocationOfAnUnknownPointer", Raises::kError,
       [] {
         std::size_t size = 0;
         Native()->getBaseAllocation(reinterpret_cast<void*>(0x1234), &size);
       }},
      {"EndAllocateToAnUnknownPool", Raises::kError,
       [] { Native()->endAllocateToPool(0, {77, 0}); }},
      {"ReleaseAnUnknownPool", Raises::kError, [] { Native()->releasePool(0, {77, 0}); }},
      {"CreateTheDefaultPool", Raises::kValueError,
       [] { Native()->createOrIncrefPool(0, {0, 0}, nullptr); }},
      {"CheckpointAnUnknownPool", Raises::kError,
       [] { Native()->getCheckpointState(0, {77, 0}); }},
      {"CheckLiveAllocationsOfAnUnknownPool", Raises::kError,
       [] { Native()->checkPoolLiveAllocations(0, {77, 0}, std::unordered_set<void*>{}); }},
      // The plugin's C ABI (the CUDAPluggableAllocator's functions and the ctypes functions).
      {"PluginMallocMoreThanTheCard", Raises::kOutOfMemory,
       [] { vramledger_malloc(8 * kGiB, 1, nullptr); }},
      {"PluginFreeOfAnUnknownPointer", Raises::kNothing,
       [] { vramledger_free(reinterpret_cast<void*>(0x1234), 64, 0, nullptr); }},
      {"PluginRecordStreamOfAnUnknownPointer", Raises::kError,
       [] { vramledger_record_stream(reinterpret_cast<void*>(0x1234), nullptr); }},
      {"PluginBeginAllocateOnAnUnknownDevice", Raises::kValueError,
       [] { vramledger_begin_allocate_to_pool(99, {5, 0}, nullptr); }},
      {"CtypesConfigureWithAnUnknownKey", Raises::kInvalidCode,
       [] { g_code = vramledger_configure("not_an_option:1"); }},
      {"CtypesIpcOpenOfAMalformedHandle", Raises::kInvalidCode,
       [] {
         const std::string handle = "garbage";
         std::shared_ptr<void> out;
         g_code = vramledger_ipc_open(0, &handle, &out);
       }},
      {"CtypesEmptyCacheOfADeviceOutsideTheTable", Raises::kInvalidCode,
       [] { g_code = vramledger_empty_cache(99); }},
  };
  return *cases;
}

// Runs `c` on the calling thread: "" when it raised what it must, else what happened.
std::string RunCase(const Case& c) {
  g_code = VRAMLEDGER_OK;
  Raises got = Raises::kNothing;
  std::string what;
  try {
    c.call();
    if (g_code == VRAMLEDGER_FAILED) got = Raises::kFailedCode;
    if (g_code == VRAMLEDGER_INVALID_ARGUMENT) got = Raises::kInvalidCode;
  } catch (const c10::OutOfMemoryError& e) {
    got = Raises::kOutOfMemory;
    what = e.what_without_backtrace();
  } catch (const c10::ValueError& e) {
    got = Raises::kValueError;
    what = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    got = Raises::kError;
    what = e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string("threw a std::exception: ") + e.what();
  }
  if (got != c.raises) {
    return "raised kind " + std::to_string(static_cast<int>(got)) + ", expected " +
           std::to_string(static_cast<int>(c.raises)) + " (" + what + ")";
  }
  if (got != Raises::kNothing && got != Raises::kFailedCode && got != Raises::kInvalidCode &&
      what.empty()) {
    return "an error without a message";
  }
  if ((got == Raises::kFailedCode || got == Raises::kInvalidCode) &&
      std::string(vramledger_last_error()).empty()) {
    return "a failure code without a message";
  }
  return "";
}

// A child process's start: the simulated devices, no forensic dumps.
void SetUpDevices() {
  if (vramledger_configure("max_dumps:0") != VRAMLEDGER_OK ||
      vramledger_testing_use_sim_backend(2, kCapacity) != VRAMLEDGER_OK) {
    std::fprintf(stderr, "set-up: %s\n", vramledger_last_error());
    std::_Exit(4);
  }
}

// The child of a thread case: runs `c` on a thread of its own and exits 0 when it raised what it
// must (3 with the reason on stderr otherwise).
[[noreturn]] void RunCaseOnAThreadAndExit(const Case& c) {
  std::string result = "not run";
  std::thread worker([&] { result = RunCase(c); });
  worker.join();
  if (!result.empty()) std::fprintf(stderr, "%s\n", result.c_str());
  std::_Exit(result.empty() ? 0 : 3);
}

// Callbacks that throw: the allocation still raises torch's OutOfMemoryError, a later one is
// served; exits 0 when both happened.
[[noreturn]] void ThrowingCallbacksAndExit() {
  SetUpDevices();
  Native()->attachOutOfMemoryObserver([](std::int64_t, std::size_t, std::size_t, std::size_t) {
    throw std::runtime_error("observer failed");
  });
  Native()->attachAllocatorTraceTracker(
      [](const auto&) { throw std::runtime_error("tracker failed"); });
  int outcomes = 0;
  std::thread worker([&] {
    try {
      Native()->AllocateOn(0, nullptr, 8 * kGiB);
    } catch (const c10::OutOfMemoryError&) {
      ++outcomes;
    }
    c10::DataPtr served = Native()->AllocateOn(0, nullptr, 4096);
    outcomes += served.get() != nullptr;
  });
  worker.join();
  std::_Exit(outcomes == 2 ? 0 : 3);
}

// A thread that pthread_exit ends inside an OOM observer; exits 0 when that thread ended (its
// body did not return) and the device still serves the main thread.
[[noreturn]] void ThreadEndingInAnObserverAndExit() {
  SetUpDevices();
  Native()->attachOutOfMemoryObserver(
      [](std::int64_t, std::size_t, std::size_t, std::size_t) { pthread_exit(nullptr); });
  auto body = [](void*) -> void* {
    Native()->AllocateOn(0, nullptr, 8 * kGiB);
    return reinterpret_cast<void*>(1);  // not reached: the observer ends the thread
  };
  pthread_t thread;
  if (pthread_create(&thread, nullptr, body, nullptr) != 0) std::_Exit(5);
  void* returned = nullptr;
  pthread_join(thread, &returned);
  c10::DataPtr served = Native()->AllocateOn(0, nullptr, 4096);
  std::_Exit(returned == nullptr && served.get() != nullptr ? 0 : 3);
}

class NoAbortTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(vramledger_configure("max_dumps:0"), VRAMLEDGER_OK) << vramledger_last_error();
    ASSERT_EQ(vramledger_testing_use_sim_backend(2, kCapacity), VRAMLEDGER_OK)
        << vramledger_last_error();
  }
  // A child re-runs this binary for its one test (no fork of a process with threads).
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_P(NoAbortTest, RefusalRaisesOnTheCallingThread) { EXPECT_EQ(RunCase(GetParam()), ""); }

TEST_P(NoAbortTest, RefusalRaisesOnAProgramThreadAndTheProcessGoesOn) {
  EXPECT_EXIT(RunCaseOnAThreadAndExit(GetParam()), ::testing::ExitedWithCode(0), "");
}

INSTANTIATE_TEST_SUITE_P(EntryPoints, NoAbortTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

// Callbacks torch attaches (OOM observers, trace trackers: Python functions behind torch's
// wrappers) that throw leave the refusal to torch's OutOfMemoryError; the process goes on.
TEST(NoAbortCallbacksTest, ThrowingObserverAndTrackerLeaveTheRefusalToTorch) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(ThrowingCallbacksAndExit(), ::testing::ExitedWithCode(0), "");
}

// A thread that ends inside a callback (pthread_exit, as Python ends a thread that waits for the
// GIL while the interpreter finalizes) unwinds through the allocator's catch-alls, which let it
// pass: that thread ends, the process goes on, and the device still serves.
TEST(NoAbortCallbacksTest, ThreadEndingInsideAnObserverEndsOnlyThatThread) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(ThreadEndingInAnObserverAndExit(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace vramledger
