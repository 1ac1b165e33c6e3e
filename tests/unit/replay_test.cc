// Tests of trace replay on SimBackend: a hand-made trace with known peaks, anomalies reported,
// OOM naming the line, options and streams passed through, and the bundled real traces.
#include "replay/replay.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "replay/replay_report.h"
#include "replay/trace_reader.h"
#include "vramledger/device_backend.h"
#include "vramledger/options.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Peaks by construction: requested 3,000,000 + 1,000 (line 5); allocated (512-byte rounding)
// 3,000,320 + 1,024; reserved one 20 MiB large-pool segment (1-10 MiB requests) and one 2 MiB
// small-pool segment, as the trace's own segment_alloc events say torch did.
constexpr char kTiny[] =
    "action,addr,size,stream,time_us\n"
    "segment_alloc,1000000000,20971520,0,1\n"  // line 2
    "alloc,1000000000,3000000,0,2\n"           // line 3
    "segment_alloc,2000000000,2097152,0,3\n"   // line 4
    "alloc,2000000000,1000,0,4\n"              // line 5
    "free_requested,2000000000,1000,0,5\n"     // line 6
    "free_completed,2000000000,1000,0,6\n"     // line 7
    "alloc,2000000000,500,0,7\n"               // line 8
    "free_completed,1000000000,3000000,0,8\n"  // line 9
    "segment_free,1000000000,20971520,0,9\n";  // line 10

std::vector<TraceEvent> Parse(std::string_view text) {
  absl::StatusOr<std::vector<TraceEvent>> events = ParseTraceEvents(text, "tiny.csv");
  EXPECT_TRUE(events.ok()) << events.status();
  return events.ok() ? *events : std::vector<TraceEvent>();
}

ReplayConfig Config(std::size_t capacity = kH200TotalBytes) {
  ReplayConfig config;
  config.capacity_bytes = capacity;
  config.source = "tiny.csv";
  return config;
}

ReplayResult MustReplay(std::string_view text, const Options& options = Options(),
                        const ReplayConfig& config = Config()) {
  absl::StatusOr<ReplayResult> result = Replay(Parse(text), options, config);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : ReplayResult();
}

TEST(ReplayTest, TinyTraceHasKnownPeaks) {
  const ReplayResult r = MustReplay(kTiny);
  EXPECT_EQ(r.events, 5);
  EXPECT_EQ(r.allocs, 3);
  EXPECT_EQ(r.frees, 2);
  EXPECT_EQ(r.trace_events, 9);
  EXPECT_EQ(r.recorded_events, 5);
  EXPECT_EQ(r.peak_requested_bytes, 3001000);
  EXPECT_EQ(r.trace_peak_requested_bytes, 3001000);
  EXPECT_EQ(r.peak_allocated_bytes, 3000320 + 1024);
  EXPECT_EQ(r.peak_reserved_bytes, 20 * kMiB + 2 * kMiB);
  EXPECT_EQ(r.final_reserved_bytes, 20 * kMiB + 2 * kMiB);  // nothing released on purpose
  EXPECT_DOUBLE_EQ(r.utilization, 3001344.0 / (22.0 * kMiB));
  EXPECT_EQ(r.recorded_peak_reserved_bytes, 20 * kMiB + 2 * kMiB);
  EXPECT_DOUBLE_EQ(r.recorded_utilization, 3001000.0 / (22.0 * kMiB));
  EXPECT_EQ(r.recorded_segment_allocs, 2);
  EXPECT_EQ(r.recorded_segment_frees, 1);
  EXPECT_EQ(r.device_allocs, 2);
  EXPECT_EQ(r.device_frees, 0);
  EXPECT_EQ(r.live_at_end, 1);
  EXPECT_EQ(r.live_bytes_at_end, 500);
  EXPECT_TRUE(r.unknown_frees.empty());
  EXPECT_TRUE(r.reused_live_addresses.empty());
  EXPECT_EQ(r.source, "tiny.csv");
  EXPECT_EQ(r.capacity_bytes, kH200TotalBytes);

  ASSERT_EQ(r.driver_calls.size(), static_cast<std::size_t>(kNumDriverCalls));
  EXPECT_EQ(r.driver_calls.at("cudaMalloc"), 2);
  EXPECT_EQ(r.driver_calls.at("cudaFree"), 0);
  double sum = 0;
  for (const auto& [name, us] : r.driver_us) sum += us;
  EXPECT_GT(r.modeled_driver_us, 0.0);
  EXPECT_NEAR(r.modeled_driver_us, sum, 1e-6);
}

TEST(ReplayTest, FreeRequestedIsIgnoredUntilFreeCompleted) {
  const ReplayResult r = MustReplay(
      "action,addr,size,stream,time_us\n"
      "alloc,4096,1000,0,1\n"
      "free_requested,4096,1000,0,2\n"
      "alloc,8192,1000,0,3\n"
      "free_completed,4096,1000,0,4\n");
  EXPECT_EQ(r.events, 3);
  EXPECT_EQ(r.peak_requested_bytes, 2000);
  EXPECT_EQ(r.peak_allocated_bytes, 2048);
  EXPECT_EQ(r.live_at_end, 1);
}

TEST(ReplayTest, UnknownFreesAreReportedNotIgnored) {
  const ReplayResult r = MustReplay(
      "action,addr,size,stream,time_us\n"
      "alloc,4096,1000,0,1\n"
      "free_completed,42,1000,0,2\n"  // never allocated
      "free_completed,4096,1000,0,3\n"
      "free_completed,4096,1000,0,4\n");  // freed twice
  ASSERT_EQ(r.unknown_frees.size(), 2u);
  EXPECT_EQ(r.unknown_frees[0].line, 3);
  EXPECT_EQ(r.unknown_frees[0].addr, 42u);
  EXPECT_EQ(r.unknown_frees[1].line, 5);
  EXPECT_EQ(r.unknown_frees[1].addr, 4096u);
  EXPECT_EQ(r.events, 2);
  EXPECT_EQ(r.recorded_events, 4);
  EXPECT_EQ(r.live_at_end, 0);

  const std::vector<std::string> warnings = ReplayWarnings(r);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "2 free_completed events of addresses not live in the trace (never allocated in it, "
            "or freed twice) were not replayed; at tiny.csv:3 (addr 0x2a), "
            "tiny.csv:5 (addr 0x1000)");
  const nlohmann::json j = ReplayResultToJson(r);
  EXPECT_EQ(j["unknown_frees"], 2);
  EXPECT_EQ(j["unknown_frees_listed"][0]["line"], 3);
  EXPECT_EQ(j["unknown_frees_listed"][0]["addr"], 42);
  EXPECT_EQ(ReplayResultToJson(r, 1)["unknown_frees_listed"].size(), 1u);
}

TEST(ReplayTest, AllocOfALiveAddressFreesTheEarlierBlock) {
  const ReplayResult r = MustReplay(
      "action,addr,size,stream,time_us\n"
      "alloc,4096,1000,0,1\n"
      "alloc,4096,3000,0,2\n");
  ASSERT_EQ(r.reused_live_addresses.size(), 1u);
  EXPECT_EQ(r.reused_live_addresses[0].line, 3);
  EXPECT_EQ(r.live_at_end, 1);
  EXPECT_EQ(r.live_bytes_at_end, 3000);
  EXPECT_EQ(r.trace_peak_requested_bytes, 3000);
  EXPECT_EQ(r.peak_requested_bytes, 3000);
  EXPECT_EQ(ReplayWarnings(r).size(), 1u);
}

TEST(ReplayTest, OutOfMemoryStopsWithTheLine) {
  absl::StatusOr<ReplayResult> r = Replay(Parse("action,addr,size,stream,time_us\n"
                                                "alloc,4096,1000,0,1\n"
                                                "alloc,8192,104857600,0,2\n"),
                                          Options(), Config(64 * kMiB));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()),
              StartsWith("tiny.csv:3: alloc of 104857600 bytes on stream 0 failed (simulated "
                         "capacity 67108864 bytes): "));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("out of memory"));
}

TEST(ReplayTest, StreamsArePassedThrough) {
  // Small blocks of different streams never share a segment: two 2 MiB segments.
  const ReplayResult r = MustReplay(
      "action,addr,size,stream,time_us\n"
      "alloc,4096,1000,1106973296,1\n"
      "alloc,8192,1000,7,2\n");
  EXPECT_EQ(r.peak_reserved_bytes, 4 * kMiB);
  EXPECT_EQ(r.driver_calls.at("cudaMalloc"), 2);
}

TEST(ReplayTest, OptionsReachTheAllocator) {
  // Issue 2's max_split_size scenario: 300 MiB, free, 250 MiB, 300 MiB.
  const std::string trace =
      "action,addr,size,stream,time_us\n"
      "alloc,1073741824,314572800,0,1\n"
      "free_completed,1073741824,314572800,0,2\n"
      "alloc,2147483648,262144000,0,3\n"
      "alloc,3221225472,314572800,0,4\n";
  EXPECT_EQ(MustReplay(trace).peak_reserved_bytes, 600 * kMiB);  // the 300 MiB block is split
  absl::StatusOr<Options> options = ParseOptions("max_split_size_mb:200");
  ASSERT_TRUE(options.ok()) << options.status();
  const ReplayResult r = MustReplay(trace, *options);
  EXPECT_EQ(r.peak_reserved_bytes, 550 * kMiB);
  EXPECT_EQ(r.conf, options->conf_string);
}

TEST(ReplayReportTest, NumbersAndJsonKeys) {
  EXPECT_EQ(WithThousands(0), "0");
  EXPECT_EQ(WithThousands(999), "999");
  EXPECT_EQ(WithThousands(1000), "1,000");
  EXPECT_EQ(WithThousands(27105552624), "27,105,552,624");
  EXPECT_EQ(WithThousands(-1234567), "-1,234,567");
  EXPECT_EQ(BytesAndGiB(39151730688), "39,151,730,688 B (36.46 GiB)");

  const ReplayResult r = MustReplay(kTiny);
  const nlohmann::json j = ReplayResultToJson(r);
  for (const char* key : {"events", "peak_allocated_bytes", "peak_requested_bytes",
                          "peak_reserved_bytes", "utilization", "recorded_peak_reserved_bytes",
                          "recorded_utilization", "driver_calls", "modeled_driver_us"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["events"], 5);
  EXPECT_EQ(j["peak_requested_bytes"], 3001000);
  EXPECT_EQ(j["driver_calls"]["cudaMalloc"], 2);
  EXPECT_TRUE(j["utilization"].is_number_float());
  const std::string table = FormatReplayTable(r);
  EXPECT_THAT(table, HasSubstr("peak requested   3,001,000 B (0.00 GiB)"));
  EXPECT_THAT(table, HasSubstr("cudaMalloc"));
}

struct BundledTrace {
  const char* file;
  std::int64_t peak_requested;  // traces/README.md: trace peak live (requested) bytes
  std::int64_t recorded_peak_reserved;
  std::int64_t events;  // alloc + free_completed
};

class BundledTraceTest : public ::testing::TestWithParam<BundledTrace> {};

TEST_P(BundledTraceTest, ReplayMatchesTheTracesOwnFigures) {
  const BundledTrace& t = GetParam();
  const std::string path = std::string(VRAMLEDGER_SOURCE_DIR) + "/traces/" + t.file;
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(path);
  ASSERT_TRUE(events.ok()) << events.status();
  ReplayConfig config;
  config.source = path;
  absl::StatusOr<ReplayResult> r = Replay(*events, Options(), config);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->peak_requested_bytes, t.peak_requested);
  EXPECT_EQ(r->trace_peak_requested_bytes, t.peak_requested);
  EXPECT_EQ(r->recorded_peak_reserved_bytes, t.recorded_peak_reserved);
  EXPECT_EQ(r->events, t.events);
  EXPECT_TRUE(r->unknown_frees.empty());
  EXPECT_TRUE(r->reused_live_addresses.empty());
  EXPECT_GE(r->peak_allocated_bytes, r->peak_requested_bytes);
  EXPECT_GE(r->peak_reserved_bytes, r->peak_allocated_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Traces, BundledTraceTest,
    ::testing::Values(
        BundledTrace{"trace-gpt2m-native.csv.gz", 27105552624, 39151730688, 34621 + 33740},
        BundledTrace{"trace-llama1b-native.csv.gz", 37021797176, 54033121280, 67917},
        BundledTrace{"trace-gpt2m-prefetch-native.csv.gz", 27512273536, 33206304768, 57054},
        BundledTrace{"trace-gpt2m-prefetch-expandable.csv.gz", 27512273536, 28754051072, 57054}),
    [](const ::testing::TestParamInfo<BundledTrace>& info) {
      std::string name = info.param.file;
      name = name.substr(0, name.find('.'));
      for (char& c : name) c = c == '-' ? '_' : c;
      return name;
    });

}  // namespace
}  // namespace vramledger
