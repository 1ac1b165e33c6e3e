// The torch-native mode: vramledger as torch's own CUDAAllocator
// (docs/design/torch-native-mode.md), so torch's memory_stats, memory_summary, _snapshot and
// record_memory_history reach vramledger without the CUDAPluggableAllocator's map and mutex. Built
// per torch minor version.
#ifndef VRAMLEDGER_TORCH_PLUGIN_NATIVE_NATIVE_ALLOCATOR_H_
#define VRAMLEDGER_TORCH_PLUGIN_NATIVE_NATIVE_ALLOCATOR_H_

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "vramledger/hooks.h"

#define VRAMLEDGER_NATIVE_EXPORT __attribute__((visibility("default")))

namespace vramledger {

/// torch's `CUDAAllocator` served by the runtime's per-device allocators (in
/// libvramledger_plugin.so, the same ones the pluggable route uses; options, guard and history
/// are the runtime's).
///
/// Each DataPtr's context is its address and its deleter raw_deleter(), which finds the
/// address's device, so a free needs no map of its own (the ledger keys blocks by address) and
/// CUDA graph trees can swap storages' deleters (they compare them with raw_deleter()). Errors
/// follow torch's allocator: an allocation that cannot be served throws c10::OutOfMemoryError
/// (torch.OutOfMemoryError) after the plugin's OOM observers ran. CUDA IPC follows torch's
/// native allocator (native_ipc.cc, docs/design/ipc.md). Thread-safe.
class VRAMLEDGER_NATIVE_EXPORT NativeAllocator final
    : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  /// Devices with a memory fraction slot of their own; a higher index is refused (c10::Error).
  static constexpr int kMaxDevices = 64;

  /// The process's instance (never destroyed: tensors may die after static destructors ran).
  static NativeAllocator* Get();

  /// `n` bytes on `device` for `stream` (raw_alloc_with_stream with an explicit device); the C++
  /// tests call it on simulated devices, where torch's current-device query has no GPU to ask.
  c10::DataPtr AllocateOn(c10::DeviceIndex device, cudaStream_t stream, std::size_t n);
  /// getIpcDevPtr on `device` rather than the current one (native_ipc.cc; the C++ tests call it
  /// on simulated devices).
  std::shared_ptr<void> OpenIpcOn(c10::DeviceIndex device, const std::string& handle);

  // c10::Allocator
  c10::DataPtr allocate(std::size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // c10::CachingDeviceAllocator::DeviceAllocator
  bool initialized() override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;

  // c10::cuda::CUDACachingAllocator::CUDAAllocator
  void* raw_alloc(std::size_t nbytes) override;
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override;
  void* getBaseAllocation(void* ptr, std::size_t* size) override;
  using CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::MempoolId_t mempool_id,
                                                         bool include_traces) override;
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override;
  void recordHistory(bool enabled, c10::CachingDeviceAllocator::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries,
                     c10::CachingDeviceAllocator::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override;
  void attachOutOfMemoryObserver(
      c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, c10::MempoolId_t id) override;
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override;
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device, c10::MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override;
  /// "vramledger" (torch.cuda.get_allocator_backend()).
  std::string name() override;

  // Private pools: CUDA graph pools and torch.cuda.MemPool (native_pools.cc). A MemPool made
  // with another allocator takes that allocator's memory as its segments.
  void createOrIncrefPool(
      c10::DeviceIndex device, c10::MempoolId_t mempool_id,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  /// {0, 0}: every pool's free cache; a private pool's: its whole free segments once unused.
  void emptyCache(c10::MempoolId_t mempool_id) override;

  // Trace trackers (native_trace.cc): each sees every trace entry in torch's form, under the
  // device allocator's lock.
  void attachAllocatorTraceTracker(
      c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) override;

 private:
  NativeAllocator() {
    for (auto& f : fractions_) f.store(std::numeric_limits<double>::quiet_NaN());
  }

  std::atomic<bool> initialized_{false};
  // Set through setMemoryFraction; NaN until then (the conf's fraction, or 1.0, is reported).
  std::array<std::atomic<double>, kMaxDevices> fractions_{};
  std::mutex skip_mu_;
  std::vector<TraceAction> skip_actions_;  // left out of snapshot()'s trace entries
};

}  // namespace vramledger

extern "C" {

/// Makes vramledger torch's current CUDA allocator (torch's `allocator` atomic, as
/// torch.cuda.memory.change_current_allocator does), before CUDA is initialized. 0 on success;
/// 2 (VRAMLEDGER_FAILED) when torch's current allocator is already initialized or is vramledger
/// already (the message is in vramledger_native_last_error()).
VRAMLEDGER_NATIVE_EXPORT int vramledger_native_install(void);

/// The message of the last failed vramledger_native_install on this thread ("" if none): the
/// runtime's one last-error store, which vramledger_last_error() reads too.
VRAMLEDGER_NATIVE_EXPORT const char* vramledger_native_last_error(void);

/// "MAJOR.MINOR" of the torch this library was built against: the CUDAAllocator vtable changes
/// between torch minor versions, so _native.py refuses to install it into any other.
VRAMLEDGER_NATIVE_EXPORT const char* vramledger_native_torch_version(void);

/// The instance as an opaque pointer (benchmarks/gpu/host_cost_bench.cc loads it this way).
VRAMLEDGER_NATIVE_EXPORT void* vramledger_native_allocator(void);

}  // extern "C"

#endif  // VRAMLEDGER_TORCH_PLUGIN_NATIVE_NATIVE_ALLOCATOR_H_
