// SimBackend beyond the DeviceBackend contract (backend_conformance.h): its address space,
// capacity, VMM rule messages, events completed by the test or a clock, capture accounting and
// modelled call costs. Each test owns its backend.
#include "device/sim_backend.h"

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kGran = 2 * kMiB;
constexpr StreamId kStream1 = 0x1000;
constexpr StreamId kStream2 = 0x2000;

// True if [a, a + a_size) and [b, b + b_size) share a byte.
bool Overlaps(DevicePtr a, std::size_t a_size, DevicePtr b, std::size_t b_size) {
  return a < b + b_size && b < a + a_size;
}

// Inserts [ptr, ptr + size) into `live`; fails the test if it overlaps a range already there.
void InsertChecked(std::map<DevicePtr, std::size_t>& live, DevicePtr ptr, std::size_t size) {
  auto next = live.lower_bound(ptr);
  if (next != live.end()) {
    ASSERT_FALSE(Overlaps(ptr, size, next->first, next->second));
  }
  if (next != live.begin()) {
    auto prev = std::prev(next);
    ASSERT_FALSE(Overlaps(ptr, size, prev->first, prev->second));
  }
  live.emplace(ptr, size);
}

TEST(SimBackendTest, IsADeviceBackendWithH200Defaults) {
  std::unique_ptr<DeviceBackend> backend = std::make_unique<SimBackend>();
  EXPECT_EQ(backend->device(), 0);
  EXPECT_EQ(backend->Granularity(), kGran);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  ASSERT_TRUE(backend->MemGetInfo(&free_bytes, &total_bytes).ok());
  EXPECT_EQ(total_bytes, std::size_t{150109880320});
  EXPECT_EQ(free_bytes, std::size_t{150109880320});
}

// event_lag_us: an event completes once the clock has passed its record time by the lag, in
// stream order; a synchronize still completes it at once.
TEST(SimBackendTest, EventsCompleteAfterTheLagOnTheClock) {
  SimBackend::Config config;
  config.event_lag_us = 100;
  SimBackend sim(config);
  EventId a = 0, b = 0;
  ASSERT_TRUE(sim.CreateEvent(&a).ok());
  ASSERT_TRUE(sim.CreateEvent(&b).ok());
  sim.AdvanceClock(1000);
  ASSERT_TRUE(sim.RecordEvent(a, 0).ok());
  sim.AdvanceClock(1050);
  ASSERT_TRUE(sim.RecordEvent(b, 0).ok());
  sim.AdvanceClock(1099);
  EXPECT_FALSE(*sim.QueryEvent(a));
  sim.AdvanceClock(1100);
  EXPECT_TRUE(*sim.QueryEvent(a));
  EXPECT_FALSE(*sim.QueryEvent(b));
  sim.AdvanceClock(900);  // the clock never goes back
  EXPECT_FALSE(*sim.QueryEvent(b));
  ASSERT_TRUE(sim.SynchronizeEvent(b).ok());
  EXPECT_TRUE(*sim.QueryEvent(b));
  sim.AdvanceClock(5000);  // its stale record is dropped without effect
  EXPECT_TRUE(*sim.QueryEvent(b));
}

// A lag near INT64_MAX at epoch-microsecond times (the bundled traces start at ~1.8e15 us) must
// not overflow `recorded + lag`, which would complete every event at once.
TEST(SimBackendTest, AHugeLagNeverCompletesAnEventEarly) {
  SimBackend::Config config;
  config.event_lag_us = std::numeric_limits<std::int64_t>::max();
  SimBackend sim(config);
  EventId a = 0;
  ASSERT_TRUE(sim.CreateEvent(&a).ok());
  constexpr std::int64_t kEpochUs = 1'795'946'953'879'164;
  sim.AdvanceClock(kEpochUs);
  ASSERT_TRUE(sim.RecordEvent(a, 0).ok());
  sim.AdvanceClock(kEpochUs + 6'720'000);
  EXPECT_FALSE(*sim.QueryEvent(a));
  ASSERT_TRUE(sim.SynchronizeEvent(a).ok());
  EXPECT_TRUE(*sim.QueryEvent(a));
}

TEST(SimBackendTest, AddressesNeverOverlapAndAreAligned) {
  SimBackend sim;
  std::mt19937_64 rng(42);
  std::map<DevicePtr, std::size_t> live;          // All live ranges, malloc and reservations.
  std::vector<std::pair<DevicePtr, bool>> order;  // (address, is_reservation)
  for (int i = 0; i < 2000; ++i) {
    if (!order.empty() && rng() % 3 == 0) {
      const std::size_t pick = rng() % order.size();
      const auto [ptr, is_reservation] = order[pick];
      if (is_reservation) {
        ASSERT_TRUE(sim.ReleaseAddress(ptr, live.at(ptr)).ok());
      } else {
        ASSERT_TRUE(sim.Free(ptr).ok());
      }
      live.erase(ptr);
      order.erase(order.begin() + static_cast<std::ptrdiff_t>(pick));
      continue;
    }
    DevicePtr ptr = 0;
    if (rng() % 4 == 0) {
      const std::size_t size = (1 + rng() % 8) * kGran;
      ASSERT_TRUE(sim.ReserveAddress(size, &ptr).ok());
      EXPECT_EQ(ptr % kGran, 0u);
      ASSERT_NO_FATAL_FAILURE(InsertChecked(live, ptr, size));
      order.emplace_back(ptr, true);
    } else {
      const std::size_t size = 1 + rng() % (5 * kMiB);
      ASSERT_TRUE(sim.Malloc(size, &ptr).ok());
      EXPECT_EQ(ptr % 512, 0u);
      if (size >= kGran) {
        EXPECT_EQ(ptr % kGran, 0u);
      }
      EXPECT_GE(ptr, DevicePtr{0x7f0000000000});
      ASSERT_NO_FATAL_FAILURE(InsertChecked(live, ptr, size));
      order.emplace_back(ptr, false);
    }
  }
}

TEST(SimBackendTest, FreedAddressIsReusedLowestFirst) {
  SimBackend sim;
  DevicePtr a = 0, b = 0, c = 0;
  ASSERT_TRUE(sim.Malloc(kGran, &a).ok());
  ASSERT_TRUE(sim.Malloc(kGran, &b).ok());
  EXPECT_EQ(b, a + kGran);
  ASSERT_TRUE(sim.Free(a).ok());
  ASSERT_TRUE(sim.Malloc(kGran, &c).ok());
  EXPECT_EQ(c, a);
}

TEST(SimBackendTest, CapacityExhaustionLeavesUsageUnchanged) {
  SimBackend sim(SimBackend::Config{.capacity = 10 * kMiB});
  DevicePtr ptr = 0;
  ASSERT_TRUE(sim.Malloc(8 * kMiB, &ptr).ok());
  EXPECT_EQ(sim.used_bytes(), 8 * kMiB);

  DevicePtr other = 0;
  absl::Status status = sim.Malloc(4 * kMiB, &other);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("out of memory"));
  EXPECT_EQ(other, 0u);
  EXPECT_EQ(sim.used_bytes(), 8 * kMiB);

  PhysicalHandle handle = 0;
  status = sim.CreatePhysical(4 * kMiB, &handle);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_EQ(sim.used_bytes(), 8 * kMiB);
  EXPECT_EQ(sim.live_allocations(), 1);

  ASSERT_TRUE(sim.CreatePhysical(2 * kMiB, &handle).ok());  // Exactly fills the device.
  std::size_t free_bytes = 1, total_bytes = 0;
  ASSERT_TRUE(sim.MemGetInfo(&free_bytes, &total_bytes).ok());
  EXPECT_EQ(free_bytes, 0u);
  EXPECT_EQ(total_bytes, 10 * kMiB);
  EXPECT_TRUE(absl::IsResourceExhausted(sim.Malloc(1, &other)));

  ASSERT_TRUE(sim.Free(ptr).ok());
  ASSERT_TRUE(sim.ReleasePhysical(handle).ok());
  EXPECT_EQ(sim.used_bytes(), 0u);
  EXPECT_EQ(sim.live_allocations(), 0);
}

TEST(SimBackendTest, SetCapacityBelowUsageRefusesGrowth) {
  SimBackend sim(SimBackend::Config{.capacity = 10 * kMiB});
  DevicePtr ptr = 0;
  ASSERT_TRUE(sim.Malloc(6 * kMiB, &ptr).ok());
  sim.SetCapacity(4 * kMiB);
  std::size_t free_bytes = 1, total_bytes = 0;
  ASSERT_TRUE(sim.MemGetInfo(&free_bytes, &total_bytes).ok());
  EXPECT_EQ(free_bytes, 0u);
  EXPECT_EQ(total_bytes, 4 * kMiB);
  DevicePtr other = 0;
  EXPECT_TRUE(absl::IsResourceExhausted(sim.Malloc(512, &other)));
  ASSERT_TRUE(sim.Free(ptr).ok());
  EXPECT_TRUE(sim.Malloc(4 * kMiB, &other).ok());
}

TEST(SimBackendTest, MallocRoundsUsageTo512Bytes) {
  SimBackend sim;
  DevicePtr ptr = 0;
  ASSERT_TRUE(sim.Malloc(1000, &ptr).ok());
  EXPECT_EQ(sim.used_bytes(), 1024u);
}

TEST(SimBackendTest, MisuseOfMallocAndFree) {
  SimBackend sim;
  DevicePtr ptr = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(sim.Malloc(0, &ptr)));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.Malloc(512, nullptr)));
  absl::Status status = sim.Free(0x1234);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("not a live cudaMalloc address"));
  ASSERT_TRUE(sim.Malloc(512, &ptr).ok());
  ASSERT_TRUE(sim.Free(ptr).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(sim.Free(ptr)));  // Double free.
  EXPECT_EQ(sim.used_bytes(), 0u);
}

TEST(SimBackendTest, VmmHappyPath) {
  SimBackend sim;
  DevicePtr va = 0;
  ASSERT_TRUE(sim.ReserveAddress(8 * kGran, &va).ok());
  PhysicalHandle h1 = 0, h2 = 0;
  ASSERT_TRUE(sim.CreatePhysical(kGran, &h1).ok());
  ASSERT_TRUE(sim.CreatePhysical(2 * kGran, &h2).ok());
  EXPECT_NE(h1, h2);
  EXPECT_EQ(sim.used_bytes(), 3 * kGran);
  EXPECT_EQ(sim.mapped_bytes(), 0u);

  ASSERT_TRUE(sim.Map(va, kGran, h1).ok());
  ASSERT_TRUE(sim.Map(va + kGran, 2 * kGran, h2).ok());
  EXPECT_EQ(sim.mapped_bytes(), 3 * kGran);
  EXPECT_FALSE(sim.IsAccessible(va, kGran));
  ASSERT_TRUE(sim.SetAccess(va, 3 * kGran).ok());  // One call over two mappings.
  EXPECT_TRUE(sim.IsAccessible(va, 3 * kGran));
  EXPECT_TRUE(sim.IsAccessible(va + 512, 100));
  EXPECT_FALSE(sim.IsAccessible(va, 4 * kGran));

  ASSERT_TRUE(sim.Unmap(va, 3 * kGran).ok());
  EXPECT_EQ(sim.mapped_bytes(), 0u);
  EXPECT_FALSE(sim.IsAccessible(va, kGran));
  // Unmapped handles can be mapped again elsewhere (page recycling), then released.
  ASSERT_TRUE(sim.Map(va + 4 * kGran, kGran, h1).ok());
  ASSERT_TRUE(sim.Unmap(va + 4 * kGran, kGran).ok());
  ASSERT_TRUE(sim.ReleasePhysical(h1).ok());
  ASSERT_TRUE(sim.ReleasePhysical(h2).ok());
  ASSERT_TRUE(sim.ReleaseAddress(va, 8 * kGran).ok());
  EXPECT_EQ(sim.used_bytes(), 0u);
  EXPECT_EQ(sim.live_allocations(), 0);
  EXPECT_EQ(sim.live_reservations(), 0);
}

TEST(SimBackendTest, GranularityAndMappingRulesAreEnforced) {
  SimBackend sim;
  DevicePtr va = 0;
  PhysicalHandle h = 0, h2 = 0;

  absl::Status status = sim.ReserveAddress(3 * kMiB, &va);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("cuMemAddressReserve: size 0x300000 is not a positive "
                                          "multiple of the granularity 2097152"));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.ReserveAddress(0, &va)));
  status = sim.CreatePhysical(kMiB, &h);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("cuMemCreate: size"));
  EXPECT_EQ(sim.used_bytes(), 0u);

  ASSERT_TRUE(sim.ReserveAddress(4 * kGran, &va).ok());
  ASSERT_TRUE(sim.CreatePhysical(kGran, &h).ok());
  ASSERT_TRUE(sim.CreatePhysical(kGran, &h2).ok());

  status = sim.Map(va + kMiB, kGran, h);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("cuMemMap: address"));
  status = sim.Map(va, 2 * kGran, h);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("the whole handle is mapped"));
  status = sim.Map(va + 4 * kGran, kGran, h);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("not inside one reservation"));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.Map(va, kGran, 0xdead)));

  ASSERT_TRUE(sim.Map(va, kGran, h).ok());
  status = sim.Map(va, kGran, h2);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("overlaps the mapping"));

  status = sim.Unmap(va + kGran, kGran);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("no mapping begins at"));
  status = sim.Unmap(va, 2 * kGran);  // Runs past the only mapping.
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("not a run of whole contiguous mappings"));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.Unmap(va, kMiB)));
  EXPECT_TRUE(absl::IsFailedPrecondition(sim.SetAccess(va + 2 * kGran, kGran)));

  status = sim.ReleasePhysical(h);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("still mapped"));
  status = sim.ReleaseAddress(va, 4 * kGran);
  EXPECT_TRUE(absl::IsFailedPrecondition(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("still has a mapping"));
  status = sim.ReleaseAddress(va, 2 * kGran);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("does not match the reservation"));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.ReleaseAddress(va + kGran, kGran)));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.ReleasePhysical(0xdead)));

  // Nothing above changed the state: the one mapping is intact.
  EXPECT_EQ(sim.mapped_bytes(), kGran);
  EXPECT_EQ(sim.used_bytes(), 2 * kGran);
  ASSERT_TRUE(sim.Unmap(va, kGran).ok());
  ASSERT_TRUE(sim.ReleasePhysical(h).ok());
  ASSERT_TRUE(sim.ReleasePhysical(h2).ok());
  ASSERT_TRUE(sim.ReleaseAddress(va, 4 * kGran).ok());
}

// Returns QueryEvent's value, failing the test on an error.
bool Done(SimBackend& sim, EventId event) {
  absl::StatusOr<bool> done = sim.QueryEvent(event);
  EXPECT_TRUE(done.ok()) << done.status();
  return done.ok() && *done;
}

TEST(SimBackendTest, EventsCompleteOnlyWhenTold) {
  SimBackend sim;
  EventId e1 = 0, e2 = 0, e3 = 0;
  ASSERT_TRUE(sim.CreateEvent(&e1).ok());
  ASSERT_TRUE(sim.CreateEvent(&e2).ok());
  ASSERT_TRUE(sim.CreateEvent(&e3).ok());
  EXPECT_EQ(sim.live_events(), 3);
  EXPECT_TRUE(Done(sim, e1));  // Never recorded: complete, as cudaEventQuery says.

  ASSERT_TRUE(sim.RecordEvent(e1, kStream1).ok());
  ASSERT_TRUE(sim.RecordEvent(e2, kStream1).ok());
  ASSERT_TRUE(sim.RecordEvent(e3, kStream2).ok());
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(Done(sim, e1));
  EXPECT_FALSE(Done(sim, e2));

  ASSERT_TRUE(sim.CompleteEvent(e1).ok());
  EXPECT_TRUE(Done(sim, e1));
  EXPECT_FALSE(Done(sim, e2));  // Later on the same stream.
  ASSERT_TRUE(sim.CompleteEvent(e2).ok());
  EXPECT_TRUE(Done(sim, e2));
  EXPECT_FALSE(Done(sim, e3));  // Other stream.

  // Re-recording makes an event pending again; completing a later one completes it (in order).
  ASSERT_TRUE(sim.RecordEvent(e1, kStream1).ok());
  ASSERT_TRUE(sim.RecordEvent(e2, kStream1).ok());
  EXPECT_FALSE(Done(sim, e1));
  ASSERT_TRUE(sim.CompleteEvent(e2).ok());
  EXPECT_TRUE(Done(sim, e1));
  EXPECT_TRUE(Done(sim, e2));

  EXPECT_TRUE(absl::IsInvalidArgument(sim.CompleteEvent(0x42)));
  ASSERT_TRUE(sim.DestroyEvent(e1).ok());
  EXPECT_EQ(sim.live_events(), 2);
  EXPECT_TRUE(absl::IsInvalidArgument(sim.QueryEvent(e1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.RecordEvent(e1, kStream1)));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.DestroyEvent(e1)));
}

TEST(SimBackendTest, CompleteStreamCoversOnlyEarlierRecordsOnThatStream) {
  SimBackend sim;
  EventId a = 0, b = 0, c = 0;
  ASSERT_TRUE(sim.CreateEvent(&a).ok());
  ASSERT_TRUE(sim.CreateEvent(&b).ok());
  ASSERT_TRUE(sim.CreateEvent(&c).ok());
  ASSERT_TRUE(sim.RecordEvent(a, kStream1).ok());
  ASSERT_TRUE(sim.RecordEvent(b, kStream2).ok());
  sim.CompleteStream(kStream1);
  EXPECT_TRUE(Done(sim, a));
  EXPECT_FALSE(Done(sim, b));
  ASSERT_TRUE(sim.RecordEvent(c, kStream1).ok());  // After the completion.
  EXPECT_FALSE(Done(sim, c));
  sim.CompleteAllEvents();
  EXPECT_TRUE(Done(sim, b));
  EXPECT_TRUE(Done(sim, c));
}

TEST(SimBackendTest, SynchronizeCompletesEvents) {
  SimBackend sim;
  EventId a = 0, b = 0, c = 0;
  ASSERT_TRUE(sim.CreateEvent(&a).ok());
  ASSERT_TRUE(sim.CreateEvent(&b).ok());
  ASSERT_TRUE(sim.CreateEvent(&c).ok());
  ASSERT_TRUE(sim.RecordEvent(a, kStream1).ok());
  ASSERT_TRUE(sim.RecordEvent(b, kStream2).ok());
  ASSERT_TRUE(sim.RecordEvent(c, kStream2).ok());
  ASSERT_TRUE(sim.SynchronizeEvent(a).ok());
  EXPECT_TRUE(Done(sim, a));
  EXPECT_FALSE(Done(sim, b));
  ASSERT_TRUE(sim.SynchronizeStream(kStream2).ok());
  EXPECT_TRUE(Done(sim, b));
  EXPECT_TRUE(Done(sim, c));
  EXPECT_TRUE(absl::IsInvalidArgument(sim.SynchronizeEvent(0x42)));
}

TEST(SimBackendTest, AutoCompleteModeCompletesOnRecord) {
  SimBackend sim(SimBackend::Config{.auto_complete_events = true});
  EventId e = 0;
  ASSERT_TRUE(sim.CreateEvent(&e).ok());
  ASSERT_TRUE(sim.RecordEvent(e, kStream1).ok());
  EXPECT_TRUE(Done(sim, e));
}

TEST(SimBackendTest, LedgerCountsCallsWithModelledCosts) {
  SimBackend sim;
  DevicePtr ptr = 0;
  ASSERT_TRUE(sim.Malloc(2 * kMiB, &ptr).ok());
  EXPECT_EQ(sim.calls().count(DriverCall::kMalloc), 1);
  EXPECT_NEAR(sim.calls().micros(DriverCall::kMalloc), 30.1, 1e-3);
  ASSERT_TRUE(sim.Free(ptr).ok());
  EXPECT_NEAR(sim.calls().micros(DriverCall::kFree), 26.1, 1e-3);
  ASSERT_TRUE(sim.Malloc(kGiB, &ptr).ok());  // Measured point.
  ASSERT_TRUE(sim.Free(ptr).ok());
  ASSERT_TRUE(sim.Malloc(512, &ptr).ok());  // Below the table: clamped to 2 MiB's figure.
  EXPECT_EQ(sim.calls().count(DriverCall::kMalloc), 3);
  EXPECT_NEAR(sim.calls().micros(DriverCall::kMalloc), 30.1 + 117.8 + 30.1, 1e-3);
  EXPECT_NEAR(sim.calls().micros(DriverCall::kFree), 26.1 + 298.4, 1e-3);

  // One expandable-segment growth by two pages and its release.
  sim.mutable_calls().Reset();
  DevicePtr va = 0;
  PhysicalHandle h1 = 0, h2 = 0;
  ASSERT_TRUE(sim.ReserveAddress(4 * kGran, &va).ok());
  ASSERT_TRUE(sim.CreatePhysical(kGran, &h1).ok());
  ASSERT_TRUE(sim.CreatePhysical(kGran, &h2).ok());
  ASSERT_TRUE(sim.Map(va, kGran, h1).ok());
  ASSERT_TRUE(sim.Map(va + kGran, kGran, h2).ok());
  ASSERT_TRUE(sim.SetAccess(va, 2 * kGran).ok());
  ASSERT_TRUE(sim.Unmap(va, 2 * kGran).ok());
  ASSERT_TRUE(sim.ReleasePhysical(h1).ok());
  ASSERT_TRUE(sim.ReleasePhysical(h2).ok());
  ASSERT_TRUE(sim.ReleaseAddress(va, 4 * kGran).ok());
  const DriverCallLedger& calls = sim.calls();
  EXPECT_EQ(calls.count(DriverCall::kMemCreate), 2);
  EXPECT_EQ(calls.count(DriverCall::kMemMap), 2);
  EXPECT_EQ(calls.count(DriverCall::kMemSetAccess), 1);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 1);
  EXPECT_EQ(calls.count(DriverCall::kMemRelease), 2);
  EXPECT_NEAR(calls.micros(DriverCall::kMemCreate), 2 * 7.9, 1e-3);
  EXPECT_NEAR(calls.micros(DriverCall::kMemMap), 2 * 0.6, 1e-3);
  EXPECT_NEAR(calls.micros(DriverCall::kMemSetAccess), 2 * 22.7, 1e-3);  // Per mapping covered.
  EXPECT_NEAR(calls.micros(DriverCall::kMemUnmap), 2 * 14.2, 1e-3);
  EXPECT_NEAR(calls.micros(DriverCall::kMemRelease), 2 * 9.2, 1e-3);
  EXPECT_NEAR(calls.micros(DriverCall::kAddressReserve), 1.6, 1e-3);  // Estimates.
  EXPECT_NEAR(calls.micros(DriverCall::kAddressFree), 1.7, 1e-3);
  EXPECT_NEAR(calls.total_micros(), 15.8 + 1.2 + 45.4 + 28.4 + 18.4 + 3.3, 1e-3);

  // Failed calls are made, so they are counted too.
  sim.mutable_calls().Reset();
  EXPECT_FALSE(sim.Free(0x1234).ok());
  EXPECT_EQ(sim.calls().count(DriverCall::kFree), 1);
}

TEST(SimBackendTest, CountsCallsDuringCaptureByRelaxedMode) {
  SimBackend sim;
  DevicePtr ptr = 0;
  ASSERT_TRUE(sim.Malloc(kGran, &ptr).ok());  // No capture yet: not counted.
  EXPECT_EQ(sim.calls_during_capture_not_relaxed(), 0);
  EXPECT_EQ(sim.calls_during_capture_relaxed(), 0);

  sim.SetCapturing(kStream1, true);
  EXPECT_TRUE(sim.IsCapturing(kStream1));
  EXPECT_FALSE(sim.IsCapturing(kStream2));
  ASSERT_TRUE(sim.Free(ptr).ok());  // Unwrapped: what the allocator must never do.
  EXPECT_EQ(sim.calls_during_capture_not_relaxed(), 1);
  {
    RelaxedCaptureScope outer(&sim);
    ASSERT_TRUE(sim.Malloc(kGran, &ptr).ok());
    {
      RelaxedCaptureScope inner(&sim);
      ASSERT_TRUE(sim.Free(ptr).ok());
    }
    ASSERT_TRUE(sim.Malloc(kGran, &ptr).ok());  // Still relaxed after the inner scope.
    // Another thread's mode is its own.
    std::thread other([&] { ASSERT_TRUE(sim.Free(ptr).ok()); });
    other.join();
  }
  EXPECT_EQ(sim.calls_during_capture_relaxed(), 3);
  EXPECT_EQ(sim.calls_during_capture_not_relaxed(), 2);
  std::size_t free_bytes = 0, total_bytes = 0;
  ASSERT_TRUE(sim.MemGetInfo(&free_bytes, &total_bytes).ok());  // Back to global mode.
  EXPECT_EQ(sim.calls_during_capture_not_relaxed(), 3);

  sim.SetCapturing(kStream1, false);
  EXPECT_FALSE(sim.IsCapturing(kStream1));
  ASSERT_TRUE(sim.MemGetInfo(&free_bytes, &total_bytes).ok());
  EXPECT_EQ(sim.calls_during_capture_not_relaxed(), 3);
  EXPECT_EQ(sim.calls_during_capture_relaxed(), 3);
}

}  // namespace
}  // namespace vramledger
