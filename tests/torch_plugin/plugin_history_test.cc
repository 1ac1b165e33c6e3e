// The runtime's history ABI (torch_plugin/runtime/history_api.h) on a simulated device: recording,
// the snapshot JSON, atomic dumps, bad arguments, and OOM errors that name their forensic dump.
#include "torch_plugin/runtime/history_api.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "torch_plugin/pluggable/plugin.h"

namespace {

namespace fs = std::filesystem;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

cudaStream_t Stream(std::uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

fs::path DumpDir() {
  static const fs::path dir =
      fs::temp_directory_path() / ("vramledger-plugin-history-" + std::to_string(getpid()));
  return dir;
}

// Each test runs in its own process under ctest; the device table is process-wide.
void SetUpOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    fs::remove_all(DumpDir());
    ASSERT_EQ(vramledger_testing_use_sim_backend(1, kGiB), VRAMLEDGER_OK)
        << vramledger_last_error();
    const std::string conf = "dump_dir:" + DumpDir().string() + ",max_dumps:2";
    ASSERT_EQ(vramledger_configure(conf.c_str()), VRAMLEDGER_OK) << vramledger_last_error();
  });
}

nlohmann::json Snapshot() {
  char* text = nullptr;
  EXPECT_EQ(vramledger_snapshot_json(&text), VRAMLEDGER_OK) << vramledger_last_error();
  if (text == nullptr) return nlohmann::json::object();
  nlohmann::json j = nlohmann::json::parse(text);
  vramledger_string_free(text);
  return j;
}

// Actions of device 0's trace, without segment events (which depend on what is cached).
std::vector<std::string> Actions(const nlohmann::json& snapshot) {
  std::vector<std::string> out;
  for (const auto& e : snapshot["device_traces"][0]) {
    const std::string action = e["action"];
    if (action.rfind("segment_", 0) != 0) out.push_back(action);
  }
  return out;
}

class PluginHistoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetUpOnce();
    ASSERT_EQ(vramledger_record_memory_history("all", "all", "all", 1000, 1), VRAMLEDGER_OK)
        << vramledger_last_error();
  }
  void TearDown() override { vramledger_record_memory_history(nullptr, nullptr, nullptr, 1, 1); }
};

TEST_F(PluginHistoryTest, RecordsEventsWithStacksAndAppendsSnapshotEntries) {
  void* p = vramledger_malloc(3 * kMiB, 0, Stream(0));
  ASSERT_NE(p, nullptr);
  vramledger_free(p, 3 * kMiB, 0, Stream(0));
  void* q = vramledger_malloc(1000, 0, Stream(0));
  const nlohmann::json snap = Snapshot();
  const std::vector<std::string> actions = Actions(snap);
  ASSERT_GE(actions.size(), 5u);
  EXPECT_EQ(
      std::vector<std::string>(actions.end() - 5, actions.end()),
      (std::vector<std::string>{"alloc", "free_requested", "free_completed", "alloc", "snapshot"}));
  bool live_block_has_frames = false;
  for (const auto& segment : snap["segments"]) {
    for (const auto& block : segment["blocks"]) {
      if (block["address"] == reinterpret_cast<std::uintptr_t>(q)) {
        live_block_has_frames = !block["frames"].empty();  // native frames: stacks="all"
      }
    }
  }
  EXPECT_TRUE(live_block_has_frames);
  EXPECT_EQ(snap["vramledger"]["history"]["enabled"], "all");
  // A second snapshot appends a second snapshot entry.
  EXPECT_EQ(Actions(Snapshot()).back(), "snapshot");
  vramledger_free(q, 1000, 0, Stream(0));
}

TEST_F(PluginHistoryTest, OffMeansEmptyTracesButSegmentsRemain) {
  void* p = vramledger_malloc(3 * kMiB, 0, Stream(0));
  ASSERT_EQ(vramledger_record_memory_history(nullptr, nullptr, nullptr, 1, 0), VRAMLEDGER_OK);
  const nlohmann::json snap = Snapshot();
  EXPECT_TRUE(snap["device_traces"].empty() || snap["device_traces"][0].empty());
  EXPECT_FALSE(snap["segments"].empty());
  vramledger_free(p, 3 * kMiB, 0, Stream(0));
}

TEST_F(PluginHistoryTest, BadArgumentsAreInvalidArgumentNamingTheValue) {
  EXPECT_EQ(vramledger_record_memory_history("sometimes", "all", "python", 10, 0),
            VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vramledger_last_error()).find("enabled='sometimes'"), std::string::npos)
      << vramledger_last_error();
  EXPECT_EQ(vramledger_record_memory_history("all", "all", "python", 0, 0),
            VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(vramledger_snapshot_json(nullptr), VRAMLEDGER_INVALID_ARGUMENT);
}

TEST_F(PluginHistoryTest, DumpWritesJsonAtomicallyAndNamesABadPath) {
  void* p = vramledger_malloc(5 * kMiB, 0, Stream(0));
  const fs::path path = DumpDir().parent_path() / ("vl-dump-" + std::to_string(getpid()) + ".json");
  ASSERT_EQ(vramledger_dump_snapshot_json(path.c_str()), VRAMLEDGER_OK) << vramledger_last_error();
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_FALSE(j["segments"].empty());
  EXPECT_EQ(j["device_traces"][0].back()["action"], "snapshot");
  fs::remove(path);
  EXPECT_EQ(vramledger_dump_snapshot_json("/nonexistent-dir/x.json"), VRAMLEDGER_FAILED);
  EXPECT_NE(std::string(vramledger_last_error()).find("/nonexistent-dir/x.json"), std::string::npos)
      << vramledger_last_error();
  vramledger_free(p, 5 * kMiB, 0, Stream(0));
}

TEST_F(PluginHistoryTest, OutOfMemoryWritesADumpNamedInTheErrorAndKeepsMaxDumps) {
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    try {
      vramledger_malloc(2 * kGiB, 0, Stream(0));
      FAIL() << "no exception";
    } catch (const c10::OutOfMemoryError& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_EQ(message.rfind("CUDA out of memory. Tried to allocate ", 0), 0u) << message;
      const std::string marker = "memory snapshot written to ";
      const std::size_t at = message.find(marker);
      ASSERT_NE(at, std::string::npos) << message;
      const std::size_t begin = at + marker.size();
      const std::string path = message.substr(begin, message.find(' ', begin) - begin);
      EXPECT_EQ(fs::path(path).parent_path(), DumpDir()) << path;
      EXPECT_NE(path.find("vramledger-oom-device0-pid" + std::to_string(getpid())),
                std::string::npos)
          << path;
      ASSERT_TRUE(fs::exists(path)) << path;
      std::ifstream in(path);
      const nlohmann::json j = nlohmann::json::parse(in);
      const auto& trace = j["device_traces"][0];
      ASSERT_GE(trace.size(), 2u);
      EXPECT_EQ(trace[trace.size() - 2]["action"], "oom");  // then the snapshot's own entry
      EXPECT_TRUE(trace[trace.size() - 2].contains("device_free"));
      EXPECT_EQ(j["vramledger"]["dump"]["reason"], "oom");
      paths.push_back(path);
    }
    usleep(5000);  // distinct modification times
  }
  int dumps = 0;
  for (const auto& entry : fs::directory_iterator(DumpDir())) {
    dumps += entry.path().filename().string().rfind("vramledger-oom-", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(dumps, 2);
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_FALSE(fs::exists(paths[0]));
  EXPECT_TRUE(fs::exists(paths[2]));
}

}  // namespace
