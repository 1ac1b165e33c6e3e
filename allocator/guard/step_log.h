// The per-step peak log: one JSON line per step and device, one file per rank
// (<dir>/vramledger-steps-rank<R>.jsonl, R from RANK or LOCAL_RANK). `vramledger report` reads it.
// Thread-safety: StepLog::Append locks; the functions are pure.
#ifndef VRAMLEDGER_GUARD_STEP_LOG_H_
#define VRAMLEDGER_GUARD_STEP_LOG_H_

#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "guard/budget_guard.h"

namespace vramledger::guard {

/// This process's rank: $RANK, else $LOCAL_RANK, else 0 (a value that is not an integer >= 0
/// counts as unset).
int RankFromEnvironment();

/// "<dir>/vramledger-steps-rank<rank>.jsonl".
std::string StepLogPath(std::string_view dir, int rank);

/// One JSON object without newline: {"step", "rank", "device", "pid", "time" (Unix seconds),
/// "peak_allocated_bytes", "peak_reserved_bytes", "allocated_bytes", "reserved_bytes",
/// "warnings", "tags": {name: step peak bytes}}.
std::string StepRecordJson(const StepRecord& record, int rank, double unix_time);

/// An open step log (appended to: use a fresh directory per job).
class StepLog {
 public:
  /// Creates `dir` if needed and opens the rank's file for appending. Internal error naming the
  /// path when it cannot.
  static absl::StatusOr<std::unique_ptr<StepLog>> Open(std::string_view dir, int rank);
  ~StepLog();
  StepLog(const StepLog&) = delete;
  StepLog& operator=(const StepLog&) = delete;

  /// Appends `line` and a newline, and flushes. Internal error on a write failure.
  absl::Status Append(std::string_view line) ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& path() const { return path_; }

 private:
  StepLog(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}

  const std::string path_;
  absl::Mutex mu_;
  std::FILE* file_ ABSL_GUARDED_BY(mu_);
};

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_STEP_LOG_H_
