// NativeAllocator: torch's CUDAAllocator interface answered by the runtime's allocators
// (docs/design/torch-native-mode.md). libvramledger_native.so, linked to the plugin (where the
// runtime's one device table lives) and libc10_cuda.
#include "torch_plugin/native/native_allocator.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "ledger/history.h"
#include "torch_plugin/native/native_trace.h"
#include "torch_plugin/pluggable/plugin.h"
#include "torch_plugin/runtime/c_errors.h"
#include "torch_plugin/runtime/history_api.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"
#include "vramledger/stats.h"

namespace vramledger {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

// Every DataPtr's deleter is raw_deleter(): CUDA graph trees swap a storage's deleter only after
// comparing it with raw_deleter() (native_checkpoint.cc). It finds the address's device itself.
bool IsOurDeleter(c10::DeleterFnPtr deleter) { return deleter == &vramledger_free_any_device; }

void CheckDevice(c10::DeviceIndex device, const char* call) {
  TORCH_CHECK(device >= 0 && device < NativeAllocator::kMaxDevices, "vramledger: ", call,
              ": device index ", static_cast<int>(device), " is outside [0, ",
              NativeAllocator::kMaxDevices, ")");
}

// As CheckDevice, and the device must exist (torch: "Invalid device argument").
void CheckDeviceExists(c10::DeviceIndex device, const char* call) {
  CheckDevice(device, call);
  const int count = vramledger_device_count();
  TORCH_CHECK(device < count, "vramledger: ", call, ": invalid device argument ",
              static_cast<int>(device), " (", count, " CUDA devices)");
}

c10::DeviceIndex CurrentDevice() {
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return device;
}

// ctypes-facing status of the ABI (0 ok, else VRAMLEDGER_FAILED), thrown as a c10::Error.
void ThrowIfFailed(int rc, const char* call) {
  TORCH_CHECK(rc == VRAMLEDGER_OK, "vramledger: ", call, ": ", vramledger_last_error());
}

void CopyStat(const Stat& from, c10::CachingAllocator::Stat* to) {
  to->current = from.current;
  to->peak = from.peak;
  to->allocated = from.allocated;
  to->freed = from.freed;
}

void CopyStats(const StatArray& from, c10::CachingAllocator::StatArray* to) {
  for (int i = 0; i < kNumStatTypes; ++i) CopyStat(from[i], &(*to)[i]);
}

}  // namespace

NativeAllocator* NativeAllocator::Get() {
  static NativeAllocator* const instance = new NativeAllocator;  // never destroyed
  return instance;
}

c10::DataPtr NativeAllocator::AllocateOn(c10::DeviceIndex device, cudaStream_t stream,
                                         std::size_t n) {
  CheckDevice(device, "allocate");
  const c10::Device where(c10::DeviceType::CUDA, device);
  if (n == 0) return {nullptr, nullptr, &vramledger_free_any_device, where};
  // Throws c10::OutOfMemoryError after the OOM observers ran, as on the pluggable route.
  void* ptr = vramledger_malloc(n, device, stream);
  return {ptr, ptr, &vramledger_free_any_device, where};
}

c10::DataPtr NativeAllocator::allocate(std::size_t n) {
  const c10::DeviceIndex device = CurrentDevice();
  return AllocateOn(device, c10::cuda::getCurrentCUDAStream(device).stream(), n);
}

// A free of an address whose device is unknown: the plugin tries the current device's allocator
// first, then the others.
c10::DeleterFnPtr NativeAllocator::raw_deleter() const { return &vramledger_free_any_device; }

void NativeAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

bool NativeAllocator::initialized() { return initialized_.load(std::memory_order_acquire); }

c10::CachingDeviceAllocator::DeviceStats NativeAllocator::getDeviceStats(c10::DeviceIndex device) {
  CheckDeviceExists(device, "memory_stats");
  c10::CachingDeviceAllocator::DeviceStats out;
  DeviceStats s;
  if (!vramledger_device_stats(device, &s)) {  // nothing allocated there yet: zeros, as torch
    Options options;
    if (vramledger_current_options(&options)) {
      out.max_split_size = static_cast<std::int64_t>(options.max_split_size);  // SIZE_MAX: -1
    }
    return out;
  }
  CopyStats(s.allocation, &out.allocation);
  CopyStats(s.segment, &out.segment);
  CopyStats(s.active, &out.active);
  CopyStats(s.inactive_split, &out.inactive_split);
  CopyStats(s.allocated_bytes, &out.allocated_bytes);
  CopyStats(s.reserved_bytes, &out.reserved_bytes);
  CopyStats(s.active_bytes, &out.active_bytes);
  CopyStats(s.inactive_split_bytes, &out.inactive_split_bytes);
  CopyStats(s.requested_bytes, &out.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  CopyStat(s.oversize_allocations, &out.oversize_allocations);
  CopyStat(s.oversize_segments, &out.oversize_segments);
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = s.max_split_size;
  return out;
}

void NativeAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  ThrowIfFailed(vramledger_reset_accumulated(device), "reset_accumulated_memory_stats");
}

void NativeAllocator::resetPeakStats(c10::DeviceIndex device) {
  ThrowIfFailed(vramledger_reset_peak(device), "reset_peak_memory_stats");
}

void* NativeAllocator::raw_alloc(std::size_t nbytes) {
  const c10::DeviceIndex device = CurrentDevice();
  return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* NativeAllocator::raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) return nullptr;
  return vramledger_malloc(nbytes, CurrentDevice(), stream);
}

void NativeAllocator::raw_delete(void* ptr) { vramledger_free_any_device(ptr); }

void NativeAllocator::init(int device_count) {
  vramledger_init(device_count);  // throws if CUDA has no device or the count cannot be read
  initialized_.store(true, std::memory_order_release);
}

double NativeAllocator::getMemoryFraction(c10::DeviceIndex device) {
  CheckDevice(device, "get_per_process_memory_fraction");
  const double f = fractions_[device].load(std::memory_order_relaxed);
  if (!std::isnan(f)) return f;  // set through torch
  Options options;  // else the conf's per_process_memory_fraction (0 there means no cap)
  if (vramledger_current_options(&options) && options.per_process_memory_fraction > 0) {
    return options.per_process_memory_fraction;
  }
  return 1.0;
}

void NativeAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  CheckDevice(device, "set_per_process_memory_fraction");
  vramledger_set_memory_fraction(fraction, device);  // throws on a bad value
  fractions_[device].store(fraction, std::memory_order_relaxed);
}

std::vector<torch_alloc::StreamSegmentSize> NativeAllocator::getExpandableSegmentSizes(
    c10::DeviceIndex device) {
  (void)device;  // torch asks only for its own checkpointing of expandable segments
  return {};
}

void NativeAllocator::enable(bool value) {
  // torch's native allocator then serves every request with an uncached cudaMalloc; vramledger
  // has no uncached mode (its ledger is the cache), so it says so rather than pretend.
  TORCH_CHECK(value,
              "vramledger (torch-native mode) cannot run without its cache "
              "(caching_allocator_enable(False)); use torch's own allocator for that");
}

bool NativeAllocator::isEnabled() const { return true; }

void NativeAllocator::cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) {
  // torch's rule (cuDNN sizes its workspace by it): a zero *largest_block is first guessed as
  // the device's free bytes, then the largest cached block counts if it is larger.
  CheckDeviceExists(device, "cache_info");
  if (*largest_block == 0) {
    std::size_t free_bytes = 0;
    if (vramledger_device_free_bytes(device, &free_bytes)) *largest_block = free_bytes;
  }
  DeviceStats s;
  if (vramledger_device_stats(device, &s)) {
    *largest_block = std::max(*largest_block, static_cast<std::size_t>(s.largest_free_block_bytes));
  }
}

void NativeAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  // As torch's own allocator: a block another allocator made (e.g. before a swap) is skipped.
  if (ptr.get() == nullptr || !IsOurDeleter(ptr.get_deleter())) return;
  vramledger_record_stream(ptr.get(), stream.stream());
}

torch_alloc::SnapshotInfo NativeAllocator::snapshot(c10::MempoolId_t mempool_id,
                                                    bool include_traces) {
  // As torch's: {0, 0} gives every pool's segments, a private pool's id only that pool's.
  const bool one_pool = mempool_id.first != 0 || mempool_id.second != 0;
  torch_alloc::SnapshotInfo info;
  const int count = vramledger_device_count();
  info.device_traces.resize(count > 0 ? static_cast<std::size_t>(count) : 0);
  Options options;
  for (int d = 0; d < count; ++d) {
    std::vector<SegmentInfo> segments;
    if (!vramledger_device_segments(d, &segments, &options)) continue;
    for (const SegmentInfo& seg : segments) {
      const c10::MempoolId_t owner{seg.pool_id.first, seg.pool_id.second};
      if (one_pool && owner != mempool_id) continue;
      c10::CachingDeviceAllocator::SegmentInfo out;
      out.device = static_cast<c10::DeviceIndex>(seg.device);
      out.address = static_cast<std::size_t>(seg.address);
      out.total_size = seg.total_size;
      out.requested_size = seg.requested_size;
      out.allocated_size = seg.allocated_size;
      out.active_size = seg.active_size;
      out.stream = reinterpret_cast<void*>(seg.stream);
      out.is_large = !seg.is_small;
      out.is_expandable = seg.is_expandable;
      out.owner_private_pool_id = owner;
      for (const BlockInfo& b : seg.blocks) {
        c10::CachingDeviceAllocator::BlockInfo block;
        block.size = b.size;
        block.requested_size = b.requested_size;
        const std::string state = b.state;
        block.allocated = state == "active_allocated";
        block.active = state != "inactive";
        out.blocks.push_back(std::move(block));
      }
      info.segments.push_back(std::move(out));
    }
  }
  // The trace entries of vramledger's history, without frames (torch's frames are its own
  // CapturedTraceback objects; vramledger.snapshot() carries vramledger's Python and native
  // frames for the same entries).
  std::vector<TraceAction> skipped;
  {
    std::lock_guard<std::mutex> lock(skip_mu_);
    skipped = skip_actions_;
  }
  for (int d = 0; include_traces && d < count; ++d) {
    std::vector<RecordedEntry> entries;
    vramledger_history_entries(d, &entries);
    auto& trace = info.device_traces[static_cast<std::size_t>(d)];
    trace.reserve(entries.size());
    for (const RecordedEntry& e : entries) {
      if (std::find(skipped.begin(), skipped.end(), e.action) != skipped.end()) continue;
      trace.emplace_back(TorchTraceAction(e.action), static_cast<c10::DeviceIndex>(d),
                         static_cast<std::size_t>(e.addr), e.size,
                         reinterpret_cast<void*>(e.stream), c10::MempoolId_t{0, 0},
                         c10::approx_time_t{0});
      trace.back().time_.t_ = static_cast<time_t>(e.time_us);  // torch's snapshot: epoch us
    }
  }
  info.config_metadata.garbage_collection_threshold = options.garbage_collection_threshold;
  info.config_metadata.max_split_size = options.max_split_size;
  info.config_metadata.pinned_num_register_threads = 1;
  info.config_metadata.expandable_segments = options.expandable_segments;
  info.config_metadata.release_lock_on_malloc = options.release_lock_on_cudamalloc;
  info.config_metadata.pinned_use_host_register = false;
  info.config_metadata.graph_capture_record_stream_reuse = false;
  info.config_metadata.last_allocator_settings = options.conf_string;
  for (std::size_t v : options.roundup_power2_divisions) {
    info.config_metadata.roundup_power2_divisions.push_back(v);
  }
  return info;
}

bool NativeAllocator::isHistoryEnabled() { return vramledger_history_recording(); }

void NativeAllocator::recordHistory(bool enabled,
                                    c10::CachingDeviceAllocator::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries,
                                    c10::CachingDeviceAllocator::RecordContext when,
                                    bool clear_history,
                                    const std::vector<std::string>& skip_actions) {
  // torch's switch: `enabled` on or off, `when` from its `context=` argument, and its
  // `enabled="state"` arriving as a one-entry trace ring (torch's _record_memory_history).
  // vramledger captures its own Python and native frames (ledger/stack_capture.h), so torch's
  // context recorder is not called; `skip_actions` are left out of torch's snapshot() only
  // (vramledger.snapshot() keeps them).
  (void)context_recorder;
  using Ctx = c10::CachingDeviceAllocator::RecordContext;
  const char* context = when == Ctx::ALL     ? "all"
                        : when == Ctx::ALLOC ? "alloc"
                        : when == Ctx::STATE ? "state"
                                             : nullptr;
  const unsigned long long entries = alloc_trace_max_entries > 0 ? alloc_trace_max_entries : 1;
  ThrowIfFailed(vramledger_record_memory_history(enabled ? "all" : nullptr, context, "python",
                                                 entries, clear_history ? 1 : 0),
                "_record_memory_history");
  std::vector<TraceAction> skipped;
  for (const std::string& name : skip_actions) {
    const int action = vramledger_trace_action(name.c_str());
    TORCH_CHECK_VALUE(action >= 0, "vramledger: _record_memory_history: unknown action '", name,
                      "' in skip_actions");
    skipped.push_back(static_cast<TraceAction>(action));
  }
  std::lock_guard<std::mutex> lock(skip_mu_);
  skip_actions_ = std::move(skipped);
}

void NativeAllocator::attachOutOfMemoryObserver(torch_alloc::OutOfMemoryObserver observer) {
  vramledger_add_oom_observer(std::move(observer));
}

void NativeAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  // As torch's allocators: peer access for the runtime; vramledger's CudaBackend grants mapped
  // pages to the peers it finds active (docs/design/peer-access.md).
  c10::cuda::CUDAGuard guard(dev);
  const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
  } else {
    C10_CUDA_CHECK(err);
  }
}

cudaError_t NativeAllocator::memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                                         std::size_t count, cudaStream_t stream, bool p2p_enabled) {
  // torch's native rule: mapped (cuMemMap) memory needs the peer copy without P2P.
  if (p2p_enabled || dst_device == src_device) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

// getCheckpointState, setCheckpointPoolState, checkPoolLiveAllocations: native_checkpoint.cc.

std::string NativeAllocator::name() { return "vramledger"; }

}  // namespace vramledger

extern "C" {

int vramledger_native_install(void) {
  namespace torch_alloc = c10::cuda::CUDACachingAllocator;
  return vramledger::CatchAll([]() -> absl::Status {
    torch_alloc::CUDAAllocator* current = torch_alloc::allocator.load();
    vramledger::NativeAllocator* ours = vramledger::NativeAllocator::Get();
    if (current == ours) {
      return absl::FailedPreconditionError(
          "vramledger (torch-native mode) is already torch's allocator");
    }
    // torch's changeCurrentAllocator allows a change only before CUDA starts (its allocator is
    // then in use).
    if (current != nullptr && current->initialized()) {
      return absl::FailedPreconditionError(
          "torch's CUDA allocator is already initialized (a CUDA tensor or torch.cuda call came "
          "first), so it can no longer be replaced");
    }
    torch_alloc::allocator.store(ours);
    return absl::OkStatus();
  });
}

const char* vramledger_native_last_error(void) { return vramledger::LastError().c_str(); }

#define VRAMLEDGER_STR2(x) #x
#define VRAMLEDGER_STR(x) VRAMLEDGER_STR2(x)
const char* vramledger_native_torch_version(void) {
  return VRAMLEDGER_STR(TORCH_VERSION_MAJOR) "." VRAMLEDGER_STR(TORCH_VERSION_MINOR);
}

void* vramledger_native_allocator(void) { return vramledger::NativeAllocator::Get(); }

}  // extern "C"
