// Out-of-memory forensics: writes a snapshot into the dump directory under a name carrying the
// device, process id and time, and keeps at most max_dumps of them.
// Thread-safety: stateless; dumps from one process get distinct names (microsecond timestamps).
#ifndef VRAMLEDGER_LEDGER_OOM_DUMP_H_
#define VRAMLEDGER_LEDGER_OOM_DUMP_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ledger/history.h"
#include "ledger/snapshot.h"
#include "vramledger/device_allocator.h"

namespace vramledger {

/// Where and how many dumps (Options::dump_dir and Options::max_dumps).
struct OomDumpConfig {
  std::string dump_dir = "./vramledger-dumps";
  int max_dumps = 8;  // <= 0: no dump is written
  int device = 0;     // the device that ran out
  /// What ran out, recorded in the snapshot's "vramledger" object ("oom" or "guard").
  std::string reason = "oom";
  std::string message;  // the error message, recorded beside it
  /// Base snapshot options (tag names, extra "vramledger" keys such as the plan); the dump's
  /// own "dump" key is added to them.
  SnapshotOptions snapshot;
};

/// Prefix and suffix of the dumps' file names: vramledger-oom-device<D>-pid<P>-<UTC time>.json.
inline constexpr char kOomDumpPrefix[] = "vramledger-oom-";
inline constexpr char kOomDumpSuffix[] = ".json";

/// Writes a JSON snapshot of `allocators` and `history` (which may be nullptr) into
/// config.dump_dir (created if missing) and removes the oldest vramledger-oom-*.json files there
/// beyond config.max_dumps. Returns the new file's path, or "" when max_dumps <= 0. Same lock
/// rules as BuildSnapshot (call it after the failed allocation returned, never under its lock).
/// Errors: those of WriteFileAtomically, or FailedPrecondition naming the directory when it
/// cannot be created. Pruning failures are ignored (the dump itself succeeded).
absl::StatusOr<std::string> WriteOomDump(const OomDumpConfig& config,
                                         const std::vector<const DeviceAllocator*>& allocators,
                                         History* history);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_OOM_DUMP_H_
