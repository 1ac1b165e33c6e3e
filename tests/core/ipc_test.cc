// CUDA IPC through the allocator (core/ipc.cc, core/ipc_imports.h) between two simulated
// processes: round trips of plain and expandable memory, shared pages pinned while their block
// lives, refusals, the receiver's cache.
#include <memory>
#include <string>

#include "core/ipc_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ledger/device_report.h"
#include "sim_allocator_fixture.h"

namespace vramledger {
namespace {

using ::testing::HasSubstr;

constexpr int kSenderPid = 101;
constexpr int kReceiverPid = 202;

// A sender (the fixture's allocator, as process 101) and a receiver (process 202).
class IpcTest : public SimAllocatorTest {
 protected:
  void MakeSender(const std::string& conf) {
    alloc_.reset();
    SimBackend::Config config;
    config.capacity = 64 * kGiB;
    config.pid = kSenderPid;
    sim_ = std::make_unique<SimBackend>(config);
    auto o = ParseOptions(conf);
    ASSERT_TRUE(o.ok()) << o.status();
    alloc_ = std::make_unique<DeviceAllocator>(*o, sim_.get());
    SimBackend::Config rconfig;
    rconfig.pid = kReceiverPid;
    receiver_sim_ = std::make_unique<SimBackend>(rconfig);
    receiver_ = std::make_unique<DeviceAllocator>(*ParseOptions(""), receiver_sim_.get());
  }
  void SetUp() override { MakeSender("expandable_segments:True,expandable_page_mb:2"); }
  void TearDown() override {
    SimAllocatorTest::TearDown();
    receiver_.reset();
    if (receiver_sim_ != nullptr) {
      EXPECT_EQ(receiver_sim_->live_opened(), 0);
      EXPECT_EQ(receiver_sim_->live_allocations(), 0);
      EXPECT_EQ(receiver_sim_->live_reservations(), 0);
    }
  }
  core::IpcHandle Decode(const IpcShare& share) {
    absl::StatusOr<core::IpcHandle> h = core::ParseIpcHandle(share.handle);
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? *h : core::IpcHandle{};
  }
  IpcShare Share(DevicePtr p) {
    absl::StatusOr<IpcShare> s = alloc_->ShareIpcHandle(p);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : IpcShare{};
  }

  std::unique_ptr<SimBackend> receiver_sim_;
  std::unique_ptr<DeviceAllocator> receiver_;
};

TEST_F(IpcTest, PlainSegmentRoundTripOpensTheSegmentOnceAndClosesWithTheLastReference) {
  MakeSender("");
  const DevicePtr a = Alloc(4096);
  const DevicePtr b = Alloc(8192);  // same 2 MiB small segment, after a
  const IpcShare share = Share(b);
  EXPECT_EQ(share.offset, static_cast<std::ptrdiff_t>(b - a));  // from the segment's base
  EXPECT_FALSE(Decode(share).pages);
  auto base = alloc_->BaseAllocation(b);
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_EQ(base->first, a);
  EXPECT_EQ(base->second, 2 * kMiB);

  absl::StatusOr<std::shared_ptr<void>> r1 = receiver_->OpenIpcHandle(share.handle);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_NE(r1->get(), nullptr);
  const IpcShare share_a = Share(a);  // the same segment: the same bytes, another offset
  EXPECT_EQ(share_a.handle, share.handle);
  absl::StatusOr<std::shared_ptr<void>> r2 = receiver_->OpenIpcHandle(share_a.handle);
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->get(), r1->get());
  EXPECT_EQ(receiver_sim_->live_opened(), 1);
  EXPECT_EQ(receiver_->open_ipc_handles(), 1u);
  r1->reset();
  EXPECT_EQ(receiver_sim_->live_opened(), 1);
  r2->reset();
  EXPECT_EQ(receiver_sim_->live_opened(), 0);
  EXPECT_EQ(receiver_->open_ipc_handles(), 0u);
  // The receiver's own allocator is untouched: opened memory is not its to allocate from.
  EXPECT_EQ(receiver_->GetStats().reserved_bytes[kAggregate].current, 0);
  Free(a);
  Free(b);
}

TEST_F(IpcTest, ExpandableRoundTripImportsThePagesUnderTheBlock) {
  const DevicePtr a = Alloc(3 * kMiB);  // pages 0-1
  const DevicePtr b = Alloc(2 * kMiB);  // [3, 5) MiB: pages 1-2, page 1 shared with a
  const IpcShare share = Share(b);
  const core::IpcHandle h = Decode(share);
  ASSERT_TRUE(h.pages);
  EXPECT_EQ(h.pid, kSenderPid);
  EXPECT_EQ(h.page_size, 2 * kMiB);
  EXPECT_EQ(h.fds.size(), 2u);
  EXPECT_EQ(share.offset, static_cast<std::ptrdiff_t>(kMiB));  // b starts 1 MiB into page 1
  EXPECT_EQ(sim_->live_exports(), 2);
  EXPECT_EQ(Share(b).handle, share.handle);  // exported once per handle
  EXPECT_EQ(sim_->live_exports(), 2);

  absl::StatusOr<std::shared_ptr<void>> r = receiver_->OpenIpcHandle(share.handle);
  ASSERT_TRUE(r.ok()) << r.status();
  const DevicePtr base = reinterpret_cast<DevicePtr>(r->get());
  EXPECT_TRUE(receiver_sim_->IsAccessible(base, 4 * kMiB));
  EXPECT_EQ(receiver_sim_->live_allocations(), 2);  // the two imported handles
  EXPECT_EQ(receiver_sim_->used_bytes(), 0u);       // the sender's memory, not the receiver's
  absl::StatusOr<std::shared_ptr<void>> again = receiver_->OpenIpcHandle(share.handle);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), r->get());
  const std::int64_t syncs = receiver_sim_->calls().count(DriverCall::kMemUnmap);
  r->reset();
  again->reset();
  EXPECT_EQ(receiver_sim_->calls().count(DriverCall::kMemUnmap), syncs + 1);
  EXPECT_EQ(receiver_sim_->live_allocations(), 0);

  auto base_alloc = alloc_->BaseAllocation(b);
  EXPECT_TRUE(absl::IsFailedPrecondition(base_alloc.status())) << base_alloc.status();
  EXPECT_THAT(base_alloc.status().message(), HasSubstr("expandable_segments:True"));
  Free(a);
  Free(b);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->live_exports(), 0);  // closed with their released handles
}

TEST_F(IpcTest, SharedPagesStayPutWhileTheBlockLivesEvenUnderRecyclingAndEmptyCache) {
  const DevicePtr a = Alloc(3 * kMiB);
  const DevicePtr b = Alloc(2 * kMiB);
  const DevicePtr page1 = b - kMiB;
  const PhysicalHandle h1 = sim_->HandleAt(page1);
  const PhysicalHandle h2 = sim_->HandleAt(page1 + 2 * kMiB);
  const IpcShare share = Share(b);
  Free(a);  // page 0 is free now; page 1 is half free, held by b
  // Growth that recycles free pages (reserved would pass the peak) and an empty_cache.
  const DevicePtr c = Alloc(6 * kMiB);
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 0);  // page 0 went to c
  Free(c);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  Check();
  EXPECT_EQ(sim_->HandleAt(page1), h1);
  EXPECT_EQ(sim_->HandleAt(page1 + 2 * kMiB), h2);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(4 * kMiB));  // only b's two pages
  // The descriptors are still open: a receiver that opens only now gets the same pages.
  absl::StatusOr<std::shared_ptr<void>> r = receiver_->OpenIpcHandle(share.handle);
  ASSERT_TRUE(r.ok()) << r.status();
  r->reset();
  Free(b);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(Reserved(), 0);
  EXPECT_EQ(sim_->live_exports(), 0);
}

TEST_F(IpcTest, FreedUnknownAndInteriorAddressesAreRefused) {
  const DevicePtr a = Alloc(3 * kMiB);
  const DevicePtr b = Alloc(kMiB);
  Free(a);
  absl::StatusOr<IpcShare> s = alloc_->ShareIpcHandle(a);
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("freed"));
  s = alloc_->ShareIpcHandle(0x1000);
  EXPECT_TRUE(absl::IsNotFound(s.status())) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("never allocated"));
  s = alloc_->ShareIpcHandle(b + 512);
  EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("inside the live block"));
  // A block freed while another stream still uses it waits for that stream: freed all the same.
  ASSERT_TRUE(alloc_->RecordStream(b, 0x77).ok());
  Free(b);
  s = alloc_->ShareIpcHandle(b);
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("waits for the streams"));
  EXPECT_FALSE(alloc_->BaseAllocation(b).ok());
  EXPECT_EQ(sim_->live_exports(), 0);
  sim_->CompleteAllEvents();
}

TEST_F(IpcTest, HandlesOfUnequalSizesCannotBeSharedInTorchsFormat) {
  MakeSender("expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8");
  const DevicePtr p = Alloc(5 * kMiB);  // a 4 MiB handle for pages 0-1, its own for page 2
  absl::StatusOr<IpcShare> s = alloc_->ShareIpcHandle(p);
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("expandable_handle_mb:0"));
  Free(p);
}

TEST_F(IpcTest, BadHandlesOpenNothing) {
  absl::StatusOr<std::shared_ptr<void>> r = receiver_->OpenIpcHandle("\x02z");
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  // The sender let go of its pages (freed and emptied): their descriptors are closed.
  const DevicePtr b = Alloc(2 * kMiB);
  const IpcShare share = Share(b);
  Free(b);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  r = receiver_->OpenIpcHandle(share.handle);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("pidfd_getfd"));
  EXPECT_EQ(receiver_->open_ipc_handles(), 0u);
  // A process cannot open its own cudaMalloc handle (CUDA refuses it too).
  MakeSender("");
  const DevicePtr p = Alloc(4096);
  r = alloc_->OpenIpcHandle(Share(p).handle);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("exported by this process"));
  Free(p);
}

}  // namespace
}  // namespace vramledger
