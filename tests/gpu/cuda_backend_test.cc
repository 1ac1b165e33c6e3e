// CudaBackend on the real driver: the DeviceBackend conformance suite (tests/device/
// backend_conformance.h) through CudaHarness, then what only a GPU shows (bytes that travel with a
// handle, the caller's device, peers). Skips every test when CUDA reports no device.
#include "device/cuda_backend.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/backend_conformance.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

// Host callback that holds its stream until *flag becomes true.
void CUDART_CB HoldStreamUntil(void* flag) {
  while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
}

std::string NoDeviceReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && count > 0) return "";
  (void)cudaGetLastError();
  return std::string("no CUDA device (") + cudaGetErrorString(err) + ")";
}

cudaStream_t AsStream(StreamId stream) { return reinterpret_cast<cudaStream_t>(stream); }

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = NoDeviceReason(); !why.empty()) GTEST_SKIP() << why;
    ASSERT_EQ(cudaGetDeviceCount(&device_count_), cudaSuccess);
    backend_ = std::make_unique<CudaBackend>(0);
    ASSERT_TRUE(backend_->vmm_status().ok()) << backend_->vmm_status();
    granularity_ = backend_->Granularity();
  }

  cudaStream_t NewStream() {
    cudaStream_t stream = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    return stream;
  }

  std::unique_ptr<CudaBackend> backend_;
  int device_count_ = 0;
  std::size_t granularity_ = 0;
};

// A handle moving within its stream is mapped at its new address while still mapped at the old
// one, and the old mapping goes only after a fence recorded at the move has completed
// (page-recycling.md, "Moves without a stall"): work queued on the old address and work
// queued after it on the new one see the same memory, in stream order.
TEST_F(CudaBackendTest, AHandleMapsAtTwoAddressesWhileOldWorkFinishes) {
  const std::size_t g = granularity_;
  cudaStream_t stream = NewStream();
  const auto stream_id = reinterpret_cast<StreamId>(stream);
  DevicePtr va = 0;
  ASSERT_TRUE(backend_->ReserveAddress(4 * g, &va).ok());
  PhysicalHandle h = 0;
  ASSERT_TRUE(backend_->CreatePhysical(g, &h).ok());
  ASSERT_TRUE(backend_->Map(va, g, h).ok());
  ASSERT_TRUE(backend_->SetAccess(va, g).ok());
  void* old_va = reinterpret_cast<void*>(va);
  void* new_va = reinterpret_cast<void*>(va + 2 * g);
  ASSERT_EQ(cudaMemsetAsync(old_va, 0x11, g, stream), cudaSuccess);  // queued on the old address
  ASSERT_TRUE(backend_->Map(va + 2 * g, g, h).ok());                 // the move, no wait
  ASSERT_TRUE(backend_->SetAccess(va + 2 * g, g).ok());
  EventId fence = 0;
  ASSERT_TRUE(backend_->CreateEvent(&fence).ok());
  ASSERT_TRUE(backend_->RecordEvent(fence, stream_id).ok());
  std::vector<unsigned char> host(g, 0);
  ASSERT_EQ(cudaMemsetAsync(static_cast<char*>(new_va) + g / 2, 0x22, g / 2, stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), new_va, g, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_TRUE(backend_->SynchronizeEvent(fence).ok());
  ASSERT_TRUE(backend_->Unmap(va, g).ok());  // the old address, after its work
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host.front(), 0x11);  // written through the old address, read through the new one
  EXPECT_EQ(host[g / 2 - 1], 0x11);
  EXPECT_EQ(host[g / 2], 0x22);
  EXPECT_EQ(host.back(), 0x22);
  ASSERT_TRUE(backend_->Unmap(va + 2 * g, g).ok());
  ASSERT_TRUE(backend_->ReleasePhysical(h).ok());
  ASSERT_TRUE(backend_->DestroyEvent(fence).ok());
  ASSERT_TRUE(backend_->ReleaseAddress(va, 4 * g).ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(CudaBackendTest, KeepsTheCallersDeviceAndWorksFromAFreshThread) {
  if (device_count_ >= 2) {
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    DevicePtr ptr = 0;
    ASSERT_TRUE(backend_->Malloc(kMiB, &ptr).ok());
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 1);
    cudaPointerAttributes attributes = {};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, reinterpret_cast<void*>(ptr)), cudaSuccess);
    EXPECT_EQ(attributes.device, 0);
    ASSERT_TRUE(backend_->Free(ptr).ok());
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
  // A thread that never touched CUDA has no context; the VMM calls must still work there.
  std::thread fresh([&] {
    DevicePtr va = 0;
    PhysicalHandle handle = 0;
    ASSERT_TRUE(backend_->ReserveAddress(granularity_, &va).ok());
    ASSERT_TRUE(backend_->CreatePhysical(granularity_, &handle).ok());
    ASSERT_TRUE(backend_->Map(va, granularity_, handle).ok());
    ASSERT_TRUE(backend_->SetAccess(va, granularity_).ok());
    ASSERT_TRUE(backend_->Unmap(va, granularity_).ok());
    ASSERT_TRUE(backend_->ReleasePhysical(handle).ok());
    ASSERT_TRUE(backend_->ReleaseAddress(va, granularity_).ok());
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0);
  });
  fresh.join();
}

// Memory mapped on device 1 is readable and writable from device 0 once device 0's
// context is active (cudaDeviceEnablePeerAccess does not cover VMM memory; docs/design/
// peer-access.md). Checked with cuMemGetAccess and with a peer copy of known bytes.
TEST_F(CudaBackendTest, GrantsActivePeersAccessToMappedPages) {
  if (device_count_ < 2) GTEST_SKIP() << "needs two CUDA devices, found " << device_count_;
  int can = 0;
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can, 0, 1), cudaSuccess);
  if (can == 0) GTEST_SKIP() << "device 0 cannot access device 1";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // device 0's primary context is active
  CudaBackend backend1(1);
  ASSERT_TRUE(backend1.vmm_status().ok()) << backend1.vmm_status();
  const std::size_t page = backend1.Granularity();
  DevicePtr va = 0;
  PhysicalHandle handle = 0;
  ASSERT_TRUE(backend1.ReserveAddress(2 * page, &va).ok());
  ASSERT_TRUE(backend1.CreatePhysical(page, &handle).ok());
  ASSERT_TRUE(backend1.Map(va, page, handle).ok());
  ASSERT_TRUE(backend1.SetAccess(va, page).ok());
  EXPECT_EQ(backend1.peer_mask() & 1u, 1u);

  void* get_access = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuMemGetAccess", &get_access, 12000,
                                             cudaEnableDefault, &found),
            cudaSuccess);
  ASSERT_NE(get_access, nullptr);
  for (int d : {0, 1}) {
    CUmemLocation location = {};
    location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    location.id = d;
    unsigned long long flags = 0;  // NOLINT(runtime/int): the driver's type
    ASSERT_EQ(reinterpret_cast<PFN_cuMemGetAccess_v10020>(get_access)(&flags, &location,
                                                                      static_cast<CUdeviceptr>(va)),
              CUDA_SUCCESS);
    EXPECT_EQ(flags, CU_MEM_ACCESS_FLAGS_PROT_READWRITE) << "device " << d;
  }

  // Device 0 writes device 1's page through a peer copy, device 1 reads it back.
  std::vector<std::uint32_t> pattern(page / 4), back(page / 4, 0);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::uint32_t>(i * 7);
  void* src0 = nullptr;
  ASSERT_EQ(cudaMalloc(&src0, page), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(src0, pattern.data(), page, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpyPeer(reinterpret_cast<void*>(va), 1, src0, 0, page), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), reinterpret_cast<void*>(va), page, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back, pattern);
  ASSERT_EQ(cudaFree(src0), cudaSuccess);

  ASSERT_TRUE(backend1.Unmap(va, page).ok());
  ASSERT_TRUE(backend1.ReleasePhysical(handle).ok());
  ASSERT_TRUE(backend1.ReleaseAddress(va, 2 * page).ok());
}

}  // namespace

namespace conformance {

class CudaHarness {
 public:
  static constexpr bool kCountsRefusedCalls = false;  // refused before the driver is called
  static constexpr int kRounds = 25;
  static constexpr int kPerRound = 4;

  ~CudaHarness() {
    if (holds_.empty()) return;
    for (auto& flag : holds_) flag->store(true);
    (void)cudaDeviceSynchronize();  // the host callbacks read the flags until they return
  }

  std::string Unavailable() { return NoDeviceReason(); }
  void SetUp() {
    backend_ = std::make_unique<CudaBackend>(0);
    ASSERT_TRUE(backend_->vmm_status().ok()) << backend_->vmm_status();
  }
  DeviceBackend* backend() { return backend_.get(); }

  StreamId NewStream() {
    cudaStream_t stream = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    return reinterpret_cast<StreamId>(stream);
  }
  void DestroyStream(StreamId stream) {
    EXPECT_EQ(cudaStreamDestroy(AsStream(stream)), cudaSuccess);
  }
  void HoldStream(StreamId stream) {
    holds_.push_back(std::make_unique<std::atomic<bool>>(false));
    ASSERT_EQ(cudaLaunchHostFunc(AsStream(stream), HoldStreamUntil, holds_.back().get()),
              cudaSuccess);
  }
  void ReleaseStream(StreamId) {
    for (auto& flag : holds_) flag->store(true);
  }

  void BeginCapture(StreamId stream) {
    ASSERT_EQ(cudaStreamBeginCapture(AsStream(stream), cudaStreamCaptureModeGlobal), cudaSuccess);
  }
  void CaptureWork(DevicePtr va, std::size_t size, StreamId stream) {
    ASSERT_EQ(cudaMemsetAsync(reinterpret_cast<void*>(va), 1, size, AsStream(stream)), cudaSuccess);
  }
  void EndCapture(StreamId stream) {
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(AsStream(stream), &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  // Exchanging shows the thread's mode; the second exchange puts it back.
  void ExpectThreadCaptureModeGlobal() {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
    ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
    EXPECT_EQ(mode, cudaStreamCaptureModeGlobal);
    ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
  }
  void ExpectNoStickyError() { EXPECT_EQ(cudaGetLastError(), cudaSuccess); }
  void ExpectWritable(DevicePtr va, std::size_t size, unsigned char byte) {
    ASSERT_EQ(cudaMemset(reinterpret_cast<void*>(va), byte, size), cudaSuccess);
    ExpectHolds(va, size, byte);
  }
  void ExpectHolds(DevicePtr va, std::size_t size, unsigned char byte) {
    std::vector<unsigned char> host(size, 0);
    ASSERT_EQ(cudaMemcpy(host.data(), reinterpret_cast<void*>(va), size, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(host.front(), byte);
    EXPECT_EQ(host.back(), byte);
  }
  void ExpectNothingLive() {}  // the driver lists no live allocations to compare with

 private:
  std::unique_ptr<CudaBackend> backend_;
  std::vector<std::unique_ptr<std::atomic<bool>>> holds_;
};

INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, BackendConformance, CudaHarness);
}  // namespace conformance
}  // namespace vramledger
