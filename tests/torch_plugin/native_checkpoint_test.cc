// CUDA graph trees' allocator calls in the torch-native mode (torch_plugin/native/
// native_checkpoint.cc) on SimBackend: a checkpoint and restore round trip as torch's
// _cuda_setCheckpointPoolState drives it (deleters swapped by comparison with raw_deleter(), the
// re-allocated blocks handed over as DataPtrs), the exact live check, and torch's errors.
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/pluggable/plugin.h"

namespace vramledger {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr int kAll = 0;  // StatType::AGGREGATE
constexpr c10::MempoolId_t kPool{3, 0};
const cudaStream_t kGraphStream = reinterpret_cast<cudaStream_t>(0x20);

class NativeCheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(vramledger_configure("max_dumps:0"), VRAMLEDGER_OK) << vramledger_last_error();
    ASSERT_EQ(vramledger_testing_use_sim_backend(2, std::size_t{8} << 30), VRAMLEDGER_OK)
        << vramledger_last_error();
  }
  // A recording into `pool` on `device`: kGraphStream's allocations go to it.
  void Begin(c10::DeviceIndex device = 0, c10::MempoolId_t pool = kPool) {
    a_->beginAllocateToPool(device, pool, [](cudaStream_t s) { return s == kGraphStream; });
  }
  c10::DataPtr Alloc(std::size_t n, c10::DeviceIndex device = 0) {
    return a_->AllocateOn(device, kGraphStream, n);
  }
  bool Live(const std::vector<const c10::DataPtr*>& ptrs, c10::DeviceIndex device = 0,
            c10::MempoolId_t pool = kPool) {
    std::unordered_set<void*> set;
    for (const c10::DataPtr* p : ptrs) set.insert(p->get());
    return a_->checkPoolLiveAllocations(device, pool, set);
  }
  std::int64_t Allocated(c10::DeviceIndex device = 0) {
    return a_->getDeviceStats(device).allocated_bytes[kAll].current;
  }

  NativeAllocator* a_ = NativeAllocator::Get();
};

TEST_F(NativeCheckpointTest, EveryDataPtrCarriesTheRawDeleter) {
  for (c10::DeviceIndex d : {0, 1}) {
    c10::DataPtr p = a_->AllocateOn(d, nullptr, kMiB);
    EXPECT_EQ(p.get_deleter(), a_->raw_deleter());
    c10::DataPtr empty = a_->AllocateOn(d, nullptr, 0);
    EXPECT_EQ(empty.get_deleter(), a_->raw_deleter());
  }
  EXPECT_EQ(Allocated(0), 0);
  EXPECT_EQ(Allocated(1), 0);
}

TEST_F(NativeCheckpointTest, RoundTripAsTorchsGraphTreesDriveIt) {
  Begin();
  c10::DataPtr a = Alloc(4 * kMiB);
  c10::DataPtr b = Alloc(kMiB + 3);
  c10::DataPtr c = Alloc(100 * 1024);
  a_->endAllocateToPool(0, kPool);
  b.clear();  // dies before the checkpoint
  const auto state = a_->getCheckpointState(0, kPool);
  const std::int64_t allocated_at_checkpoint = Allocated();
  EXPECT_TRUE(Live({&a, &c}));
  EXPECT_FALSE(Live({&a}));

  // The next recording: `a` dies, `d` is new; `c` lives on as a stale tensor.
  Begin();
  a.clear();
  c10::DataPtr d = Alloc(6 * kMiB);
  a_->endAllocateToPool(0, kPool);
  EXPECT_TRUE(Live({&c, &d}));

  torch_alloc::CheckpointDelta delta = a_->setCheckpointPoolState(0, state);
  std::vector<void*> freed = delta.ptrs_freed;
  std::sort(freed.begin(), freed.end());
  std::vector<void*> expected_freed{c.get(), d.get()};
  std::sort(expected_freed.begin(), expected_freed.end());
  EXPECT_EQ(freed, expected_freed);
  // torch's removeStorageDeleterFns: the stale storages' deleters are swapped after a comparison
  // with raw_deleter(); their blocks were freed by the restore.
  EXPECT_TRUE(c.compare_exchange_deleter(a_->raw_deleter(), &c10::detail::deleteNothing));
  EXPECT_TRUE(d.compare_exchange_deleter(a_->raw_deleter(), &c10::detail::deleteNothing));
  c.clear();
  d.clear();
  ASSERT_EQ(delta.dataptrs_allocd.size(), 2u);  // the checkpoint's `a` and `c`, again
  for (const c10::DataPtr& p : delta.dataptrs_allocd) {
    EXPECT_EQ(p.get_deleter(), a_->raw_deleter());
    EXPECT_EQ(p.get_context(), p.get());
    EXPECT_EQ(p.device(), c10::Device(c10::DeviceType::CUDA, 0));
  }
  EXPECT_TRUE(Live({&delta.dataptrs_allocd[0], &delta.dataptrs_allocd[1]}));
  EXPECT_EQ(Allocated(), allocated_at_checkpoint);

  // The same checkpoint again (graph trees return to a node): nothing stale this time.
  torch_alloc::CheckpointDelta again = a_->setCheckpointPoolState(0, state);
  EXPECT_EQ(again.ptrs_freed.size(), 2u);
  for (c10::DataPtr& p : delta.dataptrs_allocd) {  // freed by the restore: torch drops them
    EXPECT_NE(p.release_context(), nullptr);
  }
  again.dataptrs_allocd.clear();  // torch's live storages die: their blocks are freed
  EXPECT_TRUE(Live({}));
  EXPECT_EQ(Allocated(), 0);
  a_->releasePool(0, kPool);  // one release per recording, as torch's graphs do
  a_->releasePool(0, kPool);
}

TEST_F(NativeCheckpointTest, TorchsErrors) {
  try {
    a_->getCheckpointState(0, {99, 0});
    FAIL() << "an unknown pool was checkpointed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Could not find pool of id (99, 0)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(a_->checkPoolLiveAllocations(0, {99, 0}, {}), c10::Error);

  struct OtherState : torch_alloc::AllocatorState {};
  try {
    a_->setCheckpointPoolState(0, std::make_shared<OtherState>());
    FAIL() << "another allocator's state was restored";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Expected PrivatePoolState"), std::string::npos);
  }

  // A checkpoint of device 1's pool given for device 0: refused, both pools unchanged.
  Begin(1);
  c10::DataPtr on_one = Alloc(2 * kMiB, 1);
  a_->endAllocateToPool(1, kPool);
  Begin(0);
  c10::DataPtr on_zero = Alloc(2 * kMiB, 0);
  a_->endAllocateToPool(0, kPool);
  const auto state_one = a_->getCheckpointState(1, kPool);
  try {
    a_->setCheckpointPoolState(0, state_one);
    FAIL() << "device 1's checkpoint restored device 0's pool";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot restore"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(Live({&on_zero}, 0));
  EXPECT_TRUE(Live({&on_one}, 1));

  // A stale checkpoint: its segment went back to the driver with the pool, which was forgotten;
  // the pool made again under its id is another one.
  const auto stale = a_->getCheckpointState(0, kPool);
  on_zero.clear();
  a_->releasePool(0, kPool);
  Begin(0);
  c10::DataPtr bigger = Alloc(40 * kMiB, 0);
  a_->endAllocateToPool(0, kPool);
  try {
    a_->setCheckpointPoolState(0, stale);
    FAIL() << "a stale checkpoint was restored";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("was taken from a pool released and forgotten since"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(Live({&bigger}, 0));
  bigger.clear();
  on_one.clear();
  a_->releasePool(0, kPool);
  a_->releasePool(1, kPool);
  EXPECT_EQ(Allocated(0), 0);
  EXPECT_EQ(Allocated(1), 0);
}

}  // namespace
}  // namespace vramledger
