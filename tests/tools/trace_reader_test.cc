// Tests of the trace CSV reader: good lines, every malformed-line error with its exact text,
// plain and gzip files, and the bundled real trace.
#include "replay/trace_reader.h"

#include <zlib.h>

#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kGood[] =
    "action,addr,size,stream,time_us\n"
    "segment_alloc,140292086824960,207618048,0,1795946953879164\n"
    "alloc,140292086824960,205852672,0,1795946953879169\n"
    "\n"
    "free_requested,140292086824960,205852672,7,1795946953879200\r\n"
    "free_completed,140292086824960,205852672,7,1795946953879201\n"
    "segment_free,140292086824960,207618048,0,1795946953879300\n"
    "segment_map,1,2097152,0,5\n"
    "segment_unmap,1,2097152,0,6\n"
    "snapshot,0,0,0,7\n"
    "oom,123456,8,0,8";  // no final newline

std::string ErrorOf(std::string_view text) {
  absl::StatusOr<std::vector<TraceEvent>> events = ParseTraceEvents(text, "t.csv");
  EXPECT_FALSE(events.ok());
  if (events.ok()) return "";
  EXPECT_EQ(events.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(events.status().message());
}

std::string WithHeader(std::string_view line) {
  return std::string("action,addr,size,stream,time_us\n") + std::string(line) + "\n";
}

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "/" + name; }

void WriteGzip(const std::string& path, const std::string& text) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, text.data(), static_cast<unsigned>(text.size())),
            static_cast<int>(text.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

TEST(TraceReaderTest, AddressesMayBeHexAfter0x) {
  // The replay's warnings and torch's viewers show addresses in hex; a trace may hold them so.
  absl::StatusOr<std::vector<TraceEvent>> events =
      ParseTraceEvents(WithHeader("alloc,0x7f1A00000000,512,0,1\nfree_completed,"
                                  "139749645877248,512,0,2\nalloc,0XFFFFFFFFFFFFFFFF,512,0,3"),
                       "t.csv");
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ((*events)[0].addr, DevicePtr{0x7f1a00000000});
  EXPECT_EQ((*events)[1].addr, (*events)[0].addr);  // the same address in decimal
  EXPECT_EQ((*events)[2].addr, DevicePtr{0xffffffffffffffff});
  EXPECT_EQ(ErrorOf(WithHeader("alloc,0x10000000000000000,2,0,3")),
            "t.csv:2: addr is not an unsigned integer (decimal, or hex after 0x): "
            "'0x10000000000000000' (alloc,0x10000000000000000,2,0,3)");
}

TEST(TraceActionTest, NamesRoundTrip) {
  const std::vector<std::string> names = {"alloc",         "free_requested", "free_completed",
                                          "segment_alloc", "segment_free",   "segment_map",
                                          "segment_unmap", "snapshot",       "oom"};
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::optional<TraceAction> action = ParseTraceAction(names[i]);
    ASSERT_TRUE(action.has_value()) << names[i];
    EXPECT_EQ(static_cast<std::size_t>(*action), i);
    EXPECT_EQ(TraceActionName(*action), names[i]);
  }
  EXPECT_FALSE(ParseTraceAction("Alloc").has_value());
  EXPECT_FALSE(ParseTraceAction("").has_value());
}

TEST(ParseTraceEventsTest, ParsesEveryActionWithLineNumbers) {
  absl::StatusOr<std::vector<TraceEvent>> events = ParseTraceEvents(kGood, "t.csv");
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 9u);
  const TraceEvent& a = (*events)[1];
  EXPECT_EQ(a.action, TraceAction::kAlloc);
  EXPECT_EQ(a.addr, 140292086824960u);
  EXPECT_EQ(a.size, 205852672u);
  EXPECT_EQ(a.stream, 0u);
  EXPECT_EQ(a.time_us, 1795946953879169);
  EXPECT_EQ(a.line, 3);
  // The blank line 4 is skipped but counted; the '\r' of line 5 is dropped.
  EXPECT_EQ((*events)[2].action, TraceAction::kFreeRequested);
  EXPECT_EQ((*events)[2].line, 5);
  EXPECT_EQ((*events)[2].stream, 7u);
  EXPECT_EQ((*events)[2].time_us, 1795946953879200);
  EXPECT_EQ((*events)[3].action, TraceAction::kFreeCompleted);
  EXPECT_EQ((*events)[4].action, TraceAction::kSegmentFree);
  EXPECT_EQ((*events)[5].action, TraceAction::kSegmentMap);
  EXPECT_EQ((*events)[6].action, TraceAction::kSegmentUnmap);
  EXPECT_EQ((*events)[7].action, TraceAction::kSnapshot);
  EXPECT_EQ((*events)[8].action, TraceAction::kOom);
  EXPECT_EQ((*events)[8].addr, 123456u);
  EXPECT_EQ((*events)[8].line, 11);
}

TEST(ParseTraceEventsTest, HeaderOnlyIsAnEmptyTrace) {
  absl::StatusOr<std::vector<TraceEvent>> events =
      ParseTraceEvents("action,addr,size,stream,time_us\n");
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_TRUE(events->empty());
}

TEST(ParseTraceEventsTest, AByteOrderMarkBeforeTheHeaderIsSkipped) {
  absl::StatusOr<std::vector<TraceEvent>> events =
      ParseTraceEvents("\xEF\xBB\xBF" + WithHeader("alloc,1,512,0,3"), "t.csv");
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].line, 2);
  EXPECT_FALSE(ParseTraceEvents(WithHeader("\xEF\xBB\xBF"
                                           "alloc,1,512,0,3"),
                                "t.csv")
                   .ok());
}

TEST(ParseTraceEventsTest, ErrorsNameFileLineWhatAndText) {
  EXPECT_EQ(ErrorOf(""),
            "t.csv:1: empty trace; expected the header "
            "'action,addr,size,stream,time_us'");
  EXPECT_EQ(ErrorOf("act,addr,size,stream,time_us\nalloc,1,2,0,3\n"),
            "t.csv:1: expected the header 'action,addr,size,stream,time_us'; missing action; "
            "unexpected act (act,addr,size,stream,time_us)");
  EXPECT_EQ(ErrorOf("action,addr,size,time_us\nalloc,1,2,3\n"),
            "t.csv:1: expected the header 'action,addr,size,stream,time_us'; missing stream "
            "(action,addr,size,time_us)");
  EXPECT_EQ(ErrorOf("action,size,addr,stream,time_us\n"),
            "t.csv:1: expected the header 'action,addr,size,stream,time_us'; columns out of "
            "order (action,size,addr,stream,time_us)");
  EXPECT_EQ(ErrorOf("alloc,1,2,0,3\n"),
            "t.csv:1: expected the header 'action,addr,size,stream,time_us' (alloc,1,2,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,2,0,3\nallocate,1,2,0,3")),
            "t.csv:3: unknown action 'allocate' (allocate,1,2,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,2,0")),
            "t.csv:2: expected 5 columns (action,addr,size,stream,time_us), found 4 "
            "(alloc,1,2,0)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,2,0,3,4")),
            "t.csv:2: expected 5 columns (action,addr,size,stream,time_us), found 6 "
            "(alloc,1,2,0,3,4)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,abc,0,3")),
            "t.csv:2: size is not an unsigned integer: 'abc' (alloc,1,abc,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,-5,0,3")),
            "t.csv:2: size is not an unsigned integer: '-5' (alloc,1,-5,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,,2,0,3")),
            "t.csv:2: addr is not an unsigned integer (decimal, or hex after 0x): '' "
            "(alloc,,2,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,0x1g,2,0,3")),
            "t.csv:2: addr is not an unsigned integer (decimal, or hex after 0x): '0x1g' "
            "(alloc,0x1g,2,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,0x,2,0,3")),
            "t.csv:2: addr is not an unsigned integer (decimal, or hex after 0x): '0x' "
            "(alloc,0x,2,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,0x-1,2,0,3")),
            "t.csv:2: addr is not an unsigned integer (decimal, or hex after 0x): '0x-1' "
            "(alloc,0x-1,2,0,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,2,s1,3")),
            "t.csv:2: stream is not an unsigned integer: 's1' (alloc,1,2,s1,3)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,2,0,1.5")),
            "t.csv:2: time_us is not an integer: '1.5' (alloc,1,2,0,1.5)");
  EXPECT_EQ(ErrorOf(WithHeader("alloc,1,99999999999999999999,0,3")),
            "t.csv:2: size is not an unsigned integer: '99999999999999999999' "
            "(alloc,1,99999999999999999999,0,3)");
}

TEST(ParseTraceEventsTest, LongLinesAreCutInErrors) {
  const std::string message = ErrorOf(WithHeader("x" + std::string(500, 'y')));
  EXPECT_THAT(message, StartsWith("t.csv:2: expected 5 columns"));
  EXPECT_THAT(message, HasSubstr("y...)"));
  EXPECT_LT(message.size(), 400u);
}

TEST(ReadTraceFileTest, ReadsPlainAndGzipAlike) {
  const std::string plain = TempPath("trace_reader_test_plain.csv");
  const std::string gz = TempPath("trace_reader_test.csv.gz");
  std::ofstream(plain) << kGood;
  WriteGzip(gz, kGood);
  absl::StatusOr<std::vector<TraceEvent>> from_plain = ReadTraceFile(plain);
  absl::StatusOr<std::vector<TraceEvent>> from_gz = ReadTraceFile(gz);
  ASSERT_TRUE(from_plain.ok()) << from_plain.status();
  ASSERT_TRUE(from_gz.ok()) << from_gz.status();
  ASSERT_EQ(from_plain->size(), 9u);
  ASSERT_EQ(from_gz->size(), 9u);
  for (std::size_t i = 0; i < from_gz->size(); ++i) {
    EXPECT_EQ((*from_gz)[i].action, (*from_plain)[i].action);
    EXPECT_EQ((*from_gz)[i].addr, (*from_plain)[i].addr);
    EXPECT_EQ((*from_gz)[i].line, (*from_plain)[i].line);
  }
  EXPECT_EQ((*from_gz)[8].line, 11);
}

TEST(ReadTraceFileTest, ErrorsNameThePath) {
  const std::string missing = TempPath("no_such_trace.csv.gz");
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(missing);
  ASSERT_FALSE(events.ok());
  EXPECT_EQ(events.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(events.status().message()), StartsWith(missing + ": cannot open"));

  const std::string bad = TempPath("trace_reader_test_bad.csv.gz");
  WriteGzip(bad, WithHeader("alloc,1,2,0,3\nalloc,1,2,0"));
  events = ReadTraceFile(bad);
  ASSERT_FALSE(events.ok());
  EXPECT_EQ(events.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(events.status().message(),
            bad +
                ":3: expected 5 columns (action,addr,size,stream,time_us), found 4 "
                "(alloc,1,2,0)");
}

// A NUL byte inside a line neither ends the line nor joins it with the next, and bytes that are
// not printable ASCII are escaped in the message, so it stays valid UTF-8 for Python.
TEST(ReadTraceFileTest, NulAndNonAsciiBytesAreBlamedOnTheirLineAndEscaped) {
  const std::string nul = TempPath("trace_reader_test_nul.csv");
  using std::string_literals::operator""s;  // keeps the NUL inside the literal
  std::ofstream(nul, std::ios::binary) << "action,addr,size,stream,time_us\nalloc,4\0"
                                          "96,100,0,2\nalloc,9000,100,0,3\n"s;
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(nul);
  ASSERT_FALSE(events.ok());
  EXPECT_EQ(
      events.status().message(),
      nul +
          R"(:2: addr is not an unsigned integer (decimal, or hex after 0x): '4\x0096' (alloc,4\x0096,100,0,2))");

  const std::string latin = TempPath("trace_reader_test_latin.csv.gz");
  WriteGzip(latin, WithHeader("alloc\xe9,4096,100,0,1"));
  events = ReadTraceFile(latin);
  ASSERT_FALSE(events.ok());
  EXPECT_EQ(events.status().message(),
            latin + R"(:2: unknown action 'alloc\xe9' (alloc\xe9,4096,100,0,1))");
}

TEST(ReadTraceFileTest, TruncatedGzipIsDataLoss) {
  std::string text = "action,addr,size,stream,time_us\n";
  for (int i = 0; i < 20000; ++i) text += "alloc," + std::to_string(i * 512) + ",512,0,1\n";
  const std::string whole = TempPath("trace_reader_test_whole.csv.gz");
  WriteGzip(whole, text);
  std::ifstream in(whole, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = TempPath("trace_reader_test_cut.csv.gz");
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(cut);
  ASSERT_FALSE(events.ok());
  EXPECT_EQ(events.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(events.status().message()), StartsWith(cut + ":"));
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// `cat a.gz b.gz` is one gzip file of two members (read whole, as gzip -d and Python read it);
// NUL padding may follow the last member; anything else after it is an error, not ignored as
// zlib's gzread ignores it (which would hide a corrupted file).
TEST(ReadTraceFileTest, GzipMembersPaddingAndTrailingGarbage) {
  const std::string head = TempPath("trace_reader_test_head.csv.gz");
  const std::string rest = TempPath("trace_reader_test_rest.csv.gz");
  WriteGzip(head, WithHeader("alloc,4096,100,0,1"));
  WriteGzip(rest, "free_completed,4096,100,0,2\nalloc,8192,100,0,3\n");
  const std::string joined = TempPath("trace_reader_test_joined.csv.gz");
  std::ofstream(joined, std::ios::binary) << FileBytes(head) << FileBytes(rest);
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(joined);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ((*events)[2].addr, 8192u);
  EXPECT_EQ((*events)[2].line, 4);

  const std::string padded = TempPath("trace_reader_test_padded.csv.gz");
  std::ofstream(padded, std::ios::binary) << FileBytes(joined) << std::string(600, '\0');
  events = ReadTraceFile(padded);
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_EQ(events->size(), 3u);

  const std::string garbage = TempPath("trace_reader_test_garbage.csv.gz");
  const std::string bytes = FileBytes(head);
  std::ofstream(garbage, std::ios::binary) << bytes << "alloc,1,2,0,3\n";
  events = ReadTraceFile(garbage);
  ASSERT_FALSE(events.ok());
  EXPECT_EQ(events.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(
      events.status().message(),
      absl::StrCat(garbage, ": 14 bytes after the end of the gzip data (at byte ", bytes.size(),
                   ") are neither gzip nor padding: a corrupted or wrongly "
                   "joined file"));
}

TEST(ReadTraceFileTest, ReadsTheBundledGpt2Trace) {
  const std::string path = std::string(VRAMLEDGER_SOURCE_DIR) + "/traces/trace-gpt2m-native.csv.gz";
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(path);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 102529u);  // traces/README.md
  EXPECT_EQ(events->front().action, TraceAction::kSegmentAlloc);
  EXPECT_EQ(events->front().addr, 140292086824960u);
  EXPECT_EQ(events->front().size, 207618048u);
  EXPECT_EQ(events->front().line, 2);
  EXPECT_EQ(events->back().line, 102530);
  std::size_t allocs = 0, frees = 0, segments = 0;
  for (const TraceEvent& e : *events) {
    allocs += e.action == TraceAction::kAlloc;
    frees += e.action == TraceAction::kFreeCompleted;
    segments += e.action == TraceAction::kSegmentAlloc;
  }
  EXPECT_EQ(allocs, 34621u);
  EXPECT_EQ(frees, 33740u);
  EXPECT_EQ(segments, 428u);
}

}  // namespace
}  // namespace vramledger
