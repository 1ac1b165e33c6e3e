// An allocator trace tracker for the multi-GPU check (benchmarks/gpu/checks/multi_gpu/nccl.py):
// attached to torch's current CUDA allocator the way ProcessGroupNCCL attaches its register hook
// (c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker), it counts every event by action
// and keeps the segment events (SEGMENT_ALLOC / FREE / MAP / UNMAP, with address and size), so the
// check can say which of the allocator's segments and pages NCCL's hook was shown and match them
// with the buffers NCCL reports registering.
//
// Trackers run under the allocator's device lock, so the tracker neither allocates nor blocks: the
// counts are atomics and the events go into a fixed array (events past its end are counted, not
// kept). torch has no detach: once attached, the tracker stays for the process's life.
//
// Not for production use: built with the GPU benchmarks only (torch_plugin/CMakeLists.txt), loaded
// by ctypes.
#include <c10/cuda/CUDACachingAllocator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>

#define VRAMLEDGER_TC_EXPORT __attribute__((visibility("default")))

namespace {

using c10::cuda::CUDACachingAllocator::TraceEntry;

constexpr int kActions = TraceEntry::OOM + 1;
constexpr int kKept = 1 << 16;  // segment events kept for the check to read back

struct SegmentEvent {
  int action;
  int device;
  std::uint64_t addr;
  std::uint64_t size;
};

std::array<std::atomic<long>, kActions> g_counts{};
std::array<SegmentEvent, kKept> g_events{};
std::atomic<long> g_next{0};   // slots handed out (may pass kKept: those events are dropped)
std::atomic<long> g_ready{0};  // slots written, in order of g_next

bool IsSegmentEvent(TraceEntry::Action a) {
  return a == TraceEntry::SEGMENT_ALLOC || a == TraceEntry::SEGMENT_FREE ||
         a == TraceEntry::SEGMENT_MAP || a == TraceEntry::SEGMENT_UNMAP;
}

void OnEvent(const TraceEntry& e) {
  const int action = static_cast<int>(e.action_);
  if (action < 0 || action >= kActions) return;
  g_counts[action].fetch_add(1, std::memory_order_relaxed);
  if (!IsSegmentEvent(e.action_)) return;
  const long slot = g_next.fetch_add(1, std::memory_order_relaxed);
  if (slot >= kKept) return;
  g_events[slot] = SegmentEvent{action, static_cast<int>(e.device_), e.addr_, e.size_};
  // Trackers of one device run under its lock, of two devices concurrently: publish in order.
  long expected = slot;
  while (!g_ready.compare_exchange_weak(expected, slot + 1, std::memory_order_release)) {
    expected = slot;
  }
}

}  // namespace

extern "C" {

/// Attaches the counting tracker to torch's current CUDA allocator. Returns 0, or -1 when the
/// allocator refused (the exception's message goes to stderr; none crosses into the caller).
VRAMLEDGER_TC_EXPORT int vramledger_tc_attach() {
  try {
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(&OnEvent);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger_tc_attach: %s\n", e.what());
    return -1;
  }
}

/// Events of `action` (torch's TraceEntry::Action value) seen so far; -1 for an unknown action.
VRAMLEDGER_TC_EXPORT long vramledger_tc_count(int action) {
  if (action < 0 || action >= kActions) return -1;
  return g_counts[action].load(std::memory_order_relaxed);
}

/// Copies segment events [first, first + max) of those kept into the arrays; returns how many
/// were copied. Events are in the order the allocator emitted them.
VRAMLEDGER_TC_EXPORT int vramledger_tc_events(int first, int max, int* actions, int* devices,
                                              std::uint64_t* addrs, std::uint64_t* sizes) {
  const long ready = g_ready.load(std::memory_order_acquire);
  int n = 0;
  for (long i = first; i < ready && n < max; ++i, ++n) {
    actions[n] = g_events[i].action;
    devices[n] = g_events[i].device;
    addrs[n] = g_events[i].addr;
    sizes[n] = g_events[i].size;
  }
  return n;
}

/// Segment events emitted but not kept (past the fixed array).
VRAMLEDGER_TC_EXPORT long vramledger_tc_dropped() {
  const long next = g_next.load(std::memory_order_relaxed);
  return next > kKept ? next - kKept : 0;
}

}  // extern "C"
