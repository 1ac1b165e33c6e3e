// The runtime's budget guard: one guard per device attached by the device table, and the C ABI
// the Python package calls through ctypes (tags, phase, steps, per-tag stats, plan checks, the
// Python stack provider). Thread-safety: every function may be called from any thread.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_GUARD_API_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_GUARD_API_H_

#include <cstddef>

#include "torch_plugin/runtime/c_errors.h"

#ifdef __cplusplus
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "vramledger/device_allocator.h"
#include "vramledger/device_backend.h"
#include "vramledger/hooks.h"
#include "vramledger/options.h"
#endif

extern "C" {

// ---- ctypes-facing (never throw; 0 or a vramledger_status, message in vramledger_last_error) ----

/// Interns the tag `name` (1-64 bytes; "untagged" is 0) and writes its id to *id_out.
/// VRAMLEDGER_INVALID_ARGUMENT for a bad name or null pointer, VRAMLEDGER_FAILED when 1024 tags
/// exist already.
VRAMLEDGER_EXPORT int vramledger_tag_id(const char* name, unsigned* id_out);

/// Sets the calling thread's tag (0: none, the phase applies); returns the previous one.
VRAMLEDGER_EXPORT unsigned vramledger_set_thread_tag(unsigned id);

/// Sets the process-wide phase (the tag of threads without their own); returns the previous one.
VRAMLEDGER_EXPORT unsigned vramledger_set_phase(unsigned id);

/// Per-tag figures of `device` as a JSON object with memory_stats-style keys:
/// "tags.<name>.current" and "tags.<name>.peak" (requested bytes) for every tag seen there and
/// "untagged", plus "guard.refusals" and "guard.warnings" (counts). {} when the device has no
/// allocator yet. *json_out is released with vramledger_string_free.
/// VRAMLEDGER_INVALID_ARGUMENT for a null json_out.
VRAMLEDGER_EXPORT int vramledger_tag_stats_json(int device, char** json_out);

/// Every tag peak of `device` (-1: all) becomes its current value.
VRAMLEDGER_EXPORT int vramledger_reset_tag_peaks(int device);

/// Ends the training step on every device with an allocator: returns a JSON list with one record
/// per device ({"step", "rank", "device", "peak_allocated_bytes", "peak_reserved_bytes",
/// "allocated_bytes", "reserved_bytes", "warnings", "tags": {name: bytes}, ...}) and appends the
/// records to <step_log>/vramledger-steps-rank<R>.jsonl when the step_log option is set
/// (R from RANK, else LOCAL_RANK, else 0). VRAMLEDGER_FAILED when the log cannot be written.
VRAMLEDGER_EXPORT int vramledger_step(char** json_out);

/// A function that writes the calling thread's Python frames into `buf` (at most `capacity`
/// bytes of UTF-8 text: one "F\t<file>\t<line>\t<function>\n" line per frame, innermost first,
/// or "N\t<note>\n" for a note) and returns the bytes written.
typedef size_t (*vramledger_python_stack_fn)(char* buf, size_t capacity);

/// Sets the function refusal reports call for Python frames (NULL: none). The Python package
/// sets it when it loads; it is called outside the allocator lock, on the refusing thread.
VRAMLEDGER_EXPORT int vramledger_set_python_stack_fn(vramledger_python_stack_fn fn);

}  // extern "C"

#ifdef __cplusplus
namespace vramledger {

/// The device table calls this once per allocator, right after creating it: builds the device's
/// budget guard from options.process.plan (device keys checked against `device_count`; none: accounting
/// only) and installs it, chained before `ledger` (the history hooks, may be null), as the
/// allocator's hooks.
/// InvalidArgument "<plan>:<line>: field '<field>': ..." for a bad plan (also one exceeding the
/// card); NotFound when the plan file cannot be read.
absl::Status AttachGuard(int device, int device_count, const Options& options,
                         DeviceBackend* backend, DeviceAllocator* allocator,
                         AllocatorHooks* ledger);

/// The name of tag id `id` ("untagged" for 0; "tag#<id>" for an id never issued), for snapshots
/// that show the tag of each block (BlockInfo::tag, TraceEntry::tag).
std::string GuardTagName(std::uint32_t id);

/// Every route calls this on a failed allocation of `device`: a guard refusal comes back with its
/// message completed (largest free block, stack, forensic snapshot); any other status goes to
/// WithOomDump (history_api.h). Either way a refusal for memory ends with one line per pausable
/// region of the device (ledger/region_report.h). Never throws.
absl::Status GuardRefusalOrOomDump(int device, const absl::Status& status);

}  // namespace vramledger
#endif

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_GUARD_API_H_
