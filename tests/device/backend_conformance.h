// The DeviceBackend contract as one typed test suite, run against every backend through a
// harness (SimBackend: tests/device/sim_backend_conformance_test.cc; CudaBackend: tests/gpu).
#ifndef VRAMLEDGER_TESTS_DEVICE_BACKEND_CONFORMANCE_H_
#define VRAMLEDGER_TESTS_DEVICE_BACKEND_CONFORMANCE_H_

#include <unistd.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

// A harness `H` gives the suite one backend and what the contract cannot say by itself:
//   std::string Unavailable();        non-empty: why every test skips (no GPU)
//   void SetUp();                     creates the backend (after Unavailable() returned "")
//   DeviceBackend* backend();
//   static constexpr bool kCountsRefusedCalls;  a call refused for a bad argument is counted
//   static constexpr int kRounds, kPerRound;    size of the eight-thread Malloc/Free test
//   StreamId NewStream(); void DestroyStream(StreamId);
//   void HoldStream(StreamId); void ReleaseStream(StreamId);  work queued between them waits
//   void BeginCapture(StreamId); void CaptureWork(DevicePtr, std::size_t, StreamId);
//   void EndCapture(StreamId);        the capture must have stayed valid
//   void ExpectThreadCaptureModeGlobal();
//   void ExpectNoStickyError();       a failed call left no error for the next one
//   void ExpectWritable(DevicePtr, std::size_t, unsigned char);  write the byte, read it back
//   void ExpectHolds(DevicePtr, std::size_t, unsigned char);     the memory there holds it
//   void ExpectNothingLive();         every allocation, handle, event, exported descriptor and
//                                     opened IPC handle was released

namespace vramledger {
namespace conformance {

// True if [a, a + a_size) and [b, b + b_size) share a byte.
inline bool Overlaps(DevicePtr a, std::size_t a_size, DevicePtr b, std::size_t b_size) {
  return a < b + b_size && b < a + a_size;
}

// Inserts [ptr, ptr + size) into `live`; fails the test if it overlaps a range already there.
inline void InsertChecked(std::map<DevicePtr, std::size_t>& live, DevicePtr ptr, std::size_t size) {
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

// The capture mode a thread starts in (cudaStreamCaptureModeGlobal).
inline constexpr int kCaptureModeGlobal = 0;

template <typename H>
class BackendConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = h_.Unavailable(); !why.empty()) GTEST_SKIP() << why;
    h_.SetUp();
    if (HasFatalFailure()) return;
    backend_ = h_.backend();
    granularity_ = backend_->Granularity();
  }

  H h_;
  DeviceBackend* backend_ = nullptr;
  std::size_t granularity_ = 0;
};

TYPED_TEST_SUITE_P(BackendConformance);

TYPED_TEST_P(BackendConformance, ReportsDeviceZeroAPowerOfTwoGranularityAndItsMemory) {
  DeviceBackend* backend = this->backend_;
  const std::size_t g = this->granularity_;
  EXPECT_EQ(backend->device(), 0);
  EXPECT_GT(g, 0u);
  EXPECT_EQ(g & (g - 1), 0u);
  std::size_t free_bytes = 0, total_bytes = 0;
  ASSERT_TRUE(backend->MemGetInfo(&free_bytes, &total_bytes).ok());
  EXPECT_GT(total_bytes, 0u);
  EXPECT_LE(free_bytes, total_bytes);
  EXPECT_EQ(backend->calls().count(DriverCall::kMemGetInfo), 1);
}

TYPED_TEST_P(BackendConformance, MallocGivesDistinctAlignedAddresses) {
  DeviceBackend* backend = this->backend_;
  std::mt19937_64 rng(7);
  std::map<DevicePtr, std::size_t> live;
  std::size_t free_before = 0, free_after = 0, total = 0;
  ASSERT_TRUE(backend->MemGetInfo(&free_before, &total).ok());
  for (int i = 0; i < 16; ++i) {
    const std::size_t size = 512 * (1 + rng() % (128 * 1024));  // Up to 64 MiB.
    DevicePtr ptr = 0;
    ASSERT_TRUE(backend->Malloc(size, &ptr).ok());
    EXPECT_EQ(ptr % 512, 0u);
    ASSERT_NO_FATAL_FAILURE(InsertChecked(live, ptr, size));
  }
  ASSERT_TRUE(backend->MemGetInfo(&free_after, &total).ok());
  EXPECT_LT(free_after, free_before);
  for (const auto& [ptr, size] : live) ASSERT_TRUE(backend->Free(ptr).ok());
  EXPECT_EQ(backend->calls().count(DriverCall::kMalloc), 16);
  EXPECT_EQ(backend->calls().count(DriverCall::kFree), 16);
  EXPECT_GT(backend->calls().micros(DriverCall::kMalloc), 0.0);
}

TYPED_TEST_P(BackendConformance, OutOfMemoryIsResourceExhaustedAndLeavesTheDeviceUsable) {
  DeviceBackend* backend = this->backend_;
  const std::size_t g = this->granularity_;
  std::size_t free_bytes = 0, total = 0;
  ASSERT_TRUE(backend->MemGetInfo(&free_bytes, &total).ok());
  DevicePtr ptr = 0;
  absl::Status status = backend->Malloc(2 * total, &ptr);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), ::testing::HasSubstr("cudaMalloc"));
  this->h_.ExpectNoStickyError();

  const std::size_t huge = (2 * total + g - 1) / g * g;
  PhysicalHandle handle = 0;
  status = backend->CreatePhysical(huge, &handle);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), ::testing::HasSubstr("cuMemCreate"));

  ASSERT_TRUE(backend->Malloc(kMiB, &ptr).ok());  // The device is still usable.
  ASSERT_TRUE(backend->Free(ptr).ok());
  this->h_.ExpectNothingLive();
}

TYPED_TEST_P(BackendConformance, MisuseIsAnErrorButNotOutOfMemory) {
  DeviceBackend* backend = this->backend_;
  const std::size_t g = this->granularity_;
  absl::Status status = backend->Free(0x1234);
  EXPECT_FALSE(status.ok());
  EXPECT_FALSE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), ::testing::HasSubstr("cudaFree"));
  this->h_.ExpectNoStickyError();

  DevicePtr ptr = 0;
  PhysicalHandle handle = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(backend->Malloc(0, &ptr)));
  status = backend->ReserveAddress(g + g / 2, &ptr);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), ::testing::HasSubstr("granularity"));
  EXPECT_TRUE(absl::IsInvalidArgument(backend->CreatePhysical(g / 2, &handle)));
  // CudaBackend refuses these before calling the driver; SimBackend counts every call made.
  const int refused = TypeParam::kCountsRefusedCalls ? 1 : 0;
  EXPECT_EQ(backend->calls().count(DriverCall::kAddressReserve), refused);
  EXPECT_EQ(backend->calls().count(DriverCall::kMemCreate), refused);
  this->h_.ExpectNothingLive();
}

TYPED_TEST_P(BackendConformance, MappedMemoryIsWritableAndPagesCanMove) {
  DeviceBackend* backend = this->backend_;
  const std::size_t g = this->granularity_;
  DevicePtr va = 0;
  ASSERT_TRUE(backend->ReserveAddress(4 * g, &va).ok());
  EXPECT_EQ(va % g, 0u);
  PhysicalHandle h1 = 0, h2 = 0;
  ASSERT_TRUE(backend->CreatePhysical(g, &h1).ok());
  ASSERT_TRUE(backend->CreatePhysical(g, &h2).ok());
  EXPECT_NE(h1, h2);
  ASSERT_TRUE(backend->Map(va, g, h1).ok());
  ASSERT_TRUE(backend->Map(va + g, g, h2).ok());
  ASSERT_TRUE(backend->SetAccess(va, 2 * g).ok());  // One call over two mappings.
  this->h_.ExpectWritable(va, 2 * g, 0x5a);

  // Move h1 to the third page: its contents travel with it (physical page recycling).
  ASSERT_TRUE(backend->Unmap(va, g).ok());
  ASSERT_TRUE(backend->Map(va + 2 * g, g, h1).ok());
  ASSERT_TRUE(backend->SetAccess(va + 2 * g, g).ok());
  this->h_.ExpectHolds(va + 2 * g, g, 0x5a);

  ASSERT_TRUE(backend->Unmap(va + g, 2 * g).ok());  // One call over two mappings.
  ASSERT_TRUE(backend->ReleasePhysical(h1).ok());
  ASSERT_TRUE(backend->ReleasePhysical(h2).ok());
  ASSERT_TRUE(backend->ReleaseAddress(va, 4 * g).ok());
  const DriverCallLedger& calls = backend->calls();
  EXPECT_EQ(calls.count(DriverCall::kMemMap), 3);
  EXPECT_EQ(calls.count(DriverCall::kMemSetAccess), 2);
  EXPECT_EQ(calls.count(DriverCall::kMemUnmap), 2);
  EXPECT_GT(calls.micros(DriverCall::kMemSetAccess), 0.0);
  this->h_.ExpectNothingLive();
}

TYPED_TEST_P(BackendConformance, EventsCompleteWhenTheirStreamGetsThere) {
  DeviceBackend* backend = this->backend_;
  const StreamId stream = this->h_.NewStream();
  EventId event = 0;
  ASSERT_TRUE(backend->CreateEvent(&event).ok());
  absl::StatusOr<bool> done = backend->QueryEvent(event);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);  // Never recorded.

  this->h_.HoldStream(stream);
  ASSERT_TRUE(backend->RecordEvent(event, stream).ok());
  for (int i = 0; i < 3; ++i) {
    done = backend->QueryEvent(event);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_FALSE(*done);
  }
  this->h_.ExpectNoStickyError();  // A not-ready answer is no error.
  this->h_.ReleaseStream(stream);
  ASSERT_TRUE(backend->SynchronizeEvent(event).ok());
  done = backend->QueryEvent(event);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);

  this->h_.HoldStream(stream);
  ASSERT_TRUE(backend->RecordEvent(event, stream).ok());
  done = backend->QueryEvent(event);
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  this->h_.ReleaseStream(stream);
  ASSERT_TRUE(backend->SynchronizeStream(stream).ok());
  done = backend->QueryEvent(event);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);

  ASSERT_TRUE(backend->DestroyEvent(event).ok());
  EXPECT_EQ(backend->calls().count(DriverCall::kEventRecord), 2);
  this->h_.DestroyStream(stream);
  this->h_.ExpectNothingLive();
}

TYPED_TEST_P(BackendConformance, DetectsCaptureAndAllocatesInRelaxedMode) {
  DeviceBackend* backend = this->backend_;
  const std::size_t g = this->granularity_;
  const StreamId stream = this->h_.NewStream();
  const StreamId other = this->h_.NewStream();
  EXPECT_FALSE(backend->IsCapturing(stream));
  this->h_.BeginCapture(stream);
  EXPECT_TRUE(backend->IsCapturing(stream));
  EXPECT_FALSE(backend->IsCapturing(other));

  DevicePtr ptr = 0, va = 0;
  PhysicalHandle handle = 0;
  {
    const int previous = backend->EnterRelaxedCapture();
    EXPECT_EQ(previous, kCaptureModeGlobal);
    ASSERT_TRUE(backend->Malloc(g, &ptr).ok());
    ASSERT_TRUE(backend->ReserveAddress(2 * g, &va).ok());
    ASSERT_TRUE(backend->CreatePhysical(g, &handle).ok());
    ASSERT_TRUE(backend->Map(va, g, handle).ok());
    ASSERT_TRUE(backend->SetAccess(va, g).ok());
    backend->ExitRelaxedCapture(previous);
  }
  this->h_.ExpectThreadCaptureModeGlobal();  // the mode we restored

  this->h_.CaptureWork(va, g, stream);
  this->h_.EndCapture(stream);  // The capture stayed valid.
  EXPECT_FALSE(backend->IsCapturing(stream));

  ASSERT_TRUE(backend->Free(ptr).ok());
  ASSERT_TRUE(backend->Unmap(va, g).ok());
  ASSERT_TRUE(backend->ReleasePhysical(handle).ok());
  ASSERT_TRUE(backend->ReleaseAddress(va, 2 * g).ok());
  this->h_.DestroyStream(stream);
  this->h_.DestroyStream(other);
  this->h_.ExpectNothingLive();
}

// Eight threads allocate and free at once, each recording and waiting for an event on its own
// stream between rounds: no two live ranges overlap, and every call is counted.
TYPED_TEST_P(BackendConformance, ConcurrentMallocFreeFromEightThreads) {
  constexpr int kThreads = 8;
  constexpr int kRounds = TypeParam::kRounds;
  constexpr int kPerRound = TypeParam::kPerRound;
  DeviceBackend* backend = this->backend_;
  std::vector<StreamId> streams;
  for (int t = 0; t < kThreads; ++t) streams.push_back(this->h_.NewStream());
  std::mutex live_mu;
  std::map<DevicePtr, std::size_t> live;  // Guarded by live_mu.
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      for (int round = 0; round < kRounds; ++round) {
        std::vector<DevicePtr> mine;
        for (int i = 0; i < kPerRound; ++i) {
          const std::size_t size = 512 * (1 + rng() % 8192);
          DevicePtr ptr = 0;
          ASSERT_TRUE(backend->Malloc(size, &ptr).ok());
          {
            std::lock_guard<std::mutex> lock(live_mu);
            ASSERT_NO_FATAL_FAILURE(InsertChecked(live, ptr, size));
          }
          mine.push_back(ptr);
        }
        EventId event = 0;
        ASSERT_TRUE(backend->CreateEvent(&event).ok());
        ASSERT_TRUE(backend->RecordEvent(event, streams[t]).ok());
        ASSERT_TRUE(backend->SynchronizeEvent(event).ok());
        ASSERT_TRUE(backend->DestroyEvent(event).ok());
        for (DevicePtr ptr : mine) {
          {
            std::lock_guard<std::mutex> lock(live_mu);
            live.erase(ptr);
          }
          ASSERT_TRUE(backend->Free(ptr).ok());
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (StreamId stream : streams) this->h_.DestroyStream(stream);
  this->h_.ExpectNothingLive();
  EXPECT_EQ(backend->calls().count(DriverCall::kMalloc), kThreads * kRounds * kPerRound);
  EXPECT_EQ(backend->calls().count(DriverCall::kFree), kThreads * kRounds * kPerRound);
}

// A cudaMalloc'd allocation has an IPC handle, an address that starts none has not, and a process
// cannot open its own handle (CUDA refuses it; another process opens it: ipc_check.py).
TYPED_TEST_P(BackendConformance, MallocHandlesNameTheirAllocationToOtherProcessesOnly) {
  DeviceBackend* backend = this->backend_;
  EXPECT_EQ(backend->ProcessId(), static_cast<int>(getpid()));
  DevicePtr ptr = 0;
  ASSERT_TRUE(backend->Malloc(4 * kMiB, &ptr).ok());
  IpcMemHandle handle{};
  ASSERT_TRUE(backend->ExportMalloc(ptr, &handle).ok());
  EXPECT_NE(handle, IpcMemHandle{});
  IpcMemHandle none{};
  EXPECT_FALSE(backend->ExportMalloc(0x1000, &none).ok());
  this->h_.ExpectNoStickyError();
  DevicePtr opened = 0;
  EXPECT_FALSE(backend->OpenMalloc(handle, &opened).ok());
  this->h_.ExpectNoStickyError();
  ASSERT_TRUE(backend->SynchronizeDevice().ok());
  ASSERT_TRUE(backend->Free(ptr).ok());
  this->h_.ExpectNothingLive();
}

// A physical handle shared as a POSIX descriptor: imported (this process may duplicate its own
// descriptors) and mapped at a second address, it is the same memory; a descriptor that names
// nothing fails the whole import and leaves no handle.
TYPED_TEST_P(BackendConformance, SharedPhysicalHandlesImportAsTheSameMemory) {
  DeviceBackend* backend = this->backend_;
  const std::size_t g = this->granularity_;
  DevicePtr va = 0, va2 = 0;
  PhysicalHandle handle = 0;
  ASSERT_TRUE(backend->ReserveAddress(g, &va).ok());
  ASSERT_TRUE(backend->CreatePhysical(g, &handle).ok());
  ASSERT_TRUE(backend->Map(va, g, handle).ok());
  ASSERT_TRUE(backend->SetAccess(va, g).ok());
  this->h_.ExpectWritable(va, g, 0x3c);
  int fd = -1;
  ASSERT_TRUE(backend->ExportPhysical(handle, &fd).ok());
  EXPECT_GE(fd, 0);
  std::vector<PhysicalHandle> imported;
  absl::Status status = backend->ImportPhysical(backend->ProcessId(), {fd, 1 << 20}, &imported);
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(imported.empty());
  ASSERT_TRUE(backend->ImportPhysical(backend->ProcessId(), {fd}, &imported).ok());
  ASSERT_EQ(imported.size(), 1u);
  ASSERT_TRUE(backend->ReserveAddress(g, &va2).ok());
  ASSERT_TRUE(backend->Map(va2, g, imported[0]).ok());
  ASSERT_TRUE(backend->SetAccess(va2, g).ok());
  this->h_.ExpectHolds(va2, g, 0x3c);
  ASSERT_TRUE(backend->SynchronizeDevice().ok());
  ASSERT_TRUE(backend->Unmap(va2, g).ok());
  ASSERT_TRUE(backend->ReleasePhysical(imported[0]).ok());
  ASSERT_TRUE(backend->ReleaseAddress(va2, g).ok());
  ASSERT_TRUE(backend->CloseExported(fd).ok());
  ASSERT_TRUE(backend->Unmap(va, g).ok());
  ASSERT_TRUE(backend->ReleasePhysical(handle).ok());
  ASSERT_TRUE(backend->ReleaseAddress(va, g).ok());
  this->h_.ExpectNothingLive();
}

REGISTER_TYPED_TEST_SUITE_P(BackendConformance, ReportsDeviceZeroAPowerOfTwoGranularityAndItsMemory,
                            MallocGivesDistinctAlignedAddresses,
                            OutOfMemoryIsResourceExhaustedAndLeavesTheDeviceUsable,
                            MisuseIsAnErrorButNotOutOfMemory, MappedMemoryIsWritableAndPagesCanMove,
                            EventsCompleteWhenTheirStreamGetsThere,
                            DetectsCaptureAndAllocatesInRelaxedMode,
                            ConcurrentMallocFreeFromEightThreads,
                            MallocHandlesNameTheirAllocationToOtherProcessesOnly,
                            SharedPhysicalHandlesImportAsTheSameMemory);

}  // namespace conformance
}  // namespace vramledger

#endif  // VRAMLEDGER_TESTS_DEVICE_BACKEND_CONFORMANCE_H_
