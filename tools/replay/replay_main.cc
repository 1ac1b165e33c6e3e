// `vramledger-replay TRACE [--capacity-gib N] [--json] [--conf S] [--timeline CSV]`: replays a
// trace CSV on SimBackend, prints the table (or JSON); exit status 1 when the plan (--conf
// plan:FILE) refused an allocation. Single-threaded command-line entry point.
#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "replay/replay.h"
#include "replay/replay_report.h"
#include "replay/trace_reader.h"
#include "vramledger/options.h"

namespace vramledger {
namespace {

constexpr absl::string_view kUsage =
    "usage: vramledger-replay TRACE [--capacity-gib N] [--json] [--conf key:value,...]\n"
    "                         [--timeline OUT.csv] [--sample-every N] [--gpu-lag-us N]\n"
    "                         [--ignore-releases] [--plan-keep-going]\n"
    "  TRACE            trace CSV (action,addr,size,stream,time_us), plain or .gz; a\n"
    "                   `snapshot` row ends a training step\n"
    "  --capacity-gib N simulated device capacity in GiB (default: the H200's 139.80)\n"
    "  --json           print one JSON object instead of the table\n"
    "  --conf S         allocator options, PYTORCH_CUDA_ALLOC_CONF syntax; applied after\n"
    "                   VRAMLEDGER_CONF from the environment (--conf wins)\n"
    "  --timeline F     write allocated, reserved and wasted bytes over the trace, and the\n"
    "                   trace's own reserved bytes, as CSV to F\n"
    "  --sample-every N a timeline point at least every N trace events (default: at most\n"
    "                   about 2000 points)\n"
    "  --gpu-lag-us N   the simulated GPU finishes work N us of trace time after the host\n"
    "                   queued it (fences complete late, as on a real GPU; default 0: at once)\n"
    "  --ignore-releases do not empty the cache where the trace shows the program's releases\n"
    "                   (runs of segment_free / segment_unmap: empty_cache(), OOM retries)\n"
    "  --plan-keep-going with --conf plan:FILE, count every refusal and go on (default: stop at\n"
    "                   the first); either way the exit status is 1 after a refusal\n"
    "  (--plot is in the Python command: vramledger replay TRACE --plot OUT.png)\n";

struct Args {
  std::string trace;
  std::size_t capacity_bytes = kH200TotalBytes;
  bool json = false;
  std::string conf;
  std::string timeline;
  std::int64_t sample_every = 0;
  std::int64_t gpu_lag_us = 0;
  bool ignore_releases = false;
  bool plan_keep_going = false;
  bool help = false;
};

// The value of `--name V` or `--name=V` at argv[*i]; advances *i past it.
absl::StatusOr<std::string> FlagValue(absl::string_view name, int argc, char** argv, int* i) {
  const absl::string_view arg = argv[*i];
  if (arg.size() > name.size() && arg[name.size()] == '=') {
    return std::string(arg.substr(name.size() + 1));
  }
  if (*i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
  ++*i;
  return std::string(argv[*i]);
}

absl::StatusOr<Args> ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    auto is_flag = [&](absl::string_view name) {
      return arg == name || (arg.size() > name.size() && arg.substr(0, name.size()) == name &&
                             arg[name.size()] == '=');
    };
    if (arg == "-h" || arg == "--help") {
      args.help = true;
    } else if (arg == "--json") {
      args.json = true;
    } else if (arg == "--ignore-releases") {
      args.ignore_releases = true;
    } else if (arg == "--plan-keep-going") {
      args.plan_keep_going = true;
    } else if (is_flag("--conf")) {
      absl::StatusOr<std::string> value = FlagValue("--conf", argc, argv, &i);
      if (!value.ok()) return value.status();
      args.conf = *value;
    } else if (is_flag("--timeline")) {
      absl::StatusOr<std::string> value = FlagValue("--timeline", argc, argv, &i);
      if (!value.ok()) return value.status();
      if (value->empty()) return absl::InvalidArgumentError("--timeline needs a file name");
      args.timeline = *value;
    } else if (is_flag("--sample-every")) {
      absl::StatusOr<std::string> value = FlagValue("--sample-every", argc, argv, &i);
      if (!value.ok()) return value.status();
      if (!absl::SimpleAtoi(*value, &args.sample_every) || args.sample_every <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--sample-every must be a positive number of events, got '", *value, "'"));
      }
    } else if (is_flag("--gpu-lag-us")) {
      absl::StatusOr<std::string> value = FlagValue("--gpu-lag-us", argc, argv, &i);
      if (!value.ok()) return value.status();
      if (!absl::SimpleAtoi(*value, &args.gpu_lag_us) || args.gpu_lag_us < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--gpu-lag-us must be a non-negative number of microseconds, got '", *value, "'"));
      }
    } else if (is_flag("--plot")) {
      return absl::InvalidArgumentError(
          "--plot is drawn by the Python command (vramledger replay TRACE --plot OUT.png); "
          "this binary writes the --timeline CSV");
    } else if (is_flag("--capacity-gib")) {
      absl::StatusOr<std::string> value = FlagValue("--capacity-gib", argc, argv, &i);
      if (!value.ok()) return value.status();
      // Decimal only (std::from_chars' general format: SimpleAtod took "0x10" as 16), and at
      // least one 2 MiB page, so that 1e-12 is not a card of 0 bytes.
      double gib = 0;
      const char* end = value->data() + value->size();
      const auto [ptr, ec] = std::from_chars(value->data(), end, gib, std::chars_format::general);
      if (ec != std::errc() || ptr != end || !std::isfinite(gib) || gib > 1e6 ||
          gib * static_cast<double>(kGiB) < static_cast<double>(2 * kMiB)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--capacity-gib must be a number of GiB from 0.001953125 (2 MiB) to 1e6, got '",
            *value, "'"));
      }
      args.capacity_bytes = static_cast<std::size_t>(gib * static_cast<double>(kGiB));
    } else if (arg.size() > 1 && arg[0] == '-') {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '", arg, "'"));
    } else if (args.trace.empty()) {
      args.trace = std::string(arg);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("one TRACE expected, got '", args.trace, "' and '", arg, "'"));
    }
  }
  if (args.trace.empty() && !args.help) {
    return absl::InvalidArgumentError("missing TRACE (the trace CSV to replay)");
  }
  return args;
}

// Writes `text` to `path`. NotFound / PermissionDenied style errors name the path.
absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::NotFoundError(absl::StrCat(path, ": cannot open for writing"));
  out << text;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

int Fail(const absl::Status& status) {
  std::cerr << "vramledger-replay: error: " << status.message() << "\n";
  return 2;
}

int Main(int argc, char** argv) {
  absl::StatusOr<Args> args = ParseArgs(argc, argv);
  if (!args.ok()) {
    std::cerr << "vramledger-replay: error: " << args.status().message() << " (see --help)\n";
    return 2;
  }
  if (args->help) {
    std::cout << kUsage;
    return 0;
  }
  absl::StatusOr<Options> options = OptionsFromEnvAndString(args->conf);
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(args->trace);
  if (!events.ok()) return Fail(events.status());

  ReplayConfig config;
  config.capacity_bytes = args->capacity_bytes;
  config.source = args->trace;
  config.timeline = !args->timeline.empty();
  config.sample_every = args->sample_every;
  config.gpu_lag_us = args->gpu_lag_us;
  config.follow_releases = !args->ignore_releases;
  config.plan_keep_going = args->plan_keep_going;
  absl::StatusOr<ReplayResult> result = Replay(*events, *options, config);
  if (!result.ok()) return Fail(result.status());
  if (config.timeline) {
    if (absl::Status s = WriteFile(args->timeline, TimelineCsv(*result)); !s.ok()) return Fail(s);
  }

  for (const std::string& warning : ReplayWarnings(*result)) {
    std::cerr << "vramledger-replay: warning: " << warning << "\n";
  }
  if (args->json) {
    std::cout << ReplayResultToJson(*result).dump(2) << "\n";
  } else {
    std::cout << FormatReplayTable(*result);
  }
  std::cout.flush();
  if (!std::cout.good()) return 2;
  return result->plan.refusals > 0 ? 1 : 0;
}

}  // namespace
}  // namespace vramledger

int main(int argc, char** argv) { return vramledger::Main(argc, argv); }
