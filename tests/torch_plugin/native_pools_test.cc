// Private pools and trace trackers in the torch-native mode (torch_plugin/native/native_pools.cc,
// native_trace.cc) on simulated devices with expandable segments: torch.cuda.MemPool's calls
// (create or incref, use_mem_pool's per-thread begin/end/release, use counts, a MemPool with
// another allocator, use_on_oom, no_split, emptyCache of one pool), torch's errors for bad input,
// and trackers seeing torch's trace entries for every segment change.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/torch_plugin/fake_cuda_allocator.h"
#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/pluggable/plugin.h"

namespace vramledger {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;
using TorchTrace = c10::CachingDeviceAllocator::TraceEntry;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

class NativePoolsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(vramledger_configure("max_dumps:0,expandable_segments:True"), VRAMLEDGER_OK)
        << vramledger_last_error();
    ASSERT_EQ(vramledger_testing_use_sim_backend(2, 1 * kGiB), VRAMLEDGER_OK)
        << vramledger_last_error();
  }
  void TearDown() override { a_->emptyCache({0, 0}); }

  // Segments of pool `id` on device 0 in torch's snapshot.
  std::vector<c10::CachingDeviceAllocator::SegmentInfo> SegmentsOf(c10::MempoolId_t id) {
    return a_->snapshot(id, false).segments;
  }
  // torch.cuda.use_mem_pool(pool) on this thread around `fn`: begin with a filter that accepts
  // the calling thread, end, and release the use the begin took.
  template <typename Fn>
  void UseMemPool(c10::MempoolId_t id, Fn fn) {
    const std::thread::id me = std::this_thread::get_id();
    a_->beginAllocateToPool(0, id, [me](cudaStream_t) { return std::this_thread::get_id() == me; });
    fn();
    a_->endAllocateToPool(0, id);
    a_->releasePool(0, id);
  }
  template <typename Fn>
  static std::string ErrorOf(Fn fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "(no error)";
  }

  NativeAllocator* a_ = NativeAllocator::Get();
};

TEST_F(NativePoolsTest, MemPoolLifecycleWithUseMemPoolOnAnotherThread) {
  const c10::MempoolId_t pool{0, 1};
  a_->createOrIncrefPool(0, pool, nullptr);  // MemPool()
  EXPECT_EQ(a_->getPoolUseCount(0, pool), 1);
  c10::DataPtr in_pool;
  std::thread worker([&] {
    UseMemPool(pool, [&] {
      EXPECT_EQ(a_->getPoolUseCount(0, pool), 2);
      in_pool = a_->AllocateOn(0, nullptr, 4 * kMiB);
    });
  });
  worker.join();
  c10::DataPtr outside = a_->AllocateOn(0, nullptr, 4 * kMiB);  // this thread: default pools
  EXPECT_EQ(a_->getPoolUseCount(0, pool), 1);
  auto segments = SegmentsOf(pool);
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].owner_private_pool_id, pool);
  EXPECT_FALSE(segments[0].is_expandable);  // private pools keep plain segments
  EXPECT_EQ(segments[0].address, reinterpret_cast<std::size_t>(in_pool.get()));
  for (const auto& s : SegmentsOf({0, 0})) {
    if (s.owner_private_pool_id == pool) continue;
    EXPECT_EQ(s.owner_private_pool_id, (c10::MempoolId_t{0, 0}));
  }

  // ~MemPool: release its use, then empty its cache; a live tensor keeps its segment.
  a_->releasePool(0, pool);
  EXPECT_EQ(a_->getPoolUseCount(0, pool), 0);
  a_->emptyCache(pool);
  EXPECT_EQ(SegmentsOf(pool).size(), 1u);
  in_pool.clear();
  a_->emptyCache(pool);
  EXPECT_TRUE(SegmentsOf(pool).empty());
  EXPECT_NE(outside.get(), nullptr);  // the default pools are another call's
}

TEST_F(NativePoolsTest, EmptyingOnePoolLeavesAnother) {
  const c10::MempoolId_t one{0, 2}, two{0, 3};
  c10::DataPtr a, b;
  a_->createOrIncrefPool(0, one, nullptr);
  a_->createOrIncrefPool(0, two, nullptr);
  UseMemPool(one, [&] { a = a_->AllocateOn(0, nullptr, 4 * kMiB); });
  UseMemPool(two, [&] { b = a_->AllocateOn(0, nullptr, 4 * kMiB); });
  a_->releasePool(0, one);
  a_->releasePool(0, two);
  a.clear();
  b.clear();
  a_->emptyCache(one);
  EXPECT_TRUE(SegmentsOf(one).empty());
  EXPECT_EQ(SegmentsOf(two).size(), 1u);
  a_->emptyCache(two);
  EXPECT_TRUE(SegmentsOf(two).empty());
}

TEST_F(NativePoolsTest, MemPoolWithAnotherAllocatorTakesItsSegmentsFromIt) {
  const c10::MempoolId_t pool{0, 4};
  auto fake = std::make_shared<FakeCudaAllocator>();
  a_->createOrIncrefPool(0, pool, fake);  // MemPool(allocator=CUDAPluggableAllocator(...))
  c10::DataPtr t;
  UseMemPool(pool, [&] { t = a_->AllocateOn(0, nullptr, 3 * kMiB); });
  EXPECT_EQ(fake->allocs, 1);
  ASSERT_EQ(SegmentsOf(pool).size(), 1u);
  EXPECT_EQ(fake->live.count(reinterpret_cast<void*>(SegmentsOf(pool)[0].address)), 1u);
  // Its allocator out of memory: torch's OutOfMemoryError.
  fake->refuse = true;
  UseMemPool(pool,
             [&] { EXPECT_THROW(a_->AllocateOn(0, nullptr, 64 * kMiB), c10::OutOfMemoryError); });
  fake->refuse = false;
  // Only the creation names an allocator.
  EXPECT_THROW(a_->createOrIncrefPool(0, pool, std::make_shared<FakeCudaAllocator>()),
               c10::ValueError);
  a_->releasePool(0, pool);
  t.clear();
  a_->emptyCache(pool);
  EXPECT_EQ(fake->frees, 1);
  EXPECT_TRUE(fake->live.empty());
}

TEST_F(NativePoolsTest, MemPoolOfVramledgerItselfTakesVramledgersSegments) {
  const c10::MempoolId_t pool{0, 5};
  // torch passes the current allocator when MemPool() is given none of its own in some paths.
  a_->createOrIncrefPool(0, pool, std::shared_ptr<torch_alloc::CUDAAllocator>(a_, [](auto*) {}));
  c10::DataPtr t;
  UseMemPool(pool, [&] { t = a_->AllocateOn(0, nullptr, 3 * kMiB); });
  EXPECT_EQ(SegmentsOf(pool).size(), 1u);
  a_->releasePool(0, pool);
  t.clear();
  a_->emptyCache(pool);
  EXPECT_TRUE(SegmentsOf(pool).empty());
}

TEST_F(NativePoolsTest, UseOnOomPoolServesADefaultAllocationThatWouldFail) {
  const c10::MempoolId_t pool{0, 6};
  a_->createOrIncrefPool(0, pool, nullptr);
  a_->setUseOnOOM(0, pool, true);  // MemPool(use_on_oom=True)
  void* cached = nullptr;
  UseMemPool(pool, [&] {
    c10::DataPtr t = a_->AllocateOn(0, nullptr, 400 * kMiB);
    cached = t.get();
  });  // freed: cached in the pool
  c10::DataPtr held = a_->AllocateOn(0, nullptr, 600 * kMiB);
  c10::DataPtr last = a_->AllocateOn(0, nullptr, 400 * kMiB);  // the device has ~24 MiB left
  EXPECT_EQ(last.get(), cached);
  last.clear();
  a_->setUseOnOOM(0, pool, false);
  EXPECT_THROW(a_->AllocateOn(0, nullptr, 400 * kMiB), c10::OutOfMemoryError);
  held.clear();
  a_->releasePool(0, pool);
  a_->emptyCache(pool);
  EXPECT_TRUE(SegmentsOf(pool).empty());
}

TEST_F(NativePoolsTest, NoSplitPoolKeepsBlocksWhole) {
  const c10::MempoolId_t pool{0, 7};
  a_->createOrIncrefPool(0, pool, nullptr);
  a_->setNoSplit(0, pool);  // MemPool(no_split=True)
  c10::DataPtr t;
  UseMemPool(pool, [&] { t = a_->AllocateOn(0, nullptr, 512 * 1024); });
  auto segments = SegmentsOf(pool);
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].blocks.size(), 1u);  // the 2 MiB segment, not split for 512 KiB
  a_->releasePool(0, pool);
  t.clear();
  a_->emptyCache(pool);
}

TEST_F(NativePoolsTest, BadInputGetsAClearError) {
  const c10::MempoolId_t pool{0, 8};
  EXPECT_EQ(a_->getPoolUseCount(0, pool), 0);
  EXPECT_NE(ErrorOf([&] { a_->releasePool(0, pool); }).find("unknown private pool (0, 8)"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { a_->setUseOnOOM(0, pool, true); }).find("unknown private pool (0, 8)"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { a_->setNoSplit(0, pool); }).find("unknown private pool (0, 8)"),
            std::string::npos);
  EXPECT_THROW(a_->createOrIncrefPool(0, {0, 0}, nullptr), c10::ValueError);
  EXPECT_THROW(a_->createOrIncrefPool(7, pool, nullptr), c10::Error);  // no device 7
  a_->createOrIncrefPool(0, pool, nullptr);
  a_->releasePool(0, pool);
  // Released twice: the second names the pool.
  EXPECT_NE(ErrorOf([&] { a_->releasePool(0, pool); }).find("unknown private pool (0, 8)"),
            std::string::npos);
  a_->emptyCache(pool);  // unknown by now: nothing to do, as torch
}

// Trackers stay for the life of the process: this one records into a vector the test reads.
std::mutex g_mu;
std::vector<TorchTrace> g_seen;

TEST_F(NativePoolsTest, TrackersSeeTorchsEntriesForEverySegmentChange) {
  a_->attachAllocatorTraceTracker([](const TorchTrace& e) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_seen.push_back(e);
  });
  const c10::MempoolId_t pool{0, 9};
  a_->createOrIncrefPool(0, pool, nullptr);
  c10::DataPtr in_pool, expandable;
  UseMemPool(pool, [&] { in_pool = a_->AllocateOn(0, nullptr, 4 * kMiB); });
  expandable = a_->AllocateOn(0, nullptr, 6 * kMiB);
  void* const pool_ptr = in_pool.get();
  void* const expandable_ptr = expandable.get();
  in_pool.clear();
  expandable.clear();
  a_->releasePool(0, pool);
  a_->emptyCache({0, 0});
  std::vector<TorchTrace> seen;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    seen.swap(g_seen);
  }
  auto count = [&](TorchTrace::Action action, void* addr, c10::MempoolId_t id) {
    int n = 0;
    for (const TorchTrace& e : seen) {
      n += e.action_ == action && e.addr_ == reinterpret_cast<std::size_t>(addr) &&
           e.mempool_ == id && e.device_ == 0;
    }
    return n;
  };
  const c10::MempoolId_t default_pools{0, 0};
  EXPECT_EQ(count(TorchTrace::ALLOC, pool_ptr, pool), 1);
  EXPECT_EQ(count(TorchTrace::FREE_REQUESTED, pool_ptr, pool), 1);
  EXPECT_EQ(count(TorchTrace::FREE_COMPLETED, pool_ptr, pool), 1);
  EXPECT_EQ(count(TorchTrace::ALLOC, expandable_ptr, default_pools), 1);
  // The pages under the expandable tensor were mapped before it was handed out.
  const auto at = reinterpret_cast<std::size_t>(expandable_ptr);
  bool mapped_first = false;
  for (const TorchTrace& e : seen) {
    if (e.action_ == TorchTrace::SEGMENT_MAP && e.addr_ <= at && at < e.addr_ + e.size_) {
      mapped_first = true;
    }
    if (e.action_ == TorchTrace::ALLOC && e.addr_ == at) break;
  }
  EXPECT_TRUE(mapped_first);
  // The pool's plain segment: allocated and freed, named by the pool's id (NCCL registers the
  // segments of the pools it was given).
  int segment_allocs = 0, segment_frees = 0, maps = 0, unmaps = 0;
  std::size_t mapped = 0, unmapped = 0;
  for (const TorchTrace& e : seen) {
    switch (e.action_) {
      case TorchTrace::SEGMENT_ALLOC:
        segment_allocs += e.mempool_ == pool;
        break;
      case TorchTrace::SEGMENT_FREE:
        segment_frees += e.mempool_ == pool;
        break;
      case TorchTrace::SEGMENT_MAP:
        ++maps;
        mapped += e.size_;
        break;
      case TorchTrace::SEGMENT_UNMAP:
        ++unmaps;
        unmapped += e.size_;
        break;
      default:
        break;
    }
  }
  EXPECT_EQ(segment_allocs, 1);
  EXPECT_EQ(segment_frees, 1);
  EXPECT_GE(maps, 1);  // the expandable tensor's pages, mapped before it was handed out
  EXPECT_GE(unmaps, 1);
  EXPECT_GE(mapped, 6 * kMiB);
  EXPECT_EQ(mapped, unmapped);  // emptyCache returned every mapped page
}

// Last in the file: the throwing tracker stays attached for the rest of the process.
TEST_F(NativePoolsTest, ATrackerThatThrowsLeavesTheAllocationAndTheOthersAlone) {
  static std::atomic<int> after{0};
  a_->attachAllocatorTraceTracker(
      [](const TorchTrace&) { throw std::runtime_error("tracker failure"); });
  a_->attachAllocatorTraceTracker([](const TorchTrace&) { after.fetch_add(1); });
  c10::DataPtr t = a_->AllocateOn(0, nullptr, 3 * kMiB);
  EXPECT_NE(t.get(), nullptr);
  t.clear();
  EXPECT_GE(after.load(), 3);  // alloc, free_requested, free_completed at least
  EXPECT_TRUE(a_->snapshot({0, 0}, false).segments.size() >= 1);
}

}  // namespace
}  // namespace vramledger
