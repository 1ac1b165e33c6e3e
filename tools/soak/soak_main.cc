// `vramledger-soak [--ops N] [--seed S] [--check-every N] [--capacity-gib N]`: runs the soak
// (soak.h) and prints its figures; exit status 1 when an invariant broke, 2 for bad flags.
#include <cstdint>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "soak/soak.h"

namespace vramledger::soak {
namespace {

constexpr absl::string_view kUsage =
    "usage: vramledger-soak [--ops N] [--seed S] [--check-every N] [--capacity-gib N]\n"
    "  --ops N          allocator operations to run (default 10000000)\n"
    "  --seed S         seed of the operation sequence (default 1)\n"
    "  --check-every N  operations between two full invariant checks (default 1000)\n"
    "  --capacity-gib N capacity of each simulated card in GiB (default 4)\n";

// Parses `--name V` / `--name=V` as a positive integer into *out. Returns "" or the error.
std::string ParsePositive(absl::string_view name, int argc, char** argv, int* i,
                          std::int64_t* out) {
  absl::string_view arg = argv[*i];
  absl::string_view value;
  if (arg.size() > name.size() && arg[name.size()] == '=') {
    value = arg.substr(name.size() + 1);
  } else if (*i + 1 < argc) {
    value = argv[++*i];
  } else {
    return absl::StrCat(name, " needs a value");
  }
  if (!absl::SimpleAtoi(value, out) || *out <= 0) {
    return absl::StrCat(name, " must be a positive integer, got '", value, "'");
  }
  return "";
}

int Main(int argc, char** argv) {
  SoakConfig config;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    auto is = [&](absl::string_view name) {
      return arg == name || (arg.size() > name.size() && arg.substr(0, name.size()) == name &&
                             arg[name.size()] == '=');
    };
    std::int64_t value = 0;
    std::string error;
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (is("--ops")) {
      error = ParsePositive("--ops", argc, argv, &i, &value);
      config.ops = value;
    } else if (is("--seed")) {
      error = ParsePositive("--seed", argc, argv, &i, &value);
      config.seed = static_cast<std::uint64_t>(value);
    } else if (is("--check-every")) {
      error = ParsePositive("--check-every", argc, argv, &i, &value);
      config.check_every = value;
    } else if (is("--capacity-gib")) {
      error = ParsePositive("--capacity-gib", argc, argv, &i, &value);
      config.capacity = static_cast<std::size_t>(value) << 30;
    } else {
      error = absl::StrCat("unknown argument '", arg, "'");
    }
    if (!error.empty()) {
      std::cerr << "vramledger-soak: " << error << "\n" << kUsage;
      return 2;
    }
  }
  const SoakResult r = RunSoak(config);
  std::cout << "seed " << config.seed << "\n"
            << "ops " << r.ops << "\n"
            << "wall_s " << r.wall_seconds << "\n"
            << "ops_per_s " << static_cast<std::int64_t>(r.ops / std::max(r.wall_seconds, 1e-9))
            << "\n"
            << "mallocs " << r.mallocs << " (out of memory: " << r.ooms << ")\n"
            << "frees " << r.frees << "\n"
            << "record_streams " << r.record_streams << "\n"
            << "event_completions " << r.event_completions << "\n"
            << "empty_caches " << r.empty_caches << "\n"
            << "private_pools " << r.pool_entries << "\n"
            << "peak_reserved_bytes " << r.peak_reserved << "\n"
            << "checks " << r.checks << "\n"
            << "violations " << r.violations << "\n";
  for (const std::string& m : r.messages) std::cout << "violation: " << m << "\n";
  return r.violations == 0 ? 0 : 1;
}

}  // namespace
}  // namespace vramledger::soak

int main(int argc, char** argv) { return vramledger::soak::Main(argc, argv); }
