// The CUDAPluggableAllocator route's C ABI in libvramledger_plugin.so: the alloc/free pair and
// hooks that torch calls. The runtime's ctypes-facing ABI (runtime/c_api.h) is exported beside it.
#ifndef VRAMLEDGER_TORCH_PLUGIN_PLUGGABLE_PLUGIN_H_
#define VRAMLEDGER_TORCH_PLUGIN_PLUGGABLE_PLUGIN_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include "torch_plugin/runtime/c_api.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"

// Two kinds of entry point, with different error rules:
//
// * Torch-facing (vramledger_malloc and the hooks init/reset/memory_fraction/record_stream): torch
//   calls them from C++ frames that propagate exceptions into Python, so they report errors by
//   throwing c10 errors: c10::OutOfMemoryError (Python torch.OutOfMemoryError) for a refusal,
//   c10::ValueError (ValueError) for bad options or arguments, c10::Error (RuntimeError) for any
//   other failure. vramledger_free never throws: it runs inside tensor destructors.
//
// * ctypes-facing (runtime/c_api.h and the testing function below): never throw.
extern "C" {

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
/// A pool may be allocated to by several such entries at once, as in torch. C++ parameters by
/// value: built with torch's libstdc++ and C++11 ABI. Throws c10::Error for a bad device.
VRAMLEDGER_EXPORT void vramledger_begin_allocate_to_pool(int device, vramledger_mempool_id pool_id,
                                                         std::function<bool(cudaStream_t)> filter);

/// set_end_allocate_to_pool_fn hook (`void(int, MempoolId_t)`, capture_end): stops routing to
/// the pool; its memory stays reserved for the graph. Throws c10::Error for an inactive pool.
VRAMLEDGER_EXPORT void vramledger_end_allocate_to_pool(int device, vramledger_mempool_id pool_id);

/// set_release_pool hook (`void(int, MempoolId_t)`, graph reset/destruction): drops one use of
/// the pool; at none its memory returns to the driver once its blocks are free. Throws
/// c10::Error for an unknown pool.
VRAMLEDGER_EXPORT void vramledger_release_pool(int device, vramledger_mempool_id pool_id);

// ---- For the LD_PRELOAD shim, when it makes the native allocator torch's (preload-route.md) ----

/// Called with the full report of each refusal (guard or out of memory) on the allocating thread,
/// just before vramledger_malloc throws it. Never throws out of the callback's caller.
typedef void (*vramledger_refusal_fn)(int device, const char* report);

/// Sets the refusal callback (NULL: none), replacing any earlier one.
VRAMLEDGER_EXPORT void vramledger_set_refusal_reporter(vramledger_refusal_fn fn);

/// Runs `fn(device)` inside each allocator's creation, before anything of it exists
/// (DeviceTable::SetBeforeCreate). Only before the first allocation.
VRAMLEDGER_EXPORT void vramledger_set_before_create(void (*fn)(int device));

// torch.cuda.MemPool and allocator trace trackers (the torch-native mode calls these; C++
// parameters as above). Errors: c10::ValueError for a bad argument, c10::Error otherwise.

/// createOrIncrefPool: creates private pool `pool_id` on `device` with one use, or adds one.
/// With `source`, the new pool's segments come from it (a MemPool's CUDAPluggableAllocator).
/// Throws c10::ValueError for the pool (0, 0) or a source given for a pool that exists.
VRAMLEDGER_EXPORT void vramledger_create_or_incref_pool(
    int device, vramledger_mempool_id pool_id, std::shared_ptr<vramledger::SegmentSource> source);

/// setUseOnOOM: the pool's free blocks serve default-pool allocations that would fail out of
/// memory. Throws c10::Error for an unknown pool.
VRAMLEDGER_EXPORT void vramledger_set_use_on_oom(int device, vramledger_mempool_id pool_id,
                                                 bool use_on_oom);

/// setNoSplit: no block of the pool is split. Throws c10::Error for an unknown pool.
VRAMLEDGER_EXPORT void vramledger_set_no_split(int device, vramledger_mempool_id pool_id);

/// getPoolUseCount: the pool's uses (0 for a pool that does not exist, or no longer).
VRAMLEDGER_EXPORT int vramledger_pool_use_count(int device, vramledger_mempool_id pool_id);

/// emptyCache(mempool_id) on every device: (0, 0) empties every cache (vramledger_reset); a
/// private pool with no use left returns its whole free segments. Throws c10::Error on a driver
/// failure.
VRAMLEDGER_EXPORT void vramledger_empty_pool_cache(vramledger_mempool_id pool_id);

/// attachAllocatorTraceTracker: `tracker` sees every trace entry of every device from now on,
/// under that device's allocator lock (runtime/trace_trackers.h).
VRAMLEDGER_EXPORT void vramledger_attach_trace_tracker(
    std::function<void(const vramledger::TraceEntry&)> tracker);

// ---- Testing only ----

/// vramledger_malloc(size, device, default stream) with the c10 error it throws caught: returns
/// the address, or NULL and, when `message_out` is not NULL, the error's text (without torch's
/// backtrace) in *message_out, released with vramledger_string_free. ctypes releases the GIL
/// around the call, as torch's operators do before they allocate.
VRAMLEDGER_EXPORT void* vramledger_testing_malloc(size_t size, int device, char** message_out);

}  // extern "C"

#endif  // VRAMLEDGER_TORCH_PLUGIN_PLUGGABLE_PLUGIN_H_
