// The fixture of the torch.cuda.MemPool tests on SimBackend (mem_pools_test.cc,
// pool_trace_test.cc): an allocator on a simulated card, a counting fake segment source, a hooks
// object recording every trace entry, and torch's use_mem_pool on the calling thread.
#ifndef VRAMLEDGER_TESTS_CORE_MEM_POOLS_FIXTURE_H_
#define VRAMLEDGER_TESTS_CORE_MEM_POOLS_FIXTURE_H_

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "sim_allocator_fixture.h"
#include "vramledger/device_allocator.h"
#include "vramledger/hooks.h"

namespace vramledger {

inline constexpr MempoolId kPool{0, 1};
inline constexpr MempoolId kOther{0, 2};
inline constexpr StreamId kStream = 0x10;

// A segment source handing out addresses far from SimBackend's, counting its calls.
class FakeSource final : public SegmentSource {
 public:
  absl::StatusOr<DevicePtr> Allocate(std::size_t size, StreamId stream) override {
    (void)stream;
    if (refuse) return absl::ResourceExhaustedError("fake source: no memory");
    ++allocs;
    const DevicePtr p = next_;
    next_ += (size + kGiB - 1) / kGiB * kGiB;
    live.insert(p);
    return p;
  }
  absl::Status Free(DevicePtr ptr) override {
    if (live.erase(ptr) != 1) return absl::NotFoundError("fake source: unknown pointer");
    ++frees;
    return absl::OkStatus();
  }
  int allocs = 0;
  int frees = 0;
  bool refuse = false;
  std::set<DevicePtr> live;

 private:
  DevicePtr next_ = DevicePtr{1} << 46;
};

// Every trace entry, in order.
class RecordingHooks final : public AllocatorHooks {
 public:
  void OnEvent(const TraceEntry& e) override { events.push_back(e); }
  std::vector<TraceEntry> events;
};

// SimAllocatorTest (every Alloc and Free checked) on a 16 GiB card with torch's defaults, its
// allocations on kStream.
class MemPoolsTest : public SimAllocatorTest {
 protected:
  void Make(const std::string& conf, std::size_t capacity = 16 * kGiB) {
    SimAllocatorTest::Make(conf, capacity);
  }
  void SetUp() override { Make(""); }
  DevicePtr Alloc(std::size_t size, StreamId stream = kStream) {
    return SimAllocatorTest::Alloc(size, stream);
  }
  // The pool owning the segment that holds `p` ({9, 9} if none does).
  MempoolId OwnerOf(DevicePtr p) {
    for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
      if (p >= s.address && p < s.address + s.total_size) return s.pool_id;
    }
    return {9, 9};
  }
  std::size_t SegmentsIn(MempoolId pool) {
    std::size_t n = 0;
    for (const SegmentInfo& s : SegmentsOf(*alloc_)) n += s.pool_id == pool ? 1 : 0;
    return n;
  }
  // Allocations on this thread go to `pool` while `fn` runs (torch's use_mem_pool: begin with a
  // filter accepting the calling thread, end, release the use the begin took).
  template <typename Fn>
  void OnThisThreadIn(MempoolId pool, Fn fn) {
    const std::thread::id me = std::this_thread::get_id();
    ASSERT_TRUE(
        alloc_
            ->BeginAllocateToPool(pool, [me](StreamId) { return std::this_thread::get_id() == me; })
            .ok());
    fn();
    ASSERT_TRUE(alloc_->EndAllocateToPool(pool).ok());
    ASSERT_TRUE(alloc_->ReleasePool(pool).ok());
  }
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TESTS_CORE_MEM_POOLS_FIXTURE_H_
