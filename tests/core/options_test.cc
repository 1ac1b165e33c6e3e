// The settings-string parser: torch's keys and syntax, vramledger's keys, process keys, the
// errors, the environment, and docs/options.md generated from the tables.
#include "vramledger/options.h"

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_split.h"

namespace vramledger {
namespace {

TEST(Options, DefaultsMatchTorch) {
  Options o;
  EXPECT_EQ(o.max_split_size, SIZE_MAX);
  EXPECT_EQ(o.max_non_split_rounding, 20 * kMiB);
  EXPECT_EQ(o.large_segment_size, 20 * kMiB);
  EXPECT_FALSE(o.expandable_segments);
  EXPECT_TRUE(o.page_recycling);
  EXPECT_FALSE(o.recycle_tails_first);
  EXPECT_TRUE(o.keep_old_mappings);
  EXPECT_FALSE(o.host_timing);
}

TEST(Options, KeepOldMappingsParsesAndRoundTrips) {
  auto o = ParseOptions("expandable_segments:True,keep_old_mappings:False");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->keep_old_mappings);
  EXPECT_NE(OptionsToString(*o).find("keep_old_mappings:False"), std::string::npos);
  auto again = ParseOptions(OptionsToString(*o));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->keep_old_mappings);
  auto bad = ParseOptions("keep_old_mappings:1");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("keep_old_mappings"), std::string::npos) << bad.status();
}

TEST(Options, HostTimingParsesAndRoundTrips) {
  auto o = ParseOptions("host_timing:True");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->host_timing);
  auto again = ParseOptions(OptionsToString(*o));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->host_timing);
  EXPECT_FALSE(ParseOptions("host_timing:yes").ok());
}

TEST(Options, RecycleTailsFirstParsesAndRoundTrips) {
  auto o = ParseOptions("expandable_segments:True,recycle_tails_first:True");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->recycle_tails_first);
  EXPECT_NE(OptionsToString(*o).find("recycle_tails_first:True"), std::string::npos);
  auto again = ParseOptions(OptionsToString(*o));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->recycle_tails_first);
  auto bad = ParseOptions("recycle_tails_first:maybe");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("recycle_tails_first"), std::string::npos) << bad.status();
}

TEST(Options, ParsesTorchKeysWithWhitespaceAndLists) {
  auto o = ParseOptions(
      " max_split_size_mb:200, expandable_segments:True,"
      "roundup_power2_divisions:[256:1,512:2,1024:4,>:8], garbage_collection_threshold:0.6");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_split_size, 200 * kMiB);
  EXPECT_TRUE(o->expandable_segments);
  EXPECT_DOUBLE_EQ(o->garbage_collection_threshold, 0.6);
  EXPECT_EQ(o->roundup_power2_divisions[8], 1u);   // 256 MiB
  EXPECT_EQ(o->roundup_power2_divisions[9], 2u);   // 512 MiB
  EXPECT_EQ(o->roundup_power2_divisions[10], 4u);  // 1024 MiB
  EXPECT_EQ(o->roundup_power2_divisions[11], 8u);  // '>' fills the rest
  EXPECT_EQ(o->roundup_power2_divisions[15], 8u);
  EXPECT_EQ(o->roundup_power2_divisions[0], 0u);
}

TEST(Options, SingleDivisionsValueFillsEveryInterval) {
  auto o = ParseOptions("roundup_power2_divisions:4");
  ASSERT_TRUE(o.ok());
  for (std::size_t d : o->roundup_power2_divisions) EXPECT_EQ(d, 4u);
}

TEST(Options, UnknownKeyNamesTheKeyAndTheAcceptedOnes) {
  auto o = ParseOptions("max_split_size_mb:200,bogus_key:1");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("unknown option 'bogus_key'"), std::string::npos);
  EXPECT_NE(o.status().message().find("max_split_size_mb"), std::string::npos);
  EXPECT_EQ(o.status().message().find("did you mean"), std::string::npos);  // nothing near
}

TEST(Options, AMistypedKeyGetsTheNearestAcceptedOne) {
  for (const auto& [typed, meant] : std::vector<std::pair<std::string, std::string>>{
           {"expandable_segment", "expandable_segments"},
           {"Expandable_Segments", "expandable_segments"},
           {"max_split_size", "max_split_size_mb"},
           {"garbage_collection_treshold", "garbage_collection_threshold"},
           {"keep_old_mapping", "keep_old_mappings"},
           {"dumpdir", "dump_dir"}}) {
    auto o = ParseOptions(typed + ":1");
    ASSERT_FALSE(o.ok()) << typed;
    EXPECT_NE(o.status().message().find("unknown option '" + typed + "' (did you mean '" + meant +
                                        "'?); accepted keys: "),
              std::string::npos)
        << o.status().message();
  }
}

TEST(Options, BadValuesNameKeyAndExpectation) {
  struct Case {
    const char* conf;
    const char* needle;
  };
  for (const Case& c :
       {Case{"expandable_segments:true", "True or False"},
        Case{"max_split_size_mb:10", "at least 20"},
        Case{"max_split_size_mb:abc", "'max_split_size_mb'"},
        Case{"garbage_collection_threshold:1.5", "(0, 1)"},
        Case{"per_process_memory_fraction:-0.1", "[0, 1]"},
        Case{"roundup_power2_divisions:3", "power of two"},
        Case{"roundup_power2_divisions:[300:2]", "power of two"},
        Case{"backend:cudaMallocAsync", "native"},
        Case{"max_dumps:-1", ">= 0"},
        Case{"recycle_slack:abc", "[0, 1]"},
        Case{"recycle_slack:nan", "[0, 1]"},  // SimpleAtod parses "nan"
        Case{"recycle_slack:-nan", "[0, 1]"},
        Case{"per_process_memory_fraction:nan", "[0, 1]"},
        Case{"garbage_collection_threshold:nan", "(0, 1)"},
        Case{"expandable_handle_mb:-3", "multiple of 2"},
        Case{"expandable_handle_mb:8", "not a multiple of expandable_page_mb:6"},
        Case{"expandable_page_mb:8,expandable_handle_mb:12", "expandable_page_mb:8"},
        Case{"expandable_page_mb:1000000", "in [2, 1024]"},
        Case{"large_segment_size_mb:8796093022208", "in [2, 1024]"},
        Case{"expandable_handle_mb:2048", "at most 1024"},
        Case{"justakey", "expected key:value"}}) {
    auto o = ParseOptions(c.conf);
    ASSERT_FALSE(o.ok()) << c.conf;
    EXPECT_NE(o.status().message().find(c.needle), std::string::npos)
        << c.conf << " -> " << o.status().message();
  }
}

TEST(Options, HandleSizesThatHoldWholePagesAreAccepted) {
  auto o = ParseOptions("expandable_handle_mb:12");  // two 6 MiB pages
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->expandable_handle_size, 12 * kMiB);
  o = ParseOptions("expandable_page_mb:4,expandable_handle_mb:12");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->expandable_handle_size, 12 * kMiB);
}

TEST(Options, RoundTripsThroughToString) {
  auto o =
      ParseOptions("max_split_size_mb:256,expandable_segments:True,roundup_power2_divisions:2");
  ASSERT_TRUE(o.ok());
  auto again = ParseOptions(OptionsToString(*o));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->max_split_size, o->max_split_size);
  EXPECT_EQ(again->expandable_segments, o->expandable_segments);
  EXPECT_EQ(again->roundup_power2_divisions, o->roundup_power2_divisions);
}

TEST(Options, ExplicitConfWinsOverEnvironment) {
  ::setenv("VRAMLEDGER_CONF", "max_split_size_mb:100,expandable_segments:True", 1);
  auto o = OptionsFromEnvAndString("max_split_size_mb:300");
  ::unsetenv("VRAMLEDGER_CONF");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_split_size, 300 * kMiB);
  EXPECT_TRUE(o->expandable_segments);
}

TEST(Options, BadEnvironmentIsNamed) {
  ::setenv("VRAMLEDGER_CONF", "nope:1", 1);
  auto o = OptionsFromEnvAndString("");
  ::unsetenv("VRAMLEDGER_CONF");
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("VRAMLEDGER_CONF"), std::string::npos);
}

TEST(Options, ProcessKeysFillProcessOptionsOnly) {
  auto o = ParseOptions(
      "plan:/p/plan.json,dump_dir:/d,max_dumps:3,step_log:/s,preload_quiet:True,"
      "preload_no_exit_dump:True,preload_disable:True");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->process.plan, "/p/plan.json");
  EXPECT_EQ(o->process.dump_dir, "/d");
  EXPECT_EQ(o->process.max_dumps, 3);
  EXPECT_EQ(o->process.step_log, "/s");
  EXPECT_TRUE(o->process.preload_quiet);
  EXPECT_TRUE(o->process.preload_no_exit_dump);
  EXPECT_TRUE(o->process.preload_disable);
  // The allocator's own settings are untouched: the string differs only in process keys.
  const std::string written = OptionsToString(*o);
  EXPECT_EQ(written.substr(0, written.find(",plan:")),
            OptionsToString(Options()).substr(0, OptionsToString(Options()).find(",dump_dir:")));
  auto again = ParseOptions(written);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(OptionsToString(*again), written);
  auto bad = ParseOptions("preload_quiet:1");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'preload_quiet': expected True or False"),
            std::string::npos)
      << bad.status();
}

TEST(Options, DefaultsAreWrittenBackAsBefore) {
  EXPECT_EQ(OptionsToString(Options()),
            "max_non_split_rounding_mb:20,expandable_segments:False,large_segment_size_mb:20,"
            "roundup_power2_divisions:[1:0,2:0,4:0,8:0,16:0,32:0,64:0,128:0,256:0,512:0,1024:0,"
            "2048:0,4096:0,8192:0,16384:0,32768:0],release_lock_on_cudamalloc:False,"
            "per_process_memory_fraction:0,page_recycling:True,expandable_page_mb:6,"
            "recycle_slack:0.006,expandable_handle_mb:0,recycle_tails_first:False,grow_under_cap:True,"
            "keep_old_mappings:True,host_timing:False,dump_dir:./vramledger-dumps,max_dumps:8");
}

TEST(Options, ShimSwitchesComeFromTheirEnvironmentVariables) {
  ::setenv("VRAMLEDGER_PRELOAD_QUIET", "", 1);  // set, even empty, means True (as before)
  ::setenv("VRAMLEDGER_PRELOAD_NO_EXIT_DUMP", "0", 1);
  ::setenv("VRAMLEDGER_CONF", "preload_disable:True", 1);
  auto o = OptionsFromEnvAndString("");
  ::unsetenv("VRAMLEDGER_PRELOAD_QUIET");
  ::unsetenv("VRAMLEDGER_PRELOAD_NO_EXIT_DUMP");
  ::unsetenv("VRAMLEDGER_CONF");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->process.preload_quiet);
  EXPECT_TRUE(o->process.preload_no_exit_dump);
  EXPECT_TRUE(o->process.preload_disable);
  EXPECT_EQ(o->conf_string, "preload_disable:True");  // the variables are not settings strings
  auto unset = OptionsFromEnvAndString("");
  ASSERT_TRUE(unset.ok());
  EXPECT_FALSE(unset->process.preload_quiet);
  EXPECT_FALSE(unset->process.preload_no_exit_dump);
  EXPECT_FALSE(unset->process.preload_disable);
}

TEST(Options, TheTableDocumentsEveryKeyOnceWithItsRealDefault) {
  std::set<std::string> names;
  bool process_seen = false;
  for (const OptionDoc& d : OptionTable()) {
    EXPECT_TRUE(names.insert(d.name).second) << d.name;
    EXPECT_FALSE(d.type.empty() || d.accepted.empty() || d.doc.empty()) << d.name;
    // The allocator's keys come first, then the process's.
    if (d.scope == OptionScope::kProcess) process_seen = true;
    EXPECT_FALSE(process_seen && d.scope == OptionScope::kAllocator) << d.name;
  }
  EXPECT_EQ(names.size(), 29u);
  // Every key written back for default options shows the table's default.
  const std::vector<std::string> items = absl::StrSplit(OptionsToString(Options()), ',');
  for (const std::string& item : items) {
    if (item.find(':') == std::string::npos) continue;  // inside the divisions list
    const std::string key(item.substr(0, item.find(':')));
    for (const OptionDoc& d : OptionTable()) {
      if (d.name != key || d.type == "divisions") continue;
      EXPECT_EQ(item.substr(item.find(':') + 1), d.default_value) << key;
    }
  }
}

TEST(Options, DocsOptionsMdIsGeneratedFromTheTable) {
  const std::string path = std::string(VRAMLEDGER_SOURCE_DIR) + "/docs/options.md";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), OptionsMarkdown())
      << path << " differs from the option tables; regenerate it with "
      << "`python -m vramledger._options --markdown > docs/options.md`";
}

// A served process (install(), the shim) gets expandable segments with page recycling unless
// it says otherwise; the replay and the planner keep torch's defaults.
TEST(Options, RuntimeDefaultsTurnExpandableSegmentsOnAndKeepTorchsOtherwise) {
  const Options defaults = RuntimeDefaults();
  EXPECT_TRUE(defaults.expandable_segments);
  EXPECT_TRUE(defaults.page_recycling);
  EXPECT_FALSE(Options().expandable_segments);
  Options torch_but_expandable;
  torch_but_expandable.expandable_segments = true;
  EXPECT_EQ(OptionsToString(defaults), OptionsToString(torch_but_expandable));

  auto served = OptionsFromEnvAndString("max_split_size_mb:200", RuntimeDefaults());
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_TRUE(served->expandable_segments);
  auto plain = OptionsFromEnvAndString("expandable_segments:False", RuntimeDefaults());
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->expandable_segments);
  auto replay = OptionsFromEnvAndString("");
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_FALSE(replay->expandable_segments);
}

}  // namespace
}  // namespace vramledger
