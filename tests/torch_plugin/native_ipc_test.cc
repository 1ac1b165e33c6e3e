// The torch-native mode's CUDA IPC (torch_plugin/native/native_ipc.cc) on two simulated devices
// of one process: torch's shareIpcHandle, getIpcDevPtr (on a named device) and
// getBaseAllocation, with expandable segments on as the options of this process say.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/pluggable/plugin.h"

namespace vramledger {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// The c10::Error `fn` throws; fails the test when it throws none.
template <typename Fn>
std::string ErrorOf(Fn fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no c10::Error";
  return "";
}

class NativeIpcTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(vramledger_configure("expandable_segments:True,expandable_page_mb:2,max_dumps:0"),
              VRAMLEDGER_OK)
        << vramledger_last_error();
    ASSERT_EQ(vramledger_testing_use_sim_backend(2, std::size_t{4} << 30), VRAMLEDGER_OK)
        << vramledger_last_error();
  }
  void TearDown() override { ASSERT_EQ(vramledger_empty_cache(-1), VRAMLEDGER_OK); }

  NativeAllocator* a_ = NativeAllocator::Get();
};

TEST_F(NativeIpcTest, ExpandableBlockOpensOnceOnTheReceivingDeviceUntilItsLastReference) {
  c10::DataPtr pad = a_->AllocateOn(0, nullptr, kMiB + kMiB / 2);
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 3 * kMiB);
  const auto share = a_->shareIpcHandle(p.get());
  ASSERT_GE(share.handle.size(), 2u);
  EXPECT_EQ(share.handle[0], 2);
  EXPECT_EQ(share.handle[1], 'e');
  EXPECT_EQ(share.offset, static_cast<std::ptrdiff_t>(kMiB + kMiB / 2));  // into its first page
  std::shared_ptr<void> first = a_->OpenIpcOn(1, share.handle);
  std::shared_ptr<void> second = a_->OpenIpcOn(1, share.handle);
  ASSERT_NE(first.get(), nullptr);
  EXPECT_EQ(first.get(), second.get());
  EXPECT_NE(first.get(), p.get());  // a mapping of its own on the receiving device
  first.reset();
  second.reset();
  EXPECT_NE(ErrorOf([&] {
              a_->getBaseAllocation(p.get(), nullptr);
            }).find("Tensors allocated with expandable_segments:True cannot be shared"),
            std::string::npos);
}

TEST_F(NativeIpcTest, PlainSegmentSharesItsBaseAndCannotBeOpenedBySelf) {
  ASSERT_EQ(vramledger_contiguous_segments_enter(), VRAMLEDGER_OK);
  c10::DataPtr a = a_->AllocateOn(0, nullptr, 4096);
  c10::DataPtr b = a_->AllocateOn(0, nullptr, 4096);
  ASSERT_EQ(vramledger_contiguous_segments_exit(), VRAMLEDGER_OK);
  const auto share = a_->shareIpcHandle(b.get());
  EXPECT_EQ(share.handle[1], 'c');
  std::size_t size = 0;
  void* base = a_->getBaseAllocation(b.get(), &size);
  EXPECT_EQ(share.offset, static_cast<char*>(b.get()) - static_cast<char*>(base));
  EXPECT_EQ(size, 2 * kMiB);  // torch's small segment
  // A process cannot open its own cudaMalloc handle (CUDA refuses it; so does the simulator).
  EXPECT_NE(ErrorOf([&] { a_->OpenIpcOn(1, share.handle); }).find("exported by this process"),
            std::string::npos);
}

TEST_F(NativeIpcTest, FreedUnknownAndMalformedAreRefusedByName) {
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 4 * kMiB);
  void* freed = p.get();
  p.clear();
  EXPECT_NE(ErrorOf([&] { a_->shareIpcHandle(freed); }).find("freed"), std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              a_->shareIpcHandle(reinterpret_cast<void*>(0x1000));
            }).find("invalid device pointer"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              a_->OpenIpcOn(0, std::string("\x02q", 2));
            }).find("unexpected or illformed shareable handle type"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              a_->OpenIpcOn(0, std::string("\x05"
                                           "e",
                                           2));
            }).find("future version of torch"),
            std::string::npos);
}

TEST_F(NativeIpcTest, TorchsOwnEntryPointsReachVramledgerOnceInstalled) {
  namespace torch_alloc = c10::cuda::CUDACachingAllocator;
  torch_alloc::CUDAAllocator* previous = torch_alloc::allocator.load();
  ASSERT_EQ(vramledger_native_install(), VRAMLEDGER_OK) << vramledger_native_last_error();
  c10::DataPtr p = a_->AllocateOn(0, nullptr, 4 * kMiB);
  // What storage._share_cuda_() calls, through torch's current allocator.
  const auto share = torch_alloc::shareIpcHandle(p.get());
  EXPECT_EQ(share.handle, a_->shareIpcHandle(p.get()).handle);
  std::size_t size = 0;
  EXPECT_THROW(torch_alloc::getBaseAllocation(p.get(), &size), c10::Error);  // expandable
  torch_alloc::allocator.store(previous);
}

}  // namespace
}  // namespace vramledger
