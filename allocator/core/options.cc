// Parser for the `key:value,...` settings string (PYTORCH_CUDA_ALLOC_CONF syntax), driven by the
// option tables (option_tables.cc); writing options back; the environment. Thread-safe.
#include "vramledger/options.h"

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/nearest_name.h"
#include "core/option_field.h"

namespace vramledger {
namespace {

// Debian's Abseil 20220623 has its own string_view type, distinct from string_view.
using absl::string_view;

template <typename S>
const OptionField<S>* Find(const std::vector<OptionField<S>>& fields, string_view key) {
  for (const OptionField<S>& f : fields) {
    if (f.doc.name == key) return &f;
  }
  return nullptr;
}

// Stores one `key:value` into the struct whose table owns the key.
absl::Status ApplyOne(string_view key, string_view value, Options* o) {
  if (const OptionField<Options>* f = Find(AllocatorOptionFields(), key)) return f->set(value, o);
  if (const OptionField<ProcessOptions>* f = Find(ProcessOptionFields(), key)) {
    return f->set(value, &o->process);
  }
  std::vector<std::string> names;
  for (const OptionDoc& d : OptionTable()) names.push_back(d.name);
  return absl::InvalidArgumentError(absl::StrCat("unknown option '", key, "'",
                                                 DidYouMean(key, names),
                                                 "; accepted keys: ", absl::StrJoin(names, ", ")));
}

// Splits on commas that are not inside [...]. A ']' without its '[' or a '[' left open is an
// error: either would make the commas after it part of one value, hiding the keys there.
absl::StatusOr<std::vector<std::string>> SplitTopLevel(string_view conf) {
  std::vector<std::string> items(1);
  int depth = 0;
  for (char c : conf) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) continue;
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unbalanced brackets in '", conf, "': a ']' without its '['"));
    }
    if (c == ',' && depth == 0) {
      items.emplace_back();
    } else {
      items.back().push_back(c);
    }
  }
  if (depth > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unbalanced brackets in '", conf, "': a '[' without its ']'"));
  }
  return items;
}

}  // namespace

absl::Status BadOptionValue(string_view key, string_view value, string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("bad value '", value, "' for option '", key, "': expected ", expected));
}

const std::vector<OptionDoc>& OptionTable() {
  static const auto* table = [] {
    auto* docs = new std::vector<OptionDoc>;
    for (const auto& f : AllocatorOptionFields()) docs->push_back(f.doc);
    for (const auto& f : ProcessOptionFields()) docs->push_back(f.doc);
    return docs;
  }();
  return *table;
}

std::string_view OptionScopeName(OptionScope scope) {
  return scope == OptionScope::kAllocator ? "allocator" : "process";
}

namespace {

// A Markdown table cell: '|' would end the cell, an empty value shows as "(empty)".
std::string Cell(string_view text, bool code = false) {
  if (text.empty()) return "(empty)";
  const std::string escaped = absl::StrReplaceAll(text, {{"|", "\\|"}});
  return code ? absl::StrCat("`", escaped, "`") : escaped;
}

void AppendTable(OptionScope scope, std::string* out) {
  absl::StrAppend(out, "| key | type | default | accepted values | meaning |\n",
                  "|---|---|---|---|---|\n");
  for (const OptionDoc& d : OptionTable()) {
    if (d.scope != scope) continue;
    const std::string meaning =
        d.env.empty() ? d.doc : absl::StrCat(d.doc, "; also set by `", d.env, "`");
    absl::StrAppend(out, "| ", Cell(d.name, true), " | ", d.type, " | ",
                    Cell(d.default_value, true), " | ", Cell(d.accepted), " | ", Cell(meaning),
                    " |\n");
  }
}

}  // namespace

std::string OptionsMarkdown() {
  std::string out =
      "<!-- Generated from the option tables (allocator/core/option_tables.cc) by\n"
      "     `python -m vramledger._options --markdown > docs/options.md`; options_test checks\n"
      "     that this file matches them. Do not edit by hand. -->\n"
      "# Options\n\n"
      "Every option is a `key:value` pair of one settings string, written as torch's\n"
      "`PYTORCH_CUDA_ALLOC_CONF` is (`key:value,key:value`, whitespace ignored, lists in\n"
      "`[...]`, booleans `True` or `False`). Give it as keyword arguments of\n"
      "`vramledger.install(...)`, as `--conf` of the `vramledger` command, or in the\n"
      "environment variable `VRAMLEDGER_CONF`; an explicit setting wins over the environment.\n"
      "An unknown key or a bad value is refused with a message naming the key and what it\n"
      "accepts.\n\n"
      "## Allocator options\n\n"
      "Settings of each device's allocator. Torch's keys come first and keep torch's meaning;\n"
      "those marked \"validated and ignored\" are accepted so that a torch settings string\n"
      "works unchanged.\n\n";
  AppendTable(OptionScope::kAllocator, &out);
  absl::StrAppend(&out,
                  "\n## Process options\n\n"
                  "Settings of the process around the allocators: the memory plan, forensic "
                  "dumps,\nthe step log and the LD_PRELOAD shim's switches. They are written in "
                  "the same\nsettings string; the allocator itself never reads them.\n\n");
  AppendTable(OptionScope::kProcess, &out);
  absl::StrAppend(&out,
                  "\n## Environment variables\n\n"
                  "| variable | same as |\n|---|---|\n"
                  "| `VRAMLEDGER_CONF` | the whole settings string (an explicit one wins) |\n");
  for (const OptionDoc& d : OptionTable()) {
    if (d.env.empty()) continue;
    absl::StrAppend(&out, "| `", d.env, "` | `", d.name, ":True` when set, whatever its value |\n");
  }
  return out;
}

absl::StatusOr<Options> ParseOptions(std::string_view std_conf, const Options& base) {
  const string_view conf(std_conf.data(), std_conf.size());
  Options out = base;
  absl::StatusOr<std::vector<std::string>> items = SplitTopLevel(conf);
  if (!items.ok()) return items.status();
  for (const std::string& item : *items) {
    if (item.empty()) continue;
    const std::size_t colon = item.find(':');
    if (colon == std::string::npos || colon == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed option '", item, "' in '", conf, "': expected key:value"));
    }
    absl::Status s =
        ApplyOne(string_view(item).substr(0, colon), string_view(item).substr(colon + 1), &out);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(s.message(), " (in '", conf, "')"));
  }
  // A handle holds whole pages (expandable.cc): refuse a size the page does not divide rather than
  // round it down silently (expandable_handle_mb:8 with 6 MiB pages would act as one page).
  if (out.expandable_handle_size != 0 &&
      out.expandable_handle_size % out.expandable_page_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expandable_handle_mb:", out.expandable_handle_size / kMiB,
                     " is not a multiple of expandable_page_mb:", out.expandable_page_size / kMiB,
                     " (a handle holds whole pages; e.g. expandable_handle_mb:",
                     2 * out.expandable_page_size / kMiB, ") (in '", conf, "')"));
  }
  if (!conf.empty()) {
    out.conf_string =
        base.conf_string.empty() ? std::string(conf) : absl::StrCat(base.conf_string, ",", conf);
  }
  return out;
}

std::string OptionsToString(const Options& o) {
  std::vector<std::string> parts;
  for (const auto& f : AllocatorOptionFields()) {
    if (std::optional<std::string> v = f.get(o)) parts.push_back(absl::StrCat(f.doc.name, ":", *v));
  }
  for (const auto& f : ProcessOptionFields()) {
    if (std::optional<std::string> v = f.get(o.process)) {
      parts.push_back(absl::StrCat(f.doc.name, ":", *v));
    }
  }
  return absl::StrJoin(parts, ",");
}

Options RuntimeDefaults() {
  Options defaults;
  defaults.expandable_segments = true;
  return defaults;
}

absl::StatusOr<Options> OptionsFromEnvAndString(std::string_view explicit_conf,
                                                const Options& defaults) {
  Options base = defaults;
  for (const auto& f : ProcessOptionFields()) {
    const char* value = f.doc.env.empty() ? nullptr : std::getenv(f.doc.env.c_str());
    if (value == nullptr) continue;
    // A switch's variable means True when set, whatever its value (an empty one included).
    if (absl::Status s = f.set(f.doc.type == "bool" ? "True" : value, &base.process); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(f.doc.env, ": ", s.message()));
    }
  }
  if (const char* env = std::getenv("VRAMLEDGER_CONF"); env != nullptr && *env != '\0') {
    auto from_env = ParseOptions(env, base);
    if (!from_env.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("VRAMLEDGER_CONF: ", from_env.status().message()));
    }
    base = *std::move(from_env);
  }
  return ParseOptions(explicit_conf, base);
}

}  // namespace vramledger
