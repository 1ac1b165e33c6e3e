// The two option tables, the allocator's and the process's: every key with its type, default,
// accepted values, meaning, and the code that parses and stores it. Built once; thread-safe.
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/option_field.h"

namespace vramledger {
namespace {

// Debian's Abseil 20220623 has its own string_view type, distinct from std::string_view.
using absl::string_view;

constexpr char kBoolAccepted[] = "True or False (as PYTORCH_CUDA_ALLOC_CONF)";

// vramledger's sizes of one segment or one physical page: past 1 GiB every request on a smaller
// card would fail with a misleading out-of-memory error (976 GiB pages were once accepted).
constexpr std::size_t kMaxSegmentOrPageMiB = 1024;
constexpr std::size_t kNoMaxMiB = SIZE_MAX >> 20;

// Whether OptionsToString writes a key whose value is its default (false: only other values).
enum class WhenDefault { kWrite, kOmit };

template <typename S>
constexpr OptionScope ScopeOf() {
  static_assert(std::is_same_v<S, Options> || std::is_same_v<S, ProcessOptions>);
  return std::is_same_v<S, Options> ? OptionScope::kAllocator : OptionScope::kProcess;
}

template <typename S>
OptionDoc Doc(const char* name, const char* type, std::string default_value, std::string accepted,
              const char* help, const char* env = "") {
  return OptionDoc{name, ScopeOf<S>(), type, std::move(default_value), std::move(accepted),
                   help, env};
}

// `getter` applied to `in`, or nullopt when it equals the default and kOmit says to leave it out.
template <typename S, typename T, typename F>
auto Writer(T S::*member, WhenDefault when, F format) {
  return [member, when, format](const S& in) -> std::optional<std::string> {
    if (when == WhenDefault::kOmit && in.*member == S().*member) return std::nullopt;
    return format(in.*member);
  };
}

template <typename S>
OptionField<S> BoolField(const char* name, bool S::*member, const char* help,
                         WhenDefault when = WhenDefault::kWrite, const char* env = "") {
  const auto text = [](bool b) { return std::string(b ? "True" : "False"); };
  return {Doc<S>(name, "bool", text(S().*member), kBoolAccepted, help, env),
          [name, member](string_view value, S* out) {
            if (value != "True" && value != "False") {
              return BadOptionValue(name, value, kBoolAccepted);
            }
            out->*member = value == "True";
            return absl::OkStatus();
          },
          Writer(member, when, text)};
}

std::string MiBAccepted(std::size_t min_mib, std::size_t max_mib) {
  return max_mib == kNoMaxMiB
             ? absl::StrCat("an integer number of MiB, at least ", min_mib)
             : absl::StrCat("an integer number of MiB in [", min_mib, ", ", max_mib, "]");
}

// A size written in MiB and stored in bytes; `even`: a multiple of 2 MiB (the page granularity).
OptionField<Options> MiBField(const char* name, std::size_t Options::*member, std::size_t min_mib,
                              std::size_t max_mib, bool even, const char* help,
                              WhenDefault when = WhenDefault::kWrite) {
  const std::size_t default_bytes = Options().*member;
  std::string accepted = MiBAccepted(min_mib, max_mib);
  return {Doc<Options>(name, "MiB",
                       default_bytes == SIZE_MAX ? "unlimited" : absl::StrCat(default_bytes / kMiB),
                       even ? absl::StrCat(accepted, ", a multiple of 2") : accepted, help),
          [=](string_view value, Options* out) {
            std::uint64_t v = 0;
            if (!absl::SimpleAtoi(value, &v) || v < min_mib || v > max_mib) {
              return BadOptionValue(name, value, accepted);
            }
            if (even && v % 2 != 0) return BadOptionValue(name, value, "a multiple of 2 MiB");
            out->*member = static_cast<std::size_t>(v) * kMiB;
            return absl::OkStatus();
          },
          Writer(member, when, [](std::size_t bytes) { return absl::StrCat(bytes / kMiB); })};
}

// A number in [0, 1], or in (0, 1) when `open`.
OptionField<Options> FractionField(const char* name, double Options::*member, bool open,
                                   const char* help, WhenDefault when = WhenDefault::kWrite) {
  const char* accepted = open ? "a number in (0, 1)" : "a number in [0, 1]";
  return {Doc<Options>(name, "fraction", absl::StrCat(Options().*member), accepted, help),
          [=](string_view value, Options* out) {
            double v = 0;
            // Written as !(in range) so that "nan", which SimpleAtod accepts, is refused.
            if (!absl::SimpleAtod(value, &v) || !(v >= 0.0 && v <= 1.0) ||
                (open && (v <= 0.0 || v >= 1.0))) {
              return BadOptionValue(name, value, accepted);
            }
            out->*member = v;
            return absl::OkStatus();
          },
          Writer(member, when, [](double v) { return absl::StrCat(v); })};
}

OptionField<ProcessOptions> PathField(const char* name, std::string ProcessOptions::*member,
                                      const char* accepted, bool allow_empty, const char* help,
                                      WhenDefault when) {
  return {Doc<ProcessOptions>(name, "path", ProcessOptions().*member, accepted, help),
          [=](string_view value, ProcessOptions* out) {
            if (value.empty() && !allow_empty) return BadOptionValue(name, value, accepted);
            out->*member = std::string(value);
            return absl::OkStatus();
          },
          Writer(member, when, [](const std::string& s) { return s; })};
}

// A torch key that vramledger validates and otherwise ignores (host allocator, graph capture).
OptionField<Options> IgnoredField(const char* name, const char* type, const char* default_value,
                                  const char* help) {
  const bool is_bool = std::string_view(type) == "bool";
  const char* accepted = is_bool ? kBoolAccepted : "an integer";
  return {Doc<Options>(name, type, default_value, accepted, help),
          [=](string_view value, Options*) {
            std::uint64_t v = 0;
            const bool ok =
                is_bool ? (value == "True" || value == "False") : absl::SimpleAtoi(value, &v);
            return ok ? absl::OkStatus() : BadOptionValue(name, value, accepted);
          },
          [](const Options&) { return std::nullopt; }};
}

// "4" or "[256:1,512:2,1024:4,>:8]": keys are MiB powers of two, '>' means every later interval.
absl::Status ParseDivisions(string_view key, string_view value, Options* out) {
  auto check_divisions = [&](string_view text, std::size_t* d) -> absl::Status {
    if (!absl::SimpleAtoi(text, d) || (*d > 1 && (*d & (*d - 1)) != 0)) {
      return BadOptionValue(key, value, "divisions that are 0, 1 or a power of two");
    }
    return absl::OkStatus();
  };
  if (!absl::ConsumePrefix(&value, "[")) {
    std::size_t d = 0;
    if (auto s = check_divisions(value, &d); !s.ok()) return s;
    out->roundup_power2_divisions.fill(d);
    return absl::OkStatus();
  }
  if (!absl::ConsumeSuffix(&value, "]")) return BadOptionValue(key, value, "a list closed by ']'");
  auto divisions = out->roundup_power2_divisions;  // stored only when every item parses
  int last_index = -1;
  for (string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    std::vector<string_view> kv = absl::StrSplit(item, ':');
    if (kv.size() != 2) return BadOptionValue(key, item, "'MiB:divisions' or '>:divisions'");
    std::size_t d = 0;
    if (auto s = check_divisions(kv[1], &d); !s.ok()) return s;
    if (kv[0] == ">") {
      for (int i = last_index + 1; i < kRoundupPower2Intervals; ++i) divisions[i] = d;
      continue;
    }
    std::uint64_t mib = 0;
    if (!absl::SimpleAtoi(kv[0], &mib) || mib == 0 || (mib & (mib - 1)) != 0) {
      return BadOptionValue(key, item, "an interval start in MiB that is a power of two");
    }
    int index = 0;
    while ((std::uint64_t{1} << index) < mib) ++index;
    if (index >= kRoundupPower2Intervals) {
      return BadOptionValue(key, item, "an interval start up to 32768 MiB");
    }
    divisions[index] = d;
    last_index = index;
  }
  out->roundup_power2_divisions = divisions;
  return absl::OkStatus();
}

std::string DivisionsText(const std::array<std::size_t, kRoundupPower2Intervals>& divisions) {
  std::vector<std::string> items;
  for (int i = 0; i < kRoundupPower2Intervals; ++i) {
    items.push_back(absl::StrCat(std::size_t{1} << i, ":", divisions[i]));
  }
  return absl::StrCat("[", absl::StrJoin(items, ","), "]");
}

std::vector<OptionField<Options>> MakeAllocatorFields() {
  using O = Options;
  std::vector<OptionField<O>> f;
  // Torch's keys, with torch's meaning.
  f.push_back(MiBField("max_split_size_mb", &O::max_split_size, 20, kNoMaxMiB, false,
                       "blocks this large (MiB) are never split (torch)", WhenDefault::kOmit));
  f.push_back(MiBField("max_non_split_rounding_mb", &O::max_non_split_rounding, 20, kNoMaxMiB,
                       false, "oversize request may take a block up to this larger"));
  f.push_back(FractionField("garbage_collection_threshold", &O::garbage_collection_threshold,
                            /*open=*/true, "free old cached blocks above this fraction of the cap",
                            WhenDefault::kOmit));
  f.push_back(
      BoolField("expandable_segments", &O::expandable_segments,
                "grow segments by mapping pages (torch's key; True under install() and the shim)"));
  f.push_back(MiBField("large_segment_size_mb", &O::large_segment_size, 2, kMaxSegmentOrPageMiB,
                       /*even=*/true,
                       "segment size for 1-10 MiB requests (at least the request rounded up to "
                       "2 MiB)"));
  f.push_back({Doc<O>("roundup_power2_divisions", "divisions", "0",
                      "N or [MiB:N,...,>:N]; N is 0, 1 or a power of two, MiB a power of two up "
                      "to 32768",
                      "round requests to power-2 steps"),
               [](string_view value, O* out) {
                 return ParseDivisions("roundup_power2_divisions", value, out);
               },
               [](const O& in) { return DivisionsText(in.roundup_power2_divisions); }});
  f.push_back(BoolField("release_lock_on_cudamalloc", &O::release_lock_on_cudamalloc,
                        "accepted for torch compatibility"));
  f.push_back(FractionField("per_process_memory_fraction", &O::per_process_memory_fraction,
                            /*open=*/false, "cap on reserved bytes as a fraction of the card"));
  f.push_back({Doc<O>("backend", "choice", "native", "native (vramledger replaces the allocator)",
                      "only 'native' (vramledger is the allocator)"),
               [](string_view value, O*) {
                 return value == "native" ? absl::OkStatus()
                                          : BadOptionValue("backend", value,
                                                           "native (vramledger replaces the "
                                                           "allocator)");
               },
               [](const O&) { return std::nullopt; }});
  f.push_back(IgnoredField("pinned_use_cuda_host_register", "bool", "False",
                           "host allocator key, validated and ignored"));
  f.push_back(IgnoredField("pinned_num_register_threads", "int", "1",
                           "host allocator key, validated and ignored"));
  f.push_back(IgnoredField("pinned_use_background_threads", "bool", "False",
                           "host allocator key, validated and ignored"));
  f.push_back(IgnoredField("pinned_reserve_segment_size_mb", "int", "0",
                           "host allocator key, validated and ignored"));
  f.push_back(
      IgnoredField("graph_capture_record_stream_reuse", "bool", "False", "validated and ignored"));
  // vramledger's own keys.
  f.push_back(BoolField("page_recycling", &O::page_recycling,
                        "vramledger: move free pages of expandable segments"));
  f.push_back(MiBField("expandable_page_mb", &O::expandable_page_size, 2, kMaxSegmentOrPageMiB,
                       /*even=*/true, "vramledger: physical page size of expandable segments"));
  f.push_back(FractionField("recycle_slack", &O::recycle_slack, /*open=*/false,
                            "vramledger: growth allowed over peak allocated before recycling"));
  const std::string handle_accepted =
      absl::StrCat("0 or a multiple of 2 (MiB), at most ", kMaxSegmentOrPageMiB);
  f.push_back({Doc<O>("expandable_handle_mb", "MiB", "0",
                      absl::StrCat(handle_accepted, ", a multiple of expandable_page_mb"),
                      "vramledger: largest handle per run of new pages (0 = a page)"),
               [handle_accepted](string_view value, O* out) {
                 std::uint64_t v = 0;
                 if (!absl::SimpleAtoi(value, &v) || v % 2 != 0 || v > kMaxSegmentOrPageMiB) {
                   return BadOptionValue("expandable_handle_mb", value, handle_accepted);
                 }
                 out->expandable_handle_size = static_cast<std::size_t>(v) * kMiB;
                 return absl::OkStatus();
               },
               [](const O& in) { return absl::StrCat(in.expandable_handle_size / kMiB); }});
  f.push_back(BoolField("recycle_tails_first", &O::recycle_tails_first,
                        "vramledger: recycle free tails' pages before holes'"));
  f.push_back(
      BoolField("grow_under_cap", &O::grow_under_cap,
                "vramledger: under a memory fraction, grow below the cap before recycling"));
  f.push_back(BoolField("keep_old_mappings", &O::keep_old_mappings,
                        "vramledger: moved pages stay mapped where they were, reusable"));
  f.push_back(BoolField("host_timing", &O::host_timing,
                        "vramledger: time each allocation and free on the host"));
  return f;
}

std::vector<OptionField<ProcessOptions>> MakeProcessFields() {
  using P = ProcessOptions;
  std::vector<OptionField<P>> f;
  f.push_back(PathField("plan", &P::plan, "a plan file path (empty: no plan)", true,
                        "vramledger: path of the memory plan file", WhenDefault::kOmit));
  f.push_back(PathField("dump_dir", &P::dump_dir, "a directory path", false,
                        "vramledger: directory for OOM forensics", WhenDefault::kWrite));
  f.push_back({Doc<P>("max_dumps", "int", absl::StrCat(P().max_dumps), "an integer >= 0",
                      "vramledger: forensic dumps kept"),
               [](string_view value, P* out) {
                 int v = 0;
                 if (!absl::SimpleAtoi(value, &v) || v < 0) {
                   return BadOptionValue("max_dumps", value, "an integer >= 0");
                 }
                 out->max_dumps = v;
                 return absl::OkStatus();
               },
               [](const P& in) { return absl::StrCat(in.max_dumps); }});
  f.push_back(PathField("step_log", &P::step_log, "a directory path (empty: no log)", true,
                        "vramledger: directory for per-step peak logs (vramledger.step())",
                        WhenDefault::kOmit));
  f.push_back(BoolField("preload_quiet", &P::preload_quiet,
                        "LD_PRELOAD shim: print no summary on stderr (files are still written)",
                        WhenDefault::kOmit, "VRAMLEDGER_PRELOAD_QUIET"));
  f.push_back(BoolField("preload_no_exit_dump", &P::preload_no_exit_dump,
                        "LD_PRELOAD shim: write no snapshot and summary at exit",
                        WhenDefault::kOmit, "VRAMLEDGER_PRELOAD_NO_EXIT_DUMP"));
  f.push_back(BoolField("preload_disable", &P::preload_disable,
                        "LD_PRELOAD shim: forward every call to CUDA untouched", WhenDefault::kOmit,
                        "VRAMLEDGER_PRELOAD_DISABLE"));
  return f;
}

}  // namespace

const std::vector<OptionField<Options>>& AllocatorOptionFields() {
  static const auto* fields = new std::vector<OptionField<Options>>(MakeAllocatorFields());
  return *fields;
}

const std::vector<OptionField<ProcessOptions>>& ProcessOptionFields() {
  static const auto* fields = new std::vector<OptionField<ProcessOptions>>(MakeProcessFields());
  return *fields;
}

}  // namespace vramledger
