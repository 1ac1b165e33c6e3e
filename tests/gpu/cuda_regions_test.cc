// Pausable regions on the real driver (docs/design/regions.md): a pause gives the region's pages
// back to the device (cudaMemGetInfo's free bytes rise by them), a resume restores every byte of
// a CPU backup at the same addresses, work queued on another stream finishes before the pages
// go, and the times of pause and resume are printed: "regions: ..." lines (bytes, milliseconds,
// GB/s against a plain copy to pinned memory and back, and each call's phases: waiting, copies,
// driver calls with the number of handles). Skips every test without a GPU.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/cuda_backend.h"
#include "gtest/gtest.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"

namespace vramledger {
namespace {

std::size_t FreeBytes() {
  std::size_t free_bytes = 0;
  std::size_t total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  return free_bytes;
}

double Ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// One pause's and one resume's phases, in milliseconds, with their handle counts.
void PrintPhases(const char* what, const RegionPauseResult& p, const RegionResumeResult& r) {
  std::printf(
      "regions: %s phases: pause wait %.2f ms, copy %.2f ms, unmap+release %.2f ms (%zu handles); "
      "resume create+map+access %.2f ms (%zu handles), copy %.2f ms\n",
      what, p.wait_seconds * 1e3, p.copy_seconds * 1e3, p.driver_seconds * 1e3, p.handles,
      r.driver_seconds * 1e3, r.handles, r.copy_seconds * 1e3);
}

class CudaRegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    backend_ = std::make_unique<CudaBackend>(0);
    auto options = ParseOptions("expandable_segments:True");
    ASSERT_TRUE(options.ok()) << options.status();
    alloc_ = std::make_unique<DeviceAllocator>(*options, backend_.get());
  }
  void TearDown() override {
    if (alloc_ != nullptr) {
      EXPECT_TRUE(alloc_->CheckInvariants().ok());
    }
  }
  DevicePtr AllocIn(const char* region, std::size_t size, StreamId stream = 0) {
    EXPECT_TRUE(alloc_->BeginRegion(region, [](StreamId) { return true; }).ok());
    auto p = alloc_->Malloc(size, stream);
    EXPECT_TRUE(alloc_->EndRegion(region).ok());
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }

  std::unique_ptr<CudaBackend> backend_;
  std::unique_ptr<DeviceAllocator> alloc_;
};

TEST_F(CudaRegionsTest, PauseGivesThePagesBackAndResumeRestoresEveryByte) {
  constexpr std::size_t kBytes = 512 * kMiB;
  const DevicePtr a = AllocIn("train", kBytes);
  std::vector<std::uint32_t> pattern(kBytes / 4);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::uint32_t>(i * 7);
  ASSERT_EQ(cudaMemcpy(reinterpret_cast<void*>(a), pattern.data(), kBytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  // Round 1 pins its buffers and keeps them; round 2 (steady, as a training loop's pauses are)
  // reuses them and frees them.
  std::size_t free_before = 0;
  std::size_t free_paused = 0;
  double pause_ms = 0;
  double resume_ms = 0;
  for (int round = 1; round <= 2; ++round) {
    free_before = FreeBytes();
    auto start = std::chrono::steady_clock::now();
    auto paused = alloc_->PauseRegion("train", RegionBackup::kCpu);
    pause_ms = Ms(start);
    ASSERT_TRUE(paused.ok()) << paused.status();
    EXPECT_EQ(paused->backed_up_bytes, kBytes);
    free_paused = FreeBytes();
    EXPECT_GE(static_cast<double>(free_paused - free_before),
              0.98 * static_cast<double>(paused->released_bytes));
    start = std::chrono::steady_clock::now();
    auto resumed = alloc_->ResumeRegion("train", /*keep_host_buffers=*/round == 1);
    resume_ms = Ms(start);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    const std::string what = "cpu backup round " + std::to_string(round);
    std::printf("regions: %s: pause %.2f ms, resume %.2f ms\n", what.c_str(), pause_ms, resume_ms);
    PrintPhases(what.c_str(), *paused, *resumed);
  }
  auto start = std::chrono::steady_clock::now();
  std::vector<std::uint32_t> back(kBytes / 4);
  ASSERT_EQ(cudaMemcpy(back.data(), reinterpret_cast<void*>(a), kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_TRUE(back == pattern);
  // The same bytes through a plain copy to pinned memory and back, for the throughput ratio.
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, kBytes, cudaHostAllocPortable), cudaSuccess);
  start = std::chrono::steady_clock::now();
  ASSERT_EQ(cudaMemcpy(pinned, reinterpret_cast<void*>(a), kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(reinterpret_cast<void*>(a), pinned, kBytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  const double copy_ms = Ms(start);
  ASSERT_EQ(cudaFreeHost(pinned), cudaSuccess);
  const double gb = 2.0 * static_cast<double>(kBytes) / 1e9;
  std::printf(
      "regions: cpu backup %zu bytes: pause %.2f ms, resume %.2f ms, %.2f GB/s; plain pinned "
      "copy out and back %.2f ms, %.2f GB/s; ratio %.3f (round 2; target >= 0.8); free rose by "
      "%zu\n",
      kBytes, pause_ms, resume_ms, gb / ((pause_ms + resume_ms) / 1e3), copy_ms,
      gb / (copy_ms / 1e3), copy_ms / (pause_ms + resume_ms), free_paused - free_before);
  ASSERT_TRUE(alloc_->Free(a).ok());
}

TEST_F(CudaRegionsTest, PauseWaitsForWorkQueuedOnAnotherStream) {
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  const auto side_id = reinterpret_cast<StreamId>(side);
  constexpr std::size_t kBytes = 64 * kMiB;
  const DevicePtr a = AllocIn("rollout", kBytes);
  ASSERT_TRUE(alloc_->RecordStream(a, side_id).ok());
  for (int i = 0; i < 50; ++i) {  // work on the side stream, still running when pause is called
    ASSERT_EQ(cudaMemsetAsync(reinterpret_cast<void*>(a), 0x5a, kBytes, side), cudaSuccess);
  }
  auto paused = alloc_->PauseRegion("rollout", RegionBackup::kCpu);
  ASSERT_TRUE(paused.ok()) << paused.status();
  EXPECT_EQ(cudaStreamQuery(side), cudaSuccess);  // it finished before the pages went
  ASSERT_TRUE(alloc_->ResumeRegion("rollout", false).ok());
  std::vector<unsigned char> back(kBytes);
  ASSERT_EQ(cudaMemcpy(back.data(), reinterpret_cast<void*>(a), kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back.front(), 0x5a);
  EXPECT_EQ(back.back(), 0x5a);
  ASSERT_TRUE(alloc_->Free(a).ok());
  ASSERT_EQ(cudaStreamDestroy(side), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(CudaRegionsTest, PauseAndResumeTenGibWithoutBackup) {
  constexpr std::size_t kBytes = 10 * kGiB;
  if (FreeBytes() < 2 * kBytes) GTEST_SKIP() << "needs 20 GiB free";
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 10; ++i) blocks.push_back(AllocIn("big", kGiB));
  // Round 1 releases the handles the allocations made; later rounds those the resume made.
  for (int round = 1; round <= 3; ++round) {
    const std::size_t free_before = FreeBytes();
    auto start = std::chrono::steady_clock::now();
    auto paused = alloc_->PauseRegion("big", RegionBackup::kNone);
    const double pause_ms = Ms(start);
    ASSERT_TRUE(paused.ok()) << paused.status();
    const std::size_t risen = FreeBytes() - free_before;
    EXPECT_GE(static_cast<double>(risen), 0.98 * static_cast<double>(paused->released_bytes));
    start = std::chrono::steady_clock::now();
    auto resumed = alloc_->ResumeRegion("big", false);
    const double resume_ms = Ms(start);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    std::printf(
        "regions: no backup round %d, %zu bytes released: pause %.2f ms, resume %.2f ms (target: "
        "each under 50 ms); free rose by %zu\n",
        round, paused->released_bytes, pause_ms, resume_ms, risen);
    const std::string what = "no backup round " + std::to_string(round);
    PrintPhases(what.c_str(), *paused, *resumed);
  }
  for (DevicePtr p : blocks) ASSERT_TRUE(alloc_->Free(p).ok());
}

}  // namespace
}  // namespace vramledger
