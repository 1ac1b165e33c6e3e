// Driver errors at every call of every kind (SimBackend::FailCall), in the middle of a churn of
// expandable-segment allocations with page moves, retiring mappings, record_stream and
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

#include "sim_allocator_fixture.h"

namespace vramledger {
namespace {

constexpr StreamId kS1 = 0x33;

class DriverErrorTest : public SimAllocatorTest,
                        public ::testing::WithParamInterface<std::pair<DriverCall, std::string>> {
 protected:
  // Runs `ops` random operations (a failure injected beforehand); returns how many operations
  // reported the injected error. `expandable`: every block must lie on accessible mapped pages.
  int Churn(int ops, std::uint64_t seed, bool expandable) {
    std::mt19937_64 rng(seed);
    std::vector<std::pair<DevicePtr, StreamId>> live;
    int injected_seen = 0;
    for (int op = 0; op < ops; ++op) {
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
      for (const auto& seg : alloc_->Snapshot()) plain += seg.is_expandable ? 0 : seg.total_size;
      if (static_cast<std::size_t>(Reserved()) !=
          sim_->mapped_bytes() - sim_->aliased_bytes() + plain) {
        ADD_FAILURE() << "op " << op << ": reserved " << Reserved() << " != mapped "
                      << sim_->mapped_bytes() << " - aliased " << sim_->aliased_bytes()
                      << " + plain " << plain;
        break;
      }
    }
    for (const auto& [p, s] : live) EXPECT_TRUE(alloc_->Free(p).ok());
    return injected_seen;
  }
};

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
