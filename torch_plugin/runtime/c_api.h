// The runtime's C ABI, shared by the routes that run in a torch process: options, statistics,
// cache control and scopes for the Python package (ctypes), and the C++-facing accessors the
// torch-native library reads the allocators through. Exported by libvramledger_plugin.so.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_C_API_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_C_API_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "torch_plugin/runtime/c_errors.h"

// The ctypes-facing functions never throw. Those returning int give 0 on success and a
// vramledger_status code on failure; the message is then in vramledger_last_error().
extern "C" {

// ---- ctypes-facing ----

/// An out-of-memory observer: torch's OutOfMemoryObserver arguments (device, the allocation size
/// that failed, the limit: the memory-fraction cap if set, else the device total, and the device's
/// free bytes). Called on the allocating thread, without allocator locks, before the throw.
typedef void (*vramledger_oom_observer_fn)(int device, std::size_t alloc_size, std::size_t limit,
                                           std::size_t device_free);

/// Registers `observer` (nullptr removes it), replacing any earlier one; Python registers one
/// trampoline that calls every vramledger.attach_out_of_memory_observer callable. Returns
/// VRAMLEDGER_OK.
VRAMLEDGER_EXPORT int vramledger_set_oom_observer(vramledger_oom_observer_fn observer);

/// Sets the allocator options from `conf` (`key:value,...`, PYTORCH_CUDA_ALLOC_CONF syntax),
/// merged over VRAMLEDGER_CONF from the environment (`conf` wins), over the defaults of a served
/// process (RuntimeDefaults(): expandable segments on). Must precede the first
/// allocation; afterwards only the same string is accepted. NULL means "".
/// Returns VRAMLEDGER_INVALID_ARGUMENT for an unknown key or bad value (the message names it),
/// VRAMLEDGER_FAILED if allocators already run with a different string.
VRAMLEDGER_EXPORT int vramledger_configure(const char* conf);

/// Every accepted option key, comma-separated, in the order of OptionTable(). Static storage.
VRAMLEDGER_EXPORT const char* vramledger_option_names();

/// Number of CUDA devices, or -1 on failure (message in vramledger_last_error()).
VRAMLEDGER_EXPORT int vramledger_device_count();

/// The statistics of `device` as a JSON object: every key of torch.cuda.memory_stats() (integers,
/// bytes or counts), "largest_free_block_bytes", "utilization" (float, peak allocated / peak
/// reserved), and per pausable region "regions.<name>.<figure>" (ledger/region_report.h). A device that has not allocated yet reports zeros. On success *json_out is a
/// malloc'd NUL-terminated string the caller releases with vramledger_string_free; on failure it
/// is NULL. VRAMLEDGER_INVALID_ARGUMENT for a bad device index or null `json_out`,
/// VRAMLEDGER_FAILED when CUDA is unavailable.
VRAMLEDGER_EXPORT int vramledger_memory_stats_json(int device, char** json_out);

/// The fragmentation figures of `device` as a JSON object: every field of
/// vramledger::Fragmentation (ledger/fragmentation_json.h: "utilization" peak allocated / peak
/// reserved, "wasted_bytes", "wasted_bytes_at_peak", "free_bytes", "largest_free_block",
/// "free_space_fragmentation" in [0, 1], "holes", "mapped_free_pages",
/// "other_stream_cached_bytes", "page_moves", "retiring_bytes", "reused_old_mappings"; sizes in
/// bytes), "regions" (a list, as vramledger_region_list gives it), "device", "current_stream" (the stream given, as an integer), "host_time" (the
/// allocator's Malloc and Free: {"count", "time_us"} each, zeros unless host_timing is on), and
/// the driver calls made so far:
/// "driver_calls" maps each call kind's CUDA name (e.g. "cuMemMap") to {"count", "time_us"},
/// "driver_calls_total", "driver_time_us_total", and "driver_time" = "measured" (CUDA, wall
/// time around each call) or "modelled" (SimBackend's cost model). `current_stream` decides which
/// cached bytes count as another stream's. A device that has not allocated yet reports zeros.
/// *json_out as for vramledger_memory_stats_json (release with vramledger_string_free).
/// VRAMLEDGER_INVALID_ARGUMENT for a bad device index or null `json_out`, VRAMLEDGER_FAILED when
/// CUDA is unavailable.
VRAMLEDGER_EXPORT int vramledger_fragmentation_json(int device, cudaStream_t current_stream,
                                                    char** json_out);

/// Opens a contiguous-segments scope on the calling thread: until the matching exit, its
/// allocations come from plain single-handle segments (cudaMalloc) even with expandable segments
/// on, e.g. buffers registered for RDMA or shared with NCCL. Nests; per thread (an allocation
/// made by another thread, such as torch's autograd workers, is not covered). Returns
/// VRAMLEDGER_OK.
VRAMLEDGER_EXPORT int vramledger_contiguous_segments_enter(void);

/// Closes the innermost scope opened on the calling thread. VRAMLEDGER_FAILED, with a message,
/// when no scope is open on this thread (exit without enter); nothing changes then.
VRAMLEDGER_EXPORT int vramledger_contiguous_segments_exit(void);

/// Number of contiguous-segments scopes open on the calling thread (0 outside any).
VRAMLEDGER_EXPORT int vramledger_contiguous_segments_depth(void);

/// Returns every fully free cached segment of `device` (-1: every device) to the driver.
VRAMLEDGER_EXPORT int vramledger_empty_cache(int device);

/// reset_peak_memory_stats: every peak of `device` (-1: every device) becomes its current value.
VRAMLEDGER_EXPORT int vramledger_reset_peak(int device);

/// reset_accumulated_memory_stats: totals and counters of `device` (-1: every device) become 0.
VRAMLEDGER_EXPORT int vramledger_reset_accumulated(int device);

// ---- Testing only (the C++ tests of the ABI; no GPU needed) ----

/// Serves `device_count` simulated devices of `capacity` bytes each (SimBackend) instead of CUDA.
/// Must come before anything else touches the device table: VRAMLEDGER_FAILED afterwards.
VRAMLEDGER_EXPORT int vramledger_testing_use_sim_backend(int device_count, std::size_t capacity);

/// Completes every event recorded so far on the simulated `device` (as if its streams drained).
/// VRAMLEDGER_INVALID_ARGUMENT if `device` has no simulated allocator.
VRAMLEDGER_EXPORT int vramledger_testing_complete_events(int device);
}  // extern "C"

#ifdef __cplusplus
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace vramledger {
struct DeviceStats;    // vramledger/stats.h
struct Options;        // vramledger/options.h
struct SegmentInfo;    // vramledger/device_allocator.h
struct RecordedEntry;  // ledger/history.h
}  // namespace vramledger

// ---- C++-facing: the torch-native library (torch_plugin/native/, which links
// libvramledger_plugin.so, where the runtime's one table lives; docs/design/torch-native-mode.md)
// reads the allocators through these. Built with the same headers, so the C++ types agree.
// Never throw. ----
extern "C" {

/// Frees `ptr` on whichever device's allocator handed it out (the calling thread's current
/// device first). A pointer no allocator knows, or a failed free, is reported on stderr.
VRAMLEDGER_EXPORT void vramledger_free_any_device(void* ptr);

/// Copies `device`'s stats (GetStats()) into *out; false when that device has no allocator yet.
VRAMLEDGER_EXPORT bool vramledger_device_stats(int device, vramledger::DeviceStats* out);

/// Copies `device`'s segments (SegmentsOf) and options into *segments and *options; false when
/// that device has no allocator yet.
VRAMLEDGER_EXPORT bool vramledger_device_segments(int device,
                                                  std::vector<vramledger::SegmentInfo>* segments,
                                                  vramledger::Options* options);

/// The options allocators are (or will be) created with (VRAMLEDGER_CONF, vramledger_configure);
/// false when they do not parse (vramledger_malloc then throws the reason).
VRAMLEDGER_EXPORT bool vramledger_current_options(vramledger::Options* out);

/// The device's free bytes as its backend reports them (cudaMemGetInfo, or the simulated
/// capacity left), creating the device's allocator if needed; false on failure.
VRAMLEDGER_EXPORT bool vramledger_device_free_bytes(int device, std::size_t* free_bytes);

/// True while the memory history records (vramledger_record_memory_history, from any route).
VRAMLEDGER_EXPORT bool vramledger_history_recording(void);

/// Copies the memory history's trace entries of `device` (oldest first; empty while history is
/// off) into *out (history_api.cc).
VRAMLEDGER_EXPORT void vramledger_history_entries(int device,
                                                  std::vector<vramledger::RecordedEntry>* out);

/// The vramledger::TraceAction named `name` in torch's spelling ("alloc", "free_requested", ...)
/// as an int, or -1 for an unknown or null name (the core's ParseTraceAction).
VRAMLEDGER_EXPORT int vramledger_trace_action(const char* name);

// CUDA IPC (ipc_api.cc; docs/design/ipc.md): torch's shareIpcHandle, getIpcDevPtr and
// getBaseAllocation on the runtime's allocators. 0 or a vramledger_status code, the message in
// vramledger_last_error().

/// The handle bytes and offset of the live block at `ptr`, on whichever device's allocator
/// holds it (the current device first).
VRAMLEDGER_EXPORT int vramledger_ipc_share(void* ptr, std::ptrdiff_t* offset, std::string* handle);
/// Opens `handle` (another process's share) on `device`, whose allocator is created if needed.
VRAMLEDGER_EXPORT int vramledger_ipc_open(int device, const std::string* handle,
                                          std::shared_ptr<void>* out);
/// The plain segment {*base, *size} under the live block at `ptr` (any device).
VRAMLEDGER_EXPORT int vramledger_base_allocation(void* ptr, void** base, std::size_t* size);

/// Adds an out-of-memory observer with torch's arguments (device, allocation size, limit,
/// device free bytes), called before every OutOfMemoryError a torch route throws, after the C one.
VRAMLEDGER_EXPORT void vramledger_add_oom_observer(
    std::function<void(std::int64_t, std::size_t, std::size_t, std::size_t)> observer);
}  // extern "C"
#endif  // __cplusplus

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_C_API_H_
