// Tests of what a replay follows beyond alloc and free: the program's releases (runs of
// segment_free / segment_unmap: empty_cache(), torch's out-of-memory retry) and a plan enforced
// on the simulated device (plan:FILE in the options).
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "device/sim_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "replay/replay.h"
#include "replay/replay_report.h"
#include "replay/trace_reader.h"
#include "replay/trace_releases.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"
#include "vramledger/options.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;

std::vector<TraceEvent> Parse(std::string_view text) {
  absl::StatusOr<std::vector<TraceEvent>> events = ParseTraceEvents(text, "t.csv");
  EXPECT_TRUE(events.ok()) << events.status();
  return events.ok() ? *events : std::vector<TraceEvent>();
}

ReplayConfig Config(bool follow = true) {
  ReplayConfig config;
  config.source = "t.csv";
  config.follow_releases = follow;
  return config;
}

// Records an allocator's state changes as a trace, as torch's _record_memory_history would.
class TraceRecorder final : public AllocatorHooks {
 public:
  void OnEvent(const TraceEntry& e) override {
    TraceEvent t;
    t.action = e.action;
    t.addr = e.addr;
    t.size = e.size;
    t.stream = e.stream;
    t.time_us = static_cast<std::int64_t>(events.size()) + 1;
    t.line = static_cast<int>(events.size()) + 2;
    events.push_back(t);
  }
  std::vector<TraceEvent> events;
};

// A program on 10 streams in `phases` phases, the program calling empty_cache() between them
// when `empty_cache`: in each phase every stream allocates four large blocks (sizes growing from
// phase to phase, so an earlier phase's cache cannot serve them), frees two, allocates two
// more, then frees everything. torch's caching policy (expandable segments off) runs it on a
// simulated device with the history on; returns the trace and torch's peak reserved bytes.
struct Recorded {
  std::vector<TraceEvent> events;
  std::int64_t peak_reserved = 0;
};
Recorded RecordMultiStream(int phases, bool empty_cache) {
  SimBackend::Config sim;
  sim.capacity = kH200TotalBytes;
  SimBackend backend(sim);
  DeviceAllocator allocator(Options(), &backend);
  TraceRecorder recorder;
  allocator.SetHooks(&recorder);
  for (int phase = 0; phase < phases; ++phase) {
    std::vector<DevicePtr> live;
    for (StreamId stream = 1; stream <= 10; ++stream) {
      std::vector<DevicePtr> blocks;
      for (int k = 0; k < 4; ++k) {
        const std::size_t size = (24 + 8 * phase + 2 * k) * kMiB + 4096 * stream;
        blocks.push_back(*allocator.Malloc(size, stream));
      }
      EXPECT_TRUE(allocator.Free(blocks[0]).ok());
      EXPECT_TRUE(allocator.Free(blocks[1]).ok());
      live.push_back(blocks[2]);
      live.push_back(blocks[3]);
      live.push_back(*allocator.Malloc((20 + 8 * phase) * kMiB, stream));
      live.push_back(*allocator.Malloc(3 * kMiB, stream));
    }
    for (DevicePtr p : live) EXPECT_TRUE(allocator.Free(p).ok());
    if (empty_cache) {
      EXPECT_TRUE(allocator.EmptyCache().ok());
    }
  }
  Recorded out;
  out.peak_reserved = allocator.GetStats().reserved_bytes[kAggregate].peak;
  allocator.SetHooks(nullptr);
  out.events = std::move(recorder.events);
  return out;
}

TEST(TraceReleasesTest, RunsAreFoundAndClassified) {
  const std::vector<TraceEvent> events = Parse(
      "action,addr,size,stream,time_us\n"
      "segment_alloc,100,41943040,0,1\n"  // line 2: reserved 40 MiB
      "alloc,100,41943040,0,2\n"
      "free_completed,100,41943040,0,3\n"
      "segment_free,100,41943040,0,4\n"   // line 5: a run of one, then growth of 20 MiB:
      "segment_alloc,200,20971520,0,5\n"  //   40 + 20 MiB <= the trace's peak (100 MiB, line
      "alloc,200,20971520,0,6\n"          //   11): the program's empty_cache()
      "free_completed,200,20971520,0,7\n"
      "segment_free,200,20971520,0,8\n"  // line 9: no growth before the next alloc
      "alloc,300,1,0,9\n"
      "segment_alloc,400,104857600,0,10\n"  // line 11: 100 MiB, the trace's peak
      "alloc,400,104857600,0,11\n"
      "segment_unmap,500,2097152,0,12\n"  // line 13: unmap 2 MiB then map 2 MiB: a page move
      "segment_map,600,2097152,0,13\n"
      "alloc,600,1,0,14\n"
      "segment_free,400,104857600,0,15\n"  // line 16: 100 MiB reserved before, + 64 MiB growth
      "segment_alloc,700,67108864,0,16\n"  //   passes every figure: maybe torch's retry
      "alloc,700,67108864,0,17\n");
  const std::vector<TraceRelease> releases = FindTraceReleases(events);
  ASSERT_EQ(releases.size(), 3u);
  EXPECT_EQ(releases[0].first_line, 5);
  EXPECT_TRUE(releases[0].before_growth);
  EXPECT_EQ(releases[0].reserved_before, 40 * kMiB);
  EXPECT_FALSE(releases[0].possible_retry);
  EXPECT_EQ(releases[0].bytes, 40 * kMiB);
  EXPECT_EQ(releases[1].last_line, 9);
  EXPECT_FALSE(releases[1].before_growth);
  EXPECT_FALSE(releases[1].possible_retry);
  EXPECT_EQ(releases[2].first_line, 16);
  EXPECT_EQ(releases[2].reserved_before, 100 * kMiB);
  EXPECT_EQ(releases[2].growth_bytes, 64 * kMiB);
  EXPECT_TRUE(releases[2].possible_retry);
}

TEST(ReplayReleasesTest, MultiStreamEmptyCachePhasesReproduceTorchsReserved) {
  const Recorded torch = RecordMultiStream(/*phases=*/4, /*empty_cache=*/true);
  absl::StatusOr<ReplayResult> followed = Replay(torch.events, Options(), Config(true));
  ASSERT_TRUE(followed.ok()) << followed.status();
  EXPECT_EQ(followed->recorded_peak_reserved_bytes, torch.peak_reserved);
  EXPECT_NEAR(static_cast<double>(followed->peak_reserved_bytes),
              static_cast<double>(torch.peak_reserved), 0.01 * torch.peak_reserved);
  EXPECT_EQ(followed->releases.runs, 4);
  EXPECT_EQ(followed->releases.applied, 4);
  EXPECT_EQ(followed->releases.empty_cache_runs, 4);
  EXPECT_EQ(followed->final_reserved_bytes, 0);

  // Ignoring them, each phase's segments stay cached on their streams and the next phase, whose
  // blocks are larger, makes new ones: reserved grows phase after phase.
  absl::StatusOr<ReplayResult> ignored = Replay(torch.events, Options(), Config(false));
  ASSERT_TRUE(ignored.ok()) << ignored.status();
  EXPECT_GT(ignored->peak_reserved_bytes, 3 * torch.peak_reserved);
  EXPECT_EQ(ignored->releases.applied, 0);

  // The same program without empty_cache(): torch's own figure is the larger one, and both
  // replays reproduce it (there is nothing to follow).
  const Recorded kept = RecordMultiStream(/*phases=*/4, /*empty_cache=*/false);
  absl::StatusOr<ReplayResult> plain = Replay(kept.events, Options(), Config(true));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->releases.runs, 0);
  EXPECT_EQ(plain->peak_reserved_bytes, kept.peak_reserved);
  EXPECT_EQ(ignored->peak_reserved_bytes, kept.peak_reserved);

  const std::string table = FormatReplayTable(*followed);
  EXPECT_THAT(table, HasSubstr("program's releases: 4 in the trace (4 empty_cache(), 0 "
                               "out-of-memory retries;"));
  EXPECT_THAT(table, HasSubstr("applied 4 (the replay's cache emptied there"));
  EXPECT_EQ(ReplayResultToJson(*followed)["releases"]["applied"], 4);
  EXPECT_TRUE(ReplayResultToJson(*followed)["plan"].is_null());
}

TEST(ReplayReleasesTest, ARetryTheReplayWouldNotHaveNeededIsSkipped) {
  // torch held 1 GiB of segments the trace never allocated from (cached before the recording
  // began) when a 16 MiB request ran out: it released one and made another. The replay holds
  // 16 MiB: at torch's cap it would not have run out, so it keeps its cache.
  const std::vector<TraceEvent> events = Parse(
      "action,addr,size,stream,time_us\n"
      "segment_alloc,1000,1073741824,0,1\n"
      "segment_alloc,2000000000,20971520,0,2\n"
      "alloc,2000000000,15728640,0,3\n"
      "free_completed,2000000000,15728640,0,4\n"
      "segment_free,2000000000,20971520,0,5\n"
      "segment_alloc,3000000000,20971520,0,6\n"
      "alloc,3000000000,16777216,0,7\n");
  absl::StatusOr<ReplayResult> r = Replay(events, Options(), Config(true));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->releases.retry_runs, 1);
  EXPECT_EQ(r->releases.skipped, 1);
  EXPECT_EQ(r->releases.applied, 0);
  // The 15 MiB block's 16 MiB segment, kept, served the 16 MiB request: nothing new.
  EXPECT_EQ(r->final_reserved_bytes, 16 * kMiB);
  EXPECT_EQ(r->device_allocs, 1);
  EXPECT_THAT(FormatReplayTable(*r), HasSubstr("1 retries skipped"));
}

// ---- The plan ----

std::string WritePlan(const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/", name);
  std::ofstream(path) << text;
  return path;
}

Options WithPlan(const std::string& path) {
  absl::StatusOr<Options> options = ParseOptions(absl::StrCat("plan:", path));
  EXPECT_TRUE(options.ok()) << options.status();
  return options.ok() ? *options : Options();
}

// 40 MiB blocks under a 100 MiB limit (torch's policy: one 40 MiB segment each): the third live
// one needs a third segment, past the cap (line 7); so does the one at line 9.
constexpr char kOverPlan[] =
    "action,addr,size,stream,time_us\n"
    "alloc,100,41943040,0,1\n"  // line 2
    "alloc,200,41943040,0,2\n"  // line 3
    "free_requested,200,41943040,0,3\n"
    "free_completed,200,41943040,0,4\n"
    "alloc,300,41943040,0,5\n"  // line 6: the freed block's segment serves it
    "alloc,400,41943040,0,6\n"  // line 7: a third segment: 120 MiB > 100 MiB
    "free_completed,400,41943040,0,7\n"
    "alloc,500,41943040,0,8\n"  // line 9: refused again
    "free_completed,100,41943040,0,9\n";

TEST(ReplayPlanTest, TheFirstRefusalStopsTheReplayWithItsLineAndRule) {
  const std::string plan =
      WritePlan("plan-stop.json", "{\n  \"vramledger_plan\": 1,\n  \"limit\": \"100MiB\"\n}\n");
  absl::StatusOr<ReplayResult> r = Replay(Parse(kOverPlan), WithPlan(plan), Config());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->plan.path, plan);
  EXPECT_EQ(r->plan.cap, 100 * kMiB);
  EXPECT_TRUE(r->plan.stopped);
  EXPECT_EQ(r->plan.refusals, 1);
  ASSERT_EQ(r->plan.listed.size(), 1u);
  const PlanRefusal& first = r->plan.listed[0];
  EXPECT_EQ(first.line, 7);
  EXPECT_EQ(first.event, 6);
  EXPECT_EQ(first.event_text, "alloc,400,41943040,0,6");
  EXPECT_EQ(first.plan_line, 3);
  EXPECT_EQ(first.rule, "limit");
  EXPECT_THAT(first.message, HasSubstr(absl::StrCat("vramledger plan violation: ", plan,
                                                    ":3: limit: reserved memory would grow to")));
  EXPECT_THAT(first.message, HasSubstr("live bytes by category (current / plan):"));
  EXPECT_THAT(first.message, HasSubstr("untagged"));
  EXPECT_THAT(first.message, HasSubstr("largest free block"));
  EXPECT_EQ(r->allocs, 3);  // lines 2, 3 and 6; the replay stopped at line 7
  const std::string table = FormatReplayTable(*r);
  EXPECT_THAT(table, HasSubstr("refusal 1 at t.csv:7 (trace event 6): alloc,400,41943040,0,6"));
  EXPECT_THAT(table, HasSubstr("(the replay stopped at the first)"));
}

TEST(ReplayPlanTest, KeepGoingCountsEveryRefusalAndIgnoresTheirFrees) {
  const std::string plan = WritePlan("plan-go.json", "{\"limit\": \"100MiB\"}\n");
  ReplayConfig config = Config();
  config.plan_keep_going = true;
  absl::StatusOr<ReplayResult> r = Replay(Parse(kOverPlan), WithPlan(plan), config);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->plan.stopped);
  EXPECT_EQ(r->plan.refusals, 2);
  ASSERT_EQ(r->plan.listed.size(), 2u);
  EXPECT_EQ(r->plan.listed[1].line, 9);
  EXPECT_TRUE(r->unknown_frees.empty());  // line 8 frees the refused block: expected
  EXPECT_LE(r->peak_reserved_bytes, 100 * kMiB);
  EXPECT_EQ(ReplayResultToJson(*r)["plan"]["refusals"], 2);

  config.max_refusals_listed = 1;
  absl::StatusOr<ReplayResult> short_list = Replay(Parse(kOverPlan), WithPlan(plan), config);
  ASSERT_TRUE(short_list.ok());
  EXPECT_EQ(short_list->plan.refusals, 2);
  EXPECT_EQ(short_list->plan.listed.size(), 1u);
  EXPECT_THAT(FormatReplayTable(*short_list), HasSubstr("(1 more refusals not listed)"));
}

TEST(ReplayPlanTest, APlanThatHoldsRefusesNothing) {
  const std::string plan = WritePlan("plan-ok.json", "{\"limit\": \"1GiB\"}\n");
  absl::StatusOr<ReplayResult> r = Replay(Parse(kOverPlan), WithPlan(plan), Config());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->plan.refusals, 0);
  EXPECT_FALSE(r->plan.stopped);
  EXPECT_EQ(r->allocs, 5);
}

TEST(ReplayPlanTest, BadPlanFilesAreErrorsThatNameThem) {
  absl::StatusOr<ReplayResult> missing =
      Replay(Parse(kOverPlan), WithPlan("/nonexistent/plan.json"), Config());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/plan.json"));

  const std::string bad = WritePlan("plan-bad.json", "{\n  \"limit\": \"100 parsecs\"\n}\n");
  absl::StatusOr<ReplayResult> r = Replay(Parse(kOverPlan), WithPlan(bad), Config());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat(bad, ":2: field 'limit'")));
}

}  // namespace
}  // namespace vramledger
