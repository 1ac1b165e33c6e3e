// SimBackend's pinned host memory, copies and modelled device contents (sim_backend_host.cc):
// the pinned cap, contents that travel with a physical handle and not with an address, what a
// released handle forgets, copy faults, and the errors for unmapped memory and foreign pointers.
#include <cstdint>
#include <cstring>
#include <vector>

#include "device/sim_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vramledger/types.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kGran = 2 * kMiB;

class SimHostTest : public ::testing::Test {
 protected:
  // A reservation of 4 pages with one handle of 2 pages mapped at page 1, with access.
  void SetUp() override {
    ASSERT_TRUE(sim_.ReserveAddress(4 * kGran, &va_).ok());
    ASSERT_TRUE(sim_.CreatePhysical(2 * kGran, &handle_).ok());
    ASSERT_TRUE(sim_.Map(va_ + kGran, 2 * kGran, handle_).ok());
    ASSERT_TRUE(sim_.SetAccess(va_ + kGran, 2 * kGran).ok());
  }
  static std::vector<std::uint8_t> Bytes(std::size_t n, std::uint8_t first) {
    std::vector<std::uint8_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(first + i * 31);
    return v;
  }

  SimBackend sim_;
  DevicePtr va_ = 0;
  PhysicalHandle handle_ = 0;
};

TEST_F(SimHostTest, PinnedMemoryIsCappedAndFreedOnce) {
  sim_.SetPinnedCapacity(3 * kMiB);
  auto a = sim_.HostAllocPinned(2 * kMiB);
  ASSERT_TRUE(a.ok());
  auto b = sim_.HostAllocPinned(2 * kMiB);
  EXPECT_TRUE(absl::IsResourceExhausted(b.status())) << b.status();
  EXPECT_EQ(sim_.pinned_bytes(), 2 * kMiB);
  EXPECT_TRUE(absl::IsInvalidArgument(sim_.HostAllocPinned(0).status()));
  ASSERT_TRUE(sim_.HostFreePinned(*a).ok());
  EXPECT_EQ(sim_.pinned_bytes(), 0u);
  EXPECT_THAT(sim_.HostFreePinned(*a).message(), HasSubstr("not pinned memory"));
  int on_stack = 0;
  EXPECT_FALSE(sim_.HostFreePinned(&on_stack).ok());
}

TEST_F(SimHostTest, ContentsTravelWithTheHandleAcrossAPageAndAreZeroUnwritten) {
  const auto pattern = Bytes(kGran + 4096, 7);  // across the handle's two pages
  const DevicePtr at = va_ + kGran + kGran / 2;
  ASSERT_TRUE(sim_.WriteDevice(at, pattern.data(), pattern.size()).ok());
  std::vector<std::uint8_t> back(pattern.size());
  ASSERT_TRUE(sim_.ReadDevice(back.data(), at, back.size()).ok());
  EXPECT_EQ(back, pattern);
  std::vector<std::uint8_t> head(512, 0xff);
  ASSERT_TRUE(sim_.ReadDevice(head.data(), va_ + kGran, head.size()).ok());
  EXPECT_EQ(head, std::vector<std::uint8_t>(512, 0));  // never written
  // The handle mapped elsewhere shows the same bytes: contents belong to the handle.
  ASSERT_TRUE(sim_.Unmap(va_ + kGran, 2 * kGran).ok());
  ASSERT_TRUE(sim_.Map(va_ + 2 * kGran, 2 * kGran, handle_).ok());
  ASSERT_TRUE(sim_.SetAccess(va_ + 2 * kGran, 2 * kGran).ok());
  ASSERT_TRUE(sim_.ReadDevice(back.data(), at + kGran, back.size()).ok());
  EXPECT_EQ(back, pattern);
}

TEST_F(SimHostTest, CopiesMoveBytesBetweenPinnedAndDeviceMemory) {
  auto host = sim_.HostAllocPinned(64 * 1024);
  ASSERT_TRUE(host.ok());
  const auto pattern = Bytes(64 * 1024, 3);
  std::memcpy(*host, pattern.data(), pattern.size());
  const DevicePtr at = va_ + kGran + 100 * 512;
  ASSERT_TRUE(sim_.CopyHostToDevice({{*host, at, pattern.size()}}).ok());
  std::memset(*host, 0, pattern.size());
  // Two copies in one batch: halves, the second half first.
  auto* half = static_cast<char*>(*host) + pattern.size() / 2;
  ASSERT_TRUE(sim_.CopyDeviceToHost({{half, at + pattern.size() / 2, pattern.size() / 2},
                                     {*host, at, pattern.size() / 2}})
                  .ok());
  EXPECT_EQ(std::memcmp(*host, pattern.data(), pattern.size()), 0);
  EXPECT_EQ(sim_.copies(), 3);
  EXPECT_EQ(sim_.copy_waits(), 2);
  EXPECT_EQ(sim_.copied_bytes(), 2 * pattern.size());
  sim_.FailCopy(1, absl::InternalError("injected"));
  // The second copy of the batch fails: the batch stops there.
  EXPECT_THAT(
      sim_.CopyDeviceToHost({{*host, va_ + kGran, 512}, {*host, va_ + kGran, 512}}).message(),
      HasSubstr("injected"));
  EXPECT_EQ(sim_.copies(), 4);
  ASSERT_TRUE(sim_.CopyDeviceToHost({{*host, va_ + kGran, 512}}).ok());  // once only
  // Host memory that is not pinned is refused.
  std::vector<std::uint8_t> heap(512);
  EXPECT_THAT(sim_.CopyDeviceToHost({{heap.data(), va_ + kGran, 512}}).message(),
              HasSubstr("not pinned"));
  ASSERT_TRUE(sim_.HostFreePinned(*host).ok());
}

TEST_F(SimHostTest, UnmappedOrInaccessibleMemoryCannotBeCopiedAndNothingMoves) {
  std::vector<std::uint8_t> buf(4096, 1);
  auto pinned = sim_.HostAllocPinned(buf.size());
  ASSERT_TRUE(pinned.ok());
  std::memcpy(*pinned, buf.data(), buf.size());
  // Page 0 is not mapped: a copy starting in the mapped handle and running into page 3 fails.
  EXPECT_THAT(sim_.CopyHostToDevice({{*pinned, va_, buf.size()}}).message(),
              HasSubstr("not mapped with access"));
  EXPECT_FALSE(sim_.CopyHostToDevice({{*pinned, va_ + 3 * kGran - 512, 1024}}).ok());
  ASSERT_TRUE(sim_.HostFreePinned(*pinned).ok());
  std::vector<std::uint8_t> back(512, 0xff);
  ASSERT_TRUE(sim_.ReadDevice(back.data(), va_ + 3 * kGran - 512, back.size()).ok());
  EXPECT_EQ(back, std::vector<std::uint8_t>(512, 0));  // the failed copy wrote nothing
  PhysicalHandle other = 0;
  ASSERT_TRUE(sim_.CreatePhysical(kGran, &other).ok());
  ASSERT_TRUE(sim_.Map(va_ + 3 * kGran, kGran, other).ok());  // mapped, no access yet
  EXPECT_FALSE(sim_.WriteDevice(va_ + 3 * kGran, buf.data(), 512).ok());
}

TEST_F(SimHostTest, AReleasedHandleForgetsItsContents) {
  const auto pattern = Bytes(4096, 9);
  ASSERT_TRUE(sim_.WriteDevice(va_ + kGran, pattern.data(), pattern.size()).ok());
  ASSERT_TRUE(sim_.Unmap(va_ + kGran, 2 * kGran).ok());
  ASSERT_TRUE(sim_.ReleasePhysical(handle_).ok());
  ASSERT_TRUE(sim_.CreatePhysical(2 * kGran, &handle_).ok());
  ASSERT_TRUE(sim_.Map(va_ + kGran, 2 * kGran, handle_).ok());
  ASSERT_TRUE(sim_.SetAccess(va_ + kGran, 2 * kGran).ok());
  std::vector<std::uint8_t> back(pattern.size(), 0xff);
  ASSERT_TRUE(sim_.ReadDevice(back.data(), va_ + kGran, back.size()).ok());
  EXPECT_EQ(back, std::vector<std::uint8_t>(pattern.size(), 0));  // new memory
}

}  // namespace
}  // namespace vramledger
