// Crash-safe file writing: content goes to a temporary file beside the target, is flushed to
// disk, then renamed over the target, so readers see the old file or the whole new one.
// Thread-safety: stateless; concurrent writers to one path each win whole (last rename wins).
#ifndef VRAMLEDGER_LEDGER_ATOMIC_FILE_H_
#define VRAMLEDGER_LEDGER_ATOMIC_FILE_H_

#include <functional>
#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace vramledger {

/// Calls `write` with a stream on a new temporary file in the directory of `path`
/// ("<path>.tmp-<pid>-<n>"), then fsyncs it and renames it to `path`. The directory must exist.
/// Errors: whatever `write` returns (the target is left as it was); FailedPrecondition or
/// PermissionDenied naming the path and the system error when the file cannot be created,
/// written, synced or renamed. The temporary file never survives a failure.
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::function<absl::Status(std::ostream&)>& write);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_ATOMIC_FILE_H_
