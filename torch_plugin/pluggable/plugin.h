// The C ABI of libvramledger_plugin.so: the alloc/free pair and hooks that torch's
// CUDAPluggableAllocator calls, and the status-returning functions Python calls via ctypes.
#ifndef VRAMLEDGER_TORCH_PLUGIN_PLUGIN_H_
#define VRAMLEDGER_TORCH_PLUGIN_PLUGIN_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <utility>

#define VRAMLEDGER_EXPORT __attribute__((visibility("default")))

// Two kinds of entry point, with different error rules:
//
// * Torch-facing (vramledger_malloc and the hooks init/reset/memory_fraction/record_stream): torch
//   calls them from C++ frames that propagate exceptions into Python, so they report errors by
//   throwing c10 errors: c10::OutOfMemoryError (Python torch.OutOfMemoryError) for a refusal,
//   c10::ValueError (ValueError) for bad options or arguments, c10::Error (RuntimeError) for any
//   other failure. vramledger_free never throws: it runs inside tensor destructors.
//
// * ctypes-facing (everything else): never throw. Those returning int give 0 on success and a
//   vramledger_status code on failure; the message is then in vramledger_last_error().
extern "C" {

/// Status codes of the ctypes-facing functions.
enum vramledger_status {
  VRAMLEDGER_OK = 0,
  VRAMLEDGER_INVALID_ARGUMENT = 1,  // bad options or arguments: Python raises ValueError
  VRAMLEDGER_FAILED = 2,            // anything else (driver error, wrong state): RuntimeError
};

// ---- Torch-facing ----

/// Allocates `size` bytes on `device` for use on `stream` (torch's MallocFuncType).
/// Returns nullptr only for size 0; never for size > 0. Throws c10::OutOfMemoryError with torch's
/// out-of-memory message when the allocator refuses, c10::ValueError when VRAMLEDGER_CONF is
/// malformed, c10::Error for any other driver failure.
VRAMLEDGER_EXPORT void* vramledger_malloc(std::size_t size, int device, cudaStream_t stream);

/// Frees `ptr` (torch's FreeFuncType; `size`, `device`, `stream` are the alloc-time values).
/// nullptr is a no-op. An unknown pointer or a failure prints one line to stderr and returns.
VRAMLEDGER_EXPORT void vramledger_free(void* ptr, std::size_t size, int device,
                                       cudaStream_t stream);

/// Init hook (`void(int device_count)`): sizes the per-device table. Throws c10::Error if
/// cudaGetDeviceCount fails.
VRAMLEDGER_EXPORT void vramledger_init(int device_count);

/// Reset hook (`void()`, torch.cuda.empty_cache()): empties the cache of every device.
/// Throws c10::Error on a driver failure.
VRAMLEDGER_EXPORT void vramledger_reset();

/// Memory-fraction hook (`void(double, int)`): caps reserved bytes of `device` at
/// fraction x device total. Throws c10::ValueError outside [0, 1] or for a bad device.
VRAMLEDGER_EXPORT void vramledger_set_memory_fraction(double fraction, int device);

/// record_stream hook (`void(void*, cudaStream_t)`): `ptr` (a block base) was used on `stream`;
/// its memory is not reused until work queued on `stream` before its free completes.
/// Throws c10::Error for a pointer vramledger did not allocate.
VRAMLEDGER_EXPORT void vramledger_record_stream(void* ptr, cudaStream_t stream);

/// torch's MempoolId_t (c10/core/CachingDeviceAllocator.h): a CUDA graph private pool's id.
typedef std::pair<unsigned long long, unsigned long long> vramledger_mempool_id;

/// set_begin_allocate_to_pool hook (`void(int, MempoolId_t, std::function<bool(cudaStream_t)>)`,
/// torch's capture_begin and use_mem_pool): allocations on `device` on streams for which
/// `filter` is true go to private pool `pool_id` (shared if it exists) until the end hook.
/// C++ parameters by value: built with torch's libstdc++ and C++11 ABI. Throws c10::ValueError
/// if the pool is already being allocated to, c10::Error for a bad device.
VRAMLEDGER_EXPORT void vramledger_begin_allocate_to_pool(int device, vramledger_mempool_id pool_id,
                                                         std::function<bool(cudaStream_t)> filter);

/// set_end_allocate_to_pool_fn hook (`void(int, MempoolId_t)`, capture_end): stops routing to
/// the pool; its memory stays reserved for the graph. Throws c10::Error for an inactive pool.
VRAMLEDGER_EXPORT void vramledger_end_allocate_to_pool(int device, vramledger_mempool_id pool_id);

/// set_release_pool hook (`void(int, MempoolId_t)`, graph reset/destruction): drops one use of
/// the pool; at none its memory returns to the driver once its blocks are free. Throws
/// c10::Error for an unknown pool.
VRAMLEDGER_EXPORT void vramledger_release_pool(int device, vramledger_mempool_id pool_id);

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

/// The message of the last failure on the calling thread ("" if none). Valid until the next
/// vramledger call on this thread.
VRAMLEDGER_EXPORT const char* vramledger_last_error();

/// Sets the allocator options from `conf` (`key:value,...`, PYTORCH_CUDA_ALLOC_CONF syntax),
/// merged over VRAMLEDGER_CONF from the environment (`conf` wins). Must precede the first
/// allocation; afterwards only the same string is accepted. NULL means "".
/// Returns VRAMLEDGER_INVALID_ARGUMENT for an unknown key or bad value (the message names it),
/// VRAMLEDGER_FAILED if allocators already run with a different string.
VRAMLEDGER_EXPORT int vramledger_configure(const char* conf);

/// Every accepted option key, comma-separated, in the order of OptionTable(). Static storage.
VRAMLEDGER_EXPORT const char* vramledger_option_names();

/// Number of CUDA devices, or -1 on failure (message in vramledger_last_error()).
VRAMLEDGER_EXPORT int vramledger_device_count();

/// The statistics of `device` as a JSON object: every key of torch.cuda.memory_stats() (integers,
/// bytes or counts), "largest_free_block_bytes", and "utilization" (float, peak allocated / peak
/// reserved). A device that has not allocated yet reports zeros. On success *json_out is a
/// malloc'd NUL-terminated string the caller releases with vramledger_string_free; on failure it
/// is NULL. VRAMLEDGER_INVALID_ARGUMENT for a bad device index or null `json_out`,
/// VRAMLEDGER_FAILED when CUDA is unavailable.
VRAMLEDGER_EXPORT int vramledger_memory_stats_json(int device, char** json_out);

/// The fragmentation figures of `device` as a JSON object (issue 3): every field of
/// vramledger::Fragmentation ("utilization" peak allocated / peak reserved, "wasted_bytes",
/// "wasted_bytes_at_peak", "free_bytes", "largest_free_block", "free_space_fragmentation" in
/// [0, 1], "holes", "mapped_free_pages", "other_stream_cached_bytes", "page_moves",
/// "retiring_bytes"; sizes in
/// bytes), "current_stream" (the stream given, as an integer), and the driver calls made so far:
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

/// Releases a string returned by vramledger_memory_stats_json. NULL is a no-op.
VRAMLEDGER_EXPORT void vramledger_string_free(char* s);

/// Returns every fully free cached segment of `device` (-1: every device) to the driver.
VRAMLEDGER_EXPORT int vramledger_empty_cache(int device);

/// reset_peak_memory_stats: every peak of `device` (-1: every device) becomes its current value.
VRAMLEDGER_EXPORT int vramledger_reset_peak(int device);

/// reset_accumulated_memory_stats: totals and counters of `device` (-1: every device) become 0.
VRAMLEDGER_EXPORT int vramledger_reset_accumulated(int device);

// ---- Testing only (the C++ tests of this ABI; no GPU needed) ----

/// Serves `device_count` simulated devices of `capacity` bytes each (SimBackend) instead of CUDA.
/// Must come before anything else touches the device table: VRAMLEDGER_FAILED afterwards.
VRAMLEDGER_EXPORT int vramledger_testing_use_sim_backend(int device_count, std::size_t capacity);

/// Completes every event recorded so far on the simulated `device` (as if its streams drained).
/// VRAMLEDGER_INVALID_ARGUMENT if `device` has no simulated allocator.
VRAMLEDGER_EXPORT int vramledger_testing_complete_events(int device);
/// vramledger_malloc(size, device, default stream) with the c10 error it throws caught: returns
/// the address, or NULL and, when `message_out` is not NULL, the error's text (without torch's
/// backtrace) in *message_out, released with vramledger_string_free. ctypes releases the GIL
/// around the call, as torch's operators do before they allocate.
VRAMLEDGER_EXPORT void* vramledger_testing_malloc(size_t size, int device, char** message_out);

}  // extern "C"

#ifdef __cplusplus
#include <cstdint>
#include <vector>

namespace vramledger {
struct DeviceStats;    // vramledger/stats.h
struct Options;        // vramledger/options.h
struct SegmentInfo;    // vramledger/device_allocator.h
struct RecordedEntry;  // ledger/history.h
}  // namespace vramledger

// ---- C++-facing: the torch-native mode (torch_plugin/native_allocator.cc, a library of its own
// that links this one; docs/design/torch-native-mode.md) reads the plugin's allocators through
// these. Built from the same sources and headers, so the C++ types agree. Never throw. ----
extern "C" {

/// Frees `ptr` on whichever device's allocator handed it out (the calling thread's current
/// device first). A pointer no allocator knows, or a failed free, is reported on stderr.
VRAMLEDGER_EXPORT void vramledger_free_any_device(void* ptr);

/// Copies `device`'s stats (GetStats()) into *out; false when that device has no allocator yet.
VRAMLEDGER_EXPORT bool vramledger_device_stats(int device, vramledger::DeviceStats* out);

/// Copies `device`'s segments (Snapshot()) and options into *segments and *options; false when
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
/// off) into *out (torch_plugin/plugin_history.cc).
VRAMLEDGER_EXPORT void vramledger_history_entries(int device,
                                                  std::vector<vramledger::RecordedEntry>* out);

/// The vramledger::TraceAction named `name` in torch's spelling ("alloc", "free_requested", ...)
/// as an int, or -1 for an unknown or null name (the core's ParseTraceAction).
VRAMLEDGER_EXPORT int vramledger_trace_action(const char* name);

/// Adds an out-of-memory observer with torch's arguments (device, allocation size, limit,
/// device free bytes), called before every OutOfMemoryError the plugin throws, after the C one.
VRAMLEDGER_EXPORT void vramledger_add_oom_observer(
    std::function<void(std::int64_t, std::size_t, std::size_t, std::size_t)> observer);
}  // extern "C"
#endif  // __cplusplus

#endif  // VRAMLEDGER_TORCH_PLUGIN_PLUGIN_H_
