// The runtime's C ABI for pausable regions (docs/design/regions.md): a scope that routes the
// calling thread's allocations to a region, pause and resume, and the list of regions, over the
// device table's allocators. Exported by libvramledger_plugin.so (so the torch-native mode has it
// too); the LD_PRELOAD shim exports the same calls as vramledger_preload_region_* (preload.cc).
// ctypes-facing: never throw; thread-safe.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_REGION_API_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_REGION_API_H_

#include "torch_plugin/runtime/c_errors.h"

// Each returns VRAMLEDGER_OK or a vramledger_status code with the message in
// vramledger_last_error(): VRAMLEDGER_INVALID_ARGUMENT for a bad device, a null or empty name or
// a bad backup; VRAMLEDGER_OUT_OF_MEMORY when a resume is refused for memory (the card, or the
// guard with its plan line); VRAMLEDGER_FAILED otherwise (an unknown region, a pause during a
// capture, a failed pinned allocation or copy, a driver error). Every message names the region.
// A *json_out is a malloc'd string released with vramledger_string_free (NULL on failure).
extern "C" {

/// What a pause keeps of a region's live blocks (RegionBackup).
enum vramledger_region_backup {
  VRAMLEDGER_BACKUP_NONE = 0,  // nothing: the contents are lost, the addresses kept
  VRAMLEDGER_BACKUP_CPU = 1,   // copied to pinned host memory and restored by the resume
};

/// Sends the calling thread's allocations on `device` (every stream) to region `name`, created
/// on first use, until the matching vramledger_region_end; CUDA graph pools captured inside
/// belong to the region. Nests (DeviceAllocator::BeginRegion).
VRAMLEDGER_EXPORT int vramledger_region_begin(int device, const char* name);

/// Closes the calling thread's innermost scope of region `name` on `device`.
VRAMLEDGER_EXPORT int vramledger_region_end(int device, const char* name);

/// Pauses region `name` on `device` (DeviceAllocator::PauseRegion) with `backup`
/// (vramledger_region_backup). *json_out: {"device", "region", "released_bytes",
/// "backed_up_bytes", "already_paused", "handles", "wait_seconds", "copy_seconds",
/// "driver_seconds"} (RegionPauseResult).
VRAMLEDGER_EXPORT int vramledger_region_pause(int device, const char* name, int backup,
                                              char** json_out);

/// Resumes region `name` on `device` (DeviceAllocator::ResumeRegion); `keep_host_buffers`
/// non-zero keeps the pinned buffers for the next pause. A refusal for memory reports as an
/// allocation's does (GuardRefusalOrOomDump: the guard's full message or the out-of-memory dump,
/// and the device's regions). *json_out: {"device", "region", "mapped_bytes", "restored_bytes",
/// "already_running", "handles", "driver_seconds", "copy_seconds"} (RegionResumeResult).
VRAMLEDGER_EXPORT int vramledger_region_resume(int device, const char* name, int keep_host_buffers,
                                               char** json_out);

/// The regions of `device` (-1: every device that has an allocator) as a JSON array of
/// {"device", "name", "pool": [first, second], "paused", "reserved_bytes", "mapped_bytes",
/// "allocated_bytes", "paused_bytes", "backed_up_bytes", "host_buffer_bytes", "lost_bytes"}
/// (bytes), in the allocator's order. A device without an allocator has none.
VRAMLEDGER_EXPORT int vramledger_region_list(int device, char** json_out);

}  // extern "C"

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_REGION_API_H_
