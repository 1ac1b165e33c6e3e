// The runtime's memory history and snapshots: the C ABI the Python package calls through ctypes
// (record, snapshot, dump), and what the device table and the routes call (hooks, registration,
// OOM dumps). Thread-safety: every function may be called from any thread.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_HISTORY_API_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_HISTORY_API_H_

#include "torch_plugin/runtime/c_errors.h"

#ifdef __cplusplus
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "ledger/history.h"
#include "ledger/snapshot.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"
#endif

extern "C" {

// ---- ctypes-facing (never throw; 0 or a vramledger_status, message in vramledger_last_error) ----

/// torch's _record_memory_history for the whole process: `enabled` NULL (off, history cleared),
/// "state" or "all"; `context` NULL, "state", "alloc" or "all"; `stacks` "python" or "all"
/// (NULL: "python"); `max_entries` >= 1 trace entries kept per device; `clear_history` != 0
/// drops what was recorded. Allocators created later record too.
/// VRAMLEDGER_INVALID_ARGUMENT for an unknown value (the message names it).
VRAMLEDGER_EXPORT int vramledger_record_memory_history(const char* enabled, const char* context,
                                                       const char* stacks,
                                                       unsigned long long max_entries,
                                                       int clear_history);

/// The snapshot of every device as JSON (torch 2.11's dict shape plus "vramledger"); appends a
/// `snapshot` trace entry per device. *json_out is a malloc'd string to release with
/// vramledger_string_free (NULL on failure). VRAMLEDGER_INVALID_ARGUMENT for a null json_out.
VRAMLEDGER_EXPORT int vramledger_snapshot_json(char** json_out);

/// Writes the snapshot as JSON to `path` atomically (temporary file + rename), streaming the
/// trace entries. VRAMLEDGER_FAILED with the path and the system error when it cannot be written.
VRAMLEDGER_EXPORT int vramledger_dump_snapshot_json(const char* path);

}  // extern "C"

#ifdef __cplusplus
namespace vramledger {

/// The process-wide history (never destroyed). Off until vramledger_record_memory_history.
History& PluginHistory();

/// The hooks the device table installs on each allocator it creates (the history; a guard chains
/// it).
AllocatorHooks* LedgerHooks();

/// Lets another part of the plugin (the guard) add to every snapshot the plugin writes, e.g. tag
/// names (SnapshotOptions::tag_name) and the plan (SnapshotOptions::extra). `decorate` runs on
/// the snapshotting thread before each snapshot and must be thread-safe; nullptr removes it.
void SetSnapshotDecorator(std::function<void(SnapshotOptions*)> decorate);

/// Default snapshot options with the decorator applied (for snapshots written elsewhere).
SnapshotOptions PluginSnapshotOptions();

/// The device table calls this once per allocator, right after creating it: snapshots and OOM dumps
/// include it from then on. `device` outside [0, History::kMaxDevices) is ignored.
void AttachLedger(int device, DeviceAllocator* allocator);

/// Called on a failed allocation of `device` before its status is reported (GuardRefusalOrOomDump).
/// For ResourceExhausted (out of memory or a guard refusal) it writes a forensic snapshot into the
/// allocator's dump_dir (at most max_dumps kept) and returns the status with the file's path
/// appended to the message (or why it could not be written); other statuses come back as they
/// are. Never throws.
absl::Status WithOomDump(int device, const absl::Status& status);

}  // namespace vramledger
#endif

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_HISTORY_API_H_
