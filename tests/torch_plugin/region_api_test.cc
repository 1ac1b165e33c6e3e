// The runtime's region ABI (torch_plugin/runtime/region_api.h) through the plugin on a simulated
// device: a scope routes the calling thread's allocations, pause and resume report their bytes and
// keep the addresses, no-ops say so, the stats, fragmentation and out-of-memory report show the
// regions, and every error names the region with the status code Python maps to its exception.
// Each test runs in its own process (CTest), so each sets up its own simulated device and plan.
#include "torch_plugin/runtime/region_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "nlohmann/json.hpp"
#include "torch_plugin/pluggable/plugin.h"

namespace {

using ::testing::HasSubstr;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

namespace fs = std::filesystem;

// A simulated device of `capacity` bytes with expandable segments of 2 MiB pages, and `extra`
// options.
void UseSim(std::size_t capacity, const std::string& extra = "") {
  ASSERT_EQ(vramledger_testing_use_sim_backend(1, capacity), VRAMLEDGER_OK)
      << vramledger_last_error();
  const std::string conf = "expandable_segments:True,expandable_page_mb:2" + extra;
  ASSERT_EQ(vramledger_configure(conf.c_str()), VRAMLEDGER_OK) << vramledger_last_error();
}

nlohmann::json Take(char* text) {
  if (text == nullptr) return nlohmann::json();
  nlohmann::json j = nlohmann::json::parse(text);
  vramledger_string_free(text);
  return j;
}

void* Alloc(std::size_t size) {
  char* message = nullptr;
  void* p = vramledger_testing_malloc(size, 0, &message);
  if (message != nullptr) {
    ADD_FAILURE() << message;
    vramledger_string_free(message);
  }
  return p;
}

// The message of a refused allocation (empty if it succeeded).
std::string Refusal(std::size_t size) {
  char* message = nullptr;
  void* p = vramledger_testing_malloc(size, 0, &message);
  if (p != nullptr) vramledger_free(p, size, 0, nullptr);
  std::string text = message != nullptr ? message : "";
  vramledger_string_free(message);
  return text;
}

nlohmann::json Pause(const char* name, int backup) {
  char* out = nullptr;
  EXPECT_EQ(vramledger_region_pause(0, name, backup, &out), VRAMLEDGER_OK)
      << vramledger_last_error();
  return Take(out);
}

nlohmann::json Resume(const char* name, int keep = 0) {
  char* out = nullptr;
  EXPECT_EQ(vramledger_region_resume(0, name, keep, &out), VRAMLEDGER_OK)
      << vramledger_last_error();
  return Take(out);
}

nlohmann::json Regions(int device = 0) {
  char* out = nullptr;
  EXPECT_EQ(vramledger_region_list(device, &out), VRAMLEDGER_OK) << vramledger_last_error();
  return Take(out);
}

nlohmann::json Stats() {
  char* out = nullptr;
  EXPECT_EQ(vramledger_memory_stats_json(0, &out), VRAMLEDGER_OK) << vramledger_last_error();
  return Take(out);
}

TEST(RegionApiTest, ScopeRoutesTheCallingThreadOnlyAndPauseResumeKeepAddresses) {
  UseSim(8 * kGiB);
  void* outside = Alloc(6 * kMiB);
  ASSERT_EQ(vramledger_region_begin(0, "train"), VRAMLEDGER_OK) << vramledger_last_error();
  void* inside = Alloc(20 * kMiB);
  void* other_thread = nullptr;
  std::thread([&] { other_thread = Alloc(4 * kMiB); }).join();  // not in the region
  ASSERT_EQ(vramledger_region_end(0, "train"), VRAMLEDGER_OK) << vramledger_last_error();

  nlohmann::json regions = Regions();
  ASSERT_EQ(regions.size(), 1u) << regions;
  EXPECT_EQ(regions[0]["name"], "train");
  EXPECT_EQ(regions[0]["paused"], false);
  EXPECT_EQ(regions[0]["allocated_bytes"], 20 * kMiB);
  // The physical bytes it holds: what a pause releases.
  const std::size_t reserved = regions[0]["mapped_bytes"];
  EXPECT_GE(reserved, 20 * kMiB);
  EXPECT_GE(regions[0]["reserved_bytes"], reserved);
  const std::int64_t device_reserved = Stats()["reserved_bytes.all.current"];

  const nlohmann::json paused = Pause("train", VRAMLEDGER_BACKUP_CPU);
  EXPECT_EQ(paused["region"], "train");
  EXPECT_EQ(paused["released_bytes"], reserved);
  EXPECT_EQ(paused["backed_up_bytes"], 20 * kMiB);
  EXPECT_EQ(paused["already_paused"], false);
  regions = Regions();
  EXPECT_EQ(regions[0]["paused"], true);
  EXPECT_EQ(regions[0]["mapped_bytes"], 0);
  EXPECT_EQ(regions[0]["paused_bytes"], reserved);
  EXPECT_EQ(regions[0]["backed_up_bytes"], 20 * kMiB);
  nlohmann::json stats = Stats();
  EXPECT_EQ(stats["reserved_bytes.all.current"],
            device_reserved - static_cast<std::int64_t>(reserved));
  EXPECT_EQ(stats["regions.train.paused"], 1);
  EXPECT_EQ(stats["regions.train.paused_bytes"], reserved);
  EXPECT_TRUE(Pause("train", VRAMLEDGER_BACKUP_CPU)["already_paused"]);

  const nlohmann::json resumed = Resume("train");
  EXPECT_EQ(resumed["mapped_bytes"], reserved);
  EXPECT_EQ(resumed["restored_bytes"], 20 * kMiB);
  EXPECT_EQ(resumed["already_running"], false);
  EXPECT_TRUE(Resume("train")["already_running"]);
  regions = Regions();
  EXPECT_EQ(regions[0]["paused"], false);
  EXPECT_EQ(regions[0]["mapped_bytes"], reserved);
  EXPECT_EQ(regions[0]["host_buffer_bytes"], 0);
  EXPECT_EQ(Stats()["reserved_bytes.all.current"], device_reserved);
  // The same addresses serve on: every block frees where it was.
  vramledger_free(inside, 20 * kMiB, 0, nullptr);
  vramledger_free(outside, 6 * kMiB, 0, nullptr);
  vramledger_free(other_thread, 4 * kMiB, 0, nullptr);
  EXPECT_EQ(Regions()[0]["allocated_bytes"], 0);
  EXPECT_EQ(Stats()["allocated_bytes.all.current"], 0);
}

TEST(RegionApiTest, KeptHostBuffersShowUntilTheNextPause) {
  UseSim(8 * kGiB);
  ASSERT_EQ(vramledger_region_begin(0, "r"), VRAMLEDGER_OK) << vramledger_last_error();
  void* p = Alloc(8 * kMiB);
  ASSERT_EQ(vramledger_region_end(0, "r"), VRAMLEDGER_OK);
  Pause("r", VRAMLEDGER_BACKUP_CPU);
  Resume("r", /*keep=*/1);
  EXPECT_EQ(Regions()[0]["host_buffer_bytes"], 8 * kMiB);
  EXPECT_EQ(Stats()["regions.r.host_buffer_bytes"], 8 * kMiB);
  vramledger_free(p, 8 * kMiB, 0, nullptr);
}

TEST(RegionApiTest, AllocationInAPausedRegionFailsNamingIt) {
  UseSim(8 * kGiB);
  ASSERT_EQ(vramledger_region_begin(0, "rollout"), VRAMLEDGER_OK);
  void* p = Alloc(4 * kMiB);
  Pause("rollout", VRAMLEDGER_BACKUP_NONE);
  EXPECT_THAT(Refusal(kMiB), HasSubstr("rollout"));
  ASSERT_EQ(vramledger_region_end(0, "rollout"), VRAMLEDGER_OK);
  vramledger_free(p, 4 * kMiB, 0, nullptr);  // a paused region's block may be freed
  EXPECT_EQ(Regions()[0]["allocated_bytes"], 0);
}

TEST(RegionApiTest, BadArgumentsAndUnknownRegionsAreNamed) {
  UseSim(8 * kGiB);
  char* out = nullptr;
  EXPECT_EQ(vramledger_region_begin(0, ""), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_THAT(vramledger_last_error(), HasSubstr("non-empty name"));
  EXPECT_EQ(vramledger_region_begin(0, nullptr), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(vramledger_region_begin(5, "r"), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_EQ(vramledger_region_pause(0, "r", 7, &out), VRAMLEDGER_INVALID_ARGUMENT);
  EXPECT_THAT(vramledger_last_error(), HasSubstr("backup must be 0 (none) or 1 (cpu), got 7"));
  EXPECT_EQ(out, nullptr);
  // No allocator yet: no region.
  EXPECT_EQ(vramledger_region_pause(0, "ghost", VRAMLEDGER_BACKUP_NONE, &out), VRAMLEDGER_FAILED);
  EXPECT_THAT(vramledger_last_error(), HasSubstr("'ghost'"));
  EXPECT_EQ(Regions(-1), nlohmann::json::array());
  void* p = Alloc(kMiB);  // the allocator exists now; the region still does not
  EXPECT_EQ(vramledger_region_resume(0, "ghost", 0, &out), VRAMLEDGER_FAILED);
  EXPECT_THAT(vramledger_last_error(), HasSubstr("'ghost'"));
  EXPECT_EQ(vramledger_region_end(0, "ghost"), VRAMLEDGER_FAILED);
  EXPECT_THAT(vramledger_last_error(), HasSubstr("'ghost'"));
  EXPECT_EQ(vramledger_region_pause(0, "ghost", VRAMLEDGER_BACKUP_NONE, nullptr),
            VRAMLEDGER_INVALID_ARGUMENT);
  vramledger_free(p, kMiB, 0, nullptr);
}

TEST(RegionApiTest, ResumeBeyondTheCardIsOutOfMemoryAndLeavesTheRegionPaused) {
  UseSim(256 * kMiB);
  ASSERT_EQ(vramledger_region_begin(0, "big"), VRAMLEDGER_OK);
  void* p = Alloc(160 * kMiB);
  ASSERT_EQ(vramledger_region_end(0, "big"), VRAMLEDGER_OK);
  const nlohmann::json paused = Pause("big", VRAMLEDGER_BACKUP_CPU);
  void* q = Alloc(160 * kMiB);  // the card holds one of the two at a time
  char* out = nullptr;
  EXPECT_EQ(vramledger_region_resume(0, "big", 0, &out), VRAMLEDGER_OUT_OF_MEMORY);
  EXPECT_THAT(vramledger_last_error(), HasSubstr("big"));
  EXPECT_EQ(out, nullptr);
  nlohmann::json regions = Regions();
  EXPECT_EQ(regions[0]["paused"], true);
  EXPECT_EQ(regions[0]["backed_up_bytes"], paused["backed_up_bytes"]);
  EXPECT_EQ(regions[0]["mapped_bytes"], 0);
  vramledger_free(q, 160 * kMiB, 0, nullptr);
  ASSERT_EQ(vramledger_empty_cache(0), VRAMLEDGER_OK);
  EXPECT_EQ(Resume("big")["restored_bytes"], paused["backed_up_bytes"]);
  vramledger_free(p, 160 * kMiB, 0, nullptr);
}

TEST(RegionApiTest, GuardCountsARegionOnlyWhileResumedAndNamesThePlanLine) {
  const fs::path dir =
      fs::temp_directory_path() / ("vramledger_region_api_test-" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "plan.json") << "{\n  \"vramledger_plan\": 1,\n  \"limit\": \"256MiB\"\n}\n";
  UseSim(8 * kGiB, ",plan:" + (dir / "plan.json").string() + ",dump_dir:" + (dir / "d").string());
  ASSERT_EQ(vramledger_region_begin(0, "train"), VRAMLEDGER_OK);
  void* p = Alloc(160 * kMiB);
  ASSERT_EQ(vramledger_region_end(0, "train"), VRAMLEDGER_OK);
  Pause("train", VRAMLEDGER_BACKUP_CPU);
  void* q = Alloc(160 * kMiB);  // within the plan while "train" is paused
  ASSERT_NE(q, nullptr);
  char* out = nullptr;
  EXPECT_EQ(vramledger_region_resume(0, "train", 0, &out), VRAMLEDGER_OUT_OF_MEMORY);
  EXPECT_THAT(vramledger_last_error(), HasSubstr("plan.json:3"));
  EXPECT_EQ(Regions()[0]["paused"], true);
  // A refusal's report lists the regions.
  const std::string refusal = Refusal(200 * kMiB);
  EXPECT_THAT(refusal, HasSubstr("vramledger regions on device 0:"));
  EXPECT_THAT(refusal, HasSubstr("region train: paused, reserved "));
  vramledger_free(q, 160 * kMiB, 0, nullptr);
  ASSERT_EQ(vramledger_empty_cache(0), VRAMLEDGER_OK);
  Resume("train");
  vramledger_free(p, 160 * kMiB, 0, nullptr);
  fs::remove_all(dir);
}

TEST(RegionApiTest, FragmentationListsTheRegions) {
  UseSim(8 * kGiB);
  ASSERT_EQ(vramledger_region_begin(0, "a"), VRAMLEDGER_OK);
  void* p = Alloc(2 * kMiB);
  ASSERT_EQ(vramledger_region_end(0, "a"), VRAMLEDGER_OK);
  char* out = nullptr;
  ASSERT_EQ(vramledger_fragmentation_json(0, nullptr, &out), VRAMLEDGER_OK);
  const nlohmann::json f = Take(out);
  ASSERT_EQ(f["regions"].size(), 1u) << f;
  EXPECT_EQ(f["regions"][0]["name"], "a");
  EXPECT_EQ(f["regions"][0]["allocated_bytes"], 2 * kMiB);
  vramledger_free(p, 2 * kMiB, 0, nullptr);
}

}  // namespace
