// The runtime's guard ABI (torch_plugin/runtime/guard_api.h) on simulated devices: a plan from the
// options, tags through the C ABI, refusals thrown as c10::OutOfMemoryError with the full report
// (plan line, Python frames from the provider, forensic snapshot), per-tag stats, steps and plan
// checks.
#include "torch_plugin/runtime/guard_api.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>

#include "nlohmann/json.hpp"
#include "torch_plugin/pluggable/plugin.h"
#include "torch_plugin/runtime/plan_access.h"

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 4 * kGiB;

namespace fs = std::filesystem;

fs::path Dir() {
  // One directory per process: CTest runs each test case in its own process, in parallel.
  static const fs::path dir =
      fs::temp_directory_path() / ("vramledger_guard_api_test-" + std::to_string(getpid()));
  return dir;
}

// Line numbers matter: the tests below name them.
constexpr char kPlan[] =
    "{\n"
    "  \"limit\": \"1GiB\",\n"
    "  \"category_limits\": {\n"
    "    \"activations\": \"256MiB\"\n"
    "  },\n"
    "  \"devices\": {\"1\": {\"limit\": \"2GiB\"}}\n"
    "}\n";

std::size_t FakePythonStack(char* buf, std::size_t capacity) {
  const char text[] = "F\tmodel.py\t12\tforward\nF\ttrain.py\t40\tmain\n";
  const std::size_t n = std::min(capacity, sizeof(text) - 1);
  std::memcpy(buf, text, n);
  return n;
}

void SetUpOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    fs::remove_all(Dir());
    fs::create_directories(Dir());
    std::ofstream(Dir() / "plan.json") << kPlan;
    const std::string conf = "plan:" + (Dir() / "plan.json").string() +
                             ",step_log:" + (Dir() / "steps").string() +
                             ",dump_dir:" + (Dir() / "dumps").string();
    ASSERT_EQ(vramledger_testing_use_sim_backend(2, kCapacity), VRAMLEDGER_OK)
        << vramledger_last_error();
    ASSERT_EQ(vramledger_configure(conf.c_str()), VRAMLEDGER_OK) << vramledger_last_error();
    ASSERT_EQ(vramledger_set_python_stack_fn(FakePythonStack), VRAMLEDGER_OK);
  });
}

nlohmann::json TakeJson(char* text) {
  if (text == nullptr) return nlohmann::json();
  nlohmann::json j = nlohmann::json::parse(text);
  vramledger_string_free(text);
  return j;
}

nlohmann::json TagStats(int device) {
  char* text = nullptr;
  EXPECT_EQ(vramledger_tag_stats_json(device, &text), VRAMLEDGER_OK) << vramledger_last_error();
  return TakeJson(text);
}

unsigned TagId(const char* name) {
  unsigned id = 0;
  EXPECT_EQ(vramledger_tag_id(name, &id), VRAMLEDGER_OK) << vramledger_last_error();
  return id;
}

std::string RefusalText(std::size_t size, int device) {
  try {
    void* p = vramledger_malloc(size, device, nullptr);
    vramledger_free(p, size, device, nullptr);
  } catch (const c10::OutOfMemoryError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

class GuardApiTest : public ::testing::Test {
 protected:
  void SetUp() override { SetUpOnce(); }
};

TEST_F(GuardApiTest, TagsAndPhaseReachTheDeviceStats) {
  const unsigned act = TagId("activations");
  EXPECT_EQ(TagId("untagged"), 0u);
  EXPECT_EQ(TagId("activations"), act);
  unsigned bad = 0;
  EXPECT_EQ(vramledger_tag_id("", &bad), VRAMLEDGER_INVALID_ARGUMENT);
  const unsigned before = vramledger_set_thread_tag(act);
  void* a = vramledger_malloc(100 * kMiB, 0, nullptr);
  vramledger_set_thread_tag(before);
  const unsigned opt = TagId("optimizer");
  vramledger_set_phase(opt);
  void* b = vramledger_malloc(10 * kMiB, 0, nullptr);
  vramledger_set_phase(0);
  nlohmann::json stats = TagStats(0);
  EXPECT_EQ(stats.at("tags.activations.current"), 100 * kMiB);
  EXPECT_EQ(stats.at("tags.optimizer.current"), 10 * kMiB);
  EXPECT_EQ(stats.at("guard.limit_bytes"), kGiB);
  vramledger_free(a, 100 * kMiB, 0, nullptr);
  vramledger_free(b, 10 * kMiB, 0, nullptr);
  stats = TagStats(0);
  EXPECT_EQ(stats.at("tags.activations.current"), 0);
  EXPECT_EQ(stats.at("tags.activations.peak"), 100 * kMiB);
}

TEST_F(GuardApiTest, CategoryRefusalCarriesTheWholeReport) {
  const unsigned before = vramledger_set_thread_tag(TagId("activations"));
  void* a = vramledger_malloc(200 * kMiB, 0, nullptr);
  const std::string text = RefusalText(100 * kMiB, 0);
  vramledger_set_thread_tag(before);
  vramledger_free(a, 200 * kMiB, 0, nullptr);
  const std::string plan = (Dir() / "plan.json").string();
  EXPECT_EQ(text.rfind("vramledger plan violation: " + plan +
                           ":4: category_limits.activations: live 'activations' bytes would "
                           "reach 300.00 MiB",
                       0),
            0u)
      << text;
  EXPECT_NE(text.find("tag 'activations'"), std::string::npos) << text;
  EXPECT_NE(text.find("captured at the refusal:\n    model.py:12 in forward\n    train.py:40 in "
                      "main\n    [native] "),
            std::string::npos)
      << text;
  const std::size_t at = text.find("forensic snapshot: ");
  ASSERT_NE(at, std::string::npos) << text;
  const std::string path = text.substr(at + std::strlen("forensic snapshot: "));
  EXPECT_EQ(path.rfind((Dir() / "dumps").string(), 0), 0u) << path;
  EXPECT_TRUE(fs::exists(path)) << path;
  std::ifstream in(path);
  std::stringstream dump;
  dump << in.rdbuf();
  EXPECT_NE(dump.str().find("\"guard\""), std::string::npos);
  EXPECT_GE(TagStats(0).at("guard.refusals").get<int>(), 1);
}

TEST_F(GuardApiTest, LimitRefusalAndAPerDeviceOverride) {
  const std::string text = RefusalText(1536 * kMiB, 0);
  EXPECT_EQ(text.rfind("vramledger plan violation: " + (Dir() / "plan.json").string() +
                           ":2: limit: reserved memory would grow to 1.50 GiB",
                       0),
            0u)
      << text;
  void* ok = vramledger_malloc(1536 * kMiB, 1, nullptr);  // device 1: limit 2 GiB (line 6)
  EXPECT_NE(ok, nullptr);
  vramledger_free(ok, 1536 * kMiB, 1, nullptr);
  EXPECT_NE(RefusalText(3 * kGiB, 1).find(":6: devices.1.limit: "), std::string::npos);
}

TEST_F(GuardApiTest, StepWritesOneLinePerDeviceToTheRankLog) {
  void* warm = vramledger_malloc(kMiB, 0, nullptr);
  vramledger_free(warm, kMiB, 0, nullptr);
  char* text = nullptr;
  ASSERT_EQ(vramledger_step(&text), VRAMLEDGER_OK) << vramledger_last_error();
  const nlohmann::json records = TakeJson(text);
  ASSERT_TRUE(records.is_array());
  ASSERT_GE(records.size(), 1u);
  EXPECT_EQ(records[0].at("device"), 0);
  EXPECT_GT(records[0].at("peak_reserved_bytes").get<std::int64_t>(), 0);
  ASSERT_EQ(vramledger_step(nullptr), VRAMLEDGER_OK);
  std::ifstream log(Dir() / "steps" / "vramledger-steps-rank0.jsonl");
  ASSERT_TRUE(log.good());
  int lines = 0;
  for (std::string line; std::getline(log, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    EXPECT_EQ(record.at("rank"), 0);
    ++lines;
  }
  EXPECT_EQ(lines, 2 * static_cast<int>(records.size()));
}

TEST_F(GuardApiTest, PlanCheckNamesFileLineAndField) {
  char* text = nullptr;
  const std::string plan = (Dir() / "plan.json").string();
  ASSERT_EQ(vramledger_plan_check(plan.c_str(), 2, kCapacity, &text), VRAMLEDGER_OK);
  const nlohmann::json summary = TakeJson(text);
  EXPECT_EQ(summary.at("devices").size(), 2u);
  EXPECT_EQ(summary.at("devices")[1].at("limit"), 2 * kGiB);
  EXPECT_EQ(vramledger_plan_check(plan.c_str(), 1, kCapacity, &text), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(
      std::string(vramledger_last_error()),
      plan + ":6: field 'devices.1': unknown device 1: this process sees 1 CUDA device (0-0)");
  EXPECT_EQ(vramledger_plan_check(plan.c_str(), 2, kGiB / 2, &text), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_NE(std::string(vramledger_last_error()).find(":2: field 'limit': limit 1GiB"),
            std::string::npos);
  EXPECT_EQ(vramledger_plan_check("/nonexistent.json", 0, 0, &text), VRAMLEDGER_FAILED);
}

}  // namespace
