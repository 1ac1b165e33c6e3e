// Unit tests of the device tables: the H200 call-cost model and the DriverCall names.
// Pure functions; no shared state.
#include "device/sim_cost_model.h"

#include <cmath>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

TEST(SimCostModelTest, MeasuredPointsAreExact) {
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMalloc, 2 * kMiB), 30.1);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMalloc, 20 * kMiB), 31.2);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kFree, 256 * kMiB), 98.3);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMemRelease, kGiB), 296.6);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMemSetAccess, 2 * kMiB), 22.7);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMemUnmap, 20 * kMiB), 13.8);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMemCreate, kGiB), 17.1);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMemMap, 256 * kMiB), 0.6);
}

TEST(SimCostModelTest, InterpolatesLinearlyInLogSize) {
  // The geometric mean of two table sizes lies halfway in log(size).
  const auto mid = static_cast<std::size_t>(std::llround(std::sqrt(2.0 * 20.0) * kMiB));
  EXPECT_NEAR(ModelledCallMicros(DriverCall::kMalloc, mid), (30.1 + 31.2) / 2, 1e-4);
  const auto mid_high = static_cast<std::size_t>(std::llround(std::sqrt(256.0 * 1024.0) * kMiB));
  EXPECT_NEAR(ModelledCallMicros(DriverCall::kMemRelease, mid_high), (72.0 + 296.6) / 2, 1e-4);
  // Monotone between points where the measurements are.
  EXPECT_LT(ModelledCallMicros(DriverCall::kFree, 100 * kMiB),
            ModelledCallMicros(DriverCall::kFree, 200 * kMiB));
}

TEST(SimCostModelTest, ClampsOutsideTheTable) {
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMalloc, 512), 30.1);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMalloc, 0), 30.1);
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kMalloc, 64 * kGiB), 117.8);
}

TEST(SimCostModelTest, EveryCallHasAPositiveCost) {
  int measured = 0;
  for (int i = 0; i < kNumDriverCalls; ++i) {
    const auto call = static_cast<DriverCall>(i);
    EXPECT_GT(ModelledCallMicros(call, 2 * kMiB), 0.0) << DriverCallName(call);
    if (IsCallCostMeasured(call)) ++measured;
  }
  EXPECT_EQ(measured, 7);  // cudaMalloc, cudaFree and five VMM calls.
  EXPECT_FALSE(IsCallCostMeasured(DriverCall::kEventRecord));
  EXPECT_DOUBLE_EQ(ModelledCallMicros(DriverCall::kEventRecord, kGiB),
                   ModelledCallMicros(DriverCall::kEventRecord, 0));
}

TEST(DriverCallNameTest, NamesAreTheCudaSpellingsAndDistinct) {
  EXPECT_EQ(DriverCallName(DriverCall::kMalloc), "cudaMalloc");
  EXPECT_EQ(DriverCallName(DriverCall::kMemMap), "cuMemMap");
  EXPECT_EQ(DriverCallName(DriverCall::kEventCreate), "cudaEventCreateWithFlags");
  EXPECT_EQ(DriverCallName(DriverCall::kMemGetInfo), "cudaMemGetInfo");
  std::set<std::string> names;
  for (int i = 0; i < kNumDriverCalls; ++i) {
    const std::string name(DriverCallName(static_cast<DriverCall>(i)));
    EXPECT_NE(name, "unknown");
    names.insert(name);
  }
  EXPECT_EQ(names.size(), static_cast<std::size_t>(kNumDriverCalls));
  EXPECT_EQ(DriverCallName(DriverCall::kCount), "unknown");
}

}  // namespace
}  // namespace vramledger
