// Parser for the `key:value,...` settings string (PYTORCH_CUDA_ALLOC_CONF syntax) and the
// table of accepted keys. Pure functions; thread-safe.
#include "vramledger/options.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/nearest_name.h"

namespace vramledger {
namespace {

// Debian's Abseil 20220623 has its own string_view type, distinct from string_view.
using absl::string_view;

absl::Status Bad(string_view key, string_view value, string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("bad value '", value, "' for option '", key, "': expected ", expected));
}

absl::StatusOr<bool> ParseBool(string_view key, string_view value) {
  if (value == "True") return true;
  if (value == "False") return false;
  return Bad(key, value, "True or False (as PYTORCH_CUDA_ALLOC_CONF)");
}

absl::StatusOr<double> ParseFraction(string_view key, string_view value, bool open) {
  double v = 0;
  // Written as !(in range) so that "nan", which SimpleAtod accepts, is refused.
  if (!absl::SimpleAtod(value, &v) || !(v >= 0.0 && v <= 1.0) || (open && (v <= 0.0 || v >= 1.0))) {
    return Bad(key, value, open ? "a number in (0, 1)" : "a number in [0, 1]");
  }
  return v;
}

absl::StatusOr<std::size_t> ParseMiB(string_view key, string_view value, std::size_t min_mib,
                                     std::size_t max_mib = SIZE_MAX >> 20) {
  std::uint64_t v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < min_mib || v > max_mib) {
    return Bad(key, value,
               max_mib == (SIZE_MAX >> 20)
                   ? absl::StrCat("an integer number of MiB, at least ", min_mib)
                   : absl::StrCat("an integer number of MiB in [", min_mib, ", ", max_mib, "]"));
  }
  return static_cast<std::size_t>(v) * kMiB;
}

// vramledger's sizes of one segment or one physical page: past 1 GiB every request on a smaller
// card would fail with a misleading out-of-memory error (a tester's finding: 976 GiB pages).
constexpr std::size_t kMaxSegmentOrPageMiB = 1024;

// "4" or "[256:1,512:2,1024:4,>:8]": keys are MiB powers of two, '>' means every later interval.
absl::Status ParseDivisions(string_view key, string_view value, Options* out) {
  auto check_divisions = [&](string_view text, std::size_t* d) -> absl::Status {
    if (!absl::SimpleAtoi(text, d) || (*d > 1 && (*d & (*d - 1)) != 0)) {
      return Bad(key, value, "divisions that are 0, 1 or a power of two");
    }
    return absl::OkStatus();
  };
  if (!absl::ConsumePrefix(&value, "[")) {
    std::size_t d = 0;
    if (auto s = check_divisions(value, &d); !s.ok()) return s;
    out->roundup_power2_divisions.fill(d);
    return absl::OkStatus();
  }
  if (!absl::ConsumeSuffix(&value, "]")) return Bad(key, value, "a list closed by ']'");
  int last_index = -1;
  for (string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    std::vector<string_view> kv = absl::StrSplit(item, ':');
    if (kv.size() != 2) return Bad(key, item, "'MiB:divisions' or '>:divisions'");
    std::size_t d = 0;
    if (auto s = check_divisions(kv[1], &d); !s.ok()) return s;
    if (kv[0] == ">") {
      for (int i = last_index + 1; i < kRoundupPower2Intervals; ++i) {
        out->roundup_power2_divisions[i] = d;
      }
      continue;
    }
    std::uint64_t mib = 0;
    if (!absl::SimpleAtoi(kv[0], &mib) || mib == 0 || (mib & (mib - 1)) != 0) {
      return Bad(key, item, "an interval start in MiB that is a power of two");
    }
    int index = 0;
    while ((std::uint64_t{1} << index) < mib) ++index;
    if (index >= kRoundupPower2Intervals)
      return Bad(key, item, "an interval start up to 32768 MiB");
    out->roundup_power2_divisions[index] = d;
    last_index = index;
  }
  return absl::OkStatus();
}

// A True / False key's value into `*out`; `*out` is unchanged on a bad value.
absl::Status SetBool(string_view key, string_view value, bool* out) {
  absl::StatusOr<bool> v = ParseBool(key, value);
  if (v.ok()) *out = *v;
  return v.status();
}

absl::Status ApplyOne(string_view key, string_view value, Options* o) {
  if (key == "max_split_size_mb") {
    auto v = ParseMiB(key, value, 20);
    if (!v.ok()) return v.status();
    o->max_split_size = *v;
  } else if (key == "max_non_split_rounding_mb") {
    auto v = ParseMiB(key, value, 20);
    if (!v.ok()) return v.status();
    o->max_non_split_rounding = *v;
  } else if (key == "garbage_collection_threshold") {
    auto v = ParseFraction(key, value, /*open=*/true);
    if (!v.ok()) return v.status();
    o->garbage_collection_threshold = *v;
  } else if (key == "expandable_segments") {
    return SetBool(key, value, &o->expandable_segments);
  } else if (key == "large_segment_size_mb") {
    auto v = ParseMiB(key, value, 2, kMaxSegmentOrPageMiB);
    if (!v.ok()) return v.status();
    if (*v % (2 * kMiB) != 0) return Bad(key, value, "a multiple of 2 MiB");
    o->large_segment_size = *v;
  } else if (key == "roundup_power2_divisions") {
    return ParseDivisions(key, value, o);
  } else if (key == "release_lock_on_cudamalloc") {
    return SetBool(key, value, &o->release_lock_on_cudamalloc);
  } else if (key == "per_process_memory_fraction") {
    auto v = ParseFraction(key, value, /*open=*/false);
    if (!v.ok()) return v.status();
    o->per_process_memory_fraction = *v;
  } else if (key == "backend") {
    if (value != "native") return Bad(key, value, "native (vramledger replaces the allocator)");
  } else if (key == "pinned_use_cuda_host_register" || key == "pinned_use_background_threads" ||
             key == "graph_capture_record_stream_reuse") {
    return ParseBool(key, value).status();  // host allocator / graph keys: validated, no effect
  } else if (key == "pinned_num_register_threads" || key == "pinned_reserve_segment_size_mb") {
    std::uint64_t v = 0;
    if (!absl::SimpleAtoi(value, &v)) return Bad(key, value, "an integer");
  } else if (key == "page_recycling") {
    return SetBool(key, value, &o->page_recycling);
  } else if (key == "expandable_page_mb") {
    auto v = ParseMiB(key, value, 2, kMaxSegmentOrPageMiB);
    if (!v.ok()) return v.status();
    if (*v % (2 * kMiB) != 0) return Bad(key, value, "a multiple of 2 MiB");
    o->expandable_page_size = *v;
  } else if (key == "expandable_handle_mb") {
    std::uint64_t v = 0;
    if (!absl::SimpleAtoi(value, &v) || v % 2 != 0 || v > kMaxSegmentOrPageMiB) {
      return Bad(key, value,
                 absl::StrCat("0 or a multiple of 2 (MiB), at most ", kMaxSegmentOrPageMiB));
    }
    o->expandable_handle_size = static_cast<std::size_t>(v) * kMiB;
  } else if (key == "plan") {
    o->plan = std::string(value);
  } else if (key == "dump_dir") {
    if (value.empty()) return Bad(key, value, "a directory path");
    o->dump_dir = std::string(value);
  } else if (key == "max_dumps") {
    int v = 0;
    if (!absl::SimpleAtoi(value, &v) || v < 0) return Bad(key, value, "an integer >= 0");
    o->max_dumps = v;
  } else if (key == "recycle_slack") {
    double v = 0;
    if (!absl::SimpleAtod(value, &v) || !(v >= 0.0 && v <= 1.0)) {  // refuses "nan" too
      return Bad(key, value, "a number in [0, 1]");
    }
    o->recycle_slack = v;
  } else if (key == "host_timing") {
    return SetBool(key, value, &o->host_timing);
  } else if (key == "recycle_tails_first") {
    return SetBool(key, value, &o->recycle_tails_first);
  } else if (key == "keep_old_mappings") {
    return SetBool(key, value, &o->keep_old_mappings);
  } else if (key == "step_log") {  // issue 6: per-step peak logs
    o->step_log = std::string(value);
  } else {
    std::vector<std::string> names;
    for (const OptionDoc& d : OptionTable()) names.emplace_back(d.name);
    return absl::InvalidArgumentError(
        absl::StrCat("unknown option '", key, "'", DidYouMean(key, names),
                     "; accepted keys: ", absl::StrJoin(names, ", ")));
  }
  return absl::OkStatus();
}

// Splits on commas that are not inside [...].
std::vector<std::string> SplitTopLevel(string_view conf) {
  std::vector<std::string> items(1);
  int depth = 0;
  for (char c : conf) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) continue;
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      items.emplace_back();
    } else {
      items.back().push_back(c);
    }
  }
  return items;
}

}  // namespace

const std::vector<OptionDoc>& OptionTable() {
  static const auto* table = new std::vector<OptionDoc>{
      {"max_split_size_mb", "unlimited", "blocks this large (MiB) are never split (torch)"},
      {"max_non_split_rounding_mb", "20", "oversize request may take a block up to this larger"},
      {"garbage_collection_threshold", "0",
       "free old cached blocks above this fraction of the cap"},
      {"expandable_segments", "False", "grow segments by mapping pages (torch's key)"},
      {"large_segment_size_mb", "20",
       "segment size for 1-10 MiB requests (at least the request rounded up to 2 MiB)"},
      {"roundup_power2_divisions", "0", "N or [MiB:N,...,>:N]: round requests to power-2 steps"},
      {"release_lock_on_cudamalloc", "False", "accepted for torch compatibility"},
      {"per_process_memory_fraction", "0", "cap on reserved bytes as a fraction of the card"},
      {"backend", "native", "only 'native' (vramledger is the allocator)"},
      {"pinned_use_cuda_host_register", "False", "host allocator key, validated and ignored"},
      {"pinned_num_register_threads", "1", "host allocator key, validated and ignored"},
      {"pinned_use_background_threads", "False", "host allocator key, validated and ignored"},
      {"pinned_reserve_segment_size_mb", "0", "host allocator key, validated and ignored"},
      {"graph_capture_record_stream_reuse", "False", "validated and ignored"},
      {"page_recycling", "True", "vramledger: move free pages of expandable segments"},
      {"expandable_page_mb", "6", "vramledger: physical page size of expandable segments"},
      {"recycle_slack", "0.006", "vramledger: growth allowed over peak allocated before recycling"},
      {"expandable_handle_mb", "0", "vramledger: largest handle per run of new pages (0 = a page)"},
      {"recycle_tails_first", "False", "vramledger: recycle free tails' pages before holes'"},
      {"keep_old_mappings", "True",
       "vramledger: moved pages stay mapped where they were, reusable"},
      {"host_timing", "False", "vramledger: time each allocation and free on the host"},
      {"plan", "", "vramledger: path of the memory plan file"},
      {"dump_dir", "./vramledger-dumps", "vramledger: directory for OOM forensics"},
      {"max_dumps", "8", "vramledger: forensic dumps kept"},
      {"step_log", "", "vramledger: directory for per-step peak logs (vramledger.step())"},
  };
  return *table;
}

absl::StatusOr<Options> ParseOptions(std::string_view std_conf, const Options& base) {
  const string_view conf(std_conf.data(), std_conf.size());
  Options out = base;
  for (const std::string& item : SplitTopLevel(conf)) {
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
  if (o.max_split_size != SIZE_MAX)
    parts.push_back(absl::StrCat("max_split_size_mb:", o.max_split_size / kMiB));
  parts.push_back(absl::StrCat("max_non_split_rounding_mb:", o.max_non_split_rounding / kMiB));
  if (o.garbage_collection_threshold > 0) {
    parts.push_back(absl::StrCat("garbage_collection_threshold:", o.garbage_collection_threshold));
  }
  parts.push_back(absl::StrCat("expandable_segments:", o.expandable_segments ? "True" : "False"));
  parts.push_back(absl::StrCat("large_segment_size_mb:", o.large_segment_size / kMiB));
  std::vector<std::string> div;
  for (int i = 0; i < kRoundupPower2Intervals; ++i) {
    div.push_back(absl::StrCat(std::size_t{1} << i, ":", o.roundup_power2_divisions[i]));
  }
  parts.push_back(absl::StrCat("roundup_power2_divisions:[", absl::StrJoin(div, ","), "]"));
  parts.push_back(
      absl::StrCat("release_lock_on_cudamalloc:", o.release_lock_on_cudamalloc ? "True" : "False"));
  parts.push_back(absl::StrCat("per_process_memory_fraction:", o.per_process_memory_fraction));
  parts.push_back(absl::StrCat("page_recycling:", o.page_recycling ? "True" : "False"));
  parts.push_back(absl::StrCat("expandable_page_mb:", o.expandable_page_size / kMiB));
  parts.push_back(absl::StrCat("recycle_slack:", o.recycle_slack));
  parts.push_back(absl::StrCat("expandable_handle_mb:", o.expandable_handle_size / kMiB));
  parts.push_back(absl::StrCat("recycle_tails_first:", o.recycle_tails_first ? "True" : "False"));
  parts.push_back(absl::StrCat("keep_old_mappings:", o.keep_old_mappings ? "True" : "False"));
  parts.push_back(absl::StrCat("host_timing:", o.host_timing ? "True" : "False"));
  if (!o.plan.empty()) parts.push_back(absl::StrCat("plan:", o.plan));
  parts.push_back(absl::StrCat("dump_dir:", o.dump_dir));
  parts.push_back(absl::StrCat("max_dumps:", o.max_dumps));
  if (!o.step_log.empty()) parts.push_back(absl::StrCat("step_log:", o.step_log));
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<Options> OptionsFromEnvAndString(std::string_view explicit_conf) {
  Options base;
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
