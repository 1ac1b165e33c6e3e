// Pausable regions in the ledger's reports (ledger/region_report.h): the JSON of one region, the
// flat memory_stats keys and the summary lines, from plain RegionInfo values.
#include "ledger/region_report.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace vramledger {
namespace {

using ::testing::ElementsAre;

constexpr std::size_t kMiB = std::size_t{1} << 20;

RegionInfo Paused() {
  RegionInfo r;
  r.name = "train";
  r.pool = {7, 3};
  r.paused = true;
  r.reserved_bytes = 64 * kMiB;
  r.mapped_bytes = 0;
  r.allocated_bytes = 40 * kMiB;
  r.paused_bytes = 64 * kMiB;
  r.backed_up_bytes = 40 * kMiB;
  r.host_buffer_bytes = 0;
  return r;
}

RegionInfo Running() {
  RegionInfo r;
  r.name = "roll.out";  // a dot in the name: the figure is the key's last part
  r.pool = {9, 1};
  r.reserved_bytes = 20 * kMiB;
  r.mapped_bytes = 20 * kMiB;
  r.allocated_bytes = 6 * kMiB;
  r.host_buffer_bytes = 2 * kMiB;
  r.lost_bytes = 2 * kMiB;  // a failed pause lost a page under a live block
  return r;
}

TEST(RegionReportTest, JsonHasEveryFigureAndTheRegionsIdentity) {
  const nlohmann::json j = RegionJson(1, Paused());
  EXPECT_EQ(j["device"], 1);
  EXPECT_EQ(j["name"], "train");
  EXPECT_EQ(j["pool"], nlohmann::json::array({7, 3}));
  EXPECT_EQ(j["paused"], true);
  EXPECT_EQ(j["reserved_bytes"], 64 * kMiB);
  EXPECT_EQ(j["mapped_bytes"], 0);
  EXPECT_EQ(j["allocated_bytes"], 40 * kMiB);
  EXPECT_EQ(j["paused_bytes"], 64 * kMiB);
  EXPECT_EQ(j["backed_up_bytes"], 40 * kMiB);
  EXPECT_EQ(j["host_buffer_bytes"], 0);
  EXPECT_EQ(j["lost_bytes"], 0);
  EXPECT_EQ(j.size(), 11u);
}

TEST(RegionReportTest, FlatKeysPerRegionInOrder) {
  const auto flat = FlattenRegionStats({Paused(), Running()});
  ASSERT_EQ(flat.size(), 16u);  // seven figures and "paused" per region
  std::map<std::string, std::int64_t> by_key(flat.begin(), flat.end());
  EXPECT_EQ(flat.front().first, "regions.train.reserved_bytes");
  EXPECT_EQ(by_key["regions.train.paused"], 1);
  EXPECT_EQ(by_key["regions.train.backed_up_bytes"], static_cast<std::int64_t>(40 * kMiB));
  EXPECT_EQ(by_key["regions.roll.out.paused"], 0);
  EXPECT_EQ(by_key["regions.roll.out.mapped_bytes"], static_cast<std::int64_t>(20 * kMiB));
  EXPECT_EQ(by_key["regions.roll.out.host_buffer_bytes"], static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(by_key["regions.roll.out.lost_bytes"], static_cast<std::int64_t>(2 * kMiB));
  EXPECT_TRUE(FlattenRegionStats({}).empty());
}

TEST(RegionReportTest, OneLinePerRegionWithTorchsSizes) {
  EXPECT_THAT(RegionLines({Paused(), Running()}),
              ElementsAre("region train: paused, reserved 64.00 MiB, mapped 0 bytes, allocated "
                          "40.00 MiB, paused 64.00 MiB, backed up 40.00 MiB",
                          "region roll.out: running, reserved 20.00 MiB, mapped 20.00 MiB, "
                          "allocated 6.00 MiB, paused 0 bytes, backed up 0 bytes, lost 2.00 MiB "
                          "(unmapped under live blocks until the next pause and resume)"));
  EXPECT_TRUE(RegionLines({}).empty());
}

}  // namespace
}  // namespace vramledger
