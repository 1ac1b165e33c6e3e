// The plan parser: nlohmann for the values, JsonLineIndex for their lines, and one check per
// field, each error naming the file, the line and the field. Schema: docs/design/plan-file.md.
#include "guard/plan.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "core/nearest_name.h"
#include "guard/json_lines.h"
#include "nlohmann/json.hpp"

namespace vramledger::guard {
namespace {

using Json = nlohmann::json;

inline absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr std::string_view kTopKeys[] = {"vramledger_plan", "comment",  "categories",
                                         "limit",           "headroom", "warn_at",
                                         "category_limits", "devices",  "estimate"};
constexpr std::string_view kDeviceKeys[] = {"comment", "limit", "headroom", "warn_at",
                                            "category_limits"};

// Error reporting for one plan text: locations come from the line index.
class Reporter {
 public:
  Reporter(std::string_view path, std::string_view text) : path_(path), index_(text) {}

  // `json_path` is slash-joined ("devices/1/limit"); the field shown is dotted.
  absl::Status Error(std::string_view json_path, std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(AV(path_), ":", index_.LineOf(json_path),
                                                   ": field '", Field(json_path), "': ", AV(what)));
  }
  int LineOf(std::string_view json_path) const { return index_.LineOf(json_path); }
  // A key written twice in one object: an error at its second line (nlohmann keeps the last).
  absl::Status CheckNoDuplicate() const {
    const auto& [json_path, line] = index_.first_duplicate();
    if (line == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(AV(path_), ":", line, ": field '", Field(json_path),
                     "': given twice (a plan names each key once; JSON would keep the last)"));
  }
  static std::string Field(std::string_view json_path) {
    return absl::StrReplaceAll(AV(json_path), {{"/", "."}});
  }

 private:
  std::string path_;
  JsonLineIndex index_;
};

std::string Join(std::string_view prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : absl::StrCat(AV(prefix), "/", AV(key));
}

template <std::size_t N>
absl::Status CheckKeys(const Reporter& r, const Json& object, std::string_view prefix,
                       const std::string_view (&allowed)[N]) {
  for (const auto& [key, value] : object.items()) {
    (void)value;
    if (std::find(std::begin(allowed), std::end(allowed), key) == std::end(allowed)) {
      std::vector<std::string> names(std::begin(allowed), std::end(allowed));
      return r.Error(Join(prefix, key),
                     absl::StrCat("unknown key '", key, "'", DidYouMean(key, names),
                                  "; accepted keys here: ", absl::StrJoin(names, ", ")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PlanValue> SizeField(const Reporter& r, const Json& value,
                                    std::string_view json_path) {
  absl::StatusOr<SizeSpec> size = ParseSize(value);
  if (!size.ok()) return r.Error(json_path, std::string(size.status().message()));
  PlanValue v;
  v.size = *std::move(size);
  v.line = r.LineOf(json_path);
  v.field = Reporter::Field(json_path);
  return v;
}

bool ValidCategoryName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

absl::Status ParseCategories(const Reporter& r, const Json& list, Plan* plan) {
  if (!list.is_array()) {
    return r.Error("categories",
                   absl::StrCat("expected a list of category names, got ", list.dump()));
  }
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::string at = absl::StrCat("categories/", i);
    if (!list[i].is_string() || !ValidCategoryName(list[i].get<std::string>())) {
      return r.Error(at, absl::StrCat("expected a category name (letters, digits, '_', '-', '.'; "
                                      "at most 64), got ",
                                      list[i].dump()));
    }
    const std::string name = list[i].get<std::string>();
    if (plan->HasCategory(name)) {
      return r.Error(
          at, absl::StrCat("category '", name, "' is ",
                           std::find(kBuiltinCategories.begin(), kBuiltinCategories.end(), name) !=
                                   kBuiltinCategories.end()
                               ? "built in; declare only new ones"
                               : "declared twice"));
    }
    plan->categories.push_back(name);
  }
  return absl::OkStatus();
}

absl::Status ParseRules(const Reporter& r, const Json& object, std::string_view prefix,
                        const Plan& plan, PlanRules* rules) {
  for (std::string_view key : {"limit", "headroom", "warn_at"}) {
    auto it = object.find(std::string(key));
    if (it == object.end()) continue;
    absl::StatusOr<PlanValue> v = SizeField(r, *it, Join(prefix, key));
    if (!v.ok()) return v.status();
    std::optional<PlanValue>& slot = key == "limit"      ? rules->limit
                                     : key == "headroom" ? rules->headroom
                                                         : rules->warn_at;
    slot = *std::move(v);
  }
  if (rules->limit && rules->limit->size.kind == SizeSpec::Kind::kBytes &&
      rules->limit->size.bytes == 0) {
    return r.Error(Join(prefix, "limit"), "a limit must be more than 0 bytes");
  }
  auto categories = object.find("category_limits");
  if (categories == object.end()) return absl::OkStatus();
  const std::string cat_path = Join(prefix, "category_limits");
  if (!categories->is_object()) {
    return r.Error(cat_path, absl::StrCat("expected an object {\"category\": size, ...}, got ",
                                          categories->dump()));
  }
  for (const auto& [name, value] : categories->items()) {
    const std::string at = Join(cat_path, name);
    if (!plan.HasCategory(name)) {
      return r.Error(at, absl::StrCat("unknown category '", name,
                                      "'; known categories: ", absl::StrJoin(plan.categories, ", "),
                                      " (declare others in the top-level \"categories\" list)"));
    }
    absl::StatusOr<PlanValue> v = SizeField(r, value, at);
    if (!v.ok()) return v.status();
    rules->category_limits[name] = *std::move(v);
  }
  return absl::OkStatus();
}

absl::Status ParseDevices(const Reporter& r, const Json& devices, int device_count, Plan* plan) {
  if (!devices.is_object()) {
    return r.Error("devices", absl::StrCat("expected an object {\"0\": {...}, ...} keyed by "
                                           "device index, got ",
                                           devices.dump()));
  }
  for (const auto& [key, value] : devices.items()) {
    const std::string at = Join("devices", key);
    int index = -1;
    const bool digits =
        !key.empty() && key.size() <= 4 &&
        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits || !absl::SimpleAtoi(key, &index)) {
      return r.Error(at,
                     absl::StrCat("unknown device '", key,
                                  "': devices are keyed by their CUDA index (\"0\", \"1\", ...)"));
    }
    if (device_count > 0 && index >= device_count) {
      return r.Error(at, absl::StrCat("unknown device ", index, ": this process sees ",
                                      device_count, " CUDA device", device_count == 1 ? "" : "s",
                                      " (0-", device_count - 1, ")"));
    }
    if (!value.is_object()) {
      return r.Error(at, absl::StrCat("expected an object of rules, got ", value.dump()));
    }
    if (absl::Status s = CheckKeys(r, value, at, kDeviceKeys); !s.ok()) return s;
    PlanRules rules;
    if (absl::Status s = ParseRules(r, value, at, *plan, &rules); !s.ok()) return s;
    plan->devices[index] = std::move(rules);
  }
  return absl::OkStatus();
}

// nlohmann's what(): "[json.exception.parse_error.101] parse error at line 3, column 5: ...";
// keep the part after the location.
std::string SyntaxMessage(const std::string& what) {
  const std::size_t colon = what.find(": ");
  const std::string message = colon == std::string::npos ? what : what.substr(colon + 2);
  // nlohmann's "last read: '...'" may end inside a multi-byte character: bytes past ASCII are
  // written \xNN so that the message stays UTF-8 (Python decodes it).
  std::string out;
  for (const char c : message) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x80) {
      out.push_back(c);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(byte, absl::kZeroPad2));
    }
  }
  return out;
}

}  // namespace

bool Plan::HasCategory(std::string_view name) const {
  return std::find(categories.begin(), categories.end(), name) != categories.end();
}

absl::StatusOr<Plan> ParsePlan(std::string_view text, std::string_view path, int device_count) {
  Json doc;
  try {
    doc = Json::parse(text.begin(), text.end());
  } catch (const Json::parse_error& e) {
    const std::size_t offset = e.byte > 0 ? e.byte - 1 : 0;
    return absl::InvalidArgumentError(absl::StrCat(AV(path), ":", LineOfOffset(text, offset),
                                                   ": syntax error: ", SyntaxMessage(e.what())));
  } catch (const Json::exception& e) {
    // Not a syntax error but still the file's fault, e.g. "number overflow parsing '1e400'"
    // (out_of_range): an uncaught one would end the process.
    const std::string what = e.what();  // "[json.exception.out_of_range.406] number overflow..."
    const std::size_t end = what.find("] ");
    return absl::InvalidArgumentError(absl::StrCat(
        AV(path), ": ", end == std::string::npos ? what : what.substr(end + 2)));
  }
  const Reporter r(path, text);
  if (absl::Status s = r.CheckNoDuplicate(); !s.ok()) return s;
  if (!doc.is_object()) {
    return r.Error("", absl::StrCat("a plan is a JSON object, got ", doc.type_name()));
  }
  Plan plan;
  plan.path = std::string(path);
  plan.categories.assign(kBuiltinCategories.begin(), kBuiltinCategories.end());
  if (absl::Status s = CheckKeys(r, doc, "", kTopKeys); !s.ok()) return s;
  if (auto it = doc.find("vramledger_plan"); it != doc.end() && *it != 1) {
    return r.Error("vramledger_plan", absl::StrCat("unsupported plan version ", it->dump(),
                                                   "; this vramledger reads 1"));
  }
  if (auto it = doc.find("categories"); it != doc.end()) {
    if (absl::Status s = ParseCategories(r, *it, &plan); !s.ok()) return s;
  }
  if (absl::Status s = ParseRules(r, doc, "", plan, &plan.all); !s.ok()) return s;
  if (auto it = doc.find("devices"); it != doc.end()) {
    if (absl::Status s = ParseDevices(r, *it, device_count, &plan); !s.ok()) return s;
  }
  if (auto it = doc.find("estimate"); it != doc.end() && !it->is_object()) {
    return r.Error("estimate", "expected an object (written by `vramledger plan`; informational)");
  }
  return plan;
}

absl::StatusOr<Plan> LoadPlanFile(std::string_view path, int device_count) {
  std::error_code ec;
  if (std::filesystem::is_directory(std::string(path), ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(AV(path), ": is a directory; the plan is a JSON file"));
  }
  std::ifstream in{std::string(path), std::ios::binary};
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(AV(path), ": cannot read the plan file: ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return ParsePlan(text.str(), path, device_count);
}

}  // namespace vramledger::guard
