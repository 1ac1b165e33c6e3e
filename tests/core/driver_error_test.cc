// Driver errors at every call of every kind (SimBackend::FailCall), in the middle of a churn of
// expandable-segment allocations with page moves, old mappings, record_stream and
// empty_cache: the failing call's operation returns an error, nothing crashes, the books stay
// exact after every operation (CheckInvariants; reserved == mapped - aliased), and once the
// workload ends nothing leaks (no handle, mapping, reservation or event left on the device).
#include <cctype>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "ledger/device_report.h"
#include "sim_allocator_fixture.h"
#include "sim_forwarding_backend.h"

namespace vramledger {
namespace {

constexpr StreamId kS1 = 0x33;

class ChurnTest : public SimAllocatorTest {
 protected:
  // Runs `ops` random operations (a failure injected beforehand); returns how many operations
  // reported the injected error. `expandable`: every block must lie on accessible mapped pages.
  // `arm_every` > 0: before every arm_every-th operation one more failure is armed, of a random
  // kind, due within the next three calls of that kind (failures in a row: a sick driver).
  int Churn(int ops, std::uint64_t seed, bool expandable, int arm_every = 0) {
    std::mt19937_64 rng(seed);
    std::vector<std::pair<DevicePtr, StreamId>> live;
    int injected_seen = 0;
    for (int op = 0; op < ops; ++op) {
      if (arm_every > 0 && op % arm_every == 0) {
        sim_->FailCall(static_cast<DriverCall>(rng() % kNumDriverCalls),
                       static_cast<int>(rng() % 3), absl::InternalError("injected driver error"));
      }
      const int what = static_cast<int>(rng() % 100);
      absl::Status status;
      if (what < 50 || live.empty()) {
        const std::size_t size = 1 + static_cast<std::size_t>(std::exp2((rng() % 2700) / 100.0));
        const StreamId s = rng() % 4 == 0 ? kS1 : 0;
        auto p = alloc_->Malloc(size, s);
        if (p.ok()) {
          // Every byte handed out is mapped with access (a page whose SetAccess failed must
          // never hold a block).
          EXPECT_TRUE(!expandable || sim_->IsAccessible(*p, size)) << "op " << op;
          live.emplace_back(*p, s);
          if (rng() % 8 == 0) status = alloc_->RecordStream(*p, s == 0 ? kS1 : 0);
        } else {
          status = p.status();
        }
      } else if (what < 96) {
        const std::size_t i = rng() % live.size();
        status = alloc_->Free(live[i].first);
        live[i] = live.back();
        live.pop_back();
      } else if (what < 99) {
        sim_->CompleteStream(rng() % 2 == 0 ? 0 : kS1);  // the GPU catches up with one stream
      } else {
        status = alloc_->EmptyCache();
      }
      if (!status.ok()) {
        // Only the injected error or out of memory; never anything else.
        EXPECT_TRUE(status.code() == absl::StatusCode::kInternal ||
                    status.code() == absl::StatusCode::kResourceExhausted)
            << "op " << op << ": " << status;
        if (status.code() == absl::StatusCode::kInternal) ++injected_seen;
      }
      const absl::Status inv = alloc_->CheckInvariants();
      if (!inv.ok()) {
        ADD_FAILURE() << "op " << op << ": " << inv;
        break;
      }
      std::size_t plain = 0;
      for (const auto& seg : SegmentsOf(*alloc_)) plain += seg.is_expandable ? 0 : seg.total_size;
      if (static_cast<std::size_t>(Reserved()) !=
          sim_->mapped_bytes() - sim_->aliased_bytes() + plain) {
        ADD_FAILURE() << "op " << op << ": reserved " << Reserved() << " != mapped "
                      << sim_->mapped_bytes() << " - aliased " << sim_->aliased_bytes()
                      << " + plain " << plain;
        break;
      }
    }
    if (arm_every > 0) Disarm();  // the driver is well again: the clean-up below must work
    for (const auto& [p, s] : live) EXPECT_TRUE(alloc_->Free(p).ok());
    return injected_seen;
  }
  void Disarm() {
    for (int k = 0; k < kNumDriverCalls; ++k) {
      sim_->FailCall(static_cast<DriverCall>(k), 1 << 30, absl::InternalError("never"));
    }
  }
};

class DriverErrorTest : public ChurnTest,
                        public ::testing::WithParamInterface<std::pair<DriverCall, std::string>> {};

TEST_P(DriverErrorTest, BooksStayExactAndNothingLeaks) {
  const auto& [call, conf] = GetParam();
  int failures = 0;
  for (int skip : {0, 1, 3, 7, 15, 40, 120}) {
    Make(conf, 3 * kGiB);
    sim_->FailCall(call, skip, absl::InternalError("injected driver error"));
    Churn(1500, 17 + static_cast<std::uint64_t>(skip),
          conf.find("expandable_segments:True") != std::string::npos);
    failures += static_cast<int>(sim_->injected_failures());
    // Everything freed: after the GPU caught up and the cache was emptied, the device holds
    // nothing of the allocator's but its address reservations.
    // A failure still pending may hit this empty_cache: then a second one must finish the job.
    sim_->CompleteAllEvents();
    absl::Status emptied = alloc_->EmptyCache();
    if (!emptied.ok()) {
      EXPECT_EQ(emptied.code(), absl::StatusCode::kInternal) << emptied;
      emptied = alloc_->EmptyCache();
    }
    ASSERT_TRUE(emptied.ok()) << emptied;
    Check();
    EXPECT_EQ(Reserved(), 0) << "skip " << skip;
    EXPECT_EQ(sim_->used_bytes(), 0u) << "skip " << skip << ": leaked physical memory";
    EXPECT_EQ(sim_->mapped_bytes(), 0u) << "skip " << skip;
    alloc_.reset();
    EXPECT_EQ(sim_->live_reservations(), 0) << "skip " << skip;
    EXPECT_EQ(sim_->live_events(), 0) << "skip " << skip;
  }
  // The workload reaches the failing call in most runs (some kinds are rare: a handful of calls).
  EXPECT_GT(failures, 0);
}

// Several failures in a row (driver-errors.md, "Two failures"): a failed cuMemSetAccess whose
// clean-up unmap fails too left a live block on a page without access; a moved handle whose old
// mapping could not be cleared left reserved a page under the mapped bytes. Failures of random
// kinds, one armed every 20 operations.
class RepeatedDriverErrorTest : public ChurnTest,
                                public ::testing::WithParamInterface<std::string> {};

TEST_P(RepeatedDriverErrorTest, BooksStayExactAndNoBlockLandsWithoutAccess) {
  for (std::uint64_t seed = 1; seed < 60; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    Make(GetParam(), 1 * kGiB);
    Churn(2500, seed, GetParam().find("True") != std::string::npos, /*arm_every=*/20);
    sim_->CompleteAllEvents();
    ASSERT_TRUE(alloc_->EmptyCache().ok());
    Check();
    EXPECT_EQ(Reserved(), 0) << "seed " << seed;
    EXPECT_EQ(sim_->used_bytes(), 0u) << "seed " << seed << ": leaked physical memory";
    EXPECT_EQ(sim_->mapped_bytes(), 0u) << "seed " << seed;
    // Expandable allocations are served again once the page without access is gone.
    Free(Alloc(8 * kMiB));
  }
}

// A backend whose cuMemSetAccess / cuMemUnmap fail the next N times, cuMemUnmap at one address,
// and cuMemRelease of one handle for good after a first failure (FailCall arms one failure per
// kind at a time; these tests need several in a row).
class FlakyBackend : public SimForwardingBackend {
 public:
  using SimForwardingBackend::SimForwardingBackend;
  absl::Status SetAccess(DevicePtr va, std::size_t size) override {
    if (access_failures > 0) {
      --access_failures;
      return absl::InternalError("injected cuMemSetAccess failure");
    }
    return SimForwardingBackend::SetAccess(va, size);
  }
  absl::Status Map(DevicePtr va, std::size_t size, PhysicalHandle handle) override {
    mapped_at.push_back(va);
    return SimForwardingBackend::Map(va, size, handle);
  }
  absl::Status Unmap(DevicePtr va, std::size_t size) override {
    if (unmap_failures > 0) {
      --unmap_failures;
      return absl::InternalError("injected cuMemUnmap failure");
    }
    if (va == fail_unmap_at) return absl::InternalError("injected cuMemUnmap failure at va");
    return SimForwardingBackend::Unmap(va, size);
  }
  absl::Status ReleasePhysical(PhysicalHandle handle) override {
    if (handle == stuck_handle) return absl::InternalError("injected cuMemRelease failure");
    if (release_failures > 0) {
      --release_failures;
      stuck_handle = handle;
      return absl::InternalError("injected cuMemRelease failure");
    }
    return SimForwardingBackend::ReleasePhysical(handle);
  }
  int access_failures = 0;
  int unmap_failures = 0;
  int release_failures = 0;
  DevicePtr fail_unmap_at = 0;
  PhysicalHandle stuck_handle = 0;
  std::vector<DevicePtr> mapped_at;
};

class FlakyDriverTest : public SimAllocatorTest {
 protected:
  void MakeFlaky() {
    Make("expandable_segments:True", 3 * kGiB);  // 6 MiB pages, one handle each
    flaky_ = std::make_unique<FlakyBackend>(sim_.get());
    auto options = ParseOptions("expandable_segments:True");
    ASSERT_TRUE(options.ok());
    flaky_alloc_ = std::make_unique<DeviceAllocator>(*options, flaky_.get());
  }
  void TearDown() override {
    flaky_alloc_.reset();
    SimAllocatorTest::TearDown();
  }
  std::unique_ptr<FlakyBackend> flaky_;
  std::unique_ptr<DeviceAllocator> flaky_alloc_;
};

// A failed cuMemSetAccess whose clean-up cuMemUnmap fails too: the page stays mapped, is given
// access, and serves the next request; when access fails again, expandable allocations are
// refused (a block there could not be touched) until empty_cache unmaps the page.
TEST_F(FlakyDriverTest, AccessThenUnmapFailingLeavesNoPageWithoutAccessInUse) {
  MakeFlaky();
  DeviceAllocator* alloc = flaky_alloc_.get();
  flaky_->access_failures = 1;
  flaky_->unmap_failures = 1;
  auto first = alloc->Malloc(6 * kMiB, 0);
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.status().message(), "injected cuMemSetAccess failure");
  ASSERT_TRUE(alloc->CheckInvariants().ok()) << alloc->CheckInvariants();
  EXPECT_EQ(alloc->GetStats().reserved_bytes[kAggregate].current, 6 * kMiB);  // still mapped
  auto second = alloc->Malloc(6 * kMiB, 0);  // on that page: mapped, with access
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(sim_->IsAccessible(*second, 6 * kMiB));
  ASSERT_TRUE(alloc->Free(*second).ok());

  // Access fails twice (the request's and the retry's): refused until the page is unmapped.
  flaky_->access_failures = 2;
  flaky_->unmap_failures = 1;
  ASSERT_FALSE(alloc->Malloc(12 * kMiB, 0).ok());  // one more page: mapped, without access
  auto refused = alloc->Malloc(kMiB + 1, 0);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(refused.status().message().find("is mapped without access after driver failures"),
            std::string::npos)
      << refused.status();
  ASSERT_TRUE(alloc->EmptyCache().ok());  // unmaps the free pages, that one included
  auto served = alloc->Malloc(12 * kMiB, 0);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_TRUE(sim_->IsAccessible(*served, 12 * kMiB));
  ASSERT_TRUE(alloc->Free(*served).ok());
  ASSERT_TRUE(alloc->EmptyCache().ok());
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// Two mappings of one request both left without access: the refusal lasts until both are
// unmapped, not only the first.
TEST_F(FlakyDriverTest, EveryMappingWithoutAccessIsRemembered) {
  MakeFlaky();
  DeviceAllocator* alloc = flaky_alloc_.get();
  flaky_->access_failures = 3;  // the run's, then each mapping's retry
  flaky_->unmap_failures = 2;   // each mapping's clean-up unmap
  ASSERT_FALSE(alloc->Malloc(12 * kMiB, 0).ok());
  ASSERT_EQ(flaky_->mapped_at.size(), 2u);
  ASSERT_FALSE(alloc->Malloc(6 * kMiB, 0).ok());  // refused
  flaky_->fail_unmap_at = flaky_->mapped_at[1];   // the second page's unmap fails once more
  EXPECT_FALSE(alloc->EmptyCache().ok());         // the first page goes, the second stays
  flaky_->fail_unmap_at = 0;
  auto still = alloc->Malloc(6 * kMiB, 0);
  ASSERT_FALSE(still.ok());  // still refused: one is left
  EXPECT_NE(still.status().message().find("without access"), std::string::npos);
  ASSERT_TRUE(alloc->EmptyCache().ok());
  auto p = alloc->Malloc(6 * kMiB, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(sim_->IsAccessible(*p, 6 * kMiB));
  ASSERT_TRUE(alloc->Free(*p).ok());
  ASSERT_TRUE(alloc->EmptyCache().ok());
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

// A handle the driver will not release does not stop empty_cache from unmapping the free pages
// (a page without access among them): expandable allocations are served again (an empty_cache
// that returned at the stuck handle would refuse them for good).
TEST_F(FlakyDriverTest, AStuckReleaseDoesNotKeepTheFreePagesMapped) {
  MakeFlaky();
  DeviceAllocator* alloc = flaky_alloc_.get();
  auto a = alloc->Malloc(6 * kMiB, 0);
  ASSERT_TRUE(a.ok());
  auto keep = alloc->Malloc(6 * kMiB, 0);
  ASSERT_TRUE(keep.ok());
  ASSERT_TRUE(alloc->Free(*a).ok());
  flaky_->release_failures = 1;
  EXPECT_FALSE(alloc->EmptyCache().ok());  // a's handle: unmapped, not released, kept
  flaky_->access_failures = 2;
  flaky_->unmap_failures = 1;
  ASSERT_FALSE(alloc->Malloc(6 * kMiB, 0).ok());  // a page mapped without access
  ASSERT_FALSE(alloc->Malloc(6 * kMiB, 0).ok());  // refused
  EXPECT_FALSE(alloc->EmptyCache().ok());         // the stuck handle again, the page unmapped
  auto p = alloc->Malloc(6 * kMiB, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(sim_->IsAccessible(*p, 6 * kMiB));
  ASSERT_TRUE(alloc->Free(*p).ok());
  ASSERT_TRUE(alloc->Free(*keep).ok());
  flaky_->stuck_handle = 0;  // the driver is well again
  ASSERT_TRUE(alloc->EmptyCache().ok());
  EXPECT_EQ(sim_->used_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, RepeatedDriverErrorTest,
    ::testing::Values("expandable_segments:False", "expandable_segments:True",
                      "expandable_segments:True,expandable_page_mb:2",
                      "expandable_segments:True,page_recycling:False",
                      "expandable_segments:True,keep_old_mappings:False",
                      "expandable_segments:True,expandable_handle_mb:12,recycle_slack:0"));

std::string Name(const ::testing::TestParamInfo<std::pair<DriverCall, std::string>>& info) {
  const std::string& conf = info.param.second;
  const char* kind = conf.find("False") != std::string::npos     ? "plain"
                     : conf.find("handle") != std::string::npos  ? "handles"
                     : conf.find("page_mb") != std::string::npos ? "pages2"
                                                                 : "default";
  std::string name = absl::StrCat(std::string(DriverCallName(info.param.first)), "_", kind);
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

std::vector<std::pair<DriverCall, std::string>> Cases() {
  std::vector<std::pair<DriverCall, std::string>> out;
  for (DriverCall call :
       {DriverCall::kMemCreate, DriverCall::kMemRelease, DriverCall::kMemMap, DriverCall::kMemUnmap,
        DriverCall::kMemSetAccess, DriverCall::kEventCreate, DriverCall::kEventRecord,
        DriverCall::kEventQuery, DriverCall::kEventSynchronize, DriverCall::kStreamSynchronize,
        DriverCall::kMalloc, DriverCall::kFree}) {
    // Plain segments make cudaMalloc / cudaFree and event calls; expandable ones the rest.
    const bool plain = call == DriverCall::kMalloc || call == DriverCall::kFree ||
                       call == DriverCall::kEventCreate || call == DriverCall::kEventRecord ||
                       call == DriverCall::kEventQuery || call == DriverCall::kEventSynchronize;
    const bool expandable = call != DriverCall::kMalloc && call != DriverCall::kFree;
    if (plain) out.emplace_back(call, "expandable_segments:False");
    if (!expandable) continue;
    for (const char* conf :
         {"expandable_segments:True", "expandable_segments:True,expandable_page_mb:2",
          "expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8"}) {
      out.emplace_back(call, conf);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(EveryCall, DriverErrorTest, ::testing::ValuesIn(Cases()), Name);

}  // namespace
}  // namespace vramledger
