// WriteOomDump: a unique name, an atomic JSON write, then pruning of the oldest dumps.
// Stateless; a name already taken (two dumps in one microsecond) gets a numeric suffix.
#include "ledger/oom_dump.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace vramledger {
namespace {

namespace fs = std::filesystem;

std::string UtcStamp(std::int64_t micros) {
  const std::time_t seconds = static_cast<std::time_t>(micros / 1000000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%dT%H%M%S", &tm);
  char frac[16];
  std::snprintf(frac, sizeof(frac), ".%06lldZ", static_cast<long long>(micros % 1000000));
  return absl::StrCat(text, frac);
}

// Removes the oldest vramledger-oom-*.json files of `dir` until at most `keep` remain.
void Prune(const fs::path& dir, int keep) {
  std::error_code ec;
  std::vector<std::pair<fs::file_time_type, fs::path>> dumps;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, kOomDumpPrefix) || !absl::EndsWith(name, kOomDumpSuffix)) continue;
    std::error_code time_ec;
    const fs::file_time_type t = entry.last_write_time(time_ec);
    if (!time_ec) dumps.emplace_back(t, entry.path());
  }
  if (dumps.size() <= static_cast<std::size_t>(keep)) return;
  std::sort(dumps.begin(), dumps.end());  // oldest first; names break ties (time in the name)
  const std::size_t excess = dumps.size() - static_cast<std::size_t>(keep);
  for (std::size_t i = 0; i < excess; ++i) fs::remove(dumps[i].second, ec);
}

}  // namespace

absl::StatusOr<std::string> WriteOomDump(const OomDumpConfig& config,
                                         const std::vector<const DeviceAllocator*>& allocators,
                                         History* history) {
  if (config.max_dumps <= 0) return std::string();
  const fs::path dir(config.dump_dir.empty() ? "." : config.dump_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the dump directory ", dir.string(), ": ", ec.message()));
  }
  const std::int64_t now_us = absl::GetCurrentTimeNanos() / 1000;
  const std::string stem = absl::StrCat(kOomDumpPrefix, "device", config.device, "-pid", ::getpid(),
                                        "-", UtcStamp(now_us));
  std::string path = (dir / absl::StrCat(stem, kOomDumpSuffix)).string();
  for (int k = 1; fs::exists(path, ec); ++k) {  // two dumps within one microsecond
    path = (dir / absl::StrCat(stem, "-", k, kOomDumpSuffix)).string();
  }
  SnapshotOptions options = config.snapshot;
  options.extra["dump"] = SnapshotJson::object();
  options.extra["dump"]["reason"] = config.reason;
  options.extra["dump"]["device"] = config.device;
  options.extra["dump"]["message"] = config.message;
  if (absl::Status s = WriteSnapshotJsonFile(path, allocators, history, options); !s.ok()) {
    return s;
  }
  Prune(dir, config.max_dumps);
  return path;
}

}  // namespace vramledger
