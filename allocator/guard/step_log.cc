// Step log formatting and the appending writer (see step_log.h).
#include "guard/step_log.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace vramledger::guard {
namespace {

int RankFrom(const char* name) {
  const char* value = std::getenv(name);
  int rank = -1;
  if (value == nullptr || !absl::SimpleAtoi(value, &rank) || rank < 0) return -1;
  return rank;
}

}  // namespace

int RankFromEnvironment() {
  if (const int rank = RankFrom("RANK"); rank >= 0) return rank;
  if (const int rank = RankFrom("LOCAL_RANK"); rank >= 0) return rank;
  return 0;
}

std::string StepLogPath(std::string_view dir, int rank) {
  return (std::filesystem::path(std::string(dir)) /
          absl::StrCat("vramledger-steps-rank", rank, ".jsonl"))
      .string();
}

std::string StepRecordJson(const StepRecord& r, int rank, double unix_time) {
  nlohmann::json tags = nlohmann::json::object();
  for (const auto& [name, bytes] : r.tag_peaks) tags[name] = bytes;
  nlohmann::ordered_json j;
  j["step"] = r.step;
  j["rank"] = rank;
  j["device"] = r.device;
  j["pid"] = static_cast<int>(getpid());
  j["time"] = unix_time;
  j["peak_allocated_bytes"] = r.peak_allocated;
  j["peak_reserved_bytes"] = r.peak_reserved;
  j["allocated_bytes"] = r.allocated;
  j["reserved_bytes"] = r.reserved;
  j["warnings"] = r.warnings;
  j["tags"] = tags;
  return j.dump();
}

absl::StatusOr<std::unique_ptr<StepLog>> StepLog::Open(std::string_view dir, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(std::string(dir), ec);
  const std::string path = StepLogPath(dir, rank);
  if (ec) {
    return absl::InternalError(absl::StrCat("vramledger: cannot create the step log directory ",
                                            absl::string_view(dir.data(), dir.size()), ": ",
                                            ec.message()));
  }
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) {
    return absl::InternalError(
        absl::StrCat("vramledger: cannot open the step log ", path, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<StepLog>(new StepLog(path, file));
}

StepLog::~StepLog() {
  absl::MutexLock lock(&mu_);
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status StepLog::Append(std::string_view line) {
  absl::MutexLock lock(&mu_);
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() ||
      std::fputc('\n', file_) == EOF || std::fflush(file_) != 0) {
    return absl::InternalError(
        absl::StrCat("vramledger: cannot write the step log ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace vramledger::guard
