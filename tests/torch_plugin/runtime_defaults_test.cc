// The runtime's default policy against what a device can do: expandable segments that only the
// defaults asked for become plain segments on a device without driver VMM, with one line saying
// why; an explicit request is kept.
#include <gtest/gtest.h>

#include <string>

#include "absl/status/status.h"
#include "torch_plugin/runtime/device_table.h"
#include "vramledger/options.h"

namespace vramledger {
namespace {

Options Served(const std::string& conf) {
  auto o = OptionsFromEnvAndString(conf, RuntimeDefaults());
  EXPECT_TRUE(o.ok()) << o.status();
  return *o;
}

TEST(RuntimeDefaults, DeviceWithVirtualMemoryKeepsExpandableSegments) {
  std::string warning = "stale";
  const Options o = WithinBackendLimits(Served(""), absl::OkStatus(), &warning);
  EXPECT_TRUE(o.expandable_segments);
  EXPECT_EQ(warning, "");
}

TEST(RuntimeDefaults, DeviceWithoutVirtualMemoryFallsBackToPlainSegmentsSayingWhy) {
  std::string warning;
  const Options o = WithinBackendLimits(
      Served("max_split_size_mb:200"),
      absl::UnavailableError("cuMemGetAllocationGranularity: not supported"), &warning);
  EXPECT_FALSE(o.expandable_segments);
  EXPECT_EQ(o.max_split_size, std::size_t{200} << 20);  // the rest is kept
  EXPECT_EQ(warning,
            "vramledger: expandable segments (the default) are not supported here "
            "(cuMemGetAllocationGranularity: not supported); this device uses plain segments "
            "(torch's policy)");
}

TEST(RuntimeDefaults, AnExplicitRequestIsKeptEvenWithoutVirtualMemory) {
  std::string warning;
  const Options o = WithinBackendLimits(Served("expandable_segments:True"),
                                        absl::UnavailableError("no VMM"), &warning);
  EXPECT_TRUE(o.expandable_segments);  // its first allocation reports the driver's error
  EXPECT_EQ(warning, "");
  const Options plain =
      WithinBackendLimits(Served("expandable_segments:False"), absl::OkStatus(), &warning);
  EXPECT_FALSE(plain.expandable_segments);
}

}  // namespace
}  // namespace vramledger
