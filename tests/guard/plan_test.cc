// Plan files: sizes, line lookup, good plans, and every kind of error naming file, line and field;
// resolution against a card (fractions, limit over the card, headroom, warn_at).
#include "guard/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "guard/json_lines.h"
#include "guard/size_spec.h"

namespace vramledger::guard {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr std::uint64_t kGiBu = 1ull << 30;
constexpr std::uint64_t kH200 = 150109880320ull;  // torch's total_memory of an H200

std::string Message(const absl::Status& s) { return std::string(s.message()); }

absl::Status ParseError(const std::string& text, int device_count = 8) {
  auto plan = ParsePlan(text, "plan.json", device_count);
  EXPECT_FALSE(plan.ok()) << "parsed: " << text;
  return plan.ok() ? absl::OkStatus() : plan.status();
}

TEST(SizeSpecTest, UnitsFractionsAndPercent) {
  auto s = ParseSizeString("40GiB");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->bytes, 40 * kGiBu);
  EXPECT_EQ(ParseSizeString("1.5 gib")->bytes, 3 * kGiBu / 2);
  EXPECT_EQ(ParseSizeString("512MiB")->bytes, 512ull << 20);
  EXPECT_EQ(ParseSizeString("2KiB")->bytes, 2048u);
  EXPECT_EQ(ParseSizeString("1TB")->bytes, 1000000000000ull);
  EXPECT_EQ(ParseSizeString("80 GB")->bytes, 80000000000ull);
  EXPECT_EQ(ParseSizeString("100b")->bytes, 100u);
  EXPECT_EQ(ParseSizeString("4096")->bytes, 4096u);
  auto pct = ParseSizeString("25%");
  ASSERT_TRUE(pct.ok());
  EXPECT_EQ(pct->kind, SizeSpec::Kind::kFraction);
  EXPECT_DOUBLE_EQ(pct->fraction, 0.25);
  EXPECT_EQ(pct->Resolve(1000), 250u);
  EXPECT_EQ(ParseSize(nlohmann::json(0.5))->Resolve(kH200), kH200 / 2);
  EXPECT_EQ(ParseSize(nlohmann::json(1.0))->Resolve(kH200), kH200);
  EXPECT_EQ(ParseSize(nlohmann::json(1073741824))->bytes, kGiBu);
}

TEST(SizeSpecTest, RejectsWhatIsNotASize) {
  for (const char* bad : {"40 GiBs", "GiB", "-1GiB", "lots", "150%", "0%", "1.5", "0x10GiB"}) {
    EXPECT_FALSE(ParseSizeString(bad).ok()) << bad;
  }
  EXPECT_THAT(Message(ParseSizeString("1.5B").status()),
              HasSubstr("a number of bytes (B) is whole; for gigabytes write GB or GiB"));
  EXPECT_EQ(ParseSizeString("4096B")->bytes, 4096u);
  EXPECT_FALSE(ParseSize(nlohmann::json(-5)).ok());
  EXPECT_FALSE(ParseSize(nlohmann::json(1.5)).ok());
  EXPECT_FALSE(ParseSize(nlohmann::json(true)).ok());
  EXPECT_THAT(Message(ParseSize(nlohmann::json(2.0)).status()), HasSubstr("(0, 1]"));
}

TEST(JsonLineIndexTest, LinesOfKeysElementsAndFallback) {
  const std::string text =
      "{\n"
      "  \"limit\": \"40GiB\",\n"
      "  \"categories\": [\"a\",\n"
      "     \"b\"],\n"
      "  \"devices\": {\"1\": {\n"
      "      \"limit\": 5}}\n"
      "}\n";
  JsonLineIndex index(text);
  EXPECT_EQ(index.LineOf(""), 1);
  EXPECT_EQ(index.LineOf("limit"), 2);
  EXPECT_EQ(index.LineOf("categories"), 3);
  EXPECT_EQ(index.LineOf("categories/0"), 3);
  EXPECT_EQ(index.LineOf("categories/1"), 4);
  EXPECT_EQ(index.LineOf("devices/1"), 5);
  EXPECT_EQ(index.LineOf("devices/1/limit"), 6);
  EXPECT_EQ(index.LineOf("devices/1/nothing"), 5);  // falls back to the parent
  EXPECT_EQ(LineOfOffset("a\nb\nc", 4), 3);
}

constexpr char kGoodPlan[] = R"({
  "vramledger_plan": 1,
  "comment": "GPT-2 medium, batch 8",
  "categories": ["kv_cache"],
  "limit": "40GiB",
  "headroom": "4GiB",
  "warn_at": 0.9,
  "category_limits": {
    "activations": "20GiB",
    "weights": 0.05,
    "kv_cache": "25%"
  },
  "devices": {
    "1": {"limit": "30GiB", "category_limits": {"activations": "10GiB"}}
  },
  "estimate": {"total_bytes": 1}
})";

TEST(PlanTest, ParsesAGoodPlanWithLines) {
  auto plan = ParsePlan(kGoodPlan, "plan.json", 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, "plan.json");
  EXPECT_TRUE(plan->HasCategory("kv_cache"));
  EXPECT_TRUE(plan->HasCategory("communication"));
  ASSERT_TRUE(plan->all.limit.has_value());
  EXPECT_EQ(plan->all.limit->line, 5);
  EXPECT_EQ(plan->all.limit->field, "limit");
  EXPECT_EQ(plan->all.headroom->line, 6);
  EXPECT_EQ(plan->all.warn_at->line, 7);
  EXPECT_EQ(plan->all.category_limits.at("activations").line, 9);
  EXPECT_EQ(plan->all.category_limits.at("kv_cache").field, "category_limits.kv_cache");
  ASSERT_EQ(plan->devices.count(1), 1u);
  EXPECT_EQ(plan->devices.at(1).limit->line, 14);
  EXPECT_EQ(plan->devices.at(1).limit->field, "devices.1.limit");
}

TEST(PlanTest, ResolvesPerDeviceOverridesAndFractions) {
  auto plan = ParsePlan(kGoodPlan, "plan.json", 2);
  ASSERT_TRUE(plan.ok());
  auto d0 = ResolvePlan(*plan, 0, kH200);
  ASSERT_TRUE(d0.ok()) << d0.status();
  EXPECT_EQ(d0->limit, 40 * kGiBu);
  EXPECT_EQ(d0->headroom, 4 * kGiBu);
  EXPECT_EQ(d0->cap(), 36 * kGiBu);
  EXPECT_TRUE(d0->enforces_limit);
  EXPECT_EQ(d0->warn_bytes, static_cast<std::uint64_t>(0.9 * 36 * kGiBu));
  EXPECT_EQ(d0->warn_line, 7);
  ASSERT_EQ(d0->categories.size(), 3u);  // by name: activations, kv_cache, weights
  EXPECT_EQ(d0->categories[0].name, "activations");
  EXPECT_EQ(d0->categories[0].bytes, 20 * kGiBu);
  EXPECT_EQ(d0->categories[1].bytes, kH200 / 4);
  EXPECT_EQ(d0->categories[2].bytes, static_cast<std::uint64_t>(0.05 * kH200));
  auto d1 = ResolvePlan(*plan, 1, kH200);
  ASSERT_TRUE(d1.ok());
  EXPECT_EQ(d1->limit, 30 * kGiBu);
  EXPECT_EQ(d1->limit_line, 14);
  EXPECT_EQ(d1->categories[0].bytes, 10 * kGiBu);
  EXPECT_EQ(d1->categories[0].line, 14);
}

TEST(PlanTest, AnEmptyPlanCapsNothingAndHeadroomAloneCapsTheCard) {
  auto empty = ResolvePlan(*ParsePlan("{}", "p.json", 0), 0, kH200);
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(empty->enforces_limit);
  EXPECT_EQ(empty->limit, kH200);
  auto headroom = ResolvePlan(*ParsePlan(R"({"headroom": 0.1})", "p.json", 0), 0, kH200);
  ASSERT_TRUE(headroom.ok());
  EXPECT_TRUE(headroom->enforces_limit);
  EXPECT_EQ(headroom->cap(), kH200 - static_cast<std::uint64_t>(0.1 * kH200));
  EXPECT_EQ(headroom->limit_line, 0);
  EXPECT_EQ(headroom->headroom_line, 1);
}

TEST(PlanErrorTest, SyntaxErrorNamesFileAndLine) {
  const absl::Status s = ParseError("{\n  \"limit\": \"40GiB\",\n  \"headroom\" 4\n}");
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(Message(s), StartsWith("plan.json:3: syntax error: "));
}

TEST(PlanErrorTest, UnknownKeyNamesFieldAndLine) {
  EXPECT_THAT(Message(ParseError("{\n  \"limit\": 1,\n  \"limt\": 2\n}")),
              StartsWith("plan.json:3: field 'limt': unknown key 'limt' (did you mean 'limit'?); "
                         "accepted keys here: "));
  EXPECT_THAT(Message(ParseError("{\"devices\": {\n \"0\": {\"categories\": []}}}")),
              StartsWith("plan.json:2: field 'devices.0.categories': unknown key"));
}

// JSON parsers keep one of two values of a repeated key silently; a plan refuses it, at any depth.
TEST(PlanErrorTest, AKeyGivenTwiceNamesItsSecondLine) {
  EXPECT_EQ(Message(ParseError("{\"limit\": \"40GiB\",\n \"limit\": \"50GiB\"}")),
            "plan.json:2: field 'limit': given twice (a plan names each key once; JSON would keep "
            "the last)");
  EXPECT_THAT(Message(ParseError("{\"devices\": {\"0\": {\"limit\": 1,\n\n \"limit\": 2}}}")),
              StartsWith("plan.json:3: field 'devices.0.limit': given twice"));
}

TEST(PlanErrorTest, UnknownDevice) {
  const std::string text = "{\n  \"devices\": {\n    \"0\": {},\n    \"2\": {\"limit\": 1}\n  }\n}";
  EXPECT_EQ(Message(ParseError(text, 2)),
            "plan.json:4: field 'devices.2': unknown device 2: this process sees 2 CUDA devices "
            "(0-1)");
  EXPECT_TRUE(ParsePlan(text, "plan.json", 0).ok());  // device count unknown: not checked
  EXPECT_THAT(Message(ParseError("{\"devices\": {\"cuda:0\": {}}}")),
              StartsWith("plan.json:1: field 'devices.cuda:0': unknown device 'cuda:0'"));
}

TEST(PlanErrorTest, UnknownCategory) {
  const std::string text =
      "{\n  \"category_limits\": {\n    \"activations\": \"1GiB\",\n    \"activation\": 1\n  }\n}";
  EXPECT_THAT(Message(ParseError(text)),
              StartsWith("plan.json:4: field 'category_limits.activation': unknown category "
                         "'activation'; known categories: weights, gradients, optimizer, "
                         "activations, workspace, communication, untagged"));
  const std::string device =
      "{\"categories\": [\"kv\"],\n \"devices\": {\"0\": {\"category_limits\": {\n \"kvcache\": "
      "1}}}}";
  EXPECT_THAT(
      Message(ParseError(device)),
      StartsWith("plan.json:3: field 'devices.0.category_limits.kvcache': unknown category"));
}

TEST(PlanErrorTest, BadCategoryDeclarations) {
  EXPECT_THAT(Message(ParseError("{\"categories\": [\"ok\",\n \"weights\"]}")),
              StartsWith("plan.json:2: field 'categories.1': category 'weights' is built in"));
  EXPECT_THAT(Message(ParseError("{\"categories\": [\"a\", \"a\"]}")), HasSubstr("declared twice"));
  EXPECT_THAT(Message(ParseError("{\"categories\": [\"has space\"]}")),
              StartsWith("plan.json:1: field 'categories.0': expected a category name"));
  EXPECT_THAT(Message(ParseError("{\"categories\": \"kv\"}")),
              StartsWith("plan.json:1: field 'categories': expected a list"));
}

TEST(PlanErrorTest, BadSizesAndTypes) {
  EXPECT_THAT(Message(ParseError("{\n\"limit\": \"40 gigs\"}")),
              StartsWith("plan.json:2: field 'limit': expected bytes (an integer), a string"));
  EXPECT_THAT(Message(ParseError("{\"warn_at\": 1.5}")),
              StartsWith("plan.json:1: field 'warn_at': a fraction of the card must be in (0, 1]"));
  EXPECT_THAT(Message(ParseError("{\"limit\": 0}")),
              StartsWith("plan.json:1: field 'limit': a limit must be more than 0 bytes"));
  EXPECT_THAT(Message(ParseError("{\"category_limits\": [1]}")),
              StartsWith("plan.json:1: field 'category_limits': expected an object"));
  EXPECT_THAT(Message(ParseError("[1, 2]")),
              StartsWith("plan.json:1: field '': a plan is a JSON object"));
  EXPECT_THAT(Message(ParseError("{\"vramledger_plan\": 2}")),
              HasSubstr("unsupported plan version 2"));
}

TEST(PlanErrorTest, LimitLargerThanTheCard) {
  auto plan = ParsePlan("{\n  \"limit\": \"200GiB\"\n}", "plan.json", 1);
  ASSERT_TRUE(plan.ok());
  const auto resolved = ResolvePlan(*plan, 0, kH200);
  ASSERT_FALSE(resolved.ok());
  EXPECT_EQ(Message(resolved.status()),
            "plan.json:2: field 'limit': limit 200GiB = 200.00 GiB (214748364800 bytes) exceeds "
            "the card's total memory, 139.80 GiB (150109880320 bytes) on device 0");
  auto category = ParsePlan("{\"category_limits\": {\n\"weights\": \"1TiB\"}}", "plan.json", 1);
  EXPECT_THAT(Message(ResolvePlan(*category, 0, kH200).status()),
              StartsWith("plan.json:2: field 'category_limits.weights': category limit 1TiB"));
}

TEST(PlanErrorTest, HeadroomAndWarnAtMustFitTheLimit) {
  auto plan = ParsePlan("{\"limit\": \"10GiB\",\n \"headroom\": \"10GiB\"}", "plan.json", 1);
  EXPECT_THAT(Message(ResolvePlan(*plan, 0, kH200).status()),
              StartsWith("plan.json:2: field 'headroom': headroom 10.00 GiB"));
  auto warn = ParsePlan("{\"limit\": \"10GiB\",\n\n \"warn_at\": \"11GiB\"}", "plan.json", 1);
  EXPECT_THAT(Message(ResolvePlan(*warn, 0, kH200).status()),
              StartsWith("plan.json:3: field 'warn_at': warn_at 11.00 GiB"));
}

TEST(PlanErrorTest, UnreadableFileNamesThePath) {
  auto plan = LoadPlanFile("/nonexistent/plan.json", 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(absl::IsNotFound(plan.status()));
  EXPECT_THAT(Message(plan.status()),
              StartsWith("/nonexistent/plan.json: cannot read the plan file"));
}

TEST(PlanErrorTest, ADirectoryIsNotAPlan) {
  auto plan = LoadPlanFile(::testing::TempDir(), 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(plan.status()));
  EXPECT_THAT(Message(plan.status()), HasSubstr(": is a directory; the plan is a JSON file"));
}

TEST(PlanTest, LoadsAFile) {
  const std::string path = ::testing::TempDir() + "/vl_plan_test.json";
  std::ofstream(path) << "{\n  \"limit\": 0.5\n}\n";
  auto plan = LoadPlanFile(path, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, path);
  EXPECT_EQ(ResolvePlan(*plan, 0, kH200)->limit, kH200 / 2);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace vramledger::guard
