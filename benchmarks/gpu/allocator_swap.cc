// Swaps torch's current CUDA allocator inside one process, between training steps, so that
// benchmarks/gpu/bench/inprocess_ab.py can time torch's native allocator and vramledger on the same
// process, the same GPU clocks and the same batch shapes (docs/design/step-time-measurement.md,
// "One process, both allocators").
//
// torch keeps its allocator in `c10::cuda::CUDACachingAllocator::allocator` (an exported atomic,
// CUDACachingAllocator.h) and calls it for every new tensor; each DataPtr carries its maker's
// deleter, so a block is always freed by the allocator that made it whatever is current by then.
// torch's Python API refuses to swap an initialized allocator (change_current_allocator); these
// C functions do it for a benchmark that swaps only between steps, after a synchronize, with no
// record_stream across the swap (a pluggable allocator would be asked about a native block).
//
// Not for production use: built with the GPU benchmarks only (torch_plugin/CMakeLists.txt).
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdio>
#include <exception>
#include <string>

// The library is built with hidden visibility: only these C functions are its interface.
#define VRAMLEDGER_AB_EXPORT __attribute__((visibility("default")))

namespace {

c10::cuda::CUDACachingAllocator::CUDAAllocator* AsAllocator(void* p) {
  return static_cast<c10::cuda::CUDACachingAllocator::CUDAAllocator*>(p);
}

}  // namespace

extern "C" {

/// torch's current CUDA allocator (an opaque `CUDAAllocator*`), never null once libc10_cuda is
/// loaded (its static initializer stores the backend PYTORCH_CUDA_ALLOC_CONF names).
VRAMLEDGER_AB_EXPORT void* vramledger_ab_current() {
  return c10::cuda::CUDACachingAllocator::allocator.load();
}

/// Makes `allocator` (a pointer vramledger_ab_current returned earlier) torch's current one.
/// The caller keeps every allocator it swaps alive (torch's own are static; a pluggable one is
/// held by torch.cuda.memory's module state).
VRAMLEDGER_AB_EXPORT void vramledger_ab_store(void* allocator) {
  c10::cuda::CUDACachingAllocator::allocator.store(AsAllocator(allocator));
}

/// Calls `allocator->init(device_count)` unless it is initialized already: torch's lazy CUDA
/// init sets up only the allocator current at that moment. Returns 1 when it was initialized
/// before the call, 0 when this call did it, -1 when init threw (no usable CUDA device: the
/// exception's message goes to stderr; no exception crosses into the caller).
VRAMLEDGER_AB_EXPORT int vramledger_ab_init(void* allocator, int device_count) {
  c10::cuda::CUDACachingAllocator::CUDAAllocator* a = AsAllocator(allocator);
  try {
    if (a->initialized()) return 1;
    a->init(device_count);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger_ab_init: %s\n", e.what());
    return -1;
  }
}

/// Writes `allocator->name()` (e.g. "native", "pluggable") into `out` (NUL-terminated, at most
/// `size` bytes with the NUL); returns the name's full length.
VRAMLEDGER_AB_EXPORT int vramledger_ab_name(void* allocator, char* out, int size) {
  const std::string name = AsAllocator(allocator)->name();
  if (size > 0) std::snprintf(out, static_cast<std::size_t>(size), "%s", name.c_str());
  return static_cast<int>(name.size());
}

}  // extern "C"
