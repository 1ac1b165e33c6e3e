// A CUDAAllocator for the torch-native pool tests (native_pools_test.cc) standing in for a
// CUDAPluggableAllocator: raw_alloc_with_stream / raw_delete hand out and take back addresses far
// from the simulated devices' and count the calls; every other call fails, naming itself.
#ifndef VRAMLEDGER_TESTS_TORCH_PLUGIN_FAKE_CUDA_ALLOCATOR_H_
#define VRAMLEDGER_TESTS_TORCH_PLUGIN_FAKE_CUDA_ALLOCATOR_H_

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace vramledger {

class FakeCudaAllocator final : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t) override {
    TORCH_CHECK_WITH(OutOfMemoryError, !refuse, "fake allocator: out of memory");
    ++allocs;
    void* p = reinterpret_cast<void*>(next_);
    next_ += (nbytes + (std::uintptr_t{1} << 30) - 1) >> 30 << 30;
    live.insert(p);
    return p;
  }
  void raw_delete(void* ptr) override {
    TORCH_CHECK(live.erase(ptr) == 1, "fake allocator: unknown pointer");
    ++frees;
  }
  int allocs = 0;
  int frees = 0;
  bool refuse = false;
  std::set<void*> live;

  // Not used by a pool's segments.
  c10::DataPtr allocate(std::size_t) override { Unused("allocate"); }
  void copy_data(void*, const void*, std::size_t) const override { Unused("copy_data"); }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override { Unused("emptyCache"); }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override {
    Unused("getDeviceStats");
  }
  void resetAccumulatedStats(c10::DeviceIndex) override { Unused("resetAccumulatedStats"); }
  void resetPeakStats(c10::DeviceIndex) override { Unused("resetPeakStats"); }
  void* raw_alloc(std::size_t) override { Unused("raw_alloc"); }
  void init(int) override {}
  double getMemoryFraction(c10::DeviceIndex) override { Unused("getMemoryFraction"); }
  void setMemoryFraction(double, c10::DeviceIndex) override { Unused("setMemoryFraction"); }
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex) override {
    Unused("getExpandableSegmentSizes");
  }
  void enable(bool) override {}
  bool isEnabled() const override { return true; }
  void cacheInfo(c10::DeviceIndex, std::size_t*) override { Unused("cacheInfo"); }
  void* getBaseAllocation(void*, std::size_t*) override { Unused("getBaseAllocation"); }
  using CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr&, c10::cuda::CUDAStream) override { Unused("recordStream"); }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::MempoolId_t, bool) override {
    Unused("snapshot");
  }
  void beginAllocateToPool(c10::DeviceIndex, c10::MempoolId_t,
                           std::function<bool(cudaStream_t)>) override {
    Unused("beginAllocateToPool");
  }
  void endAllocateToPool(c10::DeviceIndex, c10::MempoolId_t) override {
    Unused("endAllocateToPool");
  }
  void releasePool(c10::DeviceIndex, c10::MempoolId_t) override { Unused("releasePool"); }
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void*) override {
    Unused("shareIpcHandle");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string) override { Unused("getIpcDevPtr"); }
  void recordHistory(bool, c10::CachingDeviceAllocator::CreateContextFn, std::size_t,
                     c10::CachingDeviceAllocator::RecordContext, bool,
                     const std::vector<std::string>&) override {
    Unused("recordHistory");
  }
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver) override {
    Unused("attachOutOfMemoryObserver");
  }
  void attachAllocatorTraceTracker(
      c10::cuda::CUDACachingAllocator::AllocatorTraceTracker) override {
    Unused("attachAllocatorTraceTracker");
  }
  void enablePeerAccess(c10::DeviceIndex, c10::DeviceIndex) override { Unused("enablePeerAccess"); }
  cudaError_t memcpyAsync(void*, int, const void*, int, std::size_t, cudaStream_t, bool) override {
    Unused("memcpyAsync");
  }
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex, c10::MempoolId_t) override {
    Unused("getCheckpointState");
  }
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState>) override {
    Unused("setCheckpointPoolState");
  }
  std::string name() override { return "fake"; }

 private:
  [[noreturn]] static void Unused(const char* call) {
    TORCH_CHECK(false, "fake allocator: ", call, " is not for this test");
    std::abort();
  }
  std::uintptr_t next_ = std::uintptr_t{1} << 46;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TESTS_TORCH_PLUGIN_FAKE_CUDA_ALLOCATOR_H_
