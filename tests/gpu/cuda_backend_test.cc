// GPU tests of CudaBackend on device 0: the DeviceBackend contract against the real driver.
// Skips every test when CUDA reports no device. Each test owns its backend and streams.
#include "device/cuda_backend.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;

bool Overlaps(DevicePtr a, std::size_t a_size, DevicePtr b, std::size_t b_size) {
  return a < b + b_size && b < a + a_size;
}

void InsertChecked(std::map<DevicePtr, std::size_t>& live, DevicePtr ptr, std::size_t size) {
  auto next = live.lower_bound(ptr);
  if (next != live.end()) {
    ASSERT_FALSE(Overlaps(ptr, size, next->first, next->second));
  }
  if (next != live.begin()) {
    auto prev = std::prev(next);
    ASSERT_FALSE(Overlaps(ptr, size, prev->first, prev->second));
  }
  live.emplace(ptr, size);
}

// Host callback that holds its stream until *flag becomes true.
void CUDART_CB HoldStream(void* flag) {
  while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "no CUDA device (" << cudaGetErrorString(err) << ")";
    }
    device_count_ = count;
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

TEST_F(CudaBackendTest, IsADeviceBackendWithAPowerOfTwoGranularity) {
  DeviceBackend* backend = backend_.get();
  EXPECT_EQ(backend->device(), 0);
  EXPECT_GT(granularity_, 0u);
  EXPECT_EQ(granularity_ & (granularity_ - 1), 0u);
  std::size_t free_bytes = 0, total_bytes = 0;
  ASSERT_TRUE(backend->MemGetInfo(&free_bytes, &total_bytes).ok());
  EXPECT_GT(total_bytes, 0u);
  EXPECT_LE(free_bytes, total_bytes);
  EXPECT_EQ(backend->calls().count(DriverCall::kMemGetInfo), 1);
}

TEST_F(CudaBackendTest, MallocGivesDistinctAlignedAddresses) {
  std::mt19937_64 rng(7);
  std::map<DevicePtr, std::size_t> live;
  std::size_t free_before = 0, free_after = 0, total = 0;
  ASSERT_TRUE(backend_->MemGetInfo(&free_before, &total).ok());
  for (int i = 0; i < 16; ++i) {
    const std::size_t size = 512 * (1 + rng() % (128 * 1024));  // Up to 64 MiB.
    DevicePtr ptr = 0;
    ASSERT_TRUE(backend_->Malloc(size, &ptr).ok());
    EXPECT_EQ(ptr % 512, 0u);
    ASSERT_NO_FATAL_FAILURE(InsertChecked(live, ptr, size));
  }
  ASSERT_TRUE(backend_->MemGetInfo(&free_after, &total).ok());
  EXPECT_LT(free_after, free_before);
  for (const auto& [ptr, size] : live) ASSERT_TRUE(backend_->Free(ptr).ok());
  EXPECT_EQ(backend_->calls().count(DriverCall::kMalloc), 16);
  EXPECT_EQ(backend_->calls().count(DriverCall::kFree), 16);
  EXPECT_GT(backend_->calls().micros(DriverCall::kMalloc), 0.0);
}

TEST_F(CudaBackendTest, OutOfMemoryIsResourceExhaustedAndClearsTheLastError) {
  std::size_t free_bytes = 0, total = 0;
  ASSERT_TRUE(backend_->MemGetInfo(&free_bytes, &total).ok());
  DevicePtr ptr = 0;
  absl::Status status = backend_->Malloc(2 * total, &ptr);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("cudaMalloc"));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  const std::size_t huge = (2 * total + granularity_ - 1) / granularity_ * granularity_;
  PhysicalHandle handle = 0;
  status = backend_->CreatePhysical(huge, &handle);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("cuMemCreate"));

  ASSERT_TRUE(backend_->Malloc(kMiB, &ptr).ok());  // The device is still usable.
  ASSERT_TRUE(backend_->Free(ptr).ok());
}

TEST_F(CudaBackendTest, MisuseIsAnErrorButNotOutOfMemory) {
  absl::Status status = backend_->Free(0x1234);
  EXPECT_FALSE(status.ok());
  EXPECT_FALSE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("cudaFree"));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  DevicePtr ptr = 0;
  PhysicalHandle handle = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->Malloc(0, &ptr)));
  status = backend_->ReserveAddress(granularity_ + granularity_ / 2, &ptr);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("granularity"));
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->CreatePhysical(granularity_ / 2, &handle)));
  EXPECT_EQ(backend_->calls().count(DriverCall::kAddressReserve), 0);  // Refused before CUDA.
  EXPECT_EQ(backend_->calls().count(DriverCall::kMemCreate), 0);
}

TEST_F(CudaBackendTest, MappedMemoryIsWritableAndPagesCanMove) {
  const std::size_t g = granularity_;
  DevicePtr va = 0;
  ASSERT_TRUE(backend_->ReserveAddress(4 * g, &va).ok());
  EXPECT_EQ(va % g, 0u);
  PhysicalHandle h1 = 0, h2 = 0;
  ASSERT_TRUE(backend_->CreatePhysical(g, &h1).ok());
  ASSERT_TRUE(backend_->CreatePhysical(g, &h2).ok());
  ASSERT_TRUE(backend_->Map(va, g, h1).ok());
  ASSERT_TRUE(backend_->Map(va + g, g, h2).ok());
  ASSERT_TRUE(backend_->SetAccess(va, 2 * g).ok());  // One call over two mappings.

  void* base = reinterpret_cast<void*>(va);
  ASSERT_EQ(cudaMemset(base, 0x5a, 2 * g), cudaSuccess);
  std::vector<unsigned char> host(2 * g, 0);
  ASSERT_EQ(cudaMemcpy(host.data(), base, 2 * g, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host.front(), 0x5a);
  EXPECT_EQ(host.back(), 0x5a);

  // Move h1 to the third page: its contents travel with it (physical page recycling).
  ASSERT_TRUE(backend_->Unmap(va, g).ok());
  ASSERT_TRUE(backend_->Map(va + 2 * g, g, h1).ok());
  ASSERT_TRUE(backend_->SetAccess(va + 2 * g, g).ok());
  std::vector<unsigned char> moved(g, 0);
  ASSERT_EQ(
      cudaMemcpy(moved.data(), reinterpret_cast<void*>(va + 2 * g), g, cudaMemcpyDeviceToHost),
      cudaSuccess);
  EXPECT_EQ(moved.front(), 0x5a);
  EXPECT_EQ(moved.back(), 0x5a);

  ASSERT_TRUE(backend_->Unmap(va + g, 2 * g).ok());  // One call over two mappings.
  ASSERT_TRUE(backend_->ReleasePhysical(h1).ok());
  ASSERT_TRUE(backend_->ReleasePhysical(h2).ok());
  ASSERT_TRUE(backend_->ReleaseAddress(va, 4 * g).ok());
  const DriverCallLedger& calls = backend_->calls();
  EXPECT_EQ(calls.count(DriverCall::kMemMap), 3);
  EXPECT_EQ(calls.count(DriverCall::kMemSetAccess), 2);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 2);
  EXPECT_GT(calls.micros(DriverCall::kMemSetAccess), 0.0);
}

// A handle moving within its stream is mapped at its new address while still mapped at the old
// one, and the old mapping goes only after a fence recorded at the move has completed
// (expandable-segments.md, "Moves without a stall"): work queued on the old address and work
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

TEST_F(CudaBackendTest, EventsCompleteWhenTheirStreamGetsThere) {
  cudaStream_t stream = NewStream();
  const auto stream_id = reinterpret_cast<StreamId>(stream);
  EventId event = 0;
  ASSERT_TRUE(backend_->CreateEvent(&event).ok());
  absl::StatusOr<bool> done = backend_->QueryEvent(event);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);  // Never recorded.

  std::atomic<bool> release{false};
  ASSERT_EQ(cudaLaunchHostFunc(stream, HoldStream, &release), cudaSuccess);
  ASSERT_TRUE(backend_->RecordEvent(event, stream_id).ok());
  for (int i = 0; i < 3; ++i) {
    done = backend_->QueryEvent(event);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_FALSE(*done);
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // cudaErrorNotReady was cleared.
  release = true;
  ASSERT_TRUE(backend_->SynchronizeEvent(event).ok());
  done = backend_->QueryEvent(event);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);

  std::atomic<bool> release2{false};
  ASSERT_EQ(cudaLaunchHostFunc(stream, HoldStream, &release2), cudaSuccess);
  ASSERT_TRUE(backend_->RecordEvent(event, stream_id).ok());
  done = backend_->QueryEvent(event);
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  release2 = true;
  ASSERT_TRUE(backend_->SynchronizeStream(stream_id).ok());
  done = backend_->QueryEvent(event);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);

  ASSERT_TRUE(backend_->DestroyEvent(event).ok());
  EXPECT_EQ(backend_->calls().count(DriverCall::kEventRecord), 2);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST_F(CudaBackendTest, DetectsCaptureAndAllocatesInRelaxedMode) {
  cudaStream_t stream = NewStream();
  cudaStream_t other = NewStream();
  const auto stream_id = reinterpret_cast<StreamId>(stream);
  EXPECT_FALSE(backend_->IsCapturing(stream_id));
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_TRUE(backend_->IsCapturing(stream_id));
  EXPECT_FALSE(backend_->IsCapturing(reinterpret_cast<StreamId>(other)));

  const std::size_t g = granularity_;
  DevicePtr ptr = 0, va = 0;
  PhysicalHandle handle = 0;
  {
    const int previous = backend_->EnterRelaxedCapture();
    EXPECT_EQ(previous, static_cast<int>(cudaStreamCaptureModeGlobal));
    ASSERT_TRUE(backend_->Malloc(g, &ptr).ok());
    ASSERT_TRUE(backend_->ReserveAddress(2 * g, &va).ok());
    ASSERT_TRUE(backend_->CreatePhysical(g, &handle).ok());
    ASSERT_TRUE(backend_->Map(va, g, handle).ok());
    ASSERT_TRUE(backend_->SetAccess(va, g).ok());
    backend_->ExitRelaxedCapture(previous);
  }
  // The thread is back in global mode: exchanging shows the mode we restored.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
  EXPECT_EQ(mode, cudaStreamCaptureModeGlobal);
  ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);

  ASSERT_EQ(cudaMemsetAsync(reinterpret_cast<void*>(va), 1, g, stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);  // The capture stayed valid.
  EXPECT_FALSE(backend_->IsCapturing(stream_id));
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);

  ASSERT_TRUE(backend_->Free(ptr).ok());
  ASSERT_TRUE(backend_->Unmap(va, g).ok());
  ASSERT_TRUE(backend_->ReleasePhysical(handle).ok());
  ASSERT_TRUE(backend_->ReleaseAddress(va, 2 * g).ok());
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
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

TEST_F(CudaBackendTest, ConcurrentMallocFreeFromEightThreads) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 25;
  constexpr int kPerRound = 4;
  std::mutex live_mu;
  std::map<DevicePtr, std::size_t> live;  // Guarded by live_mu.
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(2000 + t);
      for (int round = 0; round < kRounds; ++round) {
        std::vector<DevicePtr> mine;
        for (int i = 0; i < kPerRound; ++i) {
          const std::size_t size = 512 * (1 + rng() % 8192);
          DevicePtr ptr = 0;
          ASSERT_TRUE(backend_->Malloc(size, &ptr).ok());
          {
            std::lock_guard<std::mutex> lock(live_mu);
            ASSERT_NO_FATAL_FAILURE(InsertChecked(live, ptr, size));
          }
          mine.push_back(ptr);
        }
        for (DevicePtr ptr : mine) {
          {
            std::lock_guard<std::mutex> lock(live_mu);
            live.erase(ptr);
          }
          ASSERT_TRUE(backend_->Free(ptr).ok());
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(backend_->calls().count(DriverCall::kMalloc), kThreads * kRounds * kPerRound);
  EXPECT_EQ(backend_->calls().count(DriverCall::kFree), kThreads * kRounds * kPerRound);
}

// Issue 8: memory mapped on device 1 is readable and writable from device 0 once device 0's
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
}  // namespace vramledger
